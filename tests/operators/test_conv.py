"""Conv and ConvTranspose against onnxruntime on random data: 1-D, 2-D and 3-D, groups, dilations,
pads, strides, every auto_pad, output_padding and output_shape, bias or none, weights as inputs
and in the weight blob, half, and per-sample (batch) execution. Each test compiles one model of
several nodes, so one kernel checks many configurations."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from util import assert_matches_ort, rand, single_node_model, value_info

import luisaml

F32 = {"rtol": 1e-5, "atol": 1e-5}


def model(nodes, feeds, inits=None, opset=18, batch=None):
    """Return a model of `nodes` with graph inputs `feeds` (first dim `batch` if given)."""
    ins = []
    for k, v in feeds.items():
        shape = list(v.shape)
        if batch:
            shape[0] = batch
        ins.append(value_info(k, v.dtype, shape))
    read = {i for n in nodes for i in n.input}
    outs = [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for n in nodes for o in n.output if o and o not in read]
    inits = [numpy_helper.from_array(v, k) for k, v in (inits or {}).items()]
    m = helper.make_model(helper.make_graph(nodes, "conv_test", ins, outs, inits), opset_imports=[helper.make_opsetid("", opset)])
    inferred = onnx.shape_inference.infer_shapes(m)
    typed = {vi.name: vi for vi in list(inferred.graph.input) + list(inferred.graph.value_info)}
    producer = {o: n for n in nodes for o in n.output}

    def like(name):  # onnx leaves some function ops untyped: their Y is typed like their X
        vi = typed.get(name)
        return vi.type if vi is not None and vi.type.tensor_type.elem_type else like(producer[name].input[0])

    for vi in inferred.graph.output:
        if not vi.type.tensor_type.elem_type:
            vi.type.CopyFrom(like(vi.name))
    del m.graph.output[:]
    m.graph.output.extend(inferred.graph.output)
    return m


def conv(name, ins, **attrs):
    return helper.make_node("Conv", ins, [name], name=name, **attrs)


def convt(name, ins, **attrs):
    return helper.make_node("ConvTranspose", ins, [name], name=name, **attrs)


def test_conv_2d_variants():
    """Pads, strides, dilations, groups, every auto_pad, bias or none: one kernel."""
    x = rand((2, 4, 7, 6), seed=1)
    w = rand((6, 4, 3, 3), seed=2)
    wg = rand((6, 2, 3, 2), seed=3)  # group 2
    wd = rand((4, 1, 3, 3), seed=4)  # depthwise
    b = rand((6,), seed=5)
    feeds = {"x": x, "w": w, "wg": wg, "wd": wd, "b": b}
    nodes = [
        conv("plain", ["x", "w"]),
        conv("bias_pads", ["x", "w", "b"], pads=[1, 2, 0, 1]),
        conv("strides", ["x", "w", "b"], strides=[2, 3], pads=[1, 1, 1, 1]),
        conv("dilated", ["x", "w"], dilations=[2, 1], pads=[2, 0, 1, 1]),
        conv("groups", ["x", "wg", "b"], group=2, pads=[0, 1, 0, 1], strides=[1, 2]),
        conv("depthwise", ["x", "wd"], group=4, pads=[1, 1, 1, 1]),
        conv("same_upper", ["x", "w", "b"], auto_pad="SAME_UPPER", strides=[2, 2]),
        conv("same_lower", ["x", "w"], auto_pad="SAME_LOWER", strides=[2, 1]),
        conv("valid", ["x", "w", "b"], auto_pad="VALID", strides=[1, 2]),
    ]
    assert_matches_ort(model(nodes, feeds), feeds, batch_axis=None, **F32)


def test_conv_1d_and_3d():
    x1, w1, b1 = rand((1, 3, 11), seed=1), rand((5, 3, 4), seed=2), rand((5,), seed=3)
    x3, w3 = rand((1, 4, 5, 4, 6), seed=4), rand((4, 2, 2, 3, 2), seed=5)
    feeds = {"x1": x1, "w1": w1, "b1": b1, "x3": x3, "w3": w3}
    nodes = [
        conv("c1", ["x1", "w1", "b1"], pads=[2, 1], strides=[2], dilations=[2]),
        conv("c1_same", ["x1", "w1"], auto_pad="SAME_UPPER", strides=[2]),
        conv("c3", ["x3", "w3"], group=2, pads=[1, 0, 1, 0, 1, 1], strides=[1, 2, 2]),
        conv("c3_lower", ["x3", "w3"], group=2, auto_pad="SAME_LOWER", strides=[2, 1, 3]),
    ]
    assert_matches_ort(model(nodes, feeds), feeds, batch_axis=None, **F32)


def test_conv_weights_in_blob_per_sample():
    """Weights as initializers; the batch dimension symbolic, so one thread per sample."""
    x = rand((3, 3, 8, 8), seed=1)
    inits = {"w": rand((4, 3, 3, 3), seed=2), "b": rand((4,), seed=3)}
    m = single_node_model("Conv", {"x": x}, initializers=inits, batch="N", pads=[1, 1, 1, 1], strides=[2, 2])
    net, _ = assert_matches_ort(m, {"x": x}, **F32)
    assert net.batch_symbol == "N"
    assert "weights.read" in net.source


def test_conv_half_accumulates_in_float():
    x = rand((1, 8, 5, 5), np.float16, seed=1)
    w = rand((3, 8, 3, 3), np.float16, seed=2)
    b = rand((3,), np.float16, seed=3)
    m = single_node_model("Conv", {"x": x, "w": w, "b": b}, pads=[1, 1, 1, 1])
    # onnxruntime's half Conv rounds differently; the float result rounded to half is the reference
    want = _ort_float(m, {"x": x, "w": w, "b": b})
    got = luisaml.compile(m, batch_axis=None).run({"x": x, "w": w, "b": b})["y"]
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float16).astype(np.float32), rtol=1e-3, atol=1e-3)


def _ort_float(m16, feeds):
    """Run a half model in onnxruntime in float32 (inputs widened)."""
    from util import ort_run

    m = onnx.ModelProto()
    m.CopyFrom(m16)
    for vi in list(m.graph.input) + list(m.graph.output):
        vi.type.tensor_type.elem_type = TensorProto.FLOAT
    return ort_run(m, {k: v.astype(np.float32) for k, v in feeds.items()})["y"]


def test_conv_transpose_variants():
    """Strides, pads, output_padding, output_shape, auto_pad, dilations and groups: one kernel."""
    x = rand((2, 4, 3, 4), seed=1)
    w = rand((4, 3, 3, 3), seed=2)
    wg = rand((4, 2, 2, 3), seed=3)  # group 2: 4 output channels
    b = rand((3,), seed=4)
    bg = rand((4,), seed=5)
    feeds = {"x": x, "w": w, "wg": wg, "b": b, "bg": bg}
    nodes = [
        convt("plain", ["x", "w"]),
        convt("strided", ["x", "w", "b"], strides=[2, 3], pads=[1, 0, 0, 2]),
        convt("out_pad", ["x", "w", "b"], strides=[3, 2], output_padding=[2, 1]),
        convt("out_shape", ["x", "w"], strides=[2, 2], output_shape=[8, 9]),
        convt("same_upper", ["x", "w", "b"], strides=[2, 2], auto_pad="SAME_UPPER"),
        convt("same_lower", ["x", "w"], strides=[2, 3], auto_pad="SAME_LOWER"),
        convt("dilated", ["x", "w"], dilations=[2, 3], pads=[1, 1, 2, 0]),
        convt("groups", ["x", "wg", "bg"], group=2, strides=[2, 1], dilations=[1, 2]),
    ]
    assert_matches_ort(model(nodes, feeds), feeds, batch_axis=None, **F32)


def test_conv_transpose_1d_3d_per_sample():
    x1, w1 = rand((2, 2, 5), seed=1), rand((2, 3, 3), seed=2)
    x3, w3 = rand((2, 2, 3, 2, 3), seed=3), rand((2, 2, 2, 2, 2), seed=4)
    feeds = {"x1": x1, "x3": x3}
    nodes = [
        convt("t1", ["x1", "w1"], strides=[3], pads=[1, 1], output_padding=[1]),
        convt("t3", ["x3", "w3"], strides=[2, 1, 2], pads=[0, 1, 0, 1, 0, 1]),
    ]
    m = model(nodes, feeds, {"w1": w1, "w3": w3}, batch="N")
    net, _ = assert_matches_ort(m, feeds, **F32)
    assert net.batch_symbol == "N"


def test_conv_errors_name_the_node():
    x, w = rand((1, 4, 5, 5)), rand((2, 3, 3, 3))
    node = helper.make_node("Conv", ["x", "w"], ["y"], name="bad_conv")
    graph = helper.make_graph(
        [node], "g", [value_info("x", x.dtype, x.shape), value_info("w", w.dtype, w.shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 3, 3])],
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    with pytest.raises(luisaml.CompileError, match=r"bad_conv.*W\[1\] = 4"):
        luisaml.compile(m, batch_axis=None)
    xi = rand((1, 4, 5, 5), np.int32)
    m = single_node_model("Conv", {"x": xi, "w": rand((2, 4, 3, 3), np.int32)})
    with pytest.raises(luisaml.CompileError, match="int32; supported: float, float16"):
        luisaml.compile(m, batch_axis=None)


@pytest.mark.parametrize("image,block,attrs", [
    ([5, 5], [2, 3], {}),
    ([6, 7], [3, 2], {"strides": [2, 1], "pads": [1, 0, 0, 1], "dilations": [1, 2]}),
    ([4, 3, 5], [2, 2, 2], {"strides": [1, 1, 2]}),
])
def test_col2im(image, block, attrs):
    """Col2Im against onnxruntime: 2-D and 3-D, strides, pads, dilations; two images of two
    channels, overlapping blocks adding up."""
    k = len(image)
    s, d = attrs.get("strides", [1] * k), attrs.get("dilations", [1] * k)
    p = attrs.get("pads", [0] * 2 * k)
    grid = [(image[i] + p[i] + p[k + i] - d[i] * (block[i] - 1) - 1) // s[i] + 1 for i in range(k)]
    x = rand((2, 2 * int(np.prod(block)), int(np.prod(grid))), seed=k)
    model = single_node_model("Col2Im", {"x": x}, initializers={"image": np.array(image, np.int64),
                                                               "block": np.array(block, np.int64)}, **attrs)
    assert_matches_ort(model, {"x": x}, batch_axis=None)
