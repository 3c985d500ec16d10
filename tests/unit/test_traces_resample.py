"""New traces from a recorded one: reshuffled gaps (seeds) and superposed copies (wider fleets)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.errors import ConfigError
from controlplane.traces import load_trace, multi_turn, shared_prefix
from controlplane.traces.resample import reshuffle_gaps, superpose


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(1, 2**31))
def test_reshuffled_gaps_keep_requests_order_rate_and_gap_distribution(seed: int) -> None:
    trace = load_trace("mooncake-fixture")
    new = reshuffle_gaps(trace, seed)
    strip = [(r.prompt_tokens, r.output_tokens, r.content_ids, r.request_id) for r in trace]
    assert [(r.prompt_tokens, r.output_tokens, r.content_ids, r.request_id) for r in new] == strip
    assert new.duration_s == pytest.approx(trace.duration_s)
    arrivals = [r.arrival_s for r in new]
    assert arrivals == sorted(arrivals)

    def gaps(t: list[float]) -> list[float]:
        return sorted(round(b - a, 9) for a, b in itertools.pairwise(t))

    assert gaps(arrivals) == gaps([r.arrival_s for r in trace])
    assert new.meta["transforms"][-1] == f"reshuffle_gaps(seed={seed}, run=32)"  # type: ignore[index]


def test_seed_zero_is_the_recording_and_seeds_differ() -> None:
    trace = load_trace("mooncake-fixture")
    assert reshuffle_gaps(trace, 0) is trace
    assert reshuffle_gaps(trace, 1) == reshuffle_gaps(trace, 1)
    assert reshuffle_gaps(trace, 1).requests != reshuffle_gaps(trace, 2).requests


@pytest.mark.parametrize(
    "parts",
    [
        [shared_prefix(groups=3, users=2, prefix=300, question=100, seed=s) for s in (0, 0)],
        [multi_turn(sessions=4, turns=3, seed=s) for s in (1, 2, 3)],
    ],
)
def test_superposed_parts_share_nothing_but_the_fleet(parts: list) -> None:  # type: ignore[type-arg]
    merged = superpose(parts)
    assert len(merged) == sum(len(p) for p in parts)
    arrivals = [r.arrival_s for r in merged]
    assert arrivals == sorted(arrivals)
    assert len({r.request_id for r in merged}) == len(merged)
    ids_by_part: dict[int, set[int]] = {}
    for r in merged:
        k = int(r.request_id.rsplit("~", 1)[1]) if "~" in r.request_id else 0
        ids_by_part.setdefault(k, set()).update(r.content_ids)
    sets = [ids_by_part[k] for k in sorted(ids_by_part)]
    assert len(sets) == len(parts)
    assert all(not (a & b) for i, a in enumerate(sets) for b in sets[i + 1 :])
    # within a part, the sharing structure is kept: same number of distinct ids
    assert [len(s) for s in sets] == [len({c for r in p for c in r.content_ids}) for p in parts]
    with pytest.raises(ConfigError):
        superpose([])


def test_bursts_survive_the_reshuffle() -> None:
    """A burst (a run of short gaps) stays a burst: the gaps move in runs, not one by one."""
    from controlplane.traces.model import Trace, TraceRequest

    gaps = ([1.0] * 31 + [0.001] * 32 + [1.0]) * 8  # 8 bursts of 32 back-to-back requests
    t, reqs = 0.0, [TraceRequest(arrival_s=0.0, prompt_tokens=10, output_tokens=1)]
    for g in gaps:
        t += g
        reqs.append(TraceRequest(arrival_s=t, prompt_tokens=10, output_tokens=1))
    trace = Trace("bursts", tuple(reqs))
    for seed in (1, 2, 3):
        new = [r.arrival_s for r in reshuffle_gaps(trace, seed, run=32).requests]
        short = [b - a < 0.01 for a, b in itertools.pairwise(new)]
        longest = max(len(s) for s in "".join("x" if f else " " for f in short).split())
        assert longest >= 31
    with pytest.raises(ConfigError):
        reshuffle_gaps(trace, 1, run=0)
