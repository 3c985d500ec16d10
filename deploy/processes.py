"""Child processes in their own process group, stopped as a whole group.

`spawn` starts a child in a new session (so its pid is also its process-group id, and one
`killpg` reaches it and everything it forks). `Child.stop(grace_s)` sends the group SIGTERM,
waits up to `grace_s` for the leader to exit and the group to empty, SIGKILLs the group if not,
reaps the leader and waits (briefly) until no process of the group is left. A group counts as
gone when `killpg(pgid, 0)` finds nobody or when only zombies are left in it (read from /proc).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO

#: what stdin/stdout/stderr accept: a file, a descriptor, subprocess.PIPE/DEVNULL/STDOUT, None
Redirect = IO[bytes] | int | None
#: after SIGKILL: how long to wait for the leader to be reaped, then for the group to empty
KILL_WAIT_S = 10.0
GONE_WAIT_S = 5.0
_POLL_S = 0.05
_PR_SET_PDEATHSIG = 1


def _live_processes() -> Iterator[tuple[int, int, int]]:
    """(pid, ppid, pgrp) of every live (non-zombie) process (Linux /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # the fields after the parenthesised command: state ppid pgrp ...
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] not in ("Z", "X"):
            yield int(entry.name), int(fields[1]), int(fields[2])


def group_pids(pgid: int) -> list[int]:
    """Pids of the live (non-zombie) processes in process group `pgid` (Linux /proc)."""
    return [pid for pid, _, pgrp in _live_processes() if pgrp == pgid]


def group_alive(pgid: int) -> bool:
    """True while a process that is not a zombie is left in process group `pgid`."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone is there (another user's process): /proc says whether it is a zombie
    return bool(group_pids(pgid))


def descendants(pid: int) -> list[int]:
    """Pids of the live processes below `pid` (children, theirs, ...; Linux /proc)."""
    children: dict[int, list[int]] = {}
    for child, parent, _ in _live_processes():
        children.setdefault(parent, []).append(child)
    out: list[int] = []
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop()
        out.append(child)
        todo.extend(children.get(child, []))
    return out


def pid_alive(pid: int) -> bool:
    """True while `pid` is a process that is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :].split()[0] not in ("Z", "X")


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class Child:
    """A process started by `spawn`, the leader of its own process group."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.pgid = proc.pid  # a session leader's group id is its pid; kept once it is reaped
        self._gone = False  # stopped and verified empty: never signal this group id again

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def stdout(self) -> IO[bytes] | None:
        return self.proc.stdout

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def poll(self) -> int | None:
        """The leader's exit status, or None while it runs."""
        return self.proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout)

    def alive(self) -> bool:
        """True while any (non-zombie) process of the group is left, the leader included."""
        return not self._gone and group_alive(self.pgid)

    def signal(self, sig: int) -> None:
        """Send `sig` to the whole group; a group that is gone is left alone."""
        if not self._gone:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pgid, sig)

    def terminate(self) -> None:
        """SIGTERM the group (and SIGCONT it: a stopped process cannot act on SIGTERM)."""
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)

    def finish(self, deadline: float, on_kill: Callable[[], None] | None = None) -> int | None:
        """Wait until `deadline` (time.monotonic) for the leader to exit and the group to empty,
        SIGKILL the group if it has not (calling `on_kill` first), reap the leader, wait until
        the group is gone and close the pipes `spawn` opened. Returns the leader's exit status."""
        if self._gone:
            return self.proc.returncode
        while time.monotonic() < deadline and (self.proc.poll() is None or self.alive()):
            time.sleep(_POLL_S)
        if self.proc.poll() is None or self.alive():
            if on_kill is not None:
                on_kill()
            self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(KILL_WAIT_S)
        end = time.monotonic() + GONE_WAIT_S
        while self.alive() and time.monotonic() < end:
            self.signal(signal.SIGKILL)  # whatever is left has no business outliving the leader
            time.sleep(_POLL_S)
        self._gone = self.proc.returncode is not None and not group_alive(self.pgid)
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()
        return self.proc.returncode

    def stop(self, grace_s: float, on_kill: Callable[[], None] | None = None) -> int | None:
        """SIGTERM the group, SIGKILL it after `grace_s`, reap; see `finish`. A no-op (but for
        returning the exit status) once the group is gone."""
        if self._gone:
            return self.proc.returncode
        self.terminate()
        return self.finish(time.monotonic() + grace_s, on_kill)

    def kill(self) -> int | None:
        """SIGKILL the group at once, reap, wait until it is gone."""
        return self.finish(time.monotonic())


def spawn(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    stdin: Redirect = subprocess.DEVNULL,
    stdout: Redirect = None,
    stderr: Redirect = None,
    die_with_parent: bool = False,
) -> Child:
    """Start `argv` in a new session (its own process group). `env` is the whole environment
    (None: inherit ours). `die_with_parent` asks the kernel to SIGTERM the child when this
    process dies (PR_SET_PDEATHSIG); it is tied to the calling thread, so it only applies when
    called from the main thread."""
    main_thread = threading.current_thread() is threading.main_thread()
    proc = subprocess.Popen(
        list(argv),
        env=None if env is None else dict(env),
        cwd=cwd,
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        start_new_session=True,
        preexec_fn=_die_with_parent if die_with_parent and main_thread else None,
    )
    return Child(proc)


__all__ = ["GONE_WAIT_S", "KILL_WAIT_S", "Child", "group_alive", "group_pids", "spawn"]
