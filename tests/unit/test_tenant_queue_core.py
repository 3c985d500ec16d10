"""The tenant-queue core both hosts drive: FIFO order, bounded overtaking, placement moves,
the derived batch share, and books that return to zero whatever order the events come in."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.roofline.profile import profile
from controlplane.tenancy.config import FairnessConfig
from controlplane.tenancy.queue import QueueEntry, TenantQueueCore
from controlplane.tenancy.work import WorkModel
from controlplane.types import PriorityClass

H100 = profile("h100", "llama-3.1-8b")
KV = H100.num_gpu_blocks * H100.resolved_block_size
INTER, BATCH = PriorityClass.INTERACTIVE, PriorityClass.BATCH


def core(**cfg: object) -> TenantQueueCore[int]:
    return TenantQueueCore(FairnessConfig(**cfg), WorkModel.build("vtc", H100))  # type: ignore[arg-type]


def entry(tenant: str, prompt: int = 100, out: int = 50, cls: PriorityClass = INTER) -> QueueEntry:
    return QueueEntry(tenant, cls, 1.0, prompt, prompt + out)


def test_one_tenant_leaves_in_arrival_order() -> None:
    q = core()
    for k in range(4):
        q.enqueue(k, entry("A"), 0.0)
    assert [q.next(lambda k: True, 1.0) for _ in range(5)] == [0, 1, 2, 3, None]
    assert q.backlog["A"] == [[0.0, 1.0]] and not q.state.backlogged


def test_a_blocked_head_is_overtaken_only_within_its_own_charge() -> None:
    q = core()
    q.enqueue(0, entry("A", prompt=1000), 0.0)  # A's head will not fit
    for k in range(1, 40):
        q.enqueue(k, entry("B", prompt=100), 0.0)
    # B overtakes while its counter stays within A's counter + A's head prefill (1,000 tokens)
    passed: list[int] = []
    while (key := q.next(lambda k: k != 0, 0.0)) is not None:
        passed.append(key)
        q.admit(key, entry("B", prompt=100))
    assert len(passed) == 11  # 0 + 11 x 100 > 1,000: the twelfth would pass the bound
    assert q.next(lambda k: True, 0.0) == 0  # A's head goes once it fits


def test_place_moves_the_books_between_replicas() -> None:
    q = core()
    e = entry("A", prompt=2000)
    q.admit(7, e, queued=False)
    q.place(7, "r0", H100)
    q.place(7, "r1", H100)
    assert q.replicas["r0"].requests == 0 and q.replicas["r0"].prefill == 0
    assert (q.replicas["r1"].requests, q.replicas["r1"].prefill) == (1, 2000)
    q.finished(7, cached_tokens=0, outputs=10)
    assert q.replicas["r1"].requests == 0 and not q.inflight and q.held["A"] == 0


@pytest.mark.parametrize(
    ("threshold", "chat_on_r0"),
    [
        (0, False),  # vLLM's default: the document takes every step's budget until it is done
        (512, True),  # chunked at the threshold: a chat joins the next step beside it
    ],
)
def test_one_long_prompt_does_not_stall_other_first_tokens(
    threshold: int, chat_on_r0: bool
) -> None:
    prof = H100.with_overrides(long_prefill_token_threshold=threshold)
    q = core()
    q.admit(1, entry("A", prompt=32_000), queued=False)
    q.place(1, "r0", prof)
    assert not q.room("r0", prof, entry("A", prompt=32_000))  # one long prefill at a time
    chat = entry("B", prompt=200)
    assert q.room("r0", prof, chat) is chat_on_r0
    assert q.room("r1", prof, chat)  # never held back where nothing prefills
    q.first_token(1)
    assert q.room("r0", prof, entry("A", prompt=32_000)) and q.room("r0", prof, chat)


@pytest.mark.parametrize(
    ("interactive", "expect"),
    [(0, "no cap"), (40, "capped")],
)
def test_the_batch_share_is_sized_from_the_interactive_load(interactive: int, expect: str) -> None:
    q = core()  # batch_kv_share None: derived
    q.fleet_replicas = 1
    for k in range(interactive):
        q.admit(k, entry("chat", prompt=400, out=250), queued=False)
        q.place(k, "r0", H100)
    share = q.batch_share(H100)
    if expect == "no cap":
        assert share == 1.0
    else:
        assert 0.0 < share < 1.0
    assert core(batch_kv_share=0.3).batch_share(H100) == 0.3


events = st.lists(
    st.tuples(
        st.sampled_from(["enqueue", "next", "admit_now", "first", "tokens", "finish", "remove"]),
        st.integers(0, 7),
        st.sampled_from(["A", "B", "C"]),
        st.sampled_from([INTER, BATCH]),
        st.integers(1, 40_000),
    ),
    max_size=80,
)


@settings(max_examples=150)
@given(events)
def test_books_return_to_zero_whatever_the_order(
    evs: list[tuple[str, int, str, object, int]],
) -> None:
    q = core()
    q.fleet_kv, q.fleet_replicas = float(2 * KV), 2
    keys = iter(range(10_000))
    waiting: list[int] = []
    running: list[int] = []
    queued_with: dict[int, QueueEntry] = {}
    for op, i, tenant, cls, prompt in evs:
        e = entry(tenant, prompt=prompt, cls=cls)  # type: ignore[arg-type]
        if op == "enqueue":
            k = next(keys)
            q.enqueue(k, e, 0.0)
            waiting.append(k)
            queued_with[k] = e
        elif op == "next":
            k2 = q.next(lambda k: True, 0.0)
            if k2 is not None:
                waiting.remove(k2)
                q.admit(k2, queued_with[k2])
                q.place(k2, f"r{i % 2}", H100)
                running.append(k2)
        elif op == "admit_now":
            k = next(keys)
            if any(q.room(f"r{r}", H100, e) for r in range(2)):
                q.admit(k, e, queued=False)
                q.place(k, f"r{i % 2}", H100)
                running.append(k)
        elif op == "first" and running:
            q.first_token(running[i % len(running)])
        elif op == "tokens" and running:
            q.produced(running[i % len(running)], prompt % 500)
        elif op == "finish" and running:
            q.finished(running.pop(i % len(running)), cached_tokens=prompt % 64, outputs=7)
        elif op == "remove" and waiting:
            assert q.remove(waiting.pop(i % len(waiting)), 0.0)
        assert all(v >= 0 for v in q.state.counters.values())
        assert q.queued == len(waiting)
    for k in running:
        q.finished(k)
    for k in waiting:
        assert q.remove(k, 1.0)
    assert q.queued == 0 and not q.inflight and not q.waiting_entries
    assert not q.state.backlogged
    assert all(v == 0 for v in q.held.values())
    for books in q.replicas.values():
        assert (books.requests, books.reserved, books.batch_reserved) == (0, 0, 0)
        assert (books.prefill, books.long_prefill) == (0, 0)
    assert q._interactive == [0, 0, 0]
