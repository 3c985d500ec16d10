"""Router logs: one JSON object per line, with the request's context attached.

`configure_logging(json_logs, level)` puts one handler on the root logger (stderr by default;
calling it again replaces it, never stacks a second). Each JSON line holds

    ts        ISO 8601 UTC with milliseconds ("2025-01-31T12:00:00.123Z")
    level     INFO, WARNING, ...
    logger    the logger's name
    message   the formatted message
    ...       every field bound with `bind(...)` in the current context (request_id, arm, replica,
              reason by convention), then `extra={...}` fields of the call
    trace_id, span_id   of the current OpenTelemetry span, when one is recording
    exc       the formatted traceback, when the call carried exc_info

Context lives in the `request_context` contextvar, so it follows a request across `await`s and
into the tasks it spawns, never into another request's:

    with bind(request_id=rid, arm="a"):
        ...
        with bind(replica="r1", reason="prefix_hit"):
            log.info("routed")       # carries request_id, arm, replica, reason

With `json_logs=False` the line is plain text with the bound fields appended as key=value.
Values that JSON cannot encode are written as their str().
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any, TextIO

from opentelemetry import trace

from controlplane.errors import ConfigError

request_context: ContextVar[Mapping[str, Any]] = ContextVar(
    "cp_request_context", default=MappingProxyType({})
)

# attributes every LogRecord has; anything else on a record came from `extra=`
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "taskName",
}


@contextmanager
def bind(**fields: Any) -> Iterator[Mapping[str, Any]]:
    """Add `fields` to the log context for the duration of the block (None removes a field)."""
    merged = {**request_context.get(), **fields}
    merged = {k: v for k, v in merged.items() if v is not None}
    token = request_context.set(merged)
    try:
        yield merged
    finally:
        request_context.reset(token)


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    out: dict[str, Any] = dict(request_context.get())
    for key, value in vars(record).items():
        if key not in _RECORD_ATTRS and not key.startswith("_"):
            out[key] = value
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        out["trace_id"] = f"{ctx.trace_id:032x}"
        out["span_id"] = f"{ctx.span_id:016x}"
    return out


def _timestamp(record: logging.LogRecord) -> str:
    when = datetime.fromtimestamp(record.created, tz=UTC)
    return when.strftime("%Y-%m-%dT%H:%M:%S.") + f"{when.microsecond // 1000:03d}Z"


class JsonFormatter(logging.Formatter):
    """One JSON object per record (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": _timestamp(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in _fields(record).items():
            entry.setdefault(key, value)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str, ensure_ascii=False, separators=(",", ":"))


class TextFormatter(logging.Formatter):
    """`ts level logger: message key=value ...` for humans."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{_timestamp(record)} {record.levelname} {record.name}: {record.getMessage()}"
        extra = " ".join(f"{k}={v}" for k, v in _fields(record).items())
        if extra:
            line = f"{line} {extra}"
        if record.exc_info:
            line = f"{line}\n{self.formatException(record.exc_info)}"
        return line


class _RouterHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Marks the handler `configure_logging` owns, so a second call replaces it."""


def configure_logging(json_logs: bool, level: str, stream: TextIO | None = None) -> None:
    """Route the root logger through one handler with the JSON (or text) formatter."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ConfigError(f"unknown log level {level!r}: DEBUG, INFO, WARNING, ERROR or CRITICAL")
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _RouterHandler)]:
        root.removeHandler(old)
    handler = _RouterHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if json_logs else TextFormatter())
    root.addHandler(handler)
    root.setLevel(numeric)
    # a line per probe and scrape of every replica is noise: the router logs what matters
    logging.getLogger("httpx").setLevel(max(numeric, logging.WARNING))


__all__ = [
    "JsonFormatter",
    "TextFormatter",
    "bind",
    "configure_logging",
    "request_context",
]
