"""Where the router's CPU goes per request: py-spy on the live router under the bench's load.

Setup as in `router_overhead.py`'s production run: two simulated replicas (`--speed` 50, KV
events), a private Redis (shared prefix index fed by the router's KV-event followers, token
quotas, the shared fair queue), `--tenants` tenants with API keys and hard quotas, our router as
its own process (`controlplane serve --config`). The client sends open-loop Poisson streaming
chat requests at `--rate` for `--seconds`, spread over the tenants, while `py-spy record
--nonblocking` samples the router process (and its workers) at `--hz`.

Reading the samples (py-spy's collapsed stacks, one line per distinct stack with its count):

    self share       samples whose innermost frame is the function, over all samples
    inclusive share  samples with the function anywhere on the stack (counted once per sample)
    by area          each sample attributed to the first frame (innermost first) whose file falls
                     in an area (our router, FastAPI/Starlette, pydantic, httpx/httpcore, redis,
                     uvicorn/httptools, asyncio/uvloop, tokenizer, telemetry, ...); idle samples
                     (the loop waiting in epoll) are counted apart and left out of the shares

CPU per request is the router process's CPU (from /proc) during the loaded window, less its idle
background (measured for a few seconds before the load: probes, scrapes, heartbeats), over the
requests sent. `--variants` measures it (no profiler attached) with parts of the production setup
taken away one at a time (quotas, the shared fair queue, the fair queue, following KV events), so
the differences say what each part costs a request.

Writes out/bench/router_profile.json, the raw stacks (router_profile.txt, for flame graph tools)
and prints the tables (`--variants`: router_profile_variants.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from common import console, out_dir, print_table, write_json
from live_stack import (
    OurRouter,
    bench_tenants,
    cpu_s,
    new_client,
    open_loop,
    quantile,
    sim_fleet,
)
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from router_overhead import chat_body

from deploy.redis_local import RedisServer

IDLE_S = 4.0
# "where the time goes" by taking parts away: (label, tenants, extra router config); each run
# measures CPU per request net of the router's idle background (no profiler attached)
VARIANTS: tuple[tuple[str, int | None, dict[str, Any]], ...] = (
    ("production: Redis index + KV events, 4 tenants with quotas, shared fair queue", None, {}),
    ("- quotas (open mode, no tenants)", 0, {}),
    ("- shared fair queue (local fair queue)", None, {"fairness": {"shared": False}}),
    ("- fair queue (off)", None, {"fairness": {"mode": "off"}}),
    ("- KV events followed by this router", None, {"redis": {"ingest_events": False}}),
    (
        "none of those: Redis index lookups only",
        0,
        {"fairness": {"mode": "off"}, "redis": {"ingest_events": False}},
    ),
)

# (area, substrings of a frame's "function (file:line)" text), first match wins, innermost frame
# first; a sample none matches is "other"
AREAS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("idle (epoll wait)", ("select (selectors.py", "_run_once (asyncio/base_events.py:1",
                           "run_forever (uvloop", "poll (", "epoll")),
    ("json / msgspec / orjson", ("json/", "msgspec", "orjson")),
    ("pydantic validation", ("pydantic",)),
    ("tokenizer + chat template", ("tokenization.py", "tokenizers", "jinja2", "tokenizer.py")),
    ("hashing", ("hashing.py",)),
    ("redis client", ("redis/",)),
    ("httpx / httpcore (upstream)", ("httpx/", "httpcore/", "h11/", "anyio/")),
    ("uvicorn / httptools (server)", ("uvicorn/", "httptools")),
    ("fastapi / starlette", ("fastapi/", "starlette/")),
    ("telemetry (otel, prometheus, logs)", ("opentelemetry", "prometheus_client", "logging/",
                                            "router/telemetry/")),
    ("fair queue + quota", ("router/fairness/", "controlplane/tenancy/")),
    ("prefix index", ("controlplane/prefix/", "router/fleet/index.py", "controlplane/store/")),
    ("routing (core, books, policy)", ("router/core.py", "controlplane/routing/",
                                       "controlplane/policies/")),
    ("relay + proxy (ours)", ("router/http/", "router/scope.py", "router/runtime.py")),
    ("fleet probes / scrapes", ("router/fleet/", "metrics_scrape")),
    ("kv events", ("kvevents", "zmq", "cbor2")),
    ("asyncio / uvloop", ("asyncio/", "uvloop", "contextvars")),
)  # fmt: skip


def area_of(frames: list[str]) -> str:
    for frame in reversed(frames):  # innermost first
        for area, needles in AREAS:
            if any(n in frame for n in needles):
                return area
    return "other"


def parse_collapsed(text: str) -> list[tuple[list[str], int]]:
    out = []
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [f for f in stack.split(";") if not f.startswith("process ")]
        # py-spy prefixes each stack with the thread ("thread (0x...)"); keep only frames
        frames = [f for f in frames if not f.startswith("thread (")]
        out.append((frames, int(count)))
    return out


def _func(frame: str) -> str:
    """'name (path/file.py:123)' -> 'name (file.py)': lines merged."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    parts = Path(path).parts
    short = "/".join(parts[-2:]) if len(parts) >= 2 else path
    return f"{name} ({short})"


def summarize(stacks: list[tuple[list[str], int]], top: int) -> dict[str, Any]:
    total = sum(c for _, c in stacks) or 1
    idle = sum(c for f, c in stacks if area_of(f) == "idle (epoll wait)")
    busy = max(1, total - idle)
    areas: Counter[str] = Counter()
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    for frames, c in stacks:
        area = area_of(frames)
        if area == "idle (epoll wait)":
            continue
        areas[area] += c
        if frames:
            own[_func(frames[-1])] += c
        for fn in {_func(f) for f in frames}:
            incl[fn] += c
    return {
        "samples": total,
        "idle_samples": idle,
        "busy_samples": busy,
        "by_area_pct": {a: round(100 * c / busy, 1) for a, c in areas.most_common()},
        "self_pct": {f: round(100 * c / busy, 1) for f, c in own.most_common(top)},
        "inclusive_pct": {f: round(100 * c / busy, 1) for f, c in incl.most_common(top * 2)},
    }


async def load(
    url: str, rate: float, seconds: float, headers: Sequence[Mapping[str, str]], seed: int
) -> dict[str, Any]:
    rng = random.Random(seed)

    def make(i: int) -> tuple[str, str, bytes, Mapping[str, str]]:
        body = chat_body(rng, 12, 8)
        key = headers[i % len(headers)] if headers else {}
        return "router", f"{url}/v1/chat/completions", body, key

    async with new_client() as client:
        await open_loop(client, rate, 2.0, make, rng)  # warm-up
        phase = await open_loop(client, rate, seconds, make, rng)
    ok = [r.ttft for r in phase.results if r.ok]
    errors = Counter(r.error for r in phase.results if not r.ok)
    return {
        "error_kinds": dict(errors.most_common(5)),
        "requests": len(phase.results),
        "errors": len(phase.results) - len(ok),
        "ttft_p50_ms": quantile(ok, 0.5) * 1e3,
        "ttft_p99_ms": quantile(ok, 0.99) * 1e3,
    }


def run(args: argparse.Namespace, label: str = "production") -> dict[str, Any]:
    tenants, headers = bench_tenants(args.tenants)
    redis = RedisServer()
    fleet = None
    router = None
    spy: subprocess.Popen[bytes] | None = None
    raw = out_dir() / "router_profile.txt"
    try:
        redis.start()
        fleet = sim_fleet(2, speed=args.speed, max_num_seqs=256)
        extra = {"tenants": tenants, **json.loads(args.extra)}
        if "redis" in extra:
            extra["redis"] = {**extra["redis"], "url": redis.url}
        router = OurRouter(fleet, redis_url=redis.url, extra=extra, workers=args.workers)
        router.start()
        assert router.child is not None
        pgid = router.child.pgid
        py_spy = str(Path(sys.executable).parent / "py-spy")
        cmd = [py_spy, "record", "--nonblocking", "--format", "raw", "-r", str(args.hz),
               "-d", str(int(args.seconds + 4)), "-o", str(raw), "--pid", str(router.child.pid),
               "--subprocesses"]  # fmt: skip
        cols = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
        with Progress(*cols, console=console, transient=True) as progress:
            what = "under py-spy" if args.hz else "(no profile)"
            progress.add_task(f"{label}: {args.rate:g} req/s for {args.seconds:g} s {what}")
            i0, w0 = cpu_s([pgid]), time.perf_counter()
            time.sleep(IDLE_S)  # the router's background: probes, scrapes, heartbeats
            idle_rate = (cpu_s([pgid]) - i0) / (time.perf_counter() - w0)
            if args.hz:
                spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                time.sleep(1.0)
            c0, w0 = cpu_s([pgid]), time.perf_counter()
            stats = asyncio.run(load(router.url, args.rate, args.seconds, headers, args.seed))
            c1, w1 = cpu_s([pgid]), time.perf_counter()
            if spy is not None:
                spy.wait(timeout=60)
    finally:
        if spy is not None and spy.poll() is None:
            spy.terminate()
        if router is not None:
            router.stop()
        if fleet is not None:
            fleet.stop()
        redis.stop()
    stacks = parse_collapsed(raw.read_text() if args.hz and raw.exists() else "")
    # the loaded window includes the warm-up's 2 s of requests
    reqs = stats["requests"] + args.rate * 2.0
    net = (c1 - c0) - idle_rate * (w1 - w0)
    return {
        "label": label,
        "router_cpu_ms_per_request": round(net / reqs * 1e3, 3),
        "router_idle_cpu_pct": round(idle_rate * 100, 2),
        "rate_rps": args.rate,
        "seconds": args.seconds,
        "workers": args.workers,
        "tenants": args.tenants,
        "extra_config": json.loads(args.extra),
        "load": stats,
        "router_cpu_ms_per_request_incl_background": round((c1 - c0) / reqs * 1e3, 3),
        "profile": summarize(stacks, args.top),
        "raw_stacks": str(raw),
    }


def variants(args: argparse.Namespace) -> None:
    base_tenants = args.tenants
    args.hz = 0
    rows, out = [], []
    for label, tenants, extra in VARIANTS:
        args.tenants = base_tenants if tenants is None else tenants
        args.extra = json.dumps(extra)
        data = run(args, label)
        out.append(data)
        rows.append(
            [
                label,
                f"{data['router_cpu_ms_per_request']:.2f}",
                f"{data['router_idle_cpu_pct']:.1f}",
                f"{data['load']['ttft_p50_ms']:.1f} / {data['load']['ttft_p99_ms']:.1f}",
                data["load"]["errors"],
            ]
        )
    print_table(
        f"router CPU per request at {args.rate:g} streaming req/s, parts taken away",
        ["setup", "CPU ms/req (net)", "idle CPU %", "TTFT p50 / p99 ms", "errors"],
        rows,
    )
    write_json("router_profile_variants.json", {"rate_rps": args.rate, "variants": out})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=100.0, help="streaming req/s")
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds of load profiled")
    parser.add_argument("--hz", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--tenants", type=int, default=4, help="tenants with keys and quotas")
    parser.add_argument("--workers", type=int, default=1, help="router worker processes")
    parser.add_argument("--speed", type=float, default=50.0, help="sim replicas' speed-up")
    parser.add_argument("--top", type=int, default=25, help="functions listed")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--extra",
        default="{}",
        help='router config merged in, as JSON (e.g. \'{"fairness": {"mode": "off"}}\')',
    )
    parser.add_argument(
        "--variants",
        action="store_true",
        help="no profile: CPU per request with parts of the production setup taken away",
    )
    args = parser.parse_args()
    if args.variants:
        variants(args)
        return
    data = run(args)
    prof = data["profile"]
    load_ = data["load"]
    console.print(
        f"{load_['requests']} requests, {load_['errors']} errors {load_['error_kinds']}, TTFT p50 "
        f"{load_['ttft_p50_ms']:.2f} / p99 {load_['ttft_p99_ms']:.2f} ms; router CPU "
        f"{data['router_cpu_ms_per_request']:.2f} ms/request net of its idle background; "
        f"{prof['busy_samples']} busy of {prof['samples']} samples"
    )
    print_table("router CPU by area (% of busy samples)", ["area", "%"],
                list(prof["by_area_pct"].items()))  # fmt: skip
    print_table("self time (% of busy samples)", ["function", "%"],
                list(prof["self_pct"].items()))  # fmt: skip
    print_table("inclusive time (% of busy samples)", ["function", "%"],
                list(prof["inclusive_pct"].items())[: args.top])  # fmt: skip
    write_json("router_profile.json", data)


if __name__ == "__main__":
    main()
