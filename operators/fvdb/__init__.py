"""The `fvdb` operator domain (schemas in opsets/fvdb.py): sparse-grid queries, transforms,
sampling and splatting on NanoVDB OnIndex grids read straight from a ByteBuffer."""
from . import grid, index, sample, splat, transform  # noqa: F401
