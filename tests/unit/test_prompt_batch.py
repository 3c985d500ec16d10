"""Prompts per request: a completions batch larger than `limits.max_prompts_per_request` is
refused with a 400 OpenAI error before any prompt is tokenized (nothing reserved, nothing sent),
and every reservation of a batch scales with its prompts: the quota holds all prompts' tokens
plus sequences x max_tokens, the fair queue's ticket the same."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from fake_vllm import FakeVllmFleet

from controlplane.tenancy.identity import key_digest
from controlplane.tenancy.model import Tenant
from controlplane.tenancy.quota import Reservation
from controlplane.types import RoutingRequest
from router.config import load_settings
from router.fairness.queue import Ticket
from router.http.service import create_app
from router.runtime import RouterRuntime

MODEL = "tiny-llama"
KEY = "cpk-batch-0123456789"
QUOTA = 10_000_000
TENANTS = [{"id": "t", "api_key_sha256": [key_digest(KEY)], "quota_tokens": QUOTA}]
AUTH = {"authorization": f"Bearer {KEY}"}


@dataclass
class Svc:
    client: httpx.AsyncClient
    fakes: FakeVllmFleet
    rt: RouterRuntime
    tokenized: list[object] = field(default_factory=list)
    reservations: list[Reservation] = field(default_factory=list)
    tickets: list[Ticket] = field(default_factory=list)


@pytest.fixture
async def svc(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Svc]:
    fakes = FakeVllmFleet(["r1", "r2"])
    settings = load_settings(
        replicas=fakes.replica_configs(),
        tokenizer="approx",
        served_model=MODEL,
        tenants=TENANTS,
        telemetry={"json_logs": False},
    )
    rt = RouterRuntime(settings, transport=fakes.transport, resolve=fakes.resolve)
    svc = Svc(httpx.AsyncClient(), fakes, rt)
    tokenize, reserve, acquire = rt.tokenizer.tokenize, rt.quotas.reserve, rt.fairq.acquire

    async def spy_tokenize(prompt: Any, **kw: Any) -> Any:
        svc.tokenized.append(prompt)
        return await tokenize(prompt, **kw)

    async def spy_reserve(*args: Any, **kw: Any) -> Any:
        res = await reserve(*args, **kw)
        assert res is not None
        svc.reservations.append(res)
        return res

    async def spy_acquire(tenant: Tenant, req: RoutingRequest) -> Ticket:
        ticket = await acquire(tenant, req)
        svc.tickets.append(ticket)
        return ticket

    monkeypatch.setattr(rt.tokenizer, "tokenize", spy_tokenize)
    monkeypatch.setattr(rt.quotas, "reserve", spy_reserve)
    monkeypatch.setattr(rt.fairq, "acquire", spy_acquire)
    app = create_app(settings, runtime=rt)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as client,
    ):
        svc.client = client
        yield svc
        # nothing outlives its request: ledger, fair queue slots, quota reservations
        assert len(rt.ledger) == 0
        assert rt.fairq.admitted == 0 and rt.fairq.queued == 0
        stats = await rt.quotas.stats("t")
        assert stats.open == 0


def completion(prompt: object, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 5, **extra}


async def test_a_hundred_thousand_prompts_are_refused_before_tokenizing(svc: Svc) -> None:
    body = completion([[7]] * 100_000)
    r = await svc.client.post("/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == "prompt"
    assert "100000 prompts" in err["message"]
    limit = svc.rt.settings.limits.max_prompts_per_request
    assert str(limit) in err["message"]
    # refused before any work: nothing tokenized, reserved, queued or sent
    assert svc.tokenized == [] and svc.reservations == [] and svc.tickets == []
    assert svc.fakes.calls == []


@pytest.mark.parametrize(
    ("prompt", "status"),
    [
        (["a b c"] * 4, 200),  # at the limit: served
        (["a b c"] * 5, 400),
        ([[1, 2, 3]] * 4, 200),
        ([[1, 2, 3]] * 5, 400),
        (list(range(1000)), 200),  # one prompt of token ids, however long
        ("one prompt", 200),
    ],
)
async def test_the_prompt_cap_counts_prompts_not_tokens(
    monkeypatch: pytest.MonkeyPatch, prompt: object, status: int
) -> None:
    fakes = FakeVllmFleet(["r1"])
    settings = load_settings(
        replicas=fakes.replica_configs(),
        tokenizer="approx",
        served_model=MODEL,
        limits={"max_prompts_per_request": 4},
        telemetry={"json_logs": False},
    )
    rt = RouterRuntime(settings, transport=fakes.transport, resolve=fakes.resolve)
    app = create_app(settings, runtime=rt)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as client,
    ):
        r = await client.post("/v1/completions", json=completion(prompt))
        assert r.status_code == status, r.text
        assert len(fakes.calls) == (status == 200)


@pytest.mark.parametrize(("prompts", "n"), [(1, 1), (3, 1), (8, 1), (3, 2)])
async def test_reservations_scale_with_the_prompts(svc: Svc, prompts: int, n: int) -> None:
    body = completion([[1, 2, 3]] * prompts, n=n)
    r = await svc.client.post("/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    (res,) = svc.reservations
    (ticket,) = svc.tickets
    want = 3 * prompts + n * prompts * 5  # every prompt's tokens + sequences x max_tokens
    assert res.amount == want
    assert ticket.prompt_tokens == 3 * prompts
    assert ticket.reserved_tokens == want
