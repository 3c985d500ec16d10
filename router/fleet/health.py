"""Health of one replica as the live router judges it: pure state and decisions, no I/O.

Two kinds of signals (the I/O lives in `router.fleet.live_fleet`):

- active: `GET /health` every `probe_interval_s`. A replica that never answered is UNKNOWN (phase
  LOADING, however often it fails: vLLM refuses connections while it loads the model); the first
  good probe makes it UP; `consecutive_failures` failed probes in a row make an UP replica DOWN
  (phase DEAD, not routable). A good probe of a DOWN replica brings it back as a *new
  incarnation* (it restarted, or was unreachable long enough that its cache is unknown).
- passive, reported by the proxy: hard failures (refused or reset connections, 5xx, streams that
  die) count in a row and `consecutive_failures` of them eject the replica whatever the rest of
  the fleet looks like (a dead replica is dead); a success resets the count. Slowness (TTFT
  deadline missed, idle gap in a stream) ejects at once, but only while `may_eject_for_slowness`
  allows it: afterwards at most `max_ejected_fraction` of the members (replicas neither loading
  nor draining) may be unavailable (ejected for any reason, or dead). A fleet-wide slowdown is
  overload, and ejecting replicas for it would only make it worse.

Ejection lasts `eject_duration_s`: `eject_s`, doubled on each repeated ejection ("strikes"),
capped at `eject_max_s`; a replica admitted for `eject_max_s` since its last re-admission starts
again at one strike. An ejected replica comes back only through a good probe at or after
`ejected_until`, so a replica that lies on `/health` while hung is re-admitted, meets the proxy's
deadlines again and is ejected for twice as long. A DOWN replica that comes back is a new process:
its ejection is cleared (its strikes are kept).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import StrEnum


class FailureReason(StrEnum):
    """A hard failure the proxy met (a metric label)."""

    CONNECT = "connect"  # refused, unreachable, connect timeout
    RESET = "reset"  # connection reset or closed before a response
    STATUS_5XX = "5xx"
    STREAM_DIED = "stream_died"  # the stream broke before its end


class SlowReason(StrEnum):
    """A deadline the proxy saw missed (a metric label)."""

    TTFT = "ttft"
    IDLE = "idle"


class EjectReason(StrEnum):
    """Why a replica left the rotation (a metric label)."""

    FAILURES = "failures"  # consecutive hard failures reported by the proxy
    TTFT = "ttft"
    IDLE = "idle"
    DOWN = "down"  # consecutive failed probes: phase DEAD until a probe succeeds


class Liveness(StrEnum):
    UNKNOWN = "unknown"  # never answered a probe
    UP = "up"
    DOWN = "down"


class ProbeOutcome(StrEnum):
    """What a probe result changed."""

    NONE = "none"
    FIRST_UP = "first_up"
    WENT_DOWN = "went_down"
    CAME_BACK = "came_back"  # DOWN -> UP: a new incarnation
    READMITTED = "readmitted"  # an expired ejection ended by a good probe


# -- pure decisions ---------------------------------------------------------------------------
def may_eject_for_slowness(members: int, unavailable: int, max_fraction: float) -> bool:
    """Whether one more member may leave for slowness: afterwards at most `max_fraction` of the
    `members` may be unavailable (`unavailable` counts the members already out)."""
    return members > 0 and unavailable + 1 <= max_fraction * members + 1e-9


def eject_duration_s(strikes: int, base_s: float, max_s: float) -> float:
    """`base_s` doubled per strike beyond the first, capped at `max_s` (never below `base_s`)."""
    doublings = min(max(strikes - 1, 0), 62)
    return min(base_s * 2.0**doublings, max(max_s, base_s))


def next_strikes(strikes: int, readmitted_at: float, now: float, quiet_s: float) -> int:
    """Strikes after one more ejection: back to 1 after `quiet_s` admitted without one."""
    if strikes and now - readmitted_at >= quiet_s:
        return 1
    return strikes + 1


def probe_due(
    next_probe_s: float, ejected: bool, ejected_until: float, last_probe_s: float
) -> float:
    """When the next probe is due: on its interval, or when an ejection expires if no probe has
    run since it expired (so an ejected replica comes back without waiting a full interval)."""
    if ejected and last_probe_s < ejected_until:
        return min(next_probe_s, ejected_until)
    return next_probe_s


def restart_signal(
    prev_queries: float | None,
    queries: float,
    prev_start: float | None,
    start: float | None,
) -> str | None:
    """Why a scrape shows a new process, or None: its start marker moved forward, or its
    cumulative prefix-cache query counter went backwards (counters only reset with the
    process)."""
    if prev_start is not None and start is not None and start > prev_start + 1e-6:
        return "start_time"
    if prev_queries is not None and queries < prev_queries:
        return "counter_reset"
    return None


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)(\s+\S+)?\s*$")


def start_marker(text: str) -> float | None:
    """When the replica's process started, from its `/metrics` text: `process_start_time_seconds`
    when exposed, else the earliest `*_created` sample (prometheus_client stamps every counter
    and histogram with its creation time; a process keeps its earliest one for life)."""
    start: float | None = None
    earliest: float | None = None
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name = m.group(1)
        if name != "process_start_time_seconds" and not name.endswith("_created"):
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        if not math.isfinite(value):
            continue
        if name == "process_start_time_seconds":
            start = value
        elif earliest is None or value < earliest:
            earliest = value
    return start if start is not None else earliest


# -- one replica's state ------------------------------------------------------------------------
@dataclass(slots=True)
class ReplicaHealth:
    """The health state machine of one replica; every method takes the time it happens at."""

    liveness: Liveness = Liveness.UNKNOWN
    # failed probes in a row
    probe_failures: int = 0
    # hard failures the proxy reported in a row
    failures: int = 0
    ejected: bool = False
    # earliest re-admission time (a good probe at or after it re-admits)
    ejected_until: float = -math.inf
    eject_reason: EjectReason | None = None
    strikes: int = 0
    readmitted_at: float = -math.inf

    def is_ejected(self, now: float) -> bool:
        return self.ejected or now < self.ejected_until

    def eject(self, now: float, reason: EjectReason, base_s: float, max_s: float) -> float:
        """Eject now; returns the ejection's duration."""
        self.strikes = next_strikes(self.strikes, self.readmitted_at, now, max(max_s, base_s))
        duration = eject_duration_s(self.strikes, base_s, max_s)
        self.ejected = True
        self.ejected_until = now + duration
        self.eject_reason = reason
        return duration

    def on_success(self) -> None:
        self.failures = 0

    def on_failure(self, threshold: int) -> bool:
        """Count a hard failure; True when it should eject (not ejected yet, threshold met)."""
        self.failures += 1
        return not self.ejected and self.failures >= threshold

    def on_probe(self, ok: bool, now: float, threshold: int) -> ProbeOutcome:
        if not ok:
            self.probe_failures += 1
            if self.liveness is Liveness.UP and self.probe_failures >= threshold:
                self.liveness = Liveness.DOWN
                return ProbeOutcome.WENT_DOWN
            return ProbeOutcome.NONE
        self.probe_failures = 0
        if self.liveness is Liveness.UNKNOWN:
            self.liveness = Liveness.UP
            outcome = ProbeOutcome.FIRST_UP
        elif self.liveness is Liveness.DOWN:
            self.liveness = Liveness.UP
            self.failures = 0
            self.ejected, self.ejected_until, self.eject_reason = False, -math.inf, None
            return ProbeOutcome.CAME_BACK
        else:
            outcome = ProbeOutcome.NONE
        if self.ejected and now >= self.ejected_until:
            self.ejected, self.eject_reason = False, None
            self.readmitted_at = now
            self.failures = 0
            return ProbeOutcome.READMITTED
        return outcome
