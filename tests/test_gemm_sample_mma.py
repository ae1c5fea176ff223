"""Layers of one row a sample on the tensor-core tile (operators/gemm_blocks.py, `Dense.MMA_GROUP`), without a
GPU: an MLP over a dynamic batch planned for CUDA with tensor_cores takes tiled_mma.py's tile for each
Gemm or MatMul whose rows are samples (a block's 128 tile rows are 128 consecutive samples, a grouped
blocks stage), keeps tiled.py's FP32 tile of 64 samples where a side is under a warp's tile (a first
layer of 3 inputs) and the items form for a head of a few outputs. The stage kernels run in Python
(tests/gpu_emulator.py: a thread per GPU thread, the marked mma callable its FP32 DSL body, buffers
float64) and are checked against the MLP in float64 numpy (itself checked against onnxruntime), for a
batch under a tile, a batch whose last group is partial, and an epilogue reading another sample's
tensor (a residual Add bound at each row's own sample). The CUDA run: tests/gpu/test_tensor_cores_cuda.py."""
from __future__ import annotations

import numpy as np
import pytest
from gpu_emulator import build_dsl, kernel_name, run_plan
from onnx import helper
from util import graph_model, ort_run, plan_of, rand



def _mlp(k0: int = 40, width: int = 64, wide: int = 96, seed: int = 0):
    """x [N, k0] -> Gemm (transB, bias) k0->width, Relu -> MatMul width->wide, Relu -> Gemm wide->width
    + residual, Relu -> Gemm width->10 (a head); and numpy's float64 MLP."""
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((width, k0)) / np.sqrt(k0)).astype(np.float32)
    b1 = rng.standard_normal(width).astype(np.float32) * 0.1
    w2 = (rng.standard_normal((width, wide)) / np.sqrt(width)).astype(np.float32)
    w3 = (rng.standard_normal((wide, width)) / np.sqrt(wide)).astype(np.float32)
    b3 = rng.standard_normal(width).astype(np.float32) * 0.1
    w4 = (rng.standard_normal((width, 10)) / np.sqrt(width)).astype(np.float32)
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h1"], name="first", transB=1),
             helper.make_node("Relu", ["h1"], ["r1"], name="relu1"),
             helper.make_node("MatMul", ["r1", "w2"], ["h2"], name="up"),
             helper.make_node("Relu", ["h2"], ["r2"], name="relu2"),
             helper.make_node("Gemm", ["r2", "w3", "b3"], ["h3"], name="down", alpha=0.5),
             helper.make_node("Add", ["h3", "r1"], ["s"], name="residual"),
             helper.make_node("Relu", ["s"], ["r3"], name="relu3"),
             helper.make_node("Gemm", ["r3", "w4"], ["y"], name="head")]
    model = graph_model(nodes, {"x": rand((3, k0))}, {"w1": w1, "b1": b1, "w2": w2, "w3": w3, "b3": b3, "w4": w4},
                        batch="N", opset=17)

    def numpy(x):
        f = lambda v: v.astype(np.float64)
        r1 = np.maximum(f(x) @ f(w1).T + f(b1), 0)
        r2 = np.maximum(r1 @ f(w2), 0)
        r3 = np.maximum(0.5 * (r2 @ f(w3)) + f(b3) + r1, 0)
        return r3 @ f(w4)

    return model, numpy


def _plan(model, tensor_cores=True):
    return plan_of(model, batch_axis=0, tensor_cores=tensor_cores)


def _stages(plan) -> dict[str, tuple[str, str, int]]:
    """{node name: (stage domain, block tiling's type name or '', samples a block)} of the plan's roots (by
    name: a test before this one in the worker may have imported luisaml afresh)."""
    out = {}
    for st in plan.schedule.stages:
        node, op = st.root
        tl = op.block_tiling() if st.domain == "blocks" else None
        if tl is not None:
            assert tl.threads == st.threads
        out[node.name] = (st.domain, type(tl).__name__ if tl is not None else "", st.samples)
    return out


MMA = {"first": ("blocks", "MmaTiling", 128), "up": ("blocks", "MmaTiling", 128),
       "down": ("blocks", "MmaTiling", 128), "head": ("items", "", 1)}


@pytest.mark.parametrize("n", [5, 130])
def test_sample_rows_take_the_mma_tile_and_match_numpy(n):
    """A batch of 5 (one group, 123 rows of its tile past the batch) and of 130 (two groups, the
    second of 2 samples): the rows past the batch load the last sample's row and store nothing."""
    model, numpy = _mlp()
    x = rand((n, 40), seed=n)
    want = numpy(x)
    np.testing.assert_allclose(ort_run(model, {"x": x})["y"], want, rtol=1e-5, atol=1e-5)  # (the reference is ONNX's)
    plan = _plan(model)
    assert _stages(plan) == MMA
    assert plan.source.count("mma_tf32_m16n8k8(") >= 3
    got = run_plan(plan, {"x": x})["y"]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-9 * np.abs(want).max())


def test_64_samples_a_block(monkeypatch):
    """Dense.MMA_GROUP = 64 (the experiment's other side): 64-row mma tiles of 64 samples, a batch of
    70 two groups, the second of 6."""
    from luisaml.operators.gemm import Dense

    monkeypatch.setattr(Dense, "MMA_GROUP", 64)
    model, numpy = _mlp(seed=3)
    plan = _plan(model)
    assert _stages(plan) == {k: (d, t, 64 if s == 128 else s) for k, (d, t, s) in MMA.items()}
    x = rand((70, 40), seed=4)
    got, want = run_plan(plan, {"x": x})["y"], numpy(x)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-9 * np.abs(want).max())


def test_sides_under_a_warp_keep_the_fp32_tile():
    """A first layer of 3 inputs (k under the mma's 8) keeps tiled.py's tile of 64 samples; the layers
    after it take the mma tile; the answer is numpy's."""
    model, numpy = _mlp(k0=3, seed=1)
    plan = _plan(model)
    assert _stages(plan) == MMA | {"first": ("blocks", "Tiling", 64)}
    x = rand((70, 3), seed=2)
    got = run_plan(plan, {"x": x})["y"]
    want = numpy(x)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-9 * np.abs(want).max())


def test_without_tensor_cores_or_the_switch_the_fp32_tile_stays(monkeypatch):
    """tensor_cores=False, or Dense.MMA_GROUP = 0 (the A/B switch): every sample-row layer on the FP32
    tile of 64 samples, as before."""
    model, _ = _mlp()
    fp32 = {k: ("blocks", "Tiling", 64) for k in ("first", "up", "down")} | {"head": ("items", "", 1)}
    plan = _plan(model, tensor_cores=False)
    assert _stages(plan) == fp32 and "mma_tf32" not in plan.source
    from luisaml.operators.gemm import Dense

    monkeypatch.setattr(Dense, "MMA_GROUP", 0)
    plan = _plan(model)
    assert _stages(plan) == fp32 and "mma_tf32" not in plan.source


def test_sample_mma_kernel_builds_as_dsl(monkeypatch):
    """luisa-python builds the stage kernel's AST (rows at other samples of the group, the marked
    callable), only the backend's compile left out (tests/gpu_emulator.py build_dsl)."""
    model, _ = _mlp()
    plan = _plan(model)
    st = next(s for s in plan.schedule.stages if s.root[0].name == "up")
    assert st.samples == 128
    assert len(build_dsl(plan, kernel_name(plan, st), monkeypatch)) == 1


def test_cpu_plans_are_untouched(monkeypatch):
    """The CPU backend has no blocks stages: its source is the same with the sample-row forms switched
    off (Dense.MMA_GROUP = WARP_MIN_K = 0) as with them on, for this MLP and a head over a long k."""
    from luisaml.operators.gemm import Dense

    from test_gemm_warp_rows import _head

    models = [_mlp()[0], _head("Gemm", 300, 10)[0]]

    def sources():
        return [plan_of(m, "cpu", batch_axis=0).source for m in models]

    on = sources()
    monkeypatch.setattr(Dense, "MMA_GROUP", 0)
    monkeypatch.setattr(Dense, "WARP_MIN_K", 0)
    assert sources() == on
