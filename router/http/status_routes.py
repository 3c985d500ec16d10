"""The fleet status over HTTP: `GET /admin/status` (JSON) and `GET /status` (the web page).

Access rule (the status exposes no key, digest, salt or replica URL, but it does show tenant
ids, traffic and the fleet's shape, so it is an operator's view):

    admin key configured   /admin/status needs `Authorization: Bearer <admin key>` (401);
                           /status (a page with no data in it) is served, and asks for the key
    no admin key           both are served to loopback clients only (127.0.0.0/8, ::1); any
                           other client gets 403. The router's direct peer is what counts: behind
                           a proxy on the same host, configure an admin key.

The JSON is `FleetStatus.to_json()` (router/status/model.py); the page is router/status/page.py.
"""

from __future__ import annotations

import hmac
import ipaddress

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse

from controlplane.errors import AuthError, ForbiddenError
from router.config import RouterSettings
from router.runtime import RouterRuntime
from router.status.page import PAGE_CSP, PAGE_HTML

status_routes = APIRouter()

_NO_STORE = {"cache-control": "no-store"}


def is_loopback(host: str | None) -> bool:
    if not host:
        return False
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def _client_host(request: Request) -> str | None:
    return request.client.host if request.client else None


def check_status_access(request: Request, *, page: bool = False) -> None:
    settings: RouterSettings = request.app.state.settings
    if settings.admin_key is None:
        if not is_loopback(_client_host(request)):
            raise ForbiddenError(
                "the status is served to loopback clients only while no admin key is configured"
            )
        return
    if page:
        return
    given = request.headers.get("authorization", "")
    want = "Bearer " + settings.admin_key.get_secret_value()
    if not hmac.compare_digest(given.encode(), want.encode()):
        raise AuthError("a valid admin key is required (Authorization: Bearer ...)")


@status_routes.get("/admin/status")
async def fleet_status(request: Request) -> JSONResponse:
    check_status_access(request)
    rt: RouterRuntime = request.app.state.runtime
    return JSONResponse(rt.status.snapshot().to_json(), headers=_NO_STORE)


@status_routes.get("/status", response_class=HTMLResponse)
async def status_page(request: Request) -> HTMLResponse:
    check_status_access(request, page=True)
    headers = {
        **_NO_STORE,
        "content-security-policy": PAGE_CSP,
        "x-content-type-options": "nosniff",
    }
    return HTMLResponse(PAGE_HTML, headers=headers)


__all__ = ["check_status_access", "is_loopback", "status_routes"]
