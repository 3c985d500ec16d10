"""SIGTERM to a router under load, and to the commands that start processes.

Two `controlplane serve` processes in front of the same two simulated replicas; a client spreads
requests over both (a fresh connection each, streamed and not) and retries a request on the other
router only when its connection is refused, as a load balancer does. One router gets SIGTERM
mid-load, while a long stream runs through it: its `/ready` turns 503 at once while `/health`
stays 200, it keeps serving through its drain window, then refuses connections; its long stream
completes, it exits 0, and not one request of the run fails.

`controlplane up` and `controlplane fleet up` (real subprocesses) get SIGTERM once ready: every
process they started (router, replicas, the private redis-server) is gone afterwards, checked by
pid and, for Redis, by its port refusing connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from router_fixtures import MODEL, sim_args, wait_until
from sim_fleet import SimReplica

from deploy.processes import Child, spawn
from deploy.redis_local import available, free_port

pytestmark = pytest.mark.timeout(180)
CP = str(Path(sys.executable).parent / "controlplane")


class Router:
    """`controlplane serve --config FILE --port P` in its own session."""

    def __init__(self, config: dict[str, Any], workdir: Path, name: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        path = workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.log = workdir / f"{name}.log"
        with self.log.open("wb") as out:
            self.child: Child = spawn(
                [CP, "serve", "--config", str(path), "--port", str(self.port)],
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def wait_ready(self, replicas: int) -> None:
        def ready() -> bool:
            assert self.child.poll() is None, self.log.read_text()[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.get(f"{self.url}/ready", timeout=2.0)
                return r.status_code == 200 and r.json()["ready_replicas"] >= replicas
            return False

        wait_until(ready, 60.0, f"router on {self.url} ready", interval_s=0.1)


def _config(model_dir: Path, sims: list[SimReplica]) -> dict[str, Any]:
    return {
        "host": "127.0.0.1",
        "served_model": MODEL,
        "tokenizer": str(model_dir),
        "replicas": [
            {"id": f"r{i}", "url": s.url, "gpu": "cpu", "model": MODEL} for i, s in enumerate(sims)
        ],
        "policy": {"name": "round_robin"},
        "health": {"probe_interval_s": 0.5},
        "shutdown": {"drain_s": 2.0, "grace_s": 30.0},
        "telemetry": {"json_logs": False, "log_level": "INFO"},
    }


def _body(i: int, stream: bool, max_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"tell me about number {i}"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }


async def _request(urls: list[str], i: int, refused: Counter[str], max_tokens: int = 60) -> str:
    """One request on a fresh connection; on a refused connection, the next router. Returns
    'ok' or what went wrong."""
    stream = i % 2 == 0
    for k in range(len(urls)):
        url = urls[(i + k) % len(urls)]
        try:
            async with httpx.AsyncClient(timeout=60.0) as client:
                payload = _body(i, stream, max_tokens)
                r = await client.post(f"{url}/v1/chat/completions", json=payload)
        except httpx.ConnectError:
            refused[url] += 1  # nothing was sent: safe to send elsewhere
            continue
        if r.status_code != 200:
            return f"{r.status_code}: {r.text[:200]}"
        if stream:
            return "ok" if "data: [DONE]" in r.text and '"error"' not in r.text else r.text[-300:]
        return "ok" if r.json()["choices"] else r.text[:300]
    return "refused everywhere"


def test_sigterm_to_one_of_two_routers_loses_no_request(model_dir: Path, tmp_path: Path) -> None:
    with (
        SimReplica(*sim_args(model_dir, speed=1.0)) as a,
        SimReplica(*sim_args(model_dir, speed=1.0)) as b,
    ):
        config = _config(model_dir, [a, b])
        first, second = Router(config, tmp_path, "first"), Router(config, tmp_path, "second")
        try:
            first.wait_ready(2)
            second.wait_ready(2)
            urls = [first.url, second.url]
            refused: Counter[str] = Counter()

            async def run() -> tuple[list[str], str, list[int], list[int]]:
                # ~4-5 s of tokens: runs through the drain window and past the listener's close
                long_stream = asyncio.create_task(_request([first.url], 0, refused, 900))
                results: list[str] = []
                ready_seen: list[int] = []
                health_seen: list[int] = []
                sent = 0

                async def wave(n: int) -> None:
                    nonlocal sent
                    batch = [_request(urls, sent + j, refused) for j in range(n)]
                    sent += n
                    results.extend(await asyncio.gather(*batch))

                await wave(16)
                first.child.terminate()  # SIGTERM, as the kubelet sends it
                async with httpx.AsyncClient(timeout=5.0) as probe:
                    ready_seen.append((await probe.get(f"{first.url}/ready")).status_code)
                    health_seen.append((await probe.get(f"{first.url}/health")).status_code)
                # load goes on through the drain window, the refusals and the exit
                while first.child.poll() is None:
                    await wave(8)
                await wave(8)
                return results, await long_stream, ready_seen, health_seen

            results, long_result, ready_seen, health_seen = asyncio.run(run())
            code = first.child.wait(5.0)
        finally:
            for r in (first, second):
                r.child.stop(15.0)
        log = first.log.read_text()
        assert Counter(results) == {"ok": len(results)}, Counter(results)
        assert long_result == "ok", long_result  # in flight at SIGTERM, finished
        assert refused[first.url] >= 1  # after the drain window: refused, sent to the other
        assert ready_seen == [503] and health_seen == [200]
        assert code == 0, log[-3000:]
        assert "drain window over" in log and "cutting" not in log


def _tree(pid: int) -> set[int]:
    """`pid` and every live descendant of it (Linux /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = (entry / "stat").read_text()
                fields = stat[stat.rindex(")") + 2 :].split()
                if fields[0] not in ("Z", "X"):
                    parents[int(entry.name)] = int(fields[1])
    tree, grew = {pid}, True
    while grew:
        kids = {p for p, pp in parents.items() if pp in tree and p not in tree}
        tree |= kids
        grew = bool(kids)
    return tree


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :].split()[0] not in ("Z", "X")


def _refused(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.parametrize(
    "command",
    [
        pytest.param(["up", "--replicas", "2"], id="up"),
        pytest.param(["up", "--replicas", "1", "--no-redis"], id="up-no-redis"),
        pytest.param(
            ["up", "--autoscale", "--replicas", "2", "--min", "2", "--load-time-s", "1"],
            id="up-autoscale",
        ),
        pytest.param(["fleet", "up", "--replicas", "2", "--base-port", "0"], id="fleet-up"),
    ],
)
def test_sigterm_leaves_no_process_behind(
    command: list[str], model_dir: Path, tmp_path: Path
) -> None:
    if command[0] == "up" and "--no-redis" not in command and not available():
        pytest.skip("redis-server is not installed")
    argv = [CP, *command]
    port = None
    if command[0] == "up":
        port = free_port()
        argv += ["--port", str(port)]
    log = tmp_path / "out.log"
    env = {**os.environ, "COLUMNS": "200"}
    with log.open("wb") as out:
        child = spawn(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:

        def serving() -> bool:
            assert child.poll() is None, log.read_text()[-3000:]
            if port is not None:
                with contextlib.suppress(httpx.HTTPError):
                    return httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200
                return False
            return "serving; Ctrl-C or SIGTERM" in log.read_text()

        wait_until(serving, 120.0, "the command to serve", interval_s=0.2)
        started = _tree(child.pid)
        text = log.read_text()
        redis_port = re.search(r"Redis at redis://127\.0\.0\.1:(\d+)", text)
        assert len(started) >= int(command[command.index("--replicas") + 1]) + 1
        if command[0] == "up" and "--no-redis" not in command:
            assert redis_port is not None, text[-2000:]
        os.kill(child.pid, signal.SIGTERM)  # the command itself, not its group
        code = child.wait(60.0)
    finally:
        child.stop(10.0)
    assert code == 0, log.read_text()[-3000:]
    wait_until(lambda: not any(_alive(p) for p in started), 10.0, "every started process gone")
    if redis_port is not None:
        assert _refused(int(redis_port.group(1)))
