"""The parts of the Operator protocol only fVDB's operators have (operators/fvdb/), as two mixins: the
rules the passes ask of an operator class some of whose inputs may have rows bound at run time
(`BoundRows`), and what a node over a grid's voxels as the batch says of its rows (`VoxelBatch`).

The compiler's middle sees them through two generic attributes of the Operator base, False there:
`Operator.bound_rows` (the class has the rules below: passes/infer.py asks them only then) and
`Operator.spans_batch` (the node sees the whole batch: emission.py). The rows a
VoxelBatch node links are read by luisaml/fvdb/voxel_rows.py alone. A mixin comes before the
Operator base among a class's bases, so that its attributes win.

Inputs with rows bound at run time: a graph input whose only dynamic dimension is its first, not the
batch, is bound at run time when every node reading it says it can take any number of rows
(`BoundRows.reads_bound_rows`: fVDB's per-point and per-ray ops for the grid bytes, leaf and list
indices, the sampling ops for their voxel data, all read by index through the metadata derived when
a grid is bound). The passes probe those rows at two values and refuse a model where any other shape
or folded constant follows them (passes/infer.py, `bound_inputs`); the runtime accepts any rows for
them, and the derived metadata checks the voxel data against the grid when it is bound. The grid
count is such rows too (grid_byte_offsets, voxel_sizes, origins, batch_offsets and joffsets of the
per-point and ray ops, the kernel maps and InjectToDense, `extra_rows` 1 for the offsets): its inputs
are checked against the blob's grids when bound (operators/fvdb/grid_count.py). An attribute
where an exporter pinned the traced example's size (`BoundRows.pinned_by_example`: the kernel map's
`output_voxels`) is dropped from a node reading such inputs. A kernel map whose grids are bound
gives the probe's batch as its rows (`BoundRows.probe_rows`, given the probe by passes/infer.py). A
node whose output follows the grid count (InjectToDense's [G, C, ...] box) sizes it at run time when
the count is bound (`BoundRows.sized_at_run`, asked by lowering.py).
"""
from __future__ import annotations

from typing import ClassVar


class BoundRows:
    """Mixin of an operator class some of whose inputs may have rows bound at run time (any number,
    one compiled network for all: passes/infer.py, bound_inputs): fVDB's grid bytes and voxel data."""

    bound_rows: ClassVar[bool] = True  # (Operator.bound_rows: the passes ask the rules below)

    @classmethod
    def reads_bound_rows(cls, op_type: str, k: int) -> bool:
        """Whether input k may have rows bound at run time: only when the node reads it by index and
        nothing it computes depends on its size."""
        return False

    @classmethod
    def extra_rows(cls, op_type: str, k: int) -> int:
        """Rows input k has beyond its fellows' count when its rows are bound at run time: 1 for
        offsets ([G+1] beside a grid batch's [G]: batch_offsets, joffsets), else 0. The passes probe
        it at that many rows more (passes/infer.py), so that the node sees a consistent batch."""
        return 0

    @classmethod
    def pinned_by_example(cls, op_type: str) -> tuple[str, ...]:
        """Attributes in which an exporter wrote a size of the example it traced (SparseConvKernelMap's
        output_voxels): dropped when the node reads inputs whose rows are bound at run time, as its
        rule then derives that size from them."""
        return ()

    @classmethod
    def probe_rows(cls, node, probe, inputs) -> list | None:
        """Return [(elem_type, shape)] per output while the passes probe a batch size
        (luisaml.passes.infer.Probe: the batch, the inputs bound at run time) for a node whose
        output has the batch's rows without following a batched input row for row (inputs: the
        node's input Variables, None where absent); None: `infer` decides."""
        return None

    @classmethod
    def sized_at_run(cls, node, bound) -> tuple[int, ...]:
        """Return the outputs (by index) sized at run time because inputs of the node have rows bound
        then (`bound`: their names): InjectToDense's box of a grid count bound at run time, [G, ...].
        Such an output is run-time sized as Operator.runtime_sized's (luisaml/dynamic.py: the node
        runs as phases, the host reads its rows back): the passes let its first dimension follow the
        probes' rows (passes/infer.py), lowering sizes it at run time."""
        return ()


class VoxelBatch:
    """Mixin of an operator whose node may run over a grid's voxels as the batch, a voxel a sample
    (operators/fvdb/kernel_map.py): its check() sets `voxel_batch`, and the node then sees the whole
    batch (Operator.spans_batch: it reads rows of other samples at indices it computes, or checks
    the batch size against the grids' voxels)."""

    voxel_batch: bool = False  # the voxels are the batch (set by check())

    @property
    def spans_batch(self) -> bool:
        return self.voxel_batch

    def row_links(self) -> list[tuple[str, str]] | None:
        """Pairs of names whose batched rows hold the same things (a tensor; voxel_rows.GRID + a
        batch_offsets tensor: that grid's voxels; voxel_rows.INDICES + a map: the rows its indices
        name), luisaml/fvdb/voxel_rows.py; None when the voxels are not the batch: its batched inputs
        and outputs then share rows sample for sample."""
        return None
