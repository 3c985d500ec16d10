"""An open-loop load generator over routers' OpenAI API: a rate ramp, streamed chat requests.

    ramp = Ramp.parse("0:1,60:8,120:1")           # (seconds: requests/s), linear in between
    result = await run_load(["http://127.0.0.1:8000"], ramp, LoadConfig(max_tokens=32))
    result.ok, result.failed, result.records      # one `RequestRecord` per request

Arrivals: request k leaves when the integral of the rate since the start reaches k (the rate
read at each departure, so a ramp is followed step by step; a rate of 0 sends nothing until it
rises again); the ramp ends at its last point. Requests go round-robin over the URLs, each on
its own streamed POST /v1/chat/completions (httpx) read to the `[DONE]` event. A request
fails on a non-200 answer, a transport error, or a stream that ends without `[DONE]`. The
router's `x-cp-decision` header names the replica that served it (kept in the record). At most
`max_in_flight` requests run at once: beyond it an arrival waits (the generator stays honest
about what it sent, it does not queue unboundedly).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

from controlplane.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Ramp:
    """Piecewise-linear request rate: points (t seconds, requests per second), t increasing."""

    points: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        if not self.points:
            raise ConfigError("a ramp needs at least one point")
        if any(r < 0 for _, r in self.points) or any(t < 0 for t, _ in self.points):
            raise ConfigError("ramp times and rates must be >= 0")
        times = [t for t, _ in self.points]
        if any(b <= a for a, b in itertools.pairwise(times)):
            raise ConfigError("ramp times must increase")

    @classmethod
    def parse(cls, text: str) -> Ramp:
        """`"T:RATE,T:RATE,..."`, e.g. `"0:1,60:8,120:1"`."""
        points = []
        for item in text.split(","):
            t, sep, rate = item.strip().partition(":")
            try:
                if not sep:
                    raise ValueError
                points.append((float(t), float(rate)))
            except ValueError:
                raise ConfigError(f"ramp point {item!r} is not T:RATE") from None
        return cls(tuple(points))

    @property
    def duration_s(self) -> float:
        return self.points[-1][0]

    def rate_at(self, t: float) -> float:
        pts = self.points
        if t <= pts[0][0]:
            return pts[0][1]
        for (t0, r0), (t1, r1) in itertools.pairwise(pts):
            if t <= t1:
                return r0 + (r1 - r0) * (t - t0) / (t1 - t0)
        return pts[-1][1]

    def departures(self, step_s: float = 0.01) -> list[float]:
        """The send times over the whole ramp (integral of the rate reaching 1, 2, ...)."""
        out: list[float] = []
        acc, end = 0.0, self.duration_s
        for i in range(math.ceil(end / step_s)):
            t0, t1 = i * step_s, min(end, (i + 1) * step_s)
            acc += self.rate_at((t0 + t1) / 2) * (t1 - t0)
            while acc >= 1.0:
                acc -= 1.0
                out.append(t1)
        return out


@dataclass(frozen=True, slots=True)
class LoadConfig:
    model: str = "tiny-llama"
    max_tokens: int = 64
    prompt: str = "Tell me a story about a fleet of replicas."
    api_key: str = "unused"
    max_in_flight: int = 256
    timeout_s: float = 60.0


@dataclass(frozen=True, slots=True)
class RequestRecord:
    index: int
    url: str
    sent_s: float  # since the start of the run
    done_s: float
    status: int  # 0: no HTTP answer
    ok: bool
    replica: str | None  # from the router's x-cp-decision header
    error: str = ""


@dataclass
class LoadResult:
    records: list[RequestRecord] = field(default_factory=list)

    @property
    def ok(self) -> int:
        return sum(r.ok for r in self.records)

    @property
    def failed(self) -> int:
        return sum(not r.ok for r in self.records)


def replica_of(header: str | None) -> str | None:
    """The replica id in an `x-cp-decision` header (`arm=..; replica=..; ...`)."""
    for part in (header or "").split(";"):
        key, _, value = part.strip().partition("=")
        if key == "replica" and value and value != "-":
            return value
    return None


async def _one(
    client: httpx.AsyncClient, url: str, index: int, cfg: LoadConfig, t0: float
) -> RequestRecord:
    body = {
        "model": cfg.model,
        "max_tokens": cfg.max_tokens,
        "stream": True,
        "messages": [{"role": "user", "content": f"{cfg.prompt} ({index})"}],
    }
    sent = time.monotonic() - t0
    status, replica, done, error = 0, None, False, ""
    try:
        async with client.stream(
            "POST", f"{url}/v1/chat/completions", json=body,
            headers={"authorization": f"Bearer {cfg.api_key}"},
        ) as resp:  # fmt: skip
            status = resp.status_code
            replica = replica_of(resp.headers.get("x-cp-decision"))
            async for line in resp.aiter_lines():
                if line.strip() == "data: [DONE]":
                    done = True
            if status != 200:
                error = f"HTTP {status}"
            elif not done:
                error = "stream ended without [DONE]"
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    ok = status == 200 and done
    return RequestRecord(index, url, sent, time.monotonic() - t0, status, ok, replica, error)


async def run_load(
    urls: Sequence[str],
    ramp: Ramp,
    cfg: LoadConfig | None = None,
    *,
    on_record: Callable[[RequestRecord], None] | None = None,
) -> LoadResult:
    """Send the ramp's requests to `urls` (round-robin); wait for every one to end."""
    if not urls:
        raise ConfigError("load needs at least one router URL")
    cfg = cfg or LoadConfig()
    result = LoadResult()
    slots = asyncio.Semaphore(cfg.max_in_flight)
    bases = itertools.cycle([u.rstrip("/") for u in urls])
    limits = httpx.Limits(max_connections=cfg.max_in_flight)

    async with httpx.AsyncClient(timeout=cfg.timeout_s, limits=limits) as client:

        async def send(index: int, url: str) -> None:
            try:
                rec = await _one(client, url, index, cfg, t0)
            finally:
                slots.release()
            result.records.append(rec)
            if on_record is not None:
                on_record(rec)

        t0 = time.monotonic()
        tasks: list[asyncio.Task[None]] = []
        try:
            for index, at in enumerate(ramp.departures()):
                delay = at - (time.monotonic() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                await slots.acquire()
                tasks.append(asyncio.create_task(send(index, next(bases))))
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    result.records.sort(key=lambda r: r.index)
    return result


__all__ = ["LoadConfig", "LoadResult", "Ramp", "RequestRecord", "replica_of", "run_load"]
