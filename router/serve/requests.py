"""From an engine call's arguments to the policy's inputs, with no Ray: `ServeRouting`.

    request  = await routing.request(request_id, path, body, block_size)   RoutingRequest | None
    snapshot = routing.snapshot(stats_by_replica, ledger, now)              FleetSnapshot

`request` reads the OpenAI body an engine deployment's `handle(method, path, headers, body)`
carries, exactly as the standalone router does (`router.http.lean.parse`; the same tokenizer,
chat template and options; block hashes at the engines' block size, scoped by the model and the
body's `cache_salt`, keyed by `$CP_HASH_SECRET`: the scope the KV-event follower writes under).
None when the call is not a generation, the body is not plainly valid, or the prompt cannot be
tokenized: the engine answers those (with its own error), the router just picks a replica by
load.

`snapshot` is the fleet as the policies know it: one READY `ReplicaState` per candidate, its
engine figures from the replica's last routing stats (`EngineStats`), its roofline profile from
the roofline keys, block size and KV blocks it reports, and this router's own in-flight work on it
(the routing books' ledger). A replica that has not reported yet is modelled with the fleet's
first reported profile (before any report: the configured `gpu`, `roofline_model` and
`block_size`) and no engine load.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import lru_cache

from controlplane.hashing import BlockHasher, scope_key
from controlplane.roofline.profile import EngineProfile, profile
from controlplane.routing.books import RoutingBooks
from controlplane.routing.ledger import RouterLedger
from controlplane.tokenization import TokenizationError, open_tokenizer
from controlplane.types import EngineMetrics, FleetSnapshot, Phase, ReplicaState, RoutingRequest
from router.http.lean import Endpoint, parse
from router.http.prompts import sequences
from router.serve.stats import EngineStats

ENDPOINTS: dict[str, Endpoint] = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}


@lru_cache(maxsize=64)
def _profile(
    gpu: str, model: str, tp: int, block_size: int, blocks: int, length: int
) -> EngineProfile:
    return profile(
        gpu,
        model,
        tp=tp,
        block_size=block_size,
        num_gpu_blocks_override=blocks,
        max_model_len=length,
    )


def profile_of(stats: EngineStats) -> EngineProfile:
    """The roofline profile of a replica's report (cached: reports repeat)."""
    return _profile(
        stats.gpu,
        stats.roofline_model,
        stats.tp,
        stats.block_size,
        stats.num_gpu_blocks,
        stats.max_model_len,
    )


class ServeRouting:
    """The tokenizer, hashers and books one RequestRouter routes with."""

    def __init__(
        self,
        books: RoutingBooks,
        *,
        model: str,
        tokenizer: str | None,
        hash_secret_env: str = "CP_HASH_SECRET",
        gpu: str = "cpu",
        roofline_model: str = "tiny-llama",
        block_size: int = 32,
    ) -> None:
        self.books = books
        self.model = model
        # what a replica is modelled as before it reports (its report overrides all three)
        self.default_profile = _profile(gpu, roofline_model, 1, block_size, 0, 0)
        self.tokenizer = open_tokenizer(tokenizer, model=model)
        self.secret = os.environ.get(hash_secret_env, "").encode()
        self._hashers: dict[tuple[str, int], BlockHasher] = {}

    def _hasher(self, salt: str, block_size: int) -> BlockHasher:
        key = (salt, block_size)
        h = self._hashers.get(key)
        if h is None:
            if len(self._hashers) > 1024:
                self._hashers.clear()
            h = self._hashers[key] = BlockHasher(
                block_size, key=scope_key(self.model, None, salt, self.secret)
            )
        return h

    async def request(
        self, request_id: str, path: str, body: bytes, block_size: int, now: float
    ) -> RoutingRequest | None:
        endpoint = ENDPOINTS.get(path.partition("?")[0])
        req = parse(body, endpoint) if endpoint is not None else None
        if req is None or req.model != self.model:
            return None
        tok = self.tokenizer
        try:
            if req.messages is not None:
                tokd = await tok.tokenize_chat(
                    req.messages,
                    add_generation_prompt=req.add_generation_prompt,
                    continue_final_message=req.continue_final_message,
                    chat_template_kwargs=req.chat_template_kwargs,
                    tools=req.tools,
                )
            else:
                assert req.prompts is not None
                tokd = await tok.tokenize(req.prompts[0])
        except TokenizationError:
            return None
        salt = req.client_salt if isinstance(req.client_salt, str) else ""
        ids = tokd.token_ids
        n = len(ids)
        cap = req.output_cap
        return RoutingRequest(
            request_id=request_id,
            prompt_tokens=n,
            block_hashes=tuple(self._hasher(salt, block_size).hash_blocks(ids)),
            model=req.model,
            max_tokens=cap,
            predicted_output_tokens=self.books.predict("default", n, cap),
            arrival_s=now,
            block_size=block_size,
            cache_salt=salt or None,
            sequences=sequences(req),
        )

    def snapshot(
        self, stats: Mapping[str, EngineStats | None], ledger: RouterLedger, now: float
    ) -> FleetSnapshot:
        reported = [s for s in stats.values() if s is not None]
        fallback = profile_of(reported[0]) if reported else self.default_profile
        states = []
        for rid, s in stats.items():
            metrics = EngineMetrics()
            if s is not None:
                metrics = EngineMetrics(s.running, s.waiting, s.kv_usage, s.reported_at)
            states.append(
                ReplicaState(
                    replica_id=rid,
                    profile=profile_of(s) if s is not None else fallback,
                    phase=Phase.READY,
                    metrics=metrics,
                    ledger=ledger.view(rid),
                )
            )
        return FleetSnapshot(tuple(states), now)

    def block_size(self, stats: Mapping[str, EngineStats | None]) -> int:
        """The engines' block size (the first reported; the configured one before any)."""
        reported = (s.block_size for s in stats.values() if s is not None)
        return next(reported, self.default_profile.resolved_block_size)


__all__ = ["ENDPOINTS", "ServeRouting", "profile_of"]
