"""Simulated engines as a Ray Serve deployment (deploy/engines/), called through a handle, routed
by our RequestRouter (router/serve/request_router.py, prefix affinity).

One local Ray cluster (2 CPUs) runs two replicas of the simulated-engine deployment, each with
the engine in process, following its own KV events into a private Redis; the driver's handle
routes with `PolicyRequestRouter` over that index. Beside it, the same
engine as an HTTP server (`controlplane sim-replica`): every request of the table goes to both,
and the handle's answer (head, then body chunks) must be the server's, byte for byte once the
creation time is set aside: error JSON, usage, SSE events. The replicas report their routing
stats (engine figures, KV-event endpoints, load time) and their blocks reach the shared index.
Prompts sharing a prefix land on the replica that holds it, for the policy's reason (the
`x-cp-decision` header the replica returns), and that engine's own prefix-cache counters count
the hits.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import redis
from redis_server import RedisServer, available
from sim_fleet import SimReplica

from controlplane.types import DecisionReason
from deploy.tiny_model import default_model_dir, make_tiny_model
from router.serve.stats import EngineStats
from router.telemetry import DECISION_HEADER, parse_decision_header

pytestmark = [
    pytest.mark.redis,
    pytest.mark.timeout(300),
    # Ray Serve 2.60's own pydantic models warn when `ray.serve` is first imported
    pytest.mark.filterwarnings(
        "ignore:Using extra keyword arguments on `Field`"
        ":DeprecationWarning:ray.serve._private.config"
    ),
]

MODEL = "tiny-llama"
APP = "engines"
KEY_PREFIX = "t:engines"
SPEED = 5.0
LOAD_TIME_S = 0.5


@dataclass
class Stack:
    handle: Any  # DeploymentHandle of the engine deployment
    http: str  # the same engine as an HTTP server
    redis: redis.Redis


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    if not available():
        pytest.skip("redis-server is not installed")
    import ray
    from ray import serve

    from deploy.engines.deployment import policy_router_config
    from deploy.engines.sim import DEPLOYMENT, SimEngineArgs, sim_engine_app

    md = default_model_dir()
    make_tiny_model(md)
    with RedisServer() as server, SimReplica("--model-dir", str(md), "--speed", str(SPEED)) as sim:
        args = SimEngineArgs(
            model_dir=str(md),
            speed=SPEED,
            load_time_s=LOAD_TIME_S,
            redis_url=server.url,
            key_prefix=KEY_PREFIX,
        )
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        admin = redis.Redis.from_url(server.url, socket_timeout=5)
        try:
            router = policy_router_config(
                policy="prefix_affinity",
                model=MODEL,
                tokenizer=str(md),
                redis_url=server.url,
                key_prefix=KEY_PREFIX,
            )
            app = sim_engine_app(args, num_replicas=2, request_router=router)
            serve.run(app, name=APP, route_prefix=None)
            handle = serve.get_deployment_handle(DEPLOYMENT, app_name=APP)
            yield Stack(handle, sim.url, admin)
        finally:
            admin.close()
            serve.shutdown()  # type: ignore[no-untyped-call]
            ray.shutdown()


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]
    chunks: list[bytes]


def via_handle(stack: Stack, method: str, path: str, body: bytes, rid: str) -> Answer:
    headers = [["content-type", "application/json"], ["x-request-id", rid]]
    parts = list(stack.handle.options(stream=True).handle.remote(method, path, headers, body))
    head, chunks = parts[0], parts[1:]
    assert isinstance(head, dict) and all(isinstance(c, bytes) for c in chunks)
    return Answer(head["status"], {k: v for k, v in head["headers"]}, chunks)


def via_http(stack: Stack, method: str, path: str, body: bytes, rid: str) -> Answer:
    headers = {"content-type": "application/json", "x-request-id": rid}
    with (
        httpx.Client(timeout=30.0) as client,
        client.stream(method, f"{stack.http}{path}", content=body, headers=headers) as resp,
    ):
        chunks = [c for c in resp.iter_raw() if c]
        return Answer(resp.status_code, dict(resp.headers), chunks)


def comparable(answer: Answer, stream: bool) -> tuple[int, str, str, list[Any]]:
    """Status, content type, request id, and the body's JSON documents with `created` unset
    (SSE: one per event, `[DONE]` kept as is; model cards without their random permission id)."""
    text = b"".join(answer.chunks).decode()
    if stream:
        events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
        docs: list[Any] = [e if e == "[DONE]" else json.loads(e) for e in events]
    elif "json" in answer.headers.get("content-type", ""):
        docs = [json.loads(text)]
    else:
        docs = [text]
    for doc in docs:
        if isinstance(doc, dict):
            doc.pop("created", None)
            for card in doc.get("data", []) if isinstance(doc.get("data"), list) else []:
                card.pop("created", None)
                card.pop("permission", None)  # a fresh random id per answer
    h = answer.headers
    return answer.status, h.get("content-type", ""), h["x-request-id"], docs


def chat(content: str, **extra: Any) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}
    return json.dumps(body).encode()


@dataclass(frozen=True)
class Case:
    name: str
    method: str
    path: str
    body: bytes
    stream: bool = False


CASES = [
    Case("chat", "POST", "/v1/chat/completions", chat("hello there", max_tokens=6)),
    Case(
        "chat stream with usage",
        "POST",
        "/v1/chat/completions",
        chat(
            "a longer question " * 6,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        ),
        stream=True,
    ),
    Case(
        "completion stream",
        "POST",
        "/v1/completions",
        json.dumps(
            {"model": MODEL, "prompt": "once upon", "max_tokens": 5, "stream": True}
        ).encode(),
        stream=True,
    ),
    Case(
        "unknown model",
        "POST",
        "/v1/chat/completions",
        json.dumps({"model": "nope", "messages": [{"role": "user", "content": "x"}]}).encode(),
    ),
    Case("not json", "POST", "/v1/completions", b"{not json"),
    Case(
        "prompt too long",
        "POST",
        "/v1/completions",
        json.dumps({"model": MODEL, "prompt": "word " * 3000, "max_tokens": 4}).encode(),
    ),
    Case("models", "GET", "/v1/models", b""),
    Case("no such route", "GET", "/v2/nothing", b""),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_handle_answers_as_the_http_server(stack: Stack, case: Case) -> None:
    rid = f"same-{case.name.replace(' ', '-')}"
    got = via_handle(stack, case.method, case.path, case.body, rid)
    want = via_http(stack, case.method, case.path, case.body, rid)
    assert comparable(got, case.stream) == comparable(want, case.stream)
    if case.stream:  # one SSE event per chunk, as the server writes them
        assert all(c.endswith(b"\n\n") for c in got.chunks)
        assert len(got.chunks) == len(b"".join(got.chunks).split(b"\n\n")) - 1


def replica_stats(stack: Stack, n: int = 2, attempts: int = 50) -> dict[str, EngineStats]:
    """Every replica's `record_routing_stats()` (calls land on random replicas)."""
    seen: dict[str, EngineStats] = {}
    for _ in range(attempts):
        stats = EngineStats.from_dict(stack.handle.record_routing_stats.remote().result())
        assert stats is not None
        seen[stats.replica_id] = stats
        if len(seen) == n:
            return seen
    raise AssertionError(f"stats of {len(seen)} replicas only")


def test_replicas_report_stats_and_index_their_blocks(stack: Stack) -> None:
    for i in range(6):  # both replicas get some of them (Serve's default router)
        answer = via_handle(stack, "POST", "/v1/completions",
                            json.dumps({"model": MODEL, "prompt": "shared words " * 40 + str(i),
                                        "max_tokens": 2}).encode(), f"idx-{i}")  # fmt: skip
        assert answer.status == 200
    stats = replica_stats(stack)
    for s in stats.values():
        assert (s.engine, s.model, s.block_size) == ("sim", MODEL, 32)
        assert s.kv_events is not None and s.kv_events.startswith("tcp://")
        assert "*" not in s.kv_events and "0.0.0.0" not in s.kv_events
        assert s.kv_follower
        # the simulated load is part of the reported load time
        assert s.load_s >= LOAD_TIME_S and s.ready_at > s.started_at
        assert s.num_gpu_blocks > 0 and s.max_model_len > 0
        assert s.prefix_cache_queries >= s.prefix_cache_hits >= 0
    served = [rid for rid, s in stats.items() if s.prefix_cache_queries > 0]
    assert served
    # every replica that served a prompt follows its KV events into the shared index
    deadline = time.monotonic() + 10.0
    for rid in served:
        while stack.redis.scard(f"{KEY_PREFIX}:c:{rid}") == 0:
            assert time.monotonic() < deadline, f"no confirmed block of {rid} in Redis"
            time.sleep(0.05)
    rows = [stack.handle.follower_status.remote().result() for _ in range(6)]
    assert all(len(r) == 1 and r[0]["lost"] == 0 for r in rows)


def words(rng: random.Random, n: int) -> str:
    return " ".join(
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 8)))
        for _ in range(n)
    )


def wait_confirmed(stack: Stack, replica: str, above: int, timeout_s: float = 10.0) -> None:
    """Until the index holds more than `above` confirmed blocks of `replica`."""
    deadline = time.monotonic() + timeout_s
    while stack.redis.scard(f"{KEY_PREFIX}:c:{replica}") <= above:
        assert time.monotonic() < deadline, f"no new confirmed block of {replica} in Redis"
        time.sleep(0.02)


def test_shared_prefix_lands_on_the_replica_holding_it(stack: Stack) -> None:
    rng = random.Random(7)
    before = replica_stats(stack)
    confirmed = {rid: stack.redis.scard(f"{KEY_PREFIX}:c:{rid}") for rid in before}
    holders: dict[str, int] = {}  # replica -> predicted hit tokens of the requests sent to it
    reasons: set[str] = set()
    for p in range(3):
        prefix = words(rng, 80)
        first = via_handle(stack, "POST", "/v1/chat/completions",
                           chat(f"{prefix} question zero", max_tokens=4), f"pfx{p}-0")  # fmt: skip
        assert first.status == 200
        d0 = parse_decision_header(first.headers[DECISION_HEADER])
        # a prefix nobody holds: the policy's miss, to the least loaded replica
        assert d0["reason"] == DecisionReason.MISS_LEAST_LOADED, d0
        holder = d0["replica"]
        assert holder in before
        wait_confirmed(stack, holder, above=confirmed[holder])
        confirmed[holder] = stack.redis.scard(f"{KEY_PREFIX}:c:{holder}")
        for i in range(1, 4):
            again = via_handle(stack, "POST", "/v1/chat/completions",
                               chat(f"{prefix} question {i}", max_tokens=4, stream=True),
                               f"pfx{p}-{i}")  # fmt: skip
            assert again.status == 200
            d = parse_decision_header(again.headers[DECISION_HEADER])
            reasons.add(d["reason"])
            assert d["replica"] == holder, (d0, d)
            assert d["reason"] == DecisionReason.PREFIX_HIT, d
            hit = int(d["predicted_hit_tokens"])
            assert hit > 0
            holders[holder] = holders.get(holder, 0) + hit
    assert reasons == {DecisionReason.PREFIX_HIT}
    # the engines' own counters: each holder's cache served at least the predicted hits
    after = replica_stats(stack)
    for rid, predicted in holders.items():
        gained = after[rid].prefix_cache_hits - before[rid].prefix_cache_hits
        assert gained >= predicted, (rid, gained, predicted)
