"""The CUDA backend's recurrent stages, built without a GPU. The zoo's GRU and LSTM (1,024 rows, 64 ->
128 units, 32 steps, torch's export) plan as the projection and ONE launch of the block loop
(operators/rnn_block.py), whose kernel luisa's AST builder takes (the CPU backend cannot compile its
shared memory: tests/operators/test_rnn_block_loop.py runs it in Python). Where the block loop does
not fit, the steps are one shared kernel of a phase a step (operators/rnn_stages.py), whose DSL the CPU
device turns into a kernel as the CUDA device would. Names of that kernel's locals must be unique:
"t2" + 547 and "t" + 2547 were one name, typed float4 and int, and the kernel failed to build on the
GPU. Numbers are checked on the GPU (tests/gpu/test_rnn_cuda.py)."""
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from gpu_emulator import build_dsl, kernel_name
from test_rnn import case, merge
from util import graph_model

import luisaml
from luisaml import codegen
from luisaml.operators import rnn_block
from luisaml.runtime import _network, analyze

EVERY = ("B", "sequence_lens", "initial_h", "initial_c", "P")


def test_fresh_names_never_collide_across_prefixes():
    m = codegen.Module()
    prefixes = np.random.default_rng(0).choice(["t", "t2", "x1", "x", "acc"], 5000)
    names = [m.fresh(str(p)) for p in prefixes]
    assert len(set(names)) == len(names)
    assert all(re.fullmatch(r"[A-Za-z_]\w*", n) for n in names)


@pytest.mark.parametrize("extra", [{}, {"linear_before_reset": 1}])
def test_cuda_plans_shared_recurrent_kernel_builds(extra, monkeypatch):
    monkeypatch.setattr(rnn_block, "choose", lambda *a: None)  # the phase-a-step form
    nodes, feeds = merge(case("GRU", 0, S=9, B=67, I=24, H=32, use=EVERY, seed=1, **extra),
                         case("GRU", 1, S=9, B=67, I=24, H=32, direction="reverse", use=("B", "sequence_lens"),
                              seed=2, **extra))
    inits = {k: v for k, v in feeds.items() if k[0] in "WRBP" and not k.startswith("sequence")}
    feeds = {k: v for k, v in feeds.items() if k not in inits}
    plan = analyze(graph_model(nodes, feeds, inits, opset=22), batch_axis=None, target="cuda")
    steps = [k for k, name in enumerate(plan.stage_kernels) if name == "shared_recurrent"]
    assert len(steps) > 2
    luisaml.device.current() or luisaml.device.init("cpu")
    net = _network(plan, "cpu")
    arrays, _, _ = net.check_feeds(feeds)
    args, _ = net._bind(arrays, 1)
    scratch = net.pool.scratch(plan, 1)
    for k in steps:  # builds the shared kernel (only it: the plan's blocks stages need a GPU)
        net.launch(args, scratch, 1, only=k)


def _zoo(cell: str, torch_export: bool, extra: dict):
    """The zoo's `gru 64-128 seq 32` / `lstm 64-128 seq 32` at batch 1,024 (benchmarks/bench_rnn.py's
    torch export, or the same shapes as one ONNX node)."""
    if torch_export:
        pytest.importorskip("torch")
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
        import bench_rnn

        return bench_rnn.export(bench_rnn.module(cell), 1024)
    nodes, feeds = merge(case(cell.upper(), 0, S=32, B=1024, I=64, H=128, use=("B", "sequence_lens", "initial_h"), **extra))
    inits = {k: v for k, v in feeds.items() if k[0] in "WRBP" and not k.startswith("sequence")}
    return graph_model(nodes, {k: v for k, v in feeds.items() if k not in inits}, inits, opset=22)


@pytest.mark.parametrize("cell,torch_export,extra,shared", [
    ("gru", True, {}, 8192), ("lstm", True, {}, 8192),  # torch's GRU: linear_before_reset
    ("gru", False, {}, 12288), ("lstm", False, {}, 8192)])  # GRU without it: r . h in shared memory too
@pytest.mark.parametrize("form", ["auto", "unfused", "unrolled"])
def test_zoo_shapes_run_the_steps_in_one_launch(cell, torch_export, extra, shared, form, monkeypatch):
    plan = analyze(_zoo(cell, torch_export, extra), batch_axis=None, target="cuda", recurrent=form)
    steps = [st for st in plan.schedule.stages if st.root[0].op_type.endswith("Steps")]
    # unfused: the projection, then every step; auto and unrolled: the projection inside the steps (one launch)
    inside = form != "unfused"
    assert len(steps) == 1 and len(plan.schedule.stages) == (1 if inside else 2)
    (st,) = steps
    bl = st.root[1].block
    assert st.domain == "blocks" and (st.items, st.threads, st.dispatch(1)) == (128, 128, 128 * 128)
    assert (bl.SB, bl.TU, bl.UB, bl.shared_bytes, bl.U, bl.fused) == (8, 128, 1, shared, 8, inside)
    assert bl.prefetch == (form != "unrolled")  # (loads an iteration ahead: benchmarks/experiments/rnn_sass.py)
    assert "one launch for every step" in st.root[1].describe()
    luisaml.device.current() or luisaml.device.init("cpu")
    assert len(build_dsl(plan, kernel_name(plan, st), monkeypatch)) == 1
