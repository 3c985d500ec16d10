"""The routers the autoscaler scrapes and drains through, re-resolved on every use.

    http://10.0.0.5:8000            one router
    dns+http://cp-router-pods:8000  every address the name resolves to now, one router each
                                    (a headless Service of a router Deployment: any size,
                                    rolling updates included); dns+https too

Each `dns+` entry is resolved (A and AAAA, through the event loop's resolver) every time the
list is asked for, so a router that joins is scraped from the next tick on (its first reading
only sets its baseline) and one that leaves stops being asked. A name that does not resolve
contributes nothing that time and is logged; with no router at all the controller's tick reads
as NO_DATA and it holds its target.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from urllib.parse import urlsplit

from controlplane.errors import ConfigError

log = logging.getLogger("controlplane.autoscaler.routers")

DNS_PREFIX = "dns+"
Resolver = Callable[[str], Awaitable[list[str]]]


async def system_resolve(name: str) -> list[str]:
    """The addresses `name` resolves to (raises `OSError` when it does not)."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, None, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def _split(entry: str) -> tuple[str, str, int]:
    parts = urlsplit(entry[len(DNS_PREFIX) :])
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/"):
        raise ConfigError(f"router entry {entry!r}: expected dns+http(s)://name:port")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.scheme, parts.hostname, port


class RouterUrls:
    """A fixed list of router base URLs, `dns+` entries expanded by `current()`."""

    def __init__(self, entries: Sequence[str], resolve: Resolver = system_resolve) -> None:
        self.entries = [e.rstrip("/") for e in entries]
        for e in self.entries:
            if e.startswith(DNS_PREFIX):
                _split(e)  # refuse a malformed entry at start, not at the first tick
        self.resolve = resolve

    @property
    def dynamic(self) -> bool:
        return any(e.startswith(DNS_PREFIX) for e in self.entries)

    async def current(self) -> list[str]:
        """Every router's base URL now (sorted addresses per `dns+` entry, duplicates dropped)."""
        urls: list[str] = []
        for entry in self.entries:
            if not entry.startswith(DNS_PREFIX):
                urls.append(entry)
                continue
            scheme, name, port = _split(entry)
            try:
                answers = await self.resolve(name)
                found = {ipaddress.ip_address(a.split("%", 1)[0]) for a in answers}
            except (OSError, ValueError) as exc:
                log.warning("routers %s: %s does not resolve: %s", entry, name, exc)
                continue
            for a in sorted(found, key=lambda a: (a.version, int(a))):
                host = f"[{a}]" if a.version == 6 else str(a)
                urls.append(f"{scheme}://{host}:{port}")
        return list(dict.fromkeys(urls))
