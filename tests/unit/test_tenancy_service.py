"""Tenants through the router in process (fake vLLM replicas): a refused key does no work, the
tenant and its salt come from the key alone whatever else the request claims, each tenant's
prompts hash in its own scope, and /admin/tenants manages tenants without ever showing a key."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from fake_vllm import FakeVllmFleet

from controlplane.hashing import BlockHasher, scope_key
from controlplane.tenancy.identity import key_digest
from controlplane.tenancy.model import Tenant
from controlplane.tenancy.salts import tenant_salt
from controlplane.types import PriorityClass, RoutingRequest
from router.config import load_settings
from router.http.lean import parse
from router.http.service import create_app
from router.runtime import RouterRuntime

MODEL = "tiny-llama"
SECRET, HASH_SECRET, ADMIN = "salt-secret", "hash-secret", "admin-key"
KA, KB = "cpk-a-0123456789", "cpk-b-0123456789"
TENANTS = [
    {"id": "a", "api_key_sha256": [key_digest(KA)], "weight": 2.0},
    {"id": "b", "api_key_sha256": [key_digest(KB)], "priority": "batch"},
]


@dataclass
class Svc:
    client: httpx.AsyncClient
    fakes: FakeVllmFleet
    rt: RouterRuntime
    # what the request path was given: (tenant, request) per build, tenant per queue entry
    built: list[tuple[str, RoutingRequest]] = field(default_factory=list)
    queued: list[str] = field(default_factory=list)
    charged: list[str] = field(default_factory=list)  # tenant per quota reservation


async def _svc(monkeypatch: pytest.MonkeyPatch, **overrides: Any) -> AsyncIterator[Svc]:
    monkeypatch.setenv("CP_CACHE_SALT_SECRET", SECRET)
    monkeypatch.setenv("CP_HASH_SECRET", HASH_SECRET)
    fakes = FakeVllmFleet(["r1", "r2"])
    options: dict[str, Any] = {"tenants": TENANTS, "admin_key": ADMIN, **overrides}
    settings = load_settings(
        replicas=fakes.replica_configs(),
        tokenizer="approx",
        served_model=MODEL,
        telemetry={"json_logs": False},
        **options,
    )
    rt = RouterRuntime(settings, transport=fakes.transport, resolve=fakes.resolve)
    svc = Svc(httpx.AsyncClient(), fakes, rt)
    build, acquire, reserve = rt.core.build, rt.fairq.acquire, rt.quotas.reserve

    async def spy_build(*args: Any, tenant: Tenant, **kw: Any) -> RoutingRequest:
        req = await build(*args, tenant=tenant, **kw)
        svc.built.append((tenant.tenant_id, req))
        return req

    async def spy_acquire(tenant: Tenant, req: RoutingRequest) -> Any:
        svc.queued.append(tenant.tenant_id)
        return await acquire(tenant, req)

    async def spy_reserve(tenant: Tenant, *args: Any, **kw: Any) -> Any:
        svc.charged.append(tenant.tenant_id)
        return await reserve(tenant, *args, **kw)

    monkeypatch.setattr(rt.quotas, "reserve", spy_reserve)
    monkeypatch.setattr(rt.core, "build", spy_build)
    monkeypatch.setattr(rt.fairq, "acquire", spy_acquire)
    app = create_app(settings, runtime=rt)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as client,
    ):
        svc.client = client
        yield svc
        assert len(rt.ledger) == 0, "a reservation outlived its request"


@pytest.fixture
async def svc(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Svc]:
    async for s in _svc(monkeypatch):
        yield s


def chat(
    content: str = "hello there, a prompt long enough for several blocks " * 8, **extra: Any
) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def metric(svc: Svc, line_start: str) -> float:
    text = (await svc.client.get("/metrics")).text
    for line in text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize(
    ("headers", "reason"),
    [
        ({}, "missing"),
        (bearer("cpk-unknown"), "unknown"),
        ({"x-tenant-id": "a", "openai-organization": "a"}, "missing"),
        ({"authorization": f"Token {KA}"}, "malformed"),
        ({"authorization": f"Bearer {KA}", "api-key": KB}, "conflicting"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_refused_keys_do_no_work(
    svc: Svc, headers: dict[str, str], reason: str, stream: bool
) -> None:
    r = await svc.client.post("/v1/chat/completions", json=chat(stream=stream), headers=headers)
    assert r.status_code == 401
    err = r.json()["error"]
    assert err["type"] == "authentication_error"
    assert KA not in r.text and KB not in r.text
    assert svc.fakes.calls == [] and svc.built == [] and svc.queued == [] and svc.charged == []
    assert await metric(svc, f'cp_auth_failures_total{{reason="{reason}"}}') == 1.0
    assert await metric(svc, "cp_requests_total") == 0.0


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_key_a_claiming_tenant_b_is_served_as_a(svc: Svc, path: str) -> None:
    salt_b = tenant_salt(SECRET.encode(), "b")
    claims = {"user": "b", "tenant": "b", "tenant_id": "b", "cache_salt": salt_b}
    body = (
        chat(**claims)
        if path.endswith("chat/completions")
        else {
            "model": MODEL,
            "prompt": "hello " * 60,
            **claims,
        }
    )
    headers = {
        **bearer(KA),
        "x-tenant-id": "b",
        "x-tenant": "b",
        "openai-organization": "b",
        "openai-project": "b",
    }
    r = await svc.client.post(path, json=body, headers=headers)
    assert r.status_code == 200, r.text
    [(tenant, req)] = svc.built
    assert tenant == "a" and req.tenant == "a" and req.priority is PriorityClass.INTERACTIVE
    assert svc.queued == ["a"] and svc.charged == ["a"]
    [call] = svc.fakes.calls
    assert call.body["cache_salt"] == tenant_salt(SECRET.encode(), "a") != salt_b
    r = await svc.client.post(path, json=body, headers=bearer(KB))
    assert r.status_code == 200
    assert svc.built[-1][1].priority is PriorityClass.BATCH
    assert svc.fakes.calls[-1].body["cache_salt"] == salt_b
    assert await metric(svc, 'cp_cache_salt_total{reason="tenant"}') == 2.0


async def test_each_tenant_hashes_in_its_own_scope(svc: Svc) -> None:
    for key in (KA, KB, KA):
        r = await svc.client.post("/v1/chat/completions", json=chat(), headers=bearer(key))
        assert r.status_code == 200
    (_, a1), (_, b), (_, a2) = svc.built
    assert a1.block_hashes and a1.block_hashes == a2.block_hashes
    assert not set(a1.block_hashes) & set(b.block_hashes)
    parsed = parse(json.dumps(chat()).encode(), "chat")
    assert parsed is not None
    ids = (await svc.rt.core._tokens(parsed))[0].token_ids
    for req in (a1, b):
        salt = tenant_salt(SECRET.encode(), req.tenant)
        hasher = BlockHasher(req.block_size, scope_key(MODEL, None, salt, HASH_SECRET.encode()))
        assert list(req.block_hashes) == hasher.hash_blocks(ids)  # what the ingestor computes


async def test_open_mode_passes_the_client_salt_and_scopes_by_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async for s in _svc(monkeypatch, tenants=[]):
        for salt in ("mine", "mine", None):
            extra = {} if salt is None else {"cache_salt": salt}
            r = await s.client.post("/v1/chat/completions", json=chat(**extra))
            assert r.status_code == 200
            assert s.fakes.calls[-1].body.get("cache_salt") == salt
        (_, m1), (_, m2), (_, bare) = s.built
        assert m1.tenant == "default" and m1.cache_salt is None
        assert m1.block_hashes == m2.block_hashes and m1.block_hashes != bare.block_hashes


# -- /admin/tenants ---------------------------------------------------------------------------
ADMIN_H = bearer(ADMIN)
NEW = {"id": "c", "api_key_sha256": [key_digest("cpk-c-0123456789")], "quota_tokens": 1000}


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/admin/tenants", None),
        ("POST", "/admin/tenants", NEW),
        ("POST", "/admin/tenants", {"not": "a tenant"}),  # refused before validation
        ("DELETE", "/admin/tenants/a", None),
    ],
)
@pytest.mark.parametrize("headers", [{}, bearer("wrong"), bearer(KA)])
async def test_admin_tenants_need_the_admin_key(
    svc: Svc, method: str, path: str, body: Any, headers: dict[str, str]
) -> None:
    r = await svc.client.request(method, path, json=body, headers=headers)
    assert r.status_code == 401
    assert [t.tenant_id for t in svc.rt.tenancy.tenants()] == ["a", "b"]


async def test_admin_tenants_lifecycle_never_shows_keys(svc: Svc) -> None:
    r = await svc.client.get("/admin/tenants", headers=ADMIN_H)
    assert r.status_code == 200
    listed = r.json()
    assert not listed["open_mode"]
    assert [(t["id"], t["api_keys"], t["priority"]) for t in listed["tenants"]] == [
        ("a", 1, "interactive"),
        ("b", 1, "batch"),
    ]
    key_c = bearer("cpk-c-0123456789")
    assert (
        await svc.client.post(
            "/v1/completions", json={"model": MODEL, "prompt": "x"}, headers=key_c
        )
    ).status_code == 401
    r = await svc.client.post("/admin/tenants", json=NEW, headers=ADMIN_H)
    assert r.status_code == 201 and r.json()["tenant"]["quota_tokens"] == 1000
    assert not r.json()["replaced"]
    r = await svc.client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "x"}, headers=key_c
    )
    assert r.status_code == 200 and svc.built[-1][0] == "c"
    # a digest owned by another tenant, a malformed digest, a salt (never a client value)
    for bad in ({**NEW, "id": "d"}, {**NEW, "api_key_sha256": ["00"]}, {**NEW, "salt": "s"}):
        r = await svc.client.post("/admin/tenants", json=bad, headers=ADMIN_H)
        assert r.status_code == 400
    r = await svc.client.delete("/admin/tenants/c", headers=ADMIN_H)
    assert r.status_code == 200
    r = await svc.client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "x"}, headers=key_c
    )
    assert r.status_code == 401
    assert (await svc.client.delete("/admin/tenants/c", headers=ADMIN_H)).status_code == 404
    texts = [(await svc.client.get("/admin/tenants", headers=ADMIN_H)).text]
    for secret in (KA, KB, key_digest(KA), key_digest(KB), tenant_salt(SECRET.encode(), "a")):
        assert all(secret not in t for t in texts)


async def test_admin_api_disabled_without_an_admin_key(monkeypatch: pytest.MonkeyPatch) -> None:
    async for s in _svc(monkeypatch, admin_key=None):
        r = await s.client.post("/admin/tenants", json=NEW, headers=ADMIN_H)
        assert r.status_code == 404
