"""Reads across on CUDA (luisaml/across.py): a stage that reads a stored tensor through an inline
Transpose that moves its innermost axis reads it through shared memory, without a GPU: which stages
take the forms (ConvNeXt's block: LayerNorm over a permuted NCHW tensor, the residual Add of a
permuted NHWC tensor, LayerNorm2d's permute back; the CPU plan byte for byte the same with the
switch on and off), and their values in tests/gpu_emulator.py (each block's threads one at a time
between barriers and warp reductions, in thread order and reversed) against onnxruntime, for
channel counts and spatial sizes that are and are not multiples of the tiles (C = 37, 96, 192, 384,
768; H x W = 49, 35, 36, 3 x 37), and batches of several samples."""
from __future__ import annotations

import numpy as np
import pytest
from gpu_emulator import build_dsl, kernel_name, run_plan
from onnx import TensorProto, helper, numpy_helper
from util import ort_run

from luisaml import across
from luisaml.operators import rows
from luisaml.planning import CompileOptions, plan_for

RTOL = 2e-5


def _block(c: int, h: int, w: int, seed: int = 0, mixed: bool = False):
    """ConvNeXt's block without its convolutions: u = LayerNorm(permute(x) to NHWC) * gamma (the
    layer scale), r = x + permute(u) back to NCHW, then LayerNorm2d: permute(LayerNorm(permute(r))).
    r is an output (its Add a stage), or with `mixed` read by the second LayerNorm only, which then
    computes it inline (x read across, u in order, as ConvNeXt's LayerNorms before a downsampling)."""
    rng = np.random.default_rng(seed)
    inits = {name: rng.standard_normal(c).astype(np.float32) * s + o
             for name, s, o in (("s1", 0.3, 1.0), ("b1", 0.2, 0.0), ("gamma", 0.5, 0.0), ("s2", 0.3, 1.0), ("b2", 0.2, 0.0))}
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 3, 1]),
             helper.make_node("LayerNormalization", ["xt", "s1", "b1"], ["n1"], axis=-1, epsilon=1e-6, name="ln1"),
             helper.make_node("Mul", ["n1", "gamma"], ["u"]),
             helper.make_node("Transpose", ["u"], ["ut"], perm=[0, 3, 1, 2]),
             helper.make_node("Add", ["x", "ut"], ["r"], name="residual"),
             helper.make_node("Transpose", ["r"], ["rt"], perm=[0, 2, 3, 1]),
             helper.make_node("LayerNormalization", ["rt", "s2", "b2"], ["n2"], axis=-1, epsilon=1e-6, name="ln2"),
             helper.make_node("Transpose", ["n2"], ["y"], perm=[0, 3, 1, 2], name="back")]
    outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, ["N", c, h, w]) for o in ("y", "r")[:2 - mixed]]
    g = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", c, h, w])], outs,
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _plan(model, backend: str = "cuda"):
    return plan_for(model, "m", CompileOptions(batch_axis=0).resolve(backend))[0]


def _stages(plan):
    return {n.name: st for st in plan.schedule.stages for n, _ in st.nodes}


def test_which_stages_read_across():
    """ln1 reads x's NCHW elements across its rows (a tile of 32 rows of 96), the residual Add its
    permuted operand through a tile, ln2 the Add inline (x across, u in order: one tile), and the
    permute back stores its whole value through a tile; the switch off gives the old plan; the CPU
    plan is the same with it on and off."""
    plan = _plan(_block(96, 7, 9))
    st = _stages(plan)
    for name in ("ln1", "ln2"):
        assert isinstance(st[name].across, rows.AcrossTiling) and st[name].domain == "blocks"
        assert (st[name].across.tile, st[name].threads, st[name].items) == (32, 256, 2)
    mixed = _stages(_plan(_block(96, 7, 9, mixed=True)))["ln2"]
    assert "Add 'residual'" in mixed.inlined and isinstance(mixed.across, rows.AcrossTiling)
    tile = st["residual"].across
    assert isinstance(tile, across.ElementTile) and tile.staged == ("ut",) and (tile.sizes, tile.a, tile.b) == ((96, 63), 1, 0)
    assert st["residual"].items == 3 * 2 and st["residual"].threads == across.ELEMENT_THREADS
    assert isinstance(st["back"].across, across.ElementTile) and st["back"].across.staged == ()
    for c, tile_rows in ((192, 32), (384, 16), (768, 8)):
        assert _stages(_plan(_block(c, 7, 7)))["ln1"].across.tile == tile_rows
    cpu = _plan(_block(96, 7, 9), "cpu")
    assert all(s.across is None for s in cpu.schedule.stages)
    try:
        across.ACROSS = False
        old = _plan(_block(96, 7, 9))
        assert all(s.across is None for s in old.schedule.stages) and old.source != plan.source
        assert _plan(_block(96, 7, 9), "cpu").source == cpu.source
    finally:
        across.ACROSS = True


def test_kernels_build_as_dsl(monkeypatch):
    """luisa-python builds the across stages' kernels (ConvNeXt's first stage: 96 channels of 56 x 56;
    the shared tiles, the barrier, the warp sums), only the backend's compile left out."""
    plan = _plan(_block(96, 56, 56, mixed=True))
    sts = [st for st in plan.schedule.stages if st.across is not None]
    assert len(sts) == 3
    for st in sts:
        assert len(build_dsl(plan, kernel_name(plan, st), monkeypatch)) == 1


@pytest.mark.parametrize("c,h,w,batch,mixed,reverse", [
    # (every case in CI: 2-4 s each since the emulator hands a barrier's turn to one thread; ~50 s before)
    (37, 5, 7, 2, False, False), (96, 7, 7, 2, True, True), (37, 5, 7, 2, False, True), (96, 7, 7, 2, True, False),
    (40, 6, 6, 3, False, False), (40, 6, 6, 3, False, True), (33, 3, 37, 1, True, False), (33, 3, 37, 1, True, True)])
def test_block_against_onnxruntime(c, h, w, batch, mixed, reverse):
    """Odd channel counts (37, 33: a ragged warp step and an odd shared pitch), spatial sizes not a
    multiple of 32 (35, 49, 36: the last row tile and element tile ragged; 111: four tiles), batches,
    the residual stored or inline in the second LayerNorm; each block's threads in order and reversed."""
    model = _block(c, h, w, seed=c + h, mixed=mixed)
    plan = _plan(model)
    assert any(s.across is not None for s in plan.schedule.stages)
    x = (np.random.default_rng(c).standard_normal((batch, c, h, w)) * 2 + 0.5).astype(np.float32)
    got = run_plan(plan, {"x": x}, reverse=reverse)
    want = ort_run(model, {"x": x})
    for name in want:
        np.testing.assert_allclose(got[name].reshape(want[name].shape), want[name], rtol=RTOL,
                                   atol=RTOL * np.abs(want[name]).max())


@pytest.mark.parametrize("c,h,w", [(192, 7, 7), (384, 5, 5), (768, 3, 3)])
def test_wide_rows_against_onnxruntime(c, h, w):
    """The tiles of 16 and 8 rows (384 and 768 channels), one sample (3-5 s a case in the emulator)."""
    model = _block(c, h, w, seed=c)
    x = np.random.default_rng(c).standard_normal((1, c, h, w)).astype(np.float32)
    got = run_plan(_plan(model), {"x": x})
    want = ort_run(model, {"x": x})
    for name in ("y", "r"):
        np.testing.assert_allclose(got[name].reshape(want[name].shape), want[name], rtol=RTOL,
                                   atol=RTOL * np.abs(want[name]).max())


@pytest.mark.parametrize("shape,perm", [((2, 16, 9, 10), (0, 2, 3, 1)), ((37, 3, 40), (2, 0, 1)), ((3, 40, 33), (0, 2, 1))])
def test_transpose_tiles_against_numpy(shape, perm):
    """A stored Transpose (no batch axis) through whole-value tiles: axes outside the tile (the 2 and
    3 leading ones), a tile axis of merged dims (9 x 10), ragged tiles on both axes."""
    g = helper.make_graph([helper.make_node("Transpose", ["x"], ["y"], perm=list(perm), name="t")], "t",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [shape[p] for p in perm])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    plan = plan_for(model, "m", CompileOptions(batch_axis=None).resolve("cuda"))[0]
    (st,) = plan.schedule.stages
    assert isinstance(st.across, across.ElementTile) and st.across.staged == ()
    x = np.random.default_rng(len(shape)).standard_normal(shape).astype(np.float32)
    got = run_plan(plan, {"x": x})["y"]
    np.testing.assert_array_equal(got.reshape(-1), x.transpose(perm).reshape(-1))
