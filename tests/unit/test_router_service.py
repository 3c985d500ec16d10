"""The router service in process, in front of fake vLLM replicas (one MockTransport): trace
context and GenAI spans, A/B arms on metrics and headers, what the router adds to or removes
from the upstream request, and nothing left reserved."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fake_vllm import FakeVllmFleet
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from router.config import load_settings
from router.http.service import create_app
from router.runtime import RouterRuntime
from router.telemetry import parse_decision_header

MODEL = "tiny-llama"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


@dataclass
class Service:
    client: httpx.AsyncClient
    fakes: FakeVllmFleet
    runtime: RouterRuntime
    spans: InMemorySpanExporter


async def _service(**overrides: Any) -> AsyncIterator[Service]:
    fakes = FakeVllmFleet(["a", "b"])
    settings = load_settings(
        replicas=fakes.replica_configs(),
        tokenizer="approx",
        served_model=MODEL,
        telemetry={"json_logs": False, "decision_header": True},
        **overrides,
    )
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    runtime = RouterRuntime(
        settings, transport=fakes.transport, resolve=fakes.resolve, tracer_provider=provider
    )
    app = create_app(settings, runtime=runtime)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as client,
    ):
        yield Service(client, fakes, runtime, exporter)
        assert len(runtime.ledger) == 0, "a reservation outlived its request"
        for meter in runtime.demand.meters.values():
            assert (meter.in_flight, meter.backlog_requests) == (0, 0), "demand leaked"


@pytest.fixture
async def svc() -> AsyncIterator[Service]:
    async for s in _service():
        yield s


def chat(content: str = "hello", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


async def test_trace_context_reaches_the_replica_under_the_upstream_span(svc: Service) -> None:
    r = await svc.client.post(
        "/v1/chat/completions", json=chat(max_tokens=3), headers={"traceparent": PARENT}
    )
    assert r.status_code == 200
    spans = {s.name: s for s in svc.spans.get_finished_spans()}
    assert set(spans) == {f"chat {MODEL}", "route", "upstream"}
    root, upstream = spans[f"chat {MODEL}"], spans["upstream"]
    assert f"{root.context.trace_id:032x}" == TRACE_ID  # continues the client's trace
    assert upstream.parent is not None and upstream.parent.span_id == root.context.span_id
    sent = svc.fakes.calls[-1].headers["traceparent"]
    assert sent.split("-")[1] == TRACE_ID
    assert sent.split("-")[2] == f"{upstream.context.span_id:016x}"
    attrs = root.attributes or {}
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.model"] == MODEL
    assert attrs["gen_ai.request.max_tokens"] == 3
    assert attrs["gen_ai.usage.output_tokens"] == 3
    assert attrs["cp.arm"] == "prefix_affinity"
    assert attrs["cp.replica"] in ("a", "b")
    assert attrs["cp.decision.reason"]
    # the tenant's usage (open mode: the default tenant), as the replica reported it
    usage = r.json()["usage"]
    reg = svc.runtime.metrics.registry
    for kind in ("prompt", "completion"):
        got = reg.get_sample_value("cp_tenant_tokens_total", {"tenant": "default", "kind": kind})
        assert got == usage[f"{kind}_tokens"]


@pytest.mark.parametrize(
    ("stream", "include_usage", "usage_chunks"),
    [(True, None, 0), (True, False, 0), (True, True, 1)],
)
async def test_usage_reaches_the_client_only_when_asked(
    svc: Service, stream: bool, include_usage: bool | None, usage_chunks: int
) -> None:
    extra: dict[str, Any] = {"stream": stream, "max_tokens": 4}
    if include_usage is not None:
        extra["stream_options"] = {"include_usage": include_usage}
    r = await svc.client.post("/v1/chat/completions", json=chat(**extra))
    assert r.status_code == 200
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert sum('"usage"' in e for e in events) == usage_chunks
    # the router always asked the replica for usage (its metrics need the token counts)
    assert svc.fakes.calls[-1].body["stream_options"]["include_usage"] is True
    metrics = (await svc.client.get("/metrics")).text
    assert "cp_tpot_seconds_count" in metrics


async def test_request_fields_pass_through_untouched(svc: Service) -> None:
    extra: dict[str, Any] = {
        "temperature": 0.3,
        "priority": 5,
        "cache_salt": "s",
        "max_tokens": 2,
        "seed": 7,
    }
    r = await svc.client.post("/v1/chat/completions", json=chat(**extra))
    assert r.status_code == 200
    body = svc.fakes.calls[-1].body
    for key, value in extra.items():
        assert body[key] == value


async def test_default_max_tokens_is_injected_only_when_absent() -> None:
    async for s in _service(limits={"default_max_tokens": 3}):
        await s.client.post("/v1/chat/completions", json=chat())
        await s.client.post("/v1/chat/completions", json=chat(max_tokens=2))
        assert [c.body["max_tokens"] for c in s.fakes.calls] == [3, 2]


async def test_ab_arms_are_sticky_per_session_and_label_metrics() -> None:
    arms = [
        {"name": "affinity", "policy": "prefix_affinity", "weight": 1},
        {"name": "rr", "policy": "round_robin", "weight": 1},
    ]
    async for s in _service(policy={"arms": arms, "sticky_key": "session"}):
        seen: dict[str, set[str]] = {}
        for i in range(40):
            user = f"user-{i % 10}"
            r = await s.client.post("/v1/chat/completions", json=chat(f"q{i}", user=user))
            assert r.status_code == 200
            seen.setdefault(user, set()).add(
                parse_decision_header(r.headers["x-cp-decision"])["arm"]
            )
        assert all(len(a) == 1 for a in seen.values())  # sticky
        assert set().union(*seen.values()) == {"affinity", "rr"}  # both arms get traffic
        metrics = (await s.client.get("/metrics")).text
        assert 'cp_requests_total{arm="rr",policy="round_robin"' in metrics
        assert 'cp_requests_total{arm="affinity",policy="prefix_affinity"' in metrics


async def test_request_id_is_echoed_forwarded_or_made(svc: Service) -> None:
    r = await svc.client.post(
        "/v1/chat/completions", json=chat(), headers={"x-request-id": "abc-123"}
    )
    assert r.headers["x-request-id"] == "abc-123"
    assert svc.fakes.calls[-1].headers["x-request-id"] == "abc-123"
    r = await svc.client.post(
        "/v1/chat/completions", json=chat(), headers={"x-request-id": "bad id;" + "x" * 200}
    )
    assert r.headers["x-request-id"].startswith("cp-")


async def test_decision_header_is_off_by_default() -> None:
    fakes = FakeVllmFleet(["a"])
    settings = load_settings(replicas=fakes.replica_configs(), tokenizer="approx")
    runtime = RouterRuntime(settings, transport=fakes.transport, resolve=fakes.resolve)
    app = create_app(settings, runtime=runtime)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as client,
    ):
        r = await client.post("/v1/chat/completions", json=chat())
        assert r.status_code == 200
        assert "x-cp-decision" not in r.headers


async def test_demand_signal_counts_admitted_work_and_empties_after(svc: Service) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    for stream in (False, True):
        r = await svc.client.post("/v1/chat/completions", json=chat(max_tokens=3, stream=stream))
        assert r.status_code == 200
    bad = await svc.client.post("/v1/chat/completions", json={**chat(), "model": "other"})
    assert bad.status_code == 404  # refused before admission: not demand
    body = (await svc.client.get("/metrics")).text
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(body)
        for s in fam.samples
    }
    m = (("model", MODEL),)
    assert got[("cp_demand_arrivals_total", m)] == 2
    prefill = got[("cp_demand_work_seconds_total", (("kind", "prefill"), *m))]
    assert prefill > 0
    assert got[("cp_demand_prefill_work_squared_seconds_total", m)] > 0
    assert got[("cp_backlog_requests", m)] == 0
    assert got[("cp_in_flight_requests", m)] == 0
    # the sub-tick peaks, per window: both arrivals fall within the longest one
    long = (*m, ("window_s", "30"))
    assert got[("cp_demand_prefill_peak_work_seconds", long)] == pytest.approx(prefill)
    assert got[("cp_demand_prefill_peak_requests", long)] == 2
    # what the standalone autoscaler reads of it
    from autoscaler.controller import parse_router_metrics

    peaks = parse_router_metrics(body, MODEL).peaks
    assert sorted(peaks) == [5.0, 10.0, 15.0, 30.0]
    assert peaks[30.0][0] == pytest.approx(prefill)
    assert peaks[30.0][1] == 2.0


def dispatched_series(body: str) -> dict[str, float]:
    """replica -> cp_backlog_dispatched_work_seconds of the model, from a /metrics body."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        s.labels["replica"]: s.value
        for fam in text_string_to_metric_families(body)
        for s in fam.samples
        if s.name == "cp_backlog_dispatched_work_seconds" and s.labels["model"] == MODEL
    }


@pytest.mark.parametrize("stream", [False, True])
async def test_routed_backlog_shows_under_its_replica_until_the_first_token(
    svc: Service, stream: bool
) -> None:
    from autoscaler.controller import parse_router_metrics

    svc.fakes.hold = asyncio.Event()
    pending = asyncio.create_task(
        svc.client.post("/v1/chat/completions", json=chat(max_tokens=3, stream=stream))
    )
    await svc.fakes.held.wait()  # routed, sent, and no answer yet
    replica = svc.fakes.calls[-1].replica
    backlog = svc.runtime.demand.meters[MODEL].backlog_work_s
    assert backlog > 0
    body = (await svc.client.get("/metrics")).text
    assert dispatched_series(body) == {replica: pytest.approx(backlog)}
    assert parse_router_metrics(body, MODEL).dispatched == {replica: pytest.approx(backlog)}
    svc.fakes.hold.set()
    assert (await pending).status_code == 200
    # the first token took it out of the backlog: its series is gone, not left at zero
    assert dispatched_series((await svc.client.get("/metrics")).text) == {}


@pytest.mark.parametrize("leave", ["first_token", "finished"])
def test_a_replicas_dispatched_series_goes_when_its_last_request_leaves(leave: str) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from router.telemetry.demand import RouterDemand

    settings = load_settings(
        replicas=FakeVllmFleet(["a"]).replica_configs(), tokenizer="approx", served_model=MODEL
    )
    registry = CollectorRegistry()
    demand = RouterDemand(settings, registry, clock=lambda: 0.0)
    for rid in ("r1", "r2", "r3", "held"):
        demand.arrived(rid, MODEL, 500, 20)
    w = demand.meters[MODEL].backlog_work_s / 4
    for rid, replica in (("r1", "a"), ("r2", "a"), ("r3", "b")):
        demand.dispatched(rid, replica)
    demand.dispatched("unknown", "c")  # never admitted: no series

    def series() -> dict[str, float]:
        return dispatched_series(generate_latest(registry).decode())

    assert series() == {"a": pytest.approx(2 * w), "b": pytest.approx(w)}
    getattr(demand, leave)("r1")
    assert series() == {"a": pytest.approx(w), "b": pytest.approx(w)}
    getattr(demand, leave)("r3")
    assert series() == {"a": pytest.approx(w)}
    getattr(demand, leave)("r2")
    assert series() == {}
    assert demand.meters[MODEL].backlog_work_s == pytest.approx(w)  # "held": still at the router


def test_a_reroute_tells_the_hooks_the_new_replica_once() -> None:
    from types import SimpleNamespace

    from controlplane.tenancy.model import Tenant
    from router.scope import NoHooks, Outcome, RequestScope

    class Seen(NoHooks):
        def __init__(self) -> None:
            self.replicas: list[str] = []

        def on_routed(self, scope: RequestScope) -> None:
            assert scope.routed is not None
            self.replicas.append(scope.routed.replica_id)

    seen = Seen()
    scope = RequestScope("req", Tenant("t"), MODEL, (seen,), 0.0)
    routed = SimpleNamespace(replica_id="a")
    scope.routed_to(routed)  # type: ignore[arg-type]
    scope.routed_to(routed)  # type: ignore[arg-type]  # the same replica: told once
    routed.replica_id = "b"  # the reroute moves the same Routed
    scope.routed_to(routed)  # type: ignore[arg-type]
    scope.end(Outcome.COMPLETED, "200")
    routed.replica_id = "c"
    scope.routed_to(routed)  # type: ignore[arg-type]  # never after the end
    assert seen.replicas == ["a", "b"]
