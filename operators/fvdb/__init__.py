"""The `fvdb` operator domain (schemas in opsets/fvdb*.py): sparse-grid queries, transforms,
sampling, splatting and sparse convolution on NanoVDB OnIndex grids read straight from a ByteBuffer."""
from . import conv, grid, index, kernel_map, sample, splat, transform  # noqa: F401
from . import pool, topology, topology_device  # noqa: F401
from . import dense, ray  # noqa: F401
