"""Run a simulated replica under uvicorn: listening socket, signals, the refuse fault.

`run_replica(config, host, port)` serves until SIGINT or SIGTERM, then shuts down cleanly:
uvicorn stops accepting, gives open connections `GRACEFUL_S` to finish, and the app's lifespan
stops the engine loop and closes the ZMQ sockets; the process exits with status 0. When the
server listens it calls `on_ready(url)` (the CLI prints `sim-replica ready at <url>`). With a
load time it listens only after that many seconds, as vLLM does while it loads the model.

The refuse fault closes the listening socket and aborts every open connection, so clients get
"connection refused" and broken streams, then (unless forever) binds the same port again.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
import socket
from collections.abc import Callable, Generator

import uvicorn

from controlplane.sim_replica.app import Replica, build_app
from controlplane.sim_replica.config import ReplicaConfig

# seconds open connections get to finish at shutdown (hung streams are cut after it)
GRACEFUL_S = 1


class _Server(uvicorn.Server):
    """uvicorn's server with our signal handling: exit cleanly, don't re-raise the signal."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        loop = asyncio.get_running_loop()
        sigs = (signal.SIGINT, signal.SIGTERM)
        for sig in sigs:
            loop.add_signal_handler(sig, self._on_signal)
        try:
            yield
        finally:
            for sig in sigs:
                loop.remove_signal_handler(sig)

    def _on_signal(self) -> None:
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True


def listen_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted connections only when the
    # socket says TCP; without it Nagle + delayed ACKs stall keep-alive SSE streams by 40 ms
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class ReplicaServer:
    """The uvicorn server of one replica and the listener the refuse fault closes."""

    def __init__(self, replica: Replica, host: str, port: int, *, log_level: str = "warning"):
        self.replica = replica
        self.host = host
        self.sock = listen_socket(host, port)
        self.port = int(self.sock.getsockname()[1])
        self.uv_config = uvicorn.Config(
            build_app(replica),
            log_level=log_level,
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=GRACEFUL_S,
        )
        self.server = _Server(self.uv_config)
        replica.refuse = self.start_refusing
        self._refusing = False
        self._refuse_task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def serve(self, on_ready: Callable[[str], None] | None = None) -> None:
        task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        while not self.server.started and not task.done():
            await asyncio.sleep(0.01)
        if self.server.started:
            if on_ready is not None:
                on_ready(self.url)
            refuse_s = self.replica.faults.refuse_s
            if refuse_s > 0:
                self.replica.faults.refuse_s = 0.0
                await self.start_refusing(refuse_s)
        await task

    async def start_refusing(self, seconds: float) -> None:
        """Run `refuse` in a task of its own (it outlives the request that asked for it)."""
        self._refuse_task = asyncio.get_running_loop().create_task(self.refuse(seconds))

    async def refuse(self, seconds: float) -> None:
        """Stop listening and drop every connection; listen again after `seconds`."""
        if self._refusing:
            return
        self._refusing = True
        try:
            for srv in self.server.servers:
                srv.close()
            for conn in list(self.server.server_state.connections):
                transport = getattr(conn, "transport", None)
                if transport is not None:
                    transport.abort()
            if math.isinf(seconds):
                return
            await asyncio.sleep(seconds)
            if self.server.should_exit:
                return
            self.sock = listen_socket(self.host, self.port)
            srv = await asyncio.get_running_loop().create_server(
                self._protocol, sock=self.sock, backlog=self.uv_config.backlog
            )
            self.server.servers.append(srv)
        finally:
            self._refusing = False

    def _protocol(self) -> asyncio.Protocol:
        # what uvicorn's startup() builds per connection
        cfg = self.uv_config
        return cfg.http_protocol_class(  # type: ignore[call-arg]
            config=cfg,
            server_state=self.server.server_state,
            app_state=self.server.lifespan.state,
        )


def run_replica(
    config: ReplicaConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    log_level: str = "warning",
    on_ready: Callable[[str], None] | None = None,
    load_time_s: float = 0.0,
) -> None:
    """Serve one simulated replica until SIGINT/SIGTERM. `load_time_s`: nothing listens for
    that long first (vLLM refuses connections while it loads the model); a signal during the
    wait ends the process at once (the default handlers are still in place)."""

    async def main() -> None:
        if load_time_s > 0:
            await asyncio.sleep(load_time_s)
        server = ReplicaServer(Replica(config), host, port, log_level=log_level)
        await server.serve(on_ready)

    asyncio.run(main())
