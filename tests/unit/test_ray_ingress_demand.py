"""The engine deployment's demand from the ingress replicas (autoscaler/hosts/ray_ingress.py).

Without a cluster: the ingress's policy posts its replicas' reported counters on the board and
holds the ingress's replica count; the engine's adapter with `demand="ingress"` turns them into
the same sample as its own replicas' counters (but for the backlog, which only an engine
replica's own report places at that replica); nothing posted (or posted too long ago) holds the
target and re-baselines; and both policies still meet on the one board when Serve ships their
modules by value (cloudpickle, as `AutoscalingPolicy.serialize_policy` does).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from autoscaler.hosts import ray_ingress
from autoscaler.hosts.ray_ingress import (
    IngressDemand,
    board,
    ingress_autoscaling_config,
)
from autoscaler.hosts.ray_serve import (
    ARRIVALS,
    BACKLOG_WORK,
    DECODE,
    IN_FLIGHT,
    PREFILL,
    STATE_KEY,
    ServeAutoscaler,
)
from autoscaler.types import ScaleContext, ScaleDecision, ScaleReason, ScalingPolicy
from controlplane.errors import ConfigError

pytestmark = [
    pytest.mark.filterwarnings("ignore:The `metrics_interval_s` field:DeprecationWarning"),
]

APP = "fleet"


@dataclass(frozen=True)
class Point:
    value: float
    timestamp: float = 0.0


def reported(**replicas: dict[str, float]) -> dict[str, dict[Any, list[Point]]]:
    names = {name for stats in replicas.values() for name in stats}
    return {n: {rid: [Point(s[n])] for rid, s in replicas.items() if n in s} for n in names}


def ctx(deployment: str, now: float, state: dict[str, Any], **kw: Any) -> Any:
    fields: dict[str, Any] = {
        "app_name": APP, "deployment_name": deployment, "current_time": now,
        "target_num_replicas": 1, "current_num_replicas": 1, "policy_state": state,
        "raw_metrics": {}, "total_num_requests": 0.0, "total_queued_requests": 0.0,
        "capacity_adjusted_min_replicas": 1, "capacity_adjusted_max_replicas": 8,
    }  # fmt: skip
    return SimpleNamespace(**{**fields, **kw})


class Need:
    """Replicas = arrived work per second (no utilization, no backlog term): easy to check."""

    name = "need"

    def initial_state(self) -> None:
        return None

    def decide(self, c: ScaleContext, state: None, now: float) -> tuple[ScaleDecision, None]:
        target = max(1, math.ceil(c.sample.rate - 1e-9))
        return ScaleDecision(target, ScaleReason.FORECAST_UP), None


class Engine(ServeAutoscaler):
    def make_policy(self) -> ScalingPolicy[Any]:
        self.seen: list[ScaleContext] = []
        seen = self.seen

        class Spy(Need):
            def decide(self, c: ScaleContext, state: None, now: float) -> Any:
                seen.append(c)
                return super().decide(c, state, now)

        return Spy()


@pytest.fixture(autouse=True)
def clean_board() -> None:
    board().entries.clear()


def test_ingress_policy_posts_and_holds_its_count() -> None:
    policy = IngressDemand(replicas=2)
    raw = reported(i1={ARRIVALS: 3.0})
    target, state = policy(ctx("ingress", 10.0, {"k": 1}, raw_metrics=raw, target_num_replicas=5))
    assert (target, state) == (2, {"k": 1})
    assert board().read(APP, "ingress", 10.0, stale_s=1.0) == raw
    # bounds win; stale reads are no data
    target, _ = IngressDemand()(ctx("ingress", 11.0, {}, capacity_adjusted_max_replicas=3,
                                    target_num_replicas=7))  # fmt: skip
    assert target == 3
    assert board().read(APP, "ingress", 20.0, stale_s=5.0) is None


def test_engine_reads_the_ingress_demand() -> None:
    engine = Engine(policy="need", tick_s=1.0, demand="ingress", ingress_deployment="ingress")
    ingress = IngressDemand(replicas=1)
    t0 = {ARRIVALS: 10.0, PREFILL: 1.0, DECODE: 2.0, BACKLOG_WORK: 0.0, IN_FLIGHT: 1.0}
    # the engine replicas' own metrics are not read
    own = reported(e1={ARRIVALS: 999.0, PREFILL: 999.0, DECODE: 999.0})
    ingress(ctx("ingress", 100.0, {}, raw_metrics=reported(i1=t0, i2=t0)))
    _, state = engine(ctx("engine", 100.0, {}, raw_metrics=own))
    assert engine.seen == []  # the first decision sets the baselines
    # 2 s later: i1 +4 arrivals and 6 s of work, i2 +2 arrivals and 2 s: 8 s over 2 s -> 4
    t1 = {**t0, ARRIVALS: 14.0, PREFILL: 3.0, DECODE: 6.0, BACKLOG_WORK: 0.5, IN_FLIGHT: 3.0}
    t2 = {**t0, ARRIVALS: 12.0, PREFILL: 2.0, DECODE: 3.0}
    ingress(ctx("ingress", 102.0, {}, raw_metrics=reported(i1=t1, i2=t2)))
    target, state = engine(ctx("engine", 102.0, state, raw_metrics=own))
    (seen,) = engine.seen
    s = seen.sample
    assert (s.interval_s, s.arrivals, s.in_flight) == (2.0, 6, 4)
    assert (s.prefill_work_s, s.decode_work_s, s.backlog_work_s) == (3.0, 5.0, 0.5)
    assert s.backlog_by_replica == ()  # the ingress's backlog is at no engine replica
    assert target == 4 and state[STATE_KEY].target == 4


@pytest.mark.parametrize(("demand", "by_replica"), [("metrics", (2.0, 0.5)), ("ingress", ())])
def test_only_engine_replicas_place_their_backlog(
    demand: str, by_replica: tuple[float, ...]
) -> None:
    engine = Engine(policy="need", tick_s=1.0, demand=demand)
    ingress = IngressDemand()
    t0 = {ARRIVALS: 10.0, PREFILL: 1.0, DECODE: 2.0, BACKLOG_WORK: 0.0}
    state: dict[str, Any] = {}
    # the same reports, from the engine's replicas (metrics) or the ingress's (ingress)
    for now, b1, b2 in ((0.0, 0.0, 0.0), (2.0, 0.5, 2.0)):
        stats = reported(r1={**t0, BACKLOG_WORK: b1}, r2={**t0, BACKLOG_WORK: b2})
        ingress(ctx("ingress", now, {}, raw_metrics=stats))
        _, state = engine(ctx("engine", now, state, raw_metrics=stats))
    (seen,) = engine.seen
    assert seen.sample.backlog_work_s == 2.5
    assert seen.sample.backlog_by_replica == by_replica


def test_no_ingress_demand_holds_and_rebaselines() -> None:
    engine = Engine(policy="need", tick_s=1.0, demand="ingress", ingress_stale_s=5.0)
    ingress = IngressDemand()
    counters = {ARRIVALS: 10.0, PREFILL: 1.0, DECODE: 1.0}
    ingress(ctx("ingress", 0.0, {}, raw_metrics=reported(i1=counters)))
    _, state = engine(ctx("engine", 0.0, {}))  # baselines
    # the ingress goes quiet: at 10 s its post is stale -> hold Ray's target, no decision
    target, state = engine(ctx("engine", 10.0, state, target_num_replicas=3))
    assert (target, engine.seen) == (3, [])
    assert state[STATE_KEY].baselines is None
    # it reports again, with a large total: that is a new baseline, not one interval's work
    later = {ARRIVALS: 500.0, PREFILL: 400.0, DECODE: 400.0}
    ingress(ctx("ingress", 11.0, {}, raw_metrics=reported(i1=later)))
    target, state = engine(ctx("engine", 11.0, state, target_num_replicas=3))
    assert (target, engine.seen) == (3, [])


SHIPPED = """
import sys
from types import SimpleNamespace
from ray import cloudpickle
from autoscaler.hosts.ray_ingress import board
ingress_cls, engine_cls = cloudpickle.loads(sys.stdin.buffer.read())
raw = {"cp_demand_arrivals_total": {"i1": [SimpleNamespace(value=1.0, timestamp=0.0)]}}
def ctx(dep):
    return SimpleNamespace(app_name="fleet", deployment_name=dep, current_time=5.0,
        target_num_replicas=1, current_num_replicas=1, policy_state={}, raw_metrics=raw,
        total_num_requests=0.0, total_queued_requests=0.0,
        capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=8)
ingress_cls(replicas=1)(ctx("ingress"))
posted = board().read("fleet", "ingress", 5.0, stale_s=1.0) is not None
_, state = engine_cls(policy="headroom", tick_s=1.0, demand="ingress")(ctx("engine"))
print(posted, state["cp_autoscaler"].baselines is not None)
"""


def test_policies_shipped_by_value_meet_on_one_board() -> None:
    """Serve pickles each policy's module by value and loads it in its controller: there, the
    copies must post to and read from that process's board, not copies of it."""
    from ray import cloudpickle

    from autoscaler.hosts import ray_serve

    for module in (ray_ingress, ray_serve):
        cloudpickle.register_pickle_by_value(module)  # type: ignore[no-untyped-call]
    try:
        shipped = cloudpickle.dumps((IngressDemand, ServeAutoscaler))  # type: ignore[no-untyped-call]
    finally:
        for module in (ray_ingress, ray_serve):
            cloudpickle.unregister_pickle_by_value(module)  # type: ignore[no-untyped-call]
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", SHIPPED],
        input=shipped,
        capture_output=True,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        timeout=60,
        check=True,
    )
    assert out.stdout.decode().split() == ["True", "True"], out.stderr.decode()[-2000:]


@pytest.mark.parametrize(("replicas", "interval"), [(0, 1.0), (1, 0.0)])
def test_ingress_autoscaling_config_refuses(replicas: int, interval: float) -> None:
    with pytest.raises(ConfigError):
        ingress_autoscaling_config(replicas, metrics_interval_s=interval)


def test_ingress_autoscaling_config_is_a_fixed_count() -> None:
    from ray.serve.config import AutoscalingConfig

    cfg = AutoscalingConfig(**ingress_autoscaling_config(3, metrics_interval_s=0.5))
    assert (cfg.min_replicas, cfg.max_replicas, cfg.initial_replicas) == (3, 3, 3)
    assert cfg.policy.policy_function == "autoscaler.hosts.ray_ingress:IngressDemand"
    assert cfg.policy.policy_kwargs == {"replicas": 3}
