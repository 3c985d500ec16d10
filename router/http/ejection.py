"""Requests waiting on a replica that gets ejected: cut short, so they can go elsewhere once.

    guard = EjectionGuard()
    fleet.on_eject(guard.on_eject)               # every ejection, DOWN included
    async with guard.watch(replica_id):          # raises Ejected if the replica is ejected
        await the replica's first byte           # while this waits (nothing sent to the client)

Algorithm: the guard keeps, per replica, the tasks inside a `watch` section: requests waiting for
a replica's first chunk, of which the client has not seen a byte. When the fleet ejects the
replica (whatever the reason), each of them is cancelled; the section turns its own cancellation
into `Ejected` (and takes its cancel request back with `Task.uncancel`, as `router/http/watch.py`
does), so the caller re-sends the request to another replica; the cancellation closed the
upstream connection, which makes the replica (vLLM or the simulator) abort the request. Any
other cancellation (the client left, a server shutdown) propagates unchanged. The task whose own
failure caused the ejection (its TTFT timeout, recorded inside the section) is left alone: it
ends with its own error (504/502) as before, having waited a whole deadline already. A section
that ends while this guard's cancel is still undelivered takes that cancel back.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class Ejected(Exception):
    """The replica was ejected while the request waited for its first byte."""

    def __init__(self, replica_id: str) -> None:
        super().__init__(f"replica {replica_id} was ejected before it answered")
        self.replica_id = replica_id


class _Waiter:
    __slots__ = ("cancelled", "task")

    def __init__(self, task: asyncio.Task[object]) -> None:
        self.task = task
        self.cancelled = False  # the replica was ejected: this guard cancelled the task


class EjectionGuard:
    def __init__(self) -> None:
        self._waiting: dict[str, set[_Waiter]] = {}

    def waiting(self, replica_id: str) -> int:
        """Requests inside a section on `replica_id` now."""
        return len(self._waiting.get(replica_id, ()))

    def on_eject(self, replica_id: str, reason: object = None) -> None:
        """The fleet's `on_eject` callback: cut every section waiting on `replica_id`."""
        try:
            current = asyncio.current_task()
        except RuntimeError:  # no running loop
            current = None
        for w in self._waiting.pop(replica_id, ()):
            if w.task is not current and not w.task.done():
                w.cancelled = True
                w.task.cancel()

    @contextlib.asynccontextmanager
    async def watch(self, replica_id: str) -> AsyncIterator[None]:
        task = asyncio.current_task()
        assert task is not None, "watch() runs inside a task"
        w = _Waiter(task)
        self._waiting.setdefault(replica_id, set()).add(w)
        try:
            yield
        except asyncio.CancelledError:
            if w.cancelled:
                w.cancelled = False
                if task.uncancel() == 0:
                    raise Ejected(replica_id) from None
            raise
        except Exception:
            await _absorb(task, w)
            raise
        else:
            await _absorb(task, w)  # the answer won the race
        finally:
            self._discard(replica_id, w)

    def _discard(self, replica_id: str, w: _Waiter) -> None:
        waiters = self._waiting.get(replica_id)
        if waiters is not None:
            waiters.discard(w)
            if not waiters:
                del self._waiting[replica_id]


async def _absorb(task: asyncio.Task[object], w: _Waiter) -> None:
    """Take back a cancel request of this guard that the section ended before receiving."""
    if not w.cancelled:
        return
    w.cancelled = False
    try:
        await asyncio.sleep(0)
    except asyncio.CancelledError:
        if task.uncancel() > 0:
            raise  # someone else cancelled the task too
    else:
        task.uncancel()


__all__ = ["Ejected", "EjectionGuard"]
