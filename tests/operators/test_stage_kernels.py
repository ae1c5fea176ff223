"""The tiled stage forms of Gemm, MatMul and Conv (a thread per tile of outputs, prepacked
constant weights) against onnxruntime: odd shapes, column and channel tails, rows that do not
divide, groups, strides, dilations, padding (a strip's masked border path), weights as graph inputs
(not prepacked), half, integers; and that each node runs in an items stage."""

import numpy as np
from onnx import helper

from util import assert_matches_ort, graph_model, rand, stage_of

F32 = {"rtol": 1e-5, "atol": 1e-5}


def _items(net, *names):
    for name in names:
        st = stage_of(net, name)
        assert st.domain == "items" and st.root[0].name == name, st.describe()


def test_gemm_tiles_tails_and_batch():
    """N of 3, 10, 37 (column tails), 70 (blocks of 32 + tail), M of 7 (rows that do not divide
    evenly into tiles), transposes, alpha/beta, bias broadcast, a Relu epilogue; per-sample."""
    x = rand((5, 19), seed=1)
    inits = {"w3": rand((19, 3), seed=2), "w10": rand((10, 19), seed=3), "b10": rand((10,), seed=4),
             "w37": rand((19, 37), seed=5), "w70": rand((19, 70), seed=6), "b70": rand((1, 70), seed=7)}
    nodes = [
        helper.make_node("Gemm", ["x", "w3"], ["y3"], name="g3"),
        helper.make_node("Gemm", ["x", "w10", "b10"], ["h10"], name="g10", transB=1, alpha=0.5, beta=2.0),
        helper.make_node("Relu", ["h10"], ["y10"], name="relu10"),
        helper.make_node("Gemm", ["x", "w37"], ["y37"], name="g37"),
        helper.make_node("Gemm", ["x", "w70", "b70"], ["y70"], name="g70"),
    ]
    model = graph_model(nodes, {"x": x}, inits, batch="N")
    net, _ = assert_matches_ort(model, {"x": x}, **F32)
    _items(net, "g3", "g10", "g37", "g70")
    assert [n.name for n, _ in stage_of(net, "g10").epilogue] == ["relu10"]


def test_gemm_fixed_shapes_rows_and_trans_a():
    """Shapes fixed (no batch axis): M = 12 rows tiled (2 rows a tile for N = 16), transA, and B a
    graph input (read where it is, its tail columns clamped)."""
    a = rand((9, 12), seed=1)  # transA: A' is 12 x 9
    b = rand((9, 22), seed=2)
    c = rand((12, 1), seed=3)
    w = rand((9, 16), seed=4)
    nodes = [helper.make_node("Gemm", ["a", "b", "c"], ["y"], name="gin", transA=1),
             helper.make_node("Gemm", ["a", "w"], ["z"], name="gw", transA=1)]
    model = graph_model(nodes, {"a": a, "b": b, "c": c}, {"w": w})
    net, _ = assert_matches_ort(model, {"a": a, "b": b, "c": c}, batch_axis=None, **F32)
    _items(net, "gin", "gw")


def test_matmul_batched_broadcast_and_odd():
    """Batch dims broadcast on both sides, a constant batched B (prepacked per batch entry), 1-D
    operands, N = 5 and 33."""
    a = rand((2, 3, 7, 6), seed=1)
    b = rand((3, 6, 5), seed=2)
    bc = rand((3, 6, 33), seed=3)
    v = rand((6,), seed=4)
    nodes = [helper.make_node("MatMul", ["a", "b"], ["y"], name="mm"),
             helper.make_node("MatMul", ["a", "bc"], ["z"], name="mmc"),
             helper.make_node("MatMul", ["a", "v"], ["u"], name="mmv")]
    model = graph_model(nodes, {"a": a, "b": b, "v": v}, {"bc": bc})
    net, _ = assert_matches_ort(model, {"a": a, "b": b, "v": v}, batch_axis=None, **F32)
    _items(net, "mm", "mmc", "mmv")


def test_matmul_half_and_int():
    """Half (accumulated in float, rounded once; B constant and prepacked as float) and int32."""
    a = rand((4, 9), np.float16, seed=1)
    b = rand((9, 11), np.float16, seed=2)
    ai = rand((4, 9), np.int32, seed=3)
    bi = rand((9, 6), np.int32, seed=4)
    nodes = [helper.make_node("MatMul", ["a", "b"], ["y"], name="mh"),
             helper.make_node("MatMul", ["ai", "bi"], ["yi"], name="mi")]
    model = graph_model(nodes, {"a": a, "ai": ai}, {"b": b, "bi": bi})
    net, _ = assert_matches_ort(model, {"a": a, "ai": ai}, batch_axis=None, rtol=2e-3, atol=2e-3)
    _items(net, "mh", "mi")


def _conv(name, ins, **attrs):
    return helper.make_node("Conv", ins, [name], name=name, **attrs)


def test_conv_tiles_pads_strides_groups():
    """Rows of 9 (strips of 3), channel tails (M = 11, blocks of 6 with a tail), pads on every side
    (the masked border copy of the loop nest), strides, dilations, groups, depthwise, 1-D and 3-D;
    weights constant (prepacked) and a graph input (read where they are)."""
    x = rand((2, 4, 9, 11), seed=1)
    w = rand((11, 4, 3, 3), seed=2)
    b = rand((11,), seed=3)
    wg = rand((6, 2, 3, 2), seed=4)
    wd = rand((4, 1, 3, 3), seed=5)
    win = rand((5, 4, 2, 3), seed=6)
    x1, w1 = rand((2, 3, 13), seed=7), rand((10, 3, 4), seed=8)
    x3, w3 = rand((1, 2, 5, 6, 7), seed=9), rand((3, 2, 2, 3, 3), seed=10)
    nodes = [
        _conv("plain", ["x", "w", "b"]),
        _conv("pads", ["x", "w", "b"], pads=[1, 2, 1, 2]),
        _conv("strides", ["x", "w"], strides=[2, 3], pads=[1, 1, 0, 1]),
        _conv("dilated", ["x", "w", "b"], dilations=[2, 2], pads=[2, 2, 2, 2]),
        _conv("groups", ["x", "wg"], group=2, pads=[0, 1, 0, 1], strides=[1, 2]),
        _conv("depthwise", ["x", "wd"], group=4, pads=[1, 1, 1, 1]),
        _conv("input_w", ["x", "win"], pads=[0, 1, 1, 0]),
        _conv("one_d", ["x1", "w1"], pads=[2, 1], strides=[2]),
        _conv("three_d", ["x3", "w3"], pads=[1, 0, 1, 0, 1, 1]),
    ]
    feeds = {"x": x, "win": win, "x1": x1, "x3": x3}
    model = graph_model(nodes, feeds, {"w": w, "b": b, "wg": wg, "wd": wd, "w1": w1, "w3": w3})
    net, _ = assert_matches_ort(model, feeds, batch_axis=None, **F32)
    _items(net, *[n.name for n in nodes])


def test_conv_batched_relu_epilogue_and_half():
    """Per-sample stages: a Conv with its Relu as the epilogue of its tile stores, and a half Conv
    (accumulated in float)."""
    x = rand((3, 3, 8, 8), seed=1)
    w = rand((8, 3, 3, 3), seed=2)
    xh = rand((3, 2, 6, 6), np.float16, seed=3)
    wh = rand((5, 2, 3, 3), np.float16, seed=4)
    nodes = [_conv("c", ["x", "w"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["r"], name="relu"),
             _conv("ch", ["xh", "wh"], pads=[1, 0, 1, 0])]
    model = graph_model(nodes, {"x": x, "xh": xh}, {"w": w, "wh": wh}, batch="N")
    net, _ = assert_matches_ort(model, {"x": x, "xh": xh}, rtol=2e-3, atol=2e-3)
    _items(net, "c", "ch")
    assert [n.name for n, _ in stage_of(net, "c").epilogue] == ["relu"]


def test_gemm_wide_constant_layers_take_two_row_tiles():
    """A constant B with K and N of 128 or more takes 2 x 16 tiles (each B load feeds two rows)
    instead of 1 x 32: N of 256 and of 130 (12-column tiles, a tail of 2), an odd M of 5 (2-row
    tiles on the CPU, the last ragged), M of 6, transB, and a K of 127 that keeps the wide tiles."""
    from luisaml.operators.gemm import tile_shape

    assert tile_shape(6, 256, narrow=True) == (2, 16) and tile_shape(6, 256) == (1, 32)
    x5, x6 = rand((5, 128), seed=1), rand((6, 127), seed=2)
    xs = rand((6, 128), seed=7)
    inits = {"w": rand((128, 256), seed=3), "wt": rand((130, 128), seed=4), "b": rand((256,), seed=5),
             "v": rand((127, 256), seed=6)}
    nodes = [helper.make_node("Gemm", ["x5", "w", "b"], ["y"], name="gw"),
             helper.make_node("Gemm", ["xs", "w"], ["ys"], name="gs"),
             helper.make_node("Gemm", ["x5", "wt"], ["yt"], name="gt", transB=1),
             helper.make_node("Gemm", ["x6", "v"], ["yv"], name="gv")]
    feeds = {"x5": x5, "x6": x6, "xs": xs}
    model = graph_model(nodes, feeds, inits)
    net, _ = assert_matches_ort(model, feeds, rtol=1e-5, atol=1e-4)
    _items(net, "gw", "gs", "gt", "gv")
