"""A/B arms: which routing policy serves a request, as a pure function of its sticky key.

An *arm* is a named routing policy with parameters and a weight (`policy.arms` in the router
config). Without arms the router runs one arm named after its policy (`policy.name`, e.g.
"prefix_affinity"), so every metric and span carries an `arm` label either way.

Assignment, for arms a_0..a_{k-1} in configured order with weights w_i > 0 and W = sum w_i:

    u = BLAKE2b-64(data = sticky key (UTF-8), person = "cp-ab-arm") / 2^64        in [0, 1)
    arm = the first a_i with u < (w_0 + ... + w_i) / W                (the last arm if rounding)

BLAKE2b is stable across processes, machines and Python versions (unlike `hash()`, which is
salted per process), so every router replica and every restart puts one key on one arm; no shared
state is needed. The key's share of [0, 1) is fixed, so changing a weight moves only the keys
between the old and new boundary; adding, removing or reordering arms reshuffles more.

The sticky key (`sticky_key_for`) is the tenant, or with `sticky_key: session` the session key
when the request has one (the tenant otherwise): one tenant, or one conversation, sees one arm,
and its prefix-cache locality is not split across policies. Keys are namespaced
("tenant:acme", "session:abc") so a session named like a tenant does not share its arm by design.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from controlplane.errors import ConfigError
from controlplane.routing.config import PolicyConfig

_PERSON = b"cp-ab-arm"
_SCALE = float(2**64)


@dataclass(frozen=True, slots=True)
class Arm:
    """One arm of an A/B split: a routing policy, its parameters, its relative share of keys."""

    name: str
    policy: str
    params: Mapping[str, Any] = field(default_factory=dict, hash=False)
    weight: float = 1.0


def arms_from_config(config: PolicyConfig) -> tuple[Arm, ...]:
    """The configured arms in order; without any, one arm named after `config.name`."""
    if not config.arms:
        return (Arm(name=config.name, policy=config.name, params=dict(config.params)),)
    return tuple(
        Arm(name=a.name, policy=a.policy, params=dict(a.params), weight=a.weight)
        for a in config.arms
    )


def key_fraction(sticky_key: str) -> float:
    """The key's stable position in [0, 1): BLAKE2b-64 of its UTF-8 bytes over 2^64."""
    digest = hashlib.blake2b(sticky_key.encode(), digest_size=8, person=_PERSON).digest()
    return int.from_bytes(digest, "big") / _SCALE


def assign_arm(arms: Sequence[Arm], sticky_key: str) -> Arm:
    """The arm serving `sticky_key` (see the module docstring). Raises `ConfigError` on no arms
    or a non-positive weight."""
    if not arms:
        raise ConfigError("A/B assignment needs at least one arm")
    total = 0.0
    for arm in arms:
        if not arm.weight > 0:
            raise ConfigError(f"arm {arm.name!r} has weight {arm.weight}; weights must be > 0")
        total += arm.weight
    u = key_fraction(sticky_key)
    cumulative = 0.0
    for arm in arms:
        cumulative += arm.weight
        if u < cumulative / total:
            return arm
    return arms[-1]


def sticky_key_for(config: PolicyConfig, tenant: str, session: str | None) -> str:
    """The key that keeps a client on one arm: the session (if configured and present) or the
    tenant, namespaced by kind."""
    if config.sticky_key == "session" and session:
        return f"session:{session}"
    return f"tenant:{tenant}"


__all__ = ["Arm", "arms_from_config", "assign_arm", "key_fraction", "sticky_key_for"]
