"""From a prepared Model to the generated module: kernel tensors, one Operator per node, storage
for every tensor (inputs, weights, literals, pooled slots), and the two functions' source."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import dtypes, registry
from . import indexing as ix
from .codegen import KernelContext, Module, identifier, render_module
from .dtypes import DType
from .model import Graph, Model, ModelError, Node, Variable, shape_str, subgraphs
from .operator import CompileError, Derived, Operator
from .passes import PROBE_A, PROBE_B, Prepared
from .regalloc import Allocation, Request, Step, allocate
from .storage import Buffer, Bytes, Local, Storage, Tensor, Weight, constant_storage

# Intermediates up to this many elements live in registers (local arrays); larger ones would
# spill anyway (and overflow a CPU thread's stack), so they go to device scratch memory: one
# buffer per element type, a region per sample, pooled by the same allocator.
LOCAL_LIMIT = 4096
BLOB_ALIGN = 16


@dataclass
class IOSpec:
    """A graph input or output as the runtime binds it."""

    name: str
    ident: str  # parameter name in the generated functions
    dtype: DType
    shape: tuple  # the ONNX shape; the batch dimension is the symbol
    kernel_shape: tuple[int, ...]  # per sample (batch dimension 1)
    batched: bool
    accumulated: bool = False  # every sample adds into it (a buffer the runtime zeroes first)

    @property
    def numel(self) -> int:
        return int(np.prod(self.kernel_shape, dtype=np.int64))


@dataclass
class DerivedInput:
    """A host-derived shared kernel argument (operator.Derived) computed from graph inputs."""

    ident: str
    dtype: DType
    shape: tuple[int, ...]
    compute: object
    sources: tuple[str, ...]  # graph inputs (or constants), in compute()'s argument order
    params: dict
    constants: dict[str, np.ndarray]  # the sources that are constants

    def value(self, arrays: dict[str, np.ndarray]) -> np.ndarray:
        """Return the derived array for the graph inputs' host arrays."""
        args = (self.constants[s] if s in self.constants else arrays[s] for s in self.sources)
        out = np.asarray(self.compute(*args, **self.params))
        if out.shape != self.shape:
            raise ValueError(f"derived input {self.ident}: computed shape {out.shape}, expected {self.shape}")
        return out


class Blob:
    """The weight blob: constants appended on first use, aligned, recorded by name."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0
        self.layout: dict[str, tuple[int, int, DType, tuple[int, ...]]] = {}

    def add(self, t: Tensor) -> int:
        """Return the byte offset of t's data, appending it on first use."""
        if t.name in self.layout:
            return self.layout[t.name][0]
        pad = -self.size % BLOB_ALIGN
        if pad:
            self.parts.append(b"\0" * pad)
            self.size += pad
        data = dtypes.to_kernel(t.value, t.dtype, f"constant '{t.name}'").tobytes()
        self.layout[t.name] = (self.size, len(data), t.dtype, tuple(t.shape))
        self.parts.append(data)
        self.size += len(data)
        return self.layout[t.name][0]

    def bytes(self) -> bytes:
        """Return the blob, padded to a multiple of 4 bytes and at least 4 bytes long."""
        raw = b"".join(self.parts)
        return raw + b"\0" * ((-len(raw) % 4) or (4 if not raw else 0))


@dataclass
class BlobWeight(Storage):
    """A constant placed in the blob the first time code reads it."""

    tensor: Tensor
    blob: Blob

    def load(self, i: str) -> str:
        return Weight(self.blob.add(self.tensor), self.tensor.dtype).load(i)

    def byte_address(self) -> tuple[str, str]:
        return Weight(self.blob.add(self.tensor), self.tensor.dtype).byte_address()


@dataclass
class GraphCode:
    """One graph ready to emit: its tensors (outer ones it reads included), operators, storage plan."""

    graph: Graph
    tensors: dict[str, Tensor]
    ops: list[tuple[Node, Operator]]
    allocation: Allocation
    views: dict[str, str]


@dataclass
class Plan:
    """Everything compile() decided, kept for inspect and the runtime."""

    model: Model
    symbol: str | None
    main: GraphCode
    inputs: list[IOSpec]
    outputs: list[IOSpec]
    blob: Blob
    source: str = ""
    derived: list[DerivedInput] = field(default_factory=list)
    fused: Any = None  # luisaml.fusion.FusedMLP when the batch kernel is the fused MLP kernel
    fusion_note: str = ""  # what fusion decided and why, for inspect

    @property
    def tensors(self) -> dict[str, Tensor]:
        return self.main.tensors

    @property
    def ops(self) -> list[tuple[Node, Operator]]:
        return self.main.ops

    @property
    def allocation(self) -> Allocation:
        return self.main.allocation

    @property
    def views(self) -> dict[str, str]:
        return self.main.views

    @property
    def scratch(self) -> dict[str, tuple[int, dict[int, int]]]:
        """DSL type -> (elements per sample, {slot id: offset}) of the scratch buffers."""
        return scratch_layout(self.main.allocation)

    @property
    def scratch_params(self) -> list[str]:
        return [f"scratch_{dsl}" for dsl in sorted(self.scratch)]

    @property
    def host_outputs(self) -> list[str]:
        """Graph outputs no node writes (an input or a constant passed straight out)."""
        written = {s.name for s in self.outputs}
        return [o for o in self.model.graph.outputs if o not in written]


# ---- kernel tensors --------------------------------------------------------------------------


def _producer_note(name: str, producers: dict[str, Node]) -> str:
    n = producers.get(name)
    return f" (output of {n.describe()})" if n else ""


def _kernel_shape(v: Variable, prep: Prepared, producers) -> tuple[tuple[int, ...], bool, tuple]:
    """Return (per-sample shape, batched, ONNX shape with the symbol) of a variable."""
    where = f"tensor '{v.name}'{_producer_note(v.name, producers)}"
    if v.shape is None:
        raise ModelError(f"{where}: its shape could not be inferred")
    other = prep.shapes_b.get(v.name)
    dims, onnx_dims, batched = [], [], False
    for k, a in enumerate(v.shape):
        b = other[k] if (other is not None and k < len(other)) else a
        if not isinstance(a, int):
            raise ModelError(f"{where}: dimension {k} of {shape_str(v.shape)} could not be inferred")
        if prep.symbol is None or a == b:
            dims.append(a)
            onnx_dims.append(a)
            continue
        mult = _batch_multiple(a, b)
        if mult is not None and k == 0:
            # k*B at axis 0 keeps each sample's elements together (a reshape of [B, k, ...]):
            # per sample it is k rows
            batched = True
            dims.append(mult)
            onnx_dims.append(prep.symbol if mult == 1 else f"{mult}*{prep.symbol}")
            continue
        if mult is not None:
            raise ModelError(
                f"{where}: the batch dimension '{prep.symbol}' moved to axis {k} of "
                f"{shape_str(tuple(onnx_dims) + ('...',))}; per-sample execution needs it at axis 0 "
                "(compile with batch_axis=None for one instance of the graph)"
            )
        raise ModelError(
            f"{where}: dimension {k} is dynamic ({a} at batch {PROBE_A}, {b} at batch {PROBE_B}); it mixes "
            f"samples across the batch dimension '{prep.symbol}' (compile with batch_axis=None for one "
            "instance of the graph)"
        )
    return tuple(dims), batched, tuple(onnx_dims)


def _batch_multiple(a: int, b: int | None) -> int | None:
    """Return k when a dimension is k*B (k*PROBE_A and k*PROBE_B at the two probes), else None."""
    if b is None or a % PROBE_A or b % PROBE_B or a // PROBE_A != b // PROBE_B:
        return None
    return a // PROBE_A


def _constant_value(v: Variable, prep: Prepared, batched: bool) -> tuple[np.ndarray | None, bool]:
    """Return (the per-sample value, batch-dependent?) of a folded constant."""
    if v.value is None:
        return None, False
    other = prep.values_b.get(v.name)
    if other is None or (other.shape == v.value.shape and np.array_equal(other, v.value, equal_nan=True)):
        return v.value, False
    if batched and v.value.ndim and np.all(v.value == v.value[:1]) and np.all(other == other[:1]):
        return v.value[:1], False  # the same row for every sample
    return None, True


def build_tensors(g: Graph, prep: Prepared, outer: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
    """Return the kernel Tensor of every variable a graph's nodes and interface use; names a
    subgraph reads from enclosing graphs map to the enclosing graphs' tensors."""
    producers = g.producers()
    names = list(dict.fromkeys(g.inputs + [i for n in g.nodes for i in n.inputs + n.outputs if i] + g.outputs))
    tensors: dict[str, Tensor] = {}
    for name in names:
        if outer and name in outer and name not in g.vars:
            tensors[name] = outer[name]
            continue
        v = g.var(name)
        if v.dtype is None:
            raise ModelError(
                f"tensor '{name}'{_producer_note(name, producers)}: element type "
                f"{dtypes.onnx_name(v.elem_type) if v.elem_type else 'unknown'} is not supported"
            )
        shape, batched, _ = _kernel_shape(v, prep, producers)
        value, dependent = _constant_value(v, prep, batched)
        dtype = dtypes.DOUBLE_AS_FLOAT if (prep.float64_as_float and v.dtype is dtypes.DOUBLE) else v.dtype
        t = Tensor(name, dtype, shape, batched, value)
        t.batch_dependent = dependent
        tensors[name] = t
    return tensors


def io_spec(t: Tensor, v: Variable, prep: Prepared, prefix: str, producers) -> IOSpec:
    _, _, onnx_shape = _kernel_shape(v, prep, producers)
    return IOSpec(t.name, identifier(t.name, prefix), t.dtype, onnx_shape, t.shape, t.batched)


# ---- operators -------------------------------------------------------------------------------


def unsupported_nodes(g: Graph, model: Model) -> list[str]:
    """Return a line for every node (subgraphs included) that no registered operator implements."""
    registry._load_builtin()
    missing = []
    for node in g.nodes:
        opset = model.opset(node.domain)
        if registry.resolve(node.op_type, node.domain, opset) is None:
            dom = node.domain or "ai.onnx"
            have = registry.versions(node.op_type, node.domain)
            why = f"registered from opset {have[0]}, model uses {opset}" if have else "not implemented"
            missing.append(f"{node.describe()} [{dom} opset {opset}]: {why}")
        for sub in subgraphs(node):
            missing += unsupported_nodes(sub, model)
    return missing


def build_operators(
    g: Graph, model: Model, tensors: dict[str, Tensor], prep: Prepared, blob: "Blob"
) -> list[tuple[Node, Operator]]:
    """Return one Operator per node (subgraphs compiled for the nodes that hold them)."""
    ops = []
    for node in g.nodes:
        opset = model.opset(node.domain)
        cls = registry.resolve(node.op_type, node.domain, opset)
        ins = [tensors[i] if i else None for i in node.inputs]
        outs = [tensors[o] if o else None for o in node.outputs]
        for t in ins:
            if t is not None and getattr(t, "batch_dependent", False) and not getattr(cls, "shape_inputs_ok", False):
                raise CompileError(
                    f"{node.describe()}: input '{t.name}' is computed from the batch size; per-sample "
                    "execution cannot use it as data (compile with batch_axis=None)"
                )
        subs = {
            name: build_graph_code(v, prep, blob, tensors)
            for name, v in node.attrs.items()
            if isinstance(v, Graph)
        }
        ops.append((node, cls(node, ins, outs, opset, subgraphs=subs)))
    return ops


def check_batch_mixing(ops: list[tuple[Node, Operator]]) -> None:
    """Raise for a node that reads a per-sample tensor and writes a shared one, or (not being a
    view) changes how many rows of a k*B leading dimension belong to one sample."""
    for node, op in ops:
        rows_in = {t.shape[0] for t in op.inputs if t is not None and t.batched}
        for t in op.outputs:
            if t is not None and t.batched and rows_in and not op.view and t.shape[0] not in rows_in:
                raise CompileError(
                    f"{node.describe()}: output '{t.name}' has {t.shape[0]} rows per sample along the batch "
                    f"axis, its inputs {sorted(rows_in)}: this node mixes samples across the batch "
                    "(compile with batch_axis=None)"
                )
        shared = [t for k, t in enumerate(op.outputs) if t is not None and not t.batched and t.value is None
                  and not op.cooperative(k)]
        if any(t is not None and t.batched for t in op.inputs) and shared:
            bad = shared[0]
            raise CompileError(
                f"{node.describe()}: output '{bad.name}' {shape_str(bad.shape)} no longer has the batch "
                "dimension: this node mixes samples across the batch (compile with batch_axis=None)"
            )


# ---- storage ---------------------------------------------------------------------------------


def plan_storage(
    g: Graph, tensors: dict[str, Tensor], ops: list[tuple[Node, Operator]], blob: Blob, main: bool = True
) -> tuple[Allocation, dict[str, str]]:
    """Give constants and intermediates their storage; return the allocation and the view map.
    The main graph's inputs and outputs are bound by the caller; a subgraph's outputs are
    ordinary intermediates that stay live to its end (its parent copies them out)."""
    io = set(g.inputs) | (set(g.outputs) if main else set())
    for t in tensors.values():
        # an outer constant that only subgraphs read has no storage from the enclosing graph
        if t.value is not None and t.name not in io and (t.name in g.vars or t.storage is None):
            t.storage = constant_storage(t.value, t.dtype) or BlobWeight(t, blob)
    io |= {n for n, t in tensors.items() if n not in g.vars}  # outer tensors: not ours to place
    steps, views = [], {}
    for node, op in ops:
        out0 = op.outputs[0] if op.outputs else None
        st = Step(node.name, [i for i in node.inputs if i], [o for o in node.outputs if o])
        if op.view and out0 is not None and out0.name not in io and op.inputs[0] is not None:
            views[out0.name] = op.inputs[0].name
            st.views.append((out0.name, op.inputs[0].name))
        for k in op.inplace:
            t = op.inputs[k] if k < len(op.inputs) else None
            if t is not None and out0 is not None and t.shape == out0.shape and t.dtype == out0.dtype:
                st.inplace.append((out0.name, t.name))
        steps.append(st)
    if not main:
        steps.append(Step("outputs", [o for o in g.outputs if o], []))
    requests = []
    for st in steps:
        for name in st.writes:
            t = tensors[name]
            if name in io or t.value is not None or (name in views and views[name] not in _allocatable(tensors, io)):
                continue
            space = "local" if (t.numel <= LOCAL_LIMIT or not main) else "scratch"
            requests.append(Request(name, space, t.dtype.dsl, max(t.numel, 1), t.dtype.itemsize))
    return allocate(steps, requests), views


def _allocatable(tensors: dict[str, Tensor], io: set[str]) -> set[str]:
    return {n for n, t in tensors.items() if n not in io and t.value is None}


def bind_views(tensors: dict[str, Tensor], views: dict[str, str]) -> None:
    """Give each view output the storage of the tensor it views (after slots are bound)."""
    for out, src in views.items():
        root = src
        while root in views:
            root = views[root]
        tensors[out].storage = tensors[root].storage


# ---- the two functions -------------------------------------------------------------------------


def scratch_layout(allocation: Allocation) -> dict[str, tuple[int, dict[int, int]]]:
    """Return DSL type -> (elements per sample, {slot id: offset}) of the scratch buffers."""
    out: dict[str, tuple[int, dict[int, int]]] = {}
    for slot in allocation.slots:
        if slot.space != "scratch":
            continue
        size, offsets = out.get(slot.dtype, (0, {}))
        offsets[slot.id] = size
        out[slot.dtype] = (size + slot.size, offsets)
    return out


def emit_graph(ctx: KernelContext, code: GraphCode, io_storage: dict[str, Storage]) -> None:
    """Emit a graph's code; its inputs (and, for the main graph, outputs) bound to io_storage."""
    for name, st in io_storage.items():
        code.tensors[name].storage = st
    scratch = scratch_layout(code.allocation)
    for sid, slot in enumerate(code.allocation.slots):
        if slot.space == "scratch":
            per_sample, offsets = scratch[slot.dtype]
            storage = Buffer(f"scratch_{slot.dtype}", ix.add(ix.mul("scratch_region", per_sample), str(offsets[sid])))
        else:
            name = ctx.fresh("s")
            ctx.line(f"{name} = {ctx.module.array_type(slot.dtype, slot.size)}()")
            storage = Local(name)
        for m in slot.members:
            code.tensors[m].storage = storage
    bind_views(code.tensors, code.views)
    for node, op in code.ops:
        if op.view and node.outputs[0] in code.views:
            ctx.comment(f"{node.name}: {node.op_type} is a view of '{node.inputs[0]}'")
            continue
        ctx.comment(f"{node.name}: {node.op_type}")
        op.forward(ctx)


def generate(plan: Plan, model_name: str) -> str:
    """Return the source of the generated module for a plan."""
    module = Module()
    # forward: per-sample inputs and outputs are arrays, shared inputs are buffers
    fwd = KernelContext(module)
    fwd_io: dict[str, Storage] = {}
    fwd_params = []
    symbol = plan.symbol
    for s in plan.inputs:
        fwd_params.append(s.ident)
        if s.dtype.is_byte:
            fwd_io[s.name] = Bytes(s.ident)
        else:
            fwd_io[s.name] = Local(s.ident) if (s.batched or symbol is None) else Buffer(s.ident)
    for s in plan.outputs:
        fwd_params.append(s.ident)
        fwd_io[s.name] = Buffer(s.ident) if s.accumulated else Local(s.ident)
    fwd_params += [d.ident for d in plan.derived]
    fwd_params.append("weights")
    if plan.scratch:  # the caller gives the buffers and which per-sample region to use
        fwd_params += plan.scratch_params + ["scratch_region"]
    emit_graph(fwd, plan.main, fwd_io)
    if plan.fused is not None:  # a recognised MLP: the cooperative kernel of luisaml/fusion.py
        from . import fusion

        kernel_params, kernel_body, type_decls = fusion.emit_kernel(plan, module)
        return _render(plan, model_name, module, fwd, fwd_params, kernel_params, kernel_body, type_decls)
    # the batch kernel: everything in buffers, one thread per sample
    ker = KernelContext(module)
    ker.line("sample = int(dispatch_id().x)")
    if plan.scratch:
        ker.line("scratch_region = sample")
    ker_io: dict[str, Storage] = {}
    shared_out: list[tuple[IOSpec, Tensor]] = []
    for s in plan.inputs:
        base = f"sample * {s.numel}" if s.batched and s.numel else "0"
        ker_io[s.name] = Bytes(s.ident, base) if s.dtype.is_byte else Buffer(s.ident, base)
    for s in plan.outputs:
        if s.accumulated:  # every thread adds into the zeroed output buffer itself
            ker_io[s.name] = Buffer(s.ident)
        elif s.batched or symbol is None:
            ker_io[s.name] = Buffer(s.ident, f"sample * {s.numel}" if s.batched and s.numel else "0")
        else:  # shared output: computed by every thread, written by thread 0
            tmp = ker.local_array(s.dtype.dsl, s.numel, "shared_out")
            ker_io[s.name] = Local(tmp)
            shared_out.append((s, plan.tensors[s.name]))
    emit_graph(ker, plan.main, ker_io)
    if shared_out:
        ker.line("if sample == 0:")
        with ker.indent():
            for s, t in shared_out:
                with ker.loop(s.numel) as i:
                    ker.line(Buffer(s.ident).store(i, t.storage.load(i)))
    params = [s.ident for s in plan.inputs] + [s.ident for s in plan.outputs]
    kernel_params = params + [d.ident for d in plan.derived] + ["weights"] + plan.scratch_params
    return _render(plan, model_name, module, fwd, fwd_params, kernel_params, "\n".join(ker.out), [])


def _render(plan: Plan, model_name: str, module: Module, fwd: KernelContext, fwd_params: list[str],
            kernel_params: list[str], kernel_body: str, type_decls: list[tuple[str, str]]) -> str:
    summary = (
        f"{len(plan.ops)} nodes, {len(plan.allocation.slots)} register slots, "
        f"weight blob {plan.blob.size} bytes, batch axis: {plan.symbol or 'none'}"
    )
    return render_module(
        model_name=model_name,
        summary=summary,
        imports=module.imports(),
        array_types=[(name, dsl, n) for (dsl, n), name in sorted(module.array_types.items(), key=lambda kv: kv[1])],
        type_decls=type_decls,
        forward_params=fwd_params,
        forward_doc=", ".join(p for p in fwd_params),
        forward_body="\n".join(fwd.out) or "    pass",
        kernel_params=kernel_params,
        kernel_body=kernel_body,
    )


def build_plan(prep: Prepared, model_name: str = "model", fuse: str = "off", precision: str = "fp32") -> Plan:
    """Return the full compile plan of a prepared model, generated source included.

    fuse: "off", "gpu" or "emulated" (luisaml/fusion.py: a recognised MLP gets the cooperative
    batch kernel); precision: "fp32", or "fp16" (half inputs and outputs; needs the fused kernel)."""
    g = prep.model.graph
    missing = unsupported_nodes(g, prep.model)
    if missing:
        raise CompileError(f"{len(missing)} unsupported node(s):\n  " + "\n  ".join(missing))
    blob = Blob()
    main = build_graph_code(g, prep, blob)
    tensors = main.tensors
    producers = g.producers()
    written = {o for n in g.nodes for o in n.outputs if o}
    inputs = [io_spec(tensors[n], g.var(n), prep, "x", producers) for n in g.inputs]
    outputs = [io_spec(tensors[n], g.var(n), prep, "y", producers) for n in dict.fromkeys(g.outputs) if n in written]
    for s in outputs:
        if s.dtype.is_byte:
            raise CompileError(f"output '{s.name}': uint8 outputs are not supported")
    plan = Plan(prep.model, prep.symbol, main, inputs, outputs, blob)
    mark_accumulated(plan)
    bind_derived(plan)
    from . import fusion

    plan.fused, plan.fusion_note = fusion.choose(plan, fuse, precision)
    plan.source = generate(plan, model_name)
    return plan


def _all_ops(code: GraphCode):
    """Yield (node, op) of a graph and, depth first, of the subgraphs its nodes hold."""
    for node, op in code.ops:
        yield node, op
        for sub in op.subgraphs.values():
            yield from _all_ops(sub)


def mark_accumulated(plan: Plan) -> None:
    """Flag the graph outputs every sample adds into; such an output must be a graph output, since
    no node of the same kernel can read it before every sample is done."""
    by_name = {s.name: s for s in plan.outputs}
    main_ops = {id(op) for _, op in plan.main.ops}
    for node, op in _all_ops(plan.main):
        for k, t in enumerate(op.outputs):
            if t is None or not op.cooperative(k):
                continue
            if t.name not in by_name or id(op) not in main_ops or any(t.name in n.inputs for n, _ in plan.ops):
                raise CompileError(
                    f"{node.describe()}: output '{t.name}' gathers contributions from every sample of the "
                    "batch, so it must be a graph output that no other node reads (or compile with "
                    "batch_axis=None)"
                )
            by_name[t.name].accumulated = True


def bind_derived(plan: Plan) -> None:
    """Give every node's derived inputs (Operator.derived_inputs) their tensors, one per distinct
    (computation, sources, parameters): constants are computed now and stored like any constant;
    those of graph inputs become shared kernel arguments (plan.derived) computed by the runtime."""
    by_key: dict[tuple, Tensor] = {}
    graph_inputs = set(plan.model.graph.inputs)
    for node, op in _all_ops(plan.main):
        op.derived = []
        for d in op.derived_inputs():
            srcs = [op.input(k) for k in d.sources]
            key = (d.compute.__module__, d.compute.__qualname__, tuple(t.name for t in srcs), d.params)
            if key not in by_key:
                by_key[key] = _derived_tensor(node, op, d, srcs, plan, graph_inputs, len(by_key))
            op.derived.append(by_key[key])


def _derived_tensor(node: Node, op: Operator, d: Derived, srcs: list[Tensor], plan: Plan, graph_inputs: set[str],
                    k: int) -> Tensor:
    name = f"derived{k}_{d.compute.__name__}"
    dtype = d.dtype
    if all(t.value is not None for t in srcs):
        try:
            value = np.asarray(d.compute(*(t.value for t in srcs), **dict(d.params)))
        except (ValueError, TypeError, OverflowError) as e:
            raise op.error(str(e)) from e
        if value.shape != tuple(d.shape):
            raise op.error(f"derived input {name} has shape {list(value.shape)}, expected {list(d.shape)}")
        t = Tensor(name, dtype, tuple(d.shape), False, value)
        t.storage = constant_storage(value, dtype) or BlobWeight(t, plan.blob)
        return t
    bad = [t.name for t in srcs if t.value is None and t.name not in graph_inputs]
    if bad:
        raise op.error(
            f"input(s) {bad} must be graph inputs or constants: {d.compute.__name__} is derived from "
            "them on the host when they are bound"
        )
    spec = DerivedInput(identifier(name, "d"), dtype, tuple(d.shape), d.compute, tuple(t.name for t in srcs),
                        dict(d.params), {t.name: t.value for t in srcs if t.value is not None})
    plan.derived.append(spec)
    return Tensor(name, dtype, tuple(d.shape), False, None, Buffer(spec.ident))


def build_graph_code(g: Graph, prep: Prepared, blob: Blob, outer: dict[str, Tensor] | None = None) -> GraphCode:
    """Return the tensors, operators and storage plan of a graph (a subgraph when outer is given)."""
    tensors = build_tensors(g, prep, outer)
    ops = build_operators(g, prep.model, tensors, prep, blob)
    check_batch_mixing(ops)
    allocation, views = plan_storage(g, tensors, ops, blob, main=outer is None)
    return GraphCode(g, tensors, ops, allocation, views)
