"""Helpers for tests of engine deployments on Ray Serve (deploy/engines/), any engine.

    with local_serve(app, deployment) as handle:        a local Ray cluster (2 CPUs), the app
        answer = call(handle, "POST", "/v1/chat/completions", chat(MODEL, "hi"), "rid-1")
        stats = replica_stats(handle)                    every replica's EngineStats
        check_prefix_affinity(handle, admin, KEY_PREFIX, MODEL)

`check_prefix_affinity` is the scenario both engines' tests run: prompts that share a prefix
nobody holds go to the least loaded replica (the policy's `miss_least_loaded`); once that
replica's KV events have put every full block of the prompt in the shared index under the very
hashes the router computes for it (so the router's tokenization and hashing agree with the
engine's own blocks: the match is confirmed, not only the router's speculation), the prompts
sharing it land on it for `prefix_hit` with a predicted hit, and that engine's own prefix-cache
counters grow by at least the predicted tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import redis

from controlplane.types import DecisionReason
from deploy.processes import pid_alive
from router.serve.stats import EngineStats
from router.telemetry import DECISION_HEADER, parse_decision_header

APP = "engines"
# after Serve and Ray shut down: how long the engine replicas' processes may take to go
GONE_WAIT_S = 15.0


@contextlib.contextmanager
def local_serve(app: Any, deployment: str, replicas: int = 2) -> Iterator[Any]:
    """A local Ray cluster running `app`; yields a handle to `deployment`; shuts both down and
    checks that no process of the engine replicas (the engines' children included) is left."""
    import ray
    from ray import serve

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    pids: set[int] = set()
    try:
        serve.run(app, name=APP, route_prefix=None)
        handle = serve.get_deployment_handle(deployment, app_name=APP)
        pids = engine_pids(handle, replicas)
        yield handle
    finally:
        serve.shutdown()  # type: ignore[no-untyped-call]
        ray.shutdown()
    deadline = time.monotonic() + GONE_WAIT_S
    while (left := {p for p in pids if pid_alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"engine processes left after shutdown: {sorted(left)}"


def engine_pids(handle: Any, n: int, attempts: int = 50) -> set[int]:
    """Every engine replica's processes (`process_ids()`; the calls land on any replica)."""
    seen: dict[str, list[int]] = {}
    for _ in range(attempts):
        row = handle.process_ids.remote().result()
        seen[row["replica_id"]] = row["pids"]
        if len(seen) == n:
            return {p for pids in seen.values() for p in pids}
    raise AssertionError(f"process ids of {len(seen)} replicas only")


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]
    chunks: list[bytes]

    @property
    def decision(self) -> dict[str, str]:
        return parse_decision_header(self.headers[DECISION_HEADER])


def call(handle: Any, method: str, path: str, body: bytes, rid: str) -> Answer:
    """One request through the deployment's `handle` (streamed: the head, then the chunks)."""
    headers = [["content-type", "application/json"], ["x-request-id", rid]]
    parts = list(handle.options(stream=True).handle.remote(method, path, headers, body))
    head, chunks = parts[0], parts[1:]
    assert isinstance(head, dict) and all(isinstance(c, bytes) for c in chunks)
    return Answer(head["status"], {k: v for k, v in head["headers"]}, chunks)


def chat(model: str, content: str, **extra: Any) -> bytes:
    body = {"model": model, "messages": [{"role": "user", "content": content}], **extra}
    return json.dumps(body).encode()


def replica_stats(handle: Any, n: int = 2, attempts: int = 50) -> dict[str, EngineStats]:
    """Every replica's `record_routing_stats()` (these calls land on any replica)."""
    seen: dict[str, EngineStats] = {}
    for _ in range(attempts):
        stats = EngineStats.from_dict(handle.record_routing_stats.remote().result())
        assert stats is not None
        seen[stats.replica_id] = stats
        if len(seen) == n:
            return seen
    raise AssertionError(f"stats of {len(seen)} replicas only")


def words(rng: random.Random, n: int) -> str:
    return " ".join(
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 8)))
        for _ in range(n)
    )


def confirmed(admin: redis.Redis, key_prefix: str, replica: str) -> int:
    """Confirmed (KV-event) blocks of `replica` in the shared index."""
    return int(admin.scard(f"{key_prefix}:c:{replica}"))


def router_hashes(tokenizer: str, model: str, body: bytes) -> tuple[int, ...]:
    """The block hashes our RequestRouter computes for a chat body (block size 32)."""
    from controlplane.routing.books import RoutingBooks
    from controlplane.routing.config import PolicyConfig
    from router.serve.requests import ServeRouting

    routing = ServeRouting(RoutingBooks(PolicyConfig()), model=model, tokenizer=tokenizer)
    req = asyncio.run(routing.request("h", "/v1/chat/completions", body, 32, 0.0))
    assert req is not None
    return req.block_hashes


def wait_hashes_confirmed(
    admin: redis.Redis,
    key_prefix: str,
    replica: str,
    hashes: tuple[int, ...],
    timeout_s: float = 20.0,
) -> None:
    """Until every one of `hashes` is a confirmed block of `replica` in the shared index."""
    members = [h.to_bytes(8, "big") for h in hashes]
    deadline = time.monotonic() + timeout_s
    while not all(admin.smismember(f"{key_prefix}:c:{replica}", members)):
        assert time.monotonic() < deadline, f"{replica}'s KV events never confirmed {hashes}"
        time.sleep(0.02)


def wait_confirmed(
    admin: redis.Redis, key_prefix: str, replica: str, above: int, timeout_s: float = 20.0
) -> None:
    """Until the index holds more than `above` confirmed blocks of `replica`."""
    deadline = time.monotonic() + timeout_s
    while confirmed(admin, key_prefix, replica) <= above:
        assert time.monotonic() < deadline, f"no new confirmed block of {replica} in Redis"
        time.sleep(0.02)


def check_prefix_affinity(
    handle: Any,
    admin: redis.Redis,
    key_prefix: str,
    model: str,
    tokenizer: str,
    *,
    prefixes: int = 3,
    followups: int = 3,
    seed: int = 7,
) -> dict[str, int]:
    """The scenario of the module docstring; returns replica -> predicted hit tokens."""
    rng = random.Random(seed)
    before = replica_stats(handle)
    predicted: dict[str, int] = {}
    for p in range(prefixes):
        prefix = words(rng, 80)
        body = chat(model, f"{prefix} question zero", max_tokens=4)
        first = call(handle, "POST", "/v1/chat/completions", body, f"pfx{p}-0")
        assert first.status == 200, first
        d0 = first.decision
        assert d0["reason"] == DecisionReason.MISS_LEAST_LOADED, d0
        holder = d0["replica"]
        assert holder in before, (holder, before)
        hashes = router_hashes(tokenizer, model, body)
        assert len(hashes) >= 4, "the prompt spans several full blocks"
        wait_hashes_confirmed(admin, key_prefix, holder, hashes)
        for i in range(1, followups + 1):
            body = chat(model, f"{prefix} question {i}", max_tokens=4, stream=True)
            again = call(handle, "POST", "/v1/chat/completions", body, f"pfx{p}-{i}")
            assert again.status == 200, again
            d = again.decision
            assert (d["replica"], d["reason"]) == (holder, DecisionReason.PREFIX_HIT), (d0, d)
            hit = int(d["predicted_hit_tokens"])
            assert hit > 0, d
            predicted[holder] = predicted.get(holder, 0) + hit
    # the engines' own counters: each holder's cache served at least the predicted hits
    after = replica_stats(handle)
    for rid, tokens in predicted.items():
        gained = after[rid].prefix_cache_hits - before[rid].prefix_cache_hits
        assert gained >= tokens, (rid, gained, tokens)
    return predicted


__all__ = [
    "APP",
    "Answer",
    "call",
    "chat",
    "check_prefix_affinity",
    "confirmed",
    "engine_pids",
    "local_serve",
    "replica_stats",
    "router_hashes",
    "wait_confirmed",
    "wait_hashes_confirmed",
    "words",
]
