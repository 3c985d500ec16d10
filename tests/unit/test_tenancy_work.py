"""Work units against the roofline they come from; the batch class's KV share sizing."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.roofline import profile
from controlplane.roofline.capacity import decode_seconds_per_token, prefill_seconds_per_token
from controlplane.tenancy.classes import (
    ClassLoad,
    batch_kv_share,
    interactive_tpot,
    tpot_with_batch,
)
from controlplane.tenancy.work import WorkMode, WorkModel, reference_batch

H100 = profile("h100", "llama-3.1-8b")
ROOF = WorkModel.build("vtc-roofline", H100)


def test_the_reference_batch_is_64_on_an_h100_and_never_zero() -> None:
    assert reference_batch(H100) == 64 == ROOF.batch
    assert reference_batch(profile("cpu", "llama-3.1-8b", max_num_seqs=1)) >= 1


@given(st.integers(1, 3000), st.integers(0, 60_000))
def test_prefill_is_the_sum_of_the_roofline_per_token_costs(n: int, c: int) -> None:
    expected = math.fsum(prefill_seconds_per_token(H100, c + j) for j in range(n))
    assert ROOF.prefill(n, c) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("context", [0, 200, 2048, 16_000, 100_000])
def test_one_decode_token_costs_the_step_time_per_sequence(context: int) -> None:
    expected = decode_seconds_per_token(H100, 64, context)
    assert ROOF.decode_token(context) == pytest.approx(expected, rel=1e-12)
    assert ROOF.decode(1, context) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(("n", "c"), [(2, 0), (300, 16_000), (2000, 200), (8000, 50_000)])
def test_a_run_of_decode_tokens_matches_the_per_token_sum(n: int, c: int) -> None:
    exact = math.fsum(ROOF.decode_token(c + j) for j in range(n))
    assert ROOF.decode(n, c) == pytest.approx(exact, rel=1e-3)


def test_decode_cost_grows_with_context() -> None:
    costs = [ROOF.decode_token(c) for c in (0, 1000, 8000, 32_000, 128_000)]
    assert costs == sorted(costs) and costs[-1] > 5 * costs[0]


@given(st.integers(2, 20_000), st.data())
def test_refunding_cached_tokens_leaves_exactly_the_computed_prefill(
    n: int, data: st.DataObject
) -> None:
    k = data.draw(st.integers(0, n))
    assert ROOF.prefill(n, 0) - ROOF.refund_cached(k) == pytest.approx(
        ROOF.prefill(n - k, k), rel=1e-9, abs=1e-15
    )


def test_a_long_document_costs_about_twenty_times_a_chat_in_roofline_units_only() -> None:
    doc, chat = (16_000, 300), (200, 200)
    roof = ROOF.request(*doc) / ROOF.request(*chat)
    tokens = WorkModel.build("vtc").request(*doc) / WorkModel.build("vtc").request(*chat)
    requests = WorkModel.build("request").request(*doc) / WorkModel.build("request").request(*chat)
    assert 15 < roof < 30
    assert tokens == pytest.approx((16_000 + 299) / (200 + 199))
    assert requests == 1.0
    # what a request-fair queue hands the document tenant when both are backlogged
    assert roof / (roof + 1) == pytest.approx(0.955, abs=0.02)


@pytest.mark.parametrize(
    ("mode", "prefill", "decode", "refund"),
    [("request", 1.0, 0.0, 0.0), ("vtc", 100.0, 10.0, 5.0)],
)
def test_the_plain_modes(mode: str, prefill: float, decode: float, refund: float) -> None:
    w = WorkModel.build(mode)
    assert w.mode is WorkMode(mode)
    assert (w.prefill(100, 7), w.decode(10, 5000), w.refund_cached(5)) == (prefill, decode, refund)


def test_roofline_work_needs_a_profile_and_a_known_mode() -> None:
    with pytest.raises(ValueError):
        WorkModel.build("vtc-roofline")
    with pytest.raises(ValueError):
        WorkModel.build("fifo", H100)


# -- the batch class's KV share ---------------------------------------------------------------
LOAD = ClassLoad(interactive_sequences=40.0, interactive_context=500.0)


def test_batch_share_grows_with_the_target_and_keeps_the_estimate_within_it() -> None:
    alone = interactive_tpot(H100, LOAD)
    assert alone == tpot_with_batch(H100, 0.0, LOAD)
    shares = [batch_kv_share(H100, alone * f, LOAD) for f in (1.05, 1.2, 1.5, 3.0)]
    assert shares == sorted(shares) and 0 < shares[0] < shares[-1] <= 1
    for f, share in zip((1.05, 1.2, 1.5), shares, strict=False):
        tpot = tpot_with_batch(H100, share * H100.kv_capacity_tokens, LOAD)
        assert tpot <= alone * f * (1 + 1e-9)


def test_batch_share_is_zero_below_the_interactive_tpot_and_one_for_a_lax_target() -> None:
    alone = interactive_tpot(H100, LOAD)
    assert batch_kv_share(H100, alone * 0.9, LOAD) == 0.0
    assert batch_kv_share(H100, 10.0, LOAD) == 1.0


def test_longer_batch_prompts_earn_a_smaller_share() -> None:
    target = 1.2 * interactive_tpot(H100, LOAD)
    short = batch_kv_share(H100, target, LOAD)
    long = batch_kv_share(H100, target, replace(LOAD, batch_prompt=8000, batch_output=500))
    assert long < short
