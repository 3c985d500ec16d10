"""Helpers for live-router tests: sim replicas behind a `RouterServer`, metric readers, waits.

    with SimReplica(*sim_args(model_dir)) as a:
        settings = router_settings(model_dir, [replica_entry("a", a)], timeouts={"ttft_s": 1.0})
        with RouterServer(settings) as router:
            router.wait_ready(1)
            ...
            assert_router_idle(router)

`metric_value` sums the samples of one metric in a Prometheus text body whose labels include the
given ones (a counter's `_total` suffix is part of the name given). `router_tasks` lists the
router loop's asyncio tasks other than the fleet's short-lived probe/scrape children.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from router_harness import RouterServer
from sim_fleet import SimReplica

from router.config import RouterSettings, load_settings

MODEL = "tiny-llama"

# tasks the fleet schedule spawns and ends on its own (a probe or scrape in flight)
_TRANSIENT = frozenset({"_guarded"})


def sim_args(model_dir: Path, *, speed: float = 5.0, kv_events: bool = False) -> list[str]:
    """Arguments of a sim replica serving the tiny model (with KV events on free ports)."""
    args = ["--model-dir", str(model_dir), "--speed", str(speed)]
    if kv_events:
        # a wildcard makes the replica's PUB bind (a host:port would make it connect, vLLM's rule,
        # to a SUB that nobody binds); `replica_entry` reads the ports back
        args += ["--kv-events-endpoint", "tcp://*:0", "--kv-events-replay-endpoint", "tcp://*:0"]
    return args


def replica_entry(replica_id: str, sim: SimReplica, *, kv_events: bool = False) -> dict[str, Any]:
    """The router's `ReplicaConfig` of a sim replica (as a dict for `load_settings`)."""
    entry: dict[str, Any] = {"id": replica_id, "url": sim.url, "gpu": "cpu", "model": MODEL}
    if kv_events:
        pub, replay = sim.kv_endpoints()
        entry |= {"kv_events": pub, "kv_replay": replay}
    return entry


def router_settings(
    model_dir: Path, replicas: list[dict[str, Any]], **overrides: Any
) -> RouterSettings:
    """Settings for a test router: the tiny model's tokenizer, these replicas, the overrides."""
    return load_settings(
        replicas=replicas, tokenizer=str(model_dir), served_model=MODEL, **overrides
    )


# -- metrics ---------------------------------------------------------------------------------------
def metric_value(text: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels` (0.0 when there is none)."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def scrape(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=5.0).text


def router_metric(router: RouterServer, name: str, **labels: str) -> float:
    return metric_value(scrape(router.url), name, **labels)


def finished_requests(sim: SimReplica, reason: str | None = None) -> float:
    """Requests the replica's engine finished (`vllm:request_success_total`; every finish
    reason, aborts included, unless `reason` is given)."""
    labels = {} if reason is None else {"finished_reason": reason}
    return metric_value(scrape(sim.url), "vllm:request_success_total", **labels)


def running_requests(sim: SimReplica) -> float:
    return metric_value(scrape(sim.url), "vllm:num_requests_running")


# -- waits and leak checks -------------------------------------------------------------------------
def wait_until(
    predicate: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.02
) -> None:
    """Poll `predicate` until true; AssertionError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for: {what}")
        time.sleep(interval_s)


def router_tasks(router: RouterServer) -> Counter[str]:
    """The router loop's tasks by coroutine name, without probe/scrape children."""

    def names() -> Counter[str]:
        me = asyncio.current_task()
        out: Counter[str] = Counter()
        for task in asyncio.all_tasks():
            if task is me or task.done():
                continue
            coro = task.get_coro()
            name = getattr(coro, "__qualname__", type(coro).__name__)
            if name not in _TRANSIENT:
                out[name] += 1
        return out

    tasks: Counter[str] = router.call(names)
    return tasks


def ledger_size(router: RouterServer) -> int:
    size: int = router.call(lambda: len(router.runtime.ledger))
    return size


def assert_router_idle(router: RouterServer, timeout_s: float = 5.0) -> None:
    """No request of the router is in flight: empty ledger, zero in-flight gauges."""
    wait_until(lambda: ledger_size(router) == 0, timeout_s, "the router's ledger to empty")
    text = scrape(router.url)
    assert metric_value(text, "cp_inflight_requests") == 0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "cp_outstanding_requests":
                assert sample.value == 0, f"outstanding requests left: {sample}"


def replica_status(router: RouterServer) -> dict[str, dict[str, Any]]:
    """`runtime.fleet.status()` rows by replica id (read on the router's loop)."""
    rows: list[dict[str, Any]] = router.call(router.runtime.fleet.status)
    return {str(row["id"]): row for row in rows}
