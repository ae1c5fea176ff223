"""The tensor-core route on CUDA (luisaml/tensor_cores.py, operators/tiled_mma.py): the device runs in
the front's runtime directory, the start-up self-test finds TF32 and FP16 mma live, and Gemm and
MatMul compiled with tensor_cores="auto" run as mma tiles within TF32's tolerance of float64 numpy
(1e-2 of the norm, torch's; typically ~1e-3), while tensor_cores=False keeps the FP32 tile's 2e-5;
so does a ResNet-style stack of Conv (and Winograd products) against onnxruntime. The FP16 kind: a product
within the FP32 accumulation bound of its half-rounded operands' product, and precision="fp16"'s MLPs as
stages on it (half in and out) within twice torch fp16's error.

    LUISAML_BACKEND=cuda python -m pytest tests/gpu/test_tensor_cores_cuda.py -q"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from util import cuda_only, mark_products_f16

import luisaml
from luisaml import tensor_cores

pytestmark = cuda_only()

TF32_TOL, FP32_TOL = 1e-2, 2e-5


@pytest.fixture(autouse=True, scope="module")
def _front_device():
    """The device starts in the front's directory only when asked first (a process whose device
    another test started plainly runs the FP32 tiles): run this file in a process of its own."""
    if luisaml.device.current() is not None and not tensor_cores._started_in:
        pytest.skip("the CUDA device was started without tensor_cores=True in this process")
    luisaml.device.init("cuda", tensor_cores=True)


def test_device_runs_in_the_front_directory():
    assert tensor_cores._started_in and tensor_cores._started_in[0] is not None, \
        "the CUDA device did not start in the tensor-core runtime directory (the log says why)"
    d = tensor_cores._started_in[0]
    assert (d / "luisa_nvrtc").is_file() and not (d / "luisa_nvrtc").is_symlink()
    assert tensor_cores.check_front(d / "luisa_nvrtc") is None


@pytest.mark.parametrize("kind", tensor_cores.KINDS)
def test_self_test_is_live(kind):
    t = tensor_cores.status(kind)
    assert t.live, t


def _rel(got, want) -> float:
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want))


def _gemm(M, K, N, ta, tb, bias, seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((K, M) if ta else (M, K)).astype(np.float32)
    b = rng.standard_normal((N, K) if tb else (K, N)).astype(np.float32)
    c = rng.standard_normal(N).astype(np.float32)
    inits = {"B": b} | ({"C": c} if bias else {})
    node = helper.make_node("Gemm", ["A", "B"] + (["C"] if bias else []), ["Y"], transA=ta, transB=tb, alpha=0.5)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, list(a.shape))],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [M, N])],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    want = 0.5 * ((a.T if ta else a).astype(np.float64) @ (b.T if tb else b)) + (c if bias else 0)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), {"A": a}, want


def _batched_matmul(nb, M, K, N, seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((nb, M, K)).astype(np.float32)
    b = rng.standard_normal((nb, K, N)).astype(np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["A", "B"], ["Y"])], "g",
                          [helper.make_tensor_value_info("A", TensorProto.FLOAT, list(a.shape)),
                           helper.make_tensor_value_info("B", TensorProto.FLOAT, list(b.shape))],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [nb, M, N])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), {"A": a, "B": b}, \
        a.astype(np.float64) @ b.astype(np.float64)


CASES = [
    ("gemm whole tiles", lambda: _gemm(256, 128, 256, 0, 0, False, 1)),
    ("gemm ragged, bias, ragged k", lambda: _gemm(300, 200, 200, 0, 0, True, 2)),
    ("gemm transposed", lambda: _gemm(192, 72, 96, 1, 1, True, 3)),
    ("batched matmul, run-time B", lambda: _batched_matmul(3, 128, 96, 160, 4)),
    ("large", lambda: _gemm(1024, 1024, 1024, 0, 0, False, 5)),
]


@pytest.mark.parametrize("name,make", CASES, ids=[c[0] for c in CASES])
def test_mma_gemm_matches_numpy(name, make):
    model, feeds, want = make()
    tc = luisaml.compile(model, batch_axis=None, tensor_cores="auto")
    fp32 = luisaml.compile(model, batch_axis=None, tensor_cores=False)
    assert "mma_tf32_m16n8k8" in tc.plan.source and "mma_tf32" not in fp32.plan.source
    assert [st.domain for st in tc.plan.schedule.stages].count("blocks") == 1
    got_tc, got_fp32 = tc.run(feeds)["Y"], fp32.run(feeds)["Y"]
    e_tc, e_fp32 = _rel(got_tc, want), _rel(got_fp32, want)
    assert e_fp32 <= FP32_TOL, e_fp32
    assert e_tc <= TF32_TOL, e_tc
    # TF32 rounds: the mma answer is not the FP32 one (a tile that ran the FP32 body would be)
    assert e_tc > 10 * e_fp32, (e_tc, e_fp32)


@pytest.mark.parametrize("tile", ["w64", "w32", "w32-first", "w64r"])
@pytest.mark.parametrize("name,make", [  # a full grid ("w64": 176 blocks of 128 x 96, warps of 64 x 48), a short one
    ("gemm 2048 x 1040, bias, ragged k", lambda: _gemm(2048, 136, 1040, 0, 0, True, 6)), CASES[3]],
    ids=["gemm 2048 x 1040", CASES[3][0]])
def test_mma_tile_variants_match_numpy(name, make, tile, monkeypatch):
    """operators/tiled_mma.py's variants (LUISAML_MMA_TILE): each within TF32's tolerance and rounding (the
    mma ran: "w64r"'s tf32_round and mma_tf32_m16n8k8_rounded rewritten, not their FP32 bodies)."""
    monkeypatch.setenv("LUISAML_MMA_TILE", tile)
    model, feeds, want = make()
    tc = luisaml.compile(model, batch_axis=None, tensor_cores="auto")
    assert ("mma_tf32_m16n8k8_rounded" if tile == "w64r" else "mma_tf32_m16n8k8") in tc.plan.source
    e_tc = _rel(tc.run(feeds)["Y"], want)
    e_fp32 = _rel(luisaml.compile(model, batch_axis=None, tensor_cores=False).run(feeds)["Y"], want)
    assert 10 * e_fp32 < e_tc <= TF32_TOL, (e_tc, e_fp32)


def _resnet_stack(n, seed=0):
    """A ResNet-style stack over a batch of n (the batch a symbol): a 7 x 7 stride-2 stem of 3 channels
    (k = 147), a 3 x 3 stride-1 conv (Winograd's where compile takes it), a bottleneck's 1 x 1 and its
    projection shortcut summed and Relu'd (the Add and Relu a conv stage's epilogue), two 3 x 3 stride-2
    convs down to 7 x 7 (49 positions a sample: the mma tile's rows the positions of several samples)."""
    rng = np.random.default_rng(seed)
    inits, nodes = [], []

    def conv(x, y, cin, cout, k, stride=1, relu=True):
        w = (rng.standard_normal((cout, cin, k, k)) * np.sqrt(2 / (cin * k * k))).astype(np.float32)
        inits.extend([numpy_helper.from_array(w, y + "_w"), numpy_helper.from_array(rng.standard_normal(cout).astype(np.float32) * 0.1, y + "_b")])
        nodes.append(helper.make_node("Conv", [x, y + "_w", y + "_b"], [y + "_c" if relu else y], name=y, kernel_shape=[k, k],
                                      strides=[stride] * 2, pads=[k // 2] * 4))
        if relu:
            nodes.append(helper.make_node("Relu", [y + "_c"], [y]))

    conv("X", "stem", 3, 64, 7, stride=2)  # 56 -> 28
    conv("stem", "c3", 64, 64, 3)
    conv("c3", "expand", 64, 256, 1, relu=False)
    conv("stem", "proj", 64, 256, 1, relu=False)
    nodes += [helper.make_node("Add", ["expand", "proj"], ["sum"]), helper.make_node("Relu", ["sum"], ["block"])]
    conv("block", "down1", 256, 128, 3, stride=2)  # 28 -> 14
    conv("down1", "down2", 128, 256, 3, stride=2)  # 14 -> 7
    g = helper.make_graph(nodes, "stack", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 3, 56, 56])],
                          [helper.make_tensor_value_info("down2", TensorProto.FLOAT, ["N", 256, 7, 7])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model, {"X": rng.standard_normal((n, 3, 56, 56)).astype(np.float32)}


@pytest.mark.parametrize("gather", ["step", "first", "reuse"])
@pytest.mark.parametrize("winograd", ["auto", 0])
def test_mma_conv_stack_matches_onnxruntime(winograd, gather, monkeypatch):
    """Every Conv (and Winograd product) of the stack on the mma tile, within TF32's tolerance of
    onnxruntime's float32 (F(4x4)'s transforms add to TF32's rounding: ~3e-3 a layer in a float64
    numpy model of it, ~3e-4 direct); tensor_cores=False keeps the FP32 tiles' 2e-5. A batch of 5: the
    7 x 7 layer's group of samples is partial. Under each of operators/conv_tiles.py's gathers
    (LUISAML_CONV_GATHER: k as (tap, channel) where the channels allow, or (channel, tap), or "reuse"'s
    (channel block, tap, channel))."""
    from util import ort_run

    monkeypatch.setenv("LUISAML_CONV_GATHER", gather)

    model, feeds = _resnet_stack(5)
    want = ort_run(model, feeds)["down2"].astype(np.float64)
    tc = luisaml.compile(model, batch_axis=0, tensor_cores="auto", winograd=winograd)
    fp32 = luisaml.compile(model, batch_axis=0, tensor_cores=False, winograd=winograd)
    tilings = {node.name: type(op.block_tiling()).__name__ for st in tc.plan.schedule.stages if st.domain == "blocks"
               for node, op in st.nodes}
    assert len(tilings) == 6 and set(tilings.values()) == {"MmaTiling"}, tilings
    assert "mma_tf32" not in fp32.plan.source
    e_tc, e_fp32 = _rel(tc.run(feeds)["down2"], want), _rel(fp32.run(feeds)["down2"], want)
    assert e_fp32 <= FP32_TOL, e_fp32
    assert e_tc <= TF32_TOL, e_tc
    assert e_tc > 10 * e_fp32, (e_tc, e_fp32)


def _sample_mlp(widths, seed=0):
    """An MLP over a dynamic batch (Gemm with transB and a bias, Relu between): each layer one row a
    sample; its model and numpy's float64 forward."""
    rng = np.random.default_rng(seed)
    inits, nodes, x = [], [], "X"
    layers = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        w = (rng.standard_normal((b, a)) / np.sqrt(a)).astype(np.float32)
        c = (rng.standard_normal(b) * 0.1).astype(np.float32)
        layers.append((w, c))
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(c, f"c{i}")]
        last = i == len(widths) - 2
        y = "Y" if last else f"r{i}"
        nodes.append(helper.make_node("Gemm", [x, f"w{i}", f"c{i}"], [y if last else f"h{i}"], name=f"layer{i}", transB=1))
        if not last:
            nodes.append(helper.make_node("Relu", [f"h{i}"], [y]))
        x = y
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", widths[0]])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", widths[-1]])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10

    def forward(xv):
        h = xv.astype(np.float64)
        for i, (w, c) in enumerate(layers):
            h = h @ w.T.astype(np.float64) + c
            if i < len(layers) - 1:
                h = np.maximum(h, 0)
        return h

    return model, forward


@pytest.mark.parametrize("n", [1, 37, 300, 4096])
def test_mma_sample_rows_mlp_matches_numpy(n):
    """A NeRF-like MLP's layers of one row a sample (63 -> 256 -> 256 -> 128 -> 3) on the mma tile,
    128 samples a block (operators/gemm_blocks.py MMA_GROUP; the last group partial), within TF32's
    tolerance of float64 numpy; the 3-output head keeps the items form; tensor_cores=False the FP32
    tile of 64 samples and its 2e-5."""
    model, forward = _sample_mlp([63, 256, 256, 128, 3], seed=n)
    x = np.random.default_rng(n).standard_normal((n, 63)).astype(np.float32)
    want = forward(x)
    # (fuse="off": a plain chain of dense layers is otherwise the fused MLP kernel's, operators/mlp.py)
    tc = luisaml.compile(model, batch_axis=0, tensor_cores="auto", fuse="off")
    fp32 = luisaml.compile(model, batch_axis=0, tensor_cores=False, fuse="off")
    tiles = [(type(op.block_tiling()).__name__, st.samples) for st in tc.plan.schedule.stages if st.domain == "blocks"
             for _, op in st.nodes]
    assert tiles == [("MmaTiling", 128)] * 3, tiles
    assert [st.samples for st in fp32.plan.schedule.stages if st.domain == "blocks"] == [64] * 3
    e_tc, e_fp32 = _rel(tc.run({"X": x})["Y"], want), _rel(fp32.run({"X": x})["Y"], want)
    assert e_fp32 <= FP32_TOL, e_fp32
    assert e_tc <= TF32_TOL, e_tc
    assert e_tc > 10 * e_fp32, (e_tc, e_fp32)


# ---- the FP16 kind (operators/tiled_mma.py "f16") and precision="fp16"'s layers as stages on it ----------

# the HMMA's sum of a k16 step's exact products is not IEEE round to nearest (it truncates: Fasi, Higham,
# Mikaitis, Pranesh, "Numerical behavior of NVIDIA tensor cores", 2021), so a sum of K FP32 terms is bounded
# with FP32's unit roundoff for truncation, 2^-23, not 2^-24
U32_TRUNC, U16 = 2.0 ** -23, 2.0 ** -11


@pytest.mark.parametrize("name,make", CASES[:3], ids=[c[0] for c in CASES[:3]])
def test_f16_tile_matches_half_rounded_numpy(name, make, monkeypatch):
    """A Gemm whose product is marked with the FP16 kind (as precision="fp16" marks an MLP's layers): within
    the FP32 accumulation bound of the product of its operands rounded to half, elementwise, and outside it
    of the unrounded operands' product (the operands were rounded: tests/test_tiled_mma_f16.py's emulated twin)."""
    mark_products_f16(monkeypatch)
    model, feeds, _ = make()
    net = luisaml.compile(model, batch_axis=None, tensor_cores="auto")
    assert "mma_f16_m16n8k16(" in net.plan.source and "mma_tf32" not in net.plan.source
    (node,) = model.graph.node
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    a = feeds["A"].T if attrs.get("transA") else feeds["A"]
    b = numpy_helper.to_array(model.graph.initializer[0])
    b = b.T if attrs.get("transB") else b
    inits = model.graph.initializer
    c = numpy_helper.to_array(inits[1]).astype(np.float64) if len(inits) > 1 else 0.0
    a16, b16 = a.astype(np.float16).astype(np.float64), b.astype(np.float16).astype(np.float64)
    want = 0.5 * (a16 @ b16) + c
    bound = 0.5 * a.shape[1] * U32_TRUNC * (np.abs(a16) @ np.abs(b16)) + np.spacing(np.abs(want).astype(np.float32))
    got = net.run(feeds)["Y"].astype(np.float64)
    assert (np.abs(got - want) <= bound).all(), float(np.abs(got - want).max())
    exact = 0.5 * (a.astype(np.float64) @ b.astype(np.float64)) + c
    assert (np.abs(got - exact) > bound).any()


def _fp16_mlp(width: int, tmp_path):
    from util import export_batched, torch_mlp

    module = torch_mlp([63, width, width, width, width, 4])
    return module, export_batched(module, 63, tmp_path / f"mlp{width}.onnx")


@pytest.mark.parametrize("width,half_activations", [(128, True), (256, True), (128, False)])
@pytest.mark.parametrize("n", [100, 4097])
def test_fp16_mlp_on_f16_stages_matches_torch_fp16(width, half_activations, n, tmp_path, monkeypatch):
    """RESULTS.md's fp16 MLPs (63-128x4-4, 63-256x4-4) under precision="fp16" with tensor cores: four stages on
    the FP16 mma tile, half in and out (luisaml/rewrites/mlp.py f16_stages), the activations between them in
    half buffers or float ones (FP16_HALF_ACTIVATIONS); their error against the float64 model within twice
    torch fp16's on this GPU plus half's unit roundoff (of the output's largest magnitude); a torch half
    tensor on the device runs zero-copy and comes back half."""
    import torch

    import luisaml.rewrites.mlp as mlp_rewrite

    monkeypatch.setattr(mlp_rewrite, "FP16_HALF_ACTIVATIONS", half_activations)
    module, path = _fp16_mlp(width, tmp_path)
    net = luisaml.compile(path, precision="fp16", tensor_cores="auto")
    assert net.plan.fused is None and net.plan.half_io, net.plan.fusion_note
    assert net.plan.half_activations == half_activations
    mma = [op.block_tiling() for st in net.plan.schedule.stages if st.domain == "blocks" for _, op in st.nodes[:1]]
    assert sum(type(t).__name__ == "MmaTiling" and t.kind == "f16" for t in mma) == 4
    x16 = (np.random.default_rng(n).standard_normal((n, 63)) * 2).astype(np.float16)
    got = net.run({"x": x16})["y"]
    assert got.dtype == np.float16 and got.shape == (n, 4)
    with torch.no_grad():
        exact = module.double()(torch.from_numpy(x16).double()).numpy()
        theirs = module.half().cuda()(torch.from_numpy(x16).cuda()).double().cpu().numpy()
        on_device = net.run({"x": torch.from_numpy(x16).cuda()})["y"]
    scale = np.abs(exact).max()
    ours, torch_err = np.abs(got.astype(np.float64) - exact).max() / scale, np.abs(theirs - exact).max() / scale
    assert ours <= 2 * torch_err + U16, (ours, torch_err)
    assert on_device.dtype == torch.float16 and on_device.is_cuda
    np.testing.assert_array_equal(on_device.cpu().numpy(), got)


def test_fp16_mlp_fused_when_the_switch_is_off(tmp_path, monkeypatch):
    """FP16_STAGES off (the A/B switch): the fused FP32 kernel with half inputs and outputs, as before."""
    import luisaml.rewrites.mlp as mlp_rewrite

    monkeypatch.setattr(mlp_rewrite, "FP16_STAGES", False)
    _, path = _fp16_mlp(128, tmp_path)
    net = luisaml.compile(path, precision="fp16", tensor_cores="auto")
    assert net.plan.fused is not None and not net.plan.half_io
    assert net.run({"x": np.ones((300, 63), np.float16)})["y"].dtype == np.float16
