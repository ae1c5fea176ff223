"""Recurrent stages on the CUDA backend (operators/rnn_stages.py: the projection on the GEMM tile,
the steps in one launch of the block loop, operators/rnn_block.py, or where it does not fit a phase a
step, 2 rows x 4 units a thread with float4 R, one shared kernel) against onnxruntime: GRU (both
linear_before_reset) and LSTM, every direction, ragged sequence_lens, initial states, peepholes,
layout 0 over a fixed batch and layout 1 per sample; the block loop 1 or 2 rows a block (floats in
shared memory), 4 or 8 (float4s, the batch ragged against them), 3 units a thread (some threads with
2), and at the zoo's shapes (1,024 rows, 64 -> 128 units, 32 steps: 8 rows a block; the BiLSTM
tagger's layer), each form of compile's `recurrent` (the input projection inside the steps or not,
the block loop as first built).

    LUISAML_BACKEND=cuda python -m pytest tests/gpu/test_rnn_cuda.py -q"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from util import cuda_only, graph_model, ort_run, split_rnn_feeds

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operators"))
from test_rnn import as_layout0, case, from_layout0, merge  # noqa: E402

import luisaml  # noqa: E402
from luisaml.operators import rnn_block  # noqa: E402

pytestmark = cuda_only()

# the block loop's geometry (rnn_block's SMS, MAX_THREADS: on "one SM" the fewest blocks win, 8 rows a
# block, or 4 with 3 units a thread), or None: the phase-a-step form
FORMS = {"block": (132, 256), "block rows": (1, 256), "block units": (1, 12), "block first": (132, 256), "per step": None}


def _form(monkeypatch, name):
    """Return compile's `recurrent` for a form of FORMS ("block first": the block loop as first built,
    a k an iteration)."""
    if FORMS[name] is None:
        return "steps"
    monkeypatch.setattr(rnn_block, "SMS", FORMS[name][0])
    monkeypatch.setattr(rnn_block, "MAX_THREADS", FORMS[name][1])
    monkeypatch.setattr(rnn_block, "LOAD_LATENCY", 0)  # (these small cells: the SMs and L2 decide the rows)
    return "block" if name == "block first" else "auto"

EVERY = ("B", "sequence_lens", "initial_h", "initial_c", "P")


def _model(nodes, feeds, inits):
    m = graph_model(nodes, feeds, inits, opset=22)
    m.ir_version = 10  # the lent machine's onnxruntime reads IR 10 at most
    return m


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("op,extra", [("GRU", {}), ("GRU", {"linear_before_reset": 1}), ("LSTM", {}),
                                      ("LSTM", {"input_forget": 1})])
def test_layout0_fixed_batch(op, extra, form, monkeypatch):
    recurrent = _form(monkeypatch, form)
    nodes, feeds = merge(case(op, 0, S=9, B=67, I=24, H=32, use=EVERY, seed=1, **extra),
                         case(op, 1, S=9, B=67, I=24, H=32, direction="reverse", use=("B", "sequence_lens"), seed=2, **extra),
                         case(op, 2, S=5, B=33, I=16, H=16, direction="bidirectional", use=EVERY, seed=3, clip=3.0, **extra))
    feeds, inits = split_rnn_feeds(feeds)
    net = luisaml.compile(_model(nodes, feeds, inits), batch_axis=None, backend="cuda", recurrent=recurrent)
    blocks = [st for st in net.plan.schedule.stages if st.domain == "blocks" and st.root[0].op_type.endswith("Steps")]
    assert len(blocks) == (0 if form == "per step" else 3)
    got = net.run(feeds)
    for name, w in ort_run(_model(nodes, feeds, inits), feeds).items():
        np.testing.assert_allclose(got[name], w, rtol=1e-4, atol=1e-4, err_msg=name)


@pytest.mark.parametrize("recurrent", ["auto", "unfused", "unrolled", "block"])
@pytest.mark.parametrize("op,extra", [("GRU", {}), ("GRU", {"linear_before_reset": 1}), ("LSTM", {})])
def test_zoo_shapes(op, extra, recurrent):
    """1,024 rows of 64 -> 128 units over 32 steps (the zoo's GRU and LSTM): 8 rows a block, 128 blocks
    of 128 threads, one launch for the steps; ragged lengths, initial states, both directions for LSTM."""
    nodes, feeds = merge(case(op, 0, S=32, B=1024, I=64, H=128, use=EVERY, seed=7,
                              direction="bidirectional" if op == "LSTM" else "forward", **extra))
    feeds, inits = split_rnn_feeds(feeds)
    net = luisaml.compile(_model(nodes, feeds, inits), batch_axis=None, backend="cuda", recurrent=recurrent)
    (st,) = [st for st in net.plan.schedule.stages if st.root[0].op_type.endswith("Steps")]
    bl = st.root[1].block  # auto: the input projection inside the steps, one launch in all
    assert st.domain == "blocks" and bl.SB == 8 and bl.U == (1 if recurrent == "block" else 8)
    assert bl.fused == (recurrent in ("auto", "unrolled")) and len(net.plan.schedule.stages) == (1 if bl.fused else 2)
    assert bl.prefetch == (recurrent in ("auto", "unfused"))  # (the loads of R an iteration ahead)
    got = net.run(feeds)
    # 32 steps of 128-term sums in float32 drift apart in the order of operations: at these shapes the
    # CPU backend (another form and order) is 1.5e-4 from onnxruntime at most, this form measured
    # 1.1e-4 / 1.2e-4 (H100, 2026-12-06: 1 and 4 of 4M elements past 1e-4)
    for name, w in ort_run(_model(nodes, feeds, inits), feeds).items():
        np.testing.assert_allclose(got[name], w, rtol=1e-4, atol=3e-4, err_msg=name)


@pytest.mark.parametrize("op", ["GRU", "LSTM"])
def test_layout1_per_sample(op):
    node, f = case(op, 0, S=7, B=2, I=12, H=16, layout=1, direction="bidirectional", use=EVERY)
    feeds, inits = split_rnn_feeds(f)
    net = luisaml.compile(graph_model([node], feeds, inits, opset=22, batch="N"), backend="cuda")
    for n in (1, 130):
        rng = np.random.default_rng(n)
        fn = {k: (np.arange(n, dtype=np.int32) % 7 + 1) if k.startswith("sequence_lens") else
              rng.standard_normal((n,) + v.shape[1:]).astype(np.float32) for k, v in feeds.items()}
        got = net.run(fn)
        nodes0, f0 = as_layout0([node], {**fn, **inits})
        m0 = graph_model(nodes0, f0, opset=22)
        m0.ir_version = 10
        for name, w in ort_run(m0, f0).items():
            np.testing.assert_allclose(got[name], from_layout0(name, w), rtol=1e-4, atol=1e-4, err_msg=name)


@pytest.mark.parametrize("recurrent", ["auto", "unrolled", "block"])
def test_bilstm_tagger_shape(recurrent):
    """The zoo's BiLSTM tagger's layer: 64 rows, 128 -> 256 units a direction, 64 steps: 4 rows a block
    and 8 k's an iteration (32 blocks of 256 threads), or as first built (2 rows, a k an iteration)."""
    nodes, feeds = merge(case("LSTM", 0, S=64, B=64, I=128, H=256, use=EVERY, seed=11, direction="bidirectional"))
    feeds, inits = split_rnn_feeds(feeds)
    net = luisaml.compile(_model(nodes, feeds, inits), batch_axis=None, backend="cuda", recurrent=recurrent)
    (st,) = [st for st in net.plan.schedule.stages if st.root[0].op_type.endswith("Steps")]
    bl = st.root[1].block
    assert (bl.SB, bl.U, bl.fused, bl.prefetch) == ((2, 1, False, False) if recurrent == "block" else
                                                    (4, 8, False, recurrent == "auto"))
    got = net.run(feeds)
    for name, w in ort_run(_model(nodes, feeds, inits), feeds).items():  # (64 steps of 256-term sums)
        np.testing.assert_allclose(got[name], w, rtol=1e-4, atol=3e-4, err_msg=name)


@pytest.mark.parametrize("op,extra", [("GRU", {"linear_before_reset": 1}), ("LSTM", {})])
def test_loads_ahead_change_no_bit(op, extra):
    """The k loops' loads an iteration ahead ("auto") against the same kernel with the loads where written
    ("unrolled"): each accumulator sums the same terms in the same order, so the same bits on the device
    too (the emulator's check: tests/operators/test_rnn_block_loop.py)."""
    nodes, feeds = merge(case(op, 0, S=32, B=1024, I=64, H=128, use=EVERY, seed=7, direction="bidirectional", **extra))
    feeds, inits = split_rnn_feeds(feeds)
    got = {}
    for recurrent in ("auto", "unrolled"):
        net = luisaml.compile(_model(nodes, feeds, inits), batch_axis=None, backend="cuda", recurrent=recurrent)
        (st,) = [st for st in net.plan.schedule.stages if st.root[0].op_type.endswith("Steps")]
        assert st.root[1].block.prefetch == (recurrent == "auto")
        got[recurrent] = net.run(feeds)
    for name in got["auto"]:
        np.testing.assert_array_equal(np.asarray(got["auto"][name]), np.asarray(got["unrolled"][name]), err_msg=name)
