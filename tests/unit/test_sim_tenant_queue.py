"""The simulator's router-side tenant queue (the queue core the router runs too): shares by
work, capacity gating, classes, the batch KV cap, exact charges, nothing left behind; the
scenario generators, the report and the CLI."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from controlplane.cli import _register, app
from controlplane.errors import ConfigError
from controlplane.roofline import profile
from controlplane.routing.policies import make_policy
from controlplane.sim.fair_replay import batch_share_for_trace, fair_replay, parse_weights
from controlplane.sim.fairness import jain_index, tenant_fairness
from controlplane.sim.fleet import FleetConfig, FleetSim
from controlplane.sim.results import FleetResult
from controlplane.tenancy.config import FairnessConfig
from controlplane.tenancy.queue import TenantQueueCore
from controlplane.tenancy.work import WorkMode, WorkModel
from controlplane.traces import load_trace
from controlplane.traces.generators import batch_flood, long_documents, multi_tenant
from controlplane.types import PriorityClass

H100 = profile("h100", "llama-3.1-8b")
ROOF = WorkModel.build("vtc-roofline", H100)
DOCS = long_documents(duration=25, doc_rate=4, chat_rate=80)


def fair(**changes: object) -> FairnessConfig:
    """The queue's settings as the simulator's tests run them (no batch cap unless given)."""
    return FairnessConfig(**{"batch_kv_share": 1.0, **changes})  # type: ignore[arg-type]


def run(
    trace: object,
    queue: FairnessConfig | None,
    replicas: int = 2,
    weights: dict[str, float] | None = None,
) -> tuple[FleetSim, FleetResult]:
    cfg = FleetConfig(
        profile=H100,
        replicas=replicas,
        fairness=queue,
        tenant_weights=tuple((weights or {}).items()),
    )
    sim = FleetSim(cfg, functools.partial(make_policy, "least_loaded"))
    return sim, sim.run(trace)  # type: ignore[arg-type]


def assert_drained(sim: FleetSim, result: FleetResult) -> None:
    q = sim.queue
    assert q is not None
    assert all(r.completed for r in result.records), {r.rejected for r in result.records}
    assert q.queued == 0 and not q.inflight and not q.waiting_entries
    assert all(
        (s.requests, s.reserved, s.batch_reserved, s.prefill) == (0, 0, 0, 0)
        for s in q.replicas.values()
    )
    assert not any(q.held.values())
    assert not q.state.backlogged


@pytest.mark.parametrize(
    ("mode", "weights", "a_share"),
    [
        (WorkMode.VTC_ROOFLINE, {}, (0.42, 0.58)),
        (WorkMode.VTC_ROOFLINE, {"A": 1.0, "B": 3.0}, (0.17, 0.33)),
        (WorkMode.REQUEST, {}, (0.65, 1.0)),
    ],
)
def test_long_documents_share_the_gpu_by_weighted_work(
    mode: WorkMode, weights: dict[str, float], a_share: tuple[float, float]
) -> None:
    sim, result = run(DOCS, fair(mode=mode.value), weights=weights)
    f = tenant_fairness(result, ROOF, weights)
    assert f.window_kind == "contended"
    lo, hi = a_share
    assert lo <= f.share("A") <= hi, f.tenants
    assert f.share("A") + f.share("B") == pytest.approx(1.0)
    assert_drained(sim, result)


def test_the_queue_never_exceeds_a_replicas_slots() -> None:
    slots = 6
    sim, result = run(DOCS, fair(slots_per_replica=slots))
    edges: dict[str, list[tuple[float, int]]] = {}
    for r in result.records:
        assert r.dispatched_s >= r.arrival_s
        edges.setdefault(r.replica, []).extend([(r.dispatched_s, 1), (r.finish_s, -1)])
    for points in edges.values():
        level = peak = 0
        for _, step in sorted(points, key=lambda p: (p[0], p[1])):
            level += step
            peak = max(peak, level)
        assert peak == slots
    assert_drained(sim, result)


def test_charges_equal_the_work_done_with_cached_prompts_refunded() -> None:
    trace = multi_tenant(tenants="rag,chat", duration=10)
    sim, result = run(trace, fair())
    q = sim.queue
    assert q is not None
    assert any(r.cached_tokens for r in result.records)
    for tenant, charged in q.charged.items():
        done = sum(
            ROOF.request(r.prompt_tokens, r.output_tokens, r.cached_tokens)
            for r in result.records
            if r.tenant == tenant
        )
        assert charged == pytest.approx(done, rel=1e-3)


FLOOD = batch_flood(duration=12, chat_rate=6, batch_rate=30)


def test_interactive_requests_are_never_passed_by_batch_ones() -> None:
    sim, result = run(FLOOD, fair(slots_per_replica=8))
    inter = [r for r in result.records if r.priority == "interactive"]
    for b in (r for r in result.records if r.priority == "batch"):
        waiting = [r for r in inter if r.arrival_s < b.dispatched_s < r.dispatched_s]
        assert not waiting, (b, waiting[:1])
    assert_drained(sim, result)


def test_the_batch_class_holds_at_most_its_kv_share(monkeypatch: pytest.MonkeyPatch) -> None:
    share = 0.05
    kv = H100.num_gpu_blocks * H100.resolved_block_size
    seen: list[int] = []
    place = TenantQueueCore.place

    def checked(self: TenantQueueCore[int], key: int, replica: str, prof: object) -> None:
        place(self, key, replica, prof)  # type: ignore[arg-type]
        s = self.replicas[replica]
        flights = [f for f in self.inflight.values() if f.replica == replica and f.entry.batch]
        seen.append(s.batch_reserved)
        assert s.batch_reserved <= share * kv or len(flights) == 1

    monkeypatch.setattr(TenantQueueCore, "place", checked)
    sim, result = run(FLOOD, fair(batch_kv_share=share))
    assert max(seen) > share * kv / 2  # the cap was reached, not merely respected
    assert_drained(sim, result)


def test_a_replica_dying_frees_its_slots_and_the_queue_moves_on() -> None:
    sim = FleetSim(
        FleetConfig(profile=H100, replicas=2, fairness=fair(slots_per_replica=6)),
        functools.partial(make_policy, "least_loaded"),
    )
    sim.schedule_leave(4.0, "replica-0", drain=False)
    result = sim.run(FLOOD)
    died = [r for r in result.records if r.rejected]
    assert died and {r.rejected for r in died} == {"replica_died"}
    assert all(r.completed for r in result.records if not r.rejected)
    q = sim.queue
    assert q is not None and q.queued == 0 and not q.inflight
    assert all((s.requests, s.reserved, s.prefill) == (0, 0, 0) for s in q.replicas.values())


def test_without_a_queue_nothing_changes() -> None:
    sim, result = run(FLOOD, None)
    assert sim.queue is None and "backlog" not in result.meta
    assert all(r.dispatched_s == -1.0 for r in result.records)


# -- generators, report, CLI ----------------------------------------------------------------------
def test_long_documents_and_its_single_tenant_subset_share_arrivals() -> None:
    b_alone = long_documents(duration=25, doc_rate=4, chat_rate=80, tenants="B")
    assert {r.tenant for r in b_alone} == {"B"}
    full_b = [r.arrival_s for r in DOCS if r.tenant == "B"]
    assert [r.arrival_s for r in b_alone] == full_b
    assert {(r.prompt_tokens, r.output_tokens) for r in DOCS if r.tenant == "A"} == {(16_000, 300)}
    assert {(r.prompt_tokens, r.output_tokens) for r in DOCS if r.tenant == "B"} == {(200, 200)}
    flood = load_trace("gen:batch-flood?duration=5")
    assert {r.priority for r in flood if r.tenant == "batch"} == {PriorityClass.BATCH}
    with pytest.raises(ConfigError):
        long_documents(tenants="C")


@pytest.mark.parametrize(
    ("values", "expected"), [([1, 1, 1], 1.0), ([1, 0], 0.5), ([], 1.0), ([2, 1], 0.9)]
)
def test_jain_index(values: list[float], expected: float) -> None:
    assert jain_index(values) == pytest.approx(expected)


@pytest.mark.parametrize("bad", ["A", "A=0", "A=x", "=1"])
def test_weights_are_validated(bad: str) -> None:
    with pytest.raises(ConfigError):
        parse_weights(bad)
    assert parse_weights("A=1, B=2.5") == {"A": 1.0, "B": 2.5}


def test_batch_share_for_a_trace_is_sized_from_the_interactive_load() -> None:
    config = FleetConfig(profile=H100, replicas=2)
    lax, _ = batch_share_for_trace(FLOOD, config, tpot_target_s=1.0)
    strict, sized = batch_share_for_trace(FLOOD, config, slowdown=1.2)
    assert lax == 1.0 and 0.0 < strict < 1.0
    assert sized["interactive_sequences"] > 0
    assert sized["tpot_target_s"] == pytest.approx(1.2 * sized["interactive_tpot_alone_s"])
    with pytest.raises(ConfigError):
        batch_share_for_trace(FLOOD, config)


def test_fair_replay_reports_every_mode(tmp_path: Path) -> None:
    config = FleetConfig(profile=H100, replicas=2)
    trace = long_documents(duration=8, doc_rate=3, chat_rate=60)
    report = fair_replay(trace, config, ["request", "vtc-roofline"], weights={"A": 1, "B": 1})
    assert set(report.fairness) == {"request", "vtc-roofline"}
    data = report.to_json()
    assert set(data["fairness"]["vtc-roofline"]["tenants"]) == {"A", "B"}  # type: ignore[index]


def test_cli_replay_with_fairness_writes_shares_and_jain(tmp_path: Path) -> None:
    out = tmp_path / "fair.json"
    _register()
    result = CliRunner().invoke(
        app,
        [
            "replay",
            "--trace",
            "gen:long-documents?duration=6&doc_rate=3&chat_rate=40",
            "--replicas",
            "1",
            "--fairness",
            "vtc-roofline",
            "--tenant-weights",
            "A=1,B=3",
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "Jain" in result.output and "class interactive" in result.output
    fair = json.loads(out.read_text())["fairness"]["vtc-roofline"]
    assert fair["tenants"]["B"]["weight"] == 3.0
    assert 0 < fair["jain_index"] <= 1
    assert {"ttft_p99_s", "tpot_p99_s", "work_share"} <= set(fair["tenants"]["A"])
    sized = CliRunner().invoke(
        app,
        [
            "replay",
            "--trace",
            "gen:batch-flood?duration=4&chat_rate=5&batch_rate=10",
            "--replicas",
            "1",
            "--fairness",
            "vtc-roofline",
            "--interactive-tpot-target",
            "0.02",
        ],
    )
    assert sized.exit_code == 0, sized.output
    assert "batch KV share sized for TPOT 0.02s" in sized.output and "class batch" in sized.output
    bad = CliRunner().invoke(app, ["replay", "--trace", "gen:long-documents", "--fairness", "fifo"])
    assert bad.exit_code != 0
