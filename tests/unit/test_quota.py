"""Token quotas: the window arithmetic (table-driven), the in-memory store's invariants under any
interleaving of reserve/settle/time (Hypothesis), settling exactly once, the settle rule for
unknown usage, and the router in process (fake vLLM): 429 with OpenAI's headers and body,
max_tokens injected, actual usage settled."""

from __future__ import annotations

import asyncio
import hashlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fake_vllm import FakeVllmFleet
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.errors import QuotaExceededError
from controlplane.tenancy.model import Tenant
from controlplane.tenancy.quota import (
    Grant,
    QuotaReason,
    Reservation,
    SettleOutcome,
    WindowKind,
    counts,
    go_duration,
    grant,
    reset_after,
    retry_after,
    settle_tokens,
)
from controlplane.tenancy.quota_memory import MemoryQuotaStore
from router.config import load_settings
from router.http.service import create_app
from router.runtime import RouterRuntime

F, S = WindowKind.FIXED, WindowKind.SLIDING
EX, BIG = QuotaReason.EXHAUSTED, QuotaReason.TOO_LARGE


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


# -- pure window arithmetic ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("limit", "charged", "prompt", "seqs", "max_tokens", "cap", "expected"),
    [
        (100, 0, 10, 1, 20, 50, Grant(30, 20)),  # fits
        (100, 70, 10, 1, 20, 50, Grant(30, 20)),  # exactly fills the window
        (100, 71, 10, 1, 20, 50, EX),  # one token short
        (100, 0, 10, 1, 91, 50, BIG),  # never fits
        (100, 0, 10, 1, None, 50, Grant(60, 50)),  # injected: the default cap
        (100, 60, 10, 1, None, 50, Grant(40, 30)),  # injected: lowered to the room left
        (100, 89, 10, 1, None, 50, Grant(11, 1)),  # injected: a single token still fits
        (100, 90, 10, 1, None, 50, EX),  # not even one output token
        (100, 0, 100, 1, None, 50, BIG),  # the prompt alone fills the quota
        (100, 0, 10, 3, 31, 50, BIG),  # n=3: 10 + 3 x 31 > 100
        (100, 0, 10, 3, None, 50, Grant(100, 30)),  # n=3 injected: (100 - 10) // 3
        (100, 20, 10, 4, None, 50, Grant(78, 17)),
    ],
)
def test_grant(
    limit: int,
    charged: int,
    prompt: int,
    seqs: int,
    max_tokens: int | None,
    cap: int,
    expected: Grant | QuotaReason,
) -> None:
    assert grant(limit, charged, prompt, seqs, max_tokens, cap) == expected


@pytest.mark.parametrize(
    ("kind", "now", "t", "inside"),
    [
        (F, 125.0, 120.0, True),  # same 60 s calendar window [120, 180)
        (F, 125.0, 119.9, False),  # the previous window
        (F, 179.9, 120.0, True),
        (F, 180.0, 120.0, False),  # the boundary resets everything
        (S, 125.0, 65.1, True),  # within the last 60 s
        (S, 125.0, 65.0, False),  # exactly W ago: out
        (S, 180.0, 125.0, True),
    ],
)
def test_window_membership(kind: WindowKind, now: float, t: float, inside: bool) -> None:
    assert counts(kind, 60.0, now, t) is inside


@pytest.mark.parametrize(
    ("kind", "now", "entries", "room", "need", "wait"),
    [
        (F, 125.0, [(121.0, 50)], 0, 10, 55.0),  # fixed: the window's end
        (S, 125.0, [(100.0, 30), (110.0, 30), (120.0, 40)], 0, 10, 35.0),  # oldest leaves first
        (S, 125.0, [(100.0, 30), (110.0, 30), (120.0, 40)], 0, 50, 45.0),  # two must leave
        (S, 125.0, [(100.0, 30), (110.0, 30)], 5, 35, 35.0),  # room counts
        (S, 125.0, [(100.0, 30)], 0, 80, 60.0),  # never fits from these: a whole window
    ],
)
def test_retry_after(
    kind: WindowKind,
    now: float,
    entries: list[tuple[float, int]],
    room: int,
    need: int,
    wait: float,
) -> None:
    assert retry_after(kind, 60.0, now, entries, room, need) == pytest.approx(wait)


@pytest.mark.parametrize(
    ("kind", "now", "newest", "reset"),
    [
        (F, 125.0, None, 55.0),
        (F, 125.0, 124.0, 55.0),
        (S, 125.0, None, 0.0),
        (S, 125.0, 120.0, 55.0),
    ],
)
def test_reset_after(kind: WindowKind, now: float, newest: float | None, reset: float) -> None:
    assert reset_after(kind, 60.0, now, newest) == pytest.approx(reset)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.0, "0ms"),
        (0.12, "120ms"),
        (1.0, "1s"),
        (1.5, "1.5s"),
        (360.0, "6m0s"),
        (3723.5, "1h2m3.5s"),
    ],
)
def test_reset_header_uses_openai_durations(seconds: float, text: str) -> None:
    assert go_duration(seconds) == text


RES = Reservation("t", 1, prompt_tokens=20, amount=120, max_tokens=100, limit=1000, remaining=0,
                  reset_s=1.0, store="memory", window_s=60.0)  # fmt: skip


@pytest.mark.parametrize(
    ("reported", "reached", "streamed", "rule", "charged"),
    [
        (57, True, 3, "reserved", 57),  # the replica's own usage wins
        (57, True, 3, "streamed", 57),
        (None, False, None, "reserved", 0),  # never accepted by any replica
        (None, True, 7, "reserved", 120),  # client left / replica died: the whole reservation
        (None, True, 7, "streamed", 27),  # ... or the prompt plus what was relayed
        (None, True, 500, "streamed", 120),  # never more than reserved
        (None, True, None, "streamed", 120),  # not streamed: nothing known
    ],
)
def test_settle_rule_for_unknown_usage(
    reported: int | None, reached: bool, streamed: int | None, rule: Any, charged: int
) -> None:
    got = settle_tokens(
        RES, reported=reported, reached_replica=reached, streamed=streamed, rule=rule
    )
    assert got == charged


# -- the in-memory store -------------------------------------------------------------------------
def test_settle_exactly_once_duplicate_late_unknown() -> None:
    clock = Clock()
    store = MemoryQuotaStore(reservation_ttl_s=10.0, clock=clock)
    t = Tenant("t", quota_tokens=1000)
    a = store.reserve_within(t, 1000, 10, 90, default_cap=50)
    b = store.reserve_within(t, 1000, 10, 90, default_cap=50)
    assert store.charged(t) == 200
    assert store.settle_now(a, 40) is SettleOutcome.SETTLED
    assert store.charged(t) == 140  # the reservation replaced by the usage
    assert store.settle_now(a, 40) is SettleOutcome.DUPLICATE
    assert store.settle_now(a, 0) is SettleOutcome.DUPLICATE  # and it changes nothing
    assert store.charged(t) == 140
    clock.t += 11.0  # b's router died: b expires, charged in full
    stats = asyncio.run(store.stats("t"))
    assert (stats.expired, stats.open) == (1, 0)
    assert store.settle_now(b, 5) is SettleOutcome.LATE
    assert store.charged(t) == 140
    ghost = Reservation("t", 999, 1, 1, 1, 1, 1, 1.0, "memory", 60.0)
    assert store.settle_now(ghost, 1) is SettleOutcome.UNKNOWN
    stats = asyncio.run(store.stats("t"))
    assert (stats.reserved, stats.settled, stats.duplicate, stats.late, stats.unknown) == (
        2,
        1,
        2,
        1,
        1,
    )
    assert stats.missing == 1  # b: expired, never settled by its router


def test_refusal_carries_openai_headers() -> None:
    clock = Clock(125.0)
    store = MemoryQuotaStore(clock=clock)
    t = Tenant("acme", quota_tokens=100, quota_window_s=60.0)
    store.reserve_within(t, 100, 10, 80, default_cap=50)
    with pytest.raises(QuotaExceededError) as info:
        store.reserve_within(t, 100, 10, 20, default_cap=50)
    err = info.value
    assert err.status_code == 429 and err.reason == "exhausted"
    assert err.response_headers() == {
        "x-ratelimit-limit-tokens": "100",
        "x-ratelimit-remaining-tokens": "10",
        "x-ratelimit-reset-tokens": "55s",
        "retry-after": "55",
        "retry-after-ms": "55000",
    }
    assert "Limit 100, Used 90, Requested 30" in str(err)


# Hypothesis: reserve / settle (with usage <= the reservation, as a replica running under the
# injected cap) / duplicate settles / time passing, in any order: the window never holds more
# than the quota, it always equals a recount from first principles, each id settles once.
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("reserve"), st.integers(0, 60), st.none() | st.integers(1, 80)),
        st.tuples(st.just("settle"), st.integers(0, 1000), st.floats(0.0, 1.0)),
        st.tuples(st.just("wait"), st.floats(0.0, 40.0), st.just(0)),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(ops=OPS, kind=st.sampled_from([F, S]), quota=st.integers(50, 400), ttl=st.floats(5.0, 90.0))
def test_any_interleaving_keeps_the_window_within_the_quota(
    ops: list[tuple[str, Any, Any]], kind: WindowKind, quota: int, ttl: float
) -> None:
    clock = Clock()
    store = MemoryQuotaStore(window=kind, reservation_ttl_s=ttl, clock=clock)
    t = Tenant("t", quota_tokens=quota, quota_window_s=30.0)
    made: list[Reservation] = []
    charge: dict[int, tuple[float, int]] = {}  # the reference: id -> (admitted at, charged)
    expiry: dict[int, float] = {}
    settled: dict[int, float] = {}  # id -> when
    for op, x, y in ops:
        if op == "reserve":
            try:
                res = store.reserve_within(t, quota, x, y, default_cap=40)
            except QuotaExceededError:
                continue
            assert res.amount == x + res.max_tokens and (y is None or res.max_tokens == y)
            made.append(res)
            charge[res.reservation_id] = (clock.t, res.amount)
            expiry[res.reservation_id] = clock.t + ttl
        elif op == "settle" and made:
            res = made[x % len(made)]
            rid = res.reservation_id
            used = int(res.amount * y)
            outcome = store.settle_now(res, used)
            # tombstones live one TTL: past that, an old id may read as unknown
            forgotten = {SettleOutcome.UNKNOWN}
            if rid in settled:
                ok = {SettleOutcome.DUPLICATE}
                assert outcome in (ok | forgotten if clock.t - settled[rid] >= ttl else ok)
            elif clock.t >= expiry[rid]:  # expired (unless no sweep has run since)
                ok = {SettleOutcome.LATE, SettleOutcome.SETTLED}
                assert outcome in (ok | forgotten if clock.t - expiry[rid] >= ttl else ok)
            else:
                assert outcome is SettleOutcome.SETTLED
            if outcome is SettleOutcome.SETTLED:
                settled[rid] = clock.t
                charge[rid] = (charge[rid][0], used)
        elif op == "wait":
            clock.t += x
        inside = sum(c for at, c in charge.values() if counts(kind, 30.0, clock.t, at))
        assert store.charged(t) == inside <= quota
    stats = asyncio.run(store.stats("t"))
    assert stats.reserved == len(made) and stats.settled == len(settled)


# -- the router in process -----------------------------------------------------------------------
KEY = "cpk-quota-test-key"


@dataclass
class Svc:
    client: httpx.AsyncClient
    fakes: FakeVllmFleet
    runtime: RouterRuntime


@pytest.fixture
async def svc() -> AsyncIterator[Svc]:
    fakes = FakeVllmFleet(["a"])
    tenant = {
        "id": "acme",
        "api_key_sha256": [hashlib.sha256(KEY.encode()).hexdigest()],
        "quota_tokens": 200,
        "quota_window_s": 60.0,
    }
    s = load_settings(
        replicas=fakes.replica_configs(),
        tokenizer="approx",
        served_model="tiny-llama",
        telemetry={"json_logs": False},
        tenants=[tenant],
        quota={"default_max_tokens": 40},
    )
    runtime = RouterRuntime(s, transport=fakes.transport, resolve=fakes.resolve)
    app = create_app(s, runtime=runtime)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app),
            base_url="http://r",
            headers={"authorization": f"Bearer {KEY}"},
        ) as client,
    ):
        yield Svc(client, fakes, runtime)


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], **extra}


async def test_router_reserves_injects_settles_and_refuses_with_429(svc: Svc) -> None:
    r = await svc.client.post("/v1/chat/completions", json=chat(max_tokens=3))
    assert r.status_code == 200
    assert r.headers["x-ratelimit-limit-tokens"] == "200"
    held = 200 - int(r.headers["x-ratelimit-remaining-tokens"])  # prompt + 3, at admission
    # settled with the replica's usage (the fake reports 10 prompt + 3 completion tokens)
    store = svc.runtime.quotas
    assert isinstance(store, MemoryQuotaStore)
    assert store.charged(Tenant("acme", quota_tokens=200)) == 13 and held > 3

    r = await svc.client.post("/v1/chat/completions", json=chat(stream=True))
    assert r.status_code == 200
    assert svc.fakes.calls[-1].body["max_tokens"] == 40  # no max_tokens: the cap injected

    with_cap = await svc.client.post("/v1/chat/completions", json=chat(max_tokens=300))
    assert with_cap.status_code == 429
    err = with_cap.json()["error"]
    assert err["type"] == "rate_limit_error" and "Request too large" in err["message"]

    # fill the window, then one more
    while (
        r := await svc.client.post("/v1/chat/completions", json=chat(max_tokens=30))
    ).status_code == 200:
        pass
    assert r.status_code == 429
    assert int(r.headers["retry-after"]) >= 1
    assert set(r.headers) >= {"x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens"}
    assert r.json()["error"]["type"] == "rate_limit_error"
    sent = len(svc.fakes.calls)
    # without max_tokens, the injected cap is lowered to the room left (>= 1 token)
    r = await svc.client.post("/v1/chat/completions", json=chat())
    if r.status_code == 200:
        assert 1 <= svc.fakes.calls[-1].body["max_tokens"] < 40
        sent += 1
    assert len(svc.fakes.calls) == sent  # a refused request never reached the replica

    stats = await store.stats("acme")
    assert stats.settled == stats.reserved and stats.open == 0 and stats.duplicate == 0
    text, _ = svc.runtime.metrics.render()
    assert b'cp_quota_rejections_total{reason="exhausted",tenant="acme"}' in text
    assert b'cp_quota_settlements_total{outcome="settled"}' in text


async def test_no_quota_no_reservation(svc: Svc) -> None:
    store = MemoryQuotaStore()
    assert await store.reserve(Tenant("free"), 10, None, default_cap=5) is None
    store.settle_soon(None, 3)  # a no-op, as the relay calls it for every request


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_store_unreachable_hard_fails_closed_soft_admits_its_share() -> None:
    """Redis configured but nothing listens: a hard tenant gets 503 (OpenAI body), a soft one
    is served from this router's share, quota / expected_routers."""
    fakes = FakeVllmFleet(["a"])
    hard_key, soft_key = "cpk-hard-tenant-key", "cpk-soft-tenant-key"

    def tenant(tid: str, key: str, mode: str) -> dict[str, Any]:
        digest = hashlib.sha256(key.encode()).hexdigest()
        return {"id": tid, "api_key_sha256": [digest], "quota_tokens": 400, "quota_mode": mode}

    s = load_settings(
        replicas=fakes.replica_configs(),
        tokenizer="approx",
        served_model="tiny-llama",
        telemetry={"json_logs": False},
        redis={"url": f"redis://127.0.0.1:{closed_port()}/0"},
        tenants=[tenant("h", hard_key, "hard"), tenant("s", soft_key, "soft")],
        # a share of 100 tokens: the approx bound without template allowance fits a few requests
        quota={"expected_routers": 4, "timeout_ms": 200, "approx_template_tokens": 0},
    )
    runtime = RouterRuntime(s, transport=fakes.transport, resolve=fakes.resolve)
    app = create_app(s, runtime=runtime)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as client,
    ):
        r = await client.post(
            "/v1/chat/completions",
            json=chat(max_tokens=5),
            headers={"authorization": f"Bearer {hard_key}"},
        )
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "QuotaUnavailableError"
        assert not fakes.calls  # fail closed: nothing sent
        served = refused = 0
        for _ in range(12):
            r = await client.post(
                "/v1/chat/completions",
                json=chat(max_tokens=20),
                headers={"authorization": f"Bearer {soft_key}"},
            )
            if r.status_code == 200:
                served += 1
                assert int(r.headers["x-ratelimit-limit-tokens"]) == 100  # 400 // 4 routers
            else:
                assert r.status_code == 429
                refused += 1
        assert served >= 1 and refused >= 1 and served == len(fakes.calls)
        ready = await client.get("/ready")
        assert "quota store unreachable" in ready.text
        text, _ = runtime.metrics.render()
        assert b'cp_quota_rejections_total{reason="store_down",tenant="h"} 1.0' in text
        assert b'reason="local_share",tenant="s"' in text


def test_a_tombstone_lives_one_ttl_measured_as_an_age() -> None:
    """At now = settled + ttl in floating point, `now - settled` can still be under the TTL while
    `settled <= now - ttl` already holds: the store measures the age, as its callers do, so a
    second settle is still a duplicate there, not an unknown id (found by the test above)."""
    settled_at, ttl = 270.42823728344507, 7.600148557852051
    clock = Clock(settled_at)
    store = MemoryQuotaStore(reservation_ttl_s=ttl, clock=clock)
    t = Tenant("t", quota_tokens=100, quota_window_s=30.0)
    res = store.reserve_within(t, 100, 10, 5, default_cap=40)
    assert store.settle_now(res, 12) is SettleOutcome.SETTLED
    clock.t = settled_at + ttl
    assert clock.t - settled_at < ttl
    store.reserve_within(t, 100, 10, 5, default_cap=40)  # sweeps the tombstones first
    assert store.settle_now(res, 12) is SettleOutcome.DUPLICATE
