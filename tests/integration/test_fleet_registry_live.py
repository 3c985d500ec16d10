"""The shared fleet registry live: routers sharing a private real Redis, simulated replicas
speaking vLLM's HTTP protocol, clients through httpx.

Admin changes made on one router reach the other; a drain through one router stops new
requests on both while a stream in flight on the other finishes, then the replica leaves both;
a restarted router reads the fleet back; a Redis outage keeps the fleet and reports degraded;
the DNS source (a fake resolver over a real replica) adds and drains members."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from redis_server import RedisServer
from router_fixtures import (
    MODEL,
    metric_value,
    replica_entry,
    replica_status,
    router_settings,
    running_requests,
    scrape,
    sim_args,
    wait_until,
)
from router_harness import RouterServer
from sim_fleet import SimReplica

from router.fleet.lifecycle import Lifecycle
from router.fleet.sources import PollingSource
from router.runtime import RouterRuntime
from router.telemetry import parse_decision_header

ADMIN = "registry-admin-key"
AUTH = {"authorization": f"Bearer {ADMIN}"}

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def sims(model_dir: Path) -> Iterator[tuple[SimReplica, SimReplica]]:
    with SimReplica(*sim_args(model_dir)) as a, SimReplica(*sim_args(model_dir)) as b:
        yield a, b


@pytest.fixture(autouse=True)
def _reset_faults(sims: tuple[SimReplica, SimReplica]) -> Iterator[None]:
    yield
    for s in sims:
        s.set_faults(reset=True)


def shared(model_dir: Path, redis_url: str, replicas: list[dict[str, Any]], **extra: Any) -> Any:
    return router_settings(
        model_dir,
        replicas,
        admin_key=ADMIN,
        redis={"url": redis_url},
        fleet={"shared": True, "resync_s": 0.2, "heartbeat_ttl_s": 3.0, **extra},
        health={"scrape_interval_s": 0.2, "probe_interval_s": 0.2},
        telemetry={"decision_header": True},
    )


def ids(router: RouterServer) -> set[str]:
    return set(replica_status(router))


def routed_to(router: RouterServer, content: str) -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    r = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return parse_decision_header(r.headers["x-cp-decision"])["replica"]


def registry_clients(admin: redis.Redis) -> int:
    clients: list[dict[str, Any]] = admin.client_list()
    return sum(1 for c in clients if c.get("name") == "cp-fleet-registry")


def test_admin_add_on_one_router_reaches_the_other_and_a_restart_reads_it_back(
    model_dir: Path,
    redis_server: RedisServer,
    redis_admin: redis.Redis,
    sims: tuple[SimReplica, SimReplica],
) -> None:
    s0, s1 = sims
    a_settings = shared(model_dir, redis_server.url, [replica_entry("r0", s0)])
    with RouterServer(a_settings) as a, RouterServer(shared(model_dir, redis_server.url, [])) as b:
        a.wait_ready(1)
        b.wait_ready(1)  # b has no replica of its own: it follows the registry
        assert ids(b) == {"r0"}
        r = httpx.post(f"{a.url}/admin/replicas", json=replica_entry("r1", s1), headers=AUTH)
        assert r.status_code == 201, r.text
        b.wait_ready(2)
        # drain r0 through a: b routes to r1, and r0 leaves both (nothing in flight)
        assert httpx.post(f"{a.url}/admin/replicas/r0/drain", headers=AUTH).status_code == 200
        wait_until(lambda: ids(a) == ids(b) == {"r1"}, 20, "r0 to leave both routers")
        assert {routed_to(b, f"after the drain {i}") for i in range(3)} == {"r1"}
        fleet = httpx.get(f"{b.url}/admin/replicas", headers=AUTH).json()["fleet"]
        states = {row["id"]: row["state"] for row in fleet}
        assert states == {"r0": "gone", "r1": "ready"}
        assert httpx.delete(f"{b.url}/admin/replicas/r0", headers=AUTH).status_code == 404
        metrics = scrape(b.url)
        assert metric_value(metrics, "cp_fleet_replicas", state="gone") == 1
        assert metric_value(metrics, "cp_fleet_replicas", state="ready") == 1
        assert metric_value(scrape(a.url), "cp_fleet_registry_updates_total", source="admin") >= 1
        assert registry_clients(redis_admin) >= 2
    # a restarted router (a's configuration: r0 is configured) reads the fleet back: r1 from
    # the admin source, and r0 stays removed by the operator although it is still configured
    with RouterServer(a_settings) as again:
        again.wait_ready(1)
        assert ids(again) == {"r1"}
        assert routed_to(again, "after the restart") == "r1"
    # every router closed its registry connections (pub/sub included)
    wait_until(lambda: registry_clients(redis_admin) == 0, 10, "registry connections to close")


STREAM = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "a long story, please"}],
    "max_tokens": 64,
    "stream": True,
}


def test_drain_through_one_router_lets_the_other_routers_stream_finish(
    model_dir: Path, redis_server: RedisServer, sims: tuple[SimReplica, SimReplica]
) -> None:
    s0, s1 = sims
    by_id = {"r0": s0, "r1": s1}
    entries = [replica_entry("r0", s0), replica_entry("r1", s1)]
    with (
        RouterServer(shared(model_dir, redis_server.url, entries)) as a,
        RouterServer(shared(model_dir, redis_server.url, [], delete_wait_s=0.2)) as b,
    ):
        a.wait_ready(2)
        b.wait_ready(2)
        for s in sims:  # a stream long enough to still run when its engine is stalled
            s.set_faults(slow_factor=20)

        async def drain_during_stream() -> tuple[str, str | None]:
            url = f"{a.url}/v1/chat/completions"
            async with (
                httpx.AsyncClient(timeout=60) as client,
                client.stream("POST", url, json=STREAM) as resp,
            ):
                assert resp.status_code == 200
                victim = parse_decision_header(resp.headers["x-cp-decision"])["replica"]
                lines = resp.aiter_lines()
                async for line in lines:  # the first token arrived
                    if '"content"' in line:
                        break
                await asyncio.to_thread(during_the_drain, victim)
                finish = None
                async for line in lines:
                    if line.startswith("data: {"):
                        choices = json.loads(line[6:]).get("choices") or []
                        if choices and choices[0].get("finish_reason"):
                            finish = choices[0]["finish_reason"]
            return victim, finish

        def during_the_drain(victim: str) -> None:
            other = "r1" if victim == "r0" else "r0"
            sim = by_id[victim]
            # freeze the victim's engine mid-stream (/health still answers: not a failure)
            sim.set_faults(stall=True, lie_health=True)
            assert running_requests(sim) == 1  # the stream is in flight
            r = httpx.post(f"{b.url}/admin/replicas/{victim}/drain", headers=AUTH)
            assert r.status_code == 200
            wait_until(
                lambda: all(replica_status(rt)[victim]["phase"] == "draining" for rt in (a, b)),
                20,
                "both routers to drain the victim",
            )
            for rt in (a, b):  # nothing new goes to it, from either router
                assert routed_to(rt, f"during the drain via {rt.url}") == other
            # both routers published that they applied the drain; a's stream still holds it
            wait_until(lambda: applied_by_all(b, victim), 20, "both routers to apply the drain")
            assert record_state(b, victim) is Lifecycle.DRAINING
            assert victim in ids(a) and victim in ids(b)
            # DELETE cannot finish it while the stream runs: 202, still draining
            r = httpx.delete(f"{b.url}/admin/replicas/{victim}", headers=AUTH)
            assert r.status_code == 202 and r.json() == {"draining": victim}
            assert record_state(b, victim) is Lifecycle.DRAINING
            sim.set_faults(stall=False)  # the engine resumes: the stream finishes normally

        victim, finish = asyncio.run(drain_during_stream())
        assert finish == "length"
        wait_until(
            lambda: victim not in ids(a) and victim not in ids(b),
            20,
            "the drained replica to leave both routers",
        )
        assert record_state(a, victim) is Lifecycle.GONE
        assert_no_requests_left(a)


def assert_no_requests_left(router: RouterServer) -> None:
    wait_until(lambda: len(router.runtime.ledger) == 0, 10, "the ledger to empty")


def _snapshot(router: RouterServer) -> Any:
    return router.call(router.runtime.registry.load)


def record_state(router: RouterServer, replica_id: str) -> Lifecycle:
    state: Lifecycle = _snapshot(router).records[replica_id].state
    return state


def applied_by_all(router: RouterServer, replica_id: str) -> bool:
    snap = _snapshot(router)
    rec = snap.records[replica_id]
    return len(snap.observations) == 2 and all(o.version >= rec.version for o in snap.observations)


def ready_reasons(router: RouterServer) -> list[str]:
    reasons: list[str] = httpx.get(f"{router.url}/ready", timeout=5).json()["reasons"]
    return reasons


def test_redis_outage_keeps_the_fleet_and_recovers(
    model_dir: Path, redis_server: RedisServer, sims: tuple[SimReplica, SimReplica]
) -> None:
    s0, s1 = sims
    with RouterServer(shared(model_dir, redis_server.url, [replica_entry("r0", s0)])) as a:
        a.wait_ready(1)
        redis_server.stop()
        wait_until(
            lambda: any(r.startswith("fleet registry unreachable") for r in ready_reasons(a)),
            20,
            "the router to report the registry down",
        )
        assert ids(a) == {"r0"}  # the last known fleet is kept, and served
        assert routed_to(a, "while Redis is down") == "r0"
        # a fleet change cannot be made: a clear 503, nothing changed; the list still answers
        r = httpx.post(f"{a.url}/admin/replicas", json=replica_entry("r1", s1), headers=AUTH)
        assert r.status_code == 503 and r.json()["error"]["code"] == "registry_unavailable"
        r = httpx.post(f"{a.url}/admin/replicas/r0/drain", headers=AUTH)
        assert r.status_code == 503
        listed = httpx.get(f"{a.url}/admin/replicas", headers=AUTH).json()
        assert "unreachable" in listed["fleet_error"] and ids(a) == {"r0"}
        redis_server.start()  # empty: the static source reports again, the follower recovers
        wait_until(
            lambda: not any(r.startswith("fleet registry") for r in ready_reasons(a)),
            20,
            "the router to recover",
        )
        wait_until(lambda: record_ids(a) == ["r0"], 20, "the static source to report again")
        assert ids(a) == {"r0"}


def record_ids(router: RouterServer) -> list[str]:
    return list(_snapshot(router).records)


async def test_dns_source_adds_and_drains_replicas_of_a_fake_resolver(
    model_dir: Path, sims: tuple[SimReplica, SimReplica]
) -> None:
    s0, _ = sims
    port = int(s0.url.rsplit(":", 1)[1])
    answers = {"vllm.test": ["127.0.0.1"]}

    def resolve(name: str) -> list[str]:
        if name not in answers:
            raise OSError(f"{name}: no such name")
        return answers[name]

    settings = router_settings(
        model_dir,
        [],
        fleet={"dns_name": "vllm.test", "dns_port": port, "dns_interval_s": 0.1, "resync_s": 0.1},
        health={"scrape_interval_s": 0.2, "probe_interval_s": 0.2},
    )
    rt = RouterRuntime(settings, resolve=resolve)
    await rt.start()
    try:
        await _until(lambda: rt.fleet.ready_count() == 1, "the DNS replica to be ready")
        assert [r.replica_id for r in rt.fleet.replicas()] == ["dns-127-0-0-1"]
        dns = rt.sources[0]
        assert isinstance(dns, PollingSource) and dns.name == "dns"
        del answers["vllm.test"]  # resolution fails: the last view stands
        failed = dns.failures
        await _until(lambda: dns.failures >= failed + 2, "two failed DNS rounds")
        assert rt.fleet.ready_count() == 1
        assert (await rt.registry.load()).records["dns-127-0-0-1"].state is Lifecycle.LOADING
        answers["vllm.test"] = []  # the service has no endpoint any more
        await _until(lambda: not rt.fleet.replicas(), "the DNS replica to drain and leave")
        snap = await rt.registry.load()
        assert snap.records["dns-127-0-0-1"].state is Lifecycle.GONE
    finally:
        await rt.aclose()


async def _until(predicate: Any, what: str, timeout_s: float = 20.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.05)
    assert predicate(), what
