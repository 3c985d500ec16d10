"""The client's disconnect, watched by one task per request.

    watch = ClientWatch(receive)      # after the request body was read; starts the watcher
    async with watch.cancellable():   # raises ClientGone if the client left before or during it
        await work
    watch.close()                     # the response is complete (idempotent)

Algorithm: one task waits on the ASGI `receive` for `http.disconnect`. When it comes while the
request's task is inside a `cancellable()` section, that task is cancelled; the section turns the
cancellation into `ClientGone` (and takes its own cancel request back, `Task.uncancel`), so code
around it sees an ordinary exception, and a cancellation from anywhere else (a server shutdown)
still propagates. A disconnect outside a section is remembered: the next section raises
`ClientGone` at once. The handler waits on the replica (queue, first chunk, stream) only inside
sections, which are exactly the waits a client's leaving must cut short; elsewhere (quota,
index, tokenization) the work runs to its end as before.

This replaces a pair of tasks per await (the work and a watcher raced with `asyncio.wait`) and
Starlette's task group per streamed response: one task for the request's whole life.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from starlette.types import Receive


class ClientGone(Exception):
    """The client disconnected before the answer was complete."""


class ClientWatch:
    __slots__ = ("_armed", "_cancelled", "_target", "_task", "gone")

    def __init__(self, receive: Receive) -> None:
        self.gone = False
        self._armed = False
        self._cancelled = False
        self._target = asyncio.current_task()
        self._task: asyncio.Task[None] | None = asyncio.get_running_loop().create_task(
            self._watch(receive)
        )

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        self._task = None
        if self._armed and self._target is not None:
            self._cancelled = True
            self._target.cancel()

    @contextlib.asynccontextmanager
    async def cancellable(self) -> AsyncIterator[None]:
        if self.gone:
            raise ClientGone
        self._armed = True
        try:
            yield
        except asyncio.CancelledError:
            if self._cancelled and self._target is not None:
                self._cancelled = False
                if self._target.uncancel() == 0:
                    raise ClientGone from None
            raise
        finally:
            self._armed = False

    def close(self) -> None:
        """The response is complete: stop watching."""
        self._armed = False
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()


__all__ = ["ClientGone", "ClientWatch"]
