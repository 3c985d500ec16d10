"""SloCapacity: the work unit, the SLO decode batch and the Kingman utilization target."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from autoscaler.capacity import SloCapacity, kingman_p99_wait, max_utilization
from controlplane.errors import ConfigError
from controlplane.roofline.capacity import concurrency_ceilings
from controlplane.roofline.profile import profile
from controlplane.roofline.step import StepCostModel

# the reference's table of max rho with p99 wait <= K * E[S] (anchors.md section 4)
KINGMAN_TABLE = [
    (5, 0.0, 0.59),
    (5, 1.0, 0.31),
    (10, 0.5, 0.68),
    (15, 1.0, 0.72),
    (15, 2.0, 0.59),
    (20, 4.0, 0.51),
    (40, 4.0, 0.73),
]


@pytest.mark.parametrize(("k", "scv", "expected"), KINGMAN_TABLE)
def test_max_utilization_matches_the_reference_table(k: float, scv: float, expected: float) -> None:
    assert max_utilization(1.0, scv, k) == pytest.approx(expected, abs=0.01)


@given(
    mean=st.floats(0.01, 5.0),
    scv=st.floats(0.0, 8.0),
    budget=st.floats(0.05, 100.0),
)
def test_max_utilization_is_the_largest_feasible(mean: float, scv: float, budget: float) -> None:
    rho = max_utilization(mean, scv, budget)
    assert 0.01 <= rho < 1.0
    assert kingman_p99_wait(mean, scv, rho) <= budget * (1 + 1e-9)
    if rho < 0.998:
        assert kingman_p99_wait(mean, scv, min(0.999, rho + 1e-3)) > budget


PROFILES = [("h100", "llama-3.1-8b", 1), ("h100", "llama-3.1-70b", 4), ("a100", "qwen3-32b", 2)]


@pytest.mark.parametrize(("gpu", "model", "tp"), PROFILES)
def test_decode_batch_is_the_largest_meeting_the_tpot_slo(gpu: str, model: str, tp: int) -> None:
    prof = profile(gpu, model, tp=tp)
    cap = SloCapacity.build(prof, 2.0, 0.1)
    cost = StepCostModel.from_profile(prof)
    b = cap.decode_batch
    assert cost.decode_step_time(b, b * 2048) <= 0.1 * 0.8
    ceiling = concurrency_ceilings(prof, 2048).sequences  # max_num_seqs, KV or compute ridge
    assert b <= ceiling
    assert b == ceiling or cost.decode_step_time(b + 1, (b + 1) * 2048) > 0.08
    # a replica decoding b sequences at the reference context accrues one replica-second/s
    per_token = cap.decode_work(2, 2048)
    assert per_token * b / cost.decode_step_time(b, b * 2048) == pytest.approx(1.0, rel=1e-3)


@pytest.mark.parametrize(("gpu", "model", "tp"), PROFILES)
def test_work_grows_with_length_and_cache_hits_cut_prefill(gpu: str, model: str, tp: int) -> None:
    cap = SloCapacity.build(profile(gpu, model, tp=tp), 2.0, 0.1)
    assert 0 < cap.prefill_work(512) < cap.prefill_work(4096)
    assert cap.prefill_work(4096, cached_tokens=3072) < cap.prefill_work(4096)
    assert cap.decode_work(1, 100) == 0.0
    assert cap.decode_work(200, 2000) > cap.decode_work(200, 200) > 0
    assert cap.request_work(1000, 100) == pytest.approx(
        cap.prefill_work(1000) + cap.decode_work(100, 1000)
    )


def test_utilization_target_tightens_with_variability_and_a_tight_slo() -> None:
    prof = profile("h100", "llama-3.1-70b", tp=4)
    loose = SloCapacity.build(prof, 4.0, 0.1)
    tight = SloCapacity.build(prof, 1.0, 0.1)
    s = 0.1
    assert loose.utilization_target(s, 1.0) > tight.utilization_target(s, 1.0)
    assert tight.utilization_target(s, 0.5) > tight.utilization_target(s, 4.0)
    assert loose.utilization_target(0.0, 1.0) == loose.decode_ceiling
    # an SLO shorter than the prefill itself: the floor, never zero
    assert tight.utilization_target(2.0, 1.0) == tight.min_utilization
    assert not math.isnan(tight.utilization_target(1e-6, 0.0))


@pytest.mark.parametrize(("ttft", "tpot"), [(0.0, 0.1), (2.0, 0.0), (-1.0, 0.1)])
def test_bad_slos_are_refused(ttft: float, tpot: float) -> None:
    with pytest.raises(ConfigError):
        SloCapacity.build(profile("h100", "llama-3.1-8b"), ttft, tpot)
