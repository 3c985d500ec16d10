"""The quota hard-bound scenario on a live simulated fleet (used by `test_quota_live.py` and
`bench/quota_bench.py`).

    Redis + 3 simulated replicas (a, b, c) + N router processes (`controlplane serve`), one
    hard-quota tenant; R concurrent requests of that tenant spread round-robin over the routers:
    streamed and not, with and without max_tokens (the cap is then injected), some clients leave
    mid-stream or before the answer, and a replica is killed while it streams (the first one
    whose stream to a client that stays has sent text, so the kill always lands mid-stream).

    admitted tokens = the replicas' own counters: Σ Δ(vllm:prompt_tokens_total +
    vllm:generation_tokens_total). The killed replica's counters die with it, so it is first
    stalled (its engine stops stepping, which freezes the counters with its streams open), read,
    then SIGKILLed: what it admitted is known exactly and its streams still die mid-way.

Settlements come from the store's own counters in Redis (`RedisQuotaStore.stats`), read once
every router has settled (no reservation open), and from the routers' cp_quota_settlements_total.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from redis_server import free_port
from router_fixtures import MODEL, metric_value, sim_args
from sim_fleet import SimReplica

from controlplane.loadgen import replica_of
from controlplane.tenancy.quota import QuotaStats
from controlplane.tenancy.quota_redis import RedisQuotaStore
from deploy.processes import Child, spawn
from router.telemetry import DECISION_HEADER as DECISION

KEY = "cpk-quota-scenario-key"
TENANT = "acme"
COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")
WORDS = ("alpha", "beta", "gamma", "delta", "quota", "tenant", "router", "replica", "window")


@dataclass
class QuotaRun:
    routers: int
    requests: int
    quota_tokens: int
    admitted_tokens: int
    killed_replica: str
    killed_replica_tokens: int
    statuses: Counter[str] = field(default_factory=Counter)
    stats: QuotaStats = field(default_factory=QuotaStats)
    router_settlements: dict[str, float] = field(default_factory=dict)
    router_rejections: float = 0.0

    @property
    def settlements_missing(self) -> int:
        return self.stats.reserved - self.stats.settled

    @property
    def settlements_duplicated(self) -> int:
        return self.stats.duplicate

    def summary(self) -> dict[str, Any]:
        return {
            "routers": self.routers,
            "quota_tokens": self.quota_tokens,
            "admitted_tokens": self.admitted_tokens,
            "settlements_missing": self.settlements_missing,
            "settlements_duplicated": self.settlements_duplicated,
            # context: what the store charged (usage, or whole reservations when unknown), and
            # how the requests ended
            "charged_tokens": self.stats.charged,
            "killed_replica": self.killed_replica,
            "killed_replica_tokens": self.killed_replica_tokens,
            "requests": self.requests,
            "reserved": self.stats.reserved,
            "rejected": self.stats.rejected,
            "outcomes": dict(sorted(self.statuses.items())),
        }


def tokens(url: str) -> int:
    text = httpx.get(f"{url}/metrics", timeout=5.0).text
    return int(sum(metric_value(text, name) for name in COUNTERS))


class RouterProcess:
    """`controlplane serve --config FILE --port P`, in its own session."""

    def __init__(self, config: dict[str, Any], workdir: Path, index: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config_path = workdir / f"router{index}.yaml"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.log_path = workdir / f"router{index}.log"
        self.child: Child | None = None

    def start(self) -> None:
        cp = Path(sys.executable).parent / "controlplane"
        argv = [str(cp), "serve", "--config", str(self.config_path), "--port", str(self.port)]
        env = {**os.environ, "CP_CACHE_SALT_SECRET": "quota-scenario-secret"}
        with self.log_path.open("wb") as log:
            self.child = spawn(argv, env=env, stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self, replicas: int, timeout_s: float = 60.0) -> None:
        assert self.child is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.child.poll() is not None:
                raise RuntimeError(f"router exited: {self.log_path.read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.get(f"{self.url}/ready", timeout=2.0)
                if r.status_code == 200 and r.json()["ready_replicas"] >= replicas:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"router not ready: {self.log_path.read_text()[-2000:]}")

    def stop(self) -> int | None:
        return None if self.child is None else self.child.stop(15.0)


def router_config(
    model_dir: Path, sims: dict[str, SimReplica], redis_url: str, quota_tokens: int
) -> dict[str, Any]:
    return {
        "host": "127.0.0.1",
        "served_model": MODEL,
        "tokenizer": str(model_dir),
        "replicas": [
            {"id": rid, "url": sim.url, "gpu": "cpu", "model": MODEL} for rid, sim in sims.items()
        ],
        "policy": {"name": "round_robin"},
        "redis": {"url": redis_url, "ingest_events": False},
        "tenants": [
            {
                "id": TENANT,
                "api_key_sha256": [hashlib.sha256(KEY.encode()).hexdigest()],
                "quota_tokens": quota_tokens,
                "quota_window_s": 3600.0,  # one window for the whole run
                "quota_mode": "hard",
            }
        ],
        "quota": {"window": "sliding", "default_max_tokens": 48, "reservation_ttl_s": 300.0},
        "health": {"probe_interval_s": 0.5, "scrape_interval_s": 0.25},
        "timeouts": {"ttft_s": 15.0, "idle_s": 10.0},
        # x-cp-decision names the serving replica: the scenario kills the first replica whose
        # stream to a client that stays has sent text
        "telemetry": {"json_logs": True, "log_level": "WARNING", "decision_header": True},
    }


@dataclass
class Doomed:
    """The replica to kill: the first whose stream to a client that will not hang up sent text
    (so the kill lands mid-stream, after the replica counted tokens); `chosen` is set then."""

    replica: str | None = None
    chosen: asyncio.Event = field(default_factory=asyncio.Event)

    def streaming_on(self, replica: str | None) -> None:
        if replica is not None and self.replica is None:
            self.replica = replica
            self.chosen.set()


async def one_request(
    client: httpx.AsyncClient,
    url: str,
    rng: random.Random,
    statuses: Counter[str],
    doomed: Doomed,
) -> None:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 30)))
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": words}]}
    if rng.random() < 0.7:
        body["max_tokens"] = rng.randint(16, 64)
    stream = rng.random() < 0.75
    leave_after = rng.randint(1, 6) if rng.random() < 0.3 else None  # chunks, then hang up
    if not stream:
        timeout = httpx.Timeout(30.0, read=rng.uniform(0.05, 0.4) if leave_after else 30.0)
        try:
            r = await client.post(f"{url}/v1/chat/completions", json=body, timeout=timeout)
            statuses[str(r.status_code)] += 1
        except httpx.ReadTimeout:
            statuses["client_left"] += 1
        return
    body["stream"] = True
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            statuses[str(r.status_code)] += 1
            return
        replica = replica_of(r.headers.get(DECISION)) if leave_after is None else None
        events = 0
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            if '"upstream_died"' in line:
                statuses["upstream_died"] += 1
                return
            if line.strip() == "data: [DONE]":
                statuses["200"] += 1
                return
            events += 1
            if replica is not None and _has_text(line):
                doomed.streaming_on(replica)
            if leave_after is not None and events >= leave_after:
                statuses["client_left"] += 1
                return  # closing the stream here disconnects
        statuses["ended_early"] += 1


def _has_text(line: str) -> bool:
    """A stream event carrying generated text (the first event only names the role)."""
    with contextlib.suppress(ValueError, KeyError, IndexError, TypeError):
        return bool(json.loads(line[len("data:") :])["choices"][0]["delta"].get("content"))
    return False


async def kill_mid_stream(
    sims: dict[str, SimReplica], watch: Doomed, done: asyncio.Event
) -> tuple[str, int]:
    """Once a replica's stream has sent text (`watch`), stall that replica, read its frozen
    counters, SIGKILL it; returns its id and tokens. When no stream qualified before every
    request ended, the first replica goes (the scenario then shows no stream that died)."""
    loop = asyncio.get_running_loop()
    waits = [asyncio.ensure_future(e.wait()) for e in (watch.chosen, done)]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for w in waits:
        w.cancel()
    rid = watch.replica or next(iter(sims))
    doomed = sims[rid]
    await loop.run_in_executor(None, lambda: doomed.set_faults(stall=True))
    before, now = -1, await loop.run_in_executor(None, tokens, doomed.url)
    while now != before:  # the step in progress, if any, has completed
        await asyncio.sleep(0.05)
        before, now = now, await loop.run_in_executor(None, tokens, doomed.url)
    assert doomed.child is not None
    doomed.child.signal(signal.SIGKILL)
    return rid, now


async def drive(
    routers: list[RouterProcess], sims: dict[str, SimReplica], n: int, seed: int
) -> Any:
    rng = random.Random(seed)
    statuses: Counter[str] = Counter()
    done = asyncio.Event()
    limits = httpx.Limits(max_connections=2 * n, max_keepalive_connections=0)
    headers = {"authorization": f"Bearer {KEY}"}
    watch = Doomed()
    async with httpx.AsyncClient(limits=limits, headers=headers, timeout=30.0) as client:
        killer = asyncio.ensure_future(kill_mid_stream(sims, watch, done))
        rngs = [random.Random(rng.random()) for _ in range(n)]
        await asyncio.gather(
            *(
                one_request(client, routers[i % len(routers)].url, rngs[i], statuses, watch)
                for i in range(n)
            )
        )
        done.set()
        killed, killed_tokens = await killer
    return statuses, killed, killed_tokens


async def settled_stats(redis_url: str, timeout_s: float = 20.0) -> QuotaStats:
    store = RedisQuotaStore(redis_url, timeout_s=2.0, client_name="cp-quota-scenario")
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            stats = await store.stats(TENANT)
            if stats.open == 0 or time.monotonic() > deadline:
                return stats
            await asyncio.sleep(0.1)
    finally:
        await store.aclose()


def run_quota_scenario(
    model_dir: Path,
    redis_url: str,
    *,
    routers: int = 4,
    requests: int = 64,
    quota_tokens: int = 2500,
    seed: int = 0,
    speed: float = 0.25,
) -> QuotaRun:
    names = ("a", "b", "c")
    sims = {rid: SimReplica(*sim_args(model_dir, speed=speed)) for rid in names}
    procs: list[RouterProcess] = []
    with tempfile.TemporaryDirectory(prefix="quota-scenario-") as tmp:
        try:
            with ThreadPoolExecutor(3) as pool:
                list(pool.map(SimReplica.start, sims.values()))
            config = router_config(model_dir, sims, redis_url, quota_tokens)
            procs = [RouterProcess(config, Path(tmp), i) for i in range(routers)]
            for p in procs:
                p.start()
            for p in procs:
                p.wait_ready(len(sims))
            base = {rid: tokens(sim.url) for rid, sim in sims.items()}
            statuses, dead, killed = asyncio.run(drive(procs, sims, requests, seed))
            stats = asyncio.run(settled_stats(redis_url))
            admitted = killed - base[dead]
            admitted += sum(tokens(sims[rid].url) - base[rid] for rid in names if rid != dead)
            settlements: Counter[str] = Counter()
            rejections = 0.0
            for p in procs:
                text = httpx.get(f"{p.url}/metrics", timeout=5.0).text
                for outcome in ("settled", "duplicate", "late", "unknown", "deferred"):
                    v = metric_value(text, "cp_quota_settlements_total", outcome=outcome)
                    settlements[outcome] += int(v)
                rejections += metric_value(text, "cp_quota_rejections_total")
            return QuotaRun(
                routers=routers,
                requests=requests,
                quota_tokens=quota_tokens,
                admitted_tokens=admitted,
                killed_replica=dead,
                killed_replica_tokens=killed - base[dead],
                statuses=statuses,
                stats=stats,
                router_settlements=dict(settlements),
                router_rejections=rejections,
            )
        finally:
            codes = [p.stop() for p in procs]
            for sim in sims.values():
                sim.stop()
            # uvicorn re-raises the SIGTERM it handled once shut down: -15 is a clean exit
            if any(c not in (0, -15, None) for c in codes) and sys.exc_info()[0] is None:
                logs = "\n".join(p.log_path.read_text()[-1500:] for p in procs)
                raise RuntimeError(f"a router exited with {codes}:\n{logs}")
