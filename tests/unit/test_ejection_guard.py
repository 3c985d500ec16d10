"""EjectionGuard: a replica's ejection cuts the sections waiting on it, and only those."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from controlplane.errors import UpstreamTimeoutError
from router.http.ejection import Ejected, EjectionGuard


async def _wait_in_section(guard: EjectionGuard, replica: str, entered: asyncio.Event) -> str:
    async with guard.watch(replica):
        entered.set()
        await asyncio.sleep(30)
    return "answered"


@pytest.mark.parametrize(
    ("ejected", "outcome"),
    [
        ("a", "ejected"),  # the replica it waits on
        ("b", "answered-late"),  # another replica: nothing happens to this one
    ],
)
async def test_ejection_cuts_only_the_sections_on_that_replica(ejected: str, outcome: str) -> None:
    guard = EjectionGuard()
    entered = asyncio.Event()
    task = asyncio.create_task(_wait_in_section(guard, "a", entered))
    await entered.wait()
    guard.on_eject(ejected, "down")
    await asyncio.sleep(0.01)
    if outcome == "ejected":
        with pytest.raises(Ejected) as err:
            await task
        assert err.value.replica_id == "a"
        assert not task.cancelled()
    else:
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert guard.waiting("a") == 0


async def test_an_ejected_task_keeps_working_afterwards() -> None:
    guard = EjectionGuard()

    async def request() -> str:
        try:
            async with guard.watch("a"):
                await asyncio.sleep(30)
        except Ejected:
            pass
        await asyncio.sleep(0.01)  # no stray cancellation left on the task
        async with guard.watch("b"):
            await asyncio.sleep(0)
        return "retried"

    task = asyncio.create_task(request())
    await asyncio.sleep(0.01)
    guard.on_eject("a")
    assert await asyncio.wait_for(task, 5) == "retried"
    assert guard.waiting("a") == guard.waiting("b") == 0


async def test_a_cancellation_from_elsewhere_propagates() -> None:
    guard = EjectionGuard()
    entered = asyncio.Event()
    task = asyncio.create_task(_wait_in_section(guard, "a", entered))
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert guard.waiting("a") == 0


async def test_the_request_whose_own_failure_ejected_the_replica_keeps_its_error() -> None:
    guard = EjectionGuard()
    with pytest.raises(UpstreamTimeoutError):
        async with guard.watch("a"):
            guard.on_eject("a")  # from inside the section: record_slow after its TTFT timeout
            raise UpstreamTimeoutError("no first token in time")
    assert guard.waiting("a") == 0


async def test_an_upstream_error_without_ejection_stays_what_it_is() -> None:
    guard = EjectionGuard()
    with pytest.raises(UpstreamTimeoutError):
        async with guard.watch("a"):
            raise UpstreamTimeoutError("slow")


async def test_an_ejection_in_the_same_tick_as_the_answer_leaves_no_stray_cancel() -> None:
    guard = EjectionGuard()

    async def request() -> str:
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[str] = loop.create_future()

        def replica_answers_and_fleet_ejects() -> None:  # one loop callback, outside the task
            answer.set_result("first chunk")
            guard.on_eject("a")

        try:
            async with guard.watch("a"):
                loop.call_soon(replica_answers_and_fleet_ejects)
                got = await answer
        except Ejected:
            got = "ejected"  # the cancel came first: the caller re-sends it
        await asyncio.sleep(0.01)  # would raise CancelledError if a cancel were left over
        return got

    assert await asyncio.wait_for(asyncio.create_task(request()), 5) in ("ejected", "first chunk")
    assert guard.waiting("a") == 0


async def test_a_cancel_swallowed_inside_the_section_is_taken_back() -> None:
    guard = EjectionGuard()

    async def request() -> str:
        async with guard.watch("a"):
            with contextlib.suppress(asyncio.CancelledError):  # code that eats a cancel
                await asyncio.sleep(30)
            answer = "kept"
        await asyncio.sleep(0.01)
        return answer

    task = asyncio.create_task(request())
    await asyncio.sleep(0.01)
    guard.on_eject("a")
    assert await asyncio.wait_for(task, 5) == "kept"
    assert task.cancelling() == 0
