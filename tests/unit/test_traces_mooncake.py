"""Mooncake JSONL loader: the bundled excerpt, validation, and the real file when present."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from controlplane.errors import TraceError
from controlplane.settings import Settings
from controlplane.traces import fixture_path, load_mooncake, parse_mooncake
from controlplane.traces.loader import MOONCAKE_FIXTURE


def _line(**fields: object) -> str:
    base: dict[str, object] = {
        "timestamp": 0,
        "input_length": 1000,
        "output_length": 5,
        "hash_ids": [1, 2],
    }
    base.update(fields)
    return json.dumps({k: v for k, v in base.items() if v is not None})


def test_fixture_loads_in_file_order() -> None:
    path = fixture_path(MOONCAKE_FIXTURE)
    trace = load_mooncake(path, name="mc")
    raw = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(trace) == len(raw) == 300
    first = trace.requests[0]
    assert first.arrival_s == 0.0
    assert first.prompt_tokens == raw[0]["input_length"]
    assert first.output_tokens == max(1, raw[0]["output_length"])
    assert first.content_ids == tuple(raw[0]["hash_ids"])
    assert first.id_block_tokens == 512
    # the first two lines share timestamp 0: file order is kept, ids follow line order
    assert [r.request_id for r in trace.requests[:2]] == ["mc-0", "mc-1"]
    assert trace.requests[1].prompt_tokens == raw[1]["input_length"]
    arrivals = [r.arrival_s for r in trace.requests]
    assert arrivals == sorted(arrivals)
    assert trace.meta["format"] == "mooncake"


def test_equal_timestamps_keep_file_order() -> None:
    lines = [
        _line(timestamp=5, input_length=10, hash_ids=[7]),
        _line(timestamp=1, input_length=20, hash_ids=[8]),
        _line(timestamp=5, input_length=30, hash_ids=[9]),
    ]
    trace = parse_mooncake(lines, name="t")
    assert [r.prompt_tokens for r in trace] == [20, 10, 30]
    assert [r.request_id for r in trace] == ["t-1", "t-0", "t-2"]
    assert trace.requests[1].arrival_s == pytest.approx(0.005)


def test_zero_output_becomes_one_and_blank_lines_skip() -> None:
    trace = parse_mooncake(["", _line(output_length=0), "  "])
    assert len(trace) == 1
    assert trace.requests[0].output_tokens == 1
    assert trace.meta["clamped_zero_outputs"] == 1


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        (_line(hash_ids=None), "missing field(s) hash_ids"),
        (_line(timestamp=-1), "timestamp"),
        (_line(timestamp="3"), "timestamp"),
        (_line(input_length=-3), "input_length"),
        (_line(input_length=0), "input_length"),
        (_line(input_length=1.5), "input_length"),
        (_line(output_length=-1), "output_length"),
        (_line(hash_ids=[1, -2]), "hash_ids"),
        (_line(hash_ids="12"), "hash_ids"),
        (_line(input_length=512, hash_ids=[1, 2]), "more than ceil(512/512) = 1"),
    ],
)
def test_bad_lines_raise_with_location(line: str, message: str) -> None:
    with pytest.raises(TraceError) as err:
        parse_mooncake([_line(), line], source="f.jsonl")
    assert "f.jsonl:2" in str(err.value)
    assert message in str(err.value)


def test_fewer_ids_than_blocks_is_accepted_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="controlplane.traces.mooncake"):
        trace = parse_mooncake([_line(input_length=2000, hash_ids=[1])], source="f.jsonl")
    assert trace.meta["short_hash_ids_lines"] == 1
    assert "fewer hash_ids" in caplog.text
    # the undescribed tail is unshared: only the first 512-token id maps to engine blocks
    assert len(trace.requests[0].engine_block_hashes(16)) == 32


def test_other_block_granularity() -> None:
    trace = parse_mooncake([_line(input_length=40, hash_ids=[1, 2, 3])], block_tokens=16)
    assert trace.requests[0].id_block_tokens == 16


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read"):
        load_mooncake(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(TraceError, match="cannot read"):
        load_mooncake(bad)


def test_real_file_if_present() -> None:
    path = Settings().mooncake_trace
    if not path.is_file():
        pytest.skip(f"{path} not present")
    trace = load_mooncake(path)
    assert len(trace) == 3993
    assert trace.duration_s == pytest.approx(1022.025)
    assert sum(r.prompt_tokens for r in trace) / len(trace) == pytest.approx(15325.48, abs=0.01)
