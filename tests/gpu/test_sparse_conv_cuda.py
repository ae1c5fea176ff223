"""fvdb.SparseConv3d's GPU form (an implicit GEMM in cooperative blocks, operators/tiled.py) on the
CUDA backend against tests/fvdb's numpy reference of fVDB's semantics: 64 -> 64 channels (blocks),
stride 1 and 2, transposed, a kernel map built on the device and one folded on the host, bias, a
BatchNorm (folded into the weights) + Relu epilogue.

    LUISAML_BACKEND=cuda python -m pytest tests/gpu/test_sparse_conv_cuda.py -q"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import helper
from util import cuda_only

import luisaml

pytestmark = cuda_only()


def _suite():
    """tests/fvdb/test_ops_sparse_conv.py as a module (its helpers and grids), by path: `fvdb` is
    also the name of fVDB's package."""
    folder = Path(__file__).resolve().parents[1] / "fvdb"
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))  # (its `from fvdb_reference import ...`)
    path = folder / "test_ops_sparse_conv.py"
    spec = importlib.util.spec_from_file_location("sparse_conv_suite", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


S = _suite()


def _grids():
    """The suite's two surface-like grids in one batch (its `grids` fixture, built the same way)."""
    rng = np.random.default_rng(7)
    a = S.shell((-3, 5, -9), 9.5, rng)
    b = np.concatenate([S.shell((20, -4, 0), 5.0, rng), rng.integers(-30, 30, (40, 3))]).astype(np.int32)
    return rng, S.GridBatch.from_ijk([a, b], voxel_sizes=[0.1, 0.2], origins=[(0, 0, 0), (1, 2, 3)])


@pytest.mark.parametrize("K,stride,transposed,constant", [(3, 1, False, False), (3, 1, False, True),
                                                          (2, 2, False, False), (3, 2, True, False),
                                                          (5, 1, False, True), (5, 1, True, False)])
def test_64_channels_in_blocks(K, stride, transposed, constant):
    """(Each tile runs only its voxels' taps: K = 5 has 125, four words of tap masks; a folded map
    also runs its voxels in rows_by_taps' order.)"""
    rng, gb = _grids()
    if stride == 1:
        g_out = gb
    elif transposed:
        g_out = S.GridBatch.from_ijk([S.conv_transpose_grid_ijk(v, K, stride) for v in gb.ijk.unbind()])
    else:
        g_out = S.GridBatch.from_ijk([S.conv_grid_ijk(v, K, stride) for v in gb.ijk.unbind()],
                                     voxel_sizes=gb.voxel_sizes * 2, origins=gb.origins)
    x = rng.standard_normal((gb.total_voxels, 64)).astype(np.float32)
    w, b = S._weights(rng, 64, 64, K)
    got = S.run_conv(gb, g_out, x, w, b, S=stride, transposed=transposed, grids_constant=constant)
    S.assert_close(got, S.sparse_conv3d(gb, x, g_out, w, b, stride, transposed))


@pytest.mark.parametrize("c_in,constant", [(12, True), (24, False)])
def test_input_channels_not_whole_k_steps(c_in, constant):
    """12 input channels: a k step of 8 spans two taps, so the tiles run every tap (no skipping);
    24: whole steps again. Both 64 output channels (blocks)."""
    rng, gb = _grids()
    x = rng.standard_normal((gb.total_voxels, c_in)).astype(np.float32)
    w, b = S._weights(rng, 64, c_in, 3)
    got = S.run_conv(gb, gb, x, w, b, grids_constant=constant)
    S.assert_close(got, S.sparse_conv3d(gb, x, gb, w, b))


def test_blocks_stage_with_folded_batchnorm_and_relu_epilogue():
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
    net = luisaml.compile(S.fvdb_model(nodes, {**feeds, **consts}, constants=tuple(consts), outputs=["y"]),
                          batch_axis=None)
    conv = [st for st in net.plan.schedule.stages if st.root[0].op_type == S.schema.SPARSE_CONV][0]
    # (the BatchNormalization folds into the constant weight and bias: passes/cleanup.py)
    assert conv.domain == "blocks" and [n.op_type for n, _ in conv.epilogue] == ["Relu"]
    h = S.sparse_conv3d(gb, x, gb, w, b)
    want = np.maximum((h - mean) / np.sqrt(var.astype(np.float64) + 1e-5) * scale + shift, 0)
    S.assert_close(net.run(feeds)["y"], want)
