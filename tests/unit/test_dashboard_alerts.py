"""The Grafana dashboard and the Prometheus rules the chart ships (helm/controlplane/files/).

- every PromQL expression parses (promtool) and names only metrics, and labels of them, that the
  code registers (read from a live router's /metrics, the autoscaler's and the indexer's);
- the rules pass `promtool check rules`, and `promtool test rules` runs the cases of
  tests/fixtures/prometheus/alerts_test.yaml: each alert fires when it should and not otherwise;
- the dashboard file is what deploy/dashboard.py builds, and it round-trips through Grafana's
  schema types (grafana-foundation-sdk) unchanged;
- every alert has a summary, a static description and a runbook that exists.

promtool comes from Debian's `prometheus` package (`make promtool`); without it the promtool
tests are skipped with that reason.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from grafana_foundation_sdk.models.dashboard import Dashboard
from metric_catalog import Catalog, metric_catalog

from deploy import dashboard

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "helm/controlplane/files/prometheus/alerts.yaml"
RULES_TESTS = ROOT / "tests/fixtures/prometheus/alerts_test.yaml"
DOCS = ROOT / "docs"
# labels Prometheus adds to every scraped series (target labels), usable in any expression
TARGET_LABELS = frozenset({"instance", "job", "namespace", "pod"})
# the runbooks of the deploy guide (docs/deploy-kubernetes.md)
DEPLOY_RUNBOOKS = frozenset(
    {
        "runbook-redis-down",
        "runbook-hung-replica",
        "runbook-stale-index",
        "runbook-quota-store-down",
    }
)
PROMQL_WORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (`make promtool` installs Debian's prometheus)")
    return path


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def alerts() -> list[dict[str, Any]]:
    return [r for r in rules() if "alert" in r]


def dashboard_model() -> dict[str, Any]:
    model: dict[str, Any] = json.loads(dashboard.OUTPUT.read_text())
    return model


def all_exprs() -> list[tuple[str, str]]:
    """(where, PromQL) of every dashboard query and every rule."""
    out = [(f"dashboard: {e}", e) for e in dashboard.expressions(dashboard_model())]
    out += [(f"rule {r.get('alert') or r.get('record')}", str(r["expr"])) for r in rules()]
    return out


@pytest.fixture
async def catalog() -> Catalog:
    return await metric_catalog()


# -- metric names and labels ----------------------------------------------------------------------
def names_and_labels(expr: str) -> tuple[set[str], set[str]]:
    """The metric names an expression selects and the label names it matches or groups on."""
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values out of the way
    bare = re.sub(r"\[[^\]]*\]", "", bare)  # range selectors
    names = set(re.findall(r"\b(cp[:_][a-zA-Z0-9_:]*)", bare))
    labels: set[str] = set()
    for matchers in re.findall(r"\{([^}]*)\}", bare):
        labels |= set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", matchers))
    for clause in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)",
                             bare):  # fmt: skip
        labels |= {x.strip() for x in clause.split(",") if x.strip()}
    return names, labels - PROMQL_WORDS


def recorded() -> set[str]:
    return {str(r["record"]) for r in rules() if "record" in r}


def test_the_extractor_reads_names_and_labels() -> None:
    expr = (
        'sum by (arm, le) (rate(cp_ttft_seconds_bucket{status=~"5..|x=y"}[5m])) / on (arm) '
        "cp:requests_errors:ratio_rate5m == 0"
    )
    assert names_and_labels(expr) == (
        {"cp_ttft_seconds_bucket", "cp:requests_errors:ratio_rate5m"},
        {"arm", "le", "status"},
    )


def problems_of(where: str, expr: str, catalog: Catalog) -> list[str]:
    names, labels = names_and_labels(expr)
    if not names:
        return [f"{where}: names no cp_ metric"]
    problems = [f"{where}: unknown metric {n}" for n in sorted(names - set(catalog) - recorded())]
    allowed = set(TARGET_LABELS).union(*(catalog.get(n, frozenset()) for n in names))
    if names & recorded():  # a recording rule's output: its labels are some of its inputs'
        allowed |= set().union(*catalog.values())
    return problems + [f"{where}: no label {lb} on {sorted(names)}" for lb in labels - allowed]


async def test_every_expression_names_registered_metrics_and_their_labels(
    catalog: Catalog,
) -> None:
    assert [p for where, expr in all_exprs() for p in problems_of(where, expr, catalog)] == []


@pytest.mark.parametrize(
    ("expr", "problem"),
    [
        ("sum by (tenant) (rate(cp_requests_total[5m]))", "no label tenant"),
        ('cp_fleet_replicas{status="ready"}', "no label status"),
        ("rate(cp_requests[5m])", "unknown metric cp_requests"),  # the family, not the sample
        ("cp_ttft_seconds", "unknown metric cp_ttft_seconds"),
        ("vector(1)", "names no cp_ metric"),
    ],
)
async def test_the_check_catches_wrong_names_and_labels(
    catalog: Catalog, expr: str, problem: str
) -> None:
    assert any(problem in p for p in problems_of("t", expr, catalog))


async def test_the_catalog_holds_what_the_panels_must_show(catalog: Catalog) -> None:
    """The brief's panels, by the series they rest on (a rename breaks this loudly)."""
    used = set().union(*(names_and_labels(e)[0] for _, e in all_exprs()))
    for name in (
        "cp_requests_total", "cp_ttft_seconds_bucket", "cp_tpot_seconds_bucket",
        "cp_predicted_prefix_hit_tokens_total", "cp_engine_cached_tokens_total",
        "cp_tenant_tokens_total", "cp_tenant_quota_tokens", "cp_queued_requests",
        "cp_fleet_replicas", "cp_autoscaler_target_replicas", "cp_autoscaler_ready_replicas",
        "cp_autoscaler_loading_replicas", "cp_autoscaler_decisions_total",
        "cp_redis_breaker_open", "cp_kv_events_lost_total",
        "cp_kv_events_last_batch_timestamp_seconds", "cp_routable_replicas",
    ):  # fmt: skip
        assert name in catalog and name in used, name
    assert {"arm", "policy"} <= catalog["cp_ttft_seconds_bucket"]


# -- PromQL parses --------------------------------------------------------------------------------
def test_dashboard_expressions_parse(tmp_path: Path) -> None:
    tool = promtool()
    exprs = dashboard.expressions(dashboard_model())
    group = {
        "name": "dashboard-parse-check",
        "rules": [
            {"record": f"dashboard:expr_{i}", "expr": e.replace("$__rate_interval", "5m")}
            for i, e in enumerate(exprs)
        ],
    }
    path = tmp_path / "dashboard_rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [group]}))
    out = subprocess.run([tool, "check", "rules", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in out.stdout


def test_rules_pass_promtool_check() -> None:
    out = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def _with_static_annotations(tests: dict[str, Any]) -> dict[str, Any]:
    """The fixture's expected alerts, completed with each rule's description and runbook."""
    by_alert: dict[str, list[dict[str, Any]]] = {}
    for rule in alerts():
        by_alert.setdefault(rule["alert"], []).append(rule)
    tests["rule_files"] = [str(RULES)]
    for case in tests["tests"]:
        for check in case.get("alert_rule_test", []):
            for exp in check.get("exp_alerts", []):
                labels = exp.get("exp_labels", {})
                (rule,) = [r for r in by_alert[check["alertname"]]
                           if r.get("labels", {}).items() <= labels.items()]  # fmt: skip
                static = {k: rule["annotations"][k] for k in ("description", "runbook_url")}
                exp["exp_annotations"] = static | exp.get("exp_annotations", {})
    return tests


def test_alert_unit_tests(tmp_path: Path) -> None:
    tool = promtool()
    tests = _with_static_annotations(yaml.safe_load(RULES_TESTS.read_text()))
    path = tmp_path / "alerts_test.yaml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False))
    out = subprocess.run([tool, "test", "rules", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    # every alert has at least one case where it fires and one where it must not
    fired: dict[str, int] = {}
    quiet: dict[str, int] = {}
    for case in tests["tests"]:
        for check in case["alert_rule_test"]:
            counts = fired if check["exp_alerts"] else quiet
            counts[check["alertname"]] = counts.get(check["alertname"], 0) + 1
    names = {r["alert"] for r in alerts()}
    assert set(fired) == names
    assert set(quiet) == names


# -- annotations and runbooks ---------------------------------------------------------------------
def anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors and explicit `<a id>`/`{#id}` anchors of a Markdown text."""
    found = set(re.findall(r'<a\s+(?:id|name)="([^"]+)"', markdown))
    found |= set(re.findall(r"\{#([A-Za-z0-9_-]+)\}", markdown))
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*$", markdown, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        found.add(slug)
    return found


@pytest.mark.parametrize("rule", alerts(), ids=lambda r: f"{r['alert']}-{r['labels']['severity']}")
def test_alert_annotations(rule: dict[str, Any]) -> None:
    notes = rule["annotations"]
    assert set(notes) == {"summary", "description", "runbook_url"}
    assert "{{" not in notes["description"], "templated text goes in the summary"
    assert rule["labels"]["severity"] in ("warning", "critical")
    doc, _, anchor = notes["runbook_url"].partition("#")
    if doc == "docs/deploy-kubernetes.md":
        assert anchor in DEPLOY_RUNBOOKS
    else:
        assert doc == "docs/alerts.md"
        assert anchor in anchors((DOCS / "alerts.md").read_text())
    assert f"`{rule['alert']}`" in (DOCS / "alerts.md").read_text()


def test_deploy_guide_has_the_runbooks() -> None:
    guide = DOCS / "deploy-kubernetes.md"
    if not guide.exists():
        pytest.skip("docs/deploy-kubernetes.md is written with the Helm chart")
    assert anchors(guide.read_text()) >= DEPLOY_RUNBOOKS


# -- the dashboard file ---------------------------------------------------------------------------
def test_dashboard_file_is_generated() -> None:
    assert dashboard.OUTPUT.read_text() == dashboard.render(), "run: python -m deploy.dashboard"
    assert dashboard.main(["--check"]) == 0


def test_dashboard_round_trips_through_grafana_schema_types() -> None:
    model = dashboard_model()
    again = json.loads(json.dumps(Dashboard.from_json(model).to_json(), default=_to_json))
    assert again == model
    assert model["uid"] == dashboard.UID
    panels = model["panels"]
    titles = [p["title"] for p in panels if p["type"] == "row"]
    assert titles == [row.title for row in dashboard.ROWS]
    assert all(p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
               for p in panels if p["type"] != "row")  # fmt: skip


def _to_json(obj: Any) -> Any:
    return obj.to_json()
