"""The Helm chart renders, validates and wires the product the way its own code reads it.

For the defaults and each values file of helm/controlplane/ci (full, external Redis, Ray path,
engines off): `helm lint`, `helm template`, every built-in object validated against the
Kubernetes 1.35 schemas (`kubernetes-validate --strict`), every custom resource against its CRD's
schema (tests/fixtures/crds: prometheus-operator 0.93.0, KubeRay 1.7.0; pod templates inside a
RayService validated as core PodTemplates). Then the wiring: the rendered router configuration
loads through `router.config.load_settings` with the rendered environment; the termination
grace covers preStop + drain + grace; the engines carry every vLLM flag the router relies on and
the labels its discovery selects on; the indexer follows each engine ordinal the autoscaler may
create, at the engines' KV-event ports, under the pod names discovery reports. No cluster here:
nothing is applied. values.schema.json describes every value and refuses bad ones.
"""

from __future__ import annotations

import base64
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
import yaml
from helm_chart import (
    CHART,
    NAMESPACE,
    RELEASE,
    REPO,
    VALUES,
    ChartCopy,
    Obj,
    RenderError,
    env_of,
    one,
    run,
    tool,
)

from controlplane.routing.policies import POLICIES
from router.config import RouterSettings, load_settings

K8S_VERSION = "1.35.0"
CRDS = {  # (apiVersion, kind) -> fixture
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitors.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitors.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrules.json",
    ("ray.io/v1", "RayService"): "rayservices.json",
}
FIXTURES = REPO / "tests" / "fixtures" / "crds"
GOLDEN = REPO / "tests" / "fixtures" / "helm"
UPDATE_GOLDEN = "CP_UPDATE_GOLDEN"


@pytest.fixture(scope="module")
def chart(tmp_path_factory: pytest.TempPathFactory) -> ChartCopy:
    tool("helm")
    return ChartCopy.make(tmp_path_factory.mktemp("chart"))


@pytest.fixture(scope="module")
def rendered(chart: ChartCopy) -> dict[str, list[Obj]]:
    return {v: chart.render(v) for v in VALUES}


@pytest.mark.parametrize("values", VALUES)
def test_helm_lint(chart: ChartCopy, values: str) -> None:
    args: list[str | Path] = [tool("helm"), "lint", "--strict", chart.path, "-n", NAMESPACE]
    vf = chart.values_file(values)
    done = run([*args, "-f", vf] if vf else args)
    assert done.returncode == 0, done.stdout + done.stderr


def golden_text(objs: list[Obj]) -> str:
    """The render with what is not the chart's own logic masked: generated secrets, and the
    observability files' contents (checked by their own tests)."""
    docs = []
    for o in objs:
        doc = json.loads(json.dumps(o.doc))
        if o.kind == "Secret":
            doc["data"] = dict.fromkeys(doc.get("data") or {}, "<generated or from values>")
        elif o.kind == "ConfigMap" and o.name.endswith("-dashboard"):
            doc["data"] = dict.fromkeys(doc["data"], "<files/grafana/controlplane.json>")
        elif o.kind == "PrometheusRule":
            doc["spec"]["groups"] = "<files/prometheus/alerts.yaml>"
        docs.append(doc)
    return yaml.safe_dump_all(docs, sort_keys=False)


@pytest.mark.parametrize("values", VALUES)
def test_render_matches_its_golden_file(rendered: dict[str, list[Obj]], values: str) -> None:
    """An unintended change to what the chart renders fails here; an intended one is recorded
    with `CP_UPDATE_GOLDEN=1 pytest tests/integration/test_helm_chart.py` (review the diff)."""
    path = GOLDEN / f"{values}.yaml"
    text = golden_text(rendered[values])
    if os.environ.get(UPDATE_GOLDEN):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"no golden file {path}: run with {UPDATE_GOLDEN}=1"
    assert text == path.read_text(), f"{values}: the render changed; {UPDATE_GOLDEN}=1 records it"


@pytest.mark.parametrize("values", VALUES)
def test_builtin_objects_validate(
    chart: ChartCopy, rendered: dict[str, list[Obj]], values: str, tmp_path: Path
) -> None:
    builtin = [o.doc for o in rendered[values] if (o.doc["apiVersion"], o.kind) not in CRDS]
    # a RayService's pod templates are core PodTemplateSpecs: validated as PodTemplates
    for o in rendered[values]:
        if o.kind == "RayService":
            cluster = o.doc["spec"]["rayClusterConfig"]
            groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
            for i, g in enumerate(groups):
                meta = {"name": f"ray-{i}"}
                builtin.append(
                    {
                        "apiVersion": "v1",
                        "kind": "PodTemplate",
                        "metadata": meta,
                        "template": g["template"],
                    }
                )
    path = tmp_path / "objects.yaml"
    path.write_text(yaml.safe_dump_all(builtin))
    validate = tool("kubernetes-validate")
    done = run([validate, "-k", K8S_VERSION, "--strict", "--quiet", path])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "fail" not in (done.stdout + done.stderr).lower(), done.stdout + done.stderr


@pytest.mark.parametrize("values", VALUES)
def test_custom_resources_validate(rendered: dict[str, list[Obj]], values: str) -> None:
    for o in rendered[values]:
        fixture = CRDS.get((o.doc["apiVersion"], o.kind))
        if fixture is None:
            continue
        schema = json.loads((FIXTURES / fixture).read_text())["openAPIV3Schema"]
        # OpenAPI v3 schemas: validated as JSON Schema draft 7, the CRD itself not re-checked
        # (its Go regexes, e.g. '^(?i)...', are not Python's)
        errors = [e.message for e in jsonschema.Draft7Validator(schema).iter_errors(o.doc)]
        assert errors == [], f"{o.kind} {o.name}: {errors}"


def test_every_crd_kind_is_rendered_somewhere(rendered: dict[str, list[Obj]]) -> None:
    kinds = {(o.doc["apiVersion"], o.kind) for objs in rendered.values() for o in objs}
    assert set(CRDS) <= kinds


@pytest.mark.parametrize(
    ("sets", "complaint"),
    [
        ({"router.replicas": "0"}, "/router/replicas"),
        ({"router.policy.name": "fastest"}, "/router/policy/name"),
        ({"router.bogus": "1"}, "additional properties 'bogus'"),
        ({"autoscaler.mode": "aggressive"}, "/autoscaler/mode"),
        ({"redis.maxmemoryPolicy": "lru"}, "/redis/maxmemoryPolicy"),
        ({"redis.enabled": "false"}, "/redis"),  # an external Redis needs url + password
        ({"rayService.enabled": "true"}, "/rayService"),  # serveConfigV2 is required
        ({"image.digest": "latest"}, "/image/digest"),
        (
            {
                "engines.groups[0].name": "Bad_Name",
                "engines.groups[0].model": "m",
                "engines.groups[0].servedModelName": "m",
                "engines.groups[0].gpu": "h100",
            },
            "/engines/groups/0/name",
        ),
        ({"engines.groups[0].name": "g"}, "missing properties"),
        (  # no config.json: the routers could build no profile, the replicas would stay loading
            {
                "engines.groups[0].name": "g",
                "engines.groups[0].model": "m",
                "engines.groups[0].servedModelName": "m",
                "engines.groups[0].gpu": "h100",
            },
            "configJson",
        ),
    ],
)
def test_schema_refuses_bad_values(chart: ChartCopy, sets: dict[str, str], complaint: str) -> None:
    with pytest.raises(RenderError, match="schema") as err:
        chart.template(sets=sets)
    assert complaint in str(err.value)


def _walk(values: Any, schema: dict[str, Any], path: str) -> Iterator[str]:
    """Paths in `values` that the schema does not describe."""
    if not isinstance(values, dict) or schema.get("additionalProperties") is not False:
        return
    props = schema.get("properties", {})
    for key, value in values.items():
        sub = props.get(key)
        if sub is None or not sub.get("description"):
            yield f"{path}.{key}"
            continue
        yield from _walk(value, sub, f"{path}.{key}")


def test_schema_describes_every_value() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    for name in ("values.yaml", *(f"ci/{p.name}" for p in (CHART / "ci").glob("*.yaml"))):
        values = yaml.safe_load((CHART / name).read_text())
        assert list(_walk(values, schema, "")) == [], name
    # the policy names are the registry's
    enum = schema["properties"]["router"]["properties"]["policy"]["properties"]["name"]["enum"]
    assert sorted(enum) == sorted(POLICIES)


def _router_settings(objs: list[Obj], tmp_path: Path) -> tuple[RouterSettings, dict[str, Any]]:
    """The router's settings as the pod resolves them: its config file, its plain env values,
    and a stand-in for each secret value (from Secrets at run time)."""
    cm = one(objs, "ConfigMap", "-router")
    deploy = one(objs, "Deployment", "-router")
    container = deploy.container("router")
    path = tmp_path / "router.yaml"
    path.write_text(cm.doc["data"]["router.yaml"])
    args = container["args"]
    assert args[:3] == ["serve", "--config", "/etc/controlplane/router.yaml"]
    env = env_of(container)
    overrides = {k: v for k, v in env.items() if isinstance(v, str)}
    secrets = [k for k, v in env.items() if not isinstance(v, str)]
    assert {"CP_ADMIN_KEY", "CP_HASH_SECRET", "CP_REDIS_PASSWORD"} <= set(secrets)
    tenants = env.get("CP_TENANTS")
    fake = dict.fromkeys(secrets, "from-a-secret")
    if tenants is not None:  # the chart's own tenants Secret holds the values' list
        assert "tenants" not in yaml.safe_load(cm.doc["data"]["router.yaml"])
        secret = one(objs, "Secret", "-secrets").doc["data"]
        fake["CP_TENANTS"] = base64.b64decode(secret[tenants["secretKeyRef"]["key"]]).decode()
    saved = {k: os.environ.get(k) for k in (*overrides, *fake)}
    os.environ.update({**overrides, **fake})
    try:
        return load_settings(path), cm.doc["data"]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.mark.parametrize("values", VALUES)
def test_router_config_loads_through_the_settings(
    rendered: dict[str, list[Obj]], values: str, tmp_path: Path
) -> None:
    objs = rendered[values]
    settings, data = _router_settings(objs, tmp_path)
    assert settings.host == "0.0.0.0" and settings.fleet.shared
    assert settings.admin_key is not None  # /admin (the autoscaler's drains) is on
    assert settings.redis.url is not None and settings.redis.password_env == "CP_REDIS_PASSWORD"
    # the Redis URL names the chart's Service, or the external one
    redis_svc = [o for o in objs if o.kind == "Service" and o.name.endswith("-redis")]
    if redis_svc:
        assert settings.redis.url == f"redis://{redis_svc[0].name}.{NAMESPACE}.svc:6379/0"
    # the routers follow KV events themselves exactly when no indexer runs
    indexer = [o for o in objs if o.kind == "Deployment" and o.name.endswith("-indexer")]
    assert settings.redis.ingest_events == (not indexer)
    # every model group's config.json is mounted where the settings look for it
    mounted = {
        f"/etc/controlplane/{item['path']}": item["key"]
        for v in one(objs, "Deployment", "-router").pod_spec()["volumes"]
        if "configMap" in v
        for item in v["configMap"].get("items", [])
    }
    for m in settings.models:
        if m.config_json is not None:
            assert json.loads(data[mounted[m.config_json]])["architectures"]


def test_full_values_reach_the_router(rendered: dict[str, list[Obj]], tmp_path: Path) -> None:
    settings, _ = _router_settings(rendered["full"], tmp_path)
    assert [t.id for t in settings.tenants] == ["chat-app", "nightly-evals"]
    assert settings.limits.max_prompt_tokens == 8192 and settings.timeouts.ttft_s == 30.0
    assert settings.policy.name == "prefix_affinity"
    assert {m.name: (m.gpu, m.tp) for m in settings.models} == {
        "llama-3.1-8b": ("h100", 1), "qwen3-32b": ("h100", 2),
    }  # fmt: skip
    k = settings.fleet.kubernetes
    assert k is not None and k.namespace == NAMESPACE and k.port_name == "http"


@pytest.mark.parametrize("values", VALUES)
def test_termination_grace_covers_the_drain(
    rendered: dict[str, list[Obj]], values: str, tmp_path: Path
) -> None:
    settings, _ = _router_settings(rendered[values], tmp_path)
    pod = one(rendered[values], "Deployment", "-router").pod_spec()
    pre_stop = pod["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"]
    need = pre_stop + settings.shutdown.drain_s + settings.shutdown.grace_s
    assert pod["terminationGracePeriodSeconds"] >= need


def test_a_termination_grace_below_the_drain_is_refused(chart: ChartCopy) -> None:
    with pytest.raises(RenderError, match="below preStop"):
        chart.template(sets={"router.terminationGracePeriodSeconds": "20"})  # 2 + 5 + 20 > 20


# the flags deploy/local_fleet.py starts vLLM with, which the router relies on
VLLM_FLAGS = ("--enable-prefix-caching", "--enable-prompt-tokens-details",
              "--enable-force-include-usage", "--enable-request-id-headers")  # fmt: skip


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_engines_carry_every_flag_and_label(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["full"]
    values = yaml.safe_load((CHART / "ci" / "full-values.yaml").read_text())
    settings_selector = dict(
        term.split("=") for term in
        yaml.safe_load(one(objs, "ConfigMap", "-router").doc["data"]["router.yaml"])
        ["fleet"]["kubernetes"]["label_selector"].split(",")
    )  # fmt: skip
    for group in values["engines"]["groups"]:
        sts = one(objs, "StatefulSet", f"-engine-{group['name']}")
        template = sts.doc["spec"]["template"]
        c = sts.container("vllm")
        args = c["args"]
        assert args[0] == group["model"]
        assert set(VLLM_FLAGS) <= set(args)
        assert _flag(args, "--served-model-name") == group["servedModelName"]
        assert _flag(args, "--block-size") == str(group["blockSize"])
        assert _flag(args, "--tensor-parallel-size") == str(group.get("tp", 1))
        kv = json.loads(_flag(args, "--kv-events-config"))
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert kv["enable_kv_cache_events"] and kv["publisher"] == "zmq"
        assert kv["endpoint"] == f"tcp://*:{ports['kv-events']}"
        assert kv["replay_endpoint"] == f"tcp://*:{ports['kv-replay']}"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == group.get("tp", 1)
        # discovery: the router's selector matches, the model and GPU keys are there
        labels = template["metadata"]["labels"]
        assert settings_selector.items() <= labels.items()
        assert (
            template["metadata"]["annotations"]["controlplane.dev/model"]
            == group["servedModelName"]
        )
        assert labels["controlplane.dev/gpu"] == group["gpu"]
        assert any(m["mountPath"] == "/models" for m in c["volumeMounts"])


def test_indexer_follows_every_ordinal_the_autoscaler_may_create(
    rendered: dict[str, list[Obj]],
) -> None:
    objs = rendered["full"]
    values = yaml.safe_load((CHART / "ci" / "full-values.yaml").read_text())
    sources = yaml.safe_load(one(objs, "ConfigMap", "-indexer").doc["data"]["replicas.yaml"])
    by_id = {s["id"]: s for s in sources["replicas"]}
    expected: set[str] = set()
    for target in values["autoscaler"]["targets"]:
        sts = one(objs, "StatefulSet", f"-engine-{target['engineGroup']}")
        service = sts.doc["spec"]["serviceName"]
        for i in range(target["maxReplicas"]):
            pod = f"{sts.name}-{i}"  # the pod name discovery reports as the replica id
            expected.add(pod)
            host = f"{pod}.{service}.{NAMESPACE}.svc"
            assert by_id[pod]["events"] == f"tcp://{host}:5557"
            assert by_id[pod]["replay"] == f"tcp://{host}:5558"
    assert set(by_id) == expected
    # the sources parse as the indexer reads them, and it runs with the routers' secret
    from controlplane.kvevents.config import source_from_mapping

    assert all(source_from_mapping(s).model for s in sources["replicas"])
    c = one(objs, "Deployment", "-indexer").container("indexer")
    env = env_of(c)
    router_env = env_of(one(objs, "Deployment", "-router").container("router"))
    assert env["CP_HASH_SECRET"] == router_env["CP_HASH_SECRET"]
    assert _flag(c["args"], "--redis-password-env") == "CP_REDIS_PASSWORD"


def test_redis_is_password_protected_and_never_evicts(rendered: dict[str, list[Obj]]) -> None:
    sts = one(rendered["default"], "StatefulSet", "-redis")
    c = sts.container("redis")
    script = c["args"][0]
    assert 'requirepass "$REDIS_PASSWORD"' in script and "maxmemory-policy noeviction" in script
    assert "REDIS_PASSWORD" in env_of(c) and not isinstance(env_of(c)["REDIS_PASSWORD"], str)
    assert all(o.name.endswith("-redis") is False for o in rendered["external-redis"]
               if o.kind == "StatefulSet")  # fmt: skip


@pytest.mark.parametrize("values", ["full", "engines-off"])
def test_autoscaler_env_loads_as_its_settings(rendered: dict[str, list[Obj]], values: str) -> None:
    from autoscaler.hosts.kubernetes import HostSettings

    for d in (o for o in rendered[values] if o.kind == "Deployment" and "-autoscaler-" in o.name):
        c = d.container("autoscaler")
        assert c["args"] == ["autoscale", "run"]
        env = {k: v for k, v in env_of(c).items() if isinstance(v, str)}
        saved = dict(os.environ)
        os.environ.update(env)
        try:
            s = HostSettings()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        assert s.target_ref() is not None and s.admin_key_env == "CP_ROUTER_ADMIN_KEY"
        # the routers' admin key (scale-down drains) from the same Secret as the routers'
        router_env = env_of(one(rendered[values], "Deployment", "-router").container("router"))
        assert env_of(c)["CP_ROUTER_ADMIN_KEY"] == router_env["CP_ADMIN_KEY"]
        assert "secretKeyRef" in router_env["CP_ADMIN_KEY"]
        headless = one(rendered[values], "Service", "-router-pods")
        assert headless.doc["spec"]["clusterIP"] == "None"
        assert s.routers == [f"dns+http://{headless.name}.{NAMESPACE}.svc:8000"]
        assert RELEASE in d.name


@pytest.mark.parametrize("values", VALUES)
def test_notes_name_objects_the_release_has(
    chart: ChartCopy, rendered: dict[str, list[Obj]], values: str
) -> None:
    """NOTES.txt (rendered by a client-side dry-run install) points at real objects."""
    args: list[str | Path] = [tool("helm"), "install", RELEASE, chart.path, "-n", NAMESPACE,
                              "--dry-run=client"]  # fmt: skip
    vf = chart.values_file(values)
    done = run([*args, "-f", vf] if vf else args)
    assert done.returncode == 0, done.stderr
    notes = done.stdout.split("\nNOTES:\n", 1)[1]
    names = {(o.kind, o.name) for o in rendered[values]}
    refs = [("Service", n) for n in re.findall(r"svc/(\S+)", notes)]
    refs += [("Deployment", n) for n in re.findall(r"deploy/(\S+)", notes)]
    refs += [("Secret", n) for n in re.findall(r"get secret (\S+)", notes)]
    assert refs and [r for r in refs if r not in names] == []
    assert f"port-forward svc/{RELEASE}-controlplane-router" in notes


@pytest.mark.filterwarnings("ignore:The `metrics_interval_s` field:DeprecationWarning")
def test_the_ray_applications_serve_build_output_is_the_rayservice_config(chart: ChartCopy) -> None:
    """deploy/ray/serve_config_v2.yaml (`serve build` of the Ray application, kept current by
    test_serve_packaging.py) goes into the chart as the guide says, and what the RayService
    carries is that config: valid for KubeRay's CRD and for Serve's own deploy schema."""
    from ray.serve.schema import ServeDeploySchema

    built = REPO / "deploy" / "ray" / "serve_config_v2.yaml"
    objs = chart.render("ray", set_files={"rayService.serveConfigV2": built})
    ray = one(objs, "RayService", "-ray")
    schema = json.loads((FIXTURES / CRDS[("ray.io/v1", "RayService")]).read_text())
    errors = [
        e.message
        for e in jsonschema.Draft7Validator(schema["openAPIV3Schema"]).iter_errors(ray.doc)
    ]
    assert errors == []
    carried = yaml.safe_load(ray.doc["spec"]["serveConfigV2"])
    assert carried == yaml.safe_load(built.read_text())
    ServeDeploySchema.model_validate(carried)
    assert [a["import_path"] for a in carried["applications"]] == ["deploy.ray.apps:sim_fleet"]
