"""The scale-down's victim choice: table-driven cases and the ranking's invariants."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from autoscaler.victims import (
    PodState,
    Victim,
    VictimInfo,
    VictimReason,
    deployment_victims,
    statefulset_victims,
)

R = VictimReason


@pytest.mark.parametrize(
    ("current", "target", "expected"),
    [
        (3, 2, ["s-2"]),
        (5, 2, ["s-4", "s-3", "s-2"]),
        (3, 3, []),
        (2, 0, ["s-1", "s-0"]),
    ],
)
def test_statefulset_victims_are_the_top_ordinals(
    current: int, target: int, expected: list[str]
) -> None:
    victims = statefulset_victims("s", current, target)
    assert [v.name for v in victims] == expected
    assert all(v.reason == R.TOP_ORDINAL for v in victims)


def info(**load: tuple[int, int]) -> dict[str, VictimInfo]:
    return {k: VictimInfo(k, *v) for k, v in load.items()}


@pytest.mark.parametrize(
    ("pods", "load", "count", "expected"),
    [
        # least in flight wins, whatever the cache
        ([PodState("a", True), PodState("b", True)], info(a=(2, 0), b=(1, 900)), 1,
         [Victim("b", R.LEAST_WORK)]),
        # equal in flight: least cached
        ([PodState("a", True), PodState("b", True)], info(a=(0, 30), b=(0, 10)), 1,
         [Victim("b", R.LEAST_WORK)]),
        # all equal: by name, deterministic
        ([PodState("b", True), PodState("a", True)], info(a=(0, 0), b=(0, 0)), 1,
         [Victim("a", R.LEAST_WORK)]),
        # not ready before unknown before known
        ([PodState("a", True), PodState("b", True), PodState("c", False)], info(a=(0, 0)), 2,
         [Victim("c", R.NOT_READY), Victim("b", R.UNKNOWN_TO_ROUTER)]),
        # a terminating pod is already going: never a victim
        ([PodState("a", True), PodState("b", False, terminating=True)], info(a=(3, 3)), 1,
         [Victim("a", R.LEAST_WORK)]),
        # more asked than candidates: all of them
        ([PodState("a", True)], {}, 3, [Victim("a", R.UNKNOWN_TO_ROUTER)]),
        ([PodState("a", True)], {}, 0, []),
    ],
)  # fmt: skip
def test_deployment_victims(
    pods: list[PodState], load: dict[str, VictimInfo], count: int, expected: list[Victim]
) -> None:
    assert list(deployment_victims(pods, load, count)) == expected


def rank(pod: PodState, load: dict[str, VictimInfo]) -> tuple[int, int, int]:
    if not pod.ready:
        return (0, 0, 0)
    if pod.name not in load:
        return (1, 0, 0)
    return (2, load[pod.name].in_flight, load[pod.name].cached_blocks)


pods_and_load = st.lists(
    st.tuples(st.booleans(), st.booleans(), st.none() | st.tuples(st.integers(0, 5),
                                                                  st.integers(0, 5))),
    max_size=8,
).map(lambda rows: (
    [PodState(f"p{i}", ready, term) for i, (ready, term, _) in enumerate(rows)],
    {f"p{i}": VictimInfo(f"p{i}", *w) for i, (_, _, w) in enumerate(rows) if w is not None},
))  # fmt: skip


@given(pods_and_load, st.integers(0, 10))
def test_no_pod_left_is_cheaper_than_a_victim(
    case: tuple[list[PodState], dict[str, VictimInfo]], count: int
) -> None:
    pods, load = case
    victims = deployment_victims(pods, load, count)
    names = [v.name for v in victims]
    candidates = [p for p in pods if not p.terminating]
    assert len(names) == len(set(names)) == min(count, len(candidates))
    chosen = [p for p in candidates if p.name in names]
    kept = [p for p in candidates if p.name not in names]
    if chosen and kept:
        assert max(rank(p, load) for p in chosen) <= min(rank(p, load) for p in kept)
