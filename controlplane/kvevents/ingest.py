"""Apply one replica's KV-event batches to a prefix index, in the project's own hashes.

vLLM names blocks by its engine hash (64-bit truncated, seeded, algorithm-dependent); the index is
keyed by the project's keyed chained hash (`controlplane.hashing.BlockHasher`). `BlockStored`
carries the tokens, so the ingestor recomputes the project hashes itself and remembers the link
(the "dual key" of llm-d-kv-cache), which is what lets removals resolve:

    BlockStored(hashes e_1..e_n, parent e_0, tokens, lora_name)
        parent None      -> chain root: p_0 = 0, scope = (model, lora_name, cache salt of block 0)
        parent known     -> p_0, scope = engine_map[e_0]            (continue the parent's chain)
        parent unknown   -> the blocks cannot be placed: count them, skip (never guess)
        p_1..p_n = BlockHasher(scope).hash_blocks(tokens, parent=p_0)
        engine_map[e_i] = (p_i, scope);  index.record_stored(p_1..p_n)
    BlockRemoved(e_1..e_k) -> index.record_removed(p_i for known e_i whose last reference went)
    AllBlocksCleared, purge -> engine_map.clear(); index.clear(replica)

Filtering: events whose `medium` is neither None nor "GPU" (CPU/disk tiers of offloading
connectors) are ignored: the router predicts GPU prefix-cache hits, which is what vLLM's scheduler
reuses without a transfer. Only KV-cache group 0 is routed on (`group_idx` None counts as 0);
hybrid models emit one event per group and group 0 is the full-attention group of every model
vLLM ships. An event whose `block_size` differs from the replica's configured one, or whose
tokens do not cover exactly its blocks (masked blocks of sliding-window/mamba groups), is counted
and skipped.

The engine map is bounded: entries go on BlockRemoved, all go on AllBlocksCleared or a purge, and
a cap with LRU eviction is a safety net against lost removals (an evicted entry is also removed
from the index, so the index never holds a block the map cannot remove). Two engine hashes may
map to one project hash (e.g. one adapter name with two paths); project hashes are reference
counted so a removal only reaches the index when the last engine block naming it is gone. A
repeated store of a known engine hash is idempotent (vLLM re-reports reused blocks when asked
to, and a missed eviction of a duplicate is worse than an early one).

Scopes: the adapter is the event's `lora_name`; the tenant salt is the request's `cache_salt`,
which vLLM hashes into block 0 only and reports in block 0's entry of `extra_keys`, untagged
(`to_event_extra_keys`: `(salt,)`, or `(lora_name, salt)` with an adapter; mm keys are tuples,
prompt-embeds digests bytes, so the salt is the first string after the adapter name; the tagged
`("cache_salt", salt)` form is accepted too). A chain's later events inherit the root's scope
through the parent map. The salt passes through `salt_for` (identity by default), so the router
keys a request with `scope_key(model, adapter, salt, secret)` for the very salt it sent as
`cache_salt` (`controlplane.tenancy.salts`), and a tenant's blocks are indexed in its own scope.
A release without `extra_keys` (before vllm #33304) reports salted chains as unsalted: they land
in the unsalted scope, which a router with tenants never looks up (every request is salted).

Counters are plain ints on `stats` (metrics-ready: all monotone).
"""

from __future__ import annotations

import inspect
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, cast

from controlplane.hashing import BlockHasher, scope_key
from controlplane.kvevents.sink import PurgeReason
from controlplane.kvevents.wire import (
    MEDIUM_GPU,
    WireAllBlocksCleared,
    WireBatch,
    WireBlockRemoved,
    WireBlockStored,
)
from controlplane.prefix.protocol import AsyncPrefixIndex, PrefixIndex

logger = logging.getLogger(__name__)

DEFAULT_MAX_MAPPED_BLOCKS: Final = 1 << 20
# (adapter, salt): one BlockHasher per scope seen on this replica
Scope = tuple[str | None, str]


@dataclass(slots=True)
class IngestStats:
    """Monotone counters of one replica's ingestion."""

    applied_batches: int = 0
    applied_events: int = 0
    # blocks written to / removed from the index
    stored_blocks: int = 0
    removed_blocks: int = 0
    clears: int = 0
    purges: int = 0
    # blocks whose parent hash was never seen (or already forgotten): not placed
    skipped_unknown_parent: int = 0
    # events ignored by the medium / group filters
    skipped_medium: int = 0
    skipped_group: int = 0
    # events whose block size or token count does not fit the replica's block size
    skipped_mismatch: int = 0
    # removed engine hashes the map did not know (stored before we joined, or skipped)
    unmapped_removed: int = 0
    # map entries dropped by the LRU cap (each a removal that was probably lost)
    evicted: int = 0
    # purges because batches were lost for good (the subscriber counts the batches), and
    # because the replica restarted
    lost: int = 0
    restarts: int = 0


class _IndexWriter:
    """The three writes the ingestor needs, over a sync or an async index."""

    def __init__(self, index: PrefixIndex | AsyncPrefixIndex, replica_id: str) -> None:
        self.replica_id = replica_id
        self.is_async = inspect.iscoroutinefunction(index.record_stored)
        self._index = index
        self.incarnation = 0

    async def stored(self, hashes: Sequence[int]) -> None:
        if self.is_async:
            idx = cast(AsyncPrefixIndex, self._index)
            await idx.record_stored(self.replica_id, self.incarnation, hashes)
        else:
            cast(PrefixIndex, self._index).record_stored(self.replica_id, hashes)

    async def removed(self, hashes: Sequence[int]) -> None:
        if self.is_async:
            idx = cast(AsyncPrefixIndex, self._index)
            await idx.record_removed(self.replica_id, self.incarnation, hashes)
        else:
            cast(PrefixIndex, self._index).record_removed(self.replica_id, hashes)

    async def clear(self) -> None:
        if self.is_async:
            await cast(AsyncPrefixIndex, self._index).clear(self.replica_id)
        else:
            cast(PrefixIndex, self._index).clear(self.replica_id)


def cache_salt_of(extra: object, lora_name: str | None = None) -> str | None:
    """The cache salt in one block's event extra keys, if any (see the module docstring)."""
    if not isinstance(extra, tuple):
        return None
    items = list(extra)
    for item in items:  # the tagged form
        if isinstance(item, tuple) and len(item) == 2 and item[0] == "cache_salt":
            salt = item[1]
            return salt if isinstance(salt, str) else None
    if lora_name is not None and items and items[0] == lora_name:
        items = items[1:]
    return next((item for item in items if isinstance(item, str)), None)


class EventIngestor:
    """Applies one replica's batches to an index; an `EventSink` for `ReplicaSubscriber`.

    `block_size` None takes each event's own block size. `incarnation` is what async index writes
    are tagged with; a restart purge replaces it with `next_incarnation(incarnation)` (default
    +1; incarnations must increase per replica). Set the attribute when the fleet knows better.
    """

    def __init__(
        self,
        replica_id: str,
        index: PrefixIndex | AsyncPrefixIndex,
        *,
        model: str,
        block_size: int | None = None,
        secret: bytes = b"",
        salt_for: Callable[[str | None], str] | None = None,
        incarnation: int = 0,
        next_incarnation: Callable[[int], int] | None = None,
        max_mapped_blocks: int = DEFAULT_MAX_MAPPED_BLOCKS,
    ) -> None:
        if max_mapped_blocks <= 0:
            raise ValueError("max_mapped_blocks must be positive")
        self.replica_id = replica_id
        self.model = model
        self.block_size = block_size
        self.max_mapped_blocks = max_mapped_blocks
        self.stats = IngestStats()
        self._secret = secret
        self._salt_for = salt_for or (lambda salt: salt or "")
        self._writer = _IndexWriter(index, replica_id)
        self._writer.incarnation = incarnation
        self._next_incarnation = next_incarnation or (lambda inc: inc + 1)
        # engine hash -> (project hash, scope), least recently used first
        self._engine: OrderedDict[int, tuple[int, Scope]] = OrderedDict()
        # project hash -> number of engine hashes mapped to it
        self._refs: dict[int, int] = {}
        # (scope, block size) -> hasher
        self._hashers: dict[tuple[Scope, int], BlockHasher] = {}

    @property
    def incarnation(self) -> int:
        return self._writer.incarnation

    @incarnation.setter
    def incarnation(self, value: int) -> None:
        self._writer.incarnation = value

    @property
    def mapped_blocks(self) -> int:
        return len(self._engine)

    def project_hash(self, engine_hash: int) -> int | None:
        entry = self._engine.get(engine_hash)
        return None if entry is None else entry[0]

    # -- EventSink -------------------------------------------------------------------------------
    async def apply(self, batch: WireBatch) -> None:
        """Apply one batch; consecutive writes of one kind go to the index as one call."""
        stats = self.stats
        stats.applied_batches += 1
        pending: list[int] = []
        pending_kind = ""  # "stored" | "removed" | ""

        async def flush() -> None:
            nonlocal pending, pending_kind
            if pending:
                if pending_kind == "stored":
                    await self._writer.stored(pending)
                else:
                    await self._writer.removed(pending)
            pending, pending_kind = [], ""

        for ev in batch.events:
            stats.applied_events += 1
            if isinstance(ev, WireAllBlocksCleared):
                pending, pending_kind = [], ""  # everything before is wiped anyway
                await self._clear()
                stats.clears += 1
                continue
            if ev.medium not in (None, MEDIUM_GPU):
                stats.skipped_medium += 1
                continue
            if (ev.group_idx or 0) != 0:
                stats.skipped_group += 1
                continue
            stored, removed = (
                self._place(ev) if isinstance(ev, WireBlockStored) else self._unmap(ev)
            )
            for kind, hashes in (("stored", stored), ("removed", removed)):
                if not hashes:
                    continue
                if pending_kind != kind:
                    await flush()
                    pending_kind = kind
                pending.extend(hashes)
        await flush()

    async def purge(self, reason: PurgeReason) -> None:
        await self._clear()
        self.stats.purges += 1
        if reason is PurgeReason.RESTART:
            self.stats.restarts += 1
            self.incarnation = self._next_incarnation(self.incarnation)
        elif reason is PurgeReason.GAP:
            self.stats.lost += 1
        logger.info("replica %s: index entries purged (%s)", self.replica_id, reason.value)

    # -- internals -------------------------------------------------------------------------------
    async def _clear(self) -> None:
        self._engine.clear()
        self._refs.clear()
        await self._writer.clear()

    def _hasher(self, scope: Scope, block_size: int) -> BlockHasher:
        hasher = self._hashers.get((scope, block_size))
        if hasher is None:
            adapter, salt = scope
            key = scope_key(self.model, adapter, salt, self._secret)
            hasher = self._hashers[(scope, block_size)] = BlockHasher(block_size, key)
        return hasher

    def _place(self, ev: WireBlockStored) -> tuple[list[int], list[int]]:
        """Map a BlockStored's engine hashes to project hashes: (stored, removed) for the index."""
        n = len(ev.block_hashes)
        bs = self.block_size or ev.block_size
        if not n:
            return [], []
        if ev.block_size != bs or len(ev.token_ids) != n * bs:
            self.stats.skipped_mismatch += 1
            return [], []
        if ev.parent_block_hash is None:
            parent = 0
            first_extra = ev.extra_keys[0] if ev.extra_keys else None
            salt = cache_salt_of(first_extra, ev.lora_name)
            scope: Scope = (ev.lora_name, self._salt_for(salt))
        else:
            entry = self._engine.get(ev.parent_block_hash)
            if entry is None:
                self.stats.skipped_unknown_parent += n
                return [], []
            self._engine.move_to_end(ev.parent_block_hash)
            parent, scope = entry
        project = self._hasher(scope, bs).hash_blocks(ev.token_ids, parent=parent)
        removed: list[int] = []
        engine, refs = self._engine, self._refs
        for e, p in zip(ev.block_hashes, project, strict=True):
            old = engine.get(e)
            if old is not None:
                engine.move_to_end(e)
                if old[0] == p:
                    continue
                self._deref(old[0], removed)
            engine[e] = (p, scope)
            refs[p] = refs.get(p, 0) + 1
        while len(engine) > self.max_mapped_blocks:
            _, (p, _scope) = engine.popitem(last=False)
            self.stats.evicted += 1
            self._deref(p, removed)
        self.stats.stored_blocks += n
        return project, removed

    def _unmap(self, ev: WireBlockRemoved) -> tuple[list[int], list[int]]:
        removed: list[int] = []
        for e in ev.block_hashes:
            entry = self._engine.pop(e, None)
            if entry is None:
                self.stats.unmapped_removed += 1
            else:
                self._deref(entry[0], removed)
        return [], removed

    def _deref(self, project: int, removed: list[int]) -> None:
        left = self._refs.get(project, 0) - 1
        if left > 0:
            self._refs[project] = left
        else:
            self._refs.pop(project, None)
            removed.append(project)
            self.stats.removed_blocks += 1
