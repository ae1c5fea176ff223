"""A GroupNorm as torch exports it -- Reshape to [N, G, -1], InstanceNormalization, Reshape back,
the affine Mul and Add, here a GELU after it -- runs as one stage: the epilogue of the normalization
reaches its affine through the Reshape (luisaml/schedule.py `_epilogue`: element i of a view is
element i of what it views). wav2vec2's first layer (issue 27) stored the norm's output and re-read
it in an element stage of its own. Checked against onnxruntime on the CPU backend, and the CUDA
plan's kernels (a warp a group) in the emulator (tests/gpu_emulator.py)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from gpu_emulator import run_plan
from onnx import helper
from util import graph_model, ort_run, plan_of, stage_of

import luisaml

N = helper.make_node
AFFINE_GELU = ["Reshape", "Mul", "Add", "Div", "Erf", "Add", "Mul", "Mul"]


def _group_norm(C: int, G: int, L: int, gelu: bool = True, extra_reader: bool = False, seed: int = 0):
    """x [N, C, L] -> GroupNorm(G, C) as torch's exporter writes it (InstanceNormalization over
    [N, G, C / G * L] with unit scale and zero bias, then gamma [C, 1] and beta [C, 1]) -> GELU.
    extra_reader: the norm's reshaped output is also a graph output (the region stays open)."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((2, C, L)) * 3 + 1).astype(np.float32)
    inits = {
        "grouped": np.array([0, G, -1], np.int64), "back": np.array([0, C, L], np.int64),
        "ones": np.ones(G, np.float32), "zeros": np.zeros(G, np.float32),
        "gamma": rng.standard_normal((C, 1)).astype(np.float32), "beta": rng.standard_normal((C, 1)).astype(np.float32),
        "sqrt2": np.array(math.sqrt(2), np.float32), "one": np.array(1, np.float32), "half": np.array(0.5, np.float32),
    }
    nodes = [N("Reshape", ["x", "grouped"], ["g"], name="to_groups"),
             N("InstanceNormalization", ["g", "ones", "zeros"], ["n"], epsilon=1e-5, name="norm"),
             N("Reshape", ["n", "back"], ["nb"], name="back"),
             N("Mul", ["nb", "gamma"], ["m"], name="gamma"), N("Add", ["m", "beta"], ["a"], name="beta")]
    out = "a"
    if gelu:
        nodes += [N("Div", ["a", "sqrt2"], ["d"], name="div"), N("Erf", ["d"], ["e"], name="erf"),
                  N("Add", ["e", "one"], ["p"], name="plus1"), N("Mul", ["a", "p"], ["q"], name="mul"),
                  N("Mul", ["q", "half"], ["y"], name="halve")]
        out = "y"
    outs = [out] + (["nb"] if extra_reader else [])
    return graph_model(nodes, {"x": x}, inits, batch="N", outputs=outs), {"x": x}, outs


# (C, G, L): groups of one channel (wav2vec2's GroupNorm(512, 512)) and of several (the Reshapes then
# change the shape), ragged lengths (a warp's last pass partial), one shorter than a warp
CASES = [(16, 16, 37), (12, 4, 29), (8, 2, 5), (6, 6, 70)]


@pytest.mark.parametrize("C,G,L", CASES)
def test_group_norm_affine_and_gelu_are_the_norms_epilogue_on_the_cpu(C, G, L):
    model, feeds, outs = _group_norm(C, G, L, seed=C + G + L)
    net = luisaml.compile(model)
    st = stage_of(net, "norm")
    assert [n.op_type for n, _ in st.epilogue] == AFFINE_GELU, net.plan.schedule.describe()
    assert len(net.plan.schedule.stages) == 1, net.plan.schedule.describe()
    np.testing.assert_allclose(net.run(feeds)["y"], ort_run(model, feeds)["y"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("C,G,L", CASES)
def test_group_norm_epilogue_in_the_cuda_plan(C, G, L):
    """The CUDA plan (a warp a group, blocks) stores GELU(affine(norm)) from its last pass: one stage,
    its kernel run in the emulator against onnxruntime."""
    model, feeds, _ = _group_norm(C, G, L, seed=C * G + L)
    plan = plan_of(model, "cuda", batch_axis=0)
    (st,) = plan.schedule.stages
    assert st.domain == "blocks" and [n.op_type for n, _ in st.epilogue] == AFFINE_GELU, plan.schedule.describe()
    got = run_plan(plan, feeds)["y"]
    np.testing.assert_allclose(got, ort_run(model, feeds)["y"], rtol=1e-5, atol=1e-5)


def test_a_view_read_outside_keeps_the_norm_without_epilogue():
    """The reshaped norm is also a graph output: the region has two open tensors (the view's reader
    outside is a reader of the norm's output), so the norm stores and the affine is a stage of its own,
    both outputs right."""
    model, feeds, outs = _group_norm(8, 4, 11, extra_reader=True)
    net = luisaml.compile(model)
    assert not stage_of(net, "norm").epilogue, net.plan.schedule.describe()
    want, got = ort_run(model, feeds), net.run(feeds)
    for o in outs:
        np.testing.assert_allclose(got[o], want[o], rtol=1e-5, atol=1e-5)


def test_the_affine_alone_is_the_epilogue():
    """Without the GELU the region ends at the Add (a graph output): Reshape, Mul, Add."""
    model, feeds, _ = _group_norm(10, 5, 13, gelu=False)
    net = luisaml.compile(model)
    assert [n.op_type for n, _ in stage_of(net, "norm").epilogue] == ["Reshape", "Mul", "Add"]
    np.testing.assert_allclose(net.run(feeds)["a"], ort_run(model, feeds)["a"], rtol=1e-5, atol=1e-5)
