"""The applications of deploy/ray/*.yaml as module-level Serve `Application`s, for `serve build`.

    serve build deploy.ray.apps:sim_fleet -o deploy/ray/serve_config_v2.yaml

`serve build` takes an import path to a bound application (not a builder with `args:`), so each
one here is `build_fleet` applied to the `args:` of its YAML: the YAML stays the one place the
application is described, `serve run deploy/ray/<app>.yaml` and the built config start the same
deployments with the same options. `deploy/ray/serve_config_v2.yaml` is the built config of
`sim_fleet`, kept in sync by a test, for a KubeRay RayService's `serveConfigV2` (a Helm chart
embeds it with `toYaml`); the settings the YAML leaves out (Redis, secrets) come from the CP_*
environment of the cluster's processes.

The vLLM application is not built here: its engine replicas name a local interpreter
(`py_executable`) that a container image replaces with its own environment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from ray import serve

from deploy.ray.fleet import build_fleet

HERE = Path(__file__).resolve().parent


def app_args(config: Path, name: str = "fleet") -> dict[str, Any]:
    """The `args:` of application `name` in a Serve config file."""
    raw = yaml.safe_load(config.read_text())
    for app in raw.get("applications", []):
        if app.get("name") == name:
            args: dict[str, Any] = app.get("args") or {}
            return args
    raise KeyError(f"{config}: no application {name!r}")


sim_fleet: serve.Application = build_fleet(app_args(HERE / "sim_fleet.yaml"))

__all__ = ["app_args", "sim_fleet"]
