"""`FakePublisher`: a vLLM-like KV-event publisher for tests and demos (no vLLM, no torch).

It behaves like vLLM's `ZmqEventPublisher` (reference §2.2, §2.7) on loopback ports the OS picks:

- a PUB-compatible socket sends `[topic, seq (8 B big-endian), payload]`, seq from 0 per
  "process", one message per `publish`;
- the last `buffer_steps` batches are kept, and a ROUTER answers `[b"", start_seq]` with every
  buffered batch whose seq >= start, then the END marker, in the 0.33 reply format
  (`[b"", topic, seq, payload]`, `ReplayFormat.TOPIC`) or the older one (`[b"", seq, payload]`,
  `ReplayFormat.NO_TOPIC`); `ReplayFormat.SILENT` never answers (a hung replay endpoint).

Faults a test can inject: `publish(..., send=False)` buffers a batch without sending it (a
dropped message; `send(seq)` sends it later, out of order), `restart()` starts a new process
(seq back to 0, empty buffer) on the same sockets, `restart_process()` also closes and rebinds
the sockets so that subscribers reconnect, as after a real restart.

The socket is an XPUB rather than vLLM's PUB (identical for subscribers) so that
`wait_for_subscribers` can tell when a subscription has propagated, which makes tests
deterministic without sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections import deque
from collections.abc import Sequence

import zmq
import zmq.asyncio

from controlplane.kvevents.wire import (
    END_SEQ,
    WireBatch,
    WireEvent,
    decode_seq,
    encode_batch,
    encode_seq,
)


class ReplayFormat(enum.StrEnum):
    TOPIC = "topic"  # vLLM >= PR #45177: [b"", topic, seq, payload]; END [b"", b"", ff*8, b""]
    NO_TOPIC = "no_topic"  # older: [b"", seq, payload]; END [b"", ff*8, b""]
    SILENT = "silent"  # requests are read and never answered


class FakePublisher:
    def __init__(
        self,
        *,
        topic: str = "",
        buffer_steps: int = 10_000,
        replay_format: ReplayFormat = ReplayFormat.TOPIC,
        legacy_events: bool = False,
        data_parallel_rank: int | None = 0,
        with_replay: bool = True,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.topic = topic
        self.buffer_steps = buffer_steps
        self.replay_format = replay_format
        self.legacy_events = legacy_events
        self.data_parallel_rank = data_parallel_rank
        self.with_replay = with_replay
        # start seqs of the replay requests received, in order
        self.replay_requests: list[int] = []
        self.subscriptions = 0
        self._ctx = context or zmq.asyncio.Context.instance()
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self._last_ts = 0.0
        self._subscribed = asyncio.Condition()
        self.events_endpoint = ""
        self.replay_endpoint: str | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> FakePublisher:
        """Bind both sockets (on new loopback ports the first time, the same ones after)."""
        pub = self._ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        await _bind(pub, self.events_endpoint or "tcp://127.0.0.1:*")
        self._pub = pub
        self.events_endpoint = _endpoint(pub)
        self._tasks.append(asyncio.create_task(self._watch_subscriptions(pub)))
        if self.with_replay:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.SNDHWM, 2 * (self.buffer_steps + 1))
            await _bind(router, self.replay_endpoint or "tcp://127.0.0.1:*")
            self._router = router
            self.replay_endpoint = _endpoint(router)
            self._tasks.append(asyncio.create_task(self._serve_replay(router)))
        return self

    async def restart_process(self) -> None:
        """A real restart: the sockets close (subscribers see the connection drop), then a
        new process binds the same endpoints with seq from 0 and an empty buffer."""
        await self.close()
        self.restart()
        await self.start()

    async def close(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None

    async def __aenter__(self) -> FakePublisher:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- publishing ------------------------------------------------------------------------------
    @property
    def next_seq(self) -> int:
        return self._next_seq

    async def publish(
        self, events: Sequence[WireEvent], *, send: bool = True, ts: float | None = None
    ) -> int:
        """Buffer one batch under the next seq and (unless `send` is False) send it; its seq."""
        if ts is None:
            # strictly increasing, so two batches of one seq in two "processes" always differ
            ts = max(time.time(), self._last_ts + 1e-3)
        self._last_ts = ts
        batch = WireBatch(ts=ts, events=events, data_parallel_rank=self.data_parallel_rank)
        seq = self._next_seq
        self._next_seq += 1
        self._buffer.append((seq, encode_batch(batch, legacy=self.legacy_events)))
        if send:
            await self.send(seq)
        return seq

    async def send(self, seq: int) -> None:
        """Send a buffered batch on the event socket (again, or late)."""
        assert self._pub is not None, "start() first"
        payload = self._payload(seq)
        await self._pub.send_multipart([self.topic.encode(), encode_seq(seq), payload])

    async def send_raw(self, frames: Sequence[bytes]) -> None:
        """Send arbitrary frames on the event socket (malformed-input tests)."""
        assert self._pub is not None, "start() first"
        await self._pub.send_multipart(list(frames))

    def restart(self) -> None:
        """A new publisher process on the same endpoints: seq from 0, empty replay buffer."""
        self._next_seq = 0
        self._buffer.clear()

    def _payload(self, seq: int) -> bytes:
        for s, payload in self._buffer:
            if s == seq:
                return payload
        raise KeyError(f"seq {seq} is not in the replay buffer")

    # -- subscriptions ---------------------------------------------------------------------------
    async def wait_for_subscribers(self, count: int = 1, timeout_s: float = 5.0) -> None:
        """Wait until `count` subscriptions have reached the event socket."""
        async with asyncio.timeout(timeout_s), self._subscribed:
            await self._subscribed.wait_for(lambda: self.subscriptions >= count)

    async def _watch_subscriptions(self, pub: zmq.asyncio.Socket) -> None:
        while True:
            msg = await pub.recv()
            if msg[:1] == b"\x01":
                async with self._subscribed:
                    self.subscriptions += 1
                    self._subscribed.notify_all()

    # -- replay ----------------------------------------------------------------------------------
    async def _serve_replay(self, router: zmq.asyncio.Socket) -> None:
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3:
                continue  # vLLM logs and ignores any other shape
            client, _empty, start_frame = frames
            start = decode_seq(start_frame)
            self.replay_requests.append(start)
            if self.replay_format is ReplayFormat.SILENT:
                continue
            topic = self.topic.encode()
            for seq, payload in list(self._buffer):
                if seq < start:
                    continue
                if self.replay_format is ReplayFormat.TOPIC:
                    reply = [client, b"", topic, encode_seq(seq), payload]
                else:
                    reply = [client, b"", encode_seq(seq), payload]
                await router.send_multipart(reply)
            if self.replay_format is ReplayFormat.TOPIC:
                await router.send_multipart([client, b"", b"", END_SEQ, b""])
            else:
                await router.send_multipart([client, b"", END_SEQ, b""])


async def _bind(sock: zmq.asyncio.Socket, addr: str, timeout_s: float = 2.0) -> None:
    """Bind, waiting while a just-closed socket still holds the port (ZMQ closes in the
    background)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            sock.bind(addr)
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or loop.time() > deadline:
                sock.close(linger=0)
                raise
        await asyncio.sleep(0.005)


def _endpoint(sock: zmq.asyncio.Socket) -> str:
    last = sock.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(last, bytes)
    return last.decode()
