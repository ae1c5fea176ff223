"""Gemm and MatMul against onnxruntime: transposes, alpha/beta, every C broadcast, batch
broadcasting, 1-D operands, half and integers, and an MLP run per sample."""

import numpy as np
import pytest
from onnx import helper

from util import assert_matches_ort, graph_model, ort_run, rand, single_node_model

import luisaml

M, K, N = 3, 5, 4


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_gemm_variants(dtype):
    """One model: every transA/transB pair, alpha/beta, and C absent, scalar, [N], [M, 1], [M, N]."""
    a, at = rand((M, K), dtype, seed=1), rand((K, M), dtype, seed=2)
    b, bt = rand((K, N), dtype, seed=3), rand((N, K), dtype, seed=4)
    cs = {"c_none": None, "c_s": rand((1,), dtype, seed=5), "c_n": rand((N,), dtype, seed=6),
          "c_m1": rand((M, 1), dtype, seed=7), "c_mn": rand((M, N), dtype, seed=8)}
    feeds = {"a": a, "at": at, "b": b, "bt": bt}
    nodes = []
    for ta in (0, 1):
        for tb in (0, 1):
            for cname in cs:
                ins = ["at" if ta else "a", "bt" if tb else "b"] + ([cname] if cs[cname] is not None else [])
                nodes.append(helper.make_node("Gemm", ins, [f"y_{ta}{tb}_{cname}"], transA=ta, transB=tb, alpha=0.75, beta=-1.5))
    nodes.append(helper.make_node("Gemm", ["a", "b", "c_mn"], ["y_beta0"], beta=0.0))
    nodes.append(helper.make_node("Gemm", ["a", "b", "c_n"], ["y_default"]))
    feeds.update({k: v for k, v in cs.items() if v is not None})
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == np.float32 else {"rtol": 2e-3, "atol": 2e-3}
    assert_matches_ort(graph_model(nodes, feeds, opset=13), feeds, batch_axis=None, **tol)


def test_gemm_weights_in_blob():
    """B and C as initializers (read from the weight blob), opset 11 and 7 (C required)."""
    a = rand((M, K), seed=1)
    b, c = rand((N, K), seed=2), rand((N,), seed=3)
    for opset in (7, 11):
        m = single_node_model("Gemm", {"a": a}, initializers={"b": b, "c": c}, opset=opset, transB=1, alpha=2.0)
        net, _ = assert_matches_ort(m, {"a": a}, batch_axis=None)
        assert "weights.read" in net.source


def test_gemm_int_alpha_must_be_whole():
    a, b = rand((2, 3), np.int32), rand((3, 2), np.int32)
    m = single_node_model("Gemm", {"a": a, "b": b}, alpha=0.5)
    with pytest.raises(luisaml.CompileError, match="whole alpha"):
        luisaml.compile(m, batch_axis=None)


def test_gemm_shape_errors():
    """A [2, 3] x B [4, 2]: the inner dimensions differ (shape inference already says so)."""
    m = helper.make_model(
        helper.make_graph(
            [helper.make_node("Gemm", ["a", "b"], ["y"], name="g")], "g",
            [helper.make_tensor_value_info("a", 1, [2, 3]), helper.make_tensor_value_info("b", 1, [4, 2])],
            [helper.make_tensor_value_info("y", 1, [2, 2])],
        ),
        opset_imports=[helper.make_opsetid("", 13)],
    )
    with pytest.raises(Exception, match="inner dimensions|Incompatible|shape"):
        luisaml.compile(m, batch_axis=None)


MATMUL = [
    ((M, K), (K, N)),
    ((K,), (K, N)),
    ((M, K), (K,)),
    ((K,), (K,)),
    ((2, M, K), (K, N)),
    ((K,), (2, K, N)),
    ((2, M, K), (2, K, N)),
    ((2, 1, M, K), (3, K, N)),
    ((1, M, K), (2, 3, K, N)),
]


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.int64, np.float16])
def test_matmul_shapes(dtype):
    """One model: one MatMul per pair of shapes (numpy matmul semantics)."""
    nodes, feeds = [], {}
    for k, (sa, sb) in enumerate(MATMUL):
        feeds[f"a{k}"], feeds[f"b{k}"] = rand(sa, dtype, seed=2 * k), rand(sb, dtype, seed=2 * k + 1)
        nodes.append(helper.make_node("MatMul", [f"a{k}", f"b{k}"], [f"y{k}"], name=f"mm{k}"))
    if dtype == np.float16:
        tol = {"rtol": 2e-3, "atol": 4e-3}
        feeds = {k: v for k, v in feeds.items()}
    else:
        tol = {"rtol": 1e-5, "atol": 1e-5}
    assert_matches_ort(graph_model(nodes, feeds), feeds, batch_axis=None, **tol)


def test_mlp_per_sample():
    """x[N, 6] -> Gemm(W1^T) -> Relu -> MatMul(W2) -> Add(b2) -> Sigmoid, one thread per sample."""
    w1, b1 = rand((8, 6), seed=1), rand((8,), seed=2)
    w2, b2 = rand((8, 3), seed=3), rand((3,), seed=4)
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], transB=1),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("MatMul", ["r", "w2"], ["z"]),
        helper.make_node("Add", ["z", "b2"], ["s"]),
        helper.make_node("Sigmoid", ["s"], ["y"]),
    ]
    model = graph_model(nodes, {"x": rand((2, 6))}, {"w1": w1, "b1": b1, "w2": w2, "b2": b2}, batch="N")
    net = luisaml.compile(model)
    assert net.batch_symbol == "N"
    for n in (1, 7):
        x = rand((n, 6), seed=10 + n)
        np.testing.assert_allclose(net.run({"x": x})["y"], ort_run(model, {"x": x})["y"], rtol=1e-5, atol=1e-6)


def test_batched_matmul_per_sample():
    """A [N, S, K] per sample against a shared B [K, N2] and a per-sample B [N, K, N2]."""
    a, b, bb = rand((2, 3, K)), rand((K, N), seed=1), rand((2, K, N), seed=2)
    nodes = [helper.make_node("MatMul", ["a", "b"], ["y"]), helper.make_node("MatMul", ["a", "bb"], ["yb"])]
    model = graph_model(nodes, {"a": a, "bb": bb}, {"b": b}, batch="N")
    for n in (1, 4):
        feeds = {"a": rand((n, 3, K), seed=n), "bb": rand((n, K, N), seed=n + 1)}
        net, _ = assert_matches_ort(model, feeds)
        assert net.batch_symbol == "N"
