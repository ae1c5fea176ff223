"""GridBatch: a batch of fVDB OnIndex grids in one byte blob, plus what a shader needs to read it.

A GridBatch mirrors fVDB's ``GridBatchData``: the grids lie back to back in one buffer (``mCumBytes``
gives each grid's byte offset), each grid has a voxel size and an origin (fVDB's primal transform
``x_vox = (x_world - origin) / voxel_size``; origin is the world centre of voxel (0,0,0)), and three
batch tensors index voxels and leaves across grids.

:meth:`GridBatch.bundle` returns the seven arrays in the order the shader side binds them:

==================  =============  ===============================================================
grid_blob           uint8 [N]      all grids back to back (blind data stripped, like fVDB's load)
grid_byte_offsets   int64 [B]      byte position of grid b's GridData in grid_blob (mCumBytes)
voxel_sizes         float64 [B,3]  world size of a voxel of grid b
origins             float64 [B,3]  world centre of voxel (0,0,0) of grid b
leaf_batch_indices  int32 [L]      grid id of each leaf, leaves of all grids in order (mLeafBatchIndices)
batch_offsets       int64 [B+1]    [0, n0, n0+n1, ...]: cumulative active voxels (mBatchOffsets); the
                                   joffsets of the batch's features
list_indices        int32 [M]      fVDB's mListIndices, the jlidx of the batch read as a list of
                                   lists, flattened row-major ([B, ldim] -> [B*ldim]). Empty (M = 0)
                                   for a flat batch, which is the only kind fVDB and luisaml build.
==================  =============  ===============================================================

:meth:`GridBatch.metadata` returns per-grid values derived once on the host; see
:class:`GridBatchMetadata` for the column layout.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import NamedTuple

import numpy as np

from . import layout as L
from .builder import as_vec3, as_voxel_size, build_grid, concat_grids, dense_ijk, points_to_ijk
from .jagged import JaggedTensor, offsets_from_counts
from .layout import NanoVDBError
from .nanovdb import NanoGrid, as_byte_buffer
from .nanovdb_query import active_voxels, ijk_to_index, require_fvdb_index_grid
from .nanovdb_read import read_built_grids, read_grids
from .nvdb_io import PathOrBytes, read_nvdb_buffer, write_nvdb

MAX_GRIDS_PER_BATCH = 1024  # fVDB's GridBatchData::MAX_GRIDS_PER_BATCH


class GridBatchBundle(NamedTuple):
    """The seven arrays a shader receives for a GridBatch, in this order."""

    grid_blob: np.ndarray
    grid_byte_offsets: np.ndarray
    voxel_sizes: np.ndarray
    origins: np.ndarray
    leaf_batch_indices: np.ndarray
    batch_offsets: np.ndarray
    list_indices: np.ndarray


class MetaI(IntEnum):
    """Columns of GridBatchMetadata.ints (int64 [B, len(MetaI)]); byte positions are into grid_blob."""

    GRID_OFFSET = 0  # GridData (= grid_byte_offsets[b])
    GRID_SIZE = 1  # mGridSize in bytes
    TREE_OFFSET = 2  # TreeData
    ROOT_OFFSET = 3  # RootData
    TILES_OFFSET = 4  # first root tile (ROOT_OFFSET + 96); tiles are 32 B apart
    UPPER_OFFSET = 5  # first upper node (0 when UPPER_COUNT == 0); nodes are 270400 B apart
    LOWER_OFFSET = 6  # first lower node (0 when none); 33856 B apart
    LEAF_OFFSET = 7  # first leaf (0 when none); 96 B apart
    ROOT_TILE_COUNT = 8  # RootData::mTableSize
    UPPER_COUNT = 9
    LOWER_COUNT = 10
    LEAF_COUNT = 11
    VOXEL_COUNT = 12  # active voxels (= batch_offsets[b+1] - batch_offsets[b])
    CUM_VOXELS = 13  # active voxels of grids 0..b-1 (fVDB mCumVoxels = batch_offsets[b])
    CUM_LEAVES = 14  # leaves of grids 0..b-1 (fVDB mCumLeaves): global id of the grid's first leaf
    BBOX_MIN_I = 15  # index-space bbox of the active voxels (root bbox, inclusive)
    BBOX_MIN_J = 16
    BBOX_MIN_K = 17
    BBOX_MAX_I = 18
    BBOX_MAX_J = 19
    BBOX_MAX_K = 20
    VALUE_COUNT = 21  # mData1 = VOXEL_COUNT + 1 (index 0 is the background)


class MetaF(IntEnum):
    """Columns of GridBatchMetadata.floats (float64 [B, len(MetaF)])."""

    VOXEL_SIZE_X = 0
    VOXEL_SIZE_Y = 1
    VOXEL_SIZE_Z = 2
    ORIGIN_X = 3  # world centre of voxel (0,0,0)
    ORIGIN_Y = 4
    ORIGIN_Z = 5
    # World->voxel as fVDB stores it (primal): x_vox = x_world * SCALE + TRANSLATE. The dual
    # transform (voxel ijk spans [ijk, ijk+1)) adds 0.5 to TRANSLATE.
    W2V_SCALE_X = 6  # 1 / voxel size
    W2V_SCALE_Y = 7
    W2V_SCALE_Z = 8
    W2V_TRANSLATE_X = 9  # -origin / voxel size
    W2V_TRANSLATE_Y = 10
    W2V_TRANSLATE_Z = 11


@dataclass(frozen=True, eq=False)
class GridBatchMetadata:
    """Per-grid metadata derived once on the host.

    ``ints`` is int64 [B, len(MetaI)] and ``floats`` float64 [B, len(MetaF)]; the column enums name the columns.
    """

    ints: np.ndarray
    floats: np.ndarray
    total_voxels: int
    total_leaves: int
    max_voxels: int  # most active voxels in one grid (fVDB mMaxVoxels)
    max_leaves: int  # most leaves in one grid (fVDB mMaxLeafCount)
    total_bbox: np.ndarray  # int32 (2, 3): bbox enclosing every non-empty grid's bbox


def _per_grid_vec3(value: float | Iterable, count: int, what: str, positive: bool) -> np.ndarray:
    """Return value broadcast to float64 [count, 3] (a scalar, one 3-vector, [count] scalars or [count, 3]).

    A length-3 vector is always one 3-vector, even for a batch of three grids.
    """
    arr = np.asarray(value, np.float64)
    if arr.ndim == 2:
        if arr.shape != (count, 3):
            raise ValueError(f"{what} must be a scalar, a 3-vector or [{count}, 3], got shape {arr.shape}")
        rows = [as_voxel_size(r) if positive else as_vec3(r, what) for r in arr]
        return np.stack(rows) if rows else np.zeros((0, 3))
    if arr.ndim == 1 and arr.shape[0] == count and count != 3:
        arr = arr[:, None].repeat(3, axis=1)  # one scalar per grid
        return np.stack([as_voxel_size(r) if positive else as_vec3(r, what) for r in arr])
    one = as_voxel_size(arr) if positive else as_vec3(arr, what)
    return np.tile(one, (count, 1))


def _as_list(items: np.ndarray | Sequence | JaggedTensor, what: str) -> list[np.ndarray]:
    """Return one array per grid from a single [N,3] array, a list of arrays or a JaggedTensor."""
    if isinstance(items, JaggedTensor):
        if items.ldim != 1:
            raise ValueError(f"{what} must be a flat JaggedTensor (ldim 1), got ldim {items.ldim}")
        return list(items.unbind())
    if isinstance(items, np.ndarray):
        return [items]
    return [np.asarray(x) for x in items]


@dataclass(frozen=True, eq=False)
class GridBatch:
    """A batch of validated fVDB OnIndex grids in one read-only byte blob, with their transforms."""

    grid_blob: np.ndarray = field(repr=False)
    grids: tuple[NanoGrid, ...] = field(repr=False)
    voxel_sizes: np.ndarray
    origins: np.ndarray

    # -- construction ----------------------------------------------------------------------------

    @classmethod
    def from_buffer(cls, data: bytes | np.ndarray) -> GridBatch:
        """Return a GridBatch of every grid of a raw buffer, voxel sizes and origins taken from each grid."""
        raw = read_grids(as_byte_buffer(data))
        if len(raw) > MAX_GRIDS_PER_BATCH:
            raise NanoVDBError(f"a GridBatch holds at most {MAX_GRIDS_PER_BATCH} grids, got {len(raw)}")
        # A blob of our own: blind data stripped (fVDB drops it on load), grids renumbered 0..B-1.
        blob = as_byte_buffer(concat_grids(raw, strip_blind_data=True))
        grids = tuple(read_grids(blob))
        for b, g in enumerate(grids):
            require_fvdb_index_grid(g, where=f"grid {b}")
        # fVDB's load: voxel size = mVoxelSize, origin = map applied to (0,0,0).
        vs = np.stack([g.voxel_size for g in grids])
        og = np.stack([g.origin for g in grids])
        if (vs <= 0).any() or not np.isfinite(vs).all():
            raise NanoVDBError(f"voxel sizes must be positive and finite, got {vs.tolist()}")
        if not np.isfinite(og).all():
            raise NanoVDBError(f"origins must be finite, got {og.tolist()}")
        vs.flags.writeable = False
        og.flags.writeable = False
        return cls(blob, grids, vs, og)

    @classmethod
    def from_nanovdb(cls, source: PathOrBytes) -> GridBatch:
        """Return a GridBatch of every grid in a .nvdb file (none/zip codec), raw file or in-memory buffer.

        Voxel sizes come from each grid's mVoxelSize and origins from its map applied to (0,0,0),
        as fVDB's load_nanovdb does.
        """
        return cls.from_buffer(read_nvdb_buffer(source))

    @classmethod
    def from_grids(cls, grids: Sequence[bytes | np.ndarray | NanoGrid]) -> GridBatch:
        """Return a GridBatch of the given grids (bytes, buffers or parsed grids), transforms from their maps."""
        return cls.from_buffer(concat_grids(grids))

    @classmethod
    def from_ijk(
        cls,
        ijk: np.ndarray | Sequence[np.ndarray] | JaggedTensor,
        voxel_sizes: float | Iterable = 1.0,
        origins: float | Iterable = 0.0,
    ) -> GridBatch:
        """Return a GridBatch with one grid per ijk array (int [N,3]; duplicates merged), like fVDB's from_ijk."""
        items = _as_list(ijk, "ijk")
        vs = _per_grid_vec3(voxel_sizes, len(items), "voxel_sizes", True)
        og = _per_grid_vec3(origins, len(items), "origins", False)
        return cls._from_built([build_grid(x, vs[b], og[b]) for b, x in enumerate(items)])

    @classmethod
    def _from_built(cls, grids: Sequence[bytes]) -> GridBatch:
        """Return the GridBatch of grids that builder.build_grid just wrote: from_grids' bytes (one blob,
        grids renumbered 0..B-1; build_grid writes no blind data, so none is stripped), but the blob read
        from its headers (nanovdb_read.read_built_grids) instead of three tree walks and four copies
        (concat_grids' read, from_buffer's read, its concatenation's, and the result's): the builder
        writes leaf voxels only, indexed 1..N. ~60% of a host-built grid step on the detector's quick
        frames (benchmarks/NOTES.md, "The host's work a detector frame, measured")."""
        if len(grids) > MAX_GRIDS_PER_BATCH:
            raise NanoVDBError(f"a GridBatch holds at most {MAX_GRIDS_PER_BATCH} grids, got {len(grids)}")
        if not grids:
            raise NanoVDBError("cannot concatenate zero grids")
        blob = np.frombuffer(b"".join(grids), np.uint8).copy()
        pos = 0
        for index, g in enumerate(grids):  # (concat_grids' renumbering, as NanoVDB's mergeGrids)
            blob[pos + L.GRID_OFF_GRID_INDEX:pos + L.GRID_OFF_GRID_INDEX + 8] = np.frombuffer(
                struct.pack("<II", index, len(grids)), np.uint8)
            pos += len(g)
        blob.flags.writeable = False
        built = tuple(read_built_grids(blob))
        for b, g in enumerate(built):
            require_fvdb_index_grid(g, where=f"grid {b}")
        vs = np.stack([g.voxel_size for g in built])
        og = np.stack([g.origin for g in built])
        if (vs <= 0).any() or not np.isfinite(vs).all() or not np.isfinite(og).all():  # (from_buffer's checks)
            raise NanoVDBError(f"voxel sizes must be positive and finite and origins finite, got {vs.tolist()}, "
                               f"{og.tolist()}")
        vs.flags.writeable = False
        og.flags.writeable = False
        return cls(blob, built, vs, og)

    @classmethod
    def from_points(
        cls,
        points: np.ndarray | Sequence[np.ndarray] | JaggedTensor,
        voxel_sizes: float | Iterable = 1.0,
        origins: float | Iterable = 0.0,
    ) -> GridBatch:
        """Return a GridBatch with one grid per point array (float [N,3]) of the voxels holding the points.

        This is fVDB's from_points: voxel = round((p - origin) / voxel_size).
        """
        items = _as_list(points, "points")
        vs = _per_grid_vec3(voxel_sizes, len(items), "voxel_sizes", True)
        og = _per_grid_vec3(origins, len(items), "origins", False)
        ijk = [points_to_ijk(p, vs[b], og[b]) for b, p in enumerate(items)]
        return cls._from_built([build_grid(x, vs[b], og[b]) for b, x in enumerate(ijk)])

    @classmethod
    def from_dense(
        cls,
        num_grids: int,
        dense_dims: Iterable[int],
        ijk_min: Iterable[int] = (0, 0, 0),
        voxel_sizes: float | Iterable = 1.0,
        origins: float | Iterable = 0.0,
        mask: np.ndarray | None = None,
    ) -> GridBatch:
        """Return num_grids grids of the box ijk_min + [0, dense_dims), optionally masked (fVDB's from_dense)."""
        if num_grids < 1:
            raise ValueError(f"num_grids must be >= 1, got {num_grids}")
        ijk = dense_ijk(dense_dims, ijk_min, mask)
        return cls.from_ijk([ijk] * num_grids, voxel_sizes, origins)

    # -- sizes -----------------------------------------------------------------------------------

    @property
    def grid_count(self) -> int:
        """Return B, the number of grids."""
        return len(self.grids)

    def __len__(self) -> int:
        return len(self.grids)

    @property
    def num_voxels(self) -> np.ndarray:
        """Return the active voxel count of each grid (int64 [B])."""
        return np.array([g.voxel_count for g in self.grids], np.int64)

    @property
    def num_leaves(self) -> np.ndarray:
        """Return the leaf count of each grid (int64 [B])."""
        return np.array([g.leaf_count for g in self.grids], np.int64)

    @property
    def total_voxels(self) -> int:
        """Return the active voxel count of the whole batch."""
        return int(self.num_voxels.sum())

    @property
    def total_leaves(self) -> int:
        """Return the leaf count of the whole batch."""
        return int(self.num_leaves.sum())

    # -- the bundle ------------------------------------------------------------------------------

    @property
    def grid_byte_offsets(self) -> np.ndarray:
        """Return the byte position of each grid in grid_blob (int64 [B])."""
        return np.array([g.offset for g in self.grids], np.int64)

    @property
    def batch_offsets(self) -> np.ndarray:
        """Return int64 [B+1] cumulative active voxel counts [0, n0, n0+n1, ...]."""
        return offsets_from_counts(self.num_voxels)

    @property
    def leaf_batch_indices(self) -> np.ndarray:
        """Return the grid id of every leaf of the batch (int32 [total_leaves])."""
        return np.repeat(np.arange(self.grid_count, dtype=np.int32), self.num_leaves)

    @property
    def list_indices(self) -> np.ndarray:
        """Return fVDB's list indices flattened (int32 [0]: a flat batch has none)."""
        return np.zeros(0, np.int32)

    def bundle(self) -> GridBatchBundle:
        """Return the seven arrays a shader binds, in the order of GridBatchBundle (see the module docstring)."""
        return GridBatchBundle(
            self.grid_blob,
            self.grid_byte_offsets,
            self.voxel_sizes,
            self.origins,
            self.leaf_batch_indices,
            self.batch_offsets,
            self.list_indices,
        )

    def metadata(self) -> GridBatchMetadata:
        """Return the per-grid metadata arrays (layout: MetaI / MetaF columns)."""
        ints = np.zeros((self.grid_count, len(MetaI)), np.int64)
        cum_voxels = self.batch_offsets
        cum_leaves = offsets_from_counts(self.num_leaves)
        for b, g in enumerate(self.grids):
            row = ints[b]
            row[MetaI.GRID_OFFSET] = g.offset
            row[MetaI.GRID_SIZE] = g.grid_size
            row[MetaI.TREE_OFFSET] = g.tree_offset
            row[MetaI.ROOT_OFFSET] = g.root_offset
            row[MetaI.TILES_OFFSET] = g.root_offset + L.ROOT_DATA_SIZE
            row[MetaI.UPPER_OFFSET] = g.upper_offset
            row[MetaI.LOWER_OFFSET] = g.lower_offset
            row[MetaI.LEAF_OFFSET] = g.leaf_offset
            row[MetaI.ROOT_TILE_COUNT] = g.root_tile_count
            row[MetaI.UPPER_COUNT] = g.upper_count
            row[MetaI.LOWER_COUNT] = g.lower_count
            row[MetaI.LEAF_COUNT] = g.leaf_count
            row[MetaI.VOXEL_COUNT] = g.voxel_count
            row[MetaI.CUM_VOXELS] = cum_voxels[b]
            row[MetaI.CUM_LEAVES] = cum_leaves[b]
            row[MetaI.BBOX_MIN_I : MetaI.BBOX_MAX_K + 1] = g.root_bbox.reshape(-1)
            row[MetaI.VALUE_COUNT] = g.value_count
        floats = np.zeros((self.grid_count, len(MetaF)), np.float64)
        floats[:, MetaF.VOXEL_SIZE_X : MetaF.VOXEL_SIZE_Z + 1] = self.voxel_sizes
        floats[:, MetaF.ORIGIN_X : MetaF.ORIGIN_Z + 1] = self.origins
        floats[:, MetaF.W2V_SCALE_X : MetaF.W2V_SCALE_Z + 1] = 1.0 / self.voxel_sizes
        floats[:, MetaF.W2V_TRANSLATE_X : MetaF.W2V_TRANSLATE_Z + 1] = -self.origins / self.voxel_sizes
        nonempty = [g.root_bbox for g in self.grids if g.voxel_count]
        if nonempty:
            boxes = np.stack(nonempty)
            total_bbox = np.stack([boxes[:, 0].min(axis=0), boxes[:, 1].max(axis=0)]).astype(np.int32)
        else:
            total_bbox = np.array([[2**31 - 1] * 3, [-(2**31)] * 3], np.int32)
        return GridBatchMetadata(
            ints=ints,
            floats=floats,
            total_voxels=self.total_voxels,
            total_leaves=self.total_leaves,
            max_voxels=int(self.num_voxels.max(initial=0)),
            max_leaves=int(self.num_leaves.max(initial=0)),
            total_bbox=total_bbox,
        )

    # -- queries ---------------------------------------------------------------------------------

    def grid(self, b: int) -> NanoGrid:
        """Return the parsed grid b."""
        return self.grids[b]

    @property
    def ijk(self) -> JaggedTensor:
        """Return the active voxels of every grid (int32, rows in each grid's index order)."""
        return JaggedTensor.from_data_and_offsets(
            np.concatenate([active_voxels(g) for g in self.grids]), self.batch_offsets
        )

    def ijk_to_index(
        self, ijk: np.ndarray | Sequence[np.ndarray] | JaggedTensor, cumulative: bool = False
    ) -> JaggedTensor:
        """Return fVDB's ijk_to_index per grid (int64; -1 inactive; plus batch_offsets[b] when cumulative)."""
        items = _as_list(ijk, "ijk")
        if len(items) != self.grid_count:
            raise ValueError(f"ijk holds {len(items)} lists, the batch has {self.grid_count} grids")
        offsets = self.batch_offsets
        out = []
        for b, (g, x) in enumerate(zip(self.grids, items)):
            idx = ijk_to_index(g, x)
            if cumulative:
                idx = np.where(idx >= 0, idx + offsets[b], idx)
            out.append(idx)
        return JaggedTensor.from_list(out)

    def voxel_to_world(self, ijk: np.ndarray, b: int = 0) -> np.ndarray:
        """Return world positions (float64 [N,3]) of voxel coordinates of grid b: ijk * h + origin."""
        return np.asarray(ijk, np.float64) * self.voxel_sizes[b] + self.origins[b]

    def world_to_voxel(self, xyz: np.ndarray, b: int = 0) -> np.ndarray:
        """Return voxel-space positions (float64 [N,3]) of world points for grid b: (xyz - origin) / h."""
        return (np.asarray(xyz, np.float64) - self.origins[b]) / self.voxel_sizes[b]

    # -- output ----------------------------------------------------------------------------------

    def to_nanovdb(self) -> bytes:
        """Return the batch as a raw NanoVDB buffer (the grid blob's bytes)."""
        return self.grid_blob.tobytes()

    def save(self, path: str | os.PathLike, codec: str = "none") -> Path:
        """Write the batch to path as a .nvdb file (codec "none" or "zip"); return the path."""
        return write_nvdb(path, list(self.grids), codec)
