"""Conv on the tensor-core tile (operators/tiled_mma.py) without a GPU: a Conv planned for CUDA with
tensor_cores takes the mma tile for its implicit GEMM (rows the output positions of the batch,
columns a group's output channels, k the input channels x kernel taps), and so do the products of a
Winograd convolution; a grouped Conv of few channels a group keeps tiled.py's FP32 tile. Each stage
kernel runs in Python (tests/gpu_emulator.py: a thread per GPU thread, the marked mma callable its
FP32 DSL body, buffers float64) and is checked against a float64 direct convolution in numpy (itself
checked against onnxruntime), for whole and ragged tiles, a ragged k step, stride 2, pads, dilation,
bias, a fused Relu, weights at run time, groups, samples of few positions sharing a tile, under both of
conv_tiles' gathers (k as (tap, channel) or (channel, tap)); a Winograd product of a batch's last, partial group
of samples against onnxruntime at test_winograd.py's tolerance. The CUDA run: tests/gpu/
test_tensor_cores_cuda.py."""
from __future__ import annotations

import numpy as np
import pytest
from gpu_emulator import build_dsl, kernel_name, run_plan
from onnx import TensorProto, helper, numpy_helper
from util import ort_run, plan_of


# Winograd's tolerance (tests/operators/test_winograd.py): of max |y|, the float32 transformed weights
WINOGRAD_TOL = {2: 1e-5, 4: 3e-5}


def _conv_model(n, C, H, W, K, k=3, strides=1, pads=0, dilations=1, group=1, bias=True, relu=False,
                w_input=False, batch=None, seed=0):
    """A Conv (and Relu) model, its feeds and numpy's float64 output."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, C, H, W)).astype(np.float32)
    w = (rng.standard_normal((K, C // group, k, k)) / np.sqrt(C // group * k * k)).astype(np.float32)
    b = rng.standard_normal(K).astype(np.float32)
    ho = (H + 2 * pads - dilations * (k - 1) - 1) // strides + 1
    wo = (W + 2 * pads - dilations * (k - 1) - 1) // strides + 1
    inits = [numpy_helper.from_array(b, "b")] if bias else []
    ins = [helper.make_tensor_value_info("X", TensorProto.FLOAT, [batch or n, C, H, W])]
    if w_input:
        ins.append(helper.make_tensor_value_info("Wt", TensorProto.FLOAT, list(w.shape)))
    else:
        inits.append(numpy_helper.from_array(w, "Wt"))
    nodes = [helper.make_node("Conv", ["X", "Wt"] + (["b"] if bias else []), ["C" if relu else "Y"], name="conv",
                              kernel_shape=[k, k], strides=[strides] * 2, pads=[pads] * 4, dilations=[dilations] * 2,
                              group=group)]
    if relu:
        nodes.append(helper.make_node("Relu", ["C"], ["Y"]))
    g = helper.make_graph(nodes, "g", ins, [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [batch or n, K, ho, wo])],
                          inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    feeds = {"X": x} | ({"Wt": w} if w_input else {})
    return model, feeds, _direct(x, w, b if bias else None, strides, pads, dilations, group, relu)


def _direct(x, w, b, s, p, d, group, relu):
    """The convolution in float64: a sum over the kernel's taps of strided windows of the padded input."""
    n, C, H, W = x.shape
    K, cg, kh, kw = w.shape
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (p, p), (p, p)))
    ho, wo = (H + 2 * p - d * (kh - 1) - 1) // s + 1, (W + 2 * p - d * (kw - 1) - 1) // s + 1
    mg = K // group
    y = np.zeros((n, K, ho, wo))
    for gi in range(group):
        xs = xp[:, gi * cg:(gi + 1) * cg]
        for i in range(kh):
            for j in range(kw):
                win = xs[:, :, i * d:i * d + s * (ho - 1) + 1:s, j * d:j * d + s * (wo - 1) + 1:s]
                y[:, gi * mg:(gi + 1) * mg] += np.einsum("nchw,kc->nkhw", win, w[gi * mg:(gi + 1) * mg, :, i, j])
    if b is not None:
        y += b[None, :, None, None]
    return np.maximum(y, 0) if relu else y


def _plan(model, winograd=0, tensor_cores=True):
    batched = model.graph.input[0].type.tensor_type.shape.dim[0].dim_param
    return plan_of(model, batch_axis=0 if batched else None, tensor_cores=tensor_cores, winograd=winograd)


def _tilings(plan) -> dict[str, str]:
    """The block tilings' type names of the plan's blocks stages, by node type (by name: a test before
    this one in the worker may have imported luisaml afresh, its classes then other objects)."""
    out = {}
    for st in plan.schedule.stages:
        if st.domain == "blocks":
            (node, op), = st.nodes
            tl = op.block_tiling()
            assert tl.threads == st.threads
            out[node.op_type] = type(tl).__name__
    return out


CASES = [  # (id, n, C, H, W, K, kw)
    ("whole tiles", 2, 16, 8, 8, 64, dict(k=3, pads=1)),  # 128 positions x 64 channels, k = 144
    ("ragged rows, columns and k", 1, 5, 10, 10, 48, dict(k=3, pads=1)),  # 100 x 48, k = 45
    ("stride 2, pads", 2, 8, 17, 17, 32, dict(k=3, strides=2, pads=1)),  # 162 positions, two row tiles
    ("dilation 2, Relu", 1, 8, 10, 10, 32, dict(k=3, pads=2, dilations=2, relu=True)),
    ("1x1 stride 2, no bias", 1, 32, 20, 20, 64, dict(k=1, strides=2, bias=False)),
    ("7x7 stem", 1, 3, 21, 21, 32, dict(k=7, strides=2, pads=3)),  # k = 147: three channels, still one GEMM
    ("weights at run time", 1, 8, 9, 9, 32, dict(k=3, pads=1, w_input=True)),
    ("groups of 32 channels", 1, 16, 8, 8, 64, dict(k=3, pads=1, group=2)),  # the group as the product's batch
]


@pytest.mark.parametrize("n,C,H,W,K,kw", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_conv_takes_the_mma_tile_and_matches_numpy(n, C, H, W, K, kw):
    model, feeds, want = _conv_model(n, C, H, W, K, **kw)
    np.testing.assert_allclose(ort_run(model, feeds)["Y"], want, rtol=1e-5, atol=1e-5)  # (the reference is ONNX's)
    plan = _plan(model)
    assert _tilings(plan) == {"Conv": "MmaTiling"}
    assert "mma_tf32_m16n8k8" in plan.source
    if kw.get("relu"):  # the Relu is the stage's epilogue: one stage
        assert len(plan.schedule.stages) == 1
    got = run_plan(plan, feeds)["Y"]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-9 * np.abs(want).max())


GATHER_CASES = [  # (id, n, C, H, W, K, kw): a group's channels a multiple of the k step (16), or fewer
    ("3x3 stride 2, pads", 2, 16, 17, 17, 32, dict(k=3, strides=2, pads=1)),
    ("dilation 2, ragged rows, Relu", 1, 32, 10, 10, 48, dict(k=3, pads=2, dilations=2, relu=True)),
    ("weights at run time", 1, 16, 9, 9, 32, dict(k=3, pads=1, w_input=True)),
    ("groups of 16 channels", 1, 32, 8, 8, 64, dict(k=3, pads=1, group=2)),
    ("1x1 stride 2", 1, 32, 20, 20, 64, dict(k=1, strides=2)),
    # fewer channels than the step: "step" pads them to a power of two and the taps to whole steps
    ("one channel, 5x5 (k 25 as 32)", 1, 1, 20, 20, 32, dict(k=5, pads=2)),
    ("3 channels, 7x7 stride 2 (k 147 as 52 taps of 4)", 1, 3, 21, 21, 32, dict(k=7, strides=2, pads=3)),
]


@pytest.mark.parametrize("gather", ["step", "first", "reuse"])
@pytest.mark.parametrize("n,C,H,W,K,kw", [c[1:] for c in GATHER_CASES], ids=[c[0] for c in GATHER_CASES])
def test_gathers_match_numpy(n, C, H, W, K, kw, gather, monkeypatch):
    """operators/conv_tiles.py's gathers: "step" orders k as (tap, channel) (a step's 16 k's one tap's
    channels, or whole taps of padded channels; W's rows read in its (channel, tap) order), "first" as
    (channel, tap), each k decomposed, "reuse" as (channel block, tap, channel) where a group's channels are
    a multiple of the step and the taps more than one (else as "step")."""
    from luisaml.operators import conv_tiles

    monkeypatch.setenv("LUISAML_CONV_GATHER", gather)
    model, feeds, want = _conv_model(n, C, H, W, K, **kw)
    plan = _plan(model)
    (st,) = [s for s in plan.schedule.stages if s.domain == "blocks"]
    op = st.nodes[0][1]
    assert conv_tiles.tap_major(op, op.block_tiling()) == (gather != "first")
    assert conv_tiles.taps_inner(op) == (gather == "reuse" and C // kw.get("group", 1) % 16 == 0 and kw["k"] > 1)
    np.testing.assert_allclose(run_plan(plan, feeds)["Y"], want, rtol=0, atol=1e-9 * np.abs(want).max())


@pytest.mark.parametrize("gather", ["step", "reuse"])
def test_samples_sharing_a_tile_under_the_gathers(gather, monkeypatch):
    """A batched 3 x 3 over 7 x 7 positions (ResNet-50's layer4 at a small width): 64 samples share a block's
    rows (block_samples), 5 in the batch, so the group is partial; "reuse" orders its 9 taps inside each
    16-channel block, and every row still reads its own sample."""
    from luisaml.operators import conv_tiles

    monkeypatch.setenv("LUISAML_CONV_GATHER", gather)
    model, feeds, want = _conv_model(5, 32, 7, 7, 64, k=3, pads=1, batch="N")
    plan = _plan(model)
    (st,) = [s for s in plan.schedule.stages if s.domain == "blocks"]
    op = st.nodes[0][1]
    assert conv_tiles.block_samples(op) > 5 and conv_tiles.taps_inner(op) == (gather == "reuse")
    np.testing.assert_allclose(run_plan(plan, feeds)["Y"], want, rtol=0, atol=1e-9 * np.abs(want).max())


@pytest.mark.parametrize("gather", ["step", "first", "reuse"])
@pytest.mark.parametrize("C,L,k,stride", [(1, 400, 20, 5), (32, 160, 3, 2)],
                         ids=["1 channel, k 20 / 5", "32 channels, k 3 / 2"])
def test_conv1d_gathers_match_numpy(C, L, k, stride, gather, monkeypatch):
    """A 1-d Conv (wav2vec2's feature encoder: taps at stride 5 over one channel, then 3 taps at stride 2)
    under both gathers, against the 2-d direct convolution of one row. (wav2vec2's own first layer, 10 taps,
    is under conv_tiles.DIRECT_K and runs direct: tests/test_conv_direct_small_k.py; 20 taps keep the
    one-channel gather on the tile, two k steps of padded taps.)"""
    monkeypatch.setenv("LUISAML_CONV_GATHER", gather)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, C, L)).astype(np.float32)
    w = (rng.standard_normal((64, C, k)) / np.sqrt(C * k)).astype(np.float32)
    lo = (L - k) // stride + 1
    g = helper.make_graph([helper.make_node("Conv", ["X", "Wt"], ["Y"], kernel_shape=[k], strides=[stride])], "g",
                          [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", C, L])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 64, lo])],
                          [numpy_helper.from_array(w, "Wt")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    want = _direct(x[:, :, None], w[:, :, None], None, stride, 0, 1, 1, False)[:, :, 0]
    np.testing.assert_allclose(ort_run(model, {"X": x})["Y"], want, rtol=1e-5, atol=1e-5)
    plan = _plan(model)
    assert _tilings(plan) == {"Conv": "MmaTiling"}
    np.testing.assert_allclose(run_plan(plan, {"X": x})["Y"], want, rtol=0, atol=1e-9 * np.abs(want).max())


@pytest.mark.parametrize("n,K,tile", [(2, 96, "w64"), (1, 128, "w64"), (1, 128, "w32")])
def test_batched_conv_variants_match_numpy(n, K, tile, monkeypatch):
    """A batched graph's Conv (no SM fill): under "w64" 4 warps of 64 x 48 (96 channels) or 64 x 64, A (the
    gather, rows contiguous) k-major in shared memory; under "w32" 8 warps of 64 x 32 (its 64-column tiles
    would pad 96 channels past MIN_FILL: choose declines)."""
    monkeypatch.setenv("LUISAML_MMA_TILE", tile)
    model, feeds, want = _conv_model(n, 8, 12, 12, K, k=3, pads=1, relu=True, batch="N")
    plan = _plan(model)
    (st,) = [s for s in plan.schedule.stages if s.domain == "blocks"]
    tl = st.nodes[0][1].block_tiling()
    assert type(tl).__name__ == "MmaTiling" and (tl.BN, tl.WN) == ((K, K // 2) if tile == "w64" else (K, 32))
    got = run_plan(plan, feeds)["Y"]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-9 * np.abs(want).max())


@pytest.mark.parametrize("n,stride", [(3, 1), (2, 2)])
def test_samples_of_few_positions_share_a_tile(n, stride):
    """49 output positions a sample (ResNet-50's last layers) are under the mma tile's rows: a block's
    rows are the positions of 64 samples, of which the batch's n exist (the rest load the last row and
    store nothing; a tile wholly past them leaves), each row read and written at its own sample."""
    model, feeds, want = _conv_model(n, 16, 7 * stride, 7 * stride, 32, k=3, strides=stride, pads=1, relu=True,
                                     batch="N")
    plan = _plan(model)
    assert _tilings(plan) == {"Conv": "MmaTiling"}
    (st,) = [s for s in plan.schedule.stages if s.domain == "blocks"]
    assert st.samples == 64 and st.nodes[0][1].block_tiling().M == 64 * 49
    got = run_plan(plan, feeds)["Y"]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-9 * np.abs(want).max())
    assert _tilings(_plan(model, tensor_cores=False)) == {"Conv": "Tiling"}  # (the FP32 tile: a sample a block)


@pytest.mark.parametrize("group,K", [(2, 32), (4, 64)])
def test_few_channels_a_group_keep_the_fp32_tile(group, K):
    """16 output channels a group: under a warp's 32 columns, tiled_mma.choose declines."""
    model, feeds, want = _conv_model(1, 16, 8, 8, K, k=3, pads=1, group=group)
    plan = _plan(model)
    assert _tilings(plan) == {"Conv": "Tiling"} and "mma_tf32" not in plan.source
    np.testing.assert_allclose(run_plan(plan, feeds)["Y"], want, rtol=0, atol=1e-9 * np.abs(want).max())


def test_without_tensor_cores_conv_keeps_the_fp32_tile():
    model, _, _ = _conv_model(2, 16, 8, 8, 64, k=3, pads=1)
    plan = _plan(model, tensor_cores=False)
    assert _tilings(plan) == {"Conv": "Tiling"} and "mma_tf32" not in plan.source


@pytest.mark.parametrize("m,n", [(2, 1), (4, 3)])
def test_winograd_products_take_the_mma_tile(m, n):
    """F(2x2) at a fixed batch (64 tiles x 32 channels by 32 channels, 16 products); F(4x4) over a
    batch of 3 whose samples have 4 tiles each: a block's rows are the tiles of 16 samples, of which 3
    exist (tiled_mma.emit's m_limit), the stage's last group partial."""
    model, feeds, want = _conv_model(n, 32, 16 if m == 2 else 8, 16 if m == 2 else 8, 32, k=3, pads=1, relu=True,
                                     batch="N" if m == 4 else None)
    plan = _plan(model, winograd=m)
    assert plan.winograd == ["conv"]
    assert _tilings(plan) == {"WinogradProduct": "MmaTiling"}
    fp32 = _plan(model, winograd=m, tensor_cores=False)
    assert _tilings(fp32) == {"WinogradProduct": "Tiling"}
    got = run_plan(plan, feeds)["Y"]
    # the same transforms either way (the emulator's sums are float64): the tiles agree to rounding
    np.testing.assert_allclose(got, run_plan(fp32, feeds)["Y"], rtol=0, atol=1e-9 * np.abs(want).max())
    np.testing.assert_allclose(got, ort_run(model, feeds)["Y"], rtol=0, atol=WINOGRAD_TOL[m] * np.abs(want).max())


@pytest.mark.parametrize("winograd,batch,samples", [(0, None, 1), (0, "N", 64), (4, "N", 16)])
def test_conv_mma_kernel_builds_as_dsl(winograd, batch, samples, monkeypatch):
    """luisa-python builds the stage kernel's AST (the im2col gather into shared memory, the marked
    callable; batched: 49 positions a sample, rows at other samples of the group; Winograd's products
    over the 4 tiles of 16 samples), only the backend's compile left out (tests/gpu_emulator.py build_dsl)."""
    model, _, _ = _conv_model(2, 16, 7, 7, 32, k=3, pads=1, relu=True, batch=batch)
    plan = _plan(model, winograd=winograd)
    (st,) = [s for s in plan.schedule.stages if s.domain == "blocks"]
    assert set(_tilings(plan).values()) == {"MmaTiling"} and st.samples == samples
    assert len(build_dsl(plan, kernel_name(plan, st), monkeypatch)) == 1
