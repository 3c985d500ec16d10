"""The router in front of two replicas, real vLLM (CPU build, tiny model) and simulated, with
the same client code: the OpenAI SDK streaming and not, prefix affinity learnt from the replicas'
own KV events through the shared Redis index, the engines' cache hits, request ids, the admin
API, and nothing left reserved afterwards."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai import OpenAI
from redis_server import RedisServer, available
from router_fixtures import wait_until
from router_harness import RouterServer
from vllm_fleet import vllm_missing_reason

from deploy.local_fleet import FleetSpec, LocalFleet
from router.config import load_settings
from router.telemetry import parse_decision_header

pytestmark = [pytest.mark.redis, pytest.mark.timeout(900)]

MODEL = "tiny-llama"
ADMIN = "test-admin-key"
# ~20 blocks of 32 tokens with the tiny tokenizer: long enough that a hit is unmistakable
DOCUMENT = " ".join(
    f"Section {i}: the fleet routes requests by their cached prefix." for i in range(30)
)


@pytest.fixture(scope="module", params=["sim", "vllm"])
def fleet(request: pytest.FixtureRequest) -> Iterator[LocalFleet]:
    engine = request.param
    if engine == "vllm" and (why := vllm_missing_reason()) is not None:
        pytest.skip(why)
    spec = FleetSpec(
        replicas=2,
        engine=engine,
        base_port=0,
        model_name=MODEL,
        block_size=32,
        max_model_len=1024,
        python_hash_seed="0",
        speed=5.0,
        startup_timeout_s=420.0,
    )
    with LocalFleet(spec) as f:
        yield f


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    if not available():
        pytest.skip("redis-server is not installed")
    with RedisServer() as server:
        yield server.url


@pytest.fixture(scope="module")
def router(fleet: LocalFleet, redis_url: str) -> Iterator[RouterServer]:
    replicas = [
        {
            "id": f"r{i}",
            "url": rep.url,
            "gpu": "cpu",
            "model": "tiny-llama",
            "kv_events": rep.launch.events_connect,
            "kv_replay": rep.launch.replay_connect,
            "kv_topic": fleet.spec.topic,
        }
        for i, rep in enumerate(fleet.replicas)
    ]
    settings = load_settings(
        served_model=MODEL,
        tokenizer=str(fleet.replicas[0].launch.model_dir),
        replicas=replicas,
        redis={"url": redis_url, "key_prefix": f"e2e-{fleet.spec.engine}"},
        policy={"name": "prefix_affinity"},
        telemetry={"decision_header": True, "json_logs": False},
        admin_key=ADMIN,
        health={"scrape_interval_s": 0.2},
    )
    with RouterServer(settings) as server:
        server.wait_ready(2, timeout_s=60)
        yield server
        assert len(server.runtime.ledger) == 0, "a reservation outlived its request"


@pytest.fixture
def client(router: RouterServer) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_chat_through_the_sdk(client: OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello there"}], max_tokens=8
    )
    assert out.choices[0].message.content
    assert out.usage is not None and out.usage.completion_tokens == 8


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_streaming_through_the_sdk(client: OpenAI, include_usage: bool) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Stream to me"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True} if include_usage else None,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    # the router asks every replica for the final usage chunk; the client sees it only when it
    # asked (vLLM started with --enable-force-include-usage also puts usage on every chunk)
    usage = [c.usage for c in chunks if not c.choices and c.usage is not None]
    assert len(usage) == (1 if include_usage else 0)
    if include_usage:
        assert usage[0].completion_tokens == 6


@pytest.mark.parametrize("stream", [False, True])
def test_completions_through_the_sdk(client: OpenAI, stream: bool) -> None:
    if stream:
        parts = client.completions.create(
            model=MODEL, prompt="Once upon", max_tokens=5, stream=True
        )
        assert "".join(p.choices[0].text for p in parts if p.choices)
    else:
        out = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=5)
        assert out.choices[0].text and out.usage is not None


def test_unknown_model_is_an_openai_404(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(
            model="gpt-9", messages=[{"role": "user", "content": "x"}], max_tokens=1
        )
    assert "gpt-9" in str(err.value)


def _decision(router: RouterServer, content: str, request_id: str) -> tuple[dict[str, str], int]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 2,
    }
    r = httpx.post(
        f"{router.url}/v1/chat/completions",
        json=body,
        headers={"x-request-id": request_id},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == request_id
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return parse_decision_header(r.headers["x-cp-decision"]), int(cached)


def test_prefix_affinity_learns_from_the_replicas_events(router: RouterServer) -> None:
    first, _ = _decision(router, DOCUMENT + " Question one?", "affinity-1")
    owner = first["replica"]
    # the owner's KV events reach the index (through Redis); then the same document goes there
    deadline = time.monotonic() + 10
    while True:
        second, cached = _decision(router, DOCUMENT + " Question two?", f"affinity-{time.time()}")
        if second["reason"] == "prefix_hit" or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert second["reason"] == "prefix_hit"
    assert second["replica"] == owner
    assert int(second["predicted_hit_tokens"]) >= 32 * 15
    assert cached >= 32 * 15  # the engine itself reports the hit
    metrics = httpx.get(f"{router.url}/metrics").text
    assert (
        'cp_requests_total{arm="prefix_affinity",policy="prefix_affinity",reason="prefix_hit"'
        in metrics
    )


def test_admin_api_drains_and_restores(router: RouterServer) -> None:
    url = f"{router.url}/admin/replicas"
    assert httpx.get(url).status_code == 401
    auth = {"authorization": f"Bearer {ADMIN}"}
    listed = httpx.get(url, headers=auth).json()["replicas"]
    assert {r["id"] for r in listed} == {"r0", "r1"}
    r1 = next(r for r in listed if r["id"] == "r1")
    assert httpx.post(f"{url}/r1/drain", headers=auth).status_code == 200
    for i in range(4):  # nothing new goes to a draining replica
        decision, _ = _decision(router, f"drain test {i}", f"drain-{i}")
        assert decision["replica"] == "r0"
    # drained and idle, it leaves on its own (the fleet registry settles the drain)
    wait_until(
        lambda: {r["id"] for r in httpx.get(url, headers=auth).json()["replicas"]} == {"r0"},
        20,
        "the drained replica to leave",
    )
    assert httpx.delete(f"{url}/r1", headers=auth).status_code == 404  # already gone
    cfg = {k: r1[k] for k in ("id", "url")} | {"gpu": "cpu", "model": "tiny-llama"}
    assert httpx.post(url, json=cfg, headers=auth).status_code == 201
    router.wait_ready(2, timeout_s=30)
    # DELETE drains it and waits for it to leave (nothing in flight: at once)
    assert httpx.delete(f"{url}/r1", headers=auth).json() == {"removed": "r1"}
    assert httpx.delete(f"{url}/r1", headers=auth).status_code == 404
    assert httpx.post(url, json=cfg, headers=auth).status_code == 201
    router.wait_ready(2, timeout_s=30)


def test_ready_and_health(router: RouterServer) -> None:
    assert httpx.get(f"{router.url}/health").json() == {"status": "ok"}
    ready = httpx.get(f"{router.url}/ready").json()
    assert ready["status"] == "ready" and ready["index"] == "redis"
    models = httpx.get(f"{router.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
