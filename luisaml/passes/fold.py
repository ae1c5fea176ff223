"""Constant folding on the protobuf: nodes whose inputs are all known are evaluated on the host
with onnx's reference implementation and replaced by initializers (this is how the
Shape -> Gather -> Concat -> Reshape chains of torch exports disappear)."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

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
    except Exception:  # an op the reference cannot run is simply left to the kernel
        return None
    return [np.asarray(o) for o in outs]


def fold_constants(proto: onnx.ModelProto) -> int:
    """Fold every foldable node of the main graph in place; return how many were folded."""
    return _fold_graph(proto.graph, {}, proto.opset_import)


def _subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    return [g for a in node.attribute for g in ([a.g] if a.HasField("g") else []) + list(a.graphs)]


def _fold_graph(g: onnx.GraphProto, outer: dict[str, np.ndarray], opsets) -> int:
    known: dict[str, np.ndarray] = dict(outer)
    known.update({t.name: numpy_helper.to_array(t) for t in g.initializer})
    types = {vi.name: vi for vi in list(g.value_info) + list(g.input) + list(g.output)}
    graph_outputs = {o.name for o in g.output}
    keep: list[onnx.NodeProto] = []
    folded = 0
    for node in g.node:
        result = _fold_one(node, known, types, opsets)
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


def _evaluate_custom(node: onnx.NodeProto, inputs: list[np.ndarray | None], opsets) -> list[np.ndarray] | None:
    """Return the outputs of a custom-domain node by its operator's `evaluate`, or None."""
    from .. import registry
    from ..model import Node, _attr_value

    registry._load_builtin()
    version = next((o.version for o in opsets if o.domain == node.domain), 0)
    cls = registry.resolve(node.op_type, node.domain, version)
    if cls is None:
        return None
    n = Node(node.name, node.op_type, node.domain, list(node.input), list(node.output),
             {a.name: _attr_value(a, None, node.name) for a in node.attribute})
    outs = cls.evaluate(n, inputs)
    return None if outs is None else [np.asarray(o) for o in outs]


def _fold_one(node: onnx.NodeProto, known: dict[str, np.ndarray], types, opsets) -> list[np.ndarray] | None:
    if node.domain not in ("", "ai.onnx"):
        inputs = [known.get(i) if i else None for i in node.input]
        if not node.input or any(i and known.get(i) is None for i in node.input):
            return None
        return _evaluate_custom(node, inputs, opsets)
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
        return None if shape is None else [np.array(int(np.prod(shape)), dtype=np.int64)]
    inputs = [known.get(i) if i else None for i in node.input]
    if any(i and known.get(i) is None for i in node.input):
        return None
    if not node.input:
        return None  # generators with no inputs (ConstantOfShape has one) stay
    return _evaluate(node, inputs, opsets)


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


def fold_to_fixpoint(proto: onnx.ModelProto, infer) -> onnx.ModelProto:
    """Alternate shape inference and folding (constant Ifs inlined) until nothing more folds;
    then each subgraph is specialised the same way as a model of its own; return the model."""
    for _ in range(64):
        proto = infer(proto)
        _inline_constants(proto)
        if fold_constants(proto) + inline_constant_ifs(proto) == 0:
            break
        _drop_unknown_dims(proto.graph)
    if any(_subgraphs(n) for n in proto.graph.node):
        specialise_subgraphs(proto, infer)
        proto = infer(proto)  # the parents' outputs take the subgraphs' inferred types
    return proto


def _drop_unknown_dims(g: onnx.GraphProto) -> None:
    """Forget the value_info of tensors with an unknown dim: onnx's inference keeps a stale
    symbolic dim rather than the number it can infer once its inputs are folded."""
    keep = [vi for vi in g.value_info if _static_shape(vi) is not None]
    del g.value_info[:]
    g.value_info.extend(keep)


def _typed(g: onnx.GraphProto) -> dict[str, onnx.ValueInfoProto]:
    return {vi.name: vi for vi in list(g.input) + list(g.value_info) + list(g.output)}


def specialise_subgraphs(proto: onnx.ModelProto, infer, graph: onnx.GraphProto | None = None,
                         outer_types: dict | None = None, outer_consts: dict | None = None) -> None:
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
            _specialise_one(proto, sub, types, consts, infer)


def _specialise_one(proto, sub: onnx.GraphProto, types: dict, consts: dict, infer) -> None:
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
        done = fold_to_fixpoint(model, infer).graph
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
