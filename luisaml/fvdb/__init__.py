"""fVDB on the host: NanoVDB OnIndex grids (read, validate, build, write) and the GridBatch/JaggedTensor bundles.

Pure numpy. The shader side (``shaders/nanovdb.py``, ``operators/fvdb/``) reads the same bytes; the
functions here are its reference.
"""

from .builder import (
    build_dense_grid,
    build_grid,
    build_grid_from_points,
    concat_grids,
    dense_ijk,
    nanovdb_order,
    points_to_ijk,
)
from .grid_batch import MAX_GRIDS_PER_BATCH, GridBatch, GridBatchBundle, GridBatchMetadata, MetaF, MetaI
from .jagged import JaggedBundle, JaggedTensor
from .layout import NanoVDBError
from .nanovdb import GridMap, NanoGrid, TreeInfo
from .nanovdb_query import active_voxels, ijk_to_index, ijk_to_value, leaf_origins, require_fvdb_index_grid
from .nanovdb_read import read_grid, read_grids
from .nvdb_io import encode_nvdb, read_nvdb, read_nvdb_buffer, write_nvdb, write_raw

__all__ = [
    "GridBatch",
    "GridBatchBundle",
    "GridBatchMetadata",
    "GridMap",
    "JaggedBundle",
    "JaggedTensor",
    "MAX_GRIDS_PER_BATCH",
    "MetaF",
    "MetaI",
    "NanoGrid",
    "NanoVDBError",
    "TreeInfo",
    "active_voxels",
    "build_dense_grid",
    "build_grid",
    "build_grid_from_points",
    "concat_grids",
    "dense_ijk",
    "encode_nvdb",
    "ijk_to_index",
    "ijk_to_value",
    "leaf_origins",
    "nanovdb_order",
    "points_to_ijk",
    "read_grid",
    "read_grids",
    "read_nvdb",
    "read_nvdb_buffer",
    "require_fvdb_index_grid",
    "write_nvdb",
    "write_raw",
]
