"""The inspect report as data: per node its stage, outputs, parameters, FLOPs and bytes; totals;
the stages; the register allocation of `forward` and the buffer allocation across stages; and the
three ways `luisaml inspect` shows it (`text`, `to_json`, `html`: one self-contained page).

`build(model, ...)` loads and plans a model without a device (what `luisaml inspect` runs);
`from_plan(plan, ...)` reports a plan already made (`net.plan` of a CompiledNetwork). Numbers are
per sample when the network runs one sample at a time (shapes with the batch symbol), else for the
one instance the plan was made for (a graph whose batch moves: at batch 2).

The JSON document (`luisaml inspect --json`, `to_json`) has these keys; new keys may be added,
these keep their names and meanings while "schema" is 1:

- `schema`: 1.  `model`: the model's name.  `opsets`: {domain: version} (the default domain is
  "ai.onnx").  `batch_symbol`: the batch dimension's symbol, or null (one instance).
- `per_sample`: true when the network runs one sample at a time for any batch size;
  `per_sample_impossible`: why not (its batch moves or a node mixes samples), or null.
- `inputs`, `outputs`: [{`name`, `dtype` (ONNX's lower-case name: "float", "int64"), `shape`
  (ints, the batch symbol as a string, "2*batch" for two rows per sample, null when unknown)}].
- `op_counts`: {op type (`domain::` prefixed outside ai.onnx): count} after folding.
- `unsupported`: one line per node no operator implements (when not empty, the keys below
  are empty or null: nothing was planned).
- `nodes`: in program order, each {`name`, `op_type`, `domain`, `inputs` (tensor names, "" for
  an absent optional input), `outputs` (each {`name`, `dtype`, `shape`}), `stage` (the stage
  that computes it; an inline node: the first stage that reads it; null: a view, or no stages),
  `role` ("root": the node its stage loops over; "epilogue": fused after the root, before the
  store; "inline": computed where it is read; "group": one of the nodes a whole stage runs a
  thread per sample or one thread for; "fused": the fused MLP's cooperative kernel; "view":
  another shape of its input, nothing runs; "kernel": the per-sample kernel, without stages),
  `inlined_in` (stages computing an inline node), `params` (elements of its constant inputs),
  `flops` (null when luisaml has no formula for the op type: unknown rather than a guess),
  `bytes` (reads + writes of its non-constant tensors, inside the kernel: int64 is held in 4
  bytes), `note` (how the operator compiles, or "")}.
- `totals`: {`nodes`, `params`, `flops` (the sum over nodes with a formula), `flops_unknown`
  (names of the nodes without one), `bytes`, `weight_blob_bytes`, `weight_tensors`}.
- `stages`: in launch order, each {`index`, `domain` ("element", "items", "blocks", "sample",
  "single", "fused"), `items` (work items per sample, or in all when not `batched`; a blocks
  stage's items are blocks of `threads` threads), `threads`, `readback` (the host reads a row
  count back after it: outputs sized at run time, luisaml/dynamic.py), `batched`, `out`,
  `nodes`, `epilogue`, `inlined` (node names), `reads`, `writes` (tensors in device buffers),
  `describe` (the line inspect prints), `registers` (a whole group's allocation, below, or
  null)}; null when the network runs as one per-sample kernel (`schedule="per-sample"`).
- `registers`: the allocation of `forward`, one step per node; `buffers`: the allocation of the
  tensors crossing stages, one step per stage (null without stages). An allocation is
  {`steps` (labels: node names, or "stage k"), `slots` ({`id`, `space` ("local", "scratch",
  "buffer"), `dtype` (the kernel's type), `elements`, `bytes`, `members`}), `tensors` ({`name`,
  `slot`, `first`, `last` (live steps, inclusive), `elements`, `bytes`}), `bytes` (pooled),
  `bytes_unpooled` (one array per tensor), `live_bytes` (per step: bytes of the slots holding a
  live tensor), `peak_bytes`, `inplace`, `views` ([output, input] pairs merged)}.
- `batch_kernel`: what the fused-kernel pass decided, or "".
- `host_steps`: grid ops over grids bound at run time that run before the kernels when a run binds
  new grids, on the device (target "cuda") or the host (luisaml/host_steps.py), a line each; []
  when there are none.

FLOP formulas (one multiply-add is 2): Conv 2·out·(C/group)·k + out with a bias; ConvTranspose
2·in·(M/group)·k + out with a bias; Gemm 2·M·N·K + M·N with C; MatMul 2·out·K; Max/Average/LpPool
out·k; global pools and reductions (Reduce*, ArgMax, ArgMin): one per input element; Softmax,
LogSoftmax: 5 per element; LayerNormalization, InstanceNormalization, GroupNormalization,
MeanVarianceNormalization: 5 per element (+1 each for scale and bias); RMSNormalization: 3 per
element (+1 for scale); LpNormalization: 3 per element; BatchNormalization: 2 per element;
elementwise operators: 1 per output element; data movement (views, Transpose, Slice, Concat,
Gather, ...): 0; the fused MLP: its layers' 2·K·N; anything else: null."""
from __future__ import annotations

import copy
import html as _html
import json
import math
from typing import Any, Mapping

from .errors import UsageError
from .model import shape_str, type_str

SCHEMA = 1

# op types that move or select elements without arithmetic
_MOVES = frozenset({
    "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Identity", "Slice", "Concat", "Split",
    "Gather", "GatherElements", "GatherND", "Expand", "Tile", "Pad", "Shape", "Size", "DepthToSpace",
    "SpaceToDepth", "Compress", "Constant", "ConstantOfShape", "EyeLike", "ReverseSequence", "Scatter",
    "ScatterElements", "ScatterND", "TensorScatter", "CenterCropPad",
})
_POOLS = frozenset({"MaxPool", "AveragePool", "LpPool"})
_GLOBAL_POOLS = frozenset({"GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool"})
_REDUCTIONS = frozenset({"ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
                         "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare", "ArgMax", "ArgMin"})
_NORMS = {"Softmax": (5, 0), "LogSoftmax": (5, 0), "LayerNormalization": (5, 1), "InstanceNormalization": (5, 1),
          "GroupNormalization": (5, 1), "MeanVarianceNormalization": (5, 0), "RMSNormalization": (3, 1),
          "LpNormalization": (3, 0), "BatchNormalization": (2, 0)}  # (per element, +1 per scale/bias input)


# ---- building ----------------------------------------------------------------------------------
def build(model, weights=None, *, batch_axis="auto", input_shapes: Mapping[str, list] | None = None,
          name: str | None = None, limits=None, target: str = "cpu") -> dict[str, Any]:
    """Return the report of a model (a path or an onnx.ModelProto) planned without a device, as
    `luisaml inspect` shows it; a model with unsupported nodes gets a report listing them, with
    nothing planned. target: the backend whose plan to show, "cpu" or "cuda" (the fused MLP
    kernel and the cooperative blocks stages are CUDA's: compile() chooses them there)."""
    import os

    from . import passes
    from .limits import DEFAULT
    from .loaders import load_proto
    from .log import phase
    from .lowering import unsupported_nodes
    from .runtime import CompileOptions, plan_for

    if name is None:
        name = os.path.basename(os.fspath(model)) if isinstance(model, (str, os.PathLike)) else (
            getattr(getattr(model, "graph", None), "name", "") or "model")
    limits = limits or DEFAULT
    with phase("load", model=name):
        proto = load_proto(model, weights, limits=limits)
    if target not in ("cpu", "cuda"):
        raise UsageError(f"target must be 'cpu' or 'cuda', not {target!r}")
    options = CompileOptions(batch_axis=batch_axis, input_shapes=input_shapes, limits=limits,
                             merge_stages=target == "cpu", blocks=target == "cuda",
                             grid_build="device" if target == "cuda" else "host")  # (compile's "auto")
    options.check()
    with phase("passes"):
        prep = passes.prepare(copy.deepcopy(proto), batch_axis=batch_axis, input_shapes=input_shapes, limits=limits)
    g = prep.model.graph
    head = {
        "schema": SCHEMA,
        "model": name,
        "opsets": {d or "ai.onnx": v for d, v in sorted(prep.model.opsets.items())},
        "batch_symbol": prep.symbol,
        "per_sample": None,
        "per_sample_impossible": None,
        "inputs": [_declared(g.var(n), prep) for n in g.inputs],
        "outputs": [_declared(g.var(n), prep) for n in g.outputs],
        "op_counts": _op_counts(g.nodes),
        "unsupported": unsupported_nodes(g, prep.model),
    }
    if head["unsupported"]:
        return {**head, "nodes": [], "totals": None, "stages": None, "registers": None, "buffers": None,
                "batch_kernel": "", "host_steps": []}
    with phase("plan"):
        plan, why, _ = plan_for(proto, name, options, "gpu" if target == "cuda" else "off")
    rep = from_plan(plan, model_name=name, why=why)
    return {**rep, **{k: head[k] for k in ("opsets", "inputs", "outputs", "op_counts", "unsupported")},
            "batch_symbol": prep.symbol}


def from_plan(plan, *, model_name: str = "model", why: str | None = None) -> dict[str, Any]:
    """Return the report of a compile plan (`net.plan`); `why`: why the graph cannot run one
    sample at a time, when it cannot (its plan is then the one at a fixed batch)."""
    sched = plan.schedule
    symbol = plan.symbol
    tensors = plan.tensors
    placement = _placement(plan)
    nodes = []
    for n, op in plan.ops:
        stage, role, inlined_in = placement.get(n.name, (None, "kernel", []))
        nodes.append({
            "name": n.name,
            "op_type": n.op_type,
            "domain": n.domain or "ai.onnx",
            "inputs": list(n.inputs),
            "outputs": [_tensor_info(tensors[o], symbol) if o in tensors else {"name": o, "dtype": None, "shape": None}
                        for o in n.outputs if o],
            "stage": stage,
            "role": role,
            "inlined_in": inlined_in,
            "params": params(op),
            "flops": flops(n, op),
            "bytes": 0 if role == "view" else moved_bytes(op),
            "note": _note(op, role == "root" and stage is not None and sched.stages[stage].domain == "blocks"),
        })
    known = [d["flops"] for d in nodes if d["flops"] is not None]
    totals = {
        "nodes": len(nodes),
        "params": sum(d["params"] for d in nodes),
        "flops": sum(known),
        "flops_unknown": [d["name"] for d in nodes if d["flops"] is None],
        "bytes": sum(d["bytes"] for d in nodes),
        "weight_blob_bytes": plan.blob.size,
        "weight_tensors": len(plan.blob.layout),
    }
    stages = None
    if sched is not None:
        stages = [{
            "index": st.index,
            "domain": st.domain,
            "items": st.items,
            "threads": getattr(st, "threads", 1),
            "readback": bool(getattr(st, "readback", False)),
            "batched": st.batched,
            "out": st.out,
            "nodes": [n.name for n, _ in st.nodes],
            "epilogue": [n.name for n, _ in st.epilogue],
            "inlined": _inlined_names(st, sched),
            "reads": list(st.reads),
            "writes": list(st.writes),
            "describe": st.describe(),
            "registers": (allocation(st.allocation, [n.name for n, _ in st.nodes], tensors)
                          if st.allocation is not None else None),
        } for st in sched.stages]
    model = plan.model
    g = model.graph
    return {
        "schema": SCHEMA,
        "model": model_name,
        "opsets": {d or "ai.onnx": v for d, v in sorted(model.opsets.items())},
        "batch_symbol": symbol,
        "per_sample": symbol is not None and why is None,
        "per_sample_impossible": why,
        "inputs": [_io_info(s) for s in (plan.inputs if getattr(plan, "host_steps", None) is None
                                         else plan.host_steps.inputs(plan.inputs))],
        "outputs": [_io_info(s) for s in plan.outputs],
        "op_counts": _op_counts(g.nodes),
        "unsupported": [],
        "nodes": nodes,
        "totals": totals,
        "stages": stages,
        "registers": allocation(plan.allocation, [n.name for n, _ in plan.ops], tensors),
        "buffers": (allocation(sched.buffers, [f"stage {st.index}" for st in sched.stages], tensors)
                    if sched is not None else None),
        "batch_kernel": plan.fusion_note or "",
        "host_steps": plan.host_steps.describe() if getattr(plan, "host_steps", None) is not None else [],
    }


def _placement(plan) -> dict[str, tuple[int | None, str, list[int]]]:
    """Return node name -> (its stage, its role, the stages computing it inline)."""
    sched = plan.schedule
    out: dict[str, tuple[int | None, str, list[int]]] = {}
    for n, op in plan.ops:
        if op.view and n.outputs and n.outputs[0] in plan.views:
            out[n.name] = (None, "view", [])
    if sched is None:
        return out
    for st in sched.stages:
        role = {"sample": "group", "single": "group", "fused": "fused"}.get(st.domain, "root")
        for n, _ in st.nodes:
            out[n.name] = (st.index, role, [])
        for n, _ in st.epilogue:
            out[n.name] = (st.index, "epilogue", [])
        for name in _inlined_names(st, sched):  # stages in launch order: the first one is its stage
            first, _, where = out.get(name, (st.index, "inline", []))
            out[name] = (first, "inline", where + [st.index])
    return out


def _inlined_names(st, sched) -> list[str]:
    """Return the names of the nodes a stage computes inline (Stage.inlined holds display text)."""
    label = {f"{n.op_type} '{n.name}'": n.name for n, _, _ in sched.virtual.values()}
    return [label[s] for s in st.inlined if s in label]


def allocation(alloc, steps: list[str], tensors: Mapping) -> dict[str, Any]:
    """Return an Allocation (luisaml/regalloc.py) as report data: its steps, slots, each tensor's
    slot and live range, and the bytes live at each step."""
    slots = [{"id": s.id, "space": s.space, "dtype": s.dtype, "elements": s.size, "bytes": s.nbytes,
              "members": list(s.members)} for s in alloc.slots]
    itemsize = {s.id: s.itemsize for s in alloc.slots}
    rows = []
    for s in alloc.slots:
        for name in s.members:
            first, last = alloc.live.get(name, (0, 0))
            t = tensors.get(name)
            elements = max(t.numel, 1) if t is not None else s.size
            rows.append({"name": name, "slot": s.id, "first": int(first), "last": int(last), "elements": elements,
                         "bytes": elements * itemsize[s.id]})
    rows.sort(key=lambda r: (r["first"], r["slot"], r["name"]))
    live = []
    for k in range(len(steps)):
        # a slot holds one live tensor at a time (in-place: the input dies where the output starts)
        held = {r["slot"]: 0 for r in rows if r["first"] <= k <= r["last"]}
        for r in rows:
            if r["first"] <= k <= r["last"]:
                held[r["slot"]] = max(held[r["slot"]], r["bytes"])
        live.append(sum(held.values()))
    return {
        "steps": list(steps),
        "slots": slots,
        "tensors": rows,
        "bytes": alloc.bytes_pooled,
        "bytes_unpooled": alloc.bytes_unpooled,
        "live_bytes": live,
        "peak_bytes": max(live, default=0),
        "inplace": [list(p) for p in alloc.inplace],
        "views": [list(p) for p in alloc.views],
    }


def _op_counts(nodes) -> dict[str, int]:
    counts: dict[str, int] = {}
    for n in nodes:
        key = f"{n.domain}::{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _declared(v, prep) -> dict[str, Any]:
    """Return a graph input or output as the prepared model has it, the batch dimension as its symbol."""
    dim = prep.batch.dims.get(v.name)  # passes/batch.py: the shape with the batch symbol
    shape = dim.onnx_shape if dim is not None else v.shape
    rows = (getattr(prep, "bound", None) or {}).get(v.name)
    if rows is not None and shape:  # rows bound at run time: its symbol, not the probe's number
        shape = (rows,) + tuple(shape[1:])
    return {"name": v.name, "dtype": type_str(v.elem_type), "shape": list(shape) if shape is not None else None}


def _io_info(s) -> dict[str, Any]:
    return {"name": s.name, "dtype": s.dtype.name.lower(), "shape": list(s.shape)}


def _tensor_info(t, symbol: str | None) -> dict[str, Any]:
    """Return a tensor's name, dtype and shape, its batch rows written with the batch symbol."""
    shape: list = list(t.shape)
    if getattr(t, "runtime_rows", None) is not None:  # rows known only at run time: their symbol
        shape[getattr(t, "runtime_axis", 0)] = t.runtime_rows
    elif t.batched and symbol is not None and shape:
        shape[0] = symbol if shape[0] == 1 else f"{shape[0]}*{symbol}"
    return {"name": t.name, "dtype": t.dtype.name.lower(), "shape": shape}


def _note(op, blocks: bool = False) -> str:
    """Return how a node compiles (its operator's note; in its cooperative form when the node is
    the root of a blocks stage, which the CUDA target's plan has)."""
    return (op.describe_block() if blocks else op.describe()) or ""


# ---- numbers per node ------------------------------------------------------------------------------
def _numel(t) -> int:
    return max(int(t.numel), 0) if t is not None else 0


def params(op) -> int:
    """Return the elements of a node's constant inputs (a fused MLP: its layers' weights and biases)."""
    from .operators.mlp import FusedMLP

    if isinstance(op, FusedMLP):
        return sum(int(layer.weight.size + layer.bias.size) for layer in op.layers)
    seen, total = set(), 0
    for t in op.inputs:
        if t is not None and t.value is not None and t.name not in seen:
            seen.add(t.name)
            total += int(t.value.size)
    return total


def moved_bytes(op) -> int:
    """Return the bytes a node reads and writes of its non-constant tensors (each once)."""
    seen, total = set(), 0
    for t in list(op.inputs) + list(op.outputs):
        if t is not None and t.value is None and t.name not in seen:
            seen.add(t.name)
            total += _numel(t) * t.dtype.itemsize
    return total


def flops(node, op) -> int | None:
    """Return a node's floating-point operations by the formulas of the module docstring, or None
    when luisaml has none for its op type."""
    t = node.op_type
    ins, outs = op.inputs, [o for o in op.outputs if o is not None]
    out = _numel(outs[0]) if outs else 0

    def given(k: int) -> bool:
        return k < len(ins) and ins[k] is not None

    from .operators.mlp import FusedMLP

    if isinstance(op, FusedMLP):
        return int(op.flops_per_sample)
    if node.domain not in ("", "ai.onnx"):
        return None
    if op.view or t in _MOVES:
        return 0
    if t == "Conv" and given(1):
        w = ins[1].shape
        return 2 * out * math.prod(w[1:]) + (out if given(2) else 0)
    if t == "ConvTranspose" and given(1):
        w = ins[1].shape
        return 2 * _numel(ins[0]) * math.prod(w[1:]) + (out if given(2) else 0)
    if t == "Gemm" and given(0):
        a = ins[0].shape
        k = a[0] if node.attrs.get("transA", 0) else a[-1]
        return 2 * out * k + (out if given(2) else 0)
    if t == "MatMul" and given(0) and ins[0].shape:
        return 2 * out * ins[0].shape[-1]
    if t in _POOLS:
        kernel = node.attrs.get("kernel_shape")
        return out * math.prod(kernel) if kernel else None
    if t in _GLOBAL_POOLS or t in _REDUCTIONS:
        return _numel(ins[0]) if given(0) else None
    if t in _NORMS:
        per, extra = _NORMS[t]
        n = _numel(ins[0]) if given(0) else out
        affine = sum(1 for k in (1, 2) if given(k)) if extra else 0
        return n * (per + affine)
    if op.elementwise:
        return sum(_numel(o) for o in outs)
    return None


# ---- text ------------------------------------------------------------------------------------------
def _shape(info: Mapping) -> str:
    return f"{info['dtype'] or '?'}{shape_str(info['shape'])}"


def _si(n: int, unit: str) -> str:
    """Return a quantity with an SI prefix: '1.2 MFLOP', '4 FLOP'."""
    for prefix, k in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= k:
            return f"{n / k:.1f} {prefix}{unit}"
    return f"{n} {unit}"


def _bytes(n: int) -> str:
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k:
            return f"{n / k:.1f} {unit}"
    return f"{n} B"


def text(rep: Mapping) -> str:
    """Return the report as `luisaml inspect` prints it."""
    lines = [f"model: {rep['model']}",
             "opsets: " + ", ".join(f"{d} {v}" for d, v in rep["opsets"].items()),
             f"batch axis: {rep['batch_symbol'] or 'none (one instance)'}"]
    for kind in ("inputs", "outputs"):
        lines.append(f"{kind}:")
        lines += [f"  '{io['name']}': {_shape(io)}" for io in rep[kind]]
    lines.append(f"nodes after folding: {sum(rep['op_counts'].values())}")
    lines += [f"  {op:28s} {c}" for op, c in rep["op_counts"].items()]
    if rep["unsupported"]:
        lines.append(f"unsupported nodes ({len(rep['unsupported'])}):")
        lines += [f"  {u}" for u in rep["unsupported"]]
        return "\n".join(lines)
    per = "per sample" if rep["per_sample"] else "in all"
    if rep["per_sample_impossible"]:
        lines.append(f"per-sample execution: impossible ({rep['per_sample_impossible']}); the network compiles for "
                     "each batch size it runs with, shapes fixed (the plan below is at batch 2)")
    if rep.get("host_steps"):
        lines.append("run before the kernels when a run binds new grids (the grids they build are inputs of the "
                     "kernels):")
        lines += [f"  {line}" for line in rep["host_steps"]]
    notes = [(d["name"], d["op_type"], d["note"]) for d in rep["nodes"] if d["note"]]
    if notes:
        lines.append("how nodes compile:")
        lines += [f"  node '{n}' ({op}): {note}" for n, op, note in notes]
    lines.append(f"nodes ({len(rep['nodes'])}; params: elements of constant inputs; FLOPs and bytes {per}):")
    table = [("node", "op", "stage", "output", "params", "FLOPs", "bytes")]
    for d in rep["nodes"]:
        where = "" if d["stage"] is None else str(d["stage"])
        if d["role"] not in ("root", "group"):
            where = f"{where} {d['role']}".strip()
        out = ", ".join(_shape(o) for o in d["outputs"])
        table.append((d["name"], d["op_type"], where, out, f"{d['params']:,}",
                      "?" if d["flops"] is None else f"{d['flops']:,}", f"{d['bytes']:,}"))
    widths = [min(max(len(r[c]) for r in table), cap) for c, cap in enumerate((40, 20, 14, 36, 12, 14, 12))]
    for r in table:
        cells = [r[c].ljust(widths[c]) if c < 4 else r[c].rjust(widths[c]) for c in range(len(r))]
        lines.append("  " + "  ".join(cells).rstrip())
    t = rep["totals"]
    unknown = (f" ({len(t['flops_unknown'])} node{'s' if len(t['flops_unknown']) != 1 else ''} without a formula: "
               f"{', '.join(t['flops_unknown'][:5])}{', ...' if len(t['flops_unknown']) > 5 else ''})"
               if t["flops_unknown"] else "")
    lines.append(f"totals: {t['nodes']} nodes, {t['params']:,} parameters, {_si(t['flops'], 'FLOP')} {per}{unknown}, "
                 f"{_bytes(t['bytes'])} read and written {per}")
    if rep["stages"] is not None:
        breaks = sum(1 for st in rep["stages"] if st.get("readback"))
        how = ("launched as one command list" if not breaks else
               f"launched as {breaks + 1} command lists, the host reading a row count back between them")
        lines.append(f"stages ({len(rep['stages'])}, {how}):")
        lines += [f"  {st['describe']}" for st in rep["stages"]]
        lines.append("buffers across stages: " + _alloc_text(rep["buffers"]))
    lines.append(f"forward's register allocation: {_alloc_text(rep['registers'])}")
    if rep["batch_kernel"]:
        lines.append("batch kernel: " + rep["batch_kernel"])
    lines.append(f"weight blob: {t['weight_blob_bytes']} bytes in {t['weight_tensors']} tensors")
    return "\n".join(lines)


def _alloc_text(a: Mapping) -> str:
    """Return an allocation as regalloc's report writes it, with its peak live bytes."""
    n = len(a["slots"])
    lines = [f"{n} slot{'' if n == 1 else 's'}, {a['bytes']} bytes (one array per tensor: {a['bytes_unpooled']} bytes; "
             f"peak live {a['peak_bytes']} bytes); {len(a['inplace'])} in-place, {len(a['views'])} views"]
    lines += [f"  slot {s['id']}: {s['space']} {s['dtype']}[{s['elements']}] <- {', '.join(s['members'])}"
              for s in a["slots"]]
    return "\n".join(lines)


def to_json(rep: Mapping) -> str:
    """Return the report as one JSON document (keys in the module docstring)."""
    return json.dumps(rep, indent=1, allow_nan=False)


# ---- HTML --------------------------------------------------------------------------------------------
_CSS = """
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


def _e(s: Any) -> str:
    """Escape model text for HTML (names come from an untrusted file)."""
    return _html.escape(str(s), quote=True)


def _clip(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 1] + "…"


def html(rep: Mapping) -> str:
    """Return the report as one self-contained HTML page (inline CSS and SVG, no script, nothing
    fetched): the graph with stages as groups, the live ranges of both allocations, the tables."""
    per = "per sample" if rep["per_sample"] else "in all"
    t = rep["totals"]
    parts = [f"<!DOCTYPE html><html lang=en><head><meta charset=utf-8>"
             f"<meta name=viewport content='width=device-width,initial-scale=1'>"
             f"<title>luisaml inspect: {_e(rep['model'])}</title><style>{_CSS}</style></head><body>",
             f"<h1>{_e(rep['model'])}</h1>",
             f"<div class=sub>luisaml inspect · opsets {_e(', '.join(f'{d} {v}' for d, v in rep['opsets'].items()))}"
             f" · batch axis {_e(rep['batch_symbol'] or 'none (one instance)')}</div>"]
    rows = [("inputs", "; ".join(f"{io['name']}: {_shape(io)}" for io in rep["inputs"])),
            ("outputs", "; ".join(f"{io['name']}: {_shape(io)}" for io in rep["outputs"]))]
    if rep["unsupported"]:
        rows.append(("unsupported nodes", "; ".join(rep["unsupported"])))
    else:
        if rep["per_sample_impossible"]:
            rows.append(("per-sample execution", f"impossible ({rep['per_sample_impossible']}); plan at batch 2"))
        rows += [("nodes", f"{t['nodes']} ({len(rep['stages']) if rep['stages'] is not None else 'no'} stages)"),
                 ("parameters", f"{t['params']:,}"),
                 (f"FLOPs {per}", f"{t['flops']:,}" + (f" (+ {len(t['flops_unknown'])} nodes without a formula)"
                                                       if t["flops_unknown"] else "")),
                 (f"bytes read and written {per}", _bytes(t["bytes"])),
                 ("weight blob", f"{_bytes(t['weight_blob_bytes'])} in {t['weight_tensors']} tensors"),
                 ("registers of forward", _alloc_summary(rep["registers"]))]
        if rep["buffers"] is not None:
            rows.append(("buffers across stages", _alloc_summary(rep["buffers"])))
        if rep["batch_kernel"]:
            rows.append(("batch kernel", rep["batch_kernel"]))
    parts.append("<table class=kv>" + "".join(f"<tr><td>{_e(k)}</td><td>{_e(v)}</td></tr>" for k, v in rows)
                 + "</table>")
    if not rep["unsupported"]:
        parts.append("<h2>Graph</h2><div class='legend sub'>one box per stage, launched top to bottom as one command "
                     "list: <span style='background:#ddf4ff;border-color:#0969da'>element</span>"
                     "<span style='background:#dafbe1;border-color:#1a7f37'>items</span>"
                     "<span style='background:#fff8c5;border-color:#9a6700'>sample / single</span>"
                     "<span style='background:#fbefff;border-color:#8250df'>fused</span> · "
                     "<span class=ep style='border:0;padding:0;color:#8250df'>+ epilogue</span>"
                     "<i> inline</i> · an arrow is a tensor passed in a device buffer (hover for names)</div>")
        parts.append(f"<div class=scroll>{_graph_svg(rep)}</div>")
        parts.append("<h2>Memory</h2><div class=sub>each row is a slot of the allocation (its size on the left), each "
                     "bar a tensor over the steps it is live; the curve above is the bytes live at each step</div>")
        one = "one sample" if rep["per_sample"] else "the whole instance"
        parts.append(f"<h3>Registers of <code>forward</code> ({one}; a step per node)</h3>"
                     f"<div class=scroll>{_live_svg(rep['registers'], 'registers')}</div>")
        if rep["buffers"] is not None:
            parts.append(f"<h3>Device buffers across stages (a region per sample; a step per stage)</h3>"
                         f"<div class=scroll>{_live_svg(rep['buffers'], 'buffers')}</div>")
        parts.append(_nodes_table(rep, per))
        if rep["stages"] is not None:
            parts.append(_stages_table(rep))
    parts.append("</body></html>")
    return "\n".join(parts)


def _alloc_summary(a: Mapping) -> str:
    n = len(a["slots"])
    return (f"{n} slot{'' if n == 1 else 's'}, {_bytes(a['bytes'])} pooled (one array per tensor: "
            f"{_bytes(a['bytes_unpooled'])}); peak live {_bytes(a['peak_bytes'])}; {len(a['inplace'])} in-place, "
            f"{len(a['views'])} views")


def _nodes_table(rep: Mapping, per: str) -> str:
    head = ("node", "op", "stage", "role", "outputs", "params", f"FLOPs {per}", f"bytes {per}", "how it compiles")
    rows = []
    for d in rep["nodes"]:
        rows.append("<tr>" + "".join([
            f"<td><code>{_e(d['name'])}</code></td>",
            f"<td>{_e(d['op_type'] if d['domain'] == 'ai.onnx' else d['domain'] + '::' + d['op_type'])}</td>",
            f"<td class=n>{'' if d['stage'] is None else d['stage']}</td><td>{_e(d['role'])}</td>",
            f"<td><code>{_e(', '.join(_shape(o) for o in d['outputs']))}</code></td>",
            f"<td class=n>{d['params']:,}</td>",
            f"<td class=n>{'?' if d['flops'] is None else format(d['flops'], ',')}</td>",
            f"<td class=n>{d['bytes']:,}</td><td class=sub>{_e(d['note'])}</td>"]) + "</tr>")
    return ("<h2>Nodes</h2><div class=scroll><table id=nodes><tr>" + "".join(f"<th>{_e(h)}</th>" for h in head)
            + "</tr>" + "".join(rows) + "</table></div>")


def _stages_table(rep: Mapping) -> str:
    rows = []
    for st in rep["stages"]:
        names = "".join(f"<td><code>{_e(', '.join(st[k]))}</code></td>"
                        for k in ("nodes", "epilogue", "inlined", "reads", "writes"))
        rows.append(f"<tr><td class=n>{st['index']}</td><td>{_e(st['domain'])}</td>"
                    f"<td class=n>{st['items']:,} {'per sample' if st['batched'] else 'in all'}</td>{names}</tr>")
    head = ("stage", "domain", "items", "nodes", "epilogue", "inline", "reads", "writes")
    return ("<h2>Stages</h2><div class=scroll><table id=stages><tr>" + "".join(f"<th>{h}</th>" for h in head)
            + "</tr>" + "".join(rows) + "</table></div>")


# the graph: boxes stacked in launch order (a topological order), graph inputs on top and outputs
# at the bottom; a tensor passed to the next box is a straight arrow, one passed further is an arc
# in a lane on the right (lanes coloured like intervals, so arcs never run over each other)
_BOX_W, _LINE, _PAD, _GAP, _LEFT, _TOP = 520, 16, 8, 34, 16, 12


def _graph_svg(rep: Mapping) -> str:
    nodes = {d["name"]: d for d in rep["nodes"]}
    boxes: list[dict] = [{"id": "inputs", "domain": "io", "title": "graph inputs",
                          "lines": [("", f"{io['name']}", _shape(io)) for io in rep["inputs"]],
                          "writes": [io["name"] for io in rep["inputs"]], "reads": []}]
    if rep["stages"] is not None:
        for st in rep["stages"]:
            lines = []
            for name in st["nodes"]:
                d = nodes[name]
                lines.append(("", f"{d['op_type']} {name}", ", ".join(_shape(o) for o in d["outputs"])))
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
                      "lines": [("", f"{d['op_type']} {d['name']}", ", ".join(_shape(o) for o in d["outputs"]))
                                for d in ran],
                      "reads": [io["name"] for io in rep["inputs"]], "writes": [io["name"] for io in rep["outputs"]]})
    boxes.append({"id": "outputs", "domain": "io", "title": "graph outputs",
                  "lines": [("", f"{io['name']}", _shape(io)) for io in rep["outputs"]],
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
           f"viewBox='0 0 {width} {height}' role=img aria-label='stages of {_e(rep['model'])}'>",
           "<defs><marker id=arrow viewBox='0 0 10 10' refX=9 refY=5 markerWidth=7 markerHeight=7 "
           "orient=auto-start-reverse>"
           "<path d='M0,0L10,5L0,10z' fill='#57606a'/></marker></defs>"]
    for b in boxes:
        cls = f"stage d-{b['domain']}" if "index" in b else f"io d-{b['domain']}"
        data = f" data-stage={b['index']}" if "index" in b else f" data-box={_e(b['id'])}"
        out.append(f"<g class='{cls}'{data}><title>{_e(b.get('tip', b['title']))}</title>"
                   f"<rect class=box x={_LEFT} y={b['y']} width={_BOX_W} height={b['h']} rx=6 />"
                   f"<text class=title x={_LEFT + _PAD} y={b['y'] + _PAD + 12}>{_e(b['title'])}</text>")
        for j, (kind, left, right) in enumerate(b["lines"]):
            ty = b["y"] + _PAD + 12 + _LINE * (j + 1)
            cls = f" class={kind}" if kind else ""
            room = 68 - min(len(right), 34)
            out.append(f"<text{cls} x={_LEFT + _PAD + 8} y={ty}>{_e(_clip(left, room))}</text>")
            if right:
                out.append(f"<text class=dim x={_LEFT + _BOX_W - _PAD} y={ty} text-anchor=end>"
                           f"{_e(_clip(right, 34))}</text>")
        out.append("</g>")
    for (a, z), names in sorted(edges.items()):
        src, dst = boxes[a], boxes[z]
        where = [("output" if n in outputs else "input" if a == 0 else f"buffer {slot[n]}" if n in slot else "buffer")
                 for n in names]
        tip = "; ".join(f"{n} ({w})" for n, w in zip(names, where))
        label = _clip(", ".join(names), 48) + (f" · {where[0]}" if len(set(where)) == 1 else "")
        out.append(f"<g class=edge data-from='{_e(src['id'])}' data-to='{_e(dst['id'])}'><title>{_e(tip)}</title>")
        if z - a == 1:
            x, y0, y1 = _LEFT + 48, src["y"] + src["h"], dst["y"]
            out.append(f"<path d='M{x},{y0}L{x},{y1 - 1}' marker-end='url(#arrow)'/>"
                       f"<text x={x + 8} y={(y0 + y1) // 2 + 4}>{_e(label)}</text>")
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


def _live_svg(a: Mapping, ident: str) -> str:
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
                   f"<text class=dim x=8 y=22>bytes live</text><text x=8 y=38>peak {_e(_bytes(peak))}</text>"
                   f"<text class=dim x=8 y=54>{_e(_clip('at ' + steps[at], 30))}</text>"
                   f"<line x1={x0} x2={width - 20} y1={_CURVE + 10} y2={_CURVE + 10} stroke='#d8dee4'/>")
    for k in range(len(steps)):  # step grid
        if k % 2 == 0:
            out.append(f"<rect x={x0 + sw * k:.1f} y={top} width={sw:.1f} height={_ROW * max(len(slots), 1)} "
                       "fill='#f6f8fa'/>")
    for j, s in enumerate(slots):
        y = top + _ROW * j
        what = f"slot {s['id']} {s['space']} {s['dtype']}"
        out.append(f"<text x=8 y={y + 15}>{_e(_clip(what, 22))}</text>"
                   f"<text class=dim x={x0 - 6} y={y + 15} text-anchor=end>{_e(_bytes(s['bytes']))}</text>")
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
        tip = f"{r['name']}: {r['elements']:,} elements, {_bytes(r['bytes'])}, slot {r['slot']}, live {live}"
        out.append(f"<rect class=bar data-tensor='{_e(r['name'])}' data-slot={r['slot']} x={xa:.1f} y={y:.1f} "
                   f"width={max(xb - xa, 2):.1f} height={_BAR} rx=2 fill='{_PALETTE[i % len(_PALETTE)]}'>"
                   f"<title>{_e(tip)}</title></rect>")
    base = top + _ROW * max(len(slots), 1) + 6
    every = max(1, math.ceil(len(steps) * 12 / (sw * len(steps)))) if steps else 1
    for k, label in enumerate(steps):
        if k % every:
            continue
        x = x0 + sw * (k + 0.5) + 4
        out.append(f"<text class=dim transform='translate({x:.1f},{base}) rotate(-60)' text-anchor=end>"
                   f"{_e(_clip(label, 28))}<title>{_e(label)}</title></text>")
    out.append("</svg>")
    return "".join(out)
