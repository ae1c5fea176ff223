"""fvdb.SparseConv3d on the tensor-core tile (operators/tiled_mma.py) without a GPU: planned for CUDA with
tensor_cores, the layer's gather-GEMM (rows the output voxels, k the taps x input channels through the
kernel map) takes the mma tile where tiled_mma.choose does; the emitted stage kernels, run in Python
(tests/gpu_emulator.py: a thread per GPU thread, the marked mma callable its FP32 DSL body, buffers
float64), match tests/fvdb's float64 reference of fVDB's semantics (fvdb_reference.sparse_conv3d,
itself checked against torch's dense conv3d in test_ops_sparse_conv.py): a folded map (its voxels in
rows_by_taps' order, K cut to the most taps a tile reads), a map built on the device, input channels
that are not whole k steps (every tap in order, a ragged last step), ragged output channels, and grids
bound at run time (a block's rows 128 consecutive voxels, the last group partial: rows past the voxels
store nothing), and K variants of the tile a block picks by its tap count (SparseConv3d.mma_buckets).
The form is opt-in (LUISAML_SPARSE_MMA=on, set for every test here; one checks the default:
tensor_cores alone leaves the layer on the FP32 tile, which measured faster on an H100). luisa-python builds each kernel's AST (build_dsl). Few output channels keep tiled.py's FP32 tile. The
CUDA run: tests/gpu/test_sparse_conv_mma_cuda.py."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from gpu_emulator import build_dsl, kernel_name, run_plan
from onnx import helper, numpy_helper
from util import plan_of

from luisaml.fvdb import GridBatch
from luisaml.rewrites import tensor_cores as tc_rewrite
from luisaml.fvdb import torch_ops as F
from luisaml.opsets import fvdb as schema

from fvdb_reference import fvdb_model, sparse_conv3d


def _shell(center, radius: float, rng) -> np.ndarray:
    r = int(np.ceil(radius)) + 1
    box = np.stack(np.meshgrid(*[np.arange(-r, r + 1)] * 3, indexing="ij"), -1).reshape(-1, 3)
    d = np.linalg.norm(box, axis=1)
    return (box[(np.abs(d - radius) < 0.6) & (rng.random(len(box)) < 0.9)] + np.asarray(center)).astype(np.int32)


def _grid(seed: int = 0) -> GridBatch:
    """Two small surface-like grids in one batch (~200 voxels: two 128-row tiles, the second ragged),
    with a few isolated voxels (rows that read one tap). The second grid's coordinates are not negative:
    the emulator's uint words do not wrap at 32 bits, and the kernel map's NanoVDB root key of a
    negative j shifts one past them."""
    rng = np.random.default_rng(seed)
    a = _shell((-3, 5, -9), 3.4, rng)
    b = np.concatenate([_shell((20, 6, 4), 2.2, rng), rng.integers(0, 40, (8, 3))]).astype(np.int32)
    return GridBatch.from_ijk([a, b], voxel_sizes=[0.1, 0.2], origins=[(0, 0, 0), (1, 2, 3)])


def _nodes(K: int, gb: GridBatch, bias: bool):
    return [helper.make_node(schema.KERNEL_MAP, schema.kernel_map_input_names(), ["kmap"], name="kmap",
                             domain=schema.DOMAIN, kernel_size=[K] * 3, stride=[1], output_voxels=gb.total_voxels),
            helper.make_node(schema.SPARSE_CONV, ["x", "kmap", "w"] + (["b"] if bias else []), ["y"], name="conv",
                             domain=schema.DOMAIN)]


def _layer(gb: GridBatch, c_in: int, c_out: int, K: int, constant: bool, bias: bool = True, seed: int = 1):
    """A KernelMap -> SparseConv3d model over (gb, gb), its feeds and the float64 reference output."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((gb.total_voxels, c_in)).astype(np.float32)
    w = (rng.standard_normal((c_out, c_in, K, K, K)) / np.sqrt(c_in * K ** 3)).astype(np.float32)
    b = rng.standard_normal(c_out).astype(np.float32)
    grid = {f"{p}{n}": a for p in ("in_", "out_") for n, a in zip(schema.BUNDLE, gb.bundle())}
    consts = {"w": w} | ({"b": b} if bias else {})
    m = fvdb_model(_nodes(K, gb, bias), {**grid, "x": x, **consts},
                   constants=tuple(consts) + (tuple(grid) if constant else ()), outputs=["y"])
    feeds = {"x": x} | ({} if constant else grid)
    want = sparse_conv3d(gb, x.astype(np.float64), gb, w.astype(np.float64), b.astype(np.float64) if bias else None)
    return m, feeds, want


@pytest.fixture(autouse=True)
def _sparse_mma(monkeypatch):
    """The mma form of SparseConv3d is opt-in (luisaml/rewrites/tensor_cores.py): on for each test (the
    one that checks the default takes it off again)."""
    monkeypatch.setenv(tc_rewrite.SPARSE_MMA_ENV, "on")


def _plan(model, tensor_cores=True, batch_axis=None):
    return plan_of(model, batch_axis=batch_axis, tensor_cores=tensor_cores)


def _conv_tiling(plan):
    (st,) = [s for s in plan.schedule.stages if s.domain == "blocks"]
    (node, op), = st.nodes
    assert node.op_type == schema.SPARSE_CONV
    tl = op.block_tiling()
    assert tl.threads == st.threads
    return st, op, tl


def _close(got, want):
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-9 * np.abs(want).max())


@pytest.mark.parametrize("c_in,c_out,K,constant", [
    (16, 32, 3, True),  # a folded map: rows_by_taps' order, K cut to the most taps a tile reads
    (16, 48, 3, False),  # the map built on the device (all 27 taps' k), ragged output channels
    (8, 32, 2, True),  # 8 input channels: a k step spans two taps, every tap in order, a ragged last step
    (16, 64, 3, True),  # 64 x 64 tiles (choose's smaller sides for a launch of few blocks): 2 warps a block
])
def test_layer_takes_the_mma_tile_and_matches_the_reference(c_in, c_out, K, constant):
    gb = _grid()
    m, feeds, want = _layer(gb, c_in, c_out, K, constant)
    plan = _plan(m)
    st, op, tl = _conv_tiling(plan)
    assert type(tl).__name__ == "MmaTiling" and "mma_tf32_m16n8k8" in plan.source
    assert tl.M == gb.total_voxels and tl.M % tl.BM  # (a ragged last tile of rows)
    if constant and c_in % tl.BK == 0:
        from luisaml.operators.fvdb.conv import rows_by_taps

        kmap = F.sparse_conv_kernel_map(F.bundle_tensors(gb), F.bundle_tensors(gb), K).numpy()
        read = kmap[rows_by_taps(kmap, op.PACKED_ROWS)] >= 0  # (the order the node runs)
        most = max(int(read[i:i + tl.BM].any(0).sum()) for i in range(0, len(read), tl.BM))
        assert tl.K == most * c_in
    else:
        assert tl.K == K ** 3 * c_in
    # (threads run in reverse order too: a barrier missing around the tap list or a shared buffer shows)
    _close(run_plan(plan, feeds, reverse=constant)["y"], want)


def test_missing_neighbours_add_exact_zeros():
    """Features of huge magnitude in every row but the ones a voxel reads: a missing neighbour or a
    tap a tile does not have that loaded any row (a select over a load would) shows at once."""
    gb = _grid(2)
    m, feeds, want = _layer(gb, 16, 32, 3, constant=True, bias=False)
    plan = _plan(m)
    kmap = F.sparse_conv_kernel_map(F.bundle_tensors(gb), F.bundle_tensors(gb), 3).numpy()
    lonely = np.flatnonzero((kmap >= 0).sum(1) == 1)  # the isolated voxels: each reads only itself
    assert len(lonely) >= 4
    x = feeds["x"].copy()
    others = np.setdiff1d(np.arange(len(x)), lonely)
    x[others] = 1e30  # (float32: a product with any weight is far past the reference's scale)
    got = run_plan(plan, {"x": x})["y"][lonely]
    w = numpy_helper.to_array(next(i for i in m.graph.initializer if i.name == "w")).astype(np.float64)
    want = x[lonely].astype(np.float64) @ w[:, :, 1, 1, 1].T  # the centre tap alone
    _close(got, want)


def test_few_output_channels_keep_the_fp32_tile():
    """24 output channels: under a warp's 32 columns, tiled_mma.choose declines."""
    m, _, _ = _layer(_grid(), 16, 24, 3, constant=True)
    _, _, tl = _conv_tiling(_plan(m))
    assert type(tl).__name__ == "Tiling"


def test_without_tensor_cores_the_plan_is_the_fp32_tiles():
    m, _, _ = _layer(_grid(), 16, 32, 3, constant=True)
    plan = _plan(m, tensor_cores=False)
    assert type(_conv_tiling(plan)[2]).__name__ == "Tiling" and "mma_tf32" not in plan.source


def test_by_default_tensor_cores_leave_the_layer_on_the_fp32_tile(monkeypatch):
    """Without LUISAML_SPARSE_MMA=on, tensor_cores marks Gemm/MatMul/Conv but not SparseConv3d (its mma
    tile measured 0.53x its FP32 tile on an H100); with it, the same model takes the mma tile."""
    monkeypatch.delenv(tc_rewrite.SPARSE_MMA_ENV, raising=False)
    m, _, _ = _layer(_grid(), 16, 32, 3, constant=True)
    plan = _plan(m)
    assert type(_conv_tiling(plan)[2]).__name__ == "Tiling" and "mma_tf32" not in plan.source
    monkeypatch.setenv(tc_rewrite.SPARSE_MMA_ENV, "on")
    assert "mma_tf32" in _plan(m).source


def test_grids_bound_at_run_time_take_groups_of_voxels():
    """The voxels the batch (features [V, C]): a block's rows are 128 consecutive voxels, the last
    group partial (rows past the voxels load the last one and store nothing), each tap read at the
    sample its map entry names."""
    gb = _grid(3)
    plan, (grid, x, w, b) = _voxel_batch_plan(gb, with_data=True)
    assert plan.symbol == "V"
    st, op, tl = _conv_tiling(plan)
    assert type(tl).__name__ == "MmaTiling" and st.samples == tl.BM == tl.M == 128
    assert gb.total_voxels % 128 and gb.total_voxels > 128
    want = np.maximum(sparse_conv3d(gb, x.astype(np.float64), gb, w.astype(np.float64), b.astype(np.float64)), 0)
    _close(run_plan(plan, {**grid, "x": x})["y"], want)


def _voxel_batch_plan(gb: GridBatch | None = None, with_data: bool = False, c_out: int = 32,
                      tensor_cores: bool = True):
    """The CUDA plan (tensor cores) of KernelMap -> SparseConv3d -> Relu over grids bound at run time (the
    voxels the batch), 16 -> c_out channels; with_data: also (grid feeds, x, w, b)."""
    gb = gb or _grid(3)
    rng = np.random.default_rng(4)
    c_in = 16
    w = (rng.standard_normal((c_out, c_in, 3, 3, 3)) / np.sqrt(c_in * 27)).astype(np.float32)
    b = rng.standard_normal(c_out).astype(np.float32)
    x = rng.standard_normal((gb.total_voxels, c_in)).astype(np.float32)
    grid = {f"{p}{n}": a for p in ("in_", "out_") for n, a in zip(schema.BUNDLE, gb.bundle())}
    growing = ("grid_blob", "leaf_batch_indices", "list_indices")
    elem = {np.dtype(np.uint8): onnx.TensorProto.UINT8, np.dtype(np.int32): onnx.TensorProto.INT32,
            np.dtype(np.int64): onnx.TensorProto.INT64, np.dtype(np.float64): onnx.TensorProto.DOUBLE}
    ins = [helper.make_tensor_value_info(k, elem[v.dtype], [f"rows_{k}" if k.endswith(growing) else v.shape[0],
                                                            *v.shape[1:]]) for k, v in grid.items()]
    ins.append(helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["V", c_in]))
    nodes = [helper.make_node(schema.KERNEL_MAP, schema.kernel_map_input_names(), ["kmap"], name="kmap",
                              domain=schema.DOMAIN, kernel_size=[3] * 3, stride=[1]),
             helper.make_node(schema.SPARSE_CONV, ["x", "kmap", "w", "b"], ["c"], name="conv", domain=schema.DOMAIN),
             helper.make_node("Relu", ["c"], ["y"], name="relu")]
    g = helper.make_graph(nodes, "g", ins, [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["V", c_out])],
                          [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(schema.DOMAIN, 1)])
    plan = _plan(m, tensor_cores=tensor_cores, batch_axis="auto")
    return (plan, (grid, x, w, b)) if with_data else plan


@pytest.mark.parametrize("constant", [True, False])
def test_k_variants_a_block_by_its_taps(constant, monkeypatch):
    """SparseConv3d.mma_buckets = 3: three emits of the mma tile at three K, one shared set of buffers,
    each block running the one of fewest k steps that holds its tap count (a folded map's bounds from
    its tiles' counts; a map built at run time 60% / 80% / all taps)."""
    from luisaml.operators.fvdb import conv as conv_op

    monkeypatch.setattr(conv_op.SparseConv3d, "mma_buckets", 3)
    gb = _grid(5)
    m, feeds, want = _layer(gb, 16, 32, 3, constant)
    plan = _plan(m)
    st, op, tl = _conv_tiling(plan)
    buckets = op._tap_buckets(tl)
    assert buckets == sorted(set(buckets)) and buckets[-1] == tl.K // 16
    # (a folded map's bounds are counts its tiles have: this grid's two tiles give two variants)
    assert len(buckets) == (2 if constant else 3) and plan.source.count(" <= ") >= len(buckets)
    if not constant:
        assert buckets == [16, 22, 27]
    # the tile's two shared buffers declared once, before the variants
    assert sum(line.strip().startswith("mma_sh") and "Shared_" in line for line in plan.source.splitlines()) == 2
    if constant:  # (each bound some tile's count: every variant runs)
        assert set(buckets) <= set(op._tile_taps(tl.BM).tolist())
    _close(run_plan(plan, feeds, reverse=constant)["y"], want)


@pytest.mark.parametrize("case", ["folded", "device map", "8 input channels", "K variants", "voxels the batch"])
def test_mma_kernels_build_as_dsl(case, monkeypatch):
    """luisa-python builds the conv stage's AST (its stricter rules than Python's: a variable's scope and
    type, shared arrays used inside the K variants' branches): only the backend's compile is left out
    (tests/gpu_emulator.py build_dsl)."""
    from luisaml.operators.fvdb import conv as conv_op

    if case == "K variants":
        monkeypatch.setattr(conv_op.SparseConv3d, "mma_buckets", 3)
    if case == "voxels the batch":
        plan = _voxel_batch_plan()
    else:
        c_in, K = (8, 2) if case == "8 input channels" else (16, 3)
        plan = _plan(_layer(_grid(), c_in, 32, K, constant=case != "device map")[0])
    st, _, tl = _conv_tiling(plan)
    assert type(tl).__name__ == "MmaTiling"
    assert len(build_dsl(plan, kernel_name(plan, st), monkeypatch)) >= 1
