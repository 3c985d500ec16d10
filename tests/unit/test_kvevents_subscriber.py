"""ReplicaSubscriber against FakePublisher over loopback TCP: seq tracking, replay, purges."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from kvevents_fakes import RecordingSink, assert_no_other_tasks, labelled, until

from controlplane.kvevents.sink import PurgeReason
from controlplane.kvevents.subscriber import ReplicaSubscriber, SyncState
from controlplane.kvevents.testing import FakePublisher, ReplayFormat

CONNECT, RESTART, GAP, RESYNC = (
    PurgeReason.CONNECT,
    PurgeReason.RESTART,
    PurgeReason.GAP,
    PurgeReason.RESYNC,
)

Rig = Callable[..., Awaitable[tuple[FakePublisher, ReplicaSubscriber, RecordingSink]]]


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    """Builds publisher + subscriber pairs; tears them down and checks nothing leaked."""
    made: list[tuple[FakePublisher, ReplicaSubscriber]] = []

    async def make(
        sink: RecordingSink | None = None, *, sub_kw: dict[str, Any] | None = None, **pub_kw: Any
    ) -> tuple[FakePublisher, ReplicaSubscriber, RecordingSink]:
        pub = await FakePublisher(**pub_kw).start()
        sink = sink or RecordingSink()
        sub = ReplicaSubscriber(
            "r0",
            pub.events_endpoint,
            sink,
            replay_endpoint=pub.replay_endpoint,
            topic=pub.topic,
            **{
                "replay_timeout_s": 2.0,
                "sink_retry_s": 0.01,
                "reconnect_s": 0.01,
                **(sub_kw or {}),
            },
        )
        made.append((pub, sub))
        sub.start()
        await pub.wait_for_subscribers(1)
        await sub.wait_synced(5.0)
        return pub, sub, sink

    yield make
    for pub, sub in made:
        await sub.close()
        assert sub.sockets_closed and not sub.running
        assert sub.state is SyncState.CLOSED
        await pub.close()
    assert_no_other_tasks()


async def publish_all(pub: FakePublisher, labels: list[int], *, send: bool = True) -> None:
    for label in labels:
        await pub.publish(labelled(label), send=send)


async def test_in_order_stream_is_applied_once(rig: Rig) -> None:
    pub, sub, sink = await rig(topic="kv@pod@m")
    await publish_all(pub, [10, 11, 12])
    await until(lambda: sub.applied_seq == 2)
    assert sink.log == [CONNECT, 10, 11, 12]
    assert pub.replay_requests == [0]  # the slow-joiner replay on connect
    assert (sub.stats.batches_applied, sub.stats.gaps, sub.stats.lost) == (3, 0, 0)
    assert sub.trusted and sub.wire_seq == 2


async def test_connect_replays_what_was_published_before(rig: Rig) -> None:
    pub = await FakePublisher().start()
    await publish_all(pub, [1, 2, 3])  # nobody listening yet
    sink = RecordingSink()
    async with ReplicaSubscriber(
        "r0", pub.events_endpoint, sink, replay_endpoint=pub.replay_endpoint
    ) as sub:
        await sub.wait_synced(5.0)
        assert sink.log == [CONNECT, 1, 2, 3]
        assert sub.stats.batches_replayed == 3 and sub.trusted
        await pub.wait_for_subscribers(1)
        await publish_all(pub, [4])
        await until(lambda: sub.applied_seq == 3)
    await pub.close()
    assert sink.labels == [1, 2, 3, 4]
    assert_no_other_tasks()


@pytest.mark.parametrize("fmt", [ReplayFormat.TOPIC, ReplayFormat.NO_TOPIC])
async def test_gap_is_filled_by_replay_exactly_once(rig: Rig, fmt: ReplayFormat) -> None:
    pub, sub, sink = await rig(topic="kv", replay_format=fmt)
    await publish_all(pub, [0])
    await publish_all(pub, [1, 2], send=False)  # dropped on the wire
    await publish_all(pub, [3, 4])
    await until(lambda: sub.applied_seq == 4)
    assert sink.log == [CONNECT, 0, 1, 2, 3, 4]
    assert sub.stats.gaps == 1 and sub.stats.lost == 0
    assert sub.stats.duplicates >= 1  # the live copy of a batch the replay delivered
    assert pub.replay_requests == [0, 0]  # the gap replay overlaps one applied batch
    assert sub.trusted


async def test_reordered_batches_are_applied_in_order_once(rig: Rig) -> None:
    pub, sub, sink = await rig()
    await publish_all(pub, [0])
    s1 = await pub.publish(labelled(1), send=False)
    await publish_all(pub, [2])
    await until(lambda: sub.applied_seq == 2)
    await pub.send(s1)  # arrives late, after the replay applied it
    await publish_all(pub, [3])
    await until(lambda: sub.applied_seq == 3)
    assert sink.log == [CONNECT, 0, 1, 2, 3]
    assert sub.stats.restarts == 0 and sub.stats.duplicates >= 1


async def test_restart_purges_then_applies(rig: Rig) -> None:
    pub, sub, sink = await rig()
    await publish_all(pub, [0, 1, 2])
    await until(lambda: sub.applied_seq == 2)
    pub.restart()
    await publish_all(pub, [100])  # seq 0 again
    await until(lambda: sink.labels[-1:] == [100])
    assert sink.log == [CONNECT, 0, 1, 2, RESTART, 100]
    assert sub.stats.restarts == 1 and sub.applied_seq == 0


async def test_restart_with_same_seq_is_told_apart_by_content(rig: Rig) -> None:
    pub, sub, sink = await rig()
    await publish_all(pub, [0])
    await until(lambda: sub.applied_seq == 0)
    pub.restart()
    await publish_all(pub, [100])  # seq 0, but a different batch
    await until(lambda: 100 in sink.labels)
    assert sink.log == [CONNECT, 0, RESTART, 100]


async def test_restart_that_runs_ahead_is_found_by_the_overlap(rig: Rig) -> None:
    pub, sub, sink = await rig()
    await publish_all(pub, [0])
    await until(lambda: sub.applied_seq == 0)
    pub.restart()
    await publish_all(pub, [100, 101], send=False)  # new process's seq 0, 1: missed
    await publish_all(pub, [102])  # seq 2 looks like a gap after seq 0
    await until(lambda: sink.labels[-1:] == [102])
    # the overlap (seq 0) came back with other content: restart, replay the new process from 0
    assert sink.log == [CONNECT, 0, RESTART, 100, 101, 102]
    assert sub.stats.restarts == 1


async def test_gap_outside_the_buffer_is_unrecoverable(rig: Rig) -> None:
    pub, sub, sink = await rig(buffer_steps=2)
    await publish_all(pub, [0])
    await until(lambda: sub.applied_seq == 0)
    await publish_all(pub, [1, 2, 3, 4], send=False)
    await publish_all(pub, [5])
    await until(lambda: sub.applied_seq == 5)
    # replay from seq 0 returned seq 4 first: 1..3 are gone; purge, continue from 4
    assert sink.log == [CONNECT, 0, GAP, 4, 5]
    assert sub.stats.lost == 3 and not sub.trusted
    await publish_all(pub, [6])  # fresh events: hints usable again
    await until(lambda: sub.applied_seq == 6)
    assert sub.trusted


async def test_connect_to_a_long_running_replica_is_not_a_loss(rig: Rig) -> None:
    pub = await FakePublisher(buffer_steps=2).start()
    await publish_all(pub, [0, 1, 2, 3], send=False)
    sink = RecordingSink()
    async with ReplicaSubscriber(
        "r0", pub.events_endpoint, sink, replay_endpoint=pub.replay_endpoint
    ) as sub:
        await sub.wait_synced(5.0)
        assert sink.log == [CONNECT, 2, 3]
        assert sub.stats.lost == 0 and not sub.trusted
    await pub.close()


async def test_failed_replay_backs_off(rig: Rig) -> None:
    pub, sub, sink = await rig(
        replay_format=ReplayFormat.SILENT,
        sub_kw={"replay_timeout_s": 0.05, "replay_backoff_s": 3600.0},
    )
    assert sub.stats.replay_failures == 1  # the connect replay timed out
    await publish_all(pub, [0])
    await publish_all(pub, [1], send=False)
    await publish_all(pub, [2])
    await until(lambda: sub.applied_seq == 2)
    assert pub.replay_requests == [0]  # no new replay within the backoff
    assert sink.log == [CONNECT, 0, GAP, 2]
    assert sub.stats.lost == 1 and sub.stats.gaps == 1


async def test_failed_replay_is_retried_after_the_backoff(rig: Rig) -> None:
    now = [0.0]
    pub, sub, sink = await rig(
        replay_format=ReplayFormat.SILENT,
        sub_kw={"replay_timeout_s": 0.05, "replay_backoff_s": 30.0, "clock": lambda: now[0]},
    )
    pub.replay_format = ReplayFormat.TOPIC
    now[0] = 31.0
    await publish_all(pub, [0])
    await publish_all(pub, [1], send=False)
    await publish_all(pub, [2])
    await until(lambda: sub.applied_seq == 2)
    assert pub.replay_requests == [0, 0]
    assert sink.log == [CONNECT, 0, 1, 2]


async def test_without_replay_endpoint_gaps_are_lost() -> None:
    pub = await FakePublisher(with_replay=False).start()
    sink = RecordingSink()
    sub = ReplicaSubscriber("r0", pub.events_endpoint, sink)
    sub.start()
    await pub.wait_for_subscribers(1)
    await sub.wait_synced(5.0)
    await publish_all(pub, [0])
    await publish_all(pub, [1], send=False)
    await publish_all(pub, [2])
    await until(lambda: sub.applied_seq == 2)
    assert sink.log == [CONNECT, 0, GAP, 2]
    await sub.close()
    await pub.close()
    assert_no_other_tasks()


async def test_first_batch_after_a_late_join_without_replay_does_not_purge_twice() -> None:
    pub = await FakePublisher(with_replay=False).start()
    await publish_all(pub, [0, 1], send=False)
    sink = RecordingSink()
    async with ReplicaSubscriber("r0", pub.events_endpoint, sink) as sub:
        await pub.wait_for_subscribers(1)
        await publish_all(pub, [2])
        await until(lambda: sub.applied_seq == 2)
        assert sink.log == [CONNECT, 2]
        assert sub.stats.lost == 2
    await pub.close()


async def test_malformed_frames_and_payloads_are_counted_and_skipped(rig: Rig) -> None:
    pub, sub, sink = await rig()
    await pub.send_raw([b"", b"\x00"])  # two frames
    await pub.send_raw([b"", b"\x00\x01", b"x"])  # short seq
    await publish_all(pub, [0])
    # seq 1 carries garbage: consumed and counted, the stream goes on
    await pub.send_raw([b"", (1).to_bytes(8, "big"), b"\xc1"])
    pub._next_seq = 2
    await publish_all(pub, [2])
    await until(lambda: sub.applied_seq == 2)
    assert sink.log == [CONNECT, 0, 2]
    assert sub.stats.malformed_frames == 2 and sub.stats.decode_errors == 1


async def test_topic_mismatch_is_ignored(rig: Rig) -> None:
    pub, sub, sink = await rig(topic="kv@a")
    await pub.send_raw([b"kv@ab", (0).to_bytes(8, "big"), b"\xc1"])  # prefix match only
    await publish_all(pub, [0])
    await until(lambda: sub.applied_seq == 0)
    assert sink.log == [CONNECT, 0] and sub.stats.decode_errors == 0


async def test_sink_failure_resyncs_from_the_replay_buffer(rig: Rig) -> None:
    pub, sub, sink = await rig()
    await publish_all(pub, [0])
    await until(lambda: sub.applied_seq == 0)
    sink.fail_applies = 1
    sink.fail_purges = 1
    await publish_all(pub, [1])
    await until(lambda: sink.labels[-1:] == [1] and sub.trusted)
    # purge + replay from 0 rebuilds the replica from the buffer
    assert sink.log == [CONNECT, 0, RESYNC, 0, 1]
    assert sub.stats.sink_errors == 2


async def test_legacy_events_and_reply_format(rig: Rig) -> None:
    pub, sub, sink = await rig(legacy_events=True, replay_format=ReplayFormat.NO_TOPIC)
    await publish_all(pub, [7])
    await publish_all(pub, [8], send=False)
    await publish_all(pub, [9])
    await until(lambda: sub.applied_seq == 2)
    assert sink.log == [CONNECT, 7, 8, 9]


async def test_close_is_idempotent_and_leaves_nothing(rig: Rig) -> None:
    _pub, sub, _sink = await rig()
    await sub.close()
    await sub.close()
    assert sub.sockets_closed and not sub.running


async def test_restart_older_than_the_digest_window(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("controlplane.kvevents.subscriber.DIGEST_WINDOW", 2)
    pub, sub, sink = await rig()
    await publish_all(pub, [0, 1, 2, 3, 4])
    await until(lambda: sub.applied_seq == 4)
    pub.restart()
    await publish_all(pub, [100])  # seq 0: no digest left, but below the wire watermark
    await until(lambda: 100 in sink.labels)
    assert sink.log == [CONNECT, 0, 1, 2, 3, 4, RESTART, 100]


async def test_overlap_batch_gone_means_unverifiable_continuity(rig: Rig) -> None:
    pub, sub, sink = await rig(buffer_steps=2)
    await publish_all(pub, [0, 1, 2])
    await until(lambda: sub.applied_seq == 2)
    pub.restart()
    await publish_all(pub, [100, 101, 102, 103], send=False)  # new seqs 0..3, missed
    await publish_all(pub, [104])  # seq 4: a gap; the buffer holds seqs 3, 4, not the overlap 2
    await until(lambda: 104 in sink.labels)
    # seq 3 follows the applied seq 2, but nothing proves it is the same process: purge
    assert sink.log == [CONNECT, 0, 1, 2, GAP, 103, 104]
    assert sub.stats.lost == 0


@pytest.mark.parametrize("seed", range(6))
async def test_random_faults_keep_the_applied_stream_a_contiguous_suffix(
    rig: Rig, seed: int
) -> None:
    """Random drops, late sends and restarts; after the dust settles the sink holds, since its
    last purge, a gap-free run of the current process's batches ending at the newest one."""
    rng = random.Random(seed)
    # a replay request racing with a restart is never answered: keep that wait short
    pub, sub, sink = await rig(
        buffer_steps=rng.choice([2, 4, 64]), sub_kw={"replay_timeout_s": 0.2}
    )
    label = 0
    process: list[int] = []  # labels of the current process, by seq
    held: list[int] = []
    for _ in range(40):
        op = rng.random()
        if op < 0.1:
            # sockets drop and come back, as in a real restart (which takes seconds)
            subscribed = pub.subscriptions
            await pub.restart_process()
            await pub.wait_for_subscribers(subscribed + 1)
            process, held = [], []
        elif op < 0.2 and held:
            seq = held.pop(rng.randrange(len(held)))
            with contextlib.suppress(KeyError):  # fell out of the buffer
                await pub.send(seq)
        else:
            send = rng.random() < 0.7
            seq = await pub.publish(labelled(label), send=send)
            process.append(label)
            if not send:
                held.append(seq)
            label += 1
        if rng.random() < 0.3:
            await asyncio.sleep(0.001)
    await publish_all(pub, [label])
    process.append(label)
    await until(lambda: sub.applied_seq == len(process) - 1 and sink.labels[-1:] == [label])
    applied = sink.since_last_purge()
    assert applied == process[len(process) - len(applied) :], (applied, process)


async def test_reconnect_verifies_continuity_even_without_a_gap(rig: Rig) -> None:
    pub, sub, sink = await rig()
    await publish_all(pub, [0, 1])
    await until(lambda: sub.applied_seq == 1)
    await pub.restart_process()  # sockets drop; the new process binds the same ports
    await pub.wait_for_subscribers(2)  # the SUB reconnected to the new socket
    await publish_all(pub, [100, 101], send=False)  # new seqs 0, 1: missed
    await publish_all(pub, [102])  # seq 2 == applied + 1: only the reconnection tells
    await until(lambda: 102 in sink.labels)
    assert sink.log == [CONNECT, 0, 1, RESTART, 100, 101, 102]
    assert sub.stats.restarts == 1 and sub.stats.gaps == 0


async def test_reconnect_to_the_same_process_keeps_the_state(rig: Rig) -> None:
    pub, sub, sink = await rig()
    await publish_all(pub, [0, 1])
    await until(lambda: sub.applied_seq == 1)
    seq, buffer = pub.next_seq, list(pub._buffer)
    await pub.restart_process()
    pub._next_seq, pub._buffer = seq, deque(buffer, maxlen=pub.buffer_steps)  # same process
    await pub.wait_for_subscribers(2)
    await publish_all(pub, [2])
    await until(lambda: sub.applied_seq == 2)
    assert sink.log == [CONNECT, 0, 1, 2]
    assert pub.replay_requests[-1] == 1  # the overlap check
