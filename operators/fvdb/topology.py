"""The topology ops (CoarsenedGrid, RefinedGrid, DilatedGrid, PrunedGrid, ConvGrid, ConvTransposeGrid)
and the grid constructors (GridBatchFromIJK, GridBatchFromPoints, GridBatchFromNearestVoxelsToPoints):
a new GridBatch bundle, evaluated on the host when the model is compiled.

The new bundle's sizes depend on the grids, so these nodes fold over constant inputs with the
project's builder (luisaml/fvdb/topology.py, builder.py), as GridFromNanoVDB does; building grids
on the device (keys, sort, unique, nodes) needs outputs sized at run time and is not implemented
yet, so a node whose inputs are not all constants is a compile error naming it.
"""
from __future__ import annotations

import numpy as np

from luisaml.fvdb import topology as T
from luisaml.fvdb.layout import NanoVDBError
from luisaml.fvdb.jagged import JaggedTensor
from luisaml.dtypes import from_numpy
from luisaml.operator import CompileError, Operator
from luisaml.opsets import fvdb as schema
from luisaml.registry import register

from .common import bundle_grids

BUNDLE = len(schema.BUNDLE)


def _masks(node, mask, counts) -> list[np.ndarray]:
    """Return mask (bool [N], index order) cut into one piece per grid of voxel counts."""
    m = np.asarray(mask).reshape(-1)
    if m.dtype != np.bool_ or len(m) != int(sum(counts)):
        raise CompileError(f"{node.describe()}: mask '{node.inputs[BUNDLE]}' must be bool [{int(sum(counts))}] (one "
                           f"entry per active voxel), got {m.dtype} {list(np.shape(mask))}")
    return np.split(m, np.cumsum(counts)[:-1])


def _from_grids(node, inputs) -> T.GridBatch:
    try:
        grids = bundle_grids(*inputs[:6])
    except NanoVDBError as e:
        raise CompileError(f"{node.describe()}: {e}") from None
    voxels = T.voxels_of(grids)
    h, o = np.asarray(inputs[2], np.float64), np.asarray(inputs[3], np.float64)
    a = node.attrs
    op = node.op_type
    if op == "CoarsenedGrid":
        return T.to_batch(*T.coarsened(voxels, h, o, a.get("coarsening_factor", ())))
    if op == "RefinedGrid":
        mask = inputs[BUNDLE] if len(inputs) > BUNDLE and inputs[BUNDLE] is not None else None
        masks = None if mask is None else _masks(node, mask, [len(v) for v in voxels])
        return T.to_batch(*T.refined(voxels, h, o, a.get("subdiv_factor", ()), masks))
    if op == "DilatedGrid":
        return T.to_batch(*T.dilated(voxels, h, o, a.get("dilation", 1)))
    if op == "PrunedGrid":
        return T.to_batch(*T.pruned(voxels, h, o, _masks(node, inputs[BUNDLE], [len(v) for v in voxels])))
    if op == "ConvGrid":
        return T.to_batch(*T.conv_grid(voxels, h, o, a.get("kernel_size", ()), a.get("stride", 1)))
    return T.to_batch(*T.conv_transpose_grid(voxels, h, o, a.get("kernel_size", ()), a.get("stride", 1)))


def _from_jagged(node, inputs) -> T.GridBatch:
    jdata, joffsets = inputs[0], np.asarray(inputs[1], np.int64).reshape(-1)
    try:
        parts = JaggedTensor.from_data_and_offsets(np.asarray(jdata), joffsets).unbind()
    except ValueError as e:
        raise CompileError(f"{node.describe()}: {e}") from None
    count = len(parts)
    h = T.per_grid(1.0 if len(inputs) < 5 or inputs[4] is None else inputs[4], count, "voxel_sizes", True)
    o = T.per_grid(0.0 if len(inputs) < 6 or inputs[5] is None else inputs[5], count, "origins", False)
    if node.op_type == "GridBatchFromIJK":
        if not np.issubdtype(np.asarray(jdata).dtype, np.integer):
            raise CompileError(f"{node.describe()}: ijk must be integer [N, 3], got {np.asarray(jdata).dtype}")
        return T.to_batch(list(parts), h, o)
    build = T.from_points if node.op_type == "GridBatchFromPoints" else T.from_nearest_voxels
    return T.to_batch(build(list(parts), h, o), h, o)


def evaluate_grid_op(node, inputs) -> list[np.ndarray]:
    """Return the seven bundle arrays of the grids a topology node builds from constant inputs."""
    try:
        batch = _from_grids(node, inputs) if node.op_type in _FROM_GRIDS else _from_jagged(node, inputs)
    except (ValueError, NanoVDBError) as e:
        raise CompileError(f"{node.describe()}: {e}") from None
    return [np.ascontiguousarray(a) for a in batch.bundle()]


_FROM_GRIDS = ("CoarsenedGrid", "RefinedGrid", "DilatedGrid", "PrunedGrid", "ConvGrid", "ConvTransposeGrid")


class GridOp(Operator):
    """A node that builds a new GridBatch bundle on the host (all inputs constants)."""

    @classmethod
    def infer(cls, node, inputs):
        # an input not known yet (a Constant node the fold pass has still to read) leaves the
        # outputs untyped for now; one that is never known fails in check()
        if any(name and (k >= len(inputs) or inputs[k] is None or inputs[k].value is None)
               for k, name in enumerate(node.inputs)):
            return []
        values = [None if v is None else v.value for v in inputs]
        return [(from_numpy(a.dtype).onnx, a.shape) for a in evaluate_grid_op(node, values)]

    @classmethod
    def evaluate(cls, node, inputs):
        return evaluate_grid_op(node, inputs)

    @classmethod
    def untyped_reason(cls, node, graph) -> str:
        """Why the node's outputs have no shapes (lowering's error): an input that is not a constant."""
        return _not_constant([i for i in node.inputs if i and graph.var(i).value is None] or node.inputs)

    def check(self):
        raise self.error(_not_constant([t.name for t in self.inputs if t is not None and t.value is None]
                                       or self.node.inputs))


def _not_constant(names: list[str]) -> str:
    return (f"input '{names[0]}' is not a constant: building grids on the device is not implemented yet (it needs "
            "outputs sized at run time), so the grids this node reads must be constants (initializers), and it is "
            "evaluated when the model is compiled")

for _name in schema.GRID_OPS:
    register(_name, domain="fvdb", since=1)(type(_name, (GridOp,), {"__doc__": schema.GRID_OPS[_name].doc}))
