"""Roofline model of a vLLM replica: step time, memory, KV capacity and concurrency ceilings."""

from controlplane.roofline.capacity import Ceiling, CeilingKind, concurrency_ceilings
from controlplane.roofline.profile import VLLM_REFERENCE_VERSION, EngineProfile, profile
from controlplane.roofline.specs import GPUS, MODELS, GpuSpec, ModelSpec
from controlplane.roofline.step import StepCostModel

__all__ = [
    "GPUS",
    "MODELS",
    "VLLM_REFERENCE_VERSION",
    "Ceiling",
    "CeilingKind",
    "EngineProfile",
    "GpuSpec",
    "ModelSpec",
    "StepCostModel",
    "concurrency_ceilings",
    "profile",
]
