"""Router telemetry: Prometheus metrics, OpenTelemetry spans and context, JSON logs, the header."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import format_trace_id
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from controlplane import tracing as cp_tracing
from controlplane.errors import ConfigError
from controlplane.types import DecisionReason
from router.telemetry import (
    DECISION_HEADER,
    STATUS_CLIENT_CLOSED,
    RouterMetrics,
    bind,
    configure_logging,
    decision_header_value,
    extract_context,
    inject_headers,
    operation_for_path,
    parse_decision_header,
    request_context,
    set_decision_attributes,
    set_request_attributes,
    set_usage_attributes,
    setup_tracing,
    span_name,
    tracing,
)


def samples(metrics: RouterMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body, _ = metrics.render()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(body.decode())
        for s in fam.samples
    }


# ---- metrics ---------------------------------------------------------------------------------


def test_render_is_text_exposition_with_every_family() -> None:
    m = RouterMetrics()
    body, content_type = m.render()
    assert content_type.startswith("text/plain; version=")
    families = {f.name for f in text_string_to_metric_families(body.decode())}
    assert families >= {
        "cp_requests",
        "cp_ttft_seconds",
        "cp_tpot_seconds",
        "cp_e2e_seconds",
        "cp_prompt_tokens",
        "cp_predicted_prefix_hit_tokens",
        "cp_engine_cached_tokens",
        "cp_engine_prefix_cache_hits_tokens",
        "cp_engine_prefix_cache_queries_tokens",
        "cp_decision_seconds",
        "cp_index_lookup_seconds",
        "cp_outstanding_requests",
        "cp_outstanding_tokens",
        "cp_routing_fallbacks",
        "cp_kv_events_applied",
        "cp_kv_events_lost",
        "cp_retries",
        "cp_upstream_errors",
        "cp_ejections",
        "cp_client_disconnects",
        "cp_inflight_requests",
    }


def test_two_instances_have_separate_registries() -> None:
    a, b = RouterMetrics(), RouterMetrics()
    a.requests.labels(arm="x", policy="round_robin", reason="round_robin", status="200").inc()
    key = (
        "cp_requests_total",
        (("arm", "x"), ("policy", "round_robin"), ("reason", "round_robin"), ("status", "200")),
    )
    assert samples(a)[key] == 1.0
    assert key not in samples(b)


def test_given_registry_is_used() -> None:
    registry = CollectorRegistry()
    m = RouterMetrics(registry)
    m.inflight.set(3)
    assert registry.get_sample_value("cp_inflight_requests") == 3.0


@pytest.mark.parametrize(
    ("record", "name", "labels", "value"),
    [
        (
            lambda m: m.requests.labels(
                arm="a", policy="p", reason=DecisionReason.PREFIX_HIT, status=STATUS_CLIENT_CLOSED
            ).inc(),
            "cp_requests_total",
            {"arm": "a", "policy": "p", "reason": "prefix_hit", "status": "client_closed"},
            1.0,
        ),
        (
            lambda m: m.ttft.labels(arm="a", policy="p").observe(0.2),
            "cp_ttft_seconds_bucket",
            {"arm": "a", "policy": "p", "le": "0.25"},
            1.0,
        ),
        (
            lambda m: m.tpot.labels(arm="a", policy="p").observe(0.02),
            "cp_tpot_seconds_count",
            {"arm": "a", "policy": "p"},
            1.0,
        ),
        (
            lambda m: m.e2e.labels(arm="a", policy="p").observe(400.0),
            "cp_e2e_seconds_bucket",
            {"arm": "a", "policy": "p", "le": "600.0"},
            1.0,
        ),
        (
            lambda m: m.engine_cached_tokens.labels(arm="a", policy="p").inc(48),
            "cp_engine_cached_tokens_total",
            {"arm": "a", "policy": "p"},
            48.0,
        ),
        (
            lambda m: m.predicted_hit_tokens.labels(arm="a", policy="p").inc(32),
            "cp_predicted_prefix_hit_tokens_total",
            {"arm": "a", "policy": "p"},
            32.0,
        ),
        (
            lambda m: m.index_lookup_seconds.labels(outcome="unknown").observe(0.03),
            "cp_index_lookup_seconds_count",
            {"outcome": "unknown"},
            1.0,
        ),
        (
            lambda m: m.fallbacks.labels(reason="index_unknown").inc(),
            "cp_routing_fallbacks_total",
            {"reason": "index_unknown"},
            1.0,
        ),
        (
            lambda m: m.upstream_errors.labels(replica="r1", kind="connect").inc(),
            "cp_upstream_errors_total",
            {"replica": "r1", "kind": "connect"},
            1.0,
        ),
        (lambda m: m.client_disconnects.inc(), "cp_client_disconnects_total", {}, 1.0),
        (
            lambda m: m.set_engine_prefix("r2", hits=100, queries=400),
            "cp_engine_prefix_cache_queries_tokens",
            {"replica": "r2"},
            400.0,
        ),
    ],
)
def test_recorded_values_are_exposed(
    record: Callable[[RouterMetrics], object], name: str, labels: dict[str, str], value: float
) -> None:
    m = RouterMetrics()
    record(m)
    assert m.registry.get_sample_value(name, labels) == value


def test_latency_buckets_span_milliseconds_to_minutes() -> None:
    m = RouterMetrics()
    m.ttft.labels(arm="a", policy="p").observe(0.0)
    les = [
        float(labels["le"])
        for (name, lab), _ in samples(m).items()
        if name == "cp_ttft_seconds_bucket"
        for labels in [dict(lab)]
    ]
    finite = sorted(le for le in les if le != float("inf"))
    assert finite[0] <= 0.01 and finite[-1] >= 60


def test_forget_replica_drops_its_gauges() -> None:
    m = RouterMetrics()
    m.outstanding_tokens.labels(replica="r1").set(5)
    m.set_engine_prefix("r1", 1, 2)
    m.forget_replica("r1")
    m.forget_replica("never-seen")
    assert m.registry.get_sample_value("cp_outstanding_tokens", {"replica": "r1"}) is None
    assert (
        m.registry.get_sample_value("cp_engine_prefix_cache_hits_tokens", {"replica": "r1"}) is None
    )


# ---- tracing ---------------------------------------------------------------------------------


@pytest.fixture
def spans() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def test_genai_and_project_attributes(spans: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    provider, exporter = spans
    tracer = provider.get_tracer(tracing.TRACER_NAME)
    op = operation_for_path("/v1/chat/completions")
    with tracer.start_as_current_span(span_name(op, "tiny-llama")) as span:
        set_request_attributes(span, operation=op, model="tiny-llama", max_tokens=64)
        set_decision_attributes(
            span,
            arm="a",
            policy="prefix_affinity",
            reason=DecisionReason.PREFIX_HIT,
            replica="r2",
            predicted_hit_blocks=7,
        )
        set_usage_attributes(
            span, input_tokens=120, output_tokens=64, response_id="cmpl-1", cached_tokens=112
        )
    (done,) = exporter.get_finished_spans()
    assert done.name == "chat tiny-llama"
    assert dict(done.attributes or {}) == {
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": "tiny-llama",
        "gen_ai.request.max_tokens": 64,
        "cp.arm": "a",
        "cp.policy": "prefix_affinity",
        "cp.decision.reason": "prefix_hit",
        "cp.replica": "r2",
        "cp.prefix.predicted_hit_blocks": 7,
        "gen_ai.usage.input_tokens": 120,
        "gen_ai.usage.output_tokens": 64,
        "gen_ai.response.id": "cmpl-1",
        "cp.usage.cached_tokens": 112,
    }


def test_none_values_leave_attributes_absent(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = spans
    with provider.get_tracer("t").start_as_current_span("s") as span:
        set_request_attributes(span, operation="text_completion", model="m")
        set_decision_attributes(
            span, arm="a", policy="p", reason=DecisionReason.NO_HEALTHY_REPLICA, replica=None
        )
        set_usage_attributes(span)
    attrs = dict(exporter.get_finished_spans()[0].attributes or {})
    assert "gen_ai.request.max_tokens" not in attrs
    assert "cp.replica" not in attrs
    assert not any(k.startswith("gen_ai.usage") for k in attrs)
    assert attrs["cp.decision.reason"] == "no_healthy_replica"


@pytest.mark.parametrize(
    ("path", "operation"),
    [
        ("/v1/chat/completions", "chat"),
        ("/v1/chat/completions/", "chat"),
        ("/v1/completions", "text_completion"),
    ],
)
def test_operation_for_path(path: str, operation: str) -> None:
    assert operation_for_path(path) == operation


TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_trace_context_round_trip(spans: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    provider, exporter = spans
    ctx = extract_context({"traceparent": TRACEPARENT, "tracestate": "vendor=1"})
    with provider.get_tracer("t").start_as_current_span("router", context=ctx):
        upstream = inject_headers({"content-type": "application/json"})
    (span,) = exporter.get_finished_spans()
    assert format_trace_id(span.context.trace_id) == "0af7651916cd43dd8448eb211c80319c"
    assert span.parent is not None and span.parent.span_id == 0xB7AD6B7169203331
    version, trace_id, parent_id, flags = upstream["traceparent"].split("-")
    assert (version, trace_id, flags) == ("00", "0af7651916cd43dd8448eb211c80319c", "01")
    assert parent_id == f"{span.context.span_id:016x}"
    assert upstream["tracestate"] == "vendor=1"
    assert upstream["content-type"] == "application/json"


def test_no_incoming_context_injects_nothing() -> None:
    assert extract_context({}) is not None
    assert inject_headers({}) == {}


def test_setup_tracing_none_and_console() -> None:
    assert setup_tracing("none") is None
    provider = setup_tracing("console", service_name="router-test", set_global=False)
    assert provider is not None
    assert provider.resource.attributes["service.name"] == "router-test"
    provider.shutdown()


def test_setup_tracing_otlp_without_the_exporter_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cp_tracing, "_OTLP_MODULES", ("cp_test_no_such_package.trace_exporter",))
    with pytest.raises(ConfigError, match="opentelemetry-exporter-otlp-proto-http"):
        setup_tracing("otlp", set_global=False)


# ---- logs ------------------------------------------------------------------------------------


@pytest.fixture
def root_logger() -> Iterator[logging.Logger]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield root
    root.handlers[:] = handlers
    root.setLevel(level)


def json_lines(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_json_lines_carry_bound_context(
    root_logger: logging.Logger, capsys: pytest.CaptureFixture[str]
) -> None:
    configure_logging(json_logs=True, level="info")
    log = logging.getLogger("router.test")
    with bind(request_id="req-1", arm="a"):
        log.info("routed %s", "ok")
        with bind(replica="r1", reason="prefix_hit"):
            log.warning("slow", extra={"elapsed_s": 1.5})
        log.debug("hidden at INFO")
    log.info("outside")
    first, second, third = json_lines(capsys.readouterr().err)
    assert first["message"] == "routed ok"
    assert (first["level"], first["logger"]) == ("INFO", "router.test")
    assert str(first["ts"]).endswith("Z") and "T" in str(first["ts"])
    assert (first["request_id"], first["arm"]) == ("req-1", "a")
    assert "replica" not in first
    assert {k: second[k] for k in ("request_id", "arm", "replica", "reason", "elapsed_s")} == {
        "request_id": "req-1",
        "arm": "a",
        "replica": "r1",
        "reason": "prefix_hit",
        "elapsed_s": 1.5,
    }
    assert "request_id" not in third
    assert dict(request_context.get()) == {}


def test_exceptions_and_span_ids_in_json(
    root_logger: logging.Logger,
    capsys: pytest.CaptureFixture[str],
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    configure_logging(json_logs=True, level="INFO")
    provider, _ = spans
    with provider.get_tracer("t").start_as_current_span("s") as span:
        try:
            raise RuntimeError("replica r1 died")
        except RuntimeError:
            logging.getLogger("router").exception("upstream failed")
    (entry,) = json_lines(capsys.readouterr().err)
    assert "RuntimeError: replica r1 died" in str(entry["exc"])
    assert entry["trace_id"] == f"{span.get_span_context().trace_id:032x}"
    assert entry["span_id"] == f"{span.get_span_context().span_id:016x}"


def test_configure_twice_keeps_one_handler_and_text_mode(
    root_logger: logging.Logger, capsys: pytest.CaptureFixture[str]
) -> None:
    before = len(root_logger.handlers)
    configure_logging(json_logs=True, level="INFO")
    configure_logging(json_logs=False, level="WARNING")
    assert len(root_logger.handlers) == before + 1
    with bind(request_id="req-9"):
        logging.getLogger("x").info("dropped")
        logging.getLogger("x").warning("kept")
    (line,) = capsys.readouterr().err.splitlines()
    assert line.endswith("WARNING x: kept request_id=req-9")


def test_bad_log_level(root_logger: logging.Logger) -> None:
    with pytest.raises(ConfigError, match="unknown log level"):
        configure_logging(json_logs=True, level="LOUD")


async def test_context_is_per_task() -> None:
    seen: dict[str, object] = {}

    async def handle(rid: str) -> None:
        with bind(request_id=rid):
            await asyncio.sleep(0)
            seen[rid] = request_context.get()["request_id"]

    await asyncio.gather(handle("a"), handle("b"))
    assert seen == {"a": "a", "b": "b"}


# ---- decision header -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "value"),
    [
        (
            ("ab-1", "r1", DecisionReason.PREFIX_HIT, 512),
            "arm=ab-1; replica=r1; reason=prefix_hit; predicted_hit_tokens=512",
        ),
        (
            ("prefix_affinity", None, DecisionReason.NO_HEALTHY_REPLICA, 0),
            "arm=prefix_affinity; replica=-; reason=no_healthy_replica; predicted_hit_tokens=0",
        ),
        (
            ("a;b=c d", "10.0.0.5:8000", "round_robin", 0),
            "arm=a_b_c_d; replica=10.0.0.5:8000; reason=round_robin; predicted_hit_tokens=0",
        ),
    ],
)
def test_decision_header(args: tuple[str, str | None, str, int], value: str) -> None:
    assert DECISION_HEADER == "x-cp-decision"
    assert decision_header_value(*args) == value
    parsed = parse_decision_header(value)
    assert list(parsed) == ["arm", "replica", "reason", "predicted_hit_tokens"]
    assert parsed["predicted_hit_tokens"] == str(args[3])
