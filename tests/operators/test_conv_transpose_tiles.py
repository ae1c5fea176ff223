"""ConvTranspose's stage form (a thread per tile of P outputs along the row x O channels,
operators/conv_transpose.py) against onnxruntime at two batch sizes: strides 1-3 and past
MAX_STRIDE, pads, output_padding, output_shape and auto_pad, dilations, groups, channel counts the
tile's blocks do not divide, ragged strips, 1-D and 3-D, weights in the blob and as literals, half;
and torch's nn.ConvTranspose2d export (U-Net's up-convolution) against torch itself."""
import numpy as np
import pytest
from onnx import helper

from stage_forms import assert_stage_forms
from util import graph_model, ort_run, rand, stage_of

import luisaml


def convt(name, ins, **attrs):
    return helper.make_node("ConvTranspose", ins, [name], name=name, **attrs)


def _assert_tiled(net, names, tiled=True):
    for name in names:
        st = stage_of(net, name)
        desc = [op.describe() for nd, op in st.nodes if nd.name == name][0]
        want = "outputs along the row" if tiled else "a thread per output element"
        assert want in desc, f"{name}: {desc}"


CASES_2D = {  # name: (C in, W shape [C, M / group, kh, kw], attributes)
    "unet": (8, (8, 4, 2, 2), dict(strides=[2, 2])),
    "pads_outpad": (6, (6, 5, 3, 3), dict(strides=[2, 2], pads=[1, 1, 1, 1], output_padding=[1, 1])),
    "groups_dil": (6, (6, 3, 3, 3), dict(group=2, strides=[2, 1], dilations=[1, 2], pads=[0, 1, 1, 0])),
    "s3_ragged": (6, (6, 3, 4, 4), dict(strides=[3, 3], pads=[1, 0, 2, 1])),
    "dil_last": (6, (6, 3, 3, 3), dict(strides=[2, 2], dilations=[2, 2], pads=[1, 2, 0, 1])),
    "same_upper": (6, (6, 3, 3, 3), dict(strides=[2, 2], auto_pad="SAME_UPPER")),
    "same_lower": (6, (6, 3, 3, 3), dict(strides=[2, 3], auto_pad="SAME_LOWER")),
    "out_shape": (6, (6, 3, 3, 3), dict(strides=[2, 2], output_shape=[12, 10])),
    "stride1": (6, (6, 3, 3, 3), dict(pads=[1, 1, 1, 1])),
    "wide_m": (5, (5, 24, 2, 2), dict(strides=[2, 2])),  # 24 channels: blocks of O that pad the group
    "depthwise": (6, (6, 1, 3, 3), dict(group=6, strides=[2, 2], pads=[1, 1, 1, 1], output_padding=[1, 0])),
}


def test_conv_transpose_tiles_2d():
    """Every 2-D variant in one model (one kernel), weights in the blob, a bias on half of them."""
    feeds_x = {f"x{c}": rand((2, c, 6, 5), seed=c) for c in sorted({c for c, _, _ in CASES_2D.values()})}
    inits, nodes = {}, []
    for k, (name, (c, wshape, attrs)) in enumerate(CASES_2D.items()):
        inits[f"w_{name}"] = rand(wshape, seed=10 + k)
        ins = [f"x{c}", f"w_{name}"]
        if k % 2 == 0:
            inits[f"b_{name}"] = rand((wshape[1] * attrs.get("group", 1),), seed=30 + k)
            ins.append(f"b_{name}")
        nodes.append(convt(name, ins, **attrs))
    m = graph_model(nodes, feeds_x, inits, batch="N")
    net = assert_stage_forms(m, lambda n: {k: rand((n, *v.shape[1:]), seed=n) for k, v in feeds_x.items()}, list(CASES_2D),
                             rtol=1e-4, atol=1e-5)
    _assert_tiled(net, CASES_2D)


def test_conv_transpose_tiles_1d_3d_literal_weights_and_wide_strides():
    """1-D and 3-D; weights in an arithmetic progression (a literal in the code, not prepacked:
    the tile's other weight path); a stride past MAX_STRIDE keeps a thread per output element."""
    x1, x3 = rand((2, 3, 7), seed=1), rand((2, 2, 3, 4, 3), seed=2)
    inits = {"w1": rand((3, 2, 3), seed=3), "w1b": rand((3, 2, 2), seed=4), "w3": rand((2, 2, 2, 2, 3), seed=5),
             "b3": rand((2,), seed=6), "wlin": np.arange(18, dtype=np.float32).reshape(3, 2, 3) * 0.25 - 2}
    nodes = [
        convt("t1", ["x1", "w1"], strides=[3], pads=[1, 1], output_padding=[1]),
        convt("t1_literal", ["x1", "wlin"], strides=[2], pads=[0, 1]),
        convt("t1_wide", ["x1", "w1b"], strides=[9]),
        convt("t3", ["x3", "w3", "b3"], strides=[2, 1, 2], pads=[0, 1, 0, 1, 0, 1]),
    ]
    feeds = {"x1": x1, "x3": x3}
    m = graph_model(nodes, feeds, inits, batch="N")
    net = assert_stage_forms(m, lambda n: {k: rand((n, *v.shape[1:]), seed=n) for k, v in feeds.items()},
                             ["t1", "t1_literal", "t1_wide", "t3"], rtol=1e-4, atol=1e-5)
    _assert_tiled(net, ["t1", "t1_literal", "t3"])
    _assert_tiled(net, ["t1_wide"], tiled=False)


def test_conv_transpose_tiles_half():
    """Half in and out, accumulated in float: the float model's result rounded to half."""
    x, w, b = rand((2, 4, 5, 6), np.float16, seed=1), rand((4, 3, 3, 3), np.float16, seed=2), rand((3,), np.float16, seed=3)
    attrs = dict(strides=[2, 2], pads=[1, 0, 0, 1])
    m16 = graph_model([convt("y", ["x", "w", "b"], **attrs)], {"x": x}, {"w": w, "b": b}, batch="N")
    m32 = graph_model([convt("y", ["x", "w", "b"], **attrs)], {"x": x.astype(np.float32)},
                      {"w": w.astype(np.float32), "b": b.astype(np.float32)}, batch="N")
    net = luisaml.compile(m16)
    _assert_tiled(net, ["y"])
    got = net.run({"x": x})["y"]
    ref = ort_run(m32, {"x": x.astype(np.float32)})["y"]
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), ref.astype(np.float16).astype(np.float32), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("cin,cout,k,s,p,op,g", [(32, 16, 2, 2, 0, 0, 1), (12, 8, 3, 2, 1, 1, 4), (8, 6, 4, 3, 1, 2, 2)])
def test_torch_conv_transpose2d_export(tmp_path, cin, cout, k, s, p, op, g):
    """torch's ConvTranspose2d, exported, against torch's own output at two batch sizes."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    mod = torch.nn.ConvTranspose2d(cin, cout, k, s, padding=p, output_padding=op, groups=g).eval()
    x = torch.randn(2, cin, 9, 11)
    path = tmp_path / "ct.onnx"
    torch.onnx.export(mod, (x,), str(path), input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "n"}},
                      dynamo=False)
    net = luisaml.compile(str(path))
    for n in (1, 3):
        xn = torch.randn(n, cin, 9, 11)
        with torch.no_grad():
            want = mod(xn).numpy()
        got = net.run({"x": xn.numpy()})["y"]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    st = net.plan.schedule.stages[0]
    assert st.domain == "items" and "outputs along the row" in st.nodes[0][1].describe()
