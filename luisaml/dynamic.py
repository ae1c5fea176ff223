"""Outputs whose row count is known only at run time: the phases such a node runs as, the in-place
prefix sum they share, and what the runtime reads back between them.

A node whose output size depends on the data (fVDB's rays: how many voxels each ray crosses)
declares those outputs in `Operator.runtime_sized` and runs as a sequence of phases, one stage
each (schedule.py): a count phase writes each work item's row count into an offsets tensor of
static size, the scan phases below turn it into exclusive offsets in place, the host reads back
the one total it needs to allocate (the scan's last phase names it, a `TotalRead`; the runtime's
`Readback`, launch.py), and the fill phase writes every
item's rows at its offset. The count and the fill run the same code, so they agree; a fill that
would pass its item's range flags a run-time error naming the node instead of writing.

A node that needs more than one total (a grid builder: how many bytes each new grid takes, how
many leaves it has) marks its read-back phase with a `HostRead` instead: the runtime reads
`count` int32 words of the node's own int scratch (`Operator.scratch`, device memory that persists
from its first phase to its last) and gives them to the node's host step, which returns the rows of
each run-time sized output and small arrays to write into that scratch before the next phase (a
HostResult; a step may raise RunError for what the device flagged). A node may have any number of
read-back phases; each one splits the launch there (launch.py). The host step is O(what it reads):
per-grid headers, never per-voxel work.

Why no shared memory: the CPU backend cannot compile it. The scan is three plain stages over
SCAN_CHUNK-sized chunks: each chunk scanned by one thread, the chunk totals chained by one
thread (items / SCAN_CHUNK additions), then every element adds its chunk's base. For 1M rays that
is 4,096 sequential steps in the middle stage; everything else is parallel.

Run-time sized uint8 outputs are ByteBuffers the node writes word-wise (a new grid's blob). No node
may read such an output (lowering says which and why), there is no per-sample `forward`, and an
artifact cannot hold one yet. On torch CUDA tensors such an output is a torch tensor allocated once
its rows are read back and written in place (DLPack, zero_copy.py `run`): a fresh one each run, so
no run's result aliases another's. The count may size a dimension other than the first
(`Operator.runtime_axis`, `IOSpec.rows_axis` / `sized_shape`: NonZero's [rank, N]). Ops with one
output (NonZero, NonMaxSuppression, the luisaml domain's RotatedNMS / CircleNMS:
operators/detection.py) keep their counts and offsets in their own int scratch and read the total
back with a HostRead of one word; their output spans the batch, so a batched input compiles per
batch size (BatchMixingError).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

SCAN_CHUNK = 256


@dataclass
class HostResult:
    """What a node's host step returns: rows of its run-time sized outputs (by output index) and
    (word index, int32 words) to write into the node's int scratch before its next phase runs."""

    rows: dict[int, int]
    writes: list[tuple[int, np.ndarray]] = field(default_factory=list)


@dataclass(frozen=True)
class HostRead:
    """A read-back of `count` int32 words from word `index` of the node's int scratch, handed to
    step(words) -> HostResult (which may raise RunError)."""

    index: int
    count: int
    step: Callable[[np.ndarray], HostResult]


@dataclass(frozen=True)
class TotalRead:
    """A read-back of one int32 element: element `index` of `offsets`, the node's static-size tensor
    whose counts scan_phases turned into offsets in place (their total: the rows of the node's
    run-time sized outputs)."""

    offsets: Any  # a storage.Tensor (read back by its name)
    index: int


@dataclass(frozen=True)
class Phase:
    """One stage of a phased node: `items` threads run emit(ctx, item); readback: what the host reads
    back after this phase, before the next is launched: a TotalRead (the one total of a prefix sum),
    or a HostRead for the node's own host step; None: nothing. threads: 0, or a blocks stage (CUDA
    only: shared memory and barriers) of `items` blocks of that many threads, emit(ctx, item, thread)
    (a recurrence's whole sequence in one launch: operators/rnn_block.py)."""

    name: str
    items: int
    emit: Callable[..., None]
    readback: TotalRead | HostRead | None = None
    threads: int = 0


@dataclass
class Readback:
    """What the runtime reads between two stages: element `index` of tensor `tensor` (a graph
    output or a pooled buffer), the row count of the node's run-time sized `outputs`."""

    after_stage: int  # the last stage launched before the read
    tensor: str
    index: int
    node: str  # the node's description, for errors
    outputs: list[str] = field(default_factory=list)  # run-time sized tensors with this many rows
    # a HostRead phase: tensor is "" and index/count address the int scratch; step returns the rows
    # of each output (by name) and the scratch writes
    count: int = 1
    step: Callable[[np.ndarray], HostResult] | None = None


def readback_of(stage: int, node, op, phase: Phase) -> Readback:
    """Return the Readback after `stage`, a phase of node (its operator op) that reads back."""
    sized = [node.outputs[j] for j in op.runtime_sized if j < len(node.outputs) and node.outputs[j]]
    if isinstance(phase.readback, HostRead):
        hr = phase.readback

        def step(words: np.ndarray) -> HostResult:
            res = hr.step(words)
            rows = {node.outputs[j]: int(r) for j, r in res.rows.items() if j < len(node.outputs) and node.outputs[j]}
            return HostResult(rows, res.writes)

        return Readback(stage, "", hr.index, node.describe(), sized, hr.count, step)
    total = phase.readback
    return Readback(stage, total.offsets.name, int(total.index), node.describe(), sized)


def download_words(buf, index: int, count: int) -> np.ndarray:
    """Return int32 words index..index+count of a device buffer, downloading only those bytes."""
    from luisa import globalvars, lcapi

    out = np.zeros(max(count, 1), np.int32)
    if count:
        stream = globalvars.vars.stream
        stream.add(lcapi.BufferDownloadCommand.create(buf.handle, int(index) * 4, count * 4, out))
        stream.synchronize()
    return out[:count]


def upload_words(buf, index: int, words: np.ndarray) -> None:
    """Write int32 words into a device buffer from word `index` (ordered before later launches)."""
    from luisa import globalvars, lcapi

    words = np.ascontiguousarray(words, np.int32).reshape(-1)
    if words.size:
        stream = globalvars.vars.stream
        stream.add(lcapi.BufferUploadCommand.create(buf.handle, int(index) * 4, words.size * 4, words))
        stream.synchronize()  # (the array must outlive the copy)


def scan_phases(offsets, count: int) -> list[Phase]:
    """Return the phases turning offsets[1..count] (per-item counts, as the count phase wrote them)
    into the exclusive prefix sum offsets[0..count] in place; the last one reads back the total
    offsets[count] (a TotalRead: the caller replaces it where offsets is scratch, not a Tensor the
    runtime can read by name). `offsets` is the Tensor (count + 1 elements)."""
    chunks = max(-(-count // SCAN_CHUNK), 1)

    def chunk_scan(ctx, item):
        # offsets[1 + c*CHUNK .. ] become the running sums inside chunk c
        first = ctx.let(f"1 + {item} * {SCAN_CHUNK}", "first")
        last = ctx.let(f"min({first} + {SCAN_CHUNK}, {count + 1})", "end")
        acc = ctx.fresh("acc")
        ctx.line(f"{acc} = 0")
        k = ctx.fresh("k")
        ctx.line(f"for {k} in range({first}, {last}):")
        with ctx.indent():
            ctx.line(f"{acc} += {offsets.load(k)}")
            ctx.line(offsets.store(k, acc))

    def chain(ctx, item):
        # each chunk's last element becomes the global running sum (one thread, `chunks` steps)
        ctx.line(offsets.store("0", "0"))
        c = ctx.fresh("c")
        ctx.line(f"for {c} in range(1, {chunks}):")
        with ctx.indent():
            prev = ctx.let(f"{c} * {SCAN_CHUNK}", "prev")  # chunk c-1's last element
            here = ctx.let(f"min(({c} + 1) * {SCAN_CHUNK}, {count})", "here")
            ctx.line(offsets.store(here, f"{offsets.load(here)} + {offsets.load(prev)}"))

    def add_base(ctx, item):
        # element j of chunk c > 0 (not its last: chain() did that one) adds chunk c-1's total
        j = ctx.let(f"{item} + 1", "j")
        c = ctx.let(f"{item} // {SCAN_CHUNK}", "c")
        ctx.line(f"if {c} > 0 and ({j} % {SCAN_CHUNK} != 0) and {j} != {count}:")
        with ctx.indent():
            ctx.line(offsets.store(j, f"{offsets.load(j)} + {offsets.load(f'{c} * {SCAN_CHUNK}')}"))

    return [Phase("scan chunks", chunks if count else 0, chunk_scan),
            Phase("scan chain", 1, chain),
            Phase("scan add", count if count > SCAN_CHUNK else 0, add_base, readback=TotalRead(offsets, count))]
