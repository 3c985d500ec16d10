"""Where spans go: the OTLP endpoint settings of the router, the autoscaler and the indexer."""

from __future__ import annotations

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from pydantic import ValidationError

from autoscaler.hosts.kubernetes import HostSettings
from controlplane.errors import ConfigError
from controlplane.tracing import setup_tracing, traces_url
from router.config import load_settings


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("http://collector:4318", "http://collector:4318/v1/traces"),
        ("http://collector:4318/", "http://collector:4318/v1/traces"),
        ("https://otel.example:443/v1/traces", "https://otel.example:443/v1/traces"),
        ("http://gw:8080/custom/traces", "http://gw:8080/custom/traces"),  # a path is kept
    ],
)
def test_traces_url(given: str, expected: str) -> None:
    assert traces_url(given) == expected


@pytest.mark.parametrize("bad", ["collector:4318", "grpc://c:4317", "http://"])
def test_bad_endpoints_are_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="OTLP endpoint"):
        traces_url(bad)
    with pytest.raises(ConfigError, match="otlp_endpoint"):
        load_settings(telemetry={"otel_exporter": "otlp", "otlp_endpoint": bad})
    with pytest.raises(ValidationError, match="OTLP endpoint"):
        HostSettings(otlp_endpoint=bad)


def test_an_empty_endpoint_means_unset() -> None:
    assert load_settings(telemetry={"otlp_endpoint": ""}).telemetry.otlp_endpoint is None
    assert HostSettings(otlp_endpoint="").otlp_endpoint is None


def test_otlp_provider_exports_to_the_configured_url() -> None:
    provider = setup_tracing("otlp", "svc", otlp_endpoint="http://127.0.0.1:9", set_global=False)
    assert provider is not None
    processors = provider._active_span_processor._span_processors  # the one batch processor
    exporter = processors[0]._batch_processor._exporter  # type: ignore[attr-defined]
    assert isinstance(exporter, OTLPSpanExporter)
    assert exporter._endpoint == "http://127.0.0.1:9/v1/traces"
    assert provider.resource.attributes["service.name"] == "svc"
    provider.shutdown()


def test_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CP_TELEMETRY__OTEL_EXPORTER", "otlp")
    monkeypatch.setenv("CP_TELEMETRY__OTLP_ENDPOINT", "http://collector:4318")
    t = load_settings().telemetry
    assert (t.otel_exporter, t.otlp_endpoint) == ("otlp", "http://collector:4318/v1/traces")
    assert t.service_name == "controlplane-router"
    monkeypatch.setenv("CP_AUTOSCALER_OTEL_EXPORTER", "otlp")
    monkeypatch.setenv("CP_AUTOSCALER_OTLP_ENDPOINT", "http://collector:4318")
    h = HostSettings()
    assert (h.otel_exporter, h.otlp_endpoint) == ("otlp", "http://collector:4318/v1/traces")
    assert h.service_name == "controlplane-autoscaler"
    # off unless asked
    monkeypatch.delenv("CP_AUTOSCALER_OTEL_EXPORTER")
    assert HostSettings().otel_exporter == "none"
