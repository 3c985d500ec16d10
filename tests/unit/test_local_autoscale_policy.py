"""The local stack's policy and timeline (deploy/local_autoscale.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autoscaler.controller import TickResult
from autoscaler.hosts import FleetObservation
from autoscaler.types import DemandSample, ScaleDecision, ScaleReason
from controlplane.errors import ConfigError
from deploy.local_autoscale import (
    REFERENCE_LOAD_TIME_S,
    AutoscaleOptions,
    Timeline,
    local_policy,
)
from deploy.local_provider import EventKind, ProviderEvent


@pytest.mark.parametrize(
    ("load_time_s", "tick_s", "hysteresis_s"),
    [(REFERENCE_LOAD_TIME_S, 5.0, 300.0), (24.0, 1.0, 30.0), (3.0, 2.0, 4.0)],
)
def test_time_constants_scale_with_the_load_time(
    load_time_s: float, tick_s: float, hysteresis_s: float
) -> None:
    cfg = local_policy(load_time_s, tick_s).config
    assert cfg.hysteresis_s == pytest.approx(hysteresis_s)
    assert cfg.forecast.tick_s == tick_s
    assert cfg.warmup_s >= 2 * tick_s


def test_overrides_apply_and_unknown_ones_are_refused() -> None:
    assert local_policy(20.0, 2.0, spare=1).config.spare == 1
    with pytest.raises(ConfigError, match="nonsense"):
        local_policy(20.0, 2.0, nonsense=1)


class _Provider:
    draining = 1


def test_timeline_rows(tmp_path: Path) -> None:
    now = [100.0]
    path = tmp_path / "t.jsonl"
    tl = Timeline(path, _Provider(), lambda: now[0])  # type: ignore[arg-type]
    now[0] = 104.0
    sample = DemandSample(t_s=104.0, interval_s=2.0, arrivals=6, prefill_work_s=1.0,
                          decode_work_s=3.0)  # fmt: skip
    tl.tick(TickResult(ScaleDecision(3, ScaleReason.FORECAST_UP), sample,
                       FleetObservation(2, 1), True))  # fmt: skip
    tl.event(ProviderEvent(105.5, "local-1", EventKind.GONE, served=7, running=0))
    tl.close()
    tick, event = (json.loads(line) for line in path.read_text().splitlines())
    assert tick == {
        "kind": "tick", "t": 4.0, "target": 3, "reason": "forecast_up", "ordered": 2,
        "ready": 1, "draining": 1, "demand": 2.0, "arrivals_per_s": 3.0,
    }  # fmt: skip
    assert event == {"kind": "gone", "t": 5.5, "replica": "local-1", "served": 7, "running": 0,
                     "detail": ""}  # fmt: skip


@pytest.mark.parametrize(
    "kw",
    [
        {"load_time_s": -1.0},
        {"tick_s": 0.0},
        {"drain_timeout_s": 0.0},
        {"min_replicas": 3, "max_replicas": 2},
        {"min_replicas": -1},
        {"min_replicas": 0, "max_replicas": 0},
        {"policy_params": {"nonsense": 1}},
        {"policy_params": {"capacity": 1}},
    ],
)
def test_options_refuse_nonsense(kw: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        AutoscaleOptions(**kw)  # type: ignore[arg-type]


def test_options_defaults_are_valid() -> None:
    opts = AutoscaleOptions()
    assert opts.min_replicas <= opts.initial_replicas <= opts.max_replicas
