"""Conv's CPU tiles (operators/conv.py, `no_blocks`) against onnxruntime: odd rows in strips of 2
whose last one overlaps the one before, weights packed as a channel block's panels, and an
epilogue that reads another tensor (a residual Add) whose loads come before the tile's stores;
what CUDA's items form keeps (strips that divide the row) planned without a device."""
import numpy as np
from onnx import helper

from util import assert_matches_ort, graph_model, rand, stage_of, switched

import luisaml
from luisaml.runtime import analyze

F32 = {"rtol": 1e-5, "atol": 1e-5}


def _conv(name, ins, **attrs):
    return helper.make_node("Conv", ins, [name], name=name, **attrs)


def _tile(net, name):
    st = stage_of(net, name)
    return [op for nd, op in st.nodes if nd.name == name][0].tiles()


def test_odd_rows_overlap_panels_and_residual(monkeypatch):
    """Rows of 9, 7 and 49 (odd: strips of 2, the last overlapping), a residual Add and a Relu as
    the epilogue, channel tails (M = 11: blocks of O with a tail), groups, a stride-2 1-D conv over
    an odd row, a 1x1 over 7 x 7 (one tap along the row keeps strips of 1), per-sample at batch 3.
    The straight-line tiles (epilogue_loop "gelu"): the channel tiles make short rows one strip."""
    from luisaml.operators.conv import Conv

    monkeypatch.setattr(Conv, "epilogue_loop", "gelu")
    x = rand((3, 4, 9, 9), seed=1)
    w = rand((11, 4, 3, 3), seed=2)
    b = rand((11,), seed=3)
    r = rand((3, 11, 9, 9), seed=4)
    wg = rand((6, 2, 3, 3), seed=5)
    x1, w1, b1 = rand((3, 8, 99), seed=6), rand((24, 8, 3), seed=7), rand((24,), seed=8)
    x7, w7, r7 = rand((3, 16, 7, 7), seed=9), rand((40, 16, 1, 1), seed=10), rand((3, 40, 7, 7), seed=11)
    nodes = [
        _conv("c", ["x", "w", "b"], pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c", "r"], ["a"], name="add"),
        helper.make_node("Relu", ["a"], ["y"], name="relu"),
        _conv("grouped", ["x", "wg"], group=2, pads=[1, 0, 1, 2], strides=[1, 1]),
        _conv("one_d", ["x1", "w1", "b1"], strides=[2]),
        _conv("pw", ["x7", "w7"]),
        helper.make_node("Add", ["pw", "r7"], ["y7"], name="add7"),
    ]
    feeds = {"x": x, "r": r, "x1": x1, "x7": x7, "r7": r7}
    model = graph_model(nodes, feeds, {"w": w, "b": b, "wg": wg, "w1": w1, "b1": b1, "w7": w7}, batch="N")
    net, _ = assert_matches_ort(model, feeds, **F32)
    assert [n.name for n, _ in stage_of(net, "c").epilogue] == ["add", "relu"]
    one = net.network_for(3) if hasattr(net, "network_for") else net
    assert _tile(one, "c")[0] == 2 and _tile(one, "one_d")[0] == 2 and _tile(one, "grouped")[0] == 2
    assert _tile(one, "pw")[0] == 1
    # the residual's loads all come before the tile's first store
    src = one.source
    body = src[src.index("Conv 'c' (epilogue"):]
    body = body[:body.index("if stage ==")]
    last_read = max(body.rfind(f"{name}.read(") for name in ("x_r",))
    assert 0 < last_read < body.index(".write("), "a store before the residual's loads"


def test_cuda_items_form_keeps_dividing_strips():
    """Planned for CUDA (no device needed), the same odd-row Conv keeps strips that divide the row."""
    x = rand((1, 4, 9, 9), seed=1)
    model = graph_model([_conv("c", ["x", "w"], pads=[1, 1, 1, 1])], {"x": x}, {"w": rand((8, 4, 3, 3), seed=2)})
    for target, p in (("cuda", 1), ("cpu", 9)):  # the CPU: a short row is one strip (Conv.whole_rows)
        plan = analyze(model, target=target)
        ops = [op for _, op in plan.main.ops if type(op).__name__ == "Conv"]
        assert ops[0].tiles()[0] == p, target


def test_concat_read_by_conv_is_materialised_on_the_cpu():
    """A Concat a Conv reads (a skip connection, a fire module) gets a buffer on the CPU, where its
    select chain would load every input at each of the Conv's reads; CUDA keeps it inline."""
    a, b = rand((2, 3, 6, 7), seed=1), rand((2, 5, 6, 7), seed=2)
    nodes = [helper.make_node("Concat", ["a", "b"], ["cat"], name="cat", axis=1),
             _conv("c", ["cat", "w"], pads=[1, 1, 1, 1])]
    feeds = {"a": a, "b": b}
    model = graph_model(nodes, feeds, {"w": rand((4, 8, 3, 3), seed=3)}, batch="N")
    net, _ = assert_matches_ort(model, feeds, **F32)
    assert not any("Concat 'cat'" in s for s in stage_of(net, "c").inlined)
    plan = analyze(graph_model(nodes, {"a": a[:1], "b": b[:1]}, {"w": rand((4, 8, 3, 3), seed=3)}), target="cuda")
    conv_stage = [st for st in plan.schedule.stages if st.root[0].name == "c"][0]
    assert any("Concat 'cat'" in s for s in conv_stage.inlined)


def test_channel_tiles_whole_rows_against_ort_and_straight_line():
    """The CPU's channel tiles (Conv.epilogue_loop "channels": the stores through a loop over a
    position's channels; rows of up to WHOLE_ROW one strip) against onnxruntime, and bit-equal to
    the straight-line tiles ("gelu"): a 3 x 3 over rows of 9 with 20 channels (blocks of 8, the last
    ragged) and a residual Add + Relu, a 1x1 over 7 x 7 with a residual, a stride-2 3 x 3 to rows of
    7, a 4 x 4 map (16 channels a tile), rows of 24 (past WHOLE_ROW: strips of 8), a stride-2 Conv1d
    to an odd row of 45 (overlapping strips of ODD_STRIP = 4, 12 channels a tile), per-sample at batch 2."""
    from luisaml.operators.conv import Conv

    x = rand((2, 6, 9, 9), seed=1)
    feeds = {"x": x, "r": rand((2, 20, 9, 9), seed=11), "x7": rand((2, 16, 7, 7), seed=2), "r7": rand((2, 40, 7, 7), seed=12),
             "x4": rand((2, 8, 4, 4), seed=3), "x24": rand((2, 5, 24, 24), seed=4), "x1": rand((2, 6, 91), seed=13)}
    inits = {"w": rand((20, 6, 3, 3), seed=5), "b": rand((20,), seed=6), "w7": rand((40, 16, 1, 1), seed=7),
             "ws": rand((12, 6, 3, 3), seed=8), "w4": rand((32, 8, 3, 3), seed=9), "w24": rand((16, 5, 3, 3), seed=10),
             "w1": rand((24, 6, 3), seed=14)}
    nodes = [_conv("o1", ["x1", "w1"], strides=[2]),
             _conv("c", ["x", "w", "b"], pads=[1, 1, 1, 1]), helper.make_node("Add", ["c", "r"], ["a"], name="add"),
             helper.make_node("Relu", ["a"], ["y"], name="relu"),
             _conv("pw", ["x7", "w7"]), helper.make_node("Add", ["pw", "r7"], ["y7"], name="add7"),
             _conv("s2", ["x", "ws"], pads=[1, 1, 1, 1], strides=[2, 2]),
             _conv("m4", ["x4", "w4"], pads=[1, 1, 1, 1]), _conv("r24", ["x24", "w24"], pads=[1, 1, 1, 1])]
    model = graph_model(nodes, feeds, inits, batch="N")
    net, _ = assert_matches_ort(model, feeds, **F32)
    one = net.network_for(2) if hasattr(net, "network_for") else net
    tiles = {name: _tile(one, name)[:2] for name in ("c", "pw", "s2", "m4", "r24", "o1")}
    assert tiles == {"c": (9, 8), "pw": (7, 8), "s2": (5, 8), "m4": (4, 16), "r24": (8, 8), "o1": (4, 12)}, tiles
    assert "for j" in one.source
    with switched(Conv, epilogue_loop="gelu"):
        straight = luisaml.compile(model, batch_axis="auto")
    assert "for j" not in (straight.network_for(2) if hasattr(straight, "network_for") else straight).source
    got, want = net.run(feeds), straight.run(feeds)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
