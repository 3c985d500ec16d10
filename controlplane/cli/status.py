"""`controlplane status`: the router's fleet status in the terminal (GET /admin/status).

    controlplane status [--url http://127.0.0.1:8000] [--admin-key-env CP_ADMIN_KEY] [--once]
                        [--interval 1.5]

`--once` prints one frame and exits; otherwise a rich Live view refreshes every `--interval`
seconds until Ctrl-C. The admin key is read from the named environment variable (never from the
command line, where `ps` would show it). An unreachable router, a refused key or an answer that is
not a status is one line on stderr and exit code 1; once the live view runs, a failed poll is
shown in its header and the view keeps polling.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Annotated

import httpx
import pydantic
import typer
from rich.console import Console
from rich.live import Live

from controlplane.cli import app
from controlplane.cli.status_view import frame
from router.status.model import FleetStatus

err = Console(stderr=True)


class StatusUnavailable(Exception):
    """The status could not be read (the message is the one line shown)."""


def fetch_status(client: httpx.Client, url: str, key: str | None) -> FleetStatus:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    try:
        resp = client.get(f"{url}/admin/status", headers=headers)
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise StatusUnavailable(f"cannot reach the router at {url}: {exc}") from None
    if resp.status_code != 200:
        try:
            message = resp.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = resp.text[:200]
        raise StatusUnavailable(f"{url}/admin/status answered {resp.status_code}: {message}")
    try:
        return FleetStatus.from_json(resp.json())
    except (ValueError, pydantic.ValidationError):
        raise StatusUnavailable(f"{url}/admin/status did not answer with a fleet status") from None


@app.command("status")
def status_cmd(
    url: Annotated[str, typer.Option(help="The router's base URL.")] = "http://127.0.0.1:8000",
    admin_key_env: Annotated[
        str, typer.Option(help="Environment variable holding the router's admin key.")
    ] = "CP_ADMIN_KEY",
    once: Annotated[bool, typer.Option("--once", help="Print one frame and exit.")] = False,
    interval: Annotated[float, typer.Option(min=0.2, help="Seconds between refreshes.")] = 1.5,
    timeout: Annotated[float, typer.Option(min=0.1, help="Seconds to wait for an answer.")] = 5.0,
) -> None:
    """Show the fleet live: replicas by state, demand vs capacity, decisions, tenant shares."""
    key = os.environ.get(admin_key_env) or None
    base = url.rstrip("/")
    out = Console(width=None if sys.stdout.isatty() else 160)
    with httpx.Client(timeout=timeout) as client:
        try:
            current = fetch_status(client, base, key)
        except StatusUnavailable as exc:
            err.print(f"error: {exc}", markup=False, highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None
        if once:
            out.print(frame(current))
            return
        with Live(frame(current), console=out, auto_refresh=False) as live:
            try:
                while True:
                    time.sleep(interval)
                    note = ""
                    try:
                        current = fetch_status(client, base, key)
                    except StatusUnavailable as exc:
                        note = f"(stale) {exc}"
                    live.update(frame(current, note), refresh=True)
            except KeyboardInterrupt:
                pass


__all__ = ["StatusUnavailable", "fetch_status", "status_cmd"]
