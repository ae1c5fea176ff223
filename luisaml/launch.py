"""Launching a network's kernels: its stages enqueued on LuisaCompute's stream as one command list,
split where the host reads a row count back (luisaml/dynamic.py), the run-time error flag raised as
RunError naming the node, and the first launch's kernel build (under a lock, or by workers)."""
from __future__ import annotations

import contextlib
import itertools
import os
from typing import TYPE_CHECKING, Any

import numpy as np

from . import cache, device
from .dispatch import Launcher
from .dynamic import download_words, upload_words
from .errors import RunError
from .feeds import io_dtype
from .log import SLOW_BUILD_S, phase
from .pool import BufferPool

if TYPE_CHECKING:
    from .plan import IOSpec, Plan


class KernelLauncher:
    """The kernels of one generated module and how a run launches them: `launch` enqueues stages,
    `run` launches them all for n samples and waits, reading back between segments."""

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

    def run(self, args: list, n: int, out_bufs: list | None = None, make_output=None) -> dict[str, int]:
        """Launch the kernels for n samples with the plan's scratch buffers; wait for them; raise
        RunError for what a run-time check flagged (an index out of range, naming the node). With
        read-backs (luisaml/dynamic.py) the stages run in segments: up to a node's prefix sum, then
        its row count read back, its outputs' buffers sized in args and out_bufs (make_output(spec,
        rows) gives the buffer when set, else the pool's own), then on; return {run-time sized
        output: rows}."""
        import luisa

        scratch = self.pool.scratch(self.plan, n)
        errors = self.pool.error_flag() if self.plan.checks else None
        rows: dict[str, int] = {}
        start = 0
        for rb in self.plan.readbacks:
            if n > 0:
                self.launch(args, scratch, n, errors, span=(start, rb.after_stage + 1))
            luisa.synchronize()
            self._raise_flagged(errors)
            for name, total in self._read_rows(rb, out_bufs, n, scratch).items():
                rows[name] = total
                self._size_output(name, total, args, out_bufs, make_output)
            start = rb.after_stage + 1
        if n > 0:
            self.launch(args, scratch, n, errors, span=(start, None) if self.plan.readbacks else None)
        luisa.synchronize()
        self._raise_flagged(errors)
        return rows

    def _raise_flagged(self, errors) -> None:
        """Raise RunError for the check a launch flagged (its message names the node)."""
        if errors is not None:
            code = np.zeros(1, np.int32)
            errors.copy_to(code)
            if code[0]:
                k = int(code[0]) - 1
                what = self.plan.checks[k] if 0 <= k < len(self.plan.checks) else f"check {k + 1}"
                advice = " (compile with check_indices=False to clamp such indices instead)" if "index" in what else ""
                raise RunError(what + advice)

    def _check_rows(self, rb, name: str, total: int) -> None:
        """Raise LimitError when output `name` of rb's node would not fit the limits at `total` rows."""
        s = next((s for s in self.plan.outputs if s.name == name), None)
        if s is not None:
            self.plan.limits.check_elements(f"output '{name}' of {rb.node} with {total} rows",
                                            total * s.numel_per_row, io_dtype(self.plan, s).itemsize)

    def _read_rows(self, rb, out_bufs: list | None, n: int, scratch: list) -> dict[str, int]:
        """Return {run-time sized output: rows} of a read-back: its one total (_read_total), or what
        the node's host step makes of the words it reads from the int scratch, whose writes into that
        scratch it then uploads (luisaml/dynamic.py HostRead)."""
        if rb.step is None or n <= 0:
            total = self._read_total(rb, out_bufs, n) if n > 0 else 0
            return {name: total for name in rb.outputs}
        buf = scratch[sorted(self.plan.kernel_scratch).index("int")]
        result = rb.step(download_words(buf, rb.index, rb.count))
        for name, total in result.rows.items():
            self._check_rows(rb, name, total)
        for index, words in result.writes:
            upload_words(buf, index, words)
        return result.rows

    def _read_total(self, rb, out_bufs: list | None, n: int) -> int:
        """Return the row count a read-back reads (element rb.index of rb.tensor, in an output's
        buffer or a pooled one), checked: RunError naming the node for a count no buffer can hold."""
        from .luisa_compat import read_element

        buf = next((b for s, b, _ in out_bufs or [] if s.name == rb.tensor), None)
        if buf is None:
            root = rb.tensor
            while root in self.plan.main.views:
                root = self.plan.main.views[root]
            slot = next(sl for sl in self.plan.schedule.buffers.slots if root in sl.members)
            buf = self.pool.pooled(f"buf_{slot.dtype}_{slot.id}", slot.dtype, slot.size * max(n, 1))
        total = int(read_element(buf, np.int32, rb.index))
        if total < 0:
            raise RunError(f"{rb.node}: its outputs' row count read back as {total} (the sum of its counts "
                           "overflowed 32 bits)")
        for name in rb.outputs:
            self._check_rows(rb, name, total)
        return total

    def _size_output(self, name: str, rows: int, args: list, out_bufs: list | None, make=None) -> None:
        """Give run-time sized output `name` a buffer of `rows` rows, in args and out_bufs: make(spec,
        rows)'s (a torch tensor's, interop.run_zero_copy) or one of the pool's."""
        for k, (s, _, _) in enumerate(out_bufs or []):
            if s.name != name:
                continue
            count = rows * s.numel_per_row
            buf = make(s, rows) if make is not None else self.pool.exact(s.ident, io_dtype(self.plan, s).dsl, count)
            out_bufs[k] = (s, buf, count)
            args[len(self.plan.inputs) + k] = buf

    def launch(self, args: list, scratch: list, n: int, errors=None, only: int | None = None,
               span: tuple[int, int | None] | None = None) -> None:
        """Enqueue the kernels for n samples on LuisaCompute's stream, one after another in one
        command list, without synchronising: args are the input and output buffers (then the
        derived ones) in parameter order, scratch the scratch buffers, errors the int buffer the
        run-time checks flag (needed when plan.checks is not empty); only: launch just that stage;
        span: launch stages [first, last) (last None: to the end), the segments between read-backs."""
        first = not self.built
        if first:
            cache.check_kernel_cache()  # a truncated cached kernel or an unwritable folder would abort
        build = (phase("kernel build", model=os.path.basename(self.path), backend=self.backend, kernels=len(self.kernels),
                       note_after=SLOW_BUILD_S) if first else contextlib.nullcontext())
        extra = [errors] if self.plan.checks else []
        if self.plan.checks and errors is None:
            errors = extra[0] = self.pool.error_flag()
        with device.stream_lock, self._compile_lock(), build:
            if self.kernel is None:
                pass
            elif self.plan.schedule is None:
                self.kernel(*args, self.pool.weights(self.plan), *scratch, *extra, dispatch_size=n)
            else:  # the stages, one dispatch each (of their own kernel, or of the merged one)
                stages = self.plan.schedule.stages
                common = [*args, self.pool.weights(self.plan), *self.pool.stage_buffers(self.plan, n), *scratch]
                if any(st.domain == "fused" for st in stages):  # the fused MLP: its tile counter
                    common += [self.pool.tile_counter()]
                if self.plan.schedule.takes_batch:  # (schedule.Schedule.takes_batch)
                    common += [n]
                if first and self.backend == "cuda" and not self.plan.merged_stages:
                    self._build_in_parallel(common + extra + ([0] if self.plan.stage_kernels else []))
                elif first and self.plan.merged_stages:  # (here, under a progress bar on a terminal)
                    from . import parallel_build

                    parallel_build.build_here([self.kernel], common + extra + [0], self.backend)
                launch = Launcher(common + extra)  # (the arguments typed once, not per stage)
                for k, stage in enumerate(stages):
                    count = stage.dispatch(n)
                    if not count or (only is not None and k != only):
                        continue
                    if span is not None and (k < span[0] or (span[1] is not None and k >= span[1])):
                        continue
                    if self.plan.merged_stages:
                        launch(self.kernel, (k,), count)
                    elif self.plan.stage_kernels:  # (some stages share a kernel: every kernel takes k)
                        launch(self._by_name[self.plan.stage_kernels[k]], (k,), count)
                    else:
                        launch(self.kernels[k], (), count)
        self.built = True

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
