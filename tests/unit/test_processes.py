"""`deploy.processes`: a child in its own process group, stopped as a whole group.

Each case is a `python -c` child that prints one line once it is set up (its signal handlers
installed, its grandchild started), then is stopped; the assertions are about what happened to
the group (how the leader ended, whether SIGKILL was needed, that nothing of it is left), never
about how long it took.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from deploy.processes import Child, group_alive, group_pids, spawn

pytestmark = pytest.mark.timeout(60)

IGNORE_TERM = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
SLEEP = "import time; time.sleep(600)\n"
READY = "print('ready', flush=True)\n"
NAMED = "import os; print('ready', os.getpid(), flush=True)\n"  # a grandchild's ready line
IGNORED = IGNORE_TERM + NAMED
EXIT_ON_TERM = "import signal, sys; signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
TERM, KILL = signal.SIGTERM, signal.SIGKILL


def with_grandchild(script: str) -> str:
    """Start `script` as a grandchild (same process group); it names itself in the ready line."""
    return f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {script!r}])\n"


@dataclass(frozen=True)
class Case:
    name: str
    script: str
    returncode: int  # the leader's exit status once stopped
    killed: bool  # whether the group needed SIGKILL after the grace
    pause: bool = False  # SIGSTOP the group before stopping it
    leader_exits: bool = False  # wait for the leader to exit on its own before stopping


GRAND_SLEEP = with_grandchild(NAMED + SLEEP) + SLEEP
GRAND_IGNORES = with_grandchild(IGNORED + SLEEP) + SLEEP
GRAND_ALONE = with_grandchild(IGNORED + SLEEP)  # the leader exits at once

CASES = [
    Case("exits on SIGTERM", READY + SLEEP, -TERM, killed=False),
    Case("ignores SIGTERM", IGNORE_TERM + READY + SLEEP, -KILL, killed=True),
    Case("paused (SIGSTOP)", READY + SLEEP, -TERM, killed=False, pause=True),
    Case("exits 0 on SIGTERM", EXIT_ON_TERM + READY + SLEEP, 0, killed=False),
    Case("grandchild exits on SIGTERM", GRAND_SLEEP, -TERM, killed=False),
    Case("grandchild ignores SIGTERM", GRAND_IGNORES, -TERM, killed=True),
    Case("grandchild outlives the leader", GRAND_ALONE, 0, killed=True, leader_exits=True),
]


def started(script: str) -> tuple[Child, list[int]]:
    """Spawn `script`; wait for its ready line; (child, pids of the grandchildren it named)."""
    child = spawn([sys.executable, "-c", script], stdout=subprocess.PIPE)
    assert child.stdout is not None
    words = child.stdout.readline().split()
    assert words[:1] == [b"ready"], f"the child did not start: {words!r}"
    return child, [int(w) for w in words[1:]]


def gone(pid: int) -> bool:
    """No such process, or only its zombie (reaping orphans is init's business, not ours)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_stop_leaves_nothing_of_the_group(case: Case) -> None:
    child, grandchildren = started(case.script)
    assert child.pgid == child.pid == os.getpgid(child.pid) == os.getsid(child.pid)
    assert child.alive()
    assert all(os.getpgid(pid) == child.pgid for pid in grandchildren)
    assert set(grandchildren) <= set(group_pids(child.pgid))
    if case.pause:
        child.signal(signal.SIGSTOP)
    if case.leader_exits:
        assert child.wait() == case.returncode
        assert child.alive()  # the grandchild is still in the group
    kills: list[str] = []
    code = child.stop(grace_s=1.0, on_kill=lambda: kills.append(case.name))
    assert code == child.returncode == case.returncode
    assert kills == ([case.name] if case.killed else [])
    assert not child.alive() and not group_alive(child.pgid)
    assert group_pids(child.pgid) == []
    assert all(gone(pid) for pid in (child.pid, *grandchildren))
    assert child.stdout is not None and child.stdout.closed  # the pipe spawn opened


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_stopping_an_exited_child_is_a_no_op(how: str) -> None:
    child = spawn([sys.executable, "-c", "import sys; sys.exit(3)"])
    assert child.wait() == 3
    kills: list[int] = []
    for _ in range(2):
        code = child.stop(1.0, on_kill=lambda: kills.append(1)) if how == "stop" else child.kill()
        assert code == 3
    assert kills == []
    assert not child.alive()


def test_kill_does_not_wait_for_sigterm() -> None:
    child, _ = started(READY + SLEEP)
    assert child.kill() == -signal.SIGKILL
    assert not child.alive()
    assert child.stop(1.0) == -signal.SIGKILL  # and then stop is a no-op


def test_spawn_passes_env_cwd_and_redirects(tmp_path: Path) -> None:
    log = tmp_path / "out.log"
    script = "import os, sys; print(os.getcwd(), os.environ['PROBE']); sys.stdout.flush()"
    with log.open("wb") as out:
        child = spawn(
            [sys.executable, "-c", script],
            env={**os.environ, "PROBE": "42"},
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    assert child.wait() == 0
    assert log.read_text().split() == [str(tmp_path), "42"]
    assert child.stop(1.0) == 0


def test_descendants_are_the_children_and_theirs() -> None:
    """A child that started a grandchild: both are below it, neither after the group stops."""
    from deploy.processes import descendants, pid_alive

    grandchild = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {SLEEP!r}])\n"
    child = spawn([sys.executable, "-c", grandchild + READY + SLEEP], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        below = descendants(child.pid)
        assert len(below) == 1 and pid_alive(below[0])
        assert child.pid in descendants(os.getpid())
        assert below[0] in descendants(os.getpid())
    finally:
        child.stop(5.0)
    assert not pid_alive(child.pid) and not pid_alive(below[0])
    assert descendants(child.pid) == []
