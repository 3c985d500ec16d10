"""API key -> tenant, cache salts and their index scope: the key ring and salt policy as pure
objects, the CLI that makes keys, and the KV-event ingestor reading back the salt the simulated
replica (like vLLM) reports, in the scope the router hashes a tenant's request in."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
from collections.abc import Mapping

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from controlplane.cli import _register, app
from controlplane.errors import AuthError, ConfigError
from controlplane.hashing import BlockHasher, scope_key, vllm_block_hashes
from controlplane.kvevents.ingest import EventIngestor, cache_salt_of
from controlplane.kvevents.wire import WireBatch, WireBlockStored
from controlplane.prefix.memory import InMemoryPrefixIndex
from controlplane.sim.kv_events import BlockStored
from controlplane.sim_replica.blocks import BlockHashTable
from controlplane.tenancy.identity import AuthReason, KeyRejected, KeyRing, key_digest, new_key
from controlplane.tenancy.model import DEFAULT_TENANT, Tenant
from controlplane.tenancy.salts import (
    PublicPrefix,
    SaltPolicy,
    SaltReason,
    prefix_digest,
    public_salt,
    tenant_salt,
)
from controlplane.types import PriorityClass
from router.config import load_settings

KA, KB = "cpk-key-of-tenant-a", "cpk-key-of-tenant-b"
SECRET = b"salt-secret"


def ring() -> KeyRing:
    r = KeyRing(SECRET)
    r.put(Tenant("a", weight=2.0), [key_digest(KA)])
    r.put(Tenant("b", priority=PriorityClass.BATCH), [key_digest(KB), key_digest(KB + "2")])
    return r


SPOOF = {"x-tenant-id": "b", "openai-organization": "b", "openai-project": "b", "tenant": "b"}
CASES: list[tuple[str, dict[str, str], str | AuthReason]] = [
    ("bearer", {"authorization": f"Bearer {KA}"}, "a"),
    ("scheme any case, spaces", {"authorization": f"bEaReR   {KA}  "}, "a"),
    ("azure api-key", {"api-key": KB}, "b"),
    ("x-api-key", {"x-api-key": KB + "2"}, "b"),
    ("same key twice", {"authorization": f"Bearer {KA}", "api-key": KA}, "a"),
    ("spoofing headers change nothing", {"authorization": f"Bearer {KA}", **SPOOF}, "a"),
    ("none", {}, AuthReason.MISSING),
    ("only spoofing headers", SPOOF, AuthReason.MISSING),
    ("empty", {"authorization": "  "}, AuthReason.MISSING),
    ("basic scheme", {"authorization": f"Basic {KA}"}, AuthReason.MALFORMED),
    ("bare key in authorization", {"authorization": KA}, AuthReason.MALFORMED),
    ("bearer without key", {"authorization": "Bearer"}, AuthReason.MALFORMED),
    ("two tokens", {"authorization": f"Bearer {KA} {KB}"}, AuthReason.MALFORMED),
    ("control character", {"api-key": KA + "\x01"}, AuthReason.MALFORMED),
    ("too long", {"api-key": "k" * 513}, AuthReason.MALFORMED),
    ("two keys", {"authorization": f"Bearer {KA}", "x-api-key": KB}, AuthReason.CONFLICTING),
    ("unknown", {"authorization": "Bearer cpk-nobody"}, AuthReason.UNKNOWN),
    ("a digest is not a key", {"authorization": f"Bearer {key_digest(KA)}"}, AuthReason.UNKNOWN),
]


@pytest.mark.parametrize(("headers", "want"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_authenticate(headers: dict[str, str], want: str | AuthReason) -> None:
    r = ring()
    if not isinstance(want, AuthReason):
        assert r.authenticate(headers).tenant_id == want
        return
    with pytest.raises(KeyRejected) as exc:
        r.authenticate(headers)
    assert exc.value.reason is want
    assert isinstance(exc.value, AuthError) and exc.value.status_code == 401
    for secret in (KA, KB, key_digest(KA)[:8]):
        assert secret not in str(exc.value)  # a refusal never echoes a key


class _MultiHeaders:
    """Starlette-like headers with a repeated field."""

    def __init__(self, items: list[tuple[str, str]]) -> None:
        self.items = items

    def get(self, key: str, default: None = None) -> str | None:
        return next((v for k, v in self.items if k == key), default)

    def getlist(self, key: str) -> list[str]:
        return [v for k, v in self.items if k == key]


def test_repeated_authorization_headers_that_differ_conflict() -> None:
    headers = _MultiHeaders([("authorization", f"Bearer {KA}"), ("authorization", f"Bearer {KB}")])
    with pytest.raises(KeyRejected) as exc:
        ring().authenticate(headers)
    assert exc.value.reason is AuthReason.CONFLICTING


@pytest.mark.parametrize("key", [KA, "cpk-nobody"])
def test_the_final_comparison_is_constant_time(monkeypatch: pytest.MonkeyPatch, key: str) -> None:
    calls: list[tuple[str, str]] = []
    real = hmac.compare_digest

    def spy(a: str, b: str) -> bool:
        calls.append((a, b))
        return bool(real(a, b))

    monkeypatch.setattr(hmac, "compare_digest", spy)
    r = ring()
    with contextlib.suppress(KeyRejected):
        r.authenticate({"authorization": f"Bearer {key}"})
    assert len(calls) == 1  # a hit and a miss do the same comparison
    assert calls[0][1] == key_digest(key)


def test_the_ring_holds_digests_never_keys() -> None:
    r = ring()
    r.authenticate({"api-key": KA})

    def strings(obj: object, depth: int = 0) -> list[str]:
        if depth > 5:
            return []
        if isinstance(obj, str):
            return [obj]
        if isinstance(obj, Mapping):
            return [s for kv in obj.items() for x in kv for s in strings(x, depth + 1)]
        if isinstance(obj, list | tuple | set | frozenset):
            return [s for x in obj for s in strings(x, depth + 1)]
        if hasattr(obj, "__dict__") or hasattr(obj, "__slots__"):
            names = list(getattr(obj, "__dict__", {})) + list(getattr(obj, "__slots__", ()))
            return [s for n in names for s in strings(getattr(obj, n, None), depth + 1)]
        return []

    held = strings(r)
    assert key_digest(KA) in held
    assert not [s for s in held if KA in s or KB in s]


def test_open_mode_is_the_default_tenant_whatever_the_headers() -> None:
    r = KeyRing(SECRET)
    assert r.open_mode
    for headers in ({}, {"authorization": f"Bearer {KA}"}, SPOOF, {"authorization": "Basic x"}):
        assert r.authenticate(headers) is DEFAULT_TENANT
    assert DEFAULT_TENANT.salt == ""


def test_required_keys_never_reopen() -> None:
    r = KeyRing(SECRET, require_keys=True)
    with pytest.raises(KeyRejected):
        r.authenticate({})
    r = ring()
    assert r.remove("a") is not None and r.remove("b") is not None
    assert r.remove("b") is None
    assert not r.open_mode  # removing the last tenant does not make the router open
    with pytest.raises(KeyRejected) as exc:
        r.authenticate({"api-key": KA})
    assert exc.value.reason is AuthReason.UNKNOWN


def test_put_replaces_keys_and_derives_the_salt() -> None:
    r = ring()
    stored = r.put(Tenant("a", weight=3.0, salt="chosen-by-someone"), [key_digest("new")])
    assert stored.salt == tenant_salt(SECRET, "a") and stored.weight == 3.0
    assert r.authenticate({"api-key": "new"}) == stored
    with pytest.raises(KeyRejected):
        r.authenticate({"api-key": KA})  # the old key of a replaced tenant stops working
    assert r.key_count("a") == 1 and r.key_count("b") == 2


@pytest.mark.parametrize(
    ("tenant_id", "digests", "match"),
    [
        ("c", [key_digest(KB)], "belongs to tenant 'b'"),
        ("c", ["ABC"], "64 lower-case hex"),
        ("c", [key_digest(KA).upper()], "64 lower-case hex"),
        ("c\x00public\x00x", [], "tenant ids"),
        ("", [], "tenant ids"),
    ],
)
def test_put_refuses(tenant_id: str, digests: list[str], match: str) -> None:
    r = ring()
    with pytest.raises(ConfigError, match=match):
        r.put(Tenant(tenant_id), digests)
    assert [t.tenant_id for t in r.tenants()] == ["a", "b"]


# -- salts ------------------------------------------------------------------------------------
def test_salt_derivation_is_deterministic_and_secret_dependent() -> None:
    assert tenant_salt(SECRET, "a") == tenant_salt(SECRET, "a")
    assert tenant_salt(SECRET, "a") != tenant_salt(b"other", "a")
    assert tenant_salt(SECRET, "a") != tenant_salt(SECRET, "b")
    assert public_salt(SECRET, "a") != tenant_salt(SECRET, "a")
    assert tenant_salt(SECRET, "a") == hmac.new(SECRET, b"a", hashlib.sha256).hexdigest()


@given(st.text(min_size=1, max_size=64), st.text(min_size=1, max_size=64), st.binary())
def test_salts_are_distinct_and_valid_for_vllm(a: str, b: str, secret: bytes) -> None:
    sa, sb = tenant_salt(secret, a), tenant_salt(secret, b)
    assert (sa == sb) == (a == b)
    for s in (sa, sb, public_salt(secret, a)):
        assert 0 < len(s) <= 128 and not set(s) & set("@/\\\0")


IDS = list(range(1, 101))
PUB = PublicPrefix("sys", prefix_digest(IDS[:32]), 32)
PUB_LONG = PublicPrefix("sys-long", prefix_digest(IDS[:48]), 48, frozenset({"a"}))
TA, TB = ring().get("a"), ring().get("b")
assert TA is not None and TB is not None
SALT_CASES: list[tuple[str, Tenant, list[int], object, bool, SaltReason, str | None]] = [
    ("open, client salt kept", DEFAULT_TENANT, IDS, "mine", False, SaltReason.CLIENT, None),
    ("open, none", DEFAULT_TENANT, IDS, None, False, SaltReason.NONE, None),
    ("open, not a string", DEFAULT_TENANT, IDS, 5, False, SaltReason.NONE, None),
    ("client salt overwritten", TB, [7, *IDS], TA.salt, False, SaltReason.TENANT, TB.salt),
    ("public prefix", TB, IDS, "x", False, SaltReason.PUBLIC_PREFIX, PUB.name),
    ("longest open prefix", TA, IDS, None, False, SaltReason.PUBLIC_PREFIX, PUB_LONG.name),
    ("prompt shorter than it", TB, IDS[:31], None, False, SaltReason.TENANT, TB.salt),
    ("a batch never shares", TB, IDS, None, True, SaltReason.TENANT, TB.salt),
]


@pytest.mark.parametrize(
    ("tenant", "ids", "client", "batch", "reason", "want"),
    [c[1:] for c in SALT_CASES],
    ids=[c[0] for c in SALT_CASES],
)
def test_salt_choice(
    tenant: Tenant,
    ids: list[int],
    client: object,
    batch: bool,
    reason: SaltReason,
    want: str | None,
) -> None:
    policy = SaltPolicy(SECRET, [PUB, PUB_LONG])
    choice = policy.choose(tenant, ids, client, batch=batch)
    assert choice.reason is reason
    if reason is SaltReason.PUBLIC_PREFIX:
        assert choice.prefix == want and choice.salt == public_salt(SECRET, str(want))
    else:
        assert choice.salt == want
    client_scope = client if isinstance(client, str) else ""
    assert choice.scope == (choice.salt if choice.salt is not None else client_scope)


# -- the index scope: what the router hashes == what the ingestor files ------------------------
@pytest.mark.parametrize(
    ("extra", "lora", "want"),
    [
        (("s3cr3t",), None, "s3cr3t"),  # vLLM's untagged form
        (("my-lora", "s3cr3t"), "my-lora", "s3cr3t"),
        (("my-lora",), "my-lora", None),
        ((("abc123", 0), "s"), None, "s"),  # an mm key first
        ((("cache_salt", "t"),), None, "t"),  # the tagged form
        ((b"\x01" * 32,), None, None),  # prompt embeds only
        (None, None, None),
    ],
)
def test_cache_salt_of_event_extra_keys(extra: object, lora: str | None, want: str | None) -> None:
    assert cache_salt_of(extra, lora) == want


async def test_a_salted_replica_chain_is_indexed_in_the_tenants_scope_only() -> None:
    bs, model, hash_secret = 16, "tiny-llama", b"hash-secret"
    table = BlockHashTable(bs, algo="sha256", seed="0", id_limit=1024)
    salt_a = tenant_salt(SECRET, "a")
    ids = table.acquire(IDS[:64], cache_salt=salt_a)
    # block 0 is salted as vLLM salts it, so its engine hash differs from the unsalted chain
    salted = vllm_block_hashes(IDS[:64], bs, seed="0", cache_salt=salt_a)
    assert [table.event_hash(i) for i in ids] == salted
    assert salted[0] != vllm_block_hashes(IDS[:64], bs, seed="0")[0]
    ev = BlockStored(block_hashes=list(ids), parent_block_hash=None, block_size=bs)
    [wire] = table.translate([ev])
    assert isinstance(wire, WireBlockStored)
    assert wire.extra_keys == ((salt_a,), None, None, None)
    index = InMemoryPrefixIndex(clock=lambda: 0.0)
    ingestor = EventIngestor("r1", index, model=model, secret=hash_secret)
    await ingestor.apply(WireBatch(ts=0.0, events=(wire,)))

    def router_hashes(salt: str) -> list[int]:
        return BlockHasher(bs, scope_key(model, None, salt, hash_secret)).hash_blocks(IDS[:64])

    assert index.lookup(router_hashes(salt_a), ["r1"])["r1"].matched_blocks == 4
    for other in (tenant_salt(SECRET, "b"), ""):
        assert "r1" not in index.lookup(router_hashes(other), ["r1"])


# -- the CLI --------------------------------------------------------------------------------------
def test_cli_key_prints_a_key_and_its_digest() -> None:
    _register()
    res = CliRunner().invoke(app, ["tenant", "key", "--id", "acme", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["tenant"] == "acme" and out["sha256"] == key_digest(out["api_key"])
    assert len(out["api_key"]) > 40 and new_key()[0] != out["api_key"]


def test_cli_prefix_entry_loads_as_config() -> None:
    _register()
    res = CliRunner().invoke(app, ["tenant", "prefix", "sys", "--token-ids", "1,2,3"])
    assert res.exit_code == 0, res.output
    entry = yaml.safe_load(res.output)["public_prefixes"][0]
    assert entry["tokens_sha256"] == prefix_digest([1, 2, 3]) and entry["num_tokens"] == 3
    assert load_settings(public_prefixes=[entry]).public_prefixes[0].name == "sys"
