"""`controlplane fleet diff` over captures, and the CLI's clear errors (no network)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from controlplane.cli import _register, app
from controlplane.replica_info import ReplicaInfo, ServedModel, write_capture

_register()
runner = CliRunner()


def info(block: int = 32, version: str = "0.32.0") -> ReplicaInfo:
    return ReplicaInfo(
        url="http://r",
        models=(ServedModel("tiny-llama", 1024, "/m"),),
        block_size=block,
        num_gpu_blocks=100,
        enable_prefix_caching=True,
        prefix_caching_hash_algo="sha256",
        version=version,
    )


@pytest.fixture
def captures(tmp_path: Path) -> tuple[Path, Path]:
    before, after = tmp_path / "before.json", tmp_path / "after.json"
    before.write_text(write_capture({"a": info(), "b": info()}))
    after.write_text(write_capture({"a": info(version="0.33.0"), "b": info(), "c": info()}))
    return before, after


def test_diff_of_two_captures_compares_replicas_by_name(captures: tuple[Path, Path]) -> None:
    before, after = captures
    res = runner.invoke(app, ["fleet", "diff", str(before), str(after), "--json"])
    assert res.exit_code == 1, res.output
    rows = json.loads(res.output)
    assert [(r["a"], r["field"], r["a_value"], r["b_value"]) for r in rows] == [
        ("a", "version", "0.32.0", "0.33.0"),
        ("c", "missing on side A", False, True),
    ]


def test_diff_of_one_replica_of_each_capture(captures: tuple[Path, Path]) -> None:
    before, after = captures
    res = runner.invoke(app, ["fleet", "diff", f"{before}#b", f"{after}#c"])
    assert (res.exit_code, res.output.strip()) == (0, "no differences")
    res = runner.invoke(app, ["fleet", "diff", f"{before}#a", f"{after}#a"])
    assert res.exit_code == 1
    assert "version" in res.output and "0.33.0" in res.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["diff", "{before}#zz", "{after}"], "has no replica 'zz'"),
        (["diff", "{before}", "/no/such/file.json"], "cannot read capture"),
        (["describe", "localhost:8000"], "not a replica URL"),
    ],
)
def test_clear_errors(captures: tuple[Path, Path], args: list[str], message: str) -> None:
    before, after = captures
    argv = ["fleet", *(a.format(before=before, after=after) for a in args)]
    res = runner.invoke(app, argv)
    assert res.exit_code != 0
    assert res.exception is not None and message in str(res.exception)
