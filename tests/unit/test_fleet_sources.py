"""Membership sources (router/fleet/sources.py, discovery/dns.py) reporting into an in-process
registry: DNS answers become checked members, a failed poll keeps the last view, the static
configuration is a source like any other."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import pytest

from router.config import load_settings
from router.fleet.discovery.dns import dns_source, member_of, resolve_members
from router.fleet.lifecycle import Lifecycle
from router.fleet.registry import FleetRegistry
from router.fleet.registry_memory import MemoryBackend
from router.fleet.sources import member_of as config_member
from router.fleet.sources import membership_sources, static_source
from router.fleet.urls import ReplicaGuard


class FakeDns:
    def __init__(self, answers: dict[str, list[str]]) -> None:
        self.answers = answers
        self.calls = 0

    def __call__(self, name: str) -> Iterable[str]:
        self.calls += 1
        if name not in self.answers:
            raise OSError(f"NXDOMAIN {name}")
        return self.answers[name]


def registry() -> FleetRegistry:
    return FleetRegistry(MemoryBackend(), ReplicaGuard(), drain_s=60.0, ttl_s=10.0)


@pytest.mark.parametrize(
    ("address", "rid", "url"),
    [
        ("10.0.3.7", "dns-10-0-3-7", "http://10.0.3.7:8000"),
        ("fd00::7", "dns-fd00--7", "http://[fd00::7]:8000"),
        ("fe80::1%eth0", "dns-fe80--1", "http://[fe80::1]:8000"),
    ],
)
def test_member_of_an_address(address: str, rid: str, url: str) -> None:
    m = member_of(address, 8000, "http", model=None, gpu="l4")
    assert (m.replica_id, m.url, m.gpu) == (rid, url, "l4")


def test_resolve_members_skips_non_addresses() -> None:
    dns = FakeDns({"vllm": ["10.0.0.2", "10.0.0.1", "10.0.0.1", "not-an-ip"]})
    ids = [m.replica_id for m in resolve_members("vllm", 80, "https", dns)]
    assert ids == ["dns-10-0-0-1", "dns-10-0-0-2"]


async def test_dns_source_reports_checked_members_and_keeps_its_view_on_failure() -> None:
    reg = registry()
    dns = FakeDns({"vllm": ["10.0.0.1", "169.254.169.254", "8.8.8.8"]})
    src = dns_source(reg, name="vllm", port=8000, scheme="http", interval_s=60.0, resolve=dns)
    assert await src.report_once()
    snap = await reg.load()
    assert set(snap.records) == {"dns-10-0-0-1"}  # link-local and public addresses refused
    assert reg.metrics.refused.labels("dns", "url")._value.get() == 2
    dns.answers.clear()  # the name stops resolving: a DNS outage, not an empty fleet
    assert not await src.report_once()
    assert src.failures == 1 and "NXDOMAIN" in (src.last_error or "")
    assert (await reg.load()).records["dns-10-0-0-1"].state is Lifecycle.LOADING
    dns.answers["vllm"] = ["10.0.0.2"]  # scaled: one address left, one came
    assert await src.report_once()
    records = (await reg.load()).records
    assert records["dns-10-0-0-1"].state is Lifecycle.DRAINING
    assert records["dns-10-0-0-2"].state is Lifecycle.LOADING


async def test_source_loop_runs_and_closes() -> None:
    reg = registry()
    dns = FakeDns({"vllm": ["10.0.0.1"]})
    src = dns_source(reg, name="vllm", port=8000, scheme="http", interval_s=0.01, resolve=dns)
    src.start()
    for _ in range(500):
        if dns.calls >= 2:
            break
        await asyncio.sleep(0.01)
    await src.aclose()
    assert dns.calls >= 2 and src._task is None


async def test_static_configuration_is_a_source() -> None:
    settings = load_settings(
        replicas=[{"id": "a", "url": "http://10.0.0.1:8000", "tp": 2, "gpu": "a100"}],
        fleet={"dns_name": "vllm.svc"},
    )
    reg = registry()
    static = static_source(settings, reg)
    assert static is not None and await static.report_once()
    rec = (await reg.load()).records["a"]
    assert rec.sources == ("static",) and rec.options["tp"] == 2 and rec.gpu == "a100"
    assert config_member(settings.replicas[0]).options["kv_topic"] == ""
    names = [getattr(s, "name", None) for s in membership_sources(settings, reg)]
    assert names == ["dns"]
    assert static_source(load_settings(), reg) is None  # no configured replica: no view


def test_shared_fleet_needs_redis_and_ttl_exceeds_resync() -> None:
    from controlplane.errors import ConfigError

    with pytest.raises(ConfigError, match=r"fleet\.shared needs redis\.url"):
        load_settings(fleet={"shared": True})
    with pytest.raises(ConfigError, match="heartbeat_ttl_s must exceed"):
        load_settings(fleet={"resync_s": 5, "heartbeat_ttl_s": 5})


async def test_kubernetes_discovery_plugs_in_from_the_settings() -> None:
    from prometheus_client import CollectorRegistry

    from router.fleet.discovery.kubernetes import KubernetesDiscovery

    k8s = {"label_selector": "app=vllm", "namespace": "serving", "api_url": "http://127.0.0.1:9"}
    settings = load_settings(fleet={"kubernetes": k8s})
    metrics = CollectorRegistry()
    sources = membership_sources(settings, registry(), metrics=metrics)
    try:
        assert len(sources) == 1 and isinstance(sources[0], KubernetesDiscovery)
        assert sources[0].cfg.label_selector == "app=vllm"
        # its metrics are exported with the router's
        assert "cp_discovery_kubernetes_events" in {m.name for m in metrics.collect()}
    finally:
        for s in sources:
            await s.aclose()
