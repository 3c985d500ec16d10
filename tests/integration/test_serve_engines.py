"""Simulated engines as a Ray Serve deployment (deploy/engines/), called through a handle, routed
by our RequestRouter (router/serve/request_router.py, prefix affinity).

One local Ray cluster (2 CPUs) runs two replicas of the simulated-engine deployment, each with
the engine in process, following its own KV events into a private Redis; the driver's handle
routes with `PolicyRequestRouter` over that index. Beside it, the same engine as an HTTP server
(`controlplane sim-replica`): every request of the table goes to both, and the handle's answer
(head, then body chunks) must be the server's, byte for byte once the creation time is set
aside: error JSON, usage, SSE events. The replicas report their routing stats (engine figures,
KV-event endpoints, load time) and their blocks reach the shared index. Prompts sharing a prefix
land on the replica that holds it, for the policy's reason (the `x-cp-decision` header the
replica returns), and that engine's own prefix-cache counters count the hits. Each replica also
serves its app over HTTP (`open_http`, what bench/ray_serve_bench.py calls the same engines by):
the table's answers there are the server's too, and its requests count on that very engine.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from redis_server import RedisServer, available
from serve_engines import (
    Answer,
    call,
    chat,
    check_prefix_affinity,
    local_serve,
    replica_stats,
    wait_confirmed,
    words,
)
from sim_fleet import SimReplica

pytestmark = [
    pytest.mark.redis,
    pytest.mark.timeout(300),
]

MODEL = "tiny-llama"
KEY_PREFIX = "t:engines"
SPEED = 5.0
LOAD_TIME_S = 0.5


@dataclass
class Stack:
    handle: Any  # DeploymentHandle of the engine deployment
    http: str  # the same engine as an HTTP server
    redis: redis.Redis


@pytest.fixture(scope="module")
def stack(model_dir: Path) -> Iterator[Stack]:
    if not available():
        pytest.skip("redis-server is not installed")
    from deploy.engines.deployment import policy_router_config
    from deploy.engines.sim import DEPLOYMENT, SimEngineArgs, sim_engine_app

    with (
        RedisServer() as server,
        SimReplica("--model-dir", str(model_dir), "--speed", str(SPEED)) as sim,
    ):
        args = SimEngineArgs(
            model_dir=str(model_dir),
            speed=SPEED,
            load_time_s=LOAD_TIME_S,
            redis_url=server.url,
            key_prefix=KEY_PREFIX,
        )
        router = policy_router_config(
            policy="prefix_affinity",
            model=MODEL,
            tokenizer=str(model_dir),
            redis_url=server.url,
            key_prefix=KEY_PREFIX,
            # a loaded test machine must not turn a lookup into "unknown" (routed by load)
            lookup_budget_ms=2000.0,
        )
        app = sim_engine_app(args, num_replicas=2, request_router=router)
        admin = redis.Redis.from_url(server.url, socket_timeout=5)
        try:
            with local_serve(app, DEPLOYMENT) as handle:
                yield Stack(handle, sim.url, admin)
        finally:
            admin.close()


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


@dataclass(frozen=True)
class Case:
    name: str
    method: str
    path: str
    body: bytes
    stream: bool = False


CASES = [
    Case("chat", "POST", "/v1/chat/completions", chat(MODEL, "hello there", max_tokens=6)),
    Case(
        "chat stream with usage",
        "POST",
        "/v1/chat/completions",
        chat(
            MODEL,
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
    got = call(stack.handle, case.method, case.path, case.body, rid)
    want = via_http(stack, case.method, case.path, case.body, rid)
    assert comparable(got, case.stream) == comparable(want, case.stream)
    if case.stream:  # one SSE event per chunk, as the server writes them
        assert all(c.endswith(b"\n\n") for c in got.chunks)
        assert len(got.chunks) == len(b"".join(got.chunks).split(b"\n\n")) - 1


@pytest.fixture(scope="module")
def engine_urls(stack: Stack) -> dict[str, str]:
    """Replica id -> the URL of that engine replica's own HTTP server (`open_http`)."""
    seen: dict[str, str] = {}
    for _ in range(60):  # these calls land on any replica
        info = stack.handle.open_http.remote().result()
        seen[info["replica_id"]] = info["url"]
        if len(seen) == 2:
            return seen
    raise AssertionError(f"open_http reached {len(seen)} replicas only")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_replica_http_answers_as_the_http_server(
    stack: Stack, engine_urls: dict[str, str], case: Case
) -> None:
    rid = f"http-{case.name.replace(' ', '-')}"

    def uncached(answer: Answer) -> tuple[int, str, str, list[Any]]:
        # the engines' prefix caches have different histories (the same prompts went to the
        # server and to some replicas before): the cached-token count is each cache's state
        out = comparable(answer, case.stream)
        for doc in out[3]:
            if isinstance(doc, dict) and isinstance(doc.get("usage"), dict):
                doc["usage"].pop("prompt_tokens_details", None)
        return out

    for url in engine_urls.values():
        got = via_http(dataclasses.replace(stack, http=url), case.method, case.path, case.body, rid)
        want = via_http(stack, case.method, case.path, case.body, rid)
        assert uncached(got) == uncached(want)


def test_replica_http_reaches_that_very_engine(stack: Stack, engine_urls: dict[str, str]) -> None:
    rng = random.Random(5)
    for replica_id, url in engine_urls.items():
        before = replica_stats(stack.handle)
        body = json.dumps({"model": MODEL, "prompt": words(rng, 40), "max_tokens": 2}).encode()
        answer = via_http(
            dataclasses.replace(stack, http=url), "POST", "/v1/completions", body, "x"
        )
        assert answer.status == 200
        after = replica_stats(stack.handle)
        grew = {r for r in after if after[r].prefix_cache_queries > before[r].prefix_cache_queries}
        assert grew == {replica_id}


def test_replicas_report_stats_and_index_their_blocks(stack: Stack) -> None:
    rng = random.Random(3)
    served: set[str] = set()  # the replicas that served prompts of several full blocks
    for i in range(6):
        body = {"model": MODEL, "prompt": words(rng, 60), "max_tokens": 2}
        answer = call(stack.handle, "POST", "/v1/completions", json.dumps(body).encode(), f"i{i}")
        assert answer.status == 200
        served.add(answer.decision["replica"])
    stats = replica_stats(stack.handle)
    for s in stats.values():
        assert (s.engine, s.model, s.block_size) == ("sim", MODEL, 32)
        assert s.kv_events is not None and s.kv_events.startswith("tcp://")
        assert "*" not in s.kv_events and "0.0.0.0" not in s.kv_events
        assert s.kv_follower
        # the simulated load is part of the reported load time
        assert s.load_s >= LOAD_TIME_S and s.ready_at > s.started_at
        assert s.num_gpu_blocks > 0 and s.max_model_len > 0
        assert s.prefix_cache_queries >= s.prefix_cache_hits >= 0
    assert served <= set(stats)
    # every replica that served a prompt follows its KV events into the shared index
    for rid in served:
        wait_confirmed(stack.redis, KEY_PREFIX, rid, above=0)
    rows = [stack.handle.follower_status.remote().result() for _ in range(6)]
    assert all(len(r) == 1 and r[0]["lost"] == 0 for r in rows)


def test_shared_prefix_lands_on_the_replica_holding_it(stack: Stack, model_dir: Path) -> None:
    predicted = check_prefix_affinity(stack.handle, stack.redis, KEY_PREFIX, MODEL, str(model_dir))
    assert predicted
