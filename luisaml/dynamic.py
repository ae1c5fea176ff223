"""Outputs whose row count is known only at run time: the phases such a node runs as, the in-place
prefix sum they share, and where the host learns each count: at the run's end (counted, on the
device) or between two phases (a read-back).

A node whose output size depends on the data (fVDB's rays: how many voxels each ray crosses)
declares those outputs in `Operator.runtime_sized` and runs as a sequence of phases, one stage
each (schedule.py): a count phase writes each work item's row count into an offsets tensor of
static size, the scan phases below turn it into exclusive offsets in place, and the fill phase
writes every item's rows at its offset. The count and the fill run the same code, so they agree; a
fill that would pass its item's range flags a run-time error naming the node instead of writing.

**Counted on the device** (issue 28's counted execution). Where a phase names a total — a
`TotalRead` (element `index` of the offsets tensor) or a `ScratchTotal` (a word of the node's own int
scratch), the rows of all the node's run-time sized outputs or, with `output`, of that one (a node may
have a total per output, each on its own phase: a Readback each) — nothing waits for it mid-run. The
outputs' buffers are allocated at a capacity in rows (`Capacity`: a power-of-two bucket, learned from
the runs before), the fill's stores at or past the capacity are skipped (storage.Capped; a uint8
output's word writes storage.CappedBytes: the capacity in elements is a word of
the run's state buffer, the kernels' `errors` argument: `StateLayout`), a copy command after the
scan puts the total into that state buffer, and the host reads it at the run's end with the flag
and the outputs, in one synchronisation (launch.py). A total above the capacity re-runs the whole
invocation with the next bucket (the inputs are still on the device): a result is never cut.

**At the run's end.** A node whose host must check what the kernels counted (a device grid build's
error codes, the keys past its room) marks a phase with a `HostRead` flagged `at_end`: its words are
downloaded with the state and the outputs in the run's one wait, and its step runs after it: it may
raise RunError for what the device flagged; its outputs' rows are counted totals. Where a later
phased node of the same network reuses the int scratch (a device build of two grids), the words are
copied on the device right after the phase, then downloaded from that copy (launch.py `_end_sources`).

**Read back mid-run.** A node whose host must act before its later phases (a grid builder laid out by
the host: how many bytes each new grid takes, where it goes; operators/fvdb/build_layout.py, the
switch's older form) marks its read-back phase with a `HostRead`: the runtime
reads `count` int32 words of the node's own int scratch (`Operator.scratch`, device memory that
persists from its first phase to its last) and gives them to the node's host step, which returns
the rows of each run-time sized output and small arrays to write into that scratch before the
next phase (a HostResult; a step may raise RunError for what the device flagged). A node may have
any number of read-back phases; each one splits the launch there (launch.py) and costs one host
synchronisation (the error flag and the words in one download). The host step is O(what it reads):
per-grid headers, never per-voxel work.

Why no shared memory: the CPU backend cannot compile it. The scan is three plain stages over
SCAN_CHUNK-sized chunks: each chunk scanned by one thread, the chunk totals chained by one
thread (items / SCAN_CHUNK additions), then every element adds its chunk's base. For 1M rays that
is 4,096 sequential steps in the middle stage; everything else is parallel.

Run-time sized uint8 outputs are ByteBuffers the node writes word-wise (a new grid's blob), sized
by a HostRead or counted (its words written through CappedBytes.write_word, or guarded by its `limit`). No node may read such an output (lowering says which and why), there is no
per-sample `forward`, and an artifact cannot hold one yet. On torch CUDA tensors a run-time sized
output is a torch tensor allocated for the run (at its capacity, returned as a view of its rows;
a HostRead's exactly) and written in place (DLPack, zero_copy.py `run`): a fresh one each run, so
no run's result aliases another's. The count may size a dimension other than the first
(`Operator.runtime_axis`, `IOSpec.rows_axis` / `sized_shape`: NonZero's [rank, N]); the fill writes
the exact layout's elements from the buffer's start, so the rows are the buffer's first elements
whatever the capacity. Ops with one output (NonZero, NonMaxSuppression, the luisaml domain's
RotatedNMS / CircleNMS: operators/detection.py) keep their counts and offsets in their own int
scratch and name the total with a ScratchTotal; their output spans the batch, so a batched input
compiles per batch size (BatchMixingError).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

SCAN_CHUNK = 256


@dataclass
class HostResult:
    """What a node's host step returns: rows of its run-time sized outputs (by output index) and
    (word index, int32 words) to write into the node's int scratch before its next phase runs; an
    end-of-run step (HostRead.at_end) returns neither (its node's rows come from counted totals): it
    raises what its node flagged."""

    rows: dict[int, int] = field(default_factory=dict)
    writes: list[tuple[int, np.ndarray]] = field(default_factory=list)


@dataclass(frozen=True)
class HostRead:
    """A read-back of `count` int32 words from word `index` of the node's int scratch, handed to
    step(words) -> HostResult (which may raise RunError). at_end: the words are downloaded with the
    state and the outputs in the run's one wait, and the step runs after it (no split of the launch;
    it returns no rows or writes, it may raise)."""

    index: int
    count: int
    step: Callable[[np.ndarray], HostResult]
    at_end: bool = False


@dataclass(frozen=True)
class TotalRead:
    """A read-back of one int32 element: element `index` of `offsets`, the node's static-size tensor
    whose counts scan_phases turned into offsets in place (their total: the rows of the node's
    run-time sized outputs; output: of that one only, by index)."""

    offsets: Any  # a storage.Tensor (read back by its name)
    index: int
    output: int | None = None


@dataclass(frozen=True)
class ScratchTotal:
    """A total of a node whose counts and offsets live in its own int scratch: word `index` (counted
    on the device: copied into the run's state after the phase, read at the run's end); the rows of
    its run-time sized outputs, or of output `output` (by index) alone. first: the rows its outputs'
    first capacity holds at least (0: FIRST_CAPACITY_ROWS), and below which runs never shrink it (a
    grid's blob: a one-voxel grid's bytes a grid, the least a non-empty grid takes, where 256 bytes
    would repeat every first run)."""

    index: int
    output: int | None = None
    first: int = 0


@dataclass(frozen=True)
class Phase:
    """One stage of a node with run-time sized outputs or phases: `items` threads run emit(ctx, item);
    readback: where the total this phase completes is (a TotalRead or ScratchTotal: counted on the
    device, read at the run's end), or a HostRead for the node's own host step (between this phase
    and the next); None: nothing. threads: 0, or a blocks stage (CUDA only: shared memory and
    barriers) of `items` blocks of that many threads, emit(ctx, item, thread) (a recurrence's whole
    sequence in one launch: operators/rnn_block.py)."""

    name: str
    items: int
    emit: Callable[..., None]
    readback: TotalRead | ScratchTotal | HostRead | None = None
    threads: int = 0


@dataclass
class Readback:
    """Where the runtime finds a node's row count: element `index` of tensor `tensor` (a graph output
    or a pooled buffer; "": word `index` of the int scratch), the rows of the node's run-time sized
    `outputs`. counted: read at the run's end from the state buffer, where a copy after stage
    `after_stage` puts it; else read between that stage and the next (a HostRead's step)."""

    after_stage: int  # the last stage launched before the read
    tensor: str
    index: int
    node: str  # the node's description, for errors
    outputs: list[str] = field(default_factory=list)  # run-time sized tensors with this many rows
    # a HostRead phase: tensor is "" and index/count address the int scratch; step returns the rows
    # of each output (by name) and the scratch writes
    count: int = 1
    step: Callable[[np.ndarray], HostResult] | None = None
    counted: bool = False
    at_end: bool = False  # a HostRead whose words come with the run's end (its step checks them)
    first: int = 0  # a counted total's first capacity in rows (ScratchTotal.first)


def sized_by(node, op, total) -> list[str]:
    """The run-time sized outputs of node (its operator op) whose rows `total` gives (a phase's
    readback): the one it names (TotalRead / ScratchTotal `output`), else all of them."""
    only = getattr(total, "output", None)
    return [node.outputs[j] for j in op.runtime_sized
            if j < len(node.outputs) and node.outputs[j] and (only is None or j == only)]


def readback_of(stage: int, node, op, phase: Phase) -> Readback:
    """Return the Readback after `stage`, a phase of node (its operator op) that reads back."""
    sized = sized_by(node, op, phase.readback)
    if isinstance(phase.readback, HostRead):
        hr = phase.readback

        def named(j: int) -> str | None:
            return node.outputs[j] if j < len(node.outputs) and node.outputs[j] else None

        def step(words: np.ndarray) -> HostResult:
            res = hr.step(words)
            rows = {named(j): int(r) for j, r in res.rows.items() if named(j)}
            return HostResult(rows, res.writes)

        return Readback(stage, "", hr.index, node.describe(), [] if hr.at_end else sized, hr.count, step,
                        at_end=hr.at_end)
    counted = counted_on_device(op, phase)
    if isinstance(phase.readback, ScratchTotal):
        return Readback(stage, "", int(phase.readback.index), node.describe(), sized, counted=counted,
                        first=int(phase.readback.first))
    total = phase.readback
    return Readback(stage, total.offsets.name, int(total.index), node.describe(), sized, counted=counted)


def counted_on_device(op, phase: Phase) -> bool:
    """Whether the total `phase` completes stays on the device until the run's end: a TotalRead or
    ScratchTotal (its outputs at a capacity: storage.Capped, bytes storage.CappedBytes)."""
    return isinstance(phase.readback, (TotalRead, ScratchTotal))


def counted_outputs(stages) -> list[str]:
    """The run-time sized tensors whose counts stay on the device, in stage order (a schedule's
    stages: their phases' read-backs)."""
    out: list[str] = []
    for st in stages:
        if st.readback is None or st.phase is None:
            continue
        node, op = st.root
        phase = op.phases()[st.phase]
        if counted_on_device(op, phase):
            out += [name for name in sized_by(node, op, phase.readback) if name not in out]
    return out


@dataclass(frozen=True)
class StateLayout:
    """The int32 words of a run's state buffer (the kernels' `errors` argument): word 0 the run-time
    error flag, then each counted output's capacity in elements (the fill's store guard), then each
    counted read-back's total (copied there after its phase, read at the run's end)."""

    outputs: tuple[str, ...]  # the counted outputs (Plan.counted)
    totals: int  # the counted read-backs

    @property
    def size(self) -> int:
        return 1 + len(self.outputs) + self.totals

    def capacity_word(self, name: str) -> int:
        return 1 + self.outputs.index(name)

    def total_word(self, k: int) -> int:
        return 1 + len(self.outputs) + k


FIRST_CAPACITY_ROWS = 256  # a counted output's first capacity (tests lower it to force a re-run)


def bucket(rows: int) -> int:
    """The capacity bucket that holds `rows`: the next power of two, at least FIRST_CAPACITY_ROWS."""
    cap = max(int(FIRST_CAPACITY_ROWS), 1)
    while cap < rows:
        cap *= 2
    return cap


class Capacity:
    """The rows a network's counted outputs are allocated with, per output: a bucket, grown past a
    run's total when that run overflowed (the run is repeated), shrunk when runs use under a quarter of
    it (the buffers are downloaded whole at the run's end), never below its first (`floor`: an output's
    own first capacity, ScratchTotal.first)."""

    def __init__(self, floor: dict[str, int] | None = None) -> None:
        self.rows: dict[str, int] = {}
        self.floor = dict(floor or {})
        self.last: dict[str, int] = {}  # each output's rows at the last run (launch.KernelLauncher._expected)

    def __getitem__(self, name: str) -> int:
        if name not in self.rows:
            self.rows[name] = self.floor.get(name, bucket(0))
        return self.rows[name]

    def __setitem__(self, name: str, rows: int) -> None:
        self.rows[name] = int(rows)

    def settle(self, name: str, total: int, fits: Callable[[int], bool]) -> bool:
        """Record a run's total for output `name`; return True when it overflowed the capacity (which
        then grows to total's bucket, or to total itself where the bucket would pass the limits: fits)."""
        cap = self[name]
        self.last[name] = int(total)
        if total > cap:
            grown = bucket(total)
            self.rows[name] = grown if fits(grown) else total
            return True
        least = self.floor.get(name, bucket(0))
        if total * 4 < cap and cap > least:
            self.rows[name] = max(bucket(2 * total), least)
        return False


def download(buf, byte_offset: int, out: np.ndarray) -> None:
    """Enqueue the copy of out.nbytes bytes of a device buffer from byte_offset into out (no wait:
    the caller synchronises once for all its downloads, and keeps out alive until then)."""
    from luisa import globalvars, lcapi

    if out.nbytes:
        globalvars.vars.stream.add(lcapi.BufferDownloadCommand.create(buf.handle, int(byte_offset), out.nbytes, out))


def copy_word(src, src_index: int, dst, dst_index: int) -> None:
    """Enqueue the copy of int32 word src_index of buffer src into word dst_index of dst, on the device."""
    copy_words(src, src_index, dst, dst_index, 1)


def copy_words(src, src_index: int, dst, dst_index: int, count: int) -> None:
    """Enqueue the copy of `count` int32 words of buffer src from word src_index into dst from word
    dst_index, on the device."""
    from luisa import globalvars, lcapi

    globalvars.vars.stream.add(lcapi.BufferCopyCommand.create(src.handle, dst.handle, int(src_index) * 4,
                                                              int(dst_index) * 4, int(count) * 4))


def upload_words(buf, index: int, words: np.ndarray) -> None:
    """Write int32 words into a device buffer from word `index`: enqueued, ordered before later
    launches (the stream keeps the array until it has run)."""
    from luisa import globalvars, lcapi

    words = np.ascontiguousarray(words, np.int32).reshape(-1)
    if words.size:
        stream = globalvars.vars.stream
        stream.add(lcapi.BufferUploadCommand.create(buf.handle, int(index) * 4, words.size * 4, words))
        stream.add_upload_buffer(words)


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
