"""The OpenAI ingress on Ray Serve (deploy/ray/) answers exactly as the standalone router.

Two stacks in front of the same simulated engine (same arguments, same tokenizer), with the same
router settings (tenants with API keys, one with a token quota, the bad-input corpus's limits):

    serve     Serve's HTTP proxy -> the ingress deployment (the router's app over a handle) ->
              our RequestRouter -> two simulated-engine replicas (one local Ray cluster, 2 CPUs)
    alone     the standalone router (uvicorn, in a thread) -> two simulated replicas over HTTP

Asserted, request by request on both stacks:
- every case of the bad-input corpus: the same status and the same OpenAI error body;
- no key, an unknown key, an exhausted quota: the same 401/429 bodies (and Retry-After);
- OpenAI SDK chat and completion, streamed and not: the same usage and finish reasons, the same
  router headers (`x-request-id` echoed, the quota's `x-ratelimit-*`, content type);
- `/v1/models` lists the same models;
- and the Serve path really went through our RequestRouter: the ingress's scope took its decision
  (`x-cp-decision` with the policy's reason names an engine replica, when asked for).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from bad_input_corpus import BAD_INPUTS, LIMITS, BadInput
from openai.types.chat import ChatCompletionStreamOptionsParam
from redis_server import RedisServer, available, free_port
from router_fixtures import replica_entry, sim_args
from router_harness import RouterServer
from sim_fleet import SimReplica

from deploy.tiny_model import default_model_dir, make_tiny_model
from router.config import load_settings

pytestmark = [
    pytest.mark.redis,
    pytest.mark.timeout(300),
]

MODEL = "tiny-llama"
APP = "fleet"
SPEED = 5.0
KEYS = {"alpha": "sk-test-alpha", "quota": "sk-test-quota"}
QUOTA_TOKENS = 50
# the engines' context: a prompt within the router's limits plus max_tokens can exceed it
CONTEXT = 256
# the router headers a client sees from both stacks (Serve's proxy adds its own: x-cp-router)
ROUTER_HEADERS = ("content-type", "x-request-id", "x-ratelimit-limit-tokens")


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def router_values(model_dir: Path) -> dict[str, Any]:
    """The router settings both stacks run with (the standalone one adds its replicas)."""
    return {
        "served_model": MODEL,
        "tokenizer": str(model_dir),
        "limits": LIMITS,
        "tenants": [
            {"id": "alpha", "api_key_sha256": [_digest(KEYS["alpha"])]},
            {
                "id": "quota",
                "api_key_sha256": [_digest(KEYS["quota"])],
                "quota_tokens": QUOTA_TOKENS,
                "quota_window_s": 600,
            },
        ],
    }


@dataclass
class Stacks:
    serve: str
    alone: str


@pytest.fixture(scope="module")
def stacks() -> Iterator[Stacks]:
    if not available():
        pytest.skip("redis-server is not installed")
    import ray
    from ray import serve

    from deploy.ray.fleet import build_fleet

    md = default_model_dir()
    make_tiny_model(md)
    values = router_values(md)
    port = free_port()
    with (
        RedisServer() as redis_server,
        SimReplica(*sim_args(md, speed=SPEED), "--max-model-len", str(CONTEXT)) as a,
        SimReplica(*sim_args(md, speed=SPEED), "--max-model-len", str(CONTEXT)) as b,
    ):
        settings = load_settings(replicas=[replica_entry("a", a), replica_entry("b", b)], **values)
        with RouterServer(settings) as alone:
            alone.wait_ready(2)
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
            try:
                serve.start(http_options={"host": "127.0.0.1", "port": port})
                args = {
                    "engine": "sim",
                    "engine_args": {
                        "speed": SPEED,
                        "max_model_len": CONTEXT,
                        "redis_url": redis_server.url,
                    },
                    "engine_replicas": 2,
                    # a loaded machine must not turn a lookup into "unknown" (load-only)
                    "request_router": {"redis_url": redis_server.url, "lookup_budget_ms": 2000},
                    "router": {**values, "telemetry": {"decision_header": True}},
                }
                serve.run(build_fleet(args), name=APP, route_prefix="/")
                yield Stacks(f"http://127.0.0.1:{port}", alone.url)
            finally:
                serve.shutdown()  # type: ignore[no-untyped-call]
                ray.shutdown()


def _send(base: str, case: BadInput, key: str) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"}
    if case.content_type is not None:
        headers["content-type"] = case.content_type
    return httpx.request(
        case.method, base + case.path, content=case.body, headers=headers, timeout=30.0
    )


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c.id for c in BAD_INPUTS])
def test_bad_input_gets_the_same_error(stacks: Stacks, case: BadInput) -> None:
    serve, alone = (_send(url, case, KEYS["alpha"]) for url in (stacks.serve, stacks.alone))
    assert (serve.status_code, alone.status_code) == (case.status, case.status)
    assert serve.json() == alone.json()


@pytest.mark.parametrize(
    ("name", "key", "status"),
    [("no key", None, 401), ("unknown key", "sk-nobody", 401)],
)
def test_refused_keys_get_the_same_error(
    stacks: Stacks, name: str, key: str | None, status: int
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    headers = {"authorization": f"Bearer {key}"} if key else {}
    answers = [
        httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=30.0)
        for url in (stacks.serve, stacks.alone)
    ]
    assert [r.status_code for r in answers] == [status, status]
    assert answers[0].json() == answers[1].json()


def test_quota_exhausted_gets_the_same_429(stacks: Stacks) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    headers = {"authorization": f"Bearer {KEYS['quota']}"}
    statuses: dict[str, list[int]] = {}
    last: dict[str, httpx.Response] = {}
    for name, url in (("serve", stacks.serve), ("alone", stacks.alone)):
        for _ in range(4):
            r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=30.0)
            statuses.setdefault(name, []).append(r.status_code)
            last[name] = r
    assert statuses["serve"] == statuses["alone"]
    assert statuses["serve"][0] == 200 and statuses["serve"][-1] == 429
    # the same body but for the wait, which depends on when each window started
    wait = re.compile(r"again in [0-9hm.]+s")
    bodies = [wait.sub("again in N", last[n].text) for n in ("serve", "alone")]
    assert bodies[0] == bodies[1] and "Rate limit reached" in bodies[0]
    assert "retry-after" in last["serve"].headers and "retry-after" in last["alone"].headers


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=KEYS["alpha"], max_retries=0)


def _router_headers(headers: Mapping[str, str]) -> dict[str, str | None]:
    return {name: headers.get(name) for name in ROUTER_HEADERS}


CHAT_MESSAGES: list[Any] = [{"role": "user", "content": "Tell me about fleets of replicas."}]


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_sdk_non_streaming_is_the_same(stacks: Stacks, api: str) -> None:
    seen = []
    for i, base in enumerate((stacks.serve, stacks.alone)):
        with _client(base) as client:
            rid = {"x-request-id": f"same-{api}-{i}"}
            if api == "chat":
                raw = client.chat.completions.with_raw_response.create(
                    model=MODEL, messages=CHAT_MESSAGES, max_tokens=12, extra_headers=rid
                )
                out = raw.parse()
                finish = [c.finish_reason for c in out.choices]
            else:
                raw_c = client.completions.with_raw_response.create(
                    model=MODEL, prompt="Once upon a time", max_tokens=12, extra_headers=rid
                )
                raw, out = raw_c, raw_c.parse()  # type: ignore[assignment]
                finish = [c.finish_reason for c in out.choices]
            assert out.usage is not None
            assert raw.headers["x-request-id"] == rid["x-request-id"]
            headers = _router_headers(raw.headers)
            headers.pop("x-request-id")
        seen.append((out.usage.prompt_tokens, out.usage.completion_tokens, finish, headers))
    assert seen[0] == seen[1]


@pytest.mark.parametrize("include_usage", [True, False])
def test_sdk_streaming_is_the_same(stacks: Stacks, include_usage: bool) -> None:
    seen = []
    for base in (stacks.serve, stacks.alone):
        with _client(base) as client:
            opts: ChatCompletionStreamOptionsParam | None = (
                {"include_usage": True} if include_usage else None
            )
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=CHAT_MESSAGES, max_tokens=12, stream=True, stream_options=opts
            )
            headers = _router_headers(raw.headers)
            chunks = list(raw.parse())
            usage = [c.usage.model_dump() for c in chunks if c.usage is not None]
            finish = [c.choices[0].finish_reason for c in chunks if c.choices]
            content = sum(1 for c in chunks if c.choices and c.choices[0].delta.content)
            headers.pop("x-request-id")
        seen.append((usage, [f for f in finish if f], content, headers))
    assert seen[0] == seen[1]
    assert bool(seen[0][0]) is include_usage


def test_models_are_the_same(stacks: Stacks) -> None:
    cards = [
        [
            {k: v for k, v in m.items() if k != "created"}
            for m in httpx.get(f"{url}/v1/models", timeout=10.0).json()["data"]
        ]
        for url in (stacks.serve, stacks.alone)
    ]
    assert cards[0] == cards[1]
    assert [(c["id"], c["max_model_len"]) for c in cards[0]] == [(MODEL, CONTEXT)]


def test_beyond_the_context_gets_the_same_error(stacks: Stacks) -> None:
    """Within the router's limits, beyond the engines' context: the router's own 400."""
    body = {"model": MODEL, "prompt": [7] * 199, "max_tokens": 64}
    headers = {"authorization": f"Bearer {KEYS['alpha']}"}
    answers = [
        httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=30.0)
        for url in (stacks.serve, stacks.alone)
    ]
    assert [r.status_code for r in answers] == [400, 400]
    assert answers[0].json() == answers[1].json()
    assert "maximum context length is 256" in answers[0].json()["error"]["message"]


def test_serve_path_is_routed_by_our_request_router(stacks: Stacks) -> None:
    """Requests sharing a long prefix: the ingress's scope carries the RequestRouter's decision
    (its reason names an engine replica), and the repeated prefix is a prefix hit."""
    prefix = "The fleet of replicas shares this rather long system prompt. " * 6
    reasons, replicas = [], []
    for i in range(4):
        r = httpx.post(
            f"{stacks.serve}/v1/completions",
            json={"model": MODEL, "prompt": prefix + str(i), "max_tokens": 2},
            headers={"authorization": f"Bearer {KEYS['alpha']}"},
            timeout=30.0,
        )
        assert r.status_code == 200, r.text
        fields = dict(p.strip().partition("=")[::2] for p in r.headers["x-cp-decision"].split(";"))
        reasons.append(fields["reason"])
        replicas.append(fields["replica"])
    assert all(rep != "-" for rep in replicas)
    assert "prefix_hit" in reasons[1:], reasons
    assert json.dumps(reasons)  # the reasons are the policy's names (DecisionReason values)
