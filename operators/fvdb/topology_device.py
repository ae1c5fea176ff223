"""The topology ops (CoarsenedGrid, RefinedGrid, DilatedGrid, PrunedGrid, ConvGrid, ConvTransposeGrid)
built on the device over a grid bound at run time: the device grid build of topology.py, its voxel
keys read from the source grid.

Over constants they fold on the host (topology.GridOp). Over a grid bound at run time,
luisaml/fvdb/host_steps.py cuts the node out of the model and runs it, when a run binds a new grid, as a
network of its own: the node alone, with the attribute `voxel_capacity` V (the source voxels the
network takes, a power of two), compiled once per V. That node builds here, as DeviceGridBuild's
phases with one phase changed: "voxel keys" runs a thread per source voxel, which finds the voxel's
ijk in the source blob (the grid whose batch range holds it, the leaf whose index range holds it,
the bit of its rank), forms the op's candidate voxels (`Candidates`) and appends those that exist
to the key list with an atomic counter: the table word the later phases read as the key count
(`Scratch.keys`, operators/fvdb/build_scratch.py). The phases after it are the builder's, so the bytes are the host builder's; the
candidates' order varies from run to run, the grids do not (leaves are deduplicated, then sorted).

Scratch is sized for V times the candidates per voxel (coarsening and pruning 1, ConvGrid whose
kernel fits its stride 1, refinement f^3, dilation 27 a pass, ConvTransposeGrid the kernel's taps,
ConvGrid the taps that can divide: ceil(k_a / s_a) along each axis, 8 for a 3/2 kernel where every
tap was a candidate before, issue 28): about 79 int words a key.
"""
from __future__ import annotations

import numpy as np

from luisaml import dtypes
from luisaml.dynamic import Phase
from luisaml.fvdb import topology as T
from luisaml.operator import Derived
from luisaml.opsets import fvdb as schema
from luisaml.opsets import fvdb_grids as grid_schema
from luisaml.registry import register

from .build_scratch import Scratch
from .candidates import Candidates, candidates, emit_source_voxel  # (Candidates, candidates: read here by others)
from .common import META_FIELDS, GridOp as BundleOp, Meta, grid_metadata, voxel_of_index
from .topology import (BUNDLE, CAPACITY, NEW_COORDS_ERROR, TRANSFORM_WORDS, DeviceGridBuild, GridOp, grid_transforms,
                       runtime_bundle)

OPS = ("CoarsenedGrid", "RefinedGrid", "DilatedGrid", "PrunedGrid", "ConvGrid", "ConvTransposeGrid")
def topology_transforms(voxel_sizes, origins, *, grids: int, op: str, attrs: tuple) -> np.ndarray:
    """grid_transforms of the new grids: the source's voxel sizes and origins through the op's rule."""
    h, o = T.new_transforms(op, dict(attrs), np.asarray(voxel_sizes, np.float64).reshape(-1, 3),
                            np.asarray(origins, np.float64).reshape(-1, 3))
    return grid_transforms(h, o, grids=grids, has=(True, True))


def source_metadata(*arrays, capacity: int) -> np.ndarray:
    """grid_metadata of the source bundle (the first six arrays; a mask after them is checked to
    hold a row per voxel), its voxels checked against the network's capacity."""
    from luisaml.errors import InputError

    rows = int(np.shape(arrays[6])[0]) if len(arrays) > 6 else None
    meta = grid_metadata(*arrays[:6], expect_voxels=rows)
    total = int(meta[:, Meta.VOXEL_COUNT].sum())
    if total > capacity:
        raise InputError(f"the grid has {total:,} voxels; this network takes at most {capacity:,} "
                         "(luisaml/fvdb/host_steps.py compiles one per power of two)")
    return meta


class DeviceTopology(DeviceGridBuild):
    """A topology op: folds over constants (GridOp); with `voxel_capacity`, built on the device over a
    grid bound at run time (module docstring)."""

    OPS = OPS
    check_bundle = BundleOp.check_bundle  # (the query ops' bundle checks: they need only expect*, input)

    @classmethod
    def infer(cls, node, inputs):
        offsets = inputs[1] if len(inputs) > 1 else None
        if CAPACITY not in node.attrs or offsets is None or offsets.shape is None or len(offsets.shape) != 1 \
                or not isinstance(offsets.shape[0], int):
            return GridOp.infer.__func__(cls, node, inputs)  # folds (or stays untyped: the op's error)
        return runtime_bundle(int(offsets.shape[0]))

    @classmethod
    def keys_for(cls, op_type: str, attrs: dict, capacity: int) -> int:
        return capacity * candidates(op_type, attrs).count

    @classmethod
    def reads_bound_rows(cls, op_type: str, k: int) -> bool:
        return k == BUNDLE or (k < BUNDLE and schema.BUNDLE[k] in ("grid_blob", "leaf_batch_indices", "list_indices"))

    def check(self):
        if CAPACITY not in self.node.attrs:
            return GridOp.check(self)
        spec = grid_schema.GRID_OPS[self.node.op_type]
        self.expect(BUNDLE <= len(self.inputs) <= len(spec.inputs),
                    f"takes {', '.join(spec.input_names())}, got {len(self.inputs)} inputs")
        self.B = self.check_bundle()
        self.mask = self.input(BUNDLE) if self.has_input(BUNDLE) else None
        self.expect(self.mask is not None or self.node.op_type != "PrunedGrid", "takes a mask (input 7)")
        if self.mask is not None:
            self.expect_dtype(self.mask, ("BOOL",), "mask")
            self.expect(self.mask.rank == 1 and not self.mask.batched,
                        f"mask '{self.mask.name}' must be [N] (one entry per voxel)")
        V = self.node.attrs[CAPACITY]
        self.expect(isinstance(V, int) and V >= 1, f"{CAPACITY} must be a positive integer, got {V!r}")
        try:
            self.cand = candidates(self.node.op_type, self.node.attrs)
        except ValueError as e:
            raise self.error(str(e)) from None
        self.V, self.N, self.K = V, V, V * self.cand.count
        self.expect(self.K <= self.MAX_KEYS, f"{V:,} voxels of {self.cand.count} candidates each exceed the "
                    f"{self.MAX_KEYS:,} candidate voxels a device build holds")
        self.check_outputs()
        self.points = self.nearest = False
        self.S = Scratch(self.K, self.B)

    def derived_inputs(self):
        if CAPACITY not in self.node.attrs:
            return []
        attrs = tuple(sorted((k, tuple(v) if isinstance(v, (list, tuple)) else v) for k, v in self.node.attrs.items()
                             if k != CAPACITY))
        sources = tuple(range(6)) + ((BUNDLE,) if self.mask is not None else ())
        return [Derived(topology_transforms, (2, 3), dtypes.INT32, (self.B, TRANSFORM_WORDS),
                        (("grids", self.B), ("op", self.node.op_type), ("attrs", attrs))),
                Derived(source_metadata, sources, dtypes.INT32, (self.B, META_FIELDS), (("capacity", self.V),),
                        shape_only=(BUNDLE,) if self.mask is not None else ())]

    def describe(self):
        return (f"{self.node.op_type} built on the device over a grid bound at run time (up to {self.V:,} voxels, "
                f"{self.cand.count} candidate voxel(s) each) into {self.B} grid(s): hash, radix sort, nodes, "
                f"{self.layout_said}, write")

    def coords_error(self) -> str:
        return NEW_COORDS_ERROR

    def phases(self):
        out = super().phases()
        k = next(k for k, p in enumerate(out) if p.name == "voxel keys")
        out[k] = Phase("voxel keys", max(self.V, 1), self._emit_source_keys)
        return out

    def _emit_clear(self, ctx, t) -> None:
        super()._emit_clear(ctx, t)
        ctx.line(f"if {t} == 0:")  # the keys phase counts its keys up from 0
        with ctx.indent():
            ctx.line(f"scratch_int.write({self.S.keys.at}, 0)")

    def _emit_source_keys(self, ctx, v) -> None:
        """Source voxel v: its grid b, leaf and ijk c, then each candidate that exists appended."""
        meta, B, F, S = self.derived[1], self.B, META_FIELDS, self.S
        last = (B - 1) * F
        total = f"({meta.load(str(last + int(Meta.VOXEL_OFFSET)))} + {meta.load(str(last + int(Meta.VOXEL_COUNT)))})"
        ctx.line(f"if {v} < {total}" + (f" and {self.mask.load(v)}:" if self.mask is not None else ":"))
        with ctx.indent():
            b, _, c = voxel_of_index(ctx, meta, B, *self.input(0).storage.byte_address(), v)
            emit_source_voxel(ctx, self.cand, S, b, c)

for _name in OPS:
    register(_name, domain="fvdb", since=1)(type(_name, (DeviceTopology,), {"__doc__": grid_schema.GRID_OPS[_name].doc}))
