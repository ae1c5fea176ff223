"""Pools in row tiles (operators/pool.py: a work item computes ROW_TILE outputs of a row, a last
strip past the row's end stores only its own) against onnxruntime at two batch sizes: output rows
shorter than, equal to and past a tile (ragged), pads, strides, dilations, ceil_mode, 1-D and 3-D,
MaxPool's Indices; MaxPool's rows-first tiles (windows that tile the row) with pads and dilations
in the outer dimensions, half, NaN against numpy; and torch's max_pool2d export (the CIFAR CNN's)
against torch."""
import numpy as np
import pytest
from onnx import helper

from stage_forms import assert_stage_forms
from test_reduce import assert_compiles_per_batch
from util import graph_model, rand, single_node_model, stage_of

import luisaml
from luisaml.operators import pool

NODES = [  # (name, op, attributes): output rows of 11, 3, 8, 22 and 6 from an input of 22 x 22
    ("max_2x2", "MaxPool", dict(kernel_shape=[2, 2], strides=[2, 2])),
    ("max_3x3_s2_pad_ceil", "MaxPool", dict(kernel_shape=[3, 3], strides=[2, 7], pads=[1, 1, 1, 1], ceil_mode=1)),
    ("max_dil", "MaxPool", dict(kernel_shape=[2, 3], strides=[3, 2], dilations=[2, 3], pads=[0, 1, 0, 0])),
    ("avg_pad", "AveragePool", dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1], count_include_pad=1)),
    ("avg_same", "AveragePool", dict(kernel_shape=[3, 2], strides=[2, 4], auto_pad="SAME_UPPER")),
    ("lp", "LpPool", dict(kernel_shape=[2, 2], strides=[1, 2], p=2)),
]


def test_the_rows_here_cover_every_tile_case():
    assert pool.ROW_TILE == 8  # rows of 3 (one short strip), 8 (one strip), 11 and 22 (ragged), 6


def test_pools_in_row_tiles_2d():
    x = rand((2, 5, 22, 22), seed=1)
    m = graph_model([helper.make_node(op, ["x"], [name], name=name, **a) for name, op, a in NODES], {"x": x}, batch="N")
    net = assert_stage_forms(m, lambda n: {"x": rand((n, 5, 22, 22), seed=n)}, [name for name, _, _ in NODES],
                             rtol=1e-5, atol=1e-6)
    assert all(stage_of(net, name).domain == "items" for name, _, _ in NODES)


def test_pools_in_row_tiles_1d_3d():
    x1, x3 = rand((2, 3, 19), seed=2), rand((2, 2, 5, 4, 13), seed=3)
    nodes = [helper.make_node("MaxPool", ["x1"], ["m1"], name="m1", kernel_shape=[3], strides=[2], pads=[1, 1]),
             helper.make_node("AveragePool", ["x1"], ["a1"], name="a1", kernel_shape=[2]),
             helper.make_node("MaxPool", ["x3"], ["m3"], name="m3", kernel_shape=[2, 2, 3], strides=[1, 2, 1]),
             helper.make_node("GlobalAveragePool", ["x3"], ["g3"], name="g3")]
    m = graph_model(nodes, {"x1": x1, "x3": x3}, batch="N")
    assert_stage_forms(m, lambda n: {"x1": rand((n, 3, 19), seed=n), "x3": rand((n, 2, 5, 4, 13), seed=n + 1)},
                       ["m1", "a1", "m3", "g3"], rtol=1e-5, atol=1e-6)


def test_max_pool_indices_in_row_tiles():
    """Both outputs stored by each of a tile's windows; a row of 12 (a ragged second strip)."""
    m = single_node_model("MaxPool", {"x": rand((2, 3, 9, 24))}, outputs=["y", "i"], batch="N",
                          kernel_shape=[3, 2], pads=[1, 0, 1, 0], strides=[1, 2])
    net = assert_compiles_per_batch(m, "MaxPool_0", lambda n: {"x": rand((n, 3, 9, 24), seed=n)}, rtol=1e-5, atol=1e-6)
    assert stage_of(net, "MaxPool_0").domain == "items"


ROWS_FIRST = [  # (name, attributes, input [C, H, W]): rows of 16, 8, 4, 28, 27 and 3 outputs
    ("rf_2x2", dict(kernel_shape=[2, 2], strides=[2, 2]), (3, 10, 32)),
    ("rf_3x2_pads", dict(kernel_shape=[3, 2], strides=[2, 2], pads=[1, 0, 1, 0]), (3, 10, 32)),
    ("rf_dil_rows", dict(kernel_shape=[2, 4], strides=[1, 4], dilations=[3, 1]), (3, 10, 32)),
    ("rf_3x3_s3", dict(kernel_shape=[3, 3], strides=[3, 3], pads=[2, 0, 0, 0]), (3, 10, 13)),
    ("rf_resnet_stem", dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]), (3, 9, 56)),  # overlapping, pads
    ("rf_squeezenet", dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1), (3, 9, 55)),  # ragged, past the row
    ("rf_wide_pad", dict(kernel_shape=[1, 5], strides=[1, 3], pads=[0, 2, 0, 4]), (3, 4, 5)),  # a span past both ends
]


def _rows_first_tile(net, name):
    st = stage_of(net, name)
    return [op for nd, op in st.nodes if nd.name == name][0].rows_first()


def test_max_pool_rows_first():
    x = {f"x{k}": rand((2, *shape), seed=k) for k, (_, _, shape) in enumerate(ROWS_FIRST)}
    nodes = [helper.make_node("MaxPool", [f"x{k}"], [name], name=name, **a) for k, (name, a, _) in enumerate(ROWS_FIRST)]
    m = graph_model(nodes, x, batch="N")
    net = assert_stage_forms(m, lambda n: {k: rand((n, *v.shape[1:]), seed=n + j) for j, (k, v) in enumerate(x.items())},
                             [name for name, _, _ in ROWS_FIRST], rtol=0, atol=0)
    assert [_rows_first_tile(net, name) for name, _, _ in ROWS_FIRST] == [8, 8, 8, 4, 8, 8, 3]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_max_pool_rows_first_nan_and_half(dtype):
    """NaN in a window gives NaN (numpy's maximum), wherever it lies in the strip; 1-D and 3-D."""
    x2 = rand((2, 3, 6, 16), dtype, seed=3)
    x2[0, 0, 1, :] = np.nan  # a whole input row: every output of the first output row
    x2[1, 2, 4, 7] = np.nan
    x2[1, 1, 5, 15] = np.nan  # the last column of the last window
    x1, x3 = rand((2, 4, 32), dtype, seed=4), rand((2, 2, 3, 4, 16), dtype, seed=5)
    x1[1, 3, 9] = np.nan
    nodes = [helper.make_node("MaxPool", ["x2"], ["y2"], name="y2", kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("MaxPool", ["x1"], ["y1"], name="y1", kernel_shape=[2], strides=[2]),
             helper.make_node("MaxPool", ["x3"], ["y3"], name="y3", kernel_shape=[2, 1, 2], strides=[1, 1, 2])]
    feeds = {"x2": x2, "x1": x1, "x3": x3}
    net = luisaml.compile(graph_model(nodes, feeds, batch="N"))
    assert [_rows_first_tile(net, n) for n in ("y2", "y1", "y3")] == [8, 8, 8]
    got = net.run(feeds)
    # numpy's max propagates NaN; y3's windows: depth d and d + 1, one row, two columns
    pairs = x3.reshape(2, 2, 3, 4, 8, 2).max(axis=5)
    want = {"y2": x2.reshape(2, 3, 3, 2, 8, 2).max(axis=(3, 5)), "y1": x1.reshape(2, 4, 16, 2).max(axis=3),
            "y3": np.maximum(pairs[:, :, :2], pairs[:, :, 1:])}
    for k, w in want.items():
        assert got[k].dtype == dtype
        np.testing.assert_array_equal(got[k], w.astype(dtype), err_msg=k)


def test_torch_max_pool2d_export():
    """The CIFAR CNN's pool after a Relu, exported by torch, against torch at two batch sizes."""
    torch = pytest.importorskip("torch")
    import io

    import onnx

    mod = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.MaxPool2d(2))
    buf = io.BytesIO()
    torch.onnx.export(mod, (torch.randn(2, 16, 32, 32),), buf, input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "n"}}, dynamo=False)
    net = luisaml.compile(onnx.load_from_string(buf.getvalue()))
    for n in (1, 3):
        x = torch.randn(n, 16, 32, 32)
        np.testing.assert_array_equal(net.run({"x": x.numpy()})["y"], mod(x).numpy())


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_global_pools_in_lanes(dtype):
    """Global pools over a spatial block of 32 or more take the reductions' lanes (a 7 x 7 block:
    a tail of 1; 40 x 40), a block of 25 the window loops; against onnxruntime in stages at two
    batch sizes, and GlobalMaxPool's NaN (in a lane, in the tail) against numpy."""
    tol = {"rtol": 2e-3, "atol": 2e-3} if dtype == np.float16 else {"rtol": 1e-5, "atol": 1e-6}
    shapes = {"a": (4, 7, 7), "b": (3, 40, 40), "c": (2, 5, 5)}
    nodes = [helper.make_node(op, [k], [f"{op}_{k}"], name=f"{op}_{k}", **({"p": 2} if op == "GlobalLpPool" else {}))
             for k in shapes for op in ("GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool")]
    feeds_at = lambda n: {k: rand((n, *v), dtype, seed=n + j) for j, (k, v) in enumerate(shapes.items())}  # noqa: E731
    m = graph_model(nodes, feeds_at(2), batch="N")
    net = assert_stage_forms(m, feeds_at, [nd.name for nd in nodes], **tol)
    lanes = {nd.name: [op for n_, op in stage_of(net, nd.name).nodes if n_.name == nd.name][0].global_lanes() for nd in nodes}
    assert lanes == {nd.name: not nd.name.endswith("_c") for nd in nodes}
    x = rand((2, 4, 7, 7), dtype, seed=9)
    x[0, 1, 3, 3], x[1, 2, 6, 6] = np.nan, np.nan  # element 24 (a lane) and 48 (the tail)
    got = net.run({"a": x, "b": rand((2, 3, 40, 40), dtype), "c": rand((2, 2, 5, 5), dtype)})["GlobalMaxPool_a"]
    np.testing.assert_array_equal(got, x.max(axis=(2, 3), keepdims=True))
