"""The routing path of the live router: from a validated OpenAI request to a reserved replica.

    route(body)                                      per request, in this order:
      1. model check, max_tokens limit                (4xx before any work)
      2. tokens: the configured tokenizer; prompt-token limit
      3. block hashes at the fleet's block size, scoped by model and the request's cache salt
         (the tenant's, a public prefix's, or in open mode the client's: `SaltPolicy`)
      4. arm = assign_arm(arms, sticky key)           (A/B split; one arm without a split)
      5. matches = index.lookup(hashes, routable)     None = unknown: route on load, counted
      6. decision = arm.policy.choose(request, fleet.snapshot(), matches)   pure
      7. commit: policy.on_routed, ledger.reserve, index.speculate     BEFORE the request is sent
    reroute(routed)    the upstream never accepted it: move the reservation to the next candidate
    first_token(routed)                               ledger -> decoding, retract speculation
    finish(routed, output_tokens)                     exactly once, however the request ended

The policy objects, ledger, load estimate and predictor are the simulator's own; only the
producers differ (scraped metrics, the shared index, this module's clock).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any

from controlplane.errors import (
    ModelNotFoundError,
    NoReadyReplicaError,
    PromptTooLongError,
    RequestError,
)
from controlplane.hashing import BlockHasher, scope_key
from controlplane.routing.ab import Arm, arms_from_config, assign_arm, sticky_key_for
from controlplane.routing.interfaces import RoutingPolicy
from controlplane.routing.ledger import RouterLedger
from controlplane.routing.policies import make_policy
from controlplane.routing.predictor import OutputLengthPredictor
from controlplane.tenancy.model import Tenant
from controlplane.tenancy.salts import SaltPolicy
from controlplane.tokenization import PromptTokenizer, TokenizationError, Tokenized
from controlplane.types import Decision, PrefixMatch, RoutingRequest
from router.config import RouterSettings
from router.fleet.index import RouterIndex
from router.fleet.live_fleet import LiveFleet
from router.http.openai_api import ChatCompletionRequest, CompletionRequest
from router.http.prompts import sequences
from router.telemetry import RouterMetrics

DEFAULT_BLOCK_SIZE = 16
# hashers kept per (salt scope, block size); open-mode client salts are unbounded
MAX_HASHERS = 4096


@dataclass(slots=True)
class Routed:
    """One request's routing state, from `route` to `finish`."""

    request_id: str
    arm: Arm
    policy: RoutingPolicy
    request: RoutingRequest
    decision: Decision
    replica_id: str
    lookup: str  # hit | miss | unknown
    started_s: float
    tried: list[str] = field(default_factory=list)
    decoding: bool = False
    finished: bool = False

    @property
    def predicted_hit_tokens(self) -> int:
        return self.decision.expected_hit_blocks * self.request.block_size


class RouterCore:
    def __init__(
        self,
        settings: RouterSettings,
        fleet: LiveFleet,
        index: RouterIndex,
        tokenizer: PromptTokenizer,
        metrics: RouterMetrics,
        *,
        ledger: RouterLedger,
        salts: SaltPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.fleet = fleet
        self.index = index
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.ledger = ledger
        self.clock = clock
        self.arms = arms_from_config(settings.policy)
        self.policies: dict[str, RoutingPolicy] = {
            a.name: make_policy(a.policy, **a.params) for a in self.arms
        }
        self.predictor = OutputLengthPredictor()
        self.salts = salts or SaltPolicy(b"")
        self._secret = os.environ.get(settings.hash_secret_env, "").encode()
        self._hashers: OrderedDict[tuple[str, int], BlockHasher] = OrderedDict()
        self._background: set[asyncio.Task[None]] = set()

    # -- 1..3: the request ------------------------------------------------------------------------
    async def _tokens(
        self, body: ChatCompletionRequest | CompletionRequest
    ) -> tuple[Tokenized, int]:
        """The prompt's tokens, and the token count of the batch's other prompts (a completion
        batch is routed as one request, on its first prompt)."""
        try:
            if isinstance(body, ChatCompletionRequest):
                msgs = [m.model_dump(exclude_none=True) for m in body.messages]
                chat = await self.tokenizer.tokenize_chat(
                    msgs,
                    add_generation_prompt=body.add_generation_prompt,
                    continue_final_message=body.continue_final_message,
                    chat_template_kwargs=body.chat_template_kwargs,
                    tools=body.tools,
                )
                return chat, 0
            first, *rest = body.prompts()
            tok = await self.tokenizer.tokenize(first)
            extra = 0
            for p in rest:
                extra += len(await self.tokenizer.tokenize(p))
            return tok, extra
        except TokenizationError as exc:
            raise RequestError(f"cannot tokenize the prompt: {exc}") from None

    def _hasher(self, salt: str, block_size: int) -> BlockHasher:
        """The hasher of one salt scope: `scope_key(model, None, salt, secret)`, as the KV-event
        ingestor computes it from the salt vLLM reports on block 0."""
        h = self._hashers.get((salt, block_size))
        if h is None:
            key = scope_key(self.settings.served_model, None, salt, self._secret)
            h = self._hashers[(salt, block_size)] = BlockHasher(block_size, key=key)
            if len(self._hashers) > MAX_HASHERS:
                self._hashers.popitem(last=False)
        else:
            self._hashers.move_to_end((salt, block_size))
        return h

    async def build(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        *,
        request_id: str,
        tenant: Tenant,
        session: str | None,
    ) -> RoutingRequest:
        limits = self.settings.limits
        if body.model != self.settings.served_model:
            raise ModelNotFoundError(
                f"The model `{body.model}` does not exist; this router serves "
                f"`{self.settings.served_model}`."
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
        bs = self.fleet.block_size() or DEFAULT_BLOCK_SIZE
        salt = self.salts.choose(
            tenant,
            tok.token_ids,
            (body.model_extra or {}).get("cache_salt"),
            batch=extra > 0,
        )
        self.metrics.cache_salts.labels(salt.reason).inc()
        hashes = self._hasher(salt.scope, bs).hash_blocks(tok.token_ids)
        tid = tenant.tenant_id
        return RoutingRequest(
            request_id=request_id,
            prompt_tokens=n,
            block_hashes=tuple(hashes),
            tenant=tid,
            priority=tenant.priority,
            model=body.model,
            max_tokens=cap,
            predicted_output_tokens=self.predictor.predict(tid, n, cap),
            session_key=session,
            arrival_s=self.clock(),
            block_size=bs,
            cache_salt=salt.salt,
            sequences=sequences(body),
        )

    # -- 4..7: the decision -----------------------------------------------------------------------
    async def route(self, req: RoutingRequest) -> Routed:
        started = self.clock()
        arm = assign_arm(
            self.arms, sticky_key_for(self.settings.policy, req.tenant, req.session_key)
        )
        policy = self.policies[arm.name]
        routable = [r.replica_id for r in self.fleet.snapshot().routable()]
        if not routable:
            raise NoReadyReplicaError("no ready replica: every replica is loading, ejected or gone")
        t0 = time.perf_counter()
        matches: dict[str, PrefixMatch] | None = await self.index.lookup(req.block_hashes, routable)
        outcome = "unknown" if matches is None else ("hit" if matches else "miss")
        self.metrics.index_lookup_seconds.labels(outcome).observe(time.perf_counter() - t0)
        if matches is None:
            self.metrics.fallbacks.labels("index_unknown").inc()
            matches = {}
        snap = self.fleet.snapshot()
        t0 = time.perf_counter()
        decision = policy.choose(req, snap, matches)
        self.metrics.decision_seconds.labels(arm.policy).observe(time.perf_counter() - t0)
        if decision.replica_id is None:
            raise NoReadyReplicaError("no ready replica for this request")
        routed = Routed(
            request_id=req.request_id,
            arm=arm,
            policy=policy,
            request=req,
            decision=decision,
            replica_id=decision.replica_id,
            lookup=outcome,
            started_s=started,
        )
        policy.on_routed(req, decision, snap)
        await self._commit(routed)
        return routed

    async def _commit(self, routed: Routed) -> None:
        req, rid = routed.request, routed.replica_id
        routed.tried.append(rid)
        hit_tokens = min(req.prompt_tokens, routed.predicted_hit_tokens)
        if self.settings.policy.reservations:
            self.ledger.reserve(
                req.request_id,
                rid,
                req.prompt_tokens,
                req.prompt_tokens - hit_tokens,
                req.predicted_output_tokens,
                self.clock(),
            )
        if self.settings.policy.speculative and req.block_hashes:
            await self.index.speculate(
                rid, req.block_hashes, self.settings.policy.speculative_ttl_s
            )
        self._gauges(rid)

    async def reroute(self, routed: Routed) -> str | None:
        """The upstream never accepted the request: move it to the best untried candidate."""
        snap = self.fleet.snapshot()
        routable = {r.replica_id for r in snap.routable()}
        nxt = next(
            (r for r in routed.decision.ranked if r not in routed.tried and r in routable), None
        )
        if nxt is None:
            nxt = next((r for r in sorted(routable) if r not in routed.tried), None)
        if nxt is None:
            return None
        self._release(routed)
        routed.policy.on_finished(routed.request, routed.replica_id)
        routed.decision = replace(routed.decision, replica_id=nxt, expected_hit_blocks=0)
        routed.replica_id = nxt
        routed.policy.on_routed(routed.request, routed.decision, snap)
        await self._commit(routed)
        return nxt

    # -- lifecycle of the request -----------------------------------------------------------------
    def first_token(self, routed: Routed) -> None:
        if routed.decoding or routed.finished:
            return
        routed.decoding = True
        self.ledger.first_token(routed.request_id)
        routed.policy.on_first_token(routed.request, routed.replica_id)
        if routed.request.block_hashes:
            self._spawn(self.index.retract(routed.replica_id, routed.request.block_hashes, 1.0))
        self._gauges(routed.replica_id)

    def finish(self, routed: Routed, output_tokens: int | None) -> bool:
        """Release everything the request held; True the first time only."""
        if routed.finished:
            return False
        routed.finished = True
        self._release(routed)
        routed.policy.on_finished(routed.request, routed.replica_id)
        if output_tokens:
            self.predictor.observe(
                routed.request.tenant, routed.request.prompt_tokens, output_tokens
            )
        return True

    def _release(self, routed: Routed) -> None:
        self.ledger.release(routed.request_id)
        self._gauges(routed.replica_id)

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
