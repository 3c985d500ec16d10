"""Drift behind a live router, on simulated replicas (vLLM's HTTP protocol): three replicas of
one model, `d2` started with block size 64 where the other two use 32. The majority's
configuration is the group's: `d2` is reported (admin view, metric), stays routable and is kept
out of prefix affinity; a match on a replica of the majority still wins."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from router_fixtures import (
    MODEL,
    assert_router_idle,
    finished_requests,
    metric_value,
    replica_entry,
    router_settings,
    scrape,
    sim_args,
)
from router_harness import RouterServer
from sim_fleet import SimReplica, sim_replicas

from controlplane.tenancy.model import DEFAULT_TENANT
from controlplane.types import DecisionReason
from deploy.tiny_model import make_tiny_model
from router.http.openai_api import CompletionRequest

pytestmark = pytest.mark.timeout(120)

ADMIN = "drift-admin-key"
BLOCKS = {"d1": 32, "d2": 64, "d3": 32}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model(path)
    return path


@pytest.fixture(scope="module")
def sims(model_dir: Path) -> Iterator[dict[str, SimReplica]]:
    reps = {
        rid: SimReplica(*sim_args(model_dir, speed=20.0), "--block-size", str(bs))
        for rid, bs in BLOCKS.items()
    }
    with sim_replicas(reps):
        yield reps


@pytest.fixture(scope="module")
def router(model_dir: Path, sims: dict[str, SimReplica]) -> Iterator[RouterServer]:
    entries = [replica_entry(rid, s) for rid, s in sims.items()]
    with RouterServer(router_settings(model_dir, entries, admin_key=ADMIN)) as server:
        server.wait_ready(3)
        yield server


def test_drift_is_reported_in_the_admin_view_and_the_metric(router: RouterServer) -> None:
    resp = httpx.get(f"{router.url}/admin/replicas", headers={"Authorization": f"Bearer {ADMIN}"})
    rows = {r["id"]: r for r in resp.json()["replicas"]}
    assert {rid: r["drift"] for rid, r in rows.items()} == {
        "d1": [],
        "d2": ["block_size"],
        "d3": [],
    }
    assert all(r["routable"] for r in rows.values())
    assert rows["d2"]["description"]["block_size"] == 64
    resp = httpx.get(f"{router.url}/admin/models", headers={"Authorization": f"Bearer {ADMIN}"})
    (group,) = resp.json()["models"]
    assert (group["model"], group["members"], group["block_size"]) == (
        MODEL,
        ["d1", "d2", "d3"],
        32,
    )
    assert group["drifted"] == {"d2": ["block_size"]}
    assert group["reference"]["block_size"] == 32
    assert httpx.get(f"{router.url}/admin/models").status_code == 401
    text = scrape(router.url)
    assert (
        metric_value(text, "cp_replica_drift", model=MODEL, replica="d2", field="block_size") == 1
    )
    assert metric_value(text, "cp_replica_drift", replica="d1") == 0
    assert metric_value(text, "cp_replica_described") == 3


@pytest.mark.parametrize(("holder", "wins"), [("d1", True), ("d3", True), ("d2", False)])
def test_a_drifted_replicas_prefix_match_is_scored_as_a_miss(
    router: RouterServer, holder: str, wins: bool
) -> None:
    rt = router.runtime

    async def route() -> tuple[str, DecisionReason]:
        body = CompletionRequest(model=MODEL, prompt="shared prefix " * 64, max_tokens=2)
        req = await rt.core.build(
            body, request_id=f"t-{holder}", tenant=DEFAULT_TENANT, session=None
        )
        await rt.index.speculate(holder, req.block_hashes, 60.0)
        try:
            routed = await rt.core.route(req)
            rt.core.finish(routed, 0)
        finally:
            await rt.index.clear(holder)
        return routed.replica_id, routed.decision.reason

    replica, reason = router.call(route)
    if wins:
        assert (replica, reason) == (holder, DecisionReason.PREFIX_HIT)
    else:
        assert reason is not DecisionReason.PREFIX_HIT
    assert_router_idle(router)


def test_the_drifted_replica_still_serves(
    router: RouterServer, sims: dict[str, SimReplica]
) -> None:
    """Last in the module: it drains the two others, so only the drifted one is left to route to."""
    rt = router.runtime
    for rid in ("d1", "d3"):
        router.call(lambda rid=rid: rt.fleet.drain(rid))
    before = finished_requests(sims["d2"])
    with httpx.Client(base_url=router.url, timeout=60.0) as http:
        for i in range(3):
            resp = http.post(
                "/v1/completions", json={"model": MODEL, "prompt": f"load {i}", "max_tokens": 2}
            )
            assert resp.status_code == 200, resp.text
    assert finished_requests(sims["d2"]) == before + 3
    assert_router_idle(router)
