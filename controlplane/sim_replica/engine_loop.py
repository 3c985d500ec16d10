"""The simulated engine in real time: an asyncio task that steps `SimEngine` back to back.

Like vLLM's busy loop, a step is scheduled the moment the previous one ends while there is work;
its wall duration is the roofline's step time divided by `speed` (times the `slow_factor`
fault). The loop sleeps until the step ends, applies its outputs, publishes the KV events its
scheduling produced (one batch per step, as vLLM publishes from `update_from_output`), wakes the
streams that got tokens, and schedules the next step. Arrivals wait for the next step, as in
vLLM. If the event loop falls behind, steps keep their own end times (the timeline stays the
roofline's) but never more than `MAX_LAG_S` in the past.

Decode fast-forward is off: every step is a real step, so tokens stream one step at a time and
KV events are exactly stepwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from controlplane.kvevents.wire import WireEvent
from controlplane.sim.engine import SimEngine
from controlplane.sim.request import EngineRequest, Status
from controlplane.sim_replica.blocks import BlockHashTable
from controlplane.sim_replica.faults import Faults
from controlplane.sim_replica.metrics import EngineGauges, ReplicaMetrics

log = logging.getLogger(__name__)

# how far behind the wall clock a step may start when the event loop was late
MAX_LAG_S = 0.05
# a stalled loop (fault) polls for its release this often
STALL_POLL_S = 0.01


def _report_death(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the engine loop died; /health now answers 503", exc_info=task.exception())


class LiveRequest:
    """One request in the engine, as the HTTP layer follows it."""

    __slots__ = (
        "block_ids",
        "counted",
        "engine_req",
        "finish_reason",
        "last_token_s",
        "max_tokens",
        "notify",
        "output_ids",
        "prompt_ids",
    )

    def __init__(
        self,
        engine_req: EngineRequest,
        prompt_ids: list[int],
        output_ids: list[int],
        block_ids: list[int],
        *,
        finish_reason: str,
        max_tokens: int,
        notify: Callable[[], None],
    ) -> None:
        self.engine_req = engine_req
        self.prompt_ids = prompt_ids
        # every token the request will emit, decided at arrival
        self.output_ids = output_ids
        # dense block ids the request holds references on (released when it leaves)
        self.block_ids = block_ids
        # "length" (output = max_tokens) or "stop" (an earlier simulated stop)
        self.finish_reason = finish_reason
        self.max_tokens = max_tokens
        self.notify = notify
        # output tokens already counted in the metrics
        self.counted = 0
        self.last_token_s = -1.0

    @property
    def produced(self) -> int:
        """Output tokens emitted so far."""
        return min(self.engine_req.num_output, len(self.output_ids))

    @property
    def done(self) -> bool:
        return self.engine_req.status is Status.FINISHED

    @property
    def completed(self) -> bool:
        """Finished with every output token (not aborted)."""
        return self.done and self.produced == len(self.output_ids)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache at first admission (usage)."""
        return max(0, self.engine_req.cached_tokens)


def engine_gauges(engine: SimEngine, now: float) -> EngineGauges:
    sched = engine.sched
    return EngineGauges(
        running=engine.num_running,
        waiting=engine.num_waiting,
        kv_usage=engine.kv_usage(now),
        prefix_queries=sched.prefix_queries,
        prefix_hits=sched.prefix_hits,
        preemptions=sched.num_preemptions,
    )


class EngineLoop:
    """Owns the engine: every mutation goes through here, on the event loop's thread."""

    def __init__(
        self,
        engine: SimEngine,
        table: BlockHashTable,
        metrics: ReplicaMetrics,
        faults: Faults,
        *,
        speed: float = 1.0,
        publish: Callable[[list[WireEvent]], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.table = table
        self.metrics = metrics
        self.faults = faults
        self.speed = speed
        self.publish = publish
        self._clock = clock
        self._t0 = clock()
        self._uid = 0
        self._live: dict[int, LiveRequest] = {}  # engine uid -> request
        self._release: list[LiveRequest] = []  # aborted mid-step: release after the step's events
        self._step_end: float | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.steps = 0

    # -- time ------------------------------------------------------------------------------------
    def now(self) -> float:
        """Engine time: wall seconds since the loop was made."""
        return self._clock() - self._t0

    # -- requests --------------------------------------------------------------------------------
    def submit(
        self,
        prompt_ids: list[int],
        output_ids: list[int],
        *,
        request_id: str,
        notify: Callable[[], None],
        max_tokens: int,
        finish_reason: str = "length",
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> LiveRequest:
        """Queue a request whose output is `output_ids` (decided by the caller)."""
        block_ids = self.table.acquire([*prompt_ids, *output_ids], cache_salt=cache_salt)
        self._uid += 1
        req = EngineRequest(
            request_id,
            self._uid,
            len(prompt_ids),
            len(output_ids),
            block_ids,
            self.now(),
            priority=priority,
            token_ids=prompt_ids,
        )
        live = LiveRequest(
            req,
            prompt_ids,
            output_ids,
            block_ids,
            finish_reason=finish_reason,
            max_tokens=max_tokens,
            notify=notify,
        )
        req.tag = live
        self._live[req.uid] = live
        self.engine.add_request(req, self.now())
        self._wake.set()
        return live

    def abort(self, live: LiveRequest) -> None:
        """The client went away: free the request's blocks; it never emits another token."""
        if live.done or live.engine_req.uid not in self._live:
            return
        self.engine.abort(live.engine_req, self.now())
        del self._live[live.engine_req.uid]
        self.metrics.success["abort"].inc()
        if self._step_end is None:
            self._flush_events()
            self.table.release(live.block_ids)
        else:
            # this step's events may still name its blocks: release them after they are read
            self._release.append(live)

    def reset_prefix_cache(self) -> bool:
        """vLLM's dev-mode reset: forget every cached block, only when no request holds blocks
        (False otherwise, as vLLM answers). Like vLLM, the `AllBlocksCleared` event waits in
        the queue and goes out with the next step's batch."""
        engine = self.engine
        if self._step_end is not None or engine.num_running or engine.num_waiting:
            return False
        return engine.pool.reset_prefix_cache()

    @property
    def num_live(self) -> int:
        return len(self._live)

    def gauges(self) -> EngineGauges:
        return engine_gauges(self.engine, self.now())

    # -- the loop --------------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run(), name="engine-loop")
            self._task.add_done_callback(_report_death)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    @property
    def alive(self) -> bool:
        """The loop task runs and is not stalled (what an honest `/health` reports)."""
        task = self._task
        return task is not None and not task.done() and not self.faults.stall

    async def run(self) -> None:
        engine = self.engine
        while True:
            if self._step_end is None:
                if not (engine.num_waiting or engine.num_running):
                    self._wake.clear()
                    await self._wake.wait()
                await self._unstalled()
                self._begin(self.now())
                if self._step_end is None:
                    # work that cannot be scheduled yet: look again shortly
                    await asyncio.sleep(STALL_POLL_S)
                continue
            delay = self._step_end - self.now()
            # sleep(0) still yields to the HTTP handlers while catching up
            await asyncio.sleep(max(0.0, delay))
            await self._unstalled()
            end = self._step_end
            self._end_step(end)
            self._begin(max(end, self.now() - MAX_LAG_S))

    async def _unstalled(self) -> None:
        while self.faults.stall:
            await asyncio.sleep(STALL_POLL_S)

    def _begin(self, t: float) -> None:
        end = self.engine.start(t)
        if end is None:
            self._step_end = None
            return
        self._step_end = t + (end - t) * self.faults.slow_factor / self.speed
        for req in self.engine.sched.running:
            if req.first_scheduled_s < 0:
                req.first_scheduled_s = t

    def _end_step(self, t: float) -> None:
        engine = self.engine
        stepped = list(engine.sched.running)
        engine.complete(t)
        self.steps += 1
        first, finished = engine.drain()
        self._flush_events()
        for live in self._release:
            self.table.release(live.block_ids)
        self._release.clear()
        m = self.metrics
        for req in first:
            opened = self._tagged(req)
            if opened is None:
                continue
            cached = opened.cached_tokens
            prompt = req.prompt_tokens
            m.ttft.observe(t - req.arrival_s)
            m.queue_time.observe(max(0.0, req.first_scheduled_s - req.arrival_s))
            m.prefill_time.observe(t - req.first_scheduled_s)
            m.prompt_tokens.inc(prompt)
            m.prompt_computed.inc(prompt - cached)
            m.prompt_cache_hit.inc(cached)
            m.prompt_cached.inc(cached)
        for req in stepped:
            running = self._tagged(req)
            if running is None:
                continue
            new = running.produced - running.counted
            if new > 0:
                m.generation_tokens.inc(new)
                if running.counted:
                    m.itl.observe(t - running.last_token_s)
                running.counted = running.produced
                running.last_token_s = t
                running.notify()
        for req in finished:
            done = self._tagged(req)
            if done is None:
                continue
            self._finish(done, t)
            done.notify()

    def _finish(self, live: LiveRequest, t: float) -> None:
        req = live.engine_req
        del self._live[req.uid]
        self.table.release(live.block_ids)
        m = self.metrics
        n = live.produced
        decode = t - req.first_token_s
        m.success[live.finish_reason].inc()
        m.e2e.observe(t - req.arrival_s)
        m.inference_time.observe(t - req.first_scheduled_s)
        m.decode_time.observe(decode)
        if n > 1:
            m.tpot.observe(decode / (n - 1))
        m.request_prompt_tokens.observe(req.prompt_tokens)
        m.request_generation_tokens.observe(n)
        m.request_max_tokens.observe(live.max_tokens)

    def _flush_events(self) -> None:
        events = self.engine.take_events()
        if not events:
            return
        wire = self.table.translate(events)
        if self.publish is not None and wire:
            self.publish(wire)

    @staticmethod
    def _tagged(req: EngineRequest) -> LiveRequest | None:
        live = req.tag
        return live if isinstance(live, LiveRequest) else None
