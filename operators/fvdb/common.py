"""What every `fvdb` operator shares: the bundle and JaggedTensor checks, the grid metadata the host
derives once when a grid is bound, and the loop over points that finds each point's grid.

Metadata (int32 [B, META_FIELDS]) holds what the shader needs per grid and cannot read cheaply or
exactly from the bundle: where the grid's root tiles are, how many there are, its voxel offset in
the batch, and fVDB's float32 world-to-voxel transform (s = 1/h, t = -origin/h, computed in
float64 and rounded once, as fVDB's VoxelCoordTransform does; the kernel only sees float32 h and
origin). Computing it validates the whole bundle against the blob, so a kernel never follows an
offset the host has not checked.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from enum import IntEnum
from typing import ClassVar, Iterator, Mapping

import numpy as np

from luisaml import dtypes
from luisaml import indexing as ix
from luisaml.fvdb import checked
from luisaml.fvdb import layout as L
from luisaml.fvdb.grid_batch import MAX_GRIDS_PER_BATCH
from luisaml.fvdb.jagged import offsets_from_counts
from luisaml.fvdb.layout import NanoVDBError
from luisaml.fvdb.nanovdb import NanoGrid, as_byte_buffer
from luisaml.fvdb.nanovdb_query import require_fvdb_index_grid
from luisaml.fvdb.nanovdb_read import read_grids
from luisaml.fvdb.op_mixins import BoundRows
from luisaml.model import shape_str
from luisaml.operator import CompileError, Derived, Operator
from luisaml.opsets import fvdb as schema
from luisaml.storage import Tensor

from .grid_count import COUNT_INPUTS, PLUS_ONE, grid_count, grid_metadata_counted

MAX_BLOB_BYTES = 2**31 - 1  # byte offsets are 32-bit ints inside kernels


class Meta(IntEnum):
    """Columns of the per-grid metadata table."""

    TILES = 0  # byte position of the grid's first root tile in grid_blob
    TILE_COUNT = 1
    VOXEL_OFFSET = 2  # batch_offsets[b]: the grid's first index in the batch
    VOXEL_COUNT = 3
    SCALE_X = 4  # float32 bits of 1/h
    SCALE_Y = 5
    SCALE_Z = 6
    TRANSLATE_X = 7  # float32 bits of -origin/h
    TRANSLATE_Y = 8
    TRANSLATE_Z = 9
    LEAVES = 10  # byte position of the grid's first leaf in grid_blob (its leaves follow, in index order)
    LEAF_COUNT = 11


META_FIELDS = len(Meta)


def fvdb_transform(voxel_sizes: np.ndarray, origins: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Return fVDB's float32 primal world-to-voxel (scale, translate) per grid: x_vox = x * s + t."""
    h = np.asarray(voxel_sizes, np.float64).reshape(-1, 3)
    o = np.asarray(origins, np.float64).reshape(-1, 3)
    return (1.0 / h).astype(np.float32), (-o / h).astype(np.float32)


def bundle_grids(grid_blob, grid_byte_offsets, voxel_sizes, origins, leaf_batch_indices, batch_offsets,
                 expect_voxels: int | None = None, check_count=None) -> list[NanoGrid]:
    """Return grid b of a GridBatch bundle for each b, after checking the bundle against its blob:
    every grid valid, offsets, voxel and leaf numbering consistent (and expect_voxels voxels in all);
    check_count(the blob's grid count) first, for a count bound at run time (grid_count.py)."""
    parts = (grid_blob, grid_byte_offsets, voxel_sizes, origins, leaf_batch_indices, batch_offsets)
    if np.asarray(grid_blob).nbytes > MAX_BLOB_BYTES:
        raise NanoVDBError(f"grid_blob has {np.asarray(grid_blob).nbytes} bytes; kernels address at most {MAX_BLOB_BYTES}")
    # a bundle luisaml built or checked, its arrays frozen since: the blob's walk skipped (fvdb/checked.py);
    # the checks below, over the bundle's small arrays, run every time
    seen = checked.known(parts)
    if seen is not None:
        chosen, count = seen
        if check_count is not None:
            check_count(count)
    else:
        blob = as_byte_buffer(np.asarray(grid_blob))
        grids = {g.offset: g for g in read_grids(blob)}
        count = len(grids)
        if check_count is not None:
            check_count(count)
        offsets = np.asarray(grid_byte_offsets).reshape(-1)
        chosen = []
        for b, off in enumerate(offsets.tolist()):
            if off not in grids:
                starts = sorted(grids)
                raise NanoVDBError(
                    f"grid_byte_offsets[{b}] = {off} is not the start of a grid in grid_blob (grids start at "
                    f"{starts[:8]}{' ...' if len(starts) > 8 else ''})"
                )
            require_fvdb_index_grid(grids[off], where=f"grid {b} (at byte {off})")
            chosen.append(grids[off])
    n = len(chosen)
    h = np.asarray(voxel_sizes, np.float64)
    o = np.asarray(origins, np.float64)
    for name, arr in (("voxel_sizes", h), ("origins", o)):
        if arr.shape != (n, 3):
            raise NanoVDBError(f"{name} has shape {list(arr.shape)}, expected [{n}, 3]")
        if not np.isfinite(arr).all():
            raise NanoVDBError(f"{name} must be finite, got {arr.tolist()}")
    if (h <= 0).any():
        raise NanoVDBError(f"voxel_sizes must be positive, got {h.tolist()}")
    counts = np.array([g.voxel_count for g in chosen], np.int64)
    want = offsets_from_counts(counts)
    got = np.asarray(batch_offsets).reshape(-1)
    if got.shape != want.shape or (got != want).any():
        raise NanoVDBError(f"batch_offsets are {got.tolist()}, but the grids' voxel counts give {want.tolist()}")
    leaves = np.repeat(np.arange(n, dtype=np.int32), [g.leaf_count for g in chosen])
    got_leaves = np.asarray(leaf_batch_indices).reshape(-1)
    if got_leaves.shape != leaves.shape or (got_leaves != leaves).any():
        raise NanoVDBError(
            f"leaf_batch_indices do not match the grids' leaves: expected {len(leaves)} entries "
            f"repeat(arange(B), leaf counts {[g.leaf_count for g in chosen]}), got {len(got_leaves)}"
        )
    if expect_voxels is not None and int(want[-1]) != int(expect_voxels):
        raise NanoVDBError(
            f"the grids have {int(want[-1])} active voxels in all, but the voxel data has {expect_voxels} rows"
        )
    if seen is None:
        checked.remember(parts, chosen, count)
    return chosen


def grid_metadata_for_data(grid_blob, grid_byte_offsets, voxel_sizes, origins, leaf_batch_indices, batch_offsets,
                           voxel_data) -> np.ndarray:
    """grid_metadata, the voxel data's rows checked against the grids' voxels (voxel data bound at run
    time: its size is known only then)."""
    return grid_metadata(grid_blob, grid_byte_offsets, voxel_sizes, origins, leaf_batch_indices, batch_offsets,
                         expect_voxels=int(np.shape(voxel_data)[0]))


def grid_metadata(grid_blob, grid_byte_offsets, voxel_sizes, origins, leaf_batch_indices, batch_offsets,
                  expect_voxels: int | None = None, check_count=None) -> np.ndarray:
    """Return the metadata table (int32 [B, META_FIELDS]) of a checked GridBatch bundle (bundle_grids)."""
    chosen = bundle_grids(grid_blob, grid_byte_offsets, voxel_sizes, origins, leaf_batch_indices, batch_offsets,
                          expect_voxels, check_count)
    n = len(chosen)
    counts = np.array([g.voxel_count for g in chosen], np.int64)
    want = offsets_from_counts(counts)
    h = np.asarray(voxel_sizes, np.float64)
    o = np.asarray(origins, np.float64)
    meta = np.zeros((n, META_FIELDS), np.int32)
    meta[:, Meta.TILES] = [g.root_offset + L.ROOT_DATA_SIZE for g in chosen]
    meta[:, Meta.TILE_COUNT] = [g.root_tile_count for g in chosen]
    meta[:, Meta.VOXEL_OFFSET] = want[:-1]
    meta[:, Meta.VOXEL_COUNT] = counts
    scale, translate = fvdb_transform(h, o)
    meta[:, Meta.SCALE_X : Meta.SCALE_Z + 1] = scale.view(np.int32)
    meta[:, Meta.TRANSLATE_X : Meta.TRANSLATE_Z + 1] = translate.view(np.int32)
    meta[:, Meta.LEAVES] = [g.leaf_offset for g in chosen]
    meta[:, Meta.LEAF_COUNT] = [g.leaf_count for g in chosen]
    return meta


@dataclass
class Jagged:
    """A JaggedTensor input as its four tensors."""

    name: str
    jdata: Tensor
    joffsets: Tensor
    jidx: Tensor
    jlidx: Tensor


class GridRef:
    """One point's grid inside the point loop: DSL names of what the shader reads, its transform
    loaded from the metadata on first use."""

    def __init__(self, ctx, blob: str, tiles: str, tile_count: str, field) -> None:
        self.ctx = ctx
        self.blob = blob  # the ByteBuffer holding grid_blob
        self.tiles = tiles  # byte position of the grid's first root tile in that ByteBuffer
        self.tile_count = tile_count
        self.voxel_offset = field(Meta.VOXEL_OFFSET)
        self._field = field
        self._transform: tuple[list[str], list[str]] | None = None

    def lookup(self, ijk: list[str]) -> str:
        """Return the DSL of NanoVDB getValue at ijk (1-based index of an active voxel, else 0)."""
        return f"nvdb_value({self.blob}, {self.tiles}, {self.tile_count}, {', '.join(ijk)})"

    def stencil_leaf(self, base: list[str], lo: int, hi: int) -> tuple[str, str]:
        """Emit the leaf holding `base` and whether every base + [lo, hi] per axis lies in that leaf
        (NanoVDB's ReadAccessor caches nodes the same way); return their names for cached_lookup."""
        ctx = self.ctx
        leaf = ctx.let(f"{ctx.use_helper('nvdb_leaf', 'nanovdb')}({self.blob}, {self.tiles}, {self.tile_count}, "
                       f"{', '.join(base)})", "leaf")
        bounds = " and ".join(f"({c} & 7) >= {-lo} and ({c} & 7) <= {7 - hi}" for c in base)
        return leaf, ctx.let(f"({bounds})", "in_leaf")

    def cached_lookup(self, stencil: tuple[str, str], ijk: list[str]) -> str:
        """Emit getValue at ijk, read from the stencil's leaf when the whole stencil lies in it (the
        same value a full traversal gives); return the name holding it."""
        ctx = self.ctx
        leaf, in_leaf = stencil
        v = ctx.fresh("v")
        ctx.line(f"{v} = 0")
        ctx.line(f"if {in_leaf}:")
        with ctx.indent():
            ctx.line(f"if {leaf} >= 0:")
            with ctx.indent():
                value = ctx.use_helper("nvdb_leaf_value", "nanovdb")
                ctx.line(f"{v} = {value}({self.blob}, {leaf}, {', '.join(ijk)})")
        ctx.line("else:")
        with ctx.indent():
            ctx.line(f"{v} = {self.lookup(ijk)}")
        return v

    def transform(self) -> tuple[list[str], list[str]]:
        """Return the names of fVDB's float32 (scale, translate) of this grid, loading them once."""
        if self._transform is None:
            f = self.ctx.use_helper("nvdb_float", "nanovdb")
            let = self.ctx.let
            self._transform = (
                [let(f"{f}({self._field(Meta.SCALE_X + a)})", "s") for a in range(3)],
                [let(f"{f}({self._field(Meta.TRANSLATE_X + a)})", "t") for a in range(3)],
            )
        return self._transform


class GridOp(BoundRows, Operator):
    """Base of the operators that read a GridBatch bundle and JaggedTensors (their OpSpec in `specs`)."""

    # the table of the family's OpSpecs (its inputs: the bundle, then each jagged input's four tensors)
    specs: ClassVar[Mapping[str, schema.OpSpec]] = schema.OPS

    # jagged inputs whose jdata is shared by every sample (voxel data), by position
    shared_jagged: ClassVar[tuple[int, ...]] = ()
    # the grid may be any size, bound at run time (grid_blob, leaf_batch_indices and list_indices with
    # rows bound at run time): the op reads the grid through the metadata derived when it is bound, and
    # nothing it computes depends on the bundle's sizes (per-point and per-ray ops)
    any_grid: ClassVar[bool] = False
    # ... and so may the shared voxel data (read by the row the grid gives, checked against the grid's
    # voxel count when it is bound)
    any_voxel_data: ClassVar[bool] = False
    # ... and so may the grid count (grid_byte_offsets, voxel_sizes, origins, batch_offsets and every
    # joffsets, checked against the blob's grids when bound: grid_count.py); the per-point and ray ops,
    # InjectToDense (the kernel maps have their own rule: kernel_map.py)
    any_count: ClassVar[bool] = False
    count_bound = False  # this node's grid count is bound at run time (set by check_bundle)

    @classmethod
    def reads_bound_rows(cls, op_type: str, k: int) -> bool:
        nb = len(schema.BUNDLE)
        if k < nb:
            return ((cls.any_grid and schema.BUNDLE[k] in ("grid_blob", "leaf_batch_indices", "list_indices"))
                    or (cls.any_count and schema.BUNDLE[k] in COUNT_INPUTS))
        j, part = divmod(k - nb, len(schema.JAGGED))
        if cls.any_count and schema.JAGGED[part] == "joffsets":
            return True
        return cls.any_voxel_data and j in cls.shared_jagged and schema.JAGGED[part] in ("jdata", "jidx")

    @classmethod
    def extra_rows(cls, op_type: str, k: int) -> int:
        if not cls.any_count:
            return 0
        nb = len(schema.BUNDLE)
        if k < nb:
            return int(schema.BUNDLE[k] in PLUS_ONE)
        return int(schema.JAGGED[(k - nb) % len(schema.JAGGED)] == "joffsets")

    def check(self) -> None:
        spec = self.specs[self.node.op_type]
        names = spec.input_names()
        self.expect(
            len(self.inputs) == len(names),
            f"takes {len(names)} inputs ({', '.join(names)}), got {len(self.inputs)}",
        )
        for k in range(len(names)):
            self.input(k)  # every input is required
        self.B = self.check_bundle()
        self.jagged = [
            Jagged(jname, *self.inputs[len(schema.BUNDLE) + 4 * j : len(schema.BUNDLE) + 4 * j + 4])
            for j, (jname, _) in enumerate(spec.jagged)
        ]
        for j, jt in enumerate(self.jagged):
            self.check_jagged(jt, shared=j in self.shared_jagged)
        self.check_inputs()

    def check_inputs(self) -> None:
        """Check the op's own jdata types and shapes (subclasses)."""

    # ---- checks -----------------------------------------------------------------------------
    def check_bundle(self, first: int = 0, prefix: str = "") -> int:
        """Check the types and static shapes of the bundle at inputs first.. (names `prefix`grid_blob,
        ...); return the grid count B."""
        t = {prefix + n: self.input(first + k) for k, n in enumerate(schema.BUNDLE)}
        for name, kind in (("grid_blob", "UINT8"), ("grid_byte_offsets", "INT64"), ("leaf_batch_indices", "INT32"),
                           ("batch_offsets", "INT64"), ("list_indices", "INT32")):
            self.expect_dtype(t[prefix + name], (kind,), prefix + name)
        for name in ("voxel_sizes", "origins"):
            self.expect_dtype(t[prefix + name], ("DOUBLE", "FLOAT"), prefix + name)
        for name, x in t.items():
            any_size = getattr(self, "any_grid", False)  # (GridOp's; other ops that read a bundle have none)
            how = ("compile with batch_axis=None to bind a grid of any size at run time, or give the bundle static "
                   "shapes" if any_size else "give the bundle static shapes (this op needs the grid's sizes when "
                   "compiled)")
            self.expect(not x.batched, f"{name} '{x.name}' {shape_str(x.shape)} follows the batch axis (its first "
                        "dimension is symbolic and was taken as the batch); the GridBatch bundle is shared by every "
                        f"sample: {how}")
        counted = [n for n in COUNT_INPUTS if getattr(t[prefix + n], "bound_rows", None) is not None]
        self.count_bound = bool(counted)
        fixed = [n for n in COUNT_INPUTS if n not in counted]
        if counted and fixed:
            a, b = t[prefix + counted[0]], t[prefix + fixed[0]]
            self.expect(False, f"{prefix}{counted[0]} '{a.name}' (first dimension '{a.bound_rows}') has a grid "
                        f"count bound at run time, but {prefix}{fixed[0]} '{b.name}' {shape_str(b.shape)} has a fixed "
                        f"one: give {', '.join(COUNT_INPUTS)} and every joffsets a dynamic first dimension (the grid "
                        "count), or none of them")
        blob = t[prefix + "grid_blob"]
        self.expect(blob.rank == 1, f"{prefix}grid_blob '{blob.name}' must be 1-D, got {shape_str(blob.shape)}")
        off = t[prefix + "grid_byte_offsets"]
        self.expect(off.rank == 1 and 1 <= off.shape[0] <= MAX_GRIDS_PER_BATCH,
                    f"{prefix}grid_byte_offsets '{off.name}' must be [B] with 1 <= B <= {MAX_GRIDS_PER_BATCH}, got "
                    f"{shape_str(off.shape)}")
        b = off.shape[0]
        self.expect_shape(t[prefix + "voxel_sizes"], (b, 3), prefix + "voxel_sizes")
        self.expect_shape(t[prefix + "origins"], (b, 3), prefix + "origins")
        self.expect_shape(t[prefix + "batch_offsets"], (b + 1,), prefix + "batch_offsets")
        leaves = t[prefix + "leaf_batch_indices"]
        self.expect(leaves.rank == 1, f"{prefix}leaf_batch_indices '{leaves.name}' must be 1-D, got "
                    f"{shape_str(leaves.shape)}")
        return b

    def check_jagged(self, jt: Jagged, shared: bool) -> None:
        """Check one JaggedTensor's four tensors: ldim 1, B tensors, jidx per element (or empty)."""
        d = jt.jdata
        self.expect(d.rank >= 1, f"{jt.name}_jdata '{d.name}' needs a leading element axis, got {shape_str(d.shape)}")
        self.expect_dtype(jt.joffsets, ("INT64",), f"{jt.name}_joffsets")
        bound = getattr(jt.joffsets, "bound_rows", None) is not None
        o = jt.joffsets
        self.expect(bound == self.count_bound, f"{jt.name}_joffsets '{o.name}' {shape_str(o.shape)} has a "
                    f"{'grid count bound at run time' if bound else 'fixed grid count'}, but the bundle's grid count is "
                    f"{'fixed' if bound else 'bound at run time'}: give grid_byte_offsets, voxel_sizes, origins, "
                    "batch_offsets and every joffsets a dynamic first dimension (the grid count), or none of them")
        self.expect_shape(jt.joffsets, (self.B + 1,), f"{jt.name}_joffsets (one tensor per grid)")
        self.expect_dtype(jt.jidx, ("INT32",), f"{jt.name}_jidx")
        self.expect_dtype(jt.jlidx, ("INT32",), f"{jt.name}_jlidx")
        self.expect(jt.jlidx.numel == 0, f"{jt.name}_jlidx '{jt.jlidx.name}' has shape {shape_str(jt.jlidx.shape)}: "
                    "list-of-lists JaggedTensors (ldim 2) are not supported, expected an empty [0, 1]")
        if shared:
            self.expect(not d.batched, f"{jt.name}_jdata '{d.name}' follows the batch axis; voxel data is shared "
                        "by every sample (give it a static first dimension)")
            return
        i = jt.jidx
        rows = d.shape[0]
        ok = (i.rank == 1 and i.shape[0] == rows and i.batched == d.batched) or (i.numel == 0 and not i.batched)
        self.expect(ok, f"{jt.name}_jidx '{i.name}' has shape {shape_str(i.shape)}, expected one grid id per "
                    f"element of {jt.name}_jdata {shape_str(d.shape)} (or [0] for a single grid)")
        self.expect(i.numel > 0 or not self.count_bound, f"{jt.name}_jidx '{i.name}' is empty, which means one "
                    "tensor, but the grid count is bound at run time: give a grid id per element")
        self.expect(i.numel > 0 or self.B == 1, f"{jt.name}_jidx '{i.name}' is empty, which means one tensor, but "
                    f"the batch has {self.B} grids")

    def expect_points(self, jt: Jagged, dtypes_: tuple[str, ...] = ("FLOAT",)) -> None:
        """Check that a jdata is [N, 3] of one of dtypes_."""
        d = jt.jdata
        self.expect_dtype(d, dtypes_, f"{jt.name}_jdata")
        self.expect(d.rank == 2 and d.shape[1] == 3,
                    f"{jt.name}_jdata '{d.name}' must have shape [N, 3], got {shape_str(d.shape)}")

    # ---- metadata ---------------------------------------------------------------------------
    def metadata_params(self) -> tuple:
        """Return grid_metadata's keyword arguments for this node (voxel data size checks)."""
        return ()

    def derived_inputs(self) -> list[Derived]:
        if self.count_bound:
            return self.counted_derived()
        return [Derived(grid_metadata, tuple(range(6)), dtypes.INT32, (self.B, META_FIELDS), self.metadata_params())]

    def counted_derived(self, data: int | None = None) -> list[Derived]:
        """Return [the metadata, the grid count] of a bundle whose grid count is bound at run time
        (grid_count.py): the count inputs and every joffsets checked against the blob's grids when
        bound; data: the input index of voxel data whose rows are bound at run time too."""
        nb = len(schema.BUNDLE)
        joffsets = tuple(nb + len(schema.JAGGED) * j + 1 for j in range(len(self.jagged)))
        named = (0,) + tuple(schema.BUNDLE.index(n) for n in COUNT_INPUTS) + joffsets
        params = (("inputs", tuple(self.input(k).name for k in named)),)
        params += (("voxel_data", True),) if data is not None else self.metadata_params()
        extra = (data,) if data is not None else ()
        return [Derived(grid_metadata_counted, tuple(range(6)) + joffsets + extra, dtypes.INT32, (self.B, META_FIELDS),
                        params, shape_only=extra, any_rows=True),
                Derived(grid_count, (1,), dtypes.INT32, (1,), shape_only=(1,))]

    # ---- code ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def point_loop(self, ctx, jt: Jagged, defaults) -> Iterator[tuple[str, GridRef]]:
        """Emit the loop over jt's elements; per element call defaults(n) (the outputs of a point
        without a grid), find its grid b = jidx[n] and yield (n, its GridRef) inside `if 0 <= b < B`."""
        meta = self.derived[0]
        ctx.use_helper("nvdb_value", "nanovdb")
        blob, base = self.input(0).storage.byte_address()
        with ctx.loop(jt.jdata.shape[0], "p") as n:
            defaults(n)
            if jt.jidx.numel == 0:
                b, guard = "0", None
            else:
                b = ctx.let(jt.jidx.load(n), "b")
                # a grid count bound at run time is read, never a literal (grid_count.py)
                count = self.derived[1].load("0") if self.count_bound else str(self.B)
                guard = f"{b} >= 0 and {b} < {count}"
            with _maybe_if(ctx, guard):
                m = ctx.let(ix.mul(b, META_FIELDS), "m")

                def field(f: Meta) -> str:
                    return meta.load(ix.add(m, str(int(f))))

                tiles = ctx.let(ix.add(base, field(Meta.TILES)) if base != "0" else field(Meta.TILES), "tiles")
                yield n, GridRef(ctx, blob, tiles, ctx.let(field(Meta.TILE_COUNT), "ntiles"), field)

    def world_to_voxel(self, ctx, jt: Jagged, n: str, g: GridRef) -> list[str]:
        """Emit fVDB's float32 primal transform of point n of jt: x * s + t per axis."""
        scale, translate = g.transform()
        return [ctx.let(f"{jt.jdata.load(ix.add(ix.mul(n, 3), str(a)))} * {scale[a]} + {translate[a]}", "x")
                for a in range(3)]


def voxel_of_index(ctx, meta, grids: int | str, blob: str, base: str, v: str) -> tuple[str, str, list[str]]:
    """Emit the lookup of batch-global voxel index v (v below the batch's voxels) in a bundle read
    through its metadata table meta: the grid holding it (the last whose first index is <= v), the
    leaf whose index range holds it (a binary search of the leaves' first indices: nvdb_find_leaf),
    the bit of its rank in that leaf's mask (nvdb_leaf_slot). Return (grid b, its metadata row's
    first word m, [i, j, k]); blob, base: the grid blob's ByteBuffer and its byte offset; grids: the
    grid count, a number or the name holding it (a count bound at run time: grid_count.py)."""
    F = META_FIELDS
    b = ctx.fresh("b")
    ctx.line(f"{b} = 0")
    if not isinstance(grids, int) or grids > 1:  # (a name: the grid count, bound at run time)
        k = ctx.fresh("k")
        ctx.line(f"for {k} in range(1, {grids}):")
        with ctx.indent():
            ctx.line(f"if {meta.load(ix.add(ix.mul(k, F), str(int(Meta.VOXEL_OFFSET))))} <= {v}:")
            with ctx.indent():
                ctx.line(f"{b} = {k}")
    m = ctx.let(ix.mul(b, F), "m")

    def field(f: Meta) -> str:
        return meta.load(ix.add(m, str(int(f))))

    value = ctx.let(f"{v} - {field(Meta.VOXEL_OFFSET)} + 1", "value")  # its OnIndex value in grid b
    first = field(Meta.LEAVES) if base == "0" else ix.add(base, field(Meta.LEAVES))
    find = ctx.use_helper("nvdb_find_leaf", "nanovdb")
    leaf = ctx.let(f"{find}({blob}, {first}, {field(Meta.LEAF_COUNT)}, {value})", "leaf")
    slot = ctx.let(f"{ctx.use_helper('nvdb_leaf_slot', 'nanovdb')}({blob}, {leaf}, {value})", "slot")
    corner = ctx.use_helper("nvdb_leaf_origin", "nanovdb")
    c = [ctx.let(f"{corner}({blob}, {leaf}, {a}) + {s}", "c")
         for a, s in enumerate((f"({slot} >> 6)", f"(({slot} >> 3) & 7)", f"({slot} & 7)"))]
    return b, m, c


@contextlib.contextmanager
def _maybe_if(ctx, cond: str | None) -> Iterator[None]:
    if cond is None:
        yield
        return
    ctx.line(f"if {cond}:")
    with ctx.indent():
        yield


def rule_types(node, inputs, rule) -> list:
    """Return Operator.infer's [(elem_type, shape)] of the node's outputs by a schema's shape rule:
    rule([(elem_type, dims) or None an input]) -> [(elem_type, dims or None) an output]; its ValueError
    a CompileError naming the node."""
    ins = [None if v is None or v.shape is None else (v.elem_type, list(v.shape)) for v in inputs]
    try:
        outs = rule(ins)
    except ValueError as e:
        raise CompileError(f"{node.describe()}: {e}") from None
    return [(elem, None if dims is None else tuple(dims)) for elem, dims in outs]


def infer_rule(node, inputs) -> list:
    """Return Operator.infer's [(elem_type, shape)] from opsets.fvdb.output_rule (a splat's row count
    from a constant batch_offsets when the node has no total_voxels attribute)."""
    attrs = dict(node.attrs)
    offsets = inputs[5] if len(inputs) > 5 else None
    if "total_voxels" not in attrs and offsets is not None and offsets.value is not None and offsets.value.size:
        attrs["total_voxels"] = int(np.asarray(offsets.value).reshape(-1)[-1])
    return rule_types(node, inputs, lambda ins: schema.output_rule(node.op_type, ins, attrs)[:1])
