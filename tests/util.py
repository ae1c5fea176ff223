"""Helpers for tests: build small ONNX models, run them in onnxruntime and in luisaml."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import luisaml

NP_TO_ONNX = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float16): TensorProto.FLOAT16,
    np.dtype(np.int32): TensorProto.INT32,
    np.dtype(np.int64): TensorProto.INT64,
    np.dtype(np.bool_): TensorProto.BOOL,
}


def rand(shape, dtype=np.float32, seed=0, low=-2.0, high=2.0) -> np.ndarray:
    """Return random (never all-zero) data of a shape and dtype."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) > 0.5
    if dtype.kind in "iu":
        return rng.integers(int(low) - 3, int(high) + 4, size=shape).astype(dtype)
    return rng.uniform(low, high, size=shape).astype(dtype)


def value_info(name: str, dtype, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, NP_TO_ONNX[np.dtype(dtype)], shape)


def single_node_model(
    op_type: str,
    inputs: dict[str, np.ndarray],
    outputs: list[str] | dict[str, tuple] = ("y",),
    initializers: dict[str, np.ndarray] | None = None,
    opset: int = 18,
    domain: str = "",
    batch: str | None = None,
    **attrs,
) -> onnx.ModelProto:
    """Return a one-node model: `inputs` are graph inputs (their dtype/shape from the arrays),
    `initializers` constant inputs; outputs are typed by shape inference. With `batch`, the
    first dimension of every graph input is the symbol `batch`."""
    initializers = initializers or {}
    names = list(inputs) + list(initializers)
    node = helper.make_node(op_type, names, list(outputs), domain=domain, **attrs)
    ins = []
    for k, v in inputs.items():
        shape = list(v.shape)
        if batch and shape:
            shape[0] = batch
        ins.append(value_info(k, v.dtype, shape))
    outs = [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in outputs]
    graph = helper.make_graph(
        [node], f"{op_type.lower()}_test", ins, outs, [numpy_helper.from_array(v, k) for k, v in initializers.items()]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(domain or "", opset)])
    inferred = onnx.shape_inference.infer_shapes(model)
    del model.graph.output[:]
    model.graph.output.extend(inferred.graph.output)
    return model


def ort_run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Return onnxruntime's outputs (CPU provider) by name."""
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


def assert_matches_ort(model, feeds, rtol=1e-5, atol=1e-6, batch_axis="auto", **compile_kw):
    """Compile with luisaml, run, and assert every output equals onnxruntime's (dtype and shape too)."""
    net = luisaml.compile(model, batch_axis=batch_axis, **compile_kw)
    got = net.run(feeds)
    want = ort_run(model, feeds)
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype, f"{name}: dtype {g.dtype} != onnxruntime {w.dtype}"
        assert g.shape == w.shape, f"{name}: shape {g.shape} != onnxruntime {w.shape}"
        if w.dtype.kind in "fc":
            np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=name)
        else:
            np.testing.assert_array_equal(g, w, err_msg=name)
    return net, got
