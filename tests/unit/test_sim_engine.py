"""SimEngine: outputs and times, and decode fast-forward against step-by-step execution."""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Iterator, Sequence

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sim_builders import (
    UNIQUE_FLOOR,
    DriveResult,
    FlatEvent,
    PoolGuard,
    check_kv_usage,
    check_scheduler,
    content_hashes,
    drive,
    make_engine,
    make_request,
    pool_state,
)

from controlplane.sim.engine import DecodeRun, SimEngine
from controlplane.sim.request import EngineRequest, Status

# Fast-forward prices a run of k decode steps with the trapezoid between the first and the last
# step time instead of summing the k step times. The roofline step time is the smooth max
# (mem^p + comp^p)^(1/p) of two quantities affine in the context sum, so consecutive decode
# steps are affine up to that curvature, which only matters where mem and comp are comparable
# (large decode batches). Measured worst relative difference of any first-token or finish time
# (llama-3.1-8b on H100, every discrete outcome and KV event identical):
#   - the random tiny workloads below (<= 8 requests, contexts < 130): 1.25e-11 over 3,000
#     Hypothesis examples (float summation order);
#   - 40 random mid-size workloads (<= 40 requests, prompts <= 8k, outputs <= 1k): 6.1e-9;
#   - 400 concurrent requests (batches of hundreds, prompts <= 3k, outputs <= 1.5k): 1.25e-7.
# Bounds: 1e-9 for the tiny workloads, 1e-6 for the large-batch one (8x the worst seen).
TIME_RTOL = 1e-9
TIME_RTOL_LARGE = 1e-6


@pytest.fixture
def guard() -> Iterator[PoolGuard]:
    with PoolGuard() as g:
        yield g


def rel_diff(a: float, b: float) -> float:
    if a == b:
        return 0.0
    return abs(a - b) / max(abs(a), abs(b))


# -- outputs and times -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "max_output", "budget", "steps"),
    [
        (10, 1, 32, 1),
        (10, 5, 32, 5),
        (40, 1, 32, 2),  # chunked: the first token comes with the second chunk
        (40, 4, 32, 5),
        (64, 3, 16, 6),
        (1, 8, 4, 8),
    ],
)
def test_single_request_outputs(
    guard: PoolGuard, prompt: int, max_output: int, budget: int, steps: int
) -> None:
    eng = make_engine(fast_forward=False, max_num_batched_tokens=budget, num_blocks=64)
    guard.watch(eng)
    req = make_request(prompt, max_output, uid=1, arrival_s=0.0)
    res = drive(eng, [(0.0, req)])
    prefill_steps = -(-prompt // budget)
    assert res.steps == steps == prefill_steps + max_output - 1
    assert req.status is Status.FINISHED
    assert req.num_output == max_output
    assert res.tokens_out == max_output
    # the first token arrives with the step that completes the prompt
    assert req.first_token_s == res.step_ends[prefill_steps - 1]
    assert req.finish_s == res.step_ends[-1]
    assert 0.0 < req.first_token_s <= req.finish_s
    assert all(b > a for a, b in zip(res.step_ends, res.step_ends[1:], strict=False))
    assert eng.busy_s == pytest.approx(res.end_s)
    assert eng.idle


def test_outputs_are_drained_once() -> None:
    eng = make_engine(fast_forward=False, num_blocks=32)
    a = make_request(6, 2, uid=1)
    b = make_request(6, 1, uid=2)
    eng.add_request(a, 0.0)
    eng.add_request(b, 0.0)
    end = eng.start(0.0)
    assert end is not None and end > 0.0
    assert not eng.idle and eng.busy_until == end
    eng.complete(end)
    first, done = eng.drain()
    assert first == [a, b] and done == [b]
    assert b.first_token_s == b.finish_s == end
    assert eng.drain() == ([], [])
    end2 = eng.start(end)
    assert end2 is not None
    eng.complete(end2)
    first, done = eng.drain()
    assert first == [] and done == [a]
    assert a.finish_s == end2 > a.first_token_s
    assert eng.start(end2) is None
    assert eng.idle


@pytest.mark.parametrize(
    ("prompt", "max_output", "max_model_len", "num_blocks", "fits"),
    [
        # KV holds prompt + output - 1 tokens (the last sampled token is never computed)
        (10, 6, 1024, 5, True),  # 15 tokens: 4 blocks of 4
        (10, 7, 1024, 5, True),  # 16 tokens: still 4 blocks
        (10, 8, 1024, 5, False),  # 17 tokens: 5 blocks, only 4 usable
        (12, 5, 1024, 5, True),
        (13, 5, 1024, 5, False),
        (10, 6, 16, 64, True),
        (10, 7, 16, 64, False),  # over max_model_len
    ],
)
def test_fits(
    prompt: int, max_output: int, max_model_len: int, num_blocks: int, fits: bool
) -> None:
    eng = make_engine(num_blocks=num_blocks, max_model_len=max_model_len)
    assert eng.fits(prompt, max_output) is fits


# -- fast-forward mechanics --------------------------------------------------------------------


@pytest.mark.parametrize("exact_events", [True, False])
def test_decode_run_is_one_event_with_stepwise_results(
    guard: PoolGuard, exact_events: bool
) -> None:
    results: list[DriveResult] = []
    for fast in (False, True):
        eng = make_engine(fast_forward=fast, num_blocks=64, exact_events=exact_events)
        guard.watch(eng)
        reqs = [make_request(8, 30, uid=1), make_request(12, 20, uid=2)]
        results.append(drive(eng, [(0.0, r) for r in reqs], snapshots=True))
    step, ff = results
    assert step.steps == ff.steps == 30
    assert len(step.step_ends) == 30
    # r1's prefill (r2 arrives at the same instant, once the step has started), r1's first
    # decode with r2's prefill, a run to r2's finish (19 steps), a run for the rest (9 steps)
    assert len(ff.step_ends) == 4
    if exact_events:
        assert ff.events == step.events
    else:
        # the runs' block operations are batched: same blocks and hashes, grouped per run
        assert ff.events != step.events
        assert_same_windows(step, ff)
    for rid, o in step.outcomes.items():
        f = ff.outcomes[rid]
        assert f.num_output == o.num_output
        assert rel_diff(f.finish_s, o.finish_s) <= TIME_RTOL
        assert f.first_token_s == o.first_token_s


def test_run_is_cut_by_an_arrival(guard: PoolGuard) -> None:
    eng = make_engine(fast_forward=True, num_blocks=64)
    guard.watch(eng)
    a = make_request(8, 50, uid=1)
    eng.add_request(a, 0.0)
    t1 = eng.start(0.0)
    assert t1 is not None
    eng.complete(t1)
    end = eng.start(t1)
    assert end is not None
    run = eng._run
    assert isinstance(run, DecodeRun) and run.steps == 49
    # an arrival in the middle of step 3 (of the run) cuts it after that step
    t = t1 + run.elapsed(2) + 0.5 * (run.elapsed(3) - run.elapsed(2))
    b = make_request(4, 2, uid=2)
    assert eng.add_request(b, t) is True
    assert run.steps == 3
    assert eng.busy_until == pytest.approx(t1 + run.elapsed(3), rel=1e-12)
    assert eng.busy_until is not None and eng.busy_until > t
    # an arrival in the last step of the (cut) run does not move its end
    c = make_request(4, 2, uid=3)
    assert eng.add_request(c, eng.busy_until - 1e-6) is False
    eng.complete(eng.busy_until)
    assert a.num_output == 4
    batch_end = eng.start(t1 + run.elapsed(3))
    assert batch_end is not None
    assert eng._step is not None
    assert {r.request_id for r, _, _ in eng._step.scheduled} == {"r1", "r2", "r3"}
    while not eng.idle:
        assert eng.busy_until is not None
        now = eng.busy_until
        eng.complete(now)
        eng.start(now)
    assert [r.num_output for r in (a, b, c)] == [50, 2, 2]


@pytest.mark.parametrize(
    ("steps", "x_steps", "expected"),
    [
        (10, 0.0, 1),
        (10, 0.5, 1),
        (10, 1.0, 1),  # exactly at the end of step 1: the arrival is seen after it
        (10, 1.0001, 2),
        (10, 6.5, 7),
        (10, 9.99, 10),
        (10, 25.0, 10),
        (1, 3.0, 1),
    ],
)
def test_steps_done_by(steps: int, x_steps: float, expected: int) -> None:
    run = DecodeRun(start_s=0.0, steps=steps, t_first=0.01, delta=1e-5, members=[])
    whole = int(x_steps)
    frac = x_steps - whole
    t = run.elapsed(whole) + frac * (run.elapsed(whole + 1) - run.elapsed(whole))
    assert run.steps_done_by(t) == expected


@pytest.mark.parametrize(
    ("max_num_seqs", "budget", "ff_events"),
    [
        # b prefills in 7-token chunks next to a's decodes: 1 + 5 single steps, then runs
        (8, 8, 1 + 5 + 2),
        # max_num_seqs=1: b waits without being blocked by KV, a runs to its end in one go
        (1, 64, 1 + 1 + 1 + 1),
    ],
)
@pytest.mark.parametrize("exact_events", [True, False])
def test_no_run_while_a_waiting_request_could_be_admitted(
    guard: PoolGuard, max_num_seqs: int, budget: int, ff_events: int, exact_events: bool
) -> None:
    results = []
    for fast in (False, True):
        eng = make_engine(
            fast_forward=fast,
            num_blocks=64,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            exact_events=exact_events,
        )
        guard.watch(eng)
        a = make_request(4, 20, uid=1)
        b = make_request(30, 3, uid=2)
        results.append(drive(eng, [(0.0, a), (0.0, b)], snapshots=True))
    step, ff = results
    assert len(ff.step_ends) == ff_events
    assert ff.steps == step.steps
    # every step up to b's first token is its own event in both modes
    k = step.step_ends.index(step.outcomes["r2"].first_token_s) + 1
    if max_num_seqs > 1:
        assert ff.step_ends[:k] == step.step_ends[:k]
    assert_equivalent(step, ff, exact_events=exact_events)


def test_prefix_cache_hits_through_the_engine(guard: PoolGuard) -> None:
    eng = make_engine(fast_forward=True, num_blocks=64)
    guard.watch(eng)
    a = make_request(20, 3, uid=1, group=1)
    b = make_request(20, 3, uid=2, group=1)
    c = make_request(22, 3, uid=3, group=1, shared_blocks=5)
    res = drive(eng, [(0.0, a), (0.05, b), (0.1, c)])
    assert (a.cached_tokens, b.cached_tokens, c.cached_tokens) == (0, 16, 20)
    assert res.prefix_hits == 36
    assert res.prefix_queries == 62
    assert res.preemptions == 0


# -- fast-forward == stepwise on random workloads ---------------------------------------------


@st.composite
def engine_workloads(
    draw: st.DrawFn,
) -> tuple[dict[str, int], bool, list[tuple[float, int, int, int, int, int]]]:
    bs = draw(st.sampled_from([1, 2, 4, 8]))
    num_blocks = draw(st.integers(min_value=3, max_value=40))
    knobs = {
        "block_size": bs,
        "num_blocks": num_blocks,
        "max_num_seqs": draw(st.integers(min_value=1, max_value=6)),
        "max_num_batched_tokens": draw(st.integers(min_value=2, max_value=64)),
    }
    priority = draw(st.booleans())
    cap = (num_blocks - 1) * bs
    reqs = []
    for _ in range(draw(st.integers(min_value=1, max_value=8))):
        prompt = draw(st.integers(min_value=1, max_value=min(60, cap)))
        out = draw(st.integers(min_value=1, max_value=min(60, cap - prompt + 1)))
        group = draw(st.integers(min_value=0, max_value=2))
        shared = draw(st.integers(min_value=0, max_value=prompt // bs))
        # arrivals spread over ~ a few dozen decode steps (a step is ~8 ms here)
        at = draw(st.floats(min_value=0.0, max_value=0.4, allow_nan=False))
        prio = draw(st.integers(min_value=0, max_value=1))
        reqs.append((at, prompt, out, group, shared, prio))
    return knobs, priority, reqs


def run_both(
    knobs: dict[str, int],
    priority: bool,
    specs: list[tuple[float, int, int, int, int, int]],
    *,
    exact_events: bool = True,
    snapshots: bool = True,
    probes: Sequence[float] = (),
) -> tuple[DriveResult, DriveResult]:
    """Fast-forward (with `exact_events`), then stepwise, over the same arrivals; returns
    (stepwise, fast-forward). With `snapshots`, pool states are recorded wherever the
    fast-forward engine's events were taken."""
    results: dict[bool, DriveResult] = {}
    for ff in (True, False):
        eng = make_engine(
            fast_forward=ff, priority_policy=priority, knobs=knobs, exact_events=exact_events
        )
        bs = knobs["block_size"]
        arrivals = []
        for i, (at, prompt, out, group, shared, prio) in enumerate(specs):
            assert eng.fits(prompt, out)
            req = make_request(
                prompt,
                out,
                uid=i,
                group=group,
                shared_blocks=shared,
                arrival_s=at,
                priority=prio,
                block_size=bs,
            )
            arrivals.append((at, req))
        at_steps: bool | set[int] = False
        if snapshots:
            at_steps = True if ff else {steps for steps, _ in results[True].marks}
        res = drive(eng, arrivals, snapshots=at_steps, probes=probes)
        if not res.stalled:
            with PoolGuard() as g:
                g.watch(eng)
        results[ff] = res
    return results[False], results[True]


def max_time_rel_diff(a: DriveResult, b: DriveResult) -> float:
    worst = 0.0
    for rid, o in a.outcomes.items():
        f = b.outcomes[rid]
        worst = max(worst, rel_diff(o.first_token_s, f.first_token_s))
        worst = max(worst, rel_diff(o.finish_s, f.finish_s))
    return worst


def chain_edges(events: Sequence[FlatEvent]) -> Counter[tuple[str, int, int | None]]:
    """The multiset of (stored, hash, the hash before it) and (removed, hash): what consumers
    of the events learn, whichever way consecutive stores of one request are grouped."""
    out: Counter[tuple[str, int, int | None]] = Counter()
    for kind, hashes, parent in events:
        prev = parent
        for h in hashes:
            out[kind, h, prev if kind == "stored" else None] += 1
            prev = h
        if kind == "cleared":
            out[kind, -1, None] += 1
    return out


def assert_same_windows(step: DriveResult, ff: DriveResult) -> None:
    """Cut both event streams where the fast-forward engine's were taken (after each run, each
    single step, each probe): every window holds the same multiset of stored and removed hashes,
    and the pools are in the same state at every cut (when snapshots were taken)."""
    ends_step = dict(step.marks)  # steps completed -> events so far, at the last such take
    ends_ff = dict(ff.marks)
    assert set(ends_ff) <= set(ends_step)
    prev_s = prev_f = 0
    for steps in sorted(ends_ff):
        s_end, f_end = ends_step[steps], ends_ff[steps]
        assert chain_edges(ff.events[prev_f:f_end]) == chain_edges(step.events[prev_s:s_end]), (
            f"events of the window ending after {steps} steps differ"
        )
        prev_s, prev_f = s_end, f_end
        if step.states or ff.states:
            assert ff.states[steps] == step.states[steps], f"pools differ after {steps} steps"
    assert (prev_s, prev_f) == (len(step.events), len(ff.events))
    assert chain_edges(ff.events) == chain_edges(step.events)
    assert ff.final_state == step.final_state


def assert_equivalent(
    step: DriveResult, ff: DriveResult, rtol: float = TIME_RTOL, *, exact_events: bool = True
) -> None:
    # a stall (see test_engine_keeps_stepping_after_a_step_that_only_preempted) must at least
    # happen identically in both modes
    assert ff.stalled == step.stalled
    for rid, o in step.outcomes.items():
        f = ff.outcomes[rid]
        assert f.num_output == o.num_output, rid
        assert f.preemptions == o.preemptions, rid
        assert f.cached_tokens == o.cached_tokens, rid
        if not step.stalled:
            assert f.finish_s >= 0.0 and o.finish_s >= 0.0
            assert 0.0 < o.first_token_s <= o.finish_s
    assert max_time_rel_diff(step, ff) <= rtol
    assert (ff.prefix_queries, ff.prefix_hits) == (step.prefix_queries, step.prefix_hits)
    assert ff.preemptions == step.preemptions
    assert ff.steps == step.steps
    assert ff.tokens_out == step.tokens_out
    if exact_events:
        assert ff.events == step.events
    assert_same_windows(step, ff)
    # routers probing the engine see the same KV usage and, after `sync`, the same pool
    assert ff.probes == step.probes


@settings(
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(engine_workloads())
def test_fast_forward_matches_stepwise(
    work: tuple[dict[str, int], bool, list[tuple[float, int, int, int, int, int]]],
) -> None:
    knobs, priority, specs = work
    step, ff = run_both(knobs, priority, specs)
    assert_equivalent(step, ff)


@settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(
    engine_workloads(),
    st.lists(st.floats(min_value=0.0, max_value=0.8, allow_nan=False), max_size=6),
)
def test_batched_run_events_match_stepwise(
    work: tuple[dict[str, int], bool, list[tuple[float, int, int, int, int, int]]],
    probes: list[float],
) -> None:
    """Default fast-forward (exact_events=False) batches a run's block operations: every
    window between event takes (runs, single steps, probes that sync mid-run) stores and removes
    the same multiset of hashes as stepwise, and the pools agree wherever they are observed."""
    knobs, priority, specs = work
    step, ff = run_both(knobs, priority, specs, exact_events=False, probes=probes)
    assert_equivalent(step, ff, exact_events=False)


@pytest.mark.parametrize("exact_events", [True, False])
def test_fast_forward_equivalence_under_kv_pressure_and_cuts(exact_events: bool) -> None:
    """A hand-picked workload that preempts, hits shared prefixes and cuts runs; probed (the
    engine synced mid-run) every few milliseconds."""
    knobs = {"block_size": 4, "num_blocks": 12, "max_num_seqs": 4, "max_num_batched_tokens": 16}
    specs = [
        (0.0, 8, 30, 1, 2, 0),
        (0.0, 12, 25, 1, 3, 0),
        (0.03, 6, 20, 2, 1, 0),
        (0.031, 9, 12, 1, 2, 0),
        (0.12, 16, 10, 2, 4, 0),
        (0.2, 3, 8, 0, 0, 0),
    ]
    step, ff = run_both(knobs, False, specs, exact_events=exact_events)
    assert step.preemptions > 0
    assert step.prefix_hits > 0
    assert ff.cuts > 0
    assert len(ff.step_ends) < len(step.step_ends)
    assert_equivalent(step, ff, exact_events=exact_events)
    probes = [0.0037 * i for i in range(1, 200)]
    step, probed = run_both(knobs, False, specs, exact_events=exact_events, probes=probes)
    assert_equivalent(step, probed, exact_events=exact_events)
    assert probed.outcomes == ff.outcomes  # observing the engine does not change it
    assert sum(1 for _, u, _ in probed.probes if 0.0 < u < 1.0) > 20


@pytest.mark.parametrize("exact_events", [True, False])
def test_fast_forward_equivalence_with_large_batches(exact_events: bool) -> None:
    """Hundreds of concurrent decodes: the regime where the trapezoid is least exact (and
    where batched runs allocate hundreds of blocks at once)."""
    rng = random.Random(0)
    knobs = {
        "block_size": 16,
        "num_blocks": 200_000,
        "max_num_seqs": 1024,
        "max_num_batched_tokens": 8192,
        "max_model_len": 20_000,
    }
    specs = []
    for _ in range(300):
        prompt = rng.randint(1, 3000)
        specs.append(
            (
                rng.uniform(0.0, 20.0),
                prompt,
                rng.randint(50, 1200),
                rng.randint(0, 3),
                rng.randint(0, prompt // 16),
                0,
            )
        )
    step, ff = run_both(knobs, False, specs, exact_events=exact_events, snapshots=False)
    assert ff.cuts > 0 and step.prefix_hits > 0
    assert len(ff.step_ends) * 3 < len(step.step_ends)
    assert_equivalent(step, ff, TIME_RTOL_LARGE, exact_events=exact_events)


# -- engine bugs -------------------------------------------------------------------------------


def test_fast_forward_admits_when_decode_fills_a_shared_block() -> None:
    # r1's ids describe 16 tokens (prompt 8 + 8 generated); r2's 16-token prompt is that content.
    hashes = content_hashes(1, 4)
    results = []
    for fast in (False, True):
        eng = make_engine(fast_forward=fast, num_blocks=5, max_num_batched_tokens=64)
        r1 = make_request(8, 9, uid=1, known_hashes=hashes)
        r2 = make_request(16, 1, uid=2, known_hashes=hashes)
        assert eng.fits(16, 1)
        results.append(drive(eng, [(0.0, r1), (0.012, r2)]))
    step, ff = results
    # stepwise: r2 is blocked (needs 2 new blocks, 1 free) until r1's decode fills block 2
    # (its 12th token); that step caches hash 2, r2 then hits 3 blocks, needs 1 and is admitted
    assert step.outcomes["r2"].first_token_s < step.outcomes["r1"].finish_s
    assert ff.outcomes["r2"].first_token_s == pytest.approx(step.outcomes["r2"].first_token_s)


def test_abort_during_a_decode_run() -> None:
    eng = make_engine(fast_forward=True, num_blocks=16, max_num_batched_tokens=64)
    a = make_request(8, 20, uid=1)
    b = make_request(8, 10, uid=2)
    eng.add_request(a, 0.0)
    eng.add_request(b, 0.0)
    t1 = eng.start(0.0)
    assert t1 is not None
    eng.complete(t1)
    end = eng.start(t1)
    assert end is not None and eng._run is not None
    eng.abort(b, t1 + 0.001)
    assert b.blocks.tolist() == []
    eng.complete(end)
    assert b.num_output == 1 and b.blocks.tolist() == []
    check_scheduler(eng.sched)
    _finish_all(eng)
    assert a.num_output == 20


def test_engine_keeps_stepping_after_a_step_that_only_preempted() -> None:
    eng = make_engine(
        fast_forward=False,
        priority_policy=True,
        block_size=1,
        num_blocks=6,
        max_num_seqs=2,
        max_num_batched_tokens=2,
    )
    low = make_request(1, 4, uid=0, priority=1, block_size=1)
    high = make_request(1, 3, uid=1, priority=0, block_size=1)
    res = drive(eng, [(0.0, low), (0.0, high)])
    # step 3: low (running first, worst priority) needs a block, none is free, so low preempts
    # itself and the loop breaks before high: the batch is empty and the engine stops
    assert low.preemptions == 1
    assert not res.stalled
    assert (low.num_output, high.num_output) == (4, 3)


def test_abort_between_steps_frees_blocks(guard: PoolGuard) -> None:
    eng = make_engine(fast_forward=False, num_blocks=16, max_num_batched_tokens=64)
    guard.watch(eng)
    a = make_request(8, 20, uid=1)
    b = make_request(8, 10, uid=2)
    w = make_request(8, 10, uid=3)
    eng.add_request(a, 0.0)
    eng.add_request(b, 0.0)
    t1 = eng.start(0.0)
    assert t1 is not None
    eng.abort(b, 0.001)  # mid-step: the step's outputs must skip it
    eng.complete(t1)
    assert b.num_output == 0 and b.status is Status.FINISHED and b.blocks.tolist() == []
    eng.add_request(w, t1)
    eng.abort(w, t1)  # still waiting
    assert w.status is Status.FINISHED
    assert eng.num_waiting == 0
    check_scheduler(eng.sched)
    _finish_all(eng, t1)
    assert a.num_output == 20


def _finish_all(eng: SimEngine, now: float = 0.0) -> None:
    end = eng.busy_until if not eng.idle else eng.start(now)
    while end is not None:
        eng.complete(end)
        now = end
        end = eng.start(now)


def test_engine_requests_hold_no_blocks_after_finishing(guard: PoolGuard) -> None:
    eng = make_engine(fast_forward=True, num_blocks=10, max_num_batched_tokens=8)
    guard.watch(eng)
    reqs: list[EngineRequest] = [make_request(4 + i, 6, uid=i, group=i % 2) for i in range(6)]
    drive(eng, [(0.001 * i, r) for i, r in enumerate(reqs)])
    for r in reqs:
        assert r.blocks.tolist() == [] and r.status is Status.FINISHED


# -- unique block ids ------------------------------------------------------------------------


def test_add_request_numbers_unique_blocks_above_the_floor() -> None:
    eng = make_engine(num_blocks=64, block_size=4)
    a = make_request(10, 7, known_hashes=content_hashes(1, 2))  # 5 blocks, 2 known: 3 ids
    b = make_request(3, 1)  # 1 block, none known: 1 id
    c = make_request(8, 1, known_hashes=content_hashes(2, 2))  # 3 blocks, 2 known: 1 id
    d = make_request(12, 1, known_hashes=content_hashes(3, 3))  # 4 blocks, 3 known: 1 id
    e = make_request(8, 1, known_hashes=content_hashes(4, 2))  # 3 blocks, 2 known: 1 id
    assert a.unique_base == -1  # numbered when queued
    assert isinstance(a.known_hashes, np.ndarray) and a.known_hashes.dtype == np.int64
    for r in (a, b, c, d):
        eng.add_request(r, 0.0)
    assert [r.unique_base for r in (a, b, c, d)] == [
        UNIQUE_FLOOR,
        UNIQUE_FLOOR + 3,
        UNIQUE_FLOOR + 4,
        UNIQUE_FLOOR + 5,
    ]
    eng.reserve_ids(UNIQUE_FLOOR + 1000)
    eng.reserve_ids(UNIQUE_FLOOR)  # never lowers the counter
    eng.add_request(e, 0.0)
    assert e.unique_base == UNIQUE_FLOOR + 1000
    preset = make_request(4, 1)
    preset.unique_base = 77_000
    eng.add_request(preset, 0.0)
    assert preset.unique_base == 77_000
    # the default floor is above every id a trace of a few million blocks uses
    default = SimEngine(eng.profile)
    f = make_request(4, 1)
    default.add_request(f, 0.0)
    assert f.unique_base == 1 << 20


def test_block_hash_ids() -> None:
    req = make_request(10, 7, known_hashes=[5, 6])
    req.unique_base = 1000
    assert [req.block_hash(i) for i in range(5)] == [5, 6, 1000, 1001, 1002]
    for start in range(5):
        for stop in range(start, 6):
            got = req.block_hashes(start, stop)
            assert isinstance(got, np.ndarray) and got.dtype == np.int64
            assert got.tolist() == [req.block_hash(i) for i in range(start, stop)]
    # lookups cover the full blocks of prompt + output so far
    assert req.lookup_hashes(4).tolist() == [5, 6]
    req.num_output = 2  # 12 tokens: 3 full blocks
    assert req.lookup_hashes(4).tolist() == [5, 6, 1000]
    none = make_request(3, 1)
    assert none.known_hashes.tolist() == [] and none.known_hashes.dtype == np.int64


def test_engine_stores_each_request_under_its_own_ids() -> None:
    eng = make_engine(num_blocks=64, max_num_batched_tokens=64)
    reqs = [
        make_request(9, 12, uid=1, group=1),
        make_request(9, 12, uid=2, group=1),
        make_request(6, 9, uid=3),
        make_request(13, 5, uid=4, group=2, shared_blocks=1),
    ]
    res = drive(eng, [(0.001 * i, r) for i, r in enumerate(reqs)])
    stored = [h for kind, hashes, _ in res.events if kind == "stored" for h in hashes]
    shared = {h for r in reqs for h in r.known_hashes.tolist()}
    ranges = []
    for r in reqs:
        blocks = -(-(r.prompt_tokens + r.max_output) // 4)
        ranges.append(range(r.unique_base, r.unique_base + max(1, blocks - len(r.known_hashes))))
    assert all(a.stop <= b.start for a, b in itertools.pairwise(ranges))
    assert ranges[0].start == UNIQUE_FLOOR
    for h in stored:
        assert h in shared or any(h in rng for rng in ranges), h
    # every block a request filled was stored exactly once under its own id
    unique = [h for h in stored if h >= UNIQUE_FLOOR]
    assert len(unique) == len(set(unique))
    for r, rng in zip(reqs, ranges, strict=True):
        filled = (r.prompt_tokens + r.max_output - 1) // 4  # the last token is never computed
        assert sorted(h for h in unique if h in rng) == list(
            range(r.unique_base, r.unique_base + filled - len(r.known_hashes))
        )


# -- kv_usage and sync inside runs ------------------------------------------------------------


def _advance(eng: SimEngine, t: float) -> None:
    """Complete every step (or run) that ends by `t`, starting the next one."""
    while eng.busy_until is not None and eng.busy_until <= t:
        now = eng.busy_until
        eng.complete(now)
        eng.drain()
        eng.start(now)


@pytest.mark.parametrize("exact_events", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_kv_usage_matches_the_synced_pool_inside_runs(seed: int, exact_events: bool) -> None:
    """At many times inside decode runs: `kv_usage(now)` is what the pool holds once
    `sync(now)` replayed the run so far, and equals the stepwise engine's usage then; after
    `sync` the pool and every request are exactly as stepwise execution has them."""
    rng = random.Random(seed)
    knobs = {"block_size": rng.choice([1, 2, 4]), "num_blocks": 90, "max_num_batched_tokens": 64}
    specs = [
        (rng.randint(1, 20), rng.randint(20, 80), rng.randint(0, 2), rng.uniform(0.0, 0.3))
        for _ in range(rng.randint(2, 6))
    ]
    engines, requests = [], []
    for fast in (True, False):
        eng = make_engine(fast_forward=fast, exact_events=exact_events, knobs=knobs)
        reqs = [
            make_request(p, o, uid=i, group=g, arrival_s=at, block_size=knobs["block_size"])
            for i, (p, o, g, at) in enumerate(specs)
        ]
        assert all(eng.fits(r.prompt_tokens, r.max_output) for r in reqs)
        engines.append(eng)
        requests.append(reqs)
    ff, step = engines
    pending = sorted(range(len(specs)), key=lambda i: specs[i][3])
    t = 0.0
    inside = synced = 0
    while pending or not (ff.idle and step.idle):
        t += rng.uniform(0.0, 0.02)
        while pending and specs[pending[0]][3] <= t:
            i = pending.pop(0)
            at = specs[i][3]
            for eng, reqs in zip(engines, requests, strict=True):
                _advance(eng, at)
                eng.add_request(reqs[i], at)  # a cut run ends at the step in progress
                if eng.idle:
                    eng.start(at)
        for eng in engines:
            _advance(eng, t)
        usage = ff.kv_usage(t)
        assert usage == step.kv_usage(t)
        inside += ff.in_run
        if rng.random() < 0.4:
            assert check_kv_usage(ff, t) == usage
            synced += ff.in_run
            assert pool_state(ff.pool) == pool_state(step.pool)
            for a, b in zip(*requests, strict=True):
                assert (a.num_output, a.num_computed, a.blocks.tolist()) == (
                    b.num_output,
                    b.num_computed,
                    b.blocks.tolist(),
                )
        ff.take_events()
        step.take_events()
    assert inside > 30 and synced > 10
    assert pool_state(ff.pool) == pool_state(step.pool)
    for a, b in zip(*requests, strict=True):
        assert a.num_output == b.num_output == a.max_output


def test_run_caches_shared_when_a_member_fills_known_content() -> None:
    """A run caches blocks others can hit when a member's known content reaches past what it
    has cached (session turns whose ids cover their output); generated text is unique."""
    for covers_output, expected in ((False, False), (True, True)):
        eng = make_engine(num_blocks=64, max_num_batched_tokens=64)
        assert not eng.run_caches_shared  # no run
        known = content_hashes(1, 6 if covers_output else 2)  # 8-token prompt: 2 full blocks
        req = make_request(8, 30, known_hashes=known)
        eng.add_request(req, 0.0)
        end = eng.start(0.0)
        assert end is not None and not eng.in_run  # the prefill step
        eng.complete(end)
        end = eng.start(end)
        assert end is not None and eng.in_run
        assert eng.run_caches_shared is expected
        # once the run has filled every known block, nothing shared is left to cache
        t = end - 1e-9
        eng.sync(t)
        assert req.num_cached_blocks >= len(known)
        assert not eng.run_caches_shared
        eng.complete(end)
        _finish_all(eng, end)
        assert req.num_output == 30
