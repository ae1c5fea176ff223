"""Conversion from the real ``fvdb`` package's GridBatch / Grid and JaggedTensor to luisaml's bundles.

``fvdb`` is optional (it needs a CUDA build); nothing here imports it. A grid is converted through
fVDB's own writer (``save_nanovdb``: the grids as NanoVDB with ``mVoxelSize = h`` and the map's
translation = origin, both double) and luisaml's reader, so voxel order, voxel sizes and origins are
exactly fVDB's; a JaggedTensor through its four tensors.

    import fvdb
    from luisaml.fvdb import interop
    batch = interop.grid_batch_from_fvdb(fvdb_grid)        # luisaml.fvdb.GridBatch
    feats = interop.jagged_from_fvdb(fvdb_features)         # luisaml.fvdb.JaggedTensor
    feeds = dict(zip(opsets.fvdb.BUNDLE, batch.bundle()))
"""
from __future__ import annotations

import os
import tempfile

import numpy as np

from .grid_batch import GridBatch
from .jagged import JaggedTensor


def fvdb_available() -> bool:
    """Return whether the real fvdb package can be imported here (not just some module named fvdb)."""
    try:
        import fvdb
    except ImportError:
        return False
    return hasattr(fvdb, "GridBatch") and hasattr(fvdb, "JaggedTensor")


def _numpy(t) -> np.ndarray:
    """Return a torch tensor (any device) or array as a numpy array."""
    if hasattr(t, "detach"):
        return t.detach().cpu().numpy()
    return np.asarray(t)


def grid_batch_from_fvdb(grid) -> GridBatch:
    """Return luisaml's GridBatch of an fvdb GridBatch or Grid (anything with fVDB's save_nanovdb)."""
    if not hasattr(grid, "save_nanovdb"):
        raise TypeError(f"expected an fvdb GridBatch or Grid (with save_nanovdb), got {type(grid).__name__}")
    with tempfile.TemporaryDirectory(prefix="luisaml_fvdb_") as tmp:
        path = os.path.join(tmp, "grid.nvdb")
        grid.save_nanovdb(path)  # uncompressed: fVDB's default
        return GridBatch.from_nanovdb(path)


def jagged_from_fvdb(jt) -> JaggedTensor:
    """Return luisaml's JaggedTensor (numpy) of an fvdb JaggedTensor (jdata, joffsets, jidx, jlidx)."""
    missing = [a for a in ("jdata", "joffsets", "jidx", "jlidx") if not hasattr(jt, a)]
    if missing:
        raise TypeError(f"expected an fvdb JaggedTensor, {type(jt).__name__} lacks {missing}")
    jdata = _numpy(jt.jdata)
    joffsets = _numpy(jt.joffsets).astype(np.int64)
    jidx = _numpy(jt.jidx).astype(np.int32).reshape(-1)
    jlidx = _numpy(jt.jlidx).astype(np.int32)
    if jlidx.ndim == 1:  # an empty [0] for a flat list
        jlidx = jlidx.reshape(-1, 1)
    if len(joffsets) == 2 and len(jidx) == len(jdata):
        jidx = np.zeros(0, np.int32)  # fVDB leaves it empty for one tensor; some builds fill it
    return JaggedTensor(jdata, joffsets, jidx, jlidx)


def grid_batch_to_fvdb(batch: GridBatch, device: str = "cpu"):
    """Return an fvdb GridBatch of luisaml's GridBatch (needs the fvdb package)."""
    import fvdb

    with tempfile.TemporaryDirectory(prefix="luisaml_fvdb_") as tmp:
        path = os.path.join(tmp, "grid.nvdb")
        batch.save(path)
        loaded = fvdb.GridBatch.from_nanovdb(path, device=device)
    return loaded[0] if isinstance(loaded, tuple) else loaded
