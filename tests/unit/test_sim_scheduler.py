"""Scheduler: vLLM v1's one-step decisions (budget, admission, prefix hits, preemption)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sim_builders import (
    BLOCK,
    PoolGuard,
    apply_outputs,
    check_scheduler,
    content_hashes,
    flatten_events,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
)

from controlplane.errors import ConfigError
from controlplane.roofline import profile
from controlplane.sim.engine import SimEngine
from controlplane.sim.request import EngineRequest, Status
from controlplane.sim.scheduler import Scheduler


@pytest.fixture
def guard() -> Iterator[PoolGuard]:
    with PoolGuard() as g:
        yield g


def names(reqs: list[tuple[EngineRequest, int, int]]) -> list[tuple[str, int, int]]:
    return [(r.request_id, n, c) for r, n, c in reqs]


def run_until_preemption(sched: Scheduler, max_steps: int = 100) -> list[EngineRequest]:
    for _ in range(max_steps):
        batch, _ = step(sched)
        check_scheduler(sched)
        if batch.preempted:
            return batch.preempted
    raise AssertionError("no preemption")


# -- chunked prefill and budgets ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "budget", "chunks"),
    [
        (10, 32, [10]),
        (32, 32, [32]),
        (33, 32, [32, 1]),
        (100, 32, [32, 32, 32, 4]),
        (7, 3, [3, 3, 1]),
        (1, 1, [1]),
    ],
)
def test_chunked_prefill(guard: PoolGuard, prompt: int, budget: int, chunks: list[int]) -> None:
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=budget)
    guard.watch(sched)
    req = make_request(prompt, max_output=3, uid=1)
    sched.waiting.add(req)
    computed = 0
    for i, chunk in enumerate(chunks):
        batch, _ = step(sched)
        assert names(batch.scheduled) == [("r1", chunk, computed)]
        assert batch.tokens == chunk <= budget
        computed += chunk
        assert req.num_computed == computed
        # the first token comes with the step that completes the prompt, not before
        assert req.num_output == (1 if i == len(chunks) - 1 else 0)
        # blocks cover the scheduled tokens, full ones are cached as soon as scheduled
        assert len(req.blocks) == -(-computed // BLOCK)
        assert req.num_cached_blocks == computed // BLOCK
    # then one decode token per step
    batch, _ = step(sched)
    assert names(batch.scheduled) == [("r1", 1, prompt)]
    batch, done = step(sched)
    assert done == [req]
    assert req.status is Status.FINISHED
    assert req.num_output == 3


# -- long_prefill_token_threshold -------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "budget", "threshold", "chunks"),
    [
        # a long prompt advances `threshold` tokens a step although the budget has room
        (100, 64, 32, [32, 32, 32, 4]),
        (33, 64, 32, [32, 1]),
        # prompts up to the threshold are untouched (vLLM: `threshold < num_new_tokens`)
        (32, 64, 32, [32]),
        (20, 64, 32, [20]),
        # 0 is off: the budget alone chunks
        (100, 64, 0, [64, 36]),
        # a budget below the threshold still wins (the threshold comes before the budget clamp)
        (100, 24, 32, [24, 24, 24, 24, 4]),
        # threshold 1: one prompt token a step
        (3, 64, 1, [1, 1, 1]),
    ],
)
def test_long_prefill_token_threshold_chunks(
    guard: PoolGuard, prompt: int, budget: int, threshold: int, chunks: list[int]
) -> None:
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=budget)
    sched.long_prefill_token_threshold = threshold
    guard.watch(sched)
    req = make_request(prompt, max_output=3, uid=1)
    sched.waiting.add(req)
    computed = 0
    for i, chunk in enumerate(chunks):
        batch, _ = step(sched)
        assert names(batch.scheduled) == [("r1", chunk, computed)]
        computed += chunk
        assert req.num_output == (1 if i == len(chunks) - 1 else 0)
        assert len(req.blocks) == -(-computed // BLOCK)
    # decodes are one token whatever the threshold
    batch, _ = step(sched)
    assert names(batch.scheduled) == [("r1", 1, prompt)]
    run_to_completion(sched)
    assert req.num_output == 3


@pytest.mark.parametrize(
    ("threshold", "first", "second"),
    [
        # the long prompt keeps its place in front but leaves the budget to the short one
        (16, [("r1", 16, 0), ("r2", 10, 0)], [("r1", 16, 16), ("r2", 1, 10)]),
        # off: the long prompt takes the whole budget and the short one waits
        (0, [("r1", 32, 0)], [("r1", 32, 32)]),
    ],
)
def test_long_prefill_token_threshold_leaves_budget_to_short_prompts(
    guard: PoolGuard,
    threshold: int,
    first: list[tuple[str, int, int]],
    second: list[tuple[str, int, int]],
) -> None:
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=32)
    sched.long_prefill_token_threshold = threshold
    guard.watch(sched)
    long, short = make_request(100, max_output=2, uid=1), make_request(10, max_output=2, uid=2)
    sched.waiting.add(long)
    sched.waiting.add(short)
    batch, _ = step(sched)
    assert names(batch.scheduled) == first
    batch, _ = step(sched)
    assert names(batch.scheduled) == second
    run_to_completion(sched)


@pytest.mark.parametrize(
    ("threshold", "next_chunks"),
    [(8, [8, 8, 8, 8]), (24, [24, 8]), (32, [32]), (0, [32])],
)
def test_long_prefill_token_threshold_caps_running_partial_prefills(
    guard: PoolGuard, threshold: int, next_chunks: list[int]
) -> None:
    """A request already running (admitted before the cap) is capped on the running path."""
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=32)
    guard.watch(sched)
    req = make_request(64, max_output=2, uid=1)
    sched.waiting.add(req)
    batch, _ = step(sched)
    assert names(batch.scheduled) == [("r1", 32, 0)]
    assert req.status is Status.RUNNING
    sched.long_prefill_token_threshold = threshold
    computed = 32
    for chunk in next_chunks:
        batch, _ = step(sched)
        assert names(batch.scheduled) == [("r1", chunk, computed)]
        computed += chunk
    assert req.num_computed == 64 and req.num_output == 1
    run_to_completion(sched)


@pytest.mark.parametrize("threshold", [0, 512, 2048])
def test_engine_takes_long_prefill_token_threshold_from_the_profile(threshold: int) -> None:
    prof = profile("h100", "llama-3.1-8b", long_prefill_token_threshold=threshold)
    engine = SimEngine(prof)
    assert engine.sched.long_prefill_token_threshold == threshold
    # default profile: off, as vLLM with max_num_partial_prefills = 1
    assert profile("h100", "llama-3.1-8b").long_prefill_token_threshold == 0


def test_negative_long_prefill_token_threshold_is_rejected() -> None:
    with pytest.raises(ConfigError):
        profile("h100", "llama-3.1-8b", long_prefill_token_threshold=-1)
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        Scheduler(
            make_scheduler().pool,
            max_num_seqs=1,
            max_num_batched_tokens=8,
            max_model_len=64,
            long_prefill_token_threshold=-1,
        )


def test_running_are_scheduled_before_waiting(guard: PoolGuard) -> None:
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=10)
    guard.watch(sched)
    a = make_request(25, max_output=2, uid=1)
    b = make_request(6, max_output=2, uid=2)
    sched.waiting.add(a)
    batch, _ = step(sched)
    assert names(batch.scheduled) == [("r1", 10, 0)]
    sched.waiting.add(b)
    # a keeps its place in front; b only gets the budget a leaves
    batch, _ = step(sched)
    assert names(batch.scheduled) == [("r1", 10, 10)]
    batch, _ = step(sched)
    assert names(batch.scheduled) == [("r1", 5, 20), ("r2", 5, 0)]
    batch, _ = step(sched)
    assert names(batch.scheduled) == [("r1", 1, 25), ("r2", 1, 5)]
    assert a.num_output == 2 and a.status is Status.FINISHED
    assert b.num_output == 1
    run_to_completion(sched)


@pytest.mark.parametrize(
    ("max_num_seqs", "admitted_first_step"),
    [(1, 1), (2, 2), (3, 3), (8, 3)],
)
def test_max_num_seqs_caps_running(
    guard: PoolGuard, max_num_seqs: int, admitted_first_step: int
) -> None:
    sched = make_scheduler(num_blocks=64, max_num_seqs=max_num_seqs, max_num_batched_tokens=64)
    guard.watch(sched)
    reqs = [make_request(4, max_output=2, uid=i) for i in range(3)]
    for r in reqs:
        sched.waiting.add(r)
    batch, _ = step(sched)
    assert len(batch.scheduled) == admitted_first_step
    assert len(sched.running) == admitted_first_step
    assert not batch.admission_blocked  # the cap is not a KV shortage
    while sched.running or len(sched.waiting):
        step(sched)
        assert len(sched.running) <= max_num_seqs
    assert all(r.num_output == 2 for r in reqs)


# -- prefix hits -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "hit_tokens"),
    [(3, 0), (4, 0), (5, 4), (8, 4), (9, 8), (12, 8), (13, 12), (16, 12), (17, 16)],
)
def test_last_token_rule_on_admission(guard: PoolGuard, prompt: int, hit_tokens: int) -> None:
    """A second identical prompt hits (N - 1) // B blocks and recomputes the rest."""
    sched = make_scheduler(num_blocks=32, max_num_batched_tokens=64)
    guard.watch(sched)
    first = make_request(prompt, max_output=1, uid=1, group=7)
    sched.waiting.add(first)
    run_to_completion(sched)
    second = make_request(prompt, max_output=1, uid=2, group=7)
    sched.waiting.add(second)
    batch, _ = step(sched)
    assert names(batch.scheduled) == [("r2", prompt - hit_tokens, hit_tokens)]
    assert second.cached_tokens == hit_tokens
    assert sched.prefix_hits == hit_tokens
    assert sched.prefix_queries == 2 * prompt
    if prompt % BLOCK == 0:
        # the whole last block was recomputed: it now exists twice under one hash
        assert sched.pool.num_cached == prompt // BLOCK + 1


def test_same_step_admission_hits_blocks_cached_earlier_in_that_step(guard: PoolGuard) -> None:
    sched = make_scheduler(num_blocks=32, max_num_batched_tokens=64)
    guard.watch(sched)
    a = make_request(13, max_output=2, uid=1, group=3)  # 3 full blocks of content 3
    b = make_request(13, max_output=2, uid=2, group=3)
    c = make_request(10, max_output=2, uid=3, group=3, shared_blocks=1)  # shares block 0 only
    for r in (a, b, c):
        sched.waiting.add(r)
    batch, _ = step(sched)
    assert names(batch.scheduled) == [("r1", 13, 0), ("r2", 1, 12), ("r3", 6, 4)]
    assert (a.cached_tokens, b.cached_tokens, c.cached_tokens) == (0, 12, 4)
    assert sched.prefix_hits == 16
    assert sched.prefix_queries == 36
    # b shares a's three blocks; only its last-token block is new
    assert b.blocks[:3].tolist() == a.blocks[:3].tolist()
    assert c.blocks[:1].tolist() == a.blocks[:1].tolist()
    stored = [e for e in flatten_events(sched.pool.take_events()) if e[0] == "stored"]
    hs = content_hashes(3, 3)
    assert stored == [("stored", tuple(hs), None), ("stored", (c.block_hash(1),), hs[0])]
    run_to_completion(sched)


def test_prefix_stats_recorded_once_per_admission(guard: PoolGuard) -> None:
    """A head that cannot be allocated is not counted; each admission is counted once."""
    sched = make_scheduler(num_blocks=5, max_num_batched_tokens=64)
    guard.watch(sched)
    big = make_request(12, max_output=2, uid=1, group=1)  # 3 blocks, 1 left free
    sched.waiting.add(big)
    step(sched)
    assert (sched.prefix_queries, sched.prefix_hits) == (12, 0)
    other = make_request(8, max_output=1, uid=2, group=2)  # needs 2 blocks
    sched.waiting.add(other)
    batch, _ = step(sched)
    assert batch.admission_blocked
    assert other.status is Status.WAITING
    assert (sched.prefix_queries, sched.prefix_hits) == (12, 0)
    assert other.cached_tokens == -1
    run_to_completion(sched)
    assert (sched.prefix_queries, sched.prefix_hits) == (20, 0)
    assert other.cached_tokens == 0


# -- preemption --------------------------------------------------------------------------------


def _two_decoders(*, priority_policy: bool = False, budget: int = 64) -> Scheduler:
    """4 usable blocks of 4 tokens; two 4-token prompts decode until one runs out of blocks."""
    return make_scheduler(
        num_blocks=5, max_num_batched_tokens=budget, priority_policy=priority_policy
    )


def test_fcfs_preempts_the_last_running_request(guard: PoolGuard) -> None:
    sched = _two_decoders()
    guard.watch(sched)
    a = make_request(4, max_output=10, uid=1)
    b = make_request(4, max_output=10, uid=2)
    sched.waiting.add(a)
    sched.waiting.add(b)
    step(sched)  # both prefill: 1 block each
    step(sched)  # position 4: a second block each; pool now full
    for _ in range(3):  # positions 5..7 fit in the second blocks
        batch, _ = step(sched)
        assert not batch.preempted
    assert sched.pool.num_free == 0
    late = make_request(2, max_output=1, uid=3)
    sched.waiting.add(late)
    batch, _ = step(sched)  # a needs a third block: b (last running) is preempted
    assert batch.preempted == [b]
    assert b.status is Status.PREEMPTED
    assert b.num_computed == 0 and b.blocks.tolist() == [] and b.preemptions == 1
    assert sched.num_preemptions == 1
    assert list(sched.waiting) == [b, late]  # preempted goes back in front
    assert names(batch.scheduled) == [("r1", 1, 8)]
    check_scheduler(sched)
    # b's 2 blocks were freed, a took one: one block is free and `late` (1 block) would fit,
    # but nothing is admitted in a step that preempted
    assert sched.pool.num_free == 1
    assert late.status is Status.WAITING
    run_to_completion(sched)
    assert b.num_output == 10 and b.status.name == "FINISHED"
    assert late.num_output == 1
    assert a.num_output == 10


@pytest.mark.parametrize(
    ("running", "victim"),
    [
        # (priority, arrival) of the running requests, in running order
        ([(0, 0.0), (0, 1.0), (0, 2.0)], 2),
        ([(0, 2.0), (0, 1.0), (0, 0.0)], 0),  # latest arrival, wherever it sits
        ([(1, 0.0), (0, 1.0), (0, 2.0)], 0),  # worst priority first
        ([(0, 0.0), (1, 1.0), (1, 0.5)], 1),
    ],
)
def test_priority_policy_preempts_the_worst(
    guard: PoolGuard, running: list[tuple[int, float]], victim: int
) -> None:
    sched = make_scheduler(num_blocks=7, max_num_batched_tokens=64, priority_policy=True)
    guard.watch(sched)
    reqs = [
        make_request(4, max_output=20, uid=10 + i, priority=p, arrival_s=t)
        for i, (p, t) in enumerate(running)
    ]
    for r in reqs:
        sched.waiting.add(r)
    step(sched)
    sched.running[:] = reqs  # pin the running order the table describes
    preempted = run_until_preemption(sched)
    assert preempted == [reqs[victim]]
    run_to_completion(sched)
    assert all(r.num_output == 20 for r in reqs)


def test_priority_preemption_of_an_already_scheduled_request_refunds_its_budget(
    guard: PoolGuard,
) -> None:
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=64, priority_policy=True)
    guard.watch(sched)
    low = make_request(6, max_output=6, uid=1, priority=1, arrival_s=0.0)
    high = make_request(4, max_output=5, uid=2, priority=0, arrival_s=1.0)
    sched.waiting.add(low)
    sched.waiting.add(high)
    step(sched)  # high 1 block, low 2 blocks: the pool is full
    assert sched.running == [high, low]
    assert sched.pool.num_free == 0
    sched.running[:] = [low, high]  # low is scheduled first in the next step
    batch, _ = step(sched)
    # low (position 6) fits; high (position 4) needs a block: the victim is low, which was
    # already scheduled in this step, so its token goes back to the budget
    assert batch.preempted == [low]
    assert names(batch.scheduled) == [("r2", 1, 4)]
    assert batch.tokens == 1
    assert low.num_computed == 0 and low.status is Status.PREEMPTED
    check_scheduler(sched)
    run_to_completion(sched)
    assert (low.num_output, high.num_output) == (6, 5)


def test_no_admission_in_a_step_that_preempted(guard: PoolGuard) -> None:
    """Priority: the victim frees room for a waiting request, which still waits a step."""
    sched = make_scheduler(num_blocks=5, max_num_batched_tokens=64, priority_policy=True)
    guard.watch(sched)
    high = make_request(4, max_output=6, uid=1, priority=0, arrival_s=0.0)
    low = make_request(4, max_output=6, uid=2, priority=1, arrival_s=0.0)
    sched.waiting.add(high)
    sched.waiting.add(low)
    step(sched)
    step(sched)  # position 4: second block each, the pool is full
    waiting = make_request(3, max_output=1, uid=3, priority=0, arrival_s=5.0)
    sched.waiting.add(waiting)
    for _ in range(3):
        batch, _ = step(sched)
        assert batch.admission_blocked and not batch.preempted
    batch = sched.schedule()  # high needs a third block: low is preempted
    assert batch.preempted == [low]
    assert names(batch.scheduled) == [("r1", 1, 8)]
    assert sched.pool.num_free == 1  # room for `waiting` (one block), yet:
    assert waiting.status is Status.WAITING
    assert [r.request_id for r in sched.waiting] == ["r3", "r2"]  # by (priority, arrival)
    apply_outputs(sched, batch)
    batch, _ = step(sched)
    # high finished and freed its blocks: its partial last block (uncached) went to the queue's
    # head, its full ones behind low's cached block 0. r3 takes that partial block, so low's
    # block 0 survives and low re-admits with a one-block hit
    assert names(batch.scheduled) == [("r3", 3, 0), ("r2", 5, 4)]
    run_to_completion(sched)
    assert low.num_output == 6 and low.preemptions == 1


def test_preempted_request_is_readmitted_with_its_output_and_counted_apart(
    guard: PoolGuard,
) -> None:
    sched = _two_decoders()
    guard.watch(sched)
    a = make_request(4, max_output=10, uid=1, group=1)
    b = make_request(4, max_output=6, uid=2, group=2)
    sched.waiting.add(a)
    sched.waiting.add(b)
    for _ in range(6):
        batch, _ = step(sched)
    assert batch.preempted == [b]
    outputs_before = b.num_output
    assert outputs_before == 5
    queries = sched.prefix_queries
    preempted_queries = sched.preempted_prefix_queries
    for _ in range(50):
        if b.status is not Status.PREEMPTED:
            break
        step(sched)
    assert b.status is Status.FINISHED  # re-admitted, its last token came with the prefill
    # the re-admission looks up prompt + generated tokens once, in vLLM's separate (unexported)
    # preempted counters, so a victim re-hitting its own blocks does not inflate the hit rate
    assert sched.prefix_queries == queries
    assert sched.preempted_prefix_queries == preempted_queries + 4 + outputs_before
    assert b.cached_tokens == 0  # usage.cached_tokens is from the first admission
    run_to_completion(sched)
    assert b.num_output == 6 and a.num_output == 10


# -- random workloads: step invariants ---------------------------------------------------------


@st.composite
def workloads(draw: st.DrawFn) -> tuple[dict[str, int | bool], list[list[int]]]:
    bs = draw(st.sampled_from([1, 2, 4]))
    num_blocks = draw(st.integers(min_value=4, max_value=24))
    cfg: dict[str, int | bool] = {
        "block_size": bs,
        "num_blocks": num_blocks,
        "max_num_seqs": draw(st.integers(min_value=1, max_value=6)),
        "max_num_batched_tokens": draw(st.integers(min_value=1, max_value=48)),
        "priority_policy": draw(st.booleans()),
        "long_prefill_token_threshold": draw(st.sampled_from([0, 0, 1, 3, 8, 20])),
    }
    cap = (num_blocks - 1) * bs  # what `SimEngine.fits` allows: prompt + output - 1 <= cap
    reqs = []
    for _ in range(draw(st.integers(min_value=1, max_value=8))):
        prompt = draw(st.integers(min_value=1, max_value=min(40, cap)))
        out = draw(st.integers(min_value=1, max_value=min(20, cap - prompt + 1)))
        group = draw(st.integers(min_value=0, max_value=2))
        shared = draw(st.integers(min_value=0, max_value=prompt // bs))
        step_no = draw(st.integers(min_value=0, max_value=10))
        prio = draw(st.integers(min_value=0, max_value=1))
        reqs.append([prompt, out, group, shared, step_no, prio])
    return cfg, reqs


@settings(max_examples=300, deadline=None)
@given(workloads())
def test_step_invariants_on_random_workloads(
    work: tuple[dict[str, int | bool], list[list[int]]],
) -> None:
    cfg, specs = work
    bs = int(cfg["block_size"])
    sched = make_scheduler(
        num_blocks=int(cfg["num_blocks"]),
        block_size=bs,
        max_num_seqs=int(cfg["max_num_seqs"]),
        max_num_batched_tokens=int(cfg["max_num_batched_tokens"]),
        priority_policy=bool(cfg["priority_policy"]),
    )
    threshold = int(cfg["long_prefill_token_threshold"])
    sched.long_prefill_token_threshold = threshold
    reqs = [
        make_request(
            prompt,
            out,
            uid=i,
            group=group,
            shared_blocks=shared,
            arrival_s=float(at),
            priority=prio,
            block_size=bs,
        )
        for i, (prompt, out, group, shared, at, prio) in enumerate(specs)
    ]
    admissions = {r.request_id: 0 for r in reqs}
    expected_queries = expected_preempted = 0
    with PoolGuard() as guard:
        guard.watch(sched)
        step_no = 0
        while step_no < 5000:
            for r in reqs:
                if r.arrival_s == step_no:
                    sched.waiting.add(r)
            if step_no > 10 and not sched.running and not len(sched.waiting):
                break
            waiting_before = {id(r): r.num_tokens for r in sched.waiting}
            preempted_before = {id(r) for r in sched.waiting if r.preemptions}
            running_before = list(sched.running)
            batch, _ = step(sched)
            step_no += 1
            assert batch.tokens == sum(n for _, n, _ in batch.scheduled)
            assert batch.tokens <= sched.max_num_batched_tokens
            assert len(sched.running) <= sched.max_num_seqs
            seen = [id(r) for r, _, _ in batch.scheduled]
            assert len(seen) == len(set(seen))
            if threshold:
                assert all(n <= threshold for _, n, _ in batch.scheduled)
            admitted = [r for r, _, _ in batch.scheduled if id(r) in waiting_before]
            if batch.preempted:
                assert not admitted, "admitted a waiting request in a step that preempted"
                assert all(r.num_computed == 0 and not len(r.blocks) for r in batch.preempted)
            # running ones come first in the batch, in running order
            order = [r for r, _, _ in batch.scheduled if r in running_before]
            assert [r for r, _, _ in batch.scheduled][: len(order)] == order
            for r in admitted:
                admissions[r.request_id] += 1
                if id(r) in preempted_before:
                    expected_preempted += waiting_before[id(r)]
                else:
                    expected_queries += waiting_before[id(r)]
            assert sched.prefix_queries == expected_queries
            assert sched.preempted_prefix_queries == expected_preempted
            assert sched.prefix_hits <= sched.prefix_queries
            check_scheduler(sched)
        assert step_no < 5000, "no progress"
    for r in reqs:
        assert r.status is Status.FINISHED
        assert r.num_output == r.max_output
        assert admissions[r.request_id] == r.preemptions + 1
        assert 0 <= r.cached_tokens <= ((r.prompt_tokens - 1) // bs) * bs
    assert sched.num_preemptions == sum(r.preemptions for r in reqs)


def test_priority_victim_tie_break() -> None:
    sched = make_scheduler(num_blocks=5, max_num_batched_tokens=64, priority_policy=True)
    first = make_request(4, max_output=10, uid=1, arrival_s=0.0)
    second = make_request(4, max_output=10, uid=2, arrival_s=0.0)
    sched.waiting.add(first)
    sched.waiting.add(second)
    step(sched)
    assert sched.running == [first, second]
    preempted = run_until_preemption(sched)
    # both are (0, 0.0): vLLM's max() keeps the first one it meets in running order
    assert preempted == [first]
