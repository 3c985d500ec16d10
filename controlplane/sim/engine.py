"""A simulated vLLM engine: the scheduler, the block pool, and roofline step times.

The engine runs back-to-back steps while it has work, like vLLM's busy loop: `start(now)` schedules
a step and returns when it ends; `complete(now)` applies its outputs (a token for every request
whose `num_computed` reached `num_tokens`, finishing those at their `max_output`).

Decode fast-forward. When every running request is decoding, nothing can be admitted, and every
sequence stays alive, the next steps are identical in shape: n decodes whose contexts grow by one
token each. The engine then plans a *run* of k steps in one event:

    k      = min over running of remaining output tokens      (the step where the first finishes)
    k_kv   = largest e with sum_i [ceil((c_i + e) / B) - ceil(c_i / B)] <= free blocks
    t_s    = step_time(n decodes, contexts sum S_0 + s * n)       for s = 0 .. k - 1
    length = sum_s t_s  (trapezoid between t_0 and t_{k-1}: step time is affine in s up to the
             smooth roofline's curvature, < 0.1% here)

Block allocations and `BlockStored` events of the skipped steps are replayed in step order when the
run ends, so the pool ends in exactly the state stepwise execution would leave. An arrival during
a run cuts it at the end of the step in progress (`interrupt`), where vLLM would first see it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from controlplane.roofline.profile import EngineProfile
from controlplane.roofline.step import StepCostModel
from controlplane.sim.block_pool import BlockPool
from controlplane.sim.kv_events import KVEvent
from controlplane.sim.request import EngineRequest, Status
from controlplane.sim.scheduler import Scheduler, StepBatch


@dataclass(slots=True)
class DecodeRun:
    """`steps` identical-shape decode steps from `start_s` (step 0 is already scheduled)."""

    start_s: float
    steps: int
    t_first: float
    # per-step increase of the step time (contexts grow by one token per sequence per step)
    delta: float
    # running requests and their num_computed after step 0 was scheduled
    members: list[tuple[EngineRequest, int]]
    # skipped steps 1..applied already scheduled (block operations replayed, and the outputs of
    # steps 0..applied-1 applied) by `sync`
    applied: int = 0

    def elapsed(self, steps: int) -> float:
        """Time for the first `steps` steps (trapezoid over per-step times)."""
        return steps * self.t_first + self.delta * steps * (steps - 1) / 2

    def steps_ended_by(self, t: float) -> int:
        """Steps whose end is at or before `t`."""
        x = t - self.start_s
        if x < self.t_first:
            return 0
        done = min(self.steps, self.steps_done_by(t))
        while done > 0 and self.elapsed(done) > x:
            done -= 1
        return done

    def steps_done_by(self, t: float) -> int:
        """Steps finished once the step in progress at time `t` completes (at least 1)."""
        x = t - self.start_s
        if x <= 0 or self.steps <= 1:
            return 1
        a, b = self.delta / 2, self.t_first - self.delta / 2
        j = x / b if abs(a) < 1e-18 else (-b + math.sqrt(max(0.0, b * b + 4 * a * x))) / (2 * a)
        steps = max(1, math.ceil(j - 1e-12))
        while steps > 1 and self.elapsed(steps - 1) >= x:
            steps -= 1
        while steps < self.steps and self.elapsed(steps) < x:
            steps += 1
        return min(self.steps, steps)


def _step_from(first: int, s0: int, bs: int) -> int:
    """The first step >= `first` of the steps s0, s0 + bs, s0 + 2 bs, ..."""
    return s0 if first <= s0 else s0 + -(-(first - s0) // bs) * bs


class SimEngine:
    """One replica's engine. Not thread-safe; driven by a discrete-event loop or a real clock."""

    def __init__(
        self,
        profile: EngineProfile,
        *,
        events_enabled: bool = False,
        priority_policy: bool = False,
        fast_forward: bool = True,
        num_gpu_blocks: int | None = None,
        unique_id_floor: int = 1 << 20,
        exact_events: bool = False,
    ) -> None:
        self.profile = profile
        self.cost = StepCostModel.from_profile(profile)
        self.block_size = profile.resolved_block_size
        blocks = num_gpu_blocks if num_gpu_blocks is not None else profile.num_gpu_blocks
        self.pool = BlockPool(
            blocks,
            self.block_size,
            enable_caching=profile.enable_prefix_caching,
            events_enabled=events_enabled,
        )
        self.sched = Scheduler(
            self.pool,
            max_num_seqs=profile.resolved_max_num_seqs,
            max_num_batched_tokens=profile.resolved_max_num_batched_tokens,
            max_model_len=profile.resolved_max_model_len,
            priority_policy=priority_policy,
            long_prefill_token_threshold=profile.long_prefill_token_threshold,
        )
        self.fast_forward = fast_forward
        # replay a run's skipped steps op by op, so KV events interleave exactly as stepwise;
        # otherwise allocations are batched (same pool state, events grouped per run segment)
        self.exact_events = exact_events
        # hash ids for content only one request has start here (above every shared id)
        self._next_unique = unique_id_floor
        self.busy_until: float | None = None
        self._started_s = 0.0
        self._step: StepBatch | None = None
        self._run: DecodeRun | None = None
        # outputs since the last drain
        self.first_tokens: list[EngineRequest] = []
        self.finished: list[EngineRequest] = []
        self.steps = 0
        self.busy_s = 0.0
        self.tokens_out = 0

    # -- admission ---------------------------------------------------------------------------
    def fits(self, prompt_tokens: int, max_output: int) -> bool:
        """Whether a request could ever run here (context and KV capacity)."""
        total = prompt_tokens + max_output
        if total > self.profile.resolved_max_model_len:
            return False
        return -(-(total - 1) // self.block_size) <= self.pool.num_blocks - 1

    def reserve_ids(self, floor: int) -> None:
        """Hash ids below `floor` belong to shared content; unique ids are assigned above it."""
        self._next_unique = max(self._next_unique, floor)
        self.pool.reserve_ids(self._next_unique + (1 << 16))

    def add_request(self, req: EngineRequest, now: float) -> bool:
        """Queue a request. Returns True when the pending step end moved (a run was cut)."""
        if req.unique_base < 0:
            blocks = -(-(req.prompt_tokens + req.max_output) // self.block_size)
            req.unique_base = self._next_unique
            self._next_unique += max(1, blocks - req.num_known)
        self.sched.waiting.add(req)
        return self._cut(now)

    def _cut(self, now: float) -> bool:
        """End a decode run at the step in progress at `now`, where vLLM would reschedule."""
        run = self._run
        if run is not None and self.busy_until is not None and now < self.busy_until:
            done = max(run.applied + 1, run.steps_done_by(now))
            if done < run.steps:
                run.steps = done
                self.busy_until = run.start_s + run.elapsed(done)
                return True
        return False

    def kv_usage(self, now: float) -> float:
        """KV usage (vllm:kv_cache_usage_perc) at `now`, counting a run's allocations by then."""
        run = self._run
        used = self.pool.num_blocks - 1 - self.pool.num_free
        if run is not None:
            ended = min(run.steps - 1, run.steps_ended_by(now))
            if ended > run.applied:
                used += self._allocations(run, run.applied + 1, ended)
        return used / (self.pool.num_blocks - 1)

    @property
    def run_caches_shared(self) -> bool:
        """The run in progress will cache blocks other requests can hit (session content)."""
        run = self._run
        return run is not None and any(
            req.num_known > req.num_cached_blocks for req, _ in run.members
        )

    def _allocations(self, run: DecodeRun, first: int, last: int) -> int:
        """Blocks the run's skipped steps first..last allocate."""
        bs = self.block_size
        total = 0
        for _req, c in run.members:
            a0 = (-c) % bs + 1
            if first > a0:
                a0 += -(-(first - a0) // bs) * bs
            if a0 <= last:
                total += (last - a0) // bs + 1
        return total

    def sync(self, now: float) -> None:
        """Bring a decode run's state up to `now`: the block operations, KV events and outputs
        of every step scheduled by then, exactly as stepwise execution would have them. Callers
        that observe the engine (index lookups, metrics scrapes) sync first."""
        run = self._run
        if run is None:
            return
        ended = min(run.steps - 1, run.steps_ended_by(now))
        if ended <= run.applied:
            return
        self._advance_run(run, ended)

    @property
    def idle(self) -> bool:
        return self.busy_until is None

    @property
    def in_run(self) -> bool:
        """A fast-forwarded decode run is in progress (state may need `sync`)."""
        return self._run is not None

    @property
    def num_running(self) -> int:
        return len(self.sched.running)

    @property
    def num_waiting(self) -> int:
        return len(self.sched.waiting)

    # -- the step loop ---------------------------------------------------------------------------
    def start(self, now: float) -> float | None:
        """Schedule the next step (or run) at `now`; returns its end time, None when idle."""
        batch = self.sched.schedule()
        while not batch.scheduled and batch.preempted:
            # the request being scheduled preempted itself (priority policy) and nothing else
            # was scheduled: vLLM's busy loop simply schedules again
            batch = self.sched.schedule()
        if not batch.scheduled:
            self.busy_until = None
            self._step = None
            self._run = None
            return None
        self._step = batch
        dt = self.cost.step_time(batch.tokens, batch.kv_read, batch.pairs, batch.samples)
        run = self._plan_run(batch, dt, now) if self.fast_forward else None
        self._run = run
        end = now + (run.elapsed(run.steps) if run is not None else dt)
        self._started_s = now
        self.busy_until = end
        return end

    def complete(self, now: float) -> None:
        """Apply the outputs of the step (or run) that ends at `now`."""
        batch, run = self._step, self._run
        if batch is None:
            return
        self._step = None
        self._run = None
        self.busy_until = None
        self.busy_s += now - self._started_s
        if run is not None:
            self._finish_run(run, now)
            return
        self.steps += 1
        running = Status.RUNNING
        produced = 0
        for req, _n, _c in batch.scheduled:
            out = req.num_output
            # a token for every running request whose computed tokens reached num_tokens
            if req.status is not running or req.num_computed < req.prompt_tokens + out:
                continue
            out += 1
            req.num_output = out
            produced += 1
            if out == 1:
                req.first_token_s = now
                self.first_tokens.append(req)
            if out >= req.max_output:
                self._finish(req, now)
        self.tokens_out += produced

    def take_events(self) -> list[KVEvent]:
        return self.pool.take_events()

    def drain(self) -> tuple[list[EngineRequest], list[EngineRequest]]:
        first, done = self.first_tokens, self.finished
        self.first_tokens, self.finished = [], []
        return first, done

    def abort(self, req: EngineRequest, now: float) -> bool:
        """Drop a request (client went away): free its blocks, never emit another token.
        Returns True when the pending step end moved (a decode run was cut)."""
        moved = False
        run = self._run
        if run is not None and any(r is req for r, _ in run.members):
            self.sync(now)
            moved = self._cut(now)
            run.members = [(r, c) for r, c in run.members if r is not req]
        if req.status is Status.RUNNING:
            self.sched.running.remove(req)
            self.sched.free(req)
        elif req.status in (Status.WAITING, Status.PREEMPTED):
            self.sched.waiting.remove(req)
        req.status = Status.FINISHED
        req.finish_s = now
        return moved

    # -- internals -------------------------------------------------------------------------------
    def _finish(self, req: EngineRequest, now: float) -> None:
        req.status = Status.FINISHED
        req.finish_s = now
        self.sched.running.remove(req)
        self.sched.free(req)
        self.finished.append(req)

    def _plan_run(self, batch: StepBatch, dt: float, now: float) -> DecodeRun | None:
        sched = self.sched
        running = sched.running
        n = len(running)
        if batch.preempted or len(batch.scheduled) != n or n == 0:
            return None
        if batch.tokens != n:  # some request computes more than one token: a prefill chunk
            return None
        if len(sched.waiting) and not batch.admission_blocked and n < sched.max_num_seqs:
            return None
        if n > sched.max_num_batched_tokens:
            return None
        k = 1 << 30
        members: list[tuple[EngineRequest, int]] = []
        context_sum = 0
        bs = self.block_size
        slack = [0] * bs  # slack[r]: members with r free token slots in their last block
        # a waiting head blocked on KV could hit a block whose content other requests share
        # (sessions whose content ids cover generated text) and fit: the step that fills one is
        # scheduled normally, with admission; `shared` bounds the skipped steps before it
        shared = 1 << 30 if batch.admission_blocked else -1
        for req, num_new, c in batch.scheduled:
            computed = req.num_computed
            if num_new != 1 or req.num_output == 0 or computed != req.num_tokens:
                return None
            rem = req.max_output - req.num_output
            if rem <= 1:  # it finishes at the next step: no run (checked as found)
                return None
            if rem < k:
                k = rem
            if shared >= 0:
                s = (bs - 1 - computed) % bs + 1  # the first skipped step that fills a block
                if s < shared + 1 and (computed + s) // bs - 1 < req.num_known:
                    if s == 1:
                        return None
                    shared = s - 1
            members.append((req, computed))
            slack[-computed % bs] += 1
            context_sum += c
        extra = self._kv_limited_extra_steps(slack, k - 1)
        if shared >= 0:
            extra = min(extra, shared)
        if extra <= 0:
            return None
        steps = extra + 1
        t_last = self.cost.decode_step_time(n, context_sum + (steps - 1) * n)
        delta = (t_last - dt) / (steps - 1)
        return DecodeRun(start_s=now, steps=steps, t_first=dt, delta=delta, members=members)

    def _kv_limited_extra_steps(self, slack: list[int], upper: int) -> int:
        """Largest e <= upper such that e more decode steps need no more than the free blocks.

        A sequence with r free slots in its last block needs ceil((e - r) / B) new blocks for e
        more tokens (none while e <= r), so the need is a sum over the B slack counts."""
        free = self.pool.num_free
        bs = self.block_size

        def need(e: int) -> int:
            return sum(count * -((r - e) // bs) for r, count in enumerate(slack) if count)

        if need(upper) <= free:
            return upper
        lo, hi = 0, upper  # need(lo) <= free < need(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if need(mid) <= free:
                lo = mid
            else:
                hi = mid
        return lo

    def _advance_run(self, run: DecodeRun, upto: int) -> None:
        """Schedule skipped steps applied+1..upto and apply the outputs of steps before them."""
        first = run.applied + 1
        if upto >= first:
            self._replay_block_ops(run.members, first, upto)
        gained = upto - run.applied
        for req, c in run.members:
            req.num_computed = c + upto
            req.num_output += gained
        self.tokens_out += gained * len(run.members)
        self.steps += gained
        run.applied = upto

    def _finish_run(self, run: DecodeRun, now: float) -> None:
        self._advance_run(run, run.steps - 1)
        # the last step's outputs
        for req, _ in run.members:
            req.num_output += 1
        self.tokens_out += len(run.members)
        self.steps += 1
        for req, _ in run.members:
            if req.num_output >= req.max_output:
                self._finish(req, now)

    def _replay_block_ops(
        self, members: list[tuple[EngineRequest, int]], first: int, last: int
    ) -> None:
        """Allocate and cache the blocks of skipped decode steps first..last, in vLLM's order.

        Step s (1-based) computes position c + s - 1: it allocates a block when that position
        starts one, and caches a block when position c + s completes one. Member i allocates at
        steps a_i, a_i + B, ... with first <= a_i < first + B, so the allocations go round by
        round (round r: steps first + rB .. first + rB + B - 1), each round in (a_i, i) order;
        members with a smaller a_i may take one more round than the others."""
        bs = self.block_size
        if self.exact_events:
            self._replay_exact(members, first, last)
            return
        starts: list[tuple[int, int]] = []  # (a_i, member index) of members that allocate
        for idx, (_req, c) in enumerate(members):
            a0 = _step_from(first, (-c) % bs + 1, bs)  # (c + s - 1) % bs == 0: allocates
            if a0 <= last:
                starts.append((a0, idx))
        pool = self.pool
        if starts:
            starts.sort()
            m = len(starts)
            rounds = (last - starts[-1][0]) // bs + 1  # rounds every member takes part in
            extra = sum(1 for a0, _ in starts if (last - a0) // bs >= rounds)
            full = rounds * m
            popped = pool.allocate(full + extra)
            for p, (_a0, idx) in enumerate(starts):
                req = members[idx][0]
                req.add_blocks(popped[p:full:m])
                if p < extra:
                    req.add_block(int(popped[full + p]))
        if pool.enable_caching:
            cache_full = self.sched.cache_full
            for req, c in members:
                full = (c + last) // bs
                if full > req.num_cached_blocks:  # most members filled no block since
                    cache_full(req, full)

    def _replay_exact(
        self, members: list[tuple[EngineRequest, int]], first: int, last: int
    ) -> None:
        """Replay op by op: every allocation and caching of steps first..last in step order."""
        bs = self.block_size
        ops: list[tuple[int, int, int]] = []  # (step, member index, 0: allocate / 1: cache)
        for idx, (_req, c) in enumerate(members):
            a0 = _step_from(first, (-c) % bs + 1, bs)  # (c + s - 1) % bs == 0: allocates
            ops.extend((s, idx, 0) for s in range(a0, last + 1, bs))
            f0 = _step_from(first, (bs - 1 - c) % bs + 1, bs)  # (c + s) % bs == 0: caches
            ops.extend((s, idx, 1) for s in range(f0, last + 1, bs))
        ops.sort()
        pool = self.pool
        for s, idx, kind in ops:
            req, c = members[idx]
            if kind == 0:
                req.add_block(pool.allocate_few(1)[0])
            elif pool.enable_caching:
                self.sched.cache_full(req, (c + s) // bs)
