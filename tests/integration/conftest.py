"""Fixtures for integration tests: the tiny model directory (once per session), a fake
Kubernetes API server, a private redis-server per test, and store factories.

`redis_server` starts a throwaway server (free loopback port, no persistence, temp dir; never
6379) and on teardown asserts the process is gone. `make_index` (`RedisPrefixIndex`es) and
`make_store` (`RedisQuotaStore`s) build stores against it and on teardown close them and assert
that they left no asyncio task and no open connection behind. Tests using them carry the `redis`
marker and are skipped when `redis-server` is not installed.

After every test's and every module's teardown the garbage collector runs, so that a socket,
file or event loop a test forgot to close (kept alive by a reference cycle until some later
collection) fails that test with its ResourceWarning, not whichever later test the collector
happens to run in.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from fake_kube import FakeKube
from redis_server import RedisServer, available

from controlplane.prefix.redis_index import RedisPrefixIndex
from controlplane.tenancy.quota_redis import RedisQuotaStore
from deploy.processes import group_alive
from deploy.tiny_model import ensure_tiny_model

INDEX_CLIENT_NAME = "cp-test-index"
QUOTA_CLIENT_NAME = "cp-test-quota"


@pytest.fixture(autouse=True)
def _collect_after_test() -> Iterator[None]:
    """Garbage collection as the test's last teardown step (set up first, torn down last);
    pytest's check for unraisable exceptions runs right after it and fails this test."""
    yield
    gc.collect()


@pytest.fixture(scope="module", autouse=True)
def _collect_after_module() -> Iterator[None]:
    """The same once the module's shared fixtures are torn down (their leaks fail the module's
    last test)."""
    yield
    gc.collect()


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The tiny model in its default directory (`.cache/tiny-llama`), made once per session."""
    return ensure_tiny_model()


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    """A fake Kubernetes API server (tests/integration/fake_kube.py) on a free port."""
    server = FakeKube()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A private redis-server for one test; killed (and checked gone) afterwards."""
    if not available():
        pytest.skip("redis-server is not installed")
    server = RedisServer()
    server.start()
    pids = {server.pid}
    try:
        yield server
    finally:
        pids.add(server.pid)
        server.close()
        for pid in pids - {None}:
            assert pid is not None
            assert not group_alive(pid), f"redis-server {pid} still running"


@pytest.fixture
def redis_admin(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A plain synchronous client to inspect the server (keys, TTLs, CLIENT LIST)."""
    client = redis.Redis.from_url(redis_server.url, socket_timeout=2)
    try:
        yield client
    finally:
        client.close()


def index_clients(admin: redis.Redis, name: str = INDEX_CLIENT_NAME) -> int:
    """Connections the server sees from indexes named `name`."""
    clients: list[dict[str, Any]] = admin.client_list()
    return sum(1 for c in clients if c.get("name") == name)


@pytest.fixture
async def make_index(
    redis_server: RedisServer,
) -> AsyncIterator[Callable[..., RedisPrefixIndex]]:
    """Factory of indexes on the private server; teardown closes them and checks for leaks."""
    before = asyncio.all_tasks()
    made: list[RedisPrefixIndex] = []

    def factory(**kwargs: Any) -> RedisPrefixIndex:
        kwargs.setdefault("client_name", INDEX_CLIENT_NAME)
        kwargs.setdefault("key_prefix", "t:idx")
        # semantic tests must not depend on machine load; fault tests pass the real budget
        kwargs.setdefault("lookup_budget_s", 2.0)
        kwargs.setdefault("write_timeout_s", 5.0)
        kwargs.setdefault("socket_timeout_s", 5.0)
        kwargs.setdefault("connect_timeout_s", 5.0)
        url = kwargs.pop("url", redis_server.url)
        index = RedisPrefixIndex(url, **kwargs)
        made.append(index)
        return index

    yield factory

    for index in made:
        await index.aclose()
    await asyncio.sleep(0)
    leaked = {
        t for t in asyncio.all_tasks() - before if t is not asyncio.current_task() and not t.done()
    }
    assert not leaked, f"leaked asyncio tasks: {leaked}"
    if redis_server.running and not redis_server.paused:
        admin = redis.Redis.from_url(redis_server.url, socket_timeout=2)
        try:
            deadline = time.monotonic() + 2.0
            while index_clients(admin) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert index_clients(admin) == 0, "index connections left open"
        finally:
            admin.close()


@pytest.fixture
async def make_store(redis_server: RedisServer) -> AsyncIterator[Callable[..., RedisQuotaStore]]:
    """Stores on the private server; teardown closes them and checks nothing was left behind."""
    before = asyncio.all_tasks()
    made: list[RedisQuotaStore] = []

    def factory(**kwargs: Any) -> RedisQuotaStore:
        kwargs.setdefault("client_name", QUOTA_CLIENT_NAME)
        kwargs.setdefault("timeout_s", 2.0)
        store = RedisQuotaStore(kwargs.pop("url", redis_server.url), **kwargs)
        made.append(store)
        return store

    yield factory
    for store in made:
        await store.aclose()
    await asyncio.sleep(0)
    leaked = {t for t in asyncio.all_tasks() - before if t is not asyncio.current_task()}
    assert not {t for t in leaked if not t.done()}, f"leaked tasks: {leaked}"
    if redis_server.running:
        admin = redis.Redis.from_url(redis_server.url, socket_timeout=2)
        try:
            clients: list[dict[str, Any]] = admin.client_list()
            assert not [c for c in clients if c.get("name") == QUOTA_CLIENT_NAME], (
                "connections left open"
            )
        finally:
            admin.close()
