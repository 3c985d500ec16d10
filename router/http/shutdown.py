"""Graceful shutdown of a router process, shaped for a Kubernetes pod's termination.

    SIGTERM / SIGINT (first)   /ready answers 503 at once (`draining`), /health stays 200;
                               new requests are still served for `shutdown.drain_s` (a
                               load balancer keeps sending until it sees the endpoint go),
                               each response with `connection: close`, so keep-alive clients
                               reconnect (through the balancer, to another router)
    after drain_s              the listener closes: new connections are refused (a client or a
                               proxy retries a refused connection on another router safely),
                               idle keep-alive connections close, busy ones close after their
                               response
    up to grace_s more         in-flight requests (streams included) finish
    at the deadline            what is still running is cancelled (every book released by the
                               request's own cleanup), counted in cp_shutdown_cut_requests_total
                               and logged; then the lifespan ends and the process exits 0
    a second signal            skips the rest of the drain window; a third SIGINT (Ctrl-C)
                               skips the grace as well

Only SIGINT is passed on after the shutdown (as uvicorn does), so Ctrl-C still ends a CLI as
KeyboardInterrupt; SIGTERM ends in a normal return, so the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import time
from collections.abc import Callable
from types import FrameType

import uvicorn
from uvicorn.server import ServerState

from router.config import ShutdownConfig

log = logging.getLogger("controlplane.router")


class DrainState(ServerState):
    """uvicorn's state shared by the server's connections, plus whether it is draining (the
    router's protocol, `router/http/protocol.py`, then closes each connection after its
    response, with `connection: close`)."""

    def __init__(self) -> None:
        super().__init__()
        self.draining = False


class DrainingServer(uvicorn.Server):
    """`uvicorn.Server` whose first exit signal starts a drain window instead of stopping."""

    def __init__(
        self,
        config: uvicorn.Config,
        shutdown: ShutdownConfig,
        *,
        on_drain: Callable[[], None],
        on_cut: Callable[[int], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        config.timeout_graceful_shutdown = max(1, math.ceil(shutdown.grace_s))  # whole seconds
        super().__init__(config)
        self.server_state: DrainState = DrainState()
        self.shutdown_config = shutdown
        self.on_drain = on_drain
        self.on_cut = on_cut
        self.clock = clock
        self.draining_since: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.draining_since is None and not self.should_exit:
            self.begin_drain(sig)
            return
        if sig == signal.SIGINT:
            self._captured_signals.append(sig)
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True

    def begin_drain(self, sig: int | None = None) -> None:
        """Turn unready now and stop accepting `drain_s` later (a signal, or a caller)."""
        if sig == signal.SIGINT:
            self._captured_signals.append(sig)  # re-raised after the shutdown, as uvicorn does
        self.draining_since = self.clock()
        self.server_state.draining = True
        for conn in list(self.server_state.connections):
            cycle = getattr(conn, "cycle", None)
            if cycle is not None and not cycle.response_complete:
                cycle.keep_alive = False  # the response in progress closes its connection
        self.on_drain()
        name = signal.Signals(sig).name if sig is not None else "request"
        log.info(
            "shutdown (%s): /ready is 503; serving for %.1f s more, then %.1f s grace "
            "(signal again to stop accepting now)",
            name,
            self.shutdown_config.drain_s,
            self.shutdown_config.grace_s,
        )
        if self.shutdown_config.drain_s <= 0:
            self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        since = self.draining_since
        drained = since is not None and self.clock() - since >= self.shutdown_config.drain_s
        if drained and not self.should_exit:
            log.info("shutdown: drain window over, refusing new connections")
            self.should_exit = True
        return await super().on_tick(counter)

    async def _wait_tasks_to_complete(self) -> None:
        try:
            await super()._wait_tasks_to_complete()
        except asyncio.CancelledError:
            # the grace deadline (uvicorn's timeout) cancels the wait, then the tasks
            cut = len(self.server_state.tasks)
            if cut:
                log.warning("shutdown: grace deadline reached, cutting %d request(s)", cut)
                self.on_cut(cut)
            raise


__all__ = ["DrainingServer"]
