"""A small circuit breaker for a remote dependency (Redis) on the routing path.

    closed ──(N consecutive failures)──► open ──(cool-down elapsed; next caller)──► half_open
      ▲                                    ▲                                           │
      └───────────── probe succeeded ──────┼──────────── probe failed ◄────────────────┘

While open, `allow()` refuses at once, so a dead dependency costs nothing per request. After the
cool-down exactly one caller is let through as the probe; every other caller is refused until the
probe reports. A probe that never reports (its task was cancelled) is released with `abandon()`,
or replaced after `probe_timeout_s`. Single-threaded (asyncio) use; the clock is injectable.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import StrEnum


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(
        self,
        failure_threshold: int = 3,
        cooldown_s: float = 1.0,
        *,
        probe_timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failure_threshold < 1:
            raise ValueError("failure_threshold must be >= 1")
        if cooldown_s < 0:
            raise ValueError("cooldown_s must be >= 0")
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self.probe_timeout_s = probe_timeout_s if probe_timeout_s is not None else 5 * cooldown_s
        self._clock = clock
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self._opened_at = 0.0
        self._probe_at = 0.0
        self.opens = 0  # closed/half_open -> open transitions
        self.probes = 0  # half-open probes let through

    def allow(self) -> bool:
        """May the caller use the dependency now? (True in half-open = you are the probe.)"""
        state = self.state
        if state is BreakerState.CLOSED:
            return True
        now = self._clock()
        if state is BreakerState.OPEN:
            if now - self._opened_at < self.cooldown_s:
                return False
        elif now - self._probe_at < self.probe_timeout_s:
            return False  # a probe is in flight
        self.state = BreakerState.HALF_OPEN
        self._probe_at = now
        self.probes += 1
        return True

    def record_success(self) -> None:
        if self.state is BreakerState.OPEN:
            return  # a straggler from before the breaker opened: not a probe result
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0

    def record_failure(self) -> None:
        state = self.state
        if state is BreakerState.OPEN:
            return
        if state is BreakerState.HALF_OPEN:
            self._open()
            return
        self.consecutive_failures += 1
        if self.consecutive_failures >= self.failure_threshold:
            self._open()

    def abandon(self) -> None:
        """The probe's caller went away without a verdict: let the next caller probe."""
        if self.state is BreakerState.HALF_OPEN:
            self.state = BreakerState.OPEN
            self._opened_at = self._clock() - self.cooldown_s

    def _open(self) -> None:
        self.state = BreakerState.OPEN
        self._opened_at = self._clock()
        self.consecutive_failures = 0
        self.opens += 1
