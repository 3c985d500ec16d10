"""Model groups of the live fleet: which replicas serve which model, and their drift.

    groups = model_groups({replica_id: info, ...})     pure, over `ReplicaInfo` values
    groups.models                  every served model name (what /v1/models lists)
    groups.get("tiny-llama")       ModelGroup: members, drift, the group's block size and context

A model's group is every replica whose description lists it. Its reference configuration is
`controlplane.drift.find_drift`'s (the one most members share, ties to the smallest id); the
group's block size and `max_model_len` are the reference's, so prompts are hashed and limited as
the majority of its replicas would. A request goes only to members whose own context holds it
(`fitting`): a drifted member with a shorter context never gets one it would refuse. A drifted
member stays in the group (routable) and is listed in `affinity_excluded`: the router scores it
as a prefix miss.

`drift_changes` turns two successive verdicts into what changed: the fleet logs one line per
replica whose drift changed and sets the `cp_replica_drift` gauge from the current verdict.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from controlplane.drift import DriftField, GroupDrift, find_drift
from controlplane.replica_info import ReplicaInfo


@dataclass(frozen=True, slots=True)
class ModelGroup:
    model: str
    members: frozenset[str]
    drift: GroupDrift
    block_size: int | None
    max_model_len: int | None
    # each member's own max_model_len (a drifted member's may be smaller than the group's)
    contexts: Mapping[str, int | None] = field(default_factory=dict)

    @property
    def affinity_excluded(self) -> frozenset[str]:
        return frozenset(self.drift.drifted)

    def status(self) -> dict[str, object]:
        """A JSON-able row for GET /admin/models."""
        return {
            "model": self.model,
            "members": sorted(self.members),
            "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "reference": self.drift.reference_dict(),
            "drifted": {rid: [str(f) for f in fs] for rid, fs in self.drift.drifted.items()},
        }

    def fitting(self, tokens: int) -> frozenset[str]:
        """The members whose own context holds `tokens` (prompt + max_tokens); unknown: kept."""
        return frozenset(
            rid for rid in self.members if (self.contexts.get(rid) or tokens) >= tokens
        )


@dataclass(frozen=True, slots=True)
class ModelGroups:
    groups: Mapping[str, ModelGroup] = field(default_factory=dict)

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(sorted(self.groups))

    def get(self, model: str) -> ModelGroup | None:
        return self.groups.get(model)

    def drift_of(self) -> dict[str, tuple[tuple[str, DriftField], ...]]:
        """replica id -> ((model, field), ...) over every group."""
        out: dict[str, list[tuple[str, DriftField]]] = {}
        for g in self.groups.values():
            for rid, fields in g.drift.drifted.items():
                out.setdefault(rid, []).extend((g.model, f) for f in fields)
        return {rid: tuple(v) for rid, v in out.items()}


def model_groups(infos: Mapping[str, ReplicaInfo]) -> ModelGroups:
    """Group the described replicas by served model (see the module docstring)."""
    names = sorted({m.name for info in infos.values() for m in info.models})
    groups = {}
    for name in names:
        members = frozenset(rid for rid, info in infos.items() if info.model(name))
        drift = find_drift(infos, name)
        ref = drift.reference
        groups[name] = ModelGroup(
            model=name,
            members=members,
            drift=drift,
            block_size=ref[0] if ref and isinstance(ref[0], int) else None,
            max_model_len=ref[1] if ref and isinstance(ref[1], int) else None,
            contexts={rid: _context(infos[rid], name) for rid in members},
        )
    return ModelGroups(groups)


def _context(info: ReplicaInfo, model: str) -> int | None:
    card = info.model(model)
    return card.max_model_len if card is not None else None


def drift_changes(
    before: ModelGroups, after: ModelGroups
) -> list[tuple[str, tuple[tuple[str, DriftField], ...]]]:
    """(replica, its drift now) for every replica whose drift changed (empty tuple: cleared)."""
    old, new = before.drift_of(), after.drift_of()
    ids = sorted(set(old) | set(new))
    return [(rid, new.get(rid, ())) for rid in ids if old.get(rid) != new.get(rid)]
