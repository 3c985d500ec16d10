"""Live-fleet helpers shared by `router_overhead.py` and `live_quality.py`.

* `sim_fleet(...)`: simulated vLLM replicas as subprocesses (deploy.local_fleet), KV events on.
* `OurRouter`: the project's router as its own process, as in production: a YAML config file and
  `controlplane serve --config FILE --port P` (JSON logs at WARNING, the local tokenizer).
* `VllmRouter`: the Rust `vllm-router` (pip package `vllm-router`) in front of the same URLs.
* `stream_one` / `open_loop`: an asyncio + httpx load generator. Arrivals are open-loop Poisson
  at a fixed rate (a late generator fires overdue requests at once, it never skips them); every
  request streams, and its TTFT is measured from the moment its task starts sending to the first
  SSE event that carries content (chat `delta.content` or completions `text`). How late each send
  started against its schedule is recorded beside it (`Phase.late_s`): it is the client's own
  queueing, the same whatever the target, and is kept out of TTFT so it does not blur the
  router's share. Throughput is computed from the scheduled times.
* `cpu_s(pids)`: CPU seconds (user + system) used so far by processes and their process groups.

Every process is started in its own session and stopped by its process-group id on exit
(`deploy.processes`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import yaml

from deploy.local_fleet import FleetSpec, LocalFleet, free_ports
from deploy.processes import Child, group_pids, spawn

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny-llama"


def sim_fleet(
    replicas: int,
    *,
    speed: float,
    num_gpu_blocks: int | None = None,
    max_model_len: int = 1024,
    max_num_seqs: int = 64,
    block_size: int = 32,
    dev_mode: bool = False,
) -> LocalFleet:
    """A started fleet of simulated replicas (KV events on); the caller stops it."""
    spec = FleetSpec(
        replicas=replicas,
        engine="sim",
        base_port=0,
        model_name=MODEL,
        speed=speed,
        kv_events=True,
        num_gpu_blocks=num_gpu_blocks,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        block_size=block_size,
        extra_env=(("VLLM_SERVER_DEV_MODE", "1"),) if dev_mode else (),
    )
    return LocalFleet(spec).start()


def _bin(name: str) -> str | None:
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


def vllm_router_binary() -> str | None:
    return _bin("vllm-router")


def sglang_router_binary() -> str | None:
    return _bin("sglang-router")


def bench_tenants(
    n: int, *, quota_tokens: int = 10**9
) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """`n` tenants (`t0`, `t1`, ...) for a router config, each with one API key and a hard token
    quota far above what a bench sends (so every request pays the quota's reservation and
    settlement, and none is refused), and the matching request headers, one per tenant."""
    tenants, headers = [], []
    for i in range(n):
        key = f"sk-bench-{i:04d}-{hashlib.sha256(str(i).encode()).hexdigest()[:24]}"
        tenants.append(
            {
                "id": f"t{i}",
                "api_key_sha256": [hashlib.sha256(key.encode()).hexdigest()],
                "quota_tokens": quota_tokens,
                "quota_window_s": 60.0,
                "quota_mode": "hard",
            }
        )
        headers.append({"authorization": f"Bearer {key}"})
    return tenants, headers


class _Process:
    """A server subprocess in its own session, with a log file; stopped by its group id."""

    name = "server"

    def __init__(self) -> None:
        self.child: Child | None = None
        self.port = free_ports(1)[0]
        self._tmp = Path(tempfile.mkdtemp(prefix=f"bench-{self.name}-"))
        self.log_path = self._tmp / "server.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        raise NotImplementedError

    def ready(self, client: httpx.Client) -> bool:
        raise NotImplementedError

    def start(self, timeout_s: float = 60.0) -> None:
        argv = self.argv()
        with self.log_path.open("wb") as log:
            self.child = spawn(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as client:
            while True:
                if self.child.poll() is not None:
                    raise RuntimeError(f"{self.name} exited:\n{self.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if self.ready(client):
                        return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f} s")
                time.sleep(0.2)

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop(10.0)
        self.child = None
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> _Process:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class OurRouter(_Process):
    """`controlplane serve --config FILE --port P [--workers N]` in front of `fleet` (KV events
    followed)."""

    name = "router"

    def __init__(
        self,
        fleet: LocalFleet | None,
        *,
        policy: str = "prefix_affinity",
        redis_url: str | None = None,
        extra: dict[str, Any] | None = None,
        workers: int = 1,
        replicas: list[dict[str, Any]] | None = None,
        tokenizer: str | None = None,
    ) -> None:
        """In front of `fleet`, or of `replicas` (the router config's rows: id, url, gpu,
        model, kv_events, kv_replay, kv_topic) with `tokenizer`."""
        super().__init__()
        if fleet is not None:
            tokenizer = str(fleet.replicas[0].launch.model_dir)
            replicas = [
                {
                    "id": rep.name,
                    "url": rep.url,
                    "gpu": "cpu",
                    "model": MODEL,
                    "kv_events": rep.launch.events_connect,
                    "kv_replay": rep.launch.replay_connect,
                    "kv_topic": rep.launch.spec.topic,
                }
                for rep in fleet.replicas
            ]
        assert replicas and tokenizer, "a fleet, or replicas and a tokenizer"
        self.replicas = replicas
        self.workers = workers
        self.config: dict[str, Any] = {
            "host": "127.0.0.1",
            "served_model": MODEL,
            "tokenizer": tokenizer,
            "replicas": replicas,
            "policy": {"name": policy},
            "redis": {"url": redis_url},
            "telemetry": {"json_logs": True, "log_level": "WARNING"},
            **(extra or {}),
        }
        self.config_path = self._tmp / "router.yaml"

    def argv(self) -> list[str]:
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        cp = _bin("controlplane")
        assert cp is not None, "the controlplane script is not installed (pip install -e .)"
        argv = [cp, "serve", "--config", str(self.config_path), "--port", str(self.port)]
        return argv + (["--workers", str(self.workers)] if self.workers > 1 else [])

    def ready(self, client: httpx.Client) -> bool:
        resp = client.get(f"{self.url}/ready")
        return bool(
            resp.status_code == 200 and resp.json().get("ready_replicas") == len(self.replicas)
        )


class _PeerRouter(_Process):
    """A peer's router process with `--policy` in front of `urls` (its metrics on a port of
    its own); ready when it answers /v1/models."""

    def __init__(self, urls: Sequence[str], policy: str) -> None:
        super().__init__()
        self.urls = list(urls)
        self.policy = policy
        self.prometheus_port = free_ports(1)[0]

    def ready(self, client: httpx.Client) -> bool:
        return client.get(f"{self.url}/v1/models").status_code == 200


class VllmRouter(_PeerRouter):
    """The Rust `vllm-router` with `--policy` in front of `urls`."""

    name = "vllm-router"

    def argv(self) -> list[str]:
        binary = vllm_router_binary()
        assert binary is not None, "vllm-router is not installed"
        return [
            binary,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--policy", self.policy,
            "--worker-urls", *self.urls,
            "--prometheus-port", str(self.prometheus_port),
            "--log-level", "warning",
        ]  # fmt: skip


class SglangRouter(_PeerRouter):
    """The Rust `sglang-router` (pip package `sglang-router`, `sglang-router launch`) with
    `--policy` in front of `urls`: its HTTP router passes OpenAI requests through to any
    OpenAI-compatible worker."""

    name = "sglang-router"

    def argv(self) -> list[str]:
        binary = sglang_router_binary()
        assert binary is not None, "sglang-router is not installed"
        return [
            binary, "launch",
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--policy", self.policy,
            "--worker-urls", *self.urls,
            "--prometheus-port", str(self.prometheus_port),
            "--log-level", "warn",
        ]  # fmt: skip


# -- load generation --------------------------------------------------------------------------


@dataclass(slots=True)
class Result:
    target: str
    scheduled: float  # perf_counter of the planned send
    sent: float = float("nan")  # perf_counter when the request's task started sending
    ttft: float = float("nan")  # seconds from `sent` to the first content chunk
    done: float = float("nan")  # perf_counter when the stream ended
    error: str = ""
    cached_tokens: int = -1  # usage.prompt_tokens_details.cached_tokens, when reported

    @property
    def ok(self) -> bool:
        return not self.error


def _has_content(event: dict[str, Any]) -> bool:
    for choice in event.get("choices") or ():
        delta = choice.get("delta")
        if (delta and delta.get("content")) or choice.get("text"):
            return True
    return False


async def stream_one(
    client: httpx.AsyncClient,
    url: str,
    body: bytes,
    res: Result,
    timeout_s: float = 30.0,
    headers: Mapping[str, str] | None = None,
) -> Result:
    """POST `body` (a streaming request) to `url` with `headers` added (e.g. an API key); fill
    `res` with TTFT, end time or error."""
    headers = {"content-type": "application/json", **(headers or {})}
    res.sent = time.perf_counter()
    try:
        async with (
            asyncio.timeout(timeout_s),
            client.stream("POST", url, content=body, headers=headers) as resp,
        ):
            if resp.status_code != 200:
                await resp.aread()
                res.error = f"HTTP {resp.status_code}"
                return res
            buf = b""
            tail = b""
            usage: dict[str, Any] | None = None
            async for chunk in resp.aiter_bytes():
                if res.ttft != res.ttft:  # nan: still looking for the first content
                    buf += chunk
                    *events, buf = buf.split(b"\n\n")
                    for ev in events:
                        data = ev.strip().removeprefix(b"data: ")
                        if data and data != b"[DONE]" and _has_content(json.loads(data)):
                            res.ttft = time.perf_counter() - res.sent
                            break
                tail = (tail + chunk)[-4096:]
            if b"[DONE]" not in tail:
                res.error = "stream ended without [DONE]"
                return res
            for ev in tail.split(b"\n\n"):
                data = ev.strip().removeprefix(b"data: ")
                if data.startswith(b"{") and b'"usage"' in data:
                    with contextlib.suppress(ValueError):
                        usage = json.loads(data).get("usage") or usage
            if usage:
                details = usage.get("prompt_tokens_details") or {}
                res.cached_tokens = int(details.get("cached_tokens") or 0)
            res.done = time.perf_counter()
            if res.ttft != res.ttft:
                res.error = "no content"
    except TimeoutError:
        res.error = "timeout"
    except httpx.HTTPError as exc:
        res.error = type(exc).__name__
    return res


def new_client(connections: int = 1024) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(30.0, connect=5.0))


@dataclass(slots=True)
class Phase:
    """What one open-loop phase sent and got back."""

    rate: float
    results: list[Result] = field(default_factory=list)
    late_s: list[float] = field(default_factory=list)  # how late each send actually started


async def open_loop(
    client: httpx.AsyncClient,
    rate: float,
    duration_s: float,
    request: Callable[[int], tuple[str, str, bytes, Mapping[str, str]]],
    rng: random.Random,
    *,
    first_index: int = 0,
    drain_s: float = 15.0,
    timeout_s: float = 30.0,
) -> Phase:
    """Poisson arrivals at `rate`/s for `duration_s`; `request(i)` -> (target, url, body,
    headers).

    Waits for every request to finish (at most `drain_s` after the last send; stragglers are
    cancelled and count as errors)."""
    phase = Phase(rate)
    tasks: list[asyncio.Task[Result]] = []
    start = time.perf_counter()
    due = start + rng.expovariate(rate)
    i = first_index
    while due < start + duration_s:
        now = time.perf_counter()
        if due > now:
            await asyncio.sleep(due - now)
        target, url, body, headers = request(i)
        res = Result(target, due)
        phase.results.append(res)
        sending = stream_one(client, url, body, res, timeout_s, headers)
        tasks.append(asyncio.create_task(sending))
        i += 1
        due += rng.expovariate(rate)
    if tasks:
        _done, pending = await asyncio.wait(tasks, timeout=drain_s)
        for t in pending:
            t.cancel()
        for t in pending:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        for res in phase.results:
            if not res.error and res.done != res.done:
                res.error = "cancelled at drain"
            if res.sent == res.sent:
                phase.late_s.append(res.sent - res.scheduled)
    return phase


def quantile(xs: Sequence[float], q: float) -> float:
    """The q-quantile (linear interpolation, numpy's default); nan for no data."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def metrics_text(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=5.0).text


def engine_counters(urls: Sequence[str]) -> tuple[float, float, list[float]]:
    """(Σ vllm:prefix_cache_hits_total, Σ vllm:prefix_cache_queries_total, requests finished
    per replica) over `urls`."""
    from controlplane.metrics_scrape import parse_metrics

    hits = queries = 0.0
    served = []
    for url in urls:
        m = parse_metrics(metrics_text(url), model_name=MODEL)
        hits += m.prefix_cache_hits
        queries += m.prefix_cache_queries
        served.append(sum(m.request_success.values()))
    return hits, queries, served


def counter_by_label(text: str, name: str, label: str) -> dict[str, float]:
    """A Prometheus counter's samples summed by one label (e.g. cp_requests_total by reason)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                key = sample.labels.get(label, "")
                out[key] = out.get(key, 0.0) + sample.value
    return out


def cpu_s(pgids: Sequence[int]) -> float:
    """CPU seconds (user + system) used so far by every live process in these process groups."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pgid in pgids:
        for pid in group_pids(pgid):
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])
    return total / tick
