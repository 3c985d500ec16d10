"""DrainingServer's signal logic: the first signal drains, the drain window ends in the exit,
a second signal cuts the window short (SIGINT twice: force), only SIGINT is passed on."""

from __future__ import annotations

import asyncio
import signal

import pytest
import uvicorn

from router.config import ShutdownConfig
from router.http.shutdown import DrainingServer


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


async def _app(scope: object, receive: object, send: object) -> None:  # never called
    raise AssertionError


def _server(drain_s: float, clock: Clock) -> tuple[DrainingServer, list[str]]:
    events: list[str] = []
    server = DrainingServer(
        uvicorn.Config(_app),
        ShutdownConfig(drain_s=drain_s, grace_s=2.5),
        on_drain=lambda: events.append("drain"),
        on_cut=lambda n: events.append(f"cut {n}"),
        clock=clock,
    )
    return server, events


@pytest.mark.parametrize(
    ("signals", "should_exit", "force_exit", "passed_on"),
    [
        ([signal.SIGTERM], False, False, []),  # draining: still serving
        ([signal.SIGTERM, signal.SIGTERM], True, False, []),  # the window cut short
        ([signal.SIGINT], False, False, [signal.SIGINT]),
        ([signal.SIGINT, signal.SIGINT], True, False, [signal.SIGINT, signal.SIGINT]),
        ([signal.SIGINT] * 3, True, True, [signal.SIGINT] * 3),  # Ctrl-C thrice: force
    ],
)
def test_signals(
    signals: list[int], should_exit: bool, force_exit: bool, passed_on: list[int]
) -> None:
    server, events = _server(5.0, Clock())
    for sig in signals:
        server.handle_exit(sig, None)
    assert events == ["drain"]  # once, on the first signal
    assert server.server_state.draining
    assert (server.should_exit, server.force_exit) == (should_exit, force_exit)
    assert server._captured_signals == passed_on
    assert server.config.timeout_graceful_shutdown == 3  # grace_s rounded up


def test_the_drain_window_ends_in_the_exit() -> None:
    clock = Clock()
    server, _ = _server(5.0, clock)
    server.handle_exit(signal.SIGTERM, None)
    for t, expected in [(104.9, False), (105.0, True)]:
        clock.t = t
        asyncio.run(server.on_tick(1))
        assert server.should_exit is expected


def test_no_drain_window_exits_at_once() -> None:
    server, events = _server(0.0, Clock())
    server.handle_exit(signal.SIGTERM, None)
    assert server.should_exit and events == ["drain"]
