"""This project's own policies: round_robin, least_loaded, prefix_affinity, predicted_finish.

Scenario tables: fleet + prefix matches + request -> expected replica and `DecisionReason`.
Loads are this router's ledger (`busy(tokens)`: tokens still to prefill) unless a row says
otherwise, so `controlplane.routing.load.outstanding_tokens` equals the number written in the row.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from policy_builders import (
    BLOCK,
    busy,
    fleet,
    make,
    matches,
    ready_fleet,
    replica,
    request,
    route,
)

from controlplane.errors import ConfigError
from controlplane.routing.load import outstanding_tokens
from controlplane.routing.policies.common import pick_tied, usable_hit_blocks
from controlplane.routing.policies.least_loaded import LeastLoaded
from controlplane.routing.policies.predicted_finish import PredictedFinish
from controlplane.routing.policies.prefix_affinity import PrefixAffinity
from controlplane.routing.policies.round_robin import RoundRobin
from controlplane.types import (
    DecisionReason,
    FleetSnapshot,
    Ledger,
    Phase,
    PrefixMatch,
    ReplicaState,
    RoutingRequest,
)

R = DecisionReason


@dataclass(frozen=True)
class Case:
    id: str
    snap: FleetSnapshot
    expect: str
    reason: DecisionReason
    found: Mapping[str, PrefixMatch] = field(default_factory=dict)
    req: RoutingRequest = field(default_factory=lambda: request("req", 1024))
    hit_blocks: int | None = None


def check(policy_name: str, case: Case, **params: object) -> None:
    d = make(policy_name, **params).choose(case.req, case.snap, case.found)
    assert (d.replica_id, d.reason) == (case.expect, case.reason)
    assert d.ranked[0] == case.expect
    if case.hit_blocks is not None:
        assert d.expected_hit_blocks == case.hit_blocks


# -- round_robin -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("n", "k"), [(1, 5), (3, 7), (5, 4), (12, 3)])
def test_round_robin_cycles_evenly_over_n_times_k_calls(n: int, k: int) -> None:
    snap = ready_fleet(n)
    policy = RoundRobin()
    seen = [route(policy, request(f"q{i}"), snap) for i in range(n * k)]
    counts = Counter(d.replica_id for d in seen)
    assert set(counts.values()) == {k}
    assert len(counts) == n
    assert all(d.reason is R.ROUND_ROBIN for d in seen)
    ordered = sorted(r.replica_id for r in snap.replicas)
    assert [d.replica_id for d in seen[:n]] == ordered
    # ranked is the rotation starting at the chosen replica
    assert seen[1].ranked == (*ordered[1:], *ordered[:1])


def test_round_robin_skips_unroutable_replicas_without_resetting() -> None:
    policy = RoundRobin()
    up = fleet(*(replica(f"r{i}") for i in range(5)))

    def with_(**changes: dict[str, object]) -> FleetSnapshot:
        return fleet(
            *(replica(r.replica_id, **changes.get(r.replica_id, {})) for r in up.replicas)  # type: ignore[arg-type]
        )

    steps: list[tuple[FleetSnapshot, str]] = [
        (up, "r0"),
        (up, "r1"),
        (with_(r2={"phase": Phase.DRAINING}), "r3"),  # r2 skipped
        (with_(r4={"ejected": True}), "r0"),  # r4 skipped, wraps, no reset to "r0 after r3"
        (with_(r1={"phase": Phase.DEAD}), "r2"),  # r1 skipped, r2 back
        (fleet(replica("r0"), replica("r4")), "r4"),  # r3 gone: next id greater than r2
        (up, "r0"),
        (with_(r1={"phase": Phase.LOADING}, r2={"phase": Phase.LOADING}), "r3"),
        (up, "r4"),
    ]
    for i, (snap, expect) in enumerate(steps):
        d = route(policy, request(f"q{i}"), snap)
        assert d.replica_id == expect, (i, d)
        assert set(d.ranked) == {r.replica_id for r in snap.replicas if r.routable}


def test_round_robin_choose_alone_does_not_advance() -> None:
    policy = RoundRobin()
    snap = ready_fleet(3)
    assert [policy.choose(request(f"q{i}"), snap, {}).replica_id for i in range(3)] == ["r0"] * 3


def test_round_robin_ignores_load_and_cache() -> None:
    snap = fleet(replica("r0", load=500_000), replica("r1"))
    d = RoundRobin().choose(request(), snap, matches(r1=50))
    assert (d.replica_id, d.reason, d.expected_hit_blocks) == ("r0", R.ROUND_ROBIN, 0)


# -- least_loaded ----------------------------------------------------------------------------------
LEAST_LOADED_CASES = [
    Case(
        "least_outstanding_tokens",
        fleet(replica("r0", load=5_000), replica("r1", load=1_000), replica("r2", load=3_000)),
        "r1",
        R.LEAST_LOADED,
    ),
    Case(
        "tokens_not_requests_ledger",
        # r0: one 30k-token document; r1: five 200-token chats
        fleet(replica("r0", ledger=busy(30_000)), replica("r1", ledger=busy(1_000, requests=5))),
        "r1",
        R.LEAST_LOADED,
    ),
    Case(
        "tokens_not_requests_metrics",
        # no ledger: r0's 2 waiting requests are valued 2 * (2048 + 256) = 4,608 tokens,
        # r1's 10 running ones 10 * 256 = 2,560: more requests, fewer tokens
        fleet(replica("r0", waiting=2), replica("r1", running=10)),
        "r1",
        R.LEAST_LOADED,
    ),
    Case(
        "ignores_prefix_matches",
        fleet(replica("r0", load=2_000), replica("r1", load=1_999)),
        "r1",
        R.LEAST_LOADED,
        found=matches(r0=60),
    ),
    Case(
        "ignores_kv_usage",
        fleet(replica("r0", load=100, kv_usage=0.99), replica("r1", load=200)),
        "r0",
        R.LEAST_LOADED,
    ),
    Case(
        "idle_beats_busy_unhealthy_skipped",
        fleet(
            replica("r0", phase=Phase.DRAINING),
            replica("r1", load=900),
            replica("r2", load=800, ejected=True),
        ),
        "r1",
        R.LEAST_LOADED,
    ),
]


@pytest.mark.parametrize("case", LEAST_LOADED_CASES, ids=lambda c: c.id)
def test_least_loaded_table(case: Case) -> None:
    check("least_loaded", case)


def test_least_loaded_scores_are_router_load_outstanding_tokens() -> None:
    snap = fleet(
        replica("r0", load=5_000, running=3, waiting=1),
        replica("r1", running=7, waiting=2, kv_usage=0.3),
        replica("r2", ledger=Ledger(requests=2, decoding=2, decode_tokens=600, context_tokens=9)),
    )
    d = LeastLoaded().choose(request(), snap, {})
    assert d.scores == {r.replica_id: outstanding_tokens(r) for r in snap.replicas}
    assert d.replica_id == min(d.scores, key=lambda rid: d.scores[rid])
    assert list(d.ranked) == sorted(d.scores, key=lambda rid: d.scores[rid])


# -- prefix_affinity -------------------------------------------------------------------------------
def long_req(blocks: int, rid: str = "req") -> RoutingRequest:
    """A prompt of `blocks` full blocks plus 8 tokens, so all `blocks` are usable hits."""
    return request(rid, blocks * BLOCK + 8)


PREFIX_AFFINITY_CASES = [
    Case(
        "longest_match_wins",
        ready_fleet(3),
        "r1",
        R.PREFIX_HIT,
        found=matches(r0=3, r1=8, r2=(5, 0)),
        req=long_req(10),
        hit_blocks=8,
    ),
    Case(
        "speculative_blocks_count",
        ready_fleet(2),
        "r1",
        R.PREFIX_HIT,
        found=matches(r0=4, r1=(9, 0)),
        req=long_req(10),
        hit_blocks=9,
    ),
    Case(
        "longest_match_even_if_busier",
        fleet(replica("r0", load=9_000), replica("r1")),
        "r0",
        R.PREFIX_HIT,
        found=matches(r0=6, r1=2),
        req=long_req(10),
        hit_blocks=6,
    ),
    Case(
        "equal_matches_tie_broken_by_load",
        fleet(replica("r0", load=3_000), replica("r1", load=1_000), replica("r2")),
        "r1",
        R.PREFIX_HIT,
        found=matches(r0=5, r1=5),
        req=long_req(10),
        hit_blocks=5,
    ),
    Case(
        "miss_goes_to_least_loaded",
        fleet(replica("r0", load=2_000), replica("r1", load=500), replica("r2", load=900)),
        "r1",
        R.MISS_LEAST_LOADED,
        req=long_req(10),
        hit_blocks=0,
    ),
    Case(
        "match_only_on_unroutable_replica_is_a_miss",
        fleet(replica("r0", phase=Phase.DRAINING), replica("r1", load=10), replica("r2")),
        "r2",
        R.MISS_LEAST_LOADED,
        found=matches(r0=9),
        req=long_req(10),
        hit_blocks=0,
    ),
    Case(
        "one_block_match_is_a_hit_at_the_default_minimum",
        fleet(replica("r0", load=10), replica("r1")),
        "r0",
        R.PREFIX_HIT,
        found=matches(r0=1),
        req=long_req(10),
        hit_blocks=1,
    ),
    Case(
        "overloaded_preferred_replica_overrides",
        # gap 40,000 > max(16,384, 2 * 10 * 16) -> least loaded
        fleet(replica("r0", load=40_000), replica("r1", load=0), replica("r2", load=100)),
        "r1",
        R.LOAD_OVERRIDE,
        found=matches(r0=10),
        req=long_req(10),
        hit_blocks=0,
    ),
    Case(
        "override_reports_the_least_loaded_replicas_own_hit",
        fleet(replica("r0", load=40_000), replica("r1")),
        "r1",
        R.LOAD_OVERRIDE,
        found=matches(r0=10, r1=3),
        req=long_req(10),
        hit_blocks=3,
    ),
    Case(
        "gap_at_the_absolute_threshold_keeps_affinity",
        fleet(replica("r0", load=16_384), replica("r1")),
        "r0",
        R.PREFIX_HIT,
        found=matches(r0=10),
        req=long_req(10),
    ),
    Case(
        "gap_just_above_the_absolute_threshold_overrides",
        fleet(replica("r0", load=16_385), replica("r1")),
        "r1",
        R.LOAD_OVERRIDE,
        found=matches(r0=10),
        req=long_req(10),
    ),
    Case(
        "long_match_is_worth_waiting_for",
        # 1,500 blocks save 24,000 tokens: credit 48,000 > gap 40,000
        fleet(replica("r0", load=40_000), replica("r1")),
        "r0",
        R.PREFIX_HIT,
        found=matches(r0=1_500),
        req=long_req(1_600),
        hit_blocks=1_500,
    ),
    Case(
        "long_match_not_worth_an_even_longer_queue",
        fleet(replica("r0", load=48_001), replica("r1")),
        "r1",
        R.LOAD_OVERRIDE,
        found=matches(r0=1_500),
        req=long_req(1_600),
    ),
    Case(
        "hot_replica_elsewhere_does_not_disable_affinity",
        fleet(replica("r0"), replica("r1"), replica("r2", load=1_000_000)),
        "r0",
        R.PREFIX_HIT,
        found=matches(r0=4),
        req=long_req(10),
        hit_blocks=4,
    ),
    Case(
        "gate_compares_preferred_with_least_not_fleet_spread",
        # fleet spread is 1,000,000 but the preferred replica is only 10,000 above the least
        fleet(replica("r0", load=10_000), replica("r1"), replica("r2", load=1_000_000)),
        "r0",
        R.PREFIX_HIT,
        found=matches(r0=4),
        req=long_req(10),
    ),
    Case(
        "usable_hit_cap_whole_prompt_counts_k_minus_1_blocks",
        # N = 10 * 16 tokens: a 10-block match is worth (N - 1) // 16 = 9 blocks, like r1's 9;
        # equal usable hits -> the less loaded r1
        fleet(replica("r0", load=500), replica("r1")),
        "r1",
        R.PREFIX_HIT,
        found=matches(r0=10, r1=9),
        req=request("req", 10 * BLOCK),
        hit_blocks=9,
    ),
    Case(
        "single_block_prompt_fully_matched_is_a_miss",
        # N = 16: (16 - 1) // 16 = 0 usable blocks; vLLM recomputes the last token
        fleet(replica("r0", load=500), replica("r1")),
        "r1",
        R.MISS_LEAST_LOADED,
        found=matches(r0=1),
        req=request("req", BLOCK),
        hit_blocks=0,
    ),
]


@pytest.mark.parametrize("case", PREFIX_AFFINITY_CASES, ids=lambda c: c.id)
def test_prefix_affinity_table(case: Case) -> None:
    check("prefix_affinity", case)


@pytest.mark.parametrize(
    ("params", "loads", "expect", "reason"),
    [
        # r0 holds 4 usable blocks (64 tokens saved, credit 2 * 64 = 128 tokens)
        ({}, (2_000, 0), "r0", R.PREFIX_HIT),
        ({"imbalance_abs_tokens": 1_000.0}, (2_000, 0), "r1", R.LOAD_OVERRIDE),
        ({"imbalance_abs_tokens": 1_000.0, "credit_factor": 40.0}, (2_000, 0), "r0", R.PREFIX_HIT),
        (
            {"imbalance_abs_tokens": 1_000.0, "credit_factor": 40.0},
            (2_561, 0),
            "r1",
            R.LOAD_OVERRIDE,
        ),
        ({"min_match_blocks": 5}, (10, 0), "r1", R.MISS_LEAST_LOADED),
        ({"min_match_blocks": 4}, (10, 0), "r0", R.PREFIX_HIT),
    ],
    ids=[
        "defaults",
        "small_abs_threshold",
        "credit_covers_gap",
        "gap_exceeds_credit",
        "min_match_5",
        "min_match_4",
    ],
)
def test_prefix_affinity_parameters(
    params: dict[str, float], loads: tuple[int, int], expect: str, reason: DecisionReason
) -> None:
    snap = fleet(replica("r0", load=loads[0]), replica("r1", load=loads[1]))
    d = PrefixAffinity(**params).choose(long_req(10), snap, matches(r0=4))  # type: ignore[arg-type]
    assert (d.replica_id, d.reason) == (expect, reason)


def test_prefix_affinity_override_is_judged_per_request() -> None:
    """One hot replica overrides only the requests whose prefix lives there."""
    snap = fleet(replica("r0", load=60_000), replica("r1"), replica("r2"))
    policy = PrefixAffinity()
    on_hot = policy.choose(long_req(10, "a"), snap, matches(r0=10))
    on_cool = policy.choose(long_req(10, "b"), snap, matches(r2=10))
    assert (on_hot.reason, on_cool.reason) == (R.LOAD_OVERRIDE, R.PREFIX_HIT)
    assert on_hot.replica_id in {"r1", "r2"}
    assert on_cool.replica_id == "r2"


def test_prefix_affinity_ranked_starts_with_preferred_then_by_load() -> None:
    snap = fleet(replica("r0", load=300), replica("r1", load=100), replica("r2", load=200))
    d = PrefixAffinity().choose(long_req(10), snap, matches(r0=5))
    assert d.ranked == ("r0", "r1", "r2")
    assert d.scores == {"r0": 300.0, "r1": 100.0, "r2": 200.0}


def test_prefix_affinity_equal_matches_and_loads_spread_by_request_id() -> None:
    snap = ready_fleet(3)
    found = matches(r0=5, r1=5)
    chosen = {
        PrefixAffinity().choose(long_req(10, f"t{i}"), snap, found).replica_id for i in range(40)
    }
    assert chosen == {"r0", "r1"}


def test_prefix_affinity_rejects_min_match_below_one() -> None:
    with pytest.raises(ConfigError, match="min_match_blocks"):
        PrefixAffinity(min_match_blocks=0)


@settings(max_examples=200, deadline=None)
@given(
    k=st.integers(1, 400),
    extra=st.integers(0, BLOCK - 1),
    matched=st.integers(0, 500),
    bs=st.sampled_from([16, 32, 64]),
)
def test_usable_hit_blocks_is_the_n_minus_1_over_b_cap(
    k: int, extra: int, matched: int, bs: int
) -> None:
    n = k * bs + extra
    req = request("cap", n, blocks=())
    usable = usable_hit_blocks(req, matched, bs)
    assert usable == min(matched, (n - 1) // bs)
    if extra == 0 and matched >= k:
        assert usable == k - 1  # a match covering the whole prompt of N = k*B counts k-1 blocks


# -- predicted_finish ------------------------------------------------------------------------------
PREDICTED_FINISH_CASES = [
    Case(
        "cached_replica_wins_when_loads_are_equal",
        fleet(replica("r0", load=4_000), replica("r1", load=4_000), replica("r2", load=4_000)),
        "r1",
        R.PREDICTED_FINISH,
        found=matches(r1=100, r2=20),
        req=long_req(200),
        hit_blocks=100,
    ),
    Case(
        "idle_replica_beats_heavily_queued_short_match",
        fleet(replica("r0"), replica("r1", load=200_000)),
        "r0",
        R.PREDICTED_FINISH,
        found=matches(r1=2),
        req=long_req(100),
        hit_blocks=0,
    ),
    Case(
        "long_cached_prefix_beats_short_queue",
        # a 30k-token document cached on r0 vs recomputing it on an idle r1
        fleet(replica("r0", load=1_000), replica("r1")),
        "r0",
        R.PREDICTED_FINISH,
        found=matches(r0=1_900),
        req=long_req(1_900),
        hit_blocks=1_900,
    ),
    Case(
        "expected_hit_is_capped_at_n_minus_1_over_b",
        ready_fleet(2),
        "r0",
        R.PREDICTED_FINISH,
        found=matches(r0=10),
        req=request("req", 10 * BLOCK),
        hit_blocks=9,
    ),
    Case(
        "less_decode_work_wins_without_cache",
        fleet(
            replica(
                "r0",
                ledger=Ledger(
                    requests=50, decoding=50, decode_tokens=20_000, context_tokens=100_000
                ),
            ),
            replica(
                "r1", ledger=Ledger(requests=2, decoding=2, decode_tokens=300, context_tokens=2_000)
            ),
        ),
        "r1",
        R.PREDICTED_FINISH,
        req=long_req(20),
    ),
]


@pytest.mark.parametrize("case", PREDICTED_FINISH_CASES, ids=lambda c: c.id)
def test_predicted_finish_table(case: Case) -> None:
    check("predicted_finish", case)


def ttft(req: RoutingRequest, rep: ReplicaState, matched: int = 0) -> float:
    """Predicted TTFT on one replica, read through the public policy: the slope of the score in
    `ttft_weight` (the score is `ttft_weight * TTFT + terms that do not depend on it`)."""
    snap = fleet(rep)
    found = matches(**{rep.replica_id: matched}) if matched else {}
    one = PredictedFinish(ttft_weight=1.0).choose(req, snap, found).scores[rep.replica_id]
    two = PredictedFinish(ttft_weight=2.0).choose(req, snap, found).scores[rep.replica_id]
    return two - one


def test_predicted_finish_scores_rank_and_are_linear_in_ttft_weight() -> None:
    snap = fleet(replica("r0", load=3_000), replica("r1", running=4, kv_usage=0.2), replica("r2"))
    req = request("s", 2_000, predicted_output=200)
    found = matches(r1=50)
    by_weight = {
        w: PredictedFinish(ttft_weight=w).choose(req, snap, found) for w in (1.0, 2.0, 3.0)
    }
    for d in by_weight.values():
        assert d.replica_id == min(d.scores, key=lambda rid: d.scores[rid])
        assert list(d.ranked) == sorted(d.scores, key=lambda rid: (d.scores[rid], rid))
        assert all(v > 0 for v in d.scores.values())
    for rid in d.scores:
        s1, s2, s3 = (by_weight[w].scores[rid] for w in (1.0, 2.0, 3.0))
        assert s2 - s1 > 0
        assert s3 - s1 == pytest.approx(2 * (s2 - s1))


def test_predicted_finish_ttft_grows_with_queue_and_shrinks_with_cache() -> None:
    req = long_req(200)
    by_queue = [ttft(req, replica("r", load=q)) for q in (0, 5_000, 50_000)]
    assert by_queue == sorted(by_queue) and by_queue[0] < by_queue[-1]
    by_hit = [ttft(req, replica("r"), h) for h in (0, 50, 150, 199)]
    assert by_hit == sorted(by_hit, reverse=True) and by_hit[0] > by_hit[-1]


def test_predicted_finish_equal_replicas_tie_on_request_hash() -> None:
    snap = ready_fleet(3)
    tied = ["r0", "r1", "r2"]
    for i in range(20):
        req = request(f"q{i}", 700)
        assert PredictedFinish().choose(req, snap, {}).replica_id == pick_tied(req, tied)
