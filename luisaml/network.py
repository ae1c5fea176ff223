"""CompiledNetwork: a compiled model on the device, what it is and how a run goes: the feeds checked
and bound (luisaml/feeds.py) into its buffers (luisaml/pool.py), its kernels launched as one command
list (luisaml/launch.py), the outputs read back; torch tensors on the kernels' device are shared in
place (luisaml/zero_copy.py). `forward` is the per-sample function for user kernels."""
from __future__ import annotations

import abc
import os
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np

from . import counts, device, dtypes, zero_copy
from .errors import InputNameError, UsageError
from .feeds import (BoundInputs, check_feeds, expected, feeds_and_outputs, host_feeds, io_dtype, memory_key,
                    padded_inputs, voxel_batch)
from .interop import to_numpy
from .launch import KernelLauncher
from .limits import INDEX_LIMIT
from .luisa_compat import upload_prefix
from .pool import BufferPool

if TYPE_CHECKING:  # (not imported at run time: a network loaded from a .lml runs without onnx)
    from .plan import IOSpec, Plan


class Profile(list):
    """net.profile's answer: a list of (stage, median milliseconds), each kernel timed alone, with
    what a whole run costs: `run_ms`, the median wall time of net.run, and `counts`
    (luisaml/counts.Counts: launches, host synchronisations, uploads, downloads, device bytes)."""

    def __init__(self, items=(), *, run_ms: float = 0.0, per_run: counts.Counts | None = None) -> None:
        super().__init__(items)
        self.run_ms = run_ms
        self.counts = per_run if per_run is not None else counts.Counts()


SAME_UPLOAD_BYTES = 4096  # inputs up to this size are compared with the last upload (_upload_input)


class CompiledNetwork(metaclass=abc.ABCMeta):  # (abstract of nothing: luisaml/per_batch.py registers its wrapper)
    """A model compiled into one generated module: run it, or call `forward` from your own kernel."""

    artifact = None  # the luisaml.artifact.Artifact it was loaded from (luisaml.load), else None

    def __init__(self, plan: Plan, module, path: str, backend: str, save: Callable | None = None):
        self.plan = plan
        self.module = module
        self.path = path
        self.backend = backend
        self._forward = module.forward  # the @luisa.func of one sample
        # save(network, path, model_name=...): luisaml/artifact.py's, given by whoever made the
        # network (compile, load), which sit above this layer; None: it cannot be saved
        self._save = save
        self.pool = BufferPool()
        self.bound = BoundInputs()
        self._largest: tuple[int, int] | None = None  # check_batch's
        self._uploaded: dict[str, tuple] = {}  # small input -> (weak ref to its buffer, the bytes last uploaded)
        self.launcher = KernelLauncher(plan, module, path, backend, self.pool)
        self.kernels = self.launcher.kernels  # launched in this order
        self.kernel = self.launcher.kernel  # (a graph of no node has none)
        # no kernel, no output the kernels write, nothing derived or read back: a run binds nothing (a
        # network whose outputs are all its host steps' grids: a topology op alone over a bound grid
        # uploaded the new bundle, megabytes, for no kernel to read)
        self._host_only = (self.kernel is None and not plan.outputs and not plan.derived and not plan.readbacks
                           and not plan.counted)

    # ---- what it is ----------------------------------------------------------------------
    @property
    def forward(self):
        """The per-sample `@luisa.func` for user kernels; a network whose outputs are sized at run
        time has none (UsageError naming the node)."""
        if self.plan.readbacks:
            raise UsageError(f"this network has no per-sample `forward`: {self.plan.readbacks[0].node} has "
                             "outputs sized at run time (count, prefix sum, read-back, fill), which one sample "
                             "inside a user kernel cannot do; use net.run")
        return self._forward

    @property
    def build_workers(self):
        """The kernel-build processes started while the plan was generated (runtime._WorkersAhead),
        spent at the first launch; None: that launch starts them if there are enough kernels; False:
        none (luisaml/parallel_build.py)."""
        return self.launcher.build_workers

    @build_workers.setter
    def build_workers(self, workers) -> None:
        self.launcher.build_workers = workers

    @property
    def source(self) -> str:
        """The generated module's source."""
        return self.plan.source

    @property
    def allocation(self):
        """The register allocator's plan (slots, sizes, sharing, bytes)."""
        return self.plan.allocation

    @property
    def inputs(self) -> list[IOSpec]:
        """The graph inputs as run() takes them: name, dtype, shape (the batch as its symbol)."""
        steps = getattr(self.plan, "host_steps", None)
        return self.plan.inputs if steps is None else steps.inputs(self.plan.inputs)

    @property
    def outputs(self) -> list[IOSpec]:
        """The graph outputs the kernels write: name, dtype, shape (the batch as its symbol)."""
        return [s for s in self.plan.outputs]

    @property
    def output_names(self) -> list[str]:
        """Every graph output's name, in graph order (what run() returns by default)."""
        return list(self.plan.model.graph.outputs)

    @property
    def batch_symbol(self) -> str | None:
        """The symbol of the batch dimension, or None when the graph runs as one instance."""
        return self.plan.symbol

    @property
    def weight_layout(self) -> dict[str, tuple[int, int, str, tuple[int, ...]]]:
        """Name -> (byte offset, byte length, dtype, shape) of each constant in the weight blob."""
        return {k: (o, n, d.name.lower(), s) for k, (o, n, d, s) in self.plan.blob.layout.items()}

    def weight_bytes(self) -> bytes:
        """The weight blob the kernel reads (upload it yourself, or use `weights`)."""
        return self.plan.blob.bytes()

    @property
    def weights(self):
        """The weight blob as a luisa.ByteBuffer (uploaded once)."""
        return self.pool.weights(self.plan)

    def io_dtype(self, s: IOSpec) -> dtypes.DType:
        """The element type `run` takes or returns for an input or output (half in fp16 mode)."""
        return io_dtype(self.plan, s)

    def _spec(self, name: str) -> IOSpec:
        for s in self.plan.inputs + self.plan.outputs:
            if s.name == name:
                return s
        raise InputNameError(f"'{name}' is not an input or output of the compiled network")

    def input_type(self, name: str):
        """The luisa type `forward` takes for an input: an array per sample, a buffer if shared."""
        return self._io_type(self._spec(name), name in self.plan.model.graph.inputs)

    def output_type(self, name: str):
        """The luisa array type `forward` fills for an output."""
        return self._io_type(self._spec(name), False)

    def _io_type(self, s: IOSpec, is_input: bool):
        import luisa

        from .luisa_compat import buffer_type

        if is_input and s.dtype.is_byte:
            return luisa.ByteBufferType()
        if (is_input and self.plan.symbol is not None and not s.batched) or s.accumulated:
            return buffer_type(s.dtype.dsl)
        return getattr(self.module, self.plan_array_type(s))

    def plan_array_type(self, s: IOSpec) -> str:
        """Return the name of the generated module's luisa array type holding one sample of s."""
        name = f"Arr_{s.dtype.dsl}_{max(s.numel, 1)}"
        if not hasattr(self.module, name):
            import luisa
            from luisa.types import half, uint

            kind = {"float": float, "int": int, "uint": uint, "half": half, "bool": bool}[s.dtype.dsl]
            setattr(self.module, name, luisa.ArrayType(max(s.numel, 1), kind))
        return name

    def __repr__(self) -> str:
        ins = ", ".join(f"{s.name}: {s.dtype.name.lower()}{expected(s)}" for s in self.inputs)
        outs = ", ".join(f"{s.name}: {s.dtype.name.lower()}{expected(s)}" for s in self.plan.outputs)
        return f"<CompiledNetwork ({ins}) -> ({outs}) on {self.backend}>"

    def save(self, path: str | os.PathLike, *, model_name: str | None = None):
        """Write the network as one .lml file (luisaml/artifact.py: `luisaml.load` generates it again
        from data, without onnx) and return its path; model_name: the name `inspect` shows."""
        if self._save is None:
            raise UsageError("cannot save this network: it was not made by luisaml.compile or luisaml.load")
        return self._save(self, path, model_name=model_name)

    # ---- running ---------------------------------------------------------------------------
    def check_feeds(self, feeds: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], int, bool]:
        """Return (numpy feeds, batch size, any torch input), checking names, dtypes and shapes."""
        return check_feeds(self.plan, feeds)

    def derived_arguments(self, feeds: Mapping[str, Any]) -> list:
        """Return the buffers `forward` takes after the outputs (the host-derived inputs, such as fVDB
        grid metadata) for these graph inputs; empty when every derived input is a constant."""
        arrays = {k: to_numpy(v, k) for k, v in host_feeds(self.plan, feeds).items()}
        missing = sorted({s for d in self.plan.derived for s in d.sources if s not in arrays and s not in d.constants})
        if missing:
            raise InputNameError(f"derived inputs need the input(s) {missing}")
        return self.bound.derived_buffers(self.plan, arrays)

    def run(self, feeds: Mapping[str, Any], outputs: list[str] | None = None) -> dict[str, Any]:
        """Return {output name: array} for the feeds; torch tensors in give torch tensors out.

        Safe to call from several threads: runs of every network in the process take turns on
        LuisaCompute's one stream (device.stream_lock). onnxruntime's order, run(output_names or
        None, feeds), is accepted too."""
        feeds, outputs = feeds_and_outputs(feeds, outputs, self.inputs)
        wanted = list(outputs) if outputs is not None else self.output_names
        bad = [o for o in wanted if o not in self.output_names]
        if bad:
            raise InputNameError(f"unknown output(s) {bad}; the network's outputs are {self.output_names}")
        with device.stream_lock:
            seen: dict = {}  # this run's digests (feeds.bytes_digest)
            feeds = host_feeds(self.plan, feeds, seen)
            if zero_copy.applies(self, feeds):
                return zero_copy.run(self, feeds, wanted)
            return self._run_host(feeds, wanted, seen)

    def run_hashed(self, feeds: Mapping[str, np.ndarray], digests: Mapping[str, bytes]) -> dict[str, np.ndarray]:
        """run() over numpy feeds, every output, where the caller knows digests of some feeds' bytes
        (luisaml/fvdb/host_steps.py: a device build's inputs, which the outer run has hashed): those are
        not hashed again."""
        with device.stream_lock:
            seen: dict = {memory_key(a): digests[k] for k, a in feeds.items() if digests.get(k) is not None}
            return self._run_host(feeds, self.output_names, seen)

    def check_batch(self, n: int) -> None:
        """Raise LimitError when a buffer of this batch (an input, output or scratch region over
        n samples) would exceed the 32-bit range kernels index with, before allocating it."""
        limits = self.plan.limits
        if self._largest is None:  # (elements and bytes of the largest buffer a sample, worked out once)
            self._largest = self._largest_per_sample()
        if self._largest[0] * n <= INDEX_LIMIT and self._largest[1] * n <= limits.tensor_bytes:
            return  # (every buffer fits: no message to format, ~20 of them a run on densenet-121)
        for s in self.plan.inputs + self.plan.outputs:
            if s.batched:
                limits.check_elements(f"'{s.name}' at batch {n}", s.numel * n, self.io_dtype(s).itemsize)
        for dsl, per_sample in self.plan.kernel_scratch.items():
            limits.check_elements(f"the {dsl} scratch buffer at batch {n}", per_sample * n, 4)
        if self.plan.schedule is not None:
            for slot in self.plan.schedule.buffers.slots:
                limits.check_elements(f"stage buffer {slot.id} ({', '.join(slot.members[:3])}) at batch {n}",
                                      slot.size * n, slot.itemsize)

    def _largest_per_sample(self) -> tuple[int, int]:
        """(the most elements, the most bytes) a sample of any buffer check_batch checks holds."""
        sizes = [(s.numel, self.io_dtype(s).itemsize) for s in self.plan.inputs + self.plan.outputs if s.batched]
        sizes += [(per_sample, 4) for per_sample in self.plan.kernel_scratch.values()]
        if self.plan.schedule is not None:
            sizes += [(slot.size, slot.itemsize) for slot in self.plan.schedule.buffers.slots]
        return max((c for c, _ in sizes), default=0), max((c * b for c, b in sizes), default=0)

    def _run_host(self, feeds: Mapping[str, Any], wanted: list[str], seen: dict | None = None) -> dict[str, Any]:
        arrays, batch, torch_in = self.check_feeds(feeds)
        seen = {} if seen is None else seen
        to_bind, n, keep = self._voxel_batch(arrays, batch if self.plan.symbol is not None else 1, seen)
        if self._host_only:  # no kernel, no output buffer: nothing to bind (its inputs' uploads read by none)
            args, out_bufs, ran = [], [], None
        else:
            args, out_bufs = self._bind(to_bind, n, seen)
            ran = self.launcher.run(args, n, out_bufs, read=set(wanted))  # (the outputs come back in its one wait)
        rows = ran.rows if ran is not None else {}
        results: dict[str, Any] = {}
        for s, _, count in out_bufs:
            if s.name not in wanted:
                continue
            raw = ran.arrays.get(s.name, np.empty(0, self.io_dtype(s).kernel_numpy))
            shape = s.sized_shape(rows[s.name]) if s.rows is not None else s.batch_shape(n)
            results[s.name] = raw.astype(self.io_dtype(s).numpy, copy=False).reshape(shape)
            if s.name in keep:  # a sparse network's output: its grid's voxels (voxel_rows.RunRows.keep)
                results[s.name] = results[s.name][:keep[s.name]]
        for name in self.plan.host_outputs:
            if name in wanted:
                results[name] = arrays[name] if name in arrays else np.asarray(self.plan.model.graph.var(name).value)
        results = {k: results[k] for k in wanted}
        if torch_in:
            import torch

            results = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in results.items()}
        return results

    def profile(self, feeds: Mapping[str, Any], repeat: int = 5) -> Profile:
        """Return (stage, median milliseconds) of each kernel the network launches for these feeds,
        each timed on its own (launch and synchronise), after a first full run builds them; the
        list's `run_ms` is the median wall time of `repeat` whole runs (host steps, uploads and
        read-backs included) and its `counts` what one whole run asked of the device (launches,
        host synchronisations, uploads, downloads, device bytes held and their peak: luisaml/counts.py)."""
        with device.stream_lock:
            self.run(feeds)
            walls = []
            for _ in range(max(repeat, 1)):
                with counts.measure() as one_run:
                    t = time.perf_counter()
                    self.run(feeds)
                    walls.append((time.perf_counter() - t) * 1e3)
            timer = self.stage_timer(feeds)
            stages = self.plan.schedule.stages if self.plan.schedule is not None else [None]
            out = Profile(run_ms=float(np.median(walls)), per_run=one_run)
            for k, stage in enumerate(stages):
                out.append((stage.describe() if stage is not None else "the per-sample kernel",
                            float(np.median([timer(k) for _ in range(repeat)]))))
            return out

    def stage_timer(self, feeds: Mapping[str, Any]) -> Callable[[int], float]:
        """Return a function of a stage's index that launches that stage alone over these feeds,
        synchronises and returns the milliseconds it took (profile's, and the schedule search's:
        luisaml/tune.py); the kernels must have been built (a first run)."""
        import luisa

        with device.stream_lock:
            feeds = host_feeds(self.plan, feeds)
            self._run_host(feeds, self.output_names)
            arrays, batch, _ = self.check_feeds(feeds)
            arrays, n, _ = self._voxel_batch(arrays, batch if self.plan.symbol is not None else 1, {})
            args, out_bufs = self._bind(arrays, n)
            if self.plan.readbacks:  # a full run sizes the run-time sized outputs' buffers in args
                self.launcher.run(args, n, out_bufs)
            scratch = self.pool.scratch(self.plan, n)

        def time_stage(k: int) -> float:
            with device.stream_lock:
                t = time.perf_counter()
                self.launch(args, scratch, n, only=k)
                luisa.synchronize()
                return (time.perf_counter() - t) * 1e3

        return time_stage

    def _voxel_batch(self, arrays: dict[str, np.ndarray], n: int, seen: dict) -> tuple[dict, int, dict[str, int]]:
        """Return (the arrays to bind, the run's batch, {output: rows kept}) for inputs of batch n: a sparse
        network's batch is its largest grid's voxels where that is more than n, its batched inputs then
        padded with zero rows (luisaml/fvdb/voxel_rows.py); n, the arrays and {} otherwise."""
        if not self.plan.voxel_rows:
            return arrays, n, {}
        # the grids' metadata first (cached for _bind): a damaged bundle is named before the rows are compared
        self.bound.derived_buffers(self.plan, arrays, seen)
        rows = voxel_batch(self.plan, n, arrays.__getitem__)
        return padded_inputs(self.plan, arrays, n, rows.batch), rows.batch, rows.keep

    def _bind(self, arrays: dict[str, np.ndarray], n: int, seen: dict | None = None) -> tuple[list, list]:
        """Upload the inputs for n samples; return (the kernels' buffer arguments, [(output spec,
        its buffer, element count)]). seen: the run's memo of digests, if it has one already."""
        self.check_batch(n)
        args = []
        seen = {} if seen is None else seen  # this run's input digests
        for s in self.plan.inputs:
            k = dtypes.to_kernel(arrays[s.name], self.io_dtype(s), f"input '{s.name}'")
            if s.dtype.is_byte:
                args.append(self.bound.byte_input(s, k, seen if k is arrays[s.name] else None))
                continue
            buf = self.pool.sized(s.ident, self.io_dtype(s).dsl, k.size)
            if k.size:
                self._upload_input(s.ident, buf, np.ascontiguousarray(k).reshape(-1))
            args.append(buf)
        out_bufs = []
        for s in self.plan.outputs:
            count = s.numel * (n if s.batched else 1)
            buf = self.pool.sized(s.ident, self.io_dtype(s).dsl, count)
            if s.accumulated and count:  # every sample adds into it
                upload_prefix(buf, np.zeros(count, s.dtype.kernel_numpy))
            out_bufs.append((s, buf, count))
            args.append(buf)
        args += self.bound.derived_buffers(self.plan, arrays, seen)
        return args, out_bufs

    def _upload_input(self, ident: str, buf, flat: np.ndarray) -> None:
        """Enqueue the upload of input `ident`'s values into its buffer, unless the input is small
        (SAME_UPLOAD_BYTES) and this very buffer got the same bytes from the last upload: no kernel
        writes a graph input, so they are still there (a detector frame's voxel sizes, origins and
        offsets: 17 of its 28 uploads). A buffer the pool replaced, or other bytes, are uploaded."""
        if flat.nbytes > SAME_UPLOAD_BYTES:
            self._uploaded.pop(ident, None)
            upload_prefix(buf, flat)
            return
        raw = flat.tobytes()
        last = self._uploaded.get(ident)
        if last is not None and last[0]() is buf and last[1] == raw:
            return
        upload_prefix(buf, flat)
        try:
            self._uploaded[ident] = (weakref.ref(buf), raw)
        except TypeError:  # (a buffer that takes no weak reference: uploaded every run)
            self._uploaded.pop(ident, None)

    def launch(self, args: list, scratch: list, n: int, errors=None, only: int | None = None,
               span: tuple[int, int | None] | None = None) -> None:
        """Enqueue the network's kernels for n samples on LuisaCompute's stream, one after another in
        one command list, without synchronising (luisaml/launch.py KernelLauncher.launch: args, scratch,
        the error flag, one stage or a span of them)."""
        self.launcher.launch(args, scratch, n, errors, only, span)

    def __call__(self, **feeds):
        """Run and return the output (one) or a tuple of outputs in graph order."""
        res = self.run(feeds)
        vals = list(res.values())
        return vals[0] if len(vals) == 1 else tuple(vals)
