"""The replica guard (router/fleet/urls.py): which replica URLs and ids the router accepts, from
the configuration at startup and through POST /admin/replicas (nothing refused is added or
probed). Host names resolve through fake resolvers: no DNS."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from fake_vllm import FakeVllmFleet
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from typer.testing import CliRunner

from controlplane.cli import _register, app
from controlplane.errors import ConfigError, ReplicaRefusedError, RequestError
from router.config import ReplicaConfig, load_settings
from router.fleet.urls import (
    DEFAULT_ALLOWED_NETWORKS,
    GUARDED_NETWORKS,
    Network,
    check_replica_id,
    check_replica_url,
)
from router.http.service import create_app
from router.runtime import RouterRuntime

DEFAULT = tuple(ipaddress.ip_network(n) for n in DEFAULT_ALLOWED_NETWORKS)
NAMES = {
    "vllm-0.vllm.ns.svc": ["10.244.1.7"],
    "localhost": ["127.0.0.1", "::1"],
    "mixed.ns.svc": ["10.0.0.5", "169.254.169.254"],
    "public.example": ["93.184.216.34"],
    "v6.ns.svc": ["fd12:3456::7"],
    "redis.ns.svc": ["10.0.0.9"],
    "empty.ns.svc": [],
}
REDIS = [("127.0.0.1", 6379), ("redis.ns.svc", 6379)]


def resolve(host: str) -> list[str]:
    try:
        return NAMES[host.rstrip(".")]
    except KeyError:
        raise OSError(f"[Errno -2] Name or service not known: {host!r}") from None


def nets(*cidrs: str) -> tuple[Network, ...]:
    return tuple(ipaddress.ip_network(c) for c in cidrs)


def check(url: str, allowed: Iterable[Network] = DEFAULT) -> str:
    return check_replica_url(url, tuple(allowed), resolve=resolve, forbidden=REDIS)


# -- the validator ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "url",
    [
        "http://10.1.2.3:8000",
        "https://vllm-0.vllm.ns.svc:8000",  # a cluster name, through the resolver
        "http://127.0.0.1:8101",  # the local fleet
        "http://localhost:8000",
        "http://[::1]:8000",
        "http://v6.ns.svc:8000",  # IPv6 unique local
        "http://192.168.1.20",  # port 80 implied
        "https://172.16.0.1/v1-prefix/",  # a path is allowed
        "HTTP://10.0.0.1:8000",  # the scheme is case-insensitive
        "http://127.0.0.1:6380",  # next to Redis, not on it
        "http://vllm-0.vllm.ns.svc.:8000",  # fully qualified
    ],
)
def test_accepted(url: str) -> None:
    assert check(url) == url


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("file:///etc/passwd", "scheme must be http or https"),
        ("gopher://10.0.0.1:70/_INFO", "scheme must be http or https"),
        ("ftp://10.0.0.1/", "scheme must be http or https"),
        ("10.0.0.1:8000", "scheme must be http or https"),
        ("", "empty"),
        ("http://", "no host"),
        ("http:10.0.0.1", "no host"),
        ("http://:8000", "no host"),
        ("http://user:pw@10.0.0.1:8000", "user info"),
        ("http://@10.0.0.1:8000", "user info"),
        ("http://169.254.169.254/latest", "outside the allowed networks"),
        ("http://[fe80::1]:8000", "outside the allowed networks"),
        ("http://[::ffff:169.254.169.254]/", "outside the allowed networks"),
        ("http://[fd00:ec2::254]/latest", "cloud metadata"),  # inside fc00::/7, still refused
        ("http://0.0.0.0:8000", "unspecified"),
        ("http://[::]:8000", "unspecified"),
        ("http://127.0.0.1:6379", "the router's Redis"),
        ("http://localhost:6379", "the router's Redis"),  # the same address by another name
        ("http://redis.ns.svc:6379", "the router's Redis"),
        ("http://10.0.0.9:6379", "the router's Redis"),  # the Redis name's address
        ("http://mixed.ns.svc:8000", "169.254.169.254 (an address of 'mixed.ns.svc')"),
        ("http://public.example:8000", "outside the allowed networks"),
        ("http://8.8.8.8:8000", "outside the allowed networks"),
        ("http://nowhere.invalid:8000", "cannot resolve"),
        ("http://empty.ns.svc:8000", "resolves to no address"),
        ("http://10.0.0.1:0", "port 0"),
        ("http://10.0.0.1:70000", "not a valid URL"),
        ("http://10.0.0.1:80a", "not a valid URL"),
        ("http://[::1", "not a valid URL"),
        ("http://10.0.0.1:8000/?x=1", "query or a fragment"),
        ("http://10.0.0.1:8000/#top", "query or a fragment"),
        ("http://10.0.0.1 :8000", "printable ASCII"),
        ("http://10.0.0.1:8000\n", "printable ASCII"),
        ("http://10.0.0.1\\@169.254.169.254/", "backslashes"),
        ("http://vllm\u00e9.svc:8000", "printable ASCII"),
        ("http://%31%30.0.0.1:8000", "neither an IP address nor a host name"),
        ("http://" + "a" * 2100, "longer than 2048 characters"),
    ],
)
def test_refused(url: str, why: str) -> None:
    with pytest.raises(ReplicaRefusedError) as info:
        check(url)
    assert why in str(info.value)
    assert info.value.param == "url"
    # one error, two readings: a 400 for the admin API, a configuration error at startup
    assert isinstance(info.value, RequestError) and isinstance(info.value, ConfigError)
    assert info.value.status_code == 400


@pytest.mark.parametrize(
    ("allowed", "url", "ok"),
    [
        (("0.0.0.0/0",), "http://8.8.8.8:8000", True),
        (("0.0.0.0/0",), "http://169.254.10.1:8000", False),  # link-local is never implied
        (("0.0.0.0/0",), "http://169.254.169.254/", False),
        (("0.0.0.0/0",), "http://0.0.0.0:8000", False),  # unspecified: whatever is listed
        (("0.0.0.0/0",), "http://224.0.0.1:8000", False),
        (("0.0.0.0/0", "169.254.0.0/16"), "http://169.254.10.1:8000", True),
        (("0.0.0.0/0", "169.254.0.0/16"), "http://169.254.169.254/", False),  # needs its /32
        (("169.254.169.254/32",), "http://169.254.169.254/", True),
        (("::/0",), "http://[2001:db8::1]:8000", True),
        (("::/0",), "http://[fe80::1]:8000", False),
        (("::/0",), "http://[::ffff:169.254.169.254]/", False),  # mapped: read as IPv4
        (("::/0", "fe80::/64"), "http://[fe80::1]:8000", True),
        (("10.1.0.0/16",), "http://10.1.2.3:8000", True),
        (("10.1.0.0/16",), "http://10.2.0.1:8000", False),
        (("10.1.0.0/16",), "http://127.0.0.1:8000", False),
        (("10.0.0.0/8",), "http://mixed.ns.svc:8000", False),  # every address must pass
        ((), "http://127.0.0.1:8000", False),  # nothing listed: nothing accepted
    ],
)
def test_custom_allow_lists(allowed: tuple[str, ...], url: str, ok: bool) -> None:
    if ok:
        assert check(url, nets(*allowed)) == url
    else:
        with pytest.raises(ReplicaRefusedError):
            check(url, nets(*allowed))


@pytest.mark.parametrize(
    "replica_id", ["r1", "a", "R", "0", "vllm-0.ns", "A_b-c.d", "x" * 63, "pod-7f9c4.default"]
)
def test_replica_ids_accepted(replica_id: str) -> None:
    assert check_replica_id(replica_id) == replica_id
    assert ReplicaConfig(id=replica_id, url="http://10.0.0.1:8000").id == replica_id


@pytest.mark.parametrize(
    "replica_id",
    ["", "-a", ".a", "_a", "a b", "a/b", 'a"b', "a}b", "a\nb", "a:b", "x" * 64, "r\u00e9", "a\\b"],
)
def test_replica_ids_refused(replica_id: str) -> None:
    with pytest.raises(ReplicaRefusedError) as info:
        check_replica_id(replica_id)
    assert info.value.param == "id"
    with pytest.raises(ValidationError, match="replica id"):
        ReplicaConfig(id=replica_id, url="http://10.0.0.1:8000")


# -- properties ---------------------------------------------------------------------------------
def _ip(addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    a = ipaddress.ip_address(addr)
    if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None:
        return a.ipv4_mapped
    return a


def assert_allowed(url: str, addrs: list[str], allowed: tuple[Network, ...]) -> None:
    """What acceptance promises: http(s) to a host whose every address is inside an allowed
    network, never unspecified, link-local or metadata unless listed within those."""
    parts = urlsplit(url)
    assert parts.scheme in ("http", "https")
    assert parts.hostname and "@" not in parts.netloc and not parts.query and not parts.fragment
    assert parts.port is None or 1 <= parts.port <= 65535
    for a in map(_ip, addrs):
        assert any(a in n for n in allowed), (url, a)
        assert not a.is_unspecified and not a.is_multicast
        for g in GUARDED_NETWORKS:
            if a in g:
                assert any(a in n and n.num_addresses <= g.num_addresses for n in allowed)


ALLOW_LISTS = [
    DEFAULT,
    nets("0.0.0.0/0", "::/0"),
    nets("10.0.0.0/8"),
    nets("0.0.0.0/0", "169.254.0.0/16"),
    nets("169.254.169.254/32", "fe80::/10"),
]
NEAR = ["10.0.0.1", "127.0.0.1", "169.254.169.254", "169.254.1.1", "0.0.0.0", "fd00:ec2::254"]
ADDRESSES = st.one_of(st.ip_addresses().map(str), st.sampled_from(NEAR), st.just("10.0.0.2"))
HOSTS = st.one_of(
    st.ip_addresses(v=4).map(str),
    st.ip_addresses(v=6).map(lambda a: f"[{a}]"),
    st.sampled_from([*NEAR[:-1], "[::1]", "[fe80::1]", "[fd00:ec2::254]"]),
    st.from_regex(r"[a-z][a-z0-9-]{0,8}(\.[a-z][a-z0-9-]{0,8}){0,2}", fullmatch=True),
)
URLS = st.builds(
    lambda scheme, user, host, port, path, tail: f"{scheme}{user}{host}{port}{path}{tail}",
    st.sampled_from(["http://"] * 4 + ["https://", "HTTP://", "file://", "gopher://", ""]),
    st.sampled_from([""] * 6 + ["user:pw@", "@"]),
    HOSTS,
    st.one_of(st.just(""), st.integers(0, 70_000).map(lambda p: f":{p}")),
    st.sampled_from(["", "/", "/v1", "/latest/meta-data"]),
    st.sampled_from([""] * 6 + ["?x=1", "#f"]),
)


@settings(max_examples=400, deadline=None)
@given(
    url=st.one_of(URLS, st.text(max_size=40)),
    names=st.lists(ADDRESSES, min_size=1, max_size=3),
    allowed=st.sampled_from(ALLOW_LISTS),
)
def test_anything_accepted_is_http_inside_an_allowed_network(
    url: str, names: list[str], allowed: tuple[Network, ...]
) -> None:
    """Any name resolves to `names`; whatever is not refused keeps acceptance's promise."""
    try:
        check_replica_url(url, allowed, resolve=lambda _host: names)
    except ReplicaRefusedError:
        return
    host = urlsplit(url).hostname or ""
    try:
        addrs = [str(ipaddress.ip_address(host))]
    except ValueError:
        addrs = names
    assert_allowed(url, addrs, allowed)


# -- settings -----------------------------------------------------------------------------------
def test_default_allow_list_is_loopback_private_and_ula() -> None:
    s = load_settings()
    assert [str(n) for n in s.replica_allowed_networks] == list(DEFAULT_ALLOWED_NETWORKS)
    assert s.replica_guard().allowed == DEFAULT


@pytest.mark.parametrize(
    "value", ["10.1.0.0/16, fd00::/8", '["10.1.0.0/16", "fd00::/8"]', "10.1.0.0/16,fd00::/8,"]
)
def test_allowed_networks_from_the_environment(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("CP_REPLICA_ALLOWED_NETWORKS", value)
    guard = load_settings().replica_guard(resolve)
    assert guard.allowed == nets("10.1.0.0/16", "fd00::/8")
    guard.check("a", "http://10.1.2.3:8000")
    with pytest.raises(ReplicaRefusedError):
        guard.check("a", "http://127.0.0.1:8000")


@pytest.mark.parametrize("bad", [["10.0.0.1/8"], ["not-a-network"], "10.0.0.0/33"])
def test_bad_allowed_networks_are_a_config_error(bad: Any) -> None:
    with pytest.raises(ConfigError, match="replica_allowed_networks"):
        load_settings(replica_allowed_networks=bad)


@pytest.mark.parametrize(
    ("redis_url", "url", "ok"),
    [
        ("redis://127.0.0.1:6379/0", "http://127.0.0.1:6379", False),
        ("redis://:secret@127.0.0.1/0", "http://127.0.0.1:6379", False),  # default port
        ("redis://127.0.0.1:6400/0", "http://127.0.0.1:6400", False),
        ("redis://127.0.0.1:6400/0", "http://127.0.0.1:6379", True),
        (None, "http://127.0.0.1:6379", True),  # no Redis configured
        ("unix:///run/redis.sock", "http://127.0.0.1:6379", True),
    ],
)
def test_the_routers_redis_is_never_a_replica(redis_url: str | None, url: str, ok: bool) -> None:
    guard = load_settings(redis={"url": redis_url}).replica_guard(resolve)
    if ok:
        guard.check("a", url)
    else:
        with pytest.raises(ReplicaRefusedError, match="the router's Redis"):
            guard.check("a", url)


# -- static configuration -----------------------------------------------------------------------
def test_a_refused_configured_replica_fails_the_runtime_before_anything_starts() -> None:
    fakes = FakeVllmFleet(["a"])
    bad = [*fakes.replica_configs(), {"id": "meta", "url": "http://169.254.169.254/latest"}]
    settings_ = load_settings(replicas=bad, tokenizer="approx")
    with pytest.raises(ReplicaRefusedError, match="configured replica 'meta': replica URL"):
        RouterRuntime(settings_, transport=fakes.transport, resolve=fakes.resolve)


def test_a_bad_configured_replica_id_fails_loading_the_settings() -> None:
    with pytest.raises(ConfigError, match="replica id 'a b' refused"):
        load_settings(replicas=[{"id": "a b", "url": "http://10.0.0.1:8000"}])


@pytest.mark.timeout(30)
@pytest.mark.parametrize("url", ["file:///etc/passwd", "http://169.254.169.254/", "http://"])
def test_serve_refuses_a_bad_replica_url_before_binding(
    monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    for key in [k for k in os.environ if k.startswith("CP_")]:
        monkeypatch.delenv(key)
    _register()
    result = CliRunner().invoke(app, ["serve", "--port", "0", "--replica", f"a={url}"])
    assert isinstance(result.exception, ReplicaRefusedError)  # `main` prints it, exit code 2
    assert f"configured replica 'a': replica URL {url!r} refused" in str(result.exception)


# -- POST /admin/replicas through the app -------------------------------------------------------
ADMIN = "admin-key"
AUTH = {"authorization": f"Bearer {ADMIN}"}


@dataclass
class Admin:
    client: httpx.AsyncClient
    runtime: RouterRuntime
    hosts: list[str] = field(default_factory=list)  # every host the router sent a request to

    async def ids(self) -> list[str]:
        r = await self.client.get("/admin/replicas", headers=AUTH)
        assert r.status_code == 200
        return sorted(row["id"] for row in r.json()["replicas"])


@pytest.fixture
async def admin() -> AsyncIterator[Admin]:
    fakes = FakeVllmFleet(["a", "b"])
    settings_ = load_settings(
        replicas=fakes.replica_configs(),
        tokenizer="approx",
        admin_key=ADMIN,
        telemetry={"json_logs": False},
    )
    hosts: list[str] = []

    async def recording(request: httpx.Request) -> httpx.Response:
        hosts.append(request.url.host)
        return await fakes.handle(request)

    runtime = RouterRuntime(
        settings_, transport=httpx.MockTransport(recording), resolve=fakes.resolve
    )
    app_ = create_app(settings_, runtime=runtime)
    async with (
        app_.router.lifespan_context(app_),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app_), base_url="http://r") as client,
    ):
        yield Admin(client, runtime, hosts)


@pytest.mark.parametrize(
    "url",
    [
        "file:///etc/passwd",
        "gopher://127.0.0.1:6379/_FLUSHALL",
        "",
        "http://",
        "http://user:pw@10.0.0.1:8000",
        "http://169.254.169.254/latest/meta-data",
        "http://[fe80::1]:8000",
        "http://0.0.0.0:8000",
        "http://8.8.8.8:8000",
        "http://unknown.example:8000",  # does not resolve: refused, not guessed
        "http://10.0.0.1:8000/?next=http://169.254.169.254",
    ],
)
async def test_admin_refuses_a_bad_url_and_adds_nothing(admin: Admin, url: str) -> None:
    before = await admin.ids()
    r = await admin.client.post("/admin/replicas", json={"id": "evil", "url": url}, headers=AUTH)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "invalid_replica" and error["param"] == "url"
    assert error["message"].startswith("replica URL ")
    assert await admin.ids() == before == ["a", "b"]
    assert all(h.endswith(".fake") for h in admin.hosts)  # nothing else was probed
    with pytest.raises(RequestError):
        admin.runtime.fleet.get("evil")


@pytest.mark.parametrize("replica_id", ["", "a b", "x" * 64, 'r"}', "-r"])
async def test_admin_refuses_a_bad_id(admin: Admin, replica_id: str) -> None:
    body = {"id": replica_id, "url": "http://c.fake:8000"}
    r = await admin.client.post("/admin/replicas", json=body, headers=AUTH)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "id"
    assert "replica id" in error["message"]
    assert await admin.ids() == ["a", "b"]


async def test_admin_adds_a_good_replica_and_refuses_a_taken_id(admin: Admin) -> None:
    body = {"id": "c", "url": "http://c.fake:8000"}
    r = await admin.client.post("/admin/replicas", json=body, headers=AUTH)
    assert r.status_code == 201 and r.json() == {"added": "c"}
    assert await admin.ids() == ["a", "b", "c"]
    # the same replica again is a no-op (the admin source reports it once more)
    r = await admin.client.post("/admin/replicas", json=body, headers=AUTH)
    assert r.status_code == 201 and await admin.ids() == ["a", "b", "c"]
    # a configured id at another URL is taken
    taken = {"id": "a", "url": "http://c.fake:8000"}
    r = await admin.client.post("/admin/replicas", json=taken, headers=AUTH)
    assert r.status_code == 400 and "at another URL" in r.json()["error"]["message"]
    assert admin.runtime.fleet.get("a").url == "http://a.fake:8000"


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer wrong"}])
async def test_admin_key_is_checked_before_the_replica(
    admin: Admin, headers: dict[str, str]
) -> None:
    for body in ({"id": "a b", "url": "file:///"}, {"not": "a replica"}):
        r = await admin.client.post("/admin/replicas", json=body, headers=headers)
        assert r.status_code == 401  # no hint about the body without the key
    assert await admin.ids() == ["a", "b"]
