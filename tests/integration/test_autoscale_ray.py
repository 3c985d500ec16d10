"""The Ray Serve host: our policy as the custom autoscaling policy of a deployment.

Without a cluster: `autoscaling_config` is a valid Ray 2.60 `AutoscalingConfig` with Ray's delays
at 0 and factors at 1, and `ServeAutoscaler` turns an `AutoscalingContext` into our `ScaleContext`
(replica-reported counters as deltas, Ray's ongoing requests as the fallback, loading replicas,
the load time measured from a target rise to the running count reaching it).

On a local Ray cluster (2 CPUs, one for the module): a deployment of simulated engines (each
replica sleeps `LOAD_S` in `__init__`: its load time; it serves `BATCH` requests at a time and
queues the rest, like vLLM's waiting queue; it reports its demand from `record_autoscaling_stats`)
runs with the adapter and a tiny policy of this module. Under load it scales up from 1 replica;
idle, it scales back to 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from redis_server import free_port

from autoscaler.hosts import LoadTimes
from autoscaler.hosts.ray_serve import (
    ARRIVALS,
    BACKLOG_WORK,
    DECODE,
    IN_FLIGHT,
    PREFILL,
    STATE_KEY,
    DemandTotals,
    ServeAutoscaler,
    autoscaling_config,
)
from autoscaler.types import ScaleContext, ScaleDecision, ScaleReason, ScalingPolicy

pytestmark = [
    # the push interval is only configurable through this deprecated field in 2.60
    pytest.mark.filterwarnings("ignore:The `metrics_interval_s` field:DeprecationWarning"),
]

LOAD_S = 2.0  # a replica's load time (its __init__)
SERVICE_S = 0.4  # one request's time on a replica
BATCH = 2  # requests a replica serves at once
WORK_S = SERVICE_S / BATCH  # replica-seconds of one request
APP, DEPLOYMENT = "autoscale", "engine"


HTTP_PORT = free_port()


@dataclass
class TinyPolicy:
    """Enough replicas for the arrived work at 70% plus the backlog drained in `drain_s`."""

    name: str = "tiny"
    utilization: float = 0.7
    drain_s: float = 2.0

    def initial_state(self) -> int:
        return 0

    def decide(self, ctx: ScaleContext, state: int, now: float) -> tuple[ScaleDecision, int]:
        s = ctx.sample
        need = s.rate / self.utilization + s.backlog_work_s / self.drain_s
        target = max(ctx.min_replicas, min(ctx.max_replicas, math.ceil(need - 1e-9)))
        current = ctx.fleet.current
        reason = (
            ScaleReason.FORECAST_UP
            if target > current
            else ScaleReason.SCALE_DOWN
            if target < current
            else ScaleReason.HOLD
        )
        return ScaleDecision(target, reason, (("need", need),)), state + 1


class TinyAutoscaler(ServeAutoscaler):
    def make_policy(self) -> ScalingPolicy[Any]:
        return TinyPolicy()


# -- without a cluster ----------------------------------------------------------------------------
def test_autoscaling_config_is_valid_and_neutralises_ray_hysteresis() -> None:
    from ray.serve.config import AutoscalingConfig

    raw = autoscaling_config("headroom", 1, 4, tick_s=5.0, look_back_period_s=20.0)
    cfg = AutoscalingConfig(**raw)
    assert (cfg.min_replicas, cfg.max_replicas, cfg.look_back_period_s) == (1, 4, 20.0)
    assert cfg.upscale_delay_s == cfg.downscale_delay_s == cfg.downscale_to_zero_delay_s == 0
    assert cfg.get_upscaling_factor() == cfg.get_downscaling_factor() == 1.0
    assert cfg.policy.policy_function == "autoscaler.hosts.ray_serve:ServeAutoscaler"
    assert cfg.policy.policy_kwargs == {"policy": "headroom", "tick_s": 5.0}


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [((1, 0), {}), ((3, 2), {}), ((1, 2), {"tick_s": -1}), ((1, 2), {"no_such_field": 1})],
)
def test_autoscaling_config_refuses(args: tuple[int, int], kwargs: dict[str, Any]) -> None:
    from controlplane.errors import ConfigError

    with pytest.raises(ConfigError):
        autoscaling_config("headroom", *args, **kwargs)


@dataclass(frozen=True)
class Point:
    value: float
    timestamp: float = 0.0


def context(
    state: dict[str, Any],
    now: float,
    *,
    target: int = 1,
    running: int = 1,
    raw: dict[str, dict[Any, list[Point]]] | None = None,
    total: float = 0.0,
    queued: float = 0.0,
) -> Any:
    return SimpleNamespace(
        deployment_name="engine", current_time=now, target_num_replicas=target,
        current_num_replicas=running, policy_state=state, raw_metrics=raw or {},
        total_num_requests=total, total_queued_requests=queued,
        capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=8,
    )  # fmt: skip


def reported(**replicas: dict[str, float]) -> dict[str, dict[Any, list[Point]]]:
    names = {name for stats in replicas.values() for name in stats}
    return {n: {rid: [Point(s[n])] for rid, s in replicas.items() if n in s} for n in names}


class Recorder(TinyAutoscaler):
    """Keeps the contexts the policy saw."""

    def make_policy(self) -> ScalingPolicy[Any]:
        seen = self.seen = list[ScaleContext]()

        class Spy(TinyPolicy):
            def decide(self, ctx: ScaleContext, state: int, now: float) -> Any:
                seen.append(ctx)
                return super().decide(ctx, state, now)

        return Spy()


def test_adapter_metrics_demand_deltas_restart_and_tick() -> None:
    a = Recorder(tick_s=1.0, load_time_s=30.0, demand="metrics")
    counters = {ARRIVALS: 10.0, PREFILL: 1.0, DECODE: 3.0, BACKLOG_WORK: 0.0, IN_FLIGHT: 2.0}
    r3 = {ARRIVALS: 50.0, PREFILL: 5.0, DECODE: 5.0}
    target, state = a(context({}, 100.0, raw=reported(r1=counters, r3=r3)))
    assert target == 1 and a.seen == []  # the first decision only sets baselines
    # between ticks: the last target, no decision
    target, state = a(context(state, 100.5, raw=reported(r1=counters, r3=r3)))
    assert (target, a.seen) == (1, [])
    # r1 +10 arrivals and 4 s of work; r2 new (whole count), r3 restarted (its new count)
    later = {**counters, ARRIVALS: 20.0, PREFILL: 2.0, DECODE: 6.0, BACKLOG_WORK: 3.0}
    r2 = {ARRIVALS: 2.0, PREFILL: 0.5, DECODE: 0.5, IN_FLIGHT: 1.0}
    r3_restarted = {ARRIVALS: 5.0, PREFILL: 0.5, DECODE: 0.5}
    target, state = a(context(state, 102.0, raw=reported(r1=later, r2=r2, r3=r3_restarted)))
    (ctx,) = a.seen
    s = ctx.sample
    assert (s.interval_s, s.arrivals, s.in_flight) == (2.0, 17, 3)
    assert (s.prefill_work_s, s.decode_work_s, s.backlog_work_s) == (2.0, 4.0, 3.0)
    assert target == math.ceil(6.0 / 2.0 / 0.7 + 3.0 / 2.0)
    assert state[STATE_KEY].target == target


def test_adapter_counts_loading_and_measures_load_time() -> None:
    a = Recorder(tick_s=1.0, load_time_s=30.0, demand="ongoing", request_latency_s=1.0,
                 prefill_work_per_request_s=0.0, decode_work_per_request_s=1.0)  # fmt: skip
    # 3 running requests, 2 queued: 3 replicas of work + 2 s of backlog over 2 s -> 6 (capped 8)
    target, state = a(context({}, 0.0, total=5.0, queued=2.0))
    ctx = a.seen[-1]
    assert (ctx.sample.backlog_requests, ctx.sample.in_flight, ctx.load_time_s) == (2, 5, 30.0)
    assert target == math.ceil(3.0 / 0.7 + 2.0 / 2.0)
    # Ray ordered the target; one replica runs: the rest are loading, with an ETA each
    _, state = a(context(state, 1.0, target=target, running=1, total=5.0, queued=2.0))
    ctx = a.seen[-1]
    assert (ctx.fleet.ready, ctx.fleet.loading) == (1, target - 1)
    assert len(ctx.fleet.loading_eta_s) == target - 1
    # all running 4 s after the order: the load time is measured
    _, state = a(context(state, 4.0, target=target, running=target, total=5.0, queued=2.0))
    assert a.seen[-1].load_time_s == 4.0
    assert isinstance(state[STATE_KEY].load_times, LoadTimes)


# -- on a local Ray cluster -----------------------------------------------------------------------
class Engine:
    """A simulated engine: loads for LOAD_S, serves BATCH requests at once, queues the rest."""

    def __init__(self) -> None:
        time.sleep(LOAD_S)
        self.totals = DemandTotals()
        self.waiting = 0
        self.running = 0
        self.slots: asyncio.Semaphore | None = None

    async def __call__(self, request: Any) -> int:
        # called over Serve's HTTP proxy (no driver-side handle outlives the module's Ray session)
        i = int(request.query_params.get("k", "0")) if hasattr(request, "query_params") else request
        self.slots = self.slots or asyncio.Semaphore(BATCH)
        self.totals.arrived(0.25 * WORK_S, 0.75 * WORK_S)
        self.waiting += 1
        async with self.slots:
            self.waiting -= 1
            self.running += 1
            try:
                await asyncio.sleep(SERVICE_S)
            finally:
                self.running -= 1
        return i

    async def record_autoscaling_stats(self) -> dict[str, float]:
        self.totals.set_load(
            backlog_requests=self.waiting,
            backlog_work_s=self.waiting * WORK_S,
            in_flight=self.waiting + self.running,
        )
        return self.totals.stats()


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    import ray
    from ray import cloudpickle, serve

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": HTTP_PORT})
        # this module is not importable in Ray's workers: its classes travel by value
        cloudpickle.register_pickle_by_value(sys.modules[__name__])  # type: ignore[no-untyped-call]
        yield
    finally:
        # Ray's policy serialization may have unregistered it already
        with contextlib.suppress(ValueError):
            cloudpickle.unregister_pickle_by_value(sys.modules[__name__])  # type: ignore[no-untyped-call]
        serve.shutdown()  # type: ignore[no-untyped-call]
        ray.shutdown()


def running_replicas() -> int:
    from ray import serve

    status = serve.status().applications[APP].deployments[DEPLOYMENT]
    return sum(n for state, n in status.replica_states.items() if str(state) == "RUNNING")


def wait_until(predicate: Any, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


@pytest.mark.timeout(240)
def test_deployment_scales_up_under_load_and_back_down_idle(cluster: None) -> None:
    from ray import serve

    config = autoscaling_config(
        "tiny", 1, 3, adapter=TinyAutoscaler, tick_s=0.5, load_time_s=LOAD_S, demand="metrics",
        look_back_period_s=2.0, metrics_interval_s=0.5, initial_replicas=1,
    )  # fmt: skip
    deployment = serve.deployment(
        name=DEPLOYMENT,
        max_ongoing_requests=100,
        ray_actor_options={"num_cpus": 0.1},
        autoscaling_config=config,
    )(Engine)
    # the policy was serialized with this module (Ray registers it by value and unregisters it)
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # type: ignore[no-untyped-call]
    serve.run(deployment.bind(), name=APP, route_prefix="/tiny")
    assert running_replicas() == 1

    stop = threading.Event()
    url = f"http://127.0.0.1:{HTTP_PORT}/tiny"

    def client(k: int) -> int:
        served = 0
        with httpx.Client(timeout=60.0) as http:
            while not stop.is_set():
                r = http.get(url, params={"k": k})
                assert r.status_code == 200 and r.json() == k
                served += 1
        return served

    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(client, k) for k in range(16)]
        try:
            wait_until(lambda: running_replicas() >= 2, "no scale-up under load")
        finally:
            stop.set()
        assert sum(f.result() for f in futures) > 0
    wait_until(lambda: running_replicas() == 1, "no scale-down when idle")
    serve.delete(APP)
