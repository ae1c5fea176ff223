"""On CUDA a Conv whose product has few k (input channels a group x taps < conv_tiles.DIRECT_K) runs
direct -- Conv's items form, a thread per P positions x O channels, its stores consecutive positions of a
channel across a warp -- not on a GEMM tile whose one k step would be mostly padding (wav2vec2's first layer:
1 channel x 10 taps, stride 5; benchmarks/NOTES.md, "wav2vec2's first layer on CUDA"). The CUDA plan's
kernels run in the emulator (tests/gpu_emulator.py) against onnxruntime: ragged lengths, strides, several
input channels, pads and a bias; a whole k step (16) keeps its tile."""
from __future__ import annotations

import numpy as np
import pytest
from gpu_emulator import run_plan
from onnx import helper
from util import graph_model, ort_run, plan_of

from luisaml.operators import conv_tiles


def _conv(C: int, M: int, k: int, s: int, L: int, pads=(0, 0), bias: bool = False, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, C, L)).astype(np.float32)
    inits = {"w": (rng.standard_normal((M, C, k)) / np.sqrt(C * k)).astype(np.float32)}
    ins = ["x", "w"]
    if bias:
        inits["b"] = rng.standard_normal(M).astype(np.float32)
        ins.append("b")
    node = helper.make_node("Conv", ins, ["y"], kernel_shape=[k], strides=[s], pads=list(pads), name="conv")
    return graph_model([node], {"x": x}, inits, batch="N"), {"x": x}


def _stage(plan):
    (st,) = plan.schedule.stages
    return st


# (C, M, k, s, L, pads, bias): wav2vec2's layer cut short (1 x 10, stride 5, a ragged 3199-like row of
# 19 outputs), a pointwise Conv of 3 channels (PointNet's first) over odd and over 64 positions (a row the
# CPU's strips of 8 divide: on the GPU still a position a thread), 3 x 5 = 15 k (under the bound), a padded
# strided one with a bias and channels not a multiple of the items form's 16
CASES = [(1, 40, 10, 5, 100, (0, 0), False), (3, 24, 1, 1, 37, (0, 0), True), (3, 20, 1, 1, 64, (0, 0), True),
         (3, 16, 5, 2, 41, (0, 0), False), (4, 20, 3, 2, 33, (1, 1), True)]


@pytest.mark.parametrize("tc", [True, False])
@pytest.mark.parametrize("C,M,k,s,L,pads,bias", CASES)
def test_few_k_conv_runs_direct_on_cuda(C, M, k, s, L, pads, bias, tc):
    assert C * k < conv_tiles.DIRECT_K
    model, feeds = _conv(C, M, k, s, L, pads, bias, seed=C * k + L)
    plan = plan_of(model, "cuda", batch_axis=0, tensor_cores=tc)
    st = _stage(plan)
    assert st.domain == "items", plan.schedule.describe()  # (not a tile: no blocks stage)
    assert st.root[1].tiles()[0] == 1  # (a position a thread)
    got = run_plan(plan, feeds)["y"]
    np.testing.assert_allclose(got, ort_run(model, feeds)["y"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("C,k", [(1, 16), (16, 1)])
def test_a_whole_k_step_keeps_its_tile(C, k):
    """16 k (1 channel x 16 taps; a 1 x 1 over 16 channels, as MobileNet-V3's, EfficientNet's and
    SqueezeNet's): one k step without padding, the mma tile where tensor cores are asked."""
    assert C * k == conv_tiles.DIRECT_K
    model, _ = _conv(C, 64, k, 4 if k > 1 else 1, 400)
    plan = plan_of(model, "cuda", batch_axis=0, tensor_cores=True)
    st = _stage(plan)
    assert st.domain == "blocks" and getattr(st.root[1].block_tiling(), "mma", False), plan.schedule.describe()
