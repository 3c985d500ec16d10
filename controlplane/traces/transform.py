"""Pure transformations of a `Trace`; each returns a new trace and appends its provenance to
`meta["transforms"]` (a list of strings such as `"scale_rate(2)"`).

- `scale_rate(trace, s)`: replay at s x the rate by dividing every inter-arrival time by s:
  `t' = t0 + (t - t0) / s`, t0 the first arrival. Never drops or reorders requests; the span
  becomes span / s (numbers.md 7.3: Dynamo's A/B used s = 1.25).
- `rebase(trace)`: shift so the first request arrives at 0.
- `window(trace, start_s, end_s)`: requests with `start_s <= arrival < end_s`, shifted by
  `-start_s` (unless `rebase=False`).
- `densest_window(trace, requests=N | seconds=W)`: "a burst". With N: the N consecutive requests
  of smallest span (first such on ties). With W: the window `[t_i, t_i + W)` starting at a
  request that holds the most requests (earliest on ties). Two-pointer scan, O(n). Rebased so
  the window's first request arrives at 0.
- `head(trace, n)`: the first n requests.
- `concat(traces, gap_s)`: part k starts `gap_s` after part k-1's last arrival (default gap: the
  parts' mean inter-arrival time, so the rate stays). Request ids of parts k >= 1 get a `~k`
  suffix. With `distinct_ids` (default) the content ids of parts k >= 1 are re-mapped, densely,
  to ids above every id of every part (equal ids stay equal within a part, so sharing inside a
  part is kept and nothing is shared across parts) and their session keys get the suffix too;
  without it, a repeated part shares all its content with the earlier copy.
- `repeat(trace, k, gap_s)`: `concat([trace] * k)`.
- `overlay_tenants(trace, shares)`: for traces without tenants. Each request (only those whose
  tenant is "default", unless `overwrite`) is assigned by a 64-bit mix (splitmix64 finaliser) of
  `salt` and its *first content id* mapped to [0, 1) and looked up in the cumulative `shares`,
  so all requests opening with the same block (a common system prompt or document) belong to
  the same tenant. Requests without content ids hash their request id (BLAKE2b) instead.
  Priorities come from `priorities` (default interactive).
- `cap_output(trace, max_output)`: `output_tokens = min(output, cap)`; `id_tokens` is clipped
  to `prompt + cap` (content never generated is not described), and with `set_max_tokens` the
  client's `max_tokens` becomes `min(max_tokens, cap)`, as a client sending that limit would.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import replace
from itertools import accumulate

from controlplane.errors import ConfigError
from controlplane.traces.model import Trace, TraceRequest
from controlplane.types import PriorityClass

_M64 = (1 << 64) - 1


def derive(trace: Trace, requests: Sequence[TraceRequest], step: str, **meta: object) -> Trace:
    history = trace.meta.get("transforms", [])
    steps = [*history, step] if isinstance(history, list) else [step]
    return trace.with_requests(requests, transforms=steps, **meta)


def _shifted(requests: Sequence[TraceRequest], dt: float) -> list[TraceRequest]:
    return [replace(r, arrival_s=r.arrival_s + dt) for r in requests]


def scale_rate(trace: Trace, s: float) -> Trace:
    """Divide inter-arrival times by `s` (s > 1 is faster); keeps every request and the order."""
    if not s > 0:
        raise ConfigError(f"rate scale must be positive, got {s}")
    if not trace.requests:
        return derive(trace, [], f"scale_rate({s:g})")
    t0 = trace.requests[0].arrival_s
    reqs = [replace(r, arrival_s=t0 + (r.arrival_s - t0) / s) for r in trace.requests]
    return derive(trace, reqs, f"scale_rate({s:g})")


def rebase(trace: Trace) -> Trace:
    """Shift arrivals so the first request arrives at 0."""
    if not trace.requests:
        return trace
    return derive(trace, _shifted(trace.requests, -trace.requests[0].arrival_s), "rebase")


def window(trace: Trace, start_s: float, end_s: float, *, rebase: bool = True) -> Trace:
    """Requests arriving in `[start_s, end_s)`, shifted by `-start_s` when `rebase`."""
    if end_s < start_s:
        raise ConfigError(f"empty window [{start_s}, {end_s})")
    picked = [r for r in trace.requests if start_s <= r.arrival_s < end_s]
    reqs = _shifted(picked, -start_s) if rebase else picked
    return derive(trace, reqs, f"window({start_s:g}, {end_s:g})")


def densest_window(
    trace: Trace, *, requests: int | None = None, seconds: float | None = None
) -> Trace:
    """The densest stretch: N consecutive requests of least span, or the busiest W seconds."""
    if (requests is None) == (seconds is None):
        raise ConfigError("densest_window needs exactly one of requests= or seconds=")
    times = [r.arrival_s for r in trace.requests]
    n = len(times)
    if not n:
        return derive(trace, [], "densest_window(empty)")
    if requests is not None:
        if requests <= 0:
            raise ConfigError(f"requests must be positive, got {requests}")
        k = min(requests, n)
        best = min(range(n - k + 1), key=lambda i: (times[i + k - 1] - times[i], i))
        lo, hi, step = best, best + k, f"densest_window(requests={requests})"
    else:
        assert seconds is not None
        if not seconds > 0:
            raise ConfigError(f"seconds must be positive, got {seconds}")
        lo = hi = 0
        j = 0
        for i in range(n):
            j = max(j, i)
            while j < n and times[j] < times[i] + seconds:
                j += 1
            if j - i > hi - lo:
                lo, hi = i, j
        step = f"densest_window(seconds={seconds:g})"
    picked = trace.requests[lo:hi]
    return derive(
        trace, _shifted(picked, -picked[0].arrival_s), step, window_start_s=picked[0].arrival_s
    )


def head(trace: Trace, n: int) -> Trace:
    """The first `n` requests."""
    return derive(trace, trace.requests[: max(0, n)], f"head({n})")


def _max_id(traces: Sequence[Trace]) -> int:
    return max(
        (max(r.content_ids) for t in traces for r in t.requests if r.content_ids), default=-1
    )


def _mean_gap(traces: Sequence[Trace]) -> float:
    gaps = sum(t.duration_s for t in traces)
    count = sum(max(0, len(t) - 1) for t in traces)
    return gaps / count if count else 0.0


def concat(
    traces: Sequence[Trace],
    *,
    gap_s: float | None = None,
    distinct_ids: bool = True,
    name: str | None = None,
) -> Trace:
    """Play the traces one after another (see the module docstring)."""
    if not traces:
        raise ConfigError("concat needs at least one trace")
    gap = _mean_gap(traces) if gap_s is None else gap_s
    next_id = _max_id(traces) + 1
    out: list[TraceRequest] = []
    for k, part in enumerate(traces):
        if not part.requests:
            continue
        shift = (out[-1].arrival_s + gap if out else 0.0) - part.requests[0].arrival_s
        remap: dict[int, int] = {}
        for r in part.requests:
            ids, key, rid = r.content_ids, r.session_key, r.request_id
            if k:
                rid = f"{rid}~{k}"
                if distinct_ids:
                    ids = tuple(remap.setdefault(c, next_id + len(remap)) for c in ids)
                    key = None if key is None else f"{key}~{k}"
            out.append(
                replace(
                    r,
                    arrival_s=r.arrival_s + shift,
                    content_ids=ids,
                    session_key=key,
                    request_id=rid,
                )
            )
        next_id += len(remap)
    step = f"concat({', '.join(t.name for t in traces)}; gap={gap:g}, distinct={distinct_ids})"
    return derive(replace(traces[0], name=name or traces[0].name), out, step)


def repeat(trace: Trace, k: int, *, gap_s: float | None = None, distinct_ids: bool = True) -> Trace:
    """`k` back-to-back copies of the trace (see `concat`)."""
    if k < 1:
        raise ConfigError(f"repeat count must be >= 1, got {k}")
    return concat([trace] * k, gap_s=gap_s, distinct_ids=distinct_ids, name=f"{trace.name}-x{k}")


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijective 64-bit mix."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def overlay_key(request: TraceRequest, salt: int = 0) -> float:
    """Where a request falls in [0, 1) for tenant overlay (first content id, else request id)."""
    if request.content_ids:
        return _mix64(request.content_ids[0] ^ _mix64(salt)) / 2.0**64
    digest = hashlib.blake2b(f"{salt}:{request.request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def overlay_tenants(
    trace: Trace,
    shares: Mapping[str, float],
    *,
    priorities: Mapping[str, PriorityClass] | None = None,
    overwrite: bool = False,
    salt: int = 0,
) -> Trace:
    """Assign tenants by hash of the first content id, in proportion to `shares`."""
    names = list(shares)
    weights = [float(shares[n]) for n in names]
    if not names or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(f"tenant shares must be non-negative with a positive sum: {shares}")
    total = sum(weights)
    bounds = [c / total for c in accumulate(weights)]
    prio = priorities or {}
    reqs = []
    for r in trace.requests:
        if r.tenant != "default" and not overwrite:
            reqs.append(r)
            continue
        i = min(bisect_right(bounds, overlay_key(r, salt)), len(names) - 1)
        name = names[i]
        reqs.append(replace(r, tenant=name, priority=prio.get(name, PriorityClass.INTERACTIVE)))
    desc = ", ".join(f"{n}={w:g}" for n, w in zip(names, weights, strict=True))
    return derive(trace, reqs, f"overlay_tenants({desc}; salt={salt})")


def cap_output(trace: Trace, max_output: int, *, set_max_tokens: bool = True) -> Trace:
    """Clip every output to `max_output` tokens (see the module docstring)."""
    if max_output < 1:
        raise ConfigError(f"output cap must be >= 1, got {max_output}")
    reqs = []
    for r in trace.requests:
        out = min(r.output_tokens, max_output)
        id_tokens = r.id_tokens
        if id_tokens > r.prompt_tokens + out:
            id_tokens = r.prompt_tokens + out
        limit = r.max_tokens
        if set_max_tokens:
            limit = max_output if limit is None else min(limit, max_output)
        reqs.append(replace(r, output_tokens=out, id_tokens=id_tokens, max_tokens=limit))
    return derive(trace, reqs, f"cap_output({max_output})")
