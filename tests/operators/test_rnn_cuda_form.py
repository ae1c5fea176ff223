"""The CUDA backend's recurrent stages, built without a GPU: the plan for target "cuda" has the
GRU's steps in one shared kernel (operators/rnn_stages.py), whose DSL the CPU device turns into a
kernel as the CUDA device would (luisa's AST builder runs first on both). Names of that kernel's
locals must be unique: "t2" + 547 and "t" + 2547 were one name, typed float4 and int, and the
kernel failed to build on the GPU. Numbers are checked on the GPU (tests/gpu/test_rnn_cuda.py)."""
import re

import numpy as np
import pytest
from test_rnn import case, merge
from util import graph_model

import luisaml
from luisaml import codegen
from luisaml.runtime import _network, analyze

EVERY = ("B", "sequence_lens", "initial_h", "initial_c", "P")


def test_fresh_names_never_collide_across_prefixes():
    m = codegen.Module()
    prefixes = np.random.default_rng(0).choice(["t", "t2", "x1", "x", "acc"], 5000)
    names = [m.fresh(str(p)) for p in prefixes]
    assert len(set(names)) == len(names)
    assert all(re.fullmatch(r"[A-Za-z_]\w*", n) for n in names)


@pytest.mark.parametrize("extra", [{}, {"linear_before_reset": 1}])
def test_cuda_plans_shared_recurrent_kernel_builds(extra):
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
