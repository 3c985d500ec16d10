"""A replica that stops answering mid-load (SIGSTOP), and clients that walk away from streams.

A router (`RouterServer`) in front of two simulated replicas `a` and `b`, round robin, the
default 60-s TTFT deadline. Non-streamed requests (nothing reaches the client before the answer
is complete) are in flight on `a` when it is stopped: its probes fail, the fleet marks it DOWN,
and every request waiting on it is cancelled there and sent once to `b`. Every client gets one
200 answer, none waits for the TTFT deadline (no replica is ejected for `ttft`, no 504), the
retries are counted as `cp_retries_total{reason="ejected"}`, and once `a` runs again it sees the
cancelled connections and aborts what it held (its running count drops to 0). The router ends
with nothing held (ledger empty, gauges zero), each request's quota reserved and settled once.
A stopped process is always continued.

Clients that disconnect mid-stream, directly or through the router, free the replica's engine
(`vllm:num_requests_running` back to 0, the aborts counted).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from router_fixtures import (
    MODEL,
    assert_router_idle,
    finished_requests,
    replica_entry,
    router_metric,
    router_settings,
    running_requests,
    sim_args,
    wait_until,
)
from router_harness import RouterServer
from sim_fleet import SimReplica

from deploy.tiny_model import default_model_dir
from router.fleet.health import EjectReason

pytestmark = pytest.mark.timeout(120)
TENANT, KEY = "hung-test", "sk-hung-test"
KEY_SHA = hashlib.sha256(KEY.encode()).hexdigest()


@pytest.fixture
def pair(model_dir: Path) -> Iterator[tuple[SimReplica, SimReplica]]:
    with SimReplica(*sim_args(model_dir, speed=1.0)) as a, SimReplica(*sim_args(model_dir)) as b:
        yield a, b


def body(i: int, *, stream: bool, max_tokens: int) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"request number {i}, please answer at length"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }


async def _post(client: httpx.AsyncClient, url: str, i: int) -> tuple[int, str]:
    r = await client.post(
        f"{url}/v1/chat/completions",
        json=body(i, stream=False, max_tokens=900),
        headers={"authorization": f"Bearer {KEY}"},
        timeout=90.0,
    )
    return r.status_code, r.text


def test_replica_stopped_mid_load_costs_no_request(pair: tuple[SimReplica, SimReplica]) -> None:
    a, b = pair
    settings = router_settings(
        default_model_dir(),
        [replica_entry("a", a), replica_entry("b", b)],
        policy={"name": "round_robin"},
        health={"probe_interval_s": 0.2, "probe_timeout_s": 0.5, "consecutive_failures": 3},
        timeouts={"ttft_s": 60.0},  # the deadline the requests must NOT wait for
        tenants=[{"id": TENANT, "api_key_sha256": [KEY_SHA], "quota_tokens": 10**7}],
    )
    n = 12
    with RouterServer(settings) as router:
        router.wait_ready(2)

        async def load() -> list[tuple[int, str]]:
            async with httpx.AsyncClient() as client:
                tasks = [asyncio.create_task(_post(client, router.url, i)) for i in range(n)]
                # stop `a` while it is generating some of them
                while running_requests(a) == 0:
                    await asyncio.sleep(0.02)
                os.killpg(a.pid, signal.SIGSTOP)
                try:
                    return await asyncio.gather(*tasks)
                finally:
                    os.killpg(a.pid, signal.SIGCONT)

        try:
            results = asyncio.run(load())
        finally:
            os.killpg(a.pid, signal.SIGCONT)  # never leave a stopped process
        statuses = Counter(status for status, _ in results)
        assert statuses == {200: n}, results
        retried = router_metric(router, "cp_retries_total", reason="ejected")
        assert retried >= 1
        # the fleet took `a` out because it went DOWN, not because a request timed out on it
        ejections = router.call(lambda: dict(router.runtime.fleet.ejections))
        assert ejections.get(("a", EjectReason.DOWN), 0) >= 1
        assert ejections.get(("a", EjectReason.TTFT), 0) == 0
        # and the metric says the same
        metric = router.call(
            lambda: router.runtime.metrics.registry.get_sample_value(
                "cp_ejections_total", {"replica": "a", "reason": "down"}
            )
        )
        assert metric is not None and metric >= 1
        # `a`, running again, sees the cancelled connections and aborts what it held
        wait_until(lambda: running_requests(a) == 0, 20.0, "a's engine to drop the cut requests")
        assert finished_requests(a, "abort") >= retried
        assert_router_idle(router, timeout_s=10.0)
        # each request reserved its quota once and settled it once, retried or not
        stats = router.call(lambda: router.runtime.quotas.stats(TENANT))
        assert (stats.reserved, stats.settled, stats.duplicate, stats.open) == (n, n, 0, 0)


# -- aborted streams free the replica ------------------------------------------------------------
async def _walk_away(url: str, path: str, i: int) -> None:
    """Open a stream, read its first bytes, and disconnect."""
    payload = body(i, stream=True, max_tokens=900)
    async with (
        httpx.AsyncClient(timeout=30.0) as client,
        client.stream("POST", f"{url}{path}", json=payload) as r,
    ):
        assert r.status_code == 200, await r.aread()
        async for _ in r.aiter_bytes():
            return


@pytest.mark.parametrize("through_router", [False, True], ids=["direct", "router"])
def test_streams_whose_clients_left_are_aborted(
    pair: tuple[SimReplica, SimReplica], through_router: bool
) -> None:
    a = pair[0]
    n = 50
    settings = router_settings(
        default_model_dir(), [replica_entry("a", a)], health={"probe_interval_s": 0.5}
    )

    async def walk_away(url: str) -> None:
        await asyncio.gather(*(_walk_away(url, "/v1/chat/completions", i) for i in range(n)))

    aborted_before = finished_requests(a, "abort")
    if through_router:
        with RouterServer(settings) as router:
            router.wait_ready(1)
            asyncio.run(walk_away(router.url))
            wait_until(lambda: running_requests(a) == 0, 20.0, "the replica to abort them all")
            assert_router_idle(router, timeout_s=10.0)
    else:
        asyncio.run(walk_away(a.url))
        wait_until(lambda: running_requests(a) == 0, 20.0, "the replica to abort them all")
    assert finished_requests(a, "abort") - aborted_before == n
