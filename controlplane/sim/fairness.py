"""Per-tenant figures of a simulated run: GPU work shares, Jain's index, latency per tenant/class.

Work is measured in roofline units (`WorkModel` in `vtc-roofline` mode: GPU-seconds at the
reference decode batch) whatever the queue charged, so runs with different fairness modes are
compared on the same scale. A completed request's work is

    prefill  P(prompt - cached, cached)   spread evenly from dispatch to its first token
    decode   sum of D(context) over its output tokens 2..n, spread evenly from first token to
             finish

and a tenant's share is its work inside the *windows* over the windows' total. Fairness is a
statement about tenants that compete, so by default the windows are the times when every tenant
of the trace was backlogged in the router's queue (from `FleetResult.meta["backlog"]`, pieces
shorter than `MIN_WINDOW_S` dropped); without a queue, or when the tenants never all competed,
the trace's arrival span (after the last arrival the queues only drain, and every tenant
eventually gets all it asked for).

`dispatched_share` credits each request's whole work to the moment the queue dispatched it
(requests dispatched inside the windows only): what the queue decided while the tenants competed,
free of the work still running from before (a fleet that filled up with one tenant's requests
while nobody waited).

Jain's index over the weight-normalised shares x_t = share_t / (w_t / sum w):
J = (sum x)^2 / (n sum x^2), 1 when every tenant gets exactly its weight, 1/n at worst.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from controlplane.sim.results import FleetResult, RequestRecord
from controlplane.tenancy.work import WorkModel


def jain_index(values: Sequence[float]) -> float:
    """Jain's fairness index of non-negative values (1.0 for an empty or all-zero list)."""
    total = sum(values)
    squares = sum(v * v for v in values)
    if not values or squares <= 0:
        return 1.0
    return total * total / (len(values) * squares)


MIN_WINDOW_S = 1.0
Windows = Sequence[tuple[float, float]]


def _overlap(a: float, b: float, windows: Windows) -> float:
    """Fraction of [a, b] inside the windows (a point counts when inside one)."""
    if b <= a:
        return 1.0 if any(lo <= a <= hi for lo, hi in windows) else 0.0
    inside = sum(max(0.0, min(b, hi) - max(a, lo)) for lo, hi in windows)
    return inside / (b - a)


def request_work(r: RequestRecord, work: WorkModel, windows: Windows) -> float:
    """Work of one completed request done inside the windows (see the module docstring)."""
    cached = max(0, min(r.cached_tokens, r.prompt_tokens - 1))
    start = r.dispatched_s if r.dispatched_s >= 0 else r.arrival_s
    prefill = work.prefill(r.prompt_tokens - cached, cached)
    decode = work.decode(r.output_tokens - 1, r.prompt_tokens)
    return prefill * _overlap(start, r.first_token_s, windows) + decode * _overlap(
        r.first_token_s, r.finish_s, windows
    )


def _intersect(a: Windows, b: Windows) -> list[tuple[float, float]]:
    out = []
    for lo1, hi1 in a:
        for lo2, hi2 in b:
            lo, hi = max(lo1, lo2), min(hi1, hi2)
            if hi > lo:
                out.append((lo, hi))
    return sorted(out)


def contended_windows(result: FleetResult, tenants: Sequence[str]) -> list[tuple[float, float]]:
    """Times when every one of `tenants` was backlogged in the router's queue (may be empty)."""
    backlog = result.meta.get("backlog")
    if not isinstance(backlog, dict) or len(tenants) < 2:
        return []
    windows: list[tuple[float, float]] | None = None
    for t in tenants:
        spans = [(float(a), float(b)) for a, b in backlog.get(t, [])]
        windows = spans if windows is None else _intersect(windows, spans)
    return [(lo, hi) for lo, hi in windows or [] if hi - lo >= MIN_WINDOW_S]


def _p(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q)) if values else 0.0


def _latency(records: list[RequestRecord]) -> dict[str, float]:
    done = [r for r in records if r.completed]
    multi = [r for r in done if r.output_tokens > 1]
    ttft = [r.ttft_s for r in done]
    tpot = [r.tpot_s for r in multi]
    return {
        "requests": float(len(records)),
        "completed": float(len(done)),
        "ttft_p50_s": _p(ttft, 50),
        "ttft_p99_s": _p(ttft, 99),
        "tpot_p50_s": _p(tpot, 50),
        "tpot_p99_s": _p(tpot, 99),
        "queue_p99_s": _p([max(0.0, r.dispatched_s - r.arrival_s) for r in done], 99),
    }


@dataclass(frozen=True, slots=True)
class TenantFairness:
    """The figures `controlplane replay --fairness` prints and writes."""

    windows_s: list[tuple[float, float]]
    # "contended": every tenant backlogged; "arrivals": the trace's arrival span
    window_kind: str
    tenants: dict[str, dict[str, float]]
    classes: dict[str, dict[str, float]]
    jain: float

    def share(self, tenant: str) -> float:
        return self.tenants.get(tenant, {}).get("work_share", 0.0)

    def to_json(self) -> dict[str, object]:
        return {
            "window": self.window_kind,
            "window_seconds": sum(hi - lo for lo, hi in self.windows_s),
            "windows_s": [list(w) for w in self.windows_s],
            "jain_index": self.jain,
            "tenants": self.tenants,
            "classes": self.classes,
        }


def tenant_fairness(
    result: FleetResult,
    work: WorkModel,
    weights: Mapping[str, float] | None = None,
    windows: Windows | None = None,
) -> TenantFairness:
    """Per-tenant work shares (roofline units), Jain's index and per-tenant/class latency."""
    recs = result.records
    by_tenant: dict[str, list[RequestRecord]] = {}
    by_class: dict[str, list[RequestRecord]] = {}
    for r in recs:
        by_tenant.setdefault(r.tenant, []).append(r)
        by_class.setdefault(r.priority, []).append(r)
    kind = "given"
    if windows is None:
        windows, kind = contended_windows(result, sorted(by_tenant)), "contended"
    if not windows:
        arrivals = [r.arrival_s for r in recs] or [0.0]
        windows, kind = [(min(arrivals), max(arrivals))], "arrivals"
    done_work = {
        t: sum(request_work(r, work, windows) for r in rs if r.completed)
        for t, rs in by_tenant.items()
    }
    total = sum(done_work.values())
    handed = {
        t: sum(
            work.request(r.prompt_tokens, r.output_tokens, r.cached_tokens)
            for r in rs
            if r.completed and _overlap(r.dispatched_s, r.dispatched_s, windows)
        )
        for t, rs in by_tenant.items()
    }
    handed_total = sum(handed.values())
    w = {t: (weights or {}).get(t, 1.0) for t in by_tenant}
    wsum = sum(w.values()) or 1.0
    tenants: dict[str, dict[str, float]] = {}
    for t in sorted(by_tenant):
        share = done_work[t] / total if total > 0 else 0.0
        tenants[t] = {
            "weight": w[t],
            "target_share": w[t] / wsum,
            "work": done_work[t],
            "work_share": share,
            "dispatched_share": handed[t] / handed_total if handed_total > 0 else 0.0,
            **_latency(by_tenant[t]),
        }
    normalised = [tenants[t]["work_share"] / tenants[t]["target_share"] for t in tenants]
    classes = {c: _latency(rs) for c, rs in sorted(by_class.items())}
    return TenantFairness(list(windows), kind, tenants, classes, jain_index(normalised))


__all__ = ["TenantFairness", "jain_index", "request_work", "tenant_fairness"]
