"""KV-cache events over ZMQ, as vLLM's `ZmqEventPublisher` sends them (reference §2.1-2.7).

- **PUB** at `endpoint`: bound when the endpoint has a wildcard (`*`, `::`) or is `ipc://` /
  `inproc://`, else connected (a router's bound SUB collects every replica). One message per
  engine step that produced events, three frames: `[topic, seq (8 bytes big-endian, from 0),
  payload]` with the payload from `controlplane.kvevents.wire.encode_batch`.
- **ROUTER** at `replay_endpoint` (always bound): a DEALER sends `[b"", start_seq]`; the publisher
  answers `[b"", topic, seq, payload]` for every buffered batch with `seq >= start_seq` (the
  last `buffer_steps` batches), then the end marker `[b"", b"", END_SEQ, b""]`. Requests with
  another frame count are ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque

import zmq
import zmq.asyncio

from controlplane.kvevents.wire import END_SEQ, WireBatch, WireEvent, encode_batch, encode_seq
from controlplane.sim_replica.config import KVEventsSettings, is_bind_endpoint

log = logging.getLogger(__name__)


class KVEventPublisher:
    """The replica's PUB socket, its replay ROUTER and the replay buffer."""

    def __init__(self, settings: KVEventsSettings) -> None:
        self.settings = settings
        self.topic = settings.topic.encode()
        self._ctx = zmq.asyncio.Context()
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=settings.buffer_steps)
        self._seq = 0
        self.endpoint = settings.endpoint
        self.replay_endpoint = settings.replay_endpoint

    @property
    def next_seq(self) -> int:
        return self._seq

    def open(self) -> None:
        """Bind or connect the sockets (inside the running event loop)."""
        s = self.settings
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, s.hwm)
        pub.setsockopt(zmq.LINGER, 0)
        if is_bind_endpoint(s.endpoint):
            pub.bind(s.endpoint)
        else:
            pub.connect(s.endpoint)
        self._pub = pub
        self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT) or s.endpoint
        if s.replay_endpoint:
            replay = self._ctx.socket(zmq.ROUTER)
            replay.setsockopt(zmq.SNDHWM, 2 * (s.buffer_steps + 1))
            replay.setsockopt(zmq.LINGER, 0)
            replay.bind(s.replay_endpoint)
            self._replay = replay
            self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
            self._replay_task = asyncio.get_running_loop().create_task(
                self._serve_replay(replay), name="kv-replay"
            )

    def publish(self, events: list[WireEvent]) -> None:
        """Send one batch (the events of one engine step) and keep it for replay."""
        payload = encode_batch(WireBatch(time.time(), events, 0), legacy=self.settings.legacy)
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        if self._pub is not None:
            # PUB never blocks: beyond the high-water mark ZMQ drops the message
            self._pub.send_multipart([self.topic, encode_seq(seq), payload], flags=zmq.NOBLOCK)

    async def _serve_replay(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("ignoring a replay request of %d frames", len(frames))
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await sock.send_multipart([client, b"", self.topic, encode_seq(seq), payload])
            await sock.send_multipart([client, b"", b"", END_SEQ, b""])

    async def close(self) -> None:
        task, self._replay_task = self._replay_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        self._ctx.term()

    def sources(self) -> dict[str, dict[str, object]]:
        """`GET /kv_event_sources`: the resolved config per data-parallel rank."""
        s = self.settings
        return {
            "0": {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": self.endpoint,
                "replay_endpoint": self.replay_endpoint or None,
                "buffer_steps": s.buffer_steps,
                "hwm": s.hwm,
                "max_queue_size": 100_000,
                "topic": s.topic,
            }
        }
