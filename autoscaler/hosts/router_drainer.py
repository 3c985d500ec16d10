"""A `Drainer` over the routers' admin API: a scale-down drains its victims through the routers.

The autoscaler does not import the router; it speaks the admin HTTP API of the routers it
scrapes (`Authorization: Bearer <admin key>`). Replica ids are pod names.

    victim_info(ids)  GET /admin/replicas on every router. A replica is known when the fleet
                      registry's rows (`fleet`) hold it loading/ready/ejected; a draining or
                      gone one is left out (it takes no new work: it ranks as unknown to the
                      router, so it goes first). in_flight = max(the registry row's `in_flight`,
                      the live routers' heartbeats, with the sum of the reachable routers' own
                      rows, their ledgers now). cached_blocks = round(kv_usage x num_gpu_blocks)
                      of the freshest scrape among the routers' own rows (0 when never
                      scraped). A router without the registry's view (Redis down) adds its own
                      rows only; with no registry view at all, nothing is known (raises).
    drain(ids)        POST /admin/replicas/{id}/drain on the first router that answers (the
                      registry makes it fleet-wide); a 404 `UnknownReplicaError` means nothing
                      is left to drain; any other failure tries the next router.
    wait_drained      GET /admin/replicas every `drain_poll_s` until each id's registry row is
                      `gone` or absent (True), or `timeout` passed (False; unanswered polls too).

No router answering (transport error, 401 wrong key, 404 admin API off, 5xx, registry down)
raises `RouterAdminError`, and the scaler abandons this scale-down: nothing is removed, the
controller counts the error and decides again next tick.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any
from urllib.parse import quote

import httpx
from pydantic import BaseModel, Field

from autoscaler.router_urls import RouterUrls
from autoscaler.victims import VictimInfo
from controlplane.errors import ConfigError, RouterAdminError

log = logging.getLogger("controlplane.autoscaler.drainer")

LEAVING = frozenset({"draining", "gone"})  # registry states that take no new work
UNKNOWN_REPLICA = "UnknownReplicaError"  # the admin API's error code of an unknown/gone id


class DrainerSettings(BaseModel):
    """How the autoscaler reaches the routers' admin API (a mixin of the host's settings)."""

    admin_key_env: str = Field(
        default="",
        description="Environment variable holding the routers' admin key ('' = no drain: "
        "a scale-down removes pods without draining them through the routers).",
    )
    drain_poll_s: float = Field(
        default=0.5, gt=0, description="Seconds between two looks at the victims' drain state."
    )
    admin_timeout_s: float = Field(
        default=5.0, gt=0, description="Timeout of one call to a router's admin API."
    )

    def admin_key(self) -> str | None:
        """The key from `admin_key_env`; None when no variable is named."""
        if not self.admin_key_env:
            return None
        key = os.environ.get(self.admin_key_env, "")
        if not key:
            raise ConfigError(f"admin_key_env names {self.admin_key_env!r}: unset or empty")
        return key


class RouterDrainer:
    """Victim load, drain and drain wait through the routers' admin API (a `Drainer`)."""

    def __init__(
        self,
        routers: Sequence[str] | RouterUrls,
        admin_key: str,
        *,
        poll_s: float = 0.5,
        timeout_s: float = 5.0,
        client: httpx.AsyncClient | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if not (routers.entries if isinstance(routers, RouterUrls) else routers):
            raise ConfigError("the router drainer needs at least one router URL")
        if not admin_key:
            raise ConfigError("the router drainer needs the routers' admin key")
        # `dns+http://name:port` entries: every address of the name, re-resolved on each call
        self.routers = routers if isinstance(routers, RouterUrls) else RouterUrls(routers)
        self._headers = {"authorization": f"Bearer {admin_key}"}
        self.poll_s = poll_s
        self.timeout_s = timeout_s
        self._own_client = client is None
        self.client = client or httpx.AsyncClient()
        self.clock = clock
        self.sleep = sleep

    async def _listing(self, router: str) -> dict[str, Any]:
        """One router's GET /admin/replicas; raises `_Failed` with a one-line reason."""
        try:
            r = await self.client.get(
                f"{router}/admin/replicas", headers=self._headers, timeout=self.timeout_s
            )
        except httpx.HTTPError as exc:
            raise _Failed(f"{router}: {type(exc).__name__}: {exc}") from None
        if r.status_code != 200:
            raise _Failed(f"{router}: HTTP {r.status_code}: {_message(r)}")
        try:
            body = r.json()
        except ValueError:
            raise _Failed(f"{router}: not JSON") from None
        if not isinstance(body, dict):
            raise _Failed(f"{router}: not a JSON object")
        return body

    async def _listings(self, *, every: bool) -> list[dict[str, Any]]:
        """The listings of every router (`every`), or of the first with the registry's view.
        Raises `RouterAdminError` when no router gave the registry's view."""
        got: list[dict[str, Any]] = []
        failures: list[str] = []
        for router in await self.routers.current():
            try:
                body = await self._listing(router)
            except _Failed as exc:
                failures.append(str(exc))
                continue
            if not isinstance(body.get("fleet"), list):
                failures.append(f"{router}: no fleet registry view ({body.get('fleet_error')})")
                if every:
                    got.append(body)  # its own rows still count (its ledger is real work)
                continue
            got.append(body)
            if not every:
                break
        if not any(isinstance(b.get("fleet"), list) for b in got):
            raise RouterAdminError("no router's admin API answered", failures=tuple(failures))
        for f in failures:
            log.warning("router admin API: %s", f)
        return got

    async def victim_info(self, ids: Sequence[str]) -> Mapping[str, VictimInfo]:
        listings = await self._listings(every=True)
        wanted = set(ids)
        fleet_in_flight: dict[str, int] = {}
        for body in listings:
            for row in _rows(body, "fleet"):
                rid = row.get("id")
                if rid in wanted and str(row.get("state")) not in LEAVING:
                    fleet_in_flight[rid] = max(fleet_in_flight.get(rid, 0), _int(row, "in_flight"))
        own_in_flight = dict.fromkeys(fleet_in_flight, 0)
        freshest: dict[str, tuple[float, int]] = {}  # id -> (scraped_at_s, cached blocks)
        for body in listings:
            for row in _rows(body, "replicas"):
                rid = row.get("id")
                if rid not in fleet_in_flight:
                    continue
                own_in_flight[rid] += _int(row, "in_flight")
                blocks = _cached_blocks(row)
                if blocks is not None:
                    at = float(row.get("scraped_at_s") or 0.0)
                    if rid not in freshest or at >= freshest[rid][0]:
                        freshest[rid] = (at, blocks)
        return {
            rid: VictimInfo(rid, max(n, own_in_flight[rid]), freshest.get(rid, (0.0, 0))[1])
            for rid, n in fleet_in_flight.items()
        }

    async def drain(self, ids: Sequence[str]) -> None:
        for rid in ids:
            await self._drain_one(rid)

    async def _drain_one(self, rid: str) -> None:
        failures: list[str] = []
        for router in await self.routers.current():
            url = f"{router}/admin/replicas/{quote(rid, safe='')}/drain"
            try:
                r = await self.client.post(url, headers=self._headers, timeout=self.timeout_s)
            except httpx.HTTPError as exc:
                failures.append(f"{router}: {type(exc).__name__}: {exc}")
                continue
            if r.status_code == 200:
                log.info("replica %s drained through %s", rid, router)
                return
            if r.status_code == 404 and _code(r) == UNKNOWN_REPLICA:
                log.info("replica %s: unknown to the fleet registry, nothing to drain", rid)
                return
            failures.append(f"{router}: HTTP {r.status_code}: {_message(r)}")
        raise RouterAdminError(f"could not drain replica {rid!r}", failures=tuple(failures))

    async def wait_drained(self, ids: Sequence[str], timeout: float) -> bool:
        deadline = self.clock() + timeout
        waiting = set(ids)
        while True:
            try:
                (body,) = await self._listings(every=False)
            except RouterAdminError as exc:
                log.warning("drain of %s: %s", sorted(waiting), exc)
            else:
                states = {row.get("id"): str(row.get("state")) for row in _rows(body, "fleet")}
                waiting = {i for i in waiting if states.get(i, "gone") != "gone"}
                if not waiting:
                    return True
            if self.clock() >= deadline:
                return False
            await self.sleep(min(self.poll_s, max(0.0, deadline - self.clock())))

    async def aclose(self) -> None:
        if self._own_client:
            await self.client.aclose()


class _Failed(Exception):
    """One router's admin call failed (internal: collected into a `RouterAdminError`)."""


def _rows(body: Mapping[str, Any], key: str) -> list[dict[str, Any]]:
    rows = body.get(key)
    return [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []


def _int(row: Mapping[str, Any], key: str) -> int:
    value = row.get(key)
    return int(value) if isinstance(value, int | float) and value > 0 else 0


def _cached_blocks(row: Mapping[str, Any]) -> int | None:
    usage, blocks = row.get("kv_usage"), row.get("num_gpu_blocks")
    if not isinstance(usage, int | float) or not isinstance(blocks, int | float):
        return None
    return round(min(1.0, max(0.0, float(usage))) * blocks)


def _error(r: httpx.Response) -> dict[str, Any]:
    try:
        body = r.json()
    except ValueError:
        return {}
    err = body.get("error") if isinstance(body, dict) else None
    return err if isinstance(err, dict) else {}


def _code(r: httpx.Response) -> str:
    return str(_error(r).get("code", ""))


def _message(r: httpx.Response) -> str:
    return str(_error(r).get("message") or r.text[:200])


__all__ = ["DrainerSettings", "RouterDrainer"]
