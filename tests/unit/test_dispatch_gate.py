"""The tenant queue's prefill gate (controlplane.tenancy.room, on the queue core the simulator
and the router drive): per-step prompt tokens ahead
of a new request's first chunk, each prefilling request at most the replica's
long_prefill_token_threshold; one long prefill at a time per replica; unchanged at threshold 0."""

from __future__ import annotations

import functools
import itertools

import pytest

from controlplane.roofline import profile
from controlplane.routing.policies import make_policy
from controlplane.sim.fleet import FleetConfig, FleetSim
from controlplane.tenancy.config import FairnessConfig
from controlplane.tenancy.queue import QueueEntry, TenantQueueCore
from controlplane.tenancy.room import is_long_prefill, prefill_gate, prefill_per_step
from controlplane.tenancy.work import WorkModel
from controlplane.traces.generators import long_documents
from controlplane.types import PriorityClass

H100 = profile("h100", "llama-3.1-8b")
BUDGET = H100.resolved_max_num_batched_tokens  # 8,192
TH = 352


@pytest.mark.parametrize(
    ("prompt", "threshold", "per_step", "long"),
    [
        (16_000, 0, 16_000, False),  # off: the whole prompt goes ahead
        (200, 0, 200, False),
        (16_000, TH, TH, True),  # chunked at the threshold
        (200, TH, 200, False),  # under the threshold: untouched
        (TH, TH, TH, False),  # at it: one chunk, not a long prefill
        (TH + 1, TH, TH, True),
        (1, 1, 1, False),
    ],
)
def test_per_step_tokens_and_long_prefills(
    prompt: int, threshold: int, per_step: int, long: bool
) -> None:
    assert prefill_per_step(prompt, threshold) == per_step
    assert is_long_prefill(prompt, threshold) is long


@pytest.mark.parametrize(
    ("ahead", "long_ahead", "prompt", "threshold", "steps", "long_prefills", "admit"),
    [
        # threshold 0: the whole prefill backlog within 2 x 8,192 (one 16k document at a time)
        (0, 0, 40_000, 0, 2.0, 1, True),  # nothing ahead: always
        (16_000, 0, 200, 0, 2.0, 1, True),  # 16,200 <= 16,384
        (16_000, 0, 16_000, 0, 2.0, 1, False),
        (16_200, 0, 200, 0, 2.0, 1, False),  # 16,400 > 16,384
        (16_000, 0, 16_000, 0, 0.0, 1, True),  # steps 0: no limit
        (16_000, 0, 16_000, 0, 3.0, 1, False),  # 32,000 > 24,576
        (8_000, 0, 8_000, 0, 3.0, 1, True),
        # threshold 352: a document ahead takes 352 a step, so chats pass it
        (TH, 1, 200, TH, 2.0, 1, True),
        (TH + 200 * 40, 1, 200, TH, 2.0, 1, True),  # 40 chats prefilling beside a document
        (TH, 1, 16_000, TH, 2.0, 1, False),  # a second document waits (one long prefill)
        (TH, 1, 16_000, TH, 2.0, 2, True),  # unless two may prefill at once
        (2 * TH, 2, 16_000, TH, 2.0, 2, False),
        (TH, 1, 16_000, TH, 2.0, 0, True),  # long_prefills 0: rule 1 only
        (TH, 1, TH, TH, 2.0, 1, True),  # a prompt of exactly the threshold is not long
        (200, 0, 16_000, TH, 2.0, 1, True),  # only chats ahead: a document starts
        # rule 1 in per-step tokens (documents at 352 each)
        (2 * BUDGET - TH, 0, 16_000, TH, 2.0, 0, True),
        (2 * BUDGET - TH + 1, 0, 16_000, TH, 2.0, 0, False),
        (2 * BUDGET - 199, 0, 200, TH, 2.0, 1, False),
    ],
)
def test_prefill_gate(
    ahead: int,
    long_ahead: int,
    prompt: int,
    threshold: int,
    steps: float,
    long_prefills: int,
    admit: bool,
) -> None:
    got = prefill_gate(
        ahead,
        long_ahead,
        prompt,
        threshold=threshold,
        budget=BUDGET,
        steps=steps,
        long_prefills=long_prefills,
    )
    assert got is admit


def test_threshold_zero_is_the_whole_prefill_backlog_as_before() -> None:
    """At threshold 0 the gate is exactly the old one: prompt tokens without a first token
    plus the new prompt within prefill_steps x budget, whatever long_prefills says."""
    for ahead, prompt, steps, long_prefills in itertools.product(
        (0, 1, 200, 8_192, 16_000, 16_184, 16_185, 40_000),
        (1, 200, 8_192, 16_000),
        (0.0, 1.0, 2.0, 3.0),
        (0, 1, 2),
    ):
        old = not (steps > 0 and ahead and ahead + prompt > steps * BUDGET)
        new = prefill_gate(
            ahead,
            0,
            prompt,
            threshold=0,
            budget=BUDGET,
            steps=steps,
            long_prefills=long_prefills,
        )
        assert new is old, (ahead, prompt, steps, long_prefills)


def _entry(tenant: str, prompt: int, reserved: int) -> QueueEntry:
    return QueueEntry(tenant, PriorityClass.INTERACTIVE, 1.0, prompt, reserved)


@pytest.mark.parametrize(
    ("threshold", "doc_per_step", "second_doc"),
    [(0, 16_000, False), (TH, TH, False)],
)
def test_the_queue_books_per_step_tokens_and_long_prefills(
    threshold: int, doc_per_step: int, second_doc: bool
) -> None:
    prof = H100.with_overrides(long_prefill_token_threshold=threshold)
    q: TenantQueueCore[int] = TenantQueueCore(FairnessConfig(), WorkModel.build("vtc", prof))
    doc, chat = _entry("A", 16_000, 16_300), _entry("B", 200, 400)
    q.enqueue(0, doc, 0.0)
    assert q.room("r", prof, doc)
    assert q.next(lambda key: True, 0.0) == 0
    q.admit(0, doc)
    q.place(0, "r", prof)
    s = q.replicas["r"]
    assert (s.prefill, s.long_prefill) == (doc_per_step, 1 if threshold else 0)
    assert q.room("r", prof, chat)  # a chat passes either way
    assert q.room("r", prof, doc) is second_doc
    q.admit(1, chat, queued=False)
    q.place(1, "r", prof)
    assert s.prefill == doc_per_step + 200
    q.first_token(0)
    q.first_token(0)  # once only
    assert (s.prefill, s.long_prefill) == (200, 0)
    assert q.room("r", prof, doc)
    q.finished(0)
    q.finished(1)  # without a first token (failed mid-prefill): leaves the backlog too
    assert (s.requests, s.prefill, s.long_prefill) == (0, 0, 0)


def test_a_fleet_with_the_threshold_prefills_one_document_at_a_time_per_replica(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prof = H100.with_overrides(long_prefill_token_threshold=TH)
    trace = long_documents(duration=8, doc_rate=4, chat_rate=20)
    peaks: list[tuple[int, int]] = []
    place = TenantQueueCore.place

    def checked(self: TenantQueueCore[int], key: int, replica: str, prof: object) -> None:
        place(self, key, replica, prof)  # type: ignore[arg-type]
        s = self.replicas[replica]
        peaks.append((s.long_prefill, s.prefill))

    monkeypatch.setattr(TenantQueueCore, "place", checked)
    sim = FleetSim(
        FleetConfig(profile=prof, replicas=2, fairness=FairnessConfig(batch_kv_share=1.0)),
        functools.partial(make_policy, "least_loaded"),
    )
    result = sim.run(trace)
    assert all(r.completed for r in result.records)
    assert max(long for long, _ in peaks) == 1
    assert max(p for _, p in peaks) <= 2 * BUDGET
    q = sim.queue
    assert q is not None and not q.inflight
    assert all((s.requests, s.prefill, s.long_prefill) == (0, 0, 0) for s in q.replicas.values())
