"""The closed autoscaling loop on one machine: router, headroom autoscaler and local replicas in
one process (what `controlplane up --autoscale` serves).

    opts = AutoscaleOptions(load_time_s=20, min_replicas=1, max_replicas=4)
    asyncio.run(serve_autoscaled(router_settings, opts))    # until SIGTERM/SIGINT

One event loop runs three things:

1. the router (`router.http.server.RouterHttpServer`) over a `RouterRuntime` whose fleet
   registry is shared in Redis (`fleet.shared`), with no static replicas: it routes to whatever
   the registry holds, once its own probes find it READY;
2. a `deploy.local_provider.LocalProvider` reporting replica processes to that registry;
3. the `autoscaler.controller.Controller` ticking every `tick_s`: it scrapes this router's
   `/metrics` (and any `peer_routers` sharing the registry) for demand, asks the headroom
   policy (`local_policy`: the production policy with its time constants scaled down to the
   short local load time) and actuates through the provider.

Its decisions go to the router's status view (`router.status.ScaleLog`), and, with `timeline`,
every tick and provider event is appended to a JSON-lines file (`Timeline`) a run can be
plotted from. The router's shutdown (a signal) ends the loop; the provider then stops every
replica process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import httpx

from autoscaler.controller import AutoscalerSettings, Controller, RouterScraper, TickResult
from autoscaler.forecast import ForecastConfig
from autoscaler.headroom import HeadroomConfig, HeadroomPolicy
from controlplane.errors import ConfigError
from deploy.local_fleet import FleetSpec
from deploy.local_provider import LocalProvider, ProviderEvent
from router.config import RouterSettings

log = logging.getLogger("controlplane.deploy.local_autoscale")

# the production policy is tuned for a 240 s load time; locally everything scales with this
REFERENCE_LOAD_TIME_S = 240.0


@dataclass(frozen=True, slots=True)
class AutoscaleOptions:
    load_time_s: float = 20.0  # each new replica refuses connections this long
    min_replicas: int = 1
    max_replicas: int = 4
    initial_replicas: int = 1
    tick_s: float = 2.0
    drain_timeout_s: float = 60.0
    speed: float = 1.0  # the simulated replicas' time speed-up
    # the roofline profile (gpu, model) the simulated replicas run at, the routers measure
    # demand in and the policy sizes by: a 32B model on one A100: a few
    # requests per second need several replicas (a local machine can send that many)
    profile: tuple[str, str] = ("a100", "qwen3-32b")
    peer_routers: tuple[str, ...] = ()  # other routers sharing the registry (their demand)
    timeline: Path | None = None  # JSON lines: ticks and provider events
    policy_params: dict[str, Any] = field(default_factory=dict)  # HeadroomConfig overrides

    def __post_init__(self) -> None:
        if self.load_time_s < 0:
            raise ConfigError("the load time must be >= 0 seconds")
        if self.tick_s <= 0 or self.drain_timeout_s <= 0:
            raise ConfigError("the tick and the drain timeout must be > 0 seconds")
        known = {f.name for f in fields(HeadroomConfig)} - {"capacity", "forecast"}
        unknown = sorted(set(self.policy_params) - known)
        if unknown:
            raise ConfigError(f"unknown headroom parameter(s) {unknown}")
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ConfigError(
                f"need 0 <= min ({self.min_replicas}) <= max ({self.max_replicas}), max >= 1"
            )


def local_policy(
    load_time_s: float,
    tick_s: float,
    profile_key: tuple[str, str] = ("a100", "qwen3-32b"),
    **overrides: Any,
) -> HeadroomPolicy:
    """The headroom policy with its time constants scaled from the production load time to
    `load_time_s` (memory, hysteresis, re-use horizon, warm-up, forecast smoothing), the
    capacity of the simulated replicas' roofline profile at the default SLOs."""
    from autoscaler.capacity import SloCapacity
    from controlplane.roofline import profile

    k = load_time_s / REFERENCE_LOAD_TIME_S
    capacity = SloCapacity.build(profile(*profile_key, tp=1), 2.0, 0.1)
    config = HeadroomConfig(
        capacity,
        warmup_s=max(2 * tick_s, 60.0 * k),
        hysteresis_s=max(2 * tick_s, 300.0 * k),
        reuse_horizon_s=max(2 * tick_s, 300.0 * k),
        burst_memory_s=max(10 * tick_s, 3600.0 * k),
        # time is scaled, demand is not: the miniature's few small requests a second are a
        # sliver of one replica of the profile's prefill, so the production floor (1 replica)
        # would put every decision in light-traffic mode; the miniature's scenarios (a 1 -> 3
        # -> 1 step) keep the relative burst memory they were written for
        burst_floor=0.0,
        forecast=ForecastConfig(
            tick_s=tick_s,
            alpha=0.3,
            beta=0.05,
            season_s=0.0,
            horizon_target="level",
            shift_confirm_s=max(2 * tick_s, 90.0 * k),
            sigma_tau_s=max(10 * tick_s, 600.0 * k),
            trend_damping_s=max(10 * tick_s, 1800.0 * k),
        ),
    )
    unknown = [key for key in overrides if not hasattr(config, key)]
    if unknown:
        raise ConfigError(f"unknown headroom parameter(s) {unknown}")
    return HeadroomPolicy(replace(config, **overrides))


def router_config(
    opts: AutoscaleOptions,
    *,
    redis_url: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    policy: str = "prefix_affinity",
) -> dict[str, Any]:
    """The settings (as plain values) of a router in front of the local autoscaled fleet: no
    static replicas, the registry shared in Redis, demand priced in the replicas' profile.
    A second router given the same values follows the same fleet."""
    from deploy.tiny_model import default_model_dir, make_tiny_model

    model_dir = default_model_dir()
    make_tiny_model(model_dir)
    gpu, model = opts.profile
    return {
        "host": host, "port": port, "served_model": "tiny-llama",
        "tokenizer": str(model_dir), "policy": {"name": policy}, "redis": {"url": redis_url},
        "fleet": {"shared": True}, "demand": {"gpu": gpu, "model": model},
        "shutdown": {"drain_s": 0.0}, "telemetry": {"decision_header": True},
    }  # fmt: skip


class Timeline:
    """Ticks and provider events, one JSON object a line, stamped with seconds since start."""

    def __init__(self, path: Path, provider: LocalProvider, clock: Callable[[], float]) -> None:
        self.path = path
        self.provider = provider
        self.clock = clock
        self.t0 = clock()
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = path.open("a", encoding="utf-8")

    def _write(self, row: dict[str, Any]) -> None:
        self._fh.write(json.dumps(row, sort_keys=True) + "\n")
        self._fh.flush()

    def tick(self, result: TickResult) -> None:
        s = result.sample
        self._write(
            {
                "kind": "tick",
                "t": round(self.clock() - self.t0, 3),
                "target": result.decision.target,
                "reason": str(result.decision.reason),
                "ordered": result.fleet.spec,
                "ready": result.fleet.ready,
                "draining": self.provider.draining,
                "demand": round(s.rate, 6),
                "arrivals_per_s": round(s.arrivals / s.interval_s, 4) if s.interval_s else 0.0,
            }
        )

    def event(self, ev: ProviderEvent) -> None:
        row = asdict(ev)
        row["t"] = round(ev.at - self.t0, 3)
        row["kind"] = str(ev.kind)
        del row["at"]
        self._write(row)

    def close(self) -> None:
        self._fh.close()


async def serve_autoscaled(settings: RouterSettings, opts: AutoscaleOptions) -> None:
    """Serve the router with the autoscaler and its local fleet until the router stops."""
    from router.http.server import RouterHttpServer
    from router.http.service import create_app
    from router.runtime import RouterRuntime
    from router.status.scale_log import ScaleLog

    runtime = RouterRuntime(settings)
    scale_log = ScaleLog()
    runtime.status_sources.append(scale_log.entries)
    server = RouterHttpServer(settings, create_app(settings, runtime))
    spec = FleetSpec(
        engine="sim", base_port=0, speed=opts.speed, load_time_s=opts.load_time_s,
        max_model_len=4096, sim_gpu=opts.profile[0], sim_model=opts.profile[1],
    )  # fmt: skip
    provider = LocalProvider(runtime.registry, spec, drain_timeout_s=opts.drain_timeout_s)
    clock = time.monotonic
    timeline = Timeline(opts.timeline, provider, clock) if opts.timeline else None
    if timeline is not None:
        provider.on_event.append(timeline.event)
    serving = asyncio.get_running_loop().create_task(server.serve())
    stop = asyncio.Event()
    control: asyncio.Task[None] | None = None
    client = httpx.AsyncClient(timeout=3.0)
    try:
        while not server.server.started and not serving.done():
            await asyncio.sleep(0.05)
        if not serving.done():
            url = f"http://{settings.host}:{server.ports['main']}"
            ctl_settings = AutoscalerSettings(
                routers=[url, *opts.peer_routers],
                model=settings.served_model or "",
                tick_s=opts.tick_s,
                # the first estimate of the lead time (then measured); never under one tick
                load_time_s=max(opts.load_time_s, opts.tick_s),
                min_replicas=opts.min_replicas,
                max_replicas=opts.max_replicas,
            )
            policy = local_policy(opts.load_time_s, opts.tick_s, opts.profile, **opts.policy_params)
            scraper = RouterScraper(ctl_settings.routers, ctl_settings.model, client)
            controller = Controller(ctl_settings, policy, provider, scraper, clock=clock)
            controller.on_tick.append(scale_log.record)
            if timeline is not None:
                controller.on_tick.append(timeline.tick)
            start = min(max(opts.initial_replicas, opts.min_replicas), opts.max_replicas)
            await provider.scale_up(start)
            control = asyncio.get_running_loop().create_task(controller.run(stop))
        await asyncio.shield(serving)
    finally:
        stop.set()
        if control is not None:
            control.cancel()  # a scale-down may be waiting for a drain: nothing to wait for
            with contextlib.suppress(asyncio.CancelledError):
                await control
        if not serving.done():
            server.server.should_exit = True
            with contextlib.suppress(Exception):
                await serving
        await client.aclose()
        await provider.aclose()
        if timeline is not None:
            timeline.close()


__all__ = ["AutoscaleOptions", "Timeline", "local_policy", "router_config", "serve_autoscaled"]
