"""RouterLedger (this router's reservations) and controlplane.routing.load (a router's
per-replica estimate)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from policy_builders import H100_8B, fleet, replica, request

from controlplane.routing.ledger import RouterLedger
from controlplane.routing.load import (
    PRIOR_DECODE_TOKENS,
    PRIOR_PREFILL_TOKENS,
    estimate,
    outstanding_tokens,
)
from controlplane.routing.policies.least_loaded import LeastLoaded
from controlplane.types import EngineMetrics, Ledger, ReplicaState

CAP = H100_8B.num_gpu_blocks * H100_8B.resolved_block_size


# -- RouterLedger ---------------------------------------------------------------------------------
def test_reserve_first_token_release_move_the_totals() -> None:
    led = RouterLedger()
    led.reserve("a", "r0", prompt_tokens=1_000, uncached_tokens=600, predicted_output=50, now_s=1.0)
    led.reserve("b", "r0", prompt_tokens=200, uncached_tokens=200, predicted_output=30, now_s=2.0)
    led.reserve("c", "r1", prompt_tokens=64, uncached_tokens=64, predicted_output=8, now_s=2.0)
    assert len(led) == 3
    assert led.view("r0") == Ledger(
        requests=2,
        prefill_tokens=800,
        pending_prompt_tokens=1_200,
        decoding=0,
        decode_tokens=80,
        context_tokens=1_200,
        unscraped_requests=2,
    )
    led.first_token("a")
    assert led.view("r0") == Ledger(
        requests=2,
        prefill_tokens=200,
        pending_prompt_tokens=200,
        decoding=1,
        decode_tokens=80,
        context_tokens=1_200,
        unscraped_requests=2,
    )
    released = led.release("a")
    assert released is not None
    assert (released.replica_id, released.prompt_tokens, released.decoding) == ("r0", 1_000, True)
    assert led.view("r0") == Ledger(
        requests=1,
        prefill_tokens=200,
        pending_prompt_tokens=200,
        decode_tokens=30,
        context_tokens=200,
        unscraped_requests=1,
    )
    # released before its first token: its prefill leaves with it
    assert led.release("b") is not None
    assert led.view("r0") == Ledger()
    assert led.view("r1").requests == 1
    assert led.view("never-seen") == Ledger()


def test_transitions_are_exactly_once() -> None:
    led = RouterLedger()
    led.reserve("a", "r0", 500, 300, 40, now_s=0.0)
    led.first_token("a")
    once = led.view("r0")
    led.first_token("a")  # a second first token changes nothing
    assert led.view("r0") == once
    assert led.release("a") is not None
    empty = led.view("r0")
    assert led.release("a") is None  # double release: None, nothing changes
    led.first_token("a")  # first token after release: nothing
    assert led.view("r0") == empty == Ledger()
    assert len(led) == 0
    assert led.release("unknown") is None


def test_duplicate_reservation_is_refused() -> None:
    led = RouterLedger()
    led.reserve("a", "r0", 10, 10, 1, now_s=0.0)
    with pytest.raises(ValueError, match="already reserved"):
        led.reserve("a", "r1", 10, 10, 1, now_s=0.0)
    assert led.view("r1") == Ledger()
    assert led.view("r0").requests == 1


def test_unscraped_counts_only_requests_sent_after_the_last_scrape() -> None:
    led = RouterLedger()
    led.reserve("a", "r0", 10, 10, 1, now_s=1.0)
    led.reserve("b", "r0", 10, 10, 1, now_s=2.0)
    assert led.view("r0").unscraped_requests == 2
    led.scraped("r0", 3.0)
    assert led.view("r0").unscraped_requests == 0
    led.reserve("c", "r0", 10, 10, 1, now_s=4.0)
    led.reserve("d", "r1", 10, 10, 1, now_s=4.0)  # another replica's scrape is separate
    assert led.view("r0").unscraped_requests == 1
    led.release("a")  # sent before the scrape: the count of unscraped ones is unchanged
    assert led.view("r0").unscraped_requests == 1
    led.release("c")
    assert led.view("r0").unscraped_requests == 0
    assert led.view("r0").requests == 1
    led.scraped("r1", 5.0)
    led.reserve("e", "r0", 10, 10, 1, now_s=6.0)
    led.scraped("r0", 7.0)
    led.reserve("f", "r0", 10, 10, 1, now_s=8.0)
    assert led.view("r0").unscraped_requests == 1
    assert led.view("r1").unscraped_requests == 0
    for rid in "bef":
        led.release(rid)
    led.release("d")
    assert led.view("r0") == led.view("r1") == Ledger()


def test_scrape_older_than_a_reservation_leaves_that_reservation_unscraped() -> None:
    led = RouterLedger()
    led.reserve("a", "r0", 10, 10, 1, now_s=6.0)
    # a scrape sent at t=5 whose answer arrives after the reservation at t=6
    led.scraped("r0", 5.0)
    assert led.view("r0").unscraped_requests == 1
    led.release("a")
    led.reserve("b", "r0", 10, 10, 1, now_s=7.0)
    assert led.view("r0").unscraped_requests == 1


def test_drop_replica_releases_everything_on_it() -> None:
    led = RouterLedger()
    for i in range(5):
        led.reserve(f"a{i}", "r0", 100, 50, 10, now_s=float(i))
    led.reserve("b", "r1", 100, 50, 10, now_s=0.0)
    led.first_token("a1")
    keep = led.view("r1")
    assert sorted(led.drop_replica("r0")) == [f"a{i}" for i in range(5)]
    assert led.view("r0") == Ledger()
    assert led.view("r1") == keep
    assert len(led) == 1
    assert led.drop_replica("r0") == []
    assert led.release("a3") is None


@dataclass
class _Model:
    replica_id: str
    prompt: int
    uncached: int
    output: int
    sent: float
    decoding: bool = False


ops = st.lists(
    st.tuples(
        st.sampled_from(["reserve", "first", "release", "scrape", "drop"]),
        st.integers(0, 9),  # request index
        st.sampled_from(["r0", "r1", "r2"]),
        st.integers(1, 5_000),
        st.floats(0.0, 1.0),  # cached fraction
        st.integers(0, 2_000),
        st.floats(0.0, 2.0),  # time step (times never go backwards)
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops)
def test_ledger_matches_a_brute_force_model(
    ops: list[tuple[str, int, str, int, float, int, float]],
) -> None:
    led = RouterLedger()
    model: dict[str, _Model] = {}
    scraped: dict[str, float] = {}
    now = 0.0
    for op, i, rep, prompt, frac, out, dt in ops:
        now += dt
        rid = f"q{i}"
        if op == "reserve":
            if rid in model:
                with pytest.raises(ValueError):
                    led.reserve(rid, rep, prompt, int(prompt * frac), out, now)
            else:
                led.reserve(rid, rep, prompt, int(prompt * frac), out, now)
                model[rid] = _Model(rep, prompt, int(prompt * frac), out, now)
        elif op == "first":
            led.first_token(rid)
            if rid in model:
                model[rid].decoding = True
        elif op == "release":
            got = led.release(rid)
            assert (got is None) == (rid not in model)
            model.pop(rid, None)
        elif op == "scrape":
            led.scraped(rep, now)
            scraped[rep] = now
        else:
            dropped = led.drop_replica(rep)
            assert sorted(dropped) == sorted(k for k, m in model.items() if m.replica_id == rep)
            for k in dropped:
                del model[k]
        assert len(led) == len(model)
        for r in ("r0", "r1", "r2"):
            mine = [m for m in model.values() if m.replica_id == r]
            prefilling = [m for m in mine if not m.decoding]
            expect = (
                Ledger(
                    requests=len(mine),
                    prefill_tokens=sum(m.uncached for m in prefilling),
                    pending_prompt_tokens=sum(m.prompt for m in prefilling),
                    decoding=len(mine) - len(prefilling),
                    decode_tokens=sum(m.output for m in mine),
                    context_tokens=sum(m.prompt for m in mine),
                    unscraped_requests=sum(
                        1 for m in mine if m.sent > scraped.get(r, float("-inf"))
                    ),
                )
                if mine
                else Ledger()
            )
            assert led.view(r) == expect
    for k in list(model):
        led.release(k)
    assert all(led.view(r) == Ledger() for r in ("r0", "r1", "r2"))


# -- controlplane.routing.load.estimate
# --------------------------------------------------------------------------
def rep(
    running: int = 0, waiting: int = 0, kv: float = 0.0, ledger: Ledger | None = None
) -> ReplicaState:
    return ReplicaState(
        "r",
        H100_8B,
        metrics=EngineMetrics(running=running, waiting=waiting, kv_usage=kv),
        ledger=ledger or Ledger(),
    )


@pytest.mark.parametrize(
    ("state", "requests", "prefill", "decode", "decoding", "context"),
    [
        (rep(), 0, 0, 0, 0, 0),
        # no ledger: every request is someone else's, valued at the priors
        (
            rep(running=3, waiting=2, kv=0.5),
            5,
            2 * PRIOR_PREFILL_TOKENS,
            5 * PRIOR_DECODE_TOKENS,
            3,
            0.5 * CAP,
        ),
        (rep(running=7), 7, 0, 7 * PRIOR_DECODE_TOKENS, 7, 0),
        # ledger only, none of it scraped yet: exactly the ledger
        (
            rep(
                ledger=Ledger(
                    requests=2,
                    prefill_tokens=900,
                    pending_prompt_tokens=1_000,
                    decode_tokens=300,
                    context_tokens=1_000,
                    unscraped_requests=2,
                )
            ),
            2,
            900,
            300,
            0,
            1_000,
        ),
        # ledger visible in the metrics (both running): nobody else
        (
            rep(
                running=2,
                kv=0.001,
                ledger=Ledger(requests=2, decoding=2, decode_tokens=400, context_tokens=50_000),
            ),
            2,
            0,
            400,
            2,
            50_000,
        ),
        # several routers: 8 in the metrics, 2 of them ours -> 6 others, 4 of them waiting,
        # valued at our means (prefill 1000 / 2, decode 200 / 2)
        (
            rep(
                running=4,
                waiting=4,
                ledger=Ledger(
                    requests=2, prefill_tokens=1_000, pending_prompt_tokens=1_000, decode_tokens=200
                ),
            ),
            8,
            1_000 + 4 * 500,
            200 + 6 * 100,
            2,
            0,
        ),
        # one of ours is unscraped: the metrics show 1 of our 2, so 3 others
        (
            rep(
                running=4,
                ledger=Ledger(requests=2, decoding=2, decode_tokens=100, unscraped_requests=1),
            ),
            5,
            0,
            100 + 3 * 50,
            5,
            0,
        ),
        # stale metrics showing fewer than ours: others clamp at zero
        (
            rep(running=1, ledger=Ledger(requests=3, decoding=3, decode_tokens=30)),
            3,
            0,
            30,
            3,
            0,
        ),
    ],
    ids=[
        "idle",
        "metrics_only_priors",
        "metrics_only_running",
        "ledger_only_unscraped",
        "ledger_fully_visible",
        "multi_router_others",
        "multi_router_unscraped",
        "stale_metrics_clamped",
    ],
)
def test_estimate(
    state: ReplicaState, requests: int, prefill: float, decode: float, decoding: int, context: float
) -> None:
    est = estimate(state)
    assert est.requests == requests
    assert est.prefill_tokens == pytest.approx(prefill)
    assert est.decode_tokens == pytest.approx(decode)
    assert est.decoding == decoding
    assert est.context_tokens == pytest.approx(context)
    assert outstanding_tokens(state) == pytest.approx(prefill + decode)


@settings(max_examples=200, deadline=None)
@given(
    running=st.integers(0, 500),
    waiting=st.integers(0, 500),
    kv=st.floats(0, 1),
    more=st.integers(1, 50),
)
def test_estimate_grows_with_scraped_queue(
    running: int, waiting: int, kv: float, more: int
) -> None:
    base = estimate(rep(running, waiting, kv))
    assert base.outstanding_tokens >= 0
    assert estimate(rep(running, waiting + more, kv)).outstanding_tokens > base.outstanding_tokens
    assert estimate(rep(running + more, waiting, kv)).outstanding_tokens > base.outstanding_tokens


def test_others_waiting_prefill_not_collapsed_by_an_own_decoding_request() -> None:
    own_decoder = Ledger(requests=1, decoding=1, decode_tokens=100, context_tokens=500)
    mine = rep(running=1, waiting=10, ledger=own_decoder)
    # the 10 waiting requests are other routers' in both views
    assert estimate(mine).prefill_tokens == pytest.approx(10 * PRIOR_PREFILL_TOKENS)


def test_least_loaded_not_fooled_by_an_own_decoding_request() -> None:
    own_decoder = Ledger(requests=1, decoding=1, decode_tokens=100, context_tokens=500)
    snap = fleet(
        replica("queued", running=1, waiting=10, ledger=own_decoder),
        replica("light", running=1, waiting=2),
    )
    assert LeastLoaded().choose(request(), snap, {}).replica_id == "light"
