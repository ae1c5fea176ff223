"""Classifier heads on CUDA (operators/gemm_heads.py: a block per 8 columns and 16 samples, a warp per
4 samples, its lanes splitting k) against onnxruntime: ResNet-50's 2,048 -> 1,000 (Gemm, transB, bias,
after a Relu), EfficientNet's 1,280 -> 1,000 as MatMul with a Sigmoid after, ragged N and K (1,003 x
1,100: a last block of 3 columns, a ragged last k step) with alpha and beta; batches of 1, 16, 130 and
4,097. Each asserts the layer ran as the head form (a stage of 16 samples a block). The loads an
iteration ahead (gemm_heads.Heads.AHEAD) give the same bits as the loads where written.

    LUISAML_BACKEND=cuda python -m pytest tests/gpu/test_gemm_heads_cuda.py -q"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from util import cuda_only, ort_run

import luisaml

pytestmark = cuda_only()

RTOL = 2e-5


def _model(nodes, K, N, inits) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", K])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", N])],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10  # the lent machine's onnxruntime reads IR 10 at most
    return m


CASES = [("Gemm", 2048, 1000), ("MatMul", 1280, 1000), ("Gemm", 1100, 1003)]


def heads_case(op: str, K: int, N: int) -> tuple[onnx.ModelProto, np.random.Generator]:
    """The model of a case and the generator its inputs come from (tests/test_gemm_heads.py plans these
    models without a GPU). W is made float32 after the scaling: a float32 array divided by np.sqrt(K), a
    float64 scalar, is float64 under NumPy 2's promotion rules, and a double W beside a float input is a
    CompileError before any kernel runs: all three cases failed on the H100 (benchmarks/NOTES.md)."""
    rng = np.random.default_rng(K + N)
    scale = np.float32(1 / np.sqrt(K))
    if op == "Gemm":
        inits = {"W": rng.standard_normal((N, K), dtype=np.float32) * scale,
                 "C": rng.standard_normal(N, dtype=np.float32)}
        ragged = K % 32 != 0
        nodes = [helper.make_node("Relu", ["X"], ["R"]),
                 helper.make_node("Gemm", ["R", "W", "C"], ["Y"], transB=1, alpha=0.5 if ragged else 1.0,
                                  beta=2.0 if ragged else 1.0)]
    else:
        inits = {"W": rng.standard_normal((K, N), dtype=np.float32) * scale}
        nodes = [helper.make_node("MatMul", ["X", "W"], ["G"]), helper.make_node("Sigmoid", ["G"], ["Y"])]
    return _model(nodes, K, N, inits), rng


@pytest.mark.parametrize("op,K,N", CASES)
def test_heads_match_onnxruntime(op, K, N):
    model, rng = heads_case(op, K, N)
    net = luisaml.compile(model, fuse="off")  # (one layer from input to output is otherwise the fused MLP's)
    assert net.backend == "cuda"
    assert [(st.samples, st.threads, st.items) for st in net.plan.schedule.stages if st.domain == "blocks"] == [
        (16, 128, -(-N // 8))]
    for n in (1, 16, 130, 4097):
        x = rng.standard_normal((n, K), dtype=np.float32)
        got, want = net.run({"X": x})["Y"], ort_run(model, {"X": x})["Y"]
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * float(np.abs(want).max()), err_msg=f"batch {n}")


def test_loads_ahead_change_no_bit(monkeypatch):
    """gemm_heads.Heads.AHEAD (the k loop's loads an iteration ahead) against the loads where written:
    the same multiply-adds in the same order and the same warp sums, so the same float32 bits."""
    from luisaml.operators.gemm_heads import Heads

    model, rng = heads_case("Gemm", 1100, 1003)  # (a ragged last step and last column block)
    x = rng.standard_normal((130, 1100), dtype=np.float32)
    got = []
    for ahead in (False, True):
        monkeypatch.setattr(Heads, "AHEAD", ahead)
        got.append(luisaml.compile(model, fuse="off").run({"X": x})["Y"])
    np.testing.assert_array_equal(got[0], got[1])
