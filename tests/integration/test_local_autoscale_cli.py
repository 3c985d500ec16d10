"""The pieces of `up --autoscale` on their own: the simulated replica's load time, and the
commands' answers to bad input (one error line, exit code 2, nothing started)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from router_fixtures import wait_until

from controlplane.cli.sim_replica import READY_PREFIX
from deploy.processes import spawn
from deploy.redis_local import free_port
from deploy.tiny_model import default_model_dir, make_tiny_model

pytestmark = pytest.mark.timeout(120)
CP = str(Path(sys.executable).parent / "controlplane")
# long against the process's own start-up (~1-2 s), so the first probe lands inside it
LOAD_TIME_S = 8.0


def _health(url: str) -> int | None:
    """The /health status, or None when the connection is refused."""
    try:
        return httpx.get(f"{url}/health", timeout=2.0).status_code
    except httpx.ConnectError:
        return None


def test_sim_replica_refuses_connections_while_it_loads(tmp_path: Path) -> None:
    model_dir = default_model_dir()
    make_tiny_model(model_dir)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "sim.log"
    argv = [CP, "sim-replica", "--port", str(port), "--model-dir", str(model_dir),
            "--load-time-s", str(LOAD_TIME_S)]  # fmt: skip
    with log.open("wb") as out:
        child = spawn(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        assert _health(url) is None  # loading: nothing listens
        assert READY_PREFIX not in log.read_text()

        def ready() -> bool:
            assert child.poll() is None, log.read_text()[-2000:]
            return READY_PREFIX in log.read_text()

        wait_until(ready, 60.0, "the replica to finish loading", 0.2)
        assert _health(url) == 200
    finally:
        child.stop(10.0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["load", "--url", "http://127.0.0.1:9", "--ramp", "0:1,x"], "is not T:RATE"),
        (["load", "--url", "http://127.0.0.1:9", "--ramp", "10:1,5:2"], "must increase"),
        (["up", "--autoscale", "--min", "3", "--max", "2"], "min (3) <= max (2)"),
        (["up", "--autoscale", "--policy-param", "nonsense=1"], "unknown headroom parameter"),
        (["up", "--autoscale", "--policy-param", "spare"], "expects KEY=VALUE"),
    ],
)
def test_bad_input_is_one_error_line(argv: list[str], message: str) -> None:
    env = {**os.environ, "COLUMNS": "200"}
    proc = subprocess.run([CP, *argv], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
