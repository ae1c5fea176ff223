"""A .lml stores each weight once (issue 29): the artifact of a Conv + Gemm network is at most 1.25x
its model's weights, although the plan it loads into holds the kernels' packed forms as well (they
are derived again at load by the build_plan compile runs), and the loaded network equals onnxruntime."""
from __future__ import annotations

import os

import numpy as np
from onnx import helper
from util import graph_model, ort_run

import luisaml

BOUND = 1.25  # the artifact against the model's weights (issue 29, "weights stored once")


def _conv_gemm_model():
    """Two strided 3x3 convolutions and two dense layers, random weights (about 1.1 MB)."""
    rng = np.random.default_rng(29)

    def w(*shape):
        return (rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32)

    weights = {"w1": w(32, 8, 3, 3), "b1": w(32), "w2": w(64, 32, 3, 3), "b2": w(64),
               "w3": w(256, 1024), "b3": w(256), "w4": w(10, 256), "b4": w(10)}
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], strides=[2, 2], name="conv1"),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], strides=[2, 2], name="conv2"),
             helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
             helper.make_node("Flatten", ["r2"], ["f"], name="flatten"),
             helper.make_node("Gemm", ["f", "w3", "b3"], ["g1"], transB=1, name="fc1"),
             helper.make_node("Relu", ["g1"], ["r3"], name="relu3"),
             helper.make_node("Gemm", ["r3", "w4", "b4"], ["y"], transB=1, name="fc2")]
    x = rng.standard_normal((3, 8, 16, 16)).astype(np.float32)
    return graph_model(nodes, {"x": x}, weights, batch="N"), {"x": x}, sum(a.nbytes for a in weights.values())


def test_conv_gemm_artifact_stores_weights_once_and_loads_equal_to_onnxruntime(tmp_path):
    model, feeds, weight_bytes = _conv_gemm_model()
    net = luisaml.compile(model, backend="cpu")
    path = net.save(tmp_path / "conv_gemm.lml")
    size = os.path.getsize(path)
    assert size <= BOUND * weight_bytes, f"{size:,} bytes for {weight_bytes:,} bytes of weights"

    loaded = luisaml.load(path)
    # the kernels read more than the artifact holds (the packed forms beside the originals), made
    # again at load exactly as compile made them
    assert loaded.plan.blob.size > size
    assert loaded.plan.blob.bytes() == net.plan.blob.bytes()
    got = loaded.run(feeds)
    want = ort_run(model, feeds)
    assert list(got) == list(want)
    for k, v in want.items():
        assert got[k].shape == v.shape and got[k].dtype == v.dtype
        np.testing.assert_allclose(got[k], v, rtol=1e-4, atol=1e-4 * float(np.abs(v).max()), err_msg=k)
