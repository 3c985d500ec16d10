"""`load_trace` specs, fixture fallback, format sniffing and `trace_stats`."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from controlplane.errors import ConfigError, TraceError
from controlplane.settings import Settings
from controlplane.traces import fixture_path, load_trace, trace_stats
from controlplane.traces.loader import AZURE_CODE_FIXTURE, MOONCAKE_FIXTURE


@pytest.fixture
def empty_settings(tmp_path: Path) -> Settings:
    return Settings(data_dir=tmp_path)


@pytest.mark.parametrize(
    ("spec", "fixture", "size"),
    [("mooncake", MOONCAKE_FIXTURE, 300), ("azure-code", AZURE_CODE_FIXTURE, 300)],
)
def test_short_names_fall_back_to_fixtures(
    spec: str,
    fixture: str,
    size: int,
    empty_settings: Settings,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="controlplane.traces.loader"):
        trace = load_trace(spec, empty_settings)
    assert len(trace) == size
    assert fixture in caplog.text
    assert trace.meta["source"] == str(fixture_path(fixture))


def test_short_name_uses_real_file_when_present(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    target = settings.mooncake_trace
    target.parent.mkdir(parents=True)
    lines = fixture_path(MOONCAKE_FIXTURE).read_text().splitlines()[:10]
    target.write_text("\n".join(lines) + "\n")
    trace = load_trace("mooncake", settings)
    assert len(trace) == 10
    assert trace.name == "mooncake"


@pytest.mark.parametrize(
    ("source", "dest"),
    [
        (MOONCAKE_FIXTURE, "trace.jsonl"),
        (MOONCAKE_FIXTURE, "trace.txt"),
        (AZURE_CODE_FIXTURE, "trace.csv"),
        (AZURE_CODE_FIXTURE, "trace.log"),
    ],
)
def test_paths_by_extension_and_sniffing(source: str, dest: str, tmp_path: Path) -> None:
    path = tmp_path / dest
    shutil.copy(fixture_path(source), path)
    trace = load_trace(str(path))
    assert len(trace) == 300
    assert trace.meta["format"] == ("mooncake" if source == MOONCAKE_FIXTURE else "azure")


def test_unknown_files(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no trace file"):
        load_trace(str(tmp_path / "missing.jsonl"))
    odd = tmp_path / "odd.dat"
    odd.write_text("hello\n")
    with pytest.raises(TraceError, match="neither"):
        load_trace(str(odd))


def test_generator_specs() -> None:
    trace = load_trace("gen:shared-prefix?groups=20&prefix=6000&rate=5&seed=1")
    params = trace.meta["params"]
    assert isinstance(params, dict)
    assert (params["groups"], params["prefix"], params["rate"], params["seed"]) == (
        20,
        6000,
        5.0,
        1,
    )
    assert len(trace) == 100
    assert trace == load_trace("gen:shared-prefix?groups=20&prefix=6000&rate=5&seed=1")
    tenants = load_trace("gen:tenants?tenants=chat,batch&duration=30&rate-scale=0.5")
    assert {r.tenant for r in tenants} == {"chat", "batch"}
    assert len(load_trace("gen:multi-turn?sessions=2&turns=2")) == 4
    assert len(load_trace("gen:bursty")) > 0


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("gen:nope", "unknown generator"),
        ("gen:shared-prefix?bogus=1", "unknown parameter 'bogus'"),
        ("gen:shared-prefix?groups=many", "not a valid int"),
        ("gen:bursty?rate=fast", "not a valid float"),
    ],
)
def test_bad_generator_specs(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_trace(spec)


def test_trace_stats_fixture() -> None:
    stats = trace_stats(load_trace("mooncake-fixture"))
    assert stats["requests"] == 300
    assert stats["span_s"] == pytest.approx(86.79)
    assert stats["rate_rps"] == pytest.approx(300 / 86.79)
    assert stats["input_max"] >= stats["input_p99"] >= stats["input_p50"]  # type: ignore[operator]
    assert isinstance(stats["distinct_first_ids"], int) and stats["distinct_first_ids"] > 0
    assert stats["tenants"] == {"default": 300}


def test_trace_stats_percentiles() -> None:
    trace = load_trace("gen:shared-prefix?groups=1&users=4&prefix=0&question=100")
    stats = trace_stats(trace)
    assert (stats["input_mean"], stats["input_p50"], stats["input_max"]) == (100, 100, 100)
    assert stats["distinct_first_ids"] == 4


def test_real_files_stats_if_present() -> None:
    settings = Settings()
    if not settings.mooncake_trace.is_file() or not settings.azure_code_trace.is_file():
        pytest.skip("real traces not present")
    mc = trace_stats(load_trace("mooncake", settings))
    assert mc["requests"] == 3993
    assert mc["input_p50"] == 11587
    assert mc["distinct_first_ids"] == 2211
    az = trace_stats(load_trace("azure-code", settings))
    assert az["requests"] == 8819
    assert az["input_p50"] == 1469
