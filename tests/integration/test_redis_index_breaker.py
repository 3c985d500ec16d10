"""The circuit breaker in front of Redis, on a fake clock (no server needed)."""

from __future__ import annotations

import pytest

from controlplane.store.breaker import BreakerState, CircuitBreaker

pytestmark = pytest.mark.redis


def st(b: CircuitBreaker) -> BreakerState:
    return b.state  # through a call, so that type checkers do not narrow it between checks


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_opens_after_consecutive_failures_only() -> None:
    b = CircuitBreaker(3, 1.0, clock=Clock())
    for _ in range(2):
        assert b.allow()
        b.record_failure()
    b.record_success()  # resets the run
    for _ in range(2):
        b.record_failure()
    assert st(b) is BreakerState.CLOSED
    b.record_failure()
    assert st(b) is BreakerState.OPEN and b.opens == 1
    assert not b.allow()


def test_exactly_one_probe_after_the_cooldown() -> None:
    clock = Clock()
    b = CircuitBreaker(3, 1.0, clock=clock)
    for _ in range(3):
        b.record_failure()
    clock.t += 0.99
    assert not b.allow()
    clock.t += 0.01
    assert b.allow()  # the probe
    assert st(b) is BreakerState.HALF_OPEN
    assert [b.allow() for _ in range(10)] == [False] * 10
    assert b.probes == 1
    b.record_failure()  # the probe failed: open again, a new cool-down
    assert st(b) is BreakerState.OPEN and b.opens == 2
    assert not b.allow()
    clock.t += 1.0
    assert b.allow()
    b.record_success()
    assert st(b) is BreakerState.CLOSED and b.allow()


def test_stragglers_and_lost_probes() -> None:
    clock = Clock()
    b = CircuitBreaker(1, 1.0, probe_timeout_s=3.0, clock=clock)
    b.record_failure()
    b.record_success()  # a request sent before the breaker opened: not a verdict
    assert st(b) is BreakerState.OPEN
    clock.t += 1.0
    assert b.allow()
    b.abandon()  # the probe's caller was cancelled: the next caller probes at once
    assert st(b) is BreakerState.OPEN
    assert b.allow()
    clock.t += 2.9
    assert not b.allow()
    clock.t += 0.1  # the probe never reported: another one is allowed
    assert b.allow()
    assert b.probes == 3


def test_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        CircuitBreaker(0)
    with pytest.raises(ValueError):
        CircuitBreaker(3, -1.0)
