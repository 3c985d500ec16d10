"""The series the alert rules need: KV-event followers, Redis breakers, routable replicas."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from fake_vllm import FakeVllmFleet
from prometheus_client import CollectorRegistry

from controlplane.kvevents.metrics import KvEventMetrics
from controlplane.kvevents.service import ReplicaStatus
from controlplane.store.breaker import CircuitBreaker
from controlplane.store.metrics import BreakerMetrics
from controlplane.tenancy.model import Tenant
from router.config import load_settings
from router.runtime import RouterRuntime
from router.telemetry import RouterMetrics

ROW = ReplicaStatus(
    replica_id="r1", state="live", trusted=True, applied_seq=0, batches=0, replayed=0, gaps=0,
    lost=0, restarts=0, mapped_blocks=0, skipped_unknown_parent=0, incarnation=1,
)  # fmt: skip


def row(**kw: object) -> ReplicaStatus:
    return dataclasses.replace(ROW, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        # cumulative figures: each counter adds the increase since the last sync
        ([row(batches=10), row(batches=25, gaps=2, lost=1)], (25, 1, 2, 0)),
        ([row(batches=10), row(batches=10)], (10, 0, 0, 0)),
        # a follower whose figures went down (re-created): its new total is the increase
        ([row(batches=10, lost=2), row(batches=4), row(batches=6, lost=1)], (16, 3, 0, 0)),
        ([row(restarts=1), row(restarts=3, gaps=5)], (0, 0, 5, 3)),
    ],
)
def test_kv_event_counters_add_increases(
    rows: list[ReplicaStatus], expected: tuple[int, int, int, int]
) -> None:
    reg = CollectorRegistry()
    m = KvEventMetrics(reg)
    for r in rows:
        m.sync([r])
    got = tuple(
        reg.get_sample_value(f"cp_kv_events_{name}_total", {"replica": "r1"}) or 0.0
        for name in ("applied", "lost", "gaps", "restarts")
    )
    assert got == tuple(float(x) for x in expected)


def test_kv_event_freshness_and_trust_gauges() -> None:
    reg = CollectorRegistry()
    m = KvEventMetrics(reg)
    m.sync([row(trusted=False)])
    assert reg.get_sample_value("cp_kv_events_trusted", {"replica": "r1"}) == 0.0
    # no batch applied yet: no timestamp series (an alert on its age must not see 1970)
    last = "cp_kv_events_last_batch_timestamp_seconds"
    assert reg.get_sample_value(last, {"replica": "r1"}) is None
    m.sync([row(trusted=True, batches=1, last_batch_at=1_700_000_000.5)])
    assert reg.get_sample_value("cp_kv_events_trusted", {"replica": "r1"}) == 1.0
    assert reg.get_sample_value(last, {"replica": "r1"}) == 1_700_000_000.5
    m.forget("r1")
    m.forget("never-seen")
    assert reg.get_sample_value("cp_kv_events_trusted", {"replica": "r1"}) is None
    assert reg.get_sample_value("cp_kv_events_applied_total", {"replica": "r1"}) == 1.0


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_breaker_gauge_follows_the_state_and_counts_opens() -> None:
    reg = CollectorRegistry()
    m = BreakerMetrics(reg)
    clock = Clock()
    b = CircuitBreaker(failure_threshold=2, cooldown_s=1.0, clock=clock)

    def read() -> tuple[float | None, float | None]:
        return (
            reg.get_sample_value("cp_redis_breaker_open", {"store": "quota"}),
            reg.get_sample_value("cp_redis_breaker_opens_total", {"store": "quota"}),
        )

    m.sync("quota", b)
    assert read() == (0.0, 0.0)
    b.record_failure()
    b.record_failure()  # opens
    m.sync("quota", b)
    assert read() == (1.0, 1.0)
    clock.t = 2.0
    assert b.allow()  # half-open: the probe; still counted as down
    m.sync("quota", b)
    assert read() == (1.0, 1.0)
    b.record_failure()  # the probe failed: open again
    m.sync("quota", b)
    assert read() == (1.0, 2.0)
    clock.t = 4.0
    assert b.allow()
    b.record_success()
    m.sync("quota", b)
    assert read() == (0.0, 2.0)


def test_router_metrics_hold_the_new_families() -> None:
    m = RouterMetrics()
    m.routable.set(2)
    m.kv_events.sync([row(batches=3)])
    m.forget_replica("r1")
    assert m.registry.get_sample_value("cp_routable_replicas") == 2.0
    assert m.registry.get_sample_value("cp_kv_events_applied_total", {"replica": "r1"}) == 3.0
    assert m.registry.get_sample_value("cp_kv_events_trusted", {"replica": "r1"}) is None


def test_tenant_quota_gauges_follow_the_tenants() -> None:
    m = RouterMetrics()
    m.sync_quotas([Tenant("acme", quota_tokens=1000, quota_window_s=60.0), Tenant("free")])
    assert m.registry.get_sample_value("cp_tenant_quota_tokens", {"tenant": "acme"}) == 1000.0
    assert m.registry.get_sample_value("cp_tenant_quota_window_seconds", {"tenant": "acme"}) == 60
    assert m.registry.get_sample_value("cp_tenant_quota_tokens", {"tenant": "free"}) is None
    m.sync_quotas([])  # acme removed (admin API): its series go
    assert m.registry.get_sample_value("cp_tenant_quota_tokens", {"tenant": "acme"}) is None


@pytest.mark.parametrize(
    ("redis", "stores"),
    [
        (None, set()),  # in-memory index, quotas and fair queue: no breaker to report
        ({"url": "redis://127.0.0.1:9/0"}, {"prefix_index", "quota", "fair_queue"}),
    ],
)
async def test_the_router_reports_each_redis_store_breaker(
    redis: dict[str, str] | None, stores: set[str]
) -> None:
    """The store names the alert rules select on (`store="quota"`, ...) are the router's."""
    fakes = FakeVllmFleet(["a"])
    overrides: dict[str, Any] = {"redis": redis, "fairness": {"shared": True}} if redis else {}
    settings = load_settings(
        replicas=fakes.replica_configs(), tokenizer="approx", served_model="m", **overrides
    )
    runtime = RouterRuntime(settings, transport=fakes.transport, resolve=fakes.resolve)
    try:
        assert set(runtime.breakers()) == stores
        runtime.refresh_gauges()
        reg = runtime.metrics.registry
        for store in stores:  # nothing called Redis yet: closed
            assert reg.get_sample_value("cp_redis_breaker_open", {"store": store}) == 0.0
        assert reg.get_sample_value("cp_routable_replicas") == 0.0  # not probed yet
    finally:
        await runtime.aclose()
