"""The compiled simulator (mypyc, `controlplane.sim.native`) replays bit for bit like the
pure-Python one, which stays the reference."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from controlplane.sim.native import (
    NATIVE_MODULES,
    available,
    cache_dir,
    ensure_built,
    package_root,
    replay_in,
)

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))


@pytest.fixture(scope="module")
def cache_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An XDG cache home whose controlplane/native holds a build of this source."""
    return tmp_path_factory.mktemp("xdg")


@pytest.fixture(scope="module")
def native_tree(cache_home: Path, monkeypatch_module: pytest.MonkeyPatch) -> Path:
    monkeypatch_module.setenv("XDG_CACHE_HOME", str(cache_home))
    return ensure_built(cache_dir())


@pytest.fixture(scope="module")
def monkeypatch_module() -> Any:
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_every_hot_module_is_built(native_tree: Path) -> None:
    for src in NATIVE_MODULES:
        stem = (native_tree / src).with_suffix("")
        assert list(stem.parent.glob(f"{stem.name}.*.so")), src


@pytest.mark.parametrize(
    ("workload", "policy", "load"),
    [
        ("conversations", "prefix_affinity", 6.0),  # decode-heavy, saturating 4 replicas
        ("conversations", "predicted_finish", 6.0),
        ("conversations", "sglang_cache_aware", 6.0),
        ("shared-prefix-zipf", "round_robin", 3.0),
        ("shared-prefix-zipf", "least_loaded", 4.0),
        ("shared-prefix-zipf", "dynamo_kv_cost", 4.0),
        ("shared-prefix-zipf", "llm_d_weighted", 4.0),
    ],
)
def test_compiled_replay_is_bit_identical(
    native_tree: Path, workload: str, policy: str, load: float
) -> None:
    # 20 s of arrivals on 4 replicas, in a fresh interpreter per tree
    pure = replay_in(package_root(), workload, policy, load, 20.0, 4)
    compiled = replay_in(native_tree, workload, policy, load, 20.0, 4)
    assert pure["compiled"] == [False] * 4
    assert compiled["compiled"] == [True] * 4
    assert pure["requests"] == compiled["requests"] and pure["requests"]
    assert compiled["digest"] == pure["digest"]


def _cli_replay(tmp_path: Path, name: str, *extra: str) -> dict[str, Any]:
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, "-c", "from controlplane.cli import main; main()", "replay"]
    args = ["--trace", "gen:shared-prefix", "--max-requests", "300", "--replicas", "4"]
    args += ["--policies", "prefix_affinity,least_loaded", "--json", str(out), *extra]
    done = subprocess.run([*cmd, *args], check=True, capture_output=True, text=True)
    data: dict[str, Any] = json.loads(out.read_text())
    data["said compiled"] = "(compiled simulator)" in done.stdout
    data.pop("wall_seconds")
    for row in data["policies"].values():
        row.pop("wall_seconds")  # the only figure that may differ: how long it took
    return data


def test_cli_replay_native_matches_pure_python(native_tree: Path, tmp_path: Path) -> None:
    # the CLI finds the fixture's build under $XDG_CACHE_HOME and re-runs itself on it
    pure = _cli_replay(tmp_path, "pure")
    compiled = _cli_replay(tmp_path, "compiled", "--native")
    assert pure.pop("said compiled") is False
    assert compiled.pop("said compiled") is True
    assert pure["policies"] and compiled == pure
