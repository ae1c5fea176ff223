"""fvdb.GridFromNanoVDB (folded on the host at compile time) and the checks that keep malformed grids and
inconsistent bundles out of kernels: each is an error naming what is wrong, at compile time for
constant grids and when the inputs are bound for grids fed at run time."""
import numpy as np
import pytest
from onnx import helper

import luisaml
from luisaml.fvdb import GridBatch, JaggedTensor
from luisaml.opsets import fvdb as schema

from fvdb_reference import ELEM, bundle_feeds, fvdb_model, fvdb_node, lookup
from conftest import assert_floats_equal

BUNDLE = list(schema.BUNDLE)


def _grids():
    rng = np.random.default_rng(21)
    return [rng.integers(-50, 50, (300, 3)).astype(np.int32), rng.integers(-9000, 9000, (80, 3)).astype(np.int32)]


def _from_blob_model(blob: np.ndarray, probes: JaggedTensor, extra=None, blob_input=False):
    """GridFromNanoVDB(blob[, voxel_sizes, origins]) -> the bundle -> IJKToIndex and WorldToVoxel."""
    ins = ["raw"] + ([] if extra is None else ["vs", "og"])
    nodes = [helper.make_node("GridFromNanoVDB", ins, BUNDLE, name="g", domain="fvdb"),
             fvdb_node("IJKToIndex", "index", cumulative=1), fvdb_node("WorldToVoxel", "x")]
    nodes[2].input[7:] = [f"ijk_{p}" for p in schema.JAGGED]  # voxel coordinates as float points
    feeds = {"raw": blob, **{f"ijk_{p}": a for p, a in zip(schema.JAGGED, probes.bundle())}}
    feeds["ijkf"] = probes.jdata.astype(np.float32)
    nodes[2].input[7] = "ijkf"
    if extra is not None:
        feeds["vs"], feeds["og"] = extra
    consts = () if blob_input else ("raw", "vs", "og")
    return fvdb_model(nodes, feeds, constants=consts, outputs=["index", "x"]), feeds


def test_grid_from_nanovdb_folds_into_the_weight_blob():
    vox = _grids()
    gb = GridBatch.from_ijk(vox, voxel_sizes=[0.5, 0.25], origins=[(1, 2, 3), (0, 0, 0)])
    probes = JaggedTensor.from_list([np.concatenate([v, v + 1]) for v in vox])
    m, feeds = _from_blob_model(gb.grid_blob, probes)
    net = luisaml.compile(m, batch_axis=None)
    assert [n.op_type for n, _ in net.plan.ops] == ["IJKToIndex", "WorldToVoxel"]  # folded away
    out = net.run({k: feeds[k] for k in ("ijk_jdata", "ijk_joffsets", "ijk_jidx", "ijk_jlidx", "ijkf")})
    np.testing.assert_array_equal(out["index"], lookup(gb, probes.jdata, probes.jidx.astype(np.int64)))
    # voxel sizes and origins given as inputs replace the grids' own
    vs = np.array([[0.1, 0.2, 0.3], [2.0, 2.0, 2.0]])
    og = np.array([[0.5, 0.5, 0.5], [-1.0, 0.0, 1.0]])
    m, feeds = _from_blob_model(gb.grid_blob, probes, extra=(vs, og))
    out = luisaml.compile(m, batch_axis=None).run({k: feeds[k] for k in ("ijk_jdata", "ijk_joffsets", "ijk_jidx",
                                                                           "ijk_jlidx", "ijkf")})
    b = probes.jidx
    want = feeds["ijkf"] * (1 / vs).astype(np.float32)[b] + (-og / vs).astype(np.float32)[b]
    assert_floats_equal(out["x"], want)


def test_grid_from_nanovdb_needs_constants():
    gb = GridBatch.from_ijk(_grids()[:1])
    probes = JaggedTensor.from_list([np.zeros((2, 3), np.int32)])
    m, _ = _from_blob_model(gb.grid_blob, probes, blob_input=True)
    with pytest.raises(luisaml.CompileError, match=r"node 'g' \(fvdb::GridFromNanoVDB\): grid_blob 'raw' must be a "
                                                   r"constant.*feed the seven GridBatch bundle tensors"):
        luisaml.compile(m, batch_axis=None)


@pytest.mark.parametrize("corrupt, message", [
    (lambda b: b.__setitem__(slice(0, 8), 0), r"bad magic"),
    (lambda b: b.__setitem__(slice(636, 640), np.frombuffer(np.uint32(1).tobytes(), np.uint8)), r"grid type is 1"),
    (lambda b: b.__setitem__(slice(672 + 24, 672 + 28), 255), r"RootData starts at byte \d+ of the grid"),  # root offset
])
def test_malformed_constant_blobs_are_compile_errors(corrupt, message):
    gb = GridBatch.from_ijk(_grids())
    blob = gb.grid_blob.copy()
    corrupt(blob)
    probes = JaggedTensor.from_list([np.zeros((2, 3), np.int32), np.zeros((1, 3), np.int32)])
    m, _ = _from_blob_model(blob, probes)
    with pytest.raises(luisaml.CompileError, match=rf"node 'g' \(fvdb::GridFromNanoVDB\): NanoVDB grid #0.*(?:{message})"):
        luisaml.compile(m, batch_axis=None)


def test_truncated_blob_is_a_compile_error():
    gb = GridBatch.from_ijk(_grids()[:1])
    m, _ = _from_blob_model(gb.grid_blob[:1000].copy(), JaggedTensor.from_list([np.zeros((1, 3), np.int32)]))
    with pytest.raises(luisaml.CompileError, match=r"truncated"):
        luisaml.compile(m, batch_axis=None)


def test_bundles_bound_at_run_time_are_checked_before_the_kernel_reads_them():
    vox = _grids()
    gb = GridBatch.from_ijk(vox)
    probes = JaggedTensor.from_list([v[:20] for v in vox])
    feeds = bundle_feeds(gb, ijk=probes)
    net = luisaml.compile(fvdb_model([fvdb_node("IJKToIndex", "index")], feeds), batch_axis=None)
    np.testing.assert_array_equal(net.run(feeds)["index"] >= 0, True)
    cases = {
        "grid_byte_offsets": (np.array([0, 96], np.int64), r"grid_byte_offsets\[1\] = 96 is not the start of a grid"),
        "batch_offsets": (gb.batch_offsets + 1, r"batch_offsets are \[1, .*but the grids' voxel counts give \[0, "),
        "leaf_batch_indices": (np.zeros_like(gb.leaf_batch_indices), r"leaf_batch_indices do not match"),
        "voxel_sizes": (-gb.voxel_sizes, r"voxel_sizes must be positive"),
        "origins": (np.full((2, 3), np.nan), r"origins must be finite"),
    }
    for name, (value, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            net.run({**feeds, name: value})
    blob = gb.grid_blob.copy()
    blob[672 + 32 : 672 + 36] = 255  # the leaf count in TreeData
    with pytest.raises(ValueError, match=r"NanoVDB grid #0 at byte 0"):
        net.run({**feeds, "grid_blob": blob})
    # the grids themselves may be any of the blob's grids, in any order (fVDB views keep byte offsets)
    swapped = {**feeds, **dict(zip(BUNDLE, GridBatch.from_ijk(vox[::-1]).bundle()))}
    swapped["grid_blob"] = gb.grid_blob
    swapped["grid_byte_offsets"] = gb.grid_byte_offsets[::-1].copy()
    swapped["voxel_sizes"], swapped["origins"] = gb.voxel_sizes[::-1].copy(), gb.origins[::-1].copy()
    swapped["ijk_jdata"] = np.concatenate([v[:20] for v in vox[::-1]])
    got = net.run(swapped)["index"]
    np.testing.assert_array_equal(got, np.concatenate([lookup(gb, v[:20], np.full(20, b)) - gb.batch_offsets[b]
                                                       for b, v in ((1, vox[1]), (0, vox[0]))]))


def test_operator_infer_rules_match_onnx_inference():
    """luisaml's own infer rules (used where onnx cannot type a node) agree with the registered schemas."""
    from onnx import TensorProto

    import luisaml.operators  # noqa: F401 (registers the operators)
    from luisaml import registry
    from luisaml.model import Node, Variable

    gb = GridBatch.from_ijk(_grids()[:1])
    probes = JaggedTensor.from_list([np.zeros((5, 3), np.int32)])
    pts = JaggedTensor.from_list([np.zeros((5, 3), np.float32)])
    feeds = bundle_feeds(gb, ijk=probes, points=pts, data=np.zeros((gb.total_voxels, 2, 2), np.float32),
                         values=np.zeros((5, 2, 2), np.float32))
    want = {"IJKToIndex": (TensorProto.INT64, (5,)), "CoordsInGrid": (TensorProto.BOOL, (5,)),
            "PointsInGrid": (TensorProto.BOOL, (5,)), "WorldToVoxel": (TensorProto.FLOAT, (5, 3)),
            "SampleTrilinear": (TensorProto.FLOAT, (5, 2, 2)), "SampleBezier": (TensorProto.FLOAT, (5, 2, 2)),
            "SplatTrilinear": (TensorProto.FLOAT, (gb.total_voxels, 2, 2)),
            "SplatBezier": (TensorProto.FLOAT, (gb.total_voxels, 2, 2))}
    for op, expected in want.items():
        node = fvdb_node(op, "y")
        names = list(node.input)
        inputs = []
        for k, name in enumerate(names):
            a = feeds[name]
            const = a if k == 5 else None  # batch_offsets known: a splat's row count
            inputs.append(Variable(name, None, a.shape, const, elem_type=ELEM[a.dtype]))
        n = Node("y", op, "fvdb", names, ["y"], {})
        cls = registry.resolve(op, "fvdb", 1)
        assert cls.infer(n, inputs) == [expected], op
        m = fvdb_model([node], feeds, constants=("batch_offsets",))
        out = m.graph.output[0].type.tensor_type
        assert (out.elem_type, tuple(d.dim_value for d in out.shape.dim)) == expected, op
