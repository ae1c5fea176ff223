"""passes/cleanup.fold_batchnorm: an inference BatchNormalization with constant parameters folds
into the Conv before it when it is that Conv's only reader; the results equal onnxruntime's on the
unfolded graph, and the cases that must not fold keep the BatchNormalization node."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from util import ort_run

import luisaml

C = 6


def _model(conv_bias: bool, group: int = 1, also_output_conv: bool = False, second_reader: bool = False):
    rng = np.random.default_rng(group)
    inits = {"W": rng.standard_normal((C, 4 // group, 3, 3)).astype(np.float32),
             "g": rng.standard_normal(C).astype(np.float32), "b": rng.standard_normal(C).astype(np.float32),
             "m": rng.standard_normal(C).astype(np.float32), "v": rng.uniform(0.5, 2.0, C).astype(np.float32)}
    conv_in = ["x", "W"]
    if conv_bias:
        inits["B"] = rng.standard_normal(C).astype(np.float32)
        conv_in.append("B")
    nodes = [helper.make_node("Conv", conv_in, ["c"], name="conv", pads=[1, 1, 1, 1], group=group),
             helper.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], ["n"], name="bn", epsilon=1e-3),
             helper.make_node("Relu", ["n"], ["y"], name="relu")]
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", C, 7, 7])]
    if also_output_conv:
        outs.append(helper.make_tensor_value_info("c", TensorProto.FLOAT, ["N", C, 7, 7]))
    if second_reader:
        nodes.append(helper.make_node("Sigmoid", ["c"], ["s"], name="other"))
        outs.append(helper.make_tensor_value_info("s", TensorProto.FLOAT, ["N", C, 7, 7]))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 7, 7])], outs,
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    return m


@pytest.mark.parametrize("conv_bias,group,also_output_conv,second_reader,folds", [
    (True, 1, False, False, True),
    (False, 2, False, False, True),  # no bias: the fold adds one; grouped weights scale per output channel
    (True, 1, True, False, False),  # the Conv's output is a graph output: it must stay unnormalised
    (True, 1, False, True, False),  # another node reads the Conv's output
])
def test_fold_matches_onnxruntime(conv_bias, group, also_output_conv, second_reader, folds):
    m = _model(conv_bias, group, also_output_conv, second_reader)
    net = luisaml.compile(m)
    assert ("BatchNormalization" in [n.op_type for n, _ in net.plan.ops]) != folds
    x = np.random.default_rng(9).standard_normal((3, 4, 7, 7)).astype(np.float32)
    got, want = net.run({"x": x}), ort_run(m, {"x": x})
    for k, w in want.items():
        np.testing.assert_allclose(got[k], w, rtol=1e-5, atol=1e-5 * float(np.abs(w).max()), err_msg=k)
