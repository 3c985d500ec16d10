"""The compiled simulator (mypyc, `controlplane.sim.native`) replays bit for bit like the
pure-Python one, which stays the reference."""

from __future__ import annotations

from pathlib import Path

import pytest

from controlplane.sim.native import NATIVE_MODULES, available, build, package_root, run_in

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))

# one replay per case, in a fresh interpreter whose sys.path starts at the tree given: the
# record of every request (id, replica, TTFT, end) hashed, and which hot modules are compiled
REPLAY = """
import hashlib, json, sys
from controlplane.routing.policies import make_policy
from controlplane.roofline import profile
from controlplane.routing.policies import POLICIES
from controlplane.sim import block_pool, fleet, scheduler
from controlplane.sim.fleet import FleetConfig, FleetSim
from controlplane.sim.ids import dense_block_ids
from controlplane.sim.matrix import workload
from controlplane.sim.native import is_compiled
from controlplane.traces.model import Trace
name, policy, load, span = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
tr = workload(name, 0, 4, load)
tr = Trace(tr.name, tuple(r for r in tr.requests if r.arrival_s < span))
prof = profile("h100", "llama-3.1-8b", block_size=16)
ids, floor = dense_block_ids(tr, 16)
sim = FleetSim(FleetConfig(profile=prof, replicas=4), lambda: make_policy(policy))
res = sim.run(tr, block_ids=ids, id_floor=floor)
rows = [(r.request_id, r.replica, r.ttft_s, r.finish_s, r.rejected) for r in res.records]
print(json.dumps({
    "digest": hashlib.sha256(repr(rows).encode()).hexdigest(),
    "requests": len(rows),
    "compiled": [
        is_compiled(m)
        for m in (block_pool, scheduler, fleet, sys.modules[POLICIES[policy].__module__])
    ],
}))
"""


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
    args = (workload, policy, str(load), "20")
    pure = run_in(package_root(), REPLAY, *args)
    compiled = run_in(native_tree, REPLAY, *args)
    assert pure["compiled"] == [False] * 4
    assert compiled["compiled"] == [True] * 4
    assert pure["requests"] == compiled["requests"] and pure["requests"]
    assert compiled["digest"] == pure["digest"]
