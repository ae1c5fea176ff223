"""CumSum, CumProd, Hardmax and TopK against onnxruntime (CumProd, opset 26, against numpy)."""

import numpy as np
import pytest
from onnx import helper

from util import assert_matches_ort, graph_model, rand

import luisaml

I64 = np.int64


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.int64])
def test_cumsum(dtype):
    x = rand((3, 4, 5), dtype, seed=1, low=-9, high=9)
    inits = {f"a{k}": np.array(a, I64) for k, a in enumerate([0, 1, 2, -1])}
    nodes = []
    for k in range(4):
        for ex in (0, 1):
            for rev in (0, 1):
                nodes.append(helper.make_node("CumSum", ["x", f"a{k}"], [f"y{k}{ex}{rev}"], exclusive=ex, reverse=rev))
    assert_matches_ort(graph_model(nodes, {"x": x}, inits, opset=14), {"x": x}, batch_axis=None, rtol=1e-5, atol=1e-5)


def test_cumprod_against_numpy():
    import onnx

    x = rand((3, 5), seed=2, low=0.5, high=1.5)
    nodes = [helper.make_node("CumProd", ["x", "a"], [f"y{ex}{rev}"], exclusive=ex, reverse=rev) for ex in (0, 1) for rev in (0, 1)]
    model = graph_model(nodes[:0] + [helper.make_node("Neg", ["x"], ["n"])], {"x": x}, {"a": np.array(1, I64)}, opset=13)
    model.graph.node.extend(nodes)
    model.opset_import[0].version = 26
    model.ir_version = onnx.IR_VERSION
    for ex in (0, 1):
        for rev in (0, 1):
            model.graph.output.append(helper.make_tensor_value_info(f"y{ex}{rev}", onnx.TensorProto.FLOAT, [3, 5]))
    got = luisaml.compile(model, batch_axis=None).run({"x": x})
    for ex in (0, 1):
        for rev in (0, 1):
            v = x[:, ::-1] if rev else x
            want = np.cumprod(v, axis=1)
            if ex:
                want = np.concatenate([np.ones((3, 1), np.float32), want[:, :-1]], axis=1)
            want = want[:, ::-1] if rev else want
            np.testing.assert_allclose(got[f"y{ex}{rev}"], want, rtol=1e-6, err_msg=f"exclusive={ex} reverse={rev}")


def test_hardmax():
    x = rand((3, 4, 5), seed=3)
    x[0, 1, :3] = 2.5  # ties: the first maximum wins
    nodes = [helper.make_node("Hardmax", ["x"], [f"y{a}".replace("-", "m")], axis=a) for a in (0, 1, 2, -1)]
    nodes.append(helper.make_node("Hardmax", ["x"], ["default"]))
    assert_matches_ort(graph_model(nodes, {"x": x}, opset=13), {"x": x}, batch_axis=None)
    old = [helper.make_node("Hardmax", ["x"], [f"y{a}"], axis=a) for a in (0, 1, 2)]
    assert_matches_ort(graph_model(old, {"x": x}, opset=11), {"x": x}, batch_axis=None)


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.int32])
def test_topk(dtype):
    x = rand((3, 6, 4), dtype, seed=4, low=-5, high=5)  # small integers: many ties
    inits = {f"k{k}": np.array([k], I64) for k in (1, 3, 4, 6)}
    nodes = []
    for axis, k in ((-1, 3), (1, 6), (0, 1), (1, 4), (2, 4)):
        for largest in (1, 0):
            nodes.append(helper.make_node("TopK", ["x", f"k{k}"], [f"v{axis}{k}{largest}".replace("-", "m"),
                                                                     f"i{axis}{k}{largest}".replace("-", "m")],
                                          axis=axis, largest=largest))
    assert_matches_ort(graph_model(nodes, {"x": x}, inits, opset=11), {"x": x}, batch_axis=None)


def test_topk_opset1_and_batch():
    x = rand((4, 7), seed=5)
    assert_matches_ort(graph_model([helper.make_node("TopK", ["x"], ["v", "i"], k=2)], {"x": x}, opset=1), {"x": x},
                       batch_axis=None)
    model = graph_model([helper.make_node("TopK", ["x", "k"], ["v", "i"])], {"x": x}, {"k": np.array([3], I64)},
                        opset=11, batch="N")
    assert_matches_ort(model, {"x": x}, batch_axis=0)
    bad = graph_model([helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=0)], {"x": x}, {"k": np.array([3], I64)},
                      opset=11, batch="N")
    # k=3 of the batch axis: the graph is invalid for batches under 3, which the probe batch is
    with pytest.raises(luisaml.ModelError, match=r"'TopK_\d+' \(TopK\).*probe batch size 2 of 'N'.*requested k"):
        luisaml.compile(bad, batch_axis=0)
