"""fvdb.SplatNearest (luisaml's sum by voxel, what voxelizing a point cloud needs) against a numpy
reference (np.add.at by NanoVDB's round of fVDB's float32 world_to_voxel): over a constant grid, per
point with atomics and as one instance; and over a grid built from the points inside the network (a
host step), with the voxels as the batch: one compiled network for clouds of different sizes, including
one whose conv grid has more voxels than there are points (the batch's rows past the points padding)."""
import io

import numpy as np
import onnx
import pytest
import torch

import luisaml
from luisaml import runtime
from luisaml.fvdb import GridBatch, JaggedTensor
from luisaml.fvdb import torch_ops as F

from fvdb_reference import bundle_feeds, fvdb_model, fvdb_node, grid_ids, lookup, nanovdb_round, world_to_voxel

BATCHED = ("points_jdata", "points_jidx", "values_jdata", "values_jidx")
TOL = dict(rtol=1e-5, atol=1e-5)  # float32 sums in another order (atomics) than the reference's float64


def reference(gb: GridBatch, points: JaggedTensor, values: np.ndarray) -> np.ndarray:
    """Each point's value added into its voxel round(world_to_voxel(p)), when active (float64 sums)."""
    idx = lookup(gb, nanovdb_round(world_to_voxel(gb, points)).astype(np.int32), grid_ids(points))
    out = np.zeros((gb.total_voxels,) + values.shape[1:], np.float64)
    np.add.at(out, idx[idx >= 0], values[idx >= 0])
    return out


def make_scene():
    """Two grids of scattered voxels and points around them, some outside any voxel."""
    rng = np.random.default_rng(5)
    g0 = rng.integers(-6, 6, (300, 3)).astype(np.int32)
    g1 = rng.integers(-10, 10, (500, 3)).astype(np.int32)
    gb = GridBatch.from_ijk([g0, g1], voxel_sizes=[[0.2, 0.2, 0.2], [0.5, 0.4, 0.3]], origins=[[0, 0.1, 0], [1, 1, 1]])
    pts = JaggedTensor.from_list([rng.uniform(-1.3, 1.3, (700, 3)).astype(np.float32),
                                  (rng.uniform(-5, 5, (900, 3)) + 1).astype(np.float32)])
    values = pts.jagged_like(rng.uniform(-1, 1, (len(pts.jdata), 3)).astype(np.float32))
    return gb, pts, values


@pytest.fixture(scope="module")
def scene():
    return make_scene()


@pytest.mark.parametrize("per_point", [True, False])
def test_sums_by_voxel_over_a_constant_grid(scene, per_point):
    gb, pts, values = scene
    feeds = bundle_feeds(gb, points=pts, values=values)
    node = fvdb_node("SplatNearest", "sums", total_voxels=gb.total_voxels)
    if per_point:  # every sample adds into the shared output with atomics
        net = luisaml.compile(fvdb_model([node], feeds, batched=BATCHED), batch_axis=0)
        assert all(s.accumulated for s in net.outputs) and "atomic_fetch_add" in net.source
    else:
        net = luisaml.compile(fvdb_model([node], feeds), batch_axis=None)
        assert "atomic_fetch_add" not in net.source
    want = reference(gb, pts, values.jdata)
    assert np.count_nonzero(want.any(1)) > 100 and np.count_nonzero(~want.any(1)) > 50  # some voxels empty
    for _ in range(2):  # the sums start from zero on every run
        np.testing.assert_allclose(net.run(feeds)["sums"], want, **TOL)


class VoxelMeans(torch.nn.Module):
    """Points in, the grid of their voxels built inside, each voxel's mean value out (rows: the voxels), and
    a stride-2 conv grid's features over those means (a grid that may have more voxels than points)."""

    def __init__(self, h: float):
        super().__init__()
        self.register_buffer("voxel_sizes", torch.full((1, 3), h, dtype=torch.float64))
        self.register_buffer("origins", torch.zeros((1, 3), dtype=torch.float64))
        self.register_buffer("jidx", torch.zeros(0, dtype=torch.int32))
        self.register_buffer("jlidx", torch.zeros((0, 1), dtype=torch.int32))
        self.down = F.SparseConv3d(2, 3, 3)

    def forward(self, xyz, values, joffsets):
        pts = (xyz, joffsets, self.jidx, self.jlidx)
        fine = F.gridbatch_from_points(pts, self.voxel_sizes, self.origins)
        sums = F.splat_nearest(fine, pts, (torch.cat([values, torch.ones_like(values[:, :1])], 1),) + pts[1:])
        means = sums[:, :2] / torch.clamp(sums[:, 2:], min=1.0)
        coarse = F.conv_grid(fine, 3, 2)
        return means, self.down(means, F.sparse_conv_kernel_map(fine, coarse, 3, 2))


def _args(xyz, values):
    return torch.from_numpy(xyz), torch.from_numpy(values), torch.tensor([0, len(xyz)])


def test_means_by_voxel_of_a_grid_built_in_the_network_over_clouds_of_any_size():
    torch.manual_seed(0)
    rng = np.random.default_rng(1)
    h = 0.25
    model = VoxelMeans(h).eval()

    def cloud(n, spread):
        xyz = rng.normal(0, spread, (n, 3)).astype(np.float32)
        xyz[0] = (0.01, 0.02, -0.01)  # a voxel at the origin, where the padding rows (zeros) would land
        return xyz, rng.uniform(-1, 1, (n, 2)).astype(np.float32)

    buf = io.BytesIO()
    F.export_onnx(model, _args(*cloud(400, 1.0)), buf, input_names=["xyz", "values", "joffsets"],
                  output_names=["means", "coarse"], dynamic_axes={"xyz": {0: "N"}, "values": {0: "N"}})
    proto = onnx.load_from_string(buf.getvalue())
    net = luisaml.compile(proto)
    assert [s.node.op_type for s in net.plan.host_steps.steps] == ["GridBatchFromPoints", "ConvGrid"]
    for plan in (net.plan, runtime.analyze(proto, target="cuda")):  # (CUDA's form: the same two items phases)
        stages = [st for st in plan.schedule.stages if st.root[0].op_type == "SplatNearest"]
        assert len(stages) == 2 and all(st.batched and st.domain == "items" for st in stages)  # zero, then add
    # 30 points scattered over 40 voxels a side: the conv grid has more voxels than there are points
    for n, spread in ((400, 1.0), (1500, 1.0), (250, 0.6), (30, 10.0)):
        xyz, values = cloud(n, spread)
        got = net.run({"xyz": xyz, "values": values, "joffsets": np.array([0, n])})
        gb = GridBatch.from_points([xyz], h, 0.0)
        sums = reference(gb, JaggedTensor.from_list([xyz]), np.concatenate([values, np.ones((n, 1))], 1))
        assert (sums[:, 2] >= 1).all() and sums[:, 2].sum() == n and (n == 30) == (sums[:, 2].max() == 1)
        np.testing.assert_allclose(got["means"], sums[:, :2] / sums[:, 2:], **TOL)
        with torch.no_grad():
            want_coarse = model(*_args(xyz, values))[1].numpy()
        if n == 30:
            assert len(want_coarse) > n  # the batch is the conv grid's voxels: rows past the points pad
        np.testing.assert_allclose(got["coarse"], want_coarse, **TOL)
