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
    name: str = Field(description="Arm name (the `arm` label of every metric and span).")
    policy: str = Field(description="Registered routing policy name.")
    params: dict[str, Any] = Field(default_factory=dict, description="Policy parameters.")
    weight: float = Field(default=1.0, gt=0, description="Relative share of sticky keys.")


class PolicyConfig(Section):
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
    reservations: bool = Field(default=True, description="Track own in-flight work per replica.")
    speculative: bool = Field(
        default=True, description="Write speculative index entries at routing time."
    )
    speculative_ttl_s: float = Field(default=10.0, gt=0, description="Speculative entry TTL.")

    @model_validator(mode="after")
    def _unique_arms(self) -> PolicyConfig:
        names = [a.name for a in self.arms]
        if len(names) != len(set(names)):
            raise ValueError(f"arm names must be unique: {names}")
        return self
