"""The inspect report as data: per node its stage, outputs, parameters, FLOPs and bytes; totals;
the stages; the register allocation of `forward` and the buffer allocation across stages; and the
three ways `luisaml inspect` shows it (`text`, `to_json`, `html`: one self-contained page, whose
drawings are luisaml/report_page.py's).

`build(model, ...)` loads and plans a model without a device (what `luisaml inspect` runs, through
luisaml/planning.py, as compile plans);
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
  bytes), `note` (how the operator compiles, or ""), `attrs` ({attribute: value}: numbers, strings
  and lists of up to 16 numbers or strings as they are (a float that is not finite as "inf", "-inf",
  "nan"); a tensor, a longer list or a subgraph as one line of text saying what it is: its dtype
  and shape, its first values, min and max — `attribute_value`), `inputs_info` (one {`name`,
  `dtype`, `shape`, `constant`} per entry of `inputs`, null dtype and shape where unknown)}.
- `totals`: {`nodes`, `params`, `flops` (the sum over nodes with a formula), `flops_unknown`
  (names of the nodes without one), `bytes`, `weight_blob_bytes`, `weight_tensors`}.
- `stages`: in launch order, each {`index`, `domain` ("element", "items", "blocks", "sample",
  "single", "fused"), `items` (work items per sample, or in all when not `batched`; a blocks
  stage's items are blocks of `threads` threads), `threads`, `readback` (the host reads a row
  count back after it: outputs sized at run time, luisaml/dynamic.py), `batched`, `out`,
  `nodes`, `epilogue`, `inlined` (node names), `reads`, `writes` (tensors in device buffers),
  `describe` (the line inspect prints), `registers` (a whole group's allocation, below, or
  null), `time_ms` (its median time launched alone, with `inspect --profile`; else null)}; null
  when the network runs as one per-sample kernel (`schedule="per-sample"`).
- `profile`: null, or with `inspect --profile` (`with_profile`) how the stages were timed:
  {`backend`, `batch` (samples of the random feeds), `repeat` (launches per stage, the median
  kept), `total_ms` (the sum over stages; the per-sample kernel's time when there are no stages)}.
- `registers`: the allocation of `forward`, one step per node; `buffers`: the allocation of the
  tensors crossing stages, one step per stage (null without stages). An allocation is
  {`steps` (labels: node names, or "stage k"), `slots` ({`id`, `space` ("local", "scratch",
  "buffer"), `dtype` (the kernel's type), `elements`, `bytes`, `members`}), `tensors` ({`name`,
  `slot`, `first`, `last` (live steps, inclusive), `elements`, `bytes`}), `bytes` (pooled),
  `bytes_unpooled` (one array per tensor), `live_bytes` (per step: bytes of the slots holding a
  live tensor), `peak_bytes`, `inplace`, `views` ([output, input] pairs merged)}.
- `batch_kernel`: what the fused-kernel pass decided, or "".
- `rows_kept`: a line a Conv whose channels the graph reads only at run-time gathered rows (the rows-kept
  rewrite, luisaml/rewrites/rows_kept.py): the channels computed at those rows only and how many rows, or why
  not; [] when none matched.
- `host_steps`: grid ops over grids bound at run time that run before the kernels when a run binds
  new grids, on the device (target "cuda") or the host (luisaml/host_steps.py), a line each; []
  when there are none.
- `tuning`: null, or for a network compiled with `tune=` (luisaml/tune.py) its search: {`mode`,
  `device`, `measured` (kernel shapes measured in that compile; 0: all from the tuning cache),
  `seconds`, `nodes` ({`node`, `op_type`, `form`, `choice`, `rule` (the schedules as knobs),
  `source` ("measured" or "cache"), `rule_ms`, `best_ms`, `candidates`, `rejected`})}.

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
import json
import math
from typing import Any, Mapping

import numpy as np

from .errors import RunError, UsageError
from .model import Graph, type_str
from .report_page import (CSP, CSS, SCRIPT, alloc_summary, byte_text, data_json, escape, graph_svg, live_svg,
                          nodes_table, shape_text, si_text, stages_table, time_text, zoom_box)

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

    from . import compiler
    from .limits import DEFAULT
    from .loaders import load_proto
    from .log import phase
    from .lowering import unsupported_nodes
    from .planning import CompileOptions, plan_for

    if name is None:
        name = os.path.basename(os.fspath(model)) if isinstance(model, (str, os.PathLike)) else (
            getattr(getattr(model, "graph", None), "name", "") or "model")
    limits = limits or DEFAULT
    with phase("load", model=name):
        proto = load_proto(model, weights, limits=limits)
    if target not in ("cpu", "cuda"):
        raise UsageError(f"target must be 'cpu' or 'cuda', not {target!r}")
    # compile's choices on the target, but the direct form of every convolution (winograd=False)
    options = CompileOptions(batch_axis=batch_axis, input_shapes=input_shapes, limits=limits,
                             winograd=False).resolve(target)
    with phase("passes"):
        prep = compiler.prepare(copy.deepcopy(proto), batch_axis=batch_axis, input_shapes=input_shapes, limits=limits)
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
        "unsupported": unsupported_nodes(g, prep),
    }
    if head["unsupported"]:
        return {**head, "neighbour_maps": [], "nodes": [], "totals": None, "stages": None, "registers": None,
                "buffers": None, "batch_kernel": "", "rows_kept": [], "host_steps": [], "profile": None, "tuning": None}
    with phase("plan"):
        plan, why, _ = plan_for(proto, name, options)
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
            "note": (sched.stages[stage].across.describe() if role == "root" and stage is not None
                     and sched.stages[stage].across is not None else
                     _note(op, role == "root" and stage is not None and sched.stages[stage].domain == "blocks")),
            "attrs": {k: attribute_value(v) for k, v in n.attrs.items()},
            "inputs_info": [_input_info(name, tensors, symbol) for name in n.inputs],
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
            "time_ms": None,
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
        "neighbour_maps": neighbour_maps(plan.ops),
        "unsupported": [],
        "nodes": nodes,
        "totals": totals,
        "stages": stages,
        "registers": allocation(plan.allocation, [n.name for n, _ in plan.ops], tensors),
        "buffers": (allocation(sched.buffers, [f"stage {st.index}" for st in sched.stages], tensors)
                    if sched is not None else None),
        "batch_kernel": plan.fusion_note or "",
        "rows_kept": list(getattr(plan, "rows_kept", [])),
        "host_steps": plan.host_steps.describe() if getattr(plan, "host_steps", None) is not None else [],
        "profile": None,
        "tuning": plan.tuning.as_dict() if getattr(plan, "tuning", None) is not None else None,
    }


def with_profile(rep: Mapping, times: list[tuple[str, float]], *, backend: str, batch: int,
                 repeat: int) -> dict[str, Any]:
    """Return the report with each stage's time: `times` are CompiledNetwork.profile's (the stage's
    line, median milliseconds) in launch order, of a network compiled as the report was planned
    (the lines must agree: a time is never shown against another stage)."""
    stages = rep.get("stages")
    lines = [st["describe"] for st in stages] if stages is not None else ["the per-sample kernel"]
    got = [line for line, _ in times]
    if got != lines:
        k = next((k for k, (a, b) in enumerate(zip(got, lines)) if a != b), min(len(got), len(lines)))
        raise RunError(f"the profiled network launches {len(got)} kernels and the report has {len(lines)}; they "
                       f"first differ at stage {k}: profiled {got[k] if k < len(got) else 'nothing'!r}, "
                       f"reported {lines[k] if k < len(lines) else 'nothing'!r}")
    out = dict(rep)
    if stages is not None:
        out["stages"] = [{**st, "time_ms": float(ms)} for st, (_, ms) in zip(stages, times)]
    out["profile"] = {"backend": backend, "batch": int(batch), "repeat": int(repeat),
                      "total_ms": float(sum(ms for _, ms in times))}
    if getattr(times, "counts", None) is not None:  # (network.Profile: a whole run's wall time and counts)
        out["profile"].update(run_ms=float(times.run_ms), run=times.counts.as_dict())
    return out


def attribute_value(v: Any) -> Any:
    """Return a node attribute as report data (module docstring, `attrs`): what a reader needs to
    see, in a size that does not grow with the model's arrays."""
    if isinstance(v, (bool, int, str)):
        return v if not isinstance(v, str) or len(v) <= _LONG_TEXT else f"{v[:_LONG_TEXT]}… ({len(v):,} characters)"
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)
    if isinstance(v, Graph):
        return (f"graph '{v.name}': {len(v.nodes)} node{'s' if len(v.nodes) != 1 else ''}, inputs "
                f"{', '.join(v.inputs) or 'none'}, outputs {', '.join(v.outputs) or 'none'}")
    if isinstance(v, np.ndarray):
        return _array_text(v)
    if isinstance(v, (list, tuple)):
        if len(v) <= _SHORT_LIST and all(isinstance(x, (bool, int, float, str)) for x in v):
            return [attribute_value(x) for x in v]
        if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
            return "list " + _array_text(np.asarray(v))
        shown = "; ".join(str(attribute_value(x)) for x in v[:3])
        return f"list of {len(v)}: {shown}" + ("; …" if len(v) > 3 else "")
    return type(v).__name__  # a TypeProto: its kind only


_SHORT_LIST = 16  # lists up to this long are shown whole
_LONG_TEXT = 400  # characters of a string attribute shown


def _array_text(a) -> str:
    """Return an array as one line: 'float32[2, 3] = [1, 2, 3, 4, 5, 6]', or for a large one its
    first values, min and max."""
    head = f"{a.dtype}{list(a.shape)}"
    flat = a.reshape(-1)
    if flat.size <= _SHORT_LIST:
        return f"{head} = [{', '.join(_number_text(x) for x in flat)}]"
    first = ", ".join(_number_text(x) for x in flat[:6])
    if a.dtype.kind in "fiub":
        with np.errstate(invalid="ignore"):
            lo, hi = flat.min(), flat.max()
        return f"{head}: {first}, … ({flat.size:,} values, min {_number_text(lo)}, max {_number_text(hi)})"
    return f"{head}: {first}, … ({flat.size:,} values)"


def _number_text(x) -> str:
    return f"{float(x):.6g}" if isinstance(x, (float, np.floating)) else str(x)


def _input_info(name: str, tensors: Mapping, symbol: str | None) -> dict[str, Any]:
    """Return a node input's name, dtype, shape and whether it is a constant ("" : an absent input)."""
    t = tensors.get(name) if name else None
    if t is None:
        return {"name": name, "dtype": None, "shape": None, "constant": False}
    return {**_tensor_info(t, symbol), "constant": t.value is not None}


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


def neighbour_maps(ops) -> list[dict[str, Any]]:
    """Each distinct kernel map (neighbour map) fVDB's sparse convolutions read: the tensor, the node
    that builds it (None where it folded to a constant), its geometry and the convolutions reading it."""
    built = {n.outputs[0]: n for n, _ in ops if n.domain == "fvdb" and n.op_type == "SparseConvKernelMap"}
    maps: dict[str, dict[str, Any]] = {}
    for n, _ in ops:
        if n.domain == "fvdb" and n.op_type == "SparseConv3d" and len(n.inputs) > 1:
            node = built.get(n.inputs[1])
            entry = maps.setdefault(n.inputs[1], {
                "tensor": n.inputs[1], "node": node.name if node is not None else None,
                "kernel_size": attribute_value(node.attrs.get("kernel_size")) if node is not None else None,
                "stride": attribute_value(node.attrs.get("stride", 1)) if node is not None else None,
                "convolutions": []})
            entry["convolutions"].append(n.name)
    return list(maps.values())


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
def text(rep: Mapping) -> str:
    """Return the report as `luisaml inspect` prints it."""
    lines = [f"model: {rep['model']}",
             "opsets: " + ", ".join(f"{d} {v}" for d, v in rep["opsets"].items()),
             f"batch axis: {rep['batch_symbol'] or 'none (one instance)'}"]
    for kind in ("inputs", "outputs"):
        lines.append(f"{kind}:")
        lines += [f"  '{io['name']}': {shape_text(io)}" for io in rep[kind]]
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
    if rep.get("neighbour_maps"):
        maps = rep["neighbour_maps"]
        lines.append(f"neighbour maps: {len(maps)}, read by {sum(len(m['convolutions']) for m in maps)} sparse "
                     "convolutions (equal maps merged)")
        lines += [f"  {m['node'] or m['tensor'] + ' (folded)'}: kernel {m['kernel_size']}, stride {m['stride']}; "
                  f"read by {', '.join(m['convolutions'])}" for m in maps]
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
        out = ", ".join(shape_text(o) for o in d["outputs"])
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
    lines.append(f"totals: {t['nodes']} nodes, {t['params']:,} parameters, {si_text(t['flops'], 'FLOP')} {per}{unknown}, "
                 f"{byte_text(t['bytes'])} read and written {per}")
    if rep["stages"] is not None:
        breaks = sum(1 for st in rep["stages"] if st.get("readback"))
        how = ("launched as one command list" if not breaks else
               f"launched as {breaks + 1} command lists, the host reading a row count back between them")
        lines.append(f"stages ({len(rep['stages'])}, {how}):")
        prof = rep.get("profile")
        if prof:
            lines.append(f"  (median ms of {prof['repeat']} launches each alone, and share of their "
                         f"{prof['total_ms']:.3f} ms; {prof['backend']}, batch {prof['batch']})")
            total = prof["total_ms"] or 1.0
            lines += [f"  {st['time_ms']:9.3f} ms {100 * st['time_ms'] / total:5.1f}%  {st['describe']}"
                      for st in rep["stages"]]
            if prof.get("run"):
                r = prof["run"]
                lines.append(f"  a whole run: {prof['run_ms']:.3f} ms, {r['launches']} launches, {r['syncs']} host "
                             f"synchronisations, {r['uploads']} uploads, {r['downloads']} downloads, "
                             f"{byte_text(r['peak_bytes'])} device peak")
        else:
            lines += [f"  {st['describe']}" for st in rep["stages"]]
        lines.append("buffers across stages: " + _alloc_text(rep["buffers"]))
    if rep["stages"] is None and rep.get("profile"):
        p = rep["profile"]
        lines.append(f"the per-sample kernel: {p['total_ms']:.3f} ms (median of {p['repeat']}; {p['backend']}, "
                     f"batch {p['batch']})")
    tuning = rep.get("tuning")
    if tuning:
        lines.append(f"tuned schedules (tune={tuning['mode']!r} on {tuning['device']}; {tuning['measured']} kernel "
                     f"shape(s) measured in this compile, {tuning['seconds']:.1f} s):")
        lines += [f"  node '{t['node']}' ({t['op_type']}, {t['form']}): "
                  + ("the rules' choice" if t["choice"] == t["rule"] else
                     f"{_knobs(t['choice'])} (rules: {_knobs(t['rule'])})")
                  + f", {t['best_ms']:.4f} vs {t['rule_ms']:.4f} ms ({t['source']}, {t['candidates']} candidates"
                  + (f", {t['rejected']} rejected)" if t["rejected"] else ")") for t in tuning["nodes"]]
    lines.append(f"forward's register allocation: {_alloc_text(rep['registers'])}")
    if rep["batch_kernel"]:
        lines.append("batch kernel: " + rep["batch_kernel"])
    lines += [f"rows kept: {line}" for line in rep.get("rows_kept", [])]
    lines.append(f"weight blob: {t['weight_blob_bytes']} bytes in {t['weight_tensors']} tensors")
    return "\n".join(lines)


def _knobs(choice: Mapping) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(choice.items()) if k != "form")


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


# ---- HTML ------------------------------------------------------------------------------------------
def html(rep: Mapping) -> str:
    """Return the report as one self-contained HTML page (inline CSS, SVG and one script, nothing
    fetched): the graph with stages as groups, zoomed and panned in the page, with each stage's time
    when profiled; a search box over node names and op types; a node's attributes and its inputs'
    shapes on click; the live ranges of both allocations; the tables."""
    per = "per sample" if rep["per_sample"] else "in all"
    t = rep["totals"]
    prof = rep.get("profile")
    parts = [f"<!DOCTYPE html><html lang=en><head><meta charset=utf-8>"
             f"<meta http-equiv=Content-Security-Policy content=\"{CSP}\">"
             f"<meta name=viewport content='width=device-width,initial-scale=1'>"
             f"<title>luisaml inspect: {escape(rep['model'])}</title><style>{CSS}</style></head><body>"]
    if not rep["unsupported"]:
        parts.append("<div class=bar-top><input id=search type=search placeholder='find a node by name or op type' "
                     "aria-label='find a node by name or op type' autocomplete=off><span id=search-count class=sub "
                     "aria-live=polite></span></div>")
    parts += [f"<h1>{escape(rep['model'])}</h1>",
              f"<div class=sub>luisaml inspect · opsets {escape(', '.join(f'{d} {v}' for d, v in rep['opsets'].items()))}"
              f" · batch axis {escape(rep['batch_symbol'] or 'none (one instance)')}</div>"]
    rows = [("inputs", "; ".join(f"{io['name']}: {shape_text(io)}" for io in rep["inputs"])),
            ("outputs", "; ".join(f"{io['name']}: {shape_text(io)}" for io in rep["outputs"]))]
    if rep["unsupported"]:
        rows.append(("unsupported nodes", "; ".join(rep["unsupported"])))
    else:
        if rep["per_sample_impossible"]:
            rows.append(("per-sample execution", f"impossible ({rep['per_sample_impossible']}); plan at batch 2"))
        rows += [("nodes", f"{t['nodes']} ({len(rep['stages']) if rep['stages'] is not None else 'no'} stages)"),
                 ("parameters", f"{t['params']:,}"),
                 (f"FLOPs {per}", f"{t['flops']:,}" + (f" (+ {len(t['flops_unknown'])} nodes without a formula)"
                                                       if t["flops_unknown"] else "")),
                 (f"bytes read and written {per}", byte_text(t["bytes"])),
                 ("weight blob", f"{byte_text(t['weight_blob_bytes'])} in {t['weight_tensors']} tensors"),
                 ("registers of forward", alloc_summary(rep["registers"]))]
        if rep["buffers"] is not None:
            rows.append(("buffers across stages", alloc_summary(rep["buffers"])))
        if rep["batch_kernel"]:
            rows.append(("batch kernel", rep["batch_kernel"]))
        rows += [("rows kept", line) for line in rep.get("rows_kept", [])]
        rows.append(("stage times", f"{time_text(prof['total_ms'])} in all, each stage launched alone (the median of "
                                    f"{prof['repeat']}) on {prof['backend']}, batch {prof['batch']} of random inputs"
                     if prof else "not measured (inspect --html FILE --profile runs the model once to time them)"))
    parts.append("<table class=kv>" + "".join(f"<tr><td>{escape(k)}</td><td><span class=w>{escape(v)}</span></td></tr>"
                                              for k, v in rows) + "</table>")
    if not rep["unsupported"]:
        parts.append("<h2>Graph</h2><div class='legend sub'>one box per stage, launched top to bottom as one command "
                     "list: <span style='background:#ddf4ff;border-color:#0969da'>element</span>"
                     "<span style='background:#dafbe1;border-color:#1a7f37'>items</span>"
                     "<span style='background:#fff1e5;border-color:#bc4c00'>blocks</span>"
                     "<span style='background:#fff8c5;border-color:#9a6700'>sample / single</span>"
                     "<span style='background:#fbefff;border-color:#8250df'>fused</span> · "
                     "<span class=ep style='border:0;padding:0;color:#8250df'>+ epilogue</span>"
                     "<i> inline</i> · an arrow is a tensor passed in a device buffer (hover for names) · "
                     "click a node for its attributes" + (" · in red: each stage's time and share" if prof else "")
                     + "</div>")
        parts.append(zoom_box(*graph_svg(rep), view="graph"))
        parts.append("<h2>Memory</h2><div class=sub>each row is a slot of the allocation (its size on the left), each "
                     "bar a tensor over the steps it is live; the curve above is the bytes live at each step</div>")
        one = "one sample" if rep["per_sample"] else "the whole instance"
        parts.append(f"<h3>Registers of <code>forward</code> ({one}; a step per node)</h3>"
                     + zoom_box(*live_svg(rep["registers"], "registers"), view="registers"))
        if rep["buffers"] is not None:
            parts.append("<h3>Device buffers across stages (a region per sample; a step per stage)</h3>"
                         + zoom_box(*live_svg(rep["buffers"], "buffers"), view="buffers"))
        parts.append(nodes_table(rep, per))
        if rep["stages"] is not None:
            parts.append(stages_table(rep))
    parts.append("<aside id=details hidden aria-live=polite></aside>")
    parts.append(f"<script type=application/json id=report-data>{data_json(rep)}</script>")
    parts.append(f"<script>{SCRIPT}</script></body></html>")
    return "\n".join(parts)
