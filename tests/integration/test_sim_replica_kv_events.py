"""KV events of the simulated replica over ZMQ, read with raw SUB and DEALER sockets."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
import zmq
from sim_fleet import SimReplica, sim_replica

from controlplane.hashing import vllm_block_hashes
from controlplane.kvevents.wire import (
    END_SEQ,
    WireBatch,
    WireBlockRemoved,
    WireBlockStored,
    decode_batch,
    decode_seq,
)

BLOCK = 32
TOPIC = b"kv@sim@tiny-llama"
# vllm-interfaces.md §1.7, B = 32, sha256, seed "0": prompt [1..64]
REFERENCE_B32 = [12802785450610620322, 4678177864115437763]

Message = tuple[bytes, int, WireBatch, bytes]


@pytest.fixture(scope="module")
def replica() -> Iterator[SimReplica]:
    with sim_replica(
        "--speed",
        "20",
        "--kv-events-endpoint",
        "tcp://*:0",
        "--kv-events-replay-endpoint",
        "tcp://*:0",
        "--kv-events-topic",
        TOPIC.decode(),
        "--num-gpu-blocks",
        "64",
        env={"PYTHONHASHSEED": "0"},
    ) as r:
        yield r


class Sockets:
    """Raw ZMQ sockets of one test, all closed at teardown."""

    def __init__(self) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.open: list[zmq.Socket[bytes]] = []

    def socket(self, kind: int) -> zmq.Socket[bytes]:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        self.open.append(sock)
        return sock

    def close(self) -> None:
        for sock in self.open:
            sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def ctx() -> Iterator[Sockets]:
    sockets = Sockets()
    yield sockets
    sockets.close()


_primes = iter(range(1000))


def _prime(url: str, sub: zmq.Socket[bytes]) -> None:
    """ZMQ's slow joiner: the first batches after subscribing may be dropped. Send requests
    with fresh prompts until one batch arrives, then drain."""
    for _ in range(20):
        k = next(_primes)
        prompt = [3 + (k * 31 + i) % 500 for i in range(BLOCK + 1)]
        httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        if _receive(sub, until=0.5, quiet=0.1):
            return
    raise AssertionError("the subscription never took effect")


def _subscribe(ctx: Sockets, endpoint: str, url: str) -> zmq.Socket[bytes]:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    _prime(url, sub)
    return sub


def _receive(sub: zmq.Socket[bytes], until: float = 2.0, quiet: float = 0.2) -> list[Message]:
    """Messages until none arrives for `quiet` seconds (or `until` passed)."""
    out: list[Message] = []
    deadline = time.monotonic() + until
    while time.monotonic() < deadline:
        if not sub.poll(int(quiet * 1000)):
            break
        topic, seq, payload = sub.recv_multipart()
        out.append((topic, decode_seq(seq), decode_batch(payload), payload))
    return out


def _stored(messages: list[Message]) -> list[WireBlockStored]:
    return [
        ev for *_, batch, _ in messages for ev in batch.events if isinstance(ev, WireBlockStored)
    ]


def _replay(ctx: Sockets, endpoint: str, start: int) -> tuple[list[list[bytes]], list[bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    replies: list[list[bytes]] = []
    while True:
        assert dealer.poll(3000), "no replay reply"
        frames = dealer.recv_multipart()
        if frames[2] == END_SEQ:
            return replies, frames
        replies.append(frames)


def test_stored_events_carry_exact_vllm_hashes(replica: SimReplica, ctx: Sockets) -> None:
    pub, _ = replica.kv_endpoints()
    sub = _subscribe(ctx, pub, replica.url)
    text = "A control plane for vLLM fleets routes requests to replicas by prefix. " * 2
    prompt = httpx.post(f"{replica.url}/tokenize", json={"prompt": text}).json()["tokens"]
    out = httpx.post(
        f"{replica.url}/v1/completions",
        json={"prompt": text, "max_tokens": 40, "return_token_ids": True},
    ).json()
    generated = out["choices"][0]["token_ids"]
    assert out["choices"][0]["prompt_token_ids"] == prompt
    messages = _receive(sub)
    assert messages, "no KV events"
    assert all(topic == TOPIC for topic, *_ in messages)
    stored = _stored(messages)
    # every full block of prompt + output whose KV was computed (the last token never is)
    tokens = [*prompt, *generated]
    full = (len(tokens) - 1) // BLOCK
    expected = vllm_block_hashes(tokens[: full * BLOCK], BLOCK, algo="sha256", seed="0")
    assert [h for ev in stored for h in ev.block_hashes] == expected
    assert [t for ev in stored for t in ev.token_ids] == tokens[: full * BLOCK]
    first_block = len(prompt) // BLOCK
    assert stored[0].parent_block_hash is None
    assert stored[0].block_hashes == tuple(expected[:first_block])  # the prefill's blocks
    for ev in stored[1:]:  # decode fills one block per event, chained to the one before
        i = expected.index(ev.block_hashes[0])
        assert ev.parent_block_hash == expected[i - 1]
    assert {(ev.block_size, ev.medium, ev.group_idx) for ev in stored} == {(BLOCK, "GPU", 0)}
    seqs = [seq for _, seq, *_ in messages]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))


def test_reference_vector_and_replay(replica: SimReplica, ctx: Sockets) -> None:
    pub, replay = replica.kv_endpoints()
    assert replay is not None
    sub = _subscribe(ctx, pub, replica.url)
    out = httpx.post(
        f"{replica.url}/v1/completions", json={"prompt": list(range(1, 65)), "max_tokens": 1}
    )
    assert out.status_code == 200
    live = _receive(sub)
    assert _stored(live)[0].block_hashes == tuple(REFERENCE_B32)
    # replay from 0: every batch since the replica started, seq from 0, same bytes
    replies, end = _replay(ctx, replay, 0)
    assert end == [b"", b"", END_SEQ, b""]
    assert all(len(f) == 4 and f[0] == b"" and f[1] == TOPIC for f in replies)
    seqs = [decode_seq(f[2]) for f in replies]
    assert seqs == list(range(len(seqs))) and seqs[0] == 0
    by_seq = {decode_seq(f[2]): f[3] for f in replies}
    for _, seq, _, payload in live:
        assert by_seq[seq] == payload
    # from the middle
    later, _ = _replay(ctx, replay, seqs[-1])
    assert [decode_seq(f[2]) for f in later] == [seqs[-1]]


def test_eviction_publishes_block_removed(replica: SimReplica, ctx: Sockets) -> None:
    """64 blocks: distinct prompts of 20 blocks push the earlier ones out of the pool."""
    _, replay = replica.kv_endpoints()
    assert replay is not None
    for k in range(5):
        prompt = [3 + (k * 7 + i) % 500 for i in range(20 * BLOCK)]
        resp = httpx.post(f"{replica.url}/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        assert resp.status_code == 200
    replies, _ = _replay(ctx, replay, 0)
    cached: dict[int, int] = {}  # hash -> copies in the pool, as the events tell it
    removals = 0
    for frames in replies:
        for ev in decode_batch(frames[3]).events:
            if isinstance(ev, WireBlockStored):
                for h in ev.block_hashes:
                    cached[h] = cached.get(h, 0) + 1
            elif isinstance(ev, WireBlockRemoved):
                assert len(ev.block_hashes) == 1, "vLLM sends one BlockRemoved per block"
                (h,) = ev.block_hashes
                assert cached.get(h, 0) > 0, "removed a block that was never stored"
                cached[h] -= 1
                removals += 1
    assert removals >= 5 * 20 - 63
    assert sum(cached.values()) <= 63


def test_connect_mode_publisher(ctx: Sockets) -> None:
    """A non-wildcard endpoint makes the replica connect to the router's bound SUB."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    with sim_replica("--speed", "20", "--kv-events-endpoint", f"tcp://127.0.0.1:{port}") as r:
        _prime(r.url, sub)
        httpx.post(f"{r.url}/v1/completions", json={"prompt": [7] * 40, "max_tokens": 1})
        messages = _receive(sub)
    assert len(messages) == 1 and messages[0][0] == b""
    assert _stored(messages)[0].token_ids == (7,) * BLOCK
