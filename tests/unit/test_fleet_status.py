"""The fleet status: the pure model (states, capacity, shares, ordering, JSON), the decision ring,
the rate window, the scale log, the access rule's loopback test, the page and the CLI frame."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from policy_builders import make
from rich.console import Console

from autoscaler.controller import TickResult
from autoscaler.hosts import FleetObservation
from autoscaler.types import DemandSample, ScaleDecision, ScaleReason
from controlplane.cli.status_view import frame
from controlplane.errors import ConfigError
from controlplane.routing.ab import Arm
from controlplane.routing.books import Routed
from controlplane.types import Decision, DecisionReason, RoutingRequest
from router.http.status_routes import is_loopback
from router.status.model import (
    DecisionEntry,
    DemandFigures,
    FleetStatus,
    ReplicaDisplay,
    ScaleEntry,
    StatusInputs,
    TenantInput,
    build_status,
    display_state,
)
from router.status.page import PAGE_CSP, PAGE_HTML
from router.status.rate import RateWindow
from router.status.ring import DecisionRing
from router.status.scale_log import ScaleLog

DEMAND = DemandFigures(in_flight=3, backlog_requests=1, backlog_work_s=0.25, queued=2)


def row(rid: str, phase: str = "ready", *, ejected: bool = False, **extra: Any) -> dict[str, Any]:
    """A `LiveReplica.status()` row (the fields the model reads, and a URL it must drop)."""
    return {
        "id": rid,
        "url": f"http://10.0.0.1:8000/{rid}",
        "phase": phase,
        "liveness": "up",
        "incarnation": 1,
        "ejected": ejected,
        "eject_reason": "failures" if ejected else None,
        "in_flight": 1,
        "running": 2.0,
        "waiting": 0.0,
        "kv_usage": 0.5,
        "profile": "cpu/tiny-llama/tp1",
        **extra,
    }


def inputs(**kw: Any) -> StatusInputs:
    base: dict[str, Any] = {
        "at_s": 1000.0,
        "model": "tiny-llama",
        "uptime_s": 12.0,
        "replicas": [],
        "demand": DEMAND,
    }
    return StatusInputs(**(base | kw))


@pytest.mark.parametrize(
    ("phase", "ejected", "want"),
    [
        ("ready", False, ReplicaDisplay.READY),
        ("ready", True, ReplicaDisplay.EJECTED),
        ("loading", False, ReplicaDisplay.LOADING),
        ("loading", True, ReplicaDisplay.EJECTED),
        ("draining", False, ReplicaDisplay.DRAINING),
        ("draining", True, ReplicaDisplay.EJECTED),
        ("dead", False, ReplicaDisplay.DEAD),
        ("dead", True, ReplicaDisplay.DEAD),  # dead wins: it is not coming back by itself
    ],
)
def test_display_state(phase: str, ejected: bool, want: ReplicaDisplay) -> None:
    assert display_state(row("a", phase, ejected=ejected)) is want


@pytest.mark.parametrize(
    ("rows", "want"),
    [
        ([], dict(total=0, serving=0, loading=0, draining=0, ejected=0, dead=0)),
        (
            [row("a"), row("b"), row("c", "loading")],
            dict(total=3, serving=2, loading=1, draining=0, ejected=0, dead=0),
        ),
        (
            [row("a", ejected=True), row("b", "draining"), row("c", "dead"), row("d")],
            dict(total=4, serving=1, loading=0, draining=1, ejected=1, dead=1),
        ),
    ],
)
def test_capacity_counts_replicas_by_state(
    rows: list[dict[str, Any]], want: dict[str, int]
) -> None:
    cap = build_status(inputs(replicas=rows)).capacity
    assert {k: getattr(cap, k) for k in want} == want


@pytest.mark.parametrize(
    ("tenants", "want"),
    [
        ([], []),
        # nothing charged yet: every known tenant shows, at 0
        ([TenantInput("a", 1.0, "interactive"), TenantInput("b", 2.0, "batch")], [0.0, 0.0]),
        (
            [TenantInput("a", 1.0, "interactive", 30.0), TenantInput("b", 1.0, "batch", 10.0)],
            [0.75, 0.25],
        ),
        # largest share first, ties by id
        (
            [TenantInput("z", 1.0, "batch", 5.0), TenantInput("y", 1.0, "batch", 5.0)],
            [0.5, 0.5],
        ),
    ],
)
def test_tenant_shares(tenants: list[TenantInput], want: list[float]) -> None:
    shares = build_status(inputs(tenants=tenants)).tenants
    assert [s.share for s in shares] == pytest.approx(want)
    if len(shares) == 2 and want == [0.5, 0.5]:
        assert [s.id for s in shares] == ["y", "z"]


@given(st.lists(st.floats(min_value=0, max_value=1e9, allow_nan=False), min_size=1, max_size=20))
def test_shares_sum_to_one_once_anything_was_charged(charged: list[float]) -> None:
    tenants = [TenantInput(f"t{i}", 1.0, "interactive", w) for i, w in enumerate(charged)]
    shares = build_status(inputs(tenants=tenants)).tenants
    assert all(0.0 <= s.share <= 1.0 for s in shares)
    assert [s.share for s in shares] == sorted((s.share for s in shares), reverse=True)
    total = sum(s.share for s in shares)
    assert total == pytest.approx(1.0 if sum(charged) > 0 else 0.0)


def test_rows_sorted_decisions_newest_first_and_degraded_status() -> None:
    old = DecisionEntry(10.0, "a", "prefix_hit", "t1", "default")
    new = DecisionEntry(20.0, "b", "miss_least_loaded", "t2", "default")
    s = build_status(
        inputs(
            replicas=[row("b"), row("a")],
            decisions=[old, new],
            autoscaler=[ScaleEntry(5.0, 2, "hold", 2, 0), ScaleEntry(9.0, 3, "forecast_up", 2, 0)],
            degraded=["no ready replica"],
        )
    )
    assert [r.id for r in s.replicas] == ["a", "b"]
    assert s.decisions == (new, old)
    assert [a.target for a in s.autoscaler] == [3, 2]
    assert (s.status, s.degraded) == ("degraded", ("no ready replica",))
    assert build_status(inputs()).status == "ok"
    # equal times: the later one (given oldest first) shows first
    tie = [
        DecisionEntry(5.0, "a", "prefix_hit", "t", "p"),
        DecisionEntry(5.0, "b", "prefix_hit", "t", "p"),
    ]
    assert [d.replica for d in build_status(inputs(decisions=tie)).decisions] == ["b", "a"]


def test_json_round_trip_without_urls_or_secrets() -> None:
    s = build_status(
        inputs(
            replicas=[row("a", ejected=True)],
            decisions=[DecisionEntry(1.0, "a", "prefix_hit", "t", "default", 32)],
            tenants=[TenantInput("t", 1.0, "interactive", 1.0, 1, 0)],
        )
    )
    data = s.to_json()
    text = json.dumps(data)
    assert "http://" not in text and "url" not in text
    assert data["replicas"][0]["state"] == "ejected"
    assert FleetStatus.from_json(json.loads(text)) == s


def test_from_json_refuses_what_is_not_a_status() -> None:
    with pytest.raises(ValueError):
        FleetStatus.from_json({"replicas": "nope"})


def _routed(rid: str, reason: DecisionReason, tenant: str = "t1") -> Routed:
    req = RoutingRequest(request_id="r1", prompt_tokens=100, tenant=tenant, block_size=16)
    decision = Decision(replica_id=rid, reason=reason, expected_hit_blocks=2)
    arm = Arm(name="default", policy="round_robin")
    return Routed(req, arm, make("round_robin"), decision, rid)


def test_decision_ring_keeps_the_last_n() -> None:
    clock = iter(range(100))
    ring = DecisionRing(3, wall=lambda: float(next(clock)))
    for i in range(5):
        ring.record(_routed(f"r{i}", DecisionReason.PREFIX_HIT))
    got = ring.entries()
    assert [e.replica for e in got] == ["r2", "r3", "r4"]
    assert [e.at_s for e in got] == [2.0, 3.0, 4.0]
    assert got[0] == DecisionEntry(2.0, "r2", "prefix_hit", "t1", "default", hit_tokens=32)
    with pytest.raises(ConfigError):
        DecisionRing(0)


@pytest.mark.parametrize(
    ("readings", "want"),
    [
        ([(0.0, 0.0)], [None]),
        ([(0.0, 0.0), (0.5, 1.0)], [None, None]),  # under min_span_s
        ([(0.0, 0.0), (2.0, 4.0)], [None, (2.0, 2.0)]),
        # the window slides: the newest reading at least 10 s old is the base
        (
            [(0.0, 0.0), (10.0, 10.0), (20.0, 30.0), (25.0, 40.0)],
            [None, (1.0, 10.0), (2.0, 10.0), (2.0, 15.0)],
        ),
        # a counter that went down (restart) starts again
        ([(0.0, 0.0), (5.0, 10.0), (6.0, 1.0), (8.0, 5.0)], [None, (2.0, 5.0), None, (2.0, 2.0)]),
    ],
)
def test_rate_window(
    readings: list[tuple[float, float]], want: list[tuple[float, float] | None]
) -> None:
    w = RateWindow(window_s=10.0, min_span_s=1.0)
    got = [w.observe(t, v) for t, v in readings]
    assert got == [x if x is None else pytest.approx(x) for x in want]


def test_rate_window_rejects_nonsense() -> None:
    with pytest.raises(ConfigError):
        RateWindow(window_s=0)


def test_scale_log_records_ticks() -> None:
    log = ScaleLog(2, wall=lambda: 7.0)
    sample = DemandSample(t_s=0.0, interval_s=1.0)
    for target in (2, 3, 4):
        decision = ScaleDecision(target, ScaleReason.FORECAST_UP)
        log.record(TickResult(decision, sample, FleetObservation(spec=3, ready=2), applied=True))
    assert log.entries() == [
        ScaleEntry(7.0, 3, "forecast_up", ready=2, loading=1),
        ScaleEntry(7.0, 4, "forecast_up", ready=2, loading=1),
    ]


@pytest.mark.parametrize(
    ("host", "want"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("10.0.0.1", False),
        ("192.168.1.5", False),
        ("::ffff:10.0.0.1", False),
        ("testclient", False),
        ("", False),
        (None, False),
    ],
)
def test_loopback(host: str | None, want: bool) -> None:
    assert is_loopback(host) is want


def test_page_is_self_contained_and_never_parses_text_as_html() -> None:
    assert not re.search(r"(src|href)=\"?https?:", PAGE_HTML)
    assert "innerHTML" not in PAGE_HTML and "insertAdjacentHTML" not in PAGE_HTML
    assert "/admin/status" in PAGE_HTML
    assert "script-src 'sha256-" in PAGE_CSP and "connect-src 'self'" in PAGE_CSP


def test_cli_frame_shows_replicas_decisions_tenants_and_scaling() -> None:
    s = build_status(
        inputs(
            replicas=[row("alpha"), row("beta", "loading"), row("gamma", ejected=True)],
            decisions=[DecisionEntry(999.0, "alpha", "prefix_hit", "team-x", "default", 64)],
            tenants=[TenantInput("team-x", 1.0, "interactive", 3.0, 1, 0)],
            autoscaler=[ScaleEntry(990.0, 3, "forecast_up", 2, 1)],
        )
    )
    console = Console(record=True, width=160)
    console.print(frame(s))
    text = console.export_text()
    for needle in ("alpha", "beta", "gamma", "loading", "ejected (failures)", "prefix_hit"):
        assert needle in text
    assert "team-x" in text and "100.0%" in text and "forecast_up" in text
    assert "loading: beta" in text


def test_cli_frame_prints_markup_in_ids_literally() -> None:
    s = build_status(inputs(replicas=[row("[bold]x[/bold]")]))
    console = Console(record=True, width=160)
    console.print(frame(s))
    assert "[bold]x[/bold]" in console.export_text()


@pytest.mark.parametrize(
    ("demand", "want"),
    [
        (DEMAND, "demand: measuring"),
        (DemandFigures(0, 0, 0.0, 0, rate_replicas=1.25, window_s=30.0), "demand: 1.25 replicas"),
        (DemandFigures(0, 0, 0.0, 0, metered=False), "demand: off"),
    ],
)
def test_cli_frame_demand_line(demand: DemandFigures, want: str) -> None:
    console = Console(record=True, width=200)
    console.print(frame(build_status(inputs(demand=demand))))
    assert want in console.export_text()
