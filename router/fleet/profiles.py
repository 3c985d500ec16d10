"""Which roofline profile a live replica gets, and where it came from.

    profile, source = resolve_profile(cfg, info, groups, block_size=32, num_gpu_blocks=16384)

1. The replica described itself and its base model (the first card without a parent) has a
   `models` entry: the model spec is built from that model's config.json
   (`controlplane.roofline.hf_config`): the entry's `config_json` (a file or a directory), else
   the `root` the replica reports when it is a directory here. The GPU kind is the entry's
   (required there). The context is the `max_model_len` the replica reports. Source:
   `CONFIG_JSON`. No config.json found, or one the roofline cannot model: `ConfigError` (the
   fleet keeps the replica LOADING and shows the reason).
2. Otherwise the legacy keys of its `ReplicaConfig` (`gpu`, `model`): source `REPLICA_KEYS`
   when set explicitly, `DEFAULTS` when neither was (reported, never silent).

Block size and block count are the replica's (or its configuration's) either way.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from enum import StrEnum
from pathlib import Path

from controlplane.errors import ConfigError
from controlplane.replica_info import ReplicaInfo
from controlplane.roofline.hf_config import load_config, model_spec_from_config
from controlplane.roofline.profile import EngineProfile, profile
from controlplane.roofline.specs import register_model
from router.config import ModelGroupConfig, ReplicaConfig


class ProfileSource(StrEnum):
    """Where a replica's roofline profile came from (metric label `source`)."""

    CONFIG_JSON = "config_json"
    REPLICA_KEYS = "replica_keys"
    DEFAULTS = "defaults"


def config_json_path(group: ModelGroupConfig, root: str | None) -> Path:
    """The config.json of a model group (raises ConfigError naming what was tried)."""
    tried = []
    for where in (group.config_json, root):
        if not where:
            continue
        path = Path(where)
        candidate = path / "config.json" if path.is_dir() else path
        if candidate.is_file():
            return candidate
        tried.append(str(candidate))
    hint = f" (tried {', '.join(tried)})" if tried else ""
    raise ConfigError(
        f"no config.json for model {group.name!r}{hint}: set models[].config_json to the "
        "file or a directory holding it"
    )


def resolve_profile(
    cfg: ReplicaConfig,
    info: ReplicaInfo | None,
    groups: Sequence[ModelGroupConfig],
    *,
    block_size: int | None,
    num_gpu_blocks: int | None,
) -> tuple[EngineProfile, ProfileSource]:
    """The replica's profile and its source (see the module docstring; raises ConfigError)."""
    knobs: dict[str, object] = {
        "block_size": block_size or 0,
        "num_gpu_blocks_override": num_gpu_blocks or 0,
        "long_prefill_token_threshold": cfg.long_prefill_token_threshold,
    }
    base = next((m for m in info.models if m.parent is None), None) if info else None
    group = next((g for g in groups if base and g.name == base.name), None)
    if base is not None and group is not None:
        path = config_json_path(group, base.root)
        config = load_config(path)
        spec = model_spec_from_config(config, name=group.name, kv_cache_dtype=group.kv_cache_dtype)
        digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]
        key = register_model(f"hf:{group.name}:{digest}", spec)
        prof = profile(group.gpu, key, tp=group.tp, max_model_len=base.max_model_len or 0, **knobs)
        return prof, ProfileSource.CONFIG_JSON
    explicit = {"gpu", "model"} & cfg.model_fields_set
    source = ProfileSource.REPLICA_KEYS if explicit else ProfileSource.DEFAULTS
    return profile(cfg.gpu, cfg.model, tp=cfg.tp, **knobs), source
