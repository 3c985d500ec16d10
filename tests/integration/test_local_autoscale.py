"""The closed autoscaling loop on the local stack, end to end (real processes, real Redis).

`controlplane up --autoscale` (short load time, fast tick) shares a private Redis with a second
router (`controlplane serve`, no replicas of its own: it follows the shared registry). A ramp of
streamed requests goes through both routers, up and down. Asserted:

- every request succeeds;
- replicas joined (spawned, then READY) and left (DRAINING -> GONE -> stopped, in that order);
- when a replica's process is stopped it has nothing running and has finished no request
  since it went GONE (no router sent it anything after the drain completed fleet-wide);
- per router, every routing decision to a replica (the router's decision ring, polled) falls
  after that router logged the replica READY and not after it logged it DRAINING: both routers
  route to a new replica only once it is ready and never to one that is draining (the ring's
  stamps and the log's come from the same process's wall clock);
- both routers routed to a replica the autoscaler added;
- after SIGTERM to `up` every replica it started is gone (its port refuses connections), and
  the scale-down shows in router A's status (the autoscaler's decisions).

The run's timeline (ordered, ready, draining replicas, demand) is plotted to the test's tmp
dir; with CP_UPDATE_DOC_IMAGES=1 also to docs/img/local_autoscale.png (docs/autoscaling.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections import defaultdict
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from redis_server import RedisServer
from router_fixtures import wait_until

from controlplane.loadgen import LoadConfig, LoadResult, Ramp, run_load
from deploy.local_autoscale import AutoscaleOptions, router_config
from deploy.processes import Child, spawn
from deploy.redis_local import free_port

pytestmark = pytest.mark.timeout(300)
CP = str(Path(sys.executable).parent / "controlplane")
ROOT = Path(__file__).resolve().parents[2]
LOAD_TIME_S = 3.0
# up and down: one replica's worth at the ends, about three at the top
RAMP = "0:0.5,15:7,35:7,50:0.5,60:0.5"


def _serving(url: str, child: Child, log: Path) -> bool:
    assert child.poll() is None, log.read_text()[-3000:]
    with contextlib.suppress(httpx.HTTPError):
        r = httpx.get(f"{url}/ready", timeout=2.0)
        return r.status_code == 200 and r.json()["ready_replicas"] >= 1
    return False


def _refused(url: str) -> bool:
    host, _, port = url.removeprefix("http://").rpartition(":")
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, int(port))) != 0


def _log_events(log: Path) -> dict[str, dict[str, float]]:
    """{"replica ready"|"replica draining": {replica: first epoch seconds}} of one router."""
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for line in log.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        with contextlib.suppress(ValueError):
            row = json.loads(line)
            msg = row.get("message")
            if msg in ("replica ready", "replica draining") and "replica" in row:
                at = datetime.fromisoformat(row["ts"].replace("Z", "+00:00")).timestamp()
                out[msg].setdefault(row["replica"], at)
    return out


class DecisionPoller:
    """Polls routers' /admin/status and keeps every routing decision seen, per router."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.seen: dict[str, set[tuple[float, str]]] = {u: set() for u in urls}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=2.0) as client:
            while not self.stop.is_set():
                for url in self.urls:
                    with contextlib.suppress(httpx.HTTPError, ValueError):
                        body = client.get(f"{url}/admin/status").json()
                        for d in body.get("decisions", []):
                            self.seen[url].add((float(d["at_s"]), str(d["replica"])))
                self.stop.wait(0.25)

    def __enter__(self) -> DecisionPoller:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10.0)


def _timeline(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["kind"] == "tick"], [r for r in rows if r["kind"] != "tick"]


def _counts(events: list[dict[str, Any]]) -> list[tuple[float, int, int, int]]:
    """(t, ordered, ready, draining) after every provider event: ordered = spawned and not
    on its way out, ready = of those, the READY ones, draining = drained and not yet stopped."""
    live: set[str] = set()
    ready: set[str] = set()
    leaving: set[str] = set()
    out = [(0.0, 0, 0, 0)]
    for e in sorted(events, key=lambda e: e["t"]):
        name, kind = e["replica"], e["kind"]
        if kind == "spawned":
            live.add(name)
        elif kind == "ready":
            ready.add(name)
        elif kind == "draining":
            live.discard(name)
            leaving.add(name)
        elif kind in ("stopped", "exited"):
            live.discard(name)
            leaving.discard(name)
            ready.discard(name)
        out.append((e["t"], len(live), len(ready & live), len(leaving)))
    return out


def _plot(ticks: list[dict[str, Any]], events: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = _counts(events)
    end = max([r["t"] for r in ticks] + [c[0] for c in counts])
    counts.append((end, *counts[-1][1:]))
    ct = [c[0] for c in counts]
    fig, ax = plt.subplots(figsize=(9, 4.2), dpi=110)
    ax.step(ct, [c[1] for c in counts], where="post", label="ordered", lw=2.5)
    ax.step(ct, [c[2] for c in counts], where="post", label="ready", lw=1.8)
    ax.step(ct, [c[3] for c in counts], where="post", label="draining", lw=1.8)
    t = [r["t"] for r in ticks]
    ax.plot(t, [r["demand"] for r in ticks], label="demand (replicas of work)", color="grey")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("replicas")
    ax2 = ax.twinx()
    ax2.plot(t, [r["arrivals_per_s"] for r in ticks], ":", color="black", label="requests/s")
    ax2.set_ylabel("requests / s (both routers)")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper left", fontsize=8)
    ax.set_title(f"controlplane up --autoscale: two routers, load time {LOAD_TIME_S:g} s")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def test_ramp_up_and_down_through_two_routers(redis_server: RedisServer, tmp_path: Path) -> None:
    port_a, port_b = free_port(), free_port()
    url_a, url_b = f"http://127.0.0.1:{port_a}", f"http://127.0.0.1:{port_b}"
    timeline = tmp_path / "timeline.jsonl"
    log_a, log_b = tmp_path / "up.log", tmp_path / "router-b.log"
    config_b = tmp_path / "router-b.yaml"
    opts = AutoscaleOptions(load_time_s=LOAD_TIME_S)
    config_b.write_text(yaml.safe_dump(router_config(opts, redis_url=redis_server.url)))
    env = {**os.environ, "COLUMNS": "200"}
    argv_a = [
        CP, "up", "--autoscale", "--replicas", "1", "--min", "1", "--max", "4",
        "--load-time-s", str(LOAD_TIME_S), "--tick-s", "1", "--port", str(port_a),
        "--redis-url", redis_server.url, "--peer-router", url_b, "--timeline", str(timeline),
    ]  # fmt: skip
    with log_a.open("wb") as out:
        up = spawn(argv_a, env=env, stdout=out, stderr=subprocess.STDOUT)
    with log_b.open("wb") as out:
        router_b = spawn(
            [CP, "serve", "--config", str(config_b), "--port", str(port_b)],
            env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_until(lambda: _serving(url_a, up, log_a), 120.0, "up --autoscale serving", 0.2)
        wait_until(lambda: _serving(url_b, router_b, log_b), 60.0, "router B serving", 0.2)
        ramp = Ramp.parse(RAMP)
        with DecisionPoller([url_a, url_b]) as poller:
            result: LoadResult = asyncio.run(
                run_load([url_a, url_b], ramp, LoadConfig(max_tokens=64))
            )

            def scaled_down() -> bool:
                assert up.poll() is None, log_a.read_text()[-3000:]
                return any(e["kind"] == "stopped" for e in _timeline(timeline)[1])

            wait_until(scaled_down, 120.0, "a scale-down to complete", 0.5)

        # the autoscaler's decisions are in the status of the router it runs in
        def scale_down_shown() -> bool:
            scaling = httpx.get(f"{url_a}/admin/status", timeout=5.0).json()["autoscaler"]
            return "scale_down" in {e["reason"] for e in scaling}

        wait_until(scale_down_shown, 30.0, "the scale-down in router A's status", 0.5)
        os.kill(up.pid, 15)
        os.kill(router_b.pid, 15)
        assert up.wait(60.0) == 0, log_a.read_text()[-3000:]
        assert router_b.wait(60.0) == 0, log_b.read_text()[-3000:]
    finally:
        up.stop(10.0)
        router_b.stop(10.0)

    # nothing left behind: every replica the provider started refuses connections now
    ticks, events = _timeline(timeline)
    urls = [e["detail"] for e in events if e["kind"] == "spawned"]
    wait_until(lambda: all(_refused(u) for u in urls), 10.0, "every replica process gone")

    # every request succeeded
    failed = [r for r in result.records if not r.ok]
    assert not failed, failed[:5]
    assert len(result.records) == len(ramp.departures())

    _plot(ticks, events, tmp_path / "local_autoscale.png")
    if os.environ.get("CP_UPDATE_DOC_IMAGES") == "1":
        shutil.copyfile(tmp_path / "local_autoscale.png", ROOT / "docs/img/local_autoscale.png")
    by_replica: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        by_replica[e["replica"]].append(e)
    # replicas joined: more than the initial one was spawned and became READY
    joined = [
        n for n, evs in by_replica.items() if [e["kind"] for e in evs][:2] == ["spawned", "ready"]
    ]
    assert len(joined) >= 2, events
    # and left: drained, gone, then stopped, in that order, idle and untouched since GONE
    stopped = [n for n, evs in by_replica.items() if any(e["kind"] == "stopped" for e in evs)]
    assert stopped, events
    for name in stopped:
        kinds = [e["kind"] for e in by_replica[name]]
        assert kinds[-3:] == ["draining", "gone", "stopped"], (name, kinds)
        gone, stop = by_replica[name][-2], by_replica[name][-1]
        assert gone["running"] == 0 and stop["running"] == 0, (name, gone, stop)
        assert gone["served"] == stop["served"], (name, gone, stop)

    # per router: decisions only between READY and DRAINING as that router logged them
    added = {n for n in joined if n != "local-0"}
    for url, log in ((url_a, log_a), (url_b, log_b)):
        marks = _log_events(log)
        # this router applied every drain (so the bound below is a real one)
        assert set(stopped) <= set(marks["replica draining"]), (url, stopped, marks)
        decisions = poller.seen[url]
        assert decisions, url
        for at_s, replica in decisions:
            ready = marks["replica ready"].get(replica)
            assert ready is not None and ready <= at_s, (url, replica, at_s, ready)
            drain = marks["replica draining"].get(replica)
            # the log stamps whole milliseconds: a decision in the drain's millisecond is not after
            assert drain is None or int(at_s * 1000) / 1000 <= drain, (url, replica, at_s, drain)
        assert {r for _, r in decisions} & added, (url, added)
    # the drain bound was exercised: a replica that was routed to was later drained and stopped
    routed = {r for seen in poller.seen.values() for _, r in seen}
    assert routed & set(stopped), (routed, stopped)
