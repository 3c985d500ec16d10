"""`deploy.local_fleet` process handling, with fake replicas (fast; no vLLM needed).

Each fake replica is a tiny HTTP server that also spawns a grandchild, so the tests can check
that stopping reaches the whole process group and leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from deploy.local_fleet import (
    FleetError,
    FleetSpec,
    LocalFleet,
    ReplicaFailedError,
    ReplicaLaunch,
    layout,
    run_until_signalled,
    sim_argv,
    vllm_argv,
    vllm_env,
)
from deploy.processes import group_pids

FAKE_REPLICA = r"""
import http.server, os, signal, subprocess, sys, threading, time
port, mode = int(sys.argv[1]), sys.argv[2]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
if mode == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if mode == "crash":
    time.sleep(0.3)
    print("fake replica: crashing on purpose", flush=True)
    os._exit(3)
if mode == "crash-once":
    marker = os.path.join(os.getcwd(), f"crashed-{port}")
    if not os.path.exists(marker):
        open(marker, "w").close()
        print("fake replica: crashing on its first start", flush=True)
        os._exit(5)
if mode == "die-later":
    threading.Timer(1.5, lambda: os._exit(4)).start()
if mode != "never-healthy":
    time.sleep(0.2)

class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        ok = self.path == "/health" and mode != "never-healthy"
        self.send_response(200 if ok else 503)
        self.end_headers()
    def log_message(self, *args):
        pass

print(f"fake replica on {port}, grandchild {child.pid}", flush=True)
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def fake_factory(modes: dict[int, str] | None = None):  # type: ignore[no-untyped-def]
    def factory(launch: ReplicaLaunch) -> tuple[list[str], dict[str, str]]:
        mode = (modes or {}).get(launch.index, "ok")
        return [sys.executable, "-c", FAKE_REPLICA, str(launch.port), mode], {}

    return factory


def spec(**kw: object) -> FleetSpec:
    base: dict[str, object] = {
        "replicas": 2,
        "engine": "sim",
        "base_port": 0,
        "model_dir": None,
        "startup_timeout_s": 20.0,
        "stop_grace_s": 3.0,
    }
    base.update(kw)
    return FleetSpec(**base)  # type: ignore[arg-type]


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A stand-in model directory (fake replicas never read it)."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


def all_gone(pgids: list[int], timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if not any(group_pids(g) for g in pgids):
            return True
        time.sleep(0.05)
    return False


def test_start_serve_stop_leaves_nothing_behind(model_dir: Path) -> None:
    fleet = LocalFleet(spec(model_dir=model_dir), argv_factory=fake_factory())
    with fleet:
        assert len(fleet.urls) == 2
        for url in fleet.urls:
            assert httpx.get(f"{url}/health").status_code == 200
        pgids = fleet.pgids()
        # each group holds the server and its grandchild
        assert all(len(group_pids(g)) >= 2 for g in pgids)
        assert all(os.getpgid(g) == g for g in pgids)  # own process groups
        assert fleet.startup_s is not None
        reps = fleet.describe()["replicas"]
        assert isinstance(reps, list)
        assert [r["name"] for r in reps] == ["replica-0", "replica-1"]
    assert all_gone(pgids)
    fleet.stop()  # idempotent


def test_a_replica_crashing_at_startup_fails_fast_and_stops_the_rest(model_dir: Path) -> None:
    fleet = LocalFleet(spec(model_dir=model_dir), argv_factory=fake_factory({1: "crash"}))
    with pytest.raises(ReplicaFailedError) as info:  # on the crash, not a start timeout
        fleet.start()
    assert info.value.replica == "replica-1"
    assert "exited with code 3" in str(info.value)
    assert "crashing on purpose" in info.value.log_tail
    assert all_gone(fleet.pgids())


def test_a_replica_crashing_on_its_first_start_is_started_once_more(model_dir: Path) -> None:
    fleet = LocalFleet(spec(model_dir=model_dir), argv_factory=fake_factory({0: "crash-once"}))
    with fleet:
        rep = fleet.replicas[0]
        assert rep.startup_failures == 1
        assert rep.healthy_at is not None
        log = rep.log_path.read_text()
        assert "crashing on its first start" in log  # the first attempt's log is kept
        pgids = fleet.pgids()
    assert all_gone(pgids)


def test_no_retry_left_fails_with_the_root_cause(model_dir: Path) -> None:
    fleet = LocalFleet(
        spec(model_dir=model_dir, startup_retries=0), argv_factory=fake_factory({0: "crash-once"})
    )
    with pytest.raises(ReplicaFailedError) as info:
        fleet.start()
    assert "exited with code 5" in str(info.value)
    assert "crashing on its first start" in info.value.log_tail
    assert all_gone(fleet.pgids())


def test_health_timeout_stops_everything(model_dir: Path) -> None:
    fleet = LocalFleet(
        spec(model_dir=model_dir, startup_timeout_s=1.5),
        argv_factory=fake_factory({0: "never-healthy"}),
    )
    with pytest.raises(ReplicaFailedError, match="not healthy after"):
        fleet.start()
    assert all_gone(fleet.pgids())


def test_sigterm_ignoring_replica_is_killed(model_dir: Path) -> None:
    fleet = LocalFleet(
        spec(model_dir=model_dir, replicas=1, stop_grace_s=1.0),
        argv_factory=fake_factory({0: "ignore-term"}),
    )
    fleet.start()
    pgids = fleet.pgids()
    fleet.stop()
    assert all_gone(pgids)
    assert fleet.replicas[0].exited() == -signal.SIGKILL


def test_run_until_signalled_raises_when_a_replica_dies(model_dir: Path) -> None:
    fleet = LocalFleet(spec(model_dir=model_dir), argv_factory=fake_factory({0: "die-later"}))
    fleet.start()
    pgids = fleet.pgids()
    with pytest.raises(ReplicaFailedError, match="exited with code 4"):
        run_until_signalled(fleet, poll_s=0.1)
    assert all_gone(pgids)


def test_run_until_signalled_stops_on_sigterm(model_dir: Path) -> None:
    fleet = LocalFleet(spec(model_dir=model_dir), argv_factory=fake_factory())
    fleet.start()
    pgids = fleet.pgids()
    original = signal.getsignal(signal.SIGTERM)

    def send() -> None:  # only once run_until_signalled has installed its handler
        end = time.monotonic() + 10
        while signal.getsignal(signal.SIGTERM) is original and time.monotonic() < end:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=send, daemon=True).start()
    run_until_signalled(fleet, poll_s=0.05)
    assert signal.getsignal(signal.SIGTERM) is original
    assert all_gone(pgids)


async def test_async_context_manager(model_dir: Path) -> None:
    async with LocalFleet(spec(model_dir=model_dir), argv_factory=fake_factory()) as fleet:
        async with httpx.AsyncClient() as client:
            codes = await asyncio.gather(*(client.get(f"{u}/health") for u in fleet.urls))
        assert [c.status_code for c in codes] == [200, 200]
        pgids = fleet.pgids()
    assert all_gone(pgids)


def test_ports_in_use_are_refused(model_dir: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(FleetError, match="already in use"):
            layout(spec(model_dir=model_dir, base_port=port), model_dir)


def test_argv_builders(model_dir: Path) -> None:
    sp = spec(model_dir=model_dir, base_port=9300, num_gpu_blocks=128, engine="vllm")
    launches = layout(sp, model_dir)
    assert [(r.port, r.events_port, r.replay_port) for r in launches] == [
        (9300, 10300, 10301),
        (9301, 10302, 10303),
    ]
    argv = vllm_argv(launches[1], Path("/venv/bin/python"))
    assert argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    for flag in (
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--enable-force-include-usage",
        "--enable-request-id-headers",
    ):
        assert flag in argv
    assert argv[argv.index("--block-size") + 1] == "32"
    assert argv[argv.index("--num-gpu-blocks-override") + 1] == "128"
    cfg = argv[argv.index("--kv-events-config") + 1]
    assert '"endpoint":"tcp://*:10302"' in cfg and '"replay_endpoint":"tcp://*:10303"' in cfg
    env = vllm_env(launches[1])
    assert env["PYTHONHASHSEED"] == "0" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    sim = sim_argv(launches[0])
    assert "sim-replica" in sim
    assert sim[sim.index("--kv-events-endpoint") + 1] == "tcp://*:10300"
    assert sim[sim.index("--kv-events-replay-endpoint") + 1] == "tcp://*:10301"
    assert sim[sim.index("--num-gpu-blocks") + 1] == "128"


def test_vllm_block_size_must_be_a_multiple_of_32() -> None:
    from controlplane.errors import ConfigError

    with pytest.raises(ConfigError, match="multiple of 32"):
        FleetSpec(engine="vllm", block_size=16).validate()


def test_sim_engine_fleet_publishes_vllm_hashes(tmp_path: Path) -> None:
    """The sim engine through the real argv builder: /health, a completion, vLLM's hashes."""
    pytest.importorskip("controlplane.cli.sim_replica")
    import zmq
    from vllm_fleet import EventCollector, block_stored

    from controlplane.hashing import vllm_block_hashes
    from deploy.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny").path
    sp = spec(model_dir=model, speed=20.0, replicas=2)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with LocalFleet(sp) as fleet:
            col = EventCollector(ctx, fleet.replicas[1].launch.events_connect, sp.topic)
            try:
                time.sleep(0.5)  # slow joiner
                ids = list(range(1, 65))
                resp = httpx.post(
                    f"{fleet.urls[1]}/v1/completions",
                    json={"model": "tiny-llama", "prompt": ids, "max_tokens": 1},
                    timeout=30,
                )
                assert resp.status_code == 200
                stored = block_stored(col.drain(5.0))
                got = [h for ev in stored for h in ev["block_hashes"]]
                assert got == vllm_block_hashes(ids, 32, algo="sha256", seed="0")
            finally:
                col.close()
            pgids = fleet.pgids()
        assert all_gone(pgids)
    finally:
        ctx.term()


def test_vllm_env_stamp_and_errors(tmp_path: Path) -> None:
    from deploy.vllm_env import (
        STAMP_NAME,
        VllmEnvError,
        ensure_vllm_env,
        read_stamp,
        require_vllm_env,
    )

    venv = tmp_path / "venv"
    assert read_stamp(venv) is None
    with pytest.raises(VllmEnvError, match="make vllm-env"):
        require_vllm_env(venv)
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    (venv / STAMP_NAME).write_text('{"vllm_cpu": "0.0.1", "vllm": "0.0.1"}')
    assert read_stamp(venv) is None  # another version: stale
    (venv / STAMP_NAME).write_text('{"vllm_cpu": "0.32.0", "vllm": "0.32.0", "torch": "t"}')
    ready = require_vllm_env(venv)
    assert (ready.vllm_version, ready.python) == ("0.32.0", venv / "bin" / "python")
    lines: list[str] = []
    assert ensure_vllm_env(venv, log=lines.append) == ready  # idempotent: nothing runs
    with pytest.raises(VllmEnvError, match="not found"):
        ensure_vllm_env(tmp_path / "other", python="no-such-python3.11", log=lines.append)
