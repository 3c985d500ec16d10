"""The routing path of the live router: from a validated OpenAI request to a reserved replica.

    route(body)                                      per request, in this order:
      1. model check (the fleet's model groups: 404 listing the served models), max_tokens limit
      2. tokens: the configured tokenizer; prompt-token limit, and prompt + max_tokens within the
         model group's `max_model_len` as the replicas report it (400, as vLLM would answer)
      3. block hashes at the model group's block size, scoped by model and the request's salt
         (the tenant's, a public prefix's, or in open mode the client's: `SaltPolicy`)
      4. arm = books.arm_for(request)                  (A/B split; one arm without a split)
      5. matches = index.lookup(hashes, routable)     routable = the model group's members;
                                                      a drifted member's match is dropped
                                                      (scored as a miss); None = unknown
         (with Redis, `prefetch` starts it before the quota and the fair queue, over every
         routable replica; a fresh result is narrowed to the replicas the request may use)
      6. decision = books.decide(request, fleet.snapshot(), matches, arm)   pure
      7. books.commit -> index ops applied (speculate) BEFORE the request is sent
    reroute(routed)    the upstream never accepted it: move the reservation to the next candidate
    first_token(routed)                               ledger -> decoding, retract speculation
    finish(routed, output_tokens)                     exactly once, however the request ended

Steps 4-7 and the lifecycle are `controlplane.routing.books.RoutingBooks`, the object the
simulator drives too; this module adds what only a live router has: tokenization, the index's
I/O (it applies the operations the books return), the fleet's scraped snapshot and metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from controlplane.errors import (
    ModelNotFoundError,
    NoReadyReplicaError,
    PromptTooLongError,
    RequestError,
)
from controlplane.hashing import BlockHasher, scope_key
from controlplane.routing.books import IndexOp, Retract, Routed, RoutingBooks, Speculate
from controlplane.tenancy.model import Tenant
from controlplane.tenancy.salts import SaltPolicy
from controlplane.tokenization import (
    LocalTokenizer,
    PromptTokenizer,
    TokenizationError,
    Tokenized,
)
from controlplane.types import FleetSnapshot, PrefixMatch, RoutingRequest
from router.config import RouterSettings
from router.fleet.index import RouterIndex
from router.fleet.live_fleet import LiveFleet
from router.http.lean import OpenAIRequest, from_model
from router.http.openai_api import ChatCompletionRequest, CompletionRequest
from router.http.prompts import sequences
from router.telemetry import RouterMetrics

if TYPE_CHECKING:
    from router.scope import Outcome, RequestScope

DEFAULT_BLOCK_SIZE = 16
# hashers kept per (salt scope, block size); open-mode client salts are unbounded
MAX_HASHERS = 4096
# bodies larger than this are tokenized in a worker thread (about a millisecond of tokenizer
# and template work, measured on the tiny model's tokenizer); smaller ones inline, where a
# thread hop would cost more than the work
THREAD_BYTES = 16 * 1024


# a prefetched lookup older than this (the request waited in the fair queue) is done again
PREFETCH_FRESH_S = 0.05


@dataclass(slots=True)
class Prefetch:
    """An index lookup started before the request's turn (see `RouterCore.prefetch`)."""

    task: asyncio.Future[dict[str, PrefixMatch] | None]
    replicas: frozenset[str]
    started: float


def _quiet(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


def _tokenize_batch(tok: LocalTokenizer, prompts: list[str | list[int]]) -> tuple[Tokenized, int]:
    """The first prompt's tokens and the others' count, synchronously (in a worker thread)."""
    first, *rest = (tok.tokenize_sync(p) for p in prompts)
    return first, sum(len(t) for t in rest)


def _needed(req: RoutingRequest) -> int:
    """The context a request needs, as vLLM counts it: prompt + max_tokens (or one token)."""
    return req.prompt_tokens + (req.max_tokens or 1)


class RouterCore:
    def __init__(
        self,
        settings: RouterSettings,
        fleet: LiveFleet,
        index: RouterIndex,
        tokenizer: PromptTokenizer,
        metrics: RouterMetrics,
        *,
        books: RoutingBooks,
        salts: SaltPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.fleet = fleet
        self.index = index
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.books = books
        self.ledger = books.ledger
        self.clock = clock
        self.salts = salts or SaltPolicy(b"")
        self._secret = os.environ.get(settings.hash_secret_env, "").encode()
        self._hashers: OrderedDict[tuple[str, str, int], BlockHasher] = OrderedDict()
        self._background: set[asyncio.Task[None]] = set()
        # told of every committed decision (the status view's ring: router/status/ring.py)
        self.observers: list[Callable[[Routed], None]] = []

    # -- 1..3: the request ------------------------------------------------------------------------
    async def _tokens(self, req: OpenAIRequest) -> tuple[Tokenized, int]:
        """The prompt's tokens, and the token count of the batch's other prompts (a completion
        batch is routed as one request, on its first prompt). A long prompt is tokenized in a
        worker thread (the tokenizer releases the GIL), so the event loop keeps serving."""
        tok = self.tokenizer
        local = tok if isinstance(tok, LocalTokenizer) else None
        try:
            if req.messages is not None:
                kwargs: dict[str, Any] = {
                    "add_generation_prompt": req.add_generation_prompt,
                    "continue_final_message": req.continue_final_message,
                    "chat_template_kwargs": req.chat_template_kwargs,
                    "tools": req.tools,
                }
                if local is not None and len(req.body) > THREAD_BYTES:
                    encode = functools.partial(local.encode_chat, req.messages, **kwargs)
                    return await asyncio.to_thread(encode), 0
                return await tok.tokenize_chat(req.messages, **kwargs), 0
            assert req.prompts is not None
            first, *rest = req.prompts
            if local is not None and len(req.body) > THREAD_BYTES:
                return await asyncio.to_thread(_tokenize_batch, local, req.prompts)
            tokd = await tok.tokenize(first)
            extra = 0
            for p in rest:
                extra += len(await tok.tokenize(p))
            return tokd, extra
        except TokenizationError as exc:
            raise RequestError(f"cannot tokenize the prompt: {exc}") from None

    def _hasher(self, model: str, salt: str, block_size: int) -> BlockHasher:
        """The hasher of one salt scope: `scope_key(model, None, salt, secret)`, as the KV-event
        ingestor computes it from the salt vLLM reports on block 0."""
        k = (model, salt, block_size)
        h = self._hashers.get(k)
        if h is None:
            key = scope_key(model, None, salt, self._secret)
            h = self._hashers[k] = BlockHasher(block_size, key=key)
            if len(self._hashers) > MAX_HASHERS:
                self._hashers.popitem(last=False)
        else:
            self._hashers.move_to_end(k)
        return h

    def served_models(self) -> tuple[str, ...]:
        """The models of the fleet's groups; before any replica is admitted, the configured one."""
        return self.fleet.groups.models or (self.settings.served_model,)

    async def build(
        self,
        body: OpenAIRequest | ChatCompletionRequest | CompletionRequest,
        *,
        request_id: str,
        tenant: Tenant,
        session: str | None,
    ) -> RoutingRequest:
        if not isinstance(body, OpenAIRequest):  # a validated model (tests, embedders)
            raw = body.model_dump_json(exclude_unset=True).encode()
            body = from_model(body, raw, json.loads(raw))
        limits = self.settings.limits
        served = self.served_models()
        if body.model not in served:
            listed = ", ".join(f"`{m}`" for m in served)
            raise ModelNotFoundError(
                f"The model `{body.model}` does not exist; this router serves {listed}."
            )
        cap = body.output_cap
        if cap is not None and cap > limits.max_tokens:
            raise RequestError(f"max_tokens {cap} exceeds this router's limit {limits.max_tokens}")
        tok, extra = await self._tokens(body)
        n = len(tok.token_ids) + extra
        if n > limits.max_prompt_tokens:
            raise PromptTooLongError(
                f"the prompt has {n} tokens; this router accepts at most {limits.max_prompt_tokens}"
            )
        group = self.fleet.groups.get(body.model)
        context = group.max_model_len if group is not None else None
        # vLLM refuses prompt + max_tokens beyond max_model_len; with no max_tokens, a prompt
        # must leave room for one generated token
        if context is not None and n + (cap or 1) > context:
            raise PromptTooLongError(
                f"This model's maximum context length is {context} tokens. However, you "
                f"requested {n + (cap or 1)} tokens ({n} in the prompt, {cap or 1} for the "
                f"completion). Please reduce the length of the prompt or max_tokens."
            )
        bs = self.fleet.block_size(body.model) or DEFAULT_BLOCK_SIZE
        salt = self.salts.choose(
            tenant,
            tok.token_ids,
            body.client_salt,
            batch=extra > 0,
        )
        self.metrics.cache_salts.labels(salt.reason).inc()
        hashes = self._hasher(body.model, salt.scope, bs).hash_blocks(tok.token_ids)
        tid = tenant.tenant_id
        return RoutingRequest(
            request_id=request_id,
            prompt_tokens=n,
            block_hashes=tuple(hashes),
            tenant=tid,
            priority=tenant.priority,
            model=body.model,
            max_tokens=cap,
            predicted_output_tokens=self.books.predict(tid, n, cap),
            session_key=session,
            arrival_s=self.clock(),
            block_size=bs,
            cache_salt=salt.salt,
            sequences=sequences(body),
        )

    # -- 4..7: the decision -----------------------------------------------------------------------
    def prefetch(self, req: RoutingRequest) -> Prefetch | None:
        """Start the index lookup now, over every routable replica, so that its round trip to
        Redis overlaps the quota's (None: nothing to overlap, the in-memory index answers at
        once). `route` uses it while fresh, narrowed to the replicas it may choose."""
        if self.index.kind == "memory" or not req.block_hashes:
            return None
        routable = self._group_routable(req.model)
        if not routable:
            return None
        task = asyncio.ensure_future(self.index.lookup(req.block_hashes, routable))
        return Prefetch(task, frozenset(routable), time.perf_counter())

    @staticmethod
    def discard(prefetched: Prefetch | None) -> None:
        """A prefetched lookup that will not be used: let it finish on its own (a lookup never
        raises; cancelling it mid-call would cost its Redis connection)."""
        if prefetched is not None and not prefetched.task.done():
            prefetched.task.add_done_callback(_quiet)

    async def _lookup(
        self, req: RoutingRequest, routable: list[str], prefetched: Prefetch | None
    ) -> tuple[dict[str, PrefixMatch] | None, float]:
        if prefetched is not None:
            fresh = time.perf_counter() - prefetched.started < PREFETCH_FRESH_S
            if fresh and prefetched.replicas.issuperset(routable):
                found = await prefetched.task
                took = time.perf_counter() - prefetched.started
                if found is None:
                    return None, took
                return {r: m for r, m in found.items() if r in routable}, took
            self.discard(prefetched)
        t0 = time.perf_counter()
        matches = await self.index.lookup(req.block_hashes, routable)
        return matches, time.perf_counter() - t0

    async def route(
        self,
        req: RoutingRequest,
        *,
        allowed: frozenset[str] | None = None,
        prefetched: Prefetch | None = None,
    ) -> Routed:
        """Choose a replica (among `allowed`, the ones the fair queue found room on, when any of
        them is still routable) and book it."""
        books = self.books
        arm = books.arm_for(req)
        routable = self._group_routable(req.model, _needed(req))
        if not routable:
            self.discard(prefetched)
            raise NoReadyReplicaError(
                f"no ready replica for model `{req.model}`: every replica serving it is "
                "loading, ejected or gone"
            )
        if allowed:
            routable = [r for r in routable if r in allowed] or routable
        matches, took = await self._lookup(req, routable, prefetched)
        outcome = "unknown" if matches is None else ("hit" if matches else "miss")
        self.metrics.index_lookup_seconds.labels(outcome).observe(took)
        if matches is None:
            self.metrics.fallbacks.labels("index_unknown").inc()
            matches = {}
        group = self.fleet.groups.get(req.model)
        if group is not None and group.affinity_excluded:
            # a drifted replica's blocks are not hashed as the group's: its match is a miss
            matches = {r: m for r, m in matches.items() if r not in group.affinity_excluded}
        snap = self.fleet.snapshot()
        members = self._members(req.model, _needed(req))
        if members is not None:
            snap = FleetSnapshot(
                tuple(r for r in snap.replicas if r.replica_id in members), snap.now_s
            )
        if allowed:
            narrowed = tuple(r for r in snap.replicas if r.replica_id in allowed and r.routable)
            if narrowed:
                snap = FleetSnapshot(narrowed, snap.now_s)
        t0 = time.perf_counter()
        decision = books.decide(req, snap, matches, arm)
        self.metrics.decision_seconds.labels(arm.policy).observe(time.perf_counter() - t0)
        if decision.replica_id is None:
            raise NoReadyReplicaError("no ready replica for this request")
        routed, ops = books.commit(req, decision, snap, arm, self.clock(), lookup=outcome)
        for observe in self.observers:
            observe(routed)
        await self._apply(ops)
        self._gauges(routed.replica_id)
        return routed

    def _members(self, model: str, tokens: int = 0) -> frozenset[str] | None:
        """The replicas serving `model` whose context holds `tokens` (None: no groups yet,
        every replica)."""
        group = self.fleet.groups.get(model)
        if group is not None:
            return group.fitting(tokens) if tokens else group.members
        return frozenset() if self.fleet.groups.groups else None

    def _group_routable(self, model: str, tokens: int = 0) -> list[str]:
        members = self._members(model, tokens)
        return [
            r.replica_id
            for r in self.fleet.snapshot().routable()
            if members is None or r.replica_id in members
        ]

    async def _apply(self, ops: list[IndexOp]) -> None:
        """The books' index operations: speculation before the request is sent (awaited),
        retraction in the background."""
        for op in ops:
            if isinstance(op, Speculate):
                await self.index.speculate(op.replica_id, op.hashes, op.ttl_s)
            else:
                self._spawn(self.index.retract(op.replica_id, op.hashes, op.grace_s))

    async def reroute(self, routed: Routed) -> str | None:
        """The upstream never accepted the request: move it to the best untried candidate."""
        old = routed.replica_id
        snap = self.fleet.snapshot()
        members = self._members(routed.request.model, _needed(routed.request))
        if members is not None:  # never to a replica of another model (or a shorter context)
            snap = FleetSnapshot(
                tuple(r for r in snap.replicas if r.replica_id in members), snap.now_s
            )
        ops = self.books.reroute(routed, snap, self.clock())
        if ops is None:
            return None
        self._gauges(old)
        await self._apply(ops)
        self._gauges(routed.replica_id)
        return routed.replica_id

    # -- lifecycle of the request -----------------------------------------------------------------
    def first_token(self, routed: Routed) -> None:
        if routed.decoding or routed.finished:
            return
        self._retract(self.books.first_token(routed))
        self._gauges(routed.replica_id)

    def finish(self, routed: Routed, output_tokens: int | None) -> bool:
        """Release everything the request held; True the first time only."""
        ops = self.books.finish(routed, output_tokens)
        if ops is None:
            return False
        self._retract(ops)  # it never had a first token: its speculative entry goes with it
        self._gauges(routed.replica_id)
        return True

    def _retract(self, ops: list[IndexOp]) -> None:
        """The books' retractions, in the background (a request's life has only these)."""
        for op in ops:
            if isinstance(op, Retract):
                self._spawn(self.index.retract(op.replica_id, op.hashes, op.grace_s))

    # -- the request scope's hooks (router/scope.py) ----------------------------------------------
    def on_admitted(self, scope: RequestScope) -> None:
        return None

    def on_routed(self, scope: RequestScope) -> None:
        return None

    def on_first_token(self, scope: RequestScope) -> None:
        if scope.routed is not None:
            self.first_token(scope.routed)

    def on_tokens(self, scope: RequestScope, n: int) -> None:
        return None

    def on_end(self, scope: RequestScope, outcome: Outcome) -> None:
        if scope.routed is not None:
            usage = scope.usage
            self.finish(scope.routed, usage.completion_tokens if usage else None)

    def _gauges(self, replica_id: str) -> None:
        view = self.ledger.view(replica_id)
        self.metrics.outstanding_requests.labels(replica_id).set(view.requests)
        self.metrics.outstanding_tokens.labels(replica_id).set(
            view.prefill_tokens + view.decode_tokens
        )

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def aclose(self) -> None:
        for task in list(self._background):
            task.cancel()
        for task in list(self._background):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
