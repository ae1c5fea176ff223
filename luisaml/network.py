"""CompiledNetwork: a compiled model on the device. It checks feeds, owns the device buffers (inputs,
outputs, the stages' pooled buffers, scratch), launches the kernels of its plan as one command
list, and reads the outputs back; `forward` is the per-sample function for user kernels."""
from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import time
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from . import cache, device, dtypes
from .fvdb import voxel_rows
from .dispatch import Launcher
from .dtypes import shape_str
from .errors import InputError, InputNameError, InputTypeError, RunError, UsageError
from .interop import check_torch_dtype, dlpack_buffer, is_torch, same_tensor, to_numpy, torch_dtype
from .log import SLOW_BUILD_S, phase

if TYPE_CHECKING:  # (not imported at run time: a network loaded from a .lml runs without onnx)
    from .plan import IOSpec, Plan


def _feeds_and_outputs(feeds, outputs, inputs: list[IOSpec]) -> tuple[Mapping[str, Any], list[str] | None]:
    """Return (feeds, outputs) from run()'s arguments in luisaml's order or onnxruntime's
    (output names or None first); raise InputTypeError when feeds are not a mapping."""
    if not isinstance(feeds, Mapping) and isinstance(outputs, Mapping):
        feeds, outputs = outputs, feeds
    if not isinstance(feeds, Mapping):
        raise InputTypeError(f"feeds must be a dict of input name -> array, got {type(feeds).__name__}; the "
                             f"network's inputs are {[s.name for s in inputs]}")
    if isinstance(outputs, str):
        outputs = [outputs]
    return feeds, outputs


def _expected(spec: IOSpec) -> str:
    return shape_str(spec.shape)


# an array of more bytes than this is hashed in chunks of _HASH_CHUNK by a few threads (hashlib
# releases the GIL): a grid's blob is megabytes, hashed at every run that binds it from numpy
_PARALLEL_HASH_BYTES = 2 << 20
_HASH_CHUNK = 1 << 20
_hash_pool = None
# ByteBuffers a network keeps for the next new grids once no input holds them (_byte_input)
_SPARE_BYTE_BUFFERS = 2
# the digests of device tensors that changed since the last run (_dlpack_host): unique, never hashed
_ZERO_COPY_TOKENS = itertools.count()


def _computation_key(d, arrays: dict[str, np.ndarray], seen: dict) -> tuple | None:
    """The key of derived input d's computation over these arrays, by content, not by input name:
    its function, parameters, type, each input source's dtype, shape and (unless its shape alone
    matters) bytes' digest, and each constant source itself (the plan's, never hashed). None when a
    parameter is not a plain value."""
    def plain(v) -> bool:
        return isinstance(v, (int, float, str, bool, type(None))) or (
            isinstance(v, tuple) and all(plain(x) for x in v))

    if not all(plain(v) for v in d.params.values()):
        return None
    parts: list = []
    for name in d.sources:
        if name in d.constants:
            parts.append(("constant", id(d.constants[name])))  # (the plan holds it: the same every run)
            continue
        given = arrays[name]
        if name in d.shape_only:  # (a stand-in of its shape on the zero-copy path: never made whole)
            parts.append((given.dtype.str, given.shape, None))
            continue
        whole = np.ascontiguousarray(given)
        parts.append((whole.dtype.str, whole.shape, _bytes_digest(whole, seen if whole is given else None)))
    return ("derived", d.compute, tuple(sorted(d.params.items())), d.dtype.name, d.shape, tuple(parts))


def _memory_key(a: np.ndarray) -> tuple:
    """The key under which _bytes_digest memoises an array's digest in a run: its memory."""
    return ("bytes", a.__array_interface__["data"][0], a.nbytes)


def _bytes_digest(a: np.ndarray, seen: dict | None) -> bytes:
    """Return a 16-byte blake2b digest of a contiguous array's bytes; a large one as a tree (the
    digest of its chunks' digests, computed in parallel). With seen (this run's memo; only for an
    array the caller holds, so its memory cannot be another's later in the run), memory hashed once
    in the run is not hashed again: a fine and a coarse map's bundles are views of one grid's blob."""
    global _hash_pool
    where = _memory_key(a)
    if seen is not None and where in seen:
        return seen[where]
    view = memoryview(a.reshape(-1)).cast("B")  # (flat: memoryview cannot cast a shape with a zero, [0, 1])
    if a.nbytes <= _PARALLEL_HASH_BYTES:
        digest = hashlib.blake2b(view, digest_size=16).digest()
    else:
        if _hash_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            _hash_pool = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="luisaml-hash")
        parts = _hash_pool.map(lambda i: hashlib.blake2b(view[i:i + _HASH_CHUNK], digest_size=16).digest(),
                               range(0, a.nbytes, _HASH_CHUNK))
        digest = hashlib.blake2b(b"".join(parts), digest_size=16, person=b"luisaml-tree").digest()
    if seen is not None:
        seen[where] = digest
    return digest


class CompiledNetwork:
    """A model compiled into one generated module: run it, or call `forward` from your own kernel."""

    artifact = None  # the luisaml.artifact.Artifact it was loaded from (luisaml.load), else None

    def __init__(self, plan: Plan, module, path: str, backend: str):
        self.plan = plan
        self.module = module
        self.path = path
        self.backend = backend
        self._forward = module.forward  # the @luisa.func of one sample
        self.kernels = [getattr(module, name) for name in plan.kernels]  # launched in this order
        self.kernel = self.kernels[0] if self.kernels else None  # (a graph of no node has none)
        self._by_name = dict(zip(plan.kernels, self.kernels))
        # kernel-build processes started while the plan was generated (runtime._WorkersAhead), spent
        # at the first launch; None: that launch starts them if there are enough kernels; False: none
        self.build_workers: Any = None
        self._weights = None
        self._buffers: dict[tuple[str, int], Any] = {}
        self._derived: dict[str, tuple[tuple, Any, np.ndarray]] = {}  # ident -> (its computation's key, buffer, values)
        self._byte_inputs: dict[str, tuple[tuple, Any]] = {}  # byte input's ident -> (its bytes' key, ByteBuffer)
        self._spare_bytes: list = []  # ByteBuffers no byte input holds any more, newest first (_byte_input)
        # input -> (device tensor's clone, host copy, its digest, its bytes' digest): _dlpack_host
        self._host_copies: dict[str, tuple] = {}

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

    def _host_feeds(self, feeds: Mapping[str, Any], seen: dict | None = None) -> Mapping[str, Any]:
        """The feeds with the grids the host steps build from them (luisaml/host_steps.py). seen: the
        run's memo of digests (_bytes_digest), which the run's binding reads after: a grid the steps
        and the kernels both read is hashed once."""
        steps = getattr(self.plan, "host_steps", None)
        if steps is None:
            return feeds

        def digest(name: str, a: np.ndarray) -> bytes:
            whole = np.ascontiguousarray(a)
            return _bytes_digest(whole, seen if whole is feeds.get(name) else None)  # (the caller's own array)

        def remember(a: np.ndarray, d: bytes) -> None:  # (a step's output: the step's cache holds it)
            seen[_memory_key(a)] = d

        return steps.complete(feeds, {s.name: s for s in self.plan.inputs}, digest,
                              remember if seen is not None else None)

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
        if self._weights is None:
            from .luisa_compat import byte_buffer

            self._weights = byte_buffer(self.weight_bytes())
        return self._weights

    def io_dtype(self, s: IOSpec) -> dtypes.DType:
        """The element type `run` takes or returns for an input or output (half in fp16 mode)."""
        fused = self.plan.fused
        if fused is not None and fused.precision == "fp16" and s.dtype is dtypes.FLOAT:
            return dtypes.FLOAT16
        return s.dtype

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
        ins = ", ".join(f"{s.name}: {s.dtype.name.lower()}{_expected(s)}" for s in self.inputs)
        outs = ", ".join(f"{s.name}: {s.dtype.name.lower()}{_expected(s)}" for s in self.plan.outputs)
        return f"<CompiledNetwork ({ins}) -> ({outs}) on {self.backend}>"

    # luisaml/artifact.py's save, set by that layer when it is imported (as `import luisaml` does):
    # the format lives there, above this module, which therefore never imports it
    saver = None

    def save(self, path: str | os.PathLike, *, model_name: str | None = None):
        """Write the network as one .lml file (luisaml/artifact.py: `luisaml.load` generates it again
        from data, without onnx) and return its path; model_name: the name `inspect` shows."""
        if CompiledNetwork.saver is None:
            raise UsageError("saving needs luisaml.artifact, which `import luisaml` imports")
        return CompiledNetwork.saver(self, path, model_name=model_name)

    # ---- running ---------------------------------------------------------------------------
    def check_feeds(self, feeds: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], int, bool]:
        """Return (numpy feeds, batch size, any torch input), checking names, dtypes and shapes."""
        names = [s.name for s in self.plan.inputs]
        unknown = [k for k in feeds if k not in names]
        if unknown:
            raise InputNameError(f"unknown input(s) {unknown}; the network's inputs are {names}")
        missing = [k for k in names if k not in feeds]
        if missing:
            raise InputNameError(f"missing input(s) {missing}; the network's inputs are {names}")
        arrays: dict[str, np.ndarray] = {}
        torch_in = False
        batch = None
        for s in self.plan.inputs:
            x = feeds[s.name]
            torch_in |= is_torch(x)
            a = to_numpy(x, s.name)
            if a.dtype != self.io_dtype(s).numpy:
                raise InputTypeError(f"input '{s.name}': expected dtype {self.io_dtype(s).numpy}, got {a.dtype}")
            if s.batched:
                want, rows = tuple(s.kernel_shape[1:]), s.kernel_shape[0]  # rows: k of a k*B dimension
                if a.ndim != len(s.kernel_shape) or tuple(a.shape[1:]) != want or a.shape[0] % rows:
                    raise InputError(f"input '{s.name}': expected shape {_expected(s)}, got {shape_str(a.shape)}")
                n = a.shape[0] // rows
                if batch is not None and n != batch[1]:
                    raise InputError(
                        f"input '{s.name}': batch dimension '{self.plan.symbol}' is {n}, but input "
                        f"'{batch[0]}' has {batch[1]}"
                    )
                batch = batch or (s.name, n)
            elif s.rows is not None:  # rows bound at run time: any number of them
                if a.ndim != len(s.kernel_shape) or tuple(a.shape[1:]) != tuple(s.kernel_shape[1:]):
                    raise InputError(f"input '{s.name}': expected shape {shape_str(s.shape)} (any number of "
                                     f"rows), got {shape_str(a.shape)}")
                self.plan.limits.check_elements(f"input '{s.name}' {shape_str(a.shape)}", a.size,
                                                self.io_dtype(s).itemsize)
            elif tuple(a.shape) != tuple(s.kernel_shape):
                raise InputError(f"input '{s.name}': expected shape {_expected(s)}, got {shape_str(a.shape)}")
            arrays[s.name] = a
        return arrays, (batch[1] if batch else 1), torch_in

    def _buffer(self, ident: str, dsl: str, count: int):
        key = (ident, count)
        if key not in self._buffers:
            from .luisa_compat import buffer_type  # noqa: F401

            import luisa
            from luisa.types import half, uint

            self._buffers = {k: v for k, v in self._buffers.items() if k[0] != ident}
            if dsl == "ubyte":  # bytes sized at run time (a new grid's blob): a ByteBuffer of whole words
                from .luisa_compat import fix_byte_buffer

                buf = luisa.ByteBuffer(max(-(-count // 4) * 4, 4))
                fix_byte_buffer(buf)
                self._buffers[key] = buf
                return buf
            kind = {"float": float, "int": int, "uint": uint, "half": half, "bool": bool}[dsl]
            self._buffers[key] = luisa.Buffer(max(count, 1), kind)
        return self._buffers[key]

    def _pooled(self, ident: str, dsl: str, count: int):
        """Return a buffer only kernels use (a pooled slot, a scratch region) of at least `count`
        elements: the one it has while runs need between half of it and all of it, so that a voxel
        count moving a little from frame to frame (the batch of a sparse network over grids bound at
        run time) does not reallocate every such buffer every run (kernels index within the run's
        count; the host never copies these whole)."""
        for (name, capacity), buf in self._buffers.items():
            if name == ident and count <= capacity <= 2 * max(count, 1):
                return buf
        return self._buffer(ident, dsl, count)

    @staticmethod
    def _digest(arrays: dict[str, np.ndarray], name: str, shape_only: bool, seen: dict) -> bytes:
        """Return the digest of input `name` (its dtype and shape, and unless shape_only its bytes),
        computed once per run: seen memoises it (a grid's bytes feed several derived inputs)."""
        key = (name, shape_only)
        if key not in seen:
            given = arrays[name]
            h = hashlib.blake2b(digest_size=16)
            h.update(f"{name}:{given.dtype.str}:{given.shape};".encode())
            if not shape_only:  # (voxel data whose rows alone are checked: not hashed per run)
                a = np.ascontiguousarray(given)
                h.update(_bytes_digest(a, seen if a is given else None))
            seen[key] = h.digest()
        return seen[key]

    def _derived_buffers(self, arrays: dict[str, np.ndarray], seen: dict | None = None) -> list:
        """Return the buffers of the host-derived inputs, recomputed only when their sources change,
        and once a run for equal computations over equal bytes (a fine and a coarse map's bundles of
        one grid: one check and layout of the blob). Keyed by content (_computation_key), or, for a
        computation with parameters that are not plain values, by its sources' digests (_digest);
        seen: the run's memo of digests and values."""
        from .luisa_compat import upload

        seen = {} if seen is None else seen
        out = []
        for d in self.plan.derived:
            key = _computation_key(d, arrays, seen)
            if key is None:
                h = hashlib.blake2b(digest_size=16)
                for name in d.sources:
                    if name not in d.constants:
                        h.update(self._digest(arrays, name, name in d.shape_only, seen))
                key = (d.ident, h.digest())
            cached = self._derived.get(d.ident)
            if cached is None or cached[0] != key:
                value = seen.get(key)
                if value is None:
                    value = np.ascontiguousarray(
                        dtypes.to_kernel(d.value(arrays), d.dtype, f"derived input {d.ident}").reshape(-1))
                    seen[key] = value
                if cached is not None and value.size and cached[1].size == value.size:
                    # a new grid of the same layout: its values into the same buffer (the copy is
                    # ordered after the kernels of earlier runs on the one stream), not a new buffer
                    cached[1].copy_from_array(value, sync=False)
                    cached = (key, cached[1], value)  # (the host copy kept while the upload may be queued)
                else:
                    cached = (key, upload(value, d.dtype.dsl), value)
                self._derived[d.ident] = cached
            out.append(cached[1])
        return out

    def derived_arguments(self, feeds: Mapping[str, Any]) -> list:
        """Return the buffers `forward` takes after the outputs (the host-derived inputs, such as fVDB
        grid metadata) for these graph inputs; empty when every derived input is a constant."""
        arrays = {k: to_numpy(v, k) for k, v in self._host_feeds(feeds).items()}
        missing = sorted({s for d in self.plan.derived for s in d.sources if s not in arrays and s not in d.constants})
        if missing:
            raise InputNameError(f"derived inputs need the input(s) {missing}")
        return self._derived_buffers(arrays)

    def run(self, feeds: Mapping[str, Any], outputs: list[str] | None = None) -> dict[str, Any]:
        """Return {output name: array} for the feeds; torch tensors in give torch tensors out.

        Safe to call from several threads: runs of every network in the process take turns on
        LuisaCompute's one stream (device.stream_lock). onnxruntime's order, run(output_names or
        None, feeds), is accepted too."""
        feeds, outputs = _feeds_and_outputs(feeds, outputs, self.inputs)
        wanted = list(outputs) if outputs is not None else self.output_names
        bad = [o for o in wanted if o not in self.output_names]
        if bad:
            raise InputNameError(f"unknown output(s) {bad}; the network's outputs are {self.output_names}")
        with device.stream_lock:
            seen: dict = {}  # this run's digests (_bytes_digest)
            feeds = self._host_feeds(feeds, seen)
            if self._zero_copy(feeds):
                return self._run_dlpack(feeds, wanted)
            return self._run_host(feeds, wanted, seen)

    def run_hashed(self, feeds: Mapping[str, np.ndarray], digests: Mapping[str, bytes]) -> dict[str, np.ndarray]:
        """run() over numpy feeds, every output, where the caller knows digests of some feeds' bytes
        (luisaml/host_steps.py: a device build's inputs, which the outer run has hashed): those are
        not hashed again."""
        with device.stream_lock:
            seen: dict = {_memory_key(a): digests[k] for k, a in feeds.items() if digests.get(k) is not None}
            return self._run_host(feeds, self.output_names, seen)

    def check_batch(self, n: int) -> None:
        """Raise LimitError when a buffer of this batch (an input, output or scratch region over
        n samples) would exceed the 32-bit range kernels index with, before allocating it."""
        limits = self.plan.limits
        for s in self.plan.inputs + self.plan.outputs:
            if s.batched:
                limits.check_elements(f"'{s.name}' at batch {n}", s.numel * n, self.io_dtype(s).itemsize)
        for dsl, per_sample in self.plan.kernel_scratch.items():
            limits.check_elements(f"the {dsl} scratch buffer at batch {n}", per_sample * n, 4)
        if self.plan.schedule is not None:
            for slot in self.plan.schedule.buffers.slots:
                limits.check_elements(f"stage buffer {slot.id} ({', '.join(slot.members[:3])}) at batch {n}",
                                      slot.size * n, slot.itemsize)

    def _voxel_rows(self, n: int, bound) -> dict[str, int]:
        """Check the run's grids against its batch and inputs; return {output: rows} of the outputs
        at a coarse level of a sparse network (luisaml/voxel_rows.py). bound(name): a graph input's
        host array."""
        if not self.plan.voxel_rows:
            return {}
        graph = self.plan.model.graph

        def values(name: str):
            return bound(name) if name in self.plan.model.graph.inputs else graph.var(name).value

        return voxel_rows.rows_at_run(self.plan.voxel_rows, values, n)

    def _run_host(self, feeds: Mapping[str, Any], wanted: list[str], seen: dict | None = None) -> dict[str, Any]:
        arrays, batch, torch_in = self.check_feeds(feeds)
        n = batch if self.plan.symbol is not None else 1
        args, out_bufs = self._bind(arrays, n, seen)  # (derives the grids' metadata: a damaged bundle is named first)
        keep = self._voxel_rows(n, arrays.__getitem__)
        rows = self._launch_and_wait(args, n, out_bufs)
        results: dict[str, Any] = {}
        for s, buf, count in out_bufs:
            if s.name not in wanted:
                continue
            from .luisa_compat import read_buffer

            raw = read_buffer(buf, self.io_dtype(s).kernel_numpy, count)
            shape = s.sized_shape(rows[s.name]) if s.rows is not None else self._output_shape(s, n)
            results[s.name] = raw.astype(self.io_dtype(s).numpy, copy=False).reshape(shape)
            if s.name in keep:  # an output at a coarse level of a sparse network: its grid's voxels
                results[s.name] = results[s.name][:keep[s.name]]
        for name in self.plan.host_outputs:
            if name in wanted:
                results[name] = arrays[name] if name in arrays else np.asarray(self.plan.model.graph.var(name).value)
        results = {k: results[k] for k in wanted}
        if torch_in:
            import torch

            results = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in results.items()}
        return results

    def profile(self, feeds: Mapping[str, Any], repeat: int = 5) -> list[tuple[str, float]]:
        """Return (stage, median milliseconds) of each kernel the network launches for these feeds,
        each timed on its own (launch and synchronise), after a first full run builds them."""
        import luisa

        with device.stream_lock:
            feeds = self._host_feeds(feeds)
            self._run_host(feeds, self.output_names)
            arrays, batch, _ = self.check_feeds(feeds)
            n = batch if self.plan.symbol is not None else 1
            args, out_bufs = self._bind(arrays, n)
            if self.plan.readbacks:  # a full run sizes the run-time sized outputs' buffers in args
                self._launch_and_wait(args, n, out_bufs)
            scratch = [self._pooled(f"scratch_{dsl}", dsl, size * max(n, 1))
                       for dsl, size in sorted(self.plan.kernel_scratch.items())]
            stages = self.plan.schedule.stages if self.plan.schedule is not None else [None]
            out = []
            for k, stage in enumerate(stages):
                times = []
                for _ in range(repeat):
                    t = time.perf_counter()
                    self.launch(args, scratch, n, only=k)
                    luisa.synchronize()
                    times.append((time.perf_counter() - t) * 1e3)
                out.append((stage.describe() if stage is not None else "the per-sample kernel", float(np.median(times))))
            return out

    def _bind(self, arrays: dict[str, np.ndarray], n: int, seen: dict | None = None) -> tuple[list, list]:
        """Upload the inputs for n samples; return (the kernels' buffer arguments, [(output spec,
        its buffer, element count)]). seen: the run's memo of digests, if it has one already."""
        self.check_batch(n)
        args = []
        seen = {} if seen is None else seen  # this run's input digests
        for s in self.plan.inputs:
            k = dtypes.to_kernel(arrays[s.name], self.io_dtype(s), f"input '{s.name}'")
            if s.dtype.is_byte:
                args.append(self._byte_input(s, k, seen if k is arrays[s.name] else None))
                continue
            buf = self._buffer(s.ident, self.io_dtype(s).dsl, k.size)
            if k.size:
                buf.copy_from_array(k.reshape(-1))
            args.append(buf)
        out_bufs = []
        for s in self.plan.outputs:
            count = s.numel * (n if s.batched else 1)
            buf = self._buffer(s.ident, self.io_dtype(s).dsl, count)
            if s.accumulated and count:  # every sample adds into it
                buf.copy_from_array(np.zeros(count, s.dtype.kernel_numpy))
            out_bufs.append((s, buf, count))
            args.append(buf)
        args += self._derived_buffers(arrays, seen)
        return args, out_bufs

    def _byte_input(self, s: IOSpec, k: np.ndarray, seen: dict | None):
        """Return the ByteBuffer of byte input s (a grid's blob) holding k: uploaded again only when
        its bytes change (no kernel writes an input), and one buffer for inputs of the same bytes (a
        fine and a coarse map's bundles of one grid: two inputs, one upload). seen: the run's memo
        of digests, for a k that is the caller's own array (alive for the whole run)."""
        from .luisa_compat import byte_buffer, byte_size, refill_byte_buffer

        whole = np.ascontiguousarray(k)
        key = (whole.dtype.str, whole.shape, _bytes_digest(whole, seen if whole is k else None))
        buf = next((b for kk, b in self._byte_inputs.values() if kk == key), None)
        if buf is None:
            size = byte_size(whole)
            spare = next((b for b in self._spare_bytes if size <= b.bytesize <= 2 * size), None)
            if spare is not None:  # a blob no input holds any more, of about this size: written over
                self._spare_bytes.remove(spare)
                refill_byte_buffer(spare, whole)
                buf = spare
            else:
                buf = byte_buffer(whole)
        old = self._byte_inputs.get(s.ident)
        self._byte_inputs[s.ident] = (key, buf)
        if old is not None and all(b is not old[1] for _, b in self._byte_inputs.values()):
            # no input holds it now (a new grid took its place): kept for the next new grid, since a
            # ByteBuffer of megabytes took 9 ms to create on the H200 (a new grid every frame)
            self._spare_bytes = [old[1]] + self._spare_bytes[:_SPARE_BYTE_BUFFERS - 1]
        return buf

    def _launch_and_wait(self, args: list, n: int, out_bufs: list | None = None, make_output=None) -> dict[str, int]:
        """Launch the batch kernel for n samples with this plan's scratch buffers; wait for it; raise
        RunError for what a run-time check flagged (an index out of range, naming the node). With
        read-backs (luisaml/dynamic.py) the stages run in segments: up to a node's prefix sum, then
        its row count read back, its outputs' buffers sized in args and out_bufs (make_output(spec,
        rows) gives the buffer when set, else the network's own), then on; return {run-time sized
        output: rows}."""
        import luisa

        scratch = [
            self._pooled(f"scratch_{dsl}", dsl, per_sample * max(n, 1))
            for dsl, per_sample in sorted(self.plan.kernel_scratch.items())
        ]
        errors = self._error_flag() if self.plan.checks else None
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

    def _read_rows(self, rb, out_bufs: list | None, n: int, scratch: list) -> dict[str, int]:
        """Return {run-time sized output: rows} of a read-back: its one total (_read_total), or what
        the node's host step makes of the words it reads from the int scratch, whose writes into that
        scratch it then uploads (luisaml/dynamic.py HostRead)."""
        if rb.step is None or n <= 0:
            total = self._read_total(rb, out_bufs, n) if n > 0 else 0
            return {name: total for name in rb.outputs}
        from .dynamic import download_words, upload_words

        buf = scratch[sorted(self.plan.kernel_scratch).index("int")]
        result = rb.step(download_words(buf, rb.index, rb.count))
        for name, total in result.rows.items():
            s = next((s for s in self.plan.outputs if s.name == name), None)
            if s is not None:
                self.plan.limits.check_elements(f"output '{name}' of {rb.node} with {total} rows",
                                                total * s.numel_per_row, self.io_dtype(s).itemsize)
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
            buf = self._pooled(f"buf_{slot.dtype}_{slot.id}", slot.dtype, slot.size * max(n, 1))
        total = int(read_element(buf, np.int32, rb.index))
        if total < 0:
            raise RunError(f"{rb.node}: its outputs' row count read back as {total} (the sum of its counts "
                           "overflowed 32 bits)")
        for name in rb.outputs:
            s = next((s for s in self.plan.outputs if s.name == name), None)
            if s is not None:
                self.plan.limits.check_elements(f"output '{name}' of {rb.node} with {total} rows",
                                                total * s.numel_per_row, self.io_dtype(s).itemsize)
        return total

    def _size_output(self, name: str, rows: int, args: list, out_bufs: list | None, make=None) -> None:
        """Give run-time sized output `name` a buffer of `rows` rows, in args and out_bufs: make(spec,
        rows)'s (a torch tensor's, _run_dlpack) or a buffer of the network's own."""
        for k, (s, _, _) in enumerate(out_bufs or []):
            if s.name != name:
                continue
            count = rows * s.numel_per_row
            buf = make(s, rows) if make is not None else self._buffer(s.ident, self.io_dtype(s).dsl, count)
            out_bufs[k] = (s, buf, count)
            args[len(self.plan.inputs) + k] = buf

    def _error_flag(self):
        """The int buffer run-time checks flag (KernelContext.flag_error), zeroed for this launch."""
        import luisa

        if getattr(self, "_errors", None) is None:
            self._errors = luisa.Buffer(1, int)
        self._errors.copy_from_array(np.zeros(1, np.int32))
        return self._errors

    @staticmethod
    def _output_shape(s: IOSpec, n: int) -> tuple[int, ...]:
        """The shape run() returns for output s with n samples (k*B rows when batched)."""
        return ((n * s.kernel_shape[0],) + tuple(s.kernel_shape[1:])) if s.batched else tuple(s.kernel_shape)

    def launch(self, args: list, scratch: list, n: int, errors=None, only: int | None = None,
               span: tuple[int, int | None] | None = None) -> None:
        """Enqueue the network's kernels for n samples on LuisaCompute's stream, one after another in
        one command list, without synchronising: args are the input and output buffers (then the
        derived ones) in parameter order, scratch the scratch buffers, errors the int buffer the
        run-time checks flag (needed when plan.checks is not empty); only: launch just that stage;
        span: launch stages [first, last) (last None: to the end), the segments between read-backs."""
        first = not getattr(self, "_compiled", False)
        if first:
            cache.check_kernel_cache()  # a truncated cached kernel or an unwritable folder would abort
        build = (phase("kernel build", model=os.path.basename(self.path), backend=self.backend, kernels=len(self.kernels),
                       note_after=SLOW_BUILD_S) if first else contextlib.nullcontext())
        extra = [errors] if self.plan.checks else []
        if self.plan.checks and errors is None:
            errors = extra[0] = self._error_flag()
        with device.stream_lock, self._compile_lock(), build:
            if self.kernel is None:
                pass
            elif self.plan.schedule is None:
                self.kernel(*args, self.weights, *scratch, *extra, dispatch_size=n)
            else:  # the stages, one dispatch each (of their own kernel, or of the merged one)
                stages = self.plan.schedule.stages
                common = [*args, self.weights, *self._pool_buffers(n), *scratch]
                if any(st.domain == "fused" for st in stages):  # the fused MLP: its tile counter
                    common += [self._tile_counter()]
                if self.plan.schedule.takes_batch:  # (schedule.Schedule.takes_batch)
                    common += [n]
                if first and self.backend == "cuda" and not self.plan.merged_stages:
                    self._build_in_parallel(common + extra + ([0] if self.plan.stage_kernels else []))
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
        self._compiled = True

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

    def _pool_buffers(self, n: int) -> list:
        """The stages' pooled buffers for n samples (a region per sample of each slot)."""
        return [self._pooled(f"buf_{slot.dtype}_{slot.id}", slot.dtype, slot.size * max(n, 1))
                for slot in self.plan.schedule.buffers.slots]

    def _tile_counter(self):
        """The fused kernel's [next tile, blocks done] counters: zeroed once, and reset by the last
        block of every launch."""
        if getattr(self, "_tiles", None) is None:
            import luisa

            self._tiles = luisa.Buffer.from_array(np.zeros(2, np.int32))
        return self._tiles

    @contextlib.contextmanager
    def _compile_lock(self):
        """Hold an inter-process lock while this kernel compiles (its first launch).

        The CPU backend caches compiled kernels in one folder per Python installation and writes
        them non-atomically: two processes compiling the same kernel at once can read a half-written
        file and abort. The lock is keyed by the kernel's code, so different kernels still compile in
        parallel."""
        if getattr(self, "_compiled", False):
            yield
            return
        import fcntl

        body = "\n".join(self.plan.source.splitlines()[2:])  # without the header naming the model
        path = cache.locks_dir() / f"{cache.digest(body)}.lock"
        with open(path, "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    # ---- zero-copy torch interop (CUDA) ---------------------------------------------------
    # backend -> the torch device type whose memory its kernels read and write in place (tests map
    # "cpu" too, to run this path on the CPU backend)
    _SHARED_DEVICES = {"cuda": "cuda"}

    def _zero_copy(self, feeds: Mapping[str, Any]) -> bool:
        """True when every input is a torch tensor on the device the kernels run on: numeric inputs are
        read in place, outputs written in place (run-time sized ones included); byte inputs (a grid's
        bytes) and the sources of host-derived inputs are read on the host too (_dlpack_host)."""
        kind = self._SHARED_DEVICES.get(self.backend)
        if kind is None or not feeds or self.plan.host_outputs:
            return False
        if not all(is_torch(v) and v.device.type == kind for v in feeds.values()):
            return False
        return (all(not s.dtype.is_bool for s in self.plan.inputs + self.plan.outputs)
                and not any(s.dtype.is_byte for s in self.plan.outputs))

    def _dlpack_host(self, feeds: Mapping[str, Any], metas: dict[str, np.ndarray], seen: dict) -> dict[str, np.ndarray]:
        """Return what the host must read of device feeds: byte inputs (uploaded as a ByteBuffer, which
        DLPack cannot share) and the sources of derived inputs (a grid's metadata is derived on the host,
        recomputed only when their digest changes, as in run() on numpy); a source whose shape alone
        matters keeps its shape-only stand-in and is not copied. A feed equal, compared on the device,
        to what the last run copied keeps that copy and its digest (in seen): a grid bound once is not
        copied to the host and hashed again every run; any change of its contents is a miss."""
        need = {s.name for s in self.plan.inputs if s.dtype.is_byte}
        for d in self.plan.derived:
            need |= {n for n in d.sources if n not in d.constants and n not in d.shape_only}
        host = dict(metas)
        copied: dict = {}  # this run's host copies by device memory: two bundles of one grid, one copy
        changed: list = []  # (name, its tensor, its new host copy)
        for name in sorted(need):
            t = feeds[name].detach()
            where = (t.data_ptr(), t.dtype, str(t.device), tuple(t.shape), t.stride())
            if where in copied:
                host[name] = copied[where]
                continue
            last = self._host_copies.get(name)
            if same_tensor(last[0] if last else None, t):
                host[name] = last[1]
                seen[(name, False)] = last[2]
                if last[3] is not None:
                    seen[_memory_key(last[1])] = last[3]
            else:
                host[name] = np.array(to_numpy(t, name), copy=True)  # (a CPU tensor's numpy() would share it)
                changed.append((name, t, host[name]))
            copied[where] = host[name]
        # A changed tensor differs from its last run's clone, so no cache keyed by its bytes holds it: a
        # token never used before stands for their digest (hashing a 198k-voxel grid's bundle took 5 ms
        # a run on the H200's host). Copies equal to another changed copy of this run (two bundles of
        # one grid in separate memory: compared, at memcmp speed) share its token, so they share one
        # bundle check and one upload.
        firsts: dict = {}  # (dtype, shape) -> the distinct changed copies of this run
        for _, _, a in changed:
            same = firsts.setdefault((a.dtype.str, a.shape), [])
            twin = next((b for b in same if np.array_equal(a, b)), None)
            if twin is None:
                same.append(a)
                seen[_memory_key(a)] = b"zero-copy " + next(_ZERO_COPY_TOKENS).to_bytes(8, "little")
            else:
                seen[_memory_key(a)] = seen[_memory_key(twin)]
        for name in need:
            if name not in {n for n, _, _ in changed}:
                self._digest(host, name, False, seen)  # (a copy shared in this run: its memo)
        for name, t, a in changed:
            digest = self._digest(host, name, False, seen)
            self._host_copies[name] = (t.clone(), a, digest, seen.get(_memory_key(a)))
        return host

    def _run_dlpack(self, feeds: Mapping[str, Any], wanted: list[str]) -> dict[str, Any]:
        """run() for torch CUDA tensors: inputs and outputs share memory with LuisaCompute buffers
        through DLPack; torch's stream is drained before the kernel reads, and LuisaCompute's before
        torch sees the outputs (neither library exposes its stream to the other).

        Every output is a tensor allocated for this run, a run-time sized one (luisaml/dynamic.py)
        once its row count is read back: exactly that many rows, so two runs never share an output's
        memory (a view of a capacity buffer kept by the network would be overwritten by the next run
        while the caller still holds the first one). The read-back of the total is the run's only
        host round trip; the data stays on the device."""
        import torch

        metas = {}
        for k, v in feeds.items():  # shape and dtype checks without touching the data
            check_torch_dtype(v, k)
            np_dtype = torch.empty((), dtype=v.dtype).numpy().dtype
            metas[k] = np.broadcast_to(np.zeros((), np_dtype), tuple(v.shape))
        _, batch, _ = self.check_feeds(metas)
        n = batch if self.plan.symbol is not None else 1
        self.check_batch(n)
        where = next(iter(feeds.values())).device

        def drain_torch():
            if where.type == "cuda":
                torch.cuda.current_stream(where).synchronize()

        seen: dict = {}  # this run's input digests
        host = self._dlpack_host(feeds, metas, seen)
        items: list = []  # torch tensors (shared through DLPack) or luisa buffers, in parameter order
        for s in self.plan.inputs:
            if s.dtype.is_byte:
                k = dtypes.to_kernel(host[s.name], self.io_dtype(s), f"input '{s.name}'")
                items.append(self._byte_input(s, k, seen if k is host[s.name] else None))
                continue
            t = feeds[s.name].detach()
            want = torch_dtype(self.io_dtype(s).kernel_numpy)
            if self.io_dtype(s) is dtypes.INT64 and t.numel():
                lo, hi = (int(v) for v in torch.aminmax(t))
                dtypes.to_kernel(np.array([lo, hi]), dtypes.INT64, f"input '{s.name}'")  # range check
            items.append(t.to(want).contiguous())
        outs = {}
        for s in self.plan.outputs:
            # a run-time sized output starts with no rows: the stages before its read-back never write it
            shape = s.sized_shape(0) if s.rows is not None else self._output_shape(s, n)
            make = torch.zeros if s.accumulated else torch.empty
            outs[s.name] = make(shape, dtype=torch_dtype(self.io_dtype(s).kernel_numpy), device=where)
            items.append(outs[s.name])
        derived = self._derived_buffers(host, seen)  # (a damaged bundle is named here, before the checks below)
        keep = self._voxel_rows(n, lambda name: host[name] if name in host else feeds[name].detach().cpu().numpy())
        drain_torch()
        args = [dlpack_buffer(x) if is_torch(x) else x for x in items] + derived
        first_out = len(self.plan.inputs)
        out_bufs = [(s, args[first_out + k], 0) for k, s in enumerate(self.plan.outputs)]

        def sized(s: IOSpec, rows: int):
            # a fresh tensor of the read-back rows; torch's stream drained again, since its caching
            # allocator may hand out a block that work on torch's stream used last
            t = torch.empty(s.sized_shape(rows), dtype=torch_dtype(self.io_dtype(s).kernel_numpy),
                            device=where)
            outs[s.name] = t
            drain_torch()
            return dlpack_buffer(t)

        self._launch_and_wait(args, n, out_bufs, make_output=sized)
        results = {}
        for s in self.plan.outputs:
            if s.name in wanted:
                out = outs[s.name][:keep[s.name]] if s.name in keep else outs[s.name]
                results[s.name] = out if out.dtype == torch_dtype(self.io_dtype(s).numpy) else out.to(
                    torch_dtype(self.io_dtype(s).numpy))
        return {k: results[k] for k in wanted}

    def __call__(self, **feeds):
        """Run and return the output (one) or a tuple of outputs in graph order."""
        res = self.run(feeds)
        vals = list(res.values())
        return vals[0] if len(vals) == 1 else tuple(vals)


class PerBatchNetwork(CompiledNetwork):
    """A network that cannot run one sample at a time (its batch axis moves, or a node mixes
    samples): it compiles itself for each batch size it runs with, shapes fixed, and runs those
    as parallel stages. Its plan, source and allocation are those at batch 2 (what inspect shows);
    `forward` does not exist, since no per-sample function does."""

    def __init__(self, probe: CompiledNetwork, why: str, symbol: str, declared: dict[str, list], compile_at):
        from .passes.infer import PROBE_A

        super().__init__(probe.plan, probe.module, probe.path, probe.backend)
        self.why = why
        self.symbol = symbol
        # (input, axis of the batch symbol) of every input that has it
        self._batch_axes = [(k, dims.index(symbol)) for k, dims in declared.items() if symbol in dims]
        self._compile_at = compile_at
        self._nets: dict[int, CompiledNetwork] = {PROBE_A: probe}  # the probe plan is batch PROBE_A

    @property
    def forward(self):
        """Raise UsageError: a network whose batch moves has no per-sample function."""
        raise UsageError(
            f"this network has no per-sample `forward`: {self.why}; it runs with its batch size fixed per run "
            "(net.run), which a user kernel calling one sample cannot do"
        )

    @forward.setter
    def forward(self, value) -> None:  # CompiledNetwork.__init__ assigns it
        pass

    @property
    def batch_symbol(self) -> str | None:
        """The symbol of the batch dimension its shapes are fixed along at each run."""
        return self.symbol

    def network_for(self, n: int) -> CompiledNetwork:
        """Return the network compiled for batch size n (compiling it on first use)."""
        with device.stream_lock:
            if n not in self._nets:
                self._nets[n] = self._compile_at(n)
            return self._nets[n]

    def batch_of(self, feeds: Mapping[str, Any]) -> int:
        """Return the batch size the feeds carry (the batch symbol's extent in the inputs)."""
        n = None
        for name, axis in self._batch_axes:
            if name in feeds:
                shape = np.shape(feeds[name]) if not is_torch(feeds[name]) else tuple(feeds[name].shape)
                if axis >= len(shape):
                    raise InputError(f"input '{name}': expected rank > {axis} (axis {axis} is the batch '{self.symbol}'), "
                                     f"got shape {shape_str(shape)}")
                if n is not None and shape[axis] != n[1]:
                    raise InputError(f"input '{name}': batch dimension '{self.symbol}' is {shape[axis]}, but input "
                                     f"'{n[0]}' has {n[1]}")
                n = n or (name, int(shape[axis]))
        if n is None:
            names = [k for k, _ in self._batch_axes]
            raise InputNameError(f"missing input(s) {names}; the network's inputs are {[s.name for s in self.inputs]}")
        return n[1]

    def run(self, feeds: Mapping[str, Any], outputs: list[str] | None = None) -> dict[str, Any]:
        """Return {output name: array}: the network at this batch size runs the feeds."""
        feeds, outputs = _feeds_and_outputs(feeds, outputs, self.plan.inputs)
        return self.network_for(self.batch_of(feeds)).run(feeds, outputs)

    def __repr__(self) -> str:
        return super().__repr__().replace("<CompiledNetwork", "<PerBatchNetwork", 1)
