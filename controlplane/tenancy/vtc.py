"""The fair-queue ordering: virtual token counters (VTC, Sheng et al., OSDI 2024), pure.

State: one virtual counter per tenant (the work it was served, divided by its weight) and the set
of *backlogged* tenants (those with requests waiting in the queue). Events:

    on_arrival(t)   t becomes backlogged. If it was not, it is lifted to the smallest counter
                    among the backlogged tenants (to the largest counter of all when nobody is
                    backlogged: the system's virtual time), never lowered: a tenant that was
                    idle banks no credit it could later spend starving the others.
    on_idle(t)      t's queue emptied; its counter stays.
    pick(classes)   the next tenant to dispatch, among the backlogged tenants named in `classes`
                    (the caller leaves out tenants whose next request cannot go now): interactive
                    before batch, then the smallest counter, ties to the smallest tenant id.
    charge(t, w, weight)   counter += w / weight (prefill at admission, decode as it streams)
    refund(t, w, weight)   counter -= w / weight, never below 0 (cached prompt tokens at finish)

The charged work comes from `controlplane.tenancy.work.WorkModel`: one per request gives a
request-fair queue (dispatch by request count across tenants, the baseline), tokens give VTC,
roofline seconds give `vtc-roofline`. Invariants (tested with Hypothesis): counters never
decrease except by refunds; `pick` returns a backlogged tenant; while two tenants stay
backlogged their counters stay within one charge of each other (the served one was the smaller
when picked) plus whatever streams in after dispatch.

Everything here is a pure function over a frozen `VtcState`: the simulator and the live router
(`router/fairness/queue.py`) run the same code.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from controlplane.types import PriorityClass


@dataclass(frozen=True)
class VtcState:
    counters: Mapping[str, float] = field(default_factory=dict)
    backlogged: frozenset[str] = frozenset()

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def spread(self) -> float:
        """Largest minus smallest counter among the backlogged tenants (0 with fewer than two)."""
        values = [self.counter(t) for t in self.backlogged]
        return max(values) - min(values) if len(values) > 1 else 0.0


def _with(state: VtcState, tenant: str, value: float) -> VtcState:
    counters = dict(state.counters)
    counters[tenant] = value
    return VtcState(MappingProxyType(counters), state.backlogged)


def virtual_floor(state: VtcState) -> float:
    """The counter an arriving tenant is lifted to (see the module docstring)."""
    if state.backlogged:
        return min(state.counter(t) for t in state.backlogged)
    return max(state.counters.values(), default=0.0)


def on_arrival(state: VtcState, tenant: str) -> VtcState:
    """`tenant` has a request waiting; lift it if it was not backlogged."""
    if tenant in state.backlogged:
        return state
    lifted = max(state.counter(tenant), virtual_floor(state))
    counters = dict(state.counters)
    counters[tenant] = lifted
    return VtcState(MappingProxyType(counters), state.backlogged | {tenant})


def on_idle(state: VtcState, tenant: str) -> VtcState:
    """`tenant` has nothing waiting any more."""
    if tenant not in state.backlogged:
        return state
    return VtcState(state.counters, state.backlogged - {tenant})


def pick(state: VtcState, classes: Mapping[str, PriorityClass]) -> str | None:
    """The backlogged tenant (among `classes`) to dispatch next, or None."""
    best: tuple[int, float, str] | None = None
    for tenant, cls in classes.items():
        if tenant not in state.backlogged:
            continue
        key = (0 if cls is PriorityClass.INTERACTIVE else 1, state.counter(tenant), tenant)
        if best is None or key < best:
            best = key
    return None if best is None else best[2]


def charge(state: VtcState, tenant: str, work: float, weight: float = 1.0) -> VtcState:
    """Add `work / weight` to the tenant's counter."""
    if weight <= 0:
        raise ValueError(f"tenant weight must be positive, got {weight}")
    if work <= 0:
        return state
    return _with(state, tenant, state.counter(tenant) + work / weight)


def refund(state: VtcState, tenant: str, work: float, weight: float = 1.0) -> VtcState:
    """Take `work / weight` back (work charged that the GPU did not do), not below 0."""
    if weight <= 0:
        raise ValueError(f"tenant weight must be positive, got {weight}")
    if work <= 0:
        return state
    return _with(state, tenant, max(0.0, state.counter(tenant) - work / weight))


__all__ = ["VtcState", "charge", "on_arrival", "on_idle", "pick", "refund", "virtual_floor"]
