"""One pipelined round trip of `ScriptCaller` (`caller.py`): its calls, the exchange on the wire,
and when its calls are late.

    Call         one script call: its budget, its future (what the caller awaits), `on_orphan`
    Trip         the calls one lane sends at once (SCRIPT LOADs first when a retry needs them)
    exchange     write the whole pipeline, then read the replies in order: each one delivered as
                 it is read (an error reply is that call's exception), NOSCRIPT replies returned
                 when the trip loaded nothing (to be sent again behind a SCRIPT LOAD)
    Trip.waited  since when the trip has waited for Redis: its last reply, else its send, else
                 its start (connecting, writing); a call is late once `budget` has passed since
                 the later of that and the caller's last reply from any connection
    unread       reply bytes waiting unread on a connection: Redis has answered, the loop has
                 not run the lane yet; such a trip is never late

The pipeline is written at once (the lane's connection has no socket timeout, so redis-py does
not write it from a task of its own that would wait behind whatever the event loop runs).
"""

from __future__ import annotations

import asyncio
import logging
import math
import select
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import NoScriptError, ResponseError

from controlplane.store.scripts import Script

log = logging.getLogger(__name__)

Arg = str | bytes | int | float


@dataclass(eq=False, slots=True)
class Call:
    script: Script
    args: Sequence[Arg]
    budget: float
    guarded: bool
    future: asyncio.Future[Any]
    on_orphan: Callable[[Any], None] | None = None
    probe: bool = False  # the breaker's half-open probe
    sent: bool = False
    settled: bool = False  # answered, or failed (late, connection lost)

    def deliver(self, reply: Any) -> None:
        """The reply (an exception: an error reply or a failure) to whoever still waits, else
        a successful one to `on_orphan`."""
        self.settled = True
        if not self.future.done():
            if isinstance(reply, BaseException):
                self.future.set_exception(reply)
            else:
                self.future.set_result(reply)
        elif self.on_orphan is not None and not isinstance(reply, BaseException):
            try:  # its caller gave up (cancelled, or late): the reply came all the same
                self.on_orphan(reply)
            except Exception:
                log.exception("store orphan callback failed")


@dataclass(eq=False, slots=True)
class Trip:
    calls: list[Call]
    loads: list[Script]
    start: float
    stall: float  # abandoned when its connection answered nothing for this long
    guarded: bool
    sent: float | None = None  # when the pipeline was written
    last: float = -math.inf  # when its last reply was read
    conn: Any = None
    scope: asyncio.Timeout | None = None  # rescheduled to now: the trip is abandoned
    timer: asyncio.TimerHandle | None = None
    failed: bool = False  # a failure verdict was recorded for it
    done: bool = False

    def waited(self) -> float:
        return max(self.start if self.sent is None else self.sent, self.last)

    def waiting(self) -> list[Call]:
        return [c for c in self.calls if not c.settled]


async def exchange(
    conn: Any, trip: Trip, loop: asyncio.AbstractEventLoop, progress: Callable[[float], None]
) -> tuple[list[Call], int, bool]:
    """Send `trip` on `conn` and read every reply (see the module docstring); `progress` is told
    when each reply was read. Returns the calls answered NOSCRIPT (left pending), the number of
    error replies, and whether a guarded call got one; raises on a connection failure (or when
    the trip is abandoned)."""
    cmds: list[tuple[Arg, ...]] = [("SCRIPT", "LOAD", s.source) for s in trip.loads]
    cmds += [("EVALSHA", c.script.sha, 0, *c.args) for c in trip.calls]
    await conn.send_packed_command(conn.pack_commands(cmds), check_health=False)
    trip.sent = loop.time()
    for _ in trip.loads:
        await conn.read_response(timeout=math.inf)
        progress(trip_read(trip, loop))
    missing: list[Call] = []
    errors, guarded_error = 0, False
    for c in trip.calls:
        try:
            reply: Any = await conn.read_response(timeout=math.inf)
        except NoScriptError as exc:
            reply = exc
            if not trip.loads:
                progress(trip_read(trip, loop))
                missing.append(c)
                continue
        except ResponseError as exc:
            reply = exc
        progress(trip_read(trip, loop))
        if isinstance(reply, ResponseError):
            errors += 1
            guarded_error |= c.guarded
        c.deliver(reply)
    return missing, errors, guarded_error


def trip_read(trip: Trip, loop: asyncio.AbstractEventLoop) -> float:
    trip.last = loop.time()
    return trip.last


def unread(conn: Any) -> bool:
    """Does the connection hold reply bytes nobody has read yet (its stream buffer, or the
    socket: one `select` that does not wait)? redis-py keeps the stream in `_reader`/`_writer`."""
    reader, writer = getattr(conn, "_reader", None), getattr(conn, "_writer", None)
    if reader is None or writer is None:
        return False
    if getattr(reader, "_buffer", None):
        return True
    sock = writer.get_extra_info("socket")
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError, TypeError):
        return False
    return bool(readable)


__all__ = ["Arg", "Call", "Trip", "exchange", "unread"]
