"""InjectToDense (fVDB's inject_to_dense_cmajor, ops/InjectToDense.cu): voxel features into a dense box,
in fVDB's [B, C, X, Y, Z], spconv's [B, C, Z, Y, X] or the bird's-eye view [B, C*Z, Y, X].

A work item is one cell of one grid's box: its ijk is looked up in the grid (one NanoVDB getValue),
and the cell's C outputs are the features of that voxel, or 0. Gathering per cell, not scattering
per voxel as fVDB does, writes every output once with no zeroing pass and no atomics, and drops the
voxels outside the box without a test. In all three layouts the flat output index is
(b*C + c) * cells + cell, cell the cell's rank in the layout's spatial order (BEV's channel
c*Z + z: (b*C + c)*Z*Y*X + (z*Y + y)*X + x), so the layout changes only how a cell's rank splits
into x, y, z.

The grid may be bound at run time, and so may the features' rows (read by the row the grid gives,
checked against the grid's voxels when bound), as for the samplers: the output's size is the box's.

So may the grid count (grid_count.py: grid_byte_offsets, voxel_sizes, origins, batch_offsets and the
data's joffsets with a dynamic first dimension, checked against the blob when bound). The box then has
G rows known only when the grids are bound, so the output is sized at run time (luisaml/dynamic.py,
`BoundRows.sized_at_run`): a first phase copies the derived count into the node's scratch, the host
reads it back (the output's rows), and a thread per cell walks the G grids. As every run-time sized
output, it is a graph output (the 2-D layers after it are a network of their own, batched over the G
boxes). min_coord is then one corner for every grid (3 per grid would fix the count).
"""
from __future__ import annotations

import numpy as np

from luisaml import dtypes
from luisaml import indexing as ix
from luisaml.dynamic import HostRead, HostResult, Phase
from luisaml.model import shape_str
from luisaml.operator import Derived
from luisaml.opsets import fvdb as schema
from luisaml.opsets import fvdb_dense as dense_schema
from luisaml.registry import register
from luisaml.storage import Buffer

from .common import META_FIELDS, GridOp, GridRef, Meta, grid_metadata_for_data, rule_types

def _count_rows(words: np.ndarray) -> HostResult:
    """The box's rows: the grid count the first phase copied into the scratch (read back)."""
    return HostResult({0: int(words[0])})


@register(dense_schema.INJECT_TO_DENSE, domain="fvdb", since=1)
class InjectToDense(GridOp):
    """dense[b, c, cell] = data[voxel at min_coord[b] + cell, c], 0 where that voxel is inactive."""

    specs = dense_schema.OPS
    shared_jagged = (0,)  # the voxel data: read at the row the grid gives, not per sample
    any_grid = any_voxel_data = any_count = True
    stores_once = True

    @classmethod
    def infer(cls, node, inputs):
        return rule_types(node, inputs, lambda ins: [dense_schema.inject_to_dense_rule(ins, node.attrs)])

    @classmethod
    def sized_at_run(cls, node, bound) -> tuple[int, ...]:
        # a box per grid: with the grid count bound at run time, G rows known only then
        return (0,) if len(node.inputs) > 1 and node.inputs[1] in bound else ()

    def check_jagged(self, jt, shared: bool) -> None:
        d = jt.jdata
        self.expect(not d.batched, f"{jt.name}_jdata '{d.name}' {shape_str(d.shape)} follows the batch axis (the "
                    "voxels as the batch: a sparse network over grids bound at run time); the dense box has no "
                    "batch dimension, so this node would gather every sample into one tensor, which a network "
                    "over a batch cannot do yet. Split the model at this node: a network whose features are an "
                    "input with rows bound at run time (batch_axis=None) runs it over grids of any size")
        super().check_jagged(jt, shared)

    def check_inputs(self):
        data = self.jagged[0].jdata
        self.expect_dtype(data, ("FLOAT",), "data_jdata")
        self.expect(data.rank == 2, f"data_jdata '{data.name}' must be [N, C], got {shape_str(data.shape)}")
        self.voxels, self.channels = data.shape
        self.size = [int(v) for v in self.attr("grid_size")]
        self.expect(len(self.size) == 3 and min(self.size) >= 1, f"grid_size must be 3 positive ints, got {self.size}")
        lo = [int(v) for v in self.attr("min_coord")]
        self.expect(len(lo) == 3 or not self.count_bound, f"min_coord has {len(lo)} ints (3 per grid), but the grid "
                    "count is bound at run time: give one corner (3 ints) for every grid, or a fixed grid count")
        self.expect(len(lo) in (3, 3 * self.B), f"min_coord must be 3 ints or 3 per grid ({3 * self.B}), got {lo}")
        self.min_coord = np.array(lo * (self.B if len(lo) == 3 else 1), np.int64).reshape(self.B, 3)
        top = self.min_coord + np.array(self.size) - 1
        self.expect(self.min_coord.min() >= -2**31 and top.max() < 2**31, f"the box {lo} + {self.size} leaves int32")
        self.layout = self.attr("layout", "CXYZ")
        self.expect(self.layout in dense_schema.DENSE_LAYOUTS, f"layout must be one of {dense_schema.DENSE_LAYOUTS}, got "
                    f"{self.layout!r}")
        _, want = dense_schema.inject_to_dense_rule([None, (0, [self.B])] + [None] * 5 + [(1, [0, self.channels])]
                                              + [None] * 3, {"grid_size": self.size, "layout": self.layout})
        # a grid count bound at run time: G rows, sized at run time (0 here: lowering's run-time tensor)
        self.runtime_sized = (0,) if self.count_bound else ()
        self.expect_shape(self.output(), (0,) * self.count_bound + tuple(want[self.count_bound:]), "output")

    def metadata_params(self):
        return (("expect_voxels", self.voxels),)

    def derived_inputs(self):
        data = self.jagged[0].jdata
        k = len(schema.BUNDLE)  # input index of data_jdata
        bound = getattr(data, "bound_rows", None) is not None
        if self.count_bound:  # [the metadata, the grid count] (grid_count.py)
            return self.counted_derived(data=k if bound else None)
        if not bound:
            return super().derived_inputs()
        # the voxel data's rows are known when it is bound: checked then against the grids' voxels
        return [Derived(grid_metadata_for_data, tuple(range(6)) + (k,), dtypes.INT32, (self.B, META_FIELDS),
                        shape_only=(k,))]

    def work_items(self):
        return self.B * int(np.prod(self.size))

    def scratch(self):
        return {"int": 1} if self.count_bound else {}

    def phases(self):
        """A grid count bound at run time: the count read back (the box's rows), then a thread per cell
        over every grid."""
        def count(ctx, item):
            ctx.line(Buffer("scratch_int").store("0", self.derived[1].load("0")))

        def cells(ctx, cell):
            grids = ctx.let(self.derived[1].load("0"), "ngrids")
            with ctx.loop(grids, "b") as b:
                self._emit_cell(ctx, b, cell)

        return [Phase("grid count", 1, count, readback=HostRead(0, 1, _count_rows)),
                Phase("cells of every grid", int(np.prod(self.size)), cells)]

    def _box_corner(self, ctx, b: str) -> list[str]:
        """Return min_coord of grid b per axis (literals when every grid shares one box)."""
        if (self.min_coord == self.min_coord[0]).all():
            return [str(int(v)) for v in self.min_coord[0]]
        out = []
        for a in range(3):
            expr = str(int(self.min_coord[-1, a]))
            for k in range(self.B - 2, -1, -1):
                expr = f"({int(self.min_coord[k, a])} if {b} == {k} else {expr})"
            out.append(ctx.let(expr, "lo"))
        return out

    def emit_item(self, ctx, item):
        cells = int(np.prod(self.size))
        b = ctx.let(ix.div(item, cells), "b") if self.B > 1 else "0"
        cell = ctx.let(ix.mod(item, cells), "cell") if self.B > 1 else item
        self._emit_cell(ctx, b, cell)

    def _emit_cell(self, ctx, b: str, cell: str) -> None:
        """Emit the C outputs of one cell of grid b's box: its voxel's features, or zeros."""
        X, Y, Z = self.size
        C, cells = self.channels, X * Y * Z
        data, y, meta = self.jagged[0].jdata, self.output(), self.derived[0]
        if self.layout == "CXYZ":  # z fastest
            xyz = [ix.div(cell, Y * Z), ix.mod(ix.div(cell, Z), Y), ix.mod(cell, Z)]
        else:  # x fastest
            xyz = [ix.mod(cell, X), ix.mod(ix.div(cell, X), Y), ix.div(cell, X * Y)]
        lo = self._box_corner(ctx, b)
        ijk = [ctx.let(ix.add(c, o) if o != "0" else c, "c") for c, o in zip(xyz, lo)]
        # grid b, read through its metadata row as GridOp.point_loop does
        ctx.use_helper("nvdb_value", "nanovdb")
        blob, base = self.input(0).storage.byte_address()
        m = ctx.let(ix.mul(b, META_FIELDS), "m")

        def field(f: Meta) -> str:
            return meta.load(ix.add(m, str(int(f))))

        tiles = ctx.let(ix.add(base, field(Meta.TILES)) if base != "0" else field(Meta.TILES), "tiles")
        g = GridRef(ctx, blob, tiles, ctx.let(field(Meta.TILE_COUNT), "ntiles"), field)
        v = ctx.let(g.lookup(ijk), "v")
        first = ctx.let(ix.mul(ix.mul(b, C), cells), "o")  # output index of (b, channel 0, this cell)
        ctx.line(f"if {v} > 0:")
        with ctx.indent():
            row = ctx.let(ix.mul(f"({g.voxel_offset} + {v} - 1)", C), "row")
            with ctx.loop(C, "ch") as ch:
                ctx.store(y, ix.add(ix.add(first, ix.mul(ch, cells)), cell), data.load(ix.add(row, ch)))
        ctx.line("else:")
        with ctx.indent(), ctx.loop(C, "ch") as ch:
            ctx.store(y, ix.add(ix.add(first, ix.mul(ch, cells)), cell), "0.0")

    def forward(self, ctx):
        with ctx.loop(self.work_items(), "item") as item:
            self.emit_item(ctx, item)

    def describe(self):
        if self.count_bound:
            return (f"a thread per cell of the {'x'.join(map(str, self.size))} box, over every grid of a count bound "
                    f"at run time (read back: the output's rows): a NanoVDB lookup a grid, {self.channels} channels, "
                    f"layout {self.layout}")
        return (f"a thread per cell of the {'x'.join(map(str, self.size))} box of each of {self.B} grid(s): one "
                f"NanoVDB lookup, {self.channels} channels, layout {self.layout}")
