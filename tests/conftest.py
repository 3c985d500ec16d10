"""Suite-wide settings.

Hypothesis: generation speed is not what these tests check, and CI machines have two cores that
other tests (real vLLM replicas, Redis) keep busy, so the "too slow" health check and per-example
deadlines are off for every property test; the examples and their shrinking stay the same.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings

settings.register_profile(
    "controlplane", suppress_health_check=[HealthCheck.too_slow], deadline=None
)
settings.load_profile("controlplane")
