"""A user's own trace file in the autoscaling backtest: made into a day as the built-in traces
are (`autoscaler.backtest_traces.trace_day`), and `controlplane autoscale backtest` on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autoscaler.backtest_traces import backtest_trace, trace_day
from controlplane.cli import _register, app
from controlplane.errors import ConfigError, TraceError
from controlplane.traces import load_trace


@pytest.fixture
def user_csv(tmp_path: Path) -> Path:
    """Ten minutes of a user's traffic in the Azure CSV layout: one request every 2 s."""
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i in range(300):
        rows.append(
            f"2024-05-01 12:{i * 2 // 60:02d}:{i * 2 % 60:02d}.0000000,{500 + i},{20 + i % 7}"
        )
    path = tmp_path / "mine.csv"
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.mark.parametrize(
    ("kwargs", "expect"),
    [
        # flat, own rate: the 10-min file repeated over 30 min -> about 3 x 300 requests
        ({"day_s": 1800.0, "diurnal_swing": False}, (880, 905)),
        # twice the rate: twice the requests in the same day
        ({"day_s": 1800.0, "rate_scale": 2.0, "diurnal_swing": False}, (1770, 1805)),
        # the day's swing keeps (1 + trough) / 2 of them on average (0.625 for trough 0.25)
        ({"day_s": 1800.0}, (480, 640)),
    ],
)
def test_a_file_becomes_a_day(
    user_csv: Path, kwargs: dict[str, object], expect: tuple[int, int]
) -> None:
    day = trace_day(str(user_csv), **kwargs)  # type: ignore[arg-type]
    lo, hi = expect
    assert lo <= len(day.requests) <= hi
    assert all(0.0 <= r.arrival_s < 1800.0 for r in day.requests)
    src = {(r.prompt_tokens, r.output_tokens) for r in load_trace(str(user_csv)).requests}
    assert {(r.prompt_tokens, r.output_tokens) for r in day.requests} <= src  # lengths kept


def test_the_swing_is_seeded(user_csv: Path) -> None:
    a0 = trace_day(str(user_csv), day_s=1800.0, seed=0)
    a0_again = trace_day(str(user_csv), day_s=1800.0, seed=0)
    a1 = trace_day(str(user_csv), day_s=1800.0, seed=1)
    assert [r.arrival_s for r in a0.requests] == [r.arrival_s for r in a0_again.requests]
    assert [r.arrival_s for r in a0.requests] != [r.arrival_s for r in a1.requests]


def test_backtest_trace_keeps_a_spec_as_it_is_without_params(user_csv: Path) -> None:
    assert len(backtest_trace(str(user_csv)).requests) == 300
    assert len(backtest_trace(str(user_csv), day_s=600.0, diurnal_swing=False).requests) in (
        300,
        301,
    )


@pytest.mark.parametrize(
    "kwargs", [{"day_s": 0.0}, {"rate_scale": -1.0}, {"trough": 0.0}, {"trough": 1.5}]
)
def test_bad_day_parameters_are_refused(user_csv: Path, kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        trace_day(str(user_csv), **kwargs)  # type: ignore[arg-type]


def test_cli_backtests_a_user_file(user_csv: Path, tmp_path: Path) -> None:
    _register()
    out_json, out_png = tmp_path / "bt.json", tmp_path / "bt.png"
    args = ["autoscale", "backtest", "--trace", str(user_csv), "--policies", "static_peak"]
    args += ["--day", "15m", "--rate-scale", "4", "--seed", "2", "--max-replicas", "4"]
    args += ["--json", str(out_json), "--plot", str(out_png)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    doc = json.loads(out_json.read_text())
    (name,) = doc["traces"]
    tb = doc["traces"][name]
    assert tb["span_s"] <= 900.0
    assert tb["requests"] > 300  # 4x faster over 15 min, swung: more than the file holds
    assert "static_peak" in tb["policies"]
    assert out_png.stat().st_size > 0


def test_cli_refuses_a_missing_file(tmp_path: Path) -> None:
    _register()
    result = CliRunner().invoke(
        app,
        [
            "autoscale",
            "backtest",
            "--trace",
            str(tmp_path / "nope.csv"),
            "--policies",
            "static_peak",
        ],
    )
    assert result.exit_code != 0  # the `controlplane` entry point prints it, exit code 2
    assert isinstance(result.exception, TraceError)
    assert "no trace file" in str(result.exception)
