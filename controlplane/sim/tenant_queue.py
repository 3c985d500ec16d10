"""The router-side tenant queue of the simulator (`FleetConfig.fairness`; None routes at arrival).

Requests wait in per-tenant FIFOs inside the router and are dispatched only while a replica has
room, so the order of dispatch is where fairness acts. The ordering is `controlplane.tenancy.vtc`
(the live router runs the same functions); this module keeps the simulator's books:

    enqueue      at arrival: the tenant's FIFO; `vtc.on_arrival` when it was empty
    room         a replica takes one more request when, counting every request it holds (running
                 or in its waiting queue) plus this one, it stays under the lowest of the three
                 concurrency ceilings (`roofline.capacity`) at their mean reserved context
                 (prompt + predicted output): max_num_seqs, KV capacity, compute ridge. The last
                 `headroom` of those slots and of the replica's KV is kept for tenants holding
                 at most their weighted share of the fleet's KV: a tenant whose long documents
                 fill every replica cannot make a light tenant's next chat wait for one to
                 finish. A batch request also needs the batch class's KV (reserved tokens) to
                 stay within `batch_kv_share` of the replica's KV, unless no batch request holds
                 any there. And the prefill gate (below): a queue of documents inside vLLM
                 (FCFS) would make the next chat wait for all of them, out of the fair
                 queue's reach
    next         `vtc.pick` among the backlogged tenants (interactive first, then the smallest
                 counter); dispatch its head if some replica has room for it. When it has none
                 (a long document waiting for KV), another tenant of its class whose head fits
                 may overtake it while its counter stays within the blocked head's own prefill
                 charge of the blocked counter: the fleet keeps working, and a stream of small
                 requests cannot starve the long one (past the bound nobody overtakes, and the
                 KV it waits for frees). `vtc.on_idle` when the FIFO empties
    admitted     charge the prompt's prefill work at dispatch
    sweep        charge the decode tokens produced since the last sweep (each at its context);
                 run before a pick that two tenants contend for, at most every
                 `charge_interval_s` of simulated time (a live router charges per streamed chunk)
    finished     charge the rest, refund the prompt tokens the replica served from its prefix
                 cache (`usage.cached_tokens`), free the slot

Charges are divided by the tenant's weight (`vtc.charge`).

The prefill gate (`prefill_gate`). What delays a new request's first prefill chunk on a replica
is the prompt tokens vLLM schedules per step ahead of it, not the prompt tokens still to come:
each step the scheduler gives every prefilling request (running first, then the waiting queue in
order) its next chunk, at most `long_prefill_token_threshold` tokens when that is set, until the
step's `max_num_batched_tokens` budget is spent. Per prefilling request (dispatched, no first
token yet) that is (`prefill_per_step`)

    per step = min(prompt, threshold)   when the replica's threshold > 0
    per step = prompt                   when it is 0 (vLLM's default: the whole prompt goes
                                        ahead of a later request, a budget-sized chunk a step)

The router sees no prefill progress before the first token, so `prompt` stands for the remaining
prompt (they differ only in a request's last chunk). A replica takes a new request only when

  1. the per-step tokens of its prefilling requests plus the new request's own stay within
     `prefill_steps` x max_num_batched_tokens (always when none is prefilling). With the
     threshold at 0 this is the whole prefill backlog: the new first token waits at most about
     `prefill_steps` full steps;
  2. with a threshold, and the new prompt longer than it (a long prefill, `is_long_prefill`),
     fewer than `long_prefills` long prefills are in progress on the replica. This is vLLM's own
     `max_long_partial_prefills` (default 1), which its V1 scheduler does not enforce: with the
     threshold, each step's cost grows with the long chunks it carries (rule 1 alone would let
     2 x 8,192 / threshold documents prefill at once, filling every step's budget again), and the
     threshold is chosen for a step carrying one. Short prompts are never held by this rule, so
     a chat joins the next step while documents prefill one at a time per replica.

With the threshold at 0 rule 2 never applies and rule 1 is the gate as it was. A threshold below
the interactive prompts makes them long prefills, serialised behind a document by rule 2:
choose it above them. A replica's threshold is read from the profile `room` is given (its
`EngineProfile.long_prefill_token_threshold`); the live router has no prefill gate (it gates on
the fleet's slots), so nothing there changes.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from controlplane.roofline.capacity import concurrency_ceilings
from controlplane.roofline.profile import EngineProfile
from controlplane.sim.request import EngineRequest
from controlplane.tenancy import vtc
from controlplane.tenancy.work import WorkMode, WorkModel
from controlplane.types import PriorityClass

# mean contexts are rounded up to this many tokens before the ceilings are looked up
_CONTEXT_BUCKET = 64


@dataclass(frozen=True, slots=True)
class QueueConfig:
    """How the simulated router's tenant queue orders and gates dispatch."""

    mode: WorkMode = WorkMode.VTC_ROOFLINE
    # tenant -> weight (absent tenants weigh 1)
    weights: tuple[tuple[str, float], ...] = ()
    # most of each replica's KV (reserved tokens) the batch class may hold; 1.0: no cap
    batch_kv_share: float = 1.0
    charge_interval_s: float = 0.1
    # fixed concurrent requests per replica instead of the roofline ceilings (0: ceilings)
    slots_per_replica: int = 0
    # the last share of each replica's slots and KV that only tenants holding at most their
    # weighted share of the fleet's KV may fill (0: none)
    headroom: float = 0.1
    # prompt tokens per step a replica may hold ahead of a new request's first chunk (summed over
    # requests without a first token, each at most the replica's long_prefill_token_threshold),
    # in steps of its token budget (max_num_batched_tokens); more waits here (0: no limit)
    prefill_steps: float = 2.0
    # prompts longer than the replica's long_prefill_token_threshold that may prefill at once on
    # a replica (vLLM's max_long_partial_prefills, which its V1 scheduler does not enforce);
    # unused when the threshold is 0 (0: no limit)
    long_prefills: int = 1

    def weight(self, tenant: str) -> float:
        return dict(self.weights).get(tenant, 1.0)


def prefill_per_step(prompt: int, threshold: int) -> int:
    """Prompt tokens a prefilling request takes from each step's budget until its first token:
    its chunk, at most `threshold` (vLLM's long_prefill_token_threshold; 0: off) tokens."""
    return min(prompt, threshold) if threshold > 0 else prompt


def is_long_prefill(prompt: int, threshold: int) -> bool:
    """Whether vLLM chunks this prompt at the threshold (a long prefill; never when it is 0)."""
    return 0 < threshold < prompt


def prefill_gate(
    ahead: int,
    long_ahead: int,
    prompt: int,
    *,
    threshold: int,
    budget: int,
    steps: float,
    long_prefills: int,
) -> bool:
    """Whether a replica may take a new `prompt` while its prefilling requests take `ahead`
    prompt tokens per step (`prefill_per_step` summed), `long_ahead` of them long prefills:
    within `steps` x `budget` (max_num_batched_tokens) counting the new request's own per-step
    tokens (always when nothing is ahead; no limit when steps is 0), and, for a long prefill,
    fewer than `long_prefills` long ones ahead (no limit when 0)."""
    if steps > 0 and ahead > 0 and ahead + prefill_per_step(prompt, threshold) > steps * budget:
        return False
    return not (
        long_prefills > 0 and long_ahead >= long_prefills and is_long_prefill(prompt, threshold)
    )


@functools.lru_cache(maxsize=4096)
def _ceiling(prof: EngineProfile, context_bucket: int) -> int:
    return concurrency_ceilings(prof, max(1, context_bucket * _CONTEXT_BUCKET)).sequences


@dataclass(slots=True)
class _Slots:
    requests: int = 0
    reserved: int = 0
    batch_reserved: int = 0
    # prompt tokens per step its prefilling requests take (`prefill_per_step` summed)
    prefill: int = 0
    # how many of them are long prefills (`is_long_prefill`)
    long_prefill: int = 0
    # the replica's long_prefill_token_threshold (from the profile `room` last saw; 0: off)
    threshold: int = 0


@dataclass(slots=True)
class _Flight:
    tenant: str
    replica: str
    prompt: int
    reserved: int
    batch: bool
    req: EngineRequest
    decoded: int = 0
    prefilling: bool = True
    # what it adds to its replica's prefill per step until its first token; a long prefill?
    per_step: int = 0
    long: bool = False


@dataclass(slots=True)
class TenantQueue:
    config: QueueConfig
    work: WorkModel
    state: vtc.VtcState = field(default_factory=vtc.VtcState)
    fifos: dict[str, deque[int]] = field(default_factory=dict)
    classes: dict[str, PriorityClass] = field(default_factory=dict)
    slots: dict[str, _Slots] = field(default_factory=dict)
    inflight: dict[int, _Flight] = field(default_factory=dict)
    last_sweep_s: float = -1e18
    queued: int = 0
    # total work charged per tenant (before weights), for tests and reports
    charged: dict[str, float] = field(default_factory=dict)
    # KV tokens reserved by each tenant's in-flight requests, and the ready replicas' total
    held: dict[str, int] = field(default_factory=dict)
    fleet_kv: float = 0.0
    # queued request -> prompt tokens (what its prefill will be charged)
    prompts: dict[int, int] = field(default_factory=dict)
    # per tenant, the [start, end] intervals during which it was backlogged
    backlog: dict[str, list[list[float]]] = field(default_factory=dict)

    @classmethod
    def build(cls, config: QueueConfig, prof: EngineProfile) -> TenantQueue:
        return cls(config, WorkModel.build(config.mode, prof))

    # -- waiting ---------------------------------------------------------------------------------
    def enqueue(
        self, i: int, tenant: str, priority: PriorityClass, prompt_tokens: int, now: float
    ) -> None:
        fifo = self.fifos.setdefault(tenant, deque())
        self.prompts[i] = prompt_tokens
        self.classes[tenant] = priority
        if not fifo:
            self.state = vtc.on_arrival(self.state, tenant)
            self.backlog.setdefault(tenant, []).append([now, now])
        fifo.append(i)
        self.queued += 1

    def contended(self) -> bool:
        return sum(1 for f in self.fifos.values() if f) > 1

    def next(self, ready: Callable[[int], bool], now: float) -> int | None:
        """Pop the head of the fairest tenant (or of one allowed to overtake it) if `ready`
        accepts it now; None otherwise."""
        waiting = {t: self.classes[t] for t, f in self.fifos.items() if f}
        tenant = vtc.pick(self.state, waiting)
        if tenant is None:
            return None
        if not ready(self.fifos[tenant][0]):
            tenant = self._overtaker(tenant, waiting, ready)
            if tenant is None:
                return None
        fifo = self.fifos[tenant]
        i = fifo.popleft()
        self.prompts.pop(i, None)
        self.queued -= 1
        if not fifo:
            self.state = vtc.on_idle(self.state, tenant)
            self.backlog[tenant][-1][1] = now
        return i

    def _overtaker(
        self, blocked: str, waiting: dict[str, PriorityClass], ready: Callable[[int], bool]
    ) -> str | None:
        """A tenant of the blocked one's class whose head fits, while its counter is within the
        blocked head's own charge of the blocked counter (bounded overtaking)."""
        state = self.state
        head = self.fifos[blocked][0]
        limit = state.counter(blocked) + self.work.prefill(
            self.prompts.get(head, 0), 0
        ) / self.config.weight(blocked)
        cls = waiting[blocked]
        others = sorted(
            (state.counter(t), t) for t, c in waiting.items() if t != blocked and c is cls
        )
        for counter, t in others:
            if counter > limit:
                return None
            if ready(self.fifos[t][0]):
                return t
        return None

    def close(self, now: float) -> dict[str, list[tuple[float, float]]]:
        """The backlog intervals per tenant, those still open ending at `now`."""
        for tenant, fifo in self.fifos.items():
            if fifo:
                self.backlog[tenant][-1][1] = now
        return {t: [(a, b) for a, b in spans] for t, spans in self.backlog.items()}

    # -- capacity --------------------------------------------------------------------------------
    def room(
        self,
        replica: str,
        prof: EngineProfile,
        reserved: int,
        batch: bool,
        tenant: str = "",
        prompt: int = 0,
    ) -> bool:
        s = self.slots.get(replica)
        if s is None:
            s = self.slots[replica] = _Slots()
        n = s.requests + 1
        cfg = self.config
        limit = cfg.slots_per_replica or _ceiling(
            prof, -(-(s.reserved + reserved) // (n * _CONTEXT_BUCKET))
        )
        if n > limit:
            return False
        s.threshold = prof.long_prefill_token_threshold
        if not prefill_gate(
            s.prefill,
            s.long_prefill,
            prompt,
            threshold=s.threshold,
            budget=prof.resolved_max_num_batched_tokens,
            steps=cfg.prefill_steps,
            long_prefills=cfg.long_prefills,
        ):
            return False
        kv = prof.num_gpu_blocks * prof.resolved_block_size
        fill = 1.0 - cfg.headroom
        if (
            cfg.headroom > 0
            and (n > fill * limit or s.reserved + reserved > fill * kv)
            and not self.under_share(tenant, reserved)
        ):
            return False
        share = cfg.batch_kv_share
        if batch and s.batch_reserved and share < 1.0:
            return s.batch_reserved + reserved <= share * kv
        return True

    def under_share(self, tenant: str, reserved: int = 0) -> bool:
        """Whether `tenant` (with `reserved` more tokens) holds at most its weighted share of
        the fleet's KV, among the tenants holding some or waiting."""
        held = self.held.get(tenant, 0) + reserved
        active = {t for t, v in self.held.items() if v > 0} | self.state.backlogged | {tenant}
        total = sum(self.config.weight(t) for t in active)
        return held <= self.config.weight(tenant) / total * self.fleet_kv

    # -- charges ---------------------------------------------------------------------------------
    def _charge(self, tenant: str, work: float) -> None:
        if work > 0:
            self.state = vtc.charge(self.state, tenant, work, self.config.weight(tenant))
            self.charged[tenant] = self.charged.get(tenant, 0.0) + work

    def admitted(
        self, uid: int, tenant: str, replica: str, req: EngineRequest, reserved: int
    ) -> None:
        batch = self.classes.get(tenant) is PriorityClass.BATCH
        s = self.slots.setdefault(replica, _Slots())
        s.requests += 1
        s.reserved += reserved
        per_step = prefill_per_step(req.prompt_tokens, s.threshold)
        long = is_long_prefill(req.prompt_tokens, s.threshold)
        s.prefill += per_step
        s.long_prefill += long
        self.held[tenant] = self.held.get(tenant, 0) + reserved
        if batch:
            s.batch_reserved += reserved
        self.inflight[uid] = _Flight(
            tenant, replica, req.prompt_tokens, reserved, batch, req, per_step=per_step, long=long
        )
        self._charge(tenant, self.work.prefill(req.prompt_tokens, 0))

    def first_token(self, uid: int) -> None:
        """The request's prefill is done: it leaves its replica's prefill backlog."""
        f = self.inflight.get(uid)
        if f is not None and f.prefilling:
            f.prefilling = False
            s = self.slots[f.replica]
            s.prefill -= f.per_step
            s.long_prefill -= f.long

    def _decode_due(self, f: _Flight) -> float:
        produced = max(0, f.req.num_output - 1)
        new = produced - f.decoded
        if new <= 0:
            return 0.0
        work = self.work.decode(new, f.prompt + f.decoded)
        f.decoded = produced
        return work

    def sweep(self, now: float) -> None:
        """Charge every in-flight request's decode tokens since the last sweep (engines synced)."""
        self.last_sweep_s = now
        due: dict[str, float] = {}
        for f in self.inflight.values():
            w = self._decode_due(f)
            if w:
                due[f.tenant] = due.get(f.tenant, 0.0) + w
        for tenant, w in due.items():
            self._charge(tenant, w)

    def sweep_due(self, now: float) -> bool:
        return now - self.last_sweep_s >= self.config.charge_interval_s and self.contended()

    def finished(self, uid: int) -> None:
        # one that ends without a first token (failed mid-prefill) leaves the prefill backlog too
        self.first_token(uid)
        f = self.inflight.pop(uid, None)
        if f is None:
            return
        self._charge(f.tenant, self._decode_due(f))
        cached = max(0, f.req.cached_tokens)
        if cached:
            w = self.work.refund_cached(cached)
            self.state = vtc.refund(self.state, f.tenant, w, self.config.weight(f.tenant))
            self.charged[f.tenant] = self.charged.get(f.tenant, 0.0) - w
        s = self.slots[f.replica]
        s.requests -= 1
        s.reserved -= f.reserved
        self.held[f.tenant] -= f.reserved
        if f.batch:
            s.batch_reserved -= f.reserved


__all__ = ["QueueConfig", "TenantQueue", "is_long_prefill", "prefill_gate", "prefill_per_step"]
