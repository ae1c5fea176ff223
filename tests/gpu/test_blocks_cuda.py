"""The cooperative block stages (operators/tiled.py: a block of threads per GEMM or implicit-GEMM
convolution tile, through shared memory) on the CUDA backend, against onnxruntime: Gemm with
transposes, alpha/beta and a broadcast C; MatMul batched and broadcast, with a run-time B
(attention's Q K^T); Conv 1-D/2-D/3-D with strides, pads, dilations and groups, with and without
bias, with an epilogue; shapes that fill tiles exactly and ragged ones. Each test also asserts
the node ran as a "blocks" stage, so a heuristic change cannot quietly test the items form
(tiled.choose leaves products under half-filled tiles to the items form: the shapes here fill
more than half).

    LUISAML_BACKEND=cuda python -m pytest tests/gpu/test_blocks_cuda.py -q"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from util import cuda_only, ort_run

import luisaml

pytestmark = cuda_only()

RTOL = 2e-5


def _model(nodes, inputs, outputs, inits) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, outputs, [numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10  # the lent machine's onnxruntime reads IR 10 at most
    return m


def _vi(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _check(model, feeds, blocks: int, **compile_kw):
    net = luisaml.compile(model, **compile_kw)
    assert net.backend == "cuda"
    domains = [st.domain for st in net.plan.schedule.stages]
    assert domains.count("blocks") == blocks, domains
    got, want = net.run(feeds), ort_run(model, feeds)
    for name, w in want.items():
        scale = float(np.abs(w).max())
        np.testing.assert_allclose(got[name], w, rtol=RTOL, atol=RTOL * scale, err_msg=name)


@pytest.mark.parametrize("M,K,N,ta,tb,c_shape", [
    (128, 64, 128, 0, 0, None),  # whole tiles
    (200, 37, 100, 0, 1, [100]),  # ragged M, N and K, B transposed, C a row
    (60, 300, 40, 1, 0, [60, 1]),  # A transposed, C a column
    (64, 513, 96, 1, 1, [64, 96]),
])
def test_gemm(M, K, N, ta, tb, c_shape):
    rng = np.random.default_rng(M + K + N)
    a = rng.standard_normal((K, M) if ta else (M, K), dtype=np.float32)
    b = rng.standard_normal((N, K) if tb else (K, N), dtype=np.float32)
    inits = {"B": b}
    ins = ["A", "B"]
    if c_shape is not None:
        inits["C"] = rng.standard_normal(c_shape, dtype=np.float32)
        ins.append("C")
    node = helper.make_node("Gemm", ins, ["Y"], transA=ta, transB=tb, alpha=0.5, beta=2.0)
    model = _model([node], [_vi("A", list(a.shape))], [_vi("Y", [M, N])], inits)
    _check(model, {"A": a}, blocks=1)


def test_matmul_batched_runtime_b_with_relu():
    """Attention's scores: [B, H, S, D] x [B, H, D, S], both operands computed at run time."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 4, 56, 32), dtype=np.float32)
    k = rng.standard_normal((2, 4, 32, 40), dtype=np.float32)
    nodes = [helper.make_node("MatMul", ["Q", "K"], ["S"]), helper.make_node("Relu", ["S"], ["Y"])]
    model = _model(nodes, [_vi("Q", list(q.shape)), _vi("K", list(k.shape))], [_vi("Y", [2, 4, 56, 40])], {})
    _check(model, {"Q": q, "K": k}, blocks=1)


def test_matmul_broadcast_constant_b():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 50, 128), dtype=np.float32)
    w = rng.standard_normal((128, 384), dtype=np.float32)
    model = _model([helper.make_node("MatMul", ["X", "W"], ["Y"])], [_vi("X", [3, 50, 128])], [_vi("Y", [3, 50, 384])],
                   {"W": w})
    _check(model, {"X": x}, blocks=1)


@pytest.mark.parametrize("x_shape,w_shape,attrs,bias", [
    ([2, 16, 20, 20], [32, 16, 3, 3], dict(pads=[1, 1, 1, 1]), True),
    ([1, 3, 33, 31], [64, 3, 7, 7], dict(pads=[3, 3, 3, 3], strides=[2, 2]), False),  # ResNet's stem, ragged
    ([2, 32, 14, 14], [64, 16, 3, 3], dict(pads=[2, 2, 2, 2], dilations=[2, 2], group=2), True),
    ([1, 64, 9, 9], [128, 64, 1, 1], dict(strides=[2, 2]), True),  # a downsample shortcut
    ([2, 8, 101], [24, 8, 5], dict(pads=[2, 1]), True),  # 1-D, asymmetric pads
    ([1, 4, 6, 10, 10], [20, 4, 3, 3, 3], dict(pads=[1, 1, 1, 1, 1, 1]), True),  # 3-D
    # the three tilings tiled.choose picks: 5 tiles of 128 x 128, one shared buffer (ResNet's layer2)
    ([1, 32, 24, 24], [128, 32, 3, 3], dict(pads=[1, 1, 1, 1]), True),
    # 64 x 64 tiles, double-buffered, the weights as float4 loads (layer1)
    ([2, 16, 30, 30], [64, 16, 3, 3], dict(pads=[1, 1, 1, 1]), True),
    # two tiles of 64 x 128 for 49 positions: k steps of 16, double-buffered, float4 weights (layer4)
    ([2, 64, 7, 7], [256, 64, 3, 3], dict(pads=[1, 1, 1, 1]), False),
])
def test_conv(x_shape, w_shape, attrs, bias):
    rng = np.random.default_rng(sum(x_shape))
    x = rng.standard_normal(x_shape, dtype=np.float32)
    inits = {"W": rng.standard_normal(w_shape, dtype=np.float32)}
    ins = ["X", "W"]
    if bias:
        inits["Bias"] = rng.standard_normal(w_shape[0], dtype=np.float32)
        ins.append("Bias")
    conv = helper.make_node("Conv", ins, ["C"], **attrs)
    probe = _model([conv], [_vi("X", x_shape)], [_vi("C", None)], inits)
    out_shape = list(ort_run(probe, {"X": x})["C"].shape)
    nodes = [conv, helper.make_node("Relu", ["C"], ["Y"])]
    model = _model(nodes, [_vi("X", x_shape)], [_vi("Y", out_shape)], inits)
    # the direct implicit GEMM's tilings (3x3 stride-1 layers take Winograd's by default:
    # tests/gpu/test_winograd_cuda.py)
    _check(model, {"X": x}, blocks=1, winograd=False)


def test_conv_runtime_weights():
    """W an input of the graph (not prepacked): read where it is."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 8, 12, 12), dtype=np.float32)
    w = rng.standard_normal((32, 8, 3, 3), dtype=np.float32)
    conv = helper.make_node("Conv", ["X", "W"], ["Y"], pads=[1, 1, 1, 1])
    model = _model([conv], [_vi("X", [2, 8, 12, 12]), _vi("W", [32, 8, 3, 3])], [_vi("Y", [2, 32, 12, 12])], {})
    _check(model, {"X": x, "W": w}, blocks=1)


def test_batched_conv_net_per_sample():
    """A dynamic batch: the blocks stage runs per sample (block -> sample, tile)."""
    rng = np.random.default_rng(4)
    w1 = rng.standard_normal((32, 3, 3, 3), dtype=np.float32) * 0.3
    w2 = rng.standard_normal((64, 32, 3, 3), dtype=np.float32) * 0.1
    nodes = [helper.make_node("Conv", ["X", "W1"], ["A"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["A"], ["R"]),
             helper.make_node("Conv", ["R", "W2"], ["Y"], pads=[1, 1, 1, 1], strides=[2, 2])]
    model = _model(nodes, [_vi("X", ["N", 3, 24, 24])], [_vi("Y", ["N", 64, 12, 12])], {"W1": w1, "W2": w2})
    for n in (1, 5):
        x = rng.standard_normal((n, 3, 24, 24), dtype=np.float32)
        _check(model, {"X": x}, blocks=2)


@pytest.mark.parametrize("op", ["Gemm", "MatMul"])
def test_one_row_a_sample_takes_tiles_of_samples(op, monkeypatch):
    """A classifier head over a dynamic batch (one row a sample, B constant): a block's tile rows are
    64 consecutive samples (a grouped blocks stage); batches of one, under a tile and past it. (Its
    512 x 1,000 weights would take the heads form, tests/gpu/test_gemm_heads_cuda.py: switched off.)"""
    from luisaml.operators.gemm import Dense

    monkeypatch.setattr(Dense, "HEAD_MIN_WEIGHTS", 0)
    rng = np.random.default_rng(11)
    w = rng.standard_normal((512, 1000), dtype=np.float32) / 20
    inits = {"W": w}
    if op == "Gemm":
        inits["C"] = rng.standard_normal(1000, dtype=np.float32)
        nodes = [helper.make_node("Gemm", ["X", "W", "C"], ["G"], alpha=0.5)]
    else:
        nodes = [helper.make_node("MatMul", ["X", "W"], ["G"])]
    nodes.append(helper.make_node("Relu", ["G"], ["Y"]))
    model = _model(nodes, [_vi("X", ["N", 512])], [_vi("Y", ["N", 1000])], inits)
    net = luisaml.compile(model)
    assert [st.samples for st in net.plan.schedule.stages if st.domain == "blocks"] == [64]
    for n in (1, 37, 130):
        x = rng.standard_normal((n, 512), dtype=np.float32)
        _check(model, {"X": x}, blocks=1)


@pytest.mark.parametrize("op,K,N", [("Gemm", 2048, 10), ("MatMul", 300, 1)])
def test_a_narrow_head_takes_a_warp_a_sample(op, K, N):
    """A head of few outputs over a long k (cifar-cnn's 2,048 -> 10; operators/gemm_rows.py): a warp
    a sample, 4 samples a block, its lanes splitting k (300: a ragged last step); batches of one,
    under a block's samples and past it."""
    rng = np.random.default_rng(K)
    if op == "Gemm":
        inits = {"W": rng.standard_normal((N, K), dtype=np.float32) / 20, "C": rng.standard_normal(N, dtype=np.float32)}
        nodes = [helper.make_node("Gemm", ["X", "W", "C"], ["G"], transB=1)]
    else:
        inits = {"W": rng.standard_normal((K, N), dtype=np.float32) / 20}
        nodes = [helper.make_node("MatMul", ["X", "W"], ["G"])]
    nodes.append(helper.make_node("Sigmoid", ["G"], ["Y"]))
    model = _model(nodes, [_vi("X", ["N", K])], [_vi("Y", ["N", N])], inits)
    net = luisaml.compile(model, fuse="off")  # (one layer from input to output is otherwise the fused MLP's)
    assert [(st.samples, st.threads) for st in net.plan.schedule.stages if st.domain == "blocks"] == [(4, 128)]
    for n in (1, 3, 4097):
        x = rng.standard_normal((n, K), dtype=np.float32)
        _check(model, {"X": x}, blocks=1, fuse="off")
