"""A layer of one row a sample and a large W (a classifier's head) on CUDA: a block per 8 columns and
16 samples, a warp per 4 samples, its lanes splitting k (operators/gemm_heads.py), without a GPU. The
plans take the form where W has Dense.HEAD_MIN_WEIGHTS weights (lowered here so that the emulated
kernels stay small), keep the tiles below it; the stage kernel run in Python (tests/gpu_emulator.py,
threads in order and reversed) gives numpy's float64 layer (itself checked against onnxruntime): Gemm
with transB 0 and 1, a bias of [N] and of [1, N], alpha and beta, no bias, MatMul; an inline Relu
before and an epilogue (Sigmoid, Relu) after; k not a multiple of the unrolled steps nor of 32, N not
a multiple of the block's columns; batches of 1, 5 and 34 (three groups, the last of 2 samples: one warp part full, three past the batch). The CUDA run:
tests/gpu/test_gemm_heads_cuda.py."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
from gpu_emulator import build_dsl, kernel_name, run_plan
from onnx import helper
from util import graph_model, ort_run, plan_of, rand



def _head(K: int, N: int, op: str = "Gemm", trans_b: int = 1, bias: str | None = "n", alpha: float = 1.0,
          beta: float = 1.0, after: str | None = "Sigmoid", seed: int = 0):
    """x [batch, K] -> Relu -> the layer K -> N -> `after`; and numpy's float64 of it."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((K, N)) / np.sqrt(K)).astype(np.float32)  # as [K, N]
    c = rng.standard_normal((1, N) if bias == "1n" else N).astype(np.float32)
    inits = {"w": np.ascontiguousarray(w.T) if trans_b and op == "Gemm" else w}
    if op == "Gemm":
        inputs = ["r", "w"] + (["c"] if bias else [])
        inits |= {"c": c} if bias else {}
        dense = helper.make_node("Gemm", inputs, ["h"], name="head", transB=trans_b, alpha=alpha, beta=beta)
    else:
        dense = helper.make_node("MatMul", ["r", "w"], ["h"], name="head")
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"), dense]
    if after:
        nodes.append(helper.make_node(after, ["h"], ["y"], name="after"))
    model = graph_model(nodes, {"x": rand((3, K))}, inits, batch="N", opset=17, outputs=["y" if after else "h"])

    def numpy(x):
        h = np.maximum(x.astype(np.float64), 0) @ w.astype(np.float64)
        if op == "Gemm":
            h = alpha * h + (beta * c.astype(np.float64) if bias else 0)
        return {None: h, "Sigmoid": 1 / (1 + np.exp(-h)), "Relu": np.maximum(h, 0)}[after]

    return model, numpy, "y" if after else "h"


def _plan(model, tensor_cores=False, backend="cuda"):
    return plan_of(model, backend, batch_axis=0, tensor_cores=tensor_cores)


def _head_stage(plan):
    (st,) = [s for s in plan.schedule.stages if s.root[0].name == "head"]
    return st


@pytest.fixture
def small_heads(monkeypatch):
    """Heads of a few thousand weights take the form (the emulator runs every thread in Python)."""
    from luisaml.operators.gemm import Dense

    monkeypatch.setattr(Dense, "HEAD_MIN_WEIGHTS", 1)


CASES = [  # K, N, the layer's keywords
    (300, 37, {}),  # k: 2 unrolled iterations + 2 steps, the last ragged; N: a last block of 5 columns
    (256, 24, {"trans_b": 0, "bias": None, "after": "Relu"}),
    (600, 17, {"alpha": 0.5, "beta": 2.0, "bias": "1n"}),  # 4 iterations + 3 steps; 1 column in the last block
    (288, 40, {"op": "MatMul", "after": None}),
]


def _check(K, N, kw, batches):
    model, numpy, out = _head(K, N, seed=K + N, **kw)
    for n in batches:
        x = rand((n, K), seed=n)
        want = numpy(x)
        np.testing.assert_allclose(ort_run(model, {"x": x})[out], want, rtol=1e-5, atol=1e-5)  # (the reference is ONNX's)
        plan = _plan(model)
        st = _head_stage(plan)
        assert type(st.root[1].block_tiling()).__name__ == "Heads"
        assert (st.domain, st.samples, st.threads, st.items) == ("blocks", 16, 128, -(-N // 8))
        # (the tensor cores' plan: the form before the mma tile, the same kernel)
        assert _plan(model, tensor_cores=True).source.count(plan.source[plan.source.index("    set_block_size(128"):][:4000]) == 1
        for reverse in (False, True) if n > 16 else (False,):
            got = run_plan(plan, {"x": x}, reverse=reverse)[out]
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-9 * max(1.0, np.abs(want).max()))


@pytest.mark.parametrize("K,N,kw", CASES)
def test_heads_match_numpy(small_heads, K, N, kw):
    """Batches of 1 and 5: one group of 16 samples, its last warps past the batch."""
    _check(K, N, kw, (1, 5))


# a batch of 34: three groups, the last of 2 samples (one warp part full, three past the batch), threads
# in order and reversed; every emulated warp reduction is 32 Python threads meeting (3-5 s a case since the
# emulator hands a barrier's turn to one thread, ~2.5 min before: every case runs in CI)
@pytest.mark.parametrize("K,N,kw", CASES)
def test_heads_last_group_in_both_thread_orders(small_heads, K, N, kw):
    _check(K, N, kw, (34,))


@pytest.mark.parametrize("K,N,kw", [CASES[0], CASES[2]])
def test_loads_ahead_change_no_bit(small_heads, monkeypatch, K, N, kw):
    """Heads.AHEAD (the k loop's loads an iteration ahead) against the loads where written (the A/B's
    baseline): another kernel, the same sums in the same order, so the same float64 bits in the
    emulator, both in thread order and reversed (the numpy check above runs the default, AHEAD)."""
    from luisaml.operators.gemm_heads import Heads

    model, numpy, out = _head(K, N, seed=K + N, **kw)
    x = rand((5, K), seed=7)
    got = {}
    for ahead in (False, True):
        monkeypatch.setattr(Heads, "AHEAD", ahead)
        plan = _plan(model)
        assert ("xn" in plan.source) == ahead
        got[ahead] = [run_plan(plan, {"x": x}, reverse=r)[out] for r in (False, True)]
    for a, b in zip(got[False], got[True]):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(got[True][0], numpy(x), rtol=0, atol=1e-9 * max(1.0, np.abs(numpy(x)).max()))


def test_the_cuda_tests_models_plan_as_heads():
    """tests/gpu/test_gemm_heads_cuda.py's models, planned for CUDA without a GPU as its test compiles
    them (fuse off; with and without tensor cores): float32 weights (NumPy 2 made W float64 there, a
    CompileError on the H100) and the head form's one stage of 16 samples and 128 threads."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent / "gpu" / "test_gemm_heads_cuda.py"
    spec = importlib.util.spec_from_file_location("heads_cuda", path)
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    for op, K, N in gpu.CASES:
        model = gpu.heads_case(op, K, N)[0]
        assert {i.name: i.data_type for i in model.graph.initializer} == dict.fromkeys(
            ["W", "C"] if op == "Gemm" else ["W"], 1)  # (TensorProto.FLOAT)
        for tc in (False, True):
            plan = plan_of(model, "cuda", fuse="off", tensor_cores=tc)
            assert [(st.samples, st.threads, st.items) for st in plan.schedule.stages if st.domain == "blocks"] == [
                (16, 128, -(-N // 8))]


def test_the_zoo_heads_take_the_form_and_small_layers_keep_the_tiles():
    """At the shipped bound: ResNet-50's 2,048 -> 1,000 and ResNet-18's 512 -> 1,000 are heads; NeRF's
    256 -> 256 (and its 319 -> 256) keep the mma tile, or the FP32 tile without tensor cores."""
    for K, N in ((2048, 1000), (512, 1000), (576, 1024)):
        st = _head_stage(_plan(_head(K, N)[0], tensor_cores=True))
        assert (type(st.root[1].block_tiling()).__name__, st.samples) == ("Heads", 16)
    for K in (256, 319):
        model = _head(K, 256)[0]
        assert type(_head_stage(_plan(model, tensor_cores=True)).root[1].block_tiling()).__name__ == "MmaTiling"
        assert type(_head_stage(_plan(model)).root[1].block_tiling()).__name__ == "Tiling"


def test_the_switch_keeps_the_tiles(monkeypatch):
    """Dense.HEAD_MIN_WEIGHTS = 0 (the A/B switch): ResNet-50's head on the tiles as before."""
    from luisaml.operators.gemm import Dense

    model = _head(2048, 1000)[0]
    monkeypatch.setattr(Dense, "HEAD_MIN_WEIGHTS", 0)
    assert type(_head_stage(_plan(model, tensor_cores=True)).root[1].block_tiling()).__name__ == "MmaTiling"
    assert type(_head_stage(_plan(model)).root[1].block_tiling()).__name__ == "Tiling"


def test_cpu_plans_are_untouched(monkeypatch):
    """The CPU backend has no blocks stages: its plan's source is the same with the form off."""
    from luisaml.operators.gemm import Dense

    from luisaml.operators.gemm_heads import Heads

    model = _head(2048, 1000)[0]
    on = hashlib.sha256(_plan(model, backend="cpu").source.encode()).hexdigest()
    monkeypatch.setattr(Dense, "HEAD_MIN_WEIGHTS", 0)
    assert hashlib.sha256(_plan(model, backend="cpu").source.encode()).hexdigest() == on
    monkeypatch.setattr(Heads, "AHEAD", False)  # (nor with the loads where written)
    assert hashlib.sha256(_plan(model, backend="cpu").source.encode()).hexdigest() == on


def test_heads_kernel_builds_as_dsl(monkeypatch):
    """luisa-python builds the stage kernel's AST (ResNet-50's head: the unrolled loop, the clamped
    samples, the warp sums), only the backend's compile left out (tests/gpu_emulator.py build_dsl)."""
    plan = _plan(_head(2048, 1000)[0], tensor_cores=True)
    assert len(build_dsl(plan, kernel_name(plan, _head_stage(plan)), monkeypatch)) == 1
