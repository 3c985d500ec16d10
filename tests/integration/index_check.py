"""What the Redis index's lookup must answer, checked against `InMemoryPrefixIndex`'s holdings.

The Redis lookup searches each candidate's held run (redis_lua.LOOKUP) instead of walking it, so
its answer is a *boundary*: the block before it is held (or it is 0), the block at it is not (or
it is the chain's end). When the replica's blocks along the chain form a prefix (vLLM's caches
always do) there is one boundary and the answer equals the in-memory walk; when the index holds
a gap, the answer may lie at any boundary from the first gap on.

`without_suspending` checks the writes' contract: a write call never waits (it queues or drops).
"""

from __future__ import annotations

from collections.abc import Coroutine, Sequence
from typing import Any

from controlplane.prefix.memory import InMemoryPrefixIndex
from controlplane.types import PrefixMatch


def _check(flags: Sequence[bool], got: int, exact: int, what: str) -> None:
    n = len(flags)
    assert exact <= got <= n, (what, got, exact)
    assert got == n or not flags[got], (what, got, "the block at the answer is held")
    assert got == 0 or flags[got - 1], (what, got, "the block before the answer is not held")
    first_gap = next((i for i, f in enumerate(flags) if not f), n)
    if not any(flags[first_gap:]):  # a prefix: one boundary
        assert got == exact, (what, got, exact)


def check_lookup(
    got: dict[str, PrefixMatch],
    memory: InMemoryPrefixIndex,
    query: Sequence[int],
    replicas: Sequence[str],
) -> None:
    """`got` (the Redis index's answer for `query` over `replicas`) is a valid boundary per
    replica, and equals the in-memory answer wherever the holdings form a prefix."""
    exact = memory.lookup(query, replicas)
    for rid in replicas:
        conf, spec = memory.holdings(rid, query)
        union = [c or i < spec for i, c in enumerate(conf)]
        mine = got.get(rid, PrefixMatch(rid, 0, 0))
        want = exact.get(rid, PrefixMatch(rid, 0, 0))
        _check(conf, mine.confirmed_blocks, want.confirmed_blocks, f"{rid} confirmed")
        _check(union, mine.matched_blocks, want.matched_blocks, f"{rid} matched")
        assert mine.matched_blocks >= mine.confirmed_blocks
    assert set(got) <= set(replicas)
    assert all(m.matched_blocks > 0 for m in got.values())


def without_suspending(call: Coroutine[Any, Any, None]) -> bool:
    """True if the coroutine ran to its end at its first step (it never waited for anything)."""
    try:
        call.send(None)
    except StopIteration:
        return True
    call.close()
    return False
