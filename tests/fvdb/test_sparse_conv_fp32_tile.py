"""fvdb.SparseConv3d on tiled.py's FP32 tile without a GPU, in each of its forms (SparseConv3d.fp32_form,
benchmarks/NOTES.md "The FP32 tile's next step in flight"): "early" (the tile as it was), "rows" (a tile's
taps from its own rows only, B in 16-byte loads) and "ahead" (also the kernel map's entries loaded a k
step ahead of the features they name, tiled.gathered). The stage kernels run in Python
(tests/gpu_emulator.py: a thread per GPU thread, both thread orders, buffers float64) against tests/fvdb's
float64 reference of fVDB's semantics (fvdb_reference.sparse_conv3d), and every form gives the bits of
"early": the same loads of the same elements in the same sums. The shapes: 64 output channels (the
64 x 64 tiles of 128 threads, more threads than a tile's rows: the case whose tap list took the next
tile's rows), a folded map and one built on the device (its entries checked), input channels that are
not whole k steps (no tap list, a ragged last step: the index loaded every step), and grids bound at
run time (a block's rows 64 consecutive voxels). luisa-python builds each form's kernel (build_dsl).
"uniform" (as rows, a k step's tap and channel from the step's first k, tiled.by_step) is
asserted bit-equal to "rows" on its own, on a smaller grid in CI's run (the emulator's threads are
its cost: benchmarks/NOTES.md, "addresses a tap, not a step"). A folded map's rows packed into 64-row
tiles (rows_by_taps' `tile`, the default) run fewer taps, never more, and move no bit."""
from __future__ import annotations

import re

import numpy as np
import pytest
from gpu_emulator import build_dsl, kernel_name, run_plan
from test_sparse_conv_mma import _close, _conv_tiling, _grid, _layer, _plan, _shell, _voxel_batch_plan

from luisaml.fvdb import GridBatch

from fvdb_reference import sparse_conv3d

FORMS = ("early", "rows", "ahead")


@pytest.fixture
def form(monkeypatch):
    """Set SparseConv3d.fp32_form for one plan."""
    from luisaml.operators.fvdb.conv import SparseConv3d

    return lambda f: monkeypatch.setattr(SparseConv3d, "fp32_form", f)


@pytest.mark.parametrize("c_in,K,constant", [
    (16, 3, True),  # a folded map (rows_by_taps' order): each tile's tap list, 2 k steps a tap
    # (the full run only: each case emulates three forms' threads in Python, 10-22 s on a loaded 2-core host)
    pytest.param(16, 3, False, marks=pytest.mark.full),  # the map built on the device: its entries checked where the features are read
    pytest.param(12, 2, True, marks=pytest.mark.full),  # 12 input channels: k steps that cross taps, no tap list, a ragged last step
])
def test_forms_match_the_reference_and_each_other(c_in, K, constant, form):
    gb = _grid()
    m, feeds, want = _layer(gb, c_in, 64, K, constant)
    got = {}
    for f in FORMS:
        form(f)
        plan = _plan(m, tensor_cores=False)
        st, op, tl = _conv_tiling(plan)
        assert type(tl).__name__ == "Tiling" and (tl.BM, tl.BN, tl.threads) == (64, 64, 128) and tl.double
        assert ("pi" in plan.source.split("def stage_")[-1]) == (f == "ahead")  # (the index registers)
        # (threads run in reverse order too: a barrier missing around the tap list or a shared buffer shows)
        got[f] = run_plan(plan, feeds, reverse=f == "ahead")["y"]
        _close(got[f], want)
    for f in FORMS[1:]:
        np.testing.assert_array_equal(got[f], got["early"])


def test_a_tile_takes_its_taps_from_its_own_rows(form):
    """With more threads than a tile's rows, the threads past them read no row's taps ("rows", "ahead":
    the early tile ORed the next tile's rows' taps into its list, a superset: more k steps on zeros,
    the same sums, which is why the outputs cannot show it and the source is read here)."""
    gb = _grid(2)
    m, feeds, want = _layer(gb, 16, 64, 3, constant=True, bias=False)
    for f in ("rows", "ahead", "uniform"):
        form(f)
        plan = _plan(m, tensor_cores=False)
        assert "if thread < 64 and " in plan.source  # (the tile's mask loop)
        if f == "uniform":  # (its tap list is rows': emulated in test_uniform_is_rows_bit_for_bit)
            continue
        _close(run_plan(plan, feeds)["y"], want)
    form("early")
    assert "if thread < 64 and " not in _plan(m, tensor_cores=False).source


@pytest.mark.parametrize("forms", [
    ("early", "ahead"),  # the tile as it was and the default
    pytest.param(FORMS, marks=pytest.mark.full),  # (rows too: ~10 s of emulated threads a form on a loaded 2-core host)
])
def test_voxels_the_batch(forms, form):
    """Grids bound at run time: a block's rows 64 consecutive voxels (the last group partial), each tap
    read at the sample its map entry names, the entries a step ahead."""
    gb = _grid(3)
    got = {}
    for f in forms:
        form(f)
        plan, (grid, x, w, b) = _voxel_batch_plan(gb, with_data=True, c_out=64, tensor_cores=False)
        st, op, tl = _conv_tiling(plan)
        assert st.samples == tl.BM == tl.M == 64 and tl.threads == 128
        got[f] = run_plan(plan, {**grid, "x": x})["y"]
        want = np.maximum(sparse_conv3d(gb, x.astype(np.float64), gb, w.astype(np.float64), b.astype(np.float64)), 0)
        _close(got[f], want)
    for f in forms[1:]:
        np.testing.assert_array_equal(got[f], got["early"])


@pytest.mark.parametrize("case", ["folded", "device map", "12 input channels", "voxels the batch"])
def test_ahead_kernels_build_as_dsl(case, form, monkeypatch):
    """luisa-python builds the ahead form's kernel (the index registers' scope and type)."""
    form("ahead")
    if case == "voxels the batch":
        plan = _voxel_batch_plan(c_out=64, tensor_cores=False)
    else:
        c_in, K = (12, 2) if case == "12 input channels" else (16, 3)
        plan = _plan(_layer(_grid(), c_in, 64, K, constant=case != "device map")[0], tensor_cores=False)
    st, _, tl = _conv_tiling(plan)
    assert len(build_dsl(plan, kernel_name(plan, st), monkeypatch)) >= 1


def _small_grid() -> GridBatch:
    """One shell of ~60 voxels and a few isolated ones (one 64-row tile, ragged)."""
    rng = np.random.default_rng(5)
    return GridBatch.from_ijk([np.concatenate([_shell((6, 6, 4), 2.2, rng), rng.integers(0, 14, (4, 3))]).astype(np.int32)])


@pytest.mark.parametrize("case", [
    "folded",  # 32 input channels, 2 x 2 x 2 taps: 2 k steps of 16 a tap (one tile: choose's deep steps), each step's
    # tap and channel from its first k
    # (the full run only: ~200 voxels, two forms' threads in Python)
    pytest.param("device map", marks=pytest.mark.full),  # its entries checked
    pytest.param("12 input channels", marks=pytest.mark.full),  # steps across taps: each lane's k, as rows
    pytest.param("voxels the batch", marks=pytest.mark.full),
])
def test_uniform_is_rows_bit_for_bit(case, form, monkeypatch):
    """The default form's steps read the same elements as rows' into the same sums: the same bits, and
    the float64 reference's values; its tap comes from the step's first k exactly where a step lies
    within one tap; luisa-python builds it."""
    got = {}
    for f in ("rows", "uniform"):
        form(f)
        if case == "voxels the batch":
            gb = _grid(3)
            plan, (grid, x, w, b) = _voxel_batch_plan(gb, with_data=True, c_out=64, tensor_cores=False)
            feeds, c_in = {**grid, "x": x}, 16
            want = np.maximum(sparse_conv3d(gb, x.astype(np.float64), gb, w.astype(np.float64), b.astype(np.float64)), 0)
        else:
            c_in, K = {"folded": (32, 2), "12 input channels": (12, 2)}.get(case, (16, 3))
            m, feeds, want = _layer(_small_grid() if case == "folded" else _grid(), c_in, 64, K, case != "device map")
            plan = _plan(m, tensor_cores=False)
        st, _, tl = _conv_tiling(plan)
        assert (tl.BM, tl.BN, tl.threads) == (64, 64, 128) and tl.double
        assert bool(re.search(rf"= k0_\d+ // {c_in}\b", plan.source)) == (f == "uniform" and c_in % tl.BK == 0)
        got[f] = run_plan(plan, feeds, reverse=f == "uniform")["y"]
        _close(got[f], want)
    np.testing.assert_array_equal(got["uniform"], got["rows"])
    if case == "folded":
        assert len(build_dsl(plan, kernel_name(plan, st), monkeypatch)) >= 1


def _kernel_map(gb: GridBatch) -> np.ndarray:
    from luisaml.fvdb import torch_ops as F

    return F.sparse_conv_kernel_map(F.bundle_tensors(gb), F.bundle_tensors(gb), 3).numpy()


def test_packed_rows_never_run_more_taps():
    """rows_by_taps packed for 64-row tiles: a permutation whose tiles run fewer taps in all than the
    lexsorted order's on a shell of ~480 voxels (201 -> 196), and the lexsorted order where the greedy
    packing would run more (_grid(): 105 against 104)."""
    from luisaml.operators.fvdb.conv import _packed, rows_by_taps, tile_taps

    shell = GridBatch.from_ijk([_shell((20, 20, 20), 6.0, np.random.default_rng(0))])
    for gb, fewer in ((shell, True), (_grid(), False)):
        kmap = _kernel_map(gb)
        active, order, lexsorted = kmap >= 0, rows_by_taps(kmap, 64), rows_by_taps(kmap)
        np.testing.assert_array_equal(np.sort(order), np.arange(len(kmap)))
        steps = {k: tile_taps(active[o], 64).sum() for k, o in
                 (("order", order), ("lexsorted", lexsorted), ("packed", _packed(active, 64)))}
        assert steps["order"] == min(steps.values())
        assert (steps["order"] < steps["lexsorted"]) == fewer and (steps["packed"] > steps["lexsorted"]) != fewer


def _packed_loop(active: np.ndarray, tile: int) -> np.ndarray:
    """conv._packed as it was before numpy took its loops (a popcount table of 14 bits, a list per set)."""
    taps = active.shape[1]
    masks = (active.astype(np.int64) << np.arange(taps)).sum(1)
    order = np.argsort(masks, kind="stable")
    m = masks[order]
    starts = np.flatnonzero(np.r_[True, m[1:] != m[:-1]])
    lens = np.diff(np.r_[starts, len(m)])
    whole = lens // tile * tile
    head = [order[s:s + w] for s, w in zip(starts, whole) if w]
    rest = [(s + w, n - w) for s, w, n in zip(starts, whole, lens) if n > w]
    rmask = np.array([m[s] for s, _ in rest], np.int64)
    left = np.array([n for _, n in rest], np.int64)
    taken = np.zeros(len(rest), np.int64)
    half = np.array([bin(v).count("1") for v in range(1 << 14)], np.int64)
    out, union, space = [], 0, tile
    while left.any():
        if space == tile:
            i = int(np.argmax(left))
        else:
            fresh = rmask & ~union
            new = np.where(left > 0, half[fresh & 0x3FFF] + half[fresh >> 14], taps + 1)
            i = int(np.lexsort((-left, new))[0])
        n = int(min(space, left[i]))
        at = rest[i][0] + taken[i]
        out.append(order[at:at + n])
        taken[i] += n
        left[i] -= n
        union |= int(rmask[i])
        space -= n
        if space == 0:
            union, space = 0, tile
    return np.concatenate(head + out).astype(np.int32)


@pytest.mark.parametrize("rows,taps,tile,sets", [
    (500, 27, 64, 40), (3000, 28, 64, 300), (777, 8, 16, 30), (200, 27, 64, 3), (130, 27, 128, 400), (64, 5, 64, 1)])
def test_packed_is_the_loop_it_replaced(rows, taps, tile, sets):
    """_packed's numpy form orders the rows exactly as its loops did, on random tap masks: few sets
    (whole tiles of one set), many (remainders only), one, and each row's own; a shell's map too."""
    from luisaml.operators.fvdb.conv import _packed

    rng = np.random.default_rng(rows + taps)
    pool = rng.random((sets, taps)) < rng.uniform(0.1, 0.9, (sets, 1))
    active = pool[rng.integers(0, sets, rows)]
    np.testing.assert_array_equal(_packed(active, tile), _packed_loop(active, tile))
    shell = _kernel_map(GridBatch.from_ijk([_shell((20, 20, 20), 6.0, np.random.default_rng(0))])) >= 0
    np.testing.assert_array_equal(_packed(shell, tile), _packed_loop(shell, tile))


@pytest.mark.full  # (two runs of ~200 voxels' threads in Python: ~50 s here)
def test_packed_rows_move_no_bit(monkeypatch):
    """The packing (SparseConv3d.PACKED_ROWS, the default) puts voxels in other tiles than the
    lexsorted order (0), which then run other taps: each voxel's sum is the same (its missing taps add
    zeros), so are the bits."""
    from luisaml.operators.fvdb.conv import SparseConv3d, rows_by_taps, tile_taps

    gb = _grid(2)  # (packed: 102 taps over its 4 tiles against 103)
    m, feeds, want = _layer(gb, 16, 64, 3, constant=True)
    got = {}
    for rows in (0, 64):
        monkeypatch.setattr(SparseConv3d, "PACKED_ROWS", rows)
        plan = _plan(m, tensor_cores=False)
        _, op, tl = _conv_tiling(plan)
        assert tl.BM == 64
        got[rows] = run_plan(plan, feeds)["y"]
        _close(got[rows], want)
    kmap = _kernel_map(gb)
    active = kmap >= 0
    assert tile_taps(active[rows_by_taps(kmap, 64)], 64).sum() < tile_taps(active[rows_by_taps(kmap)], 64).sum()
    np.testing.assert_array_equal(got[64], got[0])
