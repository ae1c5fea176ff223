"""The recurrent stages (operators/rnn_stages.py): RNN, GRU and LSTM as a projection GEMM and a phase
per step, against onnxruntime over batches > 1, several sequence lengths, both layouts, every
direction, ragged sequence_lens, the cells' options; with hidden sizes whose tiles are float4s
(multiples of 8) and scalars; the CUDA tile (2 rows x 4 units) emitted for the CPU; a kernel a
stage (CUDA's plan: the steps one shared kernel); torch's nn.GRU / nn.LSTM against torch."""

import numpy as np
import pytest

from test_rnn import as_layout0, case, from_layout0, merge
from util import assert_matches_ort, export_torch, graph_model, ort_run, torch_rnn

import luisaml
from luisaml import planning, runtime
from luisaml.rewrites import rnn as rnn_rewrite

EVERY = ("B", "sequence_lens", "initial_h", "initial_c", "P")


def _cases(op, S, H):
    return merge(
        case(op, 0, S=S, B=5, I=7, H=H, use=EVERY, seed=1),
        case(op, 1, S=S, B=5, I=7, H=H, direction="reverse", use=("B", "sequence_lens"), seed=2),
        case(op, 2, S=S, B=5, I=7, H=H, direction="bidirectional", use=EVERY, seed=3, clip=2.0),
        case(op, 3, S=S, B=5, I=7, H=H, direction="bidirectional", seed=4),
    )


def constants(feeds):
    """Return (graph inputs, initializers): W, R, B, P as constants (R then prepacked: float4 tiles)."""
    inits = {k: v for k, v in feeds.items() if k[0] in "WRBP" and not k.startswith("sequence")}
    return {k: v for k, v in feeds.items() if k not in inits}, inits


def _kinds(net):
    return [st.root[0].op_type for st in net.plan.schedule.stages]


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
@pytest.mark.parametrize("S,H,const", [(1, 8, True), (5, 16, True), (3, 6, True), (4, 8, False)])
def test_stages_layout0(op, S, H, const):
    nodes, feeds = _cases(op, S, H)
    feeds, inits = constants(feeds) if const else (feeds, {})
    net, _ = assert_matches_ort(graph_model(nodes, feeds, inits, opset=22), feeds, batch_axis=None, rtol=1e-5, atol=1e-5)
    kinds = _kinds(net)
    assert "RecurrentProjection" in kinds and f"{op}Steps" in kinds and op not in kinds


@pytest.mark.parametrize("op", ["GRU", "LSTM"])
def test_options_and_layout1(op):
    """linear_before_reset / input_forget, and layout 1 with ragged lengths, against onnxruntime's layout 0."""
    from test_rnn import assert_layout1_matches

    extra = {"linear_before_reset": 1} if op == "GRU" else {"input_forget": 1}
    nodes, feeds = merge(case(op, 0, S=6, B=4, I=5, H=8, layout=1, direction="bidirectional", use=EVERY, seed=5, **extra),
                         case(op, 1, S=6, B=4, I=5, H=8, layout=1, direction="reverse", use=("B", "sequence_lens"), seed=6))
    assert_layout1_matches(nodes, feeds, rtol=1e-5, atol=1e-5, batch_axis=None)
    nodes, feeds = merge(case(op, 0, S=4, B=6, I=5, H=16, use=EVERY, seed=7, **extra))
    assert_matches_ort(graph_model(nodes, feeds, opset=22), feeds, batch_axis=None, rtol=1e-5, atol=1e-5)


def test_per_sample_layout1_batched():
    """Layout 1 with a batch symbol: the steps run per sample (batched stages), any batch size."""
    node, f = case("LSTM", 0, S=5, B=2, I=4, H=8, layout=1, direction="bidirectional", use=EVERY)
    shared = ("W0", "R0", "B0", "P0")
    inits = {k: v for k, v in f.items() if k in shared}
    feeds = {k: v for k, v in f.items() if k not in shared}
    net = luisaml.compile(graph_model([node], feeds, inits, opset=22, batch="N"))
    assert "LSTMSteps" in _kinds(net)
    for n in (1, 3):
        rng = np.random.default_rng(n)
        fn = {k: (np.arange(n, dtype=np.int32) % 5 + 1) if k.startswith("sequence_lens") else
              rng.standard_normal((n,) + v.shape[1:]).astype(np.float32) for k, v in feeds.items()}
        got = net.run(fn)
        nodes0, f0 = as_layout0([node], {**fn, **inits})
        for name, w in ort_run(graph_model(nodes0, f0, opset=22), f0).items():
            np.testing.assert_allclose(got[name], from_layout0(name, w), rtol=1e-5, atol=1e-5, err_msg=name)


def test_cuda_tile_and_a_kernel_a_stage(tmp_path, monkeypatch):
    """The CUDA plan's phase-a-step form (where the block loop does not fit: rnn_block.choose) on the
    CPU: 2 rows x 4 units a thread (float4 R), a kernel a stage with the steps of each node one shared
    kernel (one branch for all steps); equal to onnxruntime, also loaded back from an artifact."""
    orig = rnn_rewrite.rewrite
    monkeypatch.setattr(rnn_rewrite, "rewrite", lambda plan, gpu, form="auto": orig(plan, True, form))
    monkeypatch.setattr(rnn_rewrite.rnn_block, "choose", lambda *a: None)
    nodes, feeds = merge(case("GRU", 0, S=4, B=5, I=3, H=8, use=EVERY, seed=8),
                         case("LSTM", 1, S=4, B=5, I=3, H=8, direction="bidirectional", use=EVERY, seed=9))
    feeds, inits = constants(feeds)
    model = graph_model(nodes, feeds, inits, opset=22)
    plan, _, _ = planning.plan_for(model, "rnn", planning.CompileOptions(merge_stages=False, batch_axis=None).resolve("cpu"))
    assert "shared_recurrent" in plan.kernels
    assert len(plan.kernels) < len(plan.schedule.stages) - 8
    assert "weights.read(float4" in plan.source
    net = runtime._network(plan, "cpu")
    want = ort_run(model, feeds)
    got = net.run(feeds)
    for name, w in want.items():
        np.testing.assert_allclose(got[name], w, rtol=1e-5, atol=1e-5, err_msg=name)
    loaded = luisaml.load(net.save(tmp_path / "rnn.lml"))
    for name, w in want.items():
        np.testing.assert_allclose(loaded.run(feeds)[name], w, rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("cell", ["GRU", "LSTM"])
def test_torch_export(cell, tmp_path):
    """nn.GRU / nn.LSTM (2 layers, bidirectional, batch_first) exported by torch, against torch."""
    torch = pytest.importorskip("torch")
    module = torch_rnn(cell, 6, layers=2, bidirectional=True)
    x = torch.randn(3, 5, 6)
    net = luisaml.compile(export_torch(module, x, tmp_path / "rnn.onnx"))
    got = net.run({"x": x.numpy()})["y"]
    with torch.no_grad():
        want = module(x).numpy()
    np.testing.assert_allclose(np.asarray(got).reshape(want.shape), want, rtol=1e-5, atol=1e-5)
