"""New traces of the same kind from a recorded one: seeds for a trace that has none, and a wider
fleet's worth of traffic at the same span.

`reshuffle_gaps(trace, seed)` keeps every request and their order and redraws *when* they
arrive: the recorded inter-arrival gaps, cut into runs of `run` consecutive gaps, are played in a
seeded random order of runs (a block bootstrap). The rate, the gap distribution, the bursts
within a run (a burst is a run of short gaps: shuffling single gaps would spread it out) and
every request's content stay; which requests land in a burst changes. Seed 0 is the trace
itself.

`superpose(traces)` plays several traces at once: their requests merged by arrival time, each
part after the first with its own content ids (and session keys), so the parts share nothing
but the fleet. With `k` reshuffled copies of a trace, a fleet `k` times larger sees per
replica what the original fleet saw, over the same span.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace
from itertools import pairwise

from controlplane.errors import ConfigError
from controlplane.traces.model import Trace, TraceRequest
from controlplane.traces.transform import derive


def reshuffle_gaps(trace: Trace, seed: int, *, run: int = 32) -> Trace:
    """The trace with its runs of `run` inter-arrival gaps in a seeded random order (seed 0:
    unchanged; see the module docstring)."""
    if seed == 0 or len(trace) < 3:
        return trace
    if run < 1:
        raise ConfigError(f"run must be >= 1, got {run}")
    reqs = trace.requests
    all_gaps = [b.arrival_s - a.arrival_s for a, b in pairwise(reqs)]
    runs = [all_gaps[i : i + run] for i in range(0, len(all_gaps), run)]
    random.Random(f"reshuffle:{seed}").shuffle(runs)
    gaps = [g for r in runs for g in r]
    t = reqs[0].arrival_s
    out = [reqs[0]]
    for r, gap in zip(reqs[1:], gaps, strict=True):
        t += gap
        out.append(replace(r, arrival_s=t))
    step = f"reshuffle_gaps(seed={seed}, run={run})"
    return replace(derive(trace, out, step), name=f"{trace.name}-r{seed}")


def superpose(traces: Sequence[Trace], *, name: str | None = None) -> Trace:
    """The traces played at the same time, content ids made distinct per part (see module)."""
    if not traces:
        raise ConfigError("superpose needs at least one trace")
    next_id = 1 + max(
        (max(r.content_ids) for t in traces for r in t.requests if r.content_ids), default=-1
    )
    merged: list[TraceRequest] = []
    for k, part in enumerate(traces):
        remap: dict[int, int] = {}
        for r in part.requests:
            if k == 0:
                merged.append(r)
                continue
            ids = tuple(remap.setdefault(c, next_id + len(remap)) for c in r.content_ids)
            key = None if r.session_key is None else f"{r.session_key}~{k}"
            merged.append(
                replace(r, content_ids=ids, session_key=key, request_id=f"{r.request_id}~{k}")
            )
        next_id += len(remap)
    merged.sort(key=lambda r: r.arrival_s)  # stable: equal times keep part order
    step = f"superpose({', '.join(t.name for t in traces)})"
    return replace(derive(traces[0], merged, step), name=name or f"{traces[0].name}-w{len(traces)}")
