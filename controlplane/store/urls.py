"""Redis URLs: the guard every store applies before it connects, and redaction for logs.

`check_url` refuses a URL that would send state to Redis without a password off loopback (unless
the operator says so explicitly); `redacted` masks the password of a URL that is logged or shown.
"""

from __future__ import annotations

import contextlib
import ipaddress
from urllib.parse import urlsplit

from controlplane.errors import ConfigError


def check_url(url: str, *, allow_insecure: bool = False, has_credentials: bool = False) -> None:
    """Refuse an unauthenticated URL to a non-loopback host unless explicitly allowed."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ConfigError(f"redis URL scheme must be redis://, rediss:// or unix://, not {url!r}")
    if parts.scheme == "unix" or allow_insecure:
        return
    host = parts.hostname or ""
    loopback = host == "localhost"
    if not loopback:
        with contextlib.suppress(ValueError):
            loopback = ipaddress.ip_address(host).is_loopback
    if loopback or has_credentials or parts.password:
        return
    raise ConfigError(
        f"refusing an unauthenticated Redis URL to non-loopback host {host!r}: give a password "
        "(redis://user:pass@host or password=), or pass allow_insecure=True"
    )


def redacted(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return parts._replace(netloc=netloc).geturl()
