"""Lowering: from a prepared Model to GraphCode, the graph as the kernel sees it: one Tensor per
variable (its shape per sample), one Operator per node (subgraphs lowered with their parent),
constants in literals or the weight blob, intermediates pooled by the register allocator, the
host-derived inputs, the outputs every sample adds into, and the size checks."""
from __future__ import annotations

import re

import numpy as np

from . import dtypes, registry
from .errors import BatchMixingError
from .limits import Limits
from .model import Graph, Model, ModelError, Node, Variable, outer_reads, shape_str, subgraphs
from .operator import Derived, Operator
from .passes import Prepared
from .passes import batch as batch_pass
from .passes.batch import BatchDim
from .passes.batch import PROBE_A
from .plan import Blob, BlobWeight, DerivedInput, GraphCode, IOSpec, Plan
from .regalloc import Allocation, Request, Step, allocate
from .storage import Buffer, Tensor, constant_storage

# Intermediates up to this many elements live in registers (local arrays); larger ones would
# spill anyway (and overflow a CPU thread's stack), so they go to device scratch memory: one
# buffer per element type, a region per sample, pooled by the same allocator.
LOCAL_LIMIT = 4096


# ---- kernel tensors --------------------------------------------------------------------------


def _producer_note(name: str, producers: dict[str, Node]) -> str:
    n = producers.get(name)
    return f" (output of {n.describe()})" if n else ""


def _untyped(name: str, g: Graph, producers: dict[str, Node], prep: Prepared) -> ModelError:
    """Return the error for a tensor inference could not type: the producing node's own shape
    inference error when onnx gives one (an inner dimension that does not match, say), so the
    message blames the node with the bad inputs rather than the tensor after it."""
    node = producers.get(name)
    if node is not None and node.domain in ("", "ai.onnx") and not subgraphs(node):
        from onnx import helper, numpy_helper, shape_inference

        try:
            ins, inits = [], []
            for i in node.inputs:
                if not i:
                    continue
                v = g.var(i)
                if v.value is not None:
                    inits.append(numpy_helper.from_array(np.asarray(v.value), i))
                ins.append(helper.make_tensor_value_info(i, v.elem_type, list(v.shape) if v.shape is not None else None))
            proto = helper.make_node(node.op_type, node.inputs, node.outputs, name="n", **node.attrs)
            m = helper.make_model(helper.make_graph([proto], "g", ins, [], inits),
                                  opset_imports=[helper.make_opsetid("", prep.model.opset(""))])
            shape_inference.infer_shapes(m, check_type=True, strict_mode=True)
        except Exception as e:  # the message we want; anything else falls through to the generic one
            detail = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            if "InferenceError" in detail or "InferenceError" in type(e).__name__:
                detail = re.sub(r"\[\w+\] Inference error\(s\): |\(op_type:[^)]*\):\s*", "", detail)
                shapes = ", ".join(g.var(i).describe() for i in node.inputs if i)
                probe = f" (shapes at the probe batch size {PROBE_A} of '{prep.symbol}')" if prep.symbol else ""
                return ModelError(f"{node.describe()}: its inputs ({shapes}){probe} do not fit: {detail}")
    if node is not None and node.domain not in ("", "ai.onnx"):
        # a custom operator that knows why its outputs stay untyped says so (an fvdb topology node
        # over grids that are not constants: operators/fvdb/topology.py)
        cls = prep.operators(node.op_type, node.domain)
        reason = getattr(cls, "untyped_reason", None)
        if reason is not None:
            return ModelError(f"{node.describe()}: {reason(node, g)}")
    where = f"tensor '{name}'{_producer_note(name, producers)}"
    v = g.var(name)
    # the ONNX backend reads these two forms to find the inputs it must bind as constants
    if v.elem_type != 0 and v.shape is None:
        return ModelError(f"{where}: its shape could not be inferred")
    if v.elem_type != 0:
        k = next(k for k, d in enumerate(v.shape) if not isinstance(d, int))
        return ModelError(f"{where}: dimension {k} of {shape_str(v.shape)} could not be inferred")
    return ModelError(f"{where}: its type and shape could not be inferred")


def sample_dim(v: Variable, prep: Prepared, producers) -> BatchDim:
    """Return a variable's shape per sample (passes/batch.py), or raise naming the tensor when its
    shape is unknown or its batch dimension is not where per-sample code can index it."""
    where = f"tensor '{v.name}'{_producer_note(v.name, producers)}"
    if v.shape is None:
        raise ModelError(f"{where}: its shape could not be inferred")
    for k, d in enumerate(v.shape):
        if not isinstance(d, int):
            raise ModelError(f"{where}: dimension {k} of {shape_str(v.shape)} could not be inferred")
    dim = batch_pass.require(prep.batch, v.name, where)
    if prep.batch.moved is not None:
        raise BatchMixingError(f"{prep.batch.moved}; per-sample execution needs the batch dimension leading every tensor")
    return dim


def build_tensors(g: Graph, prep: Prepared, outer: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
    """Return the kernel Tensor of every variable a graph's nodes and interface use; names a
    subgraph reads from enclosing graphs map to the enclosing graphs' tensors."""
    producers = g.producers()
    # names a nested subgraph reads from further out pass through this graph's tensors too (an If
    # inside an If's branch reading the main graph's input)
    used = [i for n in g.nodes for i in n.inputs + n.outputs + sorted(outer_reads(n)) if i]
    names = list(dict.fromkeys(g.inputs + used + g.outputs))
    tensors: dict[str, Tensor] = {}
    for name in names:
        if outer and name in outer and name not in g.vars:
            tensors[name] = outer[name]
            continue
        v = g.var(name)
        rows = runtime_rows(name, producers, prep.operators, prep.bound)
        if rows is not None:
            tensors[name] = _runtime_tensor(v, rows, producers, runtime_axis(name, producers, prep.operators))
            continue
        if name in prep.bound:  # rows bound at run time: ROWS_PROBE here, any number when it runs
            tensors[name] = _bound_tensor(v, prep.bound[name])
            continue
        untyped = v.elem_type == 0 or v.shape is None or not all(isinstance(d, int) for d in v.shape)
        if untyped and name in producers:
            node = producers[name]
            sized = next((i for i in node.inputs if i and runtime_rows(i, producers, prep.operators, prep.bound)),
                         None)
            if sized is not None:  # its shape is unknown because it reads such a tensor: say that
                raise ModelError(f"{node.describe()}: input '{sized}' has a first dimension known only at run "
                                 f"time ({runtime_rows(sized, producers, prep.operators, prep.bound)}); no node can "
                                 "read it yet: make it a graph output")
            raise _untyped(name, g, producers, prep)
        if v.dtype is None:
            raise ModelError(
                f"tensor '{name}'{_producer_note(name, producers)}: element type "
                f"{dtypes.onnx_name(v.elem_type) if v.elem_type else 'unknown'} is not supported"
            )
        dim = sample_dim(v, prep, producers)
        dtype = dtypes.DOUBLE_AS_FLOAT if (prep.float64_as_float and v.dtype is dtypes.DOUBLE) else v.dtype
        t = Tensor(name, dtype, dim.shape, dim.batched, dim.value)
        t.batch_dependent = dim.dependent
        tensors[name] = t
    return tensors


def _bound_tensor(v: Variable, rows: str) -> Tensor:
    """Return the Tensor of an input whose rows are bound at run time (passes/infer.py, bound_inputs)."""
    if v.dtype is None:
        raise ModelError(f"input '{v.name}': element type {dtypes.onnx_name(v.elem_type)} is not supported")
    t = Tensor(v.name, v.dtype, tuple(int(d) for d in v.shape), False, None)
    t.bound_rows = rows
    return t


def io_spec(t: Tensor, v: Variable, prep: Prepared, ident: str, producers) -> IOSpec:
    if getattr(t, "bound_rows", None) is not None:
        return IOSpec(t.name, ident, t.dtype, (t.bound_rows,) + tuple(t.shape[1:]), t.shape, False, rows=t.bound_rows)
    rows = getattr(t, "runtime_rows", None)
    if rows is not None:  # its runtime_axis is the symbol the runtime sizes after a read-back
        axis = getattr(t, "runtime_axis", 0)
        shape = tuple(rows if k == axis else d for k, d in enumerate(t.shape))
        return IOSpec(t.name, ident, t.dtype, shape, t.shape, False, rows=rows, rows_axis=axis)
    return IOSpec(t.name, ident, t.dtype, sample_dim(v, prep, producers).onnx_shape, t.shape, t.batched)


def runtime_rows(name: str, producers: dict[str, Node], operators, bound=()) -> str | None:
    """Return the symbol of a tensor's run-time row count (the output of a node whose operator
    declares it runtime_sized: luisaml/dynamic.py, or sized_at_run for inputs whose rows are bound at
    run time, the names in `bound`), or None for a tensor of static shape; operators: the model's
    binding (Prepared.operators)."""
    node = producers.get(name)
    if node is None:
        return None
    cls = operators(node.op_type, node.domain)
    k = node.outputs.index(name)
    if cls is None or (k not in cls.runtime_sized and not (cls.bound_rows and k in cls.sized_at_run(node, bound))):
        return None
    return f"rows of {node.name or node.op_type}"


def runtime_axis(name: str, producers: dict[str, Node], operators) -> int:
    """Return the dimension of a run-time sized tensor that its count sizes (Operator.runtime_axis)."""
    node = producers[name]
    return operators(node.op_type, node.domain).runtime_axis


def _runtime_tensor(v: Variable, rows: str, producers: dict[str, Node], axis: int = 0) -> Tensor:
    """Return the Tensor of a run-time sized output: 0 along `axis` at compile time (whatever number
    an exporter wrote there: the runtime sizes it), its other dimensions static."""
    where = f"tensor '{v.name}'{_producer_note(v.name, producers)}"
    others = [] if v.shape is None else [d for k, d in enumerate(v.shape) if k != axis]
    if v.dtype is None or v.shape is None or len(v.shape) <= axis or not all(isinstance(d, int) for d in others):
        raise ModelError(f"{where}: its dimension {axis} is sized at run time, but its type or other dimensions "
                         f"could not be inferred ({shape_str(v.shape) if v.shape is not None else 'no shape'})")
    t = Tensor(v.name, v.dtype, tuple(0 if k == axis else int(d) for k, d in enumerate(v.shape)), False, None)
    t.runtime_rows = rows
    t.runtime_axis = axis
    return t


def check_runtime_sized(code: GraphCode) -> None:
    """Raise for a node that reads a run-time sized tensor: its size is unknown until the host reads
    it back, so only the runtime (as a graph output) may take it."""
    for node, op in code.ops:
        for t in op.inputs:
            if t is not None and getattr(t, "runtime_rows", None) is not None:
                raise ModelError(
                    f"{node.describe()}: input '{t.name}' has a first dimension known only at run time "
                    f"({t.runtime_rows}); no node can read it yet: make it a graph output")
        for sub in op.subgraphs.values():
            for name in outer_reads(node):
                t = code.tensors.get(name)
                if t is not None and getattr(t, "runtime_rows", None) is not None:
                    raise ModelError(f"{node.describe()}: its subgraph reads '{name}', whose first dimension is "
                                     "known only at run time; make it a graph output")


# ---- operators -------------------------------------------------------------------------------


def unsupported_nodes(g: Graph, prep: Prepared) -> list[str]:
    """Return a line for every node (subgraphs included) that no registered operator implements."""
    missing = []
    for node in g.nodes:
        opset = prep.model.opset(node.domain)
        if prep.operators(node.op_type, node.domain) is None:
            dom = node.domain or "ai.onnx"
            have = registry.versions(node.op_type, node.domain)
            why = f"registered from opset {have[0]}, model uses {opset}" if have else "not implemented"
            missing.append(f"{node.describe()} [{dom} opset {opset}]: {why}")
        for sub in subgraphs(node):
            missing += unsupported_nodes(sub, prep)
    return missing


def build_operators(
    g: Graph, model: Model, tensors: dict[str, Tensor], prep: Prepared, blob: "Blob"
) -> list[tuple[Node, Operator]]:
    """Return one Operator per node (subgraphs compiled for the nodes that hold them)."""
    ops = []
    for node in g.nodes:
        opset = model.opset(node.domain)
        cls = prep.operators(node.op_type, node.domain)
        ins = [tensors[i] if i else None for i in node.inputs]
        outs = [tensors[o] if o else None for o in node.outputs]
        for t in ins:
            if t is not None and getattr(t, "batch_dependent", False) and not getattr(cls, "shape_inputs_ok", False):
                raise BatchMixingError(
                    f"{node.describe()}: input '{t.name}' is computed from the batch size; per-sample "
                    "execution cannot use it as data"
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
                raise BatchMixingError(
                    f"{node.describe()}: output '{t.name}' has {t.shape[0]} rows per sample along the batch "
                    f"axis, its inputs {sorted(rows_in)}: this node mixes samples across the batch"
                )
        shared = [t for k, t in enumerate(op.outputs) if t is not None and not t.batched and t.value is None
                  and not op.cooperative(k)]
        if any(t is not None and t.batched for t in op.inputs) and shared:
            bad = shared[0]
            raise BatchMixingError(
                f"{node.describe()}: output '{bad.name}' {shape_str(bad.shape)} no longer has the batch "
                "dimension: this node mixes samples across the batch"
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
        # an outer constant that only subgraphs read has no storage from the enclosing graph; a constant
        # that is also a graph output keeps its storage for the nodes that read it (no node writes it:
        # the run returns its value from the host, Plan.host_outputs)
        placed = t.name not in io or (main and t.name not in g.inputs)
        if t.value is not None and placed and (t.name in g.vars or t.home is None):
            t.home = constant_storage(t.value, t.dtype) or BlobWeight(t, blob)
    io |= {n for n, t in tensors.items() if n not in g.vars}  # outer tensors: not ours to place
    steps, views = [], {}
    for node, op in ops:
        out0 = op.outputs[0] if op.outputs else None
        # what the node's subgraphs read from this graph stays live until the node runs
        st = Step(node.name, [i for i in list(node.inputs) + sorted(outer_reads(node)) if i],
                  [o for o in node.outputs if o])
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


def check_sizes(code: GraphCode, limits: Limits) -> None:
    """Raise LimitError for a tensor (of a sample, subgraphs included) beyond 32-bit indexing or the
    tensor size limit; the runtime checks the whole batch's buffers again before allocating them."""
    for t in code.tensors.values():
        limits.check_elements(f"tensor '{t.name}' {shape_str(t.shape)}", t.numel, t.dtype.itemsize)
    for _, op in code.ops:
        for sub in op.subgraphs.values():
            check_sizes(sub, limits)


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
                raise BatchMixingError(
                    f"{node.describe()}: output '{t.name}' gathers contributions from every sample of the "
                    "batch, so per sample it must be a graph output that no other node reads"
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
        t.home = constant_storage(value, dtype) or BlobWeight(t, plan.blob)
        return t
    bad = [t.name for t in srcs if t.value is None and t.name not in graph_inputs]
    if bad:
        raise op.error(
            f"input(s) {bad} must be graph inputs or constants: {d.compute.__name__} is derived from "
            "them on the host when they are bound"
        )
    spec = DerivedInput(plan.names.get(name, "d"), dtype, tuple(d.shape), d.compute, tuple(t.name for t in srcs),
                        dict(d.params), {t.name: t.value for t in srcs if t.value is not None},
                        tuple(t.name for k, t in zip(d.sources, srcs) if k in d.shape_only), d.any_rows)
    plan.derived.append(spec)
    return Tensor(name, dtype, tuple(d.shape), False, None, Buffer(spec.ident))


def build_graph_code(g: Graph, prep: Prepared, blob: Blob, outer: dict[str, Tensor] | None = None) -> GraphCode:
    """Return the tensors, operators and storage plan of a graph (a subgraph when outer is given)."""
    tensors = build_tensors(g, prep, outer)
    ops = build_operators(g, prep.model, tensors, prep, blob)
    check_runtime_sized(GraphCode(g, tensors, ops, None, {}))
    check_batch_mixing(ops)
    allocation, views = plan_storage(g, tensors, ops, blob, main=outer is None)
    return GraphCode(g, tensors, ops, allocation, views)
