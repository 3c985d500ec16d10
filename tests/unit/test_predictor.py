"""OutputLengthPredictor: oracle mode, the max_tokens cap, bucket fallbacks, window quantile."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.routing.predictor import OutputLengthPredictor


def fed(samples: list[tuple[str, int, int]], **params: float) -> OutputLengthPredictor:
    p = OutputLengthPredictor(**params)  # type: ignore[arg-type]
    for tenant, prompt, output in samples:
        p.observe(tenant, prompt, output)
    return p


@pytest.mark.parametrize(
    ("prompt", "bucket"),
    [
        (0, 0),
        (-5, 0),
        (1, 1),
        (2, 2),
        (3, 2),
        (4, 3),
        (7, 3),
        (8, 4),
        (300, 9),
        (511, 9),
        (512, 10),
        (30_000, 15),
    ],
)
def test_buckets_are_powers_of_two(prompt: int, bucket: int) -> None:
    assert OutputLengthPredictor.bucket(prompt) == bucket


@pytest.mark.parametrize(
    ("true_output", "max_tokens", "expect"),
    [(900, None, 900), (900, 100, 100), (50, 100, 50), (0, None, 1), (900, 0, 1)],
    ids=["true", "capped", "under_cap", "at_least_one", "cap_zero_still_one"],
)
def test_oracle_returns_the_true_length_capped(
    true_output: int, max_tokens: int | None, expect: int
) -> None:
    p = fed([("t", 100, 7)] * 20, oracle=True)
    assert p.predict("t", 100, max_tokens, true_output) == expect


def test_oracle_without_a_true_length_falls_back_to_history() -> None:
    p = fed([("t", 100, 7)] * 20, oracle=True)
    assert p.predict("t", 100, None) == 7
    assert fed([], oracle=True).predict("t", 100, None) == 256


def test_fallback_order_bucket_then_tenant_then_global_then_prior() -> None:
    p = OutputLengthPredictor(min_samples=3, prior_tokens=256)
    assert p.predict("a", 100, None) == 256  # nothing observed: the prior
    p.observe("b", 100, 1_000)
    p.observe("b", 100, 1_000)
    assert p.predict("a", 100, None) == 256  # global has 2 < 3 samples
    p.observe("b", 5_000, 1_000)
    assert p.predict("a", 100, None) == 1_000  # global: 3 samples of tenant b
    for _ in range(3):
        p.observe("a", 5_000, 50)  # tenant a, bucket 13
    assert p.predict("a", 100, None) == 50  # bucket (a, 7) empty -> tenant a pooled
    assert p.predict("a", 5_000, None) == 50  # bucket (a, 13)
    for _ in range(3):
        p.observe("a", 100, 7)
    assert p.predict("a", 100, None) == 7  # bucket (a, 7) has 3 samples
    assert p.predict("a", 120, None) == 7  # 120 shares bucket 7 (64..127)
    # tenant a pooled: [7, 7, 7, 50, 50, 50], upper median -> 50
    assert p.predict("a", 128, None) == 50
    # another tenant sees only the global window (3 x 1000, 3 x 50, 3 x 7): median 50
    assert p.predict("c", 100, None) == 50
    # every prediction is capped by max_tokens
    assert p.predict("a", 100, 5) == 5
    assert p.predict("c", 100, 20) == 20


@pytest.mark.parametrize(
    ("q", "expect"),
    [(0.0, 7), (0.25, 8), (0.5, 9), (0.75, 10), (1.0, 10)],
)
def test_window_keeps_the_last_values_and_takes_the_quantile(q: float, expect: int) -> None:
    # window 4: after 1..10 only 7, 8, 9, 10 remain; index min(n - 1, int(q * n))
    p = fed([("t", 100, v) for v in range(1, 11)], window=4, min_samples=4, quantile=q)
    assert p.predict("t", 100, None) == expect


def test_window_evicts_by_arrival_not_by_value() -> None:
    p = fed([("t", 100, v) for v in (100, 1, 2, 3)], window=3, min_samples=3, quantile=1.0)
    assert p.predict("t", 100, None) == 3  # the 100 was the oldest, it is gone


@pytest.mark.parametrize("q", [-0.1, 1.01])
def test_quantile_must_be_in_unit_interval(q: float) -> None:
    with pytest.raises(ValueError, match="quantile"):
        OutputLengthPredictor(quantile=q)


@settings(max_examples=100, deadline=None)
@given(
    values=st.lists(st.integers(0, 10_000), min_size=1, max_size=60),
    window=st.integers(1, 20),
    q=st.floats(0.0, 1.0),
)
def test_window_quantile_matches_sorted_tail(values: list[int], window: int, q: float) -> None:
    p = fed([("t", 100, v) for v in values], window=window, min_samples=1, quantile=q)
    tail = sorted(values[-window:])
    expect = tail[min(len(tail) - 1, int(q * len(tail)))]
    assert p.predict("t", 100, None) == max(1, expect)
    assert p.predict("t", 100, 3) == max(1, min(3, expect))


def test_empty_tenant_name_is_not_double_counted_globally() -> None:
    p = OutputLengthPredictor(min_samples=2, prior_tokens=256)
    p.observe("", 100, 50)
    assert p.predict("other", 100, None) == 256  # one global sample < min_samples
