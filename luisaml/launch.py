"""Launching a network's kernels: its stages enqueued on LuisaCompute's stream as one command list,
split only where a host step must read words back mid-run (luisaml/dynamic.py HostRead), the
counts that size run-time sized outputs kept on the device and read with the outputs at the end
(one host synchronisation a run, a re-run where a count passed its capacity), the run-time error
flag raised as RunError naming the node, the end-of-run host steps (dynamic.HostRead.at_end: their
words read in the same wait, what their nodes flagged raised), and the first launch's kernel build (under a
lock, or by workers)."""
from __future__ import annotations

import contextlib
import itertools
import os
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from . import cache, device, resident
from .dispatch import Launcher
from .dynamic import Capacity, StateLayout, bucket, copy_word, copy_words, download, upload_words
from .errors import LimitError, RunError
from .feeds import io_dtype
from .log import SLOW_BUILD_S, note, phase
from .luisa_compat import upload_prefix
from .pool import BufferPool

if TYPE_CHECKING:
    from .plan import IOSpec, Plan

# launches after which the command list is committed without waiting, so the device starts on the first
# ones while the host encodes the rest (0: one commit a segment, at its wait; None: the backend's own).
# On CUDA, ResNet-18 at batch 8 on an H100: net.run's wall 2.33 ms with 0, 1.82 with 4, 1.95 with 16,
# interleaved in one process (benchmarks/experiments/profile_run_host.py; NOTES.md, "net.run's wall
# time"). The CPU backend keeps one commit (not measured there).
FLUSH_LAUNCHES: int | None = None
BACKEND_FLUSH = {"cuda": 4}
# A counted output is downloaded at the run's end before its rows are known: its whole capacity (up to 4x
# its rows: dynamic.Capacity), unless that passes the last run's rows and an eighth by more than this
# many bytes; then only those, and where the run has more, the rest after a second wait (the detector's
# grid blobs at a power-of-two capacity: 8.4 MB downloaded a frame for 4.9 MB of results, CPU backend;
# 1 MiB: a wait on the H200's host estimated at what ~0.5 MB of pageable download costs, not measured:
# benchmarks/NOTES.md "The grid's layout on the device, built")
SPARE_BYTES = 1 << 20


@dataclass
class Ran:
    """What a run gives back: the rows of its run-time sized outputs, and the outputs it was asked to
    read (numpy, the kernels' dtype, flat: exactly their elements)."""

    rows: dict[str, int] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)


class KernelLauncher:
    """The kernels of one generated module and how a run launches them: `launch` enqueues stages,
    `run` launches them all for n samples and waits once (and once more per mid-run read-back)."""

    def __init__(self, plan: Plan, module, path: str, backend: str, pool: BufferPool):
        self.plan = plan
        self.path = path
        self.backend = backend
        self.pool = pool
        self.kernels = [getattr(module, name) for name in plan.kernels]  # launched in this order
        self.kernel = self.kernels[0] if self.kernels else None  # (a graph of no node has none)
        self._by_name = dict(zip(plan.kernels, self.kernels))
        # kernel-build processes started while the plan was generated (runtime._WorkersAhead), spent
        # at the first launch; None: that launch starts them if there are enough kernels; False: none
        self.build_workers: Any = None
        self.built = False  # whether the kernels were launched once (and so built)
        # the rows each counted output's buffer is allocated with; a total's own first capacity (a grid's
        # blob: its lower bound) where it has one and the limits allow it
        firsts = {name: rb.first for rb in plan.readbacks if rb.counted and rb.first for name in rb.outputs}
        self.capacity = Capacity({name: bucket(rows) if self._fits(name, bucket(rows)) else rows
                                  for name, rows in firsts.items()})
        self.layout = StateLayout(tuple(plan.counted), sum(1 for rb in plan.readbacks if rb.counted))
        self.reruns = 0  # runs repeated because a count passed its capacity (nothing is ever cut)
        # launches enqueued so far: each may write the outputs' buffers, so a host array's bytes that the last
        # run downloaded are still in its buffer only while this stays (luisaml/resident.py's fresh())
        self.writes = 0
        # output -> (a weak reference to the array the last run downloaded it into, whole, and the buffer it
        # came from, byte for byte from 0): `resident_copy`
        self.downloaded: dict[str, tuple[Any, Any]] = {}
        self.late_reads = 0  # runs whose counted outputs passed what was downloaded before the wait (SPARE_BYTES)
        # stages the next runs leave out, set by their caller, who knows they would do nothing: a device
        # grid build's idle radix passes (fvdb/radix_passes.py); never at the first run (it builds them)
        self.skipped: frozenset[int] = frozenset()
        stages = plan.schedule.stages if plan.schedule is not None else []
        self._fused = any(st.domain == "fused" for st in stages)  # (once: a loop over the stages)
        self._takes_batch = plan.schedule is not None and plan.schedule.takes_batch
        # what launch keeps between runs (_enqueue): the shared arguments typed and encoded (a Launcher,
        # rebound to each run's), each stage's launch prepared for them (None: not yet), and the
        # dispatch counts at the batch they were worked out for
        self._launcher: Launcher | None = None
        self._prepared: list = [None] * len(stages)
        self._counts: tuple[int | None, list[int]] = (None, [])
        self._int_at: tuple | None = None  # (the schedule, its int scratch's index among a run's: _int_scratch)

    def _int_scratch(self, scratch):
        """The int scratch buffer of a run's (the kernels take them sorted by DSL type), its index worked
        out once a schedule: the end-of-run reads ask every run."""
        at = self._int_at
        if at is None or at[0] is not self.plan.schedule:
            at = self._int_at = (self.plan.schedule, sorted(self.plan.kernel_scratch).index("int"))
        return scratch[at[1]]

    @property
    def takes_state(self) -> bool:
        """Whether the kernels take the run's state buffer (the `errors` argument)."""
        return bool(self.plan.checks or self.plan.counted)

    def _spec(self, name: str):
        return next(s for s in self.plan.outputs if s.name == name)

    def state(self):
        """The run's state buffer, its upload enqueued: the error flag zeroed, each counted output's
        capacity in elements (the fills' store guard), the totals zeroed (luisaml/dynamic.py)."""
        words = np.zeros(self.layout.size, np.int32)
        for name in self.layout.outputs:
            words[self.layout.capacity_word(name)] = self.capacity[name] * self._spec(name).numel_per_row
        return self.pool.run_state(words)

    def run(self, args: list, n: int, out_bufs: list | None = None, make_output=None,
            read: tuple | list | set = ()) -> Ran:
        """Launch the kernels for n samples with the plan's scratch buffers, download the outputs named
        in `read` and wait, once; raise RunError for what a run-time check flagged (an index out of
        range, naming the node). Run-time sized outputs (luisaml/dynamic.py): a counted one's buffer
        (in args and out_bufs; make_output(spec, rows) gives it when set, else the pool) holds its
        capacity, its total comes back with the outputs, and a total past the capacity runs the whole
        invocation again with a larger one; a HostRead splits the launch there (its words read back,
        its host step run, its outputs sized). Return the rows of the run-time sized outputs and the
        arrays read (cut to their rows)."""
        out_bufs = [] if out_bufs is None else out_bufs
        while True:
            ran, overflowed = self._run_once(args, n, out_bufs, make_output, read)
            if not overflowed:
                return ran
            self.reruns += 1
            note("%s; the run was repeated with room for them, nothing is cut", "; ".join(overflowed))
            for s, buf, count in out_bufs:  # (the re-run adds into them from zero again)
                if s.accumulated and count:
                    upload_prefix(buf, np.zeros(count, s.dtype.kernel_numpy))

    def _run_once(self, args: list, n: int, out_bufs: list, make_output, read) -> tuple[Ran, list[str]]:
        """One launch of every stage (run's body); return (what it gave, the counted outputs whose total
        passed their capacity: the caller runs again)."""
        from luisa import globalvars

        for name in self.layout.outputs:
            self._size_output(name, self.capacity[name], args, out_bufs, make_output)
        state = self.state() if self.takes_state or self.layout.totals else None
        scratch = self.pool.scratch(self.plan, n)
        counted = [rb for rb in self.plan.readbacks if rb.counted]
        after = {rb.after_stage: self._total_copy(rb, k, state, out_bufs, n, scratch) for k, rb in enumerate(counted)}
        launched = n > 0 and self.kernel is not None
        # the end-of-run host steps' words (dynamic.HostRead.at_end), read in the run's one wait
        ends = [rb for rb in self.plan.readbacks if rb.at_end] if launched else []
        end_words = self._end_sources(ends, scratch, after)
        ran = Ran()
        self.downloaded = {}
        start = 0
        for rb in self.plan.readbacks:
            if rb.counted or rb.at_end:
                continue
            if launched:
                self.launch(args, scratch, n, state, span=(start, rb.after_stage + 1), after=after)
            for name, total in self._read_rows(rb, state, out_bufs, n, scratch).items():
                ran.rows[name] = total
                self._size_output(name, total, args, out_bufs, make_output)
            start = rb.after_stage + 1
        if launched:
            self.launch(args, scratch, n, state, span=(start, None) if start else None, after=after)
        words = np.zeros(self.layout.size, np.int32)
        reads = [(state, 0, words)] if state is not None and launched else []
        ends = [(rb, np.zeros(rb.count, np.int32)) for rb in ends]
        for (rb, got), (buf, at) in zip(ends, end_words):
            reads.append((buf, at, got))
        parts = {}  # counted output -> (its buffer, the elements downloaded before the wait)
        for s, buf, count in out_bufs:
            if s.name in read and count:
                ran.arrays[s.name] = np.empty(count, io_dtype(self.plan, s).kernel_numpy)
                part = self._expected(s, count)
                reads.append((buf, 0, ran.arrays[s.name][:part]))
                if s.name in self.layout.outputs:
                    parts[s.name] = (buf, part)
        for buf, offset, out in reads:
            download(buf, offset, out)
        if launched or reads:
            globalvars.vars.stream.synchronize()  # the run's one wait: the flag, the totals, the outputs
        else:
            globalvars.vars.stream.execute()  # (nothing to wait for: the bound inputs' uploads committed)
        self._raise_flagged(int(words[0]))
        # before the totals: a step names what its node's device flagged (which may have left them wrong)
        for rb, got in ends:
            rb.step(got)
        overflowed = []
        for k, rb in enumerate(counted):
            total = int(words[self.layout.total_word(k)]) if launched else 0
            if total < 0:
                raise RunError(f"{rb.node}: its outputs' row count came back as {total} (the sum of its counts "
                               "overflowed 32 bits)")
            for name in rb.outputs:
                self._check_rows(rb, name, total)
                ran.rows[name] = total
                if name not in self.layout.outputs:
                    continue
                room = self.capacity[name]
                if self.capacity.settle(name, total, lambda rows: self._fits(name, rows)):
                    overflowed.append(f"output '{name}' of {rb.node} has {total:,} rows, more than the {room:,} "
                                      f"its buffer held (now {self.capacity[name]:,})")
        if not overflowed:
            self._read_late(parts, ran)
        if not overflowed:
            self.downloaded = {s.name: (weakref.ref(ran.arrays[s.name]), buf) for s, buf, count in out_bufs
                               if s.name in ran.arrays and count}
        for name in self.layout.outputs:
            if name in ran.arrays:
                ran.arrays[name] = ran.arrays[name][:ran.rows[name] * self._spec(name).numel_per_row]
        return ran, overflowed

    def resident_copy(self, name: str, a: np.ndarray, fresh: bool = True) -> tuple[Any, int, Any] | None:
        """Return (the device buffer, a's byte offset there, fresh()) where a's bytes are a contiguous part of
        what the last run downloaded of output `name` (its buffer holds them while no launch of these kernels
        follows: fresh() says so; luisaml/resident.py); None otherwise."""
        held = self.downloaded.get(name)
        if held is None or not isinstance(a, np.ndarray) or not a.flags.c_contiguous:
            return None
        whole, buf = held[0](), held[1]
        if whole is None:
            return None
        at = resident.byte_offset(a, whole)
        if at is None:  # (an address within whole's bytes: whole's memory)
            return None
        writes, me = self.writes, weakref.ref(self)
        return buf, at, (lambda: (k := me()) is not None and k.writes == writes)

    def _expected(self, s, count: int) -> int:
        """The elements of output s (count in its buffer) to download before the run's wait: all of them,
        or for a counted output whose capacity passes its last run's rows and an eighth by more than
        SPARE_BYTES, those (_read_late reads what more the run has)."""
        last = self.capacity.last.get(s.name)
        if last is None:
            return count
        per_row, size = self._spec(s.name).numel_per_row, io_dtype(self.plan, s).itemsize
        part = min(count, (last + last // 8 + 1) * per_row)
        return part if (count - part) * size > SPARE_BYTES else count

    def _read_late(self, parts: dict, ran: Ran) -> None:
        """Download the counted outputs' elements past the part read before the wait, where this run has
        more rows than that part held, and wait for them (one wait for all)."""
        from luisa import globalvars

        late = []
        for name, (buf, part) in parts.items():
            need = ran.rows[name] * self._spec(name).numel_per_row
            if need > part:
                arr = ran.arrays[name]
                late.append((buf, part * arr.itemsize, arr[part:need]))
        if late:
            for buf, offset, out in late:
                download(buf, offset, out)
            globalvars.vars.stream.synchronize()
            self.late_reads += 1

    def _end_sources(self, ends: list, scratch: list, after: dict) -> list[tuple[Any, int]]:
        """(buffer, byte offset) of each end-of-run read's words at the run's end: the int scratch where its
        stage is the last; else (stages of another phased node follow, which reuse the scratch: a device build
        of two grids, luisaml/fvdb/host_steps.py DeviceBuilds.run_pair) a copy on the device right after its
        stage, into a buffer of the pool's (enqueued through `after`, beside a counted total's copy there)."""
        if not ends:
            return []
        src, last = self._int_scratch(scratch), len(self.plan.schedule.stages) - 1
        moved = [rb for rb in ends if rb.after_stage < last]
        kept = self.pool.pooled("end_words", "int", sum(rb.count for rb in moved)) if moved else None
        out, at = [], 0
        for rb in ends:
            if rb.after_stage >= last:
                out.append((src, rb.index * 4))
                continue
            before = after.get(rb.after_stage)

            def copy(before=before, rb=rb, at=at):
                if before is not None:
                    before()
                copy_words(src, rb.index, kept, at, rb.count)
            after[rb.after_stage] = copy
            out.append((kept, at * 4))
            at += rb.count
        return out

    def _total_copy(self, rb, k: int, state, out_bufs: list, n: int, scratch: list):
        """Return what enqueues the copy of counted read-back rb's total (k-th) into the state buffer,
        after its stage: from its offsets tensor's buffer (an output's, or a pooled one) or the int scratch."""
        if rb.tensor:
            buf = self._tensor_buffer(rb.tensor, out_bufs, n)
        else:
            buf = self._int_scratch(scratch)
        word = self.layout.total_word(k)
        return lambda: copy_word(buf, rb.index, state, word)

    def _tensor_buffer(self, name: str, out_bufs: list, n: int):
        """The buffer holding tensor `name`: an output's, or its pooled slot's."""
        buf = next((b for s, b, _ in out_bufs if s.name == name), None)
        if buf is not None:
            return buf
        root = name
        while root in self.plan.main.views:
            root = self.plan.main.views[root]
        slot = next(sl for sl in self.plan.schedule.buffers.slots if root in sl.members)
        return self.pool.pooled(f"buf_{slot.dtype}_{slot.id}", slot.dtype, slot.size * max(n, 1))

    def _fits(self, name: str, rows: int) -> bool:
        """Whether output `name` at `rows` rows is within the limits."""
        s = self._spec(name)
        try:
            self.plan.limits.check_elements(name, rows * s.numel_per_row, io_dtype(self.plan, s).itemsize)
        except LimitError:
            return False
        return True

    def _raise_flagged(self, code: int) -> None:
        """Raise RunError for the check a launch flagged (code k + 1: plan.checks[k], naming the node)."""
        if code:
            k = code - 1
            what = self.plan.checks[k] if 0 <= k < len(self.plan.checks) else f"check {k + 1}"
            advice = " (compile with check_indices=False to clamp such indices instead)" if "index" in what else ""
            raise RunError(what + advice)

    def _check_rows(self, rb, name: str, total: int) -> None:
        """Raise LimitError when output `name` of rb's node would not fit the limits at `total` rows."""
        s = next((s for s in self.plan.outputs if s.name == name), None)
        if s is not None:
            self.plan.limits.check_elements(f"output '{name}' of {rb.node} with {total} rows",
                                            total * s.numel_per_row, io_dtype(self.plan, s).itemsize)

    def _read_rows(self, rb, state, out_bufs: list, n: int, scratch: list) -> dict[str, int]:
        """Return {run-time sized output: rows} of a mid-run read-back, waiting once for the error flag
        and its words together: its one total (a total not counted on the device), or what the node's
        host step makes of the words of the int scratch, whose writes into that scratch are then
        enqueued (luisaml/dynamic.py HostRead)."""
        from luisa import globalvars

        if n <= 0:
            return {name: 0 for name in rb.outputs}
        flag = np.zeros(1, np.int32)
        if state is not None:
            download(state, 0, flag)
        if rb.tensor:  # (a total in a tensor: its element; else words of the int scratch)
            buf, words = self._tensor_buffer(rb.tensor, out_bufs, n), np.zeros(1, np.int32)
        else:
            buf, words = self._int_scratch(scratch), np.zeros(rb.count, np.int32)
        download(buf, rb.index * 4, words)
        globalvars.vars.stream.synchronize()
        self._raise_flagged(int(flag[0]))
        if rb.step is None:
            total = int(words[0])
            if total < 0:
                raise RunError(f"{rb.node}: its outputs' row count read back as {total} (the sum of its counts "
                               "overflowed 32 bits)")
            for name in rb.outputs:
                self._check_rows(rb, name, total)
            return {name: total for name in rb.outputs}
        result = rb.step(words)
        for name, total in result.rows.items():
            self._check_rows(rb, name, total)
        for index, values in result.writes:
            upload_words(buf, index, values)
        return result.rows

    def _size_output(self, name: str, rows: int, args: list, out_bufs: list | None, make=None) -> None:
        """Give run-time sized output `name` a buffer of `rows` rows, in args and out_bufs: make(spec,
        rows)'s (a torch tensor's, interop.run_zero_copy) or one of the pool's."""
        for k, (s, _, _) in enumerate(out_bufs or []):
            if s.name != name:
                continue
            count = rows * s.numel_per_row
            # (within the buffer the run bound it at: no new one a run for a count that moves)
            dsl = io_dtype(self.plan, s).dsl
            buf = make(s, rows) if make is not None else self.pool.sized(s.ident, dsl, count, shrink=False)
            out_bufs[k] = (s, buf, count)
            args[len(self.plan.inputs) + k] = buf

    def launch(self, args: list, scratch: list, n: int, errors=None, only: int | None = None,
               span: tuple[int, int | None] | None = None, after: dict | None = None) -> None:
        """Enqueue the kernels for n samples on LuisaCompute's stream, one after another in one
        command list, without synchronising: args are the input and output buffers (then the
        derived ones) in parameter order, scratch the scratch buffers, errors the run's state buffer
        (the flag run-time checks set, the counted outputs' words; made here when needed and not
        given); only: launch just that stage; span: launch stages [first, last) (last None: to the
        end), the segments between mid-run read-backs; after: {stage: enqueue()} what to enqueue
        right after a stage (a counted total's copy), whether or not it had threads to launch."""
        first = not self.built
        self.writes += 1  # (the outputs' buffers may change: what the last run downloaded is only on the host)
        if first:
            cache.check_kernel_cache()  # a truncated cached kernel or an unwritable folder would abort
        build = (phase("kernel build", model=os.path.basename(self.path), backend=self.backend, kernels=len(self.kernels),
                       note_after=SLOW_BUILD_S) if first else contextlib.nullcontext())
        if self.takes_state and errors is None:
            errors = self.state()
        extra = [errors] if self.takes_state else []
        with device.stream_lock, self._compile_lock(), build:
            if self.kernel is None:
                pass
            elif self.plan.schedule is None:
                self.kernel(*args, self.pool.weights(self.plan), *scratch, *extra, dispatch_size=n)
            else:  # the stages, one dispatch each (of their own kernel, or of the merged one)
                stages = self.plan.schedule.stages
                common = [*args, self.pool.weights(self.plan), *self.pool.stage_buffers(self.plan, n), *scratch]
                if self._fused:  # the fused MLP: its tile counter
                    common += [self.pool.tile_counter()]
                if self._takes_batch:  # (schedule.Schedule.takes_batch)
                    common += [n]
                if first and self.backend == "cuda" and not self.plan.merged_stages:
                    self._build_in_parallel(common + extra + ([0] if self.plan.stage_kernels else []))
                elif first and self.plan.merged_stages:  # (here, under a progress bar on a terminal)
                    from . import parallel_build

                    parallel_build.build_here([self.kernel], common + extra + [0], self.backend)
                self._enqueue(common + extra, stages, n, only, span, after, first)
        self.built = True

    def _enqueue(self, shared: list, stages: list, n: int, only: int | None, span, after: dict | None,
                 first: bool = False) -> None:
        """launch's loop over the stages: each launch prepared once (its shader looked up, its tail
        encoded: dispatch.Prepared) and again only when the shared arguments' types change (a
        rebinding of other buffers of the same types keeps them: only their encodings are redone),
        its count worked out once per batch n; what is left per stage is the command's creation, its
        encodes and its enqueue (benchmarks/NOTES.md, "net.run's host time")."""
        from luisa import globalvars

        if self._launcher is None:
            self._launcher = Launcher(shared)
        elif self._launcher.rebind(shared):  # (other types: other shaders)
            self._prepared = [None] * len(stages)
        launcher, prepared = self._launcher, self._prepared
        if self._counts[0] != n:
            self._counts = (n, [stage.dispatch(n) for stage in stages])
        counts = self._counts[1]
        lo, hi = (0, len(stages)) if span is None else (span[0], len(stages) if span[1] is None else span[1])
        if only is not None:
            lo, hi, after = max(lo, only), min(hi, only + 1), None
        stream = globalvars.vars.stream
        add, done = stream.add_launches() if hasattr(stream, "add_launches") else (stream.add, lambda k: None)
        enqueue = launcher.enqueue
        pending = launched = 0  # launches since the last commit (FLUSH_LAUNCHES), in all
        flush = BACKEND_FLUSH.get(self.backend, 0) if FLUSH_LAUNCHES is None else FLUSH_LAUNCHES
        try:
            for k in range(lo, hi):
                count = counts[k] if first or k not in self.skipped else 0
                if count:
                    p = prepared[k]
                    if p is None:
                        p = prepared[k] = launcher.prepare(*self._stage_kernel(k), count)
                    elif p.count != count:
                        p = prepared[k] = p._replace(count=count)
                    enqueue(p, add)
                    launched += 1
                    pending += 1
                    if flush and pending >= flush:
                        stream.execute()
                        pending = 0
                if after and k in after:
                    after[k]()
            if flush and pending:  # (the tail too: committed launches are what torch.cuda.synchronize and
                stream.execute()   # CUPTI see; left pending, a caller of net.launch on shared tensors read stale outputs)
        finally:
            done(launched)  # (counts.CountingStream: the launches counted at once)

    def _stage_kernel(self, k: int) -> tuple:
        """(kernel, its arguments after the shared ones) of stage k."""
        if self.plan.merged_stages:
            return self.kernel, (k,)
        if self.plan.stage_kernels:  # (some stages share a kernel: every kernel takes k)
            return self._by_name[self.plan.stage_kernels[k]], (k,)
        return self.kernels[k], ()

    def _build_in_parallel(self, args: list) -> None:
        """Build the stage kernels in worker processes before the first launch (luisaml/parallel_build.py:
        the launches then hit LuisaCompute's disk cache); a kernel no worker built is built at launch."""
        from . import parallel_build

        pool, self.build_workers = self.build_workers, None
        if pool is False:  # (its kernels are cached: runtime._compile_grid_step)
            return
        if pool is None:
            count = parallel_build.workers_for(len(self.kernels))
            pool = parallel_build.Workers(self.backend, count) if count else None
        if pool is not None:
            built: list = []
            with phase("parallel kernel build", kernels=len(self.kernels), workers=len(pool.procs)):
                pool.build(self.path, self.plan.kernels, args, costs=self._kernel_costs(),
                           meanwhile=lambda: built.extend(parallel_build.build_ir(self.kernels, args)))
                parallel_build.create_shaders(built)

    def _kernel_costs(self) -> list[int]:
        """Each kernel's source length, from its `def` to the next top-level one (parallel_build
        balances the workers' shares by it)."""
        lines = self.plan.source.splitlines()
        starts = [i for i, line in enumerate(lines) if line.startswith("def ")] + [len(lines)]
        size = {lines[a][len("def "):].split("(", 1)[0]: sum(map(len, lines[a:b])) for a, b in itertools.pairwise(starts)}
        return [size.get(name, 1) for name in self.plan.kernels]

    @contextlib.contextmanager
    def _compile_lock(self):
        """Hold an inter-process lock while the kernels compile (their first launch).

        The CPU backend caches compiled kernels in one folder per Python installation and writes
        them non-atomically: two processes compiling the same kernel at once can read a half-written
        file and abort. The lock is one of cache.LOCK_SLOTS files picked by the kernel's code, so
        different kernels mostly compile in parallel and no lock file is left per kernel."""
        if self.built:
            yield
            return
        body = "\n".join(self.plan.source.splitlines()[2:])  # without the header naming the model
        with cache.build_lock(body):  # one of cache.LOCK_SLOTS files, not one a kernel
            yield
