"""The contract between a replica's event subscriber and whatever consumes its batches.

A subscriber delivers each batch of one replica exactly once and in sequence order (`apply`),
and says when everything known about the replica must be forgotten (`purge`), with the reason.
`EventIngestor` is the production sink; tests use recording fakes.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Protocol

from controlplane.kvevents.wire import WireBatch


class PurgeReason(StrEnum):
    """Why a replica's index entries were dropped (a bounded metric label)."""

    # first sync of a subscriber: entries left by an earlier process cannot be trusted
    CONNECT = "connect"
    # the replica restarted (seq went backwards, or a known seq came back with other content)
    RESTART = "restart"
    # batches were lost for good (outside the replay buffer, no replay endpoint, replay failed)
    GAP = "gap"
    # a batch could not be applied (index error); the subscriber rebuilds from the replay buffer
    RESYNC = "resync"


class EventSink(Protocol):
    async def apply(self, batch: WireBatch) -> None:
        """Apply one batch; batches arrive in seq order, each once."""
        ...

    async def purge(self, reason: PurgeReason) -> None:
        """Forget everything about the replica; later batches start from nothing."""
        ...
