"""Configuration drift between replicas of one model, and the diff of two replica descriptions.

Drift (pure, over `ReplicaInfo` values):

1. For one served model, each replica serving it has a *drift key*: block size, the model's
   `max_model_len`, prefix caching on/off, the prefix-cache hash algorithm, the vLLM version.
2. The group's reference key is the one most replicas share; a tie goes to the key of the
   replica whose id sorts first (so the answer never depends on dict order or timing).
3. Every replica whose key differs is drifted, with one `DriftField` per differing part (the
   metric label). A drifted replica stays routable but is kept out of prefix affinity: its
   block hashes are not the group's, so an index match on it would be a lie.

`diff(a, b)` lists every difference of two descriptions (served models, each model's context,
the cache configuration label by label, version, architecture): what changed after an upgrade.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from controlplane.replica_info import ReplicaInfo


class DriftField(StrEnum):
    """What differs from the group's reference configuration (metric label `field`)."""

    BLOCK_SIZE = "block_size"
    MAX_MODEL_LEN = "max_model_len"
    PREFIX_CACHING = "prefix_caching"
    HASH_ALGO = "hash_algo"
    VERSION = "version"


DriftKey = tuple[object, object, object, object, object]


def drift_key(info: ReplicaInfo, model: str) -> DriftKey:
    card = info.model(model)
    return (
        info.block_size,
        card.max_model_len if card else None,
        info.enable_prefix_caching,
        info.prefix_caching_hash_algo,
        info.version,
    )


_FIELDS = tuple(DriftField)


@dataclass(frozen=True, slots=True)
class GroupDrift:
    """The drift verdict of one model group."""

    model: str
    reference: DriftKey | None
    drifted: Mapping[str, tuple[DriftField, ...]]  # replica id -> what differs

    def reference_dict(self) -> dict[str, object]:
        return dict(zip((str(f) for f in _FIELDS), self.reference or (), strict=False))


def find_drift(infos: Mapping[str, ReplicaInfo], model: str) -> GroupDrift:
    """The drift of the replicas (id -> description) that serve `model` (others are ignored)."""
    keys = {rid: drift_key(info, model) for rid, info in infos.items() if info.model(model)}
    if not keys:
        return GroupDrift(model, None, {})
    counts = Counter(keys.values())
    top = max(counts.values())
    first_id = min(rid for rid, k in keys.items() if counts[k] == top)
    ref = keys[first_id]
    drifted = {
        rid: tuple(f for f, mine, theirs in zip(_FIELDS, k, ref, strict=True) if mine != theirs)
        for rid, k in sorted(keys.items())
        if k != ref
    }
    return GroupDrift(model, ref, drifted)


@dataclass(frozen=True, slots=True)
class Difference:
    """One field that differs between two descriptions (None: absent on that side)."""

    field: str
    a: object
    b: object


_SCALARS = (
    "block_size",
    "num_gpu_blocks",
    "enable_prefix_caching",
    "prefix_caching_hash_algo",
    "hash_block_size",
    "version",
    "architecture",
    "model_type",
)


def diff(a: ReplicaInfo, b: ReplicaInfo) -> tuple[Difference, ...]:
    """Every difference between two descriptions, in a stable order (the URL is not one)."""
    out: list[Difference] = []
    names_a, names_b = a.model_names, b.model_names
    if sorted(names_a) != sorted(names_b):
        out.append(Difference("models", sorted(names_a), sorted(names_b)))
    for name in sorted(set(names_a) & set(names_b)):
        ca, cb = a.model(name), b.model(name)
        assert ca is not None and cb is not None
        for attr in ("max_model_len", "root", "parent"):
            va, vb = getattr(ca, attr), getattr(cb, attr)
            if va != vb:
                out.append(Difference(f"model[{name}].{attr}", va, vb))
    for attr in _SCALARS:
        va, vb = getattr(a, attr), getattr(b, attr)
        if va != vb:
            out.append(Difference(attr, va, vb))
    covered = {"block_size", "num_gpu_blocks", "enable_prefix_caching"}
    covered |= {"prefix_caching_hash_algo", "hash_block_size", "engine"}
    for label in sorted((set(a.cache_labels) | set(b.cache_labels)) - covered):
        va, vb = a.cache_labels.get(label), b.cache_labels.get(label)
        if va != vb:
            out.append(Difference(f"cache_config.{label}", va, vb))
    return tuple(out)
