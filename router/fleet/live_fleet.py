"""The live router's view of its fleet: one `LiveReplica` per configured replica, kept current.

    fleet = LiveFleet(settings, ledger=ledger)
    await fleet.refresh()          # one probe + scrape round now (startup)
    await fleet.start()            # then the background task keeps it current
    snap = fleet.snapshot()        # what the routing policy sees
    fleet.record_slow("r1", SlowReason.TTFT)   # the proxy's passive health signals
    await fleet.aclose()

Per replica, one pooled `httpx.AsyncClient` (connect timeout `timeouts.connect_s`, no read
timeout: the proxy applies its own deadlines). One background task runs the schedule: each
replica's `GET /health` every `health.probe_interval_s` and `GET /metrics` every
`health.scrape_interval_s`, each as a short-lived child task bounded by its timeout, so a slow
replica delays nobody; a replica never has two probes (or two scrapes) in flight. An ejected
replica is probed as soon as its ejection expires.

Membership (add, drain, resume, remove) is driven by the fleet registry through
`router.fleet.follower`: this class holds one router's replicas, the registry decides which.

Lifecycle (`LiveReplica.phase`, computed):

    LOADING  --good probe and good scrape (block size agrees with the fleet)-->  READY
    READY    --consecutive_failures failed probes-->  DEAD
    DEAD     --good probe-->  LOADING, as a new incarnation
    any      --drain()-->  DRAINING (still probed; in-flight requests finish); resume() undoes it
    any      --remove()-->  DEAD, forgotten, client closed, ledger entries dropped

Health is `router.fleet.health`: DOWN (DEAD) through failed probes; ejected (`ReplicaState.ejected`,
phase unchanged) through the proxy's `record_failure` (`consecutive_failures` in a row, no cap) and
`record_slow` (at once, capped by `max_ejected_fraction`: DEAD and ejected members count as out,
LOADING and DRAINING replicas are not members); back through a good probe once `ejected_until`
has passed, for twice as long on the next ejection. Calls for unknown ids are ignored (a replica
removed meanwhile). `ejections`, `restarts`, `spared` and the `on_eject` / `on_restart` callbacks
feed telemetry.

Every scrape sets `metrics` and the
prefix-cache counters and calls `ledger.scraped(id, t)` with the time `t` the scrape *started*. The
KV block size and count come from the `ReplicaConfig`, else from `vllm:cache_config_info`, and
size the replica's roofline profile.

Self-description: the first good scrape of each incarnation also asks the replica what it is
(`controlplane.replica_info.describe_replica`: `/v1/models`, `/version`, cache config; retried
every `probe_interval_s` while it fails). `groups` (`router.fleet.groups`) is recomputed
whenever a replica is admitted or removed: replicas per served model and their drift. A drifted
replica (block size, `max_model_len`, prefix caching, hash algorithm or version unlike its
group's) is still admitted, scored as a prefix miss and logged once per change; the router's
`/metrics` reads `groups` (`cp_replica_drift`). `on_described` callbacks get each description
(the router re-keys the replica's KV events by its model).

Restart detection: a replica is a new incarnation (`incarnation += 1`, `on_restart` callbacks,
which clear its prefix-index entries) when it comes back after being DOWN, or when a scrape shows
its start marker (`process_start_time_seconds`, else the earliest `*_created` sample) moved
forward or its cumulative prefix-cache query counter went backwards.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable

import httpx

from controlplane.errors import ConfigError, ReplicaDescriptionError, UnknownReplicaError
from controlplane.metrics_scrape import MetricsScrapeError
from controlplane.replica_info import ReplicaInfo, describe_replica
from controlplane.routing.ledger import RouterLedger
from controlplane.types import FleetSnapshot, Ledger, Phase
from router.config import ReplicaConfig, RouterSettings
from router.fleet.groups import ModelGroups, drift_changes, model_groups
from router.fleet.health import (
    EjectReason,
    FailureReason,
    Liveness,
    ProbeOutcome,
    SlowReason,
    may_eject_for_slowness,
)
from router.fleet.lifecycle import Seen
from router.fleet.live_replica import LiveReplica
from router.fleet.probes import Schedule, fetch_metrics, probe_health

__all__ = ["EjectReason", "FailureReason", "LiveFleet", "LiveReplica", "SlowReason"]

log = logging.getLogger(__name__)

_EMPTY = Ledger()


class LiveFleet:
    """Every replica this router knows, their health and their last metrics."""

    def __init__(
        self,
        settings: RouterSettings,
        *,
        ledger: RouterLedger | None = None,
        clock: Callable[[], float] = time.monotonic,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.settings = settings
        self.ledger = ledger
        self._clock = clock
        # shared by every replica's client (tests pass an httpx.MockTransport)
        self._transport = transport
        self._replicas: dict[str, LiveReplica] = {}
        self._restart_cbs: list[Callable[[str], None]] = []
        self._eject_cbs: list[Callable[[str, EjectReason], None]] = []
        self._described_cbs: list[Callable[[str, ReplicaInfo], None]] = []
        self.groups = ModelGroups()
        self._grouped: dict[str, ReplicaInfo] = {}
        # telemetry: ejections by (replica, reason), restarts by replica, slow ejections refused
        # by the max_ejected_fraction cap by replica
        self.ejections: Counter[tuple[str, EjectReason]] = Counter()
        self.restarts: Counter[str] = Counter()
        self.spared: Counter[str] = Counter()
        self._schedule = Schedule(
            settings.health, clock, self._replicas.values, self._probe, self._scrape
        )
        for cfg in settings.replicas:
            self.add(cfg)

    # -- membership ------------------------------------------------------------------------------
    def add(self, cfg: ReplicaConfig) -> LiveReplica:
        if cfg.id in self._replicas:
            raise ConfigError(f"replica {cfg.id!r} already exists")
        r = LiveReplica(
            cfg,
            connect_s=self.settings.timeouts.connect_s,
            transport=self._transport,
            model_groups=tuple(self.settings.models),
        )
        self._replicas[cfg.id] = r
        self._schedule.wake()
        return r

    def drain(self, replica_id: str) -> None:
        self.get(replica_id).draining = True
        log.info("replica draining", extra={"replica": replica_id})

    def resume(self, replica_id: str) -> None:
        """Undo a drain (a source reports the replica again before it left)."""
        self.get(replica_id).draining = False
        log.info("replica resumed", extra={"replica": replica_id})

    def is_drained(self, replica_id: str) -> bool:
        """Draining and no request of this router is still in flight on it."""
        r = self.get(replica_id)
        return r.draining and self._view(replica_id).requests == 0

    async def remove(self, replica_id: str) -> None:
        r = self.get(replica_id)
        del self._replicas[replica_id]
        r.removed = True
        await self._schedule.cancel(r)
        r.upstream.close()
        await r.client.aclose()
        if self.ledger is not None:
            self.ledger.drop_replica(replica_id)
        log.info("replica removed", extra={"replica": replica_id})
        self._regroup()

    def get(self, replica_id: str) -> LiveReplica:
        try:
            return self._replicas[replica_id]
        except KeyError:
            raise UnknownReplicaError(f"unknown replica {replica_id!r}") from None

    def replicas(self) -> list[LiveReplica]:
        return list(self._replicas.values())

    def on_restart(self, callback: Callable[[str], None]) -> None:
        self._restart_cbs.append(callback)

    def on_eject(self, callback: Callable[[str, EjectReason], None]) -> None:
        self._eject_cbs.append(callback)

    def on_described(self, callback: Callable[[str, ReplicaInfo], None]) -> None:
        """Called with (replica id, its description) each time a replica describes itself."""
        self._described_cbs.append(callback)

    # -- views -----------------------------------------------------------------------------------
    def _view(self, replica_id: str) -> Ledger:
        return self.ledger.view(replica_id) if self.ledger is not None else _EMPTY

    def snapshot(self) -> FleetSnapshot:
        now = self._clock()
        states = tuple(r.state(self._view(r.replica_id), now) for r in self._replicas.values())
        return FleetSnapshot(states, now)

    def block_size(self, model: str | None = None) -> int | None:
        """The block size of `model`'s group (its reference configuration's); without a group
        (or a model), the READY replicas' block size; before any is READY, the first known."""
        group = self.groups.get(model) if model is not None else None
        if group is not None and group.block_size is not None:
            return group.block_size
        ready = [r.block_size for r in self._replicas.values() if r.phase is Phase.READY]
        known = ready + [r.block_size for r in self._replicas.values()]
        return next((b for b in known if b is not None), None)

    def seen(self) -> dict[str, Seen]:
        """What this router publishes to the registry: phase, ejected, in flight per replica."""
        now = self._clock()
        return {
            r.replica_id: Seen(
                str(r.phase), r.health.is_ejected(now), self._view(r.replica_id).requests
            )
            for r in self._replicas.values()
        }

    def ready_count(self) -> int:
        """Replicas a request may be routed to now (READY and not ejected)."""
        now = self._clock()
        return sum(1 for r in self._replicas.values() if r.routable(now))

    def status(self) -> list[dict[str, object]]:
        now = self._clock()
        return [r.status(now, self._view(r.replica_id).requests) for r in self._replicas.values()]

    # -- passive health --------------------------------------------------------------------------
    def record_success(self, replica_id: str) -> None:
        r = self._replicas.get(replica_id)
        if r is not None:
            r.health.on_success()

    def record_failure(self, replica_id: str, reason: FailureReason) -> None:
        """A hard failure; `consecutive_failures` in a row eject, whatever the fleet's state.
        Unknown ids (a replica removed meanwhile) are ignored."""
        r = self._replicas.get(replica_id)
        if r is None:
            return
        r.last_error = f"proxy: {reason}"
        if r.health.on_failure(self.settings.health.consecutive_failures):
            self._eject(r, EjectReason.FAILURES)

    def record_slow(self, replica_id: str, reason: SlowReason) -> bool:
        """Eject a READY replica for slowness unless the `max_ejected_fraction` cap forbids it;
        returns whether this call ejected it."""
        r = self._replicas.get(replica_id)
        now = self._clock()
        if r is None or r.phase is not Phase.READY or r.health.is_ejected(now):
            return False
        members = [m for m in self._replicas.values() if m.phase in (Phase.READY, Phase.DEAD)]
        out = sum(1 for m in members if m.phase is Phase.DEAD or m.health.is_ejected(now))
        if not may_eject_for_slowness(len(members), out, self.settings.health.max_ejected_fraction):
            self.spared[replica_id] += 1
            log.warning(
                "slow replica kept: ejecting it would exceed max_ejected_fraction",
                extra={"replica": replica_id, "reason": str(reason)},
            )
            return False
        self._eject(r, EjectReason(reason.value))
        return True

    def _eject(self, r: LiveReplica, reason: EjectReason) -> None:
        h = self.settings.health
        duration = r.health.eject(self._clock(), reason, h.eject_s, h.eject_max_s)
        self._ejected(r, reason, duration)
        self._schedule.wake()  # the loop probes it again when the ejection expires

    def _ejected(self, r: LiveReplica, reason: EjectReason, duration: float | None) -> None:
        self.ejections[(r.replica_id, reason)] += 1
        log.warning(
            "replica ejected",
            extra={"replica": r.replica_id, "reason": str(reason), "for_s": duration},
        )
        for cb in self._eject_cbs:
            _call(cb, r.replica_id, reason)

    def _new_incarnation(self, r: LiveReplica, why: str) -> None:
        r.incarnation += 1
        r.health.failures = 0
        r.forget_description()
        self.restarts[r.replica_id] += 1
        log.warning(
            "replica restarted",
            extra={"replica": r.replica_id, "incarnation": r.incarnation, "why": why},
        )
        for cb in self._restart_cbs:
            _call(cb, r.replica_id)

    # -- active health: probes and scrapes --------------------------------------------------------
    async def start(self) -> None:
        """Start the background probes and scrapes (`router.fleet.probes.Schedule`)."""
        self._schedule.start()

    async def aclose(self) -> None:
        await self._schedule.aclose()
        for r in self._replicas.values():
            r.upstream.close()
            await r.client.aclose()

    async def refresh(self) -> None:
        """Probe every replica, then scrape every replica, now (concurrently across replicas)."""
        rs = list(self._replicas.values())
        await asyncio.gather(*(self._probe(r) for r in rs))
        await asyncio.gather(*(self._scrape(r) for r in rs))

    async def _probe(self, r: LiveReplica) -> None:
        h = self.settings.health
        started = r.last_probe_s = self._clock()
        error = await probe_health(r.client, h.probe_timeout_s)
        if r.removed or started < r.probe_applied_s:
            return
        r.probe_applied_s = started
        if error is not None:
            r.last_error = error
        now = self._clock()
        outcome = r.health.on_probe(error is None, now, h.consecutive_failures)
        if outcome is ProbeOutcome.WENT_DOWN:
            self._ejected(r, EjectReason.DOWN, None)
        elif outcome is ProbeOutcome.CAME_BACK:
            r.came_back(now)
            self._new_incarnation(r, "came back after failed probes")
        elif outcome is ProbeOutcome.READMITTED:
            log.info("replica re-admitted", extra={"replica": r.replica_id})
        self._update_ready(r)

    async def _scrape(self, r: LiveReplica) -> None:
        started = self._clock()
        try:
            scraped, marker = await fetch_metrics(
                r.client,
                self.settings.health.scrape_timeout_s,
                model_name=self.settings.served_model,
                now_s=started,
            )
        except MetricsScrapeError as exc:
            r.scrape_failures += 1
            r.last_error = str(exc)
            return
        if r.removed or started < r.scrape_applied_s:
            return
        r.scrape_applied_s = started
        why = r.take_scrape(scraped, marker)
        if self.ledger is not None:
            self.ledger.scraped(r.replica_id, started)
        if why is not None:
            self._new_incarnation(r, why)
        if r.info is None and started >= r.next_describe_s:
            await self._describe(r)
        self._update_ready(r)

    async def _describe(self, r: LiveReplica) -> None:
        h = self.settings.health
        r.next_describe_s = self._clock() + h.probe_interval_s
        try:
            info = await describe_replica(r.client, r.url, timeout_s=h.scrape_timeout_s)
        except ReplicaDescriptionError as exc:
            r.describe_error = str(exc)
            return
        except Exception as exc:  # a bug must not keep the replica from being admitted
            log.exception("describing replica %s failed", r.replica_id)
            r.describe_error = f"describing it failed: {exc!r}"
            return
        if not r.removed:
            r.take_description(info)
            for cb in self._described_cbs:
                _call(cb, r.replica_id, info)
            log.info(
                "replica described",
                extra={
                    "replica": r.replica_id,
                    "models": list(info.model_names),
                    "profile": r.profile.label,
                    "profile_source": str(r.profile_source),
                    "profile_error": r.profile_error,
                },
            )

    def _update_ready(self, r: LiveReplica) -> None:
        """Admit a replica that is up and scraped; then regroup (its drift may have changed)."""
        if r.health.liveness is not Liveness.UP or not r.scraped or r.profile_error:
            return
        if not r.ready:
            r.ready = True
            log.info("replica ready", extra={"replica": r.replica_id})
        self._regroup()

    def _regroup(self) -> None:
        """Recompute the model groups over the admitted replicas; log and report drift changes."""
        default = self.settings.served_model
        infos = {
            o.replica_id: o.described(default)
            for o in self._replicas.values()
            if o.phase in (Phase.READY, Phase.DRAINING)
        }
        if infos == self._grouped:  # every scrape lands here: most change nothing
            return
        self._grouped = infos
        before, after = self.groups, model_groups(infos)
        self.groups = after
        changes = drift_changes(before, after)
        drift = after.drift_of()
        for o in self._replicas.values():
            o.drift = tuple(f for _, f in drift.get(o.replica_id, ()))
        for rid, fields in changes:
            what = ", ".join(f"{m}:{f}" for m, f in fields) or "none"
            level = logging.WARNING if fields else logging.INFO
            log.log(level, "replica drift", extra={"replica": rid, "drift": what})


def _call(cb: Callable[..., None], *args: object) -> None:
    try:
        cb(*args)
    except Exception:  # a subscriber's bug must not break health tracking
        log.exception("fleet callback failed")
