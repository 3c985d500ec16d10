"""`/metrics` (which names tenants) on a listener of its own: with `telemetry.metrics_port` set,
the main port answers /metrics with a 404 OpenAI error and the metrics listener, served by the
same process, has the router's exposition (tenant series included) and nothing else; unset,
/metrics stays on the main port. Live: the in-process harness (uvicorn, real sockets) and
`controlplane serve` as its own process."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from redis_server import free_port
from router_fixtures import MODEL
from router_harness import RouterServer

from controlplane.errors import ConfigError
from controlplane.tenancy.identity import key_digest
from router.config import load_settings

pytestmark = [pytest.mark.timeout(120)]

KEY = "cpk-metrics-listener-01"
# a quota no request fits: every request of the tenant is refused (429), and counted by tenant
TENANTS = [{"id": "acme-secret-customer", "api_key_sha256": [key_digest(KEY)], "quota_tokens": 1}]
ERROR_KEYS = {"message", "type", "param", "code"}


def settings(**telemetry: Any) -> Any:
    return load_settings(
        served_model=MODEL,
        tokenizer="approx",
        tenants=TENANTS,
        telemetry={"json_logs": False, "log_level": "WARNING", **telemetry},
    )


def not_found(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 404, r.text
    assert r.headers["content-type"] == "application/json"
    err: dict[str, Any] = r.json()["error"]
    assert set(err) == ERROR_KEYS and err["type"] == "not_found_error"
    return err


@pytest.fixture(scope="module")
def split() -> Iterator[RouterServer]:
    with RouterServer(settings(metrics_port=0)) as server:
        yield server


def touch_tenant(url: str) -> None:
    """A request of the tenant (refused by its quota), so that its series exist."""
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        headers={"authorization": f"Bearer {KEY}"},
        timeout=10.0,
    )
    assert r.status_code == 429, r.text


def test_the_main_port_does_not_serve_metrics(split: RouterServer) -> None:
    touch_tenant(split.url)
    err = not_found(httpx.get(f"{split.url}/metrics", timeout=5.0))
    assert "metrics listener" in err["message"]
    # everything else is still served on the main port
    assert httpx.get(f"{split.url}/health", timeout=5.0).json() == {"status": "ok"}
    assert httpx.get(f"{split.url}/v1/models", timeout=5.0).status_code == 200


def test_the_metrics_listener_serves_metrics_only(split: RouterServer) -> None:
    assert split.metrics_url and split.metrics_url != split.url
    touch_tenant(split.url)
    r = httpx.get(f"{split.metrics_url}/metrics", timeout=5.0)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert 'cp_quota_rejections_total{reason="too_large",tenant="acme-secret-customer"}' in r.text
    for path in ("/health", "/v1/models", "/admin/replicas", "/metrics/"):
        not_found(httpx.get(f"{split.metrics_url}{path}", timeout=5.0))
    r = httpx.post(f"{split.metrics_url}/v1/chat/completions", json={}, timeout=5.0)
    not_found(r)


def test_unset_keeps_metrics_on_the_main_port() -> None:
    with RouterServer(settings()) as server:
        assert server.metrics_url == ""
        r = httpx.get(f"{server.url}/metrics", timeout=5.0)
        assert r.status_code == 200 and "cp_" in r.text


def test_the_metrics_port_must_differ_from_the_main_one() -> None:
    with pytest.raises(ConfigError, match="metrics_port"):
        load_settings(port=9000, telemetry={"metrics_port": 9000})


def test_controlplane_serve_runs_both_listeners(tmp_path: Path) -> None:
    port, metrics_port = free_port(), free_port()
    config = {
        "host": "127.0.0.1",
        "served_model": MODEL,
        "tokenizer": "approx",
        "telemetry": {"metrics_port": metrics_port, "json_logs": True, "log_level": "WARNING"},
    }
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    cp = Path(sys.executable).parent / "controlplane"
    log = (tmp_path / "router.log").open("wb")
    proc = subprocess.Popen(
        [str(cp), "serve", "--config", str(path), "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "router.log").read_text()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2.0).status_code == 200:
                    break
            assert time.monotonic() < deadline, "controlplane serve did not start"
            time.sleep(0.1)
        not_found(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5.0))
        r = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5.0)
        assert r.status_code == 200 and "cp_" in r.text
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        log.close()
