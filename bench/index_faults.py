"""Redis prefix index under faults: how long a lookup or a write takes when Redis is dead, hung or
back, on a private redis-server (free loopback port, never 6379).

The tests (tests/integration/test_redis_index_faults.py) assert what happens: a lookup gives up
and answers unknown, the breaker opens after three failures and refuses without I/O, one
half-open probe, writes never suspend the caller. This script measures how long each takes,
with the default lookup budget (25 ms):

  * dead Redis (process killed): the three lookups that open the breaker, then lookups and writes
    with the breaker open (per call);
  * hung Redis (SIGSTOP): the lookups that wait for the budget, and a write;
  * recovery: from `SIGCONT` (hung) or a restart on the same port (dead) until a lookup answers
    again, with a 0.2 s breaker cool-down;
  * closing the index while Redis hangs, with a 0.2 s flush timeout.

Writes out/bench/index_faults.json.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable

from common import console, print_table, write_json

from controlplane.hashing import BlockHasher
from controlplane.prefix.redis_index import RedisPrefixIndex
from deploy.redis_local import RedisServer

Q = BlockHasher(1).hash_blocks(list(range(64)))
CANDS = [("r0", 1), ("r1", 1)]
BUDGET_S = 0.025


async def timed(coro_fn: Callable[[], Awaitable[object]], n: int) -> list[float]:
    """Seconds per call of `coro_fn()`, n calls in a row."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await coro_fn()
        out.append(time.perf_counter() - t0)
    return out


async def populated(url: str, cooldown_s: float) -> RedisPrefixIndex:
    index = RedisPrefixIndex(
        url, key_prefix="bench:faults", lookup_budget_s=2.0, write_timeout_s=0.1,
        breaker_cooldown_s=cooldown_s,
    )  # fmt: skip
    await index.record_stored("r0", 1, Q)
    assert await index.flush()
    assert await index.lookup(Q, CANDS) is not None
    index.lookup_budget_s = BUDGET_S
    return index


async def until_answer(index: RedisPrefixIndex, t0: float, limit_s: float = 10.0) -> float:
    while await index.lookup(Q, CANDS) is None:
        if time.perf_counter() - t0 > limit_s:
            raise RuntimeError("the index did not recover")
        await asyncio.sleep(0.005)
    return time.perf_counter() - t0


async def dead(server: RedisServer, n_open: int) -> dict[str, float]:
    index = await populated(server.url, cooldown_s=0.2)
    try:
        server.kill()
        opening = await timed(lambda: index.lookup(Q, CANDS), 3)
        refused = await timed(lambda: index.lookup(Q, CANDS), n_open)
        writes = await timed(lambda: index.record_stored("r0", 1, Q), n_open)
        server.restart()
        back = await until_answer(index, time.perf_counter())
        return {
            "opening_lookup_max_s": max(opening),
            "open_lookup_mean_s": statistics.fmean(refused),
            "open_write_mean_s": statistics.fmean(writes),
            "recovery_after_restart_s": back,
        }
    finally:
        await index.aclose()


async def hung(server: RedisServer) -> dict[str, float]:
    index = await populated(server.url, cooldown_s=0.2)
    try:
        server.pause()
        try:
            waits = await timed(lambda: index.lookup(Q, CANDS), 3)
            write = await timed(lambda: index.record_stored("r1", 1, Q), 1)
        finally:
            server.resume()
        back = await until_answer(index, time.perf_counter())
        server.pause()
        try:
            await index.record_stored("r0", 1, Q)
            t0 = time.perf_counter()
            await index.aclose(flush_timeout_s=0.2)
            closing = time.perf_counter() - t0
        finally:
            server.resume()
        return {
            "budget_s": BUDGET_S,
            "hung_lookup_min_s": min(waits),
            "hung_lookup_max_s": max(waits),
            "hung_write_s": write[0],
            "recovery_after_resume_s": back,
            "aclose_hung_s": closing,
        }
    finally:
        await index.aclose()


async def run(args: argparse.Namespace) -> dict[str, object]:
    rounds: list[dict[str, float]] = []
    for i in range(args.rounds):
        console.print(f"round {i + 1}/{args.rounds}: dead, then hung Redis ...")
        with RedisServer() as server:
            row = await dead(server, args.open_calls)
        with RedisServer() as server:
            row |= await hung(server)
        rounds.append(row)
    # the worst round per figure: the largest, but for the shortest hung lookup its smallest
    summary = {k: (min if k.endswith("_min_s") else max)(r[k] for r in rounds) for k in rounds[0]}
    return {"rounds": rounds, "worst": summary, "open_calls": args.open_calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="fault rounds (worst reported)")
    parser.add_argument("--open-calls", type=int, default=1000, help="calls while open")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    worst = result["worst"]
    assert isinstance(worst, dict)

    def ms(v: float) -> str:
        return f"{v * 1e3:.3f} ms"

    print_table(
        f"Redis prefix index under faults (worst of {args.rounds} rounds)",
        ["measure", "time"],
        [[k.removesuffix("_s").replace("_", " "), ms(v)] for k, v in worst.items()],
    )
    write_json("index_faults.json", result)


if __name__ == "__main__":
    main()
