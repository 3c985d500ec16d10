"""A router's reservations: its own in-flight requests per replica, kept exactly.

Reserved when a request is routed (before it is sent), moved to "decoding" at its first token,
released exactly once when it ends in any way. `unscraped_requests` counts requests routed after
the replica's last metrics scrape, the ones its metrics cannot show yet.
"""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.types import Ledger


@dataclass(slots=True)
class InFlight:
    replica_id: str
    prompt_tokens: int
    uncached_tokens: int
    predicted_output: int
    sent_s: float
    decoding: bool = False


@dataclass(slots=True)
class _Totals:
    requests: int = 0
    prefill_tokens: int = 0
    pending_prompt_tokens: int = 0
    decoding: int = 0
    decode_tokens: int = 0
    context_tokens: int = 0
    unscraped: int = 0
    scraped_s: float = float("-inf")
    last_sent_s: float = float("-inf")
    # bumped on every change, so a router can reuse its view of an unchanged replica
    version: int = 0


class RouterLedger:
    """Per-replica totals of this router's in-flight requests."""

    def __init__(self) -> None:
        self._inflight: dict[str, InFlight] = {}
        self._totals: dict[str, _Totals] = {}

    def __len__(self) -> int:
        return len(self._inflight)

    def reserve(
        self,
        request_id: str,
        replica_id: str,
        prompt_tokens: int,
        uncached_tokens: int,
        predicted_output: int,
        now_s: float,
    ) -> None:
        if request_id in self._inflight:
            raise ValueError(f"request {request_id} is already reserved")
        f = InFlight(replica_id, prompt_tokens, uncached_tokens, predicted_output, now_s)
        self._inflight[request_id] = f
        t = self._totals.setdefault(replica_id, _Totals())
        t.version += 1
        t.requests += 1
        t.prefill_tokens += uncached_tokens
        t.pending_prompt_tokens += prompt_tokens
        t.decode_tokens += predicted_output
        t.context_tokens += prompt_tokens
        t.last_sent_s = max(t.last_sent_s, now_s)
        if now_s > t.scraped_s:
            t.unscraped += 1

    def first_token(self, request_id: str) -> None:
        f = self._inflight.get(request_id)
        if f is None or f.decoding:
            return
        f.decoding = True
        t = self._totals[f.replica_id]
        t.version += 1
        t.prefill_tokens -= f.uncached_tokens
        t.pending_prompt_tokens -= f.prompt_tokens
        t.decoding += 1

    def release(self, request_id: str) -> InFlight | None:
        """Forget a request; returns None if it was not reserved (idempotent)."""
        f = self._inflight.pop(request_id, None)
        if f is None:
            return None
        t = self._totals[f.replica_id]
        t.version += 1
        t.requests -= 1
        t.decode_tokens -= f.predicted_output
        t.context_tokens -= f.prompt_tokens
        if f.decoding:
            t.decoding -= 1
        else:
            t.prefill_tokens -= f.uncached_tokens
            t.pending_prompt_tokens -= f.prompt_tokens
        if f.sent_s > t.scraped_s:
            t.unscraped -= 1
        return f

    def scraped(self, replica_id: str, now_s: float) -> None:
        """The replica's metrics were refreshed at `now_s`: everything sent before is visible."""
        t = self._totals.setdefault(replica_id, _Totals())
        t.version += 1
        t.scraped_s = now_s
        if now_s >= t.last_sent_s:
            t.unscraped = 0
        else:  # a scrape taken before some reservations but reported after them
            later = [f for f in self._inflight.values() if f.sent_s > now_s]
            t.unscraped = sum(1 for f in later if f.replica_id == replica_id)

    def version(self, replica_id: str) -> int:
        t = self._totals.get(replica_id)
        return t.version if t is not None else 0

    def view(self, replica_id: str) -> Ledger:
        t = self._totals.get(replica_id)
        if t is None or t.requests == 0:
            return Ledger()
        return Ledger(
            requests=t.requests,
            prefill_tokens=t.prefill_tokens,
            pending_prompt_tokens=t.pending_prompt_tokens,
            decoding=t.decoding,
            decode_tokens=t.decode_tokens,
            context_tokens=t.context_tokens,
            unscraped_requests=t.unscraped,
        )

    def drop_replica(self, replica_id: str) -> list[str]:
        """Release every request on a replica (it died); returns their ids."""
        ids = [rid for rid, f in self._inflight.items() if f.replica_id == replica_id]
        for rid in ids:
            self.release(rid)
        return ids
