"""TopK's GPU form for long lines (operators/topk_block.py), without a GPU: the CUDA plan of a line
of at least MIN_LENGTH takes a blocks stage (a block per line), a shorter line and the CPU backend's
plan keep the item per line, and the blocks kernel run in Python (tests/gpu_emulator.py: a block's
threads one at a time between barriers, in thread order or reversed) gives onnxruntime's values and
indices: largest and smallest, many equal values (the lower index first), NaN and +-inf, k from 1 to
a few dozen, ragged lines (not a multiple of the block), several lines along a middle axis."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from gpu_emulator import build_dsl, kernel_name, run_plan
from onnx import TensorProto, helper, numpy_helper
from util import plan_of

import luisaml
from luisaml.operators import topk_block


def _model(shape, axis: int, k: int, largest: int, dtype=np.float32):
    elem = TensorProto.FLOAT if dtype == np.float32 else TensorProto.INT64
    out = list(shape)
    out[axis] = k
    node = helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=axis, largest=largest)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", elem, list(shape))],
                          [helper.make_tensor_value_info("v", elem, out),
                           helper.make_tensor_value_info("i", TensorProto.INT64, out)],
                          [numpy_helper.from_array(np.array([k], np.int64), "k")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 11)])


def _plan(model, backend: str):
    return plan_of(model, backend, batch_axis=None)


def test_long_lines_take_a_block_each_on_cuda_only(monkeypatch):
    n = topk_block.MIN_LENGTH
    cuda = _plan(_model((3, 80000), -1, 64, 1), "cuda")
    [st] = cuda.schedule.stages
    assert (st.domain, st.items, st.threads) == ("blocks", 3, topk_block.MAX_THREADS)
    assert "sync_block()" in cuda.source
    [st] = _plan(_model((2, n, 3), 1, 4, 0), "cuda").schedule.stages  # 6 lines along the middle axis
    assert (st.domain, st.items, st.threads) == ("blocks", 6, topk_block.WARP)
    [st] = _plan(_model((4, n - 1), -1, 4, 1), "cuda").schedule.stages  # short lines: a thread each
    assert (st.domain, st.items, st.threads) == ("items", 4, 1)
    luisaml.device.current() or luisaml.device.init("cpu")
    for model in (_model((3, 80000), -1, 64, 1), _model((2, n, 3), 1, 4, 0, np.int64)):  # luisa's AST builder takes it
        plan = _plan(model, "cuda")
        assert len(build_dsl(plan, kernel_name(plan, plan.schedule.stages[0]), monkeypatch)) == 1
    cpu = _plan(_model((3, 80000), -1, 64, 1), "cpu")
    assert [(s.domain, s.items) for s in cpu.schedule.stages] == [("items", 3)] and "sync_block" not in cpu.source


def _ort(model, x: np.ndarray):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})


def _line(n: int, seed: int, dtype=np.float32) -> np.ndarray:
    """Small integers (many ties), a few NaNs and infinities where float."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-6, 7, n).astype(dtype)
    if dtype == np.float32:
        x[rng.choice(n, 12, replace=False)] = np.nan
        x[rng.choice(n, 5, replace=False)] = np.inf
        x[rng.choice(n, 5, replace=False)] = -np.inf
    return x


CASES = [  # (shape, axis, k, largest, dtype, reverse)
    ((1, 1100), -1, 17, 1, np.float32, False),  # ragged: 1100 = 34 x 32 + 12
    ((1, 1100), -1, 17, 0, np.float32, True),
    ((2, 1500, 2), 1, 1, 1, np.float32, False),  # 4 lines a stride of 2 apart
    ((2, 1500), -1, 30, 0, np.float32, False),
    ((1, 1024), -1, 24, 1, np.int64, True),  # whole steps; integers, ties only
    ((1, 2100), -1, 3, 1, np.float32, False),  # 64 threads, ragged
]


@pytest.mark.parametrize("shape,axis,k,largest,dtype,reverse", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_blocks_give_onnxruntimes_topk(shape, axis, k, largest, dtype, reverse):
    model = _model(shape, axis, k, largest, dtype)
    x = _line(int(np.prod(shape)), seed=k, dtype=dtype).reshape(shape)
    if dtype == np.float32:  # NaNs among the first picks of largest=1, the last of largest=0
        x.reshape(-1)[[3, 7]] = np.nan
    plan = _plan(model, "cuda")
    [st] = plan.schedule.stages
    n = shape[axis]
    assert st.domain == "blocks" and st.threads == topk_block.choose(1, n).threads
    assert n % st.threads != 0 or n == 1024  # ragged but the one case of whole steps
    got = run_plan(plan, {"x": x}, reverse=reverse)
    want_v, want_i = _ort(model, x)
    np.testing.assert_array_equal(got["i"], want_i)
    np.testing.assert_array_equal(got["v"], want_v.astype(np.float64))  # NaN where NaN (assert_array_equal)


def test_blocks_of_a_batched_stage():
    """The batch axis N: a block per line of each sample (3 samples of 2 lines)."""
    model = _model(("N", 2, 1100), -1, 5, 1)
    plan = plan_of(model)
    [st] = plan.schedule.stages
    assert (st.domain, st.items, st.batched) == ("blocks", 2, True)
    x = _line(3 * 2 * 1100, seed=5).reshape(3, 2, 1100)
    got = run_plan(plan, {"x": x})
    want_v, want_i = _ort(model, x)
    np.testing.assert_array_equal(got["i"], want_i)
    np.testing.assert_array_equal(got["v"], want_v.astype(np.float64))
