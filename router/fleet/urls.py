"""Which replicas the router accepts: its guard against server-side request forgery.

Rule: the router probes, scrapes and proxies to every replica it is given, so a replica URL must
be `http(s)://host[:port][/path]`: printable ASCII, no userinfo, query or fragment, a port in
1..65535, and its host (a literal IP, or every address its name resolves to) inside the allowed
networks (`replica_allowed_networks`; default: loopback, RFC 1918, IPv6 loopback and ULA).
Link-local addresses and the cloud metadata endpoints are refused even inside an allowed network,
unless a listed network lies within them (169.254.169.254 needs 169.254.169.254/32 itself); the
unspecified, multicast and broadcast addresses and the router's own Redis (host:port of
`redis.url`) are always refused. A replica id is 1..63 of [A-Za-z0-9._-], starting with a letter
or digit: it becomes a metric label and a key part.

The check runs where a replica joins: the static configuration at startup and POST
/admin/replicas. A name is resolved then, through the injected `resolve` (getaddrinfo by
default); a name whose DNS changes later is not checked again (name replicas by IP, or by names
whose DNS the operator controls).
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from controlplane.errors import ReplicaRefusedError

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[[str], Iterable[str]]

DEFAULT_ALLOWED_NETWORKS = (
    *("127.0.0.0/8", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"),  # loopback, RFC 1918
    *("::1/128", "fc00::/7"),  # IPv6 loopback and unique local addresses
)
# refused inside an allowed network unless a network listed lies within the guarded one
GUARDED_NETWORKS = tuple(
    ipaddress.ip_network(n)
    for n in (
        "169.254.0.0/16",  # IPv4 link-local
        "fe80::/10",  # IPv6 link-local
        "169.254.169.254/32",  # AWS, GCP, Azure, OCI instance metadata
        "fd00:ec2::254/128",  # AWS instance metadata over IPv6 (inside the ULA range)
        "100.100.100.200/32",  # Alibaba Cloud metadata
        "168.63.129.16/32",  # Azure platform (wireserver)
    )
)
# never a replica, whatever is listed
NEVER_NETWORKS = tuple(
    ipaddress.ip_network(n)
    for n in ("0.0.0.0/8", "::/128", "224.0.0.0/4", "ff00::/8", "255.255.255.255/32")
)
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
_LABEL = r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?"
_HOSTNAME = re.compile(rf"(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*\.?")


def system_resolve(host: str) -> list[str]:
    """Every address `host` resolves to for TCP (the system resolver, blocking)."""
    infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    return [str(info[4][0]) for info in infos]


def check_replica_id(replica_id: str) -> str:
    """`replica_id` if it is safe as a metric label and a key part."""
    if not isinstance(replica_id, str) or not _ID.fullmatch(replica_id):
        raise ReplicaRefusedError(
            f"replica id {replica_id!r} refused: 1 to 63 characters of A-Z a-z 0-9 . _ -, "
            "starting with a letter or a digit",
            param="id",
        )
    return replica_id


def address_refusal(addr: Address, allowed: Sequence[Network]) -> str | None:
    """Why a replica may not be at `addr` under the allow-list `allowed`; None: it may."""
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped  # ::ffff:a.b.c.d is a.b.c.d
    if any(addr in n for n in NEVER_NETWORKS):
        return "an unspecified, multicast or broadcast address"
    if not any(addr in n for n in allowed):
        return "outside the allowed networks (replica_allowed_networks)"
    for g in GUARDED_NETWORKS:
        within = (n for n in allowed if n.network_address in g and n.broadcast_address in g)
        if addr in g and not any(addr in n for n in within):
            return (
                f"link-local or a cloud metadata address (allowed only when {g} or a network "
                "within it is listed)"
            )
    return None


def _refuse(url: str, why: str) -> ReplicaRefusedError:
    return ReplicaRefusedError(f"replica URL {url[:200]!r} refused: {why}", param="url")


def _addresses(url: str, host: str, resolve: Resolver) -> list[Address]:
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    if not _HOSTNAME.fullmatch(host):
        raise _refuse(url, f"{host!r} is neither an IP address nor a host name")
    try:
        found = [ipaddress.ip_address(a.split("%", 1)[0]) for a in resolve(host)]
    except (OSError, UnicodeError, ValueError) as exc:
        raise _refuse(url, f"cannot resolve {host!r} ({exc})") from None
    if not found:
        raise _refuse(url, f"{host!r} resolves to no address")
    return found


def check_replica_url(
    url: str,
    allowed: Sequence[Network],
    *,
    resolve: Resolver = system_resolve,
    forbidden: Iterable[tuple[str, int]] = (),
) -> str:
    """`url` if the router may send requests to it; `forbidden`: (host, port) endpoints that
    are never a replica (the router's Redis). Raises `ReplicaRefusedError` (param "url")."""
    if not isinstance(url, str) or not url:
        raise _refuse(str(url), "empty")
    if len(url) > 2048:
        raise _refuse(url, "longer than 2048 characters")
    if any(not "!" <= c <= "~" or c == "\\" for c in url):
        raise _refuse(url, "not printable ASCII without spaces or backslashes")
    if "?" in url or "#" in url:
        raise _refuse(url, "a query or a fragment")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise _refuse(url, f"not a valid URL ({exc})") from None
    if parts.scheme not in ("http", "https"):
        raise _refuse(url, "the scheme must be http or https")
    if "@" in parts.netloc:
        raise _refuse(url, "user info (user:password@) is not allowed")
    host = parts.hostname or ""
    if not host:
        raise _refuse(url, "no host")
    if port is None:
        port = 443 if parts.scheme == "https" else 80
    if not 1 <= port <= 65535:
        raise _refuse(url, f"port {port} is outside 1..65535")
    addrs = _addresses(url, host, resolve)
    for addr in addrs:  # every address a name resolves to: the client may connect to any
        why = address_refusal(addr, allowed)
        if why is not None:
            of = "" if str(addr) == host else f" (an address of {host!r})"
            raise _refuse(url, f"{addr}{of} is {why}")
    for f_host, f_port in forbidden:
        if f_port != port:
            continue
        if f_host.lower().rstrip(".") == host.rstrip("."):
            raise _refuse(url, f"{f_host}:{f_port} is the router's Redis")
        try:
            theirs = set(_addresses(url, f_host.lower(), resolve))
        except ReplicaRefusedError:
            continue  # the Redis host does not resolve: only its name can match
        if theirs & set(addrs):
            raise _refuse(url, f"{host}:{port} is the router's Redis ({f_host}:{f_port})")
    return url


def redis_endpoint(redis_url: str | None) -> tuple[str, int] | None:
    """The (host, port) a redis:// or rediss:// URL connects to; None for unix or no URL."""
    if not redis_url:
        return None
    try:
        parts = urlsplit(redis_url)
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in ("redis", "rediss") or not parts.hostname:
        return None
    return parts.hostname, port or 6379


@dataclass(frozen=True)
class ReplicaGuard:
    """The check every replica passes before the router probes it."""

    allowed: tuple[Network, ...] = tuple(ipaddress.ip_network(n) for n in DEFAULT_ALLOWED_NETWORKS)
    forbidden: tuple[tuple[str, int], ...] = ()
    resolve: Resolver = field(default=system_resolve, compare=False)

    @classmethod
    def of(
        cls, allowed: Iterable[Network], *, redis_url: str | None, resolve: Resolver | None = None
    ) -> ReplicaGuard:
        redis = redis_endpoint(redis_url)
        return cls(tuple(allowed), (redis,) if redis else (), resolve or system_resolve)

    def check(self, replica_id: str, url: str) -> None:
        """Raise `ReplicaRefusedError` unless the replica's id and URL are both acceptable."""
        check_replica_id(replica_id)
        check_replica_url(url, self.allowed, resolve=self.resolve, forbidden=self.forbidden)
