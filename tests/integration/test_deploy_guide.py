"""docs/deploy-kubernetes.md stays true to the chart it describes.

No cluster runs here, so the guide's kubectl steps cannot be executed; what they name is checked
against the chart rendered the way the guide installs it (release `cp`, namespace `llm`, the full
values): every object name, every label selector, every chart value path (against
values.schema.json) and every router setting path (against `RouterSettings`), every metric it
names (against the code); its `kubectl create` steps run as client-side dry runs. The guide's
`controlplane config show` / `config diff` run on the rendered router configuration; its `helm`
lines run as written (lint, template), as a client-side dry run (install) or as the render of the
same flags (upgrade). What needs a cluster (get, logs, exec, port-forward, the curl checks) is
checked for the names it uses only.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from helm_chart import CHART, NAMESPACE, RELEASE, REPO, ChartCopy, Obj, one, run, tool

from router.config import RouterSettings

GUIDE = (REPO / "docs" / "deploy-kubernetes.md").read_text()
ROOTS = ("image", "router", "redis", "indexer", "autoscaler", "engines", "monitoring", "rayService")


@pytest.fixture(scope="module")
def objs(tmp_path_factory: pytest.TempPathFactory) -> list[Obj]:
    tool("helm")
    return ChartCopy.make(tmp_path_factory.mktemp("chart")).render("full")


def test_guide_installs_the_release_the_tests_render() -> None:
    assert f"helm install {RELEASE} helm/controlplane -n {NAMESPACE}" in GUIDE


def test_every_object_name_exists(objs: list[Obj]) -> None:
    names = {o.name for o in objs}
    pods = {f"{o.name}-{i}" for o in objs if o.kind == "StatefulSet" for i in range(8)}
    mentioned = set(re.findall(rf"\b{RELEASE}-controlplane-[a-z0-9-]*[a-z0-9]", GUIDE))
    assert mentioned and mentioned - names - pods == set()


def test_every_label_selector_matches_pods(objs: list[Obj]) -> None:
    labels = [
        o.doc["spec"]["template"]["metadata"]["labels"]
        for o in objs
        if o.kind in ("Deployment", "StatefulSet")
    ]
    for selector in re.findall(r"-l ([^\s`]+)", GUIDE):
        terms = dict(t.split("=") for t in selector.split(","))
        assert any(terms.items() <= lab.items() for lab in labels), selector


def _resolve(schema: dict[str, Any], path: str) -> bool:
    node = schema
    for part in re.sub(r"\[\d*\]", ".[]", path).split("."):
        if part == "[]":
            node = node.get("items", {})
            continue
        props = node.get("properties", {})
        if part not in props:
            return False
        node = props[part]
    return True


def test_every_value_path_is_in_the_schema() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    paths = set(re.findall(rf"`((?:{'|'.join(ROOTS)})\.[A-Za-z0-9_.\[\]]+)", GUIDE))
    paths |= set(re.findall(rf"--set ((?:{'|'.join(ROOTS)})\.[A-Za-z0-9_.\[\]]+)=", GUIDE))
    router_cfg = {p for p in paths if p.startswith("router.config.")}
    assert paths
    assert sorted(p for p in paths - router_cfg if not _resolve(schema, p)) == []
    # router.config.* are the router's own settings
    for p in router_cfg:
        node: Any = RouterSettings
        for part in p.removeprefix("router.config.").split("."):
            assert part in node.model_fields, p
            node = node.model_fields[part].annotation


def test_config_show_and_diff_on_the_rendered_router_config(
    objs: list[Obj], tmp_path: Path
) -> None:
    config = tmp_path / "router.yaml"
    config.write_text(one(objs, "ConfigMap", "-router").doc["data"]["router.yaml"])
    env = {**os.environ, "PYTHONPATH": str(REPO), "CP_ADMIN_KEY": "from-a-secret"}
    cli = [sys.executable, "-c", "from controlplane.cli import main; main()"]

    def controlplane(*args: str) -> str:
        done = subprocess.run(
            [*cli, *args], capture_output=True, text=True, env=env, timeout=120, check=False
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    before = tmp_path / "router-before.yaml"
    before.write_text(controlplane("config", "show", "--config", str(config)))
    assert "admin_key: '**********'" in before.read_text()
    assert "no differences" in controlplane("config", "diff", str(before), str(before))


def test_every_metric_named_is_exported_by_the_code() -> None:
    sources = "\n".join(
        p.read_text()
        for pkg in ("router", "controlplane", "autoscaler")
        for p in (REPO / pkg).rglob("*.py")
    )
    names = {n for n in re.findall(r"\b(cp_[a-z_]+)", GUIDE) if not n.endswith("_")}
    assert names
    # a Counter "cp_x" is exported as cp_x_total: either spelling in the code counts
    missing = [n for n in names if f'"{n}"' not in sources and f'"{n.removesuffix("_total")}"'
               not in sources]  # fmt: skip
    assert sorted(missing) == []


def test_the_guides_kubectl_create_steps_make_what_the_values_name() -> None:
    """The two steps that need no cluster run as client-side dry runs: the namespace, and the
    HF token Secret the full values' engines.hfTokenSecret refers to."""
    kubectl = tool("kubectl")
    values = yaml.safe_load((CHART / "ci" / "full-values.yaml").read_text())
    made = []
    for line in re.findall(r"^(kubectl (?:-n \S+ )?create .+)$", GUIDE, re.M):
        args = line.split()[1:]
        args = [a if "$HF_TOKEN" not in a else a.replace('"$HF_TOKEN"', "hf_x") for a in args]
        done = run([kubectl, *args, "--dry-run=client", "-o", "yaml"])
        assert done.returncode == 0, done.stderr
        made.append(yaml.safe_load(done.stdout))
    kinds = {(d["kind"], d["metadata"]["name"]) for d in made}
    assert ("Namespace", NAMESPACE) in kinds
    ref = values["engines"]["hfTokenSecret"]
    secret = next(d for d in made if d["kind"] == "Secret")
    assert secret["metadata"]["name"] == ref["name"] and ref["key"] in secret["data"]


def test_the_guides_helm_steps_run_without_a_cluster(tmp_path: Path) -> None:
    """Every `helm` line of the guide, on the full values: lint and template as written,
    install as a client-side dry run, upgrade as the render of the same flags (an upgrade reads
    the release from the cluster, which a dry run cannot)."""
    helm = tool("helm")
    values = CHART / "ci" / "full-values.yaml"
    lines = re.findall(r"^(helm (?:lint|template|install|upgrade) .+?)(?:\s+#.*)?$", GUIDE, re.M)
    verbs = [line.split()[1] for line in lines]
    assert {"lint", "template", "install", "upgrade"} <= set(verbs)
    for line in lines:
        args = line.split(">")[0].split()[1:]
        args = [str(values) if a == "my-values.yaml" else a for a in args]
        args = [str(REPO / a) if a == "helm/controlplane" else a for a in args]
        if args[0] == "install":
            args.append("--dry-run=client")
        elif args[0] == "upgrade":
            args[0] = "template"
        done = run([helm, *args])
        assert done.returncode == 0, f"{line}\n{done.stderr}"
        if "autoscaler.mode=kubernetes" in line:
            docs = [d for d in yaml.safe_load_all(done.stdout) if d]
            modes = {
                e["value"]
                for d in docs
                if d.get("kind") == "Deployment" and "-autoscaler-" in d["metadata"]["name"]
                for c in d["spec"]["template"]["spec"]["containers"]
                for e in c.get("env") or []
                if e["name"] == "CP_AUTOSCALER_MODE"
            }
            assert modes == {"kubernetes"}
