"""The tensor-core GEMM tile (operators/tiled_mma.py) without a GPU: the plan of a Gemm or MatMul
planned for CUDA with tensor_cores takes the mma tile (a blocks stage of whole warps within 48 KiB of
shared memory); and the emitted stage kernel, run in Python (a thread per GPU thread, sync_block a
barrier, shared arrays a block's lists, the marked callable its DSL body: tests/gpu_emulator.py) gives numpy's product
for whole and ragged tiles, transposed operands, constant (prepacked) and run-time B. The CPU backend
cannot compile shared memory or barriers, so this is the one check of the tile's indexing before a
device runs it (tests/gpu/test_tensor_cores_cuda.py)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from gpu_emulator import build_dsl, kernel_name, run_plan
from onnx import TensorProto, helper, numpy_helper
from util import plan_of

from luisaml.operators import tiled_mma
from luisaml.planning import CompileOptions


def _model(op: str, M: int, K: int, N: int, ta=0, tb=0, const_b=True, bias=False, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((K, M) if ta else (M, K)).astype(np.float32)
    b = rng.standard_normal((N, K) if tb else (K, N)).astype(np.float32)
    inits, ins = {}, [helper.make_tensor_value_info("A", TensorProto.FLOAT, list(a.shape))]
    if const_b:
        inits["B"] = b
    else:
        ins.append(helper.make_tensor_value_info("B", TensorProto.FLOAT, list(b.shape)))
    names = ["A", "B"]
    attrs = {}
    if op == "Gemm":
        attrs = {"transA": ta, "transB": tb, "alpha": 0.5}
        if bias:
            inits["C"] = rng.standard_normal(N).astype(np.float32)
            names.append("C")
    node = helper.make_node(op, names, ["Y"], **attrs)
    g = helper.make_graph([node], "g", ins, [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [M, N])],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    want = (a.T if ta else a).astype(np.float64) @ (b.T if tb else b).astype(np.float64)
    if op == "Gemm":
        want = 0.5 * want + (inits["C"] if bias else 0)
    return m, {"A": a, "B": b}, want


def _plan(model):
    return plan_of(model, batch_axis=None, tensor_cores=True)


def _run_blocks(plan, feeds: dict[str, np.ndarray], out_size: int) -> np.ndarray:
    """Run the plan's one blocks stage in Python (tests/gpu_emulator.py: a thread per GPU thread, the
    marked callable its DSL body)."""
    assert [s.domain for s in plan.schedule.stages].count("blocks") == 1
    return run_plan(plan, feeds)["Y"].reshape(out_size)


@pytest.mark.parametrize("tile", ["w64", "w32", "w64r"])  # (tiled_mma.VARIANTS; "w32-first": the first tile's source)
@pytest.mark.parametrize("op,M,K,N,ta,tb,const_b,bias", [
    ("MatMul", 128, 40, 64, 0, 0, True, False),  # whole tiles, a ragged last k step, prepacked B
    ("MatMul", 100, 24, 90, 0, 0, False, False),  # ragged M and N, run-time B ("w64": 96 columns, warps of 48)
    ("Gemm", 64, 16, 96, 1, 1, True, True),  # A and B transposed, alpha and a bias row, one k step
    ("MatMul", 256, 24, 128, 0, 0, True, False),  # "w64": 4 warps of 64 x 64, A's copies one register + constants
])
def test_emitted_mma_tile_matches_numpy(op, M, K, N, ta, tb, const_b, bias, tile, monkeypatch):
    monkeypatch.setenv("LUISAML_MMA_TILE", tile)
    model, feeds, want = _model(op, M, K, N, ta, tb, const_b, bias)
    plan = _plan(model)
    (st,) = [s for s in plan.schedule.stages if s.domain == "blocks"]
    (_, operator), = st.nodes
    tl = operator.block_tiling()
    # by name: a test before this one in the worker may have imported luisaml afresh (test_artifact's
    # sys.modules purges), and this module's tiled_mma is then the older copy
    assert type(tl).__name__ == "MmaTiling" and tl.threads == st.threads and tl.shared_bytes <= 48 * 1024
    assert tl.variant == tile and tl.BN % tl.WN == 0 and tl.BM % tl.WM == 0
    assert ("mma_tf32_m16n8k8_rounded" in plan.source and "tf32_round" in plan.source if tile == "w64r"
            else "mma_tf32_m16n8k8" in plan.source)
    if const_b:
        feeds = {"A": feeds["A"]}
    got = _run_blocks(plan, feeds, M * N).reshape(M, N)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-9 * max(1.0, np.abs(want).max()))


def test_emitted_mma_tile_batched_matmul():
    """Products of a batch (bi from the block index), both operands at run time."""
    rng = np.random.default_rng(7)
    a = rng.standard_normal((2, 64, 24)).astype(np.float32)
    b = rng.standard_normal((2, 24, 64)).astype(np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["A", "B"], ["Y"])], "g",
                          [helper.make_tensor_value_info("A", TensorProto.FLOAT, [2, 64, 24]),
                           helper.make_tensor_value_info("B", TensorProto.FLOAT, [2, 24, 64])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, 64, 64])])
    plan = _plan(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    got = _run_blocks(plan, {"A": a, "B": b}, 2 * 64 * 64).reshape(2, 64, 64)
    want = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-9 * np.abs(want).max())


def test_choose_keeps_small_products_on_the_fp32_tile():
    assert tiled_mma.choose(32, 128, 64, 1) is None and tiled_mma.choose(128, 16, 64, 1) is None
    t = tiled_mma.choose(4096, 4096, 4096, 1, tile="w32")  # the first tile: 8 warps of 64 x 32
    assert (t.BM, t.BN, t.threads, t.blocks) == (128, 128, 256, 1024) and t.shared_bytes == 37888
    t = tiled_mma.choose(4096, 4096, 4096, 1, tile="w64")  # 4 warps of 64 x 64
    assert (t.BM, t.BN, t.WN, t.threads, t.blocks) == (128, 128, 64, 128, 1024) and t.shared_bytes == 37888


def test_w64_short_grids_take_warps_of_64_x_32():
    """A launch whose 128 x 128 blocks leave SMs idle: "w64" takes 64 x 32 warps (twice the warps), then
    tiled.py's smaller sides, as "w32" does."""
    for M, N in ((12544, 128), (3136, 256), (784, 512)):
        w64 = tiled_mma.choose(M, N, 1152, 1, sms=132, tile="w64")
        w32 = tiled_mma.choose(M, N, 1152, 1, sms=132, tile="w32")
        assert (w64.BM, w64.BN, w64.WN, w64.threads) == (w32.BM, w32.BN, w32.WN, w32.threads) and w64.WN == 32
    assert tiled_mma.choose(50176, 256, 64, 1, sms=132, tile="w64").WN == 64  # 784 blocks: a full grid


@pytest.mark.parametrize("N,BN,WN", [(96, 96, 48), (384, 128, 64), (192, 96, 48), (768, 128, 64), (64, 64, 64),
                                     (40, 32, 32), (1000, 128, 64)])
def test_w64_column_sides_pad_n_least(N, BN, WN):
    """"w64" picks the side of 128, 96, 64 that pads N least (ConvNeXt's 96, 192): no empty warps."""
    t = tiled_mma.choose(4096, N, 256, 1, tile="w64")
    padded = -(-N // t.BN) * t.BN
    assert (t.BN, t.WN) == (BN, WN) and t.BN % t.WN == 0 and t.threads == 32 * (t.BM // t.WM) * (t.BN // t.WN)
    assert all(padded <= -(-N // s) * s for s in (128, 96, 64) if s <= max(N, 64))


def test_without_tensor_cores_the_plan_is_the_fp32_tile():
    model, _, _ = _model("MatMul", 128, 40, 64)
    plan = plan_of(model, batch_axis=None)
    assert "mma_tf32" not in plan.source and "blocks" in [s.domain for s in plan.schedule.stages]


def test_tensor_cores_option_is_checked():
    from luisaml.errors import UsageError

    with pytest.raises(UsageError, match="tensor_cores"):
        CompileOptions(tensor_cores="yes").resolve("cuda")
    # "auto" on the CPU backend: the FP32 tiles, no self-test
    assert CompileOptions(tensor_cores="auto").resolve("cpu").tensor_cores is False


@pytest.mark.parametrize("tile", ["w64", "w64r"])
def test_emitted_mma_kernel_builds_as_dsl(tile, monkeypatch):
    """luisa-python builds the stage kernel's AST (shared arrays, the contract's local arrays passed to
    the marked callable; "w64r": tf32_round on each copied element): only the backend's compile, which
    the CPU backend cannot do for shared memory, is left out (tests/gpu_emulator.py build_dsl)."""
    monkeypatch.setenv("LUISAML_MMA_TILE", tile)
    model, _, _ = _model("MatMul", 128, 40, 64, const_b=False)
    plan = _plan(model)
    (st,) = [s for s in plan.schedule.stages if s.domain == "blocks"]
    assert len(build_dsl(plan, kernel_name(plan, st), monkeypatch)) == 1
