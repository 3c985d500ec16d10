"""Our routing policies inside Ray Serve: `PolicyRequestRouter`, a `RequestRouter` subclass.

Select it for an engine deployment (deploy/engines/) with

    RequestRouterConfig(
        request_router_class="router.serve.request_router:PolicyRequestRouter",
        request_router_kwargs={"policy": "prefix_affinity", "model": "tiny-llama",
                               "tokenizer": "/models/tiny-llama", "redis_url": "redis://..."},
        request_routing_stats_period_s=0.5)

Every handle to the deployment (in the ingress replicas, or a driver) runs one instance. For
each engine call `handle(method, path, headers, body)`, `choose_replicas`:

    1. candidates' stats   EngineStats of each RunningReplica.routing_stats; a newer report
                           tells the ledger what that replica's figures already include
    2. request             ServeRouting.request (router/serve/requests.py): the body as the
                           standalone router reads it, tokenized, hashed at the engines' block size
    3. matches             the shared Redis prefix index (the engines' followers feed it), over
                           the candidates; unknown (Redis down, budget spent) = no match; without
                           `redis_url`, a process-local index of this router's speculation only
    4. decision            books.decide: the SAME policy objects as the simulator and the
                           standalone router (`policy`: prefix_affinity, round_robin,
                           least_loaded, predicted_finish, or a peer baseline), on a snapshot
                           of the stats plus this router's books
    5. book it             books.commit (reservation, policy hook) and the speculative index
                           entry, awaited before the request is sent
    6. tiers               one tier per ranked replica, best first (Serve sends to the first
                           that accepts; a full replica passes it to the next); replicas the
                           policy did not rank come last, together

The decision travels with the call (`routing=` keyword: arm, policy, reason, predicted hit
tokens): the engine replica returns it as the `x-cp-decision` header. Its reason is counted in
`cp_serve_decisions_total{deployment,arm,policy,reason}` (Ray metrics) and set on a
`cp.router.decide` span (`cp.decision.reason`, as the standalone router's).
`on_request_routed` re-books the request if Serve sent it to another replica than the first
choice; `on_request_completed`, or the caller cancelling before it was sent, ends it exactly
once (retracting the speculation after the grace the KV events need). Other calls
(`record_routing_stats`, a body that is not a valid generation for this model) are routed by
load alone: one tier with every candidate, Serve's own choice.

Ray is imported here only; nothing else in `router/` needs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Coroutine
from dataclasses import replace
from typing import Any

from opentelemetry import trace
from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from controlplane.routing.books import IndexOp, Routed, RoutingBooks, Speculate
from controlplane.routing.config import PolicyConfig
from controlplane.types import FleetSnapshot, PrefixMatch
from router.config import RedisConfig
from router.fleet.index import RouterIndex, open_index
from router.serve.requests import ServeRouting
from router.serve.stats import EngineStats
from router.telemetry.tracing import TRACER_NAME, set_decision_attributes

ENGINE_METHOD = "handle"
_ARGS = ("method", "path", "headers", "body")


def engine_call(pending: PendingRequest | None) -> tuple[str, bytes] | None:
    """(path, body) of an engine's `handle` call; None for any other call."""
    if pending is None or pending.metadata.call_method != ENGINE_METHOD:
        return None
    values = dict(zip(_ARGS, pending.args, strict=False))
    values.update({k: v for k, v in pending.kwargs.items() if k in _ARGS})
    path, body = values.get("path"), values.get("body", b"")
    if not isinstance(path, str) or not isinstance(body, bytes | bytearray):
        return None
    return path, bytes(body)


class PolicyRequestRouter(RequestRouter):
    def initialize_state(  # type: ignore[override]
        self,
        policy: str = "prefix_affinity",
        policy_params: dict[str, Any] | None = None,
        model: str = "tiny-llama",
        tokenizer: str | None = None,
        redis_url: str | None = None,
        key_prefix: str = "rtr:pidx",
        lookup_budget_ms: float = 25.0,
        hash_secret_env: str = "CP_HASH_SECRET",
        gpu: str = "cpu",
        roofline_model: str = "tiny-llama",
        block_size: int = 32,
        reservations: bool | None = None,
        speculative: bool | None = None,
        speculative_ttl_s: float | None = None,
        retract_grace_s: float | None = None,
    ) -> None:
        # the books' settings not given here keep PolicyConfig's defaults (one copy of them)
        given: dict[str, Any] = {
            "reservations": reservations,
            "speculative": speculative,
            "speculative_ttl_s": speculative_ttl_s,
            "retract_grace_s": retract_grace_s,
        }
        config = PolicyConfig(
            name=policy,
            params=policy_params or {},
            **{key: value for key, value in given.items() if value is not None},
        )
        self.books = RoutingBooks(config)
        self.routing = ServeRouting(
            self.books,
            model=model,
            tokenizer=tokenizer,
            hash_secret_env=hash_secret_env,
            gpu=gpu,
            roofline_model=roofline_model,
            block_size=block_size,
        )
        self._index_config = RedisConfig(
            url=redis_url, key_prefix=key_prefix, lookup_budget_ms=lookup_budget_ms
        )
        self._index: RouterIndex | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()  # Serve may call the hooks from another thread
        self._routed: dict[str, Routed] = {}  # internal request id -> its booking
        self._snapshots: dict[str, FleetSnapshot] = {}  # ... -> the snapshot it was decided on
        self._reported: dict[str, float] = {}  # replica -> reported_at of its last stats
        self._background: set[asyncio.Future[None]] = set()
        self._tracer = trace.get_tracer(TRACER_NAME)
        self._decisions = _decision_counter()
        self._deployment = self._deployment_id.name if self._deployment_id else ""

    # -- choose ----------------------------------------------------------------------------------
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        self._loop = asyncio.get_running_loop()
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        stats = {rid: EngineStats.from_dict(r.routing_stats) for rid, r in by_id.items()}
        self._note_reports(stats)
        call = engine_call(pending_request)
        if call is None or pending_request is None:
            return [candidate_replicas]
        rid = pending_request.metadata.internal_request_id
        now = time.time()
        req = await self.routing.request(rid, *call, self.routing.block_size(stats), now)
        if req is None:
            return [candidate_replicas]
        matches, lookup = await self._lookup(req.block_hashes, list(by_id))
        books = self.books
        with self._lock:
            snap = self.routing.snapshot(stats, books.ledger, now)
            arm = books.arm_for(req)
        with self._tracer.start_as_current_span("cp.router.decide") as span:
            decision = books.decide(req, snap, matches, arm)
            set_decision_attributes(
                span,
                arm=arm.name,
                policy=arm.policy,
                reason=decision.reason,
                replica=decision.replica_id,
                predicted_hit_blocks=decision.expected_hit_blocks,
            )
        if decision.replica_id is None:
            return [candidate_replicas]
        with self._lock:
            old = self._routed.pop(rid, None)  # a second pass (every replica was full)
            withdrawn = (books.finish(old, None) or []) if old is not None else []
            routed, ops = books.commit(req, decision, snap, arm, now, lookup=lookup)
            ops = withdrawn + ops
            self._routed[rid] = routed
            self._snapshots[rid] = snap
        if old is None:  # a request cancelled while it waits for a replica is never routed

            def on_done(future: asyncio.Future[Any], rid: str = rid) -> None:
                if future.cancelled():
                    self._cancelled(rid)

            pending_request.future.add_done_callback(on_done)
        await self._apply(ops)
        pending_request.kwargs["routing"] = {
            "arm": arm.name,
            "policy": arm.policy,
            "reason": str(decision.reason),
            "predicted_hit_tokens": routed.predicted_hit_tokens,
        }
        ranked = [r for r in decision.ranked if r in by_id]
        tiers = [[by_id[r]] for r in ranked]
        rest = [r for r in candidate_replicas if r.replica_id.unique_id not in set(ranked)]
        return [*tiers, rest] if rest else tiers

    def _note_reports(self, stats: dict[str, EngineStats | None]) -> None:
        """A newer report of a replica includes what was sent to it before that report."""
        with self._lock:
            for rid, s in stats.items():
                if s is not None and s.reported_at > self._reported.get(rid, 0.0):
                    self._reported[rid] = s.reported_at
                    self.books.ledger.scraped(rid, s.reported_at)

    async def _lookup(
        self, hashes: tuple[int, ...], candidates: list[str]
    ) -> tuple[dict[str, PrefixMatch], str]:
        if not hashes:
            return {}, "miss"
        found = await self._open_index().lookup(hashes, candidates)
        if found is None:
            return {}, "unknown"
        return found, "hit" if found else "miss"

    def _open_index(self) -> RouterIndex:
        """The prefix index, opened on the routing loop at first use (its connections belong
        to that loop): the shared one in Redis, else a process-local one."""
        if self._index is None:
            self._index = open_index(self._index_config)
        return self._index

    async def _apply(self, ops: list[IndexOp]) -> None:
        index = self._open_index()
        for op in ops:
            if isinstance(op, Speculate):
                await index.speculate(op.replica_id, op.hashes, op.ttl_s)
            else:
                await index.retract(op.replica_id, op.hashes, op.grace_s)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run `coro` on the routing loop, from whichever thread Serve calls a hook on."""
        loop = self._loop
        if loop is None or loop.is_closed():
            coro.close()
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            fut: asyncio.Future[None] = loop.create_task(coro)
        else:
            fut = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop), loop=loop)
        self._background.add(fut)
        fut.add_done_callback(self._background.discard)

    # -- hooks -----------------------------------------------------------------------------------
    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        rid = pending_request.metadata.internal_request_id
        actual = replica_id.unique_id
        with self._lock:
            routed = self._routed.get(rid)
            snap = self._snapshots.pop(rid, None)
            if routed is None:
                return
            ops: list[IndexOp] = []
            if routed.replica_id != actual and snap is not None:
                # the first choice was full: Serve sent it to a later tier
                withdrawn = self.books.finish(routed, None) or []
                decision = replace(routed.decision, replica_id=actual, expected_hit_blocks=0)
                routed, ops = self.books.commit(
                    routed.request, decision, snap, routed.arm, time.time(), lookup=routed.lookup
                )
                ops = withdrawn + ops
                self._routed[rid] = routed
        if ops:
            self._spawn(self._apply(ops))
        tags = {
            "deployment": self._deployment,
            "arm": routed.arm.name,
            "policy": routed.arm.policy,
            "reason": str(routed.decision.reason),
        }
        if self._decisions is not None:
            self._decisions.inc(1.0, tags=tags)

    def _cancelled(self, rid: str) -> None:
        """The caller gave up before Serve sent the request anywhere: close its booking."""
        with self._lock:
            self._snapshots.pop(rid, None)
            routed = self._routed.pop(rid, None)
            ops = (self.books.finish(routed, None) or []) if routed is not None else []
        if ops:  # its speculative entry goes with it
            self._spawn(self._apply(ops))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        with self._lock:
            self._snapshots.pop(internal_request_id, None)
            routed = self._routed.pop(internal_request_id, None)
            if routed is None:
                return
            ops = self.books.first_token(routed)  # the retraction after the events' grace
            self.books.finish(routed, None)
        if ops:
            self._spawn(self._apply(ops))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        gone = replica_id.unique_id
        with self._lock:
            for rid, routed in list(self._routed.items()):
                if routed.replica_id == gone:
                    self.books.finish(routed, None)
                    del self._routed[rid]
            self.books.ledger.drop_replica(gone)
        self._spawn(self._open_index().clear(gone))

    async def aclose(self) -> None:
        """Close the index (tests; Serve drops routers with their handles)."""
        for fut in list(self._background):
            with contextlib.suppress(Exception):
                await fut
        if self._index is not None:
            await self._index.aclose()
            self._index = None


def _decision_counter() -> Any:
    """`cp_serve_decisions_total` as a Ray metric; None outside a Ray worker or driver."""
    try:
        from ray.util.metrics import Counter

        return Counter(
            "cp_serve_decisions_total",
            description="Requests routed by our RequestRouter, by decision reason.",
            tag_keys=("deployment", "arm", "policy", "reason"),
        )
    except Exception:
        return None


__all__ = ["ENGINE_METHOD", "PolicyRequestRouter", "engine_call"]
