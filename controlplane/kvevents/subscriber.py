"""One replica's KV-event stream: ZMQ SUB for live batches, DEALER for replay, seq bookkeeping.

vLLM's publisher (reference §2.2, §2.7) sends `[topic, seq, payload]` on a PUB socket, seq
starting at 0 per process, and keeps the last `buffer_steps` batches for replay on a ROUTER
socket: a request `[b"", start_seq]` is answered with every buffered batch whose seq >= start,
then an END marker. Replies are `[b"", topic, seq, payload]` (0.33) or `[b"", seq, payload]`
(before vllm PR #45177); the END marker is `[b"", b"", ff*8, b""]` or `[b"", ff*8, b""]`.

**State.** `applied_seq` is the last seq handed to the sink (the index watermark); `wire_seq`
the last seq read from the SUB socket (the wire watermark). They differ after a replay, which
moves `applied_seq` ahead of the live stream; the live copies of replayed batches are then
skipped. A digest of every recently applied payload is kept by seq, so "already applied" and
"a restarted replica reused this seq" are told apart by content (each batch carries a fresh
timestamp). Before each replay request the SUB socket is drained into a pending list: a replay
that answers holds everything its process had published by then, so any pending message it
does not contain verbatim is from a replaced process (`stale`), never applied.

**Algorithm** (one task; replays run inline while live messages queue in the SUB socket):

1. Connect; purge the replica (CONNECT: whatever the index holds from an earlier process
   cannot be trusted, and the engine-hash map is empty); replay from 0 (beats the slow-joiner
   problem, and recovers whatever the replica's buffer still holds).
2. Live batch with seq s (not covered by a replay):
   - s <= applied_seq: the content recorded for s → duplicate (the live copy of a replayed
     batch, or a late one), skip. Other content, or s older than the digest window and at or
     below the wire watermark → RESTART: purge, forget the watermarks, then handle s as a
     new process's batch. (A SUB socket never delivers one message twice, so new content
     under a known seq can only come from a new process.)
   - s == applied_seq + 1: apply.
   - s > applied_seq + 1: gap → replay from applied_seq (one batch of overlap, whose digest
     must match: a mismatch means the replica restarted in between → purge, replay from 0).
     If the replay answered, s is now covered (a duplicate or stale); else s is applied after
     the loss is recorded.
3. Replay replies are checked against `applied_seq` like live batches. If the first replied
   seq is past the one requested, the missing batches fell out of the buffer: unrecoverable →
   purge (GAP), count them as lost, continue from there. An overlap request answered without
   the overlap batch is treated the same (continuity cannot be proven); one answered with no
   batch at all means a newer process with fewer batches (RESTART, replay from 0). A replay
   that times out (`replay_timeout_s` of silence) or cannot be sent fails: the gap is treated
   as unrecoverable, and no replay is attempted for `replay_backoff_s` (gaps in that window are
   losses at once). Without a replay endpoint every gap is unrecoverable.
4. After the SUB socket reconnects (a socket monitor reports a second handshake), the replay
   backoff is lifted and the next live batch is verified like a gap even when its seq follows
   `applied_seq`: a restarted replica whose first batch we see carries exactly
   `applied_seq + 1` is caught by the overlap (without a replay, the state is purged).
5. A batch that cannot be decoded is counted and skipped (its seq is consumed). A sink error
   (index down) triggers a RESYNC after `sink_retry_s`: purge (retried until it succeeds),
   then replay from 0.

`trusted` is False from the start, after any lost batch and after a sink error; it becomes True
after a replay that started at the requested seq, or when a fresh live batch is applied in
sequence.

Known limit: a restart with neither a reconnection (ipc/inproc endpoints that survive, or a
monitor event that arrives late) nor a known seq with new content nor a gap goes unnoticed.
Recreate the subscriber (which purges) when the fleet learns of a restart by other means.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from hashlib import blake2b
from typing import Final

import zmq
import zmq.asyncio
from opentelemetry.trace import Tracer
from zmq.utils.monitor import parse_monitor_message

from controlplane.kvevents.sink import EventSink, PurgeReason
from controlplane.kvevents.wire import (
    END_SEQ,
    KVEventDecodeError,
    WireBatch,
    decode_batch,
    decode_seq,
    encode_seq,
)
from controlplane.tracing import tracer_of

logger = logging.getLogger(__name__)

DEFAULT_REPLAY_TIMEOUT_S: Final = 5.0
DEFAULT_REPLAY_BACKOFF_S: Final = 30.0
DEFAULT_SINK_RETRY_S: Final = 1.0
# seq -> payload digest for this many recent batches
DIGEST_WINDOW: Final = 4096
# the SUB socket queues live batches while a replay runs (vLLM's PUB uses the same HWM)
SUB_RCVHWM: Final = 100_000
# live messages moved off the socket before a replay, at most
MAX_PENDING: Final = SUB_RCVHWM

# one INTERNAL span per batch handed to the index (a sink error marks it failed)
TRACER_NAME: Final = "controlplane.kvevents"
BATCH_SPAN: Final = "cp.kvevents.batch"
SPAN_REPLICA: Final = "cp.replica"
SPAN_SEQ: Final = "cp.kvevents.seq"
SPAN_EVENTS: Final = "cp.kvevents.events"
SPAN_REPLAYED: Final = "cp.kvevents.replayed"


class SyncState(enum.StrEnum):
    CONNECTING = "connecting"
    REPLAYING = "replaying"
    LIVE = "live"
    CLOSED = "closed"


@dataclass(slots=True)
class SubscriberStats:
    """Monotone counters of one replica's stream."""

    # live messages read (each batch once, unless it is a duplicate)
    live_received: int = 0
    batches_applied: int = 0
    # of those, applied from replay replies
    batches_replayed: int = 0
    # live or replayed copies of batches already applied
    duplicates: int = 0
    # live messages from a process that was already replaced (received before a replay
    # that came from its successor)
    stale: int = 0
    # seq gaps seen on the live stream
    gaps: int = 0
    # batches lost for good (outside the replay buffer, replay failed, no replay endpoint)
    lost: int = 0
    restarts: int = 0
    replays: int = 0
    replay_failures: int = 0
    decode_errors: int = 0
    sink_errors: int = 0
    malformed_frames: int = 0
    purges: int = 0


class _ReplayFailed(Exception):
    pass


class _Resync(Exception):
    """A sink call failed: rebuild the replica from its replay buffer."""


class ReplicaSubscriber:
    """Follows one replica's KV events and feeds them, in order and once each, to a sink."""

    def __init__(
        self,
        replica_id: str,
        events_endpoint: str,
        sink: EventSink,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        context: zmq.asyncio.Context | None = None,
        replay_timeout_s: float = DEFAULT_REPLAY_TIMEOUT_S,
        replay_backoff_s: float = DEFAULT_REPLAY_BACKOFF_S,
        sink_retry_s: float = DEFAULT_SINK_RETRY_S,
        reconnect_s: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
        tracer: Tracer | None = None,
    ) -> None:
        self.replica_id = replica_id
        self._tracer = tracer or tracer_of(TRACER_NAME)
        self.events_endpoint = events_endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.replay_timeout_s = replay_timeout_s
        self.replay_backoff_s = replay_backoff_s
        self.sink_retry_s = sink_retry_s
        self.reconnect_s = reconnect_s
        self.stats = SubscriberStats()
        self.state = SyncState.CONNECTING
        self.trusted = False
        self.applied_seq = -1
        self.wire_seq = -1
        # Unix time of the last batch handed to the sink (0.0: none yet): the index's freshness
        self.last_applied_at = 0.0
        self._sink = sink
        self._clock = clock
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sub: zmq.asyncio.Socket | None = None
        self._dealer: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._handshakes = 0
        # the SUB socket reconnected (the replica may have restarted): verify continuity
        self._verify = False
        self._task: asyncio.Task[None] | None = None
        self._digests: OrderedDict[int, bytes] = OrderedDict()
        self._replay_blocked_until = float("-inf")
        self._needs_resync: PurgeReason | None = None
        # live messages read from the SUB socket but not handled yet; True = covered by a
        # replay that answered after they were received
        self._pending: deque[tuple[list[bytes], bool]] = deque()
        # something was applied since the last purge
        self._dirty = False
        self._synced = asyncio.Event()

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Connect and start following the replica (idempotent)."""
        if self._task is not None:
            return
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, SUB_RCVHWM)
        sub.setsockopt(zmq.RECONNECT_IVL, max(1, round(self.reconnect_s * 1000)))
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        # handshakes on the SUB socket: the first is the connection, later ones reconnections
        self._monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sub.connect(self.events_endpoint)
        self._sub = sub
        self._task = asyncio.create_task(self._run(), name=f"kvevents-{self.replica_id}")

    async def close(self) -> None:
        """Stop the task and close both sockets (safe to call twice)."""
        task, self._task = self._task, None
        while task is not None and not task.done():
            task.cancel()
            # wait, not await: a crash was logged where it happened, and a cancellation the
            # task absorbed is repeated
            await asyncio.wait({task}, timeout=1.0)
        if task is not None and not task.cancelled():
            task.exception()  # retrieved: no "exception was never retrieved" warning
        self._close_dealer()
        if self._sub is not None:
            if self._monitor is not None:
                self._sub.disable_monitor()
                self._monitor.close(linger=0)
                self._monitor = None
            self._sub.close(linger=0)
            self._sub = None
        self.state = SyncState.CLOSED

    async def __aenter__(self) -> ReplicaSubscriber:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def sockets_closed(self) -> bool:
        return self._sub is None and self._dealer is None and self._monitor is None

    async def wait_synced(self, timeout_s: float | None = None) -> None:
        """Wait until the first sync (purge + replay from 0) is done."""
        async with asyncio.timeout(timeout_s):
            await self._synced.wait()

    # -- main loop -------------------------------------------------------------------------------
    async def _run(self) -> None:
        sub = self._sub
        assert sub is not None
        try:
            await self._resync(PurgeReason.CONNECT)
            self._synced.set()
            while True:
                if self._needs_resync is not None:
                    await self._resync(self._needs_resync)
                    continue
                if not self._pending:
                    self._pending.append((await sub.recv_multipart(), False))
                frames, covered = self._pending.popleft()
                try:
                    await self._on_message(frames, covered)
                except _Resync:
                    self._needs_resync = PurgeReason.RESYNC
                    await asyncio.sleep(self.sink_retry_s)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug: log it; the replica stays untrusted
            logger.exception("replica %s: event subscriber crashed", self.replica_id)
            self.trusted = False
            raise

    async def _resync(self, reason: PurgeReason) -> None:
        """Purge the replica (retrying while the sink fails), then replay from 0."""
        if reason is PurgeReason.RESTART:
            self.stats.restarts += 1
        await self._drain()
        while True:
            try:
                await self._purge(reason)
                break
            except _Resync:
                await asyncio.sleep(self.sink_retry_s)
        self._needs_resync = None
        self.applied_seq = -1
        self._digests.clear()
        try:
            await self._replay_into(0, overlap=False, fresh=True)
        except _Resync:
            self._needs_resync = PurgeReason.RESYNC
        self.state = SyncState.LIVE

    async def _drain(self) -> None:
        """Move every message already queued on the SUB socket to `_pending` (before a replay
        request, so that a reply tells which of them it covers)."""
        sub = self._sub
        assert sub is not None
        while len(self._pending) < MAX_PENDING:
            try:
                frames = await sub.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            self._pending.append((frames, False))

    def _parse(self, frames: list[bytes]) -> tuple[int, bytes] | None:
        if len(frames) != 3:
            self.stats.malformed_frames += 1
            return None
        topic, seq_frame, payload = frames
        if self.topic and topic != self.topic.encode():
            return None
        try:
            return decode_seq(seq_frame), payload
        except KVEventDecodeError:
            self.stats.malformed_frames += 1
            return None

    async def _on_message(self, frames: list[bytes], covered: bool) -> None:
        """One live message; `covered`: a replay answered after it was received."""
        parsed = self._parse(frames)
        if parsed is None:
            return
        seq, payload = parsed
        self.stats.live_received += 1
        if covered:
            self._skip_covered(seq, payload)
            return
        if await self._reconnected():
            # the replica may have restarted (and its replay endpoint come back)
            self._replay_blocked_until = float("-inf")
            self._verify = self.applied_seq >= 0
        wire_before, self.wire_seq = self.wire_seq, seq
        if seq <= self.applied_seq:
            if self._is_duplicate(seq, payload, wire_before):
                self.stats.duplicates += 1
                return
            await self._restart(seq)
        gap = seq > self.applied_seq + 1
        if gap or self._verify:
            self._verify = False
            if gap:
                self.stats.gaps += 1
            if await self._fill_gap():
                self._skip_covered(seq, payload)
                return
            # no replay, or it failed: the batches in between are lost (after a reconnection
            # without a gap: none are, but continuity is unproven, so the state goes too)
            await self._lose(self.applied_seq + 1, seq)
        await self._apply(seq, payload, replayed=False)

    async def _reconnected(self) -> bool:
        """True if the SUB socket completed a handshake again since the first one."""
        if self._monitor is None:
            return False
        again = False
        while True:
            try:
                msg = await self._monitor.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return again
            if parse_monitor_message(msg)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._handshakes += 1
                again = again or self._handshakes > 1

    def _skip_covered(self, seq: int, payload: bytes) -> None:
        """A message received before a replay that answered: the replay holds everything its
        process had published by then, so the message is a copy, or from a dead process."""
        if seq <= self.applied_seq and self._digests.get(seq) == _digest(payload):
            self.stats.duplicates += 1
        else:
            self.stats.stale += 1

    def _is_duplicate(self, seq: int, payload: bytes, wire_before: int) -> bool:
        known = self._digests.get(seq)
        if known is not None:
            return known == _digest(payload)
        # too old for the digest window: a live seq at or below the wire watermark can only be
        # a new process's; above it, it is the live copy of a batch replay already applied
        return seq > wire_before

    async def _restart(self, seq: int) -> None:
        logger.warning(
            "replica %s: seq %d after %d: the replica restarted", self.replica_id, seq,
            self.applied_seq,
        )  # fmt: skip
        self.stats.restarts += 1
        await self._purge(PurgeReason.RESTART)
        self.applied_seq = -1
        self._digests.clear()
        self._verify = False

    async def _fill_gap(self) -> bool:
        """Replay from `applied_seq`; True if a replay answered (see `_replay_into`)."""
        if self.replay_endpoint is None or self._clock() < self._replay_blocked_until:
            return False
        await self._drain()
        has_overlap = self.applied_seq >= 0 and self.applied_seq in self._digests
        start = self.applied_seq if has_overlap else self.applied_seq + 1
        return await self._replay_into(start, overlap=has_overlap, fresh=False)

    async def _lose(self, first: int, upto: int) -> None:
        """Batches [first, upto) are gone for good (or, when none are, the replay could not
        prove `upto` follows what was applied): purge and continue from `upto`."""
        lost = upto - first
        self.stats.lost += lost
        logger.warning(
            "replica %s: %d batches lost before seq %d (or continuity unverifiable)",
            self.replica_id, lost, upto,
        )  # fmt: skip
        if self._dirty:
            await self._purge(PurgeReason.GAP)
        self.trusted = False
        self.applied_seq = upto - 1

    async def _purge(self, reason: PurgeReason) -> None:
        self.trusted = False
        try:
            await self._sink.purge(reason)
            self.stats.purges += 1
            self._dirty = False
        except Exception as exc:
            self.stats.sink_errors += 1
            logger.warning("replica %s: purge failed: %s", self.replica_id, exc)
            raise _Resync from exc

    async def _apply(self, seq: int, payload: bytes, *, replayed: bool) -> None:
        self.applied_seq = seq
        self._remember(seq, payload)
        try:
            batch = decode_batch(payload)
        except KVEventDecodeError as exc:
            self.stats.decode_errors += 1
            logger.warning("replica %s: seq %d undecodable: %s", self.replica_id, seq, exc)
            return
        self._dirty = True
        attributes: dict[str, str | int | bool] = {
            SPAN_REPLICA: self.replica_id,
            SPAN_SEQ: seq,
            SPAN_EVENTS: len(batch.events),
            SPAN_REPLAYED: replayed,
        }
        with self._tracer.start_as_current_span(BATCH_SPAN, attributes=attributes):
            await self._deliver(batch)
        self.stats.batches_applied += 1
        self.last_applied_at = time.time()
        if replayed:
            self.stats.batches_replayed += 1
        else:
            self.trusted = True

    async def _deliver(self, batch: WireBatch) -> None:
        try:
            await self._sink.apply(batch)
        except Exception as exc:
            self.stats.sink_errors += 1
            self.trusted = False
            logger.warning("replica %s: applying a batch failed: %s", self.replica_id, exc)
            raise _Resync from exc

    def _remember(self, seq: int, payload: bytes) -> None:
        digests = self._digests
        digests[seq] = _digest(payload)
        while len(digests) > DIGEST_WINDOW:
            digests.popitem(last=False)

    # -- replay ----------------------------------------------------------------------------------
    async def _replay_into(self, start: int, *, overlap: bool, fresh: bool) -> bool:
        """Request replay from `start` and apply what comes back; True if the replay answered
        (END marker), which also marks every pending live message as covered.

        `overlap`: `start` is the last applied seq, sent back to check continuity.
        `fresh`: the replica was just purged, so a truncated buffer loses nothing we held.
        """
        if self.replay_endpoint is None:
            return False
        self.state = SyncState.REPLAYING
        self.stats.replays += 1
        stream = _ReplayStream(self, start)
        complete = True
        try:
            async for seq, payload in stream:
                if stream.count == 1:
                    if overlap and seq == start:
                        if self._digests.get(seq) == _digest(payload):
                            continue
                        self._close_dealer()  # drop the rest of this replay
                        await self._restart(seq)
                        return await self._replay_into(0, overlap=False, fresh=True)
                    if overlap or seq > start:
                        # truncated buffer, or the overlap batch is gone so continuity cannot
                        # be checked (it may be another process's seq space)
                        complete = False
                        if fresh:
                            self.applied_seq = seq - 1
                        else:
                            await self._lose(self.applied_seq + 1, seq)
                if seq <= self.applied_seq:
                    self.stats.duplicates += 1
                    continue
                if seq > self.applied_seq + 1:  # a hole inside the buffer: should not happen
                    complete = False
                    await self._lose(self.applied_seq + 1, seq)
                await self._apply(seq, payload, replayed=True)
        except _ReplayFailed as exc:
            self.stats.replay_failures += 1
            self._replay_blocked_until = self._clock() + self.replay_backoff_s
            logger.warning(
                "replica %s: replay from %d failed (%s); no replay for %.0fs", self.replica_id,
                start, exc, self.replay_backoff_s,
            )  # fmt: skip
        finally:
            if not stream.ended:
                self._close_dealer()  # replies may still be in flight: never mix two replays
            self.state = SyncState.LIVE
        if not stream.ended:
            self.trusted = False
            return False
        if not stream.count:
            if not fresh:
                # nothing at or after `start`, yet a live batch past it exists: the publisher
                # that answered is a newer process with fewer batches (or keeps no buffer)
                await self._restart(start)
                return await self._replay_into(0, overlap=False, fresh=True)
            # an empty buffer: nothing was missed, but it vouches for no pending message
            self.trusted = True
            return False
        self.trusted = complete
        self._pending = deque((frames, True) for frames, _ in self._pending)
        return True

    def _dealer_socket(self) -> zmq.asyncio.Socket:
        if self._dealer is None:
            assert self.replay_endpoint is not None
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.IMMEDIATE, 1)
            dealer.setsockopt(zmq.RECONNECT_IVL, max(1, round(self.reconnect_s * 1000)))
            dealer.connect(self.replay_endpoint)
            self._dealer = dealer
        return self._dealer

    def _close_dealer(self) -> None:
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None


class _ReplayStream:
    """Async iterator over one replay's (seq, payload) replies, both reply formats."""

    def __init__(self, owner: ReplicaSubscriber, start: int) -> None:
        self._owner = owner
        self._start = start
        self._sent = False
        # replies returned so far; True once the END marker arrived
        self.count = 0
        self.ended = False

    def __aiter__(self) -> _ReplayStream:
        return self

    async def __anext__(self) -> tuple[int, bytes]:
        owner = self._owner
        timeout = owner.replay_timeout_s
        dealer = owner._dealer_socket()
        # asyncio.timeout, not wait_for: in 3.11 wait_for can swallow a cancellation
        if not self._sent:
            self._sent = True
            try:
                async with asyncio.timeout(timeout):
                    await dealer.send_multipart([b"", encode_seq(self._start)])
            except (TimeoutError, zmq.ZMQError) as exc:
                raise _ReplayFailed(f"request not sent: {exc!r}") from exc
        while True:
            try:
                async with asyncio.timeout(timeout):
                    frames = await dealer.recv_multipart()
            except (TimeoutError, zmq.ZMQError) as exc:
                raise _ReplayFailed(f"no reply within {timeout}s: {exc!r}") from exc
            if frames and frames[0] == b"":
                frames = frames[1:]
            # new: [topic, seq, payload]; old: [seq, payload]; END: seq = ff*8
            if len(frames) == 3:
                seq_frame, payload = frames[1], frames[2]
            elif len(frames) == 2:
                seq_frame, payload = frames[0], frames[1]
            else:
                owner.stats.malformed_frames += 1
                continue
            if seq_frame == END_SEQ:
                self.ended = True
                raise StopAsyncIteration
            try:
                seq = decode_seq(seq_frame)
            except KVEventDecodeError:
                owner.stats.malformed_frames += 1
                continue
            self.count += 1
            return seq, payload


def _digest(payload: bytes) -> bytes:
    return blake2b(payload, digest_size=8).digest()
