"""Active health I/O of the live fleet: one probe, one scrape, and the task that schedules them.

`Schedule` is one background task. Each pass it starts, as short-lived child tasks, the probe of
every replica whose probe is due (every `probe_interval_s`, and at once when an ejection expires:
`health.probe_due`) and the scrape of every replica whose scrape is due (every
`scrape_interval_s`), never two of a kind at once for one replica, then sleeps until the next due
time or until woken (a child finished, a replica was added or ejected). Each child is bounded by
its own timeout (`asyncio.timeout` as well as httpx's, so no transport can hang it) and catches
everything but cancellation: a slow or broken replica delays nobody, a bug stops nothing.
`aclose()` cancels the loop and every child and waits for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

import httpx

from controlplane.metrics_scrape import MetricsScrapeError, ScrapedMetrics, parse_metrics
from router.config import HealthConfig
from router.fleet.health import probe_due, start_marker
from router.fleet.live_replica import LiveReplica

log = logging.getLogger(__name__)

_MIN_SLEEP_S = 0.005


async def probe_health(client: httpx.AsyncClient, timeout_s: float) -> str | None:
    """`GET /health`; None when it answered 200, else what went wrong."""
    try:
        async with asyncio.timeout(timeout_s):
            resp = await client.get("/health", timeout=timeout_s)
    except (httpx.HTTPError, TimeoutError) as exc:
        return f"/health: {exc!r}"
    return None if resp.status_code == 200 else f"/health answered {resp.status_code}"


async def fetch_metrics(
    client: httpx.AsyncClient, timeout_s: float, *, model_name: str | None, now_s: float
) -> tuple[ScrapedMetrics, float | None]:
    """`GET /metrics`, parsed, and the process start marker; raises MetricsScrapeError."""
    try:
        async with asyncio.timeout(timeout_s):
            resp = await client.get("/metrics", timeout=timeout_s)
    except (httpx.HTTPError, TimeoutError) as exc:
        raise MetricsScrapeError(f"GET /metrics failed: {exc!r}") from exc
    if resp.status_code != 200:
        raise MetricsScrapeError(f"/metrics answered {resp.status_code}")
    text = resp.text
    return parse_metrics(text, model_name=model_name, now_s=now_s), start_marker(text)


Op = Callable[[LiveReplica], Coroutine[Any, Any, None]]


class Schedule:
    """The background task probing and scraping every replica on its intervals."""

    def __init__(
        self,
        health: HealthConfig,
        clock: Callable[[], float],
        replicas: Callable[[], Iterable[LiveReplica]],
        probe: Op,
        scrape: Op,
    ) -> None:
        self._health = health
        self._clock = clock
        self._replicas = replicas
        self._probe = probe
        self._scrape = scrape
        self._task: asyncio.Task[None] | None = None
        self._ops: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()

    @property
    def running(self) -> bool:
        return self._task is not None

    def wake(self) -> None:
        self._wake.set()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="live-fleet-schedule")

    async def aclose(self) -> None:
        tasks = [t for t in (self._task, *self._ops) if t is not None]
        self._task = None
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @staticmethod
    async def cancel(r: LiveReplica) -> None:
        """Cancel a replica's probe and scrape in flight, and wait for them."""
        ops = [t for t in (r.probe_task, r.scrape_task) if t is not None]
        for t in ops:
            t.cancel()
        await asyncio.gather(*ops, return_exceptions=True)

    async def _run(self) -> None:
        h = self._health
        while True:
            now = self._clock()
            wake_at = now + min(h.probe_interval_s, h.scrape_interval_s)
            for r in list(self._replicas()):
                if r.probe_task is None:
                    hs = r.health
                    due = probe_due(r.next_probe_s, hs.ejected, hs.ejected_until, r.last_probe_s)
                    if now >= due:
                        r.next_probe_s = now + h.probe_interval_s
                        r.probe_task = self._spawn(r, self._probe, "probe")
                    else:
                        wake_at = min(wake_at, due)
                if r.scrape_task is None:
                    if now >= r.next_scrape_s:
                        r.next_scrape_s = now + h.scrape_interval_s
                        r.scrape_task = self._spawn(r, self._scrape, "scrape")
                    else:
                        wake_at = min(wake_at, r.next_scrape_s)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(_MIN_SLEEP_S, wake_at - now)):
                    await self._wake.wait()

    def _spawn(self, r: LiveReplica, op: Op, kind: str) -> asyncio.Task[None]:
        task = asyncio.create_task(_guarded(op, r, kind))
        self._ops.add(task)

        def done(t: asyncio.Task[None]) -> None:
            self._ops.discard(t)
            if r.probe_task is t:
                r.probe_task = None
            elif r.scrape_task is t:
                r.scrape_task = None
            self._wake.set()

        task.add_done_callback(done)
        return task


async def _guarded(op: Op, r: LiveReplica, kind: str) -> None:
    # the coroutine is made here, so a task cancelled before it starts leaves none unawaited
    try:
        await op(r)
    except Exception:  # a bug must not stop the schedule
        log.exception("fleet %s of %s failed", kind, r.replica_id)
