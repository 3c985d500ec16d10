"""No package imports one above it.

The layers, lowest first (a module may import its own layer and every layer below):

    core        controlplane.* not named below: types, errors, settings, roofline, hashing,
                tokenization, traces, prefix, kvevents, store, metrics_scrape
    routing     controlplane.routing: policies, ledger, load, predictor, the routing books
    tenancy     controlplane.tenancy: identity, salts, VTC, quotas, the tenant-queue core
    simulator   controlplane.sim, controlplane.sim_replica (the simulated vLLM server)
    autoscaler  autoscaler.* (its hosts include the simulator's)
    router      router.* (the live router)
    deploy      deploy.* (launchers, Ray Serve builders)
    cli         controlplane.cli.*, and every `__main__` module (entry points)

Every import is read from the source (module level, inside functions, and under
`TYPE_CHECKING`): a lazy import that runs the wrong way is a cycle all the same.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("controlplane", "router", "autoscaler", "deploy")

# (module prefix, layer); the longest matching prefix wins
LAYERS: tuple[tuple[str, int], ...] = (
    ("controlplane", 0),
    ("controlplane.routing", 1),
    ("controlplane.tenancy", 2),
    ("controlplane.sim", 3),
    ("controlplane.sim_replica", 3),
    ("autoscaler", 4),
    ("router", 5),
    ("deploy", 6),
    ("controlplane.cli", 7),
)
NAMES = {0: "core", 1: "routing", 2: "tenancy", 3: "simulator", 4: "autoscaler", 5: "router"}
NAMES |= {6: "deploy", 7: "cli"}


def layer_of(module: str) -> int | None:
    if module.split(".")[-1] == "__main__":
        return max(n for _, n in LAYERS)
    best: tuple[int, int] | None = None
    for prefix, n in LAYERS:
        inside = module == prefix or module.startswith(prefix + ".")
        if inside and (best is None or len(prefix) > best[0]):
            best = (len(prefix), n)
    return None if best is None else best[1]


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every absolute import of the project's packages."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return [(line, m) for line, m in out if m.split(".")[0] in PACKAGES]


def upward_imports(root: Path = ROOT) -> list[str]:
    bad = []
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            mod = module_name(path, root)
            own = layer_of(mod)
            assert own is not None, mod
            for line, target in imports_of(path):
                theirs = layer_of(target)
                if theirs is not None and theirs > own:
                    rel = path.relative_to(root)
                    bad.append(
                        f"{rel}:{line} {mod} ({NAMES[own]}) imports {target} ({NAMES[theirs]})"
                    )
    return bad


def test_no_package_imports_one_above_it() -> None:
    assert upward_imports() == []


@pytest.mark.parametrize(
    ("module", "layer"),
    [
        ("controlplane.types", "core"),
        ("controlplane.store.breaker", "core"),
        ("controlplane.routing.policies.round_robin", "routing"),
        ("controlplane.tenancy.vtc", "tenancy"),
        ("controlplane.sim.fleet", "simulator"),
        ("controlplane.sim_replica.app", "simulator"),
        ("autoscaler.hosts.sim", "autoscaler"),
        ("router.http.relay", "router"),
        ("deploy.local_fleet", "deploy"),
        ("controlplane.cli.replay", "cli"),
        ("controlplane.sim_replica.__main__", "cli"),
    ],
)
def test_layer_table(module: str, layer: str) -> None:
    n = layer_of(module)
    assert n is not None and NAMES[n] == layer


def test_an_upward_import_is_caught(tmp_path: Path) -> None:
    """The check fails on a lazy import from the simulator into the router."""
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "controlplane" / "sim").mkdir()
    (tmp_path / "controlplane" / "sim" / "__init__.py").write_text("")
    (tmp_path / "controlplane" / "sim" / "fleet.py").write_text(
        "def f():\n    from router.core import RouterCore\n    return RouterCore\n"
    )
    (tmp_path / "router" / "core.py").write_text("from controlplane.sim.fleet import f\n")
    bad = upward_imports(tmp_path)
    assert len(bad) == 1
    assert "controlplane.sim.fleet (simulator) imports router.core (router)" in bad[0]
