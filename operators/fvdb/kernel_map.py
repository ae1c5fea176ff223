"""SparseConvKernelMap: the kernel map of a grid pair, built once (fVDB's relation,
luisaml/fvdb/sparse_conv.py), and how its readers (SparseConv3d in conv.py, the pooling reductions
in pool.py) read an entry and link their rows.

Why a node of its own: the map depends only on the grid pair, kernel size and stride, so a network
whose layers share a pair (every stride-1 layer of a U-Net level) exports one map node and feeds it
to each layer: the reuse is in the graph and the schedule keeps the map in a buffer across stages.
Over constant grids the map folds on the host at compile time (evaluate).

Over grids bound at run time (any size, one compiled network) the voxels are the batch: the map
has a row per voxel of the output grid, and a work item per sample finds its voxel from its index
(nanovdb's nvdb_find_leaf, nvdb_leaf_slot); it sees the whole batch (VoxelBatch). The batch is
the most voxels any of the run's grids has (a coarser level has fewer; a conv grid over scattered
voxels may have more than the fine grid it was made from): a grid with fewer leaves its map's rows
past them missing (luisaml/fvdb/voxel_rows.py says which inputs and outputs hold which grid's voxels,
and pads the inputs to the batch). So may the grid
count be (grid_count.py: both bundles' grid_byte_offsets, voxel_sizes, origins and batch_offsets with
a dynamic first dimension): the search for a voxel's grid and the batch's last voxel read G from a
derived int32 [1] (`paired_grid_count`: both bundles hold as many grids, each checked against its blob
when bound), never a literal; the pooling and refine maps (pool.py) are this kernel.

A kernel-map work item is one voxel slot of one output leaf (most slots of a surface's leaves are
empty and return at once).
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto

from luisaml import dtypes
from luisaml import indexing as ix
from luisaml.fvdb import layout as L
from luisaml.fvdb.layout import NanoVDBError
from luisaml.fvdb.nanovdb_query import active_voxels, ijk_to_index
from luisaml.fvdb.op_mixins import VoxelBatch
from luisaml.fvdb.sparse_conv import ConvGeometry, conv_geometry, kernel_map
from luisaml.fvdb.voxel_rows import GRID, INDICES
from luisaml.model import shape_str
from luisaml.operator import CompileError, Derived
from luisaml.opsets import fvdb as schema
from luisaml.registry import register

from .common import META_FIELDS, GridOp, GridRef, Meta, bundle_grids, grid_metadata, voxel_of_index
from .grid_count import COUNT_INPUTS, PLUS_ONE, grid_metadata_counted, paired_grid_count

BUNDLE = len(schema.BUNDLE)
OUT = BUNDLE  # the output grid's bundle starts at input 7
LEAF_SLOTS = 512


def leaf_positions(grid_blob, grid_byte_offsets, voxel_sizes, origins, leaf_batch_indices, batch_offsets) -> np.ndarray:
    """Return the byte position (int32 [leaves]) of every leaf of a checked bundle, in batch order."""
    grids = bundle_grids(grid_blob, grid_byte_offsets, voxel_sizes, origins, leaf_batch_indices, batch_offsets)
    pos = [g.leaf_offset + L.LEAF_NODE_SIZE * np.arange(g.leaf_count, dtype=np.int64) for g in grids]
    return np.concatenate(pos).astype(np.int32) if pos else np.zeros(0, np.int32)


def _geometry(node) -> ConvGeometry:
    try:
        return conv_geometry(node.attrs.get("kernel_size", ()), node.attrs.get("stride", 1))
    except ValueError as e:
        raise CompileError(f"{node.describe()}: {e}") from None


def map_index(ctx, expr: str, limit: str | int, flag: str | None, checked: bool = True) -> str:
    """Emit `k = expr` (a map's entry) and return k; checked: an entry outside [-1, limit) is read as
    missing (-1), after `flag` (KernelContext.flag_error's statement, None where checks are off)."""
    k = ctx.fresh("k")
    ctx.line(f"{k} = {expr}")
    if checked:
        ctx.line(f"if {k} < -1 or {k} >= {limit}:")
        with ctx.indent():
            if flag is not None:
                ctx.line(flag)
            ctx.line(f"{k} = -1")
    return k


def gather_links(op) -> list[tuple[str, str]] | None:
    """VoxelBatch.row_links of a node out = f(features, map) that reads features at the rows the map
    names (SparseConv3d, the pooling reductions), when the voxels are the batch."""
    if not op.voxel_batch:
        return None
    x, m = op.input(0).name, op.input(1).name
    return [(op.output().name, m), (x, INDICES + m)]


@register(schema.KERNEL_MAP, domain="fvdb", since=1)
class SparseConvKernelMap(VoxelBatch, GridOp):
    """int32 [N_out, T]: the batch-global input voxel each output voxel reads at each tap, or -1."""

    # the bundle inputs whose rows may be bound at run time (of either grid): the map then has a row
    # per voxel of the output grid, and those voxels are the batch (a voxel a sample: module docstring)
    _BOUND_PARTS = ("grid_blob", "leaf_batch_indices", "list_indices")

    @classmethod
    def reads_bound_rows(cls, op_type: str, k: int) -> bool:
        # ... and so may both grid counts (grid_count.py): the kernel reads G where it finds a voxel's grid
        return k < 2 * BUNDLE and schema.BUNDLE[k % BUNDLE] in cls._BOUND_PARTS + COUNT_INPUTS

    @classmethod
    def extra_rows(cls, op_type: str, k: int) -> int:
        return int(k < 2 * BUNDLE and schema.BUNDLE[k % BUNDLE] in PLUS_ONE)  # (batch_offsets: G + 1)

    @classmethod
    def pinned_by_example(cls, op_type: str) -> tuple[str, ...]:
        return ("output_voxels",)  # (torch_ops writes the traced grid's count)

    @classmethod
    def probe_rows(cls, node, probe, inputs) -> list | None:
        """The rule's answer while the passes probe a model whose grids this map reads are bound at
        run time: a row per sample (module docstring), or None when they are not bound."""
        if not (probe is not None and any(node.inputs[k] in probe.bound for k in range(2 * BUNDLE))):
            return None
        if probe.batch is None:
            raise CompileError(
                f"{node.describe()}: a grid is bound at run time, so the map has a row per voxel of a grid whose "
                "size is known only then: make the voxels the batch (give the features a dynamic first "
                "dimension and compile with batch_axis='auto'), or fix the grids' shapes with input_shapes")
        return [(TensorProto.INT32, (probe.batch, cls.geometry(node).taps))]

    @classmethod
    def infer(cls, node, inputs):
        attrs = dict(node.attrs)
        offsets = inputs[OUT + 5] if len(inputs) > OUT + 5 else None
        if "output_voxels" not in attrs and offsets is not None and offsets.value is not None and offsets.value.size:
            attrs["output_voxels"] = int(np.asarray(offsets.value).reshape(-1)[-1])
        try:
            elem, dims = cls.shape_rule(node, list(inputs), attrs)
        except ValueError as e:
            raise CompileError(f"{node.describe()}: {e}") from None
        return [(elem, None if dims is None else tuple(dims))]

    @classmethod
    def shape_rule(cls, node, inputs: list, attrs: dict):
        """Return (elem_type, dims) of the map by its schema's rule (a pooling map has its own)."""
        return schema.kernel_map_rule(inputs, attrs)

    @classmethod
    def geometry(cls, node) -> ConvGeometry:
        """Return the node's tap geometry (a subclass may pool instead: operators/fvdb/pool.py)."""
        return _geometry(node)

    @classmethod
    def evaluate(cls, node, inputs):
        geo = cls.geometry(node)
        try:
            grids_in = bundle_grids(*inputs[:6])
            grids_out = bundle_grids(*inputs[OUT:OUT + 6])
        except NanoVDBError as e:
            raise CompileError(f"{node.describe()}: {e}") from None
        if len(grids_in) != len(grids_out):
            raise CompileError(f"{node.describe()}: the input bundle has {len(grids_in)} grids, the output bundle "
                               f"{len(grids_out)}; a kernel map pairs grid b with grid b")
        offsets = np.asarray(inputs[5], np.int64).reshape(-1)

        def lookup(b, ijk):
            idx = ijk_to_index(grids_in[b], ijk.astype(np.int32))
            return np.where(idx >= 0, idx + offsets[b], -1)

        out = kernel_map([active_voxels(g) for g in grids_out], lookup, geo, bool(node.attrs.get("transposed", 0)))
        return [out]

    def check(self):
        names = schema.kernel_map_input_names()
        self.expect(len(self.inputs) == len(names), f"takes {len(names)} inputs (the input grid's bundle, then the "
                    f"output grid's), got {len(self.inputs)}")
        self.B = self.check_bundle(0, "in_")
        counted = self.count_bound
        b_out = self.check_bundle(OUT, "out_")
        self.expect(counted == self.count_bound, f"the {'input' if counted else 'output'} bundle's grid count is bound "
                    f"at run time, the {'output' if counted else 'input'} bundle's is fixed; a kernel map pairs grid b "
                    "with grid b: give both bundles' grid_byte_offsets, voxel_sizes, origins and batch_offsets a "
                    "dynamic first dimension (the grid count), or neither")
        self.expect(b_out == self.B, f"the input bundle has {self.B} grids, the output bundle {b_out}; a kernel map "
                    "pairs grid b with grid b")
        self.geo = self.geometry(self.node)
        self.transposed = bool(self.attr("transposed", 0))
        y = self.output()
        self.expect_dtype(y, ("INT32",), "output")
        self.voxel_batch = y.batched
        self.expect(y.batched or not self.count_bound, "the grid count is bound at run time, so the map has a row per "
                    "voxel of grids known only then: make the voxels the batch (give the features a dynamic first "
                    "dimension and compile with batch_axis='auto')")
        if y.batched:  # grids bound at run time: a row per sample, each sample a voxel of the output grid
            self.expect(y.shape == (1, self.geo.taps), f"output '{y.name}' has {shape_str(y.shape)} per sample, "
                        f"expected [1, {self.geo.taps}] for kernel {list(self.geo.kernel)}")
            return
        self.expect(y.rank == 2 and y.shape[1] == self.geo.taps, f"output '{y.name}' has shape {shape_str(y.shape)}, "
                    f"expected [output voxels, {self.geo.taps}] for kernel {list(self.geo.kernel)}")
        self.leaves = self.input(OUT + 4).shape[0]

    def derived_inputs(self):
        if self.voxel_batch and self.count_bound:  # the grid counts too: checked against each blob when bound
            names = [tuple(self.input(first + k).name for k in (0,) + tuple(schema.BUNDLE.index(n) for n in COUNT_INPUTS))
                     for first in (0, OUT)]
            return [Derived(grid_metadata_counted, tuple(range(first, first + 6)), dtypes.INT32, (self.B, META_FIELDS),
                            (("inputs", inputs),), any_rows=True) for first, inputs in zip((0, OUT), names)] + \
                   [Derived(paired_grid_count, (1, OUT + 1), dtypes.INT32, (1,), (("inputs", (names[0][1], names[1][1])),),
                            shape_only=(1, OUT + 1))]
        if self.voxel_batch:  # (the voxel counts are checked against the batch in the kernel)
            return [Derived(grid_metadata, tuple(range(6)), dtypes.INT32, (self.B, META_FIELDS)),
                    Derived(grid_metadata, tuple(range(OUT, OUT + 6)), dtypes.INT32, (self.B, META_FIELDS))]
        rows = self.output().shape[0]
        return [Derived(grid_metadata, tuple(range(6)), dtypes.INT32, (self.B, META_FIELDS)),
                Derived(grid_metadata, tuple(range(OUT, OUT + 6)), dtypes.INT32, (self.B, META_FIELDS),
                        (("expect_voxels", rows),)),
                Derived(leaf_positions, tuple(range(OUT, OUT + 6)), dtypes.INT32, (self.leaves,))]

    def row_links(self):
        if not self.voxel_batch:
            return None
        y = self.output().name  # its rows: the output grid's voxels; the rows it names: the input grid's
        return [(y, GRID + self.node.inputs[OUT + 5]), (INDICES + y, GRID + self.node.inputs[5])]

    def work_items(self):
        if self.voxel_batch:
            return 1
        return self.leaves * LEAF_SLOTS if self.output().shape[0] else 0

    def emit_item(self, ctx, item):
        if self.voxel_batch:
            self._emit_voxel_sample(ctx)
            return
        meta_in, meta_out, leaf_pos = self.derived
        y, T = self.output(), self.geo.taps
        blob_out, base_out = self.input(OUT).storage.byte_address()
        value = ctx.use_helper("nvdb_leaf_value", "nanovdb")
        corner = ctx.use_helper("nvdb_leaf_origin", "nanovdb")
        leaf_i = ctx.let(ix.div(item, LEAF_SLOTS), "l")
        slot = ctx.let(ix.mod(item, LEAF_SLOTS), "slot")
        leaf = ctx.let(ix.add(base_out, leaf_pos.load(leaf_i)) if base_out != "0" else leaf_pos.load(leaf_i), "leaf")
        b = ctx.let(self.input(OUT + 4).load(leaf_i), "b")
        c = [ctx.let(f"{corner}({blob_out}, {leaf}, {a}) + {s}", "c")
             for a, s in enumerate((f"({slot} >> 6)", f"(({slot} >> 3) & 7)", f"({slot} & 7)"))]
        v_out = ctx.let(f"{value}({blob_out}, {leaf}, {', '.join(c)})", "v")
        ctx.line(f"if {v_out} > 0:")
        with ctx.indent():
            m = ctx.let(ix.mul(b, META_FIELDS), "m")  # grid b's row of both metadata tables
            row = ctx.let(ix.mul(f"({meta_out.load(ix.add(m, str(int(Meta.VOXEL_OFFSET))))} + {v_out} - 1)", T), "row")
            g, voxel_offset = self._input_grid(ctx, meta_in, m)
            self.emit_taps(ctx, g, c, voxel_offset, lambda tap, v: ctx.store(y, ix.add(row, tap), v))

    def _input_grid(self, ctx, meta_in, m: str) -> tuple[GridRef, str]:
        """The input grid's GridRef for metadata row m (a DSL expression: grid b's row), and its first
        voxel's batch-global index."""
        blob_in, base_in = self.input(0).storage.byte_address()

        def field(f: Meta) -> str:
            return meta_in.load(ix.add(m, str(int(f))))

        tiles = field(Meta.TILES) if base_in == "0" else ix.add(base_in, field(Meta.TILES))
        g = GridRef(ctx, blob_in, ctx.let(tiles, "tiles"), ctx.let(field(Meta.TILE_COUNT), "ntiles"), field)
        return g, ctx.let(g.voxel_offset, "voff")

    def _emit_voxel_sample(self, ctx) -> None:
        """Grids bound at run time, a voxel a sample: this sample's voxel v of the output bundle is
        found from its index (the grid holding it, the leaf whose index range holds it, the bit of its
        rank in that leaf's mask), then its taps are looked up as over a static grid. A grid with
        fewer voxels than the batch (a coarse level, or the fine grid below a larger conv grid)
        leaves the rows past them missing; sample 0 flags one with more."""
        if ctx.sample is None:
            raise self.error("over grids bound at run time it runs over the batch in stages; compile with "
                             "schedule='auto' or 'stages'")
        meta_in, meta_out = self.derived[:2]
        y, F = self.output(), META_FIELDS
        # the grid count: a literal, or read when it is bound at run time (grid_count.py)
        B = ctx.let(self.derived[2].load("0"), "ngrids") if self.count_bound else self.B
        blob_out, base_out = self.input(OUT).storage.byte_address()
        v, n = ctx.sample, ctx.n_samples
        last = ctx.let(f"({B} - 1) * {F}", "last") if self.count_bound else str((B - 1) * F)

        def total(meta) -> str:
            return (f"({meta.load(ix.add(last, str(int(Meta.VOXEL_OFFSET))))} + "
                    f"{meta.load(ix.add(last, str(int(Meta.VOXEL_COUNT))))})")

        flag = ctx.flag_error(str(self.error(
            "a grid bound at run time has more voxels than the batch (run() makes the batch its grids' most "
            "voxels): a map over such grids has a row per voxel, a voxel a sample")))
        if flag is not None:
            ctx.line(f"if {v} == 0 and ({total(meta_out)} > {n} or {total(meta_in)} > {n}):")
            with ctx.indent():
                ctx.line(flag)
        with ctx.loop(self.geo.taps, "tap") as tap:
            ctx.store(y, tap, "(-1)")
        ctx.line(f"if {v} < {total(meta_out)}:")
        with ctx.indent():
            _, m, c = voxel_of_index(ctx, meta_out, B, blob_out, base_out, v)
            g, voxel_offset = self._input_grid(ctx, meta_in, m)
            # (an index past the batch, where the batch is not the voxel count, is left missing: the
            # flag above is then the error run() reports, not the layers' reads)
            self.emit_taps(ctx, g, c, voxel_offset,
                           lambda tap, index: ctx.store(y, tap, f"({index} if {index} < {n} else -1)"))

    def emit_taps(self, ctx, g: GridRef, c: list[str], voxel_offset: str, store) -> None:
        """Emit the loop over the taps of output voxel c: the input voxel each reads, looked up in the
        input grid (through one leaf when the whole stencil lies in it), stored by store(tap, index)."""
        geo = self.geo
        K, S, P = geo.kernel, geo.stride, geo.padding
        fdiv = ctx.use_helper("floor_div", "nanovdb")
        ctx.use_helper("nvdb_value", "nanovdb")  # GridRef.lookup's traversal
        # the stencil box's low corner per axis and its extent (the same on every axis: the widest)
        if self.transposed:
            # c_in = (c + P - d) / S for d in [0, K): between floor((c + P - K + 1) / S) and floor((c + P) / S)
            base = [ctx.let(f"{fdiv}({ix.add(c[a], str(P[a] - K[a] + 1))}, {S[a]})" if S[a] > 1
                            else ix.add(c[a], str(P[a] - K[a] + 1)), "lo") for a in range(3)]
            span = max(-(-(K[a] - 1) // S[a]) for a in range(3))
        else:
            base = [ctx.let(ix.add(ix.mul(c[a], S[a]), str(-P[a])) if P[a] else ix.mul(c[a], S[a]), "lo")
                    for a in range(3)]
            span = max(K) - 1
        stencil = g.stencil_leaf(base, 0, span)
        with ctx.loop(geo.taps, "tap") as tap:
            d = [ctx.let(ix.div(tap, K[1] * K[2]), "da"), ctx.let(ix.mod(ix.div(tap, K[2]), K[1]), "db"),
                 ctx.let(ix.mod(tap, K[2]), "dc")]
            index = ctx.fresh("index")
            ctx.line(f"{index} = -1")
            valid = []
            if self.transposed:
                q = [ctx.let(f"{c[a]} + {P[a]} - {d[a]}", "q") for a in range(3)]
                src = [ctx.let(f"{fdiv}({q[a]}, {S[a]})", "src") if S[a] > 1 else q[a] for a in range(3)]
                valid = [f"{src[a]} * {S[a]} == {q[a]}" for a in range(3) if S[a] > 1]
            else:
                src = [f"{base[a]} + {d[a]}" for a in range(3)]
            if valid:
                ctx.line(f"if {' and '.join(valid)}:")
                ctx.level += 1
            v = g.cached_lookup(stencil, src)
            ctx.line(f"if {v} > 0:")
            with ctx.indent():
                ctx.line(f"{index} = {voxel_offset} + {v} - 1")
            if valid:
                ctx.level -= 1
            store(tap, index)

    def forward(self, ctx):
        with ctx.loop(self.work_items(), "item") as item:
            self.emit_item(ctx, item)

    def describe(self):
        kind = "transposed " if self.transposed else ""
        where = ("a thread per voxel of the output grid, bound at run time (a voxel a sample)" if self.voxel_batch
                 else f"a thread per voxel slot of the output grid's {self.leaves} leaves")
        return f"{kind}kernel map, kernel {list(self.geo.kernel)}, stride {list(self.geo.stride)}: {where}"
