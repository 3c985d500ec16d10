"""Redis prefix index: lookup latency, round trips, throughput and memory, on a private Redis.

Starts its own redis-server (free loopback port, no persistence; never 6379) and measures:

  * lookup latency p50/p99 for a 32k-token prompt (2,000 blocks of 16 tokens) over 16 replicas,
    end to end in one asyncio process (hashes packed, EVALSHA, reply parsed), sequential lookups;
    the server-side time per call (INFO commandstats) is reported next to it;
  * round trips per lookup: commands written to the socket (a wrapper around redis-py's
    `send_packed_command`) and EVALSHA calls seen by the server, both divided by the lookups;
  * lookups per second one process sustains with concurrent lookups (Redis runs the scripts one
    at a time, so this is bounded by the server-side time per lookup), measured closed-loop with a
    generous budget; then open-loop Poisson arrivals at 50% and 80% of it with the default 25 ms
    budget: latency and the fraction that comes back unknown;
  * Redis memory per million blocks indexed: INFO used_memory before and after inserting 1M
    confirmed blocks spread over 16 replicas (and, as an extra, 1M speculative blocks).

The population is "realistic" for prefix-affinity routing: one replica holds the whole prompt
(the session's owner), one an older 1,200-block turn of it plus an in-flight speculative claim to
1,600, two a 256-block shared document, six the 32-block system prompt, six nothing; every
replica also holds 20,000 unrelated blocks so its sets have production-like sizes. Two extra
scenarios bracket it: a single holder of the full prompt, and eight replicas with long prefixes.

Writes out/bench/index.json.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

import redis
from common import console, print_table, write_json
from redis.asyncio.connection import AbstractConnection

from controlplane.hashing import BlockHasher, scope_key
from controlplane.prefix.redis_index import RedisPrefixIndex
from deploy.redis_local import RedisServer

BLOCK = 16
PROMPT_TOKENS = 32_000
BLOCKS = PROMPT_TOKENS // BLOCK  # 2,000
REPLICAS = 16
Candidates = list[tuple[str, int]]


class SendCounter:
    """Counts commands written to Redis sockets (a pipeline counts once: one round trip)."""

    def __init__(self) -> None:
        self.count = 0
        self._orig = AbstractConnection.send_packed_command

    def install(self) -> None:
        orig = self._orig
        counter = self

        async def counting(
            self: AbstractConnection, command: Any, check_health: bool = True
        ) -> None:
            counter.count += 1
            await orig(self, command, check_health)

        AbstractConnection.send_packed_command = counting  # type: ignore[method-assign]

    def uninstall(self) -> None:
        AbstractConnection.send_packed_command = self._orig  # type: ignore[method-assign]


def make_chain(rng: random.Random, hasher: BlockHasher, blocks: int) -> list[int]:
    return hasher.hash_blocks([rng.randrange(128_000) for _ in range(blocks * BLOCK)])


async def store(index: RedisPrefixIndex, rid: str, hashes: Sequence[int], step: int = 2048) -> None:
    for i in range(0, len(hashes), step):
        await index.record_stored(rid, 1, hashes[i : i + step])
        if index.pending_writes > 64:
            await index.flush(60)
    await index.flush(60)


def percentile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


async def latency(
    index: RedisPrefixIndex, admin: redis.Redis, query: list[int], cands: Candidates, n: int
) -> dict[str, float]:
    """Sequential lookups; an unknown answer (budget exceeded) counts at its real latency."""
    # an earlier overload run may have left the breaker open: wait for its probe to close it,
    # or every lookup below would be answered "unknown" without touching Redis
    for _ in range(100):
        if await index.lookup(query, cands) is not None:
            break
        await asyncio.sleep(0.1)
    else:
        raise RuntimeError("the prefix index did not recover from the overload runs")
    # warm up: connection, script cache, and Redis settling from the bulk load just before
    # (sets still rehashing incrementally): a router sees a long-lived Redis
    for _ in range(min(1000, n)):
        await index.lookup(query, cands)
    admin.config_resetstat()
    lat: list[float] = []
    unknown = 0
    for _ in range(n):
        t0 = time.perf_counter()
        got = await index.lookup(query, cands)
        lat.append(time.perf_counter() - t0)
        unknown += got is None
    server = admin.info("commandstats")["cmdstat_evalsha"]
    return {
        "p50_ms": percentile(lat, 0.50) * 1e3,
        "p99_ms": percentile(lat, 0.99) * 1e3,
        "mean_ms": statistics.fmean(lat) * 1e3,
        "server_us_per_lookup": float(server["usec_per_call"]),
        "unknown": unknown,
    }


async def throughput(
    index: RedisPrefixIndex, query: list[int], cands: Candidates, seconds: float, tasks: int
) -> tuple[float, float]:
    """(answered lookups per second, fraction that came back unknown) with `tasks` in flight."""
    answered = unknown = 0
    stop = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal answered, unknown
        while time.perf_counter() < stop:
            if await index.lookup(query, cands) is None:
                unknown += 1
                await asyncio.sleep(0)  # an open breaker answers without I/O: let others run
            else:
                answered += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(tasks)))
    return answered / (time.perf_counter() - t0), unknown / max(1, answered + unknown)


async def offered_load(
    index: RedisPrefixIndex, query: list[int], cands: Candidates, rate: float, seconds: float
) -> dict[str, float]:
    """Open loop: Poisson arrivals at `rate` lookups/s, each its own task (as requests are)."""
    rng = random.Random(3)
    lat: list[float] = []
    unknown = 0

    async def one() -> None:
        nonlocal unknown
        t0 = time.perf_counter()
        got = await index.lookup(query, cands)
        lat.append(time.perf_counter() - t0)
        unknown += got is None

    tasks: set[asyncio.Task[None]] = set()
    start = time.perf_counter()
    due = start
    while due < start + seconds:
        due += rng.expovariate(rate)
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        task = asyncio.create_task(one())
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    while tasks:
        await asyncio.gather(*tasks)
    return {
        "p50_ms": percentile(lat, 0.5) * 1e3,
        "p99_ms": percentile(lat, 0.99) * 1e3,
        "unknown": unknown / max(1, len(lat)),
    }


async def memory_per_million(
    url: str, admin: redis.Redis, blocks: int, speculative: bool
) -> tuple[float, float]:
    """(bytes per million blocks, blocks written per second) for a fresh key prefix."""
    rng = random.Random(11)
    prefix = "bench:mem:spec" if speculative else "bench:mem"
    index = RedisPrefixIndex(
        url, key_prefix=prefix, max_entries_per_replica=blocks, write_queue_size=100_000
    )
    per = blocks // REPLICAS
    admin.flushall(asynchronous=False)  # a clean slate, freed synchronously
    admin.memory_purge()
    before = int(admin.info("memory")["used_memory"])
    t0 = time.perf_counter()
    try:
        for r in range(REPLICAS):
            hashes = [rng.getrandbits(64) for _ in range(per)]
            for i in range(0, per, 2000):
                if speculative:
                    await index.speculate(f"r{r}", 1, hashes[i : i + 2000], 600.0)
                else:
                    await index.record_stored(f"r{r}", 1, hashes[i : i + 2000])
            await index.flush(120)
        rate = per * REPLICAS / (time.perf_counter() - t0)
        after = int(admin.info("memory")["used_memory"])
        assert index.writes_dropped == 0 and index.writes_failed == 0
    finally:
        await index.aclose()
    return (after - before) * 1_000_000 / (per * REPLICAS), rate


async def run(args: argparse.Namespace) -> dict[str, object]:
    rng = random.Random(7)
    hasher = BlockHasher(BLOCK, key=scope_key("llama-3.1-8b"))
    query = make_chain(rng, hasher, BLOCKS)
    counter = SendCounter()
    with RedisServer() as server:
        admin = redis.Redis.from_url(server.url)
        index = RedisPrefixIndex(server.url, key_prefix="bench:idx", write_queue_size=10_000)
        try:
            console.print(f"populating {REPLICAS} replicas on a private redis-server ...")
            holdings = {0: 2000, 1: 1200, 2: 256, 3: 256, **{r: 32 for r in range(4, 10)}}
            for r in range(REPLICAS):
                await store(index, f"r{r}", query[: holdings.get(r, 0)])
                await store(index, f"r{r}", make_chain(rng, hasher, args.background))
            await index.speculate("r1", 1, query[:1600], 600.0)
            assert await index.flush(60)
            cands = [(f"r{r}", 1) for r in range(REPLICAS)]
            got = await index.lookup(query, cands)
            assert got is not None and got["r0"].matched_blocks == BLOCKS
            assert got["r1"].matched_blocks == 1600 and got["r1"].confirmed_blocks == 1200

            main = await latency(index, admin, query, cands, args.lookups)

            # round trips: socket writes and server-side EVALSHA calls per lookup
            admin.config_resetstat()
            counter.install()
            try:
                for _ in range(200):
                    await index.lookup(query, cands)
            finally:
                counter.uninstall()
            evalsha = admin.info("commandstats")["cmdstat_evalsha"]["calls"]
            trips = counter.count / 200
            assert evalsha == 200, evalsha

            # capacity: a generous budget, so that queueing behind Redis is measured, not cut
            roomy = RedisPrefixIndex(server.url, key_prefix="bench:idx", lookup_budget_s=1.0)
            try:
                lps, _ = await throughput(roomy, query, cands, args.seconds, args.concurrency)
            finally:
                await roomy.aclose()
            # offered load at half and 80% of that capacity, default 25 ms budget
            loads = {
                frac: await offered_load(index, query, cands, frac * lps, args.seconds)
                for frac in (0.5, 0.8)
            }

            # bracketing scenarios
            one = await latency(index, admin, query, [("r0", 1)], args.lookups // 2)
            heavy_q = make_chain(rng, hasher, BLOCKS)
            for r in range(8):
                await store(index, f"h{r}", heavy_q[: BLOCKS - 150 * r])
            heavy = await latency(
                index, admin, heavy_q, [(f"h{r}", 1) for r in range(16)], args.lookups // 2
            )
        finally:
            await index.aclose()
        console.print(f"inserting {args.million:g}M blocks for the memory figure ...")
        n_blocks = int(args.million * 1_000_000)
        mem, write_rate = await memory_per_million(server.url, admin, n_blocks, False)
        spec_mem, spec_rate = await memory_per_million(server.url, admin, n_blocks, True)
        admin.close()

    result: dict[str, object] = {
        "prompt_tokens": PROMPT_TOKENS,
        "replicas": REPLICAS,
        "lookup_p50_ms": round(main["p50_ms"], 3),
        "lookup_p99_ms": round(main["p99_ms"], 3),
        "round_trips_per_lookup": trips,
        "lookups_per_s": round(lps, 1),
        "redis_bytes_per_million_blocks": round(mem),
        # extras
        "block_size": BLOCK,
        "population": "1 full, 1 x 1200 (+ speculative to 1600), 2 x 256, 6 x 32, 6 none; "
        f"{args.background} unrelated blocks each",
        "lookup_mean_ms": round(main["mean_ms"], 3),
        "lookups_timed": args.lookups,
        "lookups_unknown": main["unknown"],
        "server_us_per_lookup": round(main["server_us_per_lookup"], 1),
        "server_evalsha_per_lookup": evalsha / 200,
        "concurrency": args.concurrency,
        **{
            f"at_{round(f * 100)}pct_load_{k}": round(v, 4 if k == "unknown" else 3)
            for f, r in loads.items()
            for k, v in r.items()
        },
        "one_holder_p50_ms": round(one["p50_ms"], 3),
        "one_holder_p99_ms": round(one["p99_ms"], 3),
        "eight_long_holders_p50_ms": round(heavy["p50_ms"], 3),
        "eight_long_holders_p99_ms": round(heavy["p99_ms"], 3),
        "eight_long_holders_server_us": round(heavy["server_us_per_lookup"], 1),
        "confirmed_blocks_written_per_s": round(write_rate),
        "speculative_bytes_per_million_blocks": round(spec_mem),
        "speculative_blocks_written_per_s": round(spec_rate),
        "redis_version": "7.0",
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lookups", type=int, default=2000, help="sequential lookups timed")
    parser.add_argument("--seconds", type=float, default=3.0, help="throughput run length")
    parser.add_argument("--concurrency", type=int, default=8, help="concurrent lookup tasks")
    parser.add_argument("--background", type=int, default=20_000, help="unrelated blocks each")
    parser.add_argument("--million", type=float, default=1.0, help="millions of blocks (memory)")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    rows: list[list[object]] = [
            ["lookup p50 (ms)", result["lookup_p50_ms"], ""],
            ["lookup p99 (ms)", result["lookup_p99_ms"], "< 2"],
            ["server time per lookup (us)", result["server_us_per_lookup"], ""],
            ["round trips per lookup", result["round_trips_per_lookup"], "1"],
            ["lookups/s, one process", result["lookups_per_s"], ""],
            ["  at 50% of it: p50 / p99 (ms), unknown",
             f"{result['at_50pct_load_p50_ms']} / {result['at_50pct_load_p99_ms']}, "
             f"{result['at_50pct_load_unknown']:.2%}", ""],
            ["  at 80% of it: p50 / p99 (ms), unknown",
             f"{result['at_80pct_load_p50_ms']} / {result['at_80pct_load_p99_ms']}, "
             f"{result['at_80pct_load_unknown']:.2%}", ""],
            ["one holder p50 / p99 (ms)",
             f"{result['one_holder_p50_ms']} / {result['one_holder_p99_ms']}", ""],
            ["8 long holders p50 / p99 (ms)",
             f"{result['eight_long_holders_p50_ms']} / {result['eight_long_holders_p99_ms']}", ""],
            ["Redis bytes per 1M confirmed blocks", result["redis_bytes_per_million_blocks"], ""],
            ["Redis bytes per 1M speculative blocks",
             result["speculative_bytes_per_million_blocks"], ""],
            ["confirmed blocks written/s", result["confirmed_blocks_written_per_s"], ""],
    ]  # fmt: skip
    print_table(
        f"Redis prefix index: {PROMPT_TOKENS:,}-token prompt ({BLOCKS:,} blocks), "
        f"{REPLICAS} replicas, loopback",
        ["metric", "value", "target"],
        rows,
    )
    write_json("index.json", result)


if __name__ == "__main__":
    main()
