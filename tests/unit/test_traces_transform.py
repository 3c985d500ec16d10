"""Trace transformations: rate scaling, windows, bursts, concatenation, tenants, output caps."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.errors import ConfigError
from controlplane.traces import (
    cap_output,
    concat,
    densest_window,
    head,
    load_trace,
    multi_turn,
    overlay_tenants,
    rebase,
    repeat,
    scale_rate,
    window,
)
from controlplane.traces.model import Trace, TraceRequest
from controlplane.types import PriorityClass


def make(times: list[float], ids: list[tuple[int, ...]] | None = None) -> Trace:
    reqs = [
        TraceRequest(
            arrival_s=t,
            prompt_tokens=100 + i,
            output_tokens=10,
            content_ids=ids[i] if ids else (),
        )
        for i, t in enumerate(times)
    ]
    return Trace("t", tuple(reqs)).sorted()


arrival_lists = st.lists(
    st.floats(0, 1e4, allow_nan=False, allow_infinity=False), min_size=1, max_size=40
)


@settings(max_examples=60, deadline=None)
@given(times=arrival_lists, s=st.floats(0.05, 20.0))
def test_scale_rate_keeps_requests_and_order_and_scales_span(times: list[float], s: float) -> None:
    trace = make(times)
    scaled = scale_rate(trace, s)
    assert len(scaled) == len(trace)
    assert [r.request_id for r in scaled] == [r.request_id for r in trace]
    arrivals = [r.arrival_s for r in scaled]
    assert arrivals == sorted(arrivals)
    assert scaled.duration_s == pytest.approx(trace.duration_s / s, rel=1e-9, abs=1e-9)
    assert scaled.meta["transforms"] == [f"scale_rate({s:g})"]


def test_scale_rate_rejects_non_positive() -> None:
    with pytest.raises(ConfigError):
        scale_rate(make([0.0]), 0.0)


def test_window_and_rebase() -> None:
    trace = make([1.0, 2.0, 3.0, 4.0, 5.0])
    w = window(trace, 2.0, 4.0)
    assert [r.arrival_s for r in w] == [0.0, 1.0]
    assert [r.arrival_s for r in window(trace, 2.0, 4.0, rebase=False)] == [2.0, 3.0]
    assert rebase(trace).requests[0].arrival_s == 0.0
    assert len(head(trace, 2)) == 2


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"requests": 3}, [0.0, 0.1, 0.2]),
        ({"requests": 2}, [0.0, 0.1]),
        ({"seconds": 0.25}, [0.0, 0.1, 0.2]),
        ({"seconds": 1.5}, [0.0, 0.1, 0.2]),
        ({"seconds": 0.15}, [0.0, 0.1]),
        ({"seconds": 0.01}, [0.0]),
        ({"requests": 99}, [0.0, 1.0, 5.0, 5.1, 5.2, 9.0]),
    ],
)
def test_densest_window(kwargs: dict[str, float], expected: list[float]) -> None:
    trace = make([0.0, 1.0, 5.0, 5.1, 5.2, 9.0])
    burst = densest_window(trace, **kwargs)  # type: ignore[arg-type]
    assert [round(r.arrival_s, 9) for r in burst] == expected


def test_densest_window_needs_one_argument() -> None:
    with pytest.raises(ConfigError):
        densest_window(make([0.0]))
    with pytest.raises(ConfigError):
        densest_window(make([0.0]), requests=1, seconds=1.0)


def test_repeat_shifts_time_and_remaps_ids() -> None:
    trace = make([0.0, 1.0, 2.0], ids=[(1, 2), (1, 3), (4,)])
    rep = repeat(trace, 3)
    assert len(rep) == 9
    assert [r.arrival_s for r in rep] == [float(i) for i in range(9)]  # gap = mean gap
    assert len({r.request_id for r in rep}) == 9
    second = rep.requests[3:6]
    # sharing inside a copy survives, nothing is shared across copies
    assert second[0].content_ids[0] == second[1].content_ids[0]
    first_ids = {c for r in rep.requests[:3] for c in r.content_ids}
    assert not first_ids & {c for r in second for c in r.content_ids}
    same = repeat(trace, 2, gap_s=10.0, distinct_ids=False)
    assert same.requests[3].arrival_s == 12.0
    assert same.requests[3].content_ids == (1, 2)


def test_concat_different_traces_and_sessions() -> None:
    sess = multi_turn(sessions=2, turns=2, seed=1)
    both = concat([sess, sess], gap_s=0.0)
    keys = {r.session_key for r in both}
    assert len(keys) == 4
    assert both.meta["transforms"]


def test_overlay_tenants_by_first_id() -> None:
    trace = load_trace("mooncake-fixture")
    shares = {"a": 0.5, "b": 0.3, "c": 0.2}
    over = overlay_tenants(trace, shares, priorities={"c": PriorityClass.BATCH})
    assert over == overlay_tenants(trace, shares, priorities={"c": PriorityClass.BATCH})
    by_first: dict[int, set[str]] = {}
    for r in over:
        by_first.setdefault(r.content_ids[0], set()).add(r.tenant)
        assert (r.priority is PriorityClass.BATCH) == (r.tenant == "c")
    assert all(len(v) == 1 for v in by_first.values())
    counts = {n: sum(r.tenant == n for r in over) for n in shares}
    assert all(counts[n] > 0 for n in shares)
    # already-assigned tenants stay unless overwrite
    again = overlay_tenants(over, {"z": 1.0})
    assert [r.tenant for r in again] == [r.tenant for r in over]
    assert {r.tenant for r in overlay_tenants(over, {"z": 1.0}, overwrite=True)} == {"z"}


def test_overlay_without_ids_uses_request_ids() -> None:
    trace = load_trace("azure-code-fixture")
    over = overlay_tenants(trace, {"x": 1, "y": 1})
    counts = {n: sum(r.tenant == n for r in over) for n in ("x", "y")}
    assert 100 < counts["x"] < 200


def test_cap_output() -> None:
    trace = multi_turn(sessions=3, turns=2, output=400, seed=2)
    capped = cap_output(trace, 50)
    for before, after in zip(trace, capped, strict=True):
        assert after.output_tokens == min(before.output_tokens, 50)
        assert after.max_tokens == 50
        assert after.id_tokens <= after.prompt_tokens + after.output_tokens
    untouched = cap_output(trace, 50, set_max_tokens=False)
    assert all(r.max_tokens is None for r in untouched)
    with pytest.raises(ConfigError):
        cap_output(trace, 0)
