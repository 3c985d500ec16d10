"""Azure LLM inference CSV loader: 7-digit timestamps, mixed formats, the bundled excerpt."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from controlplane.errors import TraceError
from controlplane.settings import Settings
from controlplane.traces import fixture_path, load_azure, parse_azure, parse_timestamp_ns
from controlplane.traces.loader import AZURE_CODE_FIXTURE

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"
_EPOCH_NS = parse_timestamp_ns("1970-01-01 00:00:00")


@pytest.mark.parametrize(
    ("text", "expected_ns"),
    [
        ("2023-11-16 18:17:03.9799600", 1700158623_979960000),
        ("2023-11-16 18:17:03", 1700158623_000000000),
        ("2023-11-16T18:17:03.5", 1700158623_500000000),
        ("2023-11-16 18:17:03.123456789123", 1700158623_123456789),
        ("2023-11-16 18:17:03.25Z", 1700158623_250000000),
        ("2023-11-16 19:17:03.25+01:00", 1700158623_250000000),
        ("2023-11-16 17:17:03-0100", 1700158623_000000000),
        (" 2024-05-10 00:00:00.0057370 ", 1715299200_005737000),
    ],
)
def test_timestamp_parsing(text: str, expected_ns: int) -> None:
    assert parse_timestamp_ns(text) - _EPOCH_NS == expected_ns


def test_timestamp_matches_datetime_for_six_digits() -> None:
    dt = datetime(2023, 11, 16, 18, 17, 3, 979960, tzinfo=UTC)
    ns = parse_timestamp_ns("2023-11-16 18:17:03.979960") - _EPOCH_NS
    assert ns == round(dt.timestamp() * 1e6) * 1000


@pytest.mark.parametrize("text", ["2023-11-16", "16/11/2023 18:17:03", "2023-13-01 00:00:00", ""])
def test_bad_timestamps(text: str) -> None:
    with pytest.raises(ValueError):
        parse_timestamp_ns(text)


def test_fixture() -> None:
    trace = load_azure(fixture_path(AZURE_CODE_FIXTURE), name="az")
    assert len(trace) == 300
    first = trace.requests[0]
    assert (first.arrival_s, first.prompt_tokens, first.output_tokens) == (0.0, 4808, 10)
    assert trace.requests[1].arrival_s == pytest.approx(0.052)
    assert all(not r.content_ids for r in trace)
    assert [r.arrival_s for r in trace] == sorted(r.arrival_s for r in trace)


def test_mixed_2024_formats_and_column_order() -> None:
    lines = [
        "\ufeffContextTokens,TIMESTAMP,GeneratedTokens,Extra",
        "100,2024-05-10 00:00:00.5000000,3,x",
        "200,2024-05-10 00:00:01,0,y",
        "",
        "300,2024-05-10 00:00:00.25,7,z",
    ]
    lines[0] = lines[0].lstrip("\ufeff")
    trace = parse_azure(lines)
    # earliest row is the origin; sorted stably
    assert [(r.arrival_s, r.prompt_tokens) for r in trace] == [(0.0, 300), (0.25, 100), (0.75, 200)]
    assert trace.requests[2].output_tokens == 1
    assert trace.meta["clamped_zero_outputs"] == 1


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (["TIMESTAMP,ContextTokens"], "lacks column GeneratedTokens"),
        ([HEADER, "2023-11-16 18:17:03.1,10"], ":2: expected at least 3 columns"),
        ([HEADER, "2023-11-16 18:17:03.1,10,1", "yesterday,10,1"], ":3: unrecognised timestamp"),
        ([HEADER, "2023-11-16 18:17:03.1,-10,1"], "ContextTokens must be non-negative"),
        ([HEADER, "2023-11-16 18:17:03.1,10,abc"], "GeneratedTokens must be an integer"),
        ([], "empty file"),
    ],
)
def test_bad_input(rows: list[str], message: str) -> None:
    with pytest.raises(TraceError, match=message):
        parse_azure(rows, source="a.csv")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read"):
        load_azure(tmp_path / "nope.csv")


def test_real_file_if_present() -> None:
    path = Settings().azure_code_trace
    if not path.is_file():
        pytest.skip(f"{path} not present")
    trace = load_azure(path)
    assert len(trace) == 8819
    assert trace.duration_s == pytest.approx(3435.948, abs=1e-3)
