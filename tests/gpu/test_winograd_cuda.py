"""Winograd convolution on the CUDA backend (operators/winograd.py; CUDA's default for 3x3 stride-1
Conv of 16+ channels) against onnxruntime: F(4x4) and F(2x2); ResNet's layer shapes, whose product
blocks cover 16, 4 or 1 samples of tiles (a batch that is not a whole number of groups, and a batch
of one); a fixed batch; the residual Add and Relu as the epilogue; and a saved .lml artifact
(its grouped stages' dispatch) equal to the compiled network bit for bit.

    LUISAML_BACKEND=cuda python -m pytest tests/gpu/test_winograd_cuda.py -q"""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from util import cuda_only, ort_run

import luisaml

pytestmark = cuda_only()

TOL = {2: 1e-5, 4: 3e-5}  # of max |y|, as tests/operators/test_winograd.py (float32 transforms)


def _model(C, K, H, batch="N", seed=0):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((K, C, 3, 3)) * np.sqrt(2 / (9 * C))).astype(np.float32)
    b = rng.standard_normal(K).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("Add", ["c", "r"], ["s"]), helper.make_node("Relu", ["s"], ["y"])]
    g = helper.make_graph(nodes, "wino", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, C, H, H]),
                                          helper.make_tensor_value_info("r", TensorProto.FLOAT, [batch, K, H, H])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, K, H, H])],
                          [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10  # the lent machine's onnxruntime reads IR 10 at most
    return m


def _feeds(C, K, H, n, seed=1):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((n, C, H, H)).astype(np.float32),
            "r": rng.standard_normal((n, K, H, H)).astype(np.float32)}


def _close(got, want, m):
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL[m] * float(np.abs(want).max()))


@pytest.mark.parametrize("m", [4, 2])
@pytest.mark.parametrize("C,K,H", [(64, 64, 56), (128, 128, 28), (256, 256, 14), (512, 512, 7), (48, 80, 9)])
def test_layers(m, C, K, H):
    model = _model(C, K, H)
    net = luisaml.compile(model, winograd=m)
    assert net.backend == "cuda" and net.plan.winograd == ["conv"]
    product = [st for st in net.plan.schedule.stages if st.domain == "blocks"]
    assert len(product) == 1 and product[0].root[1].node.op_type == "WinogradProduct"
    for n in (1, 5, 33):  # groups of 16 / 4 samples: whole, partial, one sample
        feeds = _feeds(C, K, H, n, seed=n)
        _close(net.run(feeds)["y"], ort_run(model, feeds)["y"], m)


def test_fixed_batch():
    model = _model(64, 64, 14, batch=3)
    net = luisaml.compile(model, batch_axis=None, winograd=4)
    assert net.plan.winograd == ["conv"]
    feeds = _feeds(64, 64, 14, 3)
    _close(net.run(feeds)["y"], ort_run(model, feeds)["y"], 4)


def test_default_is_f4_and_artifact_round_trip(tmp_path):
    model = _model(512, 512, 7)
    net = luisaml.compile(model)
    assert net.plan.winograd == ["conv"]
    assert any(st.grouped for st in net.plan.schedule.stages)
    feeds = _feeds(512, 512, 7, 21)
    want = net.run(feeds)["y"]
    _close(want, ort_run(model, feeds)["y"], 4)
    loaded = luisaml.load(net.save(tmp_path / "w.lml"))
    np.testing.assert_array_equal(loaded.run(feeds)["y"], want)


def _chain(channels, H, seed=2):
    """Convs c0 -> c1 -> ... with Relu between: intermediates of different sizes share pooled buffers."""
    rng = np.random.default_rng(seed)
    nodes, inits, cur = [], [], "x"
    for i, (c, k) in enumerate(zip(channels, channels[1:])):
        w = (rng.standard_normal((k, c, 3, 3)) * np.sqrt(2 / (9 * c))).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes += [helper.make_node("Conv", [cur, f"w{i}"], [f"c{i}"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name=f"conv{i}"),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"])]
        cur = f"r{i}"
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", channels[0], H, H])],
                          [helper.make_tensor_value_info(cur, TensorProto.FLOAT, ["N", channels[-1], H, H])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    return m, cur


def test_chain_shares_buffers():
    """A product's rows of another sample are read at that sample: a pooled buffer's samples lie
    its slot's size apart (here larger than the tensor), not the tensor's size."""
    model, out = _chain([16, 32, 32, 64], 14)
    net = luisaml.compile(model, winograd=4)
    assert len(net.plan.winograd) == 3
    slots = net.plan.schedule.buffers.slots
    sizes = {m: slot.size for slot in slots for m in slot.members}
    assert any(sizes[t.name] > t.numel for t in net.plan.tensors.values() if "/winograd" in t.name and t.name in sizes)
    for n in (3, 9):
        x = np.random.default_rng(n).standard_normal((n, 16, 14, 14)).astype(np.float32)
        _close(net.run({"x": x})[out], ort_run(model, {"x": x})[out], 4)
