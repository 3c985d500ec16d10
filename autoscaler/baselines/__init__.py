"""The autoscaling baselines the headroom policy is compared with (anchors.md section 3).

Each is a pure `ScalingPolicy` over a frozen config and a frozen state, one per module:

- `ray_default`: Ray Serve's default (ongoing requests / 2, 30 s up / 600 s down delays);
- `kpa`: Knative's KPA (stable 60 s / panic 6 s windows on concurrency);
- `hpa_gpu_util`: the Kubernetes HPA on GPU utilization (target 80%, tolerance 10%, 300 s
  scale-down stabilization);
- `static_peak`: a fixed count provisioned for the trace's peak minute.
"""

from __future__ import annotations

from autoscaler.baselines.hpa_gpu_util import HpaConfig, HpaGpuUtilPolicy, HpaState
from autoscaler.baselines.kpa import KpaConfig, KpaPolicy, KpaState, kpa_target_concurrency
from autoscaler.baselines.ray_default import RayDefaultConfig, RayDefaultPolicy, RayDefaultState
from autoscaler.baselines.static_peak import (
    StaticPeakConfig,
    StaticPeakPolicy,
    peak_rate,
    static_peak_replicas,
)

__all__ = [
    "HpaConfig",
    "HpaGpuUtilPolicy",
    "HpaState",
    "KpaConfig",
    "KpaPolicy",
    "KpaState",
    "RayDefaultConfig",
    "RayDefaultPolicy",
    "RayDefaultState",
    "StaticPeakConfig",
    "StaticPeakPolicy",
    "kpa_target_concurrency",
    "peak_rate",
    "static_peak_replicas",
]
