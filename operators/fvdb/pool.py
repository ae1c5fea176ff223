"""Pooling between a fine and a coarse grid: PoolingMap and RefineMap build the map of a grid pair
once (luisaml/fvdb/topology.py's geometry), MaxPool, AvgPool and Refine reduce features through it.

Why a map node, as the sparse convolution has: a pooling window is a kernel map with the window
anchored at the corner (no centring offset), so PoolingMap is SparseConvKernelMap's device kernel
(a thread per voxel slot of the output grid's leaves, lookups through one cached leaf when the
window lies in it) and its host fold over constant grids; the reduction is then a plain items
operator over features and map, whose output takes the usual epilogues, and a map over one pair
serves every feature tensor pooled over it. RefineMap is the same kernel with one column: the
parent floor(f / S) of each fine voxel.

Over grids bound at run time the voxels are the batch, as for the sparse convolution (conv.py): the
maps have a row per sample, and a reduction reads the features of the sample each index names.

A reduction work item is one output voxel x O channels (channel blocks of a voxel on consecutive
threads, so a warp reads whole feature rows).
"""
from __future__ import annotations

import contextlib

import numpy as np

from luisaml import indexing as ix
from luisaml.fvdb.nanovdb_query import active_voxels, ijk_to_index
from luisaml.fvdb.op_mixins import VoxelBatch
from luisaml.fvdb.layout import NanoVDBError
from luisaml.fvdb.sparse_conv import ConvGeometry
from luisaml.fvdb.topology import factor3, pool_geometry, refine_parents
from luisaml.model import shape_str
from luisaml.operator import CompileError, Operator
from luisaml.opsets import fvdb_grids as grid_schema
from luisaml.registry import register

from .common import GridRef, bundle_grids, rule_types
from .kernel_map import OUT, SparseConvKernelMap, gather_links, map_index

MAX_CHANNELS = 16  # accumulators per thread (SparseConv3d's channel block)


class _MapBase(SparseConvKernelMap):
    """A map of a grid pair with SparseConvKernelMap's inputs, device kernel and fold."""

    @classmethod
    def shape_rule(cls, node, inputs: list, attrs: dict):
        return grid_schema.pool_map_rule(node.op_type, inputs, attrs)


@register(grid_schema.POOL_MAP, domain="fvdb", since=1)
class PoolingMap(_MapBase):
    """int32 [N_coarse, p0*p1*p2]: the batch-global fine voxel at c*S + t of each coarse voxel c, or -1."""

    @classmethod
    def geometry(cls, node) -> ConvGeometry:
        try:
            return pool_geometry(node.attrs.get("pool_size", ()), node.attrs.get("stride", 0))
        except ValueError as e:
            raise CompileError(f"{node.describe()}: {e}") from None

    def describe(self):
        where = ("a thread per coarse voxel (a voxel a sample: grids bound at run time)" if self.voxel_batch
                 else f"a thread per voxel slot of the coarse grid's {self.leaves} leaves")
        return f"pooling map, window {list(self.geo.kernel)}, stride {list(self.geo.stride)}: {where}"


@register(grid_schema.REFINE_MAP, domain="fvdb", since=1)
class RefineMap(_MapBase):
    """int32 [N_fine, 1]: the batch-global coarse voxel floor(f / S) of each fine voxel f, or -1."""

    @classmethod
    def geometry(cls, node) -> ConvGeometry:
        try:
            s = factor3(node.attrs.get("subdiv_factor", ()), "subdiv_factor")
        except ValueError as e:
            raise CompileError(f"{node.describe()}: {e}") from None
        return ConvGeometry((1, 1, 1), tuple(int(v) for v in s))

    @classmethod
    def evaluate(cls, node, inputs):
        geo = cls.geometry(node)
        try:
            grids_in, grids_out = bundle_grids(*inputs[:6]), bundle_grids(*inputs[OUT:OUT + 6])
        except NanoVDBError as e:
            raise CompileError(f"{node.describe()}: {e}") from None
        if len(grids_in) != len(grids_out):
            raise CompileError(f"{node.describe()}: the coarse bundle has {len(grids_in)} grids, the fine bundle "
                               f"{len(grids_out)}; a refine map pairs grid b with grid b")
        offsets = np.asarray(inputs[5], np.int64).reshape(-1)
        rows = []
        for b, g in enumerate(grids_out):
            fine = active_voxels(g) if g.voxel_count else np.zeros((0, 3), np.int32)
            idx = ijk_to_index(grids_in[b], refine_parents(fine, geo.stride).astype(np.int32))
            rows.append(np.where(idx >= 0, idx + offsets[b], -1))
        return [np.concatenate(rows).astype(np.int32).reshape(-1, 1)]

    def emit_taps(self, ctx, g: GridRef, c: list[str], voxel_offset: str, store) -> None:
        fdiv = ctx.use_helper("floor_div", "nanovdb")
        ctx.use_helper("nvdb_value", "nanovdb")
        S = self.geo.stride
        parent = [ctx.let(f"{fdiv}({c[a]}, {S[a]})" if S[a] > 1 else c[a], "p") for a in range(3)]
        v = ctx.let(g.lookup(parent), "v")
        index = ctx.let(f"({voxel_offset} + {v} - 1) if {v} > 0 else -1", "index")
        store("0", index)

    def describe(self):
        where = ("a thread per fine voxel (a voxel a sample: grids bound at run time)" if self.voxel_batch
                 else f"a thread per voxel slot of the fine grid's {self.leaves} leaves")
        return f"refine map, factor {list(self.geo.stride)}: {where}"


class _Pool(VoxelBatch, Operator):
    """out[o] = reduce over the map's columns t with map[o, t] >= 0 of features[map[o, t]]."""

    stores_once = True
    reduce = "sum"  # "max" (MaxPool), "avg" (AvgPool) or "sum" (Refine: one column)

    @classmethod
    def infer(cls, node, inputs):
        return rule_types(node, inputs, lambda ins: [grid_schema.pool_rule(ins)])

    def check(self):
        self.expect(len(self.inputs) == 2, f"takes 2 inputs (features, map), got {len(self.inputs)}")
        x, pmap = self.input(0), self.input(1)
        self.expect_dtype(x, ("FLOAT",), "input 0 (features)")
        self.expect_dtype(pmap, ("INT32",), "input 1 (map)")
        self.expect(x.rank == 2, f"features '{x.name}' must be [N_in, C], got {shape_str(x.shape)}")
        self.expect(pmap.rank == 2, f"map '{pmap.name}' must be [N_out, taps], got {shape_str(pmap.shape)}")
        # over grids bound at run time the voxels are the batch: features [1, C] and map [1, taps] a sample
        self.voxel_batch = x.batched or pmap.batched
        if self.voxel_batch:
            self.expect(x.batched and pmap.batched and x.shape[0] == 1 and pmap.shape[0] == 1,
                        f"features '{x.name}' and map '{pmap.name}' must both have a row per voxel, the voxels the "
                        "batch (a map over grids bound at run time)")
        self.n_in, self.c = x.shape
        self.n_out, self.taps = pmap.shape
        self.expect_shape(self.output(), (self.n_out, self.c), "output")
        if pmap.value is not None:
            v = np.asarray(pmap.value)
            bad = (v < -1) | (v >= self.n_in)
            self.expect(not bad.any(), f"map '{pmap.name}' holds index {int(v[bad][0]) if bad.any() else 0} outside "
                        f"[-1, {self.n_in}) (the rows of features '{x.name}')")

    def channel_blocks(self) -> tuple[int, int]:
        """Return (O channels per work item, channel blocks per voxel)."""
        O = min(self.c, MAX_CHANNELS) or 1
        return O, -(-self.c // O)

    def work_items(self):
        _, cblocks = self.channel_blocks()
        return self.n_out * cblocks if self.c else 0

    def row_links(self):
        return gather_links(self)

    def emit_item(self, ctx, item):
        if self.voxel_batch and ctx.at_sample is None:
            raise self.error("over grids bound at run time it runs over the batch in stages; compile with "
                             "schedule='auto' or 'stages'")
        x, pmap, y = self.input(0), self.input(1), self.output()
        O, cblocks = self.channel_blocks()
        C, T = self.c, self.taps
        o = ctx.let(ix.div(item, cblocks), "o") if cblocks > 1 else item
        c0 = ctx.let(ix.mul(ix.mod(item, cblocks), O), "c0") if cblocks > 1 else "0"
        safe = C % O or O  # channels j >= safe may fall past C in the last block
        cols = [ix.add(c0, str(j)) if j < safe else f"min({ix.add(c0, str(j))}, {C - 1})" for j in range(O)]
        acc = [ctx.fresh("acc") for _ in range(O)]
        for a in acc:
            ctx.line(f"{a} = {'(-INF)' if self.reduce == 'max' else '0.0'}")
        # a map fed or built at run time: an index past the features is flagged (run() raises
        # naming this node) and read as missing
        checked = pmap.value is None
        # (a voxel a sample: the map's index is a sample, the features' rows are the batch)
        n_in = ctx.n_samples if self.voxel_batch else self.n_in
        flag = ctx.flag_error(str(self.error(f"map '{pmap.name}' holds an index outside [-1, "
                                             f"{'batch' if self.voxel_batch else n_in}) (the rows of features "
                                             f"'{x.name}')"))) if checked else None
        row = ctx.let(ix.mul(o, T), "row")
        with ctx.loop(T, "tap") as tap:
            k = map_index(ctx, pmap.load(ix.add(row, tap)), n_in, flag, checked)
            if self.voxel_batch or self.n_in > 0:
                ctx.line(f"if {k} >= 0:")
                with ctx.indent():
                    base = "0" if self.voxel_batch else ctx.let(ix.mul(k, C), "xr")
                    with (ctx.at_sample(k) if self.voxel_batch else contextlib.nullcontext()):
                        vs = [ctx.let(x.load(ix.add(base, cols[j])), "xv") for j in range(O)]
                    for j, v in enumerate(vs):
                        step = f"max({acc[j]}, {v})" if self.reduce == "max" else f"{acc[j]} + {v}"
                        ctx.line(f"{acc[j]} = {step}")
        scale = repr(float(np.float32(1.0 / T))) if self.reduce == "avg" else None
        for j in range(O):
            value = f"{acc[j]} * {scale}" if scale else acc[j]
            ctx.line_if(None if j < safe else f"{ix.add(c0, str(j))} < {C}",
                        y.store(ix.add(ix.mul(o, C), ix.add(c0, str(j))), value))

    def forward(self, ctx):
        with ctx.loop(self.work_items(), "item") as item:
            self.emit_item(ctx, item)

    def describe(self):
        O, _ = self.channel_blocks()
        per = " (a voxel a sample: grids bound at run time)" if self.voxel_batch else ""
        return f"{self.reduce} over a map of {self.taps} columns, {self.c} channels: a thread per voxel x {O} channels{per}"


@register("MaxPool", domain="fvdb", since=1)
class MaxPool(_Pool):
    """fVDB max_pool: the max of each coarse voxel's window, -inf where it holds no active voxel."""

    reduce = "max"


@register("AvgPool", domain="fvdb", since=1)
class AvgPool(_Pool):
    """fVDB avg_pool: the window's sum times 1 / (p0*p1*p2)."""

    reduce = "avg"


@register("Refine", domain="fvdb", since=1)
class Refine(_Pool):
    """fVDB refine: each fine voxel's parent features, 0 where the parent is inactive."""

    reduce = "sum"
