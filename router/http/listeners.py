"""`/metrics` on a listener of its own.

The Prometheus exposition names tenants (quota, queue and fairness series are labelled by tenant
id), so it need not be reachable where clients are. With `telemetry.metrics_port` set,
`RouterHttpServer` binds a second socket in the same process and serves the app wrapped in
`MetricsListenerSplit`:

    request on the metrics listener   GET /metrics -> the router's exposition; anything else 404
    request on the main listener      /metrics -> 404; everything else as before

Which listener a request came in on is the local port of its connection (`scope["server"]`), so
the split costs one comparison per request. Both are OpenAI error bodies (404 `not_found`), and
the metrics listener goes through the same connection limits as the main one. Unset (the
default), `/metrics` is served on the main port, as before; under Ray Serve (`deploy/app.py`),
whose proxy owns the sockets, the setting has no effect.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Receive, Scope, Send

from router.http.openai_api import error_body

METRICS_PATH = "/metrics"


class MetricsListenerSplit:
    def __init__(self, app: ASGIApp, *, metrics_port: int) -> None:
        self.app = app
        self.metrics_port = metrics_port

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            server = scope.get("server")
            on_metrics = server is not None and server[1] == self.metrics_port
            if on_metrics != (scope["path"] == METRICS_PATH):
                if on_metrics:
                    message = f"the metrics listener serves {METRICS_PATH} only"
                else:
                    message = f"{METRICS_PATH} is served on the router's metrics listener"
                await _not_found(send, message)
                return
        await self.app(scope, receive, send)


async def _not_found(send: Send, message: str) -> None:
    body = json.dumps(error_body(404, message, code="not_found")).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 404,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


__all__ = ["METRICS_PATH", "MetricsListenerSplit"]
