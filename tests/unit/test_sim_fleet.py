"""FleetSim (light): requests finish once, nothing leaks, the single-replica ceiling is exact."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from sim_builders import PoolGuard, check_scheduler

from controlplane.roofline.profile import profile
from controlplane.routing.policies import make_policy
from controlplane.sim.engine_index import EngineBackedIndex
from controlplane.sim.fleet import FleetConfig, FleetSim
from controlplane.sim.ids import dense_block_ids
from controlplane.sim.results import FleetResult
from controlplane.traces import infinite_cache_ceiling, load_trace, multi_turn, shared_prefix
from controlplane.traces.model import Trace


def small_trace() -> Trace:
    return shared_prefix(groups=4, users=4, prefix=600, question=150, output=40, rate=20.0, seed=7)


def session_trace() -> Trace:
    return multi_turn(
        sessions=30, turns=4, first=500, message=150, output=200, think=0.5, rate=5.0, seed=3
    )


def run_fleet(
    trace: Trace,
    *,
    policy: str = "prefix_affinity",
    replicas: int = 2,
    routers: int = 1,
    num_blocks: int = 400,
    fast_forward: bool = True,
    scrape_interval_s: float = 0.5,
    max_model_len: int = 0,
    kv_event_delay_s: float = 0.0,
) -> tuple[FleetSim, FleetResult]:
    prof = profile(
        "h100",
        "llama-3.1-8b",
        block_size=16,
        num_gpu_blocks_override=num_blocks,
        max_model_len=max_model_len,
    )
    cfg = FleetConfig(
        profile=prof,
        replicas=replicas,
        routers=routers,
        fast_forward=fast_forward,
        scrape_interval_s=scrape_interval_s,
        kv_event_delay_s=kv_event_delay_s,
    )
    sim = FleetSim(cfg, functools.partial(make_policy, policy))
    return sim, sim.run(trace)


def assert_clean(sim: FleetSim, result: FleetResult, trace: Trace) -> None:
    assert len(result.records) == len(trace)
    ids = [r.request_id for r in result.records]
    assert len(set(ids)) == len(ids)
    for rec in result.records:
        assert rec.completed, rec
        assert rec.arrival_s <= rec.first_token_s <= rec.finish_s
        assert 0 <= rec.cached_tokens < rec.prompt_tokens
    # every request was finished exactly once: a second finish would have failed to pop it
    assert sim._routing == {}
    for router in sim.routers:
        assert len(router.books.ledger) == 0, "leaked reservations"
    with PoolGuard() as guard:
        for rep in sim.replicas:
            assert rep.engine.idle
            guard.watch(rep.engine)
            check_scheduler(rep.engine.sched)
    tokens = sum(rec.output_tokens for rec in result.records)
    assert sum(s.tokens_out for s in result.replicas) == tokens


@pytest.mark.parametrize("kv_event_delay_s", [0.0, 0.01])
@pytest.mark.parametrize(
    ("policy", "routers", "num_blocks", "scrape"),
    [
        ("round_robin", 1, 400, 0.5),
        ("prefix_affinity", 1, 400, 0.5),
        ("prefix_affinity", 2, 120, 0.0),  # KV pressure: preemptions
        ("least_loaded", 2, 400, 0.1),
    ],
)
def test_two_replicas_finish_every_request_once(
    policy: str, routers: int, num_blocks: int, scrape: float, kv_event_delay_s: float
) -> None:
    trace = small_trace()
    sim, result = run_fleet(
        trace,
        policy=policy,
        routers=routers,
        num_blocks=num_blocks,
        scrape_interval_s=scrape,
        kv_event_delay_s=kv_event_delay_s,
    )
    assert_clean(sim, result, trace)
    assert {rec.replica for rec in result.records} == {"replica-0", "replica-1"}
    if kv_event_delay_s > 0:
        # delayed events need the event-fed index, and it was fed
        assert not isinstance(sim.index, EngineBackedIndex)
        assert result.kv_events_applied > 0
        assert sim.index.stored_total > 0
    else:
        # no delay: the index reads the engines' pools, no event is generated
        assert isinstance(sim.index, EngineBackedIndex)
        assert result.kv_events_applied == 0
    # either way the index knows what the replicas cached (all events are in by now; a set fed
    # by events forgets a block once one of two copies is evicted, the pool still has the other)
    block_ids, _ = dense_block_ids(trace, 16)
    found = 0
    for h in {int(ids[0]) for ids in block_ids}:
        indexed = set(sim.index.lookup([h], ["replica-0", "replica-1"]))
        held = {rep.rid for rep in sim.replicas if rep.engine.pool.cached_block(h) is not None}
        assert indexed == held if kv_event_delay_s == 0 else indexed <= held, h
        found += bool(indexed)
    assert found


def test_kv_pressure_case_preempts() -> None:
    trace = small_trace()
    sim, result = run_fleet(trace, routers=2, num_blocks=120, scrape_interval_s=0.0)
    assert sum(s.preemptions for s in result.replicas) > 0
    assert_clean(sim, result, trace)


@pytest.mark.parametrize("block_size", [16, 64])
def test_single_replica_unlimited_kv_reaches_the_infinite_cache_ceiling(block_size: int) -> None:
    trace = load_trace("mooncake-fixture")
    prof = profile(
        "h100",
        "llama-3.1-8b",
        block_size=block_size,
        num_gpu_blocks_override=4_000_000 // block_size,
        max_model_len=200_000,  # the fixture's longest request would be rejected at 128k
    )
    policy = functools.partial(make_policy, "round_robin")
    sim = FleetSim(FleetConfig(profile=prof, replicas=1), policy)
    result = sim.run(trace)
    assert_clean(sim, result, trace)
    ceiling = infinite_cache_ceiling(trace, block_size)
    assert ceiling.hit_tokens > 0
    assert sum(rec.cached_tokens for rec in result.records) == ceiling.hit_tokens
    (stats,) = result.replicas
    assert stats.prefix_hits == ceiling.hit_tokens
    assert stats.prefix_queries == ceiling.prompt_tokens
    assert stats.preemptions == 0


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded"])
def test_fast_forward_does_not_change_a_fleet_run(policy: str) -> None:
    """Policies that read neither the prefix index nor KV usage route identically."""
    trace = session_trace()
    results = [
        run_fleet(trace, policy=policy, num_blocks=300, fast_forward=ff)[1] for ff in (False, True)
    ]
    step, ff = results
    assert sum(s.preemptions for s in step.replicas) > 0
    for a, b in zip(step.records, ff.records, strict=True):
        assert (a.replica, a.cached_tokens, a.preemptions) == (
            b.replica,
            b.cached_tokens,
            b.preemptions,
        )
        assert b.finish_s == pytest.approx(a.finish_s, rel=1e-6)
        assert b.first_token_s == pytest.approx(a.first_token_s, rel=1e-6)
    assert [s.preemptions for s in step.replicas] == [s.preemptions for s in ff.replicas]
    assert [s.steps for s in step.replicas] == [s.steps for s in ff.replicas]


def test_fast_forward_does_not_change_index_driven_routing() -> None:
    trace = session_trace()
    step = run_fleet(trace, num_blocks=300, fast_forward=False)[1]
    ff = run_fleet(trace, num_blocks=300, fast_forward=True)[1]
    assert [r.replica for r in step.records] == [r.replica for r in ff.records]
    assert [r.cached_tokens for r in step.records] == [r.cached_tokens for r in ff.records]


def _outcomes(result: FleetResult) -> list[tuple[object, ...]]:
    return [
        (r.request_id, r.replica, r.cached_tokens, r.preemptions, r.first_token_s, r.finish_s)
        for r in result.records
    ]


@pytest.mark.parametrize("policy", ["prefix_affinity", "least_loaded"])
def test_run_with_precomputed_or_relabeled_block_ids(policy: str) -> None:
    """`run(block_ids=, id_floor=)` with `dense_block_ids` is the default run; any injective
    relabeling of the ids (the simulator only compares them) replays identically."""
    trace = session_trace()
    _, default = run_fleet(trace, policy=policy, num_blocks=300)
    block_ids, floor = dense_block_ids(trace, 16)
    seen: list[int] = []
    prof = profile("h100", "llama-3.1-8b", block_size=16, num_gpu_blocks_override=300)
    cfg = FleetConfig(profile=prof, replicas=2)
    sim = FleetSim(cfg, functools.partial(make_policy, policy))
    given = sim.run(trace, block_ids=block_ids, id_floor=floor, progress=seen.append)
    assert _outcomes(given) == _outcomes(default)
    assert seen == sorted(seen) and seen[-1] == len(trace)
    # a random permutation of [0, floor): same equalities, other values
    perm = np.random.default_rng(0).permutation(floor).astype(np.int64)
    relabeled = [perm[ids] for ids in block_ids]
    assert any(
        a.tolist() != b.tolist() for a, b in zip(block_ids, relabeled, strict=True) if len(a)
    )
    sim = FleetSim(cfg, functools.partial(make_policy, policy))
    moved = sim.run(trace, block_ids=relabeled, id_floor=floor)
    assert _outcomes(moved) == _outcomes(default)
    assert sum(r.cached_tokens for r in default.records) > 0


def test_preempted_readmissions_are_counted_apart() -> None:
    """Replica prefix stats count first admissions only (vLLM's exported counters)."""
    trace = session_trace()
    sim, result = run_fleet(trace, policy="round_robin", num_blocks=300)
    assert sum(s.preemptions for s in result.replicas) > 0
    queries = sum(rep.engine.sched.prefix_queries for rep in sim.replicas)
    assert queries == sum(r.prompt_tokens for r in trace.requests)
    assert sum(s.prefix_queries for s in result.replicas) == queries
    assert sum(rep.engine.sched.preempted_prefix_queries for rep in sim.replicas) > 0
    assert sum(s.prefix_hits for s in result.replicas) == sum(
        rec.cached_tokens for rec in result.records
    )
