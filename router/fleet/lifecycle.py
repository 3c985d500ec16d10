"""The fleet registry's decisions, as pure functions over frozen records (no I/O, no clock).

Per replica one `Record`; its `state` is what the registry decides:

    (new)     --a source reports it-->                       LOADING (a member; probes decide READY)
    LOADING   --no source reports it any more-->             DRAINING (reason UNREPORTED)
    LOADING   --drain(ids) (admin API, autoscaler)-->        DRAINING (reason ADMIN)
    DRAINING  --reported again, drained as UNREPORTED,
                or added again through the admin source-->   LOADING
    DRAINING  --every live router applied the drain and has
                nothing in flight on it, or the deadline-->  GONE (every router removes it)
    GONE      --reported again-->                            LOADING, a new record; a replica the
                                                             operator drained (ADMIN) comes back
                                                             only through the admin source

READY and EJECTED are not decided here: each router observes them with its own probes and
publishes them (`Observation`, with the registry version it has applied and its in-flight count
per replica); `observed_state` folds them into one fleet-wide view. An observation older than the
heartbeat TTL is a dead router's and counts for nothing (it cannot block a drain). Every changed
record is stamped with the registry version that changed it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from router.fleet.membership import Member

ADMIN_SOURCE = "admin"


class Lifecycle(StrEnum):
    LOADING = "loading"
    READY = "ready"
    EJECTED = "ejected"
    DRAINING = "draining"
    GONE = "gone"


class DrainReason(StrEnum):
    UNREPORTED = "unreported"  # no source reports it any more
    ADMIN = "admin"  # drained on purpose (admin API, autoscaler)


class Refusal(StrEnum):
    """Why a reported member did not enter the registry (metric label)."""

    URL = "url"  # the replica guard refused its URL
    ID = "id"  # the replica guard refused its id
    URL_CONFLICT = "url_conflict"  # another source reports this id at another URL
    DUPLICATE = "duplicate"  # the same id twice in one report


@dataclass(frozen=True, slots=True)
class Record:
    replica_id: str
    url: str
    state: Lifecycle
    version: int
    sources: tuple[str, ...] = ()
    model: str | None = None
    gpu: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    options: Mapping[str, object] = field(default_factory=dict)
    drain_reason: DrainReason | None = None
    drain_deadline: float | None = None

    def to_json(self) -> str:
        return json.dumps(
            {
                "id": self.replica_id,
                "url": self.url,
                "state": str(self.state),
                "version": self.version,
                "sources": list(self.sources),
                "model": self.model,
                "gpu": self.gpu,
                "labels": dict(self.labels),
                "options": dict(self.options),
                "drain_reason": self.drain_reason and str(self.drain_reason),
                "drain_deadline": self.drain_deadline,
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Record:
        d: dict[str, Any] = json.loads(text)
        return cls(
            replica_id=d["id"],
            url=d["url"],
            state=Lifecycle(d["state"]),
            version=int(d["version"]),
            sources=tuple(d["sources"]),
            model=d["model"],
            gpu=d["gpu"],
            labels=d["labels"],
            options=d["options"],
            drain_reason=DrainReason(d["drain_reason"]) if d["drain_reason"] else None,
            drain_deadline=d["drain_deadline"],
        )


@dataclass(frozen=True, slots=True)
class Seen:
    """One replica as one router sees it."""

    phase: str  # the router's Phase value: loading, ready, draining, dead
    ejected: bool
    in_flight: int


@dataclass(frozen=True, slots=True)
class Observation:
    """What one router published: when, the registry version it has applied, its replicas."""

    router_id: str
    at: float
    version: int
    replicas: Mapping[str, Seen]

    def to_json(self) -> str:
        reps = {k: [v.phase, v.ejected, v.in_flight] for k, v in self.replicas.items()}
        return json.dumps({"router": self.router_id, "at": self.at, "v": self.version, "r": reps})

    @classmethod
    def from_json(cls, text: str | bytes) -> Observation:
        d = json.loads(text)
        reps = {k: Seen(str(p), bool(e), int(n)) for k, (p, e, n) in d["r"].items()}
        return cls(str(d["router"]), float(d["at"]), int(d["v"]), reps)


Records = Mapping[str, Record]


def _new(source: str, m: Member, version: int) -> Record:
    return Record(
        m.replica_id,
        m.url,
        Lifecycle.LOADING,
        version,
        (source,),
        m.model,
        m.gpu,
        dict(m.labels),
        dict(m.options),
    )


def apply_member(
    records: Records, source: str, m: Member, version: int
) -> tuple[Record | None, Refusal | None]:
    """The record after `source` reports `m` (None: unchanged), or why `m` is refused."""
    rec = records.get(m.replica_id)
    if rec is None:
        return _new(source, m, version), None
    if rec.state is Lifecycle.GONE:
        sticky = rec.drain_reason is DrainReason.ADMIN and source != ADMIN_SOURCE
        return (None if sticky else _new(source, m, version)), None
    if rec.url != m.url:
        if set(rec.sources) <= {source}:  # its only source moved it: a new replica
            return _new(source, m, version), None
        return None, Refusal.URL_CONFLICT
    sources = tuple(sorted({*rec.sources, source}))
    new = replace(rec, sources=sources)
    undrain = rec.drain_reason is DrainReason.UNREPORTED or source == ADMIN_SOURCE
    if rec.state is Lifecycle.DRAINING and undrain:
        new = replace(new, state=Lifecycle.LOADING, drain_reason=None, drain_deadline=None)
    return (None if new == rec else replace(new, version=version)), None


def withdraw(rec: Record, source: str, version: int, now: float, drain_s: float) -> Record | None:
    """The record once `source` no longer reports it (None: unchanged)."""
    if source not in rec.sources:
        return None
    sources = tuple(s for s in rec.sources if s != source)
    new = replace(rec, sources=sources, version=version)
    if not sources and rec.state is Lifecycle.LOADING:
        new = _draining(new, DrainReason.UNREPORTED, now + drain_s)
    return new


def apply_report(
    records: Records,
    source: str,
    members: Iterable[Member],
    version: int,
    now: float,
    drain_s: float,
) -> tuple[dict[str, Record], list[tuple[Member, Refusal]]]:
    """`source`'s whole view replaces its previous one: the changed records, the refused."""
    changed: dict[str, Record] = {}
    refused: list[tuple[Member, Refusal]] = []
    seen: set[str] = set()
    for m in members:
        if m.replica_id in seen:
            refused.append((m, Refusal.DUPLICATE))
            continue
        seen.add(m.replica_id)
        rec, why = apply_member(records, source, m, version)
        if why is not None:
            refused.append((m, why))
        elif rec is not None:
            changed[m.replica_id] = rec
    for rec in records.values():
        if rec.replica_id not in seen:
            gone = withdraw(rec, source, version, now, drain_s)
            if gone is not None:
                changed[rec.replica_id] = gone
    return changed, refused


def _draining(rec: Record, reason: DrainReason, deadline: float) -> Record:
    return replace(rec, state=Lifecycle.DRAINING, drain_reason=reason, drain_deadline=deadline)


def apply_drain(
    records: Records, ids: Iterable[str], version: int, now: float, drain_s: float
) -> dict[str, Record]:
    """Drain on purpose (ADMIN): members go DRAINING; an UNREPORTED drain becomes ADMIN (so no
    source brings it back); GONE and unknown ids are left alone."""
    changed = {}
    for i in ids:
        rec = records.get(i)
        if rec is None or rec.state is Lifecycle.GONE or rec.drain_reason is DrainReason.ADMIN:
            continue
        deadline = rec.drain_deadline if rec.drain_deadline is not None else now + drain_s
        changed[i] = replace(_draining(rec, DrainReason.ADMIN, deadline), version=version)
    return changed


def live(observations: Iterable[Observation], now: float, ttl_s: float) -> list[Observation]:
    """The observations of routers whose heartbeat is younger than `ttl_s`."""
    return [o for o in observations if now - o.at <= ttl_s]


def settle(
    records: Records, observations: Iterable[Observation], version: int, now: float, ttl_s: float
) -> dict[str, Record]:
    """DRAINING records that are done: every live router applied the drain (its observation is
    at the record's version or later) and has nothing in flight on it; or the deadline passed."""
    routers = live(observations, now, ttl_s)
    changed = {}
    for rec in records.values():
        if rec.state is not Lifecycle.DRAINING:
            continue
        late = rec.drain_deadline is not None and now >= rec.drain_deadline
        applied = all(o.version >= rec.version for o in routers)
        busy = sum(
            o.replicas[rec.replica_id].in_flight for o in routers if rec.replica_id in o.replicas
        )
        if late or (applied and busy == 0):
            changed[rec.replica_id] = replace(rec, state=Lifecycle.GONE, version=version)
    return changed


def observed_state(rec: Record, routers: Iterable[Observation]) -> Lifecycle:
    """The fleet-wide state: the registry's, refined for members by the routers' probes (READY
    when a router routes to it, EJECTED when every router that probes it found it out)."""
    if rec.state is not Lifecycle.LOADING:
        return rec.state
    seen = [o.replicas[rec.replica_id] for o in routers if rec.replica_id in o.replicas]
    if any(s.phase == "ready" and not s.ejected for s in seen):
        return Lifecycle.READY
    if seen and all(s.ejected or s.phase == "dead" for s in seen):
        return Lifecycle.EJECTED
    return Lifecycle.LOADING
