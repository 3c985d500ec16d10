"""SpeculativeChains against a brute-force model: a list of (replica, chain, expires_at)."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.prefix.speculative import SpeculativeChains


def chained(tokens: Sequence[int]) -> tuple[int, ...]:
    return tuple(hash(tuple(tokens[: j + 1])) for j in range(len(tokens)))


# a small tree of prompts: chains that share prefixes of different lengths, branch at several
# depths, and end inside one another (so the tree splits edges, and chains end mid-edge)
PROMPTS = sorted(
    {
        chained([7] * a + [b] * c + tail)
        for a in (1, 3, 6)
        for b in (1, 2)
        for c in (0, 2, 5)
        for tail in ([], [3, 3], [3, 4, 4, 4])
    }
)
REPLICAS = ("r0", "r1")

ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.sampled_from(REPLICAS),
            st.sampled_from(PROMPTS),
            st.floats(0.5, 8.0),
        ),
        # shorten the k-th chain added so far (k drawn as an index, taken modulo their count)
        st.tuples(st.just("shorten"), st.just(""), st.integers(0, 60), st.floats(0.0, 3.0)),
        st.tuples(st.just("tick"), st.just(""), st.just(()), st.floats(0.0, 3.0)),
        st.tuples(st.just("forget"), st.sampled_from(REPLICAS), st.just(()), st.just(0.0)),
    ),
    min_size=10,
    max_size=60,
)


def brute_longest(model: list[list[object]], rid: str, query: Sequence[int], now: float) -> int:
    best = 0
    for r, chain, exp in model:
        if r != rid or not isinstance(exp, float) or exp <= now:
            continue
        assert isinstance(chain, tuple)
        k = 0
        while k < min(len(chain), len(query)) and chain[k] == query[k]:
            k += 1
        best = max(best, k)
    return best


@settings(max_examples=400, deadline=None)
@given(steps=ops)
def test_longest_prefix_matches_a_brute_force_model(
    steps: list[tuple[str, str, tuple[int, ...] | int, float]],
) -> None:
    check_against_model(steps)


def check_against_model(steps: list[tuple[str, str, tuple[int, ...] | int, float]]) -> None:
    chains = SpeculativeChains()
    model: list[list[object]] = []
    now = 0.0
    for op, rid, hashes, x in steps:
        if op == "add":
            assert isinstance(hashes, tuple)
            chains.add(rid, hashes, now + x, now)
            model.append([rid, hashes, now + x])
        elif op == "shorten":
            if not model:
                continue
            assert isinstance(hashes, int)
            owner, chain = model[hashes % len(model)][:2]
            assert isinstance(owner, str) and isinstance(chain, tuple)
            chains.shorten(owner, chain, now + x, now)
            for row in model:
                if row[0] == owner and row[1] == chain:
                    row[2] = min(float(row[2]), now + x)  # type: ignore[arg-type]
        elif op == "tick":
            now += x
        else:
            chains.forget(rid)
            model = [row for row in model if row[0] != rid]
        chains.prune(now)
        live = [row for row in model if float(row[2]) > now]  # type: ignore[arg-type]
        assert chains.held() == len(live)
        for r in REPLICAS:
            for query in PROMPTS:
                want = brute_longest(model, r, query, now)
                assert chains.longest_prefix(r, query) == want
