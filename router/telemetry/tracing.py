"""OpenTelemetry for the router: provider setup, GenAI span attributes, W3C trace context.

`setup_tracing` (the provider: none, console or OTLP) lives in `controlplane/tracing.py`,
shared with the KV-event indexer and the autoscaler, and is re-exported here.

Spans follow the GenAI semantic conventions: name "{operation} {model}", attributes
`gen_ai.operation.name` ("chat" for /v1/chat/completions, "text_completion" for /v1/completions),
`gen_ai.request.model`, `gen_ai.request.max_tokens`, `gen_ai.usage.input_tokens`,
`gen_ai.usage.output_tokens`, `gen_ai.response.id`; and the project's `cp.arm`, `cp.policy`,
`cp.decision.reason`, `cp.replica`, `cp.prefix.predicted_hit_blocks`, `cp.usage.cached_tokens`.
None values are skipped (an attribute is absent rather than empty).

Trace context: `extract_context(headers)` reads `traceparent`/`tracestate` (and baggage) from
the client's headers through the global propagator (OTEL_PROPAGATORS; W3C by default), and
`inject_headers(headers)` writes the current context into the headers sent upstream, so a
replica's spans join the client's trace.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

from opentelemetry import propagate
from opentelemetry.context import Context
from opentelemetry.trace import Span

from controlplane.tracing import setup_tracing
from controlplane.types import DecisionReason

TRACER_NAME = "controlplane.router"

OPERATION = "gen_ai.operation.name"
REQUEST_MODEL = "gen_ai.request.model"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
RESPONSE_ID = "gen_ai.response.id"
CP_ARM = "cp.arm"
CP_POLICY = "cp.policy"
CP_REASON = "cp.decision.reason"
CP_REPLICA = "cp.replica"
CP_PREDICTED_HIT_BLOCKS = "cp.prefix.predicted_hit_blocks"
CP_CACHED_TOKENS = "cp.usage.cached_tokens"


def operation_for_path(path: str) -> str:
    """The GenAI operation name of an OpenAI endpoint path."""
    return "chat" if path.rstrip("/").endswith("chat/completions") else "text_completion"


def span_name(operation: str, model: str) -> str:
    """The GenAI span name: "{gen_ai.operation.name} {gen_ai.request.model}"."""
    return f"{operation} {model}" if model else operation


def _set(span: Span, attributes: Mapping[str, Any]) -> None:
    for key, value in attributes.items():
        if value is not None:
            span.set_attribute(key, value)


def set_request_attributes(
    span: Span, *, operation: str, model: str, max_tokens: int | None = None
) -> None:
    """What the client asked for."""
    _set(span, {OPERATION: operation, REQUEST_MODEL: model, REQUEST_MAX_TOKENS: max_tokens})


def set_decision_attributes(
    span: Span,
    *,
    arm: str,
    policy: str,
    reason: DecisionReason | str,
    replica: str | None,
    predicted_hit_blocks: int | None = None,
) -> None:
    """Where the router sent the request and why."""
    _set(
        span,
        {
            CP_ARM: arm,
            CP_POLICY: policy,
            CP_REASON: str(reason),
            CP_REPLICA: replica,
            CP_PREDICTED_HIT_BLOCKS: predicted_hit_blocks,
        },
    )


def set_usage_attributes(
    span: Span,
    *,
    input_tokens: int | None = None,
    output_tokens: int | None = None,
    response_id: str | None = None,
    cached_tokens: int | None = None,
) -> None:
    """What the replica reported (the response's `id` and `usage`)."""
    _set(
        span,
        {
            USAGE_INPUT_TOKENS: input_tokens,
            USAGE_OUTPUT_TOKENS: output_tokens,
            RESPONSE_ID: response_id,
            CP_CACHED_TOKENS: cached_tokens,
        },
    )


def extract_context(headers: Mapping[str, str]) -> Context:
    """The trace context the client sent (an empty context when none)."""
    return propagate.extract(headers)


def inject_headers(
    headers: MutableMapping[str, str], context: Context | None = None
) -> MutableMapping[str, str]:
    """Write `context` (default: the current one) into `headers`, in place; returns them."""
    propagate.inject(headers, context=context)
    return headers


__all__ = [
    "TRACER_NAME",
    "extract_context",
    "inject_headers",
    "operation_for_path",
    "set_decision_attributes",
    "set_request_attributes",
    "set_usage_attributes",
    "setup_tracing",
    "span_name",
]
