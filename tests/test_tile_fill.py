"""Gemm/MatMul's GPU tiles chosen from measurement (operators/tiled.py, operators/tiled_mma.py),
without a GPU: the FP32 rule's 64 x 128 tiles with k steps of 16 where it took 128 x 128 (Conv's
pipelined tiles unchanged), the tensor-core tile shrinking where a whole launch would leave
multiprocessors idle (a product per sample of an unknown batch keeps its tile), and both tiles'
kernels run in Python (tests/gpu_emulator.py) against numpy."""
from __future__ import annotations

import numpy as np
import pytest
from gpu_emulator import run_plan
from onnx import TensorProto, helper, numpy_helper

from luisaml.operators import tiled, tiled_mma
from luisaml.planning import CompileOptions, plan_for

SMS = 132  # an H100 / H200


@pytest.mark.parametrize("M,N,nbatch", [(1024, 768, 1), (12608, 576, 1), (128, 128, 96), (100, 200, 1)])
def test_fp32_products_take_64_x_128_tiles_with_k_steps_of_16(M, N, nbatch):
    tl = tiled.choose(M, N, 768, nbatch, m_fast=False)
    assert (tl.BM, tl.BN, tl.TM, tl.TN, tl.BK, tl.double, tl.threads) == (64, 128, 8, 8, 16, False, 128)
    assert tiled._valid(tl.BM, tl.BN, tl.TM, tl.TN, tl.BK, tl.double)
    # Conv's pipelined tiles keep their measured rule: 128 x 128
    conv = tiled.choose(M, N, 768, nbatch, m_fast=True, pipelined=True)
    assert (conv.BM, conv.BN) == (128, 128)


def test_small_fp32_products_keep_their_tiles():
    tl = tiled.choose(1024, 64, 768, 1, m_fast=False)  # 64 columns: 128 x 64 as before
    assert (tl.BM, tl.BN, tl.BK) == (128, 64, 8)
    assert tiled.choose(70, 40, 64, 1, m_fast=False) is None  # mostly padding: the items form


@pytest.mark.parametrize("M,N,nbatch", [(1024, 768, 1), (1024, 3072, 1), (128, 128, 96), (4096, 4096, 1), (128, 128, 1)])
def test_the_tensor_core_tile_fills_the_multiprocessors(M, N, nbatch):
    rule = tiled_mma.choose(M, N, 768, nbatch)
    tl = tiled_mma.choose(M, N, 768, nbatch, sms=SMS)
    if rule.blocks >= SMS:
        assert tl == rule
        return
    assert tl.blocks > rule.blocks and (tl.blocks >= SMS or (tl.BM, tl.BN) == tiled_mma.FILL_SIDES[-1])
    for bm, bn in tiled_mma.FILL_SIDES:  # none larger listed before it covers them
        if (bm, bn) == (tl.BM, tl.BN):
            break
        assert nbatch * -(-M // bm) * -(-N // bn) < SMS
    assert tl.shared_bytes <= 48 * 1024 and tl.threads % 32 == 0


def _matmul(M: int, K: int, N: int, batch_dim: bool, seed: int = 0):
    """MatMul by a constant, a bias Add and a Relu (the epilogue)."""
    rng = np.random.default_rng(seed)
    b = rng.standard_normal((K, N)).astype(np.float32)
    c = rng.standard_normal(N).astype(np.float32)
    a_shape = (["N"] if batch_dim else []) + [M, K]
    nodes = [helper.make_node("MatMul", ["A", "B"], ["P"]), helper.make_node("Add", ["P", "C"], ["S"]),
             helper.make_node("Relu", ["S"], ["Y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, a_shape)],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, a_shape[:-1] + [N])],
                          [numpy_helper.from_array(b, "B"), numpy_helper.from_array(c, "C")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), b, c


def _tiling(plan):
    [st] = [st for st in plan.schedule.stages if st.domain == "blocks"]
    tl = st.root[1].block_tiling()
    assert (st.items, st.threads) == (tl.blocks, tl.threads)
    return st, tl


def test_only_a_whole_launch_shrinks_the_tensor_core_tile():
    model, _, _ = _matmul(1024, 768, 768, batch_dim=False)
    _, tl = _tiling(plan_for(model, "m", CompileOptions(batch_axis=None, tensor_cores=True).resolve("cuda"))[0])
    assert type(tl).__name__ == "MmaTiling" and tl.blocks >= SMS and (tl.BM, tl.BN) != (128, 128)
    per_sample, _, _ = _matmul(1024, 768, 768, batch_dim=True)
    st, tl = _tiling(plan_for(per_sample, "m", CompileOptions(tensor_cores=True).resolve("cuda"))[0])
    assert st.batched and (tl.BM, tl.BN) == (128, 128)  # the batch multiplies its blocks


@pytest.mark.parametrize("M,K,N,mma_sides,reverse", [
    (128, 32, 128, None, False),  # the FP32 64 x 128 tile, whole
    (120, 37, 200, None, True),  # ragged M, N and K (a ragged last k step of 16), threads reversed
    (128, 40, 128, (64, 128), False),  # the tensor-core tile's shrunk sides, whole
    (128, 24, 100, (128, 64), True),
])
def test_tiles_give_numpys_product(M, K, N, mma_sides, reverse, monkeypatch):
    """The tile emitted with its epilogue (bias, Relu), run as the GPU would (a block's threads one at
    a time between barriers, in thread order or reversed)."""
    model, b, c = _matmul(M, K, N, batch_dim=False, seed=M)
    a = np.random.default_rng(1).standard_normal((M, K)).astype(np.float32)
    want = np.maximum(a.astype(np.float64) @ b + c, 0)
    if mma_sides:  # a whole launch of one tile: shrinks to these sides (the first FILL_SIDES entry)
        monkeypatch.setattr(tiled_mma, "FILL_SIDES", (mma_sides,))
    plan, _, _ = plan_for(model, "m", CompileOptions(batch_axis=None, tensor_cores=bool(mma_sides)).resolve("cuda"))
    _, tl = _tiling(plan)
    if mma_sides:
        assert type(tl).__name__ == "MmaTiling" and (tl.BM, tl.BN) == mma_sides
        tol = 1e-9  # the emulated mma callable: its FP32 body in float64
    else:
        assert (tl.BM, tl.BN, tl.BK) == (64, 128, 16)
        tol = 1e-5
    got = run_plan(plan, {"A": a}, reverse=reverse)["Y"]
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())
