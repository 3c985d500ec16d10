"""The simulator compiled with mypyc: the same source, built into a separate tree.

The simulator's hot path (block pool, scheduler, engine, fleet loop, the routing books, the
roofline step model and every policy) is strict-typed Python, which mypyc compiles to C
extensions as it is. `build(dest)` copies the `controlplane` package to `dest` and compiles
`NATIVE_MODULES` there in place (a C compiler and the Python headers are needed; about 30 s);
`ensure_built(dest)` builds only when the source changed (a digest of every `.py` file). The
source tree never holds an extension module that would shadow an edited `.py` (an extension
module wins the import). A process with `dest` first on `sys.path` runs the compiled
simulator: `exec_compiled` re-runs a command that way (`controlplane replay --native`, the
benches' `--native`). The pure-Python simulator stays the reference, and a replay must match
it bit for bit (tests/unit/test_sim_native.py).

`controlplane/types.py` is not compiled: its memo field (`_memo: object = field(...)`) does
not import under mypyc.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

NATIVE_MODULES: tuple[str, ...] = (
    "controlplane/sim/block_pool.py",
    "controlplane/sim/scheduler.py",
    "controlplane/sim/request.py",
    "controlplane/sim/engine.py",
    "controlplane/prefix/speculative.py",
    "controlplane/sim/engine_index.py",
    "controlplane/sim/fleet.py",
    "controlplane/sim/ids.py",
    "controlplane/routing/books.py",
    "controlplane/routing/ledger.py",
    "controlplane/routing/load.py",
    "controlplane/routing/predictor.py",
    "controlplane/routing/ab.py",
    "controlplane/routing/policies/common.py",
    "controlplane/routing/policies/prefix_affinity.py",
    "controlplane/routing/policies/predicted_finish.py",
    "controlplane/routing/policies/round_robin.py",
    "controlplane/routing/policies/least_loaded.py",
    "controlplane/routing/policies/sglang_cache_aware.py",
    "controlplane/routing/policies/dynamo_kv_cost.py",
    "controlplane/routing/policies/llm_d_weighted.py",
    "controlplane/roofline/step.py",
)


def package_root() -> Path:
    """The directory holding the `controlplane` package of this process."""
    return Path(__file__).resolve().parents[2]


def available() -> str | None:
    """Why the compiled simulator cannot be built here (None: it can)."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        return "no C compiler (cc, gcc) on PATH"
    try:
        import mypyc  # noqa: F401
    except ImportError:
        return "mypyc is not installed (it ships with mypy: the dev extra)"
    return None


def build(dest: Path) -> Path:
    """Copy the package to `dest` and compile `NATIVE_MODULES` there; returns `dest`."""
    why = available()
    if why is not None:
        raise RuntimeError(f"cannot build the compiled simulator: {why}")
    dest.mkdir(parents=True, exist_ok=True)
    pkg = dest / "controlplane"
    if pkg.exists():
        shutil.rmtree(pkg)
    shutil.copytree(
        package_root() / "controlplane",
        pkg,
        ignore=shutil.ignore_patterns("__pycache__", "*.so"),
    )
    # mypyc builds through setuptools from the current directory: `dest` has no
    # pyproject.toml, so the project's own packaging metadata is not read
    subprocess.run(
        [sys.executable, "-m", "mypyc", *NATIVE_MODULES],
        cwd=dest,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return dest


def source_digest() -> str:
    """sha256 over every `.py` file of the package (path and content) and the module list."""
    h = hashlib.sha256(repr(NATIVE_MODULES).encode())
    pkg = package_root() / "controlplane"
    for path in sorted(pkg.rglob("*.py")):
        h.update(str(path.relative_to(pkg)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


STAMP = "native-source.sha256"


def ensure_built(dest: Path) -> Path:
    """`build(dest)` unless `dest` already holds a build of this exact source; returns `dest`."""
    digest = source_digest()
    stamp = dest / STAMP
    if stamp.exists() and stamp.read_text() == digest:
        return dest
    build(dest)
    stamp.write_text(digest)
    return dest


def cache_dir() -> Path:
    """Where the command line keeps its compiled tree: $XDG_CACHE_HOME/controlplane/native."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "controlplane" / "native"


def tree_env(root: Path) -> dict[str, str]:
    """This process's environment with `root` as the only PYTHONPATH entry and this process's
    data dir (a built tree would look for the traces beside itself)."""
    from controlplane.settings import get_settings

    data = str(get_settings().data_dir)
    return {**os.environ, "PYTHONPATH": str(root.resolve()), "CP_DATA_DIR": data}


def exec_compiled(dest: Path, argv: list[str]) -> None:
    """Replace this process by `python argv...` run on the compiled tree at `dest` (built:
    `ensure_built`): a command's `--native` switch. Never returns."""
    os.execve(sys.executable, [sys.executable, *argv], tree_env(dest))


# One replay, run by `replay_in` in a fresh interpreter: argv = workload ("mooncake": the
# recorded trace; else a matrix workload, seed 0), policy, load multiple, span s (0: all),
# replicas. Prints the CPU seconds, the span, the sha256 of every request's (id, replica, TTFT,
# end, rejected) and which hot modules (block pool, scheduler, fleet, the policy) are compiled.
REPLAY = """
import hashlib, json, sys, time
from controlplane.routing.policies import POLICIES, make_policy
from controlplane.roofline import profile
from controlplane.sim import block_pool, fleet, scheduler
from controlplane.sim.fleet import FleetConfig, FleetSim
from controlplane.sim.ids import dense_block_ids
from controlplane.sim.matrix import workload
from controlplane.sim.native import is_compiled
from controlplane.traces import load_trace
from controlplane.traces.model import Trace
name, policy, load, span, n = sys.argv[1:3] + [float(a) for a in sys.argv[3:5]] + [int(sys.argv[5])]
tr = load_trace("mooncake") if name == "mooncake" else workload(name, 0, n, load)
if span > 0:
    tr = Trace(tr.name, tuple(r for r in tr.requests if r.arrival_s < span))
prof = profile("h100", "llama-3.1-8b", block_size=16)
c0 = time.process_time()
ids, floor = dense_block_ids(tr, 16)
res = FleetSim(FleetConfig(profile=prof, replicas=n), lambda: make_policy(policy)).run(
    tr, block_ids=ids, id_floor=floor
)
cpu = time.process_time() - c0
rows = [(r.request_id, r.replica, r.ttft_s, r.finish_s, r.rejected) for r in res.records]
hot = (block_pool, scheduler, fleet, sys.modules[POLICIES[policy].__module__])
print(json.dumps({
    "requests": len(rows), "span_s": tr.duration_s, "cpu_s": cpu,
    "digest": hashlib.sha256(repr(rows).encode()).hexdigest(),
    "compiled": [is_compiled(m) for m in hot],
}))
"""


def replay_in(
    root: Path, workload: str, policy: str, load: float, span_s: float, replicas: int
) -> dict[str, Any]:
    """`REPLAY` on the tree at `root` (pure-Python: `package_root()`, or a built one)."""
    return run_in(root, REPLAY, workload, policy, str(load), str(span_s), str(replicas))


def run_in(root: Path, code: str, *args: str) -> dict[str, Any]:
    """Run `code` in a fresh interpreter with `root` first on `sys.path` (the pure-Python tree,
    `package_root()`, or a built one, `tree_env`); returns the JSON object its last output line
    holds."""
    out = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=root,
        env=tree_env(root),
        check=True,
        capture_output=True,
        text=True,
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def is_compiled(module: object) -> bool:
    """True when `module` was loaded from an extension module."""
    path = getattr(module, "__file__", "") or ""
    return path.endswith((".so", ".pyd"))


__all__ = [
    "NATIVE_MODULES",
    "available",
    "build",
    "cache_dir",
    "ensure_built",
    "exec_compiled",
    "is_compiled",
    "package_root",
    "replay_in",
    "run_in",
    "source_digest",
    "tree_env",
]
