"""The pure fair-queue ordering: lifts, picks, charges, refunds, and its invariants."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.tenancy import vtc
from controlplane.tenancy.vtc import VtcState
from controlplane.types import PriorityClass

INT, BAT = PriorityClass.INTERACTIVE, PriorityClass.BATCH


def state(counters: dict[str, float], backlogged: str = "") -> VtcState:
    return VtcState(counters, frozenset(backlogged))


@pytest.mark.parametrize(
    ("before", "tenant", "after"),
    [
        # lifted to the smallest backlogged counter, never lowered
        (state({"a": 10, "b": 30, "c": 0}, "ab"), "c", 10),
        (state({"a": 10, "b": 30, "c": 50}, "ab"), "c", 50),
        # a new tenant starts at the floor too
        (state({"a": 10, "b": 30}, "ab"), "new", 10),
        # nobody backlogged: lifted to the largest counter (the system's virtual time)
        (state({"a": 10, "b": 30, "c": 5}), "c", 30),
        (state({}), "first", 0),
        # already backlogged: unchanged
        (state({"a": 10, "c": 0}, "ac"), "c", 0),
    ],
)
def test_on_arrival_lifts_without_banked_credit(
    before: VtcState, tenant: str, after: float
) -> None:
    s = vtc.on_arrival(before, tenant)
    assert s.counter(tenant) == after
    assert tenant in s.backlogged
    assert {t: s.counter(t) for t in before.counters if t != tenant} == {
        t: v for t, v in before.counters.items() if t != tenant
    }


def test_on_idle_keeps_the_counter() -> None:
    s = vtc.on_idle(state({"a": 7}, "a"), "a")
    assert s.counter("a") == 7 and not s.backlogged
    assert vtc.on_idle(s, "a") == s


@pytest.mark.parametrize(
    ("counters", "backlogged", "classes", "expected"),
    [
        ({"a": 5, "b": 3}, "ab", {"a": INT, "b": INT}, "b"),
        # interactive always before batch, whatever the counters
        ({"a": 500, "b": 3}, "ab", {"a": INT, "b": BAT}, "a"),
        # ties go to the smallest tenant id
        ({"b": 3, "a": 3}, "ab", {"b": INT, "a": INT}, "a"),
        # only backlogged tenants named in `classes` are candidates
        ({"a": 1, "b": 3, "c": 9}, "bc", {"a": INT, "c": INT}, "c"),
        ({"a": 1}, "", {"a": INT}, None),
        ({"a": 1}, "a", {}, None),
    ],
)
def test_pick(
    counters: dict[str, float], backlogged: str, classes: dict[str, PriorityClass], expected: str
) -> None:
    assert vtc.pick(state(counters, backlogged), classes) == expected


def test_charges_divide_by_weight_and_refunds_stop_at_zero() -> None:
    s = vtc.charge(state({}), "a", 6.0, weight=3.0)
    assert s.counter("a") == 2.0
    assert vtc.charge(s, "a", 0.0).counter("a") == 2.0
    assert vtc.refund(s, "a", 3.0, weight=3.0).counter("a") == 1.0
    assert vtc.refund(s, "a", 100.0).counter("a") == 0.0
    with pytest.raises(ValueError):
        vtc.charge(s, "a", 1.0, weight=0)
    with pytest.raises(ValueError):
        vtc.refund(s, "a", 1.0, weight=-1)


def test_state_is_immutable() -> None:
    s = vtc.charge(state({}), "a", 1.0)
    with pytest.raises(TypeError):
        s.counters["a"] = 0.0  # type: ignore[index]


TENANTS = ("a", "b", "c")
events = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), st.sampled_from(TENANTS)),
        st.tuples(st.just("idle"), st.sampled_from(TENANTS)),
        st.tuples(st.just("charge"), st.sampled_from(TENANTS), st.floats(0, 50)),
        st.tuples(st.just("refund"), st.sampled_from(TENANTS), st.floats(0, 50)),
        st.tuples(st.just("serve"), st.floats(0, 50)),
    ),
    max_size=60,
)


@given(events)
def test_counters_only_fall_by_refunds_and_pick_is_backlogged(
    evs: list[tuple[object, ...]],
) -> None:
    s = state({})
    classes = {"a": INT, "b": INT, "c": BAT}
    for ev in evs:
        before = dict(s.counters)
        kind = ev[0]
        if kind == "arrive":
            s = vtc.on_arrival(s, str(ev[1]))
        elif kind == "idle":
            s = vtc.on_idle(s, str(ev[1]))
        elif kind == "charge":
            s = vtc.charge(s, str(ev[1]), float(ev[2]))  # type: ignore[arg-type]
        elif kind == "refund":
            s = vtc.refund(s, str(ev[1]), float(ev[2]))  # type: ignore[arg-type]
        else:
            chosen = vtc.pick(s, classes)
            assert (chosen is None) == (not s.backlogged)
            if chosen is not None:
                assert chosen in s.backlogged
                s = vtc.charge(s, chosen, float(ev[1]))  # type: ignore[arg-type]
        if kind != "refund":
            assert all(s.counter(t) >= v for t, v in before.items())


@given(
    st.lists(st.floats(0.01, 10.0), min_size=1, max_size=200),
    st.floats(0.25, 4.0),
    st.floats(0.25, 4.0),
)
def test_backlogged_tenants_stay_within_one_charge(
    charges: list[float], wa: float, wb: float
) -> None:
    """Two tenants stay backlogged; each dispatch charges the picked one. Its counter was the
    smaller when picked, so the spread never exceeds the largest single charge / weight."""
    weights = {"a": wa, "b": wb}
    s = vtc.on_arrival(vtc.on_arrival(state({}), "a"), "b")
    bound = max(charges) / min(wa, wb)
    for work in charges:
        chosen = vtc.pick(s, {"a": INT, "b": INT})
        assert chosen is not None
        s = vtc.charge(s, chosen, work, weights[chosen])
        assert s.spread() <= bound + 1e-9


@given(st.lists(st.sampled_from(TENANTS), max_size=40), st.floats(0, 100))
def test_a_returning_tenant_never_starts_below_the_backlogged(
    order: list[str], credit: float
) -> None:
    s = state({"a": 0.0, "b": credit, "c": 2 * credit}, "bc")
    for t in order:
        s = vtc.on_arrival(s, t)
        floor = min(s.counter(x) for x in s.backlogged)
        assert s.counter(t) >= floor
