"""A tiny OTLP/HTTP trace receiver for tests: a real HTTP server that decodes protobuf.

    with OtlpReceiver() as rx:
        ... export spans to rx.url (POST {rx.url}/v1/traces) ...
        span = rx.wait_for(lambda s: s.name == "chat tiny-llama")

It accepts what an OpenTelemetry Collector's `otlphttp` receiver accepts for traces: POST
`/v1/traces` with `Content-Type: application/x-protobuf` (gzip-encoded or not), a serialized
`ExportTraceServiceRequest`; it answers 200 with an `ExportTraceServiceResponse`. Anything else is
a 4xx, and counted in `refused`.
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any]
    resource: dict[str, Any]
    scope: str


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return _attrs(v.kvlist_value.values)
    return None if which is None else getattr(v, which)


def _attrs(kvs: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in kvs:
        assert isinstance(kv, KeyValue)
        out[kv.key] = _value(kv.value)
    return out


def decode(body: bytes) -> list[ReceivedSpan]:
    req = ExportTraceServiceRequest.FromString(body)
    spans = []
    for rs in req.resource_spans:
        resource = _attrs(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                spans.append(
                    ReceivedSpan(
                        name=s.name, kind=s.kind, trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(), parent_span_id=s.parent_span_id.hex(),
                        attributes=_attrs(s.attributes), resource=resource, scope=ss.scope.name,
                    )
                )  # fmt: skip
    return spans


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.requests = 0
        self.refused = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                return None

            def _answer(self, status: int, body: bytes = b"", ctype: str = "text/plain") -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.path != "/v1/traces":
                    receiver._refuse()
                    return self._answer(404, b"not found")
                if self.headers.get("Content-Type") != "application/x-protobuf":
                    receiver._refuse()
                    return self._answer(415, b"protobuf only")
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                try:
                    spans = decode(body)
                except Exception:
                    receiver._refuse()
                    return self._answer(400, b"undecodable")
                receiver._got(spans)
                ok = ExportTraceServiceResponse().SerializeToString()
                return self._answer(200, ok, "application/x-protobuf")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def _refuse(self) -> None:
        with self._lock:
            self.refused += 1

    def _got(self, spans: list[ReceivedSpan]) -> None:
        with self._lock:
            self.requests += 1
            self.spans.extend(spans)

    def wait_for(
        self, match: Callable[[ReceivedSpan], bool], timeout_s: float = 10.0
    ) -> ReceivedSpan:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                found = [s for s in self.spans if match(s)]
            if found:
                return found[0]
            time.sleep(0.05)
        with self._lock:
            names = sorted({s.name for s in self.spans})
        raise AssertionError(f"no matching span within {timeout_s}s; received {names}")

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)
