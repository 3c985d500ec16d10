"""The standalone host against a fake Kubernetes API and fake routers, both real HTTP servers.

The fake API speaks the scale subresource of a Deployment or a StatefulSet (GET/PATCH `.../scale`
with `resourceVersion`, GET the object for `readyReplicas`), checks the bearer token, can fail
the next calls (500, a 409 on PATCH) and makes an ordered replica ready `LOAD_S` after its order
on the test's clock. The fake router serves `/metrics` with the demand counters the test sets.
Every tick is driven by the test (`controller.tick()`), so nothing waits on wall time.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from pydantic import SecretStr

from autoscaler.controller import DECIDE_SPAN, TRACER_NAME, Controller
from autoscaler.hosts.kubernetes import (
    HostSettings,
    KubernetesApiError,
    KubernetesScaler,
    ObserveOnly,
    build,
    metrics_app,
)
from autoscaler.types import ScaleContext, ScaleDecision, ScaleReason
from controlplane.tracing import tracer_of

TOKEN = "test-token"
NS, NAME = "llm", "vllm"
LOAD_S = 30.0


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@dataclass
class FakeKube:
    clock: Clock
    resource: str = "deployments"
    spec: int = 1
    ordered_at: list[float] = field(default_factory=lambda: [-1e9])  # one per ordered replica
    rv: int = 100
    fail_next: list[int] = field(default_factory=list)  # next calls' statuses (0: answer)
    conflict_once: bool = False
    patches: list[dict[str, Any]] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)

    @property
    def ready(self) -> int:
        return sum(1 for t in self.ordered_at[: self.spec] if t + LOAD_S <= self.clock())

    def handle(self, method: str, path: str, auth: str, body: bytes) -> tuple[int, dict[str, Any]]:
        self.calls.append(f"{method} {path}")
        base = f"/apis/apps/v1/namespaces/{NS}/{self.resource}/{NAME}"
        if auth != f"Bearer {TOKEN}":
            return 401, {"kind": "Status", "message": "Unauthorized"}
        injected = self.fail_next.pop(0) if self.fail_next else 0
        if injected:
            return injected, {"kind": "Status", "message": "injected"}
        scale = {
            "metadata": {"name": NAME, "namespace": NS, "resourceVersion": str(self.rv)},
            "spec": {"replicas": self.spec},
            "status": {"replicas": self.spec},
        }
        if path == f"{base}/scale" and method == "GET":
            return 200, scale
        if path == base and method == "GET":
            return 200, {
                "spec": {"selector": {"matchLabels": {"app": NAME}}},
                "status": {"replicas": self.spec, "readyReplicas": self.ready},
            }
        pods = f"/api/v1/namespaces/{NS}/pods"
        if path == f"{pods}?labelSelector=app%3D{NAME}" and method == "GET":
            items = [{"metadata": {"name": f"{NAME}-{i}"}} for i in range(self.spec)]
            return 200, {"kind": "PodList", "items": items}
        if path.startswith(f"{pods}/") and method == "PATCH":
            return 200, {"metadata": {"name": path.rsplit("/", 1)[1]}}
        if path == f"{base}/scale" and method == "PATCH":
            patch = json.loads(body)
            if self.conflict_once or patch["metadata"]["resourceVersion"] != str(self.rv):
                self.conflict_once = False
                self.rv += 1  # someone else wrote in between
                return 409, {"kind": "Status", "message": "the object has been modified"}
            self.patches.append(patch)
            n = patch["spec"]["replicas"]
            self.ordered_at = self.ordered_at[:n] + [self.clock()] * (n - len(self.ordered_at))
            self.spec, self.rv = n, self.rv + 1
            scale["spec"] = {"replicas": n}
            return 200, scale
        return 404, {"kind": "Status", "message": f"no route {method} {path}"}


@dataclass
class FakeRouter:
    work: dict[str, float] = field(default_factory=lambda: {"prefill": 0.0, "decode": 0.0})
    arrivals: float = 0.0
    backlog_work_s: float = 0.0
    status: int = 200

    def text(self) -> str:
        lines = [f'cp_demand_work_seconds_total{{model="m",kind="{k}"}} {v}'
                 for k, v in self.work.items()]  # fmt: skip
        lines += [
            f'cp_demand_arrivals_total{{model="m"}} {self.arrivals}',
            f'cp_backlog_work_seconds{{model="m"}} {self.backlog_work_s}',
            'cp_backlog_requests{model="m"} 0',
            'cp_in_flight_requests{model="m"} 0',
        ]
        return "\n".join(lines) + "\n"


class Server:
    """A ThreadingHTTPServer on a free port; `respond(method, path, auth, body)` answers."""

    def __init__(self, respond: Any) -> None:
        class Handler(BaseHTTPRequestHandler):
            def _any(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                code, payload = respond(
                    self.command, self.path, self.headers.get("Authorization", ""), body
                )
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PATCH = _any

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


@dataclass
class Tiny:
    """Arrived work at 70% plus the backlog drained in 10 s; loading replicas count."""

    name: str = "tiny"

    def initial_state(self) -> list[ScaleContext]:
        return []

    def decide(
        self, ctx: ScaleContext, state: list[ScaleContext], now: float
    ) -> tuple[ScaleDecision, list[ScaleContext]]:
        need = ctx.sample.rate / 0.7 + ctx.sample.backlog_work_s / 10.0
        target = max(ctx.min_replicas, min(ctx.max_replicas, math.ceil(need - 1e-9)))
        cur = ctx.fleet.current
        reason = ScaleReason.FORECAST_UP if target > cur else (
            ScaleReason.SCALE_DOWN if target < cur else ScaleReason.HOLD)  # fmt: skip
        return ScaleDecision(target, reason, (("need", need),)), [*state, ctx]


@dataclass
class Rig:
    clock: Clock
    kube: FakeKube
    router: FakeRouter
    controller: Controller
    actuator: KubernetesScaler | ObserveOnly

    async def tick_with(self, work_per_tick: float, dt: float = 10.0) -> ScaleDecision:
        self.clock.t += dt
        self.router.work["decode"] += work_per_tick
        self.router.arrivals += 10
        result = await self.controller.tick()
        assert result is not None
        return result.decision


@pytest.fixture
def servers() -> Iterator[tuple[Clock, FakeKube, FakeRouter, Server, Server]]:
    clock = Clock()
    kube, router = FakeKube(clock), FakeRouter()
    api = Server(kube.handle)
    rtr = Server(lambda m, p, a, b: (router.status, router.text().encode()))
    yield clock, kube, router, api, rtr
    api.close()
    rtr.close()


async def no_sleep(_: float) -> None:
    return None


@pytest.fixture(params=["kubernetes"])
async def rig(
    request: pytest.FixtureRequest, servers: tuple[Clock, FakeKube, FakeRouter, Server, Server]
) -> AsyncIterator[Rig]:
    clock, kube, router, api, rtr = servers
    mode, resource = [*request.param.split(":"), "deployments"][:2]
    kube.resource = resource
    target = {"statefulset": NAME} if resource == "statefulsets" else {"deployment": NAME}
    if mode.endswith("-unnamed"):
        mode, target = mode.removesuffix("-unnamed"), {}
    settings = HostSettings.model_validate({
        "routers": [rtr.url], "model": "m", "mode": mode, "namespace": NS, "api_url": api.url,
        "token": TOKEN, "tick_s": 10.0, "load_time_s": 120.0, "min_replicas": 1,
        "max_replicas": 8, "retry_backoff_s": 0.0, **target,
    })  # fmt: skip
    controller, actuator, scrape = build(settings, policy=Tiny(), clock=clock, sleep=no_sleep)
    # the first tick sets the counter baselines: NO_DATA, nothing changes
    first = await controller.tick()
    assert first is not None and first.decision.reason == ScaleReason.NO_DATA
    yield Rig(clock, kube, router, controller, actuator)
    await actuator.aclose()
    await scrape.aclose()


@pytest.mark.parametrize(
    "rig", ["kubernetes:deployments", "kubernetes:statefulsets"], indirect=True
)
async def test_scales_up_counts_loading_and_measures_load_time(rig: Rig) -> None:
    rig.kube.conflict_once = True  # the first PATCH meets a concurrent write
    decision = await rig.tick_with(30.0)  # 3 replicas of work -> ceil(3 / 0.7) = 5
    assert (decision.target, decision.reason) == (5, ScaleReason.FORECAST_UP)
    assert rig.kube.spec == 5
    assert [p["spec"]["replicas"] for p in rig.kube.patches] == [5]
    assert rig.kube.calls[0].endswith(f"/{rig.kube.resource}/{NAME}/scale")
    # while they load: counted as loading, not ordered again
    for _ in range(2):
        decision = await rig.tick_with(30.0)
        ctx = rig.controller.state[-1]
        assert (ctx.fleet.ready, ctx.fleet.loading, decision.target) == (1, 4, 5)
        assert len(ctx.fleet.loading_eta_s) == 4
    assert len(rig.kube.patches) == 1
    # ready: the load time is the fleet's, not the configured 120 s
    await rig.tick_with(30.0)
    ctx = rig.controller.state[-1]
    assert (ctx.fleet.ready, ctx.fleet.loading) == (5, 0)
    assert LOAD_S <= ctx.load_time_s < 120.0
    # idle: back down
    decision = await rig.tick_with(0.0)
    assert (decision.target, rig.kube.spec) == (1, 1)


@pytest.mark.parametrize("rig", ["advisory", "advisory-unnamed"], indirect=True)
async def test_advisory_never_patches(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="controlplane.autoscaler")
    decision = await rig.tick_with(30.0)
    assert decision.target == 5
    assert rig.kube.patches == [] and rig.kube.spec == 1
    assert not any(c.startswith("PATCH") for c in rig.kube.calls)
    messages = [r.getMessage() for r in caplog.records]
    lines = [json.loads(m) for m in messages if m.startswith("{")]
    assert lines[-1]["target"] == 5 and lines[-1]["mode"] == "advisory"


@pytest.mark.parametrize("rig", ["keda", "keda-unnamed"], indirect=True)
async def test_keda_exposes_the_target(rig: Rig) -> None:
    await rig.tick_with(30.0)
    transport = httpx.ASGITransport(app=metrics_app(rig.controller))
    async with httpx.AsyncClient(transport=transport, base_url="http://autoscaler") as client:
        assert (await client.get("/keda")).json() == {"target": 5, "model": "m"}
        text = (await client.get("/metrics")).text
    assert 'cp_autoscaler_target_replicas{model="m"} 5.0' in text
    assert 'cp_autoscaler_decisions_total{policy="tiny",reason="forecast_up"} 1.0' in text
    assert 'cp_autoscaler_forecast_need{model="m"}' in text
    assert rig.kube.patches == []


async def test_api_errors_are_retried_then_survived(rig: Rig) -> None:
    errors = rig.controller.metrics.errors
    # one 500: retried, the tick goes through
    rig.kube.fail_next = [500]
    assert (await rig.tick_with(30.0)).target == 5
    # more failures than retries: the tick decides nothing, nothing raised, counted
    rig.kube.fail_next = [500] * 10
    rig.clock.t += 10.0
    assert await rig.controller.tick() is None
    assert errors.labels("observe")._value.get() == 1
    # a failing PATCH: counted, the loop goes on, the next tick applies
    rig.kube.fail_next = []
    rig.router.work["decode"] += 80.0
    rig.clock.t += 10.0
    rig.kube.fail_next = [0, 0, 0, 403]  # the GETs pass, the PATCH is refused
    result = await rig.controller.tick()
    assert result is not None and not result.applied and rig.kube.spec == 5
    assert errors.labels("apply")._value.get() == 1
    assert (await rig.tick_with(80.0)).target == 8
    assert rig.kube.spec == 8


async def test_unreachable_router_holds(rig: Rig) -> None:
    rig.router.status = 503
    decision = await rig.tick_with(60.0)
    assert (decision.reason, decision.target, rig.kube.spec) == (ScaleReason.NO_DATA, 1, 1)
    # back: the delta spans both ticks, over both ticks' time
    rig.router.status = 200
    decision = await rig.tick_with(0.0)
    assert decision.target == math.ceil(60.0 / 20.0 / 0.7) == rig.kube.spec


async def test_wrong_token_is_a_clear_error(
    servers: tuple[Clock, FakeKube, FakeRouter, Server, Server],
) -> None:
    _, _, _, api, rtr = servers
    settings = HostSettings(
        routers=[rtr.url], mode="kubernetes", namespace=NS, api_url=api.url,
        token=SecretStr("wrong"), deployment=NAME, retry_backoff_s=0.0,
    )  # fmt: skip
    scaler = KubernetesScaler(settings, sleep=no_sleep)
    try:
        with pytest.raises(KubernetesApiError, match=r"HTTP 401 \(token rejected\): Unauthorized"):
            await scaler.observe()
    finally:
        await scaler.aclose()


async def test_unreachable_router_url_is_no_data(
    servers: tuple[Clock, FakeKube, FakeRouter, Server, Server],
) -> None:
    clock, kube, _, api, rtr = servers
    settings = HostSettings(
        routers=[rtr.url, "http://127.0.0.1:9"], mode="kubernetes", namespace=NS,
        api_url=api.url, token=SecretStr(TOKEN), deployment=NAME, scrape_timeout_s=1.0,
    )  # fmt: skip
    controller, actuator, scrape = build(settings, policy=Tiny(), clock=clock)
    try:
        for _ in range(2):
            clock.t += 10.0
            result = await controller.tick()
            assert result is not None and result.decision.reason == ScaleReason.NO_DATA
        assert kube.patches == []
    finally:
        await actuator.aclose()
        await scrape.aclose()


@pytest.mark.parametrize(
    ("work", "target", "reason", "patched"),
    [
        (30.0, 5, ScaleReason.FORECAST_UP, True),  # 3 replicas of work -> ceil(3 / 0.7) = 5
        (0.0, 1, ScaleReason.HOLD, False),
    ],
)
async def test_one_span_per_decision_with_its_reason(
    rig: Rig, work: float, target: int, reason: ScaleReason, patched: bool
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    rig.controller.tracer = tracer_of(TRACER_NAME, provider)
    await rig.tick_with(work)
    (span,) = exporter.get_finished_spans()
    attrs = dict(span.attributes or {})
    assert span.name == DECIDE_SPAN and span.kind is SpanKind.INTERNAL
    assert attrs["cp.autoscaler.reason"] == str(reason)
    assert attrs["cp.autoscaler.target"] == target
    assert attrs["cp.autoscaler.applied"] is True  # the scale subresource holds the target
    assert (attrs["cp.autoscaler.model"], attrs["cp.autoscaler.policy"]) == ("m", "tiny")
    assert (attrs["cp.autoscaler.spec"], attrs["cp.autoscaler.ready"]) == (1, 1)
    assert attrs["cp.autoscaler.mode"] == "kubernetes"
    assert "cp.autoscaler.figure.need" in attrs
    assert bool(rig.kube.patches) is patched
    # the bounds the AutoscalerAtMax alert compares the target with
    registry = rig.controller.metrics.registry
    assert registry.get_sample_value("cp_autoscaler_max_replicas", {"model": "m"}) == 8.0
    assert registry.get_sample_value("cp_autoscaler_min_replicas", {"model": "m"}) == 1.0
    provider.shutdown()
