"""The A/B report: per-arm outcomes with 95% intervals, from routers' /metrics pages alone.

Input is the exposition of `router.telemetry.metrics` from one or more routers; samples with equal
name and labels are summed across routers (every router uses the same buckets). Per arm:

* **requests, error rate**: `cp_requests_total` summed over policy, reason and status; an error
  is any non-2xx status, including "client_closed" and "upstream_died". Interval: Wilson score.
* **TTFT / TPOT p50, p99**: estimated from the arm's histogram buckets as Prometheus'
  `histogram_quantile` does: rank = q·n, find the first bucket whose cumulative count reaches the
  rank, interpolate linearly inside it (lower edge 0 for the first bucket); a rank in the +Inf
  bucket returns the largest finite bound; fewer than two buckets (e.g. +Inf only) or no
  observations give no estimate. Interval: the order-statistic (distribution-free) interval: with
  B ~ Binomial(n, q), the order statistics X_(l) <= x_q <= X_(u) hold with probability ~95% for

      l = floor(n·q - z·sqrt(n·q·(1-q))),  u = ceil(n·q + z·sqrt(n·q·(1-q)))   (clamped to 0..n)

  (normal approximation of B), and X_(j) is read off the bucketed CDF as the quantile at rank j,
  i.e. `histogram_quantile(j / n)`. It covers sampling error only: the bucket resolution (the
  uniform-within-bucket assumption) is a further, unquantified error.
* **mean TTFT**: `_sum / _count`, interval mean ± z·s/sqrt(n) (CLT), with s² estimated from the
  buckets: each observation at its bucket's midpoint plus the bucket's uniform variance
  (width²/12); observations in the +Inf bucket count at the largest finite bound, which
  understates s when there are many.
* **prefix hit rate** = engine cached tokens / prompt tokens (the replica's own
  `usage.prompt_tokens_details.cached_tokens`), and **predicted hit rate** = tokens the router
  expected to hit / prompt tokens. Tokens of one request are not independent trials, so the
  interval is Wilson with n = the arm's successful requests: a per-request hit share lies in
  [0, 1], so its variance is at most p(1-p), and this is the binomial-bound interval for the
  mean share (exact when each request hits fully or not at all; prompt-length weighting ignored).

z = 1.96 throughout. Everything here is a pure function over parsed samples except
`fetch_exposition`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from controlplane.metrics_scrape import MetricsScrapeError

Z95 = 1.959963984540054
Labels = tuple[tuple[str, str], ...]
SampleKey = tuple[str, Labels]
Samples = Mapping[SampleKey, float]
Buckets = Sequence[tuple[float, float]]  # (upper bound `le`, cumulative count), sorted by le


@dataclass(frozen=True, slots=True)
class Estimate:
    """A point estimate with a 95% interval; None where the data cannot say."""

    value: float | None
    low: float | None = None
    high: float | None = None


NONE = Estimate(None)


@dataclass(frozen=True, slots=True)
class ArmReport:
    arm: str
    policies: tuple[str, ...]
    requests: int
    errors: int
    error_rate: Estimate
    ttft_p50: Estimate
    ttft_p99: Estimate
    tpot_p50: Estimate
    tpot_p99: Estimate
    ttft_mean: Estimate
    prompt_tokens: float
    engine_cached_tokens: float
    predicted_hit_tokens: float
    prefix_hit_rate: Estimate
    predicted_hit_rate: Estimate


def parse_samples(text: str) -> dict[SampleKey, float]:
    """Every sample of an exposition by (name, sorted labels); `_created` samples dropped."""
    out: dict[SampleKey, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.endswith("_created"):
                    continue
                out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    except ValueError as exc:
        raise MetricsScrapeError(f"cannot parse the metrics exposition: {exc}") from None
    return out


def sum_samples(pages: Iterable[Samples]) -> dict[SampleKey, float]:
    """Samples of several routers added up by (name, labels)."""
    total: dict[SampleKey, float] = defaultdict(float)
    for page in pages:
        for key, value in page.items():
            total[key] += value
    return dict(total)


def _select(samples: Samples, name: str, arm: str) -> Iterable[tuple[dict[str, str], float]]:
    for (n, labels), value in samples.items():
        if n == name:
            d = dict(labels)
            if d.get("arm") == arm:
                yield d, value


def _total(samples: Samples, name: str, arm: str) -> float:
    return sum(v for _, v in _select(samples, name, arm))


def arm_buckets(samples: Samples, histogram: str, arm: str) -> list[tuple[float, float]]:
    """The arm's cumulative buckets of `histogram` (summed over its other labels), by le."""
    by_le: dict[float, float] = defaultdict(float)
    for labels, value in _select(samples, f"{histogram}_bucket", arm):
        by_le[float(labels["le"])] += value
    return sorted(by_le.items())


def histogram_quantile(q: float, buckets: Buckets) -> float | None:
    """Prometheus' `histogram_quantile` over cumulative buckets (see the module docstring)."""
    if len(buckets) < 2 or not math.isinf(buckets[-1][0]) or not 0 <= q <= 1:
        return None
    n = buckets[-1][1]
    if n <= 0:
        return None
    rank = q * n
    # the first finite bucket reaching the rank (for rank 0: the first non-empty one)
    b = next((i for i, (_, c) in enumerate(buckets[:-1]) if c >= rank and c > 0), len(buckets) - 1)
    if b == len(buckets) - 1:
        return buckets[-2][0]
    end, count = buckets[b]
    if b == 0 and end <= 0:
        return end
    start = 0.0
    if b > 0:
        start, prev = buckets[b - 1]
        count -= prev
        rank -= prev
    return start + (end - start) * rank / count


def quantile_estimate(q: float, buckets: Buckets, z: float = Z95) -> Estimate:
    """The q-quantile with its order-statistic interval (see the module docstring)."""
    value = histogram_quantile(q, buckets)
    if value is None:
        return NONE
    n = buckets[-1][1]
    sd = math.sqrt(n * q * (1 - q))
    lo = min(max(math.floor(n * q - z * sd), 0), n)
    hi = min(max(math.ceil(n * q + z * sd), 0), n)
    return Estimate(value, histogram_quantile(lo / n, buckets), histogram_quantile(hi / n, buckets))


def histogram_mean(buckets: Buckets, total: float, z: float = Z95) -> Estimate:
    """Mean = _sum / _count with a CLT interval from the bucketed variance (module docstring)."""
    if not buckets or buckets[-1][1] <= 0:
        return NONE
    n = buckets[-1][1]
    mean = total / n
    if n < 2 or len(buckets) < 2:
        return Estimate(mean)
    last_finite = buckets[-2][0]
    ss = 0.0
    prev_le, prev_c = 0.0, 0.0
    for le, c in buckets:
        count = c - prev_c
        if math.isinf(le):
            mid, width = last_finite, 0.0
        else:
            start = min(prev_le, le)
            mid, width = (start + le) / 2, le - start
        ss += count * ((mid - mean) ** 2 + width**2 / 12)
        prev_le, prev_c = le, c
    half = z * math.sqrt(ss / (n - 1) / n)
    return Estimate(mean, max(mean - half, 0.0), mean + half)


def wilson(p_hat: float, n: float, z: float = Z95) -> Estimate:
    """Wilson score interval of a proportion p_hat observed over n trials."""
    if n <= 0:
        return NONE
    p = min(max(p_hat, 0.0), 1.0)
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return Estimate(p_hat, max(center - half, 0.0), min(center + half, 1.0))


def _is_ok(status: str) -> bool:
    return len(status) == 3 and status.startswith("2") and status.isdigit()


def arms_in(samples: Samples) -> list[str]:
    """Every arm named by a `cp_` sample, sorted."""
    arms = {dict(labels).get("arm") for name, labels in samples if name.startswith("cp_")}
    return sorted(a for a in arms if a is not None)


def arm_report(samples: Samples, arm: str) -> ArmReport:
    """One arm's numbers (see the module docstring)."""
    requests = errors = ok = 0.0
    policies: set[str] = set()
    for labels, value in _select(samples, "cp_requests_total", arm):
        requests += value
        if _is_ok(labels.get("status", "")):
            ok += value
        else:
            errors += value
        if value > 0 and "policy" in labels:
            policies.add(labels["policy"])
    ttft = arm_buckets(samples, "cp_ttft_seconds", arm)
    tpot = arm_buckets(samples, "cp_tpot_seconds", arm)
    prompt = _total(samples, "cp_prompt_tokens_total", arm)
    cached = _total(samples, "cp_engine_cached_tokens_total", arm)
    predicted = _total(samples, "cp_predicted_prefix_hit_tokens_total", arm)
    return ArmReport(
        arm=arm,
        policies=tuple(sorted(policies)),
        requests=round(requests),
        errors=round(errors),
        error_rate=wilson(errors / requests, requests) if requests > 0 else NONE,
        ttft_p50=quantile_estimate(0.5, ttft),
        ttft_p99=quantile_estimate(0.99, ttft),
        tpot_p50=quantile_estimate(0.5, tpot),
        tpot_p99=quantile_estimate(0.99, tpot),
        ttft_mean=histogram_mean(ttft, _total(samples, "cp_ttft_seconds_sum", arm)),
        prompt_tokens=prompt,
        engine_cached_tokens=cached,
        predicted_hit_tokens=predicted,
        prefix_hit_rate=wilson(cached / prompt, ok) if prompt > 0 else NONE,
        predicted_hit_rate=wilson(predicted / prompt, ok) if prompt > 0 else NONE,
    )


def build_report(pages: Iterable[Samples]) -> list[ArmReport]:
    """Per-arm reports over the summed pages of several routers, by arm name."""
    samples = sum_samples(pages)
    return [arm_report(samples, arm) for arm in arms_in(samples)]


def report_dict(reports: Sequence[ArmReport], sources: Sequence[str] = ()) -> dict[str, Any]:
    """The JSON form of a report: `{"sources": [...], "arms": [{...}, ...]}`."""
    return {"sources": list(sources), "arms": [asdict(r) for r in reports]}


def fetch_exposition(url: str, timeout_s: float = 5.0) -> str:
    """A router's /metrics text (http(s)://, or file:// for a saved page)."""
    if url.startswith("file://"):
        try:
            return Path(url.removeprefix("file://")).read_text()
        except OSError as exc:
            raise MetricsScrapeError(f"cannot read {url}: {exc}") from None
    try:
        resp = httpx.get(url, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise MetricsScrapeError(f"cannot fetch {url}: {exc}") from None
    if resp.status_code != 200:
        raise MetricsScrapeError(f"{url} answered HTTP {resp.status_code}")
    return resp.text


__all__ = [
    "ArmReport",
    "Estimate",
    "arm_report",
    "build_report",
    "fetch_exposition",
    "histogram_mean",
    "histogram_quantile",
    "parse_samples",
    "quantile_estimate",
    "report_dict",
    "sum_samples",
    "wilson",
]
