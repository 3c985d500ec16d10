"""The `/status` web page: one self-contained HTML document (inline CSS and script, nothing
fetched from elsewhere) that polls `GET /admin/status` every `POLL_MS` and renders it.

Rendering builds DOM nodes and sets `textContent` only (replica and tenant ids are user-given:
nothing is parsed as HTML). When the router asks for the admin key (401), the page shows a key
field; the key stays in the tab's sessionStorage and goes out as `Authorization: Bearer`.
`PAGE_CSP` allows exactly this document's script (by hash) and connections to its own origin.
The page holds no data itself: what it shows comes from /admin/status under its access rule.
"""

from __future__ import annotations

import base64
import hashlib

POLL_MS = 1500

_SCRIPT = r"""
"use strict";
const POLL_MS = __POLL_MS__;
const MAX_DECISIONS = 12;
const ORDER = ["loading", "ready", "draining", "ejected", "dead"];
const $ = (id) => document.getElementById(id);
function el(tag, cls, text) {
  const n = document.createElement(tag);
  if (cls) n.className = cls;
  if (text !== undefined && text !== null) n.textContent = String(text);
  return n;
}
function fmt(x, digits) {
  return (typeof x === "number" && isFinite(x)) ? x.toFixed(digits) : "-";
}
function ago(at, now) {
  const s = Math.max(0, now - at);
  return s < 60 ? s.toFixed(1) + " s ago" : Math.round(s / 60) + " min ago";
}
function bar(frac) {
  const outer = el("span", "bar");
  const inner = el("span", "fill");
  inner.style.width = Math.round(Math.max(0, Math.min(1, frac)) * 100) + "%";
  outer.appendChild(inner);
  return outer;
}
function fill(tbody, rows, cells, attrs) {
  tbody.replaceChildren();
  for (const row of rows) {
    const tr = el("tr");
    if (attrs) attrs(tr, row);
    for (const c of cells(row)) {
      const td = el("td");
      if (c instanceof Node) td.appendChild(c); else td.textContent = String(c);
      tr.appendChild(td);
    }
    tbody.appendChild(tr);
  }
}
function render(s) {
  const now = s.at_s;
  $("model").textContent = s.model;
  const st = $("overall");
  st.textContent = s.status + (s.degraded.length ? ": " + s.degraded.join("; ") : "");
  st.className = "pill " + (s.status === "ok" ? "ok" : "bad");
  $("updated").textContent = new Date(s.at_s * 1000).toLocaleTimeString();
  $("uptime").textContent = fmt(s.uptime_s / 60, 1) + " min";
  const cap = s.capacity;
  for (const k of ["serving", "loading", "draining", "ejected", "dead", "total"]) {
    $("cap-" + k).textContent = cap[k];
  }
  const d = s.demand;
  $("rate").textContent = !d.metered ? "off"
    : d.rate_replicas === null ? "measuring" : d.rate_replicas.toPrecision(3);
  $("rate-window").textContent =
    d.rate_replicas === null ? "" : "over " + fmt(d.window_s, 0) + " s";
  $("vs").textContent = cap.serving + " serving, " + cap.loading + " loading";
  $("in-flight").textContent = d.in_flight;
  $("backlog").textContent =
    d.backlog_requests + " req, " + fmt(d.backlog_work_s, 2) + " replica-s";
  $("queued").textContent = d.queued;
  const loading = s.replicas.filter((r) => r.state === "loading").map((r) => r.id);
  $("loading-ids").textContent = loading.length ? loading.join(", ") : "nothing";
  const reps = s.replicas.slice().sort((a, b) =>
    ORDER.indexOf(a.state) - ORDER.indexOf(b.state) || (a.id < b.id ? -1 : 1));
  fill($("replicas"), reps, (r) => [
    r.id,
    el("span", "pill " + r.state, r.state + (r.eject_reason ? " (" + r.eject_reason + ")" : "")),
    r.in_flight, fmt(r.running, 0), fmt(r.waiting, 0),
    (() => { const f = el("span"); f.appendChild(bar(r.kv_usage));
             f.appendChild(el("span", "num", fmt(r.kv_usage * 100, 0) + "%")); return f; })(),
    r.profile,
  ], (tr, r) => { tr.dataset.replica = r.id; tr.dataset.state = r.state; });
  $("no-replicas").hidden = reps.length > 0;
  fill($("decisions"), s.decisions.slice(0, MAX_DECISIONS), (x) => [
    ago(x.at_s, now), x.replica, x.reason, x.tenant, x.policy, x.hit_tokens,
  ], (tr, x) => { tr.dataset.reason = x.reason; });
  $("no-decisions").hidden = s.decisions.length > 0;
  fill($("tenants"), s.tenants, (t) => [
    t.id, (() => { const f = el("span"); f.appendChild(bar(t.share));
                   f.appendChild(el("span", "num", fmt(t.share * 100, 1) + "%")); return f; })(),
    fmt(t.weight, 2), t.priority, t.in_flight, t.queued,
  ], (tr, t) => { tr.dataset.tenant = t.id; });
  $("no-tenants").hidden = s.tenants.length > 0;
  $("scaling").hidden = s.autoscaler.length === 0;
  fill($("scale"), s.autoscaler, (a) => [ago(a.at_s, now), a.target, a.reason, a.ready, a.loading]);
  document.body.dataset.loaded = "1";
}
function headers() {
  const key = sessionStorage.getItem("cp-admin-key");
  return key ? { "Authorization": "Bearer " + key } : {};
}
async function poll() {
  try {
    const r = await fetch("/admin/status", { headers: headers(), cache: "no-store" });
    if (r.status === 401) {
      $("auth").hidden = false;
      $("error").textContent = "the router asks for its admin key";
    } else if (!r.ok) {
      let msg = "HTTP " + r.status;
      try { msg += ": " + (await r.json()).error.message; } catch (e) { /* not JSON */ }
      $("error").textContent = msg;
    } else {
      $("auth").hidden = true;
      $("error").textContent = "";
      render(await r.json());
    }
  } catch (e) {
    $("error").textContent = "the router is unreachable (" + e + ")";
  }
  setTimeout(poll, POLL_MS);
}
$("auth").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem("cp-admin-key", $("key").value);
  $("key").value = "";
});
poll();
""".replace("__POLL_MS__", str(POLL_MS))

_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 0; background: #f6f7f9; color: #1d232b; }
header { background: #1d232b; color: #fff; padding: 10px 18px; display: flex; gap: 18px;
         align-items: baseline; flex-wrap: wrap; }
header h1 { font-size: 17px; margin: 0; }
main { padding: 12px 18px; display: grid; gap: 14px;
       grid-template-columns: repeat(auto-fit, minmax(520px, 1fr)); }
section { background: #fff; border: 1px solid #dde1e6; border-radius: 6px; padding: 10px 14px;
          overflow-x: auto; }
section.wide { grid-column: 1 / -1; }
h2 { font-size: 14px; margin: 0 0 8px; text-transform: uppercase; letter-spacing: .04em;
     color: #4b5563; }
table { border-collapse: collapse; width: 100%; }
th, td { text-align: left; padding: 3px 6px; border-bottom: 1px solid #eef0f3;
         white-space: nowrap; }
th { font-weight: 600; color: #4b5563; font-size: 12px; }
.figs { display: grid; grid-template-columns: repeat(3, 1fr); gap: 8px; }
.fig b { display: block; font-size: 20px; }
.fig span { color: #6b7280; font-size: 12px; }
.pill { padding: 1px 8px; border-radius: 9px; font-size: 12px; background: #e5e7eb; }
.pill.ready, .pill.ok { background: #d1fae5; color: #065f46; }
.pill.loading { background: #dbeafe; color: #1e40af; }
.pill.draining { background: #fef3c7; color: #92400e; }
.pill.ejected { background: #fee2e2; color: #991b1b; }
.pill.dead, .pill.bad { background: #374151; color: #fff; }
.bar { display: inline-block; width: 80px; height: 8px; background: #e5e7eb;
       border-radius: 4px; margin-right: 6px; vertical-align: middle; overflow: hidden; }
.fill { display: block; height: 100%; background: #6366f1; }
.num { font-variant-numeric: tabular-nums; }
.muted { color: #6b7280; }
#error { color: #b91c1c; }
"""

PAGE_HTML = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>controlplane status</title>
<style>{_CSS}</style></head>
<body>
<header><h1>controlplane fleet</h1><span id="model"></span><span id="overall" class="pill"></span>
<span>updated <span id="updated">-</span></span><span>up <span id="uptime">-</span></span>
<span id="error"></span>
<form id="auth" hidden><input id="key" type="password" placeholder="admin key"
 autocomplete="off"> <button>use key</button></form></header>
<main>
<section><h2>Capacity and demand</h2><div class="figs">
<div class="fig"><b id="cap-serving">-</b><span>serving</span></div>
<div class="fig"><b id="cap-loading">-</b><span>loading</span></div>
<div class="fig"><b id="cap-draining">-</b><span>draining</span></div>
<div class="fig"><b id="cap-ejected">-</b><span>ejected</span></div>
<div class="fig"><b id="cap-dead">-</b><span>dead</span></div>
<div class="fig"><b id="cap-total">-</b><span>replicas known</span></div>
<div class="fig"><b id="rate">-</b>
<span>demand, replicas <span id="rate-window"></span></span></div>
<div class="fig"><b id="vs">-</b><span>against capacity</span></div>
<div class="fig"><b id="in-flight">-</b><span>requests in flight</span></div>
<div class="fig"><b id="backlog">-</b><span>backlog (no first token)</span></div>
<div class="fig"><b id="queued">-</b><span>in the fair queue</span></div>
<div class="fig"><b id="loading-ids">-</b><span>loading now</span></div>
</div></section>
<section><h2>Replicas</h2><table><thead><tr><th>id</th><th>state</th><th>in flight</th>
<th>running</th><th>waiting</th><th>KV</th><th>profile</th></tr></thead>
<tbody id="replicas"></tbody></table><p id="no-replicas" class="muted" hidden>no replica</p>
</section>
<section class="wide"><h2>Last routing decisions</h2><table><thead><tr><th>when</th><th>replica</th>
<th>reason</th><th>tenant</th><th>policy</th><th>hit tokens</th></tr></thead>
<tbody id="decisions"></tbody></table>
<p id="no-decisions" class="muted" hidden>no request routed yet</p></section>
<section><h2>Tenant shares</h2><table><thead><tr><th>tenant</th><th>share of work</th>
<th>weight</th><th>class</th><th>in flight</th><th>queued</th></tr></thead>
<tbody id="tenants"></tbody></table><p id="no-tenants" class="muted" hidden>no tenant</p>
</section>
<section id="scaling" hidden><h2>Autoscaler</h2><table><thead><tr><th>when</th>
<th>target</th><th>reason</th><th>ready</th><th>loading</th></tr></thead>
<tbody id="scale"></tbody></table></section>
</main>
<script>{_SCRIPT}</script>
</body></html>
"""

_HASH = base64.b64encode(hashlib.sha256(_SCRIPT.encode()).digest()).decode()
PAGE_CSP = (
    f"default-src 'none'; script-src 'sha256-{_HASH}'; style-src 'unsafe-inline'; "
    "connect-src 'self'; form-action 'none'; frame-ancestors 'none'; base-uri 'none'"
)

__all__ = ["PAGE_CSP", "PAGE_HTML", "POLL_MS"]
