"""The project's one error hierarchy.

    ControlPlaneError
    ├── ConfigError            bad settings, unknown GPU/model/policy names, invalid flags
    ├── TraceError             a trace file that cannot be read or parsed
    ├── RequestError           a request the router must refuse (maps to a 4xx)
    │   └── PromptTooLongError prompt + max_tokens exceed the model's context
    └── CapacityError          nothing can serve the request now (maps to 503)
        └── NoReadyReplicaError

Library code raises these; the HTTP boundary maps them to OpenAI-shaped errors once, and the CLI
maps them to a message on stderr and a non-zero exit code.
"""

from __future__ import annotations


class ControlPlaneError(Exception):
    """Base of every error this project raises on purpose."""


class ConfigError(ControlPlaneError, ValueError):
    """A setting, flag or name that does not make sense."""


class TraceError(ControlPlaneError, ValueError):
    """A trace that cannot be read."""


class RequestError(ControlPlaneError):
    """A request that must be refused with a 4xx."""

    status_code = 400


class PromptTooLongError(RequestError):
    """Prompt plus max_tokens exceed the served model's context length."""


class CapacityError(ControlPlaneError):
    """No capacity to serve the request now."""

    status_code = 503


class NoReadyReplicaError(CapacityError):
    """Every replica is loading, draining, ejected or dead."""
