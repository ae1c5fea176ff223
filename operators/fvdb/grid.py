"""GridFromNanoVDB: the GridBatch bundle of a raw NanoVDB buffer, evaluated on the host when the model
is compiled (its output shapes depend on the grids, so its inputs must be constants)."""
from __future__ import annotations

import numpy as np

from luisaml.fvdb import GridBatch, NanoVDBError
from luisaml.operator import CompileError, Operator
from luisaml.opsets import fvdb as schema
from luisaml.registry import register
from luisaml.dtypes import from_numpy


def bundle_of(node, blob, voxel_sizes=None, origins=None) -> list[np.ndarray]:
    """Return the seven bundle arrays of the grids in blob; voxel sizes and origins from the grids
    (fVDB's load_nanovdb) unless given as [B, 3]."""
    try:
        batch = GridBatch.from_buffer(np.asarray(blob, np.uint8).reshape(-1))
        bundle = list(batch.bundle())
        for k, (name, given) in enumerate((("voxel_sizes", voxel_sizes), ("origins", origins))):
            if given is None:
                continue
            arr = np.asarray(given, np.float64)
            if arr.shape != (batch.grid_count, 3):
                raise NanoVDBError(f"{name} has shape {list(arr.shape)}, the buffer holds {batch.grid_count} grids: "
                                   f"expected [{batch.grid_count}, 3]")
            if not np.isfinite(arr).all() or (name == "voxel_sizes" and (arr <= 0).any()):
                raise NanoVDBError(f"{name} must be finite{' and positive' if name == 'voxel_sizes' else ''}, "
                                   f"got {arr.tolist()}")
            bundle[2 + k] = arr
    except NanoVDBError as e:
        raise CompileError(f"{node.describe()}: {e}") from None
    return [np.ascontiguousarray(a) for a in bundle]


def _inputs(node, values) -> list:
    return [values[k] if k < len(values) and k < len(node.inputs) and node.inputs[k] else None for k in range(3)]


@register(schema.GRID_FROM_NANOVDB, domain="fvdb", since=1)
class GridFromNanoVDB(Operator):
    """The seven GridBatch bundle tensors of a raw NanoVDB buffer (+ optional voxel sizes and origins)."""

    @classmethod
    def infer(cls, node, inputs):
        if inputs[0] is None or inputs[0].value is None:
            raise CompileError(
                f"{node.describe()}: grid_blob '{node.inputs[0]}' must be a constant: the bundle's shapes depend "
                "on the grids; to bind grids at run time, feed the seven GridBatch bundle tensors as graph inputs"
            )
        values = [None if v is None else v.value for v in inputs]
        if any(node.inputs[k] and values[k] is None for k in range(1, min(len(values), len(node.inputs)))):
            raise CompileError(f"{node.describe()}: voxel_sizes and origins must be constants when given")
        return [(from_numpy(a.dtype).onnx, a.shape) for a in bundle_of(node, *_inputs(node, values))]

    @classmethod
    def evaluate(cls, node, inputs):
        return bundle_of(node, *_inputs(node, inputs))

    def check(self):
        raise self.error(
            "is evaluated on the host when the model is compiled, so its inputs must all be constants; to bind "
            "grids at run time, feed the seven GridBatch bundle tensors as graph inputs"
        )
