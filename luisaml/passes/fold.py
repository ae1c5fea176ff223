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
    g = proto.graph
    known: dict[str, np.ndarray] = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    types = {vi.name: vi for vi in list(g.value_info) + list(g.input) + list(g.output)}
    graph_outputs = {o.name for o in g.output}
    keep: list[onnx.NodeProto] = []
    folded = 0
    for node in g.node:
        result = _fold_one(node, known, types, proto.opset_import)
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
    if node.op_type == "Shape":
        shape = _static_shape(types.get(node.input[0]))
        if shape is None:
            return None
        start = next((a.i for a in node.attribute if a.name == "start"), 0)
        end = next((a.i for a in node.attribute if a.name == "end"), None)
        return [np.array(shape[start:end] if end is not None else shape[start:], dtype=np.int64)]
    if node.op_type == "Size":
        shape = _static_shape(types.get(node.input[0]))
        return None if shape is None else [np.array(int(np.prod(shape)), dtype=np.int64)]
    inputs = [known.get(i) if i else None for i in node.input]
    if any(i and known.get(i) is None for i in node.input):
        return None
    if not node.input:
        return None  # generators with no inputs (ConstantOfShape has one) stay
    return _evaluate(node, inputs, opsets)


def fold_to_fixpoint(proto: onnx.ModelProto, infer) -> onnx.ModelProto:
    """Alternate shape inference and folding until nothing more folds; return the model."""
    for _ in range(64):
        proto = infer(proto)
        _inline_constants(proto)
        if fold_constants(proto) == 0:
            break
    return proto


def _inline_constants(proto: onnx.ModelProto) -> None:
    """Turn Constant nodes that are not graph outputs into initializers."""
    g = proto.graph
    outs = {o.name for o in g.output}
    keep = []
    for n in g.node:
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
