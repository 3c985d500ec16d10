"""What a vLLM replica says about itself: its resolved configuration, read from the replica.

    info = await describe_replica(client, url)     # three GETs, each bounded by `timeout_s`

1. `GET /v1/models`: every served model card -> name, `max_model_len`, `root` (the model path),
   `parent` (a LoRA adapter names its base model).
2. `GET /metrics`: `vllm:cache_config_info` -> block size, GPU (KV) blocks, prefix caching, the
   prefix-cache hash algorithm and hash block size.
3. `GET /version`: the vLLM version (None when the server has no such endpoint: 404).
4. When a base model's `root` is a directory on this machine holding `config.json`, its
   `architectures[0]` and `model_type` (the roofline's `hf_config` reads the same file).

Nothing is defaulted: a field the replica does not report is None, and a replica that does not
answer `/v1/models` or `/metrics` raises `ReplicaDescriptionError`. `ReplicaInfo` is a frozen
value with a JSON form (`to_json` / `from_json`), so a capture written today compares with one
taken after an upgrade (`controlplane fleet diff`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from controlplane.errors import ReplicaDescriptionError
from controlplane.metrics_scrape import MetricsScrapeError, parse_metrics

CAPTURE_FORMAT = "controlplane.replica_info/1"


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One card of `/v1/models`."""

    name: str
    max_model_len: int | None
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model; None for a base model


@dataclass(frozen=True, slots=True)
class ReplicaInfo:
    """A replica's resolved configuration, as it reported it."""

    url: str
    models: tuple[ServedModel, ...]
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    enable_prefix_caching: bool | None = None
    prefix_caching_hash_algo: str | None = None
    hash_block_size: int | None = None
    version: str | None = None
    architecture: str | None = None
    model_type: str | None = None
    # every label of vllm:cache_config_info, as exported
    cache_labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def model_names(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.models)

    def model(self, name: str) -> ServedModel | None:
        return next((m for m in self.models if m.name == name), None)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["models"] = [asdict(m) for m in self.models]
        data["cache_labels"] = dict(self.cache_labels)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ReplicaInfo:
        try:
            models = tuple(ServedModel(**m) for m in data["models"])
            rest = {k: v for k, v in data.items() if k != "models"}
            return cls(models=models, **rest)
        except (KeyError, TypeError) as exc:
            raise ReplicaDescriptionError(f"not a replica description: {exc}") from None


def parse_models(body: Any) -> tuple[ServedModel, ...]:
    """The cards of a `/v1/models` answer (raises ReplicaDescriptionError)."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        raise ReplicaDescriptionError("/v1/models answered no `data` list")
    cards = []
    for card in data:
        if not isinstance(card, dict) or not isinstance(card.get("id"), str):
            raise ReplicaDescriptionError(f"/v1/models: a card without an id: {card!r:.200}")
        mml = card.get("max_model_len")
        cards.append(
            ServedModel(
                name=card["id"],
                max_model_len=mml if isinstance(mml, int) and mml > 0 else None,
                root=card.get("root") if isinstance(card.get("root"), str) else None,
                parent=card.get("parent") if isinstance(card.get("parent"), str) else None,
            )
        )
    if not cards:
        raise ReplicaDescriptionError("/v1/models lists no model")
    return tuple(cards)


def architecture_of(root: str | None) -> tuple[str | None, str | None]:
    """(`architectures[0]`, `model_type`) of `root/config.json` when it is readable here."""
    if not root:
        return None, None
    path = Path(root) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None, None
    if not isinstance(config, dict):
        return None, None
    archs = config.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    mtype = config.get("model_type")
    return arch, mtype if isinstance(mtype, str) else None


async def _get(client: httpx.AsyncClient, path: str, timeout_s: float) -> httpx.Response:
    try:
        async with asyncio.timeout(timeout_s):
            return await client.get(path, timeout=timeout_s)
    except (httpx.HTTPError, TimeoutError) as exc:
        raise ReplicaDescriptionError(f"GET {path} failed: {exc!r}") from None


async def describe_replica(
    client: httpx.AsyncClient, url: str | None = None, *, timeout_s: float = 5.0
) -> ReplicaInfo:
    """Ask one replica what it is (see the module docstring). `client` carries the base URL."""
    models_resp = await _get(client, "/v1/models", timeout_s)
    if models_resp.status_code != 200:
        raise ReplicaDescriptionError(f"/v1/models answered {models_resp.status_code}")
    try:
        models = parse_models(models_resp.json())
    except ValueError as exc:
        raise ReplicaDescriptionError(f"/v1/models is not JSON: {exc}") from None
    metrics_resp = await _get(client, "/metrics", timeout_s)
    if metrics_resp.status_code != 200:
        raise ReplicaDescriptionError(f"/metrics answered {metrics_resp.status_code}")
    try:
        cache = parse_metrics(metrics_resp.text).cache
    except MetricsScrapeError as exc:
        raise ReplicaDescriptionError(str(exc)) from None
    version_resp = await _get(client, "/version", timeout_s)
    version = None
    if version_resp.status_code == 200:
        try:
            v = version_resp.json().get("version")
        except (ValueError, AttributeError):
            v = None
        version = v if isinstance(v, str) else None
    base = next((m for m in models if m.parent is None), models[0])
    arch, mtype = architecture_of(base.root)
    return ReplicaInfo(
        url=(url or str(client.base_url)).rstrip("/"),
        models=models,
        block_size=cache.block_size if cache else None,
        num_gpu_blocks=cache.num_gpu_blocks if cache else None,
        enable_prefix_caching=cache.enable_prefix_caching if cache else None,
        prefix_caching_hash_algo=cache.prefix_caching_hash_algo if cache else None,
        hash_block_size=cache.hash_block_size if cache else None,
        version=version,
        architecture=arch,
        model_type=mtype,
        cache_labels=dict(cache.labels) if cache else {},
    )


def write_capture(infos: Mapping[str, ReplicaInfo]) -> str:
    """A capture file's text: every replica's description under its name."""
    body = {"format": CAPTURE_FORMAT, "replicas": {k: v.to_json() for k, v in infos.items()}}
    return json.dumps(body, indent=2, sort_keys=True) + "\n"


def read_capture(text: str) -> dict[str, ReplicaInfo]:
    """The descriptions of a capture file (raises ReplicaDescriptionError)."""
    try:
        body = json.loads(text)
    except ValueError as exc:
        raise ReplicaDescriptionError(f"a capture must be JSON: {exc}") from None
    if not isinstance(body, dict) or body.get("format") != CAPTURE_FORMAT:
        raise ReplicaDescriptionError(f"not a capture (format {CAPTURE_FORMAT!r} expected)")
    reps = body.get("replicas")
    if not isinstance(reps, dict):
        raise ReplicaDescriptionError("a capture's `replicas` must be an object")
    return {str(k): ReplicaInfo.from_json(v) for k, v in reps.items()}
