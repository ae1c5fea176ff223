"""Constant folding on the protobuf: nodes whose inputs are all known are evaluated on the host
with onnx's reference implementation and replaced by initializers (this is how the
Shape -> Gather -> Concat -> Reshape chains of torch exports disappear).

Before a node is evaluated, the size of what it would produce is predicted (from its inferred
output shape, or for the ops whose size depends on their constant inputs, ConstantOfShape, Range,
Expand, Tile, Pad, Resize, OneHot, from those inputs): a tensor a kernel cannot index, or more
than Limits.fold_bytes computed on the host, is a LimitError naming the node, not a MemoryError."""
from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import LimitError
from ..limits import DEFAULT, Limits

# Never folded: results that must differ per run, and ops whose output the kernel reads as data.
NOT_FOLDED = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"}
MAX_FOLDED_ELEMENTS = 1 << 24


def _static_shape(vi: onnx.ValueInfoProto | None) -> list[int] | None:
    if vi is None or not vi.type.HasField("tensor_type") or not vi.type.tensor_type.HasField("shape"):
        return None
    dims = vi.type.tensor_type.shape.dim
    if not all(d.HasField("dim_value") for d in dims):
        return None
    return [int(d.dim_value) for d in dims]


def _evaluate(node: onnx.NodeProto, inputs: list[np.ndarray | None], opsets) -> list[np.ndarray] | None:
    """Return the outputs of one node run by onnx's reference evaluator, or None if it fails."""
    from onnx.reference import ReferenceEvaluator

    names = [f"in{i}" if n else "" for i, n in enumerate(node.input)]
    feeds = {names[i]: a for i, a in enumerate(inputs) if names[i]}
    n2 = onnx.NodeProto()
    n2.CopyFrom(node)
    del n2.input[:]
    n2.input.extend(names)
    del n2.output[:]
    n2.output.extend(f"out{i}" if o else "" for i, o in enumerate(node.output))
    graph = helper.make_graph(
        [n2],
        "fold",
        [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape) for k, v in feeds.items()],
        [helper.make_tensor_value_info(o, 0, None) for o in n2.output if o],
    )
    m = helper.make_model(graph, opset_imports=list(opsets))
    try:
        outs = ReferenceEvaluator(m).run(None, feeds)
    except MemoryError:
        raise LimitError(f"{_describe(node)}: evaluating it on the host to fold it ran out of memory") from None
    except Exception:  # an op the reference cannot run is simply left to the kernel
        return None
    return [np.asarray(o) for o in outs]


def fold_constants(proto: onnx.ModelProto, *, limits: Limits = DEFAULT, operators=None) -> int:
    """Fold every foldable node of the main graph in place; return how many were folded. operators:
    the model's Binding (luisaml.registry; op_type, domain -> operator class), whose `evaluate` folds
    a custom-domain node; None: such nodes stay."""
    return _fold_graph(proto.graph, {}, proto.opset_import, limits, operators)


def _subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    return [g for a in node.attribute for g in ([a.g] if a.HasField("g") else []) + list(a.graphs)]


def _fold_graph(g: onnx.GraphProto, outer: dict[str, np.ndarray], opsets, limits: Limits, operators) -> int:
    known: dict[str, np.ndarray] = dict(outer)
    known.update({t.name: numpy_helper.to_array(t) for t in g.initializer})
    types = {vi.name: vi for vi in list(g.value_info) + list(g.input) + list(g.output)}
    graph_outputs = {o.name for o in g.output}
    keep: list[onnx.NodeProto] = []
    folded = 0
    for node in g.node:
        result = _fold_one(node, known, types, opsets, limits, operators)
        if result is None:
            keep.append(node)
            continue
        outs = result
        # the size cap keeps standard ops from inflating the model; a custom domain's evaluate
        # (an fvdb grid built on the host, say) is the only way to run its node
        custom = node.domain not in ("", "ai.onnx")
        if any(o is None for o in outs) or (not custom and sum(o.size for o in outs) > MAX_FOLDED_ELEMENTS):
            keep.append(node)
            continue
        folded += 1
        for name, arr in zip(node.output, outs):
            if not name:
                continue
            known[name] = arr
            if name in graph_outputs:
                # a graph output must stay produced by a node: keep a Constant for it
                keep.append(helper.make_node("Constant", [], [name], value=numpy_helper.from_array(arr, name)))
            else:
                g.initializer.append(numpy_helper.from_array(arr, name))
    del g.node[:]
    g.node.extend(keep)
    return folded


def _evaluate_custom(node: onnx.NodeProto, inputs: list[np.ndarray | None], operators) -> list[np.ndarray] | None:
    """Return the outputs of a custom-domain node by its operator's `evaluate`, or None."""
    from ..model import Node, _attr_value

    cls = operators(node.op_type, node.domain) if operators is not None else None
    if cls is None:
        return None
    n = Node(node.name, node.op_type, node.domain, list(node.input), list(node.output),
             {a.name: _attr_value(a, None, node.name) for a in node.attribute})
    outs = cls.evaluate(n, inputs)
    return None if outs is None else [np.asarray(o) for o in outs]


def _fold_one(node: onnx.NodeProto, known: dict[str, np.ndarray], types, opsets,
              limits: Limits = DEFAULT, operators=None) -> list[np.ndarray] | None:
    if node.domain not in ("", "ai.onnx"):
        inputs = [known.get(i) if i else None for i in node.input]
        if not node.input or any(i and known.get(i) is None for i in node.input):
            return None
        _check_fold_size(node, inputs, types, limits, custom=True)
        return _evaluate_custom(node, inputs, operators)
    if node.op_type in NOT_FOLDED:
        return None
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
        return None
    if node.op_type == "Constant":
        return None  # kept as is: it is already a literal
    if node.op_type in ("Shape", "Size"):  # from static dims, or a constant's own
        x = node.input[0]
        shape = list(np.shape(known[x])) if x in known else _static_shape(types.get(x))
    if node.op_type == "Shape":
        if shape is None:
            return None
        start = next((a.i for a in node.attribute if a.name == "start"), 0)
        end = next((a.i for a in node.attribute if a.name == "end"), None)
        return [np.array(shape[start:end] if end is not None else shape[start:], dtype=np.int64)]
    if node.op_type == "Size":
        return None if shape is None else [np.array(math.prod(shape), dtype=np.int64)]
    inputs = [known.get(i) if i else None for i in node.input]
    if any(i and known.get(i) is None for i in node.input):
        return None
    if not node.input:
        return None  # generators with no inputs (ConstantOfShape has one) stay
    if not _check_fold_size(node, inputs, types, limits, custom=False):
        return None
    return _evaluate(node, inputs, opsets)


def _describe(node: onnx.NodeProto) -> str:
    op = f"{node.domain}::{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type
    return f"node '{node.name or node.op_type}' ({op})"


def _check_fold_size(node: onnx.NodeProto, inputs: list[np.ndarray | None], types, limits: Limits,
                     custom: bool) -> bool:
    """Return whether a node whose inputs are known may be evaluated on the host: False for a
    standard op whose result would be too large to fold anyway (the kernel computes it, as it
    would after evaluating); raise LimitError naming the node for a result no kernel can index,
    or one larger than Limits.fold_bytes."""
    sizes = predicted_sizes(node, inputs, types)
    for name, count, itemsize in sizes:
        if count is not None:
            limits.check_elements(f"{_describe(node)} output '{name}'", count, itemsize)
    known = [(c, i) for _, c, i in sizes if c is not None]
    if not custom and sum(c for c, _ in known) > MAX_FOLDED_ELEMENTS:
        return False
    nbytes = sum(c * i for c, i in known)
    if nbytes > limits.fold_bytes:
        limits.check_bytes(f"{_describe(node)}, evaluated on the host to fold it,", nbytes, "fold_bytes")
    return True


def predicted_sizes(node: onnx.NodeProto, inputs: list[np.ndarray | None], types) -> list[tuple[str, int | None, int]]:
    """Return (output name, element count or None when unknown, itemsize) for each output of a
    node whose inputs are the given constants: from the inferred shape, else from the inputs of
    the ops whose output size depends on their values."""
    out = []
    for k, name in enumerate(node.output):
        if not name:
            continue
        vi = types.get(name)
        shape = _static_shape(vi)
        elem = vi.type.tensor_type.elem_type if vi is not None and vi.type.HasField("tensor_type") else 0
        count = math.prod(shape) if shape is not None else (_value_dependent_count(node, inputs) if k == 0 else None)
        out.append((name, count, _itemsize(elem, node, inputs)))
    return out


def _itemsize(elem: int, node: onnx.NodeProto, inputs) -> int:
    if not elem and node.op_type == "ConstantOfShape":
        value = next((a.t for a in node.attribute if a.name == "value"), None)
        elem = value.data_type if value is not None else onnx.TensorProto.FLOAT
    if elem:
        try:
            return helper.tensor_dtype_to_np_dtype(elem).itemsize
        except (KeyError, TypeError, ValueError):
            pass
    first = next((x for x in inputs if x is not None), None)
    return first.dtype.itemsize if first is not None else 8


def _ints(x: np.ndarray | None) -> list[int] | None:
    if x is None or x.dtype.kind not in "iu":
        return None
    return [int(v) for v in np.asarray(x).reshape(-1)]


def _value_dependent_count(node: onnx.NodeProto, inputs: list[np.ndarray | None]) -> int | None:
    """Return the element count of output 0 of an op whose output size depends on its constant
    inputs (what shape inference may leave unknown), or None when it cannot be told."""
    op = node.op_type
    x = inputs[0] if inputs else None
    get = lambda i: inputs[i] if len(inputs) > i else None  # noqa: E731
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if op == "ConstantOfShape":
        dims = _ints(x)
        return None if dims is None else math.prod(max(d, 0) for d in dims)
    if op == "Range":
        try:
            start, limit, delta = (float(np.asarray(v).reshape(-1)[0]) for v in inputs[:3])
        except (TypeError, ValueError, IndexError):
            return None
        if delta == 0 or not all(map(math.isfinite, (start, limit, delta))):
            return None
        return max(math.ceil((limit - start) / delta), 0)
    if x is None:
        return None
    shape = list(np.shape(x))
    if op == "Expand":
        dims = _ints(get(1))
        if dims is None:
            return None
        rank = max(len(shape), len(dims))
        a, b = [1] * (rank - len(shape)) + shape, [1] * (rank - len(dims)) + dims
        return math.prod(max(p, q, 0) for p, q in zip(a, b))
    if op == "Tile":
        reps = _ints(get(1))
        return None if reps is None or len(reps) != len(shape) else math.prod(max(d * r, 0) for d, r in zip(shape, reps))
    if op == "Pad":
        pads = _ints(get(1)) if len(inputs) > 1 else attrs.get("pads")
        axes = _ints(get(3)) or list(range(len(shape)))
        if pads is None or len(pads) != 2 * len(axes):
            return None
        out = list(shape)
        for j, ax in enumerate(axes):
            if -len(shape) <= ax < len(shape):
                out[ax] += pads[j] + pads[j + len(axes)]
        return math.prod(max(d, 0) for d in out)
    if op in ("Resize", "Upsample"):
        sizes = _ints(get(3))
        if sizes is not None and sizes:
            return math.prod(max(d, 0) for d in sizes)
        scales = get(2) if op == "Resize" and len(inputs) > 2 else get(1)
        scales = attrs.get("scales", scales) if scales is None else scales
        if scales is None or np.size(scales) != len(shape):
            return None
        return math.prod(int(math.floor(d * float(s))) if math.isfinite(float(s)) else 0
                         for d, s in zip(shape, np.asarray(scales, np.float64).reshape(-1)))
    if op == "OneHot":
        depth = _ints(get(1))
        return None if not depth else int(np.size(x)) * max(depth[0], 0)
    return None


def inline_constant_ifs(proto: onnx.ModelProto) -> int:
    """Replace every If of the main graph whose condition is a known constant by the branch it
    takes (branch-local names get a prefix; Identity nodes give the branch's outputs the If's
    names); return how many. An exporter's shape checks become plain graph code, and what the
    branch computes from constants folds further."""
    from .functions import rename_node

    g = proto.graph
    known = {t.name: t for t in g.initializer}
    nodes, count = [], 0
    for n in g.node:
        if n.op_type != "If" or n.domain not in ("", "ai.onnx") or not n.input or n.input[0] not in known:
            nodes.append(n)
            continue
        cond = bool(numpy_helper.to_array(known[n.input[0]]).reshape(-1)[0])
        name = "then_branch" if cond else "else_branch"
        branch = next(a.g for a in n.attribute if a.name == name)
        prefix = f"{n.name or 'If'}__{name}{count}__"
        own = {t.name for t in branch.initializer} | {o for bn in branch.node for o in bn.output}

        def rename(x: str, own=own, prefix=prefix) -> str:
            return prefix + x if x in own else x

        for t in branch.initializer:
            t2 = onnx.TensorProto()
            t2.CopyFrom(t)
            t2.name = rename(t.name)
            g.initializer.append(t2)
        nodes.extend(rename_node(bn, rename, {}, prefix) for bn in branch.node)
        for k, (o, y) in enumerate(zip(branch.output, n.output)):
            if y:
                nodes.append(helper.make_node("Identity", [rename(o.name)], [y], name=f"{prefix}out{k}"))
        count += 1
    if count:
        del g.node[:]
        g.node.extend(nodes)
    return count


def fold_to_fixpoint(proto: onnx.ModelProto, infer, *, limits: Limits = DEFAULT, operators=None) -> onnx.ModelProto:
    """Alternate shape inference and folding (constant Ifs inlined) until nothing more folds;
    then each subgraph is specialised the same way as a model of its own; return the model.
    operators: as fold_constants takes it."""
    for _ in range(64):
        guard_generators(proto.graph, limits)
        proto = infer(proto)
        check_static_sizes(proto.graph, limits)
        _inline_constants(proto)
        if fold_constants(proto, limits=limits, operators=operators) + inline_constant_ifs(proto) == 0:
            break
        _drop_unknown_dims(proto.graph)
    if any(_subgraphs(n) for n in proto.graph.node):
        specialise_subgraphs(proto, infer, limits=limits, operators=operators)
        proto = infer(proto)  # the parents' outputs take the subgraphs' inferred types
    return proto


# onnx's shape inference (data_prop=True) materialises the values of an integer tensor that a
# generator makes from constants, as shape data of about this many bytes per element
DATA_PROP_BYTES = 160
_GENERATORS = ("Range", "ConstantOfShape", "Expand", "Tile", "Pad")


def guard_generators(g: onnx.GraphProto, limits: Limits = DEFAULT, outer: dict | None = None) -> None:
    """Raise LimitError naming the node for a generator of constants (Range, ConstantOfShape,
    Expand, Tile, Pad; subgraphs included) whose output no kernel could index, or whose integer
    values onnx's shape inference would materialise beyond Limits.fold_bytes: that happens before
    folding, inside onnx, where no other check can stop it."""
    known = dict(outer or {})
    known.update({t.name: t for t in g.initializer})
    for n in g.node:
        if n.op_type == "Constant" and n.domain in ("", "ai.onnx") and n.output:
            known[n.output[0]] = n
    for n in g.node:
        for sub in _subgraphs(n):
            guard_generators(sub, limits, known)
        if n.op_type not in _GENERATORS or n.domain not in ("", "ai.onnx"):
            continue
        if not n.input or any(i and i not in known for i in n.input):
            continue
        if any(math.prod(known[i].dims) > 64 for i in n.input[1:] if i and isinstance(known[i], onnx.TensorProto)):
            continue  # a shape, repeat or pad list is short; a big operand is real data
        inputs = [_known_array(known[i]) if i else None for i in n.input]
        count = _value_dependent_count(n, inputs)
        if count is None:
            continue
        itemsize = _itemsize(0, n, inputs)
        limits.check_elements(f"{_describe(n)} output '{n.output[0]}'", count, itemsize)
        value = inputs[0] if n.op_type != "ConstantOfShape" else None
        is_int = (value.dtype.kind in "iub") if value is not None else _constant_of_shape_is_int(n)
        if is_int and count * DATA_PROP_BYTES > limits.fold_bytes:
            limits.check_bytes(
                f"{_describe(n)} makes a constant of {count:,} integers; onnx's shape inference materialises such "
                f"values (about {DATA_PROP_BYTES} bytes each) and", count * DATA_PROP_BYTES, "fold_bytes")


def _known_array(v) -> np.ndarray | None:
    """Return the value of an initializer or a Constant node (None when it cannot be read)."""
    try:
        return numpy_helper.to_array(v) if isinstance(v, onnx.TensorProto) else _constant_value(v)
    except Exception:  # a malformed constant is reported by the loader's own checks
        return None


def _constant_of_shape_is_int(n: onnx.NodeProto) -> bool:
    value = next((a.t for a in n.attribute if a.name == "value"), None)
    return value is not None and value.data_type not in (
        onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16)


def check_static_sizes(g: onnx.GraphProto, limits: Limits = DEFAULT) -> None:
    """Raise LimitError naming the tensor and its producer for a tensor whose inferred static
    shape holds more elements than a kernel can index (or more than Limits.tensor_bytes)."""
    producer = {o: n for n in g.node for o in n.output if o}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        shape = _static_shape(vi)
        if shape is None:
            continue
        n = producer.get(vi.name)
        what = f"tensor '{vi.name}' {shape}" + (f" (output of {_describe(n)})" if n is not None else "")
        limits.check_elements(what, math.prod(shape), _itemsize(vi.type.tensor_type.elem_type, n or onnx.NodeProto(), []))


def _drop_unknown_dims(g: onnx.GraphProto) -> None:
    """Forget the value_info of tensors with an unknown dim: onnx's inference keeps a stale
    symbolic dim rather than the number it can infer once its inputs are folded."""
    keep = [vi for vi in g.value_info if _static_shape(vi) is not None]
    del g.value_info[:]
    g.value_info.extend(keep)


def _typed(g: onnx.GraphProto) -> dict[str, onnx.ValueInfoProto]:
    return {vi.name: vi for vi in list(g.input) + list(g.value_info) + list(g.output)}


def specialise_subgraphs(proto: onnx.ModelProto, infer, graph: onnx.GraphProto | None = None,
                         outer_types: dict | None = None, outer_consts: dict | None = None, *,
                         limits: Limits = DEFAULT, operators=None) -> None:
    """Infer and fold every subgraph as a standalone model whose inputs are its formal inputs plus
    the outer tensors it reads (outer constants become its initializers); write the result back.
    onnx's own inference does not see values across scopes (a Squeeze whose axes live outside
    would stay untyped), and folding would stop at the subgraph's border."""
    g = graph if graph is not None else proto.graph
    types = dict(outer_types or {})
    types.update(_typed(g))
    consts = dict(outer_consts or {})
    consts.update({t.name: t for t in g.initializer})
    for node in g.node:
        for sub in _subgraphs(node):
            _specialise_one(proto, sub, types, consts, infer, limits, operators)


def _specialise_one(proto, sub: onnx.GraphProto, types: dict, consts: dict, infer, limits: Limits = DEFAULT,
                    operators=None) -> None:
    local = {i.name for i in sub.input} | {t.name for t in sub.initializer} | {o for n in sub.node for o in n.output}
    reads = sorted({i for n in sub.node for i in n.input if i and i not in local} |
                   {o.name for o in sub.output if o.name not in local} | _nested_reads(sub, local))
    borrowed = [consts[r] for r in reads if r in consts]
    outer_inputs = [types[r] for r in reads if r not in consts and r in types]
    outputs = []
    for o in sub.output:
        vi = onnx.ValueInfoProto()
        vi.CopyFrom(o)
        vi.type.tensor_type.ClearField("shape")
        outputs.append(vi)
    standalone = helper.make_graph(list(sub.node), sub.name or "subgraph", list(sub.input) + outer_inputs, outputs,
                                   list(sub.initializer) + borrowed)
    model = helper.make_model(standalone, opset_imports=list(proto.opset_import), ir_version=proto.ir_version)
    try:
        done = fold_to_fixpoint(model, infer, limits=limits, operators=operators).graph
    except LimitError:
        raise
    except Exception:  # a subgraph that cannot be specialised keeps what onnx inferred in place
        return
    borrowed_names = {t.name for t in borrowed}
    del sub.node[:]
    sub.node.extend(done.node)
    inits = [t for t in done.initializer if t.name not in borrowed_names]
    del sub.initializer[:]
    sub.initializer.extend(inits)
    outer_names = {vi.name for vi in outer_inputs}
    del sub.value_info[:]
    sub.value_info.extend(vi for vi in done.value_info if vi.name not in outer_names)
    by_name = {o.name: o for o in done.output}
    for o in sub.output:
        if o.name in by_name:
            o.type.CopyFrom(by_name[o.name].type)


def _nested_reads(g: onnx.GraphProto, local: set[str]) -> set[str]:
    """Names that the subgraphs of g's nodes read from outside g."""
    out: set[str] = set()
    for n in g.node:
        for sub in _subgraphs(n):
            inner = local | {i.name for i in sub.input} | {t.name for t in sub.initializer} | {
                o for m in sub.node for o in m.output}
            out |= {i for m in sub.node for i in m.input if i and i not in inner} | _nested_reads(sub, inner)
    return out


def _inline_constants(proto: onnx.ModelProto) -> None:
    """Turn Constant nodes that are not graph outputs into initializers (subgraphs included)."""
    _inline_graph_constants(proto.graph)


def _inline_graph_constants(g: onnx.GraphProto) -> None:
    outs = {o.name for o in g.output}
    keep = []
    for n in g.node:
        for sub in _subgraphs(n):
            _inline_graph_constants(sub)
        if n.op_type == "Constant" and n.domain in ("", "ai.onnx") and n.output[0] not in outs:
            arr = _constant_value(n)
            if arr is not None:
                g.initializer.append(numpy_helper.from_array(arr, n.output[0]))
                continue
        keep.append(n)
    del g.node[:]
    g.node.extend(keep)


def _constant_value(n: onnx.NodeProto) -> np.ndarray | None:
    for a in n.attribute:
        if a.name == "value":
            return numpy_helper.to_array(a.t)
        if a.name == "value_float":
            return np.array(a.f, dtype=np.float32)
        if a.name == "value_floats":
            return np.array(list(a.floats), dtype=np.float32)
        if a.name == "value_int":
            return np.array(a.i, dtype=np.int64)
        if a.name == "value_ints":
            return np.array(list(a.ints), dtype=np.int64)
    return None
