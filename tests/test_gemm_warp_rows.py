"""A layer of one row a sample and few columns over a long k (a classifier's head) on CUDA: a warp a
sample, its lanes splitting k, the sums combined across the warp (operators/gemm_rows.py), without a
GPU: the plan takes the form (4 samples a block) where tiled.py's tile of samples declines and K is at
least Dense.WARP_MIN_K, and the stage kernel run in Python (tests/gpu_emulator.py: warp_active_sum a
stop of every lane of the warp) gives numpy's float64 head (itself checked against onnxruntime), for
a k that is not a multiple of 32, a bias and an epilogue, a batch whose last block holds fewer samples
than its warps, A read through the inline node before it. The CUDA run: tests/gpu/test_blocks_cuda.py."""
from __future__ import annotations

import numpy as np
import pytest
from gpu_emulator import build_dsl, kernel_name, run_plan
from onnx import helper
from util import graph_model, ort_run, plan_of, rand



def _head(op: str, K: int, N: int, seed: int = 0):
    """x [N, K] -> Relu -> Gemm (transB, bias, alpha) or MatMul K->N -> Sigmoid; and numpy's float64 head."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((N, K) if op == "Gemm" else (K, N)) / np.sqrt(K)).astype(np.float32)
    c = rng.standard_normal(N).astype(np.float32)
    inits = {"w": w} | ({"c": c} if op == "Gemm" else {})
    dense = (helper.make_node("Gemm", ["r", "w", "c"], ["h"], name="head", transB=1, alpha=0.5) if op == "Gemm" else
             helper.make_node("MatMul", ["r", "w"], ["h"], name="head"))
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"), dense,
             helper.make_node("Sigmoid", ["h"], ["y"], name="sigmoid")]
    model = graph_model(nodes, {"x": rand((3, K))}, inits, batch="N", opset=17)

    def numpy(x):
        r = np.maximum(x.astype(np.float64), 0)
        h = 0.5 * (r @ w.T.astype(np.float64)) + c if op == "Gemm" else r @ w.astype(np.float64)
        return 1 / (1 + np.exp(-h))

    return model, numpy


def _plan(model, tensor_cores=False):
    return plan_of(model, batch_axis=0, tensor_cores=tensor_cores)


def _head_stage(plan):
    (st,) = [s for s in plan.schedule.stages if s.root[0].name == "head"]
    return st


@pytest.mark.parametrize("op,K,N,n", [("Gemm", 300, 10, 6), ("MatMul", 256, 1, 1), ("Gemm", 512, 15, 4)])
def test_a_warp_a_sample_matches_numpy(op, K, N, n):
    model, numpy = _head(op, K, N, seed=K)
    x = rand((n, K), seed=n)
    want = numpy(x)
    np.testing.assert_allclose(ort_run(model, {"x": x})["y"], want, rtol=1e-5, atol=1e-6)  # (the reference is ONNX's)
    for tc in (False, True):  # (the tensor cores' plan: N under a warp's tile, the same form)
        plan = _plan(model, tensor_cores=tc)
        st = _head_stage(plan)
        assert st.domain == "blocks" and st.samples == 4 and st.threads == 128
        assert type(st.root[1].block_tiling()).__name__ == "WarpRows" and "warp_active_sum" in plan.source
        got = run_plan(plan, {"x": x})["y"]
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("K,N", [(128, 10), (256, 16)])
def test_short_or_wide_heads_keep_their_forms(K, N):
    """K under WARP_MIN_K keeps the items form; 16 columns take tiled.py's tile of 64 samples (its MIN_SIDE)."""
    model, _ = _head("Gemm", K, N)
    st = _head_stage(_plan(model))
    assert (st.domain, st.samples) == (("items", 1) if N < 16 else ("blocks", 64))


def test_the_switch_keeps_the_items_form(monkeypatch):
    """Dense.WARP_MIN_K = 0 (the A/B switch): the head's items form, as before."""
    from luisaml.operators.gemm import Dense

    model, _ = _head("Gemm", 300, 10)
    monkeypatch.setattr(Dense, "WARP_MIN_K", 0)
    st = _head_stage(_plan(model))
    assert (st.domain, st.samples) == ("items", 1)


def test_warp_rows_kernel_builds_as_dsl(monkeypatch):
    """luisa-python builds the stage kernel's AST (the warp reductions, rows at other samples of the
    group), only the backend's compile left out (tests/gpu_emulator.py build_dsl)."""
    model, _ = _head("Gemm", 300, 10)
    plan = _plan(model)
    assert len(build_dsl(plan, kernel_name(plan, _head_stage(plan)), monkeypatch)) == 1
