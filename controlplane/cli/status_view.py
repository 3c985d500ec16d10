"""The terminal frame of `controlplane status`: one rich renderable from a `FleetStatus`.

    frame(status, note="") -> Group      header line, capacity/demand line, then tables:
                                         replicas (by state), last decisions, tenant shares,
                                         the autoscaler's decisions (when one is attached)

Text from the router (ids, reasons) is shown as plain `Text`, never parsed as rich markup.
"""

from __future__ import annotations

import time

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from router.status.model import FleetStatus, ReplicaDisplay

ORDER = list(ReplicaDisplay)
STYLE = {
    ReplicaDisplay.LOADING: "blue",
    ReplicaDisplay.READY: "green",
    ReplicaDisplay.DRAINING: "yellow",
    ReplicaDisplay.EJECTED: "red",
    ReplicaDisplay.DEAD: "bold white on red",
}
MAX_DECISIONS = 10


def _ago(at_s: float, now_s: float) -> str:
    s = max(0.0, now_s - at_s)
    return f"{s:.1f} s ago" if s < 60 else f"{s / 60:.0f} min ago"


def _header(s: FleetStatus, note: str) -> Text:
    state = Text(s.status, style="green" if s.status == "ok" else "bold red")
    line = Text.assemble(
        ("fleet ", "bold"),
        (s.model, "bold cyan"),
        "  ",
        state,
        f"  up {s.uptime_s / 60:.1f} min  at {time.strftime('%H:%M:%S', time.localtime(s.at_s))}",
    )
    if s.degraded:
        line.append("  " + "; ".join(s.degraded), style="red")
    if note:
        line.append("  " + note, style="bold red")
    return line


def _capacity(s: FleetStatus) -> Text:
    c, d = s.capacity, s.demand
    rate = "measuring" if d.rate_replicas is None else f"{d.rate_replicas:.3g} replicas"
    if not d.metered:
        rate = "off (demand.enabled is false)"
    loading = [r.id for r in s.replicas if r.state is ReplicaDisplay.LOADING]
    return Text(
        f"capacity: {c.serving} serving, {c.loading} loading, {c.draining} draining, "
        f"{c.ejected} ejected, {c.dead} dead (of {c.total})\n"
        f"demand: {rate} of work; {d.in_flight} in flight, backlog {d.backlog_requests} "
        f"({d.backlog_work_s:.2f} replica-s), {d.queued} queued; "
        f"loading: {', '.join(loading) or 'nothing'}"
    )


def _replicas(s: FleetStatus) -> Table:
    t = Table(title="replicas", title_justify="left", expand=False)
    for col in ("id", "state", "in flight", "running", "waiting", "KV", "profile"):
        t.add_column(
            col, justify="right" if col in ("in flight", "running", "waiting", "KV") else "left"
        )
    for r in sorted(s.replicas, key=lambda r: (ORDER.index(r.state), r.id)):
        state = Text(str(r.state), style=STYLE[r.state])
        if r.eject_reason:
            state.append(f" ({r.eject_reason})")
        t.add_row(
            Text(r.id),
            state,
            str(r.in_flight),
            f"{r.running:.0f}",
            f"{r.waiting:.0f}",
            f"{r.kv_usage:.0%}",
            Text(r.profile),
        )
    return t


def _decisions(s: FleetStatus) -> Table:
    t = Table(title="last routing decisions", title_justify="left")
    for col in ("when", "replica", "reason", "tenant", "policy", "hit tokens"):
        t.add_column(col)
    for d in s.decisions[:MAX_DECISIONS]:
        t.add_row(
            _ago(d.at_s, s.at_s),
            Text(d.replica),
            Text(d.reason),
            Text(d.tenant),
            Text(d.policy),
            str(d.hit_tokens),
        )
    return t


def _tenants(s: FleetStatus) -> Table:
    t = Table(title="tenant shares", title_justify="left")
    for col in ("tenant", "share", "weight", "class", "in flight", "queued"):
        t.add_column(col)
    for x in s.tenants:
        t.add_row(
            Text(x.id),
            f"{x.share:.1%}",
            f"{x.weight:g}",
            Text(x.priority),
            str(x.in_flight),
            str(x.queued),
        )
    return t


def _scaling(s: FleetStatus) -> Table:
    t = Table(title="autoscaler", title_justify="left")
    for col in ("when", "target", "reason", "ready", "loading"):
        t.add_column(col)
    for a in s.autoscaler[:MAX_DECISIONS]:
        t.add_row(_ago(a.at_s, s.at_s), str(a.target), Text(a.reason), str(a.ready), str(a.loading))
    return t


def frame(s: FleetStatus, note: str = "") -> Group:
    parts: list[RenderableType] = [_header(s, note), _capacity(s), _replicas(s), _decisions(s)]
    parts.append(_tenants(s))
    if s.autoscaler:
        parts.append(_scaling(s))
    return Group(*parts)


__all__ = ["frame"]
