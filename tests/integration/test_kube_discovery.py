"""Kubernetes discovery against the fake API server (real HTTP, list + watch).

Each test changes the fake cluster and waits (bounded) for the sink's last report to be the
expected view: pods appear, go unready, terminate and leave; a 410 (as an ERROR event and as an
HTTP status) relists; the API going down and coming back with changes it made meanwhile (and its
history compacted) converges to the right view. Teardown checks no task and no watch is left.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import pytest
from fake_kube import NS, FakeKube

from controlplane.errors import ReplicaRefusedError
from router.fleet.discovery.kubernetes import (
    KubernetesDiscovery,
    KubernetesDiscoveryConfig,
    RelistReason,
)
from router.fleet.membership import Member

WAIT_S = 15.0  # a failure bound, not a threshold
APP = {"app": "vllm"}


class Sink:
    """A MembershipSink that keeps every report."""

    def __init__(self) -> None:
        self.refused = False
        self.reports: list[tuple[Member, ...]] = []
        self.changed = asyncio.Condition()

    async def set_members(self, source: str, members: Sequence[Member]) -> None:
        assert source == "kubernetes"
        async with self.changed:
            self.reports.append(tuple(members))
            self.changed.notify_all()

    def view(self) -> dict[str, tuple[str, bool]] | None:
        if not self.reports:
            return None
        return {m.replica_id: (m.url, m.ready) for m in self.reports[-1]}

    async def until(self, expected: dict[str, tuple[str, bool]]) -> None:
        async def wait() -> None:
            async with self.changed:
                await self.changed.wait_for(lambda: self.view() == expected)

        try:
            await asyncio.wait_for(wait(), WAIT_S)
        except TimeoutError:
            raise AssertionError(f"view {self.view()} never became {expected}") from None


@dataclass
class Rig:
    kube: FakeKube
    sink: Sink
    discovery: KubernetesDiscovery

    def watches(self) -> list[dict[str, str]]:
        return [r.query for r in self.kube.requests if r.query.get("watch") == "true"]

    def lists(self) -> int:
        return sum(1 for r in self.kube.requests if r.method == "GET" and "watch" not in r.query)


async def eventually(check: Callable[[], bool]) -> None:
    async def wait() -> None:
        while not check():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(wait(), WAIT_S)


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    before = asyncio.all_tasks()
    kube = FakeKube()
    await kube.start()
    kube.add_pod("vllm-a", ip="10.0.0.1", labels=APP)
    kube.add_pod("vllm-b", ip=None, labels=APP)  # scheduled, no IP yet
    kube.add_pod("other", ip="10.0.0.9", labels={"app": "redis"})
    cfg = KubernetesDiscoveryConfig(
        api_url=kube.url, namespace=NS, label_selector="app=vllm", retries=0,
        backoff_s=0.01, backoff_max_s=0.1, watch_timeout_s=60,
    )  # fmt: skip
    sink = Sink()
    discovery = KubernetesDiscovery(cfg, sink)
    discovery.start()
    try:
        yield Rig(kube, sink, discovery)
    finally:
        await discovery.aclose()
        await eventually(lambda: kube.open_watches == 0)
        await kube.stop()
        assert asyncio.all_tasks() - before - {asyncio.current_task()} == set()


async def test_pods_join_go_unready_and_leave(rig: Rig) -> None:
    kube, sink = rig.kube, rig.sink
    await sink.until({"vllm-a": ("http://10.0.0.1:8000", True)})
    kube.modify_pod("vllm-b", podIP="10.0.0.2")  # the IP arrives: a member, not ready yet
    kube.set_ready("vllm-b", False)
    await sink.until({"vllm-a": ("http://10.0.0.1:8000", True),
                      "vllm-b": ("http://10.0.0.2:8000", False)})  # fmt: skip
    kube.set_ready("vllm-b", True)
    kube.set_ready("vllm-a", False)
    await sink.until({"vllm-a": ("http://10.0.0.1:8000", False),
                      "vllm-b": ("http://10.0.0.2:8000", True)})  # fmt: skip
    kube.set_ready("vllm-a", True)
    kube.terminate_pod("vllm-a")  # Ready still True, but on its way out
    await sink.until({"vllm-a": ("http://10.0.0.1:8000", False),
                      "vllm-b": ("http://10.0.0.2:8000", True)})  # fmt: skip
    kube.delete_pod("vllm-a")
    kube.add_pod("vllm-c", ip="fd00::3", labels=APP, port=9000)
    await sink.until({"vllm-b": ("http://10.0.0.2:8000", True),
                      "vllm-c": ("http://[fd00::3]:9000", True)})  # fmt: skip
    # the watch asked for bookmarks, by label, from the listed version
    first = rig.watches()[0]
    assert first["allowWatchBookmarks"] == "true" and first["labelSelector"] == "app=vllm"
    assert first["resourceVersion"] == "103" and first["timeoutSeconds"] == "60"
    assert rig.lists() == 1
    # a pod of another app never shows up; no report repeats the one before it
    assert all(m.replica_id != "other" for r in sink.reports for m in r)
    assert all(a != b for a, b in zip(sink.reports, sink.reports[1:], strict=False))


async def test_bookmark_moves_the_version(rig: Rig) -> None:
    await rig.sink.until({"vllm-a": ("http://10.0.0.1:8000", True)})
    await eventually(lambda: rig.kube.open_watches == 1)
    rig.kube.rv += 50  # other objects changed in the namespace
    rig.kube.bookmark()
    await eventually(lambda: rig.discovery.rv == "153")
    rig.kube.set_ready("vllm-a", False)  # the next event still arrives on the same watch
    await rig.sink.until({"vllm-a": ("http://10.0.0.1:8000", False)})
    assert len(rig.sink.reports) == 2 and len(rig.watches()) == 1  # the bookmark reported nothing
    assert rig.discovery.events.labels("BOOKMARK")._value.get() == 1


@pytest.mark.parametrize("how", ["error_event", "http_410"])
async def test_gone_relists_and_stays_correct(rig: Rig, how: str) -> None:
    kube, sink, discovery = rig.kube, rig.sink, rig.discovery
    await sink.until({"vllm-a": ("http://10.0.0.1:8000", True)})
    await eventually(lambda: kube.open_watches == 1)
    if how == "error_event":
        kube.delete_pod("vllm-a")  # seen by the open watch
        kube.add_pod("vllm-d", ip="10.0.0.4", labels=APP)
        kube.expire()  # then the watch is told its version is gone
    else:
        await kube.stop()  # the watch ends; the next one is answered by an HTTP 410
        kube.delete_pod("vllm-a")
        kube.add_pod("vllm-d", ip="10.0.0.4", labels=APP)
        kube.fail_next = [410]
        await kube.start()
    await eventually(lambda: discovery.relists.labels(RelistReason.GONE)._value.get() == 1)
    await eventually(lambda: rig.lists() == 2)
    await sink.until({"vllm-d": ("http://10.0.0.4:8000", True)})
    # watching goes on from the relisted version
    kube.set_ready("vllm-d", False)
    await sink.until({"vllm-d": ("http://10.0.0.4:8000", False)})


async def test_api_down_then_back_with_history_compacted(rig: Rig) -> None:
    kube, sink, discovery = rig.kube, rig.sink, rig.discovery
    await sink.until({"vllm-a": ("http://10.0.0.1:8000", True)})
    await eventually(lambda: kube.open_watches == 1)
    await kube.stop()
    # while the API is away: the last view stands, the discovery keeps retrying
    await eventually(lambda: discovery.errors.labels("watch")._value.get() >= 2)
    assert sink.view() == {"vllm-a": ("http://10.0.0.1:8000", True)}
    kube.delete_pod("vllm-a")
    kube.add_pod("vllm-e", ip="10.0.0.5", labels=APP, ready=False)
    kube.expire()  # and etcd compacted what happened meanwhile
    await kube.start()
    await sink.until({"vllm-e": ("http://10.0.0.5:8000", False)})
    assert discovery.relists.labels(RelistReason.GONE)._value.get() == 1
    kube.set_ready("vllm-e", True)
    await sink.until({"vllm-e": ("http://10.0.0.5:8000", True)})


async def test_api_down_then_back_rewatches_without_relisting(rig: Rig) -> None:
    kube, sink = rig.kube, rig.sink
    await sink.until({"vllm-a": ("http://10.0.0.1:8000", True)})
    await eventually(lambda: kube.open_watches == 1)
    await kube.stop()
    kube.set_ready("vllm-a", False)  # kept in the history: a rewatch sees it
    await kube.start()
    await sink.until({"vllm-a": ("http://10.0.0.1:8000", False)})
    assert rig.lists() == 1
    assert rig.watches()[-1]["resourceVersion"] == "103"


async def test_a_refused_report_is_offered_again() -> None:
    kube = FakeKube()
    await kube.start()
    kube.add_pod("vllm-a", ip="10.0.0.1", labels=APP)

    class RefusesOnce(Sink):
        async def set_members(self, source: str, members: Sequence[Member]) -> None:
            if not self.refused:
                self.refused = True
                raise ReplicaRefusedError("not today", param="url")
            await super().set_members(source, members)

    sink = RefusesOnce()
    cfg = KubernetesDiscoveryConfig(api_url=kube.url, namespace=NS, label_selector="app=vllm")
    discovery = KubernetesDiscovery(cfg, sink)
    discovery.start()
    try:
        await eventually(lambda: discovery.errors.labels("report")._value.get() == 1)
        assert sink.reports == []
        kube.add_pod("vllm-b", ip="10.0.0.2", labels=APP)  # the next event carries the whole view
        await sink.until({"vllm-a": ("http://10.0.0.1:8000", True),
                          "vllm-b": ("http://10.0.0.2:8000", True)})  # fmt: skip
    finally:
        await discovery.aclose()
        await kube.stop()
