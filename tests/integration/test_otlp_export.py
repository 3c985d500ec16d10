"""OTLP export end to end: `controlplane serve` with `telemetry.otel_exporter: otlp` sends a routed
request's spans, with their GenAI attributes, to a real OTLP/HTTP receiver (protobuf decoded)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from otlp_receiver import OtlpReceiver, decode
from quota_scenario import RouterProcess
from router_fixtures import MODEL, sim_args
from sim_fleet import SimReplica

from deploy.tiny_model import default_model_dir, make_tiny_model

SPAN_KIND_CLIENT = 3  # opentelemetry.proto.trace.v1.Span.SpanKind.SPAN_KIND_CLIENT


@pytest.fixture(scope="module")
def model_dir() -> Path:
    md = default_model_dir()
    make_tiny_model(md)
    return md


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as rx:
        yield rx
    assert rx.refused == 0, "the exporter sent something a collector would refuse"


def test_receiver_refuses_what_a_collector_refuses(receiver: OtlpReceiver) -> None:
    assert httpx.post(f"{receiver.url}/v1/metrics", content=b"").status_code == 404
    bad = httpx.post(
        f"{receiver.url}/v1/traces", content=b"\xff\x00garbage",
        headers={"Content-Type": "application/x-protobuf"},
    )  # fmt: skip
    assert bad.status_code == 400
    assert decode(b"") == []
    receiver.refused = 0  # the fixture's own check is about the router's exports


@pytest.mark.timeout(90)
def test_routed_request_span_reaches_the_collector(
    model_dir: Path, tmp_path: Path, receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the router's own settings; the batch processor's delay shortened so the test waits less
    monkeypatch.setenv("CP_TELEMETRY__OTEL_EXPORTER", "otlp")
    monkeypatch.setenv("CP_TELEMETRY__OTLP_ENDPOINT", receiver.url)  # "/v1/traces" is added
    monkeypatch.setenv("CP_TELEMETRY__SERVICE_NAME", "router-under-test")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
    with SimReplica(*sim_args(model_dir)) as sim:
        config = {
            "host": "127.0.0.1",
            "served_model": MODEL,
            "tokenizer": str(model_dir),
            "replicas": [{"id": "a", "url": sim.url, "gpu": "cpu", "model": MODEL}],
            "telemetry": {"json_logs": True, "log_level": "WARNING"},
        }
        router = RouterProcess(config, tmp_path, 0)
        router.start()
        try:
            router.wait_ready(1)
            r = httpx.post(
                f"{router.url}/v1/chat/completions",
                json={"model": MODEL, "max_tokens": 4,
                      "messages": [{"role": "user", "content": "hello over otlp"}]},
                timeout=30.0,
            )  # fmt: skip
            assert r.status_code == 200, r.text
            root = receiver.wait_for(lambda s: s.name == f"chat {MODEL}")
            upstream = receiver.wait_for(lambda s: s.name == "upstream")
        finally:
            assert router.stop() == 0
    a = root.attributes
    assert root.resource["service.name"] == "router-under-test"
    assert root.scope == "controlplane.router"
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == MODEL
    assert a["gen_ai.request.max_tokens"] == 4
    assert a["gen_ai.usage.output_tokens"] == r.json()["usage"]["completion_tokens"]
    assert a["gen_ai.usage.input_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert "cp.usage.cached_tokens" in a
    assert (a["cp.replica"], a["cp.policy"]) == ("a", "prefix_affinity")
    assert a["cp.decision.reason"]
    # the upstream call is a CLIENT child of the request's span, in the same trace
    assert upstream.kind == SPAN_KIND_CLIENT
    assert (upstream.trace_id, upstream.parent_span_id) == (root.trace_id, root.span_id)
