"""The fleet status against a live router with simulated replicas: `GET /admin/status` reflects
the fleet and the traffic, the access rule (loopback only without an admin key, the key when one
is set), `controlplane status --once` (a real subprocess), and the `/status` page rendered by
headless Chromium (its DOM after the script ran, and screenshots of it and of the CLI frame).

Screenshots go to the test's tmp dir; with CP_UPDATE_DOC_IMAGES=1 they are also written to
docs/img/ (status_page.png, status_cli.png), the images docs/operations.md shows.
"""

from __future__ import annotations

import asyncio
import io
import os
import shutil
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI
from router_fixtures import (
    MODEL,
    assert_router_idle,
    replica_entry,
    router_settings,
    sim_args,
    wait_until,
)
from router_harness import RouterServer
from sim_fleet import SimReplica

from autoscaler.controller import AutoscalerSettings, Controller, RouterScraper, load_policy
from autoscaler.hosts.kubernetes import ObserveOnly
from autoscaler.types import ScaleReason
from controlplane.types import DecisionReason
from router.config import ReplicaConfig
from router.status.scale_log import ScaleLog

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]
SECRET = "status-test-salt-secret"
ADMIN = "status-admin-key-0123456789"
KEYS = {"team-alpha": "sk-status-alpha-0001", "team-beta": "sk-status-beta-0002"}
LOADING_ID = "r3-loading"
REASONS = {str(r) for r in DecisionReason}
# a long system prompt per tenant: its later requests can find their prefix cached
SYSTEM = {t: f"You are the on-call assistant of {t}. " * 12 for t in KEYS}


@dataclass
class Live:
    router: RouterServer  # no admin key: loopback clients only
    keyed: RouterServer  # admin key set
    sims: dict[str, SimReplica]


def _closed_port() -> int:
    """A loopback port nothing listens on (a replica there never answers: it stays loading)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


@pytest.fixture(scope="module")
def live(model_dir: Path) -> Iterator[Live]:
    from controlplane.tenancy.identity import key_digest

    tenants = [
        {"id": "team-alpha", "api_key_sha256": [key_digest(KEYS["team-alpha"])], "weight": 1.0},
        {
            "id": "team-beta",
            "api_key_sha256": [key_digest(KEYS["team-beta"])],
            "weight": 2.0,
            "priority": "batch",
        },
    ]
    with (
        pytest.MonkeyPatch.context() as mp,
        SimReplica(*sim_args(model_dir)) as s1,
        SimReplica(*sim_args(model_dir)) as s2,
    ):
        mp.setenv("CP_CACHE_SALT_SECRET", SECRET)
        replicas = [replica_entry("r1", s1), replica_entry("r2", s2)]
        common: dict[str, Any] = {"tenants": tenants, "health": {"scrape_interval_s": 0.2}}
        plain = router_settings(model_dir, replicas, **common)
        keyed = router_settings(model_dir, replicas, admin_key=ADMIN, **common)
        with RouterServer(plain) as router, RouterServer(keyed) as keyed_router:
            router.wait_ready(2)
            keyed_router.wait_ready(2)
            yield Live(router, keyed_router, {"r1": s1, "r2": s2})
            assert_router_idle(router)
            assert_router_idle(keyed_router)


def status(url: str, key: str | None = None) -> dict[str, Any]:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    resp = httpx.get(f"{url}/admin/status", headers=headers, timeout=10.0)
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body


def chat(url: str, tenant: str, i: int) -> None:
    with OpenAI(base_url=f"{url}/v1", api_key=KEYS[tenant], max_retries=0) as client:
        out = client.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "system", "content": SYSTEM[tenant]},
                {"role": "user", "content": f"Status check {i}."},
            ],
            max_tokens=8,
        )
        assert out.choices[0].message.content


def traffic(url: str, tenants: list[str]) -> None:
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda it: chat(url, it[1], it[0]), enumerate(tenants)))


def shape_fleet(live: Live, router: RouterServer) -> None:
    """r2 draining and a replica that never answers (loading), as /admin/replicas would make
    them: through the runtime (the keyless router has no admin API)."""
    rt = router.runtime
    cfg = ReplicaConfig(
        id=LOADING_ID, url=f"http://127.0.0.1:{_closed_port()}", gpu="cpu", model=MODEL
    )
    if LOADING_ID not in {r.replica_id for r in rt.fleet.replicas()}:
        router.call(lambda: rt.add_replica(cfg))
    router.call(lambda: rt.fleet.drain("r2"))


# -- the JSON --------------------------------------------------------------------------------------
def test_status_reflects_the_fleet_and_recent_traffic(live: Live) -> None:
    url = live.router.url
    before = status(url)  # also the demand rate's first reading
    assert {r["id"]: r["state"] for r in before["replicas"]} == {"r1": "ready", "r2": "ready"}
    assert before["capacity"]["serving"] == 2
    assert {t["id"] for t in before["tenants"]} >= {"team-alpha", "team-beta"}

    sent = ["team-alpha"] * 6 + ["team-beta"] * 3
    traffic(url, sent)
    wait_until(lambda: status(url)["demand"]["in_flight"] == 0, 10.0, "requests to finish")

    after = status(url)
    newest = after["decisions"][: len(sent)]
    assert Counter(d["tenant"] for d in newest) == Counter(sent)
    assert {d["replica"] for d in newest} <= {"r1", "r2"}
    assert {d["reason"] for d in newest} <= REASONS
    assert [d["at_s"] for d in after["decisions"]] == sorted(
        (d["at_s"] for d in after["decisions"]), reverse=True
    )
    shares = {t["id"]: t for t in after["tenants"]}
    assert shares["team-alpha"]["share"] > 0 and shares["team-beta"]["share"] > 0
    assert sum(t["share"] for t in after["tenants"]) == pytest.approx(1.0)
    assert shares["team-beta"]["weight"] == 2.0 and shares["team-beta"]["priority"] == "batch"
    assert after["demand"]["backlog_requests"] == 0 and after["demand"]["queued"] == 0
    # the arrival rate of the work just served, once the router watched it for a second
    wait_until(lambda: (status(url)["demand"]["rate_replicas"] or 0) > 0, 10.0, "a demand rate")
    text = httpx.get(f"{url}/admin/status", timeout=10.0).text
    for secret in (SECRET, *KEYS.values(), live.sims["r1"].url):
        assert secret not in text


def test_an_attached_autoscaler_shows_its_decisions(live: Live) -> None:
    """A headroom `Controller` in the test process scrapes the live router's /metrics; its
    ticks reach the status through `ScaleLog` and `runtime.status_sources`."""
    settings = AutoscalerSettings(routers=[live.router.url], model=MODEL, min_replicas=1)
    log = ScaleLog()

    async def two_ticks() -> None:
        async with httpx.AsyncClient(timeout=5.0) as client:
            scraper = RouterScraper(settings.routers, MODEL, client)
            policy = load_policy(settings.policy, settings.policy_params)
            controller = Controller(settings, policy, ObserveOnly("advisory"), scraper)
            controller.on_tick.append(log.record)
            for _ in range(2):
                assert await controller.tick() is not None

    asyncio.run(two_ticks())
    live.router.call(lambda: live.router.runtime.status_sources.append(log.entries))
    shown = status(live.router.url)["autoscaler"]
    assert len(shown) == 2
    assert shown[-1]["reason"] == str(ScaleReason.NO_DATA)  # the first tick sets baselines
    assert {a["reason"] for a in shown} <= {str(r) for r in ScaleReason}
    assert all(a["target"] >= 1 for a in shown)


# -- the access rule -------------------------------------------------------------------------------
def test_without_an_admin_key_only_loopback_clients_are_served(live: Live) -> None:
    page = httpx.get(f"{live.router.url}/status", timeout=10.0)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'sha256-" in page.headers["content-security-policy"]

    async def from_elsewhere(path: str) -> httpx.Response:
        transport = httpx.ASGITransport(app=live.router.app, client=("10.1.2.3", 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            return await client.get(path)

    for path in ("/admin/status", "/status"):
        resp = asyncio.run(from_elsewhere(path))
        assert resp.status_code == 403, resp.text
        assert "loopback" in resp.json()["error"]["message"]


@pytest.mark.parametrize(
    ("key", "code"), [(None, 401), ("wrong-key", 401), (ADMIN, 200)], ids=["none", "wrong", "ok"]
)
def test_with_an_admin_key_the_key_is_required(live: Live, key: str | None, code: int) -> None:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    resp = httpx.get(f"{live.keyed.url}/admin/status", headers=headers, timeout=10.0)
    assert resp.status_code == code, resp.text
    if code == 401:
        assert resp.json()["error"]["code"] == "AuthError"
    # the page holds no data: served, and it asks for the key
    assert httpx.get(f"{live.keyed.url}/status", timeout=10.0).status_code == 200


# -- the CLI ---------------------------------------------------------------------------------------
def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    code = "from controlplane.cli import main; main()"
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "160", **(env or {})}
    full_env.pop("CP_ADMIN_KEY", None)
    return subprocess.run(
        [sys.executable, "-c", code, "status", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=full_env,
        cwd=ROOT,
    )


def test_cli_once_shows_replica_ids_and_states(live: Live) -> None:
    shape_fleet(live, live.router)
    wait_until(
        lambda: {r["id"] for r in status(live.router.url)["replicas"]} >= {LOADING_ID},
        10.0,
        "the loading replica in the status",
    )
    out = run_cli("--url", live.router.url, "--once")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for rid, state in (("r1", "ready"), ("r2", "draining"), (LOADING_ID, "loading")):
        assert any(rid in line and state in line for line in lines), (rid, state, out.stdout)
    assert f"loading: {LOADING_ID}" in out.stdout


def test_cli_reads_the_admin_key_from_the_environment(live: Live) -> None:
    ok = run_cli(
        "--url", live.keyed.url, "--once", "--admin-key-env", "T_KEY", env={"T_KEY": ADMIN}
    )
    assert ok.returncode == 0, ok.stderr
    assert "r1" in ok.stdout and "r2" in ok.stdout
    refused = run_cli("--url", live.keyed.url, "--once")
    assert refused.returncode == 1
    assert refused.stderr.strip().count("\n") == 0 and "401" in refused.stderr


def test_cli_unreachable_router_is_one_line_and_exit_1() -> None:
    out = run_cli("--url", f"http://127.0.0.1:{_closed_port()}", "--once", "--timeout", "2")
    assert out.returncode == 1
    assert out.stderr.strip().count("\n") == 0, out.stderr
    assert "cannot reach the router" in out.stderr and "Traceback" not in out.stderr


# -- the page in headless Chromium -----------------------------------------------------------------
def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def headless(*args: str, budget_ms: int = 8000) -> subprocess.CompletedProcess[str]:
    exe = chromium()
    if exe is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
    flags += ["--no-first-run", "--hide-scrollbars", f"--virtual-time-budget={budget_ms}"]
    return subprocess.run([exe, *flags, *args], capture_output=True, text=True, timeout=90)


def keep_image(path: Path) -> None:
    assert path.exists() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("CP_UPDATE_DOC_IMAGES") == "1":
        shutil.copyfile(path, ROOT / "docs" / "img" / path.name)


def long_stream(url: str, tenant: str, stop: threading.Event) -> int:
    """A long streamed completion, read until `stop` is set, then closed (the client leaves):
    requests in flight while the page is captured. Its chunk count."""
    with OpenAI(base_url=f"{url}/v1", api_key=KEYS[tenant], max_retries=0) as client:
        messages: Any = [
            {"role": "system", "content": SYSTEM[tenant]},
            {"role": "user", "content": "Go."},
        ]
        chunks = 0
        with client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=700, stream=True
        ) as stream:
            for _ in stream:
                chunks += 1
                if stop.is_set():
                    break
        return chunks


def test_page_renders_the_fleet_in_headless_chromium(live: Live, tmp_path: Path) -> None:
    shape_fleet(live, live.router)
    traffic(live.router.url, ["team-alpha", "team-beta", "team-alpha"])
    url = f"{live.router.url}/status"
    # slower steps on r1 (the one ready replica): the streams are still running when captured
    live.sims["r1"].set_faults(slow_factor=16.0)
    stop = threading.Event()
    try:
        with ThreadPoolExecutor(4) as pool:
            streams = [
                pool.submit(long_stream, live.router.url, tenant, stop)
                for tenant in ("team-alpha", "team-alpha", "team-beta", "team-beta")
            ]
            wait_until(lambda: status(live.router.url)["demand"]["in_flight"] > 0, 30.0, "streams")
            render_page(url, tmp_path)
            stop.set()
            assert all(s.result(timeout=150) > 0 for s in streams)
    finally:
        stop.set()
        live.sims["r1"].set_faults(reset=True)
    wait_until(lambda: status(live.router.url)["demand"]["in_flight"] == 0, 30.0, "streams end")


def render_page(url: str, tmp_path: Path) -> None:
    """A screenshot (first, while the streams run: one poll is enough), then the DOM."""
    shot = tmp_path / "status_page.png"
    out = headless(f"--screenshot={shot}", "--window-size=1400,1150", url, budget_ms=2000)
    assert out.returncode == 0, out.stderr[-2000:]
    keep_image(shot)

    dom = headless("--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert 'data-loaded="1"' in html, "the page's script did not render a status"
    for rid, state in (("r1", "ready"), ("r2", "draining"), (LOADING_ID, "loading")):
        assert f'data-replica="{rid}" data-state="{state}"' in html
    assert 'data-tenant="team-alpha"' in html and 'data-tenant="team-beta"' in html
    assert "data-reason=" in html


def test_page_asks_for_the_admin_key_when_one_is_set(live: Live) -> None:
    dom = headless("--dump-dom", f"{live.keyed.url}/status", budget_ms=3000)
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert '<form id="auth">' in html, "the key field is not shown"
    assert "asks for its admin key" in html
    assert "data-replica=" not in html and 'data-loaded="1"' not in html


def test_cli_frame_screenshot(live: Live, tmp_path: Path) -> None:
    """The `controlplane status` frame as the terminal shows it (rich's SVG, rendered)."""
    from rich.console import Console

    from controlplane.cli.status import fetch_status
    from controlplane.cli.status_view import frame

    shape_fleet(live, live.router)
    with httpx.Client(timeout=10.0) as client:
        current = fetch_status(client, live.router.url, None)
    console = Console(record=True, width=120, file=io.StringIO())
    console.print(frame(current))
    svg = tmp_path / "status_cli.svg"
    console.save_svg(str(svg), title="controlplane status")
    assert LOADING_ID in svg.read_text()
    shot = tmp_path / "status_cli.png"
    out = headless(f"--screenshot={shot}", "--window-size=1200,900", svg.as_uri())
    assert out.returncode == 0, out.stderr[-2000:]
    keep_image(shot)
