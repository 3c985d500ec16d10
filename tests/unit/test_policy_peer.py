"""Peer baselines: sglang_cache_aware, dynamo_kv_cost, llm_d_weighted.

Each keeps its own state from the router's decisions; tests prime it through the hooks
(`on_routed`, `on_first_token`, `on_finished`), exactly as the router and simulator do.
"""

from __future__ import annotations

import pytest
from policy_builders import (
    BLOCK,
    chain,
    fleet,
    matches,
    ready_fleet,
    replica,
    request,
    route,
    routed_to,
)

from controlplane.roofline.profile import profile
from controlplane.routing.policies.common import pick_tied
from controlplane.routing.policies.dynamo_kv_cost import DynamoKvCost
from controlplane.routing.policies.llm_d_weighted import MAX_HASHED_BLOCKS, LlmDWeighted
from controlplane.routing.policies.sglang_cache_aware import SglangCacheAware
from controlplane.types import Decision, DecisionReason, FleetSnapshot, RoutingRequest

R = DecisionReason
H = chain(10, seed=1)  # the shared prefix most tests route


def req_with(blocks: tuple[int, ...], rid: str = "req", arrival_s: float = 0.0) -> RoutingRequest:
    return request(rid, len(blocks) * BLOCK + 8, blocks=blocks, arrival_s=arrival_s)


def partial(k: int, n: int = 10) -> tuple[int, ...]:
    """The first k blocks of H followed by n - k blocks nobody holds."""
    return H[:k] + chain(n - k, seed=99)


# -- sglang_cache_aware ---------------------------------------------------------------------------
def sglang_with(
    inflight: dict[str, int], trees: dict[str, tuple[int, ...]], **params: float
) -> SglangCacheAware:
    policy = SglangCacheAware(**params)  # type: ignore[arg-type]
    for rid, blocks in trees.items():
        routed_to(policy, req_with(blocks, f"tree-{rid}"), rid)
        policy.on_finished(req_with(blocks, f"tree-{rid}"), rid)
    for rid, n in inflight.items():
        for i in range(n):
            routed_to(policy, req_with((), f"load-{rid}-{i}"), rid)
    return policy


@pytest.mark.parametrize(
    ("inflight", "trees", "query", "params", "expect", "reason"),
    [
        ({}, {"r0": H}, H, {}, {"r0"}, R.CACHE_MATCH),
        ({}, {"r0": H}, partial(4), {}, {"r0"}, R.CACHE_MATCH),  # 0.4 > 0.3
        ({}, {"r0": H}, partial(3), {}, {"r1", "r2"}, R.SMALLEST_TREE),  # 0.3 is not > 0.3
        ({}, {"r0": H}, partial(3), {"cache_threshold": 0.25}, {"r0"}, R.CACHE_MATCH),
        ({}, {"r0": H}, partial(9), {"cache_threshold": 0.95}, {"r1", "r2"}, R.SMALLEST_TREE),
        ({}, {}, H, {}, {"r0", "r1", "r2"}, R.SMALLEST_TREE),
        ({}, {"r0": H, "r1": H[:3], "r2": chain(20, 5)}, chain(10, 7), {}, {"r1"}, R.SMALLEST_TREE),
        # the smallest-tree fallback ignores compute load (within the balance band)
        (
            {"r1": 60},
            {"r0": H, "r1": H[:3], "r2": chain(20, 5)},
            chain(10, 7),
            {},
            {"r1"},
            R.SMALLEST_TREE,
        ),
        # longest match among several holders
        ({}, {"r0": H[:5], "r1": H}, H, {}, {"r1"}, R.CACHE_MATCH),
        # balanced at an absolute gap of exactly 64
        ({"r0": 64}, {"r0": H}, H, {}, {"r0"}, R.CACHE_MATCH),
        # imbalanced: 65 - 0 > 64 and 65 > 1.5 * 0 -> least loaded, the cache is ignored
        ({"r0": 65}, {"r0": H}, H, {}, {"r1", "r2"}, R.IMBALANCED),
        # the relative rule: 200 - 100 > 64 and 200 > 150
        ({"r0": 200, "r1": 100, "r2": 150}, {"r0": H}, H, {}, {"r1"}, R.IMBALANCED),
        # 400 - 300 > 64 but 400 < 1.5 * 300: balanced
        ({"r0": 400, "r1": 300, "r2": 300}, {"r0": H}, H, {}, {"r0"}, R.CACHE_MATCH),
        # fleet-wide gate: a hot r2 turns off the cache for a request whose prefix is on idle r0
        ({"r1": 1, "r2": 70}, {"r0": H}, H, {}, {"r0"}, R.IMBALANCED),
        ({"r0": 1, "r2": 70}, {"r0": H}, H, {}, {"r1"}, R.IMBALANCED),
    ],
    ids=[
        "full_match",
        "rate_0.4_above_threshold",
        "rate_0.3_at_threshold_falls_back",
        "lower_threshold",
        "higher_threshold",
        "fresh_policy_smallest_tree_tie",
        "miss_goes_to_smallest_tree",
        "smallest_tree_ignores_inflight",
        "longest_match_wins",
        "abs_gap_64_balanced",
        "abs_gap_65_imbalanced",
        "relative_rule_imbalanced",
        "relative_rule_balanced",
        "hot_replica_elsewhere_gates_fleet_wide",
        "imbalanced_picks_min_load_even_if_cached_elsewhere",
    ],
)
def test_sglang_cache_aware_table(
    inflight: dict[str, int],
    trees: dict[str, tuple[int, ...]],
    query: tuple[int, ...],
    params: dict[str, float],
    expect: set[str],
    reason: DecisionReason,
) -> None:
    policy = sglang_with(inflight, trees, **params)
    d = policy.choose(req_with(query), ready_fleet(3), {})
    assert d.replica_id in expect
    assert d.reason is reason
    if reason is R.CACHE_MATCH:
        assert d.expected_hit_blocks == sum(1 for a, b in zip(query, H, strict=False) if a == b)


def test_sglang_ignores_the_prefix_index_and_scraped_metrics() -> None:
    policy = sglang_with({}, {"r1": H})
    snap = fleet(replica("r0"), replica("r1", load=500_000, waiting=300, kv_usage=1.0))
    d = policy.choose(req_with(H), snap, matches(r0=10))
    assert (d.replica_id, d.reason) == ("r1", R.CACHE_MATCH)
    assert d.scores == {"r0": 0.0, "r1": 0.0}  # scores are its in-flight counts


def test_sglang_inflight_counts_follow_the_hooks() -> None:
    policy = SglangCacheAware()
    snap = ready_fleet(2)
    reqs = [req_with((), f"q{i}") for i in range(70)]
    for q in reqs:
        routed_to(policy, q, "r0")
    assert policy.choose(req_with(H), snap, {}).reason is R.IMBALANCED
    for q in reqs[:10]:
        policy.on_finished(q, "r0")
    d = policy.choose(req_with(H), snap, {})
    assert d.reason is R.SMALLEST_TREE
    assert d.scores == {"r0": 60.0, "r1": 0.0}


def test_sglang_chosen_tree_receives_the_request_either_way() -> None:
    policy = SglangCacheAware()
    snap = ready_fleet(2)
    first = route(policy, req_with(H, "a"), snap)
    assert first.reason is R.SMALLEST_TREE
    again = policy.choose(req_with(H, "b"), snap, {})
    assert (again.replica_id, again.reason, again.expected_hit_blocks) == (
        first.replica_id,
        R.CACHE_MATCH,
        10,
    )


def test_sglang_eviction_keeps_the_most_recent_blocks_per_interval() -> None:
    policy = SglangCacheAware(eviction_interval_s=10.0, max_tree_blocks=5)
    snap = ready_fleet(2)
    old, new = chain(8, seed=20), chain(4, seed=21)
    routed_to(policy, req_with(old, "old", arrival_s=0.0), "r0")
    routed_to(policy, req_with(new, "new", arrival_s=1.0), "r0")
    # before the interval has passed, nothing is trimmed
    assert policy.choose(req_with(old), snap, {}).expected_hit_blocks == 8
    routed_to(policy, req_with(chain(1, seed=22), "tick", arrival_s=10.0), "r1")
    # r0 held 12 blocks; trimmed to its 5 most recent: all of `new` and the tail of `old`
    gone = policy.choose(req_with(old), snap, {})
    assert gone.reason is R.SMALLEST_TREE
    kept = policy.choose(req_with(new), snap, {})
    assert (kept.replica_id, kept.reason, kept.expected_hit_blocks) == ("r0", R.CACHE_MATCH, 4)


# -- dynamo_kv_cost --------------------------------------------------------------------------------
def dynamo_with_active(
    decode_blocks: dict[str, int], prefill_blocks: dict[str, int]
) -> DynamoKvCost:
    """Drive the hooks so each worker carries the given active prefill and decode blocks."""
    policy = DynamoKvCost()
    for rid, n in decode_blocks.items():
        # exactly n blocks of prompt: dynamo accounts ceil(prompt_tokens / B) blocks
        q = request(f"dec-{rid}", n * BLOCK, blocks=chain(n, seed=sum(map(ord, rid))))
        routed_to(policy, q, rid)
        policy.on_first_token(q, rid)  # prompt blocks leave prefill, stay active
    for rid, n in prefill_blocks.items():
        q = request(f"pre-{rid}", n * BLOCK, blocks=chain(n, seed=7))
        routed_to(policy, q, rid)  # prefill and active
    return policy


def test_dynamo_worked_example_from_the_docs() -> None:
    """anchors.md §1.5: request of 10 blocks, overlaps 2/5/8, decode 10/5/9 -> 18/10/11 -> worker 2.

    The doc's "decode 10/5/9" is the whole decode term; the documented formula (and this
    implementation) also add the incoming request's own blocks to every worker's decode term,
    `decode_blocks = active_decode_blocks + ceil(isl / B)`, and no non-negative active-block count
    can make worker 2's decode term 5 once 10 incoming blocks are added. So the example is driven
    with active decode blocks 10/5/9 (via on_routed + on_first_token, zero active prefill), which
    yields the doc's costs plus the same 10 incoming blocks on every worker: 28/20/21, worker 2.
    """
    policy = dynamo_with_active({"w1": 10, "w2": 5, "w3": 9}, {})
    snap = fleet(replica("w1"), replica("w2"), replica("w3"))
    q = request("example", 10 * BLOCK, blocks=chain(10, seed=3))
    d = policy.choose(q, snap, matches(w1=2, w2=5, w3=8))
    incoming = 10
    assert {rid: c - incoming for rid, c in d.scores.items()} == {"w1": 18, "w2": 10, "w3": 11}
    assert (d.replica_id, d.reason, d.ranked) == ("w2", R.KV_COST, ("w2", "w3", "w1"))
    assert d.expected_hit_blocks == 5


@pytest.mark.parametrize(
    ("decode", "prefill", "found", "expect_costs"),
    [
        # fresh: cost = (blocks - overlap) + blocks; prompt 10 blocks
        ({}, {}, {}, {"w1": 20, "w2": 20}),
        ({}, {}, {"w1": 4}, {"w1": 16, "w2": 20}),
        # speculative blocks earn no credit (events only)
        ({}, {}, {"w1": (8, 0), "w2": (8, 3)}, {"w1": 20, "w2": 17}),
        # active prefill counts twice (prefill term and decode term), decode once
        ({"w1": 6}, {"w2": 3}, {}, {"w1": 26, "w2": 26}),
        # overlap cannot push the prefill term below zero
        ({}, {}, {"w1": 12}, {"w1": 10, "w2": 20}),
    ],
    ids=["fresh", "overlap_credit", "confirmed_only", "active_blocks", "clamped_at_zero"],
)
def test_dynamo_costs(
    decode: dict[str, int],
    prefill: dict[str, int],
    found: dict[str, int | tuple[int, int]],
    expect_costs: dict[str, float],
) -> None:
    policy = dynamo_with_active(decode, prefill)
    snap = fleet(replica("w1"), replica("w2"))
    d = policy.choose(request("q", 10 * BLOCK, blocks=chain(10, 3)), snap, matches(**found))
    assert d.scores == expect_costs
    assert d.reason is R.KV_COST
    best = min(expect_costs.values())
    assert expect_costs[d.replica_id or ""] == best


def test_dynamo_parameters_scale_prefill_and_credit() -> None:
    snap = fleet(replica("w1"), replica("w2"))
    q = request("q", 10 * BLOCK, blocks=chain(10, 3))
    found = matches(w1=4)
    assert DynamoKvCost(prefill_load_scale=2.0).choose(q, snap, found).scores == {
        "w1": 22,
        "w2": 30,
    }
    assert DynamoKvCost(overlap_credit=0.5).choose(q, snap, found).scores == {"w1": 18, "w2": 20}


def test_dynamo_ties_go_to_lowest_kv_usage_then_request_hash() -> None:
    snap = fleet(
        replica("w1", kv_usage=0.5), replica("w2", kv_usage=0.1), replica("w3", kv_usage=0.1)
    )
    for i in range(20):
        q = request(f"t{i}", 10 * BLOCK, blocks=chain(10, 3))
        d = DynamoKvCost().choose(q, snap, {})
        assert d.replica_id == pick_tied(q, ["w2", "w3"])


def test_dynamo_hooks_add_at_routing_drop_prefill_at_first_token_free_at_finish() -> None:
    policy = DynamoKvCost()
    snap = fleet(replica("w1"), replica("w2"))
    probe = request("probe", 10 * BLOCK, blocks=chain(10, 3))
    fresh = policy.choose(probe, snap, {}).scores
    q = request("q", 6 * BLOCK, blocks=chain(6, 4))
    policy.on_routed(q, Decision("w1", R.KV_COST, ("w1", "w2")), snap)
    assert policy.choose(probe, snap, {}).scores == {"w1": 32, "w2": 20}
    policy.on_first_token(q, "w1")
    policy.on_first_token(q, "w1")  # once only
    assert policy.choose(probe, snap, {}).scores == {"w1": 26, "w2": 20}
    policy.on_finished(q, "w1")
    policy.on_finished(q, "w1")  # once only
    assert policy.choose(probe, snap, {}).scores == fresh
    # a request finished before its first token frees both terms
    policy.on_routed(q, Decision("w2", R.KV_COST, ("w2", "w1")), snap)
    policy.on_finished(q, "w2")
    assert policy.choose(probe, snap, {}).scores == fresh


@pytest.mark.parametrize(
    ("prompt_tokens", "hashes"),
    [(4_000, ()), (100, chain(6, 4))],
    ids=["no_block_hashes", "partial_last_block"],
)
def test_dynamo_routing_adds_the_blocks_choose_charges(
    prompt_tokens: int, hashes: tuple[int, ...]
) -> None:
    policy = DynamoKvCost()
    snap = fleet(replica("w1"), replica("w2"))
    probe = request("probe", 10 * BLOCK, blocks=chain(10, 3))
    q = request("q", prompt_tokens, blocks=hashes)
    incoming = -(-prompt_tokens // BLOCK)  # what choose charged this request on every worker
    assert policy.choose(q, snap, {}).scores["w1"] == 2 * incoming
    policy.on_routed(q, Decision("w1", R.KV_COST, ("w1", "w2")), snap)
    after = policy.choose(probe, snap, {}).scores
    assert after["w1"] - after["w2"] == 2 * incoming  # active prefill + active decode blocks


# -- llm_d_weighted -------------------------------------------------------------------------------
def llmd_snapshot() -> FleetSnapshot:
    return fleet(
        replica("r0", waiting=0, kv_usage=0.2),
        replica("r1", waiting=5, kv_usage=0.5),
        replica("r2", waiting=10, kv_usage=0.9),
    )


def llmd_with(
    snap: FleetSnapshot, holders: dict[str, tuple[int, ...]], **weights: float
) -> LlmDWeighted:
    policy = LlmDWeighted(**weights)
    for rid, blocks in holders.items():
        policy.choose(req_with(blocks, f"seen-{rid}"), snap, {})  # learns LRU capacities
        routed_to(policy, req_with(blocks, f"prime-{rid}"), rid)
    return policy


def test_llm_d_scorer_math_with_default_weights() -> None:
    snap = llmd_snapshot()
    policy = llmd_with(snap, {"r1": H, "r2": H[:5]})
    d = policy.choose(req_with(H), snap, {})
    # queue (max-q)/(max-min): 1, .5, 0;  kv 1-usage: .8, .5, .1;  prefix: 0, 10/10, 5/10
    expect = {
        "r0": 2 * 1.0 + 2 * 0.8 + 3 * 0.0,
        "r1": 2 * 0.5 + 2 * 0.5 + 3 * 1.0,
        "r2": 2 * 0.0 + 2 * 0.1 + 3 * 0.5,
    }
    assert d.scores == pytest.approx(expect)
    assert (d.replica_id, d.reason, d.ranked) == ("r1", R.WEIGHTED_SCORE, ("r1", "r0", "r2"))
    assert d.expected_hit_blocks == 10


@pytest.mark.parametrize(
    ("weights", "expect"),
    [
        ({}, "r1"),
        ({"prefix_weight": 0.0}, "r0"),
        ({"queue_weight": 0.0, "kv_weight": 0.0}, "r1"),
        ({"queue_weight": 10.0}, "r0"),
    ],
    ids=["defaults_2_2_3", "no_prefix", "prefix_only", "queue_heavy"],
)
def test_llm_d_weights(weights: dict[str, float], expect: str) -> None:
    snap = llmd_snapshot()
    d = llmd_with(snap, {"r1": H, "r2": H[:5]}, **weights).choose(req_with(H), snap, {})
    assert d.replica_id == expect


def test_llm_d_equal_queues_score_one_and_kv_is_clamped() -> None:
    snap = fleet(
        replica("r0", waiting=3, kv_usage=1.3),
        replica("r1", waiting=3, kv_usage=-0.2),
        replica("r2", waiting=3, kv_usage=0.25, load=900_000),  # the ledger is not a scorer input
    )
    d = LlmDWeighted().choose(req_with(H), snap, {})
    assert d.scores == pytest.approx({"r0": 2.0, "r1": 4.0, "r2": 3.5})
    assert d.replica_id == "r1"


def test_llm_d_lookup_stops_at_the_first_block_no_endpoint_holds() -> None:
    snap = ready_fleet(2)
    policy = LlmDWeighted()
    policy.choose(req_with(H), snap, {})
    routed_to(policy, req_with(H[:3] + H[4:], "gap"), "r0")  # everything but block 3
    routed_to(policy, req_with(H[:2], "short"), "r1")
    d = policy.choose(req_with(H), snap, {})
    assert d.replica_id == "r0"
    assert d.expected_hit_blocks == 3
    assert d.scores["r0"] - d.scores["r1"] == pytest.approx(3 * (3 - 2) / 10)


def test_llm_d_hashes_at_most_256_blocks() -> None:
    snap = ready_fleet(2)
    long = chain(300, seed=11)
    policy = llmd_with(snap, {"r0": long})
    d = policy.choose(req_with(long), snap, {})
    assert d.expected_hit_blocks == MAX_HASHED_BLOCKS
    assert d.scores["r0"] == pytest.approx(2 + 2 + 3)
    # blocks past 256 are never recorded
    tail = policy.choose(req_with(long[MAX_HASHED_BLOCKS:]), snap, {})
    assert tail.expected_hit_blocks == 0


def test_llm_d_lru_per_endpoint_holds_num_gpu_blocks_hashes() -> None:
    small = profile("h100", "llama-3.1-8b", num_gpu_blocks_override=4)
    snap = fleet(replica("r0", prof=small), replica("r1", prof=small))
    policy = LlmDWeighted()
    route(policy, req_with(H, "a"), snap)
    # only the 4 most recently used hashes survive: the walk from block 0 finds nothing
    d = policy.choose(req_with(H), snap, {})
    assert d.expected_hit_blocks == 0
    tail = policy.choose(req_with(H[6:]), snap, {})
    assert tail.expected_hit_blocks == 4


def test_llm_d_without_hashes_scores_no_prefix() -> None:
    snap = ready_fleet(2)
    policy = llmd_with(snap, {"r0": H})
    d = policy.choose(request("nohash", 4_000, blocks=()), snap, {})
    assert d.scores == {"r0": 4.0, "r1": 4.0}
    assert d.expected_hit_blocks == 0
