"""MaxPool (and its Indices), AveragePool, LpPool and the global pools against onnxruntime on random
data: 1-D, 2-D, 3-D, pads, strides, dilations, ceil_mode, count_include_pad, every auto_pad, half,
per-sample (batch) execution and the parallel stages each pool runs in. Most tests compile one
model of several nodes."""

import numpy as np
import pytest
from onnx import helper

from test_conv import model
from test_reduce import assert_compiles_per_batch, assert_runs_in_parallel
from util import assert_matches_ort, ort_run, rand, single_node_model, stage_of

import luisaml

F32 = {"rtol": 1e-5, "atol": 1e-6}


def node(op, name, ins, outs=None, **attrs):
    return helper.make_node(op, ins, outs or [name], name=name, **attrs)


def test_max_pool_variants():
    x = rand((2, 3, 7, 8), seed=1)
    x1, x3 = rand((1, 2, 9), seed=2), rand((1, 2, 5, 4, 6), seed=3)
    feeds = {"x": x, "x1": x1, "x3": x3}
    nodes = [
        node("MaxPool", "plain", ["x"], kernel_shape=[2, 2]),
        node("MaxPool", "pads_strides", ["x"], kernel_shape=[3, 3], pads=[1, 1, 1, 0], strides=[2, 2]),
        node("MaxPool", "dilated", ["x"], kernel_shape=[2, 3], dilations=[2, 2], pads=[1, 0, 1, 2]),
        node("MaxPool", "ceil", ["x"], kernel_shape=[3, 2], strides=[2, 3], ceil_mode=1),
        node("MaxPool", "ceil_pads", ["x"], kernel_shape=[3, 3], strides=[2, 3], pads=[1, 0, 1, 0], ceil_mode=1),
        node("MaxPool", "same_upper", ["x"], kernel_shape=[3, 2], strides=[2, 2], auto_pad="SAME_UPPER"),
        node("MaxPool", "same_lower", ["x"], kernel_shape=[2, 3], strides=[1, 2], auto_pad="SAME_LOWER"),
        node("MaxPool", "valid", ["x"], kernel_shape=[3, 3], strides=[2, 1], auto_pad="VALID"),
        node("MaxPool", "one_d", ["x1"], kernel_shape=[3], strides=[2], pads=[1, 1]),
        node("MaxPool", "three_d", ["x3"], kernel_shape=[2, 2, 3], strides=[1, 2, 2], pads=[0, 1, 1, 1, 0, 1]),
        node("GlobalMaxPool", "global", ["x"]),
        node("GlobalMaxPool", "global_3d", ["x3"]),
    ]
    assert_matches_ort(model(nodes, feeds), feeds, batch_axis=None, **F32)


def test_max_pool_indices():
    """The Indices output, row-major and column-major (storage_order 1), with pads and dilations."""
    x = rand((2, 3, 6, 7), seed=4)
    x3 = rand((1, 2, 4, 5, 3), seed=5)
    feeds = {"x": x, "x3": x3}
    nodes = [
        node("MaxPool", "rows", ["x"], ["rows", "rows_i"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[2, 2]),
        node("MaxPool", "cols", ["x"], ["cols", "cols_i"], kernel_shape=[2, 3], storage_order=1, dilations=[2, 1]),
        node("MaxPool", "vol", ["x3"], ["vol", "vol_i"], kernel_shape=[2, 2, 2], pads=[1, 0, 1, 0, 1, 0]),
    ]
    assert_matches_ort(model(nodes, feeds), feeds, batch_axis=None, **F32)


def test_average_pool_variants():
    x = rand((2, 3, 7, 8), seed=6)
    x1, x3 = rand((1, 2, 9), seed=7), rand((1, 2, 5, 4, 6), seed=8)
    feeds = {"x": x, "x1": x1, "x3": x3}
    nodes = [
        node("AveragePool", "plain", ["x"], kernel_shape=[2, 3]),
        node("AveragePool", "pads", ["x"], kernel_shape=[3, 3], pads=[1, 2, 1, 0], strides=[2, 2]),
        node("AveragePool", "pads_incl", ["x"], kernel_shape=[3, 3], pads=[1, 2, 1, 0], strides=[2, 2], count_include_pad=1),
        node("AveragePool", "ceil", ["x"], kernel_shape=[3, 3], strides=[2, 3], ceil_mode=1),
        node("AveragePool", "ceil_incl", ["x"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1, count_include_pad=1),
        node("AveragePool", "dilated", ["x"], kernel_shape=[2, 2], dilations=[2, 3], pads=[1, 1, 0, 1], count_include_pad=1),
        node("AveragePool", "same_upper", ["x"], kernel_shape=[3, 3], strides=[2, 2], auto_pad="SAME_UPPER"),
        node("AveragePool", "same_lower", ["x"], kernel_shape=[2, 2], auto_pad="SAME_LOWER", count_include_pad=1),
        node("AveragePool", "one_d", ["x1"], kernel_shape=[4], strides=[2], pads=[2, 1]),
        node("AveragePool", "three_d", ["x3"], kernel_shape=[2, 3, 2], strides=[2, 1, 2], pads=[1, 1, 0, 0, 1, 1]),
        node("GlobalAveragePool", "global", ["x"]),
        node("GlobalAveragePool", "global_1d", ["x1"]),
        node("LpPool", "lp2", ["x"], kernel_shape=[3, 2], strides=[2, 2], pads=[1, 0, 1, 1]),
        node("LpPool", "lp1", ["x"], kernel_shape=[2, 2], p=1),
        node("LpPool", "lp3", ["x1"], kernel_shape=[3], p=3),
        node("GlobalLpPool", "glp", ["x3"]),
    ]
    assert_matches_ort(model(nodes, feeds, opset=19), feeds, batch_axis=None, **F32)


def test_ceil_mode_window_in_the_right_pad_is_dropped():
    """onnx's shape inference keeps a last window that starts in the right pad, onnxruntime and
    onnx's reference drop it: luisaml refuses the inconsistent model, naming the rule."""
    x = rand((1, 1, 7, 8), seed=1)
    m = single_node_model("MaxPool", {"x": x}, kernel_shape=[3, 3], strides=[3, 3], pads=[1, 1, 1, 1], ceil_mode=1)
    with pytest.raises(luisaml.CompileError, match=r"\[1, 1, 3, 4\].*\[1, 1, 3, 3\].*ceil_mode drops"):
        luisaml.compile(m, batch_axis=None)


@pytest.mark.parametrize("schedule", ["stages", "per-sample"])
def test_pools_half_per_sample(schedule):
    """Half data (the sum in float), batched: parallel stages, and one thread per sample running
    the per-sample function (each pool's whole form)."""
    x = rand((3, 4, 6, 6), np.float16, seed=9)
    feeds = {"x": x}
    nodes = [
        node("MaxPool", "mx", ["x"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
        node("AveragePool", "avg", ["x"], kernel_shape=[2, 2], strides=[2, 2]),
        node("GlobalAveragePool", "gavg", ["x"]),
        node("LpPool", "lp", ["x"], kernel_shape=[3, 2], p=2),
    ]
    net, _ = assert_matches_ort(model(nodes, feeds, batch="N"), feeds, rtol=1e-3, atol=1e-3, schedule=schedule)
    assert net.batch_symbol == "N"


POOLS = [  # (op, attributes)
    ("MaxPool", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ("MaxPool", {"kernel_shape": [2, 3], "dilations": [2, 1], "ceil_mode": 1}),
    ("AveragePool", {"kernel_shape": [3, 3], "pads": [1, 2, 1, 0], "count_include_pad": 1}),
    ("AveragePool", {"kernel_shape": [2, 2], "auto_pad": "SAME_UPPER"}),
    ("LpPool", {"kernel_shape": [3, 2], "strides": [2, 2], "p": 3}),
    ("GlobalAveragePool", {}),
    ("GlobalMaxPool", {}),
    ("GlobalLpPool", {"p": 2}),
]


@pytest.mark.parametrize("op,attrs", POOLS, ids=[f"{p[0]}-{k}" for k, p in enumerate(POOLS)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
def test_pools_run_in_row_tiles(op, attrs, dtype):
    """Batched: a stage runs one work item per ROW_TILE outputs of a row (their windows), over the
    whole batch."""
    from luisaml.operators.pool import ROW_TILE

    m = single_node_model(op, {"x": rand((2, 3, 7, 6), dtype)}, batch="N", **attrs)
    tol = {"rtol": 1e-3, "atol": 1e-3} if dtype == np.float16 else F32
    net = assert_runs_in_parallel(m, f"{op}_0", lambda n: {"x": rand((n, 3, 7, 6), dtype, seed=n)}, **tol)
    st = stage_of(net, f"{op}_0")
    y = ort_run(m, {"x": rand((1, 3, 7, 6), dtype)})["y"]
    assert st.domain == "items" and st.items == y.size // y.shape[-1] * -(-y.shape[-1] // ROW_TILE)


def test_max_pool_indices_runs_one_item_per_element():
    """With Indices, MaxPool has two outputs: a stage runs one work item per output element that
    stores both. Its flat indices count the samples before, so it compiles per batch size and has
    no per-sample `forward`."""
    m = single_node_model("MaxPool", {"x": rand((2, 3, 5, 6))}, outputs=["y", "i"], batch="N",
                          kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[2, 1], storage_order=1)
    net = assert_compiles_per_batch(m, "MaxPool_0", lambda n: {"x": rand((n, 3, 5, 6), seed=n)}, **F32)
    assert stage_of(net, "MaxPool_0").domain == "items"
    assert "flat indices across the batch" in net.why
