"""The project's one error hierarchy.

    ControlPlaneError
    ├── ConfigError            bad settings, unknown GPU/model/policy names, invalid flags
    ├── TraceError             a trace file that cannot be read or parsed
    ├── RequestError           a request the router must refuse (maps to a 4xx)
    │   ├── PromptTooLongError prompt + max_tokens exceed the model's context
    │   ├── TooManyPromptsError a completions batch with more prompts than the router takes
    │   ├── BodyTooLargeError  413: the body exceeds the configured limit
    │   ├── RequestHeadTooLargeError 431: the request head exceeds its size or header limit
    │   ├── RequestHeadTimeoutError  408: the request head did not arrive in time
    │   ├── InvalidHttpError   400: bytes that are not HTTP/1.1
    │   ├── ModelNotFoundError 404: a model this router does not serve
    │   ├── AuthError          401: a missing or wrong key
    │   ├── ForbiddenError     403: a client this resource is not served to (the status view
    │   │                      from a non-loopback address while no admin key is configured)
    │   ├── QuotaExceededError 429: no room in the tenant's token quota (Retry-After)
    │   ├── ReplicaRefusedError 400: a replica URL or id the router will not use (also a
    │   │                      ConfigError: a configured replica refused at startup)
    │   └── NotFoundError      404: an unknown resource (replica, route)
    │       └── UnknownReplicaError  a replica id the fleet does not know
    ├── CapacityError          nothing can serve the request now (maps to 503)
    │   ├── NoReadyReplicaError
    │   ├── TooManyConnectionsError  more connections open than the router takes
    │   ├── QuotaUnavailableError  a hard quota's store cannot be reached (fail closed)
    │   └── RegistryUnavailableError  the shared fleet registry cannot be reached (admin)
    ├── ReplicaDescriptionError a replica that did not say what it is (/v1/models, /metrics)
    ├── UpstreamError          the chosen replica failed the request (502)
    │   └── UpstreamTimeoutError  no answer within the deadline (504)
    ├── StoreError             a Redis store call that got no answer (never reaches a client:
    │   │                      each store decides what it means: unknown, 503, local fallback)
    │   ├── StoreUnavailableError  not sent: breaker open, too many calls waiting, closed
    │   └── StoreTimeoutError      sent; Redis did not answer within the call's budget
    ├── KubernetesApiError     a Kubernetes API call that failed after its retries (`status`:
    │   │                      the HTTP code, None for a transport error; never reaches a client)
    │   └── ResourceGoneError  410 Gone: a watch's resourceVersion expired (relist)
    └── RouterAdminError       no router's admin API answered the autoscaler (each router's
                               failure in the message; never reaches a client)

Library code raises these; the HTTP boundary maps them to OpenAI-shaped errors once, and the CLI
maps them to a message on stderr and a non-zero exit code.
"""

from __future__ import annotations


class ControlPlaneError(Exception):
    """Base of every error this project raises on purpose."""

    def response_headers(self) -> dict[str, str]:
        """Extra HTTP headers of the error response (e.g. Retry-After)."""
        return {}


class ConfigError(ControlPlaneError, ValueError):
    """A setting, flag or name that does not make sense."""


class TraceError(ControlPlaneError, ValueError):
    """A trace that cannot be read."""


class RequestError(ControlPlaneError):
    """A request that must be refused with a 4xx."""

    status_code = 400


class PromptTooLongError(RequestError):
    """Prompt plus max_tokens exceed the served model's context length."""


class TooManyPromptsError(RequestError):
    """A completions request carries more prompts than `limits.max_prompts_per_request`."""

    openai_code = "too_many_prompts"
    param = "prompt"


class BodyTooLargeError(RequestError):
    """The request body exceeds the configured limit."""

    status_code = 413


class RequestHeadTooLargeError(RequestError):
    """The request line and headers exceed `limits.max_header_bytes` or `limits.max_headers`."""

    status_code = 431
    openai_code = "request_header_fields_too_large"


class RequestHeadTimeoutError(RequestError):
    """The request head did not arrive within `limits.header_timeout_s`."""

    status_code = 408
    openai_code = "header_timeout"


class InvalidHttpError(RequestError):
    """Bytes on the connection that do not parse as an HTTP/1.1 request."""

    openai_code = "invalid_http"


class ModelNotFoundError(RequestError):
    """The request names a model this router does not serve (OpenAI's `model_not_found`)."""

    status_code = 404
    openai_code = "model_not_found"
    param = "model"


class AuthError(RequestError):
    """A missing or wrong API or admin key."""

    status_code = 401


class ForbiddenError(RequestError):
    """The client may not have this resource, whatever key it sends."""

    status_code = 403


class QuotaExceededError(RequestError):
    """The tenant's token quota cannot take this request now: OpenAI's 429, with `Retry-After`
    and the `x-ratelimit-*-tokens` headers (built by `controlplane.tenancy.quota`)."""

    status_code = 429
    openai_code = "rate_limit_exceeded"

    def __init__(
        self, message: str, *, reason: str, retry_after_s: float, headers: dict[str, str]
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s
        self.headers = dict(headers)

    def response_headers(self) -> dict[str, str]:
        return dict(self.headers)


class ReplicaRefusedError(RequestError, ConfigError):
    """A replica URL or id the router will not use (`router/fleet/urls.py`): 400 from
    POST /admin/replicas, a configuration error when the replica is configured statically.
    `param` names the refused field ("url" or "id")."""

    openai_code = "invalid_replica"

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.param = param


class NotFoundError(RequestError):
    """An unknown resource."""

    status_code = 404


class UnknownReplicaError(NotFoundError):
    """A replica id the router does not know (admin API, the live fleet)."""

    status_code = 404


class CapacityError(ControlPlaneError):
    """No capacity to serve the request now."""

    status_code = 503


class NoReadyReplicaError(CapacityError):
    """Every replica is loading, draining, ejected or dead."""


class TooManyConnectionsError(CapacityError):
    """More connections are open than `limits.max_connections`."""

    openai_code = "too_many_connections"


class QuotaUnavailableError(CapacityError):
    """A hard quota cannot be checked (its store is unreachable): refuse rather than overshoot."""

    reason = "store_down"


class RegistryUnavailableError(CapacityError):
    """A fleet change (admin API) cannot reach the shared fleet registry; nothing changed."""

    openai_code = "registry_unavailable"


class ReplicaDescriptionError(ControlPlaneError):
    """A replica whose self-description (`controlplane/replica_info.py`) could not be read."""


class UpstreamError(ControlPlaneError):
    """The replica the request was sent to failed it."""

    status_code = 502


class UpstreamTimeoutError(UpstreamError):
    """The replica did not answer within the deadline."""

    status_code = 504


class StoreError(ControlPlaneError):
    """A call to a Redis store got no answer (`controlplane/store/caller.py`)."""


class StoreUnavailableError(StoreError):
    """The call was not sent: the circuit breaker is open, too many calls wait, or the store is
    closed (`reason`)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"the store is unavailable ({reason})")
        self.reason = reason


class StoreTimeoutError(StoreError):
    """The call was sent, and Redis did not answer within its budget."""


class KubernetesApiError(ControlPlaneError):
    """A Kubernetes API call that failed after its retries (`controlplane/kube/api.py`)."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class RouterAdminError(ControlPlaneError):
    """No router's admin API answered a call of the autoscaler's drainer (`failures`: one line
    per router tried, e.g. a transport error, a 401 for a wrong admin key, a 503)."""

    def __init__(self, message: str, *, failures: tuple[str, ...] = ()) -> None:
        super().__init__(message + "".join(f"\n  {f}" for f in failures))
        self.failures = failures


class ResourceGoneError(KubernetesApiError):
    """410 Gone: the resourceVersion a watch started from is too old; list again."""

    def __init__(self, message: str) -> None:
        super().__init__(message, status=410)
