"""`controlplane serve --workers N`: several router processes on one port, sharing Redis.

Two workers in front of two simulated replicas serve requests on fresh connections (the kernel
spreads them over the workers' SO_REUSEPORT sockets), every request is settled once in the shared
quota store, and the process group holds the parent and its two workers until it is stopped.
Without Redis, more than one worker is a configuration error, before anything starts.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from quota_scenario import KEY, RouterProcess, router_config, settled_stats
from router_fixtures import sim_args
from sim_fleet import SimReplica

from deploy.processes import group_pids, spawn
from deploy.redis_local import RedisServer

pytestmark = [pytest.mark.redis, pytest.mark.timeout(180)]


class Workers(RouterProcess):
    def start(self) -> None:
        cp = Path(sys.executable).parent / "controlplane"
        argv = [str(cp), "serve", "--config", str(self.config_path), "--port", str(self.port)]
        env = {**os.environ, "CP_CACHE_SALT_SECRET": "workers-secret"}
        with self.log_path.open("wb") as log:
            self.child = spawn(
                [*argv, "--workers", "2"], env=env, stdout=log, stderr=subprocess.STDOUT
            )


async def fresh_connections(url: str, n: int) -> list[int]:
    async def one(i: int) -> int:
        body = {
            "model": "tiny-llama",
            "messages": [{"role": "user", "content": f"hello number {i}"}],
            "max_tokens": 4,
            "stream": i % 2 == 0,
        }
        headers = {"authorization": f"Bearer {KEY}", "connection": "close"}
        async with httpx.AsyncClient(timeout=30.0) as client:
            r = await client.post(f"{url}/v1/chat/completions", json=body, headers=headers)
            return r.status_code

    return list(await asyncio.gather(*(one(i) for i in range(n))))


def test_two_workers_share_one_port_and_the_quota_store(
    model_dir: Path, redis_server: RedisServer, tmp_path: Path
) -> None:
    with SimReplica(*sim_args(model_dir, speed=20.0)) as a, SimReplica(*sim_args(model_dir)) as b:
        config = router_config(model_dir, {"a": a, "b": b}, redis_server.url, 10**7)
        router = Workers(config, tmp_path, 0)
        router.start()
        try:
            router.wait_ready(2)
            assert router.child is not None
            assert len(group_pids(router.child.pgid)) >= 3  # the parent and two workers
            statuses = asyncio.run(fresh_connections(router.url, 24))
            assert statuses == [200] * 24
        finally:
            code = router.stop()
        assert code in (0, -15, None), router.log_path.read_text()[-2000:]
        stats = asyncio.run(settled_stats(redis_server.url))
        assert stats.reserved == stats.settled == 24 and stats.open == 0


def test_workers_without_redis_is_a_config_error(model_dir: Path, tmp_path: Path) -> None:
    cp = Path(sys.executable).parent / "controlplane"
    done = subprocess.run(
        [str(cp), "serve", "--replica", "a=http://127.0.0.1:9", "--workers", "2"],
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert b"redis.url" in done.stderr + done.stdout
