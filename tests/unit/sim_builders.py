"""Builders and checkers for the simulated-engine tests (like vLLM's tests/v1/core/utils.py).

- `tiny_profile` / `make_pool` / `make_scheduler` / `make_engine`: engines with a handful of blocks.
- `make_request`: an `EngineRequest` whose leading full blocks carry shared content hashes.
  Hash ids are dense and small (the pool indexes an array by them): content ids stay below
  `UNIQUE_FLOOR`, where the engine (and `make_scheduler`'s waiting queue) start numbering the
  ids of blocks only one request has.
- `step`: one scheduler step plus the engine's output bookkeeping, for driving a bare `Scheduler`.
- `drive`: a small discrete-event loop (the fleet's, minus routing) that runs one engine over a
  list of timed arrivals and records outputs, stats and the flattened KV event stream.
- `check_pool` / `PoolGuard`: structural invariants of a `BlockPool`, and a teardown guard that
  asserts no block is leaked once every request is done; `pool_state`: a comparable snapshot.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType

import numpy as np

from controlplane.roofline.profile import EngineProfile, profile
from controlplane.sim.block_pool import BlockPool, Blocks
from controlplane.sim.engine import SimEngine
from controlplane.sim.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from controlplane.sim.request import EngineRequest, Status
from controlplane.sim.scheduler import PriorityWaitingQueue, Scheduler, StepBatch, WaitingQueue

BLOCK = 4

# -- content hashes ----------------------------------------------------------------------------

# content group g's block j has hash id (g + 1) << GROUP_BITS | j; unique ids start above them all
GROUP_BITS = 10
MAX_GROUP = 62
UNIQUE_FLOOR = 1 << 16


def content_hashes(group: int, n: int) -> list[int]:
    """Chained hashes of the first `n` blocks of shared content `group` (disjoint from unique)."""
    assert 0 <= group <= MAX_GROUP and n <= 1 << GROUP_BITS, (group, n)
    return [(group + 1) << GROUP_BITS | j for j in range(n)]


# -- profiles, pools, schedulers, engines ------------------------------------------------------


def tiny_profile(
    *,
    block_size: int = BLOCK,
    num_blocks: int = 16,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 32,
    max_model_len: int = 1024,
    enable_prefix_caching: bool = True,
) -> EngineProfile:
    return profile(
        "h100",
        "llama-3.1-8b",
        block_size=block_size,
        num_gpu_blocks_override=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching,
    )


def make_pool(num_blocks: int = 8, block_size: int = BLOCK, *, events: bool = True) -> BlockPool:
    return BlockPool(num_blocks, block_size, events_enabled=events)


class UniqueIds:
    """Numbers the blocks only one request has, as `SimEngine.add_request` does: a request
    queued for the first time gets `unique_base` from a counter starting at `floor`, and reserves
    one id per block beyond its known content (at least one)."""

    def __init__(self, block_size: int, floor: int = UNIQUE_FLOOR) -> None:
        self.block_size = block_size
        self.next = floor

    def assign(self, req: EngineRequest) -> None:
        if req.unique_base >= 0:
            return
        blocks = -(-(req.prompt_tokens + req.max_output) // self.block_size)
        req.unique_base = self.next
        self.next += max(1, blocks - len(req.known_hashes))


class _NumberingQueue(WaitingQueue):
    def __init__(self, ids: UniqueIds) -> None:
        super().__init__()
        self._ids = ids

    def add(self, req: EngineRequest) -> None:
        self._ids.assign(req)
        super().add(req)


class _NumberingPriorityQueue(PriorityWaitingQueue):
    def __init__(self, ids: UniqueIds) -> None:
        super().__init__()
        self._ids = ids

    def add(self, req: EngineRequest) -> None:
        self._ids.assign(req)
        super().add(req)

    prepend = add


def make_scheduler(
    *,
    num_blocks: int = 16,
    block_size: int = BLOCK,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 32,
    max_model_len: int = 1024,
    priority_policy: bool = False,
    events: bool = True,
) -> Scheduler:
    """A bare scheduler whose waiting queue numbers unique blocks like the engine would."""
    pool = BlockPool(num_blocks, block_size, events_enabled=events)
    sched = Scheduler(
        pool,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        priority_policy=priority_policy,
    )
    ids = UniqueIds(block_size)
    sched.waiting = _NumberingPriorityQueue(ids) if priority_policy else _NumberingQueue(ids)
    return sched


def make_engine(
    *,
    fast_forward: bool = True,
    priority_policy: bool = False,
    events: bool = True,
    exact_events: bool = False,
    knobs: Mapping[str, int] | None = None,
    **more: int,
) -> SimEngine:
    """An engine on `tiny_profile(**knobs, **more)`, numbering unique blocks from UNIQUE_FLOOR."""
    return SimEngine(
        tiny_profile(**{**(knobs or {}), **more}),  # type: ignore[arg-type]
        events_enabled=events,
        priority_policy=priority_policy,
        fast_forward=fast_forward,
        unique_id_floor=UNIQUE_FLOOR,
        exact_events=exact_events,
    )


_uids = itertools.count(1000)


def make_request(
    prompt_tokens: int,
    max_output: int = 4,
    *,
    uid: int | None = None,
    group: int | None = None,
    shared_blocks: int | None = None,
    known_hashes: Sequence[int] | None = None,
    arrival_s: float = 0.0,
    priority: int = 0,
    block_size: int = BLOCK,
    request_id: str | None = None,
) -> EngineRequest:
    """A request whose first `shared_blocks` full blocks (default: all) hold content `group`.

    Without a group (and without explicit `known_hashes`) every block is unique to the request.
    Its unique blocks are numbered when it is queued (`SimEngine.add_request`, `make_scheduler`).
    """
    if uid is None:
        uid = next(_uids)
    if known_hashes is None:
        if group is None:
            known_hashes = []
        else:
            full = prompt_tokens // block_size
            n = full if shared_blocks is None else min(shared_blocks, full)
            known_hashes = content_hashes(group, n)
    assert all(0 <= h < UNIQUE_FLOOR for h in known_hashes), "content ids stay below unique ids"
    return EngineRequest(
        request_id if request_id is not None else f"r{uid}",
        uid,
        prompt_tokens,
        max_output,
        list(known_hashes),
        arrival_s,
        priority=priority,
    )


# -- driving a bare scheduler ------------------------------------------------------------------


def step(sched: Scheduler) -> tuple[StepBatch, list[EngineRequest]]:
    """Schedule one step and apply its outputs as `SimEngine.complete` does; returns finished."""
    batch = sched.schedule()
    return batch, apply_outputs(sched, batch)


def apply_outputs(sched: Scheduler, batch: StepBatch) -> list[EngineRequest]:
    """A token for every scheduled request whose prompt is done; finish at `max_output`."""
    done: list[EngineRequest] = []
    for req, _n, _c in batch.scheduled:
        if req.status is not Status.RUNNING or req.num_computed < req.num_tokens:
            continue
        req.num_output += 1
        if req.num_output >= req.max_output:
            req.status = Status.FINISHED
            sched.running.remove(req)
            sched.free(req)
            done.append(req)
    return done


def run_to_completion(sched: Scheduler, max_steps: int = 10_000) -> list[StepBatch]:
    batches: list[StepBatch] = []
    while sched.running or len(sched.waiting):
        batch, _ = step(sched)
        batches.append(batch)
        if len(batches) > max_steps:
            raise AssertionError("scheduler made no progress")
    return batches


# -- KV events ---------------------------------------------------------------------------------

FlatEvent = tuple[str, tuple[int, ...], int | None]


def flatten_events(events: Iterable[KVEvent]) -> list[FlatEvent]:
    """One entry per BlockStored call and one per removed hash (consumers treat merges alike)."""
    out: list[FlatEvent] = []
    for ev in events:
        if isinstance(ev, BlockStored):
            out.append(("stored", tuple(ev.block_hashes), ev.parent_block_hash))
        elif isinstance(ev, BlockRemoved):
            out.extend(("removed", (h,), None) for h in ev.block_hashes)
        elif isinstance(ev, AllBlocksCleared):
            out.append(("cleared", (), None))
    return out


# -- an event loop for one engine --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    request_id: str
    num_output: int
    first_token_s: float
    finish_s: float
    preemptions: int
    cached_tokens: int


@dataclass(slots=True)
class DriveResult:
    outcomes: dict[str, RequestOutcome]
    prefix_queries: int
    prefix_hits: int
    preemptions: int
    events: list[FlatEvent]
    steps: int
    tokens_out: int
    # arrivals that cut a fast-forwarded decode run short
    cuts: int = 0
    # the engine went idle with requests still running or waiting (nothing left to wake it)
    stalled: bool = False
    end_s: float = 0.0
    step_ends: list[float] = field(default_factory=list)
    # every time events were taken: (steps completed, len(events) so far); the block operations
    # of every step scheduled by then are in
    marks: list[tuple[int, int]] = field(default_factory=list)
    # with `snapshots`: the pool's state at the last mark of each steps-completed count
    states: dict[int, PoolState] = field(default_factory=dict)
    final_state: PoolState | None = None
    # per probe: (time, KV usage the engine reported, pool state after `sync`) when snapshots
    probes: list[tuple[float, float, PoolState | None]] = field(default_factory=list)


_ARRIVAL, _STEP, _PROBE = 0, 1, 2


def check_kv_usage(engine: SimEngine, now: float) -> float:
    """`kv_usage(now)`, checked against the pool once `sync(now)` brought it up to date."""
    usage = engine.kv_usage(now)
    engine.sync(now)
    pool = engine.pool
    used = pool.num_blocks - 1 - pool.num_free
    assert round(usage * (pool.num_blocks - 1)) == used, (usage, used)
    assert abs(usage - pool.usage) <= 1e-12
    assert engine.kv_usage(now) == usage  # syncing does not change what is reported
    return usage


def drive(
    engine: SimEngine,
    arrivals: Sequence[tuple[float, EngineRequest]],
    *,
    snapshots: bool | Collection[int] = False,
    probes: Sequence[float] = (),
) -> DriveResult:
    """Run `engine` over timed arrivals with the fleet's event discipline.

    Arrivals at a time equal to a step end are handled first (they are pushed first), an
    arrival during a fast-forwarded run may cut it (`add_request` returns True) and then the
    pending step end is re-pushed under a new version, exactly as `FleetSim` does. At each
    probe time the engine is observed as a router would: `kv_usage`, then `sync` (checked by
    `check_kv_usage`) and its events taken. `snapshots` records the pool's state at every take
    (True) or only at takes after these many completed steps (a collection).
    """
    snapshot_at = snapshots if isinstance(snapshots, Collection) else None
    recording = snapshots is True or snapshot_at is not None
    heap: list[tuple[float, int, int, object, int]] = []
    seq = itertools.count()
    for t, req in sorted(arrivals, key=lambda p: p[0]):
        assert engine.fits(req.prompt_tokens, req.max_output), f"{req} can never run here"
        heapq.heappush(heap, (t, next(seq), _ARRIVAL, req, 0))
    for t in sorted(probes):
        heapq.heappush(heap, (t, next(seq), _PROBE, None, 0))
    probed: list[tuple[float, float, PoolState | None]] = []
    version = 0
    events: list[FlatEvent] = []
    marks: list[tuple[int, int]] = []
    states: dict[int, PoolState] = {}

    def take(snapshot: bool = True) -> None:
        events.extend(flatten_events(engine.take_events()))
        marks.append((engine.steps, len(events)))
        if not snapshot:  # another take follows before the engine changes or steps again
            return
        if snapshots is True or (snapshot_at is not None and engine.steps in snapshot_at):
            states[engine.steps] = pool_state(engine.pool)

    cuts = 0
    now = last = 0.0
    step_ends: list[float] = []
    reqs: list[EngineRequest] = [r for _, r in arrivals]
    while heap:
        now, _, kind, payload, ver = heapq.heappop(heap)
        if kind == _PROBE:
            usage = check_kv_usage(engine, now)
            take()
            probed.append((now, usage, pool_state(engine.pool) if recording else None))
            continue
        last = now
        if kind == _ARRIVAL:
            assert isinstance(payload, EngineRequest)
            cut = engine.add_request(payload, now)
            cuts += cut
            if cut or engine.idle:
                version += 1
                end = engine.busy_until if not engine.idle else engine.start(now)
                take()
                if end is not None:
                    heapq.heappush(heap, (end, next(seq), _STEP, None, version))
        elif ver == version:
            step_ends.append(now)
            engine.complete(now)
            engine.drain()
            take(snapshot=False)
            end = engine.start(now)
            take()
            if end is not None:
                heapq.heappush(heap, (end, next(seq), _STEP, None, version))
    outcomes = {
        r.request_id: RequestOutcome(
            r.request_id, r.num_output, r.first_token_s, r.finish_s, r.preemptions, r.cached_tokens
        )
        for r in reqs
    }
    return DriveResult(
        outcomes=outcomes,
        prefix_queries=engine.sched.prefix_queries,
        prefix_hits=engine.sched.prefix_hits,
        preemptions=engine.sched.num_preemptions,
        events=events,
        steps=engine.steps,
        tokens_out=engine.tokens_out,
        cuts=cuts,
        stalled=bool(engine.num_running or engine.num_waiting),
        end_s=last,
        step_ends=step_ends,
        marks=marks,
        states=states,
        final_state=pool_state(engine.pool) if recording else None,
        probes=probed,
    )


# -- pool invariants ---------------------------------------------------------------------------


# (num_free, recycled free queue, per block (ref, hash), per cached hash (findable block, dups))
PoolState = tuple[
    int,
    tuple[int, ...],
    tuple[tuple[int, int | None], ...],
    tuple[tuple[int, int, tuple[int, ...]], ...],
]


def cache_index(pool: BlockPool) -> dict[int, list[int]]:
    """The pool's hash -> blocks index: the findable (earliest inserted) copy, then later ones."""
    cached = pool._cached  # hash id -> block; block 0 (the null block) is never cached
    dups: dict[int, list[int]] = pool._dups
    out: dict[int, list[int]] = {}
    for h in np.flatnonzero(cached > 0).tolist():
        out[h] = [int(cached[h]), *dups.get(h, [])]
    for h in dups:
        assert h in out, f"hash {h} has later copies {dups[h]} but no findable one"
    return out


def pool_state(pool: BlockPool) -> PoolState:
    """Everything observable about a pool, comparable with `==`."""
    blocks = tuple((pool.ref_count(b), pool.block_hash(b)) for b in range(pool.num_blocks))
    # the hashes blocks carry (`check_pool` checks the index holds no others)
    hashes = sorted({h for _, h in blocks if h is not None})
    dups: dict[int, list[int]] = pool._dups
    index = tuple((h, pool.cached_block(h) or 0, tuple(dups.get(h, ()))) for h in hashes)
    return pool.num_free, tuple(pool.free_queue()), blocks, index


def check_pool(pool: BlockPool, holders: Iterable[Sequence[int] | Blocks] | None = None) -> None:
    """Structural invariants of a pool; with `holders` (each one's block list), ref counts must
    equal how many holders hold each block."""
    n = pool.num_blocks
    assert pool.ref_count(0) == 1, "the null block must stay referenced"
    assert not pool.is_free(0)
    queue = pool.free_queue()
    assert all(isinstance(b, int) for b in queue)
    assert len(queue) == len(set(queue)), f"free queue has duplicates: {queue}"
    assert 0 not in queue
    for b in queue:
        assert pool.ref_count(b) == 0, f"block {b} is queued as free with ref {pool.ref_count(b)}"
    queued = set(queue)
    fresh = 0
    hashed: dict[int, list[int]] = {}
    for b in range(1, n):
        ref = pool.ref_count(b)
        assert ref >= 0, f"block {b} has negative ref count {ref}"
        h = pool.block_hash(b)
        if h is not None:
            assert h >= 0
            hashed.setdefault(h, []).append(b)
        if ref == 0:
            assert pool.is_free(b), f"unreferenced block {b} is not free (leaked)"
            if b not in queued:
                fresh += 1
                assert h is None, f"never-used block {b} carries a hash"
        else:
            assert not pool.is_free(b), f"referenced block {b} is free"
    assert pool.num_free == fresh + len(queue)
    # never-used blocks are exactly the id range the pool has not handed out yet
    assert all(pool.is_free(b) and b not in queued for b in range(n - fresh, n))
    assert 0.0 <= pool.usage <= 1.0
    assert pool.usage == 1.0 - pool.num_free / (n - 1)
    # uncached freed blocks sit on the stack (the queue's head), the cached ones in the ring
    stacked = pool._stack[::-1]
    assert queue[: len(stacked)] == stacked
    assert all(pool.block_hash(b) is None for b in stacked), "a cached block on the stack"
    assert all(int(pool._qpos[b]) == -2 for b in stacked)
    ringed = queue[len(stacked) :]
    # the ring: each queued block's live entry sits between head and tail, in queue order
    live = [pool._ring[int(pool._qpos[b])] for b in ringed]
    assert live == ringed
    positions = [int(pool._qpos[b]) for b in ringed]
    assert positions == sorted(positions)
    assert all(pool._head <= p < pool._tail for p in positions)
    assert pool._nfree == len(ringed)
    # the cache index holds exactly the hashes of the blocks that carry one
    index = cache_index(pool)
    assert set(index) == set(hashed), "cached hashes differ from the hashes blocks carry"
    assert pool.num_cached == sum(len(v) for v in hashed.values())
    for h, blocks in hashed.items():
        copies = index[h]
        assert sorted(copies) == sorted(blocks), f"hash {h}: index {copies} vs blocks {blocks}"
        assert pool.cached_block(h) == copies[0]
        found = pool.longest_cached_prefix([h], 1)
        assert isinstance(found, np.ndarray) and found.dtype == np.int64
        assert found.tolist() == [copies[0]]
        assert pool.block_hash(int(found[0])) == h
    if holders is not None:
        refs: dict[int, int] = {}
        for held_blocks in holders:
            held = [int(b) for b in held_blocks]
            assert len(held) == len(set(held)), f"{held} holds a block twice"
            for b in held:
                refs[b] = refs.get(b, 0) + 1
        for b in range(1, n):
            assert pool.ref_count(b) == refs.get(b, 0), (
                f"block {b}: ref {pool.ref_count(b)} but {refs.get(b, 0)} holders"
            )


def check_scheduler(sched: Scheduler) -> None:
    """Pool invariants with the running requests as the only holders."""
    for r in sched.waiting:
        assert len(r.blocks) == 0 == r.num_blocks, f"waiting request {r} holds blocks"
    for r in sched.running:
        assert isinstance(r.blocks, np.ndarray) and r.blocks.dtype == np.int64
        assert r.num_blocks == len(r.blocks)
        assert r.num_cached_blocks <= len(r.blocks)
        # cached blocks carry the request's chained hashes
        cached = [sched.pool.block_hash(int(b)) for b in r.blocks[: r.num_cached_blocks]]
        assert cached == r.block_hashes(0, r.num_cached_blocks).tolist()
    check_pool(sched.pool, [r.blocks for r in sched.running])


class PoolGuard:
    """Collects pools/schedulers/engines; on a clean exit asserts nothing is leaked.

    Use as `with PoolGuard() as guard: guard.watch(engine)` or through a fixture that yields it.
    At exit every watched scheduler must have no running or waiting request left, and every
    pool must have all its usable blocks free with consistent ref counts and cache index.
    """

    def __init__(self) -> None:
        self._pools: list[BlockPool] = []
        self._scheds: list[Scheduler] = []

    def watch(self, obj: BlockPool | Scheduler | SimEngine) -> None:
        if isinstance(obj, SimEngine):
            self._scheds.append(obj.sched)
        elif isinstance(obj, Scheduler):
            self._scheds.append(obj)
        else:
            self._pools.append(obj)

    def check(self) -> None:
        for sched in self._scheds:
            assert not sched.running, f"requests still running: {sched.running}"
            assert not len(sched.waiting), f"requests still waiting: {list(sched.waiting)}"
            check_scheduler(sched)
            pool = sched.pool
            assert pool.num_free == pool.num_blocks - 1, "blocks leaked"
        for pool in self._pools:
            check_pool(pool)
            assert pool.num_free == pool.num_blocks - 1, "blocks leaked"

    def __enter__(self) -> PoolGuard:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.check()
