"""The trace format every loader and generator produces, and its expansion into engine blocks.

A trace request never carries text. Its content is described by *chained content ids* at some
granularity (`id_block_tokens`, e.g. Mooncake's 512): equal id at position i means equal content
for the first (i + 1) * id_block_tokens tokens (the last id may cover a partial block). The
simulator maps them onto engine blocks of B tokens (B must divide `id_block_tokens`):

    engine block j covers tokens [j*B, (j+1)*B) and lies inside content block t = j*B // g
    hash(j) = ids[t] * (g // B) + (j mod g // B)        if (j+1)*B <= id_tokens
            = unique to the request                      otherwise

Because ids are already chained, (id, sub-block) identifies the whole prefix up to that engine
block; nothing is re-chained. Blocks past `id_tokens` (the tokens the ids describe, by default the
prompt) hold content nobody else has, e.g. generated text, and get a per-request unique hash.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from itertools import chain

from controlplane.errors import TraceError
from controlplane.types import PriorityClass


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a workload: when it arrives, how long it is, what content it shares."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    # chained content ids of `id_block_tokens` tokens each; empty = nothing shared
    content_ids: tuple[int, ...] = ()
    id_block_tokens: int = 512
    # tokens the ids describe (default: the prompt); may extend into the output for sessions
    id_tokens: int = -1
    tenant: str = "default"
    priority: PriorityClass = PriorityClass.INTERACTIVE
    session_key: str | None = None
    # the client's max_tokens, if it sent one (otherwise the server's limit applies)
    max_tokens: int | None = None
    request_id: str = ""

    @property
    def described_tokens(self) -> int:
        return self.prompt_tokens if self.id_tokens < 0 else self.id_tokens

    def engine_block_hashes(self, block_size: int) -> list[int]:
        """Chained hashes of the engine blocks whose content the ids describe."""
        g = self.id_block_tokens
        if not self.content_ids:
            return []
        if g % block_size:
            raise TraceError(
                f"engine block size {block_size} does not divide the trace's {g}-token blocks"
            )
        per = g // block_size
        full = min(self.described_tokens // block_size, len(self.content_ids) * per)
        ids = self.content_ids[: -(-full // per)]
        out = list(chain.from_iterable(range(i * per, i * per + per) for i in ids))
        del out[full:]
        return out


@dataclass(frozen=True, slots=True)
class Trace:
    """A named, time-ordered list of requests."""

    name: str
    requests: tuple[TraceRequest, ...]
    # free-form provenance: source file, generator parameters, scaling applied
    meta: dict[str, object] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)

    @property
    def duration_s(self) -> float:
        if not self.requests:
            return 0.0
        return self.requests[-1].arrival_s - self.requests[0].arrival_s

    def sorted(self) -> Trace:
        """Stable sort by arrival (file order kept within a tick) and fill missing request ids."""
        ordered = sorted(enumerate(self.requests), key=lambda pair: (pair[1].arrival_s, pair[0]))
        reqs = tuple(
            r if r.request_id else replace(r, request_id=f"{self.name}-{i}") for i, r in ordered
        )
        return replace(self, requests=reqs)

    def with_requests(self, requests: Sequence[TraceRequest], **meta: object) -> Trace:
        return replace(self, requests=tuple(requests), meta={**self.meta, **meta})
