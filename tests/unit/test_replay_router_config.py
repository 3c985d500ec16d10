"""`controlplane replay --router-config`: a router's A/B split, books, queue and tenants, replayed
offline with the objects the router builds from the same file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from controlplane.cli import _register, app
from controlplane.cli.common import build_trace
from controlplane.cli.replay_config import fleet_config, with_tenant_classes
from controlplane.errors import ConfigError
from controlplane.types import PriorityClass
from router.config import load_settings

TRACE = "gen:tenants?tenants=chat,rag&duration=20&seed=3"
ROUTER = {
    "served_model": "llama-3.1-8b",
    "replicas": [
        {"id": f"r{i}", "url": f"http://10.0.0.{i}:8000", "gpu": "a100", "model": "llama-3.1-8b"}
        for i in range(3)
    ],
    "policy": {
        "arms": [
            {"name": "rr", "policy": "round_robin", "weight": 1},
            {"name": "pa", "policy": "prefix_affinity", "params": {"min_match_blocks": 2}},
        ],
        "speculative_ttl_s": 5.0,
    },
    "tenants": [
        {"id": "chat", "weight": 1.0},
        {"id": "rag", "weight": 3.0, "priority": "batch"},
    ],
}


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(ROUTER))
    return path


def test_the_fleet_and_the_books_come_from_the_file(config_file: Path) -> None:
    settings = load_settings(config_file)
    cfg = fleet_config(settings, None, None, None, None)
    assert (cfg.replicas, cfg.profile.gpu_key) == (3, "a100")
    assert cfg.policy is settings.policy and cfg.policy.speculative_ttl_s == 5.0
    assert cfg.fairness is settings.fairness
    assert dict(cfg.tenant_weights) == {"chat": 1.0, "rag": 3.0}
    flags = fleet_config(settings, 5, "h100", None, None)
    assert (flags.replicas, flags.profile.gpu_key) == (5, "h100")


def test_tenant_classes_replace_the_traces() -> None:
    settings = load_settings(tenants=ROUTER["tenants"])
    trace = with_tenant_classes(build_trace(TRACE), settings)
    classes = {r.tenant: r.priority for r in trace.requests}
    assert classes == {"chat": PriorityClass.INTERACTIVE, "rag": PriorityClass.BATCH}


def test_the_cli_replays_the_split_per_arm(config_file: Path, tmp_path: Path) -> None:
    _register()
    out = tmp_path / "r.json"
    result = CliRunner().invoke(
        app,
        [
            *("replay", "--trace", TRACE, "--router-config", str(config_file)),
            *("--each-arm", "--json", str(out)),
        ],
    )
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["policies"]
    assert set(rows) == {"split", "arm rr", "arm pa", "rr alone", "pa alone"}
    split = rows["split"]
    assert rows["arm rr"]["requests"] + rows["arm pa"]["requests"] == split["requests"]
    assert set(rows["arm rr"]["reasons"]) == {"round_robin"}
    assert "round_robin" not in rows["arm pa"]["reasons"]
    # sticky by tenant: each tenant's requests all went to one arm
    assert {rows["arm rr"]["requests"], rows["arm pa"]["requests"]} != {0}
    assert rows["rr alone"]["requests"] == rows["pa alone"]["requests"] == split["requests"]
    assert "arm rr" in result.output and "split" in result.output


def test_a_bad_config_is_a_clear_error(tmp_path: Path) -> None:
    _register()
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"policy": {"arms": [{"name": "x", "policy": "nope"}]}}))
    result = CliRunner().invoke(app, ["replay", "--trace", TRACE, "--router-config", str(bad)])
    # the command's error (`controlplane` prints it and exits 2), before any replay
    assert isinstance(result.exception, ConfigError)
    assert "unknown routing policy 'nope'" in str(result.exception)
