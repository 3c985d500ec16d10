"""DNS discovery: a headless service's A/AAAA records are the fleet.

    source = dns_source(registry, name="vllm.ns.svc.cluster.local", port=8000, scheme="http",
                        interval_s=10.0)
    source.start()    # every interval: resolve off the event loop, report the whole view

Each address becomes one member, id `dns-<address>` (dots and colons as dashes: `dns-10-0-3-7`,
`dns-fd00--7`), URL `scheme://address:port` (IPv6 in brackets); the registry's guard checks both.
A failed resolution reports nothing (the last view stands: a DNS outage is not an empty fleet);
an answer with no address is an empty view.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Sequence

from router.fleet.membership import Member, MembershipSink
from router.fleet.sources import PollingSource
from router.fleet.urls import Resolver, system_resolve

log = logging.getLogger(__name__)

SOURCE = "dns"


def member_of(
    address: str, port: int, scheme: str, *, model: str | None, gpu: str | None
) -> Member:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    host = f"[{ip}]" if ip.version == 6 else str(ip)
    rid = "dns-" + str(ip).replace(".", "-").replace(":", "-")
    return Member(rid, f"{scheme}://{host}:{port}", model=model, gpu=gpu)


def resolve_members(
    name: str,
    port: int,
    scheme: str,
    resolve: Resolver = system_resolve,
    *,
    model: str | None = None,
    gpu: str | None = None,
) -> list[Member]:
    """The members `name` resolves to now (blocking; `OSError` when it does not resolve)."""
    addresses = sorted(set(resolve(name)))
    members = []
    for a in addresses:
        try:
            members.append(member_of(a, port, scheme, model=model, gpu=gpu))
        except ValueError:
            log.warning("dns answer is not an address", extra={"dns_name": name, "answer": a[:80]})
    return members


def dns_source(
    sink: MembershipSink,
    *,
    name: str,
    port: int,
    scheme: str,
    interval_s: float,
    resolve: Resolver = system_resolve,
    model: str | None = None,
    gpu: str | None = None,
) -> PollingSource:
    def poll() -> Sequence[Member]:
        return resolve_members(name, port, scheme, resolve, model=model, gpu=gpu)

    return PollingSource(sink, SOURCE, poll, interval_s)
