"""The router drainer over a fake transport: table-driven over the routers' admin API answers.

Each fake router answers GET /admin/replicas and POST /admin/replicas/{id}/drain from a script
(a JSON body, an HTTP error in the router's OpenAI error shape, or a transport error); every
request is recorded with its Authorization header. Time is a fake clock moved by the fake sleep.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from autoscaler.hosts.kubernetes import HostSettings, build
from autoscaler.hosts.router_drainer import RouterDrainer
from autoscaler.victims import NoDrainer, VictimInfo
from controlplane.errors import ConfigError, RouterAdminError

KEY = "the-admin-key"
A, B = "http://router-a:8000", "http://router-b:8000"

Answer = dict[str, Any] | tuple[int, dict[str, Any]] | Exception


def err(status: int, code: str, message: str = "no") -> tuple[int, dict[str, Any]]:
    return status, {"error": {"message": message, "type": "x", "param": None, "code": code}}


DOWN = httpx.ConnectError("connection refused")
UNAUTHORIZED = err(401, "AuthError", "a valid admin key is required")
ADMIN_OFF = err(404, "NotFoundError", "the admin API is disabled")
UNKNOWN = err(404, "UnknownReplicaError", "unknown replica")
REGISTRY_DOWN = err(503, "registry_unavailable", "the fleet registry is unreachable")


def fleet(*rows: tuple[str, str, int]) -> list[dict[str, Any]]:
    return [{"id": i, "url": f"http://{i}", "state": s, "in_flight": n} for i, s, n in rows]


def own(rid: str, in_flight: int, kv: float | None = None, at: float = 1.0) -> dict[str, Any]:
    return {"id": rid, "in_flight": in_flight, "kv_usage": kv, "num_gpu_blocks": 1000,
            "scraped_at_s": at}  # fmt: skip


def listing(
    rows: list[dict[str, Any]], replicas: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    return {"replicas": replicas or [], "fleet": rows, "at": 0.0}


@dataclass
class FakeRouters:
    """Scripted admin APIs: per (router, 'list' | 'drain'), answers consumed in order (the last
    one repeats)."""

    script: dict[tuple[str, str], list[Answer]]
    seen: list[tuple[str, str, str]] = field(default_factory=list)  # (method, url, auth)

    def handler(self, request: httpx.Request) -> httpx.Response:
        url = str(request.url)
        self.seen.append((request.method, url, request.headers.get("authorization", "")))
        router = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        kind = "drain" if request.method == "POST" else "list"
        answers = self.script.get((router, kind)) or [err(500, "unscripted")]
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        if isinstance(answer, Exception):
            raise answer
        if isinstance(answer, tuple):
            return httpx.Response(answer[0], json=answer[1])
        return httpx.Response(200, json=answer)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.t

    async def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.t += s


@pytest.fixture
async def rig() -> AsyncIterator[Callable[..., tuple[RouterDrainer, FakeRouters, Clock]]]:
    clients: list[httpx.AsyncClient] = []

    def make(
        script: dict[tuple[str, str], list[Answer]], routers: tuple[str, ...] = (A, B)
    ) -> tuple[RouterDrainer, FakeRouters, Clock]:
        fake, clock = FakeRouters(script), Clock()
        client = httpx.AsyncClient(transport=httpx.MockTransport(fake.handler))
        clients.append(client)
        drainer = RouterDrainer(
            routers, KEY, poll_s=1.0, client=client, clock=clock, sleep=clock.sleep
        )
        return drainer, fake, clock

    yield make
    for c in clients:
        assert not c.is_closed  # the drainer leaves a client it was given to its owner
        await c.aclose()


VICTIM_INFO_CASES = {
    "one router: known states kept, leaving ones and unknown ids left out": (
        {(A, "list"): [listing(
            fleet(("p0", "ready", 3), ("p1", "loading", 0), ("p2", "ejected", 1),
                  ("p3", "draining", 0), ("p4", "gone", 0)),
            [own("p0", 3, 0.5), own("p1", 0, None), own("p2", 1, 0.1234)],
        )]},
        ["p0", "p1", "p2", "p3", "p4", "p9"],
        {"p0": (3, 500), "p1": (0, 0), "p2": (1, 123)},
    ),
    "two routers: own ledgers summed, the heartbeat row when larger, the freshest scrape": (
        {
            (A, "list"): [listing(fleet(("p0", "ready", 1), ("p1", "ready", 5)),
                                  [own("p0", 2, 0.2, at=5.0), own("p1", 1, 0.9, at=1.0)])],
            (B, "list"): [listing(fleet(("p0", "ready", 1), ("p1", "ready", 5)),
                                  [own("p0", 3, 0.4, at=9.0), own("p1", 0, 0.1, at=7.0)])],
        },
        ["p0", "p1"],
        {"p0": (5, 400), "p1": (5, 100)},
    ),
    "one router down: the other's view": (
        {(A, "list"): [DOWN],
         (B, "list"): [listing(fleet(("p0", "ready", 2)), [own("p0", 2, 0.01)])]},
        ["p0"],
        {"p0": (2, 10)},
    ),
    "a router without the registry view: its own ledger still counts": (
        {(A, "list"): [{"replicas": [own("p0", 7, 0.9, at=1.0)], "fleet_error": "unreachable"}],
         (B, "list"): [listing(fleet(("p0", "ready", 0)), [own("p0", 0, 0.0, at=2.0)])]},
        ["p0"],
        {"p0": (7, 0)},
    ),
}  # fmt: skip


@pytest.mark.parametrize("script, ids, want", VICTIM_INFO_CASES.values(), ids=VICTIM_INFO_CASES)
async def test_victim_info(rig: Any, script: Any, ids: list[str], want: dict[str, Any]) -> None:
    drainer, fake, _ = rig(script)
    got = await drainer.victim_info(ids)
    assert got == {i: VictimInfo(i, *v) for i, v in want.items()}
    assert {auth for *_, auth in fake.seen} == {f"Bearer {KEY}"}
    assert [(m, u.split("/admin")[0]) for m, u, _ in fake.seen] == [("GET", A), ("GET", B)]


NO_ANSWER_CASES = {
    "both down": ([DOWN], [DOWN], "ConnectError"),
    "wrong admin key": ([UNAUTHORIZED], [UNAUTHORIZED], "HTTP 401: a valid admin key"),
    "admin API disabled": ([ADMIN_OFF], [ADMIN_OFF], "HTTP 404: the admin API is disabled"),
    "registry down, no view": ([{"replicas": [], "fleet_error": "unreachable"}], [DOWN],
                               "no fleet registry view (unreachable)"),
    "not JSON": ([(200, [1, 2])], [REGISTRY_DOWN], "HTTP 503"),
}  # fmt: skip


@pytest.mark.parametrize("a, b, says", NO_ANSWER_CASES.values(), ids=NO_ANSWER_CASES)
async def test_victim_info_with_no_router_answering_raises(
    rig: Any, a: list[Answer], b: list[Answer], says: str
) -> None:
    drainer, _, _ = rig({(A, "list"): a, (B, "list"): b})
    with pytest.raises(RouterAdminError, match="no router's admin API answered") as info:
        await drainer.victim_info(["p0"])
    assert len(info.value.failures) == 2
    assert info.value.failures[0].startswith(A) and info.value.failures[1].startswith(B)
    assert says in str(info.value)


DRAIN_CASES = {
    "the first router drains it fleet-wide": ([(200, {"draining": "p0"})], [], [A]),
    "a failing router: the next one": ([REGISTRY_DOWN], [(200, {"draining": "p0"})], [A, B]),
    "a transport error: the next one": ([DOWN], [(200, {"draining": "p0"})], [A, B]),
    "unknown or gone already: nothing to drain": ([UNKNOWN], [], [A]),
}  # fmt: skip


@pytest.mark.parametrize("a, b, asked", DRAIN_CASES.values(), ids=DRAIN_CASES)
async def test_drain(rig: Any, a: list[Answer], b: list[Answer], asked: list[str]) -> None:
    drainer, fake, _ = rig({(A, "drain"): a, (B, "drain"): b})
    await drainer.drain(["p0"])
    assert [(m, u) for m, u, _ in fake.seen] == [
        ("POST", f"{r}/admin/replicas/p0/drain") for r in asked
    ]


async def test_drain_of_several_ids_quotes_them_and_fails_clearly(rig: Any) -> None:
    drainer, fake, _ = rig({(A, "drain"): [(200, {}), ADMIN_OFF], (B, "drain"): [UNAUTHORIZED]})
    with pytest.raises(RouterAdminError, match="could not drain replica 'p/1'") as info:
        await drainer.drain(["p0", "p/1"])
    assert [u for _, u, _ in fake.seen] == [
        f"{A}/admin/replicas/p0/drain",
        f"{A}/admin/replicas/p%2F1/drain",
        f"{B}/admin/replicas/p%2F1/drain",
    ]
    assert "HTTP 404: the admin API is disabled" in info.value.failures[0]
    assert "HTTP 401" in info.value.failures[1]


def polls(*states: dict[str, str] | Exception) -> list[Answer]:
    return [
        s if isinstance(s, Exception) else listing(fleet(*((i, st, 0) for i, st in s.items())))
        for s in states
    ]


WAIT_CASES = {
    "draining, then gone": (
        polls({"p0": "draining"}, {"p0": "draining"}, {"p0": "gone"}), 10.0, True, 2),
    "absent counts as gone": (polls({"p0": "draining", "p1": "gone"}, {}), 10.0, True, 1),
    "one victim still draining at the deadline": (
        polls({"p0": "gone", "p1": "draining"}), 3.0, False, 3),
    "a router that stops answering, then the answer": (
        [DOWN, DOWN, listing(fleet(("p0", "gone", 0)))], 10.0, True, 2),
    "no answer for the whole wait": ([DOWN], 2.5, False, 3),
    "no time at all, already gone": (polls({"p1": "gone"}), 0.0, True, 0),
}  # fmt: skip


@pytest.mark.parametrize("answers, timeout, drained, sleeps", WAIT_CASES.values(), ids=WAIT_CASES)
async def test_wait_drained(
    rig: Any, answers: list[Answer], timeout: float, drained: bool, sleeps: int
) -> None:
    drainer, fake, clock = rig({(A, "list"): answers}, routers=(A,))
    assert await drainer.wait_drained(["p0", "p1"], timeout) is drained
    assert len(clock.sleeps) == sleeps
    assert clock.t <= timeout  # never slept past the deadline
    assert all(m == "GET" for m, _, _ in fake.seen)


def test_admin_key_comes_from_the_named_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CP_AUTOSCALER_ADMIN_KEY_ENV", "ROUTER_ADMIN")
    monkeypatch.setenv("ROUTER_ADMIN", KEY)
    assert HostSettings(routers=[A]).admin_key() == KEY
    monkeypatch.delenv("ROUTER_ADMIN")
    with pytest.raises(ConfigError, match="'ROUTER_ADMIN': unset or empty"):
        HostSettings(routers=[A]).admin_key()
    monkeypatch.delenv("CP_AUTOSCALER_ADMIN_KEY_ENV")
    assert HostSettings(routers=[A]).admin_key() is None


@pytest.mark.parametrize("with_key", [True, False])
async def test_build_drains_through_the_routers_when_a_key_is_configured(
    with_key: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    if with_key:
        monkeypatch.setenv("ROUTER_ADMIN", KEY)
    settings = HostSettings(
        routers=[A, B], mode="kubernetes", deployment="vllm", namespace="llm",
        api_url="http://kube:6443", admin_key_env="ROUTER_ADMIN" if with_key else "",
        drain_poll_s=0.25,
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="controlplane.autoscaler.kubernetes"):
        _, actuator, scrape = build(settings)
    try:
        drainer = getattr(actuator, "drainer", None)
        warned = [r for r in caplog.records if "scale-down without drain" in r.getMessage()]
        if with_key:
            assert isinstance(drainer, RouterDrainer) and not warned
            assert drainer.routers.entries == [A, B] and drainer.poll_s == 0.25
            assert drainer.client is scrape  # closed with the scrape client
        else:
            assert isinstance(drainer, NoDrainer) and len(warned) == 1
    finally:
        await actuator.aclose()
        await scrape.aclose()


def test_a_missing_key_fails_before_anything_is_opened(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROUTER_ADMIN", raising=False)
    settings = HostSettings(
        routers=[A], mode="kubernetes", deployment="vllm", api_url="http://kube:6443",
        admin_key_env="ROUTER_ADMIN",
    )  # fmt: skip
    with pytest.raises(ConfigError, match="ROUTER_ADMIN"):
        build(settings)


@pytest.mark.parametrize("routers, key", [([], KEY), ([A], "")])
def test_a_drainer_needs_routers_and_a_key(routers: list[str], key: str) -> None:
    with pytest.raises(ConfigError):
        RouterDrainer(routers, key)


@pytest.mark.parametrize(
    "flags, says, key_env",
    [
        (["--admin-key-env", "ROUTER_ADMIN"], "drain through the routers", "ROUTER_ADMIN"),
        ([], "scale-down without drain", ""),
    ],
)
def test_autoscale_run_takes_the_admin_key_variable(
    flags: list[str], says: str, key_env: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    import controlplane.cli.autoscale_run as run
    from controlplane.cli import _register, app

    _register()
    monkeypatch.delenv("CP_AUTOSCALER_ADMIN_KEY_ENV", raising=False)
    served: list[HostSettings] = []

    async def serve(settings: HostSettings) -> None:
        served.append(settings)

    monkeypatch.setattr(run, "serve", serve)
    args = ["autoscale", "run", "--routers", A, "--mode", "kubernetes", "--deployment", "vllm"]
    result = CliRunner().invoke(app, [*args, *flags], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert says in result.output
    assert [s.admin_key_env for s in served] == [key_env]
