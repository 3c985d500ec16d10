"""Security scans: checkov on every rendered manifest and on the Dockerfile, hadolint on the
Dockerfile, and the Dockerfile's own rules checked directly. No Docker daemon here: the image is
linted, not built.

The checkov checks skipped on the chart, each for a stated reason (SKIPPED below); anything else
that fails, fails the test. The Dockerfile's one skip (CKV_DOCKER_2, no HEALTHCHECK) is inline in
the Dockerfile with its reason.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helm_chart import REPO, VALUES, ChartCopy, run, tool

SKIPPED = {
    "CKV_K8S_11": "no CPU limits: CFS throttling adds latency to the router's proxy path and "
    "stalls vLLM's scheduler; CPU requests are set",
    "CKV_K8S_15": "imagePullPolicy IfNotPresent: images are pinned (tags, image.digest)",
    "CKV_K8S_43": "images by tag by default; image.digest pins the control plane's image and "
    "the Redis and vLLM image values take a digest reference",
    "CKV_K8S_35": "secrets reach the processes as environment variables by design: every "
    "setting names the variable holding its secret (hash_secret_env, password_env, "
    "admin_key_env, CP_TENANTS)",
    "CKV_K8S_38": "the router (Kubernetes discovery) and the autoscaler (scale subresource) "
    "call the API; no other pod mounts a token",
    "CKV_K8S_22": "the official vLLM image writes compile caches outside the model volume",
    "CKV_K8S_23": "the official vLLM image runs as root",
    "CKV_K8S_40": "the official vLLM image runs as root (see CKV_K8S_23)",
    "CKV2_K8S_6": "a NetworkPolicy guards Redis; who reaches the routers and engines (clients, "
    "Prometheus, gateways) is the cluster's to say",
}
# which of those apply to which workloads (a skip for the control plane's own pods would hide a
# regression there)
ENGINE_ONLY = {"CKV_K8S_22", "CKV_K8S_23", "CKV_K8S_40"}


@pytest.fixture(scope="module")
def rendered_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tool("helm")
    chart = ChartCopy.make(tmp_path_factory.mktemp("chart"))
    out = tmp_path_factory.mktemp("rendered")
    for values in VALUES:
        (out / f"{values}.yaml").write_text(chart.template(values))
    return out


def checkov(*args: str | Path) -> list[dict[str, object]]:
    done = run([tool("checkov"), *args, "--quiet", "--skip-download", "-o", "json"])
    data = json.loads(done.stdout)
    reports = data if isinstance(data, list) else [data]
    failed: list[dict[str, object]] = []
    for r in reports:
        failed.extend(r["results"]["failed_checks"])
    return failed


def test_checkov_chart(rendered_dir: Path) -> None:
    failed = checkov("-d", rendered_dir, "--framework", "kubernetes")
    where = dict.fromkeys(ENGINE_ONLY, "-engine-")
    unexpected = [
        (check, resource)
        for check, resource in ((str(f["check_id"]), str(f["resource"])) for f in failed)
        if check not in SKIPPED or where.get(check, "") not in resource
    ]
    assert unexpected == []


def test_checkov_dockerfile() -> None:
    failed = checkov("-f", REPO / "Dockerfile", "--framework", "dockerfile")
    assert [f["check_id"] for f in failed] == []


def test_hadolint_dockerfile() -> None:
    done = run([tool("hadolint"), REPO / "Dockerfile"])
    assert done.returncode == 0, done.stdout + done.stderr


def test_dockerfile_rules() -> None:
    """Multi-stage, pinned base, the wheel installed, non-root, the CLI as entrypoint."""
    text = (REPO / "Dockerfile").read_text()
    froms = re.findall(r"^FROM (\S+)", text, re.M)
    assert len(froms) == 2 and len(set(froms)) == 1  # the same base in both stages
    assert re.fullmatch(r"python:3\.\d+\.\d+-slim-\w+|python@sha256:[0-9a-f]{64}", froms[0])
    final = text.split("\nFROM ")[-1]
    assert "pip install" not in final and "apt-get" not in final  # nothing built there
    assert "COPY --from=build /opt/controlplane /opt/controlplane" in final
    user = re.findall(r"^USER (\S+)", final, re.M)
    assert user and not user[-1].startswith(("root", "0"))
    assert 'ENTRYPOINT ["controlplane"]' in final
    assert "-m build --wheel" in text and "/dist/*.whl" in text
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".git", ".venv", ".venv-vllm", ".tools", "tests"} <= set(ignored)
