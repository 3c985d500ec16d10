"""Serving the router: uvicorn with the guarded HTTP protocol, on sockets bound up front.

    server = RouterHttpServer(settings)      # binds host:port now (port 0: the OS picks)
    server.run()                             # blocks: its own event loop (uvloop when installed)
    await server.serve()                     # or in a running loop (tests, a thread)
    server.ports                             # {"main": 8000} as bound

`controlplane serve` and `controlplane up` run this; the test harness too, so every live test
goes through the same connection limits (`router/http/protocol.py`: head deadline, idle
keep-alive, head size and header count, connection cap). uvicorn's WebSocket support is off
(the router serves none), and so is its access log (the router logs each request itself).
The sockets are bound before the app starts, so a port conflict fails at once, and a port of 0
is known (and can be printed) before the first request.
"""

from __future__ import annotations

import logging
import socket

import uvicorn
from fastapi import FastAPI

from router.config import RouterSettings
from router.http.protocol import guarded_protocol

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
    ) -> None:
        if app is None:
            from router.http.service import create_app

            app = create_app(settings)
        self.settings = settings
        self.app = app
        limits = settings.limits
        self.config = uvicorn.Config(
            app,
            http=guarded_protocol(limits),
            ws="none",
            lifespan="on",
            log_config=None,
            access_log=False,
            timeout_keep_alive=max(1, round(limits.keepalive_timeout_s)),
            timeout_graceful_shutdown=5,
        )
        self.server = uvicorn.Server(self.config)
        host = settings.host if host is None else host
        self.sockets = [bind(host, settings.port if port is None else port)]
        self.host = host

    @property
    def ports(self) -> dict[str, int]:
        return {"main": int(self.sockets[0].getsockname()[1])}

    def _started(self) -> None:
        log.info("router listening on http://%s:%d", self.host, self.ports["main"])

    async def serve(self) -> None:
        """Serve until `server.should_exit` (uvicorn's shutdown closes the sockets)."""
        self._started()
        try:
            await self.server.serve(sockets=self.sockets)
        finally:
            self.close()

    def run(self) -> None:
        """Serve in a new event loop until a signal stops it."""
        self._started()
        try:
            self.server.run(sockets=self.sockets)
        finally:
            self.close()

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


__all__ = ["RouterHttpServer", "bind"]
