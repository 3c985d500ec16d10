"""The fleet registry and the membership sources a router runs, wired from its settings.

    registry = open_registry(settings, guard, metrics)    # Redis when fleet.shared, else memory
    static = static_source(settings, registry)            # the configured replicas, if any
    sources = membership_sources(settings, registry)      # DNS (and others) when configured
    for s in sources: s.start()

A `PollingSource` calls its blocking `poll` off the event loop every `interval_s` and reports
the whole view (`set_members`). A poll that raises (the source is unreachable) or a report the
registry cannot take (Redis down) is logged and counted, and the previous view stands until the
next round; nothing is raised into the loop. A new source is one more entry in
`membership_sources` (anything with `start()` and `aclose()`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
from collections.abc import Callable, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry

from router.config import ReplicaConfig, RouterSettings
from router.fleet.membership import Member, MembershipSink
from router.fleet.registry import Backend, FleetRegistry, RegistryMetrics
from router.fleet.registry_memory import MemoryBackend
from router.fleet.urls import ReplicaGuard, Resolver, system_resolve

log = logging.getLogger(__name__)

STATIC = "static"


async def stop_task(task: asyncio.Task[None]) -> None:
    """Cancel a loop task and wait for it. A cancellation swallowed inside a client library
    (seen with Redis reads under a timeout) must not hang the shutdown: the loop also checks
    its closing flag each round, and the task is cancelled again until it ends."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=1.0)
    with contextlib.suppress(asyncio.CancelledError):
        task.result()


class Source(Protocol):
    def start(self) -> None: ...
    async def aclose(self) -> None: ...


class PollingSource:
    def __init__(
        self,
        sink: MembershipSink,
        name: str,
        poll: Callable[[], Sequence[Member]],
        interval_s: float,
    ) -> None:
        self.sink = sink
        self.name = name
        self.poll = poll
        self.interval_s = interval_s
        self.failures = 0
        self.last_error: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    async def report_once(self) -> bool:
        """Poll and report now; False when either failed (the previous view stands)."""
        try:
            members = await asyncio.to_thread(self.poll)
            await self.sink.set_members(self.name, members)
        except Exception as exc:  # a source's failure is a missed round, never a crash
            self.failures += 1
            self.last_error = f"{type(exc).__name__}: {exc}"[:300]
            log.warning(
                "membership source failed", extra={"source": self.name, "error": self.last_error}
            )
            return False
        self.last_error = None
        return True

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"source-{self.name}")

    async def _run(self) -> None:
        while not self._closing:
            await self.report_once()
            await asyncio.sleep(self.interval_s)

    async def aclose(self) -> None:
        self._closing = True
        task, self._task = self._task, None
        if task is not None:
            await stop_task(task)


def member_of(cfg: ReplicaConfig) -> Member:
    """A configured (or admin-given) replica as a member, every setting kept in `options`."""
    options = cfg.model_dump(mode="json", exclude={"id", "url", "gpu", "model"})
    return Member(cfg.id, cfg.url, model=cfg.model, gpu=cfg.gpu, options=options)


def static_source(settings: RouterSettings, sink: MembershipSink) -> PollingSource | None:
    """The configured replicas as source "static"; None when there are none (a router
    without configured replicas follows the others': it must not report an empty view). Every
    router sharing a registry lists the same replicas, or none."""
    if not settings.replicas:
        return None
    members = [member_of(r) for r in settings.replicas]
    return PollingSource(sink, STATIC, lambda: members, settings.fleet.resync_s)


def membership_sources(
    settings: RouterSettings,
    sink: MembershipSink,
    *,
    resolve: Resolver | None = None,
    metrics: CollectorRegistry | None = None,
) -> list[Source]:
    """Every source `settings` asks for but the static one (`static_source`, which the router
    reports once before its first sync): DNS, Kubernetes. `resolve`: host name -> addresses
    (tests); `metrics`: where sources register their metrics (the router's registry)."""
    from router.fleet.discovery.dns import dns_source
    from router.fleet.discovery.kubernetes import KubernetesDiscovery

    f = settings.fleet
    sources: list[Source] = []
    if f.dns_name:
        sources.append(
            dns_source(
                sink,
                name=f.dns_name,
                port=f.dns_port,
                scheme=f.dns_scheme,
                interval_s=f.dns_interval_s,
                model=f.dns_model,
                gpu=f.dns_gpu,
                resolve=resolve or system_resolve,
            )
        )
    if f.kubernetes is not None:
        sources.append(KubernetesDiscovery(f.kubernetes, sink, registry=metrics))
    return sources


def open_registry(
    settings: RouterSettings, guard: ReplicaGuard, metrics: RegistryMetrics
) -> FleetRegistry:
    """The registry of `settings.fleet`: in Redis when shared, else this process's own."""
    f = settings.fleet
    backend: Backend
    if f.shared and settings.redis.url:
        from router.fleet.registry_redis import RedisBackend

        backend = RedisBackend(
            settings.redis.url, f.key_prefix, password_env=settings.redis.password_env
        )
    else:
        backend = MemoryBackend()
    return FleetRegistry(
        backend, guard, drain_s=f.drain_timeout_s, ttl_s=f.heartbeat_ttl_s, metrics=metrics
    )


def router_id(settings: RouterSettings) -> str:
    """This router's id in the registry (`fleet.router_id`, else host name, pid and a nonce)."""
    if settings.fleet.router_id:
        return settings.fleet.router_id
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
