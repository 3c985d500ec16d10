"""OpenTelemetry provider set-up shared by every process: router, KV-event indexer, autoscaler.

`setup_tracing(exporter, service_name, otlp_endpoint=...)` builds a `TracerProvider` (resource
`service.name`) for one of three exporters:

    none     no provider; the API's no-op tracer stays (spans cost nothing)
    console  spans printed to stdout as they end (development)
    otlp     batched OTLP/HTTP (protobuf) export to `otlp_endpoint`, a collector's traces URL
             ("http://otel-collector:4318/v1/traces"; a URL without a path gets "/v1/traces").
             Without `otlp_endpoint` the standard variables decide
             (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_EXPORTER_OTLP_ENDPOINT, default
             http://localhost:4318/v1/traces); headers, timeout, compression and TLS always come
             from the OTEL_EXPORTER_OTLP_* variables. The HTTP exporter is a dependency
             (`opentelemetry-exporter-otlp-proto-http`); the gRPC one is used only when the HTTP
             one is missing.

Each process names its tracer after itself (`controlplane.router`, `controlplane.kvevents`,
`controlplane.autoscaler`) and takes spans from the global provider unless a provider is
injected (tests use the SDK's in-memory exporter that way).
"""

from __future__ import annotations

import importlib
from typing import Annotated, Literal
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from pydantic import AfterValidator

from controlplane.errors import ConfigError

Exporter = Literal["none", "console", "otlp"]
TRACES_PATH = "/v1/traces"

_OTLP_MODULES = (
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
)


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of `endpoint` (a bare collector URL gets `/v1/traces`)."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"OTLP endpoint {endpoint!r}: an http(s) URL such as "
                          f"http://otel-collector:4318{TRACES_PATH}")  # fmt: skip
    if parts.path in ("", "/"):
        return endpoint.rstrip("/") + TRACES_PATH
    return endpoint


def settings_endpoint(value: str | None) -> str | None:
    """A settings field's OTLP endpoint as its traces URL; "" (an unset chart value) or None:
    unset, the OTEL_EXPORTER_OTLP_* variables decide."""
    return traces_url(value) if value else None


# the `otlp_endpoint` field of every process's settings
OtlpEndpoint = Annotated[str | None, AfterValidator(settings_endpoint)]


def _otlp_exporter(endpoint: str | None) -> SpanExporter:
    for module in _OTLP_MODULES:
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        grpc = ".grpc." in module
        if endpoint is None:
            exporter: SpanExporter = mod.OTLPSpanExporter()
        else:  # gRPC takes host:port (a URL's path is meaningless there)
            url = traces_url(endpoint)
            exporter = mod.OTLPSpanExporter(endpoint=urlsplit(url).netloc if grpc else url)
        return exporter
    raise ConfigError(
        "otel_exporter=otlp needs an OTLP exporter package, which is not installed: "
        "pip install opentelemetry-exporter-otlp-proto-http (or -grpc), or use 'console'/'none'"
    )


def setup_tracing(
    exporter: Exporter,
    service_name: str = "controlplane-router",
    *,
    otlp_endpoint: str | None = None,
    set_global: bool = True,
) -> TracerProvider | None:
    """The provider for `exporter` (None for "none"); installed as the global provider unless
    `set_global` is False (the global one can be set once per process)."""
    if exporter == "none":
        return None
    if exporter == "console":
        processor: SimpleSpanProcessor | BatchSpanProcessor = SimpleSpanProcessor(
            ConsoleSpanExporter()
        )
    elif exporter == "otlp":
        processor = BatchSpanProcessor(_otlp_exporter(otlp_endpoint))
    else:
        raise ConfigError(f"unknown OpenTelemetry exporter {exporter!r}: none, console or otlp")
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(processor)
    if set_global:
        trace.set_tracer_provider(provider)
    return provider


def tracer_of(name: str, provider: trace.TracerProvider | None = None) -> trace.Tracer:
    """A tracer named `name` from `provider`, or from the process's global provider (no-op until
    `setup_tracing` installs one)."""
    return (provider or trace.get_tracer_provider()).get_tracer(name)


__all__ = [
    "TRACES_PATH",
    "Exporter",
    "OtlpEndpoint",
    "settings_endpoint",
    "setup_tracing",
    "tracer_of",
    "traces_url",
]
