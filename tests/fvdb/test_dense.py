"""fvdb.InjectToDense (operators/fvdb/dense.py) and its torch function (luisaml/fvdb/torch_dense.py)
against a numpy reference written from fVDB's inject_to_dense_cmajor (ops/InjectToDense.cu): grid b's
voxel ijk goes to cell ijk - min_coord[b] of the box, voxels outside it are dropped, the other cells
are 0; in the three layouts (fVDB's CXYZ, spconv's CZYX, CenterPoint's BEV)."""
import numpy as np
import pytest
import torch

import luisaml
from luisaml.fvdb import GridBatch, JaggedTensor
from luisaml.fvdb import torch_ops as F
from luisaml.fvdb.torch_dense import inject_to_dense

from fvdb_reference import bundle_feeds, fvdb_model, fvdb_node

LAYOUTS = ("CXYZ", "CZYX", "BEV")


def reference(gb: GridBatch, data: np.ndarray, min_coord, grid_size, layout: str) -> np.ndarray:
    """fVDB's dense box [B, C, X, Y, Z] by a loop over every voxel, then the layout's axes."""
    X, Y, Z = grid_size
    lo = np.broadcast_to(np.asarray(min_coord, np.int64).reshape(-1, 3), (gb.grid_count, 3))
    out = np.zeros((gb.grid_count, data.shape[1], X, Y, Z), np.float32)
    for b, vox in enumerate(gb.ijk.unbind()):
        for n, ijk in enumerate(np.asarray(vox, np.int64)):
            x, y, z = ijk - lo[b]
            if 0 <= x < X and 0 <= y < Y and 0 <= z < Z:
                out[b, :, x, y, z] = data[int(gb.batch_offsets[b]) + n]
    if layout == "CXYZ":
        return out
    czyx = out.transpose(0, 1, 4, 3, 2)
    return czyx if layout == "CZYX" else czyx.reshape(gb.grid_count, -1, Y, X)


def random_grids(seed: int, counts, spread: int = 9) -> GridBatch:
    """Grids of random voxels around the origin, some of them outside the boxes the tests take."""
    rng = np.random.default_rng(seed)
    return GridBatch.from_ijk([rng.integers(-spread, spread, (n, 3)).astype(np.int32) for n in counts],
                              voxel_sizes=[[0.2, 0.2, 0.2]] * len(counts), origins=[[0.0, 0.1, 0.0]] * len(counts))


def voxel_data(gb: GridBatch, data: np.ndarray) -> JaggedTensor:
    """The voxel data as a JaggedTensor of one tensor per grid."""
    off = gb.batch_offsets
    return JaggedTensor.from_list([data[off[b]:off[b + 1]] for b in range(gb.grid_count)])


def dense_feeds(gb: GridBatch, data: np.ndarray) -> dict:
    return bundle_feeds(gb, data=voxel_data(gb, data))


def dense_model(gb: GridBatch, channels: int, dynamic: bool = False, **attrs):
    feeds = dense_feeds(gb, np.zeros((gb.total_voxels, channels), np.float32))
    m = fvdb_model([fvdb_node("InjectToDense", "dense", **attrs)], feeds)
    if dynamic:  # the parts of a grid and its data that grow with it: bound at run time
        for vi in m.graph.input:
            if vi.name in ("grid_blob", "leaf_batch_indices", "list_indices", "data_jdata"):
                d = vi.type.tensor_type.shape.dim[0]
                d.Clear()
                d.dim_param = f"rows_{vi.name}"
    return m


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_grids_into_boxes_of_their_own_equal_the_reference(layout):
    gb = random_grids(1, (300, 120))
    lo, size = [-4, -6, -3, -8, -2, 0], [9, 7, 5]  # grid 1's box elsewhere; both cut through the voxels
    net = luisaml.compile(dense_model(gb, 3, min_coord=lo, grid_size=size, layout=layout), batch_axis=None)
    data = np.random.default_rng(2).standard_normal((gb.total_voxels, 3)).astype(np.float32)
    got = net.run(dense_feeds(gb, data))["dense"]
    want = reference(gb, data, lo, size, layout)
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    # the boxes drop voxels and leave empty cells: both cases occur
    corner = np.reshape(lo, (2, 3))
    kept = sum(int(((np.asarray(v) >= corner[b]) & (np.asarray(v) < corner[b] + size)).all(1).sum())
               for b, v in enumerate(gb.ijk.unbind()))
    assert 0 < kept < gb.total_voxels and (got == 0).any()


def test_one_network_for_grids_and_features_of_any_size():
    """The grid and its features bound at run time: one compiled network, the box fixed."""
    size = [8, 6, 4]
    first = random_grids(3, (200,))
    net = luisaml.compile(dense_model(first, 2, dynamic=True, min_coord=[-3, -3, -2], grid_size=size,
                                      layout="BEV"), batch_axis=None)
    for seed, gb in ((4, first), (5, random_grids(5, (700,), spread=6)), (6, random_grids(6, (40,)))):
        data = np.random.default_rng(seed).standard_normal((gb.total_voxels, 2)).astype(np.float32)
        got = net.run(dense_feeds(gb, data))["dense"]
        np.testing.assert_array_equal(got, reference(gb, data, [-3, -3, -2], size, "BEV"))
    feeds = dense_feeds(first, np.zeros((first.total_voxels, 2), np.float32))
    feeds["data_jdata"] = np.zeros((first.total_voxels + 1, 2), np.float32)  # a row more than the grid's voxels
    with pytest.raises(luisaml.LuisamlError, match=r"voxel data has \d+ rows"):
        net.run(feeds)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_torch_function_equals_the_reference_and_its_export_compiles(layout):
    gb = random_grids(7, (150, 90))
    bundle = F.bundle_tensors(gb)
    data = torch.from_numpy(np.random.default_rng(8).standard_normal((gb.total_voxels, 4)).astype(np.float32))
    lo, size = (-5, -4, -3), (10, 8, 6)
    want = reference(gb, data.numpy(), lo, size, layout)
    got = inject_to_dense(bundle, data, lo, size, layout)
    np.testing.assert_array_equal(got.numpy(), want)

    class Dense(torch.nn.Module):
        def forward(self, x, *grid):
            return torch.relu(inject_to_dense(grid, x, lo, size, layout))

    import io

    import onnx

    buf = io.BytesIO()
    F.export_onnx(Dense(), (data, *bundle), buf, input_names=["x", *[f"g{k}" for k in range(7)]],
                  output_names=["dense"])
    proto = onnx.load_from_string(buf.getvalue())
    assert [n.op_type for n in proto.graph.node if n.domain == "fvdb"] == ["InjectToDense"]
    net = luisaml.compile(proto, batch_axis=None)
    out = net.run({"x": data.numpy(), **{f"g{k}": t.numpy() for k, t in enumerate(bundle)}})["dense"]
    np.testing.assert_array_equal(out, np.maximum(want, 0))


def test_gradient_is_the_gather_of_the_dense_gradient():
    gb = random_grids(9, (80,))
    data = torch.randn(gb.total_voxels, 3, requires_grad=True)
    out = inject_to_dense(F.bundle_tensors(gb), data, (-4, -4, -4), (8, 8, 8), "BEV")
    weight = torch.randn(out.shape)
    (out * weight).sum().backward()
    # d/d data of sum(w * dense) by the reference's own placement of an all-ones probe per channel
    want = np.zeros((gb.total_voxels, 3), np.float32)
    rows = np.arange(gb.total_voxels, dtype=np.float32)
    for c in range(3):
        probe = np.zeros((gb.total_voxels, 3), np.float32)
        probe[:, c] = rows + 1  # the cell of each voxel, found by its row number
        placed = reference(gb, probe, (-4, -4, -4), (8, 8, 8), "BEV")
        at = placed > 0
        want[placed[at].astype(np.int64) - 1, c] = weight.numpy()[at]
    np.testing.assert_allclose(data.grad.numpy(), want, rtol=1e-6)


@pytest.mark.parametrize("attrs,message", [
    ({"min_coord": [0, 0, 0], "grid_size": [4, 0, 4]}, "grid_size must be 3 positive"),
    ({"min_coord": [0, 0], "grid_size": [4, 4, 4]}, "min_coord must be 3 ints or 3 per grid"),
    ({"min_coord": [0, 0, 0], "grid_size": [4, 4, 4], "layout": "XYZC"}, "layout must be one of"),
])
def test_bad_attributes_name_the_node(attrs, message):
    gb = random_grids(10, (30,))
    feeds = dense_feeds(gb, np.zeros((gb.total_voxels, 2), np.float32))
    import onnx
    from onnx import helper

    from luisaml.opsets import fvdb_dense

    node = helper.make_node("InjectToDense", fvdb_dense.OPS["InjectToDense"].input_names(), ["dense"], name="to_dense",
                            domain="fvdb", **attrs)
    ins = [helper.make_tensor_value_info(k, onnx.helper.np_dtype_to_tensor_dtype(v.dtype), list(v.shape))
           for k, v in feeds.items()]
    g = helper.make_graph([node], "g", ins, [helper.make_tensor_value_info("dense", onnx.TensorProto.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("fvdb", 1)])
    with pytest.raises(luisaml.LuisamlError, match=rf"to_dense.*{message}"):
        luisaml.compile(m, batch_axis=None)
