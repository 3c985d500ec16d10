"""`dns+http://name:port` router entries: expanded to every address, re-resolved on each use."""

from __future__ import annotations

import pytest

from autoscaler.router_urls import RouterUrls
from controlplane.errors import ConfigError


class FakeDns:
    """Answers from a table that a test changes between calls; unknown names fail."""

    def __init__(self, table: dict[str, list[str]]) -> None:
        self.table = table
        self.asked: list[str] = []

    async def __call__(self, name: str) -> list[str]:
        self.asked.append(name)
        if name not in self.table:
            raise OSError(f"{name}: name or service not known")
        return self.table[name]


@pytest.mark.parametrize(
    ("entries", "table", "want"),
    [
        (["http://10.0.0.1:8000/"], {}, ["http://10.0.0.1:8000"]),
        (
            ["dns+http://routers:8000"],
            {"routers": ["10.0.0.9", "10.0.0.2", "10.0.0.9"]},
            ["http://10.0.0.2:8000", "http://10.0.0.9:8000"],
        ),
        (["dns+https://routers:9443"], {"routers": ["fd00::7"]}, ["https://[fd00::7]:9443"]),
        (["dns+http://gone:8000", "http://10.0.0.1:8000"], {}, ["http://10.0.0.1:8000"]),
        (
            ["http://10.0.0.2:8000", "dns+http://routers:8000"],
            {"routers": ["10.0.0.2"]},
            ["http://10.0.0.2:8000"],
        ),
    ],
    ids=["static", "dns-sorted-deduplicated", "dns-ipv6", "unresolvable-skipped", "no-duplicate"],
)
async def test_current(entries: list[str], table: dict[str, list[str]], want: list[str]) -> None:
    assert await RouterUrls(entries, FakeDns(table)).current() == want


async def test_each_call_resolves_again() -> None:
    dns = FakeDns({"routers": ["10.0.0.1"]})
    urls = RouterUrls(["dns+http://routers:8000"], dns)
    assert await urls.current() == ["http://10.0.0.1:8000"]
    dns.table["routers"] = ["10.0.0.1", "10.0.0.3"]  # a router pod joined
    assert await urls.current() == ["http://10.0.0.1:8000", "http://10.0.0.3:8000"]
    assert dns.asked == ["routers", "routers"]


@pytest.mark.parametrize("entry", ["dns+ftp://routers:21", "dns+http://:8000", "dns+http://r/x"])
def test_malformed_entry_is_refused(entry: str) -> None:
    with pytest.raises(ConfigError, match="dns\\+http"):
        RouterUrls([entry])
