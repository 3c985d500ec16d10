"""The fleet's status as one frozen, JSON-able value: what `GET /admin/status`, the `/status`
page and `controlplane status` show.

    build_status(inputs) -> FleetStatus          pure: no clock, no I/O

1. Each replica row (`LiveReplica.status()`) gets one display state, first match wins:
   `dead` (phase), `ejected` (out of the rotation for a while), `loading`, `draining`, `ready`.
2. Capacity counts the replicas by state; `serving` are the ready ones (the ejected are not).
3. Demand: admitted work not finished (in flight), the backlog (no first token yet) and the
   arrival rate of SLO-priced work in replica-seconds per second, i.e. the replicas it needs
   (None until the router has watched it over a window); it is set against `serving` and the
   replicas still `loading`.
4. Tenant shares: each known tenant's part of the work the fair queue charged (0 when nothing
   was charged yet), with its weight, requests in flight and waiting; the largest share first.
5. The last routing decisions and the attached autoscaler's, newest first (given oldest first:
   equal times keep the later one first).

Nothing here holds a key, a digest, a salt or a replica URL: the value is shown to operators.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeVar

from pydantic import TypeAdapter


class ReplicaDisplay(StrEnum):
    """How a replica is shown (a status value, also the CSS class of its row)."""

    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    EJECTED = "ejected"
    DEAD = "dead"


@dataclass(frozen=True, slots=True)
class ReplicaRow:
    id: str
    state: ReplicaDisplay
    phase: str
    liveness: str
    incarnation: int
    in_flight: int
    running: float
    waiting: float
    kv_usage: float
    eject_reason: str | None = None
    profile: str = ""


@dataclass(frozen=True, slots=True)
class Capacity:
    total: int
    serving: int
    loading: int
    draining: int
    ejected: int
    dead: int


@dataclass(frozen=True, slots=True)
class DemandFigures:
    """What the router's demand meter reads (router/telemetry/demand.py)."""

    in_flight: int
    backlog_requests: int
    backlog_work_s: float
    queued: int
    # SLO-priced work arriving per second = replicas it keeps busy; None: not measured yet
    rate_replicas: float | None = None
    window_s: float = 0.0
    # False: the router's demand signal is switched off (`demand.enabled`), no rate ever
    metered: bool = True


@dataclass(frozen=True, slots=True)
class DecisionEntry:
    """One routing decision of this router (kept in `router/status/ring.py`)."""

    at_s: float  # wall clock (epoch seconds)
    replica: str
    reason: str
    tenant: str
    policy: str
    hit_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ScaleEntry:
    """One decision of an autoscaler attached to this process."""

    at_s: float
    target: int
    reason: str
    ready: int
    loading: int


@dataclass(frozen=True, slots=True)
class TenantInput:
    id: str
    weight: float
    priority: str
    charged_work: float = 0.0
    in_flight: int = 0
    queued: int = 0


@dataclass(frozen=True, slots=True)
class TenantShare:
    id: str
    weight: float
    priority: str
    share: float
    charged_work: float
    in_flight: int
    queued: int


@dataclass(frozen=True, slots=True)
class StatusInputs:
    at_s: float
    model: str
    uptime_s: float
    replicas: Sequence[Mapping[str, Any]]
    demand: DemandFigures
    tenants: Sequence[TenantInput] = ()
    decisions: Sequence[DecisionEntry] = ()
    autoscaler: Sequence[ScaleEntry] = ()
    degraded: Sequence[str] = ()


@dataclass(frozen=True, slots=True)
class FleetStatus:
    at_s: float
    model: str
    uptime_s: float
    status: str  # ok | degraded
    degraded: tuple[str, ...]
    replicas: tuple[ReplicaRow, ...]
    capacity: Capacity
    demand: DemandFigures
    tenants: tuple[TenantShare, ...] = ()
    decisions: tuple[DecisionEntry, ...] = ()
    autoscaler: tuple[ScaleEntry, ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = _ADAPTER.dump_python(self, mode="json")
        return out

    @classmethod
    def from_json(cls, data: Any) -> FleetStatus:
        """Parse what `to_json` gave (pydantic's ValidationError on anything else)."""
        return _ADAPTER.validate_python(data)


_ADAPTER: TypeAdapter[FleetStatus] = TypeAdapter(FleetStatus)
E = TypeVar("E", DecisionEntry, ScaleEntry)


def display_state(row: Mapping[str, Any]) -> ReplicaDisplay:
    phase = str(row.get("phase", ""))
    if phase == ReplicaDisplay.DEAD:
        return ReplicaDisplay.DEAD
    if row.get("ejected"):
        return ReplicaDisplay.EJECTED
    if phase == ReplicaDisplay.LOADING:
        return ReplicaDisplay.LOADING
    if phase == ReplicaDisplay.DRAINING:
        return ReplicaDisplay.DRAINING
    return ReplicaDisplay.READY


def _num(value: Any) -> float:
    return float(value) if isinstance(value, int | float) else 0.0


def replica_row(row: Mapping[str, Any]) -> ReplicaRow:
    return ReplicaRow(
        id=str(row["id"]),
        state=display_state(row),
        phase=str(row.get("phase", "")),
        liveness=str(row.get("liveness", "")),
        incarnation=int(row.get("incarnation") or 0),
        in_flight=int(row.get("in_flight") or 0),
        running=_num(row.get("running")),
        waiting=_num(row.get("waiting")),
        kv_usage=_num(row.get("kv_usage")),
        eject_reason=row.get("eject_reason"),
        profile=str(row.get("profile") or ""),
    )


def capacity_of(rows: Sequence[ReplicaRow]) -> Capacity:
    def n(state: ReplicaDisplay) -> int:
        return sum(1 for r in rows if r.state is state)

    return Capacity(
        total=len(rows),
        serving=n(ReplicaDisplay.READY),
        loading=n(ReplicaDisplay.LOADING),
        draining=n(ReplicaDisplay.DRAINING),
        ejected=n(ReplicaDisplay.EJECTED),
        dead=n(ReplicaDisplay.DEAD),
    )


def tenant_shares(tenants: Sequence[TenantInput]) -> tuple[TenantShare, ...]:
    total = sum(max(0.0, t.charged_work) for t in tenants)
    shares = [
        TenantShare(
            id=t.id,
            weight=t.weight,
            priority=t.priority,
            share=max(0.0, t.charged_work) / total if total > 0 else 0.0,
            charged_work=t.charged_work,
            in_flight=t.in_flight,
            queued=t.queued,
        )
        for t in tenants
    ]
    return tuple(sorted(shares, key=lambda s: (-s.share, s.id)))


def _newest_first(entries: Sequence[E]) -> tuple[E, ...]:
    """By time, newest first; entries given oldest first keep that order reversed on ties."""
    return tuple(sorted(reversed(entries), key=lambda e: -e.at_s))


def build_status(inputs: StatusInputs) -> FleetStatus:
    rows = tuple(sorted((replica_row(r) for r in inputs.replicas), key=lambda r: r.id))
    degraded = tuple(inputs.degraded)
    return FleetStatus(
        at_s=inputs.at_s,
        model=inputs.model,
        uptime_s=inputs.uptime_s,
        status="degraded" if degraded else "ok",
        degraded=degraded,
        replicas=rows,
        capacity=capacity_of(rows),
        demand=inputs.demand,
        tenants=tenant_shares(inputs.tenants),
        decisions=_newest_first(inputs.decisions),
        autoscaler=_newest_first(inputs.autoscaler),
    )


__all__ = [
    "Capacity",
    "DecisionEntry",
    "DemandFigures",
    "FleetStatus",
    "ReplicaDisplay",
    "ReplicaRow",
    "ScaleEntry",
    "StatusInputs",
    "TenantInput",
    "TenantShare",
    "build_status",
    "display_state",
]
