"""Concats stored in place on the CPU (luisaml/schedule.py `_in_place`): a Concat along its first
per-sample dimension whose inputs stages store whole takes no stage; each input is stored at its
offset in the Concat's buffer (SqueezeNet's fire modules), a Concat whose inputs lie in one buffer
already is a region of it (DenseNet's layers, each concatenating all before it), an output placed
inside a larger one places its inputs there too. Against onnxruntime, with the cases that must keep
a stage: a graph input or output among the pieces, an input twice, a Concat along an inner axis."""
import numpy as np
import pytest
from onnx import helper

from util import assert_matches_ort, graph_model, rand


def _conv(name, x, w, **kw):
    return helper.make_node("Conv", [x, w], [name], name=name, **kw)


def _concat_stages(net) -> int:
    return sum(1 for st in net.plan.schedule.stages for nd, _ in st.nodes if nd.op_type == "Concat")


@pytest.mark.parametrize("batch", [1, 3])
def test_fire_module_concat_in_place(batch):
    """Two convolutions of a squeeze layer (5 and 7 channels, odd sizes) concatenated, read by a
    third convolution and a Relu; no Concat stage is left and both halves sit in one buffer."""
    nodes = [_conv("s", "x", "ws"), helper.make_node("Relu", ["s"], ["sr"], name="sr"),
             _conv("e1", "sr", "w1"), _conv("e3", "sr", "w3", pads=[1, 1, 1, 1]),
             helper.make_node("Concat", ["e1", "e3"], ["c"], name="cat", axis=1),
             _conv("y", "c", "wy"), helper.make_node("Relu", ["c"], ["r"], name="r")]
    inits = {"ws": rand((4, 3, 1, 1), seed=1), "w1": rand((5, 4, 1, 1), seed=2), "w3": rand((7, 4, 3, 3), seed=3),
             "wy": rand((6, 12, 3, 3), seed=4)}
    model = graph_model(nodes, {"x": rand((batch, 3, 9, 11))}, inits, batch="N")
    net, _ = assert_matches_ort(model, {"x": rand((batch, 3, 9, 11), seed=5)}, rtol=1e-4, atol=1e-4)
    sched = net.plan.schedule
    assert _concat_stages(net) == 0, sched.describe()
    assert sched.aliases == {"e1": ("c", 0), "e3": ("c", 5 * 9 * 11)}


@pytest.mark.parametrize("batch", [1, 2])
def test_dense_block_concats_share_one_buffer(batch):
    """DenseNet's pattern: each layer concatenates the block input and every layer's output so far
    (growth 3, odd), reads it through BatchNorm and Relu, and adds 3 channels; the last Concat's
    buffer holds them all, the earlier Concats are its regions (prefixes)."""
    c0, growth, layers = 4, 3, 4
    nodes, inits, feats = [], {}, ["x"]
    for k in range(layers):
        ch = c0 + growth * k
        cat = f"cat{k}" if k else "x"
        if k:
            nodes.append(helper.make_node("Concat", list(feats), [cat], name=cat, axis=1))
        inits |= {f"s{k}": rand((ch,), seed=10 + k, low=0.5, high=1.5), f"b{k}": rand((ch,), seed=20 + k),
                  f"m{k}": rand((ch,), seed=30 + k), f"v{k}": rand((ch,), seed=40 + k, low=0.5, high=2.0),
                  f"w{k}": rand((growth, ch, 3, 3), seed=50 + k)}
        nodes += [helper.make_node("BatchNormalization", [cat, f"s{k}", f"b{k}", f"m{k}", f"v{k}"], [f"bn{k}"], name=f"bn{k}"),
                  helper.make_node("Relu", [f"bn{k}"], [f"r{k}"], name=f"r{k}"),
                  _conv(f"y{k}", f"r{k}", f"w{k}", pads=[1, 1, 1, 1])]
        feats.append(f"y{k}")
    nodes.append(helper.make_node("Concat", list(feats), ["all"], name="all", axis=1))
    nodes.append(helper.make_node("Relu", ["all"], ["out"], name="out"))
    # the block's input is a stage's output (a graph input would keep every Concat's stage)
    nodes.insert(0, _conv("x", "x0", "wx"))
    inits["wx"] = rand((c0, 2, 1, 1), seed=7)
    model = graph_model(nodes, {"x0": rand((batch, 2, 7, 5))}, inits, batch="N")
    net, _ = assert_matches_ort(model, {"x0": rand((batch, 2, 7, 5), seed=6)}, rtol=1e-4, atol=1e-4)
    sched = net.plan.schedule
    assert _concat_stages(net) == 0, sched.describe()
    hw = 7 * 5
    assert sched.aliases["x"] == ("all", 0)
    assert sched.aliases["y2"] == ("all", (c0 + 2 * growth) * hw)
    assert sched.aliases["cat2"] == ("all", 0) and sched.aliases["cat3"] == ("all", 0)


def test_concat_placed_inside_a_larger_one():
    """A Concat whose output is itself a piece of a larger Concat, with a reader of its own: its
    inputs land in the larger one's buffer at its offset plus theirs."""
    nodes = [_conv("a", "x", "wa"), _conv("b", "x", "wb"), _conv("d", "x", "wd"),
             helper.make_node("Concat", ["a", "b"], ["ab"], name="ab", axis=1),
             helper.make_node("Exp", ["ab"], ["e"], name="e"),
             helper.make_node("Concat", ["d", "ab"], ["all"], name="all", axis=1),
             _conv("y", "all", "wy"), _conv("z", "ab", "wz")]
    inits = {"wa": rand((2, 3, 1, 1), seed=1), "wb": rand((3, 3, 1, 1), seed=2), "wd": rand((4, 3, 1, 1), seed=3),
             "wy": rand((2, 9, 1, 1), seed=4), "wz": rand((2, 5, 1, 1), seed=5)}
    model = graph_model(nodes, {"x": rand((2, 3, 4, 6))}, inits, batch="N", outputs=["y", "z", "e"])
    net, _ = assert_matches_ort(model, {"x": rand((2, 3, 4, 6), seed=6)}, rtol=1e-4, atol=1e-4)
    assert net.plan.schedule.aliases == {"d": ("all", 0), "ab": ("all", 4 * 24), "a": ("all", 4 * 24),
                                         "b": ("all", 6 * 24)}
    assert _concat_stages(net) == 0


@pytest.mark.parametrize("case", ["graph_input", "graph_output", "twice", "inner_axis", "unbatched"])
def test_concats_that_keep_their_stage(case):
    """A graph input among the pieces, the Concat a graph output, an input twice, a Concat along an
    inner axis (not its inputs end to end): each keeps its form and equals onnxruntime; a plan
    without a batch places its Concat too."""
    axis = 2 if case == "inner_axis" else 1
    shape = (1, 3, 4, 5) if case == "unbatched" else (2, 3, 4, 5)  # (unbatched: axis 1 first past a 1)
    ins = {"x": rand(shape)}
    nodes = [_conv("a", "x", "wa"), _conv("b", "x", "wb")]
    pieces = {"graph_input": ["a", "x"], "twice": ["a", "b", "a"]}.get(case, ["a", "b"])
    if case == "inner_axis":
        nodes[1] = _conv("b", "x", "wa")
    nodes.append(helper.make_node("Concat", pieces, ["c"], name="cat", axis=axis))
    outputs = ["c"] if case == "graph_output" else ["y"]
    if case != "graph_output":
        nodes.append(helper.make_node("Sigmoid", ["c"], ["y"], name="y"))
    inits = {"wa": rand((3, 3, 1, 1), seed=1), "wb": rand((2, 3, 1, 1), seed=2)}
    batch = None if case == "unbatched" else "N"
    model = graph_model(nodes, ins, inits, batch=batch, outputs=outputs)
    net, _ = assert_matches_ort(model, {"x": rand(shape, seed=3)}, rtol=1e-4, atol=1e-4,
                                batch_axis=None if batch is None else "auto")
    aliases = net.plan.schedule.aliases
    if case == "unbatched":
        assert aliases == {"a": ("c", 0), "b": ("c", 3 * 20)}
    else:
        assert not aliases, net.plan.schedule.describe()


def test_concat_pieces_read_through_views_and_by_others():
    """Pieces that other nodes read too (a Gemm over a Flatten of one, an Add of the other) and a
    Concat read through a Flatten: every reader reads the piece where it was stored."""
    nodes = [helper.make_node("Gemm", ["x", "w1"], ["a"], name="a"),
             helper.make_node("Gemm", ["x", "w2"], ["b"], name="b"),
             helper.make_node("Concat", ["a", "b"], ["c"], name="cat", axis=1),
             helper.make_node("Gemm", ["c", "w3"], ["y"], name="y"),
             helper.make_node("Gemm", ["a", "w4"], ["z"], name="z"),
             helper.make_node("Tanh", ["b"], ["t"], name="t")]
    inits = {"w1": rand((7, 19), seed=1), "w2": rand((7, 13), seed=2), "w3": rand((32, 5), seed=3),
             "w4": rand((19, 3), seed=4)}
    model = graph_model(nodes, {"x": rand((6, 7))}, inits, batch="N")
    net, _ = assert_matches_ort(model, {"x": rand((6, 7), seed=5)}, rtol=1e-4, atol=1e-4)
    assert net.plan.schedule.aliases == {"a": ("c", 0), "b": ("c", 19)}
