"""Conv's CPU tiles (operators/conv.py, `no_blocks`) against onnxruntime: odd rows in strips of 2
whose last one overlaps the one before, weights packed as a channel block's panels, and an
epilogue that reads another tensor (a residual Add) whose loads come before the tile's stores;
what CUDA's items form keeps (strips that divide the row) planned without a device."""
import numpy as np
from onnx import helper

from util import assert_matches_ort, graph_model, rand, stage_of

from luisaml.runtime import analyze

F32 = {"rtol": 1e-5, "atol": 1e-5}


def _conv(name, ins, **attrs):
    return helper.make_node("Conv", ins, [name], name=name, **attrs)


def _tile(net, name):
    st = stage_of(net, name)
    return [op for nd, op in st.nodes if nd.name == name][0].tiles()


def test_odd_rows_overlap_panels_and_residual():
    """Rows of 9, 7 and 49 (odd: strips of 2, the last overlapping), a residual Add and a Relu as
    the epilogue, channel tails (M = 11: blocks of O with a tail), groups, a stride-2 1-D conv over
    an odd row, a 1x1 over 7 x 7 (one tap along the row keeps strips of 1), per-sample at batch 3."""
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
    for target, p in (("cuda", 1), ("cpu", 2)):
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
