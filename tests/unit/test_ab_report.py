"""The A/B report: quantiles from buckets, intervals, per-arm sums across routers, the CLI."""

from __future__ import annotations

import bisect
import json
import math
import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

from controlplane.cli import _register, app
from controlplane.metrics_scrape import MetricsScrapeError
from router.telemetry.ab_report import (
    NONE,
    Estimate,
    arm_buckets,
    build_report,
    histogram_mean,
    histogram_quantile,
    parse_samples,
    quantile_estimate,
    report_dict,
    sum_samples,
    wilson,
)
from router.telemetry.metrics import RouterMetrics

INF = math.inf
TENTHS = [(round(0.1 * i, 1), 10.0 * i) for i in range(1, 11)] + [(INF, 100.0)]


@pytest.mark.parametrize(
    ("q", "buckets", "expected"),
    [
        (0.5, [(0.1, 10), (0.5, 30), (1.0, 40), (INF, 40)], 0.3),
        (0.25, [(0.1, 10), (0.5, 30), (1.0, 40), (INF, 40)], 0.1),
        (1.0, [(0.1, 10), (0.5, 30), (1.0, 40), (INF, 40)], 1.0),
        (0.0, [(0.1, 10), (0.5, 30), (1.0, 40), (INF, 40)], 0.0),
        (0.0, [(0.1, 0), (0.5, 4), (INF, 4)], 0.1),  # minimum: first non-empty bucket's edge
        (0.5, [(0.1, 0), (INF, 5)], 0.1),  # rank in +Inf: the largest finite bound
        (0.99, [(0.1, 90), (1.0, 98), (INF, 100)], 1.0),
        (0.25, [(0.0, 2), (1.0, 4), (INF, 4)], 0.0),  # first bound <= 0 returns it
        (0.5, TENTHS, 0.5),
        (0.37, TENTHS, 0.37),
        (0.5, [(INF, 5)], None),  # +Inf bucket only
        (0.5, [(0.1, 0), (INF, 0)], None),  # no observations
        (0.5, [], None),
        (1.5, TENTHS, None),
    ],
)
def test_histogram_quantile(
    q: float, buckets: list[tuple[float, float]], expected: float | None
) -> None:
    got = histogram_quantile(q, buckets)
    if expected is None:
        assert got is None
    else:
        assert got == pytest.approx(expected)


@pytest.mark.parametrize(
    ("q", "expected"),
    [
        # n=100, q=0.5: sd 5, ranks floor(50 - 9.8) = 40 and ceil(50 + 9.8) = 60
        (0.5, Estimate(0.5, 0.4, 0.6)),
        # q=0.99: sd 0.995, ranks floor(99 - 1.95) = 97 and min(ceil(100.95), 100) = 100
        (0.99, Estimate(0.99, 0.97, 1.0)),
    ],
)
def test_quantile_interval_ranks(q: float, expected: Estimate) -> None:
    got = quantile_estimate(q, TENTHS)
    assert (got.value, got.low, got.high) == pytest.approx(
        (expected.value, expected.low, expected.high)
    )


@pytest.mark.parametrize(("q", "n"), [(0.5, 200), (0.99, 2000)])
def test_quantile_interval_covers_the_true_quantile(q: float, n: int) -> None:
    # Uniform(0, 1) observations in 100 equal buckets: interpolation is unbiased there, so the
    # interval's coverage is its sampling coverage, ~95%.
    reps, rng = 300, random.Random(7)
    edges = [i / 100 for i in range(1, 101)]
    covered = 0
    for _ in range(reps):
        xs = sorted(rng.random() for _ in range(n))
        buckets = [(e, float(bisect.bisect_right(xs, e))) for e in edges] + [(INF, float(n))]
        est = quantile_estimate(q, buckets)
        assert est.low is not None and est.high is not None
        covered += est.low <= q <= est.high
    # 95% nominal; allow 4 binomial sds of the coverage estimate below it (plus rank rounding,
    # which only widens the interval)
    assert covered / reps >= 0.95 - 4 * math.sqrt(0.95 * 0.05 / reps)


@pytest.mark.parametrize(
    ("p_hat", "n", "low", "high"),
    [
        (0.5, 10, 0.2366, 0.7634),
        (0.0, 10, 0.0, 0.2775),
        (1.0, 10, 0.7225, 1.0),
        (0.02, 1000, 0.0130, 0.0307),
    ],
)
def test_wilson(p_hat: float, n: int, low: float, high: float) -> None:
    est = wilson(p_hat, n)
    assert est.value == p_hat
    assert (est.low, est.high) == pytest.approx((low, high), abs=1e-4)


def test_wilson_without_trials() -> None:
    assert wilson(0.0, 0) == NONE


@pytest.mark.parametrize(
    ("buckets", "total", "expected_mean", "has_interval"),
    [
        (TENTHS, 50.0, 0.5, True),
        ([(1.0, 1), (INF, 1)], 0.4, 0.4, False),  # one observation: no spread to estimate
        ([(INF, 3)], 6.0, 2.0, False),  # +Inf only
        ([(1.0, 0), (INF, 0)], 0.0, None, False),
        ([], 0.0, None, False),
    ],
)
def test_histogram_mean(
    buckets: list[tuple[float, float]],
    total: float,
    expected_mean: float | None,
    has_interval: bool,
) -> None:
    est = histogram_mean(buckets, total)
    assert est.value == (None if expected_mean is None else pytest.approx(expected_mean))
    assert (est.low is not None) == has_interval


def test_histogram_mean_interval_matches_the_uniform_sd() -> None:
    # 100 observations evenly over [0, 1]: s ~ 1/sqrt(12), half-width 1.96 * s / 10
    est = histogram_mean(TENTHS, 50.0)
    assert est.low is not None and est.high is not None
    half = 1.959963984540054 * math.sqrt(100 / 99 / 12) / 10
    assert (est.low, est.high) == pytest.approx((0.5 - half, 0.5 + half), rel=1e-6)


# ---- whole reports from exposition text ------------------------------------------------------


def hist(name: str, arm: str, policy: str, counts: list[tuple[str, int]], total: float) -> str:
    lines = [f'{name}_bucket{{arm="{arm}",policy="{policy}",le="{le}"}} {c}' for le, c in counts]
    n = counts[-1][1] if counts else 0
    lines += [
        f'{name}_count{{arm="{arm}",policy="{policy}"}} {n}',
        f'{name}_sum{{arm="{arm}",policy="{policy}"}} {total}',
    ]
    return "\n".join(lines)


def page(requests: dict[tuple[str, str, str], int], extra: str = "") -> str:
    lines = ["# TYPE cp_requests_total counter"]
    for (arm, policy, status), n in requests.items():
        lines.append(
            f'cp_requests_total{{arm="{arm}",policy="{policy}",reason="r",status="{status}"}} {n}'
        )
    return "\n".join(lines) + "\n" + extra + "\n"


ROUTER_1 = page(
    {("a", "prefix_affinity", "200"): 90, ("a", "prefix_affinity", "503"): 5},
    "\n".join(
        [
            "# TYPE cp_ttft_seconds histogram",
            hist(
                "cp_ttft_seconds",
                "a",
                "prefix_affinity",
                [("0.1", 40), ("0.5", 90), ("+Inf", 90)],
                18.0,
            ),
            'cp_prompt_tokens_total{arm="a",policy="prefix_affinity"} 9000',
            'cp_engine_cached_tokens_total{arm="a",policy="prefix_affinity"} 4500',
            'cp_predicted_prefix_hit_tokens_total{arm="a",policy="prefix_affinity"} 5000',
        ]
    ),
)
ROUTER_2 = page(
    {
        ("a", "prefix_affinity", "200"): 10,
        ("a", "prefix_affinity", "client_closed"): 5,
        ("b", "round_robin", "200"): 50,
        ("idle", "least_loaded", "200"): 0,
    },
    "\n".join(
        [
            "# TYPE cp_ttft_seconds histogram",
            hist(
                "cp_ttft_seconds",
                "a",
                "prefix_affinity",
                [("0.1", 0), ("0.5", 10), ("+Inf", 10)],
                3.0,
            ),
            hist("cp_ttft_seconds", "b", "round_robin", [("+Inf", 50)], 40.0),
            'cp_prompt_tokens_total{arm="a",policy="prefix_affinity"} 1000',
            'cp_engine_cached_tokens_total{arm="a",policy="prefix_affinity"} 500',
            'cp_prompt_tokens_total{arm="b",policy="round_robin"} 5000',
            'cp_engine_cached_tokens_total{arm="b",policy="round_robin"} 0',
            'cp_engine_prefix_cache_hits_tokens{replica="r1"} 123',
        ]
    ),
)


def test_report_sums_routers_per_arm() -> None:
    reports = {r.arm: r for r in build_report([parse_samples(ROUTER_1), parse_samples(ROUTER_2)])}
    assert list(reports) == ["a", "b", "idle"]

    a = reports["a"]
    assert (a.policies, a.requests, a.errors) == (("prefix_affinity",), 110, 10)
    assert a.error_rate.value == pytest.approx(10 / 110)
    assert a.error_rate.low is not None and a.error_rate.low < 10 / 110 < (a.error_rate.high or 0)
    # summed buckets: 40 at <= 0.1, 100 at <= 0.5; p50 rank 50 -> 0.1 + 0.4 * 10 / 60
    assert a.ttft_p50.value == pytest.approx(0.1 + 0.4 * 10 / 60)
    assert a.ttft_mean.value == pytest.approx(21.0 / 100)
    assert (a.prompt_tokens, a.engine_cached_tokens, a.predicted_hit_tokens) == (
        10000,
        5000,
        5000,
    )
    assert a.prefix_hit_rate.value == pytest.approx(0.5)
    assert a.prefix_hit_rate == wilson(0.5, 100)  # n = the arm's successful requests
    assert a.predicted_hit_rate.value == pytest.approx(0.5)
    assert a.tpot_p50 == NONE  # no TPOT histogram on the page

    b = reports["b"]  # +Inf bucket only: counts and mean, no quantiles
    assert (b.requests, b.errors, b.error_rate.value) == (50, 0, 0.0)
    assert b.ttft_p50 == NONE and b.ttft_p99 == NONE
    assert b.ttft_mean == Estimate(0.8)
    assert b.prefix_hit_rate.value == 0.0

    idle = reports["idle"]  # zero requests: nothing to estimate, nothing divided by zero
    assert (idle.requests, idle.errors, idle.policies) == (0, 0, ())
    assert idle.error_rate == NONE and idle.ttft_p50 == NONE and idle.prefix_hit_rate == NONE


def test_sum_samples_adds_equal_series() -> None:
    one = parse_samples(ROUTER_1)
    doubled = sum_samples([one, one])
    assert arm_buckets(doubled, "cp_ttft_seconds", "a") == [(0.1, 80.0), (0.5, 180.0), (INF, 180.0)]


def test_report_from_the_routers_own_metrics() -> None:
    m = RouterMetrics()
    for i in range(20):
        m.requests.labels(arm="x", policy="round_robin", reason="round_robin", status="200").inc()
        m.ttft.labels(arm="x", policy="round_robin").observe(0.02 + i * 0.001)
        m.tpot.labels(arm="x", policy="round_robin").observe(0.012)
        m.prompt_tokens.labels(arm="x", policy="round_robin").inc(100)
        m.engine_cached_tokens.labels(arm="x", policy="round_robin").inc(25)
    m.requests.labels(
        arm="x", policy="round_robin", reason="round_robin", status="upstream_died"
    ).inc()
    (report,) = build_report([parse_samples(m.render()[0].decode())])
    assert (report.arm, report.requests, report.errors) == ("x", 21, 1)
    assert report.ttft_p50.value is not None and 0.025 <= report.ttft_p50.value <= 0.05
    assert report.tpot_p99.value is not None and 0.01 <= report.tpot_p99.value <= 0.02
    assert report.prefix_hit_rate.value == pytest.approx(0.25)
    assert report.ttft_mean.value == pytest.approx(0.02 + 0.0095)


def test_report_dict_is_json() -> None:
    reports = build_report([parse_samples(ROUTER_2)])
    data = json.loads(json.dumps(report_dict(reports, ["file:///x"])))
    assert data["sources"] == ["file:///x"]
    assert [a["arm"] for a in data["arms"]] == ["a", "b", "idle"]
    assert data["arms"][2]["ttft_p50"] == {"value": None, "low": None, "high": None}


def test_unparseable_page() -> None:
    with pytest.raises(MetricsScrapeError, match="cannot parse"):
        parse_samples('cp_requests_total{arm="a" 1\n')


# ---- CLI -------------------------------------------------------------------------------------


def test_cli_report_sums_pages_and_writes_json(tmp_path: Path) -> None:
    _register()
    one, two = tmp_path / "r1.txt", tmp_path / "r2.txt"
    one.write_text(ROUTER_1)
    two.write_text(ROUTER_2)
    out = tmp_path / "report.json"
    result = CliRunner().invoke(
        app,
        ["ab", "report", "--url", f"file://{one}", "--url", f"file://{two}", "--json", str(out)],
    )
    assert result.exit_code == 0, result.output
    assert "prefix_affinity" in result.output and "round_robin" in result.output
    assert "50.0%" in result.output  # arm a's prefix hit rate
    data = json.loads(out.read_text())
    assert {a["arm"]: a["requests"] for a in data["arms"]} == {"a": 110, "b": 50, "idle": 0}


def test_cli_report_empty_page(tmp_path: Path) -> None:
    _register()
    empty = tmp_path / "empty.txt"
    empty.write_text("# TYPE cp_requests_total counter\n")
    result = CliRunner().invoke(app, ["ab", "report", "--url", f"file://{empty}"])
    assert result.exit_code == 0
    assert "no cp_ metrics" in result.output


def test_cli_report_unreachable_router(tmp_path: Path) -> None:
    _register()
    result = CliRunner().invoke(app, ["ab", "report", "--url", f"file://{tmp_path}/missing"])
    assert isinstance(result.exception, MetricsScrapeError)
