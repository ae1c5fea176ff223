"""Small model builders and the outside references the families share (onnxruntime, numpy).

Kept apart from tests/util.py on purpose: worker processes import this package as
`tests.robustness`, pytest imports it as `robustness`, and only relative imports work in both.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

NP_TO_ONNX = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float16): TensorProto.FLOAT16,
    np.dtype(np.float64): TensorProto.DOUBLE,
    np.dtype(np.int32): TensorProto.INT32,
    np.dtype(np.int64): TensorProto.INT64,
    np.dtype(np.bool_): TensorProto.BOOL,
    np.dtype(np.uint8): TensorProto.UINT8,
}
F = TensorProto.FLOAT
I64 = TensorProto.INT64
BOOL = TensorProto.BOOL


def vi(name: str, elem: int, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def make_model(nodes, inputs: Iterable[onnx.ValueInfoProto], outputs: Iterable[str | onnx.ValueInfoProto],
               initializers: Mapping[str, np.ndarray] | None = None, opset: int = 18, name: str = "robust",
               infer: bool = True) -> onnx.ModelProto:
    """Return a model; outputs given by name are typed by onnx shape inference (untyped when
    inference cannot type them, or with infer=False)."""
    inits = [numpy_helper.from_array(np.asarray(v), k) for k, v in (initializers or {}).items()]
    outs = [o if isinstance(o, onnx.ValueInfoProto) else helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None)
            for o in outputs]
    graph = helper.make_graph(list(nodes), name, list(inputs), outs, inits)
    opsets = [helper.make_opsetid("", opset)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=helper.find_min_ir_version_for(opsets))
    if infer:
        try:
            inferred = onnx.shape_inference.infer_shapes(model)
        except Exception:  # noqa: BLE001 - malformed on purpose: leave the outputs untyped
            return model
        typed = {o.name: o for o in inferred.graph.output}
        for k, o in enumerate(model.graph.output):
            t = typed.get(o.name)
            if t is not None and t.type.tensor_type.elem_type:
                model.graph.output[k].CopyFrom(t)
    return model


def save(model: onnx.ModelProto, path: str | os.PathLike) -> str:
    """Write the model's bytes (no checks: malformed models are the point) and return the path."""
    Path(path).write_bytes(model.SerializeToString())
    return os.fspath(path)


class ReferenceRejected(Exception):
    """onnxruntime would not load or run the model; the message says why."""


def ort_outputs(model: onnx.ModelProto | bytes, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Return onnxruntime's outputs by name (CPU provider), or raise ReferenceRejected."""
    import onnxruntime as ort

    raw = model if isinstance(model, bytes) else model.SerializeToString()
    opts = ort.SessionOptions()
    opts.log_severity_level = 4
    opts.intra_op_num_threads = 1
    try:
        sess = ort.InferenceSession(raw, opts, providers=["CPUExecutionProvider"])
        names = [o.name for o in sess.get_outputs()]
        return dict(zip(names, sess.run(names, dict(feeds))))
    except Exception as e:  # noqa: BLE001 - any refusal is "no reference"
        raise ReferenceRejected(f"{type(e).__name__}: {str(e)[:300]}") from None


def random_feed(elem: int, shape, rng: np.random.Generator) -> np.ndarray:
    """Return random data of an ONNX element type and a concrete shape."""
    dt = helper.tensor_dtype_to_np_dtype(elem)
    if dt == np.bool_:
        return np.asarray(rng.random(shape) > 0.5)
    if dt.kind in "iu":
        return np.asarray(rng.integers(0, 4, size=shape)).astype(dt)
    return np.asarray(rng.uniform(-2, 2, size=shape)).astype(dt)


def feeds_for(model: onnx.ModelProto, batch: int = 3, seed: int = 0) -> dict[str, np.ndarray]:
    """Return random feeds for the graph inputs that no initializer provides (symbolic dims: batch)."""
    rng = np.random.default_rng(seed)
    inits = {t.name for t in model.graph.initializer}
    feeds = {}
    for i in model.graph.input:
        if i.name in inits:
            continue
        tt = i.type.tensor_type
        # a symbolic dimension is the batch; a nonsense one (negative, huge) is fed as 1
        shape = [batch if not d.HasField("dim_value") else d.dim_value if 0 <= d.dim_value <= 64 else 1
                 for d in tt.shape.dim]
        feeds[i.name] = random_feed(tt.elem_type, shape, rng)
    return feeds


# ---- base models ---------------------------------------------------------------------------------

W1 = np.random.default_rng(1).uniform(-1, 1, (4, 8)).astype(np.float32)
B1 = np.random.default_rng(2).uniform(-1, 1, (8,)).astype(np.float32)
W2 = np.random.default_rng(3).uniform(-1, 1, (8, 3)).astype(np.float32)
B2 = np.random.default_rng(4).uniform(-1, 1, (3,)).astype(np.float32)
MLP_WEIGHTS = {"W1": W1, "B1": B1, "W2": W2, "B2": B2}


def mlp(name: str = "mlp", opset: int = 18, weights: Mapping[str, np.ndarray] | None = None) -> onnx.ModelProto:
    """x[N,4] -> MatMul W1 -> Add B1 -> Relu -> MatMul W2 -> Add B2 -> y[N,3]."""
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h0"], name="mm1"),
        helper.make_node("Add", ["h0", "B1"], ["h1"], name="add1"),
        helper.make_node("Relu", ["h1"], ["h2"], name="relu"),
        helper.make_node("MatMul", ["h2", "W2"], ["h3"], name="mm2"),
        helper.make_node("Add", ["h3", "B2"], ["y"], name="add2"),
    ]
    return make_model(nodes, [vi("x", F, ["N", 4])], ["y"], dict(weights or MLP_WEIGHTS), opset=opset, name=name)


def mlp_reference(x: np.ndarray, w: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    w = w or MLP_WEIGHTS
    h = np.maximum(x @ w["W1"] + w["B1"], 0)
    return {"y": (h @ w["W2"] + w["B2"]).astype(np.float32)}


def if_model(name: str = "if_model") -> onnx.ModelProto:
    """x[N,4], c (bool) -> MatMul -> If(c: +1 else -1) -> y[N,4] (a run-time branch)."""
    one = np.array(1.0, np.float32)
    then_g = helper.make_graph([helper.make_node("Add", ["t", "one"], ["ty"], name="then_add")], "then_g", [],
                               [vi("ty", F, None)])
    else_g = helper.make_graph([helper.make_node("Sub", ["t", "one"], ["ey"], name="else_sub")], "else_g", [],
                               [vi("ey", F, None)])
    nodes = [helper.make_node("MatMul", ["x", "W"], ["t"], name="mm"),
             helper.make_node("If", ["c"], ["y"], name="branch", then_branch=then_g, else_branch=else_g)]
    w = np.random.default_rng(5).uniform(-1, 1, (4, 4)).astype(np.float32)
    return make_model(nodes, [vi("x", F, ["N", 4]), vi("c", BOOL, [])], [vi("y", F, ["N", 4])],
                      {"W": w, "one": one}, name=name)


def conv_model(name: str = "conv_model") -> onnx.ModelProto:
    """x[N,2,6,6] -> Conv 3x3 -> Relu -> MaxPool 2 -> GlobalAveragePool -> Flatten -> y[N,3]."""
    rng = np.random.default_rng(6)
    nodes = [
        helper.make_node("Conv", ["x", "CW", "CB"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("MaxPool", ["r"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("GlobalAveragePool", ["p"], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["y"], name="flat"),
    ]
    inits = {"CW": rng.uniform(-1, 1, (3, 2, 3, 3)).astype(np.float32), "CB": rng.uniform(-1, 1, 3).astype(np.float32)}
    return make_model(nodes, [vi("x", F, ["N", 2, 6, 6])], ["y"], inits, name=name)


def shape_model(name: str = "shape_model") -> onnx.ModelProto:
    """x[N,2,3] -> Transpose -> Reshape -> Concat with itself -> Slice -> Softmax -> ReduceSum -> y."""
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], name="tr", perm=[0, 2, 1]),
        helper.make_node("Reshape", ["t", "shape"], ["r"], name="rs"),
        helper.make_node("Concat", ["r", "r"], ["c"], name="cat", axis=1),
        helper.make_node("Slice", ["c", "starts", "ends", "axes"], ["s"], name="sl"),
        helper.make_node("Softmax", ["s"], ["sm"], name="softmax", axis=-1),
        helper.make_node("ReduceSum", ["sm", "raxes"], ["y"], name="rsum", keepdims=0),
    ]
    inits = {"shape": np.array([0, 6], np.int64), "starts": np.array([1], np.int64), "ends": np.array([10], np.int64),
             "axes": np.array([1], np.int64), "raxes": np.array([1], np.int64)}
    return make_model(nodes, [vi("x", F, ["N", 2, 3])], ["y"], inits, name=name)


BASES = {"mlp": mlp, "if": if_model, "conv": conv_model, "shape": shape_model}


def names_in(model: onnx.ModelProto) -> set[str]:
    """Return every node, tensor and graph name of a model (subgraphs included)."""
    out: set[str] = set()

    def walk(g: onnx.GraphProto) -> None:
        out.add(g.name)
        out.update(v.name for v in list(g.input) + list(g.output) + list(g.value_info))
        out.update(t.name for t in g.initializer)
        for n in g.node:
            out.add(n.name)
            out.update(n.input)
            out.update(n.output)
            for a in n.attribute:
                for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                    walk(sub)

    walk(model.graph)
    # a damaged model may hold names that are not UTF-8 (protobuf hands those back as bytes)
    return {n.decode("utf-8", "replace") if isinstance(n, bytes) else n for n in out if n}


# ---- weights apart from the model ------------------------------------------------------------------

def dataless(model: onnx.ModelProto) -> onnx.ModelProto:
    """Return a copy of model whose initializers keep their names, types and dims but no data (what
    a model with its weights in a separate file looks like)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for t in out.graph.initializer:
        for f in ("raw_data", "float_data", "int32_data", "int64_data", "double_data"):
            t.ClearField(f)
    return out


def safetensors_bytes(tensors: Mapping[str, np.ndarray]) -> bytes:
    from safetensors.numpy import save

    return save({k: np.ascontiguousarray(v) for k, v in tensors.items()})


def blob_bytes(tensors: Mapping[str, np.ndarray]) -> tuple[bytes, dict[str, list[int]]]:
    """Return the header-less blob of the name-sorted tensors and each one's [start, end)."""
    parts, offsets, pos = [], {}, 0
    for k in sorted(tensors):
        b = np.ascontiguousarray(tensors[k]).tobytes()
        offsets[k] = [pos, pos + len(b)]
        parts.append(b)
        pos += len(b)
    return b"".join(parts), offsets


def json_model_doc(model: onnx.ModelProto, offsets: Mapping[str, list[int]]) -> dict:
    """Return the LuisaML JSON document of a model (as the C++ exporter writes it: MessageToDict,
    element types as names, `data_offsets` in place of initializer data). Written here rather than
    taken from luisaml.loaders so that the suite does not test luisaml against itself."""
    from google.protobuf.json_format import MessageToDict

    doc = MessageToDict(model, preserving_proto_field_name=True)
    for init in doc["graph"].get("initializer", []):
        for key in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "data_location"):
            init.pop(key, None)
        init["data_offsets"] = list(offsets[init["name"]])

    def name_types(obj):
        if isinstance(obj, dict):
            for key in ("elem_type", "data_type"):
                if isinstance(obj.get(key), int):
                    obj[key] = onnx.TensorProto.DataType.Name(obj[key])
            for v in obj.values():
                name_types(v)
        elif isinstance(obj, list):
            for v in obj:
                name_types(v)

    name_types(doc)
    return doc


def with_weights(model: onnx.ModelProto, tensors: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """Return a copy of model whose initializers hold these arrays (the reference's view)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    inits = [numpy_helper.from_array(np.asarray(tensors[t.name]), t.name) for t in out.graph.initializer]
    del out.graph.initializer[:]
    out.graph.initializer.extend(inits)
    return out
