"""The demand signal, measured where requests arrive: at the router (never GPU utilization).

A `DemandMeter` sees these events per request, from whichever host runs it (the live router, the
simulator's routers):

    arrived(id, prompt, predicted_output, now)   work is priced at arrival with `SloCapacity`:
                                                 prefill P(prompt), decode D(predicted output);
                                                 the request joins the backlog and in-flight set
    dispatched(id, replica, now)                 a router sent it to `replica` (again: moved
                                                 there; optional: a host that cannot tell)
    started(id, now)                             it left the backlog (a replica began its prefill)
    first_token(id, now)                         TTFT observed (for reports, not for decisions)
    finished(id, now)                            it leaves in-flight (and the backlog, if it never
                                                 started: rejected, cancelled, failed)

`sample(now)` closes the interval since the previous sample and returns a `DemandSample`:

- arrival rate, kept apart from the backlog: `prefill_work_s` and `decode_work_s` sum the work
  of requests that *arrived* in the interval; `backlog_work_s` is the work of requests accepted
  and not started at `now`; `backlog_by_replica` splits off the part already dispatched, per
  replica (only that replica can serve it: new replicas drain the router's queue, not another
  replica's waiting queue). A policy that treats the backlog as demand (Ray's default, KPA)
  turns the queue that piled up while replicas loaded into permanent capacity; keeping the two
  apart lets the headroom policy drain the one and forecast the other.
- `in_flight_avg`: the time-average of the in-flight count over the interval (what Ray's
  `look_back_period_s` and Knative's windows average), integrated exactly at every event.
- `prefill_mean_s`, `prefill_scv`: mean and squared coefficient of variation of the arrivals'
  prefill work, the M/G/1 inputs of the utilization target.
- `ttft_p99_s`: p99 of the TTFTs observed in the interval (-1 when none).
- `prefill_peaks`: the same prefill work measured on sliding windows. For each window length
  `w` in the meter's `peak_windows` (default `PEAK_WINDOWS_S`, the usual decision ticks), the
  most prefill work that arrived within any `w` seconds ending at an arrival of the interval
  (windows reach back into the previous interval) and the requests that brought it. A tick's
  own total depends on where the tick boundaries fall: a 2-s spike of hundreds of requests is
  whole in one tick and halved in two on the next repetition; the sliding window sees it whole
  every time.

Prefix-cache hits are not known at arrival; the meter prices whole prompts, so demand errs on the
side of capacity. The meter is plain mutable bookkeeping, O(1) per event; the policies that read
its samples are pure.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from autoscaler.capacity import SloCapacity
from autoscaler.types import DemandSample

PEAK_WINDOWS_S: tuple[float, ...] = (5.0, 10.0, 15.0, 30.0)
# how a router exports `recent_peaks` (per window_s), and the hosts that read it
PEAK_WORK = "cp_demand_prefill_peak_work_seconds"
PEAK_REQUESTS = "cp_demand_prefill_peak_requests"


class _PeakWindow:
    """Sliding sum of the prefill work that arrived in the last `w` seconds. Keeps its largest
    value (with the request count) since the last reset, for `sample`, and the largest over
    the windows ending in the last `w` seconds (a monotone queue), for readers that poll on
    their own clock (/metrics). O(1) amortized per arrival."""

    __slots__ = ("best", "best_n", "events", "recent", "sum", "w")

    def __init__(self, w: float) -> None:
        self.w = w
        self.events: deque[tuple[float, float]] = deque()
        self.sum = 0.0
        self.best = 0.0
        self.best_n = 0
        # (window end, sum, requests), sums strictly decreasing from the front
        self.recent: deque[tuple[float, float, int]] = deque()

    def add(self, now: float, work: float) -> None:
        ev = self.events
        ev.append((now, work))
        self.sum += work
        while ev and ev[0][0] <= now - self.w:
            self.sum -= ev.popleft()[1]
        if self.sum > self.best:
            self.best, self.best_n = self.sum, len(ev)
        recent = self.recent
        while recent and recent[-1][1] <= self.sum:
            recent.pop()
        recent.append((now, self.sum, len(ev)))

    def recent_peak(self, now: float) -> tuple[float, int]:
        """The largest window sum (and its requests) among windows ending in `(now - w, now]`."""
        recent = self.recent
        while recent and recent[0][0] <= now - self.w:
            recent.popleft()
        return (recent[0][1], recent[0][2]) if recent else (0.0, 0)


def sum_peaks(
    parts: Iterable[Iterable[tuple[float, float, float]]],
) -> tuple[tuple[float, float, int], ...]:
    """Several meters' `(window, work, requests)` peaks added up per window (a bound: their
    densest windows need not coincide), for the windows every part reports."""
    totals: dict[float, tuple[float, float]] | None = None
    for part in parts:
        mine = {w: (work, n) for w, work, n in part}
        if totals is None:
            totals = mine
            continue
        totals = {
            w: (work + mine[w][0], n + mine[w][1]) for w, (work, n) in totals.items() if w in mine
        }
    return tuple((w, work, round(n)) for w, (work, n) in sorted((totals or {}).items()))


def backlog_by_replica(parts: Iterable[Mapping[str, float]]) -> tuple[float, ...]:
    """`DemandSample.backlog_by_replica` from per-replica dispatched backlog work reported by
    several parts (routers that send to the same replicas): added up per replica, the positive
    ones, descending."""
    totals: dict[str, float] = {}
    for part in parts:
        for replica, work in part.items():
            totals[replica] = totals.get(replica, 0.0) + work
    return tuple(sorted((w for w in totals.values() if w > 0), reverse=True))


@dataclass(slots=True)
class _Open:
    arrival_s: float
    work_s: float
    started: bool = False
    replica: str | None = None  # where a router dispatched it (None: still at the router)


class DemandMeter:
    """Router-side demand bookkeeping for one model."""

    def __init__(
        self,
        capacity: SloCapacity,
        *,
        start_s: float = 0.0,
        peak_windows: tuple[float, ...] = PEAK_WINDOWS_S,
    ) -> None:
        self.capacity = capacity
        self._open: dict[str, _Open] = {}
        self._backlog_work = 0.0
        self._backlog_n = 0
        # dispatched backlog work per replica (entries leave when it reaches no request)
        self._pinned: dict[str, float] = {}
        self._pinned_n: dict[str, int] = {}
        self._t0 = start_s
        self._last_event = start_s
        self._area = 0.0  # integral of the in-flight count since _t0
        self._peaks = [_PeakWindow(w) for w in peak_windows if w > 0]
        self._reset()

    def _reset(self) -> None:
        self._arrivals = 0
        self._prefill = 0.0
        self._decode = 0.0
        self._prefill_sq = 0.0
        self._ttfts: list[float] = []
        for pw in self._peaks:
            pw.best, pw.best_n = 0.0, 0

    def _advance(self, now: float) -> None:
        if now > self._last_event:
            self._area += len(self._open) * (now - self._last_event)
            self._last_event = now

    # -- events ----------------------------------------------------------------------------------
    def arrived(
        self, request_id: str, prompt_tokens: int, predicted_output_tokens: int, now: float
    ) -> tuple[float, float]:
        """Record an arrival; returns its (prefill, decode) work ((0, 0) for a repeated id)."""
        if request_id in self._open:
            return 0.0, 0.0
        self._advance(now)
        cap = self.capacity
        prefill = cap.prefill_work(prompt_tokens)
        decode = cap.decode_work(max(1, predicted_output_tokens), prompt_tokens)
        self._arrivals += 1
        self._prefill += prefill
        self._decode += decode
        self._prefill_sq += prefill * prefill
        for pw in self._peaks:
            pw.add(now, prefill)
        self._open[request_id] = _Open(now, prefill + decode)
        self._backlog_work += prefill + decode
        self._backlog_n += 1
        return prefill, decode

    def dispatched(self, request_id: str, replica: str, now: float) -> None:
        """A router sent the request to `replica`: its backlog now waits there (a reroute
        moves it; a request already started or finished is left as it is)."""
        entry = self._open.get(request_id)
        if entry is None or entry.started or entry.replica == replica:
            return
        if entry.replica is not None:
            self._unpin(entry)
        entry.replica = replica
        self._pinned[replica] = self._pinned.get(replica, 0.0) + entry.work_s
        self._pinned_n[replica] = self._pinned_n.get(replica, 0) + 1

    def started(self, request_id: str, now: float) -> None:
        entry = self._open.get(request_id)
        if entry is None or entry.started:
            return
        entry.started = True
        self._leave_backlog(entry)

    def first_token(self, request_id: str, now: float) -> None:
        entry = self._open.get(request_id)
        if entry is None:
            return
        self.started(request_id, now)
        self._ttfts.append(now - entry.arrival_s)

    def finished(self, request_id: str, now: float) -> None:
        self._advance(now)
        entry = self._open.pop(request_id, None)
        if entry is not None and not entry.started:
            self._leave_backlog(entry)

    def _leave_backlog(self, entry: _Open) -> None:
        self._backlog_n -= 1
        self._backlog_work = max(0.0, self._backlog_work - entry.work_s) if self._backlog_n else 0.0
        if entry.replica is not None:
            self._unpin(entry)

    def _unpin(self, entry: _Open) -> None:
        rep = entry.replica
        assert rep is not None
        left = self._pinned_n[rep] - 1
        if left:
            self._pinned_n[rep] = left
            self._pinned[rep] = max(0.0, self._pinned[rep] - entry.work_s)
        else:
            del self._pinned_n[rep], self._pinned[rep]

    # -- reading ---------------------------------------------------------------------------------
    def recent_peaks(self, now: float) -> tuple[tuple[float, float, int], ...]:
        """Per peak window `w`: the most prefill work within `w` seconds among the windows
        ending in the last `w` seconds, and its requests: `(w, work, requests)`. Unlike
        `sample`'s it resets on time, not on reading, so any number of scrapers see the same."""
        return tuple((pw.w, *pw.recent_peak(now)) for pw in self._peaks)

    @property
    def in_flight(self) -> int:
        return len(self._open)

    @property
    def backlog_requests(self) -> int:
        return self._backlog_n

    @property
    def backlog_work_s(self) -> float:
        return self._backlog_work

    @property
    def backlog_by_replica(self) -> dict[str, float]:
        """The dispatched backlog's work per replica holding any (a copy)."""
        return dict(self._pinned)

    def sample(self, now: float, *, gpu_util: float = 0.0) -> DemandSample:
        """Close the interval since the last sample and describe it."""
        self._advance(now)
        interval = max(0.0, now - self._t0)
        n = self._arrivals
        mean = self._prefill / n if n else 0.0
        scv = 1.0
        if n > 1 and mean > 0:
            var = max(0.0, self._prefill_sq / n - mean * mean)
            scv = var / (mean * mean)
        ttft_p99 = float(np.percentile(self._ttfts, 99)) if self._ttfts else -1.0
        sample = DemandSample(
            t_s=now,
            interval_s=interval,
            arrivals=n,
            prefill_work_s=self._prefill,
            decode_work_s=self._decode,
            backlog_requests=self._backlog_n,
            backlog_work_s=self._backlog_work,
            backlog_by_replica=backlog_by_replica([self._pinned]),
            in_flight=len(self._open),
            in_flight_avg=self._area / interval if interval > 0 else float(len(self._open)),
            prefill_mean_s=mean,
            prefill_scv=scv,
            gpu_util=gpu_util,
            ttft_p99_s=ttft_p99,
            prefill_peaks=tuple((pw.w, pw.best, pw.best_n) for pw in self._peaks if pw.best_n),
        )
        self._t0 = now
        self._area = 0.0
        self._reset()
        return sample


__all__ = [
    "PEAK_REQUESTS",
    "PEAK_WINDOWS_S",
    "PEAK_WORK",
    "DemandMeter",
    "backlog_by_replica",
    "sum_peaks",
]
