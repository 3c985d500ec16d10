"""The replica's ZMQ publisher: seq numbers, the replay ROUTER, the legacy encoding."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from controlplane.kvevents.wire import END_SEQ, WireBlockRemoved, decode_batch, decode_seq
from controlplane.sim_replica.config import KVEventsSettings
from controlplane.sim_replica.kv_publisher import KVEventPublisher


async def _replay(
    ctx: zmq.asyncio.Context, endpoint: str, *requests: list[bytes]
) -> list[list[bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        for frames in requests:
            await dealer.send_multipart(frames)
        out: list[list[bytes]] = []
        while True:
            reply = await asyncio.wait_for(dealer.recv_multipart(), 3.0)
            out.append(reply)
            if reply[2] == END_SEQ:
                return out
    finally:
        dealer.close()


async def test_replay_and_legacy_encoding(tmp_path: Path) -> None:
    settings = KVEventsSettings(
        endpoint=f"ipc://{tmp_path}/pub",
        replay_endpoint=f"ipc://{tmp_path}/replay",
        topic="t",
        buffer_steps=2,
        legacy=True,
    )
    pub = KVEventPublisher(settings)
    pub.open()
    ctx = zmq.asyncio.Context()
    try:
        for h in (1, 2, 3):
            pub.publish([WireBlockRemoved([h])])
        assert pub.next_seq == 3
        assert pub.sources()["0"]["endpoint"] == settings.endpoint
        # a request with another frame count is ignored; the next one is answered
        replies = await _replay(ctx, settings.replay_endpoint, [b"bad"], [b"", b"\x00" * 8])
        assert replies[-1] == [b"", b"", END_SEQ, b""]
        batches = replies[:-1]
        assert [decode_seq(f[2]) for f in batches] == [1, 2], "only buffer_steps batches kept"
        assert all(f[1] == b"t" for f in batches)
        raw = msgspec.msgpack.decode(batches[0][3])
        assert raw[1][0] == ["BlockRemoved", [2], "GPU", None], "positional legacy events"
        assert decode_batch(batches[0][3]).events == (WireBlockRemoved([2]),)
        later = await _replay(ctx, settings.replay_endpoint, [b"", (2).to_bytes(8, "big")])
        assert [decode_seq(f[2]) for f in later[:-1]] == [2]
    finally:
        ctx.destroy(linger=0)
        await pub.close()
