"""Shared helpers for the KV-event tests: a recording sink, labelled batches, polling."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import takewhile

from controlplane.kvevents.sink import PurgeReason
from controlplane.kvevents.wire import WireBatch, WireBlockRemoved, WireEvent
from controlplane.types import PrefixMatch


def labelled(label: int) -> list[WireEvent]:
    """A one-event batch that names itself: tests read the label back from the sink."""
    return [WireBlockRemoved(block_hashes=[label])]


@dataclass
class RecordingSink:
    """Records what a subscriber delivers: labels of applied batches and purge reasons.

    `log` interleaves both: an int per applied batch, a `PurgeReason` per purge.
    `fail_applies` makes the next N applies raise (an index that is down).
    """

    log: list[int | PurgeReason] = field(default_factory=list)
    fail_applies: int = 0
    fail_purges: int = 0

    async def apply(self, batch: WireBatch) -> None:
        if self.fail_applies:
            self.fail_applies -= 1
            raise ConnectionError("index down")
        for ev in batch.events:
            assert isinstance(ev, WireBlockRemoved)
            self.log.extend(ev.block_hashes)

    async def purge(self, reason: PurgeReason) -> None:
        if self.fail_purges:
            self.fail_purges -= 1
            raise ConnectionError("index down")
        self.log.append(reason)

    @property
    def labels(self) -> list[int]:
        return [x for x in self.log if not isinstance(x, PurgeReason)]

    @property
    def purges(self) -> list[PurgeReason]:
        return [x for x in self.log if isinstance(x, PurgeReason)]

    def since_last_purge(self) -> list[int]:
        out: list[int] = []
        for x in self.log:
            if isinstance(x, PurgeReason):
                out = []
            else:
                out.append(x)
        return out


async def until(cond: Callable[[], bool], timeout_s: float = 5.0, what: str = "") -> None:
    """Poll `cond` every few milliseconds until it holds; fail after `timeout_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what or cond}")
        await asyncio.sleep(0.002)


def assert_no_other_tasks() -> None:
    """Only the running test's own task is left on the loop."""
    current = asyncio.current_task()
    others = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
    assert not others, f"leaked tasks: {others}"


@dataclass
class AsyncRecordingIndex:
    """An `AsyncPrefixIndex` that records every write (with its incarnation) and holds sets."""

    calls: list[tuple[str, str, int, tuple[int, ...]]] = field(default_factory=list)
    held: dict[tuple[str, int], set[int]] = field(default_factory=dict)

    async def lookup(
        self, hashes: Sequence[int], candidates: Sequence[tuple[str, int]]
    ) -> dict[str, PrefixMatch] | None:
        out: dict[str, PrefixMatch] = {}
        for rid, inc in candidates:
            held = self.held.get((rid, inc), set())
            n = sum(1 for _ in takewhile(held.__contains__, hashes))
            if n:
                out[rid] = PrefixMatch(rid, n, n)
        return out

    async def record_stored(self, replica_id: str, incarnation: int, hashes: Sequence[int]) -> None:
        self.calls.append(("stored", replica_id, incarnation, tuple(hashes)))
        self.held.setdefault((replica_id, incarnation), set()).update(hashes)

    async def record_removed(
        self, replica_id: str, incarnation: int, hashes: Sequence[int]
    ) -> None:
        self.calls.append(("removed", replica_id, incarnation, tuple(hashes)))
        self.held.get((replica_id, incarnation), set()).difference_update(hashes)

    async def clear(self, replica_id: str) -> None:
        self.calls.append(("clear", replica_id, -1, ()))
        for key in [k for k in self.held if k[0] == replica_id]:
            del self.held[key]

    async def speculate(
        self, replica_id: str, incarnation: int, hashes: Sequence[int], ttl_s: float
    ) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:
        return None
