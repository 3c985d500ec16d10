"""The Ray Serve path against the standalone router, on the same engines; routers' quality.

Overhead. A local Ray cluster (`num_cpus=2`) runs the whole Serve application
(deploy/ray/fleet.py: Serve's HTTP proxy -> our OpenAI ingress deployment -> the engine
deployment's handle with our RequestRouter -> a simulated-engine replica), two engine replicas at
speed SPEED (a short chat prompt with MAX_TOKENS output tokens costs the engine about a
millisecond). Each engine replica also serves its own app over HTTP (`EngineServer.open_http`:
uvicorn in the replica's process), so the very same two engines are reached three ways:

    direct       the client round-robins over the engines' HTTP URLs
    standalone   `controlplane serve` (its own process) in front of those URLs, the same router
                 settings as the ingress (prefix_affinity, the local tokenizer, Redis, JSON
                 logs at WARNING), following the same engines' KV events (its own key prefix)
    serve_path   Serve's proxy on its HTTP port

The client (asyncio + httpx, bench/live_stack.py) sends open-loop Poisson arrivals of streaming
chat requests at RATE/s, each with its own short prompt; the targets take turns in PHASE_S
phases, in a fresh random order every round (ROUNDS), so drift hits all alike. TTFT is from a
request's send to its first content chunk; "added" at a quantile = the target's minus direct's,
over all of a target's requests. CPU per request: CPU time (/proc, user + system) of the
target's own processes during its phases divided by its requests, less the processes' idle rate
(their CPU while other targets ran; router_overhead.cpu_costs): for serve_path Serve's proxy
actor and the ingress replica (our RequestRouter runs in it), for standalone the router process.

Serve variants (each a fresh cluster, the three targets measured side by side in it):
`default` (Serve 2.60's defaults, access logs off) and `throughput_optimized`
(RAY_SERVE_THROUGHPUT_OPTIMIZED=1: user code and the handle's router on the replica's main loop,
request-path logs buffered, no stderr logging, GC frozen after start, gRPC between handle and
replica) with RAY_SERVE_ENABLE_DIRECT_INGRESS=0, which that flag would otherwise turn on (direct
ingress drops the proxy hop: a path of its own, below). `serve_path` in the JSON is the variant
with the proxy and the lower added p50 (its flags are listed beside it). A third variant,
`direct_ingress` (the same flags with RAY_SERVE_ENABLE_DIRECT_INGRESS=1: the ingress replica
serves HTTP on its own port, given by RAY_SERVE_DIRECT_INGRESS_MIN/MAX_HTTP_PORT, no proxy hop;
Serve 2.60 still starts a proxy, idle here), is `serve_direct_ingress`.

Quality: engine-reported prefix hit rate and TTFT of our RequestRouter (prefix affinity), Serve's
default `PowerOfTwoChoicesRequestRouter` and Ray's own `PrefixCacheAffinityRouter` (the ray
wheel's, through deploy/engines/ray_prefix_router.py), from bench/serve_engines_bench.py's run
(out/bench/serve_engines.json; run here when absent).

    python bench/ray_serve_bench.py        # out/bench/ray_serve.json, ray_serve.png
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx
from common import console, out_dir, phase_columns, print_table, save_figure, write_json
from live_stack import MODEL, OurRouter, Result, cpu_s, new_client, open_loop, quantile
from rich.progress import Progress
from router_overhead import WORDS, cpu_costs

from deploy.redis_local import RedisServer, free_port
from deploy.tiny_model import default_model_dir, make_tiny_model

SPEED = 50.0
RATE = 20.0
PHASE_S = 6.0
ROUNDS = 3
PROMPT_WORDS = 12
MAX_TOKENS = 8
SEED = 5
TARGETS = ("direct", "standalone", "serve_path")
VARIANTS: dict[str, dict[str, str]] = {
    "default": {},
    "throughput_optimized": {
        "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
    },
    # the same, and the ingress replica serves HTTP itself: no proxy (port given below)
    "direct_ingress": {
        "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
    },
}
ALWAYS = "access logs off (LoggingConfig(enable_access_log=False)), log level WARNING"


def proc_pids(marker: str) -> list[int]:
    """Pids whose command line contains `marker` (Ray names its workers `ray::<actor class>`)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if marker in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode():
                    pids.append(int(entry.name))
    return pids


def pids_cpu_s(pids: list[int]) -> float:
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / tick


def router_settings(md: Path, redis_url: str, key_prefix: str) -> dict[str, Any]:
    """The router settings both paths run with (the ingress's and the standalone router's)."""
    return {
        "served_model": MODEL,
        "tokenizer": str(md),
        "policy": {"name": "prefix_affinity"},
        "redis": {"url": redis_url, "key_prefix": key_prefix},
        "telemetry": {"json_logs": True, "log_level": "WARNING"},
    }


async def engine_rows(handle: Any, n: int = 2, tries: int = 60) -> list[dict[str, Any]]:
    """Every engine replica's HTTP URL and KV endpoints, as router config rows."""
    seen: dict[str, dict[str, Any]] = {}
    for _ in range(tries):
        info = await handle.open_http.remote()
        seen[info["replica_id"]] = info
        if len(seen) == n:
            break
    assert len(seen) == n, f"reached {len(seen)} of {n} engine replicas"
    return [
        {
            "id": rid,
            "url": i["url"],
            "gpu": "cpu",
            "model": MODEL,
            "kv_events": i["kv_events"],
            "kv_replay": i["kv_replay"],
            "kv_topic": "",
        }
        for rid, i in sorted(seen.items())
    ]


async def measure(
    urls: dict[str, list[str]], cpu: dict[str, Callable[[], float]], label: str
) -> dict[str, Any]:
    rng = random.Random(SEED)
    counters = dict.fromkeys(urls, 0)

    def requester(target: str) -> Callable[[int], tuple[str, str, bytes, Mapping[str, str]]]:
        def make(_i: int) -> tuple[str, str, bytes, Mapping[str, str]]:
            pool, n = urls[target], counters[target]
            counters[target] += 1
            text = " ".join(rng.choice(WORDS) for _ in range(PROMPT_WORDS))
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": text}],
                "max_tokens": MAX_TOKENS,
                "stream": True,
            }
            return (
                target,
                f"{pool[n % len(pool)]}/v1/chat/completions",
                json.dumps(body).encode(),
                {},
            )

        return make

    phases: list[tuple[str, int, float, dict[str, float]]] = []
    results: dict[str, list[Result]] = {t: [] for t in urls}
    columns = phase_columns()
    async with new_client() as client:
        with Progress(*columns, console=console, transient=True) as progress:
            task = progress.add_task(f"{label}: warm-up", total=len(urls) * (1 + ROUNDS))
            for t in urls:  # connections, tokenizer, handles: not counted
                await open_loop(client, RATE, 2.0, requester(t), rng)
                progress.advance(task)
            for rnd in range(ROUNDS):
                order = list(urls)
                rng.shuffle(order)
                for t in order:
                    progress.update(task, description=f"{label}, round {rnd + 1}: {t}")
                    c0 = {k: f() for k, f in cpu.items()}
                    w0 = time.perf_counter()
                    phase = await open_loop(client, RATE, PHASE_S, requester(t), rng)
                    w1 = time.perf_counter()
                    used = {k: f() - c0[k] for k, f in cpu.items()}
                    phases.append((t, len(phase.results), w1 - w0, used))
                    results[t] += phase.results
                    progress.advance(task)
    costs = cpu_costs(phases, list(urls))
    out: dict[str, Any] = {}
    for t, res in results.items():
        ttft = [r.ttft for r in res if r.ok]
        out[t] = {
            "requests": len(res),
            "errors": sum(not r.ok for r in res),
            "ttft_p50_ms": quantile(ttft, 0.5) * 1e3,
            "ttft_p99_ms": quantile(ttft, 0.99) * 1e3,
            "cpu_ms": costs[t],
        }
    for t in urls:
        if t != "direct":
            out[t]["added_ttft_p50_ms"] = out[t]["ttft_p50_ms"] - out["direct"]["ttft_p50_ms"]
            out[t]["added_ttft_p99_ms"] = out[t]["ttft_p99_ms"] - out["direct"]["ttft_p99_ms"]
            out[t]["cpu_ms_per_request"] = costs[t]["router_process"]
    # the Serve path's CPU split by process: the proxy's share, the ingress replica's
    for part in ("serve_proxy", "serve_ingress"):
        renamed = [(t, n, w, {**u, "serve_path": u[part]}) for t, n, w, u in phases]
        share = cpu_costs(renamed, list(urls))["serve_path"]["router_process"]
        out["serve_path"][f"cpu_ms_per_request_{part.removeprefix('serve_')}"] = share
    return out


def run_variant(name: str, flags: dict[str, str], md: Path, redis_url: str) -> dict[str, Any]:
    """One fresh Ray cluster with `flags` in its environment: the three targets side by side."""
    port = free_port()
    direct_ingress = flags.get("RAY_SERVE_ENABLE_DIRECT_INGRESS") == "1"
    if direct_ingress:  # the ingress replica's own HTTP port: one port, this one
        port = free_port()
        flags = flags | {
            "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),
        }
    saved = {k: os.environ.get(k) for k in flags}
    os.environ.update(flags)  # before ray.init: the cluster's processes inherit them
    import ray
    from ray import serve

    from deploy.ray.fleet import ENGINE_DEPLOYMENT, FleetArgs, build_fleet

    logging = {"enable_access_log": False, "log_level": "WARNING"}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        http = {"host": "127.0.0.1", "port": port if not direct_ingress else free_port()}
        serve.start(http_options=http, logging_config=logging)
        args = FleetArgs(
            engine="sim",
            engine_args={"speed": SPEED, "model_dir": str(md)},
            engine_replicas=2,
            router=router_settings(md, redis_url, "rtr:pidx"),
        )
        serve.run(build_fleet(args), name="fleet", route_prefix="/", logging_config=logging)
        handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name="fleet")
        rows = asyncio.run(engine_rows(handle))
        settings = router_settings(md, redis_url, "sa:pidx")
        standalone = OurRouter(None, replicas=rows, tokenizer=str(md), extra=settings)
        with standalone:
            assert standalone.child is not None
            proxy = proc_pids("ray::ProxyActor")
            ingress = proc_pids("ServeReplica:fleet:ingress")
            engines = proc_pids("ServeReplica:fleet:engine")
            console.print(f"{name}: proxy pids {proxy}, ingress {ingress}, engines {engines}")
            assert proxy and ingress and len(engines) == 2, "Serve's processes not found"
            models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10)
            assert models.status_code == 200, f"serve path on port {port}: {models.status_code}"
            for pid in proxy + ingress:  # the flags reached Serve's processes
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                assert all(f"{k}={v}".encode() in env for k, v in flags.items()), (pid, flags)
            pgid = standalone.child.pgid
            cpu: dict[str, Callable[[], float]] = {
                "client": time.process_time,
                "fleet": lambda: pids_cpu_s(engines),
                "standalone": lambda: cpu_s([pgid]),
                "serve_path": lambda: pids_cpu_s(proxy + ingress),
                "serve_proxy": lambda: pids_cpu_s(proxy),
                "serve_ingress": lambda: pids_cpu_s(ingress),
            }
            urls = {
                "direct": [r["url"] for r in rows],
                "standalone": [standalone.url],
                "serve_path": [f"http://127.0.0.1:{port}"],
            }
            return asyncio.run(measure(urls, cpu, name))
    finally:
        serve.shutdown()  # type: ignore[no-untyped-call]
        ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def quality() -> dict[str, Any]:
    """The three routers' figures from serve_engines_bench's JSON (running it when absent)."""
    path = out_dir() / "serve_engines.json"
    if (
        not path.exists()
        or "ray_prefix_cache_affinity" not in json.loads(path.read_text())["routers"]
    ):
        here = Path(__file__).resolve().parent
        subprocess.check_call([sys.executable, str(here / "serve_engines_bench.py")])
    routers = json.loads(path.read_text())["routers"]

    def row(name: str) -> dict[str, Any]:
        r = routers[name]
        return {
            "engine_prefix_hit_rate": r["engine_prefix_hit_rate"],
            "ttft_p50_s": r["ttft_p50_ms"] / 1e3,
            "ttft_p99_s": r["ttft_p99_ms"] / 1e3,
        }

    return {
        "ours": row("ours_prefix_affinity"),
        "pow2": row("serve_pow2"),
        "ray_prefix_cache_affinity": {**row("ray_prefix_cache_affinity"), "source": "ray"},
    }


def plot(variants: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [(f"Serve ({v})", r["serve_path"]) for v, r in variants.items()]
    bars += [(f"standalone ({v} run)", r["standalone"]) for v, r in variants.items()]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    xs = range(len(bars))
    ax1.bar([x - 0.2 for x in xs], [b["added_ttft_p50_ms"] for _, b in bars], 0.4, label="p50")
    ax1.bar([x + 0.2 for x in xs], [b["added_ttft_p99_ms"] for _, b in bars], 0.4, label="p99")
    ax1.set_ylabel("added TTFT vs direct (ms)")
    ax1.legend()
    ax2.bar(list(xs), [b["cpu_ms_per_request"] for _, b in bars], 0.6, color="tab:green")
    ax2.set_ylabel("router/ingress/proxy CPU ms per request")
    for ax in (ax1, ax2):
        ax.set_xticks(list(xs), [n for n, _ in bars], rotation=20, ha="right", fontsize=8)
    fig.suptitle(f"Serve path vs standalone router, same 2 simulated engines, {RATE:g} req/s")
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="Serve variants to run")
    chosen = parser.parse_args().variants.split(",")
    # Serve reads its flags at import: imported here, before any variant's flags are set, this
    # process (which only asks the engines for their URLs) keeps the defaults; the cluster's
    # processes, started per variant, get the variant's
    import ray.serve  # noqa: F401

    md = default_model_dir()
    make_tiny_model(md)
    variants: dict[str, dict[str, Any]] = {}
    with RedisServer() as redis_server:
        for name, flags in VARIANTS.items():
            if name in chosen:
                variants[name] = run_variant(name, flags, md, redis_server.url)
    rows = []
    for v, r in variants.items():
        for t in TARGETS:
            d = r[t]
            rows.append(
                [
                    f"{t} ({v})",
                    d["requests"],
                    d["errors"],
                    d["ttft_p50_ms"],
                    d["ttft_p99_ms"],
                    d.get("added_ttft_p50_ms", 0.0),
                    d.get("added_ttft_p99_ms", 0.0),
                    d.get("cpu_ms_per_request", 0.0),
                ]
            )
    print_table(
        f"Serve path vs standalone router in front of the same 2 engines ({RATE:g} req/s)",
        [
            "target",
            "requests",
            "errors",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "added p50 ms",
            "added p99 ms",
            "CPU ms/req",
        ],
        rows,
    )
    proxied = [v for v in variants if VARIANTS[v].get("RAY_SERVE_ENABLE_DIRECT_INGRESS") != "1"]
    best = min(proxied, key=lambda v: variants[v]["serve_path"]["added_ttft_p50_ms"])
    keys = ("added_ttft_p50_ms", "added_ttft_p99_ms", "cpu_ms_per_request")
    q = quality()
    print_table(
        "Routers on Ray Serve (bench/serve_engines_bench.py's run)",
        ["router", "engine prefix hit rate", "TTFT p50 s", "TTFT p99 s"],
        [[n, r["engine_prefix_hit_rate"], r["ttft_p50_s"], r["ttft_p99_s"]] for n, r in q.items()],
    )
    flags = VARIANTS[best]
    console.print(f"serve_path: the {best} variant ({flags or 'no flags'}; {ALWAYS})")
    plot(variants, out_dir() / "ray_serve.png")
    write_json(
        "ray_serve.json",
        {
            "serve_path": {k: variants[best]["serve_path"][k] for k in keys}
            | {"variant": best, "options": {"env": flags, "always": ALWAYS}},
            "standalone": {k: variants[best]["standalone"][k] for k in keys},
            # no proxy: the ingress replica's own HTTP server (Serve 2.60's direct ingress)
            **(
                {
                    "serve_direct_ingress": {
                        k: variants["direct_ingress"]["serve_path"][k] for k in keys
                    }
                }
                if "direct_ingress" in variants
                else {}
            ),
            "quality": q,
            "variants": variants,
            "load": {
                "rate_rps": RATE,
                "phase_s": PHASE_S,
                "rounds": ROUNDS,
                "speed": SPEED,
                "prompt_words": PROMPT_WORDS,
                "max_tokens": MAX_TOKENS,
            },
        },
    )


if __name__ == "__main__":
    main()
