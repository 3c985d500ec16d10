"""One Kubernetes API client for every part that talks to the API server (raw httpx, JSON).

Credentials: a configured `api_url` / `token` / `ca_file`, else the pod's service account (API
`https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT`, token and CA under
/var/run/secrets/kubernetes.io/serviceaccount; the token file is re-read per request because it
rotates). The namespace defaults to the service account's.

Calls: `call(method, path, body)` sends JSON (a PATCH body is a JSON merge patch) and retries
429/5xx and transport errors with a doubling backoff, `retries` times; any other failure raises
`KubernetesApiError` at once with the API's own message and the HTTP code (`status`), 410 as
`ResourceGoneError`. `watch(path, params)` streams a watch's newline-delimited
`{"type", "object"}` events, unretried (the caller relists or rewatches); an ERROR event carrying
a 410 Status raises `ResourceGoneError`, any other ERROR event `KubernetesApiError`.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, Field, SecretStr

from controlplane.errors import ConfigError, KubernetesApiError, ResourceGoneError

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
RETRIABLE = frozenset({429, 500, 502, 503, 504})
HINTS = {
    401: " (token rejected)",
    403: " (RBAC: the service account may not do this; see the module's RBAC list)",
    404: " (no such object: check namespace and name)",
}


class KubeConnection(BaseModel):
    """How to reach the API server (a mixin of every settings class that talks to it)."""

    api_url: str = Field(default="", description="API server URL ('' = in-cluster).")
    token: SecretStr | None = Field(default=None, description="Bearer token (None = SA token).")
    token_file: Path = Field(default=SA_DIR / "token", description="Service account token file.")
    ca_file: Path = Field(default=SA_DIR / "ca.crt", description="CA bundle of the API server.")
    insecure_skip_tls_verify: bool = Field(default=False, description="Do not verify TLS.")
    request_timeout_s: float = Field(default=5.0, gt=0, description="Timeout of one API call.")
    retries: int = Field(default=3, ge=0, description="Retries of a 409/429/5xx/transport error.")
    retry_backoff_s: float = Field(default=0.5, ge=0, description="First backoff, doubled.")


def api_base_url(conn: KubeConnection) -> str:
    """The configured URL, else the in-cluster one from the service's environment."""
    if conn.api_url:
        return conn.api_url.rstrip("/")
    host = os.environ.get("KUBERNETES_SERVICE_HOST")
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise ConfigError("no Kubernetes API: set the api_url setting or run in a pod")
    return f"https://{host}:{port}"


def resolve_namespace(namespace: str) -> str:
    """`namespace`, else the service account's, else `default`."""
    if namespace:
        return namespace
    ns_file = SA_DIR / "namespace"
    return ns_file.read_text().strip() if ns_file.exists() else "default"


def _message(what: str, resp: httpx.Response) -> str:
    try:
        detail = resp.json().get("message", resp.text)
    except ValueError:
        detail = resp.text
    code = resp.status_code
    return f"{what}: HTTP {code}{HINTS.get(code, '')}: {detail}"


def _error(what: str, resp: httpx.Response) -> KubernetesApiError:
    message = _message(what, resp)
    if resp.status_code == 410:
        return ResourceGoneError(message)
    return KubernetesApiError(message, status=resp.status_code)


class KubeClient:
    """JSON calls and watch streams against one API server, with the connection's credentials."""

    def __init__(
        self,
        conn: KubeConnection,
        *,
        client: httpx.AsyncClient | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.conn = conn
        verify: Any = True
        if conn.insecure_skip_tls_verify:
            verify = False
        elif conn.ca_file.exists():
            verify = str(conn.ca_file)
        self.client = client or httpx.AsyncClient(
            base_url=api_base_url(conn), verify=verify, timeout=conn.request_timeout_s
        )
        self.sleep = sleep

    def headers(self) -> dict[str, str]:
        if self.conn.token is not None:
            token = self.conn.token.get_secret_value()
        elif self.conn.token_file.exists():
            token = self.conn.token_file.read_text().strip()
        else:
            return {}
        return {"Authorization": f"Bearer {token}"}

    async def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        params: Mapping[str, str] | None = None,
        what: str = "",
    ) -> dict[str, Any]:
        """One call with retries of 429/5xx/transport errors; anything else raises at once."""
        headers = self.headers()
        if body is not None:
            headers["Content-Type"] = "application/merge-patch+json"
        what = f"{method} {what or path}"
        delay = self.conn.retry_backoff_s
        for attempt in range(self.conn.retries + 1):
            last = attempt == self.conn.retries
            try:
                resp = await self.client.request(
                    method, path, headers=headers, json=body, params=params
                )
            except httpx.TransportError as exc:
                if last:
                    raise KubernetesApiError(f"{what}: {exc!r}") from None
            else:
                if resp.status_code < 300:
                    result: dict[str, Any] = resp.json()
                    return result
                if resp.status_code not in RETRIABLE or last:
                    raise _error(what, resp)
            await self.sleep(delay)
            delay *= 2
        raise AssertionError("unreachable")

    async def watch(
        self, path: str, params: Mapping[str, str], *, read_timeout_s: float
    ) -> AsyncIterator[dict[str, Any]]:
        """The events of one watch request until the server ends it (no retries)."""
        what = f"WATCH {path}"
        timeout = httpx.Timeout(self.conn.request_timeout_s, read=read_timeout_s)
        request = self.client.build_request(
            "GET", path, params={**params, "watch": "true"}, headers=self.headers(),
            timeout=timeout,
        )  # fmt: skip
        try:
            resp = await self.client.send(request, stream=True)
        except httpx.TransportError as exc:
            raise KubernetesApiError(f"{what}: {exc!r}") from None
        try:
            if resp.status_code >= 300:
                await resp.aread()
                raise _error(what, resp)
            async for line in resp.aiter_lines():
                if not line.strip():
                    continue
                try:
                    event: dict[str, Any] = json.loads(line)
                except ValueError:
                    raise KubernetesApiError(f"{what}: not a JSON event: {line[:200]!r}") from None
                if event.get("type") == "ERROR":
                    status = event.get("object") or {}
                    message = f"{what}: {status.get('message', 'watch error')}"
                    if status.get("code") == 410:
                        raise ResourceGoneError(message)
                    raise KubernetesApiError(message, status=status.get("code"))
                yield event
        except httpx.TransportError as exc:
            raise KubernetesApiError(f"{what}: {exc!r}") from None
        finally:
            await resp.aclose()

    async def aclose(self) -> None:
        await self.client.aclose()


__all__ = [
    "SA_DIR",
    "KubeClient",
    "KubeConnection",
    "api_base_url",
    "resolve_namespace",
]
