"""The routing matrix's pure parts: near-best sets, the summary counts, the knee search."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.sim import matrix
from controlplane.sim.matrix import find_knee, near_best, summarize, workload


@pytest.mark.parametrize(
    ("values", "higher", "expected"),
    [
        ({"a": 10.0, "b": 9.81, "c": 9.79}, True, {"a", "b"}),
        ({"a": 1.0, "b": 1.02, "c": 1.03}, False, {"a", "b"}),
        ({"a": 0.0, "b": 0.0}, True, {"a", "b"}),  # nobody met the SLO: a tie
        ({"a": 5.0}, False, {"a"}),
    ],
)
def test_near_best(values: dict[str, float], higher: bool, expected: set[str]) -> None:
    assert near_best(values, higher_is_better=higher) == expected


def test_summary_counts_cells_per_policy() -> None:
    def cell(good: dict[str, float], p99: dict[str, float]) -> dict[str, object]:
        return {"policies": {k: {"goodput_rps": good[k], "ttft_p99_s": p99[k]} for k in good}}

    cells = [
        cell({"pf": 10.0, "pa": 9.9, "rr": 5.0}, {"pf": 1.0, "pa": 2.0, "rr": 3.0}),
        cell({"pf": 8.0, "pa": 10.0, "rr": 5.0}, {"pf": 1.01, "pa": 1.0, "rr": 3.0}),
    ]
    assert summarize(cells) == {
        "pf": {"best_or_within_2pct_goodput": 1, "best_or_within_2pct_ttft_p99": 2, "cells": 2},
        "pa": {"best_or_within_2pct_goodput": 2, "best_or_within_2pct_ttft_p99": 1, "cells": 2},
        "rr": {"best_or_within_2pct_goodput": 0, "best_or_within_2pct_ttft_p99": 0, "cells": 2},
    }


@settings(max_examples=40, deadline=None)
@given(knee=st.floats(0.2, 50.0), idle_ttft=st.floats(0.05, 3.0), tpot_bound=st.booleans())
def test_knee_search_brackets_the_crossing(knee: float, idle_ttft: float, tpot_bound: bool) -> None:
    """A probe whose TTFT (or TPOT) p99 jumps past its limit at `knee`: the search lands within
    one bisection interval of it, whichever side of 1 it is and whichever SLO binds (knees lie
    above the idle probe's load, 1/8)."""
    limit_ttft = max(matrix.SLO_TTFT_S, 2 * idle_ttft)

    def probe(name: str, seed: int, replicas: int, load: float, **_: object) -> tuple[float, float]:
        over = load > knee and load != matrix.UNLOADED
        if tpot_bound:
            return idle_ttft, (1.0 if over else 0.01)
        return (limit_ttft * 1.5 if over else idle_ttft), 0.01

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(matrix, "probe", probe)
        found = find_knee("any", 8, iterations=8)
    assert abs(math.log(found / knee)) < math.log(2) / 2**7


@pytest.mark.parametrize("name", sorted(matrix.WORKLOADS))
def test_workloads_scale_with_load_and_widen_with_the_fleet(name: str) -> None:
    base = workload(name, 0, 8, 1.0, span_s=20.0, head=200)
    busier = workload(name, 0, 8, 2.0, span_s=20.0, head=200)
    other = workload(name, 1000, 8, 1.0, span_s=20.0, head=200)  # a 16-replica fleet's 2nd copy
    wide = workload(name, 0, 16, 1.0, span_s=20.0, head=200)
    assert busier.duration_s < base.duration_s  # the same first requests, arriving faster
    assert len(wide) == len(base) + len(other)

    def distinct(t: object) -> int:
        return len({c for r in t for c in r.content_ids})  # type: ignore[attr-defined]

    assert distinct(wide) == distinct(base) + distinct(other)
