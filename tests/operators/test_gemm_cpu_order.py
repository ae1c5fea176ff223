"""The CPU backend's Gemm and MatMul tiles over a constant B: work items down a column block's rows
(`Dense.rows_fast`) and the straight-line epilogue inside the k loop's last step
(`Dense.stores_in_loop`, shaders/matmul.py.j2's `tail`), against onnxruntime and bit-equal to the
order and the stores after the loop (the same multiply-adds in the same order); ragged row and
column blocks, a batched product, a bias + residual + Relu epilogue, a Gemm with transB and C."""
import numpy as np
import pytest
from onnx import helper

from util import assert_matches_ort, graph_model, rand, stage_of, switched

import luisaml
from luisaml.operators.gemm import Dense

F32 = {"rtol": 1e-4, "atol": 1e-4}


def _old_form(model, feeds, **kw):
    """Outputs with items along the columns and the stores after the k loop."""
    with switched(Dense, rows_fast=False, stores_in_loop=False):
        return luisaml.compile(model, **kw).run(feeds)


@pytest.mark.parametrize("m,k,n", [(197, 130, 200), (33, 256, 130), (8, 128, 512)])
def test_matmul_bias_residual_relu_rows_fast_in_loop(m, k, n):
    """MatMul [m, k] x [k, n] + bias + residual + Relu over a batch of 2 (the residual the batch's
    other input): 4 x 16 or 4 x 8 tiles, a ragged last row block (197, 33) and column block (200, 130)."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"], name="mm"),
             helper.make_node("Add", ["mm", "b"], ["ab"], name="bias"),
             helper.make_node("Add", ["ab", "r"], ["ar"], name="res"),
             helper.make_node("Relu", ["ar"], ["y"], name="relu")]
    inits = {"w": rand((k, n), seed=1, low=-0.3, high=0.3), "b": rand((n,), seed=2)}
    feeds = {"x": rand((2, m, k), seed=3), "r": rand((2, m, n), seed=4)}
    model = graph_model(nodes, feeds, inits, batch="N", outputs=["y"])
    net, got = assert_matches_ort(model, feeds, **F32)
    st = stage_of(net, "mm")
    assert [nd.name for nd, _ in st.epilogue] == ["bias", "res", "relu"]
    op = st.root[1]
    assert op.packable_b() and op.cpu_items()
    src = net.plan.source
    body = src[src.index("MatMul 'mm' (epilogue"):]
    # the stores under the k loop's last step, the items down the rows
    assert f"== {k - 1}:" in body.split(".write(", 1)[0]
    np.testing.assert_array_equal(got["y"], _old_form(model, feeds)["y"])


def test_gemm_transb_c_in_loop():
    """Gemm with transB, alpha and a C row over 50 rows: the same values as the stores after the loop."""
    m, k, n = 50, 192, 160
    node = helper.make_node("Gemm", ["x", "wt", "c"], ["y"], name="g", transB=1, alpha=0.5, beta=2.0)
    feeds = {"x": rand((m, k), seed=5)}
    model = graph_model([node], feeds, {"wt": rand((n, k), seed=6, low=-0.3, high=0.3), "c": rand((n,), seed=7)})
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = m
    net, got = assert_matches_ort(model, feeds, batch_axis=None, **F32)
    assert stage_of(net, "g").root[1].tiles()[:2] == (4, 16)
    np.testing.assert_array_equal(got["y"], _old_form(model, feeds, batch_axis=None)["y"])
