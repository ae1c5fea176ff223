"""A warp per row on the CUDA backend (operators/rows.py): the normalizations and Softmax /
LogSoftmax as blocks stages, against onnxruntime. Rows whose length is a multiple of 32 and ragged
ones (a guard inside the lane's step), a row count that leaves the last block part empty (the row
guard), LayerNorm's Mean and InvStdDev outputs (stored by every lane), an inline input (the
residual Add before a LayerNorm), rows of large and equal values, and a softmax row of -inf. The
global pools' rows (a warp per channel, a block per channel from rows.BLOCK_LENGTH) in a
squeeze-and-excitation block at EfficientNet-B0's first size, with GlobalMaxPool's NaN and -inf;
the reductions over a contiguous plane (ReduceMean, as timm exports its squeeze, ReduceSum, ReduceMax,
ReduceMin) in the same forms; an SE block's 1 x 1 Convs over the squeezed input as a warp per output
(operators/conv_tiles.py's dot form). Each test asserts the node ran as a blocks stage (or, for rows under
rows.MIN_LENGTH, as items or elements).

    LUISAML_BACKEND=cuda python -m pytest tests/gpu/test_rows_cuda.py -q"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from util import cuda_only, ort_run

import luisaml

pytestmark = cuda_only()

RTOL = 2e-5


def _model(nodes, inputs, outputs, inits, opset=17) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, outputs, [numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 10  # the lent machine's onnxruntime reads IR 10 at most
    return m


def _vi(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _check(model, feeds, domain="blocks"):
    net = luisaml.compile(model)
    assert net.backend == "cuda"
    domains = [st.domain for st in net.plan.schedule.stages]
    assert domain in domains, domains
    got, want = net.run(feeds), ort_run(model, feeds)
    for name, w in want.items():
        scale = max(float(np.abs(w[np.isfinite(w)]).max(initial=0.0)), 1.0)
        np.testing.assert_allclose(got[name], w, rtol=RTOL, atol=RTOL * scale, err_msg=name)


@pytest.mark.parametrize("rows,length", [(64, 128), (5, 100), (7, 32), (1023, 17), (3, 1000)])
def test_layernorm_with_statistics_and_an_inline_residual(rows, length):
    rng = np.random.default_rng(rows + length)
    inits = {"g": rng.standard_normal(length).astype(np.float32), "b": rng.standard_normal(length).astype(np.float32)}
    nodes = [helper.make_node("Add", ["x", "r"], ["s"]),
             helper.make_node("LayerNormalization", ["s", "g", "b"], ["y", "mean", "inv"], axis=-1)]
    model = _model(nodes, [_vi("x", [rows, length]), _vi("r", [rows, length])],
                   [_vi("y", [rows, length]), _vi("mean", [rows, 1]), _vi("inv", [rows, 1])], inits)
    x = (rng.standard_normal((rows, length)) * 3 + 40).astype(np.float32)
    x[0] = 245.0  # a row of equal values centres to 0 exactly
    _check(model, {"x": x, "r": rng.standard_normal((rows, length)).astype(np.float32)})


@pytest.mark.parametrize("op,attrs,shape,extra", [
    ("InstanceNormalization", {}, [3, 5, 9, 7], ("scale", "B")),
    ("GroupNormalization", {"num_groups": 2}, [4, 6, 5, 5], ("scale", "bias")),
    ("LpNormalization", {"axis": -1, "p": 2}, [9, 70], ()),
    ("LpNormalization", {"axis": -1, "p": 1}, [9, 64], ()),
    ("MeanVarianceNormalization", {"axes": [2, 3]}, [2, 3, 8, 8], ()),
])
def test_other_normalizations(op, attrs, shape, extra):
    rng = np.random.default_rng(len(shape) + shape[-1])
    C = shape[1]
    per = {"InstanceNormalization": C, "GroupNormalization": attrs.get("num_groups", 1)}.get(op, C)
    inits = {k: rng.standard_normal(per).astype(np.float32) for k in extra}
    opset = 18 if op == "GroupNormalization" else 17
    model = _model([helper.make_node(op, ["x", *extra], ["y"], **attrs)], [_vi("x", shape)], [_vi("y", shape)], inits,
                   opset=opset)
    _check(model, {"x": rng.standard_normal(shape).astype(np.float32)})


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("shape,axis", [([6, 4, 32, 32], -1), ([5, 100], -1), ([3, 2, 20, 9], 2), ([10, 8], -1)])
def test_softmax_rows(op, shape, axis):
    rng = np.random.default_rng(shape[-1])
    model = _model([helper.make_node(op, ["x"], ["y"], axis=axis)], [_vi("x", shape)], [_vi("y", shape)], {})
    x = (rng.standard_normal(shape) * 20).astype(np.float32)
    if axis == -1:
        x.reshape(-1, shape[-1])[1] = 88.0  # a row of equal large values
    # a row along axis 2 (not the contiguous axis: one strided loop) takes a warp too; rows of 8
    # stay a thread each (rows.MIN_LENGTH)
    _check(model, {"x": x}, domain="items" if shape[axis] < 16 else "blocks")


def test_softmax_row_of_negative_infinity():
    x = np.zeros((4, 64), np.float32)
    x[2] = -np.inf
    x[3, 5] = np.inf
    model = _model([helper.make_node("Softmax", ["x"], ["y"], axis=-1)], [_vi("x", [4, 64])], [_vi("y", [4, 64])], {})
    net = luisaml.compile(model)
    got, want = net.run({"x": x})["y"], ort_run(model, {"x": x})["y"]
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got[:2], want[:2], rtol=RTOL)


def test_rows_of_a_per_sample_network():
    """A batch axis: the rows' blocks are per sample (block index = sample x blocks a sample + block),
    6 rows a sample leaving the second block of each sample half empty."""
    rng = np.random.default_rng(5)
    inits = {"g": rng.standard_normal(100).astype(np.float32)}
    nodes = [helper.make_node("LayerNormalization", ["x", "g"], ["n"], axis=-1),
             helper.make_node("Softmax", ["n"], ["y"], axis=-1)]
    model = _model(nodes, [_vi("x", ["N", 6, 100])], [_vi("y", ["N", 6, 100])], inits)
    net = luisaml.compile(model)
    assert [(st.domain, st.batched) for st in net.plan.schedule.stages] == [("blocks", True)] * 2
    x = (rng.standard_normal((37, 6, 100)) * 4).astype(np.float32)
    got, want = net.run({"x": x})["y"], ort_run(model, {"x": x})["y"]
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL)


def _poison(x: np.ndarray) -> None:
    """NaN as a plane's last element (the ragged tail), a plane of -inf, NaN in every other lane."""
    planes = x.reshape(x.shape[0], x.shape[1], -1)
    planes[1, 2, -1] = np.nan
    planes[2, 0, :] = -np.inf
    planes[3, 1, 1::2] = np.nan


@pytest.mark.parametrize("hw,threads", [(112, 256), (14, 128), (7, 128), (3, 1)])
def test_squeeze_and_excitation_pools(hw, threads):
    """EfficientNet-B0's squeeze sizes (112 x 112: a block of 8 warps a channel; 14 x 14 and 7 x 7: a
    warp; 3 x 3: a thread) with the SE gate after it, and GlobalMaxPool / GlobalLpPool beside it,
    at a batch of 5 (a ragged last block of warps: 3 channels x 5)."""
    rng = np.random.default_rng(hw)
    c, s = 3, 2
    inits = {"w1": (rng.standard_normal((s, c, 1, 1)) * 0.5).astype(np.float32), "b1": rng.standard_normal(s).astype(np.float32),
             "w2": (rng.standard_normal((c, s, 1, 1)) * 0.5).astype(np.float32), "b2": rng.standard_normal(c).astype(np.float32)}
    nodes = [helper.make_node("GlobalAveragePool", ["x"], ["q"], name="squeeze"),
             helper.make_node("Conv", ["q", "w1", "b1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Conv", ["r", "w2", "b2"], ["e"]), helper.make_node("Sigmoid", ["e"], ["gate"]),
             helper.make_node("Mul", ["x", "gate"], ["y"]),
             helper.make_node("GlobalMaxPool", ["x"], ["m"]), helper.make_node("GlobalLpPool", ["x"], ["lp"], p=2)]
    model = _model(nodes, [_vi("x", ["N", c, hw, hw])],
                   [_vi("y", ["N", c, hw, hw]), _vi("m", ["N", c, 1, 1]), _vi("lp", ["N", c, 1, 1])], inits)
    net = luisaml.compile(model)
    pools = [st for st in net.plan.schedule.stages if any(n.op_type.startswith("Global") for n, _ in st.nodes)]
    assert [(st.domain, st.threads) for st in pools] == [("blocks" if threads > 1 else "items", threads)] * 3
    x = (rng.standard_normal((5, c, hw, hw)) * 3).astype(np.float32)
    got, want = net.run({"x": x}), ort_run(model, {"x": x})
    for name in ("y", "lp"):
        np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=RTOL, err_msg=name)
    np.testing.assert_array_equal(got["m"], want["m"])
    _poison(x)
    np.testing.assert_array_equal(net.run({"x": x})["m"], x.max(axis=(2, 3), keepdims=True))


@pytest.mark.parametrize("hw,threads", [(112, 256), (14, 128), (3, 1)])
def test_reductions_over_a_plane(hw, threads):
    """timm's squeeze as ReduceMean over H, W (keepdims) at EfficientNet-B0's sizes (112 x 112: a block
    of 8 warps an output; 14 x 14: a warp; 3 x 3: a thread), with a Sigmoid epilogue, beside ReduceSum
    (keepdims 0) and ReduceMax / ReduceMin over the same plane, at a batch of 5; ReduceMax's NaN and
    -inf as numpy's."""
    rng = np.random.default_rng(hw + 1)
    c = 3
    nodes = [helper.make_node("ReduceMean", ["x"], ["q"], axes=[2, 3], keepdims=1),
             helper.make_node("Sigmoid", ["q"], ["y"]),
             helper.make_node("ReduceSum", ["x", "axes"], ["s"], keepdims=0),
             helper.make_node("ReduceMax", ["x"], ["m"], axes=[2, 3], keepdims=0),
             helper.make_node("ReduceMin", ["x"], ["n"], axes=[2, 3], keepdims=1)]
    model = _model(nodes, [_vi("x", ["N", c, hw, hw])],
                   [_vi("y", ["N", c, 1, 1]), _vi("s", ["N", c]), _vi("m", ["N", c]), _vi("n", ["N", c, 1, 1])],
                   {"axes": np.array([2, 3], np.int64)})
    net = luisaml.compile(model)
    red = [st for st in net.plan.schedule.stages if any(n.op_type.startswith("Reduce") for n, _ in st.nodes)]
    assert [(st.domain, st.threads) for st in red] == [("blocks" if threads > 1 else "element", threads)] * 4
    x = (rng.standard_normal((5, c, hw, hw)) * 3).astype(np.float32)
    got, want = net.run({"x": x}), ort_run(model, {"x": x})
    for name in ("y", "s"):
        scale = max(float(np.abs(want[name]).max()), 1.0)  # (as _check: the sums reach hundreds)
        np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=RTOL * scale, err_msg=name)
    for name in ("m", "n"):
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    _poison(x)
    np.testing.assert_array_equal(net.run({"x": x})["m"], x.max(axis=(2, 3)))


@pytest.mark.parametrize("c,squeeze,batch", [(1152, 48, 32), (96, 4, 5), (33, 17, 3)])
def test_squeeze_and_excitation_dot_form(c, squeeze, batch):
    """EfficientNet-B0's largest SE (1,152 -> 48 -> 1,152 at batch 32) and small ragged ones: both 1 x 1
    Convs over the squeezed 1 x 1 input as a warp per output (operators/conv_tiles.py's dot form),
    against onnxruntime."""
    from luisaml.operators import rows

    rng = np.random.default_rng(c)
    inits = {"w1": (rng.standard_normal((squeeze, c, 1, 1)) * 0.1).astype(np.float32), "b1": rng.standard_normal(squeeze).astype(np.float32),
             "w2": (rng.standard_normal((c, squeeze, 1, 1)) * 0.3).astype(np.float32), "b2": rng.standard_normal(c).astype(np.float32)}
    nodes = [helper.make_node("GlobalAveragePool", ["x"], ["q"]),
             helper.make_node("Conv", ["q", "w1", "b1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Conv", ["r", "w2", "b2"], ["e"]), helper.make_node("Sigmoid", ["e"], ["gate"]),
             helper.make_node("Mul", ["x", "gate"], ["y"])]
    model = _model(nodes, [_vi("x", ["N", c, 7, 7])], [_vi("y", ["N", c, 7, 7])], inits)
    net = luisaml.compile(model)
    convs = [op for st in net.plan.schedule.stages for n, op in st.nodes if n.op_type == "Conv"]
    # (a Conv of fewer input channels than rows.MIN_LENGTH keeps its tile: (96, 4)'s second, 4 -> 96)
    assert [isinstance(op.block_tiling(), rows.RowTiling) for op in convs] == [True, squeeze >= rows.MIN_LENGTH]
    x = rng.standard_normal((batch, c, 7, 7)).astype(np.float32)
    got, want = net.run({"x": x}), ort_run(model, {"x": x})
    np.testing.assert_allclose(got["y"], want["y"], rtol=RTOL, atol=RTOL * float(np.abs(want["y"]).max()))
