"""Simulated vLLM replicas (`python -m controlplane.sim_replica`) as subprocesses, for tests.

Each replica listens on a port the OS picks (`--port 0`; the URL comes from its ready line), runs
in its own process group (`deploy.processes`), and is waited for until `/health` answers 200.
Teardown sends SIGTERM to the group, then SIGKILL after a grace period, and checks nothing of the
group is left.

    with SimReplica("--speed", "20", env={"PYTHONHASHSEED": "0"}) as replica:
        httpx.get(f"{replica.url}/v1/models")
        replica.set_faults(unavailable=True)
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any

import httpx

from deploy.processes import Child, group_alive, spawn

READY_PREFIX = "sim-replica ready at "
ADMIN_TOKEN = "test-admin-token"


class SimReplica:
    """One simulated replica process."""

    def __init__(
        self,
        *args: str,
        env: Mapping[str, str] | None = None,
        admin_token: str = ADMIN_TOKEN,
        start_timeout_s: float = 20.0,
    ) -> None:
        self.args = args
        self.env = dict(env or {})
        self.admin_token = admin_token
        self.start_timeout_s = start_timeout_s
        self.child: Child | None = None
        self.url = ""
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed by stop()

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> SimReplica:
        cmd = [
            sys.executable,
            "-m",
            "controlplane.sim_replica",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--admin-token",
            self.admin_token,
            *self.args,
        ]
        env = {**os.environ, **self.env}
        self.child = spawn(cmd, env=env, stdout=subprocess.PIPE, stderr=self._stderr)
        deadline = time.monotonic() + self.start_timeout_s
        self.url = self._read_ready_line(deadline)
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return self
            time.sleep(0.02)
        raise TimeoutError(
            f"sim replica not healthy in {self.start_timeout_s}s: {self._last_words()}"
        )

    def _read_ready_line(self, deadline: float) -> str:
        assert self.child is not None and self.child.stdout is not None
        out = self.child.stdout
        buf = b""
        while time.monotonic() < deadline:
            ready, _, _ = select.select([out], [], [], 0.05)
            if ready:
                chunk = os.read(out.fileno(), 4096)
                if not chunk:
                    break
                buf += chunk
                for line in buf.decode(errors="replace").splitlines():
                    if line.startswith(READY_PREFIX):
                        return line[len(READY_PREFIX) :].strip()
            elif self.child.poll() is not None:
                break
        raise RuntimeError(f"sim replica did not start: {buf!r} {self._last_words()}")

    def _last_words(self) -> str:
        """Stop the replica and return all it wrote on stderr (read before `stop()` closes it)."""
        assert self.child is not None
        self.child.stop(5.0)
        err = self.stderr
        self.stop()
        return err

    @property
    def pid(self) -> int:
        assert self.child is not None
        return self.child.pgid

    @property
    def stderr(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")

    def wait_exit(self, timeout: float = 5.0) -> int:
        assert self.child is not None
        return self.child.wait(timeout)

    def stop(self, grace_s: float = 5.0) -> int | None:
        """SIGTERM the process group, SIGKILL after `grace_s`; returns the exit status."""
        if self.child is None:
            return None
        code = self.child.stop(grace_s)
        self._stderr.close()
        return code

    def __enter__(self) -> SimReplica:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- helpers ---------------------------------------------------------------------------------
    def set_faults(self, **knobs: Any) -> dict[str, Any]:
        """POST /_faults (`reset=True` clears every knob first)."""
        resp = httpx.post(
            f"{self.url}/_faults",
            json=knobs,
            headers={"Authorization": f"Bearer {self.admin_token}"},
            timeout=5.0,
        )
        resp.raise_for_status()
        faults: dict[str, Any] = resp.json()["faults"]
        return faults

    def kv_endpoints(self) -> tuple[str, str | None]:
        """(PUB endpoint, replay endpoint) to connect to, from GET /kv_event_sources."""
        src = httpx.get(f"{self.url}/kv_event_sources", timeout=5.0).json()["0"]

        def local(ep: str | None) -> str | None:
            return None if ep is None else ep.replace("0.0.0.0", "127.0.0.1")

        pub = local(src["endpoint"])
        assert pub is not None
        return pub, local(src["replay_endpoint"])


@contextlib.contextmanager
def sim_replica(*args: str, env: Mapping[str, str] | None = None) -> Iterator[SimReplica]:
    """A started replica; on exit it is stopped and its process group is checked gone."""
    replica = SimReplica(*args, env=env)
    replica.start()
    try:
        yield replica
    finally:
        replica.stop()
        assert not group_alive(replica.pid), "the sim replica left processes behind"


@contextlib.contextmanager
def sim_replicas(replicas: dict[str, SimReplica]) -> Iterator[dict[str, SimReplica]]:
    """`replicas` started in parallel; on exit every started one is stopped and its process
    group checked gone."""
    try:
        with ThreadPoolExecutor(len(replicas)) as pool:
            list(pool.map(SimReplica.start, replicas.values()))
        yield replicas
    finally:
        for r in replicas.values():
            if r.child is not None:
                r.stop()
                assert not group_alive(r.pid), "a sim replica left processes behind"
