"""The compiled simulator (mypyc, `controlplane.sim.native`) replays bit for bit like the
pure-Python one, which stays the reference."""

from __future__ import annotations

from pathlib import Path

import pytest

from controlplane.sim.native import NATIVE_MODULES, available, build, package_root, replay_in

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))


@pytest.fixture(scope="module")
def native_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("native"))


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
