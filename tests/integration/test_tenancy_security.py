"""Tenant isolation, live: a router with two tenants in front of two simulated replicas that
publish KV events into a private Redis index.

- an unknown (or missing) key is answered 401 `authentication_error` and nothing reaches a
  replica or the fair queue;
- key A sent with headers and body fields claiming tenant B (`x-tenant-id`, `OpenAI-Organization`,
  `user`, `tenant`, B's own `cache_salt`) is queued as A and its blocks are cached under A's salt:
  probing the replica directly, the prompt is cached for A's salt and for no other;
- A's repeated prefix becomes an index prefix hit for A (learnt from the replica's own KV events,
  no speculative entries) and is never one for B, in the index or in the engine;
- after a canary corpus (chat and completions, streamed or not, refused and malformed requests),
  no canary text and no run of its token ids appears in any Redis key or value, nor in the
  router's log output (JSON, DEBUG, captured from the root logger).
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis
from redis_server import RedisServer, available
from router_fixtures import MODEL, replica_entry, router_settings, sim_args, wait_until
from router_harness import RouterServer
from sim_fleet import SimReplica

from controlplane.tenancy.identity import key_digest
from controlplane.tenancy.model import Tenant
from controlplane.tenancy.salts import tenant_salt
from controlplane.tokenization import LocalTokenizer
from controlplane.types import RoutingRequest
from router.http.openai_api import ChatCompletionRequest
from router.telemetry import parse_decision_header
from router.telemetry.logs import configure_logging

pytestmark = [pytest.mark.redis, pytest.mark.timeout(300)]

SECRET, HASH_SECRET = "test-salt-secret", "test-hash-secret"
KA, KB = "cpk-tenant-a-3c1f0e9d", "cpk-tenant-b-77ab42c1"
DOC = " ".join(f"Clause {i}: the tenant's private contract text goes here." for i in range(24))
CANARIES = [f"CANARY{i}x{n}QZ" for i, n in enumerate((7741, 9210, 3388, 5127, 6604, 8093))]


class Live:
    def __init__(
        self, router: RouterServer, sims: dict[str, SimReplica], logs: io.StringIO, redis_url: str
    ) -> None:
        self.router, self.sims, self.logs, self.redis_url = router, sims, logs, redis_url
        # tenants of the requests that entered the fair queue; replicas the proxy called
        self.queued: list[str] = []
        self.sent: list[str] = []
        self.charged: list[str] = []

    def post(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> httpx.Response:
        return httpx.post(f"{self.router.url}{path}", json=body, headers=headers, timeout=30.0)

    def engine_prompt_tokens(self) -> float:
        total = 0.0
        for sim in self.sims.values():
            for line in httpx.get(f"{sim.url}/metrics", timeout=5.0).text.splitlines():
                if line.startswith("vllm:prompt_tokens_total"):
                    total += float(line.rsplit(" ", 1)[1])
        return total


@pytest.fixture(scope="module")
def live(model_dir: Path) -> Iterator[Live]:
    if not available():
        pytest.skip("redis-server is not installed")
    root = logging.getLogger()
    level, httpx_level = root.level, logging.getLogger("httpx").level
    logs = io.StringIO()
    with (
        pytest.MonkeyPatch.context() as mp,
        RedisServer() as redis_server,
        SimReplica(*sim_args(model_dir, kv_events=True)) as s1,
        SimReplica(*sim_args(model_dir, kv_events=True)) as s2,
    ):
        mp.setenv("CP_CACHE_SALT_SECRET", SECRET)
        mp.setenv("CP_HASH_SECRET", HASH_SECRET)
        configure_logging(json_logs=True, level="DEBUG", stream=logs)
        settings = router_settings(
            model_dir,
            [replica_entry("r1", s1, kv_events=True), replica_entry("r2", s2, kv_events=True)],
            redis={"url": redis_server.url, "key_prefix": "sec"},
            # confirmed entries only: what the index holds came from the replicas' KV events
            policy={"name": "prefix_affinity", "speculative": False},
            telemetry={"decision_header": True, "json_logs": True, "log_level": "DEBUG"},
            tenants=[
                {"id": "a", "api_key_sha256": [key_digest(KA)]},
                {"id": "b", "api_key_sha256": [key_digest(KB)], "priority": "batch"},
            ],
            health={"scrape_interval_s": 0.2},
        )
        try:
            with RouterServer(settings) as router:
                router.wait_ready(2)
                state = Live(router, {"r1": s1, "r2": s2}, logs, redis_server.url)
                acquire = router.runtime.fairq.acquire

                async def spy(tenant: Tenant, req: RoutingRequest) -> Any:
                    state.queued.append(tenant.tenant_id)
                    return await acquire(tenant, req)

                open_upstream = router.runtime.proxy.open

                async def spy_open(replica_id: str, *args: Any, **kw: Any) -> Any:
                    state.sent.append(replica_id)
                    return await open_upstream(replica_id, *args, **kw)

                reserve = router.runtime.quotas.reserve

                async def spy_reserve(tenant: Tenant, *args: Any, **kw: Any) -> Any:
                    state.charged.append(tenant.tenant_id)
                    return await reserve(tenant, *args, **kw)

                router.call(lambda: setattr(router.runtime.quotas, "reserve", spy_reserve))
                router.call(lambda: setattr(router.runtime.fairq, "acquire", spy))
                router.call(lambda: setattr(router.runtime.proxy, "open", spy_open))
                yield state
                assert len(router.runtime.ledger) == 0, "a reservation outlived its request"
        finally:
            for h in [h for h in root.handlers if type(h).__name__ == "_RouterHandler"]:
                root.removeHandler(h)
            root.setLevel(level)
            logging.getLogger("httpx").setLevel(httpx_level)


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 4,
        **extra,
    }


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def cached(r: httpx.Response) -> int:
    return int((r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def salt(tenant: str) -> str:
    return tenant_salt(SECRET.encode(), tenant)


def scope_hashes(live: Live, tenant: str, body: dict[str, Any]) -> RoutingRequest:
    """The request as the router builds it for `tenant` (its scoped block hashes)."""
    rt = live.router.runtime
    t = rt.tenancy.get(tenant)
    assert t is not None
    req: RoutingRequest = live.router.call(
        lambda: rt.core.build(
            ChatCompletionRequest(**body), request_id="probe", tenant=t, session=None
        )
    )
    return req


def confirmed(live: Live, req: RoutingRequest) -> dict[str, int]:
    rt = live.router.runtime
    matches = live.router.call(lambda: rt.index.lookup(req.block_hashes, ["r1", "r2"])) or {}
    return {rid: m.confirmed_blocks for rid, m in matches.items() if m.confirmed_blocks}


# -- tests -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "headers", [{}, bearer("cpk-nobody"), {"x-tenant-id": "a", "openai-organization": "a"}]
)
def test_unknown_key_is_401_with_nothing_queued_or_sent(
    live: Live, headers: dict[str, str]
) -> None:
    before = live.engine_prompt_tokens()
    seen = (len(live.charged), len(live.queued), len(live.sent))
    for body in (chat(DOC), chat(DOC, stream=True)):
        r = live.post("/v1/chat/completions", body, headers)
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "authentication_error"
    assert (len(live.charged), len(live.queued), len(live.sent)) == seen
    assert live.engine_prompt_tokens() == before


def test_key_a_claiming_b_is_charged_queued_and_salted_as_a(live: Live) -> None:
    text = "Spoofed request. " + DOC
    spoof_headers = {**bearer(KA), "x-tenant-id": "b", "openai-organization": "b", "x-tenant": "b"}
    body = chat(text, user="b", tenant="b", cache_salt=salt("b"))
    charged, queued, sent = len(live.charged), len(live.queued), len(live.sent)
    r = live.post("/v1/chat/completions", body, spoof_headers)
    assert r.status_code == 200, r.text
    replica = parse_decision_header(r.headers["x-cp-decision"])["replica"]
    assert live.charged[charged:] == ["a"] and live.queued[queued:] == ["a"]
    assert live.sent[sent:] == [replica]
    sim = live.sims[replica]
    # the replica cached the prompt under A's salt, not B's (nor unsalted)
    probes = {
        name: cached(
            httpx.post(f"{sim.url}/v1/chat/completions", json=chat(text, **extra), timeout=30)
        )
        for name, extra in (
            ("a", {"cache_salt": salt("a")}),
            ("b", {"cache_salt": salt("b")}),
            ("none", {}),
        )
    }
    assert probes["a"] > 0 and probes["b"] == 0 and probes["none"] == 0, probes


def test_a_prefix_is_an_index_hit_for_its_tenant_only(live: Live) -> None:
    text = "Index isolation. " + DOC
    body = chat(text)
    first = live.post("/v1/chat/completions", body, bearer(KA))
    assert first.status_code == 200 and cached(first) == 0
    home = parse_decision_header(first.headers["x-cp-decision"])["replica"]
    req_a, req_b = scope_hashes(live, "a", body), scope_hashes(live, "b", body)
    wait_until(lambda: home in confirmed(live, req_a), 5.0, "the index to learn A's blocks")
    assert confirmed(live, req_b) == {}  # never in B's scope
    again = live.post("/v1/chat/completions", body, bearer(KA))
    decision = parse_decision_header(again.headers["x-cp-decision"])
    assert decision["reason"] == "prefix_hit" and decision["replica"] == home
    assert cached(again) > 0
    # B, even claiming A every way it can, gets no index hit and no engine hit
    spoof = {**bearer(KB), "x-tenant-id": "a", "openai-organization": "a"}
    b = live.post("/v1/chat/completions", chat(text, user="a", cache_salt=salt("a")), spoof)
    assert b.status_code == 200
    assert parse_decision_header(b.headers["x-cp-decision"])["reason"] != "prefix_hit"
    assert cached(b) == 0


def test_no_prompt_text_in_redis_or_logs(live: Live, model_dir: Path) -> None:
    tok = LocalTokenizer.from_path(model_dir)
    sent = 0
    for i, canary in enumerate(CANARIES):
        key = (KA, KB)[i % 2]
        text = f"{DOC} {canary} {canary.lower()} and more {canary}"
        for path, body in (
            ("/v1/chat/completions", chat(text, stream=bool(i % 3 == 0))),
            ("/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 3}),
        ):
            r = live.post(path, body, bearer(key))
            assert r.status_code == 200, r.text
            sent += 1
        # refused on the way: unknown key, malformed field, unknown model
        assert live.post("/v1/chat/completions", chat(text), bearer(canary)).status_code == 401
        assert (
            live.post(
                "/v1/chat/completions", chat(text, max_tokens=canary), bearer(key)
            ).status_code
            == 400
        )
        assert (
            live.post(
                "/v1/chat/completions", {**chat(text), "model": canary}, bearer(key)
            ).status_code
            == 404
        )
    client = redis.Redis.from_url(live.redis_url)
    try:
        wait_until(lambda: client.dbsize() > 0, 5.0, "the index to hold entries")
        dump = redis_dump(client)
    finally:
        client.close()
    logs = live.logs.getvalue()
    assert logs.count('"message":"request finished"') >= sent  # the capture works
    needles = [c.encode() for c in CANARIES] + [c.lower().encode() for c in CANARIES]
    for blob, where in ((dump, "Redis"), (logs.encode(), "the router's logs")):
        found = [n.decode() for n in needles if n in blob]
        assert not found, f"canary text in {where}: {found}"
        for canary in CANARIES:
            ids = tok.encode(f" {canary} {canary.lower()}", add_special_tokens=False)
            for run in token_runs(ids):
                assert run not in blob, f"a run of canary token ids in {where}"


def token_runs(ids: list[int], n: int = 4) -> list[bytes]:
    """Runs of `n` ids as u32 LE (how hashes pack them) and as JSON/CSV text."""
    out = []
    for i in range(len(ids) - n + 1):
        window = ids[i : i + n]
        out.append(np.asarray(window, dtype="<u4").tobytes())
        out.append(json.dumps(window).encode()[1:-1])
        out.append(",".join(map(str, window)).encode())
    return out


def redis_dump(client: redis.Redis) -> bytes:
    """Every key and every value of every type, concatenated."""
    parts: list[object] = []
    for key in client.scan_iter(count=1000):
        parts.append(key)
        kind = _b(client.type(key)).decode()
        got: Any
        if kind == "string":
            parts.append(client.get(key))
        elif kind == "hash":
            got = client.hgetall(key)
            parts.extend(x for kv in got.items() for x in kv)
        elif kind == "set":
            parts.extend(client.smembers(key))
        elif kind == "zset":
            got = client.zrange(key, 0, -1, withscores=True)
            parts.extend(member for member, _score in got)
        elif kind == "list":
            parts.extend(client.lrange(key, 0, -1))
        elif kind == "stream":
            got = client.xrange(key)
            parts.extend(x for _id, fields in got for kv in fields.items() for x in kv)
        else:
            raise AssertionError(f"unexpected Redis type {kind} at {key!r}")
    return b"\n".join(_b(p) for p in parts)


def _b(value: object) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()
