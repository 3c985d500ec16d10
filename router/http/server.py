"""Serving the router: uvicorn with the guarded HTTP protocol, on sockets bound up front.

    server = RouterHttpServer(settings)      # binds host:port now (port 0: the OS picks)
    server.run()                             # blocks: its own event loop (uvloop when installed)
    await server.serve()                     # or in a running loop (tests, a thread)
    server.ports                             # {"main": 8000, "metrics": 9100} as bound

`controlplane serve` and `controlplane up` run this; the test harness too, so every live test
goes through the same connection limits (`router/http/protocol.py`: head deadline, idle
keep-alive, head size and header count, connection cap). uvicorn's WebSocket support is off
(the router serves none), and so is its access log (the router logs each request itself).
The sockets are bound before the app starts, so a port conflict fails at once, and a port of 0
is known (and can be printed) before the first request.

SIGTERM/SIGINT: a drain window, then a grace deadline for in-flight requests, then exit 0
(`router/http/shutdown.py`, settings `shutdown.*`).

With `telemetry.metrics_port`, a second socket serves `/metrics` alone from the same process and
app (`router/http/listeners.py`), and the main port answers 404 for it.
"""

from __future__ import annotations

import logging
import socket

import uvicorn
from fastapi import FastAPI
from starlette.types import ASGIApp

from router.config import RouterSettings
from router.http.listeners import MetricsListenerSplit
from router.http.protocol import guarded_protocol
from router.http.shutdown import DrainingServer

log = logging.getLogger("controlplane.router")


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (IPv6 when the host is an IPv6 address)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=2048)


class RouterHttpServer:
    def __init__(
        self,
        settings: RouterSettings,
        app: FastAPI | None = None,
        *,
        host: str | None = None,
        port: int | None = None,
        sock: socket.socket | None = None,
    ) -> None:
        """`sock`: a listening socket to serve on instead of binding host:port (a worker of
        `controlplane serve --workers`, whose sockets share the port)."""
        if app is None:
            from router.http.service import create_app

            app = create_app(settings)
        self.settings = settings
        self.app = app
        host = settings.host if host is None else host
        self.host = host
        self.sockets = [
            sock if sock is not None else bind(host, settings.port if port is None else port)
        ]
        served: ASGIApp = app
        t = settings.telemetry
        if t.metrics_port is not None:
            metrics_host = t.metrics_host or host
            try:
                self.sockets.append(bind(metrics_host, t.metrics_port))
            except OSError:
                self.close()
                raise
            served = MetricsListenerSplit(app, metrics_port=self.ports["metrics"])
        limits = settings.limits
        self.config = uvicorn.Config(
            served,
            http=guarded_protocol(limits),
            ws="none",
            lifespan="on",
            log_config=None,
            access_log=False,
            timeout_keep_alive=max(1, round(limits.keepalive_timeout_s)),
        )
        self.server = DrainingServer(
            self.config, settings.shutdown, on_drain=self._drain, on_cut=self._cut
        )

    @property
    def ports(self) -> dict[str, int]:
        names = ("main", "metrics")
        return {n: int(s.getsockname()[1]) for n, s in zip(names, self.sockets, strict=False)}

    def _drain(self) -> None:
        self.app.state.draining = True  # /ready: 503 (router/http/endpoints.py)

    def _cut(self, n: int) -> None:
        runtime = getattr(self.app.state, "runtime", None)
        if runtime is not None:
            runtime.metrics.shutdown_cut.inc(n)

    def _started(self) -> None:
        ports = self.ports
        log.info("router listening on http://%s:%d", self.host, ports["main"])
        if "metrics" in ports:
            host = self.settings.telemetry.metrics_host or self.host
            log.info("router metrics on http://%s:%d/metrics", host, ports["metrics"])

    async def serve(self) -> None:
        """Serve until `server.should_exit` (uvicorn's shutdown closes the sockets)."""
        self._started()
        try:
            await self.server.serve(sockets=self.sockets)
        finally:
            self.close()

    def run(self) -> None:
        """Serve in a new event loop until a signal stops it (and its drain and grace end)."""
        self._started()
        try:
            self.server.run(sockets=self.sockets)
        finally:
            self.close()

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


__all__ = ["RouterHttpServer", "bind"]
