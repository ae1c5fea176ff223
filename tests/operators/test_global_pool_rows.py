"""The global pools' GPU form (operators/pool.py's block_tiling, operators/rows.py), without a GPU:
the CUDA plan of a global pool over a contiguous float block of rows.MIN_LENGTH or more takes a
blocks stage (a warp per channel, or a block of rows.BLOCK_WARPS warps per channel from
rows.BLOCK_LENGTH), a shorter block and the CPU backend's plan keep the item per channel; the
kernels run in Python (tests/gpu_emulator.py: a block's threads one at a time between barriers and
warp reductions, in thread order or reversed) give onnxruntime's values (the sums in another order:
a tolerance) for short and long blocks, ragged ones (not a multiple of the warp or the block), a
channel count that leaves a block's last warps without a row, batches of several samples, an
epilogue (Sigmoid) and a squeeze-and-excitation block (GlobalAveragePool -> Conv 1 x 1 -> ReLU ->
Conv 1 x 1 -> Sigmoid -> Mul); GlobalMaxPool's NaN and -inf against numpy (this repository's rule,
tests/operators/test_nan.py: a NaN anywhere gives NaN, a channel of -inf gives -inf, where
onnxruntime's vectorised max gives -FLT_MAX)."""
from __future__ import annotations

import numpy as np
import pytest
from gpu_emulator import build_dsl, kernel_name, run_plan
from onnx import TensorProto, helper, numpy_helper
from util import ort_run, plan_of

import luisaml
from luisaml.operators import rows

RTOL = 1e-5


def _model(op: str, c: int, hw: tuple[int, ...], epilogue: bool = False, **attrs):
    nodes = [helper.make_node(op, ["x"], ["g" if epilogue else "y"], **attrs)]
    if epilogue:
        nodes.append(helper.make_node("Sigmoid", ["g"], ["y"]))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", c, *hw])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", c] + [1] * len(hw))])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _se_model(c: int, hw: int, squeeze: int, seed: int = 3):
    """A squeeze-and-excitation block as torchvision writes it: the channels' means through two 1 x 1
    convolutions gate x."""
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((squeeze, c, 1, 1)) * 0.5).astype(np.float32)
    w2 = (rng.standard_normal((c, squeeze, 1, 1)) * 0.5).astype(np.float32)
    b1, b2 = rng.standard_normal(squeeze).astype(np.float32), rng.standard_normal(c).astype(np.float32)
    nodes = [helper.make_node("GlobalAveragePool", ["x"], ["s"], name="squeeze"),
             helper.make_node("Conv", ["s", "w1", "b1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Conv", ["r", "w2", "b2"], ["e"]), helper.make_node("Sigmoid", ["e"], ["gate"]),
             helper.make_node("Mul", ["x", "gate"], ["y"])]
    inits = [numpy_helper.from_array(v, k) for k, v in {"w1": w1, "b1": b1, "w2": w2, "b2": b2}.items()]
    g = helper.make_graph(nodes, "se", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", c, hw, hw])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", c, hw, hw])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _plan(model, backend: str = "cuda"):
    return plan_of(model, backend, batch_axis=0)


def _pool_stage(plan):
    [st] = [st for st in plan.schedule.stages if any(n.op_type.startswith("Global") for n, _ in st.nodes)]
    return st


def _ort(model, x: np.ndarray) -> np.ndarray:
    return ort_run(model, {"x": x})["y"]


def test_forms_by_length_on_cuda_only(monkeypatch):
    """Under MIN_LENGTH an item per channel; from it a warp per channel (ROWS_PER_BLOCK channels a
    block); from BLOCK_LENGTH a block per channel; the CPU plan keeps the items (no warp builtins)."""
    assert (rows.MIN_LENGTH, rows.BLOCK_LENGTH, rows.BLOCK_WARPS) == (16, 1024, 8)  # the shapes below straddle them
    cases = [((3, 3), ("items", 6, 1)), ((4, 4), ("blocks", 2, rows.ROWS_PER_BLOCK * rows.WARP)),
             ((31, 33), ("blocks", 2, rows.ROWS_PER_BLOCK * rows.WARP)), ((32, 32), ("blocks", 6, 256))]
    for op in ("GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool"):
        for hw, form in cases:
            st = _pool_stage(_plan(_model(op, 6, hw)))
            assert (st.domain, st.items, st.threads) == form, (op, hw)
    cpu = _plan(_model("GlobalAveragePool", 6, (32, 32)), "cpu")
    assert _pool_stage(cpu).domain == "items" and "warp_active" not in cpu.source
    luisaml.device.current() or luisaml.device.init("cpu")
    for op, hw in (("GlobalMaxPool", (32, 32)), ("GlobalMaxPool", (5, 5)), ("GlobalLpPool", (40, 40))):
        plan = _plan(_model(op, 6, hw, epilogue=True))  # luisa's AST builder takes both forms
        assert len(build_dsl(plan, kernel_name(plan, _pool_stage(plan)), monkeypatch)) == 1


CASES = [  # (op, channels, spatial, batch, epilogue, reverse)
    # a warp a channel, ragged (25); 5 channels: the 2nd block's last 3 warps have no row
    ("GlobalAveragePool", 5, (5, 5), 3, False, False),
    ("GlobalAveragePool", 4, (8, 8), 2, True, True),  # 2 whole steps a lane; a Sigmoid epilogue
    ("GlobalAveragePool", 3, (33, 33), 2, True, False),  # a block a channel, ragged (1,089 = 4 x 256 + 65)
    ("GlobalAveragePool", 2, (32, 32), 1, False, True),  # a block a channel, whole steps
    ("GlobalAveragePool", 3, (4, 5, 6), 2, False, False),  # 3-D: 120 a channel
    ("GlobalLpPool", 3, (7, 7), 2, False, True),
    ("GlobalLpPool", 2, (36, 30), 2, True, False),
    ("GlobalMaxPool", 6, (7, 9), 2, True, True),
    ("GlobalMaxPool", 2, (40, 40), 2, False, False),
]


@pytest.mark.parametrize("op,c,hw,n,epilogue,reverse", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_blocks_give_onnxruntimes_pools(op, c, hw, n, epilogue, reverse):
    model = _model(op, c, hw, epilogue)
    plan = _plan(model)
    assert _pool_stage(plan).domain == "blocks"
    x = (np.random.default_rng(c * 100 + n).standard_normal((n, c, *hw)) * 3 + 1).astype(np.float32)
    got = run_plan(plan, {"x": x}, reverse=reverse)["y"]
    np.testing.assert_allclose(got, _ort(model, x), rtol=RTOL, atol=RTOL)


@pytest.mark.parametrize("hw,reverse", [((6, 7), False), ((33, 32), True)])
def test_max_of_nan_and_negative_infinity(hw, reverse):
    """A NaN in one lane's part of a channel (the warp's max may drop it) or in its ragged tail gives
    NaN; a channel of -inf gives -inf; +inf wins; the rest as numpy (onnxruntime agrees on those).
    (One sample of 6 channels: the emulator's block of 256 threads takes seconds a channel.)"""
    model = _model("GlobalMaxPool", 6, hw)
    plan = _plan(model)
    assert _pool_stage(plan).domain == "blocks"
    x = np.random.default_rng(7).standard_normal((1, 6, *hw)).astype(np.float32)
    flat = x.reshape(6, -1)
    flat[1, 3] = np.nan  # early in a lane
    flat[2, -1] = np.nan  # the last element: the ragged tail's
    flat[3, :] = -np.inf
    flat[4, 5] = np.inf
    flat[5, 1::2] = np.nan  # NaN in half the lanes
    got = run_plan(plan, {"x": x}, reverse=reverse)["y"]
    want = x.max(axis=(2, 3), keepdims=True)
    np.testing.assert_array_equal(got, want)
    clean = np.isfinite(want)
    np.testing.assert_array_equal(got[clean], _ort(model, x)[clean])


@pytest.mark.parametrize("hw,c,n,form", [(12, 6, 2, ("blocks", 128)), (33, 3, 1, ("blocks", 256)),
                                         (3, 6, 2, ("items", 1))])
def test_squeeze_and_excitation(hw, c, n, form):
    """The SE block's squeeze in each form; the Mul reads the gate per channel."""
    model = _se_model(c, hw, 2)
    plan = _plan(model)
    st = [st for st in plan.schedule.stages if any(nd.name == "squeeze" for nd, _ in st.nodes)][0]
    assert (st.domain, st.threads) == form
    x = np.random.default_rng(hw).standard_normal((n, c, hw, hw)).astype(np.float32)
    got = run_plan(plan, {"x": x})["y"]
    np.testing.assert_allclose(got, _ort(model, x), rtol=RTOL, atol=RTOL)


def test_the_emulator_runs_the_softmax_rows_too():
    """The warp reductions the emulator learnt for these run Softmax's warp per row as well (6 rows:
    the second block's last 2 warps have no row; rows of 50, ragged)."""
    nodes = [helper.make_node("Softmax", ["x"], ["y"], axis=-1)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 6, 50])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 6, 50])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    plan = _plan(model)
    assert [st.domain for st in plan.schedule.stages] == ["blocks"]
    x = (np.random.default_rng(4).standard_normal((2, 6, 50)) * 5).astype(np.float32)
    np.testing.assert_allclose(run_plan(plan, {"x": x}, reverse=True)["y"], _ort(model, x), rtol=RTOL, atol=1e-7)
