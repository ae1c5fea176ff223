"""fvdb.SparseConv3d on the tensor-core tile (compile(tensor_cores="auto"), operators/tiled_mma.py) on
CUDA, the device started in the front's directory: the gather-GEMM's blocks stage takes the mma tile
and its output is within TF32's tolerance of tests/fvdb's float64 reference (1e-2 of the norm, torch's;
typically ~1e-3), and not as close as FP32's (the FP32 body would be); tensor_cores=False keeps the
FP32 tile's 1e-5. The form is opt-in (LUISAML_SPARSE_MMA=on, set here for every test). Folded and device-built maps, strides 1 and 2, transposed, K = 5 (125 taps), input
channels that are not whole k steps, a BatchNorm + Relu epilogue, and grids bound at run time (a
block's rows 128 consecutive voxels; sizes under a tile and not a multiple of it). The emulated run
(no GPU): tests/fvdb/test_sparse_conv_mma.py.

    LUISAML_BACKEND=cuda python -m pytest tests/gpu/test_sparse_conv_mma_cuda.py -q"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import helper
from util import cuda_only

import luisaml
from luisaml import tensor_cores
from luisaml.rewrites import tensor_cores as tc_rewrite

pytestmark = cuda_only()

FVDB = Path(__file__).resolve().parents[1] / "fvdb"
if str(FVDB) not in sys.path:
    sys.path.insert(0, str(FVDB))  # (the suites' `from fvdb_reference import ...`)
import test_sparse_conv_any_grid as A  # noqa: E402

TF32_TOL, FP32_TOL = 1e-2, 1e-5


def _suite():
    """tests/fvdb/test_ops_sparse_conv.py by path (`fvdb` is also the name of fVDB's package)."""
    spec = importlib.util.spec_from_file_location("sparse_conv_suite_mma", FVDB / "test_ops_sparse_conv.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


S = _suite()


@pytest.fixture(autouse=True, scope="module")
def _front_device():
    """The device starts in the front's directory only when asked first: run this file in a process of
    its own (as tests/gpu/test_tensor_cores_cuda.py)."""
    if luisaml.device.current() is not None and not tensor_cores._started_in:
        pytest.skip("the CUDA device was started without tensor_cores=True in this process")
    luisaml.device.init("cuda", tensor_cores=True)


@pytest.fixture(autouse=True)
def _sparse_mma(monkeypatch):
    """SparseConv3d takes the mma tile only where asked (luisaml/rewrites/tensor_cores.py)."""
    monkeypatch.setenv(tc_rewrite.SPARSE_MMA_ENV, "on")


def _rel(got, want) -> float:
    want = np.asarray(want, np.float64)
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want))


def _grids():
    rng = np.random.default_rng(7)
    a = S.shell((-3, 5, -9), 9.5, rng)
    b = np.concatenate([S.shell((20, -4, 0), 5.0, rng), rng.integers(-30, 30, (40, 3))]).astype(np.int32)
    return rng, S.GridBatch.from_ijk([a, b], voxel_sizes=[0.1, 0.2], origins=[(0, 0, 0), (1, 2, 3)])


def _both(model, feeds, **kw):
    """(the mma network's output, the FP32 network's), each compiled here; the mma plan checked."""
    tc = luisaml.compile(model, tensor_cores="auto", **kw)
    fp32 = luisaml.compile(model, tensor_cores=False, **kw)
    conv = [op for st in tc.plan.schedule.stages if st.domain == "blocks" for n, op in st.nodes
            if n.op_type == S.schema.SPARSE_CONV]
    assert conv and all(type(op.block_tiling()).__name__ == "MmaTiling" for op in conv)
    assert "mma_tf32_m16n8k8" in tc.plan.source and "mma_tf32" not in fp32.plan.source
    return tc.run(feeds), fp32.run(feeds)


def _check(got_tc, got_fp32, want):
    e_tc, e_fp32 = _rel(got_tc, want), _rel(got_fp32, want)
    assert e_fp32 <= FP32_TOL, e_fp32
    assert e_tc <= TF32_TOL, e_tc
    assert e_tc > 10 * e_fp32, (e_tc, e_fp32)  # TF32 rounds: an FP32-close answer ran the FP32 body


@pytest.mark.parametrize("K,stride,transposed,constant,c_in", [
    (3, 1, False, False, 64), (3, 1, False, True, 64), (2, 2, False, False, 64), (3, 2, True, False, 64),
    (5, 1, False, True, 64), (3, 1, False, True, 24), (3, 1, False, False, 32)])
def test_layer_on_the_mma_tile(K, stride, transposed, constant, c_in):
    rng, gb = _grids()
    if stride == 1:
        g_out = gb
    elif transposed:
        g_out = S.GridBatch.from_ijk([S.conv_transpose_grid_ijk(v, K, stride) for v in gb.ijk.unbind()])
    else:
        g_out = S.GridBatch.from_ijk([S.conv_grid_ijk(v, K, stride) for v in gb.ijk.unbind()],
                                     voxel_sizes=gb.voxel_sizes * 2, origins=gb.origins)
    x = rng.standard_normal((gb.total_voxels, c_in)).astype(np.float32)
    w, b = S._weights(rng, 64, c_in, K)
    feeds = {**S._pair_feeds(gb, g_out), "x": x}
    nodes = [S._kernel_map_node(K, stride, transposed, g_out),
             helper.make_node(S.schema.SPARSE_CONV, ["x", "kmap", "w", "b"], ["y"], name="conv", domain="fvdb")]
    grid_names = tuple(n for n in feeds if n != "x")
    m = S.fvdb_model(nodes, {**feeds, "w": w, "b": b}, constants=("w", "b") + (grid_names if constant else ()),
                     outputs=["y"])
    run_feeds = {"x": x} if constant else feeds
    got_tc, got_fp32 = _both(m, run_feeds, batch_axis=None)
    _check(got_tc["y"], got_fp32["y"], S.sparse_conv3d(gb, x, g_out, w, b, stride, transposed))


def test_batchnorm_relu_epilogue_on_the_mma_tile():
    rng, gb = _grids()
    c = 64
    x = rng.standard_normal((gb.total_voxels, c)).astype(np.float32)
    w, b = S._weights(rng, c, c, 3)
    scale, shift, mean = (rng.standard_normal(c).astype(np.float32) for _ in range(3))
    var = rng.uniform(0.5, 2.0, c).astype(np.float32)
    feeds = {**S._pair_feeds(gb, gb), "x": x}
    consts = dict(w=w, b=b, scale=scale, shift=shift, mean=mean, var=var)
    nodes = [S._kernel_map_node(3, 1, False, gb),
             helper.make_node(S.schema.SPARSE_CONV, ["x", "kmap", "w", "b"], ["h"], name="conv", domain="fvdb"),
             helper.make_node("BatchNormalization", ["h", "scale", "shift", "mean", "var"], ["h1"], name="bn"),
             helper.make_node("Relu", ["h1"], ["y"], name="relu")]
    m = S.fvdb_model(nodes, {**feeds, **consts}, constants=tuple(consts), outputs=["y"])
    got_tc, got_fp32 = _both(m, feeds, batch_axis=None)
    h = S.sparse_conv3d(gb, x, gb, w, b)
    _check(got_tc["y"], got_fp32["y"], np.maximum((h - mean) / np.sqrt(var.astype(np.float64) + 1e-5) * scale + shift, 0))


@pytest.mark.parametrize("C", [32, 64])
def test_a_residual_block_over_grids_of_any_size(C):
    """Both convolutions a grouped blocks stage of 128 voxels a tile on the mma tile; grids of 30 to
    2,500 points (fewer voxels than a tile, and not a multiple of one)."""
    rng = np.random.default_rng(C)
    m, p = A.block_model(C, 3, rng, 1)
    tc = luisaml.compile(m, tensor_cores="auto")
    fp32 = luisaml.compile(m, tensor_cores=False)
    grouped = [st for st in tc.plan.schedule.stages if st.domain == "blocks" and st.samples == 128]
    assert len(grouped) == 2 and "mma_tf32_m16n8k8" in tc.plan.source
    sizes = []
    for gb in (A.sphere(1, 400, 6.0), A.sphere(2, 2500, 14.0), A.sphere(3, 30, 2.0)):
        feeds = {**A.grid_feeds(gb, "in_", "out_"), "x": rng.standard_normal((gb.total_voxels, C)).astype(np.float32)}
        want = A.reference_block(gb, feeds["x"].astype(np.float64), p)
        _check(tc.run(feeds)["y"], fp32.run(feeds)["y"], want)
        sizes.append(gb.total_voxels)
    assert min(sizes) < 128 and max(sizes) > 128 and any(s % 128 for s in sizes)


@pytest.mark.parametrize("constant", [True, False])
def test_k_variants_on_the_mma_tile(constant, monkeypatch):
    """SparseConv3d.mma_buckets = 3 (not the default until measured: bench_fvdb --mma-tiles 128,64,3):
    three emits of the tile at three K behind a branch on the block's tap count, sharing one set of
    shared buffers."""
    from luisaml.operators.fvdb import conv as conv_op

    monkeypatch.setattr(conv_op.SparseConv3d, "mma_buckets", 3)
    rng, gb = _grids()
    x = rng.standard_normal((gb.total_voxels, 64)).astype(np.float32)
    w, b = S._weights(rng, 64, 64, 3)
    feeds = {**S._pair_feeds(gb, gb), "x": x}
    nodes = [S._kernel_map_node(3, 1, False, gb),
             helper.make_node(S.schema.SPARSE_CONV, ["x", "kmap", "w", "b"], ["y"], name="conv", domain="fvdb")]
    grid_names = tuple(n for n in feeds if n != "x")
    m = S.fvdb_model(nodes, {**feeds, "w": w, "b": b}, constants=("w", "b") + (grid_names if constant else ()),
                     outputs=["y"])
    got_tc, got_fp32 = _both(m, {"x": x} if constant else feeds, batch_axis=None)
    _check(got_tc["y"], got_fp32["y"], S.sparse_conv3d(gb, x, gb, w, b))
