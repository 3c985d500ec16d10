"""One scheduling decision of vLLM v1's scheduler (`vllm/v1/core/sched/scheduler.py`).

There are no prefill and decode phases, only "num_computed catches up with num_tokens" under a
token budget (`max_num_batched_tokens`). Each step:

1. Running requests, in order: schedule `min(num_tokens - num_computed, budget)` new tokens
   (first capped at `long_prefill_token_threshold`, below). If
   their KV slots cannot be allocated, preempt the last running request (FCFS) or the one with
   the worst (priority, arrival) (priority policy), by recompute: free its blocks, reset
   `num_computed` to 0, put it back in front of the waiting queue. Retry until it fits or the
   request preempted itself.
2. Waiting requests, only if nothing was preempted this step and fewer than `max_num_seqs` run:
   look up the longest cached prefix (at most `(num_tokens - 1) // block_size` blocks: the last
   token is always recomputed to get logits), allocate slots for the rest of the chunk (capped
   the same way, then by the budget), admit. Stop at the first request that cannot be allocated.

`long_prefill_token_threshold` (vLLM's `SchedulerConfig` field, `--long-prefill-token-threshold`):
for running (partially prefilled) and waiting requests alike, vLLM does
`if 0 < threshold < num_new_tokens: num_new_tokens = threshold` before clamping to the budget, so a
long prompt advances at most `threshold` tokens a step even when the budget has room, and the
steps it shares with other requests' prefills and decodes stay short. Decodes (1 token) and
prompts no longer than the threshold are untouched. 0 turns it off; that is vLLM's default while
`max_num_partial_prefills` is 1 (with more partial prefills vLLM defaults it to 4% of
`max_model_len`, a mode this simulator does not model). It is a per-replica knob
(`EngineProfile.long_prefill_token_threshold`).

Blocks are hashed and published as soon as they are scheduled (`cache_blocks` inside
`allocate_slots`), so a request admitted later in the same step already hits them. Prefix-cache
stats (`vllm:prefix_cache_queries`/`hits`) are recorded at admission; a preempted request's
re-admission goes to separate counters that vLLM does not export.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from controlplane.sim.block_pool import BlockPool, Blocks
from controlplane.sim.request import EngineRequest, Status


class WaitingQueue:
    """FCFS: a deque; preempted requests go back to the front."""

    def __init__(self) -> None:
        self._q: deque[EngineRequest] = deque()

    def add(self, req: EngineRequest) -> None:
        self._q.append(req)

    def prepend(self, req: EngineRequest) -> None:
        self._q.appendleft(req)

    def peek(self) -> EngineRequest:
        return self._q[0]

    def pop(self) -> EngineRequest:
        return self._q.popleft()

    def remove(self, req: EngineRequest) -> None:
        self._q.remove(req)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._q)


class PriorityWaitingQueue(WaitingQueue):
    """Priority policy: a heap on (priority, arrival, sequence); preempted ones re-enter by key."""

    def __init__(self) -> None:
        super().__init__()
        self._h: list[tuple[tuple[int, float, int], EngineRequest]] = []

    def add(self, req: EngineRequest) -> None:
        heapq.heappush(self._h, (req.queue_key, req))

    prepend = add

    def peek(self) -> EngineRequest:
        return self._h[0][1]

    def pop(self) -> EngineRequest:
        return heapq.heappop(self._h)[1]

    def remove(self, req: EngineRequest) -> None:
        self._h = [(k, r) for k, r in self._h if r is not req]
        heapq.heapify(self._h)

    def __len__(self) -> int:
        return len(self._h)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(r for _, r in sorted(self._h))


@dataclass(slots=True)
class StepBatch:
    """What one step computes, and the batch totals the roofline needs."""

    # (request, tokens scheduled, num_computed before the step)
    scheduled: list[tuple[EngineRequest, int, int]] = field(default_factory=list)
    preempted: list[EngineRequest] = field(default_factory=list)
    tokens: int = 0
    kv_read: int = 0
    pairs: float = 0.0
    samples: int = 0
    # True when the head of the waiting queue could not get KV slots
    admission_blocked: bool = False


class Scheduler:
    """Running/waiting queues and the KV cache manager around one `BlockPool`."""

    def __init__(
        self,
        pool: BlockPool,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        priority_policy: bool = False,
        long_prefill_token_threshold: int = 0,
    ) -> None:
        if long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0 (0: off)")
        self.pool = pool
        self.block_size = pool.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.priority_policy = priority_policy
        # vLLM's long_prefill_token_threshold: cap on one request's new tokens per step (0: off)
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.running: list[EngineRequest] = []
        self.waiting: WaitingQueue = PriorityWaitingQueue() if priority_policy else WaitingQueue()
        # vllm:prefix_cache_queries / vllm:prefix_cache_hits (tokens), vllm:num_preemptions;
        # a preempted request's re-admission is counted apart and not exported, as in vLLM's
        # PrefixCacheStats.record(preempted=...)
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.preempted_prefix_queries = 0
        self.preempted_prefix_hits = 0
        self.num_preemptions = 0

    # -- KV cache manager ----------------------------------------------------------------------
    def _allocate_slots(
        self, req: EngineRequest, num_new: int, hit_blocks: Blocks | None = None
    ) -> bool:
        pool, bs = self.pool, self.block_size
        num_hit = 0 if hit_blocks is None else len(hit_blocks)
        computed = req.num_computed + num_hit * bs
        need_tokens = min(computed + num_new, self.max_model_len)
        new_blocks = -(-need_tokens // bs) - num_hit - req.num_blocks
        if num_hit:
            assert hit_blocks is not None
            if new_blocks + pool.evictable_among(hit_blocks) > pool.num_free:
                return False
            pool.touch(hit_blocks)
            req.add_blocks(hit_blocks)
            req.num_cached_blocks = req.num_blocks
        if new_blocks > 0:
            if new_blocks > pool.num_free:
                return False
            req.add_blocks(pool.allocate(new_blocks))
        if pool.enable_caching:
            full = min(computed + num_new, req.num_tokens) // bs
            if full > req.num_cached_blocks:
                self.cache_full(req, full)
        return True

    def cache_full(self, req: EngineRequest, full: int) -> None:
        """Cache the request's blocks up to `full` (those filled since it last cached)."""
        start = req.num_cached_blocks
        if full > start:
            pool = self.pool
            # the parent hash only goes into the KV event
            parent = req.block_hash(start - 1) if start and pool.events_enabled else None
            if full == start + 1:  # a decode step filled one block
                pool.cache_few([int(req.block_buf[start])], [req.block_hash(start)], parent)
            elif full - start <= 8:  # a few blocks: plain lists
                hashes = [req.block_hash(i) for i in range(start, full)]
                pool.cache_few(req.block_buf[start:full].tolist(), hashes, parent)
            else:
                pool.cache(req.block_buf[start:full], req.block_hashes(start, full), parent)
            req.num_cached_blocks = full

    def free(self, req: EngineRequest) -> None:
        self.pool.free(req.blocks[::-1])
        req.drop_blocks()

    def _preempt(self, req: EngineRequest) -> None:
        self.free(req)
        req.status = Status.PREEMPTED
        req.num_computed = 0
        req.preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(req)

    # -- one step --------------------------------------------------------------------------------
    def schedule(self) -> StepBatch:
        batch = StepBatch()
        budget = self.max_num_batched_tokens
        running = self.running
        scheduled = batch.scheduled
        threshold = self.long_prefill_token_threshold
        bs, max_len = self.block_size, self.max_model_len
        pool = self.pool
        caching = pool.enable_caching
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            c = req.num_computed
            num_tokens = req.prompt_tokens + req.num_output
            num_new = num_tokens - c
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new > budget:
                num_new = budget
            if num_new > max_len - 1 - c:
                num_new = max_len - 1 - c
            if num_new <= 0:
                i += 1
                continue
            end = c + num_new
            room = req.num_blocks * bs
            fills = caching and min(end, num_tokens) // bs > req.num_cached_blocks
            if end <= room and not fills:
                # its blocks have room and fill none: nothing to allocate or cache (most decodes)
                scheduled.append((req, num_new, c))
                budget -= num_new
                i += 1
                continue
            if num_new == 1 and (end <= room or pool.num_free):
                # a decode at a block boundary (what `_allocate_slots` does, without its
                # generality): at most one new block, at most one block filled
                if end > room:
                    req.add_block(pool.allocate_few(1)[0])
                if fills:
                    self.cache_full(req, min(end, num_tokens) // bs)
                scheduled.append((req, 1, c))
                budget -= 1
                i += 1
                continue
            while True:
                if self._allocate_slots(req, num_new):
                    ok = True
                    break
                victim = self._pick_victim()
                running.remove(victim)
                for k, (r, n, _) in enumerate(scheduled):
                    if r is victim:
                        del scheduled[k]
                        budget += n
                        i -= 1
                        break
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is req:
                    ok = False
                    break
            if not ok:
                break
            scheduled.append((req, num_new, req.num_computed))
            budget -= num_new
            i += 1

        if not batch.preempted:
            waiting = self.waiting
            while len(waiting) and budget > 0 and len(running) < self.max_num_seqs:
                req = waiting.peek()
                max_hit_blocks = (req.num_tokens - 1) // self.block_size
                hit_blocks = self.pool.longest_cached_prefix(
                    req.lookup_hashes(self.block_size), max_hit_blocks
                )
                num_computed = len(hit_blocks) * self.block_size
                num_new = req.num_tokens - num_computed
                if 0 < threshold < num_new:
                    num_new = threshold
                num_new = min(num_new, budget)
                if not self._allocate_slots(req, num_new, hit_blocks):
                    batch.admission_blocked = True
                    break
                if req.preemptions:
                    self.preempted_prefix_queries += req.num_tokens
                    self.preempted_prefix_hits += num_computed
                else:
                    self.prefix_queries += req.num_tokens
                    self.prefix_hits += num_computed
                if req.cached_tokens < 0:
                    req.cached_tokens = num_computed
                waiting.pop()
                running.append(req)
                req.status = Status.RUNNING
                req.num_computed = num_computed
                scheduled.append((req, num_new, num_computed))
                budget -= num_new

        # batch totals for the roofline; num_computed advances now, as in vLLM
        tokens = kv_read = samples = 0
        pairs = 0.0
        for req, n, c in scheduled:
            tokens += n
            kv_read += c + n
            pairs += n * c + n * (n + 1) / 2
            samples += 1
            req.num_computed = c + n
        batch.tokens, batch.kv_read, batch.pairs, batch.samples = tokens, kv_read, pairs, samples
        return batch

    def _pick_victim(self) -> EngineRequest:
        if self.priority_policy:
            # vLLM: max(running, key=(priority, arrival)); ties go to the first in running order
            return max(self.running, key=lambda r: (r.priority, r.arrival_s))
        return self.running[-1]
