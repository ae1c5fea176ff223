"""Shape and dtype inference. onnx.shape_inference does the standard ops on a model whose
dimensions are all numbers; the batch dimension is found by specialising the model to two batch
sizes and comparing the results.

`operators`, where a function takes it: the model's Binding (luisaml.registry: op_type, domain ->
its operator class), whose rules type the nodes onnx cannot (`infer`, `probe_rows`) and say which
inputs may have rows bound at run time (`bound_rows`); None: onnx's rules alone, and no input's rows
are bound at run time."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .. import dtypes
from ..model import ModelError, Node, Variable, _attr_value, _var_from_type, shape_str
from ..limits import DEFAULT as DEFAULT_LIMITS
from ..limits import Limits
from .fold import fold_to_fixpoint

from .batch import PROBE_A, PROBE_B  # noqa: F401  (defined beside the annotation, which imports no onnx)
# the rows of inputs bound at run time (bound_inputs) in the probes, then in a third that shows
# whether anything else depends on them
ROWS_PROBE, ROWS_CHECK = 8, 13


@dataclass(frozen=True)
class Probe:
    """The specialisation being inferred: its batch size (None without a batch symbol) and the
    inputs whose rows are bound at run time."""

    batch: int | None
    bound: frozenset[str]


def _probe(proto: onnx.ModelProto, values: dict[str, int], batch: int | None, bound, limits: Limits,
           operators) -> onnx.ModelProto:
    """Fold and infer proto with the named dims set to numbers, under the Probe they make (passed to
    the operators' probe_rows rules)."""
    probe = Probe(batch, frozenset(bound))
    return fold_to_fixpoint(set_symbols(proto, values), lambda m: infer_shapes(m, probe, operators), limits=limits,
                            operators=operators)


# an initializer of more elements than this reaches onnx's shape inference as a typed graph input, its
# data left out: onnx serialised and parsed every weight at every call (ResNet-18's 47 MB, four calls
# a compile: 0.65 of its 0.97 s of passes here), and no shape rule reads so large a constant's values
# (data propagation reads shapes and small integer tensors)
INFER_DATA_LIMIT = 4096


def _onnx_infer(proto: onnx.ModelProto) -> onnx.ModelProto:
    g = proto.graph
    order = [t.name for t in g.initializer]
    big = [t for t in g.initializer if int(np.prod(t.dims, dtype=np.int64)) > INFER_DATA_LIMIT]
    if big:
        named = {t.name for t in big}
        kept = [t for t in g.initializer if t.name not in named]
        stand_ins = [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in big
                     if t.name not in {i.name for i in g.input}]
        light = onnx.ModelProto()
        light.CopyFrom(proto)  # (a copy in memory, far cheaper than onnx serialising and parsing the weights)
        del light.graph.initializer[:]
        light.graph.initializer.extend(kept)
        light.graph.input.extend(stand_ins)
    else:
        light = proto
    try:
        m = onnx.shape_inference.infer_shapes(light, check_type=False, strict_mode=False, data_prop=True)
    except Exception as e:  # onnx raises InferenceError for a model that is inconsistent
        raise ModelError(f"shape inference failed: {e}") from e
    if big:  # the weights back, in their order; the stand-in inputs out
        by_name = {t.name: t for t in m.graph.initializer} | {t.name: t for t in big}
        del m.graph.initializer[:]
        m.graph.initializer.extend(by_name[n] for n in order)
        extra = {vi.name for vi in stand_ins}
        inputs = [vi for vi in m.graph.input if vi.name not in extra]
        del m.graph.input[:]
        m.graph.input.extend(inputs)
    return m


def infer_shapes(proto: onnx.ModelProto, probe: Probe | None = None, operators=None) -> onnx.ModelProto:
    """Return the model with value_info for every tensor onnx can type; nodes onnx leaves untyped
    (other domains, and standard function ops such as GroupNormalization) are typed by their
    operator's own `infer` rule, and inference resumes after them."""
    m = _onnx_infer(proto)
    for _ in range(len(m.graph.node) + 1):
        if not _infer_custom(m, probe, operators):
            break
        m = _onnx_infer(m)
    return m


def _known_types(g: onnx.GraphProto) -> dict[str, Variable]:
    out: dict[str, Variable] = {}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            v = _var_from_type(vi.name, vi.type)
            if v.shape is not None:
                out[vi.name] = v
    for t in g.initializer:
        out[t.name] = Variable(t.name, dtypes.SUPPORTED.get(t.data_type), tuple(int(d) for d in t.dims),
                               numpy_helper.to_array(t), elem_type=t.data_type)
    return out


def _infer_custom(m: onnx.ModelProto, probe: Probe | None, operators) -> bool:
    """Type the untyped outputs of nodes by their operators' rules; return if any."""
    if operators is None:
        return False
    g = m.graph
    known = _known_types(g)
    added = False
    for node in g.node:
        # a custom node's output counts as typed once its shape is all numbers (a graph output may
        # arrive with its symbolic dims cleared, which only the node's own rule can fill in)
        custom = node.domain not in ("", "ai.onnx")
        cls = operators(node.op_type, node.domain)
        # ... and so does a standard node's whose operator has a rule of its own, for the dims onnx
        # leaves unknown (Compress with a constant condition)
        refine = custom or (cls is not None and cls.infer is not None)
        if all(o in known and (_static(known[o].shape) or not refine) for o in node.output if o):
            continue
        if cls is None or any(i and i not in known for i in node.input):
            continue
        n = Node(node.name, node.op_type, node.domain, list(node.input), list(node.output),
                 {a.name: _attr_value(a, None, node.name) for a in node.attribute})
        args = [known.get(i) if i else None for i in node.input]
        result = cls.probe_rows(n, probe, args) if probe is not None and cls.bound_rows else None
        if result is None and cls.infer is not None:
            result = cls.infer(n, args)
        if not result:
            continue
        by_name = {vi.name: vi for vi in g.value_info}
        for name, (elem, shape) in zip(node.output, result):
            if not name or (name in known and (shape is None or not _static(shape))):
                continue  # nothing better than what is there
            vi = helper.make_tensor_value_info(name, elem, list(shape) if shape is not None else None)
            if name in by_name:
                g.value_info.remove(by_name[name])
            if name not in {o.name for o in g.output}:
                g.value_info.append(vi)
            else:
                out = next(o for o in g.output if o.name == name)
                out.type.CopyFrom(vi.type)
            known[name] = _var_from_type(name, vi.type)
            added = True
    return added


def _static(shape) -> bool:
    return shape is not None and all(isinstance(d, (int, np.integer)) for d in shape)


def _dims(vi: onnx.ValueInfoProto):
    return vi.type.tensor_type.shape.dim


def input_shapes(proto: onnx.ModelProto) -> dict[str, list[int | str | None]]:
    """Return each real graph input's dims: int, a dim_param name, or None when unnamed."""
    inits = {t.name for t in proto.graph.initializer}
    out = {}
    for vi in proto.graph.input:
        if vi.name in inits:
            continue
        # a negative dim_value (some exporters write -1) or a dim_param of '?' is as dynamic as an
        # unnamed dim, and two of them are not the same dimension
        out[vi.name] = [
            int(d.dim_value) if d.HasField("dim_value") and d.dim_value >= 0
            else (d.dim_param if d.dim_param.strip() not in ("", "?", "-1") else None)
            for d in _dims(vi)
        ]
    return out


def find_batch_symbol(proto: onnx.ModelProto, batch_axis, operators=None) -> str | None:
    """Return the symbol of the batch axis, or None for single-instance mode.

    "auto": the symbol that leads an input and an output; else, when an output leads with a dim
    that is not a number, the symbol leading an input, or a new symbol given (in place) to every
    input whose leading dim is unnamed (-1, '?', no value): the probes then show whether it is a
    batch. 0: the same, without needing the output."""
    if batch_axis is None:
        return None
    if batch_axis not in ("auto", 0):
        raise ValueError(f"batch_axis must be 'auto', 0 or None, not {batch_axis!r}")
    ins = input_shapes(proto)
    leading_in = [s[0] for s in ins.values() if s and isinstance(s[0], str)]
    leading_out = []  # each output's leading dim: a number, a name, or None when unnamed
    for o in proto.graph.output:
        if o.name in ins:  # an input passed straight out (a grid a host step built) says nothing of a batch
            continue
        for d in list(_dims(o))[:1]:
            if d.HasField("dim_value") and d.dim_value >= 0:
                leading_out.append(int(d.dim_value))
            else:
                leading_out.append(d.dim_param if d.dim_param.strip() not in ("", "?", "-1") else None)
    for sym in leading_in:
        if sym in leading_out:
            return sym
    if batch_axis == "auto" and all(isinstance(d, int) for d in leading_out):
        return None
    if leading_in:
        # a symbol only inputs that may be bound at any size lead (a grid's bytes) is not the batch
        batch_like = [s[0] for k, s in ins.items() if s and isinstance(s[0], str) and not _any_rows(proto, k, operators)]
        return batch_like[0] if batch_like else leading_in[0]
    unnamed = [k for k, s in ins.items() if s and s[0] is None]
    if unnamed:
        taken = {d.dim_param for vi in list(proto.graph.input) + list(proto.graph.output) for d in _dims(vi)}
        sym = next(f"batch{k or ''}" for k in range(len(taken) + 1) if f"batch{k or ''}" not in taken)
        by_name = {vi.name: vi for vi in proto.graph.input}
        for k in unnamed:
            _dims(by_name[k])[0].dim_param = sym
        return sym
    if batch_axis == 0:
        raise ModelError(
            "batch_axis=0 needs an input whose first dimension is dynamic; inputs are "
            + ", ".join(f"'{k}' {shape_str(['?' if d is None else d for d in v])}" for k, v in ins.items())
        )
    return None


def set_symbols(proto: onnx.ModelProto, values: dict[str, int]) -> onnx.ModelProto:
    """Return a copy whose graph inputs have the named symbolic dims set to numbers, and whose
    intermediate and output shapes are left for inference to compute (stale or symbolic ones
    written by an exporter would otherwise win)."""
    m = onnx.ModelProto()
    m.CopyFrom(proto)
    del m.graph.value_info[:]  # stale once the inputs change; inference recomputes it
    for vi in m.graph.input:
        for d in _dims(vi):
            if d.HasField("dim_param") and d.dim_param in values:
                d.dim_value = values[d.dim_param]
    _forget_shapes(m.graph, outputs=True)
    return m


def _forget_shapes(g: onnx.GraphProto, outputs: bool) -> None:
    """Clear symbolic dims of a graph's outputs and its subgraphs' outputs and value_info (an
    exporter may call 4*B "B"); inference says what they are."""
    for vi in list(g.output) if outputs else []:
        for d in _dims(vi):
            if d.HasField("dim_param") or (d.HasField("dim_value") and d.dim_value < 0):
                d.Clear()
    for n in g.node:
        for a in n.attribute:
            for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                del sub.value_info[:]
                _forget_shapes(sub, outputs=True)


def set_input_shapes(proto: onnx.ModelProto, shapes: dict[str, list]) -> None:
    """Overwrite the dims of named graph inputs in place (None, '?' or a negative number keeps a
    dim as it is; a string names a symbolic dim); an input without a shape gets one."""
    by_name = {vi.name: vi for vi in proto.graph.input}
    for name, shape in shapes.items():
        if name not in by_name:
            raise ModelError(f"input_shapes names '{name}', which is not a graph input ({', '.join(by_name)})")
        tt = by_name[name].type.tensor_type
        if not tt.HasField("shape"):  # unknown rank: the given shape is the shape
            tt.shape.SetInParent()
            for _ in shape:
                tt.shape.dim.add()
        dims = _dims(by_name[name])
        if len(dims) != len(shape):
            raise ModelError(f"input_shapes['{name}'] has rank {len(shape)}, the model's input has rank {len(dims)}")
        for d, v in zip(dims, shape):
            if isinstance(v, str):
                if v.strip() not in ("", "?"):
                    d.dim_param = v
            elif v is not None and not isinstance(v, (int, np.integer)):
                raise ModelError(f"input_shapes['{name}'] = {list(shape)}: a dimension must be an int, a name or None")
            elif v is not None and v >= 0:
                d.dim_value = int(v)


def unresolved_inputs(proto: onnx.ModelProto) -> dict[str, list]:
    """Return the graph inputs that still have a non-numeric dim."""
    return {k: v for k, v in input_shapes(proto).items() if any(not isinstance(d, int) for d in v)}


class DynamicDimsError(ModelError):
    """Graph inputs with dynamic dimensions besides the batch: compile() specialises the model to
    each shape it runs with (luisaml/per_shape.py), what needs one plan (analyze) refuses.
    inputs: {input: its dims} of those inputs (ints, the batch symbol, and the other dynamic dims: a
    name, or None when unnamed); symbol: the batch symbol (None: the graph has no batch)."""

    def __init__(self, message: str, inputs: dict[str, list] | None = None, symbol: str | None = None):
        super().__init__(message)
        self.inputs = inputs or {}
        self.symbol = symbol


@dataclass
class Specialised:
    """The model at batch PROBE_A, plus what differs at PROBE_B: batch dims and batch-dependent data;
    bound: inputs whose rows are bound at run time (bound_inputs), name -> the symbol of their rows."""

    proto: onnx.ModelProto
    symbol: str | None
    shapes_b: dict[str, list[int | None]]
    values_b: dict[str, np.ndarray]
    bound: dict[str, str] | None = None


def bound_inputs(proto: onnx.ModelProto, unresolved: dict[str, list], symbol: str | None,
                 operators=None) -> dict[str, str]:
    """Return the inputs whose rows are bound at run time: a dynamic first dimension that is not the
    batch, every other dimension fixed, and every node reading it an operator that can read rows of
    any number (Operator.bound_rows: fVDB's grid bytes and voxel data). Name -> the symbol of its
    rows; an unnamed dynamic dimension is named 'rows of <input>' in proto."""
    out: dict[str, str] = {}
    for name, dims in unresolved.items():
        if not dims or isinstance(dims[0], int) or dims[0] == symbol or any(not isinstance(d, int) for d in dims[1:]):
            continue
        if not _any_rows(proto, name, operators) or name in _subgraph_inputs(proto.graph):
            continue
        vi = next(v for v in proto.graph.input if v.name == name)
        d = _dims(vi)[0]
        if not d.HasField("dim_param") or not d.dim_param or d.dim_param == symbol:
            d.Clear()
            d.dim_param = f"rows of {name}"
        out[name] = d.dim_param
    _separate_extra_rows(proto, out, operators)
    for n in proto.graph.node:  # an exporter's example size pinned in an attribute no longer holds
        if any(i in out for i in n.input):
            cls = operators(n.op_type, n.domain) if operators is not None else None
            drop = set(cls.pinned_by_example(n.op_type)) if cls is not None and cls.bound_rows else set()
            for a in [a for a in n.attribute if a.name in drop]:
                n.attribute.remove(a)
    return out


def _extra_rows(proto: onnx.ModelProto, name: str, operators) -> int:
    """Rows a bound input has beyond its fellows' count (BoundRows.extra_rows: 1 for a grid batch's
    offsets, [G+1] beside [G]), the most any node reading it says."""
    extra = 0
    for n in proto.graph.node:
        for k, i in enumerate(n.input):
            cls = operators(n.op_type, n.domain) if i == name and operators is not None else None
            if cls is not None and cls.bound_rows and cls.reads_bound_rows(n.op_type, k):
                extra = max(extra, int(cls.extra_rows(n.op_type, k)))
    return extra


def _separate_extra_rows(proto: onnx.ModelProto, bound: dict[str, str], operators) -> None:
    """Give a bound input with extra rows a symbol of its own where its symbol is shared with inputs of
    another extra (an exporter naming batch_offsets' [G+1] 'G' like grid_byte_offsets' [G]): the
    probes set each symbol to one number (bound_probe)."""
    extras = {name: _extra_rows(proto, name, operators) for name in bound}
    by_symbol: dict[str, set[int]] = {}
    for name, sym in bound.items():
        by_symbol.setdefault(sym, set()).add(extras[name])
    by_name = {vi.name: vi for vi in proto.graph.input}
    for name, sym in list(bound.items()):
        if extras[name] and len(by_symbol[sym]) > 1:
            d = _dims(by_name[name])[0]
            d.Clear()
            d.dim_param = f"{sym} + {extras[name]}"
            bound[name] = d.dim_param


def bound_probe(proto: onnx.ModelProto, bound: dict[str, str], rows: int, operators) -> dict[str, int]:
    """Return {symbol: rows} of the bound inputs' symbols for a probe at `rows` (plus each input's
    extra rows: BoundRows.extra_rows)."""
    return {sym: rows + _extra_rows(proto, name, operators) for name, sym in bound.items()}


def _readers(proto: onnx.ModelProto, name: str, operators) -> tuple[list, list]:
    """Return (the nodes reading `name` that can take any number of its rows: Operator.bound_rows,
    those that cannot)."""
    takes, refuses = [], []
    for n in proto.graph.node:
        for k, i in enumerate(n.input):
            if i == name:
                cls = operators(n.op_type, n.domain) if operators is not None else None
                (takes if cls is not None and cls.bound_rows and cls.reads_bound_rows(n.op_type, k)
                 else refuses).append(n)
    return takes, refuses


def _any_rows(proto: onnx.ModelProto, name: str, operators) -> bool:
    """Whether input `name` is read (by a node, or passed straight out as a graph output), and every
    node reading it can take any number of its rows."""
    takes, refuses = _readers(proto, name, operators)
    return (bool(takes) or any(o.name == name for o in proto.graph.output)) and not refuses


def _fixed_size_reader(proto: onnx.ModelProto, name: str, operators) -> str:
    """Return ' (...)' naming the node that keeps an input's rows from being bound at run time when
    another node reading it could take any number (a Cast beside a kernel map), else ''."""
    takes, refuses = _readers(proto, name, operators)
    if not (takes and refuses):
        return ""
    n = refuses[0]
    return (f" (read by node '{n.name or n.op_type}' ({n.domain + '::' if n.domain else ''}{n.op_type}), which needs "
            "its size when compiling)")


def _subgraph_inputs(g: onnx.GraphProto) -> set[str]:
    """Return every name the nodes of g's subgraphs (at any depth) read."""
    out: set[str] = set()
    for n in g.node:
        out |= _node_subgraph_inputs(n)
    return out


def _node_subgraph_inputs(n: onnx.NodeProto) -> set[str]:
    """Return every name the nodes of n's subgraphs (an If's branches, a Loop's body; at any depth) read."""
    out: set[str] = set()
    for a in n.attribute:
        for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
            out |= {i for m in sub.node for i in m.input} | _subgraph_inputs(sub)
    return out


def _sized_at_run(proto: onnx.ModelProto, bound: dict[str, str], operators) -> set[str]:
    """Return the outputs of nodes that size them at run time from inputs whose rows are bound then
    (BoundRows.sized_at_run: InjectToDense's box over a grid count bound at run time): their first
    dimension follows those rows, which lowering makes a size read back at run time."""
    out: set[str] = set()
    for n in proto.graph.node:
        cls = operators(n.op_type, n.domain) if operators is not None else None
        if cls is not None and cls.bound_rows:
            node = Node(n.name, n.op_type, n.domain, list(n.input), list(n.output))
            out |= {n.output[k] for k in cls.sized_at_run(node, bound) if k < len(n.output) and n.output[k]}
    return out


def _check_bound_rows(a: onnx.ModelProto, c: onnx.ModelProto, bound: dict[str, str], sized=frozenset()) -> None:
    """Raise for a tensor whose shape or folded value differs between two probes that differ only in
    the rows of the bound inputs: it depends on their size, which one compiled network cannot (but
    the first dimension of a tensor in `sized`, which is sized at run time: _sized_at_run)."""
    shapes_a, shapes_c = _all_shapes(a), _all_shapes(c)
    producers = {o: n for n in a.graph.node for o in n.output}
    values_c = {t.name: numpy_helper.to_array(t) for t in c.graph.initializer}
    inputs = ", ".join(f"'{k}' ({v})" for k, v in bound.items())
    for n in a.graph.node:  # a node reading a tensor sized at run time: lowering's refusal, said here first
        read = [i for i in n.input if i in sized]
        if read and any(shapes_a.get(o) != shapes_c.get(o) for o in n.output if o):
            raise ModelError(f"node '{n.name or n.op_type}' ({n.op_type}): input '{read[0]}' has a first dimension "
                             f"known only at run time (it follows the rows of {inputs}, which are bound then); no "
                             "node can read it yet: make it a graph output, and the nodes after it a network of "
                             "their own")
    for name, shape in shapes_a.items():
        if name in bound:
            continue
        other = shapes_c.get(name)
        if name in sized and other is not None and shape:
            other, shape = other[1:], shape[1:]
        if other is not None and other != shape:
            n = producers.get(name)
            where = f" (output of node '{n.name or n.op_type}' ({n.op_type}))" if n is not None else ""
            raise ModelError(f"tensor '{name}'{where}: its shape depends on the rows of {inputs}, which are bound "
                             "at run time; fix them with input_shapes={name: [...]}")
    for t in a.graph.initializer:
        other = values_c.get(t.name)
        if other is not None and not np.array_equal(numpy_helper.to_array(t), other):
            raise ModelError(f"constant '{t.name}' folds to a value that depends on the rows of {inputs}, which are "
                             "bound at run time; fix them with input_shapes={name: [...]}")


def _all_shapes(proto: onnx.ModelProto) -> dict[str, list[int | None]]:
    return _graph_shapes(proto.graph)


def _graph_shapes(g: onnx.GraphProto) -> dict[str, list[int | None]]:
    """Return the dims of every typed tensor of a graph and its subgraphs."""
    out = {}
    for n in g.node:
        for a in n.attribute:
            for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                out.update(_graph_shapes(sub))
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape"):
            out[vi.name] = [int(d.dim_value) if d.HasField("dim_value") else None for d in _dims(vi)]
    for t in g.initializer:
        out[t.name] = [int(d) for d in t.dims]
    return out


def specialise(proto: onnx.ModelProto, symbol: str | None, limits: Limits = DEFAULT_LIMITS,
               operators=None) -> Specialised:
    """Fold and infer the model with every dim numeric; with a batch symbol, at two batch sizes."""
    unresolved = unresolved_inputs(proto)
    bound = bound_inputs(proto, unresolved, symbol, operators)
    rows = bound_probe(proto, bound, ROWS_PROBE, operators)
    unresolved = {k: v for k, v in unresolved.items() if k not in bound}
    if symbol is None:
        if unresolved:
            raise _dynamic_dims_error(
                proto, "inputs with dynamic dimensions: "
                + ", ".join(f"'{k}' {_dims_str(v)}{_fixed_size_reader(proto, k, operators)}" for k, v in unresolved.items())
                + "; give input_shapes={name: [...]} or compile with batch_axis='auto' for a batch dimension",
                unresolved, None)
        a = _probe(proto, rows, None, bound, limits, operators)
        _check_rows_probe(proto, a, bound, {}, limits, operators)
        return Specialised(a, None, {}, {}, bound)
    others = {k: v for k, v in unresolved.items() if any(not isinstance(d, int) and d != symbol for d in v)}
    if others:
        raise _dynamic_dims_error(
            proto, f"only the batch dimension '{symbol}' may be dynamic, but "
            + ", ".join(f"'{k}' is {_dims_str(v)}{_fixed_size_reader(proto, k, operators)}" for k, v in others.items())
            + "; fix the other dimensions with input_shapes={name: [...]}",
            others, symbol)
    a = _probe(proto, {symbol: PROBE_A, **rows}, PROBE_A, bound, limits, operators)
    b = _probe(proto, {symbol: PROBE_B, **rows}, PROBE_B, bound, limits, operators)
    _check_rows_probe(proto, a, bound, {symbol: PROBE_A}, limits, operators)
    values_b = {t.name: numpy_helper.to_array(t) for t in b.graph.initializer}
    return Specialised(a, symbol, _all_shapes(b), values_b, bound)


def _dynamic_dims_error(proto: onnx.ModelProto, message: str, inputs: dict[str, list], symbol: str | None) -> ModelError:
    """Return the DynamicDimsError of inputs with dynamic dimensions besides the batch (compile then
    specialises the model per shape), or a ModelError where one of them reaches a node of another
    domain than ONNX's: such a node may hold sizes of the exported example in its attributes (fVDB's
    total_voxels), which fixing the input's shape would leave wrong."""
    reached = _custom_node_reached(proto, inputs)
    if reached is not None:
        k, n = reached
        return ModelError(f"{message} ('{k}' reaches node '{n.name or n.op_type}' ({n.domain}::{n.op_type}), whose "
                          "attributes may hold the exported example's sizes: it is not compiled per shape)")
    return DynamicDimsError(message, inputs, symbol)


def _custom_node_reached(proto: onnx.ModelProto, names) -> tuple[str, onnx.NodeProto] | None:
    """Return (input, node) of the first of `names` whose values reach a node of another domain than
    ONNX's (through any nodes, or a subgraph reading them), else None."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in proto.graph.node:
        for t in set(n.input) | _node_subgraph_inputs(n):
            readers.setdefault(t, []).append(n)
    for name in names:
        seen, frontier = {name}, [name]
        while frontier:
            for n in readers.get(frontier.pop(), []):
                if n.domain not in ("", "ai.onnx"):
                    return name, n
                for o in n.output:
                    if o and o not in seen:
                        seen.add(o)
                        frontier.append(o)
    return None


def _dims_str(dims: list) -> str:
    """An input's dims as messages write them, an unnamed dynamic one '?'."""
    return shape_str(["?" if d is None else d for d in dims])


def _check_rows_probe(proto, a, bound: dict[str, str], batch: dict[str, int], limits: Limits, operators) -> None:
    """With bound inputs, specialise once more with other rows and check nothing else changed."""
    if bound:
        other = bound_probe(proto, bound, ROWS_CHECK, operators)
        probe_c = _probe(proto, {**batch, **other}, next(iter(batch.values()), None), bound, limits, operators)
        _check_bound_rows(a, probe_c, bound, _sized_at_run(proto, bound, operators))
