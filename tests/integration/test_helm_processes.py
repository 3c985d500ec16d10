"""The chart's router, indexer and autoscaler, run from their rendered containers.

The chart is rendered with a values file that points at local parts (a private password-protected
redis-server as the "external" Redis, two simulated replicas with KV events as static replicas
and indexer sources, a fake API server holding the engine StatefulSet). Each process is then
started as the image would: `controlplane` + the container's args, with the container's
environment (Secret references filled with test secrets; the mounted ConfigMaps written to a temp
folder that stands for /etc/controlplane). What stands in for the cluster is all that changes:
the router listens on 127.0.0.1 and a free port (CP_HOST, CP_PORT over the rendered 0.0.0.0:8000),
the autoscaler scrapes that router instead of the routers' headless Service and reaches the
fake API server instead of the in-cluster one.

Then: the router serves a tenant's request; the indexer, not the router, writes the replicas'
KV events into Redis; the advisory autoscaler reads the StatefulSet, decides, and exports its
target. SIGTERM stops each process (the router exits 0) and leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml
from fake_kube import NS, FakeKube
from helm_chart import NAMESPACE, REPO, ChartCopy, Obj, one
from redis_server import RedisServer, available, free_port
from router_fixtures import metric_value, sim_args
from sim_fleet import SimReplica, sim_replicas

from deploy.processes import Child, group_alive, spawn

pytestmark = pytest.mark.redis

WAIT_S = 60.0  # a failure bound, not a threshold
API_KEY = "sk-chart-test-key"
SECRETS = {  # secret key -> test value (the chart's own Secret's keys)
    "admin-key": "chart-test-admin-key",
    "hash-secret": "chart-test-hash-secret",
    "cache-salt-secret": "chart-test-salt",
    "password": "chart-test-redis-password",
}
CLI = [sys.executable, "-c", "from controlplane.cli import main; main()"]


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    if not available():
        pytest.skip("redis-server is not installed")
    server = RedisServer(password=SECRETS["password"])
    server.start()
    pid = server.pid
    try:
        yield server
    finally:
        server.close()
        assert pid is None or not group_alive(pid), "redis-server left running"


def local_values(server: RedisServer, sims: dict[str, SimReplica], model_dir: Path) -> str:
    replicas, sources = [], []
    for rid, sim in sims.items():
        pub, replay = sim.kv_endpoints()
        replicas.append({"id": rid, "url": sim.url, "gpu": "cpu", "model": "tiny-llama",
                         "kv_events": pub, "kv_replay": replay})  # fmt: skip
        sources.append({"id": rid, "events": pub, "replay": replay, "model": "tiny-llama"})
    url = server.url.replace(f":{SECRETS['password']}@", "")  # the password comes from a Secret
    digest = hashlib.sha256(API_KEY.encode()).hexdigest()
    values = {
        "redis": {"enabled": False,
                  "external": {"url": url, "passwordSecret": {"name": "local", "key": "password"}}},
        "router": {
            "tokenizer": str(model_dir), "servedModel": "tiny-llama",
            "discovery": {"kubernetes": False}, "staticReplicas": replicas,
            "tenants": {"list": [{"id": "team-a", "api_key_sha256": [digest]}]},
            "shutdown": {"drainSeconds": 0, "graceSeconds": 5},
        },
        "indexer": {"replicas": sources},
        "autoscaler": {"mode": "advisory", "tickSeconds": 0.5, "targets": [
            {"name": "sim", "kind": "StatefulSet", "workload": "engines", "model": "tiny-llama",
             "minReplicas": 1, "maxReplicas": 4}]},
    }  # fmt: skip
    return yaml.safe_dump(values)


class Pod:
    """One rendered container run as a local process."""

    def __init__(self, deploy: Obj, container: str, etc: Path, secrets: dict[str, str]) -> None:
        self.name = container
        self.spec = deploy.container(container)
        self.args = [a.replace("/etc/controlplane", str(etc)) for a in self.spec["args"]]
        self.env: dict[str, str] = {}
        for e in self.spec.get("env") or []:
            if "value" in e:
                self.env[e["name"]] = e["value"]
            elif "secretKeyRef" in e["valueFrom"]:
                self.env[e["name"]] = secrets[e["valueFrom"]["secretKeyRef"]["key"]]
            else:  # a fieldRef: the pod's name
                self.env[e["name"]] = f"{deploy.name}-pod"
        self.log = etc / f"{container}.log"
        self.child: Child | None = None

    def start(self, **overrides: str) -> None:
        env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO), "HOME": str(self.log.parent),
               **self.env, **overrides}  # fmt: skip
        with self.log.open("wb") as out:  # the child keeps its own descriptor
            self.child = spawn([*CLI, *self.args], env=env, stdout=out, stderr=subprocess.STDOUT)

    def stop(self) -> int | None:
        assert self.child is not None
        self.child.signal(signal.SIGTERM)
        code = self.child.finish(time.monotonic() + 30.0)
        assert not group_alive(self.child.pid), f"{self.name} left processes behind"
        return code

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


async def until(check: Callable[[], Any], what: str, pods: list[Pod]) -> Any:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        for p in pods:
            assert p.child is not None and p.child.poll() is None, f"{p.name} exited:\n{p.tail()}"
        try:
            got = check()
        except (httpx.HTTPError, redis.RedisError, KeyError, ValueError):
            got = None
        if got:
            return got
        await asyncio.sleep(0.2)
    logs = "\n".join(f"--- {p.name}\n{p.tail()}" for p in pods)
    raise AssertionError(f"never: {what}\n{logs}")


async def test_rendered_processes_route_index_and_advise(
    tmp_path: Path, model_dir: Path, redis_server: RedisServer, kube: FakeKube
) -> None:
    chart = ChartCopy.make(tmp_path)
    sims = {n: SimReplica(*sim_args(model_dir, kv_events=True)) for n in ("sim-a", "sim-b")}
    with sim_replicas(sims):
        values = tmp_path / "local-values.yaml"
        values.write_text(local_values(redis_server, sims, model_dir))
        objs = chart.render_file(values)
        etc = tmp_path / "etc"
        etc.mkdir()
        for cm in (o for o in objs if o.kind == "ConfigMap"):
            for key, text in cm.doc["data"].items():
                (etc / key).write_text(text)
        secrets = dict(SECRETS)
        chart_secret = one(objs, "Secret", "-secrets").doc["data"]
        secrets["tenants.json"] = base64.b64decode(chart_secret["tenants.json"]).decode()
        router = Pod(one(objs, "Deployment", "-router"), "router", etc, secrets)
        indexer = Pod(one(objs, "Deployment", "-indexer"), "indexer", etc, secrets)
        scaler = Pod(one(objs, "Deployment", "-autoscaler-sim"), "autoscaler", etc, secrets)
        kube.add_workload("statefulsets", scaler.env["CP_AUTOSCALER_STATEFULSET"], 2)
        port, scaler_port = free_port(), free_port()
        base = f"http://127.0.0.1:{port}"
        pods = [router, indexer, scaler]
        try:
            router.start(CP_HOST="127.0.0.1", CP_PORT=str(port))
            indexer_port = free_port()
            indexer.start(
                CP_INDEXER_METRICS_PORT=str(indexer_port), CP_INDEXER_METRICS_HOST="127.0.0.1"
            )
            scaler.start(
                CP_AUTOSCALER_ROUTERS=json.dumps([base]), CP_AUTOSCALER_API_URL=kube.url,
                CP_AUTOSCALER_NAMESPACE=NS, CP_AUTOSCALER_LISTEN_HOST="127.0.0.1",
                CP_AUTOSCALER_LISTEN_PORT=str(scaler_port),
            )  # fmt: skip
            ready = await until(
                lambda: httpx.get(f"{base}/ready").json()["ready_replicas"] == 2, "ready", pods
            )
            assert ready
            # a tenant's request, twice (the second finds its prefix in the index)
            prompt = "the chart runs this router " * 8
            body = {"model": "tiny-llama", "max_tokens": 8,
                    "messages": [{"role": "user", "content": prompt}]}  # fmt: skip
            headers = {"authorization": f"Bearer {API_KEY}"}
            for _ in range(2):
                r = httpx.post(
                    f"{base}/v1/chat/completions", json=body, headers=headers, timeout=30
                )
                assert r.status_code == 200, r.text
            assert (
                httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30).status_code == 401
            )
            # the indexer (not the router) writes the replicas' KV events into Redis
            admin = redis.Redis.from_url(redis_server.url, socket_timeout=2)
            try:
                keys = await until(lambda: admin.keys("rtr:pidx*"), "index keys in Redis", pods)
                assert keys
            finally:
                admin.close()
            text = httpx.get(f"{base}/metrics").text
            assert metric_value(text, "cp_kv_events_applied_total") == 0
            # the indexer's probes: the rendered path answers on its metrics port, with its series
            for probe in ("readinessProbe", "livenessProbe"):
                path = indexer.spec[probe]["httpGet"]["path"]
                got = httpx.get(f"http://127.0.0.1:{indexer_port}{path}")
                assert got.status_code == 200
            assert "cp_kv_events_" in got.text
            # the advisory autoscaler read the StatefulSet and exported a target
            scaled = f"http://127.0.0.1:{scaler_port}"
            await until(
                lambda: "cp_autoscaler_target_replicas{" in httpx.get(f"{scaled}/metrics").text,
                "an autoscaler decision", pods,
            )  # fmt: skip
            assert httpx.get(f"{scaled}/healthz").json()["mode"] == "advisory"
            paths = {r.path for r in kube.requests}
            assert any(p.endswith("/statefulsets/engines/scale") for p in paths)
            assert not [r for r in kube.requests if r.method != "GET"]
        finally:
            codes = {p.name: p.stop() for p in pods if p.child is not None}
        assert codes["router"] == 0, router.tail()
        assert NAMESPACE == NS


async def test_rendered_redis_requires_its_password_and_never_evicts(tmp_path: Path) -> None:
    """The Redis container's script, run with the local redis-server: requirepass from the
    environment (not on the command line), maxmemory and noeviction as rendered."""
    if not available():
        pytest.skip("redis-server is not installed")
    port = free_port()
    objs = ChartCopy.make(tmp_path).render(sets={"redis.port": str(port)})
    container = one(objs, "StatefulSet", "-redis").container("redis")
    assert container["command"] == ["sh", "-c"]
    data = tmp_path / "data"
    data.mkdir()
    script = container["args"][0].replace("dir /data", f"dir {data}")
    password = "chart-test-redis-password"
    env = {"PATH": os.environ["PATH"], "REDIS_PASSWORD": password}
    with (tmp_path / "redis.log").open("wb") as out:
        child = spawn(["sh", "-c", script], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        authed = redis.Redis(port=port, password=password, socket_timeout=2)
        anonymous = redis.Redis(port=port, socket_timeout=2)
        try:
            deadline = time.monotonic() + WAIT_S
            while True:
                try:
                    authed.ping()
                    break
                except redis.ConnectionError:
                    assert child.poll() is None and time.monotonic() < deadline, (
                        tmp_path / "redis.log"
                    ).read_text()
                    await asyncio.sleep(0.1)
            with pytest.raises(redis.AuthenticationError):
                anonymous.ping()
            assert authed.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
            assert authed.config_get("maxmemory") == {"maxmemory": str(1 << 30)}
            assert authed.config_get("save") == {"save": ""}
            # the password is not on the process's command line
            cmdline = Path(f"/proc/{child.pid}/cmdline").read_bytes()
            assert password.encode() not in cmdline
        finally:
            authed.close()
            anonymous.close()
    finally:
        child.signal(signal.SIGTERM)
        child.finish(time.monotonic() + 10.0)
        assert not group_alive(child.pid)
