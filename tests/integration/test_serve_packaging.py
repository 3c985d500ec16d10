"""Packaging of the Ray Serve path: the `ray` extra, the Serve configs, `serve build`, `serve run`.

- `pip install 'vllm-fleet-controlplane[ray]'` brings what the Ray path imports: every
  third-party module imported by deploy/ray, deploy/engines, router/serve and the Ray autoscaling
  hosts belongs to a core dependency or to the `ray` extra (vLLM aside: the engines import it in
  their own interpreter), and no extra pulls `ray[llm]`;
- deploy/ray/sim_fleet.yaml and vllm_fleet.yaml are valid Serve configs whose builder makes the
  application they describe (ingress + engines + our RequestRouter + the headroom adapter on the
  ingress's demand);
- `serve build deploy.ray.apps:sim_fleet` writes a config Serve's `ServeDeploySchema` accepts
  (what KubeRay's `serveConfigV2` is), and deploy/ray/serve_config_v2.yaml is that output;
- `serve run` of the simulated application (its YAML with a free port and a short load time)
  serves an OpenAI chat completion, and SIGTERM leaves nothing of it running.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from redis_server import free_port

from deploy.tiny_model import default_model_dir, make_tiny_model

pytestmark = [
    pytest.mark.filterwarnings("ignore:The `metrics_interval_s` field:DeprecationWarning"),
]

ROOT = Path(__file__).resolve().parents[2]
RAY_DIR = ROOT / "deploy" / "ray"
SERVE = str(Path(sys.executable).parent / "serve")
RAY_PATH = [
    *sorted((ROOT / "deploy" / "ray").glob("*.py")),
    *sorted((ROOT / "deploy" / "engines").glob("*.py")),
    *sorted((ROOT / "router" / "serve").glob("*.py")),
    *sorted((ROOT / "autoscaler" / "hosts").glob("ray_*.py")),
]
# imported only inside the engine replicas, on the engine's own interpreter
ENGINE_ONLY = {"vllm"}


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _third_party(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    ours = {"controlplane", "router", "autoscaler", "deploy"}
    return {n for n in names if n not in ours and n not in sys.stdlib_module_names}


def test_the_ray_extra_brings_what_the_ray_path_imports() -> None:
    project = _pyproject()["project"]
    extras = project["optional-dependencies"]
    ray_extra = [Requirement(r) for r in extras["ray"]]
    assert [(r.name, sorted(r.extras), str(r.specifier)) for r in ray_extra] == [
        ("ray", ["serve"], "==2.60.0")
    ]
    # never ray[llm], in any extra
    for reqs in extras.values():
        for r in map(Requirement, reqs):
            assert not (r.name == "ray" and "llm" in r.extras), r
    provided = {canonicalize_name(Requirement(r).name) for r in project["dependencies"]}
    provided |= {canonicalize_name(r.name) for r in ray_extra}
    dists = importlib.metadata.packages_distributions()
    missing = {}
    for path in RAY_PATH:
        for module in _third_party(path) - ENGINE_ONLY:
            owners = {canonicalize_name(d) for d in dists.get(module, [])}
            if not owners & provided:
                missing[f"{path.relative_to(ROOT)}: {module}"] = sorted(owners)
    assert not missing, missing


@pytest.mark.parametrize("name", ["sim_fleet.yaml", "vllm_fleet.yaml"])
def test_serve_config_builds_the_application_it_describes(name: str) -> None:
    from ray.serve._private.build_app import build_app
    from ray.serve.schema import ServeDeploySchema

    from deploy.ray.fleet import build_fleet

    raw = yaml.safe_load((RAY_DIR / name).read_text())
    (app_cfg,) = ServeDeploySchema.model_validate(raw).applications
    assert app_cfg.import_path == "deploy.ray.fleet:build_fleet"
    built = build_app(build_fleet(app_cfg.args), name="fleet")
    deployments = {d.name: d for d in built.deployments}
    assert set(deployments) == {"ingress", "engine"}
    engine, ingress = deployments["engine"], deployments["ingress"]
    router = engine._deployment_config.request_router_config
    assert router.request_router_class == "router.serve.ingress_router:IngressRequestRouter"
    assert router.request_router_kwargs["policy"] == "prefix_affinity"
    scaling = engine._deployment_config.autoscaling_config
    assert scaling is not None
    assert scaling.policy.policy_function == "autoscaler.hosts.ray_serve:ServeAutoscaler"
    assert scaling.policy.policy_kwargs["demand"] == "ingress"
    assert scaling.upscale_delay_s == scaling.downscale_delay_s == 0.0
    assert engine._deployment_config.graceful_shutdown_timeout_s == 120.0
    ingress_scaling = ingress._deployment_config.autoscaling_config
    assert ingress_scaling is not None
    assert ingress_scaling.policy.policy_function == "autoscaler.hosts.ray_ingress:IngressDemand"
    if name.startswith("vllm"):
        runtime_env = (engine.ray_actor_options or {})["runtime_env"]
        assert runtime_env["py_executable"].endswith("/bin/python")


def _env_without_cp() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CP_")}
    return {**env, "PYTHONPATH": str(ROOT)}


def test_serve_build_output_is_a_serve_config_and_the_checked_in_copy(tmp_path: Path) -> None:
    from ray.serve.schema import ServeDeploySchema

    out = tmp_path / "serve_config_v2.yaml"
    subprocess.run(
        [SERVE, "build", "deploy.ray.apps:sim_fleet", "-o", str(out)],
        cwd=ROOT,
        env=_env_without_cp(),
        check=True,
        capture_output=True,
        timeout=120,
    )
    built = yaml.safe_load(out.read_text())
    schema = ServeDeploySchema.model_validate(built)
    (app,) = schema.applications
    assert app.import_path == "deploy.ray.apps:sim_fleet"
    assert {d["name"] for d in built["applications"][0]["deployments"]} == {"ingress", "engine"}
    # the copy a Helm chart embeds as a RayService's serveConfigV2
    checked_in = RAY_DIR / "serve_config_v2.yaml"
    assert out.read_text() == checked_in.read_text(), (
        "deploy/ray/serve_config_v2.yaml is stale: run "
        "`serve build deploy.ray.apps:sim_fleet -o deploy/ray/serve_config_v2.yaml`"
    )


def _session_pids(sid: int) -> list[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,sid="], capture_output=True, text=True)
    pids = []
    for line in out.stdout.splitlines():
        pid, s = (int(x) for x in line.split())
        if s == sid:
            pids.append(pid)
    return pids


@pytest.mark.timeout(240)
def test_serve_run_serves_a_chat_completion_and_stops_clean(tmp_path: Path) -> None:
    make_tiny_model(default_model_dir())
    raw = yaml.safe_load((RAY_DIR / "sim_fleet.yaml").read_text())
    port = free_port()
    raw["http_options"]["port"] = port
    args = raw["applications"][0]["args"]
    args["engine_args"]["load_time_s"] = 0.5  # the same application, loading faster
    config = tmp_path / "sim_fleet.yaml"
    config.write_text(yaml.safe_dump(raw))
    log = tmp_path / "serve_run.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [SERVE, "run", str(config)],
            cwd=ROOT,
            env=_env_without_cp(),
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        body = {
            "model": "tiny-llama",
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "Hi"}],
        }
        deadline = time.monotonic() + 150.0
        answer = None
        while answer is None:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                r = httpx.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=30.0
                )
                if r.status_code == 200:
                    answer = r.json()
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        assert answer["object"] == "chat.completion"
        assert answer["usage"]["completion_tokens"] == 8
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(90.0)
        # nothing of the application is left: no process of `serve run`'s session
        deadline = time.monotonic() + 30.0
        while _session_pids(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _session_pids(proc.pid) == [], log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10.0)


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ({"router": {"tokenizer": "remote"}}, "tokenizes prompts itself"),
        ({"router": {"tokenizer": "approx"}, "engine_replicas": 0}, "engine_replicas"),
        ({"router": {"tokenizer": "approx"}, "no_such_arg": 1}, "no_such_arg"),
        (
            {
                "router": {"tokenizer": "approx"},
                "autoscaling": {"min_replicas": 3, "max_replicas": 2},
            },
            "min_replicas",
        ),
        (
            {"router": {"tokenizer": "approx", "demand": {"enabled": False}}, "autoscaling": {}},
            "demand meter",
        ),
        ({"router": {"tokenizer": "approx"}, "engine_args": {"speed": -1}}, "engine_args"),
    ],
)
def test_build_fleet_refuses(args: dict[str, Any], error: str) -> None:
    from controlplane.errors import ConfigError
    from deploy.ray.fleet import build_fleet

    with pytest.raises(ConfigError, match=error):
        build_fleet(args)
