"""The inspect report's HTML page, drawn from the report's data (luisaml/report.py `html` puts it
together): its style, its one script (zoom and pan, the search box, a node's details), the graph of
stages and the live ranges of an allocation as inline SVG, the node and stage tables; and the units
both the page and the text view write quantities in. Model text is escaped wherever it enters the
markup, and reaches the script only as JSON data that it writes as text (names come from an
untrusted file); the page's Content-Security-Policy runs that script alone and fetches nothing."""
from __future__ import annotations

import base64
import hashlib
import html as _html
import json
import math
from typing import Any, Mapping

from .model import shape_str


def shape_text(info: Mapping) -> str:
    """Return a tensor's dtype and shape as written: 'float[batch, 3]'."""
    return f"{info['dtype'] or '?'}{shape_str(info['shape'])}"


def si_text(n: int, unit: str) -> str:
    """Return a quantity with an SI prefix: '1.2 MFLOP', '4 FLOP'."""
    for prefix, k in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= k:
            return f"{n / k:.1f} {prefix}{unit}"
    return f"{n} {unit}"


def byte_text(n: int) -> str:
    """Return a byte count in binary units: '1.5 MiB', '12 B'."""
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k:
            return f"{n / k:.1f} {unit}"
    return f"{n} B"


CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0 24px 24px;color:#1d232a;background:#fff}
h1{font-size:22px;margin:16px 0 4px}h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #d8dee4;padding-bottom:4px}
h3{font-size:15px;margin:18px 0 6px}.sub{color:#57606a}
.bar-top{position:sticky;top:0;z-index:3;background:#fff;padding:8px 0;border-bottom:1px solid #eaeef2;display:flex;
gap:10px;align-items:center;flex-wrap:wrap}
.bar-top input{font:inherit;padding:3px 8px;width:min(360px,60vw);border:1px solid #8c959f;border-radius:6px}
.scroll{overflow-x:auto;border:1px solid #eaeef2;border-radius:6px}
table{border-collapse:collapse;font-size:13px;width:100%}td,th{padding:3px 10px;border-bottom:1px solid #eaeef2;
text-align:left;vertical-align:top;overflow-wrap:break-word}th{background:#f6f8fa;white-space:nowrap}
td.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap;overflow-wrap:normal}
code{font:12px ui-monospace,SFMono-Regular,Menlo,monospace}table.kv{width:auto}.kv td:first-child{color:#57606a;overflow-wrap:normal}
.w{display:block;min-width:10ch;overflow-wrap:anywhere}.names{max-height:9.5em;overflow-y:auto}
tr[data-node]{cursor:pointer}tr.hit{background:#fff8c5}tr.sel{background:#ddf4ff}
.track{display:block;width:6em;margin:2px 0 0 auto;background:#eaeef2;border-radius:2px}
.share{display:block;height:4px;background:#cf222e;border-radius:2px}
svg text{font:12px ui-monospace,SFMono-Regular,Menlo,monospace;fill:#1d232a}
svg .title{font-weight:600}svg .dim{fill:#57606a}svg .ep{fill:#8250df}svg .inl{fill:#57606a;font-style:italic}
svg .time{fill:#cf222e;font-weight:600}rect.share{fill:#cf222e}
g.stage rect.box{stroke-width:1.2}g.stage:hover rect.box,g.stage.hit rect.box{stroke-width:2.5}
.d-element rect.box{fill:#ddf4ff;stroke:#0969da}.d-items rect.box{fill:#dafbe1;stroke:#1a7f37}
.d-sample rect.box,.d-single rect.box{fill:#fff8c5;stroke:#9a6700}.d-fused rect.box{fill:#fbefff;stroke:#8250df}
.d-blocks rect.box{fill:#fff1e5;stroke:#bc4c00}.d-io rect.box,.d-kernel rect.box{fill:#f6f8fa;stroke:#57606a}
g.node{cursor:pointer}g.node rect.hl{fill:transparent}g.node:hover rect.hl{fill:#0969da22}
g.node.hit rect.hl{fill:#ffd33d;fill-opacity:.75}g.node.sel rect.hl{fill:#0969da;fill-opacity:.3;stroke:#0969da}
g.edge path{fill:none;stroke:#57606a;stroke-width:1.3}g.edge:hover path{stroke:#cf222e;stroke-width:2.5}
g.edge text{font-size:11px;fill:#57606a}
rect.bar{stroke:#1d232a;stroke-width:.5}rect.bar:hover{stroke-width:2}
.legend span{display:inline-block;padding:0 8px;margin-right:6px;border-radius:4px;border:1px solid}
.zoombar{display:flex;gap:4px;align-items:center;margin:0 0 4px}.zoombar button{font:inherit;min-width:2.2em;
padding:0 6px;border:1px solid #8c959f;border-radius:6px;background:#f6f8fa;cursor:pointer}
.zoomview{overflow:auto;border:1px solid #eaeef2;border-radius:6px}
.zoomview.live{overflow:hidden;cursor:grab;touch-action:none}.zoomview.live.dragging{cursor:grabbing}
.zoomview:focus-visible{outline:2px solid #0969da}
#details{position:fixed;right:16px;bottom:16px;z-index:4;width:min(380px,90vw);max-height:60vh;overflow:auto;
background:#fff;border:1px solid #8c959f;border-radius:8px;box-shadow:0 8px 24px #1d232a33;padding:8px 12px}
#details[hidden]{display:none}#details h3{margin:2px 24px 6px 0;overflow-wrap:anywhere}
#details dl{display:grid;grid-template-columns:max-content minmax(0,1fr);gap:2px 10px;margin:0;font-size:13px}
#details dt{color:#57606a}#details dd{margin:0;overflow-wrap:anywhere;font:12px ui-monospace,SFMono-Regular,Menlo,monospace}
#details .close{position:absolute;right:8px;top:6px;border:0;background:none;font-size:18px;cursor:pointer}
"""
_PALETTE = ("#54aeff", "#4ac26b", "#d4a72c", "#fb8f44", "#c297ff", "#ff8182", "#6fdde0", "#a0a8b0")

# The page's one script: zoom and pan of the drawings (their viewBox), the search box, and a node's
# details on click. It reads the model's text only as data (JSON.parse of the report-data element)
# and writes it only through textContent, so no name or attribute is ever parsed as markup or run;
# the page's Content-Security-Policy admits this script alone, by its hash, and fetches nothing.
SCRIPT = r"""
(() => {
"use strict";
const $ = (s, r = document) => r.querySelector(s);
const $$ = (s, r = document) => Array.from(r.querySelectorAll(s));
const data = JSON.parse($("#report-data").textContent);
const byName = new Map((data.nodes || []).map(d => [d.name, d]));
const views = new Map();

function zoomable(box) {
  const view = $(".zoomview", box), svg = $("svg", view), label = $(".zoomlabel", box);
  const W = parseFloat(svg.getAttribute("width")) || 1, H = parseFloat(svg.getAttribute("height")) || 1;
  svg.setAttribute("width", "100%");
  svg.setAttribute("height", "100%");
  svg.setAttribute("preserveAspectRatio", "xMinYMin meet");
  view.classList.add("live");
  const st = {s: 1, x: 0, y: 0};
  const size = () => [Math.max(view.clientWidth, 1), Math.max(view.clientHeight, 1)];
  const clamp = (v, lo, hi) => hi <= 0 ? 0 : Math.min(Math.max(v, lo), hi);  // narrower than the view: at 0
  function apply() {
    const [w, h] = size(), vw = w / st.s, vh = h / st.s;
    st.x = clamp(st.x, 0, W - vw);
    st.y = clamp(st.y, 0, H - vh);
    svg.setAttribute("viewBox", `${st.x.toFixed(2)} ${st.y.toFixed(2)} ${vw.toFixed(2)} ${vh.toFixed(2)}`);
    if (label) label.textContent = `${Math.round(st.s * 100)}%`;
  }
  function zoomAt(f, cx, cy) {
    const s = Math.min(Math.max(st.s * f, 0.02), 16);
    const ux = st.x + cx / st.s, uy = st.y + cy / st.s;
    st.s = s; st.x = ux - cx / s; st.y = uy - cy / s;
    apply();
  }
  const api = {
    zoom(f) { const [w, h] = size(); zoomAt(f, w / 2, h / 2); },
    fit() { const [w, h] = size(); st.s = Math.min(w / W, h / H, 1); st.x = st.y = 0; apply(); },
    width() { const [w] = size(); st.s = Math.min(w / W, 1); st.x = st.y = 0; apply(); },
    actual() { st.s = 1; apply(); },
    reveal(el) {
      const b = el.getBBox(), [w, h] = size();
      if (st.s < 0.5) st.s = 1;
      st.x = b.x + b.width / 2 - w / st.s / 2;
      st.y = b.y + b.height / 2 - h / st.s / 2;
      apply();
    },
  };
  view.addEventListener("wheel", e => {
    const unit = e.deltaMode === 1 ? 16 : e.deltaMode === 2 ? size()[1] : 1;
    if (e.ctrlKey || e.metaKey) {
      e.preventDefault();
      const r = view.getBoundingClientRect();
      zoomAt(Math.exp(-e.deltaY * unit * 0.002), e.clientX - r.left, e.clientY - r.top);
      return;
    }
    const x0 = st.x, y0 = st.y;
    st.x += e.deltaX * unit / st.s;
    st.y += e.deltaY * unit / st.s;
    apply();
    if (st.x !== x0 || st.y !== y0) e.preventDefault();  // else the page scrolls on
  }, {passive: false});
  let drag = null, moved = false;
  view.addEventListener("pointerdown", e => {
    if (e.button === 0) { drag = {x: e.clientX, y: e.clientY, sx: st.x, sy: st.y}; moved = false; }
  });
  view.addEventListener("pointermove", e => {
    if (!drag) return;
    const dx = e.clientX - drag.x, dy = e.clientY - drag.y;
    if (!moved && Math.hypot(dx, dy) < 4) return;
    if (!moved) { moved = true; view.setPointerCapture(e.pointerId); view.classList.add("dragging"); }
    st.x = drag.sx - dx / st.s; st.y = drag.sy - dy / st.s;
    apply();
  });
  const end = () => { drag = null; view.classList.remove("dragging"); };
  view.addEventListener("pointerup", end);
  view.addEventListener("pointercancel", end);
  view.addEventListener("click", e => { if (moved) { e.stopPropagation(); moved = false; } }, true);
  view.addEventListener("keydown", e => {
    const k = {"+": 1.25, "=": 1.25, "-": 0.8}[e.key];
    if (k) { api.zoom(k); e.preventDefault(); } else if (e.key === "0") { api.fit(); e.preventDefault(); }
  });
  $$(".zoombar button", box).forEach(b => b.addEventListener("click", () => {
    const how = b.dataset.zoom;
    if (how === "in") api.zoom(1.25); else if (how === "out") api.zoom(0.8); else api[how]();
  }));
  window.addEventListener("resize", apply);
  api.width();
  views.set(view.dataset.view, api);
}
$$(".zoombox").forEach(zoomable);

// a node's details: written with textContent only
const panel = $("#details");
const text = (tag, s, cls) => {
  const e = document.createElement(tag);
  e.textContent = s;
  if (cls) e.className = cls;
  return e;
};
const shapeOf = t => `${t.dtype || "?"}[${t.shape == null ? "?" : t.shape.join(", ")}]`;
const valueOf = v => typeof v === "string" ? v : Array.isArray(v) ? `[${v.map(x => JSON.stringify(x)).join(", ")}]`
    : JSON.stringify(v);
function select(name) {
  const d = byName.get(name);
  if (!d) return;
  $$(".sel").forEach(e => e.classList.remove("sel"));
  $$("[data-node]").forEach(e => { if (e.dataset.node === name) e.classList.add("sel"); });
  const close = text("button", "\u00d7", "close");
  close.title = "close (Esc)";
  close.addEventListener("click", () => { panel.hidden = true; });
  const dl = document.createElement("dl");
  const row = (k, v) => dl.append(text("dt", k), text("dd", v));
  row("op", d.domain && d.domain !== "ai.onnx" ? `${d.domain}::${d.op_type}` : d.op_type);
  const where = d.stage == null ? "" : `stage ${d.stage}`;
  row("runs", [where, d.role].filter(Boolean).join(", ") +
      (d.inlined_in && d.inlined_in.length > 1 ? ` (inline in stages ${d.inlined_in.join(", ")})` : ""));
  const attrs = Object.entries(d.attrs || {});
  if (!attrs.length) row("attributes", "none");
  attrs.forEach(([k, v]) => row(`@${k}`, valueOf(v)));
  const ins = d.inputs_info || (d.inputs || []).map(n => ({name: n}));
  ins.forEach((t, k) => row(`input ${k}`, t.name === "" ? "(absent)" :
      `${t.name}: ${shapeOf(t)}${t.constant ? " (constant)" : ""}`));
  (d.outputs || []).forEach((t, k) => row(`output ${k}`, `${t.name}: ${shapeOf(t)}`));
  row("params", (d.params ?? 0).toLocaleString("en"));
  row("FLOPs", d.flops == null ? "unknown" : d.flops.toLocaleString("en"));
  row("bytes", (d.bytes ?? 0).toLocaleString("en"));
  if (d.note) row("compiles", d.note);
  panel.replaceChildren(close, text("h3", `${d.op_type} ${d.name}`), dl);
  panel.hidden = false;
}
document.addEventListener("click", e => {
  const el = e.target.closest && e.target.closest("[data-node]");
  if (el) select(el.dataset.node);
});
document.addEventListener("keydown", e => { if (e.key === "Escape") panel.hidden = true; });

// the search box: nodes whose name or op type holds the text, and the stages that run them
const search = $("#search"), count = $("#search-count");
let hits = [], at = -1;
function find() {
  const q = search.value.trim().toLowerCase();
  const found = new Set();
  if (q) byName.forEach((d, name) => {
    const op = d.domain && d.domain !== "ai.onnx" ? `${d.domain}::${d.op_type}` : d.op_type;
    if (name.toLowerCase().includes(q) || op.toLowerCase().includes(q)) found.add(name);
  });
  hits = []; at = -1;
  $$("#graph g.node").forEach(g => {
    const on = found.has(g.dataset.node);
    g.classList.toggle("hit", on);
    if (on) hits.push(g);
  });
  const stages = new Set();
  byName.forEach((d, name) => {
    if (!found.has(name)) return;
    if (d.stage != null) stages.add(String(d.stage));
    (d.inlined_in || []).forEach(k => stages.add(String(k)));
  });
  $$("#graph g.stage").forEach(g => g.classList.toggle("hit", stages.has(g.dataset.stage)));
  const filter = (tr, on) => { tr.classList.toggle("hit", on); tr.hidden = !!q && !on; };
  $$("#nodes tr[data-node]").forEach(tr => filter(tr, found.has(tr.dataset.node)));
  $$("#stages tr[data-stage]").forEach(tr => filter(tr, stages.has(tr.dataset.stage)));
  const n = found.size, m = stages.size;
  count.textContent = q ? `${n} node${n === 1 ? "" : "s"} in ${m} stage${m === 1 ? "" : "s"}` +
      (hits.length ? " (Enter: the next in the graph)" : "") : "";
}
if (search) {
  search.addEventListener("input", find);
  search.addEventListener("keydown", e => {
    if (e.key !== "Enter" || !hits.length) return;
    at = (at + 1) % hits.length;
    const g = views.get("graph");
    if (g) g.reveal(hits[at]);
    select(hits[at].dataset.node);
  });
}
})();
"""
CSP = ("default-src 'none'; style-src 'unsafe-inline'; img-src data:; script-src 'sha256-"
       + base64.b64encode(hashlib.sha256(SCRIPT.encode()).digest()).decode() + "'")


def escape(s: Any) -> str:
    """Escape model text for HTML (names come from an untrusted file)."""
    return _html.escape(str(s), quote=True)


def clip(s: str, n: int) -> str:
    """Return s cut to n characters, an ellipsis ending a cut one."""
    return s if len(s) <= n else s[: n - 1] + "…"


def alloc_summary(a: Mapping) -> str:
    """Return an allocation's one-line summary: slots, bytes pooled and unpooled, peak, in-place, views."""
    n = len(a["slots"])
    return (f"{n} slot{'' if n == 1 else 's'}, {byte_text(a['bytes'])} pooled (one array per tensor: "
            f"{byte_text(a['bytes_unpooled'])}); peak live {byte_text(a['peak_bytes'])}; {len(a['inplace'])} in-place, "
            f"{len(a['views'])} views")


def data_json(rep: Mapping) -> str:
    """Return the nodes the script shows (their details) as JSON safe inside a <script> element:
    every '<', '>' and '&' written as a \\u escape, so no model text can close the element."""
    keep = ("name", "op_type", "domain", "stage", "role", "inlined_in", "attrs", "inputs", "inputs_info", "outputs",
            "params", "flops", "bytes", "note")
    nodes = [{k: d[k] for k in keep if k in d} for d in rep.get("nodes") or []]
    text = json.dumps({"nodes": nodes}, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def zoom_box(svg: str, height: int, view: str) -> str:
    """Return a drawing in a view the page's script zooms and pans (buttons, ctrl+wheel, drag;
    the wheel scrolls it), no taller than 75% of the window; without the script, it scrolls."""
    return (f"<div class=zoombox><div class=zoombar><button type=button data-zoom=in title='zoom in (+)'>+</button>"
            "<button type=button data-zoom=out title='zoom out (-)'>−</button>"
            "<button type=button data-zoom=width title='fit the width'>width</button>"
            "<button type=button data-zoom=fit title='fit the whole drawing (0)'>fit</button>"
            "<button type=button data-zoom=actual title='actual size'>1:1</button>"
            "<span class='zoomlabel sub'></span><span class=sub>· drag or wheel to pan, ctrl+wheel to zoom</span>"
            f"</div><div class=zoomview data-view={view} tabindex=0 style='height:min(75vh,{height + 2}px)'>{svg}"
            "</div></div>")


def _names(names: list[str]) -> str:
    """Return a cell's list of names, each whole (wrapped anywhere), scrolling past a few lines."""
    return "<div class='w names'>" + ", ".join(f"<code>{escape(n)}</code>" for n in names) + "</div>"


def time_text(ms: float) -> str:
    """Return a stage's time: '0.123 ms', '12.3 ms', '1.23 s'."""
    return f"{ms / 1e3:.2f} s" if ms >= 1e3 else f"{ms:.3g} ms" if ms >= 10 else f"{ms:.3f} ms"


def nodes_table(rep: Mapping, per: str) -> str:
    """Return the page's node table; per: "per sample" or "in all" (what the numbers count). A row
    shows the node's details when clicked."""
    head = ("node", "op", "stage", "role", "outputs", "params", f"FLOPs {per}", f"bytes {per}", "how it compiles")
    rows = []
    for d in rep["nodes"]:
        op = d["op_type"] if d["domain"] == "ai.onnx" else d["domain"] + "::" + d["op_type"]
        rows.append(f"<tr data-node='{escape(d['name'])}'>" + "".join([
            f"<td><code class=w>{escape(d['name'])}</code></td>",
            f"<td><span class=w>{escape(op)}</span></td>",
            f"<td class=n>{'' if d['stage'] is None else escape(d['stage'])}</td><td>{escape(d['role'])}</td>",
            f"<td><code class=w>{escape(', '.join(shape_text(o) for o in d['outputs']))}</code></td>",
            f"<td class=n>{d['params']:,}</td>",
            f"<td class=n>{'?' if d['flops'] is None else format(d['flops'], ',')}</td>",
            f"<td class=n>{d['bytes']:,}</td><td class=sub><span class=w>{escape(d['note'])}</span></td>"]) + "</tr>")
    return ("<h2>Nodes</h2><div class=sub>click a row for the node's attributes and its inputs' shapes</div>"
            "<div class=scroll><table id=nodes><tr>" + "".join(f"<th>{escape(h)}</th>" for h in head)
            + "</tr>" + "".join(rows) + "</table></div>")


def stages_table(rep: Mapping) -> str:
    """Return the page's stage table, in launch order; with the stages' times when profiled."""
    prof = rep.get("profile")
    total = (prof or {}).get("total_ms") or 1.0
    rows = []
    for st in rep["stages"]:
        names = "".join(f"<td>{_names(st[k])}</td>" for k in ("nodes", "epilogue", "inlined", "reads", "writes"))
        when = ""
        if prof:
            ms = st.get("time_ms")
            share = 100 * ms / total if ms is not None else 0.0
            when = ("<td class=n></td>" if ms is None else
                    f"<td class=n data-ms='{ms:.6f}'>{escape(time_text(ms))}<br>{share:.1f}%<span class=track>"
                    f"<span class=share style='width:{min(100.0, share):.1f}%'></span></span></td>")
        k = int(st["index"])
        rows.append(f"<tr data-stage={k}><td class=n>{k}</td><td>{escape(st['domain'])}</td><td class=n>"
                    f"{st['items']:,}<br>{'per sample' if st['batched'] else 'in all'}</td>{when}{names}</tr>")
    head = ("stage", "domain", "items") + (("time",) if prof else ()) + ("nodes", "epilogue", "inline", "reads",
                                                                         "writes")
    sub = ""
    if prof:
        sub = (f"<div class=sub>time: the median of {int(prof['repeat'])} launches of the stage alone on "
               f"{escape(prof['backend'])} (batch {int(prof['batch'])}, random inputs), and its share of all "
               f"stages' {escape(time_text(total))}</div>")
    return ("<h2>Stages</h2>" + sub + "<div class=scroll><table id=stages><tr>"
            + "".join(f"<th>{h}</th>" for h in head) + "</tr>" + "".join(rows) + "</table></div>")


# the graph: boxes stacked in launch order (a topological order), graph inputs on top and outputs
# at the bottom; a tensor passed to the next box is a straight arrow, one passed further is an arc
# in a lane on the right (lanes coloured like intervals, so arcs never run over each other). A box
# is as wide as its longest line needs, between _BOX_W and _BOX_MAX (past that a line is cut, whole
# in its tooltip and the node's details); a line per node, clickable.
_BOX_W, _BOX_MAX, _LINE, _PAD, _GAP, _LEFT, _TOP = 520, 1400, 16, 8, 34, 16, 12
_CHAR = 7.3  # the width of a 12px monospace character
_RIGHT = 48  # characters of a line's shapes shown


def _op(d: Mapping) -> str:
    return d["op_type"] if d.get("domain", "ai.onnx") == "ai.onnx" else f"{d['domain']}::{d['op_type']}"


def graph_svg(rep: Mapping) -> tuple[str, int]:
    """Return the graph as SVG and its height: a box per stage (a line per node, epilogue and inlined
    node; its time with --profile), top to bottom in launch order, an arrow per tensor passed
    between stages in a device buffer."""
    nodes = {d["name"]: d for d in rep["nodes"]}
    prof = rep.get("profile")
    total = (prof or {}).get("total_ms") or 1.0

    def line(kind: str, prefix: str, name: str) -> tuple[str, str, str, str | None]:
        d = nodes.get(name)
        if d is None:
            return (kind, prefix + name, "", None)
        return (kind, f"{prefix}{_op(d)} {name}", ", ".join(shape_text(o) for o in d["outputs"]), name)

    boxes: list[dict] = [{"id": "inputs", "domain": "io", "title": "graph inputs",
                          "lines": [("", io["name"], shape_text(io), None) for io in rep["inputs"]],
                          "writes": [io["name"] for io in rep["inputs"]], "reads": []}]
    if rep["stages"] is not None:
        for st in rep["stages"]:
            lines = [line("", "", n) for n in st["nodes"]]
            lines += [line("ep", "+ ", n) for n in st["epilogue"]]
            lines += [line("inl", "inline ", n) for n in st["inlined"]]
            items = f"{st['items']:,} {'per sample' if st['batched'] else 'in all'}"
            box = {"id": f"stage {st['index']}", "index": st["index"], "domain": st["domain"],
                   "title": f"stage {st['index']} · {st['domain']} · {items}", "lines": lines,
                   "reads": st["reads"], "writes": st["writes"], "tip": st["describe"]}
            if prof and st.get("time_ms") is not None:
                box["time"] = (st["time_ms"], st["time_ms"] / total)
                box["tip"] += f" — {time_text(st['time_ms'])}, {100 * st['time_ms'] / total:.1f}% of the stages' time"
            boxes.append(box)
    else:
        ran = [d for d in rep["nodes"] if d["role"] != "view"]
        box = {"id": "kernel", "domain": "kernel", "title": "the per-sample kernel (one thread per sample)",
               "lines": [line("", "", d["name"]) for d in ran],
               "reads": [io["name"] for io in rep["inputs"]], "writes": [io["name"] for io in rep["outputs"]]}
        if prof:
            box["time"] = (prof["total_ms"], 1.0)
        boxes.append(box)
    boxes.append({"id": "outputs", "domain": "io", "title": "graph outputs",
                  "lines": [("", io["name"], shape_text(io), None) for io in rep["outputs"]],
                  "reads": [io["name"] for io in rep["outputs"]], "writes": []})
    # where each tensor is written (the last writer before a reader: a graph input is box 0)
    slot = {r["name"]: r["slot"] for r in (rep["buffers"] or {"tensors": []})["tensors"]}
    outputs = {io["name"] for io in rep["outputs"]}
    writer: dict[str, int] = {}
    edges: dict[tuple[int, int], list[str]] = {}
    for k, b in enumerate(boxes):
        for name in b["reads"]:
            if name in writer and writer[name] != k:
                edges.setdefault((writer[name], k), []).append(name)
        for name in b["writes"]:
            writer[name] = k
    chars = max([len(b["title"]) + 24 for b in boxes]
                + [len(left) + 3 + min(len(right), _RIGHT) for b in boxes for _, left, right, _ in b["lines"]])
    box_w = int(min(max(_BOX_W, chars * _CHAR + 2 * _PAD + 16), _BOX_MAX))
    room = int((box_w - 2 * _PAD - 16) / _CHAR)  # characters a line holds
    y = _TOP
    for b in boxes:
        b["y"] = y
        b["h"] = _LINE * (1 + max(len(b["lines"]), 1)) + 2 * _PAD
        y += b["h"] + _GAP
    lanes: list[int] = []  # the last box each lane is busy until
    lane_of: dict[tuple[int, int], int] = {}
    for (a, z) in sorted(e for e in edges if e[1] - e[0] > 1):
        for i, busy in enumerate(lanes):
            if busy <= a:
                lanes[i], lane_of[(a, z)] = z, i
                break
        else:
            lane_of[(a, z)] = len(lanes)
            lanes.append(z)
    width = _LEFT + box_w + 40 + 16 * len(lanes) + 20
    height = y - _GAP + _TOP
    out = [f"<svg id=graph xmlns='http://www.w3.org/2000/svg' width={width} height={height} "
           f"viewBox='0 0 {width} {height}' role=img aria-label='stages of {escape(rep['model'])}'>",
           "<defs><marker id=arrow viewBox='0 0 10 10' refX=9 refY=5 markerWidth=7 markerHeight=7 "
           "orient=auto-start-reverse>"
           "<path d='M0,0L10,5L0,10z' fill='#57606a'/></marker></defs>"]
    for b in boxes:
        cls = f"stage d-{b['domain']}" if "index" in b else f"io d-{b['domain']}"
        data = f" data-stage={int(b['index'])}" if "index" in b else f" data-box={escape(b['id'])}"
        out.append(f"<g class='{cls}'{data}><title>{escape(b.get('tip', b['title']))}</title>"
                   f"<rect class=box x={_LEFT} y={b['y']} width={box_w} height={b['h']} rx=6 />"
                   f"<text class=title x={_LEFT + _PAD} y={b['y'] + _PAD + 12}>{escape(b['title'])}</text>")
        if "time" in b:
            ms, share = b["time"]
            out.append(f"<text class=time x={_LEFT + box_w - _PAD} y={b['y'] + _PAD + 12} text-anchor=end>"
                       f"{escape(time_text(ms))} · {100 * share:.1f}%</text>"
                       f"<rect class=share x={_LEFT} y={b['y'] + b['h'] - 4} width={box_w * share:.1f} height=4 />")
        for j, (kind, left, right, name) in enumerate(b["lines"]):
            ty = b["y"] + _PAD + 12 + _LINE * (j + 1)
            cls = f" class={kind}" if kind else ""
            shown = clip(right, _RIGHT)
            cut = clip(left, max(room - len(shown) - 3, 12))  # whole in the tooltip and the details
            text = (f"<text{cls} x={_LEFT + _PAD + 8} y={ty}>{escape(cut)}</text>"
                    + (f"<text class=dim x={_LEFT + box_w - _PAD} y={ty} text-anchor=end>{escape(shown)}</text>"
                       if right else ""))
            if name is None:
                out.append(text)
                continue
            tip = f"{left}: {right}" if right else left
            out.append(f"<g class=node data-node='{escape(name)}'><title>{escape(tip)}</title>"
                       f"<rect class=hl x={_LEFT + 3} y={ty - 12} width={box_w - 6} height={_LINE} rx=3 />{text}</g>")
        out.append("</g>")
    for (a, z), names in sorted(edges.items()):
        src, dst = boxes[a], boxes[z]
        where = [("output" if n in outputs else "input" if a == 0 else f"buffer {slot[n]}" if n in slot else "buffer")
                 for n in names]
        tip = "; ".join(f"{n} ({w})" for n, w in zip(names, where))
        label = clip(", ".join(names), 48) + (f" · {where[0]}" if len(set(where)) == 1 else "")
        out.append(f"<g class=edge data-from='{escape(src['id'])}' data-to='{escape(dst['id'])}'><title>{escape(tip)}</title>")
        if z - a == 1:
            x, y0, y1 = _LEFT + 48, src["y"] + src["h"], dst["y"]
            out.append(f"<path d='M{x},{y0}L{x},{y1 - 1}' marker-end='url(#arrow)'/>"
                       f"<text x={x + 8} y={(y0 + y1) // 2 + 4}>{escape(label)}</text>")
        else:
            lx = _LEFT + box_w + 24 + 16 * lane_of[(a, z)]
            y0, y1 = src["y"] + src["h"] - 10, dst["y"] + 12
            r = 6
            out.append(f"<path d='M{_LEFT + box_w},{y0}L{lx - r},{y0}Q{lx},{y0} {lx},{y0 + r}L{lx},{y1 - r}"
                       f"Q{lx},{y1} {lx - r},{y1}L{_LEFT + box_w + 1},{y1}' marker-end='url(#arrow)'/>")
        out.append("</g>")
    out.append("</svg>")
    return "".join(out), height


# the live-range chart: a row per slot, a column per step, a bar per tensor from the middle of the
# step that writes it to the middle of the last step that reads it (an in-place output starts
# where its input ends), and the bytes live at each step as a curve above
_LABEL_W, _ROW, _BAR, _CURVE = 230, 22, 14, 70


def live_svg(a: Mapping, ident: str) -> tuple[str, int]:
    """Return an allocation's live ranges as SVG and its height: a row per slot, a bar per tensor over
    its live steps, and the bytes live at each step as a curve above; ident: the svg element's id."""
    steps, slots, rows = a["steps"], a["slots"], a["tensors"]
    n = max(len(steps), 1)
    sw = min(40.0, max(6.0, 900.0 / n))
    x0 = _LABEL_W
    top = _CURVE + 20
    label_h = min(max((len(s) for s in steps), default=4), 28) * 7 + 16
    width = int(x0 + sw * n + 20)
    height = top + _ROW * max(len(slots), 1) + label_h
    out = [f"<svg id={ident} class=liveness xmlns='http://www.w3.org/2000/svg' width={width} height={height} "
           f"viewBox='0 0 {width} {height}' role=img aria-label='live ranges of {ident}'>"]
    peak = max(a["live_bytes"], default=0)
    if peak:
        pts = [(x0 + sw * k, _CURVE + 10 - (v / peak) * _CURVE) for k, v in enumerate(a["live_bytes"])]
        path = "".join(f"{'M' if k == 0 else 'L'}{x:.1f},{y:.1f}H{x + sw:.1f}" for k, (x, y) in enumerate(pts))
        at = a["live_bytes"].index(peak)
        out.append(f"<path class=live d='{path}' fill=none stroke='#cf222e' stroke-width='1.5'/>"
                   f"<text class=dim x=8 y=22>bytes live</text><text x=8 y=38>peak {escape(byte_text(peak))}</text>"
                   f"<text class=dim x=8 y=54>{escape(clip('at ' + steps[at], 30))}</text>"
                   f"<line x1={x0} x2={width - 20} y1={_CURVE + 10} y2={_CURVE + 10} stroke='#d8dee4'/>")
    for k in range(len(steps)):  # step grid
        if k % 2 == 0:
            out.append(f"<rect x={x0 + sw * k:.1f} y={top} width={sw:.1f} height={_ROW * max(len(slots), 1)} "
                       "fill='#f6f8fa'/>")
    for j, s in enumerate(slots):
        y = top + _ROW * j
        what = f"slot {s['id']} {s['space']} {s['dtype']}"
        out.append(f"<text x=8 y={y + 15}>{escape(clip(what, 22))}</text>"
                   f"<text class=dim x={x0 - 6} y={y + 15} text-anchor=end>{escape(byte_text(s['bytes']))}</text>")
    if not slots:
        out.append(f"<text class=dim x={x0} y={top + 15}>no tensors pooled here</text>")
    index = {s["id"]: j for j, s in enumerate(slots)}
    for i, r in enumerate(rows):
        y = top + _ROW * index[r["slot"]] + (_ROW - _BAR) / 2
        if r["last"] > r["first"]:
            xa, xb = x0 + sw * (r["first"] + 0.5), x0 + sw * (r["last"] + 0.5)
        else:
            xa, xb = x0 + sw * (r["first"] + 0.2), x0 + sw * (r["first"] + 0.8)
        live = (f"step {steps[r['first']]}" if r["first"] == r["last"] else
                f"steps {r['first']}..{r['last']} ({steps[r['first']]} .. {steps[r['last']]})") if steps else ""
        tip = f"{r['name']}: {r['elements']:,} elements, {byte_text(r['bytes'])}, slot {r['slot']}, live {live}"
        out.append(f"<rect class=bar data-tensor='{escape(r['name'])}' data-slot={r['slot']} x={xa:.1f} y={y:.1f} "
                   f"width={max(xb - xa, 2):.1f} height={_BAR} rx=2 fill='{_PALETTE[i % len(_PALETTE)]}'>"
                   f"<title>{escape(tip)}</title></rect>")
    base = top + _ROW * max(len(slots), 1) + 6
    every = max(1, math.ceil(len(steps) * 12 / (sw * len(steps)))) if steps else 1
    for k, label in enumerate(steps):
        if k % every:
            continue
        x = x0 + sw * (k + 0.5) + 4
        out.append(f"<text class=dim transform='translate({x:.1f},{base}) rotate(-60)' text-anchor=end>"
                   f"{escape(clip(label, 28))}<title>{escape(label)}</title></text>")
    out.append("</svg>")
    return "".join(out), height
