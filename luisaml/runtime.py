"""compile(), CompiledNetwork and NetworkInstance: from a model file to results on the device."""
from __future__ import annotations

import hashlib
import contextlib
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from . import codegen, compiler, device, dtypes, loaders, passes
from .compiler import IOSpec, Plan
from .model import ModelError, shape_str


def _model_name(model) -> str:
    if isinstance(model, (str, os.PathLike)):
        return os.path.basename(os.fspath(model))
    return getattr(getattr(model, "graph", None), "name", None) or "model"


def analyze(model, weights=None, *, batch_axis="auto", input_shapes=None, fuse="off", precision="fp32",
            float64: str = "reject") -> Plan:
    """Return the compile plan of a model without starting a device (what `inspect` shows).

    fuse: "off", "gpu" or "emulated" (see `compile`)."""
    if float64 not in ("reject", "float32"):
        raise ValueError(f"float64 must be 'reject' or 'float32', not {float64!r}")
    proto = loaders.load_proto(model, weights)
    prep = passes.prepare(proto, batch_axis=batch_axis, input_shapes=input_shapes)
    prep.float64_as_float = float64 == "float32"
    return compiler.build_plan(prep, _model_name(model), fuse=fuse, precision=precision)


def fusion_mode(fuse, backend: str, precision: str = "fp32") -> str:
    """Return the fused-kernel mode for a backend: "gpu" (shared memory, CUDA), "emulated" (the CPU
    backend, which cannot compile shared memory) or "off"."""
    if fuse in (False, "off", None):
        if precision != "fp32":
            raise ValueError(f"precision='{precision}' needs the fused MLP kernel; it cannot be used with fuse={fuse!r}")
        return "off"
    if fuse not in ("auto", True):
        raise ValueError(f"fuse must be 'auto', True or False, not {fuse!r}")
    if backend == "cuda":
        return "gpu"
    # on the CPU backend the fused kernel is a correctness path: only when asked for
    return "emulated" if (fuse is True or precision != "fp32") else "off"


def compile(
    model,
    weights=None,
    *,
    backend: str = "auto",
    batch_axis="auto",
    input_shapes: Mapping[str, list] | None = None,
    verbose: bool = False,
    precision: str = "fp32",
    fuse="auto",
    float64: str = "reject",
) -> "CompiledNetwork":
    """Return the model compiled into one kernel on the chosen backend.

    model: a path (.onnx or LuisaML .json), or an onnx.ModelProto.
    weights: a safetensors file, a header-less blob, bytes, or a dict of arrays (optional).
    batch_axis: "auto" (the symbolic dimension leading an input and an output: one thread per
    sample), 0, or None (one instance of the graph as its shapes say).
    input_shapes: fix dynamic dimensions, e.g. {"x": [None, 16, 3]} (None keeps a dimension).
    precision: "fp32", or "fp16": float inputs and outputs are half (the fused MLP kernel only;
    never chosen implicitly).
    fuse: "auto" (an MLP gets the fused cooperative kernel on CUDA), True (also on the CPU
    backend, emulated), False (always the one-thread-per-sample kernel).
    float64: "reject" (operators other than fVDB's refuse float64 tensors), or "float32": compute
    them in float32 (LuisaCompute has no double); inputs and outputs stay float64 on the host."""
    t0 = time.perf_counter()
    name = device.init(backend)
    mode = fusion_mode(fuse, name, precision)
    plan = analyze(model, weights, batch_axis=batch_axis, input_shapes=input_shapes, fuse=mode, precision=precision,
                   float64=float64)
    path = codegen.write_module(plan.source)
    module = codegen.import_module(path)
    if verbose:
        print(f"luisaml: compiled {_model_name(model)} in {time.perf_counter() - t0:.2f} s -> {path}", file=sys.stderr)
    return CompiledNetwork(plan, module, str(path), name)


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def _to_numpy(x, name: str) -> np.ndarray:
    if _is_torch(x):
        return x.detach().cpu().numpy()
    if isinstance(x, np.ndarray):
        return x
    if np.isscalar(x) or isinstance(x, (list, tuple)):
        return np.asarray(x)
    raise TypeError(f"input '{name}': expected a numpy array or torch tensor, got {type(x).__name__}")


def _expected(spec: IOSpec) -> str:
    return shape_str(spec.shape)


class CompiledNetwork:
    """A model compiled into one generated module: run it, or call `forward` from your own kernel."""

    def __init__(self, plan: Plan, module, path: str, backend: str):
        self.plan = plan
        self.module = module
        self.path = path
        self.backend = backend
        self.forward = module.forward  # the @luisa.func of one sample
        self.kernel = module.batch_kernel
        self._weights = None
        self._buffers: dict[tuple[str, int], Any] = {}
        self._derived: dict[str, tuple[bytes, Any]] = {}  # ident -> (digest of its sources, buffer)

    # ---- what it is ----------------------------------------------------------------------
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
        return self.plan.inputs

    @property
    def outputs(self) -> list[IOSpec]:
        return [s for s in self.plan.outputs]

    @property
    def output_names(self) -> list[str]:
        return list(self.plan.model.graph.outputs)

    @property
    def batch_symbol(self) -> str | None:
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
        raise KeyError(f"'{name}' is not an input or output of the compiled network")

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
        name = f"Arr_{s.dtype.dsl}_{max(s.numel, 1)}"
        if not hasattr(self.module, name):
            import luisa
            from luisa.types import half, uint

            kind = {"float": float, "int": int, "uint": uint, "half": half, "bool": bool}[s.dtype.dsl]
            setattr(self.module, name, luisa.ArrayType(max(s.numel, 1), kind))
        return name

    def __repr__(self) -> str:
        ins = ", ".join(f"{s.name}: {s.dtype.name.lower()}{_expected(s)}" for s in self.plan.inputs)
        outs = ", ".join(f"{s.name}: {s.dtype.name.lower()}{_expected(s)}" for s in self.plan.outputs)
        return f"<CompiledNetwork ({ins}) -> ({outs}) on {self.backend}>"

    # ---- running ---------------------------------------------------------------------------
    def check_feeds(self, feeds: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], int, bool]:
        """Return (numpy feeds, batch size, any torch input), checking names, dtypes and shapes."""
        names = [s.name for s in self.plan.inputs]
        unknown = [k for k in feeds if k not in names]
        if unknown:
            raise KeyError(f"unknown input(s) {unknown}; the network's inputs are {names}")
        missing = [k for k in names if k not in feeds]
        if missing:
            raise KeyError(f"missing input(s) {missing}; the network's inputs are {names}")
        arrays: dict[str, np.ndarray] = {}
        torch_in = False
        batch = None
        for s in self.plan.inputs:
            x = feeds[s.name]
            torch_in |= _is_torch(x)
            a = _to_numpy(x, s.name)
            if a.dtype != self.io_dtype(s).numpy:
                raise TypeError(f"input '{s.name}': expected dtype {self.io_dtype(s).numpy}, got {a.dtype}")
            if s.batched:
                want, rows = tuple(s.kernel_shape[1:]), s.kernel_shape[0]  # rows: k of a k*B dimension
                if a.ndim != len(s.kernel_shape) or tuple(a.shape[1:]) != want or a.shape[0] % rows:
                    raise ValueError(
                        f"input '{s.name}': expected shape {_expected(s)}, got {shape_str(a.shape)}"
                    )
                n = a.shape[0] // rows
                if batch is not None and n != batch[1]:
                    raise ValueError(
                        f"input '{s.name}': batch dimension '{self.plan.symbol}' is {n}, but input "
                        f"'{batch[0]}' has {batch[1]}"
                    )
                batch = batch or (s.name, n)
            elif tuple(a.shape) != tuple(s.kernel_shape):
                raise ValueError(f"input '{s.name}': expected shape {_expected(s)}, got {shape_str(a.shape)}")
            arrays[s.name] = a
        return arrays, (batch[1] if batch else 1), torch_in

    def _buffer(self, ident: str, dsl: str, count: int):
        key = (ident, count)
        if key not in self._buffers:
            from .luisa_compat import buffer_type  # noqa: F401

            import luisa
            from luisa.types import half, uint

            kind = {"float": float, "int": int, "uint": uint, "half": half, "bool": bool}[dsl]
            self._buffers = {k: v for k, v in self._buffers.items() if k[0] != ident}
            self._buffers[key] = luisa.Buffer(max(count, 1), kind)
        return self._buffers[key]

    def _derived_buffers(self, arrays: dict[str, np.ndarray]) -> list:
        """Return the buffers of the host-derived inputs, recomputed only when their sources change."""
        from .luisa_compat import upload

        out = []
        for d in self.plan.derived:
            h = hashlib.blake2b(digest_size=16)
            for name in d.sources:
                if name in d.constants:
                    continue
                a = np.ascontiguousarray(arrays[name])
                h.update(f"{name}:{a.dtype.str}:{a.shape};".encode())
                h.update(memoryview(a).cast("B"))
            key = h.digest()
            cached = self._derived.get(d.ident)
            if cached is None or cached[0] != key:
                value = dtypes.to_kernel(d.value(arrays), d.dtype, f"derived input {d.ident}")
                cached = (key, upload(value.reshape(-1), d.dtype.dsl))
                self._derived[d.ident] = cached
            out.append(cached[1])
        return out

    def derived_arguments(self, feeds: Mapping[str, Any]) -> list:
        """Return the buffers `forward` takes after the outputs (the host-derived inputs, such as fVDB
        grid metadata) for these graph inputs; empty when every derived input is a constant."""
        arrays = {k: _to_numpy(v, k) for k, v in feeds.items()}
        missing = sorted({s for d in self.plan.derived for s in d.sources if s not in arrays and s not in d.constants})
        if missing:
            raise KeyError(f"derived inputs need the input(s) {missing}")
        return self._derived_buffers(arrays)

    def run(self, feeds: Mapping[str, Any], outputs: list[str] | None = None) -> dict[str, Any]:
        """Return {output name: array} for the feeds; torch tensors in give torch tensors out."""
        wanted = list(outputs) if outputs is not None else self.output_names
        bad = [o for o in wanted if o not in self.output_names]
        if bad:
            raise KeyError(f"unknown output(s) {bad}; the network's outputs are {self.output_names}")
        if self._zero_copy(feeds):
            return self._run_dlpack(feeds, wanted)
        arrays, batch, torch_in = self.check_feeds(feeds)
        n = batch if self.plan.symbol is not None else 1
        args = []
        for s in self.plan.inputs:
            k = dtypes.to_kernel(arrays[s.name], self.io_dtype(s), f"input '{s.name}'")
            if s.dtype.is_byte:
                from .luisa_compat import byte_buffer

                args.append(byte_buffer(k))
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
        args += self._derived_buffers(arrays)
        self._launch_and_wait(args, n)
        results: dict[str, Any] = {}
        for s, buf, count in out_bufs:
            if s.name not in wanted:
                continue
            from .luisa_compat import read_buffer

            raw = read_buffer(buf, self.io_dtype(s).kernel_numpy, count)
            shape = self._output_shape(s, n)
            results[s.name] = raw.astype(self.io_dtype(s).numpy, copy=False).reshape(shape)
        for name in self.plan.host_outputs:
            if name in wanted:
                results[name] = arrays[name] if name in arrays else np.asarray(self.plan.model.graph.var(name).value)
        results = {k: results[k] for k in wanted}
        if torch_in:
            import torch

            results = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in results.items()}
        return results

    def _launch_and_wait(self, args: list, n: int) -> None:
        """Launch the batch kernel for n samples with this plan's scratch buffers; wait for it."""
        import luisa

        scratch = [
            self._buffer(f"scratch_{dsl}", dsl, per_sample * max(n, 1))
            for dsl, (per_sample, _) in sorted(self.plan.scratch.items())
        ]
        if n > 0:
            self.launch(args, scratch, n)
        luisa.synchronize()

    @staticmethod
    def _output_shape(s: IOSpec, n: int) -> tuple[int, ...]:
        """The shape run() returns for output s with n samples (k*B rows when batched)."""
        return ((n * s.kernel_shape[0],) + tuple(s.kernel_shape[1:])) if s.batched else tuple(s.kernel_shape)

    def launch(self, args: list, scratch: list, n: int) -> None:
        """Enqueue the batch kernel for n samples on LuisaCompute's stream (no synchronisation):
        args are the input and output buffers (then the derived ones) in parameter order."""
        with self._compile_lock():
            fused = self.plan.fused
            if fused is not None:
                self.kernel(*args, self.weights, self._tile_counter(), n, dispatch_size=fused.dispatch_size(n))
            else:
                self.kernel(*args, self.weights, *scratch, dispatch_size=n)
        self._compiled = True

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
        path = codegen.cache_dir().parent / "locks" / f"{codegen.digest(body)}.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    # ---- zero-copy torch interop (CUDA) ---------------------------------------------------
    def _zero_copy(self, feeds: Mapping[str, Any]) -> bool:
        """True when every input is a torch CUDA tensor the kernel can read in place."""
        if self.backend != "cuda" or not feeds or self.plan.derived or self.plan.host_outputs:
            return False
        if not all(_is_torch(v) and v.is_cuda for v in feeds.values()):
            return False
        return all(not s.dtype.is_byte and not s.dtype.is_bool for s in self.plan.inputs + self.plan.outputs)

    def _run_dlpack(self, feeds: Mapping[str, Any], wanted: list[str]) -> dict[str, Any]:
        """run() for torch CUDA tensors: inputs and outputs share memory with LuisaCompute buffers
        through DLPack; torch's stream is drained before the kernel reads, and LuisaCompute's before
        torch sees the outputs (neither library exposes its stream to the other)."""
        import torch

        metas = {}
        for k, v in feeds.items():  # shape and dtype checks without touching the data
            np_dtype = torch.empty((), dtype=v.dtype).numpy().dtype
            metas[k] = np.broadcast_to(np.zeros((), np_dtype), tuple(v.shape))
        _, batch, _ = self.check_feeds(metas)
        n = batch if self.plan.symbol is not None else 1
        device = next(iter(feeds.values())).device
        keep, args = [], []
        for s in self.plan.inputs:
            t = feeds[s.name].detach()
            want = _torch_dtype(self.io_dtype(s).kernel_numpy)
            if self.io_dtype(s) is dtypes.INT64 and t.numel():
                lo, hi = int(t.min()), int(t.max())
                dtypes.to_kernel(np.array([lo, hi]), dtypes.INT64, f"input '{s.name}'")  # range check
            t = t.to(want).contiguous()
            keep.append(t)
        outs = {}
        for s in self.plan.outputs:
            shape = self._output_shape(s, n)
            make = torch.zeros if s.accumulated else torch.empty
            outs[s.name] = make(shape, dtype=_torch_dtype(self.io_dtype(s).kernel_numpy), device=device)
        torch.cuda.current_stream(device).synchronize()
        for t in keep + list(outs.values()):
            args.append(_dlpack_buffer(t))
        self._launch_and_wait(args, n)
        results = {}
        for s in self.plan.outputs:
            if s.name in wanted:
                out = outs[s.name]
                results[s.name] = out if out.dtype == _torch_dtype(self.io_dtype(s).numpy) else out.to(
                    _torch_dtype(self.io_dtype(s).numpy))
        return {k: results[k] for k in wanted}

    def __call__(self, **feeds):
        """Run and return the output (one) or a tuple of outputs in graph order."""
        res = self.run(feeds)
        vals = list(res.values())
        return vals[0] if len(vals) == 1 else tuple(vals)


def _torch_dtype(np_dtype):
    import torch

    return {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16,
            np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64,
            np.dtype(np.uint32): torch.uint32, np.dtype(np.bool_): torch.bool}[np.dtype(np_dtype)]


def _dlpack_buffer(t):
    """Return a luisa.Buffer sharing a contiguous torch CUDA tensor's memory (an empty one gets a
    one-element buffer: a kernel never reads it)."""
    import luisa

    if t.numel() == 0:
        t = t.new_zeros(1)
    buf = luisa.Buffer.from_dlpack(t.reshape(-1))
    buf._torch_owner = t  # the tensor outlives the buffer that borrows it
    return buf


@dataclass
class _Binding:
    value: Any


class NetworkInstance:
    """The C++ LuisaML API on luisaml's machinery: bind inputs, outputs and weights, then forward()."""

    def __init__(self, model=None, weights=None, **options):
        self.net: CompiledNetwork | None = None
        self._inputs: dict[str, Any] = {}
        self._outputs: dict[str, Any] = {}
        self._weights = None
        self._source = None  # (model, weights, options) when this instance compiled the model
        self.warp_size = 32
        if model is not None:
            self.set_model(model, weights, **options)

    def set_model(self, model, weights=None, **options) -> None:
        """Compile (or adopt a CompiledNetwork) and clear the bindings."""
        self._source = None if isinstance(model, CompiledNetwork) else (model, weights, dict(options))
        self.net = model if self._source is None else self._compile()
        self._inputs.clear()
        self._outputs.clear()
        self._weights = None

    def _compile(self) -> CompiledNetwork:
        model, weights, options = self._source
        if self.warp_size <= 1:  # as in the C++ runtime: no paths where threads cooperate
            options = dict(options, fuse=False)
        return compile(model, weights, **options)

    def _need_model(self) -> CompiledNetwork:
        if self.net is None:
            raise RuntimeError("no model: call set_model first")
        return self.net

    def set_input(self, name: str, tensor) -> None:
        """Bind a graph input to an array or torch tensor (checked at forward)."""
        net = self._need_model()
        if name not in [s.name for s in net.inputs]:
            raise KeyError(f"'{name}' is not an input; inputs are {[s.name for s in net.inputs]}")
        self._inputs[name] = tensor

    def set_output(self, name: str, tensor=None) -> None:
        """Bind a graph output to a numpy array written in place (or None to allocate one)."""
        net = self._need_model()
        if name not in net.output_names:
            raise KeyError(f"'{name}' is not an output; outputs are {net.output_names}")
        self._outputs[name] = tensor

    def set_weight_buffer(self, buffer) -> None:
        """Use another weight blob laid out as `net.weight_layout` (bytes or a luisa.ByteBuffer)."""
        net = self._need_model()
        want = len(net.weight_bytes())
        if isinstance(buffer, (bytes, bytearray, np.ndarray)):
            raw = bytes(buffer) if not isinstance(buffer, np.ndarray) else buffer.tobytes()
            if len(raw) < want:
                raise ValueError(f"weight buffer has {len(raw)} bytes, the network's layout needs {want}")
            from .luisa_compat import byte_buffer

            buffer = byte_buffer(raw)
        elif getattr(buffer, "bytesize", want) < want:
            raise ValueError(f"weight buffer has {buffer.bytesize} bytes, the network's layout needs {want}")
        self._weights = buffer

    def set_warp_size(self, warp_size: int) -> None:
        """Set whether threads may cooperate: <= 1 compiles the one-thread-per-sample kernel only
        (no fused cooperative kernel), as warp_size 1 disables the warp paths of the C++ runtime."""
        if int(warp_size) < 0:
            raise ValueError("warp size must be >= 0")
        cooperative = self.warp_size > 1
        self.warp_size = int(warp_size)
        if self._source is not None and cooperative != (self.warp_size > 1):
            self.net = self._compile()

    def forward(self) -> dict[str, np.ndarray]:
        """Run the bound inputs through the network; fill bound outputs in place; return all outputs."""
        net = self._need_model()
        unbound = [s.name for s in net.inputs if s.name not in self._inputs]
        if unbound:
            raise RuntimeError(f"input(s) {unbound} are not bound: call set_input for each")
        saved = net._weights
        if self._weights is not None:
            net._weights = self._weights
        try:
            results = net.run(self._inputs)
        finally:
            net._weights = saved
        for name, target in self._outputs.items():
            if target is None:
                continue
            value = results[name]
            arr = target.detach().numpy() if _is_torch(target) else target
            if tuple(arr.shape) != tuple(value.shape) or arr.dtype != np.asarray(value).dtype:
                raise ValueError(
                    f"output '{name}': bound array is {arr.dtype}{shape_str(arr.shape)}, "
                    f"the network produces {np.asarray(value).dtype}{shape_str(np.asarray(value).shape)}"
                )
            arr[...] = value if not _is_torch(value) else value.numpy()
        return results
