"""CUDA's block loop (operators/rnn_block.py: a recurrence's whole sequence in one blocks launch, h in
shared memory, a barrier a step) without a GPU: RNN, GRU (both linear_before_reset) and LSTM planned
for CUDA take it, and their emitted kernels, run in Python (tests/gpu_emulator.py: a thread per GPU
thread, the threads of a block one at a time up to each barrier, in both orders), give onnxruntime's
Y, Y_h and Y_c: every direction, ragged sequence_lens, initial states, peepholes, clip, input_forget,
every activation with alpha/beta, layouts 0 and 1 (the batch per sample too), row groups ragged
against the batch, a unit a thread and several (some threads with none), shared memory as floats and
as float4s of 4 rows. The same kernels also pass luisa-python's AST builder (what a CUDA launch does
before NVRTC). tests/gpu/test_rnn_cuda.py runs them on a GPU."""
import numpy as np
import pytest
from gpu_emulator import build_dsl, kernel_name, run_plan
from test_rnn import as_layout0, case, from_layout0, merge
from util import export_torch, graph_model, ort_run, split_rnn_feeds, torch_rnn

import luisaml
from luisaml.operators import rnn_block
from luisaml.runtime import analyze

EVERY = ("B", "sequence_lens", "initial_h", "initial_c", "P")

# rnn_block's (SMS, MAX_ROWS, MAX_THREADS): the shipped estimate gives these small cells a row a block
# (floats in shared memory); on "one SM" the fewest blocks win: 2 rows a block (floats), 8 (float4s,
# the batch of 5 ragged against them), 3 threads a block (8 units: 3 a thread, the last thread's third
# past H; 12 units: 4 a thread) and 4 rows a block (the accumulators' cap)
GEOMETRIES = {"row": (132, 8, 256), "pairs": (1, 2, 256), "rows": (1, 8, 256), "units": (1, 8, 3)}
ROWS = {"row": {1}, "pairs": {2}, "rows": {8}, "units": {4}}


def _cases(op, extra):
    return merge(case(op, 0, S=4, B=5, I=3, H=8, use=EVERY, seed=1, **extra),
                 case(op, 1, S=3, B=5, I=4, H=12, direction="reverse", use=("B", "sequence_lens", "initial_h"), seed=2, **extra),
                 case(op, 2, S=4, B=5, I=3, H=8, direction="bidirectional", use=EVERY, seed=3, clip=2.0, **extra))


def _geometry(monkeypatch, name):
    for key, value in zip(("SMS", "MAX_ROWS", "MAX_THREADS"), GEOMETRIES[name]):
        monkeypatch.setattr(rnn_block, key, value)
    # the k loop's round trips are most of these small cells' estimate (a tie at any rows): left out, the
    # SMs and L2 decide the rows as GEOMETRIES says
    monkeypatch.setattr(rnn_block, "LOAD_LATENCY", 0)


def _block_stages(plan):
    """The steps' stages, checked to be the block loop: one blocks stage a recurrent node."""
    steps = [st for st in plan.schedule.stages if st.root[0].op_type.endswith("Steps")]
    for st in steps:
        op = st.root[1]
        assert st.domain == "blocks" and op.block is not None and st.threads == op.block.TU, st.describe()
        assert len(st.root[0].outputs) == 3  # no state buffers: the state is on chip
    assert len({st.root[0].name for st in steps}) == len(steps)
    return steps


def _check(model, feeds, want=None, reverse=False, tol=2e-5, form="auto"):
    plan = analyze(model, batch_axis=None, target="cuda", recurrent=form)
    steps = _block_stages(plan)
    got = run_plan(plan, feeds, reverse=reverse)
    for name, w in (want or ort_run(model, feeds)).items():
        np.testing.assert_allclose(got[name], w, rtol=tol, atol=tol, err_msg=name)
    return plan, steps


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize("op,extra", [("RNN", {}), ("GRU", {}), ("GRU", {"linear_before_reset": 1}), ("LSTM", {}),
                                      ("LSTM", {"input_forget": 1})])
def test_block_loop_matches_onnxruntime(monkeypatch, op, extra, geometry):
    _geometry(monkeypatch, geometry)
    nodes, feeds = _cases(op, extra)
    feeds, inits = split_rnn_feeds(feeds)
    model = graph_model(nodes, feeds, inits, opset=22)
    want = ort_run(model, feeds)
    got = {}
    # the k loop unrolled (8 or 4 k's an iteration, the loads an iteration ahead) with the projection
    # inside the step (no projection stage) and without, "auto" with the loads where they are used
    # ("unrolled"), and the form as first built
    for form in ("auto", "unfused", "unrolled", "block"):
        for reverse in (False, True):
            plan, steps = _check(model, feeds, want, reverse, form=form)
        got[form] = run_plan(plan, feeds)
        us = {st.root[1].block.U for st in steps}
        assert us == {1} if form == "block" else us <= {4, 8} and len(us) >= 1
        assert all(st.root[1].block.fused == (form in ("auto", "unrolled")) for st in steps)
        assert all(st.root[1].block.prefetch == (form in ("auto", "unfused")) for st in steps)
        inside = form in ("auto", "unrolled")
        assert sum(st.root[0].op_type == "RecurrentProjection" for st in plan.schedule.stages) == (0 if inside else 3)
    for name in want:  # each accumulator sums in the same order either way: the same bits
        np.testing.assert_array_equal(got["unfused"][name], got["block"][name], err_msg=name)
        np.testing.assert_array_equal(got["auto"][name], got["unrolled"][name], err_msg=name)
    sb = {st.root[1].block.SB for st in steps}
    ub = {st.root[1].block.UB for st in steps}
    assert sb == ({8} if geometry == "units" and op == "RNN" else ROWS[geometry])  # (RNN: 1 gate, room for 8 rows)
    assert ub == ({1} if geometry != "units" else {3, 4})
    if op == "GRU" and not extra:  # two barriers a step: r . h_(t-1) of every unit before the hidden gate
        assert plan.source.count("sync_block()") == 3 * len(steps)


def test_run_time_weights_and_every_activation(monkeypatch):
    """R as a graph input (read where it is, not prepacked) and every activation with alpha/beta,
    different per direction (a branch on the direction inside the loop), clip."""
    _geometry(monkeypatch, "rows")
    nodes, feeds = merge(
        case("RNN", 0, S=3, B=5, I=3, H=8, direction="bidirectional", use=("B",), activations=["LeakyRelu", "ThresholdedRelu"],
             activation_alpha=[0.3, 0.25]),
        case("RNN", 1, S=3, B=5, I=3, H=8, use=("B", "initial_h"), activations=["Softplus"], clip=0.8),
        case("GRU", 2, S=3, B=5, I=3, H=8, direction="bidirectional", use=("B",),
             activations=["HardSigmoid", "ScaledTanh", "Sigmoid", "Softsign"], activation_alpha=[0.3, 0.8], activation_beta=[0.45, 1.3]),
        case("GRU", 3, S=3, B=5, I=3, H=8, use=("B",), activations=["Affine", "Relu"], activation_alpha=[0.4], activation_beta=[0.3],
             clip=1.5, linear_before_reset=1),
        case("LSTM", 4, S=3, B=5, I=3, H=8, use=("B", "P", "initial_c"), activations=["HardSigmoid", "Elu", "ScaledTanh"],
             activation_alpha=[0.25, 0.6, 0.9], activation_beta=[0.4, 1.1]),
        case("LSTM", 5, S=3, B=5, I=3, H=8, direction="bidirectional", use=("B", "P", "sequence_lens"), clip=0.5,
             activations=["Sigmoid", "Tanh", "Softsign", "Sigmoid", "LeakyRelu", "Tanh"]),
    )
    model = graph_model(nodes, feeds, opset=22)  # W, R, B, P graph inputs
    _check(model, feeds)


def test_layout1(monkeypatch):
    """Layout 1 over a fixed batch (Y's strides its own), and with a batch symbol (the steps per sample:
    a block a sample's rows and direction) at two batch sizes."""
    _geometry(monkeypatch, "rows")
    nodes, f = merge(case("LSTM", 0, S=4, B=5, I=3, H=8, layout=1, direction="bidirectional", use=EVERY, seed=4),
                     case("GRU", 1, S=4, B=5, I=3, H=8, layout=1, direction="reverse", use=("B", "sequence_lens"), seed=5))
    feeds, inits = split_rnn_feeds(f)
    plan = analyze(graph_model(nodes, feeds, inits, opset=22), batch_axis=None, target="cuda")
    _block_stages(plan)
    got = run_plan(plan, feeds, reverse=True)
    nodes0, f0 = as_layout0(nodes, f)
    for name, w in ort_run(graph_model(nodes0, f0, opset=22), f0).items():
        np.testing.assert_allclose(got[name], from_layout0(name, w), rtol=2e-5, atol=2e-5, err_msg=name)

    node, f = case("LSTM", 0, S=5, B=2, I=4, H=8, layout=1, direction="bidirectional", use=EVERY, seed=6)
    feeds, inits = split_rnn_feeds(f)
    plan = analyze(graph_model([node], feeds, inits, opset=22, batch="N"), target="cuda")
    (st,) = _block_stages(plan)
    assert st.batched and (st.root[1].block.SB, st.root[1].block.blocks) == (1, 2)  # a sample's row, 2 directions
    for n in (1, 3):
        rng = np.random.default_rng(n)
        fn = {k: (np.arange(n, dtype=np.int32) % 5 + 1) if k.startswith("sequence_lens") else
              rng.standard_normal((n,) + v.shape[1:]).astype(np.float32) for k, v in feeds.items()}
        got = run_plan(plan, fn)
        nodes0, f0 = as_layout0([node], {**fn, **inits})
        for name, w in ort_run(graph_model(nodes0, f0, opset=22), f0).items():
            np.testing.assert_allclose(got[name], from_layout0(name, w), rtol=2e-5, atol=2e-5, err_msg=name)


@pytest.mark.parametrize("geometry", ["rows", "units"])
def test_kernels_build_as_dsl(monkeypatch, geometry):
    """luisa-python builds the block loop's kernels (shared float4s or floats, the registers set in
    branches on the direction, barriers inside the step loop): only the backend's compile is left out."""
    _geometry(monkeypatch, geometry)
    luisaml.device.current() or luisaml.device.init("cpu")
    nodes, feeds = merge(case("GRU", 0, S=4, B=5, I=3, H=8, direction="bidirectional", use=EVERY, seed=1,
                              activations=["HardSigmoid", "Tanh", "Sigmoid", "Softsign"]),
                         case("LSTM", 1, S=4, B=5, I=3, H=12, direction="bidirectional", use=EVERY, seed=2, clip=1.0),
                         case("RNN", 2, S=4, B=5, I=3, H=8, use=EVERY, seed=3))
    feeds, inits = split_rnn_feeds(feeds)
    node, f = case("LSTM", 0, S=5, B=2, I=4, H=8, layout=1, direction="bidirectional", use=EVERY, seed=6)
    per_sample = graph_model([node], *split_rnn_feeds(f), opset=22, batch="N")  # the steps per sample
    for plan in (analyze(graph_model(nodes, feeds, inits, opset=22), batch_axis=None, target="cuda"),
                 analyze(per_sample, target="cuda")):
        for st in _block_stages(plan):
            assert len(build_dsl(plan, kernel_name(plan, st), monkeypatch)) == 1


def test_choose():
    """The geometry, the estimate choosing the rows a block, and the fallback rule: shared memory past
    48 KiB or accumulators past 64 at one row a block, or a step estimated slower than a phase of the
    phase-a-step form (a wide cell over few rows), keeps that form."""
    class Cell:
        def __init__(self, gates, H, B, D=1, S=32, I=64):
            self.gates, self.H, self.B, self.D, self.S, self.I = gates, H, B, D, S, I

    gru = rnn_block.choose(Cell(3, 128, 1024), False, False)  # the zoo's: L2-bound, 4 rows twice as slow
    assert (gru.SB, gru.TU, gru.UB, gru.blocks, gru.shared_bytes) == (8, 128, 1, 128, 8192)
    assert gru.U == 8  # 8 k's an iteration: 24 loads of R in flight a thread
    assert rnn_block.step_clocks(3, 128, 1, 1024, 4, 8) == 2 * rnn_block.step_clocks(3, 128, 1, 1024, 8, 8)
    # a k an iteration: 128 round trips to L2 a step, past every other term
    assert rnn_block.step_clocks(3, 128, 1, 1024, 8, 1) == 128 * rnn_block.LOAD_LATENCY
    assert rnn_block.choose(Cell(3, 128, 1024), True, False).shared_bytes == 12288  # r . h as well
    lstm = rnn_block.choose(Cell(4, 128, 1024, D=2), False, False)
    assert (lstm.SB, lstm.blocks) == (8, 256)
    assert rnn_block.choose(Cell(3, 8, 5), False, False).SB == 1  # a tie: the most blocks
    bilstm = rnn_block.choose(Cell(4, 256, 64, D=2), False, False)  # the zoo's BiLSTM tagger
    assert (bilstm.SB, bilstm.blocks, bilstm.U) == (4, 32, 8)  # 2 rows: 64 MiB of L2 reads a step, 4 rows 32
    first = rnn_block.choose(Cell(4, 256, 64, D=2), False, False, "block")  # the form as first built
    assert (first.SB, first.blocks, first.U) == (2, 64, 1)
    assert rnn_block.choose(Cell(4, 256, 64, D=2), False, False, "steps") is None
    assert rnn_block.unroll(4, 1024, 4) == 4 and rnn_block.unroll(3, 12, 1) == 4 and rnn_block.unroll(4, 7, 1) == 1
    wide = rnn_block.choose(Cell(4, 512, 1024), False, False)
    assert (wide.TU, wide.UB, wide.SB, wide.shared_bytes) == (256, 2, 8, 32768)
    assert rnn_block.choose(Cell(4, 1024, 1024), False, False).SB == 4  # 4 units a thread: 4 rows, 32 KiB
    odd = rnn_block.choose(Cell(4, 700, 1024), False, False)  # 3 units a thread, the last threads' third past H
    assert (odd.TU, odd.UB, odd.SB) == (234, 3, 4)
    assert rnn_block.choose(Cell(3, 4352, 1), False, True).SB == 1  # 34 KiB at one row
    assert rnn_block.choose(Cell(3, 4352, 1), True, True) is None  # 51 KiB with r . h
    assert rnn_block.choose(Cell(4, 4352, 1), False, True) is None  # 68 accumulators at one row
    assert rnn_block.choose(Cell(4, 256, 16), False, False) is not None
    assert rnn_block.choose(Cell(4, 512, 1), False, False) is None  # 4 MiB of R read by one SM a step
    assert rnn_block.choose(Cell(4, 2048, 64), False, False) is None  # 64 MiB of R, 2 rows a block at most
    assert rnn_block.choose(Cell(4, 2048, 1), False, True).SB == 1  # per sample: the batch fills the GPU
    assert rnn_block.choose(Cell(4, 512, 2), False, True).SB == 2


def test_phase_a_step_where_it_does_not_fit():
    """A wide cell with few rows keeps the phase-a-step form (its state buffers, S + 1 phases)."""
    nodes, feeds = merge(case("LSTM", 0, S=3, B=2, I=3, H=1024, use=("B",), seed=1))
    feeds, inits = split_rnn_feeds(feeds)
    plan = analyze(graph_model(nodes, feeds, inits, opset=22), batch_axis=None, target="cuda")
    steps = [st for st in plan.schedule.stages if st.root[0].op_type == "LSTMSteps"]
    assert [st.domain for st in steps] == ["items"] * 4 and steps[0].root[1].block is None
    assert len(steps[0].root[0].outputs) == 5


@pytest.mark.parametrize("cell", ["GRU", "LSTM"])
def test_torch_export_projection_inside(cell, tmp_path):
    """torch's batch_first nn.GRU (linear_before_reset) / nn.LSTM, 2 layers, bidirectional, as the block
    loop with the input projection inside the step: X read through the exporter's Transpose's source
    (P's row order), Y stored through its chain of layout nodes; no projection stage; against torch."""
    torch = pytest.importorskip("torch")
    module = torch_rnn(cell, 6, layers=2, bidirectional=True)
    x = torch.randn(3, 5, 6)
    plan = analyze(export_torch(module, x, tmp_path / "rnn.onnx"), batch_axis=None, target="cuda")
    steps = _block_stages(plan)
    assert len(steps) == 2 and all(st.root[1].block.fused for st in steps)
    assert not any(st.root[0].op_type == "RecurrentProjection" for st in plan.schedule.stages)
    with torch.no_grad():
        want = module(x).numpy()
    got = run_plan(plan, {"x": x.numpy()}, reverse=True)["y"]
    np.testing.assert_allclose(np.asarray(got).reshape(want.shape), want, rtol=2e-5, atol=2e-5)
    # the loads an iteration ahead (both k loops: R's and the projection's W) move no sum: the same bits
    assert all(st.root[1].block.prefetch for st in steps)
    unrolled = analyze(export_torch(module, x, tmp_path / "rnn.onnx"), batch_axis=None, target="cuda", recurrent="unrolled")
    assert not any(st.root[1].block.prefetch for st in _block_stages(unrolled))
    np.testing.assert_array_equal(np.asarray(run_plan(unrolled, {"x": x.numpy()})["y"]), np.asarray(got))


def test_recurrent_option_is_checked():
    from luisaml.errors import UsageError
    from luisaml.planning import CompileOptions

    with pytest.raises(UsageError, match="recurrent must be"):
        CompileOptions(recurrent="fused").resolve("cuda")
    assert CompileOptions(recurrent="block").resolve("cuda").build_options().recurrent == "block"
    assert CompileOptions(recurrent="unrolled").resolve("cuda").build_options().recurrent == "unrolled"
