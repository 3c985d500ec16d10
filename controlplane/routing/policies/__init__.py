"""Routing policies, one per module, registered by name."""

from __future__ import annotations

from collections.abc import Callable

from controlplane.errors import ConfigError
from controlplane.routing.interfaces import RoutingPolicy
from controlplane.routing.policies.dynamo_kv_cost import DynamoKvCost
from controlplane.routing.policies.least_loaded import LeastLoaded
from controlplane.routing.policies.llm_d_weighted import LlmDWeighted
from controlplane.routing.policies.predicted_finish import PredictedFinish
from controlplane.routing.policies.prefix_affinity import PrefixAffinity
from controlplane.routing.policies.round_robin import RoundRobin
from controlplane.routing.policies.sglang_cache_aware import SglangCacheAware

POLICIES: dict[str, Callable[..., RoutingPolicy]] = {
    RoundRobin.name: RoundRobin,
    LeastLoaded.name: LeastLoaded,
    PrefixAffinity.name: PrefixAffinity,
    PredictedFinish.name: PredictedFinish,
    SglangCacheAware.name: SglangCacheAware,
    DynamoKvCost.name: DynamoKvCost,
    LlmDWeighted.name: LlmDWeighted,
}

OWN_POLICIES = ("round_robin", "least_loaded", "prefix_affinity", "predicted_finish")
PEER_POLICIES = ("sglang_cache_aware", "dynamo_kv_cost", "llm_d_weighted")


def make_policy(name: str, **params: object) -> RoutingPolicy:
    """Build a policy by its registered name; unknown names raise `ConfigError`."""
    try:
        factory = POLICIES[name]
    except KeyError:
        known = ", ".join(POLICIES)
        raise ConfigError(f"unknown routing policy {name!r}; known: {known}") from None
    try:
        return factory(**params)
    except TypeError as exc:
        raise ConfigError(f"bad parameters for policy {name!r}: {exc}") from exc


__all__ = ["OWN_POLICIES", "PEER_POLICIES", "POLICIES", "make_policy"]
