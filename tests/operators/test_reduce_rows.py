"""The reductions' GPU form (operators/reduce.py's Fold.block_tiling, operators/rows.py's fold_row),
without a GPU: the CUDA plan of a float ReduceMean / Sum / Max / Min / L2 / SumSquare whose reduced
elements of each output are one contiguous run of rows.MIN_LENGTH or more takes a blocks stage (a
warp per output, a block of rows.BLOCK_WARPS warps per output from rows.BLOCK_LENGTH), as the global
pools do (tests/operators/test_global_pool_rows.py); a short run, a non-trailing axis, ReduceProd and
the CPU backend's plan keep the thread per output. The kernels run in Python (tests/gpu_emulator.py)
and give onnxruntime's values (sums in another order: a tolerance) with keepdims 0 and 1, short,
long and ragged runs, batches of several samples and an epilogue (ReduceMean -> Sigmoid);
ReduceMax / ReduceMin's NaN and infinities against numpy (this repository's rule,
tests/operators/test_nan.py: a NaN anywhere gives NaN)."""
from __future__ import annotations

import numpy as np
import pytest
from gpu_emulator import build_dsl, kernel_name, run_plan
from onnx import TensorProto, helper, numpy_helper
from util import ort_run, plan_of

import luisaml
from luisaml.operators import rows
from luisaml.operators.reduce import BLOCKED_SUM

RTOL = 1e-5


def _model(op: str, shape: tuple[int, ...], axes: list[int], keepdims: int = 1, epilogue: bool = False):
    inits = []
    if op == "ReduceSum":  # axes an input from opset 13
        inits = [numpy_helper.from_array(np.array(axes, np.int64), "axes")]
        nodes = [helper.make_node(op, ["x", "axes"], ["g" if epilogue else "y"], keepdims=keepdims)]
    else:
        nodes = [helper.make_node(op, ["x"], ["g" if epilogue else "y"], axes=axes, keepdims=keepdims)]
    if epilogue:
        nodes.append(helper.make_node("Sigmoid", ["g"], ["y"]))
    out = [1 if d in axes else n for d, n in enumerate(["N", *shape], start=0)] if keepdims else \
        [n for d, n in enumerate(["N", *shape]) if d not in axes]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", *shape])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, out)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _plan(model, backend: str = "cuda"):
    return plan_of(model, backend, batch_axis=0)


def _reduce_stage(plan):
    [st] = [st for st in plan.schedule.stages if any(n.op_type.startswith("Reduce") for n, _ in st.nodes)]
    return st


def _ort(model, x: np.ndarray) -> np.ndarray:
    return ort_run(model, {"x": x})["y"]


def test_forms_by_run_on_cuda_only(monkeypatch):
    """Under MIN_LENGTH a thread per output; from it a warp per output (ROWS_PER_BLOCK outputs a
    block); from BLOCK_LENGTH a block per output; a reduced axis that is not the trailing run, a sum
    too long for a lane, ReduceProd (no warp product) and ReduceLogSumExp (two passes) keep the
    element form; the CPU plan keeps it too."""
    assert (rows.MIN_LENGTH, rows.BLOCK_LENGTH, rows.BLOCK_WARPS) == (16, 1024, 8)  # the shapes below straddle them
    warp = ("blocks", 2, rows.ROWS_PER_BLOCK * rows.WARP)
    cases = [((6, 3, 3), [2, 3], ("element", 6, 1)), ((6, 4, 4), [2, 3], warp), ((6, 31, 33), [2, 3], warp),
             ((6, 32, 32), [2, 3], ("blocks", 6, 256)), ((6, 8, 40), [3], ("blocks", 12, 128)),
             ((6, 40, 40), [1], ("element", 1600, 1)),  # the channels: a run 1,600 apart
             ((6, 40, 40), [1, 2], ("element", 40, 1))]  # C, H: not the trailing run
    for op in ("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceL2", "ReduceSumSquare", "ReduceL1",
               "ReduceLogSum"):
        for shape, axes, form in cases:
            for keepdims in (0, 1):
                st = _reduce_stage(_plan(_model(op, shape, axes, keepdims)))
                assert (st.domain, st.items, st.threads) == form, (op, shape, axes, keepdims)
    # a lane summing reduce.BLOCKED_SUM elements (4M a row) keeps the element form's blocked sum; a max has no such loss
    huge = (1, rows.BLOCK_WARPS * rows.WARP * BLOCKED_SUM)
    assert [_reduce_stage(_plan(_model(op, huge, [2]))).domain for op in ("ReduceMean", "ReduceMax")] == ["element", "blocks"]
    assert _reduce_stage(_plan(_model("ReduceProd", (6, 32, 32), [2, 3]))).domain == "element"
    assert _reduce_stage(_plan(_model("ReduceLogSumExp", (6, 32, 32), [2, 3]))).domain == "element"
    cpu = _plan(_model("ReduceMean", (6, 32, 32), [2, 3]), "cpu")
    assert _reduce_stage(cpu).domain == "element" and "warp_active" not in cpu.source
    luisaml.device.current() or luisaml.device.init("cpu")
    for op, shape in (("ReduceMean", (6, 32, 32)), ("ReduceMin", (6, 5, 5)), ("ReduceSumSquare", (6, 40, 40))):
        plan = _plan(_model(op, shape, [2, 3], epilogue=True))  # luisa's AST builder takes both forms
        assert len(build_dsl(plan, kernel_name(plan, _reduce_stage(plan)), monkeypatch)) == 1


CASES = [  # (op, shape, axes, keepdims, batch, epilogue, reverse)
    # a warp an output, ragged (25); 5 outputs: the 2nd block's last 3 warps have no row
    ("ReduceMean", (5, 5, 5), [2, 3], 1, 3, False, False),
    ("ReduceMean", (4, 8, 8), [2, 3], 0, 2, True, True),  # 2 whole steps a lane; a Sigmoid epilogue
    ("ReduceMean", (3, 33, 33), [2, 3], 0, 2, True, False),  # a block an output, ragged (1,089 = 4 x 256 + 65)
    ("ReduceMean", (2, 32, 32), [2, 3], 1, 1, False, True),  # a block an output, whole steps
    ("ReduceSum", (3, 4, 50), [3], 0, 2, False, False),  # the last axis alone, 12 outputs of 50
    ("ReduceSum", (2, 36, 30), [2, 3], 1, 2, False, True),
    ("ReduceMax", (6, 7, 9), [2, 3], 1, 2, True, True),
    ("ReduceMin", (2, 40, 40), [2, 3], 0, 2, False, False),
    ("ReduceL2", (3, 7, 7), [2, 3], 1, 2, False, True),
    ("ReduceSumSquare", (3, 2, 20), [2, 3], 0, 2, False, False),
    ("ReduceL1", (2, 5, 30), [3], 1, 1, False, False),
    ("ReduceLogSum", (2, 3, 40), [3], 0, 1, False, True),
]


@pytest.mark.parametrize("op,shape,axes,keepdims,n,epilogue,reverse", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_blocks_give_onnxruntimes_reductions(op, shape, axes, keepdims, n, epilogue, reverse):
    model = _model(op, shape, axes, keepdims, epilogue)
    plan = _plan(model)
    assert _reduce_stage(plan).domain == "blocks"
    rng = np.random.default_rng(len(CASES) * n + shape[-1])
    x = (rng.standard_normal((n, *shape)) * 3 + (4 if op == "ReduceLogSum" else 1)).astype(np.float32)
    if op == "ReduceLogSum":
        x = np.abs(x)
    got = run_plan(plan, {"x": x}, reverse=reverse)["y"]
    np.testing.assert_allclose(got, _ort(model, x), rtol=RTOL, atol=RTOL)


@pytest.mark.parametrize("op,hw,reverse", [("ReduceMax", (6, 7), False), ("ReduceMin", (6, 7), True),
                                           ("ReduceMax", (33, 32), True)])
def test_max_and_min_of_nan_and_infinities(op, hw, reverse):
    """A NaN in one lane's part of a run (the warp's max or min may drop it) or in its ragged tail
    gives NaN; a run of -inf (+inf for the min) gives it; the opposite infinity wins; the rest as
    numpy (onnxruntime agrees on those). One sample of 6 outputs: the emulator's block of 256
    threads takes seconds an output."""
    model = _model(op, (6, *hw), [2, 3], keepdims=0)
    plan = _plan(model)
    assert _reduce_stage(plan).domain == "blocks"
    x = np.random.default_rng(7).standard_normal((1, 6, *hw)).astype(np.float32)
    flat = x.reshape(6, -1)
    big = np.inf if op == "ReduceMax" else -np.inf
    flat[1, 3] = np.nan  # early in a lane
    flat[2, -1] = np.nan  # the last element: the ragged tail's
    flat[3, :] = -big
    flat[4, 5] = big
    flat[5, 1::2] = np.nan  # NaN in half the lanes
    got = run_plan(plan, {"x": x}, reverse=reverse)["y"]
    want = (np.max if op == "ReduceMax" else np.min)(x, axis=(2, 3))
    np.testing.assert_array_equal(got, want)
    clean = np.isfinite(want)
    np.testing.assert_array_equal(got[clean], _ort(model, x)[clean])


def test_timms_squeeze_and_excitation():
    """timm's SE block exports its squeeze as ReduceMean over H, W (keepdims): a warp per channel
    here, its gate (Conv -> ReLU -> Conv -> Sigmoid -> Mul) reading the means per channel."""
    c, s, hw, n = 6, 2, 12, 2
    rng = np.random.default_rng(5)
    inits = {"w1": (rng.standard_normal((s, c, 1, 1)) * 0.5).astype(np.float32), "b1": rng.standard_normal(s).astype(np.float32),
             "w2": (rng.standard_normal((c, s, 1, 1)) * 0.5).astype(np.float32), "b2": rng.standard_normal(c).astype(np.float32)}
    nodes = [helper.make_node("ReduceMean", ["x"], ["q"], axes=[2, 3], keepdims=1, name="squeeze"),
             helper.make_node("Conv", ["q", "w1", "b1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Conv", ["r", "w2", "b2"], ["e"]), helper.make_node("Sigmoid", ["e"], ["gate"]),
             helper.make_node("Mul", ["x", "gate"], ["y"])]
    vi = [helper.make_tensor_value_info(k, TensorProto.FLOAT, ["N", c, hw, hw]) for k in ("x", "y")]
    g = helper.make_graph(nodes, "se", vi[:1], vi[1:], [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    plan = _plan(model)
    st = [st for st in plan.schedule.stages if any(nd.name == "squeeze" for nd, _ in st.nodes)][0]
    assert (st.domain, st.threads) == ("blocks", 128)
    x = rng.standard_normal((n, c, hw, hw)).astype(np.float32)
    np.testing.assert_allclose(run_plan(plan, {"x": x})["y"], _ort(model, x), rtol=RTOL, atol=RTOL)
