"""`controlplane config show|diff`, and the example router config in deploy/."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from controlplane.cli import _register, app
from controlplane.cli.config_cmd import ABSENT, diff_settings, flatten
from controlplane.errors import ConfigError
from controlplane.routing.ab import arms_from_config, assign_arm, sticky_key_for
from controlplane.routing.config import PolicyConfig
from router.config import RouterSettings, load_settings, resolved_dict

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "router.example.yaml"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    _register()
    for key in list(os.environ):
        if key.startswith("CP_"):
            monkeypatch.delenv(key)


def write(tmp_path: Path, name: str, data: dict[str, Any]) -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_example_config_loads() -> None:
    settings = load_settings(config_file=EXAMPLE)
    assert [(r.id, r.url) for r in settings.replicas] == [
        ("r1", "http://127.0.0.1:8101"),
        ("r2", "http://127.0.0.1:8102"),
        ("r3", "http://127.0.0.1:8103"),
    ]
    arms = arms_from_config(settings.policy)
    assert [(a.name, a.policy, a.weight) for a in arms] == [
        ("prefix_affinity", "prefix_affinity", 1.0),
        ("round_robin", "round_robin", 1.0),
    ]
    assert settings.policy.sticky_key == "tenant"
    assert settings.redis.url == "redis://127.0.0.1:6379/0"
    assert settings.limits.default_max_tokens == 1024
    tenant_arm = assign_arm(arms, sticky_key_for(settings.policy, "acme", "conversation-1"))
    assert tenant_arm == assign_arm(arms, sticky_key_for(settings.policy, "acme", None))


def test_show_prints_every_default(tmp_path: Path) -> None:
    path = write(tmp_path, "a.yaml", {"port": 9000, "policy": {"name": "round_robin"}})
    result = CliRunner().invoke(app, ["config", "show", "--config", str(path)])
    assert result.exit_code == 0, result.output
    shown = yaml.safe_load(result.output)
    assert shown["port"] == 9000
    assert shown["policy"]["name"] == "round_robin"
    assert shown == resolved_dict(
        RouterSettings(port=9000, policy=PolicyConfig(name="round_robin"))
    )
    assert shown["timeouts"]["ttft_s"] == 60.0  # a default, made explicit


def test_show_masks_the_admin_key(tmp_path: Path) -> None:
    path = write(tmp_path, "a.yaml", {"admin_key": "hunter2"})
    result = CliRunner().invoke(app, ["config", "show", "--config", str(path)])
    assert "hunter2" not in result.output
    assert yaml.safe_load(result.output)["admin_key"] == "**********"


def test_show_without_a_file_is_the_defaults() -> None:
    result = CliRunner().invoke(app, ["config", "show"])
    assert result.exit_code == 0
    assert yaml.safe_load(result.output) == resolved_dict(RouterSettings())


def test_show_missing_file(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["config", "show", "--config", str(tmp_path / "nope.yaml")])
    assert isinstance(result.exception, ConfigError)


@pytest.mark.parametrize(
    ("value", "flat"),
    [
        ({"a": {"b": 1, "c": [1, 2]}}, {"a.b": 1, "a.c[0]": 1, "a.c[1]": 2}),
        (
            {"replicas": [{"id": "r1", "url": "u"}]},
            {"replicas[r1].id": "r1", "replicas[r1].url": "u"},
        ),
        ({"arms": [{"name": "x", "params": {}}]}, {"arms[x].name": "x", "arms[x].params": {}}),
        ({"a": [], "b": None}, {"a": [], "b": None}),
    ],
)
def test_flatten(value: dict[str, Any], flat: dict[str, Any]) -> None:
    assert flatten(value) == flat


@pytest.mark.parametrize(
    ("a", "b", "changes"),
    [
        ({"port": 1}, {"port": 1}, []),
        ({"port": 1, "host": "h"}, {"port": 2, "host": "h"}, [("port", 1, 2)]),
        (
            {"replicas": [{"id": "r1", "url": "u1"}]},
            {"replicas": [{"id": "r1", "url": "u2"}, {"id": "r2", "url": "u3"}]},
            [
                ("replicas[r1].url", "u1", "u2"),
                ("replicas[r2].id", ABSENT, "r2"),
                ("replicas[r2].url", ABSENT, "u3"),
            ],
        ),
        ({"x": {"y": 1}}, {"x": {}}, [("x.y", 1, ABSENT), ("x", ABSENT, {})]),
    ],
)
def test_diff_settings(
    a: dict[str, Any], b: dict[str, Any], changes: list[tuple[str, Any, Any]]
) -> None:
    assert diff_settings(a, b) == changes


@pytest.mark.parametrize(
    ("flags", "exit_code"), [([], 0), (["--exit-code"], 1)], ids=["default", "exit-code"]
)
def test_diff_command(tmp_path: Path, flags: list[str], exit_code: int) -> None:
    old = write(tmp_path, "old.yaml", {"port": 8000, "redis": {"lookup_budget_ms": 25}})
    new = write(
        tmp_path,
        "new.yaml",
        {"port": 8001, "redis": {"lookup_budget_ms": 10}, "policy": {"sticky_key": "session"}},
    )
    result = CliRunner().invoke(app, ["config", "diff", str(old), str(new), *flags])
    assert result.exit_code == exit_code, result.output
    for text in ("port", "8000", "8001", "redis.lookup_budget_ms", "25.0", "10.0"):
        assert text in result.output
    assert "policy.sticky_key" in result.output and '"session"' in result.output
    assert "timeouts" not in result.output  # equal defaults are not listed


@pytest.mark.parametrize("flags", [[], ["--exit-code"]])
def test_diff_identical_files(tmp_path: Path, flags: list[str]) -> None:
    a = write(tmp_path, "a.yaml", {"port": 8000})
    b = write(tmp_path, "b.yaml", {})  # the default port: resolved values are equal
    result = CliRunner().invoke(app, ["config", "diff", str(a), str(b), *flags])
    assert result.exit_code == 0
    assert "no differences" in result.output


def test_diff_invalid_file(tmp_path: Path) -> None:
    a = write(tmp_path, "a.yaml", {})
    bad = write(tmp_path, "bad.yaml", {"port": "not a port"})
    result = CliRunner().invoke(app, ["config", "diff", str(a), str(bad)])
    assert isinstance(result.exception, ConfigError)
    assert "invalid router configuration" in str(result.exception)
