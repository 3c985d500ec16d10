"""The routing settings both hosts read: the policy (or an A/B split of arms) and the books.

One pydantic model, the live router's `policy:` section (`router.config.RouterSettings.policy`),
and the simulator's `FleetConfig.policy`: a replay of a router configuration runs the same arms
with the same parameters and the same bookkeeping defaults.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Section(BaseModel):
    """A frozen settings section that refuses unknown keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ArmConfig(Section):
    """One arm of an A/B split: a registered policy with parameters and a share of keys."""

    name: str = Field(description="Arm name (the `arm` label of every metric and span).")
    policy: str = Field(description="Registered routing policy name.")
    params: dict[str, Any] = Field(default_factory=dict, description="Policy parameters.")
    weight: float = Field(default=1.0, gt=0, description="Relative share of sticky keys.")


class PolicyConfig(Section):
    """How a router chooses replicas, and what it books around each choice."""

    name: str = Field(default="prefix_affinity", description="Routing policy (no A/B split).")
    params: dict[str, Any] = Field(default_factory=dict, description="Its parameters.")
    arms: list[ArmConfig] = Field(
        default_factory=list, description="A/B split: when non-empty, replaces name/params."
    )
    sticky_key: Literal["tenant", "session"] = Field(
        default="tenant",
        description="What keeps a client on one arm: its tenant, or the session key "
        "(`user` field / x-session-id header; tenant when absent).",
    )
    reservations: bool = Field(
        default=True,
        description="Keep this router's in-flight work per replica (the ledger) and count it in "
        "the load the policy sees; off: scraped metrics only.",
    )
    speculative: bool = Field(
        default=True,
        description="Write a speculative prefix-index entry for the chosen replica at routing "
        "time, before its KV events can confirm the blocks.",
    )
    speculative_ttl_s: float = Field(
        default=60.0,
        gt=0,
        description="Lifetime of a speculative entry whose request has no first token yet (one "
        "that has is retracted after retract_grace_s). It must outlast the queue wait: an entry "
        "that expires while its request still waits hides the prefix from the next request that "
        "shares it (in overload, a conversation's next turn then lands elsewhere). The default "
        "is the router's first-byte deadline (timeouts.ttft_s).",
    )
    retract_grace_s: float = Field(
        default=1.0,
        ge=0,
        description="After a request's first token its speculative entry lives this much longer, "
        "for the KV events of its blocks to arrive; then the events are the only truth.",
    )

    @model_validator(mode="after")
    def _unique_arms(self) -> PolicyConfig:
        names = [a.name for a in self.arms]
        if len(names) != len(set(names)):
            raise ValueError(f"arm names must be unique: {names}")
        return self
