"""The Grafana dashboard of the `cp_*` metrics, built with Grafana's own schema types.

    python -m deploy.dashboard            # writes helm/controlplane/files/grafana/controlplane.json
    python -m deploy.dashboard --check    # exit 1 when the checked-in file differs

The chart ships the JSON as a ConfigMap (Grafana's sidecar picks it up). The panels are data,
below: one `Row` per concern, each `Panel` a list of (PromQL, legend) queries over the series
the router (`router/telemetry/metrics.py`, `demand.py`, `router/fleet/registry.py`), the KV-event
indexer (`controlplane/kvevents/metrics.py`), the stores' breakers (`controlplane/store/
metrics.py`) and the autoscaler (`autoscaler/controller.py`, `hosts/kube_scaler.py`) export.
tests/unit/test_dashboard_alerts.py checks that every expression parses (promtool) and names
only metrics and labels that code registers. Rendering goes through grafana-foundation-sdk's
builders, whose classes are generated from Grafana's dashboard schema, so the JSON is in the
shape Grafana loads.

Series several routers export for the same thing (each router's view of the fleet) are
aggregated with `max` (a state seen by every router) or `sum` (each router's own share).
`$__rate_interval` is Grafana's; `$datasource` picks the Prometheus data source.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dash_b
from grafana_foundation_sdk.builders import prometheus as prom_b
from grafana_foundation_sdk.builders import timeseries as ts_b
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import LegendDisplayMode, LegendPlacement
from grafana_foundation_sdk.models.dashboard import DashboardCursorSync, DataSourceRef

OUTPUT = Path(__file__).resolve().parents[1] / "helm/controlplane/files/grafana/controlplane.json"
UID = "cp-controlplane"
RATE = "[$__rate_interval]"
ERRORS = 'status=~"5..|upstream_died"'
DESCRIPTION = (
    "Router, prefix index, tenants, fleet and autoscaler of the vLLM fleet control plane "
    "(cp_* metrics)."
)


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    queries: tuple[tuple[str, str], ...]  # (PromQL, legend)
    unit: str = "short"
    width: int = 8


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


def _quantiles(metric: str, by: str) -> tuple[tuple[str, str], ...]:
    """p50/p95/p99 of a histogram, per `by` labels, from its buckets' rates."""
    legend = " ".join(f"{{{{{label.strip()}}}}}" for label in by.split(","))
    return tuple(
        (
            f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket{RATE})))",
            f"p{round(q * 100)} {legend}",
        )
        for q in (0.5, 0.95, 0.99)
    )


def _ratio(num: str, den: str, by: str = "") -> str:
    group = f" by ({by})" if by else ""
    return f"sum{group} (rate({num}{RATE})) / sum{group} (rate({den}{RATE}))"


ROWS: tuple[Row, ...] = (
    Row("Traffic", (
        Panel("Requests by status", "Finished requests per second by HTTP status (client_closed: "
              "the client left; upstream_died: the replica broke mid-response).",
              (("sum by (status) (rate(cp_requests_total" + RATE + "))", "{{status}}"),), "reqps"),
        Panel("Error ratio", "Share of requests that ended in a 5xx or a replica that died "
              "mid-response (the availability SLO's bad events).",
              ((f"sum (rate(cp_requests_total{{{ERRORS}}}{RATE})) / "
                f"sum (rate(cp_requests_total{RATE}))", "errors"),), "percentunit"),
        Panel("In flight and queued", "Requests in the routers now, and waiting in their fair "
              "queues.",
              (("sum (cp_inflight_requests)", "in flight"),
               ("sum (cp_queued_requests)", "queued")), "short"),
        Panel("Retries and upstream errors", "Requests retried on another replica by reason, "
              "and failed upstream attempts by replica and kind.",
              (("sum by (reason) (rate(cp_retries_total" + RATE + "))", "retry {{reason}}"),
               ("sum by (replica, kind) (rate(cp_upstream_errors_total" + RATE + "))",
                "{{replica}} {{kind}}")), "reqps"),
        Panel("Client disconnects and shutdown cuts", "Clients that left mid-request; requests "
              "cut by a router's shutdown deadline.",
              (("sum (rate(cp_client_disconnects_total" + RATE + "))", "disconnects"),
               ("sum (rate(cp_shutdown_cut_requests_total" + RATE + "))", "cut at shutdown")),
              "reqps"),
        Panel("Auth failures", "Requests refused with 401, by reason.",
              (("sum by (reason) (rate(cp_auth_failures_total" + RATE + "))", "{{reason}}"),),
              "reqps"),
    )),
    Row("Latency per policy and A/B arm", (
        Panel("Time to first token", "TTFT quantiles per A/B arm and routing policy.",
              _quantiles("cp_ttft_seconds", "arm, policy"), "s"),
        Panel("Time per output token", "TPOT (mean per request after the first token) "
              "quantiles per A/B arm and policy.", _quantiles("cp_tpot_seconds", "arm, policy"),
              "s"),
        Panel("End to end", "Request duration quantiles per A/B arm and policy.",
              _quantiles("cp_e2e_seconds", "arm, policy"), "s"),
        Panel("Routing decision time (p99)", "The policy's choose() per policy, and the "
              "prefix-index lookup by outcome (unknown: over budget or index down).",
              (("histogram_quantile(0.99, sum by (le, policy) (rate(cp_decision_seconds_bucket"
                + RATE + ")))", "decide {{policy}}"),
               ("histogram_quantile(0.99, sum by (le, outcome) (rate("
                "cp_index_lookup_seconds_bucket" + RATE + ")))", "lookup {{outcome}}")), "s"),
    )),
    Row("Prefix cache and routing decisions", (
        Panel("Prefix hit rate: predicted vs engine-reported", "Per arm: prompt tokens the router "
              "expected the chosen replica to hold, and those the replica reported cached "
              "(usage.prompt_tokens_details); a widening gap means a stale index.",
              ((_ratio("cp_predicted_prefix_hit_tokens_total", "cp_prompt_tokens_total", "arm"),
                "predicted {{arm}}"),
               (_ratio("cp_engine_cached_tokens_total", "cp_prompt_tokens_total", "arm"),
                "engine {{arm}}")), "percentunit"),
        Panel("Replicas' own prefix-cache hit rate", "vLLM's prefix-cache hits / queries per "
              "replica, from the counters the routers scrape.",
              (("max by (replica) (rate(cp_engine_prefix_cache_hits_tokens" + RATE + ")) / "
                "max by (replica) (rate(cp_engine_prefix_cache_queries_tokens" + RATE + "))",
                "{{replica}}"),), "percentunit"),
        Panel("Decisions by reason", "Routed requests per second by the policy's reason "
              "(prefix_hit, load_override, miss_least_loaded, ...).",
              (("sum by (reason) (rate(cp_requests_total" + RATE + "))", "{{reason}}"),), "reqps"),
        Panel("Routing fallbacks", "Decisions made without full information, by reason.",
              (("sum by (reason) (rate(cp_routing_fallbacks_total" + RATE + "))", "{{reason}}"),),
              "reqps"),
        Panel("KV events applied", "KV event batches applied to the prefix index per replica; "
              "gaps (replayed) and batches lost for good.",
              (("sum by (replica) (rate(cp_kv_events_applied_total" + RATE + "))", "{{replica}}"),
               ("sum by (replica) (increase(cp_kv_events_gaps_total" + RATE + "))",
                "gaps {{replica}}"),
               ("sum by (replica) (increase(cp_kv_events_lost_total" + RATE + "))",
                "lost {{replica}}")), "short"),
        Panel("Index freshness", "Seconds since each replica's last applied KV-event batch, "
              "and whether its stream is trusted (0: entries may be stale).",
              (("time() - max by (replica) (cp_kv_events_last_batch_timestamp_seconds)",
                "age {{replica}}"),
               ("min by (replica) (cp_kv_events_trusted)", "trusted {{replica}}")), "s"),
    )),
    Row("Tenants", (
        Panel("Token share per tenant", "Each tenant's share of the tokens served (prompt + "
              "completion), over the rate interval.",
              (("sum by (tenant) (rate(cp_tenant_tokens_total" + RATE + ")) / scalar(sum (rate("
                "cp_tenant_tokens_total" + RATE + ")))", "{{tenant}}"),), "percentunit"),
        Panel("Tokens per tenant", "Tokens served per second by tenant and kind.",
              (("sum by (tenant, kind) (rate(cp_tenant_tokens_total" + RATE + "))",
                "{{tenant}} {{kind}}"),), "short"),
        Panel("Quota burn per tenant", "Tokens per quota window at the current rate, as a "
              "share of the tenant's quota: above 1 the tenant will be refused (429) before "
              "its window ends.",
              (("sum by (tenant) (rate(cp_tenant_tokens_total" + RATE + ")) * on (tenant) "
                "max by (tenant) (cp_tenant_quota_window_seconds) / on (tenant) "
                "max by (tenant) (cp_tenant_quota_tokens)", "{{tenant}}"),), "percentunit"),
        Panel("Queue depth per tenant", "Requests waiting in the routers' fair queues.",
              (("sum by (tenant) (cp_queued_requests)", "{{tenant}}"),), "short"),
        Panel("Quota rejections", "Requests refused by a token quota (429), by tenant and "
              "reason (store_down: the quota store is unreachable).",
              (("sum by (tenant, reason) (rate(cp_quota_rejections_total" + RATE + "))",
                "{{tenant}} {{reason}}"),), "reqps"),
        Panel("Quota settlements", "Reservations settled, by outcome.",
              (("sum by (outcome) (rate(cp_quota_settlements_total" + RATE + "))",
                "{{outcome}}"),), "ops"),
        Panel("Shared fair queue", "Calls of the shared fair queue to Redis by outcome.",
              (("sum by (outcome) (rate(cp_fair_shared_calls_total" + RATE + "))",
                "{{outcome}}"),), "ops"),
    )),
    Row("Fleet", (
        Panel("Replicas by state", "The fleet registry's replicas by lifecycle state (the "
              "highest count any router reports).",
              (("max by (state) (cp_fleet_replicas)", "{{state}}"),), "short"),
        Panel("Routable replicas per router", "Replicas each router may send requests to now.",
              (("min (cp_routable_replicas)", "fewest"), ("max (cp_routable_replicas)", "most")),
              "short"),
        Panel("Outstanding work per replica", "Tokens routed and not finished, summed over the "
              "routers' ledgers.",
              (("sum by (replica) (cp_outstanding_tokens)", "{{replica}}"),), "short"),
        Panel("Ejections", "Replicas ejected by health checks, by reason.",
              (("sum by (reason) (increase(cp_ejections_total" + RATE + "))", "{{reason}}"),),
              "short"),
        Panel("Redis breakers", "1 while a store's Redis circuit breaker is open (Redis down for "
              "it), per store.",
              (("max by (store) (cp_redis_breaker_open)", "{{store}}"),), "short"),
        Panel("Configuration drift", "Replicas whose configuration differs from their model "
              "group's, by field (kept out of prefix affinity).",
              (("count by (field) (max by (replica, field) (cp_replica_drift))", "{{field}}"),),
              "short"),
    )),
    Row("Autoscaler", (
        Panel("Target vs ready vs loading", "The autoscaler's target, the replicas serving and "
              "those loading, with its bounds.",
              (("max by (model) (cp_autoscaler_target_replicas)", "target {{model}}"),
               ("max by (model) (cp_autoscaler_ready_replicas)", "ready {{model}}"),
               ("max by (model) (cp_autoscaler_loading_replicas)", "loading {{model}}"),
               ("max by (model) (cp_autoscaler_max_replicas)", "max {{model}}")), "short",
              width=12),
        Panel("Decisions by reason", "Autoscaler decisions per interval by reason (forecast_up, "
              "hold, scale_down, at_max, ...).",
              (("sum by (reason) (increase(cp_autoscaler_decisions_total" + RATE + "))",
                "{{reason}}"),), "short", width=12),
        Panel("Demand", "Work arriving at the routers and the backlog, in replica-seconds at "
              "the SLO per second (what the autoscaler plans on).",
              (("sum by (model) (rate(cp_demand_work_seconds_total" + RATE + "))",
                "arriving {{model}}"),
               ("max by (model) (cp_autoscaler_demand_rate)", "autoscaler's rate {{model}}"),
               ("sum by (model) (cp_backlog_work_seconds)", "backlog {{model}}")), "short"),
        Panel("Measured load time", "Replica start-to-ready time the autoscaler measured.",
              (("max by (model) (cp_autoscaler_load_time_seconds)", "{{model}}"),), "s"),
        Panel("Scale-down drains and errors", "Drains of scale-down victims by outcome, and "
              "failed controller steps by stage.",
              (("sum by (outcome) (increase(cp_autoscaler_drains_total" + RATE + "))",
                "drain {{outcome}}"),
               ("sum by (stage) (increase(cp_autoscaler_errors_total" + RATE + "))",
                "error {{stage}}")), "short"),
    )),
)  # fmt: skip


def _panel(p: Panel, ds: DataSourceRef) -> ts_b.Panel:
    """A time series panel of the queries, with a legend below."""
    builder = ts_b.Panel().title(p.title).description(p.description).datasource(ds)
    builder.unit(p.unit).height(8).span(p.width)
    legend = common_b.VizLegendOptions().display_mode(LegendDisplayMode.LIST)
    builder.legend(legend.placement(LegendPlacement.BOTTOM).show_legend(True))
    for i, (expr, legend_format) in enumerate(p.queries):
        query = prom_b.Dataquery().expr(expr).legend_format(legend_format).ref_id(chr(65 + i))
        builder.with_target(query.datasource(ds))
    return builder


def build() -> dict[str, object]:
    """The dashboard as Grafana's JSON model."""
    ds = DataSourceRef(type_val="prometheus", uid="${datasource}")
    source = dash_b.DatasourceVariable("datasource").label("Data source").type("prometheus")
    board = (
        dash_b.Dashboard("vLLM fleet control plane")
        .uid(UID)
        .tags(["controlplane", "vllm"])
        .description(DESCRIPTION)
        .refresh("30s")
        .time("now-3h", "now")
        .timezone("browser")
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .with_variable(source)
    )
    for row in ROWS:
        board.with_row(dash_b.Row(row.title))
        for panel in row.panels:
            board.with_panel(_panel(panel, ds))
    out: dict[str, object] = json.loads(json.dumps(board.build(), cls=JSONEncoder))
    return out


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def expressions(model: dict[str, object]) -> list[str]:
    """Every PromQL expression of a dashboard's panels (rows included)."""
    exprs: list[str] = []
    panels = model.get("panels", [])
    assert isinstance(panels, list)
    for panel in panels:
        for nested in [panel, *panel.get("panels", [])]:
            exprs.extend(t["expr"] for t in nested.get("targets", []) if "expr" in t)
    return exprs


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    text = render()
    if "--check" in args:
        same = OUTPUT.exists() and OUTPUT.read_text() == text
        print(f"{OUTPUT}: {'up to date' if same else 'differs: run python -m deploy.dashboard'}")
        return 0 if same else 1
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
