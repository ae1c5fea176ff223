"""TopK's GPU forms for long lines, without a GPU: the chunks and merge (operators/topk_chunks.py, two
phases) and the block per line (operators/topk_block.py, LUISAML_TOPK=block). The CUDA plan
of a line of at least MIN_LENGTH takes them, a shorter line and the CPU backend's plan keep the item
per line (the CPU's source the same under either switch), and the kernels run in Python
(tests/gpu_emulator.py: a block's threads one at a time between barriers and warp reductions, in
thread order or reversed) give onnxruntime's values and indices: largest and smallest, many equal
values (the lower index first), NaN, +-inf, -0 and subnormals, k from 1 to the whole line, ragged
lines and chunks, several lines along a middle axis, int64, float16, batched samples."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from gpu_emulator import build_dsl, kernel_name, run_plan
from onnx import TensorProto, helper, numpy_helper
from util import plan_of

import luisaml
from luisaml.operators import topk_block, topk_chunks

FORMS = ("chunks", "block")


def _model(shape, axis: int, k: int, largest: int, dtype=np.float32):
    elem = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16, np.int64: TensorProto.INT64}[dtype]
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


def test_long_lines_take_chunks_and_a_merge_on_cuda_only(monkeypatch):
    n = topk_block.MIN_LENGTH
    cuda = _plan(_model((3, 80000), -1, 64, 1), "cuda")
    tiling = topk_chunks.choose(3, 80000, 64, luisaml.dtypes.FLOAT)
    assert (tiling.share, tiling.chunks, tiling.lists) == (9, 278, 9)  # 288 elements a chunk, 9 lists a lane
    assert [(st.domain, st.items, st.threads, st.phase) for st in cuda.schedule.stages] == [
        ("blocks", 3 * 278, 32, 0), ("blocks", 3, 32, 1)]
    assert cuda.kernel_scratch == {"float": 3 * 278 * 64, "int": 3 * 278 * 64}
    assert "sync_block()" in cuda.source and "warp_active_max" in cuda.source and "Shared_" not in cuda.source
    [st] = _plan(_model((4, n - 1), -1, 4, 1), "cuda").schedule.stages  # short lines: a thread each
    assert (st.domain, st.items, st.threads) == ("items", 4, 1)
    luisaml.device.current() or luisaml.device.init("cpu")
    for model in (_model((3, 80000), -1, 64, 1), _model((2, n, 3), 1, 4, 0, np.int64)):  # luisa's AST builder takes them
        plan = _plan(model, "cuda")
        for st in plan.schedule.stages:
            assert len(build_dsl(plan, kernel_name(plan, st), monkeypatch)) == 1
    cpu = _plan(_model((3, 80000), -1, 64, 1), "cpu")
    assert [(s.domain, s.items) for s in cpu.schedule.stages] == [("items", 3)] and "sync_block" not in cpu.source
    monkeypatch.setenv("LUISAML_TOPK", "block")  # the switch leaves the CPU's plan as it was
    assert _plan(_model((3, 80000), -1, 64, 1), "cpu").source == cpu.source


def test_long_lines_take_a_block_each_on_cuda_only(monkeypatch):
    monkeypatch.setenv("LUISAML_TOPK", "block")
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
    """Small integers (many ties), a few NaNs, infinities, -0 and subnormals (between 0 and the
    numbers: fast math would flush them) where float."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-6, 7, n).astype(dtype)
    if dtype == np.float32:
        for value, count in ((np.nan, 12), (np.inf, 5), (-np.inf, 5), (-0.0, 5), (1e-45, 3), (-1e-45, 3), (1e-40, 2)):
            x[rng.choice(n, count, replace=False)] = value
    return x


CASES = [  # (shape, axis, k, largest, dtype, reverse); chunks: 32 x S elements, C a line, G = C / 32 lists a lane
    ((1, 1100), -1, 17, 1, np.float32, False),  # ragged: 1100 = 34 x 32 + 12; S = 2, C = 18, the last chunk 12
    ((1, 1100), -1, 17, 0, np.float32, True),
    ((2, 1500, 2), 1, 1, 1, np.float32, False),  # 4 lines a stride of 2 apart
    ((2, 1500), -1, 30, 0, np.float32, False),
    ((1, 1024), -1, 24, 1, np.int64, True),  # whole steps and chunks (S = 1, C = 32); integers, ties only
    ((1, 2100), -1, 3, 1, np.float32, False),  # 64 threads, ragged; C = 33: G = 2, one lane's second list
]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shape,axis,k,largest,dtype,reverse", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_blocks_give_onnxruntimes_topk(shape, axis, k, largest, dtype, reverse, form, monkeypatch):
    monkeypatch.setenv("LUISAML_TOPK", form)
    model = _model(shape, axis, k, largest, dtype)
    x = _line(int(np.prod(shape)), seed=k, dtype=dtype).reshape(shape)
    if dtype == np.float32:  # NaNs among the first picks of largest=1, the last of largest=0
        x.reshape(-1)[[3, 7]] = np.nan
    plan = _plan(model, "cuda")
    n = shape[axis]
    if form == "block":
        [st] = plan.schedule.stages
        assert st.domain == "blocks" and st.threads == topk_block.choose(1, n).threads
        assert n % st.threads != 0 or n == 1024  # ragged but the one case of whole steps
    else:
        assert [(st.domain, st.threads) for st in plan.schedule.stages] == [("blocks", 32)] * 2
    got = run_plan(plan, {"x": x}, reverse=reverse)
    want_v, want_i = _ort(model, x)
    np.testing.assert_array_equal(got["i"], want_i)
    np.testing.assert_array_equal(got["v"], want_v.astype(np.float64))  # NaN where NaN (assert_array_equal)


@pytest.mark.parametrize("form", FORMS)
def test_blocks_of_a_batched_stage(form, monkeypatch):
    """The batch axis N: a block per line (or chunk) of each sample (3 samples of 2 lines)."""
    monkeypatch.setenv("LUISAML_TOPK", form)
    model = _model(("N", 2, 1100), -1, 5, 1)
    plan = plan_of(model)
    want_stages = [("blocks", 2, True)] if form == "block" else [("blocks", 2 * 18, True), ("blocks", 2, True)]
    assert [(st.domain, st.items, st.batched) for st in plan.schedule.stages] == want_stages
    x = _line(3 * 2 * 1100, seed=5).reshape(3, 2, 1100)
    got = run_plan(plan, {"x": x})
    want_v, want_i = _ort(model, x)
    np.testing.assert_array_equal(got["i"], want_i)
    np.testing.assert_array_equal(got["v"], want_v.astype(np.float64))


@pytest.mark.parametrize("n,k,largest,dtype,reverse", [
    (100, 100, 1, np.float32, False),  # k the whole line: every chunk's every element through the merge
    (100, 100, 0, np.int64, True),
    (70, 1, 0, np.float32, True),  # k = 1; 3 chunks, the last of 6
    (2112, 3, 1, np.int64, False),  # 33 whole chunks: lanes 1-31 have no second list; lane 0 merges lists 0 and 32, both led by a 6
])
def test_chunks_from_one_pick_to_the_whole_line(n, k, largest, dtype, reverse, monkeypatch):
    """k from 1 to the line's length, on lines short enough to emulate (MIN_LENGTH lowered: the
    chunks are 32 long, a lane an element each), and a merge of two lists a lane."""
    monkeypatch.setattr(topk_block, "MIN_LENGTH", 64)
    model = _model((2, n), -1, k, largest, dtype)
    x = _line(2 * n, seed=n + k, dtype=dtype).reshape(2, n)
    plan = _plan(model, "cuda")
    chunks = topk_chunks.choose(2, n, k, luisaml.dtypes.FLOAT).chunks
    assert chunks == -(-n // (32 if n <= 1024 else 64))
    assert [(st.domain, st.items) for st in plan.schedule.stages] == [("blocks", 2 * chunks), ("blocks", 2)]
    got = run_plan(plan, {"x": x}, reverse=reverse)
    want_v, want_i = _ort(model, x)
    np.testing.assert_array_equal(got["i"], want_i)
    np.testing.assert_array_equal(got["v"], want_v.astype(np.float64))


def test_chunks_of_half_values():
    """float16 values ranked through float (exact), stored back as half: NaN, -0 and half's
    subnormals among the smallest picks."""
    model = _model((1, 1100), -1, 12, 0, np.float16)
    x = np.random.default_rng(1).integers(1, 7, (1, 1100)).astype(np.float16)
    x[0, [5, 9, 700]] = [np.nan, -0.0, 0.0]
    x[0, [11, 400, 1090]] = np.float16(6e-8), np.float16(-6e-8), np.float16(-1e-5)
    plan = _plan(model, "cuda")
    assert [st.domain for st in plan.schedule.stages] == ["blocks", "blocks"]
    got = run_plan(plan, {"x": x}, extra={"half": lambda v: float(np.float16(v))})  # (the emulator computes in float64)
    want_v, want_i = _ort(model, x)
    np.testing.assert_array_equal(got["i"], want_i)
    np.testing.assert_array_equal(got["v"], want_v.astype(np.float64))


def test_order_key_orders_floats_as_topk():
    """dsl_lib.order_key (run as Python, as the emulator runs it) against numpy's order of float32:
    strictly increasing over sorted distinct values, -0 equal to +0, every NaN (either sign, any
    payload) one key above +inf."""
    from gpu_emulator import Emulator

    from luisaml.shaders import dsl_lib

    key = Emulator(dsl_lib).function(dsl_lib.order_key)
    bits = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF], np.uint32)  # NaNs
    nans = [key(float(v)) for v in bits.view(np.float32)]
    assert nans == [2**31 - 1] * 4
    finite = np.array([-np.inf, -3.4e38, -1.0, -1e-38, -1e-40, -1e-45, 0.0, 1e-45, 1e-40, 1e-38, 1.0, 3.4e38, np.inf],
                      np.float32)
    keys = [key(float(v)) for v in finite]
    assert keys == sorted(keys) and len(set(keys)) == len(keys) and key(-0.0) == key(0.0) == 0
    assert max(keys) < nans[0]
