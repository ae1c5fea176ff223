"""CUDA's items form of a depthwise or grouped Conv (no block tiling) loads a strip's row window
once per kernel row and unrolls the taps over it (Conv.row_window): a 7-wide window over 8 outputs
is 14 loads, not 56, and each load also does the inline producers' work (here a Transpose of the
outer axes and an Add of a per-channel operand; ConvNeXt's residual Adds over Transposes of
channels-last tensors get a buffer before the Conv instead: schedule._multi_read_inlines). The CUDA plan has only items stages here, so the CPU
device runs it whole: its outputs against onnxruntime (under LUISAML_BACKEND=cuda, the GPU runs it).
The CPU's tiles of the depthwise ones take the window too (odd rows in overlapping strips of 2
included), bit-equal to the loop over taps (the same multiply-adds in the same order); a dense or
grouped Conv (several output channels a group) keeps the loop.

    LUISAML_BACKEND=cuda python -m pytest tests/operators/test_conv_row_window.py -q"""
import os

import numpy as np
import pytest
from onnx import helper

from util import graph_model, ort_run, rand, switched

import luisaml
from luisaml.runtime import _network, analyze


def _model(w, k, s, d, c, group):
    """a [N, 9, c, w], Transpose to [N, c, 9, w] (the innermost axis stays: inline in the Conv's
    reads), + b [N, c, 1, 1], then a k x k Conv of `group` groups, padded to keep the size at
    stride 1."""
    nodes = [helper.make_node("Transpose", ["a"], ["t"], perm=[0, 2, 1, 3]),
             helper.make_node("Add", ["t", "b"], ["r"]),
             helper.make_node("Conv", ["r", "w", "bias"], ["y"], group=group, pads=[k // 2 * d] * 4,
                              strides=[s, s], dilations=[d, d], name="conv")]
    inits = {"w": rand((c, c // group, k, k), seed=3, low=-0.5, high=0.5), "bias": rand((c,), seed=4)}
    return graph_model(nodes, {"a": rand((2, 9, c, w)), "b": rand((2, c, 1, 1))}, inits, batch="N")


CASES = {  # (row width, kernel, stride, dilation, channels, groups)
    "depthwise 7x7": (16, 7, 1, 1, 8, 8),  # strips of 8: 14 offsets for 56 taps x outputs
    "depthwise 3x3 stride 2": (12, 3, 2, 1, 8, 8),  # 6 outputs a row, strips of 2: offsets 0..4
    "depthwise 3x3 dilation 2": (16, 3, 1, 2, 8, 8),
    "grouped 3x3, 4 channels a group": (16, 3, 1, 1, 16, 4),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_cuda_items_conv_equals_onnxruntime(case):
    w, k, s, d, c, group = CASES[case]
    model = _model(w, k, s, d, c, group)
    plan = analyze(model, target="cuda")
    stage = next(st for st in plan.schedule.stages if st.root[0].name == "conv")
    assert stage.domain == "items", stage.describe()
    op = stage.root[1]
    P, O, _, _ = op.tiles()
    window = op.row_window(P, O)
    assert window == list(range((P - 1) * s + (k - 1) * d + 1))  # (every case has s or d of 1)
    # each offset of the window loaded once in each copy of the nest (masked and not), no loop over
    # the taps (the loop form: P loads in a loop of k taps); a loop over a group's channels stays
    assert plan.source.count("x_a.read(") == 2 * len(window), plan.source
    if os.environ.get("LUISAML_BACKEND") == "cuda":
        net = luisaml.compile(model)
        assert plan.source.count("x_a.read(") == net.source.count("x_a.read(")  # the same form
    else:
        luisaml.device.current() or luisaml.device.init("cpu")
        net = _network(plan, "cpu")
    for n in (1, 3):
        feeds = {"a": rand((n, 9, c, w), seed=n), "b": rand((n, c, 1, 1), seed=n + 10)}
        np.testing.assert_allclose(net.run(feeds)["y"], ort_run(model, feeds)["y"], rtol=1e-5, atol=1e-5)


CPU_CASES = {k: v for k, v in CASES.items() if k.startswith("depthwise")} | {
    "depthwise 7x7, odd rows (strips of 2)": (15, 7, 1, 1, 8, 8)}


@pytest.mark.parametrize("case", CPU_CASES, ids=list(CPU_CASES))
def test_cpu_tiles_take_the_window(case):
    """On the CPU backend: the window's offsets, outputs against onnxruntime and bit-equal to the
    loop over taps (Conv.cpu_row_window off)."""
    from luisaml.operators.conv import Conv

    w, k, s, d, c, group = CPU_CASES[case]
    model = _model(w, k, s, d, c, group)
    feeds = {"a": rand((3, 9, c, w), seed=5), "b": rand((3, c, 1, 1), seed=6)}
    with switched(Conv, cpu_row_window=False):
        old = luisaml.compile(model, backend="cpu")
        y_old = old.run(feeds)["y"]
    net = luisaml.compile(model, backend="cpu")
    op = next(st for st in net.plan.schedule.stages if st.root[0].name == "conv").root[1]
    P, O, _, _ = op.tiles()
    window = op.row_window(P, O)
    assert window == list(range((P - 1) * s + (k - 1) * d + 1))
    # the stage's two nests (masked and not): P loads in the loop over taps before, the window's now
    # (`forward`, one sample, sums each output's window as before)
    assert net.source.count("x_a.read(") - old.source.count("x_a.read(") == 2 * (len(window) - P)
    y = net.run(feeds)["y"]
    np.testing.assert_allclose(y, ort_run(model, feeds)["y"], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(y, y_old)


@pytest.mark.parametrize("group", [1, 4])
def test_cpu_dense_and_grouped_conv_keep_the_loop(group):
    """A 3 x 3 Conv of one group, or of 4 groups of 4 channels, on the CPU: no window (the tile
    vectorises across its channels), and it still equals onnxruntime."""
    model = _model(16, 3, 1, 1, 16, group)
    plan = analyze(model, target="cpu")
    op = next(st for st in plan.schedule.stages if st.root[0].name == "conv").root[1]
    assert op.tiles()[1] > 1 and op.row_window(*op.tiles()[:2]) == []
    feeds = {"a": rand((2, 9, 16, 16), seed=7), "b": rand((2, 16, 1, 1), seed=8)}
    np.testing.assert_allclose(luisaml.compile(model, backend="cpu").run(feeds)["y"], ort_run(model, feeds)["y"],
                               rtol=1e-5, atol=1e-5)
