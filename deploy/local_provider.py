"""A local fleet provider: the autoscaler's `Actuator` over replica processes on this machine.

    provider = LocalProvider(registry, FleetSpec(engine="sim", load_time_s=20))
    controller = Controller(settings, policy, provider, scraper)   # autoscaler/controller.py
    ...
    await provider.aclose()                                         # every process stopped

Scale up: start `target - spec` simulated replicas (free ports, the spec's load time, ids
`local-<n>` never reused) and report the whole live set to the fleet registry as source `local`.
Every router sharing the registry probes a new member and routes to it only once it answers
(READY); while it loads it refuses connections and stays LOADING.

Scale down, in this order, so no request is cut and none reaches a replica on its way out:

    1. victims: `autoscaler.victims.deployment_victims` over the live replicas: not READY
       first, then unknown to the routers, then least in flight (the routers' observations;
       the registry does not know a replica's cached blocks, so they count as 0 and the name
       breaks ties)
    2. drain: `registry.drain(victims)`, then `registry.wait_drained(victims, drain_timeout_s)`:
       GONE once every live router has applied the drain and has nothing in flight there (on
       a timeout the scale-down goes on, logged)
    3. withdraw: report the live set without them
    4. stop their processes (SIGTERM to the group, SIGKILL after the grace)

`observe()`: spec = live replicas not on their way out, ready = those the fleet sees READY. A
replica process that exits by itself is withdrawn and no longer counts (the next decision
replaces it). Every step is told to `on_event` as a `ProviderEvent` (spawned, ready, draining,
gone, stopped, exited), with the replica's served-request count where it matters, so a run can
be plotted and checked. Close (`stop`/`aclose`, atexit): every process stopped.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from autoscaler.hosts import FleetObservation
from autoscaler.types import ScaleDecision
from autoscaler.victims import PodState, VictimInfo, deployment_victims
from deploy.local_fleet import FleetSpec, ReplicaLaunch, free_ports, sim_argv, sim_env
from deploy.processes import Child, spawn
from router.config import ReplicaConfig
from router.fleet.registry import FleetRegistry
from router.fleet.sources import member_of

log = logging.getLogger("controlplane.deploy.local_provider")

SOURCE = "local"


class EventKind(StrEnum):
    """A step of one replica's life under the provider (timeline label)."""

    SPAWNED = "spawned"
    READY = "ready"
    DRAINING = "draining"
    GONE = "gone"
    STOPPED = "stopped"
    EXITED = "exited"


@dataclass(frozen=True, slots=True)
class ProviderEvent:
    at: float  # the provider's clock
    replica: str
    kind: EventKind
    served: int | None = None  # requests the replica finished so far (its own counter)
    running: int | None = None  # requests running or waiting on it
    detail: str = ""


@dataclass
class LocalReplica:
    launch: ReplicaLaunch
    child: Child
    log_path: Path
    ready: bool = False
    leaving: bool = False

    @property
    def name(self) -> str:
        return self.launch.name


@dataclass
class LocalProvider:
    """Replica processes on this machine, reported to `registry` as source `local`."""

    registry: FleetRegistry
    spec: FleetSpec = field(default_factory=lambda: FleetSpec(engine="sim", load_time_s=20.0))
    drain_timeout_s: float = 60.0
    clock: Callable[[], float] = time.monotonic
    mode: str = "local"
    on_event: list[Callable[[ProviderEvent], None]] = field(default_factory=list)
    replicas: dict[str, LocalReplica] = field(default_factory=dict, init=False)
    _next: int = field(default=0, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _closed: bool = field(default=False, init=False)
    _log_dir: Path | None = field(default=None, init=False)
    _model_dir: Path | None = field(default=None, init=False)

    # -- the Actuator -----------------------------------------------------------------------------
    async def observe(self) -> FleetObservation:
        self._reap()
        await self._report()
        states = await self._states()
        live = self.live()
        for rep in live:
            if not rep.ready and states.get(rep.name) == "ready":
                rep.ready = True
                self._emit(rep.name, EventKind.READY)
        return FleetObservation(spec=len(live), ready=sum(r.ready for r in live))

    async def apply(self, target: int, decision: ScaleDecision, fleet: FleetObservation) -> bool:
        current = len(self.live())
        if target > current:
            await self.scale_up(target - current)
            log.info("local fleet: %d -> %d (%s)", current, target, decision.reason)
        elif target < current:
            gone = await self.scale_down(current - target)
            log.info("local fleet: %d -> %d (%s), removed %s", current, target,
                     decision.reason, gone)  # fmt: skip
        return True

    # -- scaling ----------------------------------------------------------------------------------
    def live(self) -> list[LocalReplica]:
        """Replicas running and not on their way out (the fleet's `spec`)."""
        return [r for r in self.replicas.values() if not r.leaving]

    @property
    def draining(self) -> int:
        return sum(r.leaving for r in self.replicas.values())

    async def scale_up(self, n: int) -> list[str]:
        await asyncio.to_thread(self._prepare)  # the tiny model, made once (slow the first time)
        # spawned from the loop's own thread: when that is the main thread, the kernel stops
        # the replicas if this process dies without stopping them (PR_SET_PDEATHSIG; a worker
        # thread's exit would fire it too early)
        started = [self._spawn() for _ in range(n)]
        await self._report()
        return started

    async def scale_down(self, n: int) -> list[str]:
        """Choose `n` victims, drain them fleet-wide, withdraw them, then stop them."""
        states = await self._states()
        in_flight = await self._in_flight()
        live = self.live()
        pods = [PodState(r.name, states.get(r.name) == "ready") for r in live]
        info = {
            r.name: VictimInfo(r.name, in_flight[r.name], 0) for r in live if r.name in in_flight
        }
        victims = [v.name for v in deployment_victims(pods, info, n)]
        if not victims:
            return []
        for name in victims:
            self.replicas[name].leaving = True
            self._emit(name, EventKind.DRAINING, detail=str(states.get(name, "unknown")))
        known = [v for v in victims if v in states]
        if known:
            await self.registry.drain(known)
            left = await self.registry.wait_drained(known, self.drain_timeout_s)
            if left:
                log.warning("local fleet: %s not drained in %.0f s, stopping them anyway",
                            sorted(left), self.drain_timeout_s)  # fmt: skip
        async with httpx.AsyncClient(timeout=2.0) as client:
            for name in victims:
                served, running = await _served(client, self.replicas[name].launch.url)
                self._emit(name, EventKind.GONE, served=served, running=running)
        await self._report()
        for name in victims:
            await self._stop_one(name)
        return victims

    async def _stop_one(self, name: str) -> None:
        rep = self.replicas[name]
        async with httpx.AsyncClient(timeout=2.0) as client:
            served, running = await _served(client, rep.launch.url)
        await asyncio.to_thread(rep.child.stop, self.spec.stop_grace_s)
        del self.replicas[name]
        self._emit(name, EventKind.STOPPED, served=served, running=running)

    # -- registry ---------------------------------------------------------------------------------
    async def _report(self) -> None:
        members = [member_of(self._config(r.launch)) for r in self.live()]
        await self.registry.set_members(SOURCE, members)

    async def _states(self) -> dict[str, str]:
        """Fleet-wide state of every replica the registry holds (the routers' probes folded)."""
        snap = await self.registry.load()
        return {str(row["id"]): str(row["state"]) for row in self.registry.fleet_view(snap)}

    async def _in_flight(self) -> dict[str, int]:
        snap = await self.registry.load()
        return {
            str(row["id"]): int(row["in_flight"])  # type: ignore[call-overload]
            for row in self.registry.fleet_view(snap)
        }

    def _config(self, ln: ReplicaLaunch) -> ReplicaConfig:
        return ReplicaConfig(
            id=ln.name,
            url=ln.url,
            gpu=ln.spec.sim_gpu,
            model=ln.spec.sim_model,
            kv_events=ln.events_connect if ln.spec.kv_events else None,
            kv_replay=ln.replay_connect if ln.spec.kv_events else None,
            kv_topic=ln.spec.topic,
        )

    # -- processes --------------------------------------------------------------------------------
    def _prepare(self) -> tuple[Path, Path]:
        with self._lock:
            return self._prepared()

    def _prepared(self) -> tuple[Path, Path]:
        if self._model_dir is None or self._log_dir is None:
            from deploy.tiny_model import default_model_dir, make_tiny_model

            model_dir = self.spec.model_dir
            if model_dir is None:
                model_dir = default_model_dir()
                make_tiny_model(model_dir)
            self._model_dir = model_dir.resolve()
            self._log_dir = self.spec.log_dir or Path(tempfile.mkdtemp(prefix="local-provider-"))
            self._log_dir.mkdir(parents=True, exist_ok=True)
            atexit.register(self.stop)
        return self._model_dir, self._log_dir

    def _spawn(self) -> str:
        with self._lock:
            if self._closed:
                raise RuntimeError("the local provider is closed")
            model_dir, log_dir = self._prepared()
            index, self._next = self._next, self._next + 1
            http, events, replay = free_ports(3, self.spec.host)
            launch = ReplicaLaunch(
                index=index,
                name=f"{SOURCE}-{index}",
                host=self.spec.host,
                port=http,
                events_port=events,
                replay_port=replay,
                spec=replace(self.spec, engine="sim"),
                model_dir=model_dir,
            )
            log_path = log_dir / f"{launch.name}.log"
            with log_path.open("wb") as out:
                child = spawn(
                    sim_argv(launch),
                    env={**_base_env(), **sim_env(launch)},
                    cwd=log_dir,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    die_with_parent=threading.current_thread() is threading.main_thread(),
                )
            self.replicas[launch.name] = LocalReplica(launch, child, log_path)
        self._emit(launch.name, EventKind.SPAWNED, detail=launch.url)
        return launch.name

    def _reap(self) -> None:
        for rep in list(self.replicas.values()):
            code = rep.child.poll()
            if code is not None and not rep.leaving:
                del self.replicas[rep.name]
                self._emit(rep.name, EventKind.EXITED, detail=f"exit code {code}")
                log.warning("local fleet: %s exited with code %s (log %s)",
                            rep.name, code, rep.log_path)  # fmt: skip

    def _emit(self, replica: str, kind: EventKind, **kw: object) -> None:
        event = ProviderEvent(self.clock(), replica, kind, **kw)  # type: ignore[arg-type]
        for listener in self.on_event:
            listener(event)

    def stop(self) -> None:
        """Stop every replica process (idempotent, thread-safe)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)
        children = [r.child for r in self.replicas.values()]
        for child in children:
            child.terminate()
        deadline = time.monotonic() + self.spec.stop_grace_s
        for child in children:
            child.finish(deadline)
        self.replicas.clear()
        if self._log_dir is not None and self.spec.log_dir is None:
            shutil.rmtree(self._log_dir, ignore_errors=True)

    async def aclose(self) -> None:
        await asyncio.shield(asyncio.to_thread(self.stop))


def _base_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}


async def _served(client: httpx.AsyncClient, url: str) -> tuple[int | None, int | None]:
    """(requests finished, requests running or waiting) from a replica's /metrics; None when
    it does not answer."""
    try:
        resp = await client.get(f"{url}/metrics")
        resp.raise_for_status()
    except httpx.HTTPError:
        return None, None
    served = running = 0.0
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            if s.name == "vllm:request_success_total":
                served += s.value
            elif s.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
                running += s.value
    return int(served), int(running)


__all__ = ["SOURCE", "EventKind", "LocalProvider", "LocalReplica", "ProviderEvent"]
