"""The dot form of a 1 x 1 Conv over a 1 x 1 input on CUDA (operators/conv_tiles.py's dot_tiling and
emit_dot: a warp per output channel of a sample, operators/rows.py's fold_row), without a GPU: which
Convs take it (one group, 1 x 1 kernel and input, rows.MIN_LENGTH channels or more, at most
DOT_MAX_WEIGHTS weights; the CPU plan keeps its items), and its values in tests/gpu_emulator.py
(each block's threads one at a time between warp reductions, in thread order and reversed) against
onnxruntime for a squeeze-and-excitation block (both fully connected layers, Relu and Sigmoid
epilogues), a head without bias, channel counts that leave a warp's last step ragged, output counts
that leave a block's last warps without a row, and batches of several samples."""
from __future__ import annotations

import numpy as np
import pytest
from gpu_emulator import run_plan
from onnx import TensorProto, helper, numpy_helper
from util import ort_run, plan_of

from luisaml.operators import conv_tiles, rows

RTOL = 1e-5


def _se(c: int, hw: int, squeeze: int, seed: int = 3):
    rng = np.random.default_rng(seed)
    inits = {"w1": (rng.standard_normal((squeeze, c, 1, 1)) * 0.3).astype(np.float32),
             "b1": rng.standard_normal(squeeze).astype(np.float32),
             "w2": (rng.standard_normal((c, squeeze, 1, 1)) * 0.3).astype(np.float32),
             "b2": rng.standard_normal(c).astype(np.float32)}
    nodes = [helper.make_node("GlobalAveragePool", ["x"], ["s"]),
             helper.make_node("Conv", ["s", "w1", "b1"], ["h"], name="fc1"), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Conv", ["r", "w2", "b2"], ["e"], name="fc2"), helper.make_node("Sigmoid", ["e"], ["gate"]),
             helper.make_node("Mul", ["x", "gate"], ["y"])]
    g = helper.make_graph(nodes, "se", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", c, hw, hw])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", c, hw, hw])],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _head(c: int, m: int, kernel: int = 1, size: int = 1, seed: int = 5):
    """A classifier head written as Conv, no bias: [N, c, size, size] -> [N, m, ...]."""
    w = (np.random.default_rng(seed).standard_normal((m, c, kernel, kernel)) * 0.2).astype(np.float32)
    out = size - kernel + 1
    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], name="head")], "head",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", c, size, size])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", m, out, out])],
                          [numpy_helper.from_array(w, "w")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _plan(model, backend: str = "cuda"):
    return plan_of(model, backend, batch_axis=0)


def _conv_stages(plan):
    return {n.name: (st, op) for st in plan.schedule.stages for n, op in st.nodes if n.op_type == "Conv"}


def test_which_convs_take_the_dot_form():
    """fc1 (48 -> 20) and fc2 (20 -> 48) of an SE block: a warp an output (ROWS_PER_BLOCK outputs a
    block); a Conv of fewer input channels than rows.MIN_LENGTH, a 3 x 3 kernel, a 1 x 1 kernel over a
    2 x 2 input, and a head past DOT_MAX_WEIGHTS keep their forms; the CPU plan keeps its items."""
    assert rows.MIN_LENGTH == 16  # the channel counts below straddle it
    stages = _conv_stages(_plan(_se(48, 5, 20)))
    for name, outputs in (("fc1", 20), ("fc2", 48)):
        st, op = stages[name]
        assert isinstance(op.block_tiling(), rows.RowTiling)
        assert (st.domain, st.threads, st.items) == ("blocks", rows.ROWS_PER_BLOCK * rows.WARP, -(-outputs // rows.ROWS_PER_BLOCK))
    _, op = _conv_stages(_plan(_se(48, 5, 12)))["fc2"]  # 12 input channels
    assert not isinstance(op.block_tiling(), rows.RowTiling)
    for model in (_head(32, 10, kernel=3, size=3), _head(32, 10, size=2)):
        _, op = _conv_stages(_plan(model))["head"]
        assert not isinstance(op.block_tiling(), rows.RowTiling)
    big = conv_tiles.DOT_MAX_WEIGHTS // 256 + 1
    _, op = _conv_stages(_plan(_head(256, big)))["head"]
    assert not isinstance(op.block_tiling(), rows.RowTiling)
    cpu = _plan(_se(48, 5, 20), "cpu")
    assert all(st.domain != "blocks" for st, _ in _conv_stages(cpu).values()) and "warp_active" not in cpu.source


@pytest.mark.parametrize("c,hw,squeeze,batch", [(48, 5, 20, 3), (33, 2, 17, 2), (64, 1, 16, 1), (100, 3, 7, 4)])
@pytest.mark.parametrize("reverse", [False, True])
def test_squeeze_and_excitation_against_onnxruntime(c, hw, squeeze, batch, reverse):
    """Channel counts under, at and past a warp (ragged last steps: 33, 17, 100), output counts that
    leave a block's last warps without a row (17, 33, 7 is under MIN_LENGTH for fc2's input: items)."""
    model = _se(c, hw, squeeze, seed=c + squeeze)
    plan = _plan(model)
    x = (np.random.default_rng(c).standard_normal((batch, c, hw, hw)) * 2).astype(np.float32)
    got = run_plan(plan, {"x": x}, reverse=reverse)["y"]
    want = ort_run(model, {"x": x})["y"]
    np.testing.assert_allclose(got.reshape(want.shape), want, rtol=RTOL, atol=RTOL * np.abs(want).max())


def test_head_without_bias_against_onnxruntime():
    model = _head(40, 10)
    plan = _plan(model)
    assert isinstance(_conv_stages(plan)["head"][1].block_tiling(), rows.RowTiling)
    x = np.random.default_rng(1).standard_normal((5, 40, 1, 1)).astype(np.float32)
    got = run_plan(plan, {"x": x})["y"]
    want = ort_run(model, {"x": x})["y"]
    np.testing.assert_allclose(got.reshape(want.shape), want, rtol=RTOL, atol=RTOL * np.abs(want).max())
