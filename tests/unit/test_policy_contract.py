"""The routing-policy contract, checked for every policy in
`controlplane.routing.policies.POLICIES`.

- only routable replicas (READY and not ejected) are chosen or ranked;
- no routable replica -> `Decision.none_healthy()`;
- ties are broken by the request id: deterministic, and spread over the tied replicas;
- `choose` is pure (same decision twice, policy state untouched); the hooks hold the state;
- Hypothesis: for random fleets, `ranked` is a permutation of the routable ids, `ranked[0]` chosen.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from policy_builders import (
    POLICY_NAMES,
    STATEFUL,
    UNHEALTHY_PHASES,
    chain,
    fleet,
    fleets,
    make,
    matches,
    prefix_matches,
    ready_fleet,
    replica,
    request,
    requests_,
    routable_ids,
    route,
    routed_to,
)

from controlplane.routing.interfaces import RoutingPolicy
from controlplane.routing.policies import OWN_POLICIES, PEER_POLICIES, POLICIES, make_policy
from controlplane.types import Decision, DecisionReason, FleetSnapshot, Phase

NORMAL_REASON = {
    "round_robin": {DecisionReason.ROUND_ROBIN},
    "least_loaded": {DecisionReason.LEAST_LOADED},
    "prefix_affinity": {
        DecisionReason.PREFIX_HIT,
        DecisionReason.MISS_LEAST_LOADED,
        DecisionReason.LOAD_OVERRIDE,
    },
    "predicted_finish": {DecisionReason.PREDICTED_FINISH},
    "sglang_cache_aware": {
        DecisionReason.CACHE_MATCH,
        DecisionReason.SMALLEST_TREE,
        DecisionReason.IMBALANCED,
    },
    "dynamo_kv_cost": {DecisionReason.KV_COST},
    "llm_d_weighted": {DecisionReason.WEIGHTED_SCORE},
}


def state(policy: RoutingPolicy) -> dict[str, Any]:
    return copy.deepcopy(dict(vars(policy)))


def test_registry_holds_the_seven_policies_by_their_names() -> None:
    assert set(POLICIES) == set(NORMAL_REASON)
    assert set(OWN_POLICIES) | set(PEER_POLICIES) == set(POLICIES)
    for name, factory in POLICIES.items():
        policy = make_policy(name)
        assert isinstance(policy, RoutingPolicy)
        assert isinstance(policy, factory)  # type: ignore[arg-type]
        assert policy.name == name


def test_make_policy_rejects_unknown_names_and_bad_parameters() -> None:
    from controlplane.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown routing policy"):
        make_policy("random")
    with pytest.raises(ConfigError, match="bad parameters"):
        make_policy("round_robin", cache_threshold=0.5)


# -- unhealthy replicas ----------------------------------------------------------------------------
UNHEALTHY_KINDS: list[tuple[str, dict[str, Any]]] = [
    ("loading", {"phase": Phase.LOADING}),
    ("draining", {"phase": Phase.DRAINING}),
    ("dead", {"phase": Phase.DEAD}),
    ("ejected", {"ejected": True}),
    ("ejected_and_draining", {"phase": Phase.DRAINING, "ejected": True}),
]


def tempting_fleet(unhealthy: dict[str, Any]) -> tuple[FleetSnapshot, dict[str, Any]]:
    """An idle, cache-holding unhealthy replica `u0` beside two heavily loaded healthy ones."""
    bad = replica("u0", **unhealthy)
    good = [replica(f"h{i}", load=60_000, waiting=40, running=40, kv_usage=0.95) for i in range(2)]
    return fleet(bad, *good), {"bad": bad, "good": {r.replica_id for r in good}}


@pytest.mark.parametrize("name", POLICY_NAMES)
@pytest.mark.parametrize(
    ("kind", "unhealthy"), UNHEALTHY_KINDS, ids=[k for k, _ in UNHEALTHY_KINDS]
)
def test_unhealthy_replicas_are_never_chosen_nor_ranked(
    name: str, kind: str, unhealthy: dict[str, Any]
) -> None:
    snap, parts = tempting_fleet(unhealthy)
    policy = make(name)
    hashes = chain(40, seed=7)
    # peer policies learn from their own decisions: teach them that u0 holds the whole prefix
    for i in range(3):
        routed_to(policy, request(f"prime-{i}", 40 * 16 + 1, blocks=hashes), "u0")
    found = matches(u0=40)
    for i in range(30):
        req = request(f"q-{i}", 40 * 16 + 1, blocks=hashes)
        d = policy.choose(req, snap, found)
        assert d.replica_id in parts["good"], (kind, d)
        assert set(d.ranked) == parts["good"]
        assert set(d.scores) <= parts["good"]
        assert d.reason in NORMAL_REASON[name]


@pytest.mark.parametrize("name", POLICY_NAMES)
@pytest.mark.parametrize(
    "snap",
    [
        FleetSnapshot.make_empty(),
        fleet(*(replica(f"r{i}", phase=p) for i, p in enumerate(UNHEALTHY_PHASES))),
        fleet(replica("r0", ejected=True), replica("r1", ejected=True)),
        fleet(replica("r0", phase=Phase.LOADING), replica("r1", ejected=True)),
    ],
    ids=["empty", "loading_draining_dead", "all_ejected", "loading_and_ejected"],
)
def test_no_routable_replica_gives_none_healthy(name: str, snap: FleetSnapshot) -> None:
    policy = make(name)
    req = request("lonely", 800)
    d = policy.choose(req, snap, matches(r0=10, r1=10))
    assert d == Decision.none_healthy()
    assert d.replica_id is None
    assert d.reason is DecisionReason.NO_HEALTHY_REPLICA
    assert d.ranked == ()
    # the router still tells the policy; a None decision must not disturb its state
    before = state(policy)
    policy.on_routed(req, d, snap)
    assert state(policy) == before


# -- ties ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [n for n in POLICY_NAMES if n != "round_robin"])
def test_ties_are_deterministic_per_request_id_and_spread_over_tied_replicas(name: str) -> None:
    snap = ready_fleet(3)
    chosen = Counter[str]()
    for i in range(90):
        req = request(f"tie-{i}", 512)
        first = make(name).choose(req, snap, {})
        again = make(name).choose(req, snap, {})
        assert first == again  # a fresh instance, the same request id: the same decision
        assert first.reason in NORMAL_REASON[name]
        assert first.replica_id is not None
        chosen[first.replica_id] += 1
    assert set(chosen) == {"r0", "r1", "r2"}
    assert min(chosen.values()) >= 15, chosen  # FNV-1a spreads 90 ids roughly evenly


def test_round_robin_ignores_the_request_id_and_spreads_through_its_cursor() -> None:
    snap = ready_fleet(3)
    fresh = {make("round_robin").choose(request(f"x{i}"), snap, {}).replica_id for i in range(20)}
    assert fresh == {"r0"}
    policy = make("round_robin")
    seen = [route(policy, request(f"x{i}"), snap).replica_id for i in range(6)]
    assert seen == ["r0", "r1", "r2", "r0", "r1", "r2"]


@pytest.mark.parametrize("name", [n for n in POLICY_NAMES if n != "round_robin"])
def test_ties_ignore_replica_order_in_the_snapshot(name: str) -> None:
    a = ready_fleet(4)
    b = fleet(*reversed(a.replicas))
    for i in range(20):
        req = request(f"order-{i}", 300)
        assert make(name).choose(req, a, {}).replica_id == make(name).choose(req, b, {}).replica_id


# -- purity of choose, state in the hooks ----------------------------------------------------------
def primed(name: str) -> tuple[RoutingPolicy, FleetSnapshot]:
    policy = make(name)
    snap = fleet(replica("r0", load=3_000), replica("r1"), replica("r2", kv_usage=0.4))
    for i in range(5):
        req = request(f"p{i}", 640, seed=i % 2)
        d = route(policy, req, snap, matches(r0=i))
        assert d.replica_id is not None
        policy.on_first_token(req, d.replica_id)
        if i % 2:
            policy.on_finished(req, d.replica_id)
    return policy, snap


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_choose_leaves_policy_state_untouched(name: str) -> None:
    policy, snap = primed(name)
    grown = fleet(*snap.replicas, replica("r3"), replica("r4", load=100))
    before = state(policy)
    for i in range(4):
        policy.choose(request(f"c{i}", 900, seed=1), grown, matches(r1=3, r3=(5, 0)))
    assert state(policy) == before


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_hooks_hold_the_state(name: str) -> None:
    policy, snap = primed(name)
    req = request("hooked", 640, seed=3)
    before = state(policy)
    d = policy.choose(req, snap, {})
    assert d.replica_id is not None
    policy.on_routed(req, d, snap)
    after_routed = state(policy)
    if name in STATEFUL:
        assert after_routed != before
    else:
        assert after_routed == before
    policy.on_first_token(req, d.replica_id)
    policy.on_finished(req, d.replica_id)
    if name not in STATEFUL:
        assert state(policy) == before


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_finishing_an_unknown_request_is_harmless(name: str) -> None:
    policy, _ = primed(name)
    before = state(policy)
    ghost = request("never-routed", 320)
    policy.on_first_token(ghost, "r1")
    policy.on_finished(ghost, "r9")
    if name == "sglang_cache_aware":
        # counts in flight per worker: an unknown finish clamps at zero (and adds a zero entry)
        after = state(policy)
        assert after["_trees"] == before["_trees"]
        assert {k: v for k, v in after["_inflight"].items() if v} == {
            k: v for k, v in before["_inflight"].items() if v
        }
    else:
        assert state(policy) == before


# -- Hypothesis invariants ------------------------------------------------------------------------
@pytest.mark.parametrize("name", POLICY_NAMES)
@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_ranked_is_a_permutation_of_the_routable_replicas(name: str, data: st.DataObject) -> None:
    snap = data.draw(fleets())
    policy = make(name)
    # a short history, so stateful policies hold trees, cursors and active blocks
    for j in range(data.draw(st.integers(0, 4))):
        prior = data.draw(requests_(rid=f"h{j}"))
        d = route(policy, prior, snap, data.draw(prefix_matches(snap)))
        if d.replica_id is not None:
            if data.draw(st.booleans()):
                policy.on_first_token(prior, d.replica_id)
            if data.draw(st.booleans()):
                policy.on_finished(prior, d.replica_id)
    req = data.draw(requests_())
    found = data.draw(prefix_matches(snap))

    first = policy.choose(req, snap, found)
    second = policy.choose(req, snap, found)
    assert first == second

    routable = routable_ids(snap)
    if not routable:
        assert first == Decision.none_healthy()
        return
    assert len(first.ranked) == len(set(first.ranked))
    assert set(first.ranked) == routable
    assert first.replica_id == first.ranked[0]
    assert first.replica_id in routable
    assert first.reason in NORMAL_REASON[name]
    assert set(first.scores) <= routable
    assert first.expected_hit_blocks >= 0
