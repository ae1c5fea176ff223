"""fvdb.PoolingMap -> MaxPool / AvgPool and fvdb.RefineMap -> Refine against the numpy reference of
fVDB's semantics (fvdb_reference.pool / refine, loops over ijk dictionaries): pool sizes 1, 2, 3 and
strides 0 (= the pool size), 1, 2 and per axis, over two grids in a batch with negative coordinates,
a single voxel, empty grids and warp-built grids; the maps built on the device (grids bound at run
time) and folded on the host (constant grids); the torch functions, their gradients and export."""
import io

import numpy as np
import onnx
import pytest
import torch
from onnx import helper

import luisaml
from luisaml.fvdb import GridBatch
from luisaml.fvdb import torch_ops as F
from luisaml.fvdb.topology import coarsened
from luisaml.opsets import fvdb as schema
from luisaml.opsets import fvdb_grids as grid_schema

from fvdb_reference import fvdb_model, pool, refine
from suite_mode import full_run


def assert_close(got, want, what=""):
    """Within 1e-5 relative of the largest magnitude; -inf exactly where the reference has it."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    inf = np.isinf(want)
    np.testing.assert_array_equal(got[inf], want[inf], err_msg=what)
    scale = max(float(np.abs(want[~inf]).max(initial=0.0)), 1e-30)
    err = float(np.abs(got[~inf] - want[~inf]).max(initial=0.0)) / scale
    assert err <= 1e-5, f"{what}: relative error {err:.3g}"


def coarse_of(fine: GridBatch, factor) -> GridBatch:
    """fVDB's default coarse grid of a pool: coarsened(fine, stride)."""
    voxels, h, o = coarsened([v for v in fine.ijk.unbind()], fine.voxel_sizes, fine.origins, factor)
    return GridBatch.from_ijk(voxels, h, o)


@pytest.fixture(scope="module")
def grids():
    rng = np.random.default_rng(21)
    # two grids: a clustered blob across negative coordinates and several leaves, and scattered voxels
    a = rng.integers(-9, 7, (700, 3))
    b = np.concatenate([rng.integers(30, 40, (200, 3)), rng.integers(-300, 300, (60, 3))])
    return rng, GridBatch.from_ijk([a.astype(np.int32), b.astype(np.int32)], voxel_sizes=[0.1, 0.3],
                                   origins=[(0, 0, 0), (-1, 2, 0.5)])


def _pair_feeds(g_in: GridBatch, g_out: GridBatch) -> dict:
    feeds = {f"in_{n}": a for n, a in zip(schema.BUNDLE, g_in.bundle())}
    feeds.update({f"out_{n}": a for n, a in zip(schema.BUNDLE, g_out.bundle())})
    return feeds


def run_pool(op_type, g_in, g_out, x, grids_constant=False, **attrs):
    """Compile {Pooling,Refine}Map -> op_type over (g_in, g_out) and return (output, map or None)."""
    map_op = grid_schema.REFINE_MAP if op_type == "Refine" else grid_schema.POOL_MAP
    feeds = {**_pair_feeds(g_in, g_out), "x": x}
    nodes = [helper.make_node(map_op, schema.kernel_map_input_names(), ["pmap"], name="pmap", domain=schema.DOMAIN,
                              output_voxels=g_out.total_voxels, **attrs),
             helper.make_node(op_type, ["x", "pmap"], ["y"], name="pool", domain=schema.DOMAIN)]
    grid_names = [n for n in feeds if n != "x"]
    outputs = ["y"] if grids_constant else ["y", "pmap"]
    m = fvdb_model(nodes, feeds, constants=tuple(grid_names) if grids_constant else (), outputs=outputs)
    net = luisaml.compile(m, batch_axis=None)
    ops = [n.op_type for n, _ in net.plan.ops]
    assert ops == ([op_type] if grids_constant else [map_op, op_type])
    out = net.run({k: v for k, v in feeds.items() if not (grids_constant and k in grid_names)})
    return out["y"], out.get("pmap")


@pytest.mark.parametrize("K, S", [(1, 0), (2, 0), (3, 0), (2, 1), (3, 2), ((2, 3, 1), (1, 2, 0))])
@pytest.mark.parametrize("op_type", ["MaxPool", "AvgPool"])
def test_pool_over_two_grids(grids, op_type, K, S):
    rng, fine = grids
    coarse = coarse_of(fine, np.where(np.asarray(S) == 0, K, S))
    x = rng.standard_normal((fine.total_voxels, 5)).astype(np.float32)
    got, pmap = run_pool(op_type, fine, coarse, x, pool_size=list(np.broadcast_to(K, 3)),
                         stride=list(np.broadcast_to(S, 3)))
    mode = "max" if op_type == "MaxPool" else "avg"
    assert_close(got, pool(fine, x, coarse, K, S, mode), f"{op_type} K={K} S={S}")
    # the device-built map equals the torch function's (host) map
    want = F.pooling_map(F.bundle_tensors(fine), F.bundle_tensors(coarse), K, S).numpy()
    np.testing.assert_array_equal(pmap, want)


def test_max_pool_is_minus_inf_over_an_empty_window(grids):
    """A coarse grid the user built with voxels far from the fine grid: windows without active voxels."""
    rng, fine = grids
    coarse = GridBatch.from_ijk([np.array([[0, 0, 0], [500, 500, 500]], np.int32), np.array([[-77, 0, 3]], np.int32)])
    x = rng.standard_normal((fine.total_voxels, 3)).astype(np.float32)
    got, _ = run_pool("MaxPool", fine, coarse, x, pool_size=[2, 2, 2], stride=[0])
    want = pool(fine, x, coarse, 2, 0, "max")
    assert np.isinf(want).any()
    assert_close(got, want)


@pytest.mark.parametrize("factor", [1, 2, 3, (2, 1, 3)])
def test_refine_over_two_grids(grids, factor):
    rng, coarse = grids
    fine_voxels = [np.concatenate([v * np.array(np.broadcast_to(factor, 3)), rng.integers(-50, 50, (30, 3))])
                   for v in coarse.ijk.unbind()]  # refined voxels plus some whose parent is inactive
    fine = GridBatch.from_ijk([v.astype(np.int32) for v in fine_voxels])
    x = rng.standard_normal((coarse.total_voxels, 20)).astype(np.float32)  # two channel blocks
    got, pmap = run_pool("Refine", coarse, fine, x, subdiv_factor=list(np.broadcast_to(factor, 3)))
    assert_close(got, refine(coarse, x, fine, factor))
    np.testing.assert_array_equal(pmap, F.refine_map(F.bundle_tensors(coarse), F.bundle_tensors(fine), factor).numpy())


def test_constant_grids_fold_the_maps(grids):
    rng, fine = grids
    coarse = coarse_of(fine, 2)
    x = rng.standard_normal((fine.total_voxels, 4)).astype(np.float32)
    got, _ = run_pool("MaxPool", fine, coarse, x, grids_constant=True, pool_size=[2, 2, 2], stride=[2, 2, 2])
    assert_close(got, pool(fine, x, coarse, 2, 2, "max"))
    y = rng.standard_normal((coarse.total_voxels, 4)).astype(np.float32)
    got, _ = run_pool("Refine", coarse, fine, y, grids_constant=True, subdiv_factor=[2, 2, 2])
    assert_close(got, refine(coarse, y, fine, 2))


def test_single_voxel_and_empty_grids():
    rng = np.random.default_rng(5)
    one = GridBatch.from_ijk([np.array([[-5, 7, 1000]], np.int32)])
    parent = coarse_of(one, 2)
    x = rng.standard_normal((1, 3)).astype(np.float32)
    got, _ = run_pool("AvgPool", one, parent, x, pool_size=[2, 2, 2])
    assert_close(got, pool(one, x, parent, 2, 0, "avg"))
    got, _ = run_pool("Refine", parent, one, got, subdiv_factor=[2, 2, 2])
    assert_close(got, x / 8)
    empty = GridBatch.from_ijk([np.zeros((0, 3), np.int32)])
    got, _ = run_pool("MaxPool", one, empty, x, pool_size=[2, 2, 2])
    assert got.shape == (0, 3)
    got, _ = run_pool("Refine", empty, one, np.zeros((0, 3), np.float32), subdiv_factor=[2, 2, 2])
    np.testing.assert_array_equal(got, np.zeros((1, 3), np.float32))


def test_grids_built_by_warp(warp_ref):
    rng = np.random.default_rng(12)
    ijk = rng.integers(-20, 20, (400, 3)).astype(np.int32)
    fine = GridBatch.from_buffer(warp_ref.volume_bytes(warp_ref.volume_from_ijk(ijk)))
    coarse = GridBatch.from_buffer(warp_ref.volume_bytes(warp_ref.volume_from_ijk(np.floor_divide(ijk, 2))))
    x = rng.standard_normal((fine.total_voxels, 3)).astype(np.float32)
    got, _ = run_pool("MaxPool", fine, coarse, x, pool_size=[3, 3, 3], stride=[2, 2, 2])
    assert_close(got, pool(fine, x, coarse, 3, 2, "max"))
    y = rng.standard_normal((coarse.total_voxels, 3)).astype(np.float32)
    got, _ = run_pool("Refine", coarse, fine, y, subdiv_factor=[2, 2, 2])
    assert_close(got, refine(coarse, y, fine, 2))


def test_maps_fed_at_run_time_are_checked():
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    m = fvdb_model([helper.make_node("MaxPool", ["x", "pmap"], ["y"], name="pool", domain="fvdb")],
                   {"x": x, "pmap": np.full((2, 2), -1, np.int32)})
    net = luisaml.compile(m, batch_axis=None)
    got = net.run({"x": x, "pmap": np.array([[0, 3], [-1, -1]], np.int32)})["y"]
    assert_close(got, np.stack([x[3], np.full(3, -np.inf)]))
    with pytest.raises(luisaml.RunError, match=r"node 'pool' \(fvdb::MaxPool\): map 'pmap' holds an index outside "
                                               r"\[-1, 4\)"):
        net.run({"x": x, "pmap": np.array([[0, 4], [-1, -1]], np.int32)})


# ---- torch -------------------------------------------------------------------------------------------


def test_torch_functions_equal_the_reference_and_their_gradients_the_adjoint(grids):
    rng, fine = grids
    coarse = coarse_of(fine, 2)
    ft, ct = F.bundle_tensors(fine), F.bundle_tensors(coarse)
    x = torch.from_numpy(rng.standard_normal((fine.total_voxels, 4))).requires_grad_()
    for fn, mode in ((F.max_pool, "max"), (F.avg_pool, "avg")):
        y = fn(ft, ct, x, 3, 2)
        assert_close(y.detach().numpy(), pool(fine, x.detach().numpy(), coarse, 3, 2, mode), mode)
    c = rng.standard_normal((coarse.total_voxels, 4))
    assert_close(F.refine(ct, ft, torch.from_numpy(c), 2).numpy(), refine(coarse, c, fine, 2), "refine")
    # gradients: the derivative of each output is its own formulation's (max: the argmax voxel; avg:
    # 1 / K^3 to every window voxel; refine: the sum over children), checked by torch's gradcheck
    xs = torch.from_numpy(rng.standard_normal((fine.total_voxels, 2))).requires_grad_()
    assert _gradcheck(lambda v: F.avg_pool(ft, ct, v, 2, 0), xs)
    assert _gradcheck(lambda v: F.max_pool(ft, ct, v, 2, 0), xs)
    cs = torch.from_numpy(rng.standard_normal((coarse.total_voxels, 2))).requires_grad_()
    assert _gradcheck(lambda v: F.refine(ct, ft, v, 2), cs)


def _gradcheck(fn, x: torch.Tensor, rows: int = 32, sketch: int = 16) -> bool:
    """torch's gradcheck of fn at x: in the full run the whole Jacobian (two runs of fn an input, a
    backward an output: ~110 s for the three above on 2 cores); in CI's its columns of `rows` rows of x
    drawn at random (the others held at x), each column seen through `sketch` random combinations of
    the outputs (a wrong entry of a column moves its sketch: ~1 s). Not gradcheck's fast mode, one
    random combination of the columns too: it let a backward 1% off on half the voxels through
    (AvgPool, MaxPool, Refine), which this catches."""
    if full_run():
        return torch.autograd.gradcheck(fn, (x,))
    rng = np.random.default_rng(len(x))
    at = torch.from_numpy(rng.choice(len(x), min(rows, len(x)), replace=False))
    held = x.detach()
    mix = torch.from_numpy(rng.standard_normal((sketch, len(fn(held)))))
    return torch.autograd.gradcheck(lambda v: mix @ fn(held.index_copy(0, at, v)), (held[at].clone().requires_grad_(),))


class _PoolModule(torch.nn.Module):
    def __init__(self, fine, coarse):
        super().__init__()
        self.fine, self.coarse = F.bundle_tensors(fine), F.bundle_tensors(coarse)

    def forward(self, x):
        d = F.max_pool(self.fine, self.coarse, x, 2) + F.avg_pool(self.fine, self.coarse, x, 2)
        return F.refine(self.coarse, self.fine, torch.relu(d), 2) + x


def test_exported_torch_module_compiles_and_runs(grids):
    rng, fine = grids
    coarse = coarse_of(fine, 2)
    model = _PoolModule(fine, coarse)
    x = torch.from_numpy(rng.standard_normal((fine.total_voxels, 6)).astype(np.float32))
    buf = io.BytesIO()
    F.export_onnx(model, (x,), buf, input_names=["x"], output_names=["y"])
    proto = onnx.load_from_string(buf.getvalue())
    assert {n.op_type for n in proto.graph.node} >= {grid_schema.POOL_MAP, grid_schema.REFINE_MAP, "MaxPool", "AvgPool", "Refine"}
    net = luisaml.compile(proto, batch_axis=None)
    ops = [n.op_type for n, _ in net.plan.ops]
    assert grid_schema.POOL_MAP not in ops and grid_schema.REFINE_MAP not in ops  # constant grids: the maps fold
    with torch.no_grad():
        want = model(x).numpy()
    assert_close(net.run({"x": x.numpy()})["y"], want)
