"""shaders/nanovdb.py, the DSL traversal, run in small kernels: lookups equal warp-lang's
volume_lookup_index on grids warp builds (the outside reference) and the host reader on luisaml's own
multi-grid blobs; the rounding and Bezier helpers equal fVDB's double-promoted arithmetic."""
import luisa
import numpy as np
from luisa.types import uint  # noqa: F401

from luisaml.fvdb import GridBatch, ijk_to_index
from luisaml.fvdb import layout as L
from luisaml.luisa_compat import byte_buffer
from luisaml.shaders import nanovdb as nv
from luisaml.shaders.nanovdb import bezier_weight, nvdb_round, nvdb_value

from fvdb_reference import bezier, nanovdb_round
from conftest import assert_floats_equal


@luisa.func
def lookup_kernel(blob, tiles: int, count: int, ijk, out):
    t = int(dispatch_id().x)
    out.write(t, nvdb_value(blob, tiles, count, ijk.read(3 * t), ijk.read(3 * t + 1), ijk.read(3 * t + 2)) - 1)


@luisa.func
def scalar_kernel(x, rounded, weights):
    t = int(dispatch_id().x)
    rounded.write(t, nvdb_round(x.read(t)))
    weights.write(t, bezier_weight(x.read(t)))


def shader_lookup(blob: np.ndarray, grid, ijk: np.ndarray) -> np.ndarray:
    """Return nvdb_value - 1 (fVDB's index) of each ijk, looked up by the DSL in the blob's grid."""
    ijk = np.ascontiguousarray(ijk, np.int32)
    out = luisa.Buffer(len(ijk), int)
    tiles = grid.root_offset + L.ROOT_DATA_SIZE
    lookup_kernel(byte_buffer(blob), tiles, grid.root_tile_count, luisa.Buffer.from_array(ijk.reshape(-1)), out,
                  dispatch_size=len(ijk))
    return out.numpy()


def test_layout_constants_match_the_host_layout():
    for name in ("ROOT_DATA_SIZE", "ROOT_TILE_SIZE", "LEAF_NODE_SIZE", "UPPER_OFF_CHILD_MASK", "UPPER_OFF_TABLE", "LOWER_OFF_CHILD_MASK",
                 "LOWER_OFF_TABLE", "LEAF_OFF_VALUE_MASK", "LEAF_OFF_OFFSET", "LEAF_OFF_PREFIX_SUM"):
        assert getattr(nv, name) == getattr(L, name), name


def test_lookups_equal_warp_on_warp_built_grids(warp_ref, random_voxels, probes_around):
    rng = np.random.default_rng(31)
    ijk = random_voxels(rng, n_near=1500, n_far=150)
    vol = warp_ref.volume_from_ijk(ijk, voxel_size=0.5, translation=(1, 2, 3))
    blob = np.frombuffer(warp_ref.volume_bytes(vol), np.uint8)
    grid = GridBatch.from_buffer(blob).grids[0]  # warp's bytes, validated
    probes = probes_around(ijk, rng, n_random=2000)
    got = shader_lookup(blob, grid, probes)
    np.testing.assert_array_equal(got, warp_ref.lookup_index(vol, probes))
    assert (got >= 0).sum() == len(np.unique(ijk, axis=0))


def test_lookups_equal_the_host_reader_in_every_grid_of_a_blob():
    rng = np.random.default_rng(32)
    sets = [rng.integers(-300, 300, (800, 3)), rng.integers(-5, 5, (100, 3)),
            np.array([[-(2**31), 2**31 - 1, 0], [4095, 4096, -4097]])]
    gb = GridBatch.from_ijk([s.astype(np.int32) for s in sets])
    for g, s in zip(gb.grids, sets):
        probes = np.concatenate([s, s - 1, rng.integers(-400, 400, (500, 3))]).astype(np.int32)
        assert g.offset > 0 or g is gb.grids[0]
        np.testing.assert_array_equal(shader_lookup(gb.grid_blob, g, probes), ijk_to_index(g, probes))


def test_round_and_bezier_weight_follow_fvdb_promotions():
    below_half = np.nextafter(np.float32(0.5), np.float32(0))
    edge = np.array([0.5, -0.5, 1.5, -1.5, 2.5, below_half, -below_half, 1 - 2**-24, -1e-10, 1e-10, 0.0, -0.0,
                     8388607.5, -8388607.5, 0.49999997, -0.50000006, 1.4999999, -1.4999999, 0.5000001], np.float32)
    x = np.concatenate([edge, np.random.default_rng(3).uniform(-2, 2, 2000).astype(np.float32)])
    rounded, weights = luisa.Buffer(len(x), int), luisa.Buffer(len(x), float)
    scalar_kernel(luisa.Buffer.from_array(x), rounded, weights, dispatch_size=len(x))
    np.testing.assert_array_equal(rounded.numpy(), nanovdb_round(x))
    assert_floats_equal(weights.numpy(), bezier(x))
