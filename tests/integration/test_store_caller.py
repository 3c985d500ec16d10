"""`ScriptCaller` against a private redis-server: concurrent calls share pipelined round trips
and each gets its own reply, calls arriving during a round trip go in the next, a call cancelled
before its round trip is never sent and one cancelled after hands its reply to `on_orphan`, an
error reply fails only its call, NOSCRIPT is reloaded once, too many waiting calls are shed
without touching the breaker, unguarded calls neither ask nor inform it, and under any mix of
concurrent calls, cancellations and failing scripts (Hypothesis) every call ends exactly once
with its own answer and nothing is left behind (no task, no connection)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.exceptions import ResponseError
from redis_server import RedisServer

from controlplane.errors import StoreUnavailableError
from controlplane.store.breaker import BreakerState, CircuitBreaker
from controlplane.store.caller import ScriptCaller
from controlplane.store.scripts import Script, script_client

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]

CLIENT = "cp-test-caller"
ECHO = Script("return ARGV[1]")
COUNT = Script("return redis.call('INCR', 'cp-test:count')")
FAIL = Script("return redis.error_reply('boom ' .. ARGV[1])")
# holds Redis for some tens of milliseconds: its reply is certainly not back at once
SLOW = Script("local x = 0 for i = 1, 3000000 do x = x + i end return ARGV[1]")
Factory = Callable[..., ScriptCaller]


@pytest.fixture
async def make_caller(redis_server: RedisServer) -> AsyncIterator[Factory]:
    """Callers (each with its pool and breaker); teardown closes them and checks that no task
    and no connection is left."""
    before = asyncio.all_tasks()
    made: list[tuple[ScriptCaller, Any]] = []

    def factory(**kwargs: Any) -> ScriptCaller:
        _, client = script_client(
            redis_server.url,
            client_name=CLIENT,
            max_connections=8,
            pool_timeout_s=2.0,
            socket_timeout_s=2.0,
            connect_timeout_s=2.0,
        )
        caller = ScriptCaller(client, CircuitBreaker(3, 0.2), **kwargs)
        made.append((caller, client))
        return caller

    yield factory
    for caller, client in made:
        await caller.aclose()
        await client.aclose(close_connection_pool=True)
    await asyncio.sleep(0)
    leaked = {t for t in asyncio.all_tasks() - before if t is not asyncio.current_task()}
    assert not {t for t in leaked if not t.done()}, f"leaked tasks: {leaked}"
    if redis_server.running and not redis_server.paused:
        admin = redis.Redis.from_url(redis_server.url, socket_timeout=2)
        try:
            names = [c.get("name") for c in admin.client_list()]
            assert CLIENT not in names, "connections left open"
        finally:
            admin.close()


def state(caller: ScriptCaller) -> BreakerState:
    return caller.breaker.state  # a call, so that type checkers do not narrow it between checks


async def echo(caller: ScriptCaller, value: str, **kw: Any) -> Any:
    return await caller.call(ECHO, [value], budget_s=2.0, **kw)


async def sent(caller: ScriptCaller, calls: int) -> None:
    """Until `calls` calls were sent (the lane runs a loop iteration or two later)."""
    async with asyncio.timeout(5):
        while caller.calls_sent < calls:
            await asyncio.sleep(0)


async def test_concurrent_calls_share_round_trips_and_get_their_own_replies(
    make_caller: Factory,
) -> None:
    caller = make_caller(max_batch=64)
    await echo(caller, "warm")  # connection made, script loaded
    trips = caller.round_trips
    got = await asyncio.gather(*(echo(caller, f"v{i}") for i in range(300)))
    assert got == [f"v{i}".encode() for i in range(300)]
    assert caller.round_trips - trips <= 300 // 64 + 2  # a handful of pipelines, not 300 calls
    assert caller.pending == 0 and caller.breaker.state is BreakerState.CLOSED


async def test_calls_arriving_during_a_round_trip_go_in_the_next(make_caller: Factory) -> None:
    caller = make_caller(connections=1)
    await echo(caller, "warm")
    await caller.call(SLOW, ["warm"], budget_s=2.0)
    trips = caller.round_trips
    first = asyncio.ensure_future(caller.call(SLOW, ["first"], budget_s=2.0))
    await sent(caller, caller.calls_sent + 1)  # the lane waits for its reply
    assert caller.round_trips - trips == 1
    rest = [asyncio.ensure_future(echo(caller, f"r{i}")) for i in range(10)]
    assert await first == b"first"
    assert await asyncio.gather(*rest) == [f"r{i}".encode() for i in range(10)]
    assert caller.round_trips - trips == 2  # the ten went together, in the next round trip


async def test_a_call_cancelled_before_its_round_trip_is_never_sent(
    make_caller: Factory, redis_admin: redis.Redis
) -> None:
    caller = make_caller(connections=1)
    await echo(caller, "warm")
    redis_admin.delete("cp-test:count")
    first = asyncio.ensure_future(caller.call(SLOW, ["first"], budget_s=2.0))
    await sent(caller, caller.calls_sent + 1)  # in flight, the only lane busy
    doomed = asyncio.ensure_future(caller.call(COUNT, [""], budget_s=2.0))
    await asyncio.sleep(0)  # queued behind it
    assert caller.pending == 1
    doomed.cancel()
    assert await first == b"first"
    with pytest.raises(asyncio.CancelledError):
        await doomed
    assert await caller.call(COUNT, [""], budget_s=2.0) == 1  # the cancelled one never ran


async def test_a_call_cancelled_after_it_was_sent_hands_its_reply_to_on_orphan(
    make_caller: Factory,
) -> None:
    caller = make_caller()
    await echo(caller, "warm")
    await caller.call(SLOW, ["warm"], budget_s=2.0)  # loaded: the next one runs at once
    orphans: list[Any] = []
    call = asyncio.ensure_future(
        caller.call(SLOW, ["late"], budget_s=2.0, on_orphan=orphans.append)
    )
    await sent(caller, caller.calls_sent + 1)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    async with asyncio.timeout(5):
        while not orphans:
            await asyncio.sleep(0.01)
    assert orphans == [b"late"]


async def test_an_error_reply_fails_only_its_call_and_counts_as_a_failure(
    make_caller: Factory,
) -> None:
    caller = make_caller()
    await echo(caller, "warm")
    calls = [(ECHO, ["a"]), (FAIL, ["b"]), (ECHO, ["c"])]
    got = await caller.call_many(calls, budget_s=2.0)
    assert got[0] == b"a" and got[2] == b"c"
    assert isinstance(got[1], ResponseError) and "boom b" in str(got[1])
    assert caller.breaker.consecutive_failures == 1  # Redis answered an error
    assert await echo(caller, "ok") == b"ok"
    assert caller.breaker.consecutive_failures == 0


async def test_scripts_lost_by_redis_are_loaded_again(
    make_caller: Factory, redis_admin: redis.Redis
) -> None:
    caller = make_caller()
    await echo(caller, "warm")
    loads = caller.script_loads
    redis_admin.script_flush()
    got = await asyncio.gather(*(echo(caller, f"v{i}") for i in range(20)))
    assert got == [f"v{i}".encode() for i in range(20)]
    assert caller.script_loads - loads == 1  # one SCRIPT LOAD for the whole pipeline


async def test_too_many_waiting_calls_are_shed_without_touching_the_breaker(
    make_caller: Factory,
) -> None:
    caller = make_caller(max_pending=5)
    got = await asyncio.gather(*(echo(caller, f"v{i}") for i in range(20)), return_exceptions=True)
    shed = [g for g in got if isinstance(g, StoreUnavailableError)]
    assert shed and all(g.reason == "overloaded" for g in shed)
    assert all(g == f"v{i}".encode() for i, g in enumerate(got) if not isinstance(g, Exception))
    assert caller.shed == len(shed)
    assert caller.breaker.state is BreakerState.CLOSED
    assert caller.breaker.consecutive_failures == 0


async def test_unguarded_calls_neither_ask_nor_inform_the_breaker(
    make_caller: Factory, redis_server: RedisServer
) -> None:
    caller = make_caller()
    await echo(caller, "warm")
    redis_server.kill()
    for _ in range(5):
        with pytest.raises(Exception):  # noqa: B017 - connection refused, whatever its class
            await echo(caller, "x", guarded=False)
    assert caller.breaker.state is BreakerState.CLOSED
    assert caller.breaker.consecutive_failures == 0
    for _ in range(3):  # guarded calls do open it
        with pytest.raises(Exception):  # noqa: B017
            await echo(caller, "x")
    assert state(caller) is BreakerState.OPEN
    trips = caller.round_trips
    with pytest.raises(StoreUnavailableError, match="open"):
        await echo(caller, "x")
    assert caller.round_trips == trips  # refused without any I/O


# -- every call ends once, with its own answer (Hypothesis) --------------------------------------
ACTION = st.tuples(
    st.sampled_from(["echo", "fail", "cancel_queued", "cancel_sent"]), st.integers(0, 3)
)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(actions=st.lists(ACTION, min_size=1, max_size=80), connections=st.integers(1, 3))
def test_every_call_ends_once_with_its_own_answer(
    redis_server: RedisServer, actions: list[tuple[str, int]], connections: int
) -> None:
    async def main() -> None:
        _, client = script_client(
            redis_server.url,
            client_name=CLIENT,
            max_connections=8,
            pool_timeout_s=2.0,
            socket_timeout_s=2.0,
            connect_timeout_s=2.0,
        )
        caller = ScriptCaller(client, CircuitBreaker(1000, 0.2), connections=connections)
        before = asyncio.all_tasks()
        try:
            tasks: list[tuple[str, str, asyncio.Task[Any]]] = []
            for i, (kind, pause) in enumerate(actions):
                value = f"v{i}"
                script = FAIL if kind == "fail" else ECHO
                task = asyncio.ensure_future(caller.call(script, [value], budget_s=5.0))
                tasks.append((kind, value, task))
                if kind == "cancel_sent":
                    await asyncio.sleep(0)
                if kind.startswith("cancel"):
                    task.cancel()
                for _ in range(pause):
                    await asyncio.sleep(0)
            await asyncio.gather(*(t for _, _, t in tasks), return_exceptions=True)
            for kind, value, task in tasks:
                assert task.done()
                if task.cancelled():
                    assert kind.startswith("cancel")
                elif kind == "fail":
                    exc = task.exception()
                    assert isinstance(exc, ResponseError) and f"boom {value}" in str(exc)
                else:
                    assert task.result() == value.encode()
            assert caller.pending == 0
        finally:
            await caller.aclose()
            await client.aclose(close_connection_pool=True)
        left = {t for t in asyncio.all_tasks() - before if not t.done()}
        assert left <= {asyncio.current_task()}

    asyncio.run(main())
