"""The inspect report's HTML page, drawn from the report's data (luisaml/report.py `html` puts it
together): its style, the graph of stages and the live ranges of an allocation as inline SVG, the
node and stage tables; and the units both the page and the text view write quantities in. Model text
is escaped wherever it enters the page (names come from an untrusted file)."""
from __future__ import annotations

import html as _html
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
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px;color:#1d232a;background:#fff}
h1{font-size:22px;margin:0 0 4px}h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #d8dee4;padding-bottom:4px}
h3{font-size:15px;margin:18px 0 6px}.sub{color:#57606a}
.scroll{overflow-x:auto;border:1px solid #eaeef2;border-radius:6px}
table{border-collapse:collapse;font-size:13px}td,th{padding:3px 10px;border-bottom:1px solid #eaeef2;text-align:left;
vertical-align:top}th{background:#f6f8fa;position:sticky;top:0}td.n{text-align:right;font-variant-numeric:tabular-nums}
code{font:12px ui-monospace,SFMono-Regular,Menlo,monospace}td code{white-space:nowrap}.kv td:first-child{color:#57606a}
svg text{font:12px ui-monospace,SFMono-Regular,Menlo,monospace;fill:#1d232a}
svg .title{font-weight:600}svg .dim{fill:#57606a}svg .ep{fill:#8250df}svg .inl{fill:#57606a;font-style:italic}
g.stage rect.box{stroke-width:1.2}g.stage:hover rect.box{stroke-width:2.5}
.d-element rect.box{fill:#ddf4ff;stroke:#0969da}.d-items rect.box{fill:#dafbe1;stroke:#1a7f37}
.d-sample rect.box,.d-single rect.box{fill:#fff8c5;stroke:#9a6700}.d-fused rect.box{fill:#fbefff;stroke:#8250df}
.d-io rect.box,.d-kernel rect.box{fill:#f6f8fa;stroke:#57606a}
g.edge path{fill:none;stroke:#57606a;stroke-width:1.3}g.edge:hover path{stroke:#cf222e;stroke-width:2.5}
g.edge text{font-size:11px;fill:#57606a}
rect.bar{stroke:#1d232a;stroke-width:.5}rect.bar:hover{stroke-width:2}
.legend span{display:inline-block;padding:0 8px;margin-right:6px;border-radius:4px;border:1px solid}
"""
_PALETTE = ("#54aeff", "#4ac26b", "#d4a72c", "#fb8f44", "#c297ff", "#ff8182", "#6fdde0", "#a0a8b0")


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


def nodes_table(rep: Mapping, per: str) -> str:
    """Return the page's node table; per: "per sample" or "in all" (what the numbers count)."""
    head = ("node", "op", "stage", "role", "outputs", "params", f"FLOPs {per}", f"bytes {per}", "how it compiles")
    rows = []
    for d in rep["nodes"]:
        rows.append("<tr>" + "".join([
            f"<td><code>{escape(d['name'])}</code></td>",
            f"<td>{escape(d['op_type'] if d['domain'] == 'ai.onnx' else d['domain'] + '::' + d['op_type'])}</td>",
            f"<td class=n>{'' if d['stage'] is None else d['stage']}</td><td>{escape(d['role'])}</td>",
            f"<td><code>{escape(', '.join(shape_text(o) for o in d['outputs']))}</code></td>",
            f"<td class=n>{d['params']:,}</td>",
            f"<td class=n>{'?' if d['flops'] is None else format(d['flops'], ',')}</td>",
            f"<td class=n>{d['bytes']:,}</td><td class=sub>{escape(d['note'])}</td>"]) + "</tr>")
    return ("<h2>Nodes</h2><div class=scroll><table id=nodes><tr>" + "".join(f"<th>{escape(h)}</th>" for h in head)
            + "</tr>" + "".join(rows) + "</table></div>")


def stages_table(rep: Mapping) -> str:
    """Return the page's stage table, in launch order."""
    rows = []
    for st in rep["stages"]:
        names = "".join(f"<td><code>{escape(', '.join(st[k]))}</code></td>"
                        for k in ("nodes", "epilogue", "inlined", "reads", "writes"))
        rows.append(f"<tr><td class=n>{st['index']}</td><td>{escape(st['domain'])}</td>"
                    f"<td class=n>{st['items']:,} {'per sample' if st['batched'] else 'in all'}</td>{names}</tr>")
    head = ("stage", "domain", "items", "nodes", "epilogue", "inline", "reads", "writes")
    return ("<h2>Stages</h2><div class=scroll><table id=stages><tr>" + "".join(f"<th>{h}</th>" for h in head)
            + "</tr>" + "".join(rows) + "</table></div>")


# the graph: boxes stacked in launch order (a topological order), graph inputs on top and outputs
# at the bottom; a tensor passed to the next box is a straight arrow, one passed further is an arc
# in a lane on the right (lanes coloured like intervals, so arcs never run over each other)
_BOX_W, _LINE, _PAD, _GAP, _LEFT, _TOP = 520, 16, 8, 34, 16, 12


def graph_svg(rep: Mapping) -> str:
    """Return the graph as SVG: a box per stage (its nodes, epilogue and inlined ones), top to bottom in
    launch order, an arrow per tensor passed between stages in a device buffer."""
    nodes = {d["name"]: d for d in rep["nodes"]}
    boxes: list[dict] = [{"id": "inputs", "domain": "io", "title": "graph inputs",
                          "lines": [("", f"{io['name']}", shape_text(io)) for io in rep["inputs"]],
                          "writes": [io["name"] for io in rep["inputs"]], "reads": []}]
    if rep["stages"] is not None:
        for st in rep["stages"]:
            lines = []
            for name in st["nodes"]:
                d = nodes[name]
                lines.append(("", f"{d['op_type']} {name}", ", ".join(shape_text(o) for o in d["outputs"])))
            lines += [("ep", f"+ {nodes[n]['op_type']} {n}", "") for n in st["epilogue"]]
            if st["inlined"]:
                lines.append(("inl", "inline: " + ", ".join(f"{nodes[n]['op_type']} {n}" for n in st["inlined"]), ""))
            items = f"{st['items']:,} {'per sample' if st['batched'] else 'in all'}"
            boxes.append({"id": f"stage {st['index']}", "index": st["index"], "domain": st["domain"],
                          "title": f"stage {st['index']} · {st['domain']} · {items}", "lines": lines,
                          "reads": st["reads"], "writes": st["writes"], "tip": st["describe"]})
    else:
        ran = [d for d in rep["nodes"] if d["role"] != "view"]
        boxes.append({"id": "kernel", "domain": "kernel", "title": "the per-sample kernel (one thread per sample)",
                      "lines": [("", f"{d['op_type']} {d['name']}", ", ".join(shape_text(o) for o in d["outputs"]))
                                for d in ran],
                      "reads": [io["name"] for io in rep["inputs"]], "writes": [io["name"] for io in rep["outputs"]]})
    boxes.append({"id": "outputs", "domain": "io", "title": "graph outputs",
                  "lines": [("", f"{io['name']}", shape_text(io)) for io in rep["outputs"]],
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
    width = _LEFT + _BOX_W + 40 + 16 * len(lanes) + 20
    height = y - _GAP + _TOP
    out = [f"<svg id=graph xmlns='http://www.w3.org/2000/svg' width={width} height={height} "
           f"viewBox='0 0 {width} {height}' role=img aria-label='stages of {escape(rep['model'])}'>",
           "<defs><marker id=arrow viewBox='0 0 10 10' refX=9 refY=5 markerWidth=7 markerHeight=7 "
           "orient=auto-start-reverse>"
           "<path d='M0,0L10,5L0,10z' fill='#57606a'/></marker></defs>"]
    for b in boxes:
        cls = f"stage d-{b['domain']}" if "index" in b else f"io d-{b['domain']}"
        data = f" data-stage={b['index']}" if "index" in b else f" data-box={escape(b['id'])}"
        out.append(f"<g class='{cls}'{data}><title>{escape(b.get('tip', b['title']))}</title>"
                   f"<rect class=box x={_LEFT} y={b['y']} width={_BOX_W} height={b['h']} rx=6 />"
                   f"<text class=title x={_LEFT + _PAD} y={b['y'] + _PAD + 12}>{escape(b['title'])}</text>")
        for j, (kind, left, right) in enumerate(b["lines"]):
            ty = b["y"] + _PAD + 12 + _LINE * (j + 1)
            cls = f" class={kind}" if kind else ""
            room = 68 - min(len(right), 34)
            out.append(f"<text{cls} x={_LEFT + _PAD + 8} y={ty}>{escape(clip(left, room))}</text>")
            if right:
                out.append(f"<text class=dim x={_LEFT + _BOX_W - _PAD} y={ty} text-anchor=end>"
                           f"{escape(clip(right, 34))}</text>")
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
            lx = _LEFT + _BOX_W + 24 + 16 * lane_of[(a, z)]
            y0, y1 = src["y"] + src["h"] - 10, dst["y"] + 12
            r = 6
            out.append(f"<path d='M{_LEFT + _BOX_W},{y0}L{lx - r},{y0}Q{lx},{y0} {lx},{y0 + r}L{lx},{y1 - r}"
                       f"Q{lx},{y1} {lx - r},{y1}L{_LEFT + _BOX_W + 1},{y1}' marker-end='url(#arrow)'/>")
        out.append("</g>")
    out.append("</svg>")
    return "".join(out)


# the live-range chart: a row per slot, a column per step, a bar per tensor from the middle of the
# step that writes it to the middle of the last step that reads it (an in-place output starts
# where its input ends), and the bytes live at each step as a curve above
_LABEL_W, _ROW, _BAR, _CURVE = 230, 22, 14, 70


def live_svg(a: Mapping, ident: str) -> str:
    """Return an allocation's live ranges as SVG: a row per slot, a bar per tensor over its live steps,
    and the bytes live at each step as a curve above; ident: the svg element's id."""
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
    return "".join(out)
