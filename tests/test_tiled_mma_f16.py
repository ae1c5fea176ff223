"""The tensor-core tile's FP16 kind (operators/tiled_mma.py, kind "f16": shaders/tensor_cores.py's m16n8k16
with FP32 accumulation) without a GPU, as tests/test_tiled_mma.py checks the TF32 kind: a Gemm or MatMul
planned for CUDA with its products marked "f16" emits the f16 callable, and the emitted stage kernel run in
Python (tests/gpu_emulator.py: the marked callable's DSL body) gives the product of A and B rounded to half.

The reference is numpy's: A and B rounded to float16, their product in float64. The tile rounds each operand
once where a thread copies it to shared memory, so the DSL body multiplies the same halves the HMMA does,
and each product of two halves is exact in FP32 (11 + 11 significant bits); what may differ is only the
order and precision of the sums. Bound, elementwise: K * 2^-24 * (|A16| @ |B16|) (a sum of K terms in FP32,
round to nearest: what the GPU's accumulation may add; the emulator's float64 sums stay far inside it).
The product of the unrounded operands is outside that bound, so a tile that did not round would fail."""
from __future__ import annotations

import numpy as np
import pytest
from gpu_emulator import build_dsl, kernel_name, run_plan
from test_tiled_mma import _model
from util import mark_products_f16, plan_of

U32 = 2.0 ** -24  # FP32's unit roundoff (round to nearest)


def f16_product_bound(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Return (A B with A and B rounded to float16, in float64; the elementwise bound of an FP32 sum of
    the K exact products: K u32 |A16| @ |B16|)."""
    a16 = a.astype(np.float16).astype(np.float64)
    b16 = b.astype(np.float16).astype(np.float64)
    return a16 @ b16, a.shape[-1] * U32 * (np.abs(a16) @ np.abs(b16))


def _f16_plan(model, monkeypatch):
    """The model's CUDA plan with tensor cores, its products marked with the FP16 kind (what
    compile(precision="fp16") asks of the layers it runs as stages)."""
    mark_products_f16(monkeypatch)
    return plan_of(model, batch_axis=None, tensor_cores=True)


def _operands(op, M, K, N, ta, tb, seed=0):
    """The model's A and B as the product reads them (tests/test_tiled_mma.py's _model draws them)."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((K, M) if ta else (M, K)).astype(np.float32)
    b = rng.standard_normal((N, K) if tb else (K, N)).astype(np.float32)
    return (a.T if ta else a), (b.T if tb else b)


@pytest.mark.parametrize("tile", ["w64", "w32"])
@pytest.mark.parametrize("op,M,K,N,ta,tb,const_b", [
    ("MatMul", 128, 40, 64, 0, 0, True),  # whole tiles, k steps of 16 with a ragged last one (40 = 16 + 16 + 8)
    ("MatMul", 100, 24, 90, 0, 0, False),  # ragged M and N, run-time B ("w64": 96 columns, warps of 48)
    ("Gemm", 64, 16, 96, 1, 1, True),  # A and B transposed (A's rows contiguous: k-major A), one k step
    ("MatMul", 256, 72, 128, 0, 0, True),  # "w64": 4 warps of 64 x 64, five k steps
])
def test_emitted_f16_tile_matches_half_rounded_numpy(op, M, K, N, ta, tb, const_b, tile, monkeypatch):
    monkeypatch.setenv("LUISAML_MMA_TILE", tile)
    model, feeds, _ = _model(op, M, K, N, ta, tb, const_b)
    plan = _f16_plan(model, monkeypatch)
    (st,) = [s for s in plan.schedule.stages if s.domain == "blocks"]
    (_, operator), = st.nodes
    tl = operator.block_tiling()
    assert type(tl).__name__ == "MmaTiling" and tl.kind == "f16" and tl.threads == st.threads
    assert "mma_f16_m16n8k16(" in plan.source and "mma_tf32" not in plan.source and "f16_round(" in plan.source
    a, b = _operands(op, M, K, N, ta, tb)
    scale = 0.5 if op == "Gemm" else 1.0  # (_model's Gemm: alpha 0.5, applied to the FP32 sum: exact)
    want, bound = f16_product_bound(a, b)
    if const_b:
        feeds = {"A": feeds["A"]}
    got = run_plan(plan, feeds)["Y"].reshape(M, N)
    err = np.abs(got - scale * want)
    worst = np.unravel_index(err.argmax(), err.shape)
    assert (err <= scale * bound).all(), f"worst {err[worst]:.3g} against a bound of {scale * bound[worst]:.3g}"
    # the operands were rounded: the unrounded product is further than the bound (so the check above can fail)
    exact = scale * (a.astype(np.float64) @ b.astype(np.float64))
    assert (np.abs(got - exact) > scale * bound).any()


def test_emitted_f16_tile_overflows_as_half(monkeypatch):
    """An operand past half's range (65504) becomes inf where it is copied, as cvt.rn.f16 makes it on the
    device (torch fp16 overflows the same way): the products it enters are inf, the others unchanged."""
    model, feeds, _ = _model("MatMul", 64, 16, 64, const_b=False)
    plan = _f16_plan(model, monkeypatch)
    a, b = feeds["A"].copy(), feeds["B"].copy()
    a[3, 5] = 1.0e5
    b = np.abs(b) + 0.5  # (so row 3's products with the inf are +inf, never inf - inf)
    got = run_plan(plan, {"A": a, "B": b})["Y"].reshape(64, 64)
    assert np.isposinf(got[3]).all()
    want, bound = f16_product_bound(np.delete(a, 3, 0), b)
    assert (np.abs(np.delete(got, 3, 0) - want) <= bound).all()


def test_f16_kind_keeps_tf32_where_not_asked():
    """Without the FP16 mark a product keeps the TF32 kind (the plan of tensor_cores=True, as before)."""
    model, _, _ = _model("MatMul", 128, 40, 64)
    plan = plan_of(model, batch_axis=None, tensor_cores=True)
    assert "mma_tf32_m16n8k8(" in plan.source and "mma_f16" not in plan.source and "half(" not in plan.source


def test_f16_choose_needs_a_k16_step():
    from luisaml.operators import tiled_mma

    assert tiled_mma.choose(128, 64, 8, 1, kind="f16") is None  # (K under one mma's k of 16)
    t = tiled_mma.choose(4096, 4096, 4096, 1, kind="f16", tile="w64")
    assert (t.BM, t.BN, t.WN, t.threads, t.kind) == (128, 128, 64, 128, "f16") and "m16n8k16" in t.describe()


@pytest.mark.parametrize("tile", ["w64", "w32-first"])
def test_emitted_f16_kernel_builds_as_dsl(tile, monkeypatch):
    """luisa-python builds the FP16 stage kernel's AST (the half rounding of each copied element, the contract's
    arrays of 32 and 48 floats), the backend's compile left out (tests/gpu_emulator.py build_dsl)."""
    monkeypatch.setenv("LUISAML_MMA_TILE", tile)
    model, _, _ = _model("MatMul", 128, 40, 64, const_b=False)
    plan = _f16_plan(model, monkeypatch)
    (st,) = [s for s in plan.schedule.stages if s.domain == "blocks"]
    assert len(build_dsl(plan, kernel_name(plan, st), monkeypatch)) == 1
