"""The router's telemetry in one import: metrics, traces, logs, and the decision header.

The parts live in `router.telemetry.metrics` (Prometheus), `router.telemetry.tracing`
(OpenTelemetry) and `router.telemetry.logs` (JSON logs); this module re-exports them and defines
the `x-cp-decision` response header (sent only with `telemetry.decision_header: true`, since it
names internal replicas):

    x-cp-decision: arm=prefix_affinity; replica=r1; reason=prefix_hit; predicted_hit_tokens=512

Keys always appear in that order; `replica` is "-" when none was chosen. Values are made
header- and parser-safe: every character outside [A-Za-z0-9._:/+-] becomes "_".
`parse_decision_header` reads it back into a dict.
"""

from __future__ import annotations

import re

from controlplane.types import DecisionReason
from router.telemetry.logs import (
    JsonFormatter,
    TextFormatter,
    bind,
    configure_logging,
    request_context,
)
from router.telemetry.metrics import STATUS_CLIENT_CLOSED, STATUS_UPSTREAM_DIED, RouterMetrics
from router.telemetry.tracing import (
    TRACER_NAME,
    extract_context,
    inject_headers,
    operation_for_path,
    set_decision_attributes,
    set_request_attributes,
    set_usage_attributes,
    setup_tracing,
    span_name,
)

DECISION_HEADER = "x-cp-decision"
_UNSAFE = re.compile(r"[^A-Za-z0-9._:/+\-]")


def _safe(value: str) -> str:
    return _UNSAFE.sub("_", value) or "-"


def decision_header_value(
    arm: str, replica: str | None, reason: DecisionReason | str, predicted_hit_tokens: int
) -> str:
    """`arm=..; replica=..; reason=..; predicted_hit_tokens=N` (see the module docstring)."""
    return "; ".join(
        (
            f"arm={_safe(arm)}",
            f"replica={_safe(replica) if replica else '-'}",
            f"reason={_safe(str(reason))}",
            f"predicted_hit_tokens={int(predicted_hit_tokens)}",
        )
    )


def parse_decision_header(value: str) -> dict[str, str]:
    """The header's fields as a dict (unknown keys kept, malformed parts skipped)."""
    out: dict[str, str] = {}
    for part in value.split(";"):
        key, sep, val = part.strip().partition("=")
        if sep and key:
            out[key] = val
    return out


__all__ = [
    "DECISION_HEADER",
    "STATUS_CLIENT_CLOSED",
    "STATUS_UPSTREAM_DIED",
    "TRACER_NAME",
    "JsonFormatter",
    "RouterMetrics",
    "TextFormatter",
    "bind",
    "configure_logging",
    "decision_header_value",
    "extract_context",
    "inject_headers",
    "operation_for_path",
    "parse_decision_header",
    "request_context",
    "set_decision_attributes",
    "set_request_attributes",
    "set_usage_attributes",
    "setup_tracing",
    "span_name",
]
