"""What every family of the fVDB torch functions (torch_ops.py) shares: a grid bundle and a
JaggedTensor as torch tensors, the grids behind a bundle parsed and validated once (a dense ijk ->
index table where it fits), the argument checks, the tracer paused around a host computation, and
the typed fvdb.* node a function exports to."""
from __future__ import annotations

import functools
import hashlib
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from ..opsets import fvdb as schema
from .grid_batch import GridBatch
from .jagged import JaggedTensor
from .nanovdb import NanoGrid
from .nanovdb_query import active_voxels
from .nanovdb_query import ijk_to_index as _host_ijk_to_index


def bundle_tensors(grid: GridBatch) -> tuple[torch.Tensor, ...]:
    """Return the seven GridBatch bundle arrays as torch tensors (grid_blob, grid_byte_offsets, ...)."""
    return tuple(torch.from_numpy(np.array(a)) for a in grid.bundle())


def jagged_tensors(x: JaggedTensor | torch.Tensor | np.ndarray | Sequence) -> tuple[torch.Tensor, ...]:
    """Return (jdata, joffsets, jidx, jlidx) as torch tensors for a JaggedTensor, one tensor (a single-element
    list: empty jidx, as fVDB leaves it) or a list of tensors (one per grid)."""
    if isinstance(x, (torch.Tensor, np.ndarray)):
        data = torch.as_tensor(x)
        n = data.shape[0]
        return (data, torch.tensor([0, n], dtype=torch.int64), torch.zeros(0, dtype=torch.int32),
                torch.zeros((0, 1), dtype=torch.int32))
    if not isinstance(x, JaggedTensor):
        parts = [torch.as_tensor(t) for t in x]
        counts = torch.tensor([0] + [len(t) for t in parts], dtype=torch.int64)
        offsets = torch.cumsum(counts, 0)
        jidx = (torch.repeat_interleave(torch.arange(len(parts), dtype=torch.int32), counts[1:])
                if len(parts) > 1 else torch.zeros(0, dtype=torch.int32))
        return torch.cat(parts), offsets, jidx, torch.zeros((0, 1), dtype=torch.int32)
    return tuple(torch.from_numpy(np.array(a)) for a in x.bundle())


# ---- the grids behind a bundle, parsed once -------------------------------------------------------


# A grid whose active bounding box has at most this many cells is looked up through a dense table
# built once from its validated tree (one gather per query instead of a tree walk).
DENSE_TABLE_CELLS = 1 << 24


class _Index:
    """ijk -> index (-1 inactive) of one grid: a dense table over its bounding box, or the tree walk."""

    def __init__(self, grid: NanoGrid):
        self.grid = grid
        self.lo = grid.root_bbox[0].astype(np.int64)
        dims = grid.root_bbox[1].astype(np.int64) - self.lo + 1
        self.table = None
        if grid.voxel_count and int(np.prod(dims)) <= DENSE_TABLE_CELLS:
            ijk = active_voxels(grid).astype(np.int64)  # ordered by index
            self.dims = dims
            self.table = np.full(int(np.prod(dims)), -1, np.int64)
            self.table[self._flat(ijk - self.lo)] = np.arange(len(ijk))

    def _flat(self, rel: np.ndarray) -> np.ndarray:
        return (rel[:, 0] * self.dims[1] + rel[:, 1]) * self.dims[2] + rel[:, 2]

    def __call__(self, ijk: np.ndarray) -> np.ndarray:
        if self.table is None:
            return _host_ijk_to_index(self.grid, ijk) if self.grid.voxel_count else np.full(len(ijk), -1, np.int64)
        rel = ijk.astype(np.int64) - self.lo
        inside = ((rel >= 0) & (rel < self.dims)).all(1)
        out = np.full(len(ijk), -1, np.int64)
        out[inside] = self.table[self._flat(rel[inside])]
        return out


class Grids(NamedTuple):
    index: list[_Index]
    voxel_offsets: np.ndarray  # int64 [B]
    total_voxels: int
    scale: torch.Tensor  # float32 [B, 3], fVDB's 1/h
    translate: torch.Tensor  # float32 [B, 3], fVDB's -origin/h


_CACHE: OrderedDict = OrderedDict()
_CACHE_SIZE = 8


def _key(bundle: Sequence[torch.Tensor]) -> tuple:
    """Return the cache key of a bundle: the blob tensor's identity and version (in-place writes bump
    it), and the contents of the small tensors."""
    blob = bundle[0]
    small = hashlib.blake2b(digest_size=16)
    for t in bundle[1:6]:
        a = np.ascontiguousarray(t.detach().cpu().numpy())
        small.update(f"{a.dtype.str}{a.shape};".encode())
        small.update(memoryview(a).cast("B"))
    return (id(blob), blob.data_ptr(), blob.numel(), blob._version, small.digest())


def grids_of(bundle: Sequence[torch.Tensor]) -> Grids:
    """Return the bundle's grids (validated against the blob as the shader side does), cached per bundle."""
    if len(bundle) != len(schema.BUNDLE):
        raise ValueError(f"a grid bundle has {len(schema.BUNDLE)} tensors ({', '.join(schema.BUNDLE)}), got {len(bundle)}")
    key = _key(bundle)
    hit = _CACHE.get(key)
    if hit is not None and hit[0]() is bundle[0]:  # the very tensor, still alive: its bytes are the same
        _CACHE.move_to_end(key)
        return hit[1]
    from ..operators.fvdb.common import bundle_grids, fvdb_transform

    arrays = [t.detach().cpu().numpy() for t in bundle]
    grids = bundle_grids(*arrays[:6])  # every check the kernels rely on
    offsets = np.asarray(arrays[5], np.int64).reshape(-1)
    scale, translate = fvdb_transform(arrays[2], arrays[3])
    out = Grids([_Index(g) for g in grids], offsets[:-1], int(offsets[-1]), torch.from_numpy(scale),
                torch.from_numpy(translate))
    _CACHE[key] = (weakref.ref(bundle[0]), out)
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return out


# ---- the exported node and the traced call ---------------------------------------------------------


def export_node(g, op_type: str, inputs, like, sizes, dtype=None, **attrs):
    """Return an fvdb.<op_type> node's output in a TorchScript export graph, typed like `like`."""
    out = g.op(f"{schema.DOMAIN}::{op_type}", *inputs, **attrs)
    t = like.type()
    if dtype is not None:
        t = t.with_dtype(dtype)
    out.setType(t.with_sizes(sizes))
    return out


def rows_of(v) -> int | None:
    """The rows of an export graph value (None: unknown)."""
    from torch.onnx import symbolic_helper

    sizes = symbolic_helper._get_tensor_sizes(v)
    return sizes[0] if sizes else None


def trailing_sizes(v) -> list:
    """The sizes of an export graph value past its rows."""
    from torch.onnx import symbolic_helper

    return list(symbolic_helper._get_tensor_sizes(v) or [None, None])[1:]


def host_forward(forward):
    """Run a Function's forward with the TorchScript tracer paused: the exporter records the node
    (its symbolic), not the host computation inside, whose constants it cannot always map."""

    @functools.wraps(forward)
    def wrapped(ctx, *args):
        state = torch._C._get_tracing_state()
        torch._C._set_tracing_state(None)
        try:
            return forward(ctx, *args)
        finally:
            torch._C._set_tracing_state(state)

    return wrapped


def flat_args(bundle, *jagged) -> tuple:
    """Return a bundle's seven tensors and each JaggedTensor's four as one tuple (a Function's
    arguments), checking their counts."""
    bundle = tuple(bundle)
    if len(bundle) != len(schema.BUNDLE):
        raise ValueError(f"a grid bundle has {len(schema.BUNDLE)} tensors ({', '.join(schema.BUNDLE)}), got {len(bundle)}")
    out = bundle
    for j in jagged:
        j = tuple(j)
        if len(j) != len(schema.JAGGED):
            raise ValueError(f"a JaggedTensor is {len(schema.JAGGED)} tensors (jdata, joffsets, jidx, jlidx), got {len(j)}")
        out += j
    return out


def bundle_voxels(bundle) -> int:
    """The bundle's voxel count (the last of its batch_offsets)."""
    with warnings.catch_warnings():  # while tracing, the example grid's count becomes an attribute
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        return int(bundle[5][-1].item())
