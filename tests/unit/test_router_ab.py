"""A/B arm assignment: deterministic, stable across processes, weights respected."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.errors import ConfigError
from controlplane.routing.ab import Arm, arms_from_config, assign_arm, key_fraction, sticky_key_for
from controlplane.routing.config import ArmConfig, PolicyConfig

AB = (Arm("a", "prefix_affinity", weight=1.0), Arm("b", "round_robin", weight=1.0))
SKEWED = (Arm("x", "round_robin", weight=1.0), Arm("y", "least_loaded", weight=3.0))
THREE = (
    Arm("p", "prefix_affinity", weight=0.2),
    Arm("q", "round_robin", weight=0.3),
    Arm("r", "least_loaded", weight=0.5),
)


def test_no_arms_configured_gives_one_arm_named_after_the_policy() -> None:
    cfg = PolicyConfig(name="prefix_affinity", params={"min_match_blocks": 2})
    (arm,) = arms_from_config(cfg)
    assert arm == Arm("prefix_affinity", "prefix_affinity", {"min_match_blocks": 2}, 1.0)
    assert assign_arm((arm,), "tenant:anyone") is arm


def test_configured_arms_keep_order_params_and_weights() -> None:
    cfg = PolicyConfig(
        arms=[
            ArmConfig(name="pa", policy="prefix_affinity", params={"credit_factor": 3.0}),
            ArmConfig(name="rr", policy="round_robin", weight=2.5),
        ]
    )
    assert arms_from_config(cfg) == (
        Arm("pa", "prefix_affinity", {"credit_factor": 3.0}, 1.0),
        Arm("rr", "round_robin", {}, 2.5),
    )


# Pinned: BLAKE2b is specified, so these never change across processes, machines or Python
# versions. A change here would move live tenants between arms.
@pytest.mark.parametrize(
    ("key", "fraction", "ab_arm"),
    [
        ("tenant:acme", 0.17000030138429056, "a"),
        ("tenant:globex", 0.5237221983957793, "b"),
        ("session:abc", 0.5362689778919031, "b"),
        ("", 0.9186811883086257, "b"),
    ],
)
def test_pinned_fractions(key: str, fraction: float, ab_arm: str) -> None:
    assert key_fraction(key) == pytest.approx(fraction, rel=1e-12)
    assert 0.0 <= key_fraction(key) < 1.0
    assert assign_arm(AB, key).name == ab_arm


def test_assignment_is_the_same_in_another_process() -> None:
    keys = [f"tenant:t{i}" for i in range(50)] + ["session:abc", "tenant:ünïcode"]
    here = [assign_arm(THREE, k).name for k in keys]
    code = (
        "import sys, json\n"
        "from controlplane.routing.ab import Arm, assign_arm\n"
        "arms = (Arm('p','prefix_affinity',weight=0.2), Arm('q','round_robin',weight=0.3),"
        " Arm('r','least_loaded',weight=0.5))\n"
        "keys = json.loads(sys.stdin.read())\n"
        "print(json.dumps([assign_arm(arms, k).name for k in keys]))\n"
    )
    # a different hash seed: the built-in hash() would assign differently, BLAKE2b must not
    there = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps(keys),
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
        cwd=Path(__file__).resolve().parents[2],
    )
    assert json.loads(there.stdout) == here


@pytest.mark.parametrize(
    ("fraction", "arms", "expected"),
    [
        (0.0, AB, "a"),
        (0.4999, AB, "a"),
        (0.5, AB, "b"),
        (0.9999, AB, "b"),
        (0.2499, SKEWED, "x"),
        (0.25, SKEWED, "y"),
        (0.1999, THREE, "p"),
        (0.2, THREE, "q"),
        (0.4999, THREE, "q"),
        (0.5, THREE, "r"),
    ],
)
def test_boundaries_follow_cumulative_weights(
    monkeypatch: pytest.MonkeyPatch, fraction: float, arms: tuple[Arm, ...], expected: str
) -> None:
    monkeypatch.setattr("controlplane.routing.ab.key_fraction", lambda key: fraction)
    assert assign_arm(arms, "whatever").name == expected


@pytest.mark.parametrize("arms", [AB, SKEWED, THREE], ids=["50-50", "25-75", "20-30-50"])
def test_weights_respected_over_10k_keys(arms: tuple[Arm, ...]) -> None:
    n = 10_000
    counts = Counter(assign_arm(arms, f"tenant:{i}").name for i in range(n))
    total = sum(a.weight for a in arms)
    for arm in arms:
        p = arm.weight / total
        sd = math.sqrt(n * p * (1 - p))
        # 5 binomial standard deviations: a false failure has probability < 1e-6 per arm
        assert abs(counts[arm.name] - n * p) < 5 * sd, (arm.name, counts[arm.name], n * p)


@pytest.mark.parametrize(
    ("sticky", "tenant", "session", "expected"),
    [
        ("tenant", "acme", None, "tenant:acme"),
        ("tenant", "acme", "s1", "tenant:acme"),
        ("session", "acme", "s1", "session:s1"),
        ("session", "acme", None, "tenant:acme"),
        ("session", "acme", "", "tenant:acme"),
    ],
)
def test_sticky_key(sticky: str, tenant: str, session: str | None, expected: str) -> None:
    cfg = PolicyConfig.model_validate({"sticky_key": sticky})
    assert sticky_key_for(cfg, tenant, session) == expected


@pytest.mark.parametrize(
    ("arms", "message"),
    [
        ((), "at least one arm"),
        ((Arm("a", "round_robin", weight=0.0),), "weights must be > 0"),
        ((Arm("a", "round_robin", weight=float("nan")),), "weights must be > 0"),
    ],
)
def test_bad_arms(arms: tuple[Arm, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        assign_arm(arms, "tenant:t")


arm_lists = st.lists(
    st.floats(min_value=1e-3, max_value=1e3, allow_nan=False), min_size=1, max_size=6
).map(lambda ws: tuple(Arm(f"arm{i}", "round_robin", weight=w) for i, w in enumerate(ws)))


@given(arms=arm_lists, key=st.text(max_size=40))
def test_assignment_is_a_pure_function_returning_a_configured_arm(
    arms: tuple[Arm, ...], key: str
) -> None:
    first = assign_arm(arms, key)
    assert first in arms
    assert assign_arm(arms, key) == first
    assert assign_arm(list(arms), key) == first


@given(weights=st.lists(st.integers(1, 100), min_size=2, max_size=5), key=st.text(max_size=20))
def test_scaling_all_weights_changes_nothing(weights: list[int], key: str) -> None:
    arms = tuple(Arm(f"a{i}", "round_robin", weight=w) for i, w in enumerate(weights))
    scaled = tuple(Arm(a.name, a.policy, weight=a.weight * 7) for a in arms)
    assert assign_arm(arms, key).name == assign_arm(scaled, key).name
