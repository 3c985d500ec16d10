"""RoutingBooks: the bookkeeping around a decision that the simulator and the router share."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from policy_builders import BLOCK, chain, fleet, replica

from controlplane.routing.books import Retract, RoutingBooks, Speculate, usable_hit_tokens
from controlplane.routing.config import ArmConfig, PolicyConfig
from controlplane.types import Decision, DecisionReason, PrefixMatch, RoutingRequest


def request(prompt: int = 10 * BLOCK, *, tenant: str = "default") -> RoutingRequest:
    return RoutingRequest(
        request_id="q1",
        prompt_tokens=prompt,
        block_hashes=chain(10),
        tenant=tenant,
        predicted_output_tokens=100,
        block_size=BLOCK,
    )


@pytest.mark.parametrize(
    ("prompt", "hit_blocks", "usable"),
    [
        (10 * BLOCK, 0, 0),
        (10 * BLOCK, 4, 4 * BLOCK),
        (10 * BLOCK, 10, 9 * BLOCK),  # the last token is always computed: (N - 1) // B blocks
        (10 * BLOCK + 1, 10, 10 * BLOCK),
        (1, 3, 0),
    ],
)
def test_usable_hit_tokens(prompt: int, hit_blocks: int, usable: int) -> None:
    assert usable_hit_tokens(request(prompt=prompt), hit_blocks) == usable


@pytest.mark.parametrize(
    ("config", "reserved", "ops"),
    [
        (PolicyConfig(name="prefix_affinity"), True, [Speculate]),
        (PolicyConfig(name="prefix_affinity", speculative=False), True, []),
        (PolicyConfig(name="prefix_affinity", reservations=False), False, [Speculate]),
    ],
)
def test_commit_reserves_and_speculates(
    config: PolicyConfig, reserved: bool, ops: list[type]
) -> None:
    books = RoutingBooks(config)
    snap = fleet(replica("r0"), replica("r1"))
    req = request()
    matches = {"r1": PrefixMatch("r1", 6, 6)}
    arm = books.arm_for(req)
    decision = books.decide(req, snap, matches, arm)
    assert decision.replica_id == "r1" and decision.reason is DecisionReason.PREFIX_HIT
    routed, got = books.commit(req, decision, snap, arm, now=5.0)
    assert [type(op) for op in got] == ops
    view = books.ledger.view("r1")
    if reserved:
        assert (view.requests, view.prefill_tokens) == (1, 10 * BLOCK - 6 * BLOCK)
        assert view.decode_tokens == 100
    else:
        assert view.requests == 0
    assert got == [] or got[0] == Speculate("r1", req.block_hashes, config.speculative_ttl_s)
    assert routed.tried == ["r1"]


def test_first_token_retracts_once_and_finish_releases_once() -> None:
    books = RoutingBooks(PolicyConfig(name="least_loaded", retract_grace_s=2.5))
    snap = fleet(replica("r0"))
    req = request()
    arm = books.arm_for(req)
    routed, _ = books.commit(req, books.decide(req, snap, {}, arm), snap, arm, 0.0)
    assert books.first_token(routed) == [Retract("r0", req.block_hashes, 2.5)]
    assert books.first_token(routed) == []  # idempotent
    assert books.ledger.view("r0").decoding == 1
    assert books.finish(routed, 42) == []  # its entry was retracted at the first token
    assert books.finish(routed, 42) is None
    assert len(books.ledger) == 0
    # the predictor learned the output (it needs min_samples before it predicts from it)
    for _ in range(10):
        books.predictor.observe("default", req.prompt_tokens, 42)
    assert books.predict("default", req.prompt_tokens, None) == 42


def test_reroute_moves_the_reservation_to_the_next_ranked_candidate() -> None:
    books = RoutingBooks(PolicyConfig(name="least_loaded"))
    snap = fleet(replica("r0"), replica("r1", load=100), replica("r2", load=200))
    req = request()
    arm = books.arm_for(req)
    decision = books.decide(req, snap, {}, arm)
    routed, _ = books.commit(req, decision, snap, arm, 0.0)
    assert routed.replica_id == "r0"
    ttl = books.config.speculative_ttl_s
    assert books.reroute(routed, snap, 1.0) == [
        Retract("r0", req.block_hashes, 0.0),
        Speculate("r1", req.block_hashes, ttl),
    ]
    assert routed.replica_id == "r1" and routed.tried == ["r0", "r1"]
    assert books.ledger.view("r0").requests == 0 and books.ledger.view("r1").requests == 1
    assert routed.decision.expected_hit_blocks == 0
    books.reroute(routed, snap, 2.0)
    assert books.reroute(routed, snap, 3.0) is None  # everything tried: nothing changes
    assert routed.replica_id == "r2" and books.ledger.view("r2").requests == 1


@pytest.mark.parametrize(
    ("speculative", "first_token", "withdrawn"),
    [
        (True, False, True),  # failed or cancelled before a first token: the entry goes now
        (True, True, False),  # its first token retracted it after the grace already
        (False, False, False),  # nothing was written
    ],
)
def test_finish_withdraws_the_entry_of_a_request_that_never_started(
    speculative: bool, first_token: bool, withdrawn: bool
) -> None:
    books = RoutingBooks(PolicyConfig(name="least_loaded", speculative=speculative))
    snap = fleet(replica("r0"))
    req = request()
    arm = books.arm_for(req)
    routed, _ = books.commit(req, books.decide(req, snap, {}, arm), snap, arm, 0.0)
    if first_token:
        books.first_token(routed)
    expected = [Retract("r0", req.block_hashes, 0.0)] if withdrawn else []
    assert books.finish(routed, None) == expected
    assert books.finish(routed, None) is None
    assert len(books.ledger) == 0


def test_commit_refuses_a_decision_without_a_replica() -> None:
    books = RoutingBooks(PolicyConfig())
    arm = books.arms[0]
    with pytest.raises(ValueError, match="chose a replica"):
        books.commit(request(), Decision.none_healthy(), fleet(), arm, 0.0)


@given(st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=40))
def test_arms_are_sticky_per_tenant(tenants: list[str]) -> None:
    cfg = PolicyConfig(
        arms=[
            ArmConfig(name="a", policy="round_robin"),
            ArmConfig(name="b", policy="least_loaded", weight=3),
        ]
    )
    books = RoutingBooks(cfg)
    seen: dict[str, str] = {}
    for t in tenants:
        arm = books.arm_for(request(tenant=t)).name
        assert seen.setdefault(t, arm) == arm
    assert set(books.policies) == {"a", "b"}
