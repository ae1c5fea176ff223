"""A CUDA plan's stage kernels run in Python, without a GPU: the CPU backend cannot compile shared
memory or block barriers, so this is how the tests check the blocks stages' indexing and barriers
(the GEMM tiles, the recurrent block loop) before a device runs them.

A kernel's body (its `pyfunc`, the DSL source as Python) runs with the DSL's names bound to Python:
buffers are numpy arrays (float64), float4 a 4-vector, `weights.read(type, byte offset)` the blob's
words, shared arrays one list per block, a Python thread per GPU thread; the threads of a block run
one at a time, each up to its next `sync_block` (a barrier), in thread order or reversed, so that a
missing barrier reads what another thread has not written yet, or has overwritten; an items stage
runs its work items one after another. A warp reduction (warp_active_sum / max / min / any) is such a
stop too: each lane leaves its value and waits for its turn, when every lane of its warp has left
one; a warp whose lanes do not all reach it is an error (the forms here keep a warp whole), and
warp_active_max / min drop NaN (as CUDA's fmaxf / fminf do; over ints they give an int), so a form must find a NaN
another way. `run_plan` runs every stage of a plan in launch order over its own buffers and returns
the graph's outputs."""
from __future__ import annotations

import threading
import types

import numpy as np


class Vec(np.ndarray):
    """A float4: float4(x) broadcasts, float4(a, b, c, d); arithmetic elementwise; .x .y .z .w lanes."""

    def __new__(cls, *v):
        if len(v) == 1:
            a = np.broadcast_to(np.asarray(v[0], dtype=np.float64), (4,)).copy()
        else:
            a = np.array([float(e) for e in v], dtype=np.float64)
        return a.view(cls)

    # (item(i), not self[i].item(): a tenth of the time, and the emulated tiles' most common call)
    x = property(lambda self: self.item(0))
    y = property(lambda self: self.item(1))
    z = property(lambda self: self.item(2))
    w = property(lambda self: self.item(3))


def _out(r):
    """A scalar as a Python number, an array as a Vec."""
    return r.item() if np.ndim(r) == 0 else np.asarray(r).view(Vec)


def _wrap(ufunc):
    def f(*args):
        with np.errstate(all="ignore"):
            return _out(ufunc(*args))
    return f


def _fma(a, b, c):
    return _out(np.asarray(a) * b + c) if isinstance(a, np.ndarray) or isinstance(b, np.ndarray) else a * b + c


def _min(a, b):
    return _out(np.minimum(a, b)) if isinstance(a, np.ndarray) or isinstance(b, np.ndarray) else min(a, b)


def _max(a, b):
    return _out(np.maximum(a, b)) if isinstance(a, np.ndarray) or isinstance(b, np.ndarray) else max(a, b)


def _select(f, t, cond):
    return _out(np.where(cond, t, f))


def _bitwise_cast(dtype, v):
    """A 32-bit word read as int (signed) or float: the NanoVDB shaders' coordinates and values."""
    import struct

    word = struct.pack("<f", v) if isinstance(v, float) else (int(v) & 0xFFFFFFFF).to_bytes(4, "little")
    if dtype is float:
        return struct.unpack("<f", word)[0]
    u = int.from_bytes(word, "little")
    return u - (1 << 32) if dtype is int and u >= 1 << 31 else u


def _warp_extreme(values: list, fold):
    """A warp's max or min: an int for ints (TopK's ranks, operators/topk_chunks.py), a float else."""
    if all(isinstance(v, int) for v in values):
        return int(fold.reduce(np.asarray(values, np.int64)))
    return float(fold.reduce(values))


class Id:
    def __init__(self, x):
        self.x = x


class Buf:
    """A buffer parameter over a numpy array. An index outside it is an error, as a GPU's fault would be
    (numpy would wrap a negative one: a read before the buffer that a small test's pooled memory hides
    on the device, and a large one's does not)."""

    def __init__(self, a: np.ndarray):
        self.a = a

    def _at(self, i):
        i = int(i)
        if not 0 <= i < len(self.a):
            raise IndexError(f"buffer index {i} outside [0, {len(self.a)})")
        return i

    def read(self, *at):
        if len(at) == 2:  # a byte buffer's read(uint, byte offset) (a NanoVDB grid's words): little-endian
            i = self._at(at[1])
            self._at(i + 3)
            return int(sum(int(self.a[i + b]) << (8 * b) for b in range(4)))
        return self.a[self._at(at[0])].item()

    def write(self, i, v):
        self.a[self._at(i)] = v

    __getitem__ = read
    __setitem__ = write


class Blob:
    """The weight blob: `weights.read(type, byte offset)`."""

    def __init__(self, data: bytes):
        data = data + b"\0" * (-len(data) % 4)
        self.f = np.frombuffer(data, dtype=np.float32)
        self.i = np.frombuffer(data, dtype=np.int32)

    def read(self, dtype, offset):
        w = offset // 4
        if dtype is Vec:
            return Vec(*self.f[w:w + 4])
        return int(self.i[w]) if dtype is int else float(self.f[w])


WARP = 32

MATH = ("exp", "log", "tanh", "sqrt", "abs", "floor", "ceil", "sin", "cos", "tan", "isnan", "isinf", "exp2", "log2",
        "sign", "round", "trunc", "copysign")


class Emulator:
    """The DSL's names for the kernels of one generated module; `extra`: more names (a marked
    callable's body, ...)."""

    def __init__(self, module, extra: dict | None = None):
        self.local = threading.local()
        self.block_shared: dict[int, list] = {}
        self.lock = threading.Lock()
        local = self.local
        names = dict(
            float4=Vec, fma=_fma, min=_min, max=_max, select=_select,
            clamp=lambda v, lo, hi: _out(np.clip(v, lo, hi)),
            set_block_size=lambda *a: None,
            thread_id=lambda: Id(local.thread), block_id=lambda: Id(local.block),
            dispatch_id=lambda: Id(local.tid), dispatch_size=lambda: Id(local.size),
            sync_block=lambda: local.barrier.wait(),
            warp_active_sum=lambda v: sum(local.warp(v)),
            warp_active_max=lambda v: _warp_extreme(local.warp(v), np.fmax),
            warp_active_min=lambda v: _warp_extreme(local.warp(v), np.fmin),
            warp_active_any=lambda v: any(local.warp(v)),
            quiet_nan=lambda: float("nan"),  # (math_lib's: a NaN the CUDA codegen cannot fold into a literal)
            # 32-bit unsigned words (SparseConv3d's tap masks): wrapped as CUDA's, and their bit counts
            uint=lambda v=0: int(v) & 0xFFFFFFFF, popcount=lambda v: bin(int(v) & 0xFFFFFFFF).count("1"),
            bitwise_cast=_bitwise_cast,
            # a conversion to half rounds to nearest even and overflows to inf (CUDA's __float2half_rn, cvt.rn.f16.f32):
            # numpy's float16, held as a Python float (the tensor-core tile's FP16 copies: float(half(x)))
            half=lambda v: float(np.float16(v)),
        )
        for m in MATH:
            names[m] = _wrap(getattr(np, {"abs": "absolute", "round": "rint"}.get(m, m)))
        names.update(extra or {})
        self.names = names
        self.funcs: dict[int, types.FunctionType] = {}
        self.globals = self._globals(vars(module))

    def _globals(self, space: dict) -> dict:
        g = dict(space)
        for name, value in space.items():
            if name.startswith("Shared_"):
                g[name] = self._shared(value)
            elif name.startswith("Arr_"):
                g[name] = (lambda n, zero: (lambda: [zero] * n))(value.size, 0 if "_int" in name else 0.0)
            elif hasattr(value, "pyfunc") and name not in self.names:  # a DSL helper: emulated too
                g[name] = self.function(value)
        g.update(self.names)
        return g

    def _shared(self, value):
        n, vec = value.size, "float4" in repr(value.dtype) or "vector" in repr(value.dtype).lower()

        def make():
            local = self.local
            with self.lock:
                arrays = self.block_shared.setdefault(local.block, [])
                if local.made >= len(arrays):
                    arrays.append([Vec(0.0) for _ in range(n)] if vec else [0.0] * n)
            local.made += 1
            return arrays[local.made - 1]
        return make

    def function(self, func) -> types.FunctionType:
        """The Python function of a luisa.func with the emulated names."""
        key = id(func)
        if key not in self.funcs:
            # (a recursive helper, or helpers that call each other, find the one function, whose
            # globals are filled in afterwards)
            space: dict = {}
            # (a callable a factory made, shaders/tensor_cores.py's tiles: the constants it closes over)
            cells = func.pyfunc.__closure__ or ()
            self.funcs[key] = types.FunctionType(func.pyfunc.__code__, space, closure=tuple(
                types.CellType(self.function(c.cell_contents) if hasattr(c.cell_contents, "pyfunc") else c.cell_contents)
                for c in cells) or None)
            space.update(self._globals(func.pyfunc.__globals__))
        return self.funcs[key]

    def run_items(self, func, args: list, items: int) -> None:
        fn, local = self.function(func), self.local
        local.size = items
        with np.errstate(all="ignore"):
            for tid in range(items):
                local.tid = tid
                fn(*args)

    def run_blocks(self, func, args: list, blocks: int, threads: int, reverse: bool = False) -> None:
        """Every block's threads one at a time, in thread order (reverse: the other way), each from
        where it stopped to its next sync_block: a barrier missing between a write and another
        thread's read shows in one of the two orders. Every thread must pass the same barriers."""
        fn = self.function(func)
        order = list(range(threads))[::-1 if reverse else 1]
        place = {t: i for i, t in enumerate(order)}  # (a thread's place in the order)
        for block in range(blocks):
            # Each thread waits on a semaphore of its own, released by the thread whose turn ends: one
            # thread wakes a hand-over (a condition notified for all woke every waiting thread, 128 a
            # hand-over in a 128-thread block: most of what an emulated tile cost).
            go = [threading.Semaphore(0) for _ in range(threads)]
            alive = [True] * threads  # (by place in the order)
            passed = [0] * threads
            errors = []

            def hand_on(me):
                """Give the turn to the next live thread after `me` in the order (round to the first;
                `me` again where it is the only one left), or to none where none is left."""
                at = place[me]
                for d in range(1, threads + 1):
                    nxt = (at + d) % threads
                    if alive[nxt]:
                        go[order[nxt]].release()
                        return

            def barrier(me):
                passed[me] += 1
                hand_on(me)
                go[me].acquire()
                if errors:
                    raise RuntimeError("another thread failed")

            deposits: dict[tuple[int, int], dict[int, float]] = {}

            def warp(me, value, block=block):
                """The values of every lane of my warp at its next warp reduction, in lane order."""
                local = self.local
                key = (local.collectives, me // WARP)
                local.collectives += 1
                deposits.setdefault(key, {})[me % WARP] = value
                hand_on(me)
                go[me].acquire()
                if errors:
                    raise RuntimeError("another thread failed")
                got, lanes = deposits[key], min(WARP, threads - me // WARP * WARP)
                if len(got) != lanes:
                    raise RuntimeError(f"block {block}: warp {me // WARP} reduced with {len(got)} of its {lanes} lanes")
                return [got[lane] for lane in sorted(got)]

            def body(thread, block=block):
                local = self.local
                local.thread, local.block, local.made, local.collectives = thread, block, 0, 0
                local.tid, local.size = block * threads + thread, blocks * threads
                local.barrier = type("Barrier", (), {"wait": staticmethod(lambda: barrier(thread))})
                local.warp = lambda v: warp(thread, v)
                go[thread].acquire()
                try:
                    if not errors:
                        with np.errstate(all="ignore"):
                            fn(*args)
                except Exception as e:  # (reported below; the others stop at their next barrier)
                    errors.append(e)
                alive[place[thread]] = False
                hand_on(thread)

            pool = [threading.Thread(target=body, args=(i,)) for i in range(threads)]
            for t in pool:
                t.start()
            go[order[0]].release()
            for t in pool:
                t.join()
            self.block_shared.pop(block, None)
            if errors:
                raise errors[0]
            assert len(set(passed)) == 1, f"block {block}: threads passed different barriers: {passed}"


def kernel_name(plan, st) -> str:
    """The name of the kernel a stage launches in the plan's module."""
    return plan.stage_kernels[st.index] if plan.stage_kernels else f"stage_{st.index}"


def kernel_of(plan, module, st):
    """The luisa.func a stage launches."""
    return getattr(module, kernel_name(plan, st))


def run_plan(plan, feeds: dict[str, np.ndarray], extra: dict | None = None, reverse: bool = False) -> dict[str, np.ndarray]:
    """Return the graph's outputs of a plan for `feeds` (a batch symbol: the batch the batched inputs
    have), every stage run in launch order (run_items / run_blocks, reverse its thread order) over
    buffers of its own."""
    from luisaml import cache
    from luisaml.emission import buffer_ident

    assert plan.schedule is not None and not plan.merged_stages
    module = cache.import_module(cache.write_module(plan.source))
    emu = Emulator(module, extra)
    n = 1
    if plan.symbol is not None:
        n = next(np.shape(feeds[s.name])[0] for s in plan.inputs if s.batched)

    def zeros(size: int, dsl_or_dtype) -> np.ndarray:
        integer = dsl_or_dtype in ("int", "uint") or getattr(dsl_or_dtype, "is_int", False)
        return np.zeros(max(size, 1), np.int64 if integer else np.float64)

    args = {"weights": Blob(plan.blob.bytes()), "errors": Buf(zeros(4, "int"))}
    for s in plan.inputs:
        args[s.ident] = Buf(np.asarray(feeds[s.name]).astype(np.int64 if s.dtype.is_int else np.float64).ravel())
    for d in plan.derived:  # host-derived inputs (a grid's metadata), computed from the feeds as a run does
        if d.ident not in args:
            value = np.asarray(d.value({k: np.asarray(v) for k, v in feeds.items()}))
            args[d.ident] = Buf(value.astype(np.int64 if d.dtype.is_int else np.float64).ravel())
    outs = {}
    for s in plan.outputs:
        outs[s.name] = zeros(s.numel * (n if s.batched else 1), s.dtype)
        args[s.ident] = Buf(outs[s.name])
    for slot in plan.schedule.buffers.slots:
        args[buffer_ident(slot)] = Buf(zeros(slot.size * n, slot.dtype))
    for dsl, size in plan.kernel_scratch.items():
        args[f"scratch_{dsl}"] = Buf(zeros(size * n, dsl))
    for st in plan.schedule.stages:
        func = kernel_of(plan, module, st)
        code = func.pyfunc.__code__
        values = [st.index if p == "stage" else n if p == "n" else args[p] for p in code.co_varnames[:code.co_argcount]]
        if st.domain == "blocks":
            emu.run_blocks(func, values, st.dispatch(n) // st.threads, st.threads, reverse)
        else:
            emu.run_items(func, values, st.dispatch(n))
    shape = {s.name: tuple(n if isinstance(d, str) else d for d in s.shape) if s.batched else s.kernel_shape
             for s in plan.outputs}
    return {s.name: outs[s.name][:int(np.prod(shape[s.name]))].reshape(shape[s.name]) for s in plan.outputs}


def build_dsl(plan, name: str, monkeypatch) -> list:
    """Build kernel `name` of a plan (a CUDA plan's, shared memory and barriers included) through
    luisa-python's AST builder, as a launch on any backend does first, with the backend's compile
    left out (the CPU backend cannot compile shared memory); return the built functions. luisa must
    be initialised (buffers are made for the argument types)."""
    import sys

    import luisa
    from luisa.types import dtype_of

    from luisaml import cache, luisa_compat

    kernel = getattr(cache.import_module(cache.write_module(plan.source)), name)
    built = []

    class Impl:
        def create_shader(self, function):
            built.append(function)
            return 0

        def destroy_shader(self, handle):
            pass

    monkeypatch.setattr(sys.modules["luisa.func"], "get_global_device",
                        lambda: type("Device", (), {"impl": lambda self: Impl()})())
    ints = {s.ident for s in plan.inputs + plan.outputs if s.dtype.is_int}
    ints |= {f"buf_{dsl}_{k}" for k in range(len(plan.schedule.buffers.slots)) for dsl in ("int", "uint")}
    args = []
    code = kernel.pyfunc.__code__
    for p in code.co_varnames[:code.co_argcount]:
        if p == "weights":
            args.append(luisa_compat.byte_buffer(b"\0" * 16))
        elif p in ("stage", "n"):
            args.append(0)
        else:
            args.append(luisa.Buffer(4, int if p in ints or p.startswith(("scratch_int", "errors")) else float))
    try:
        kernel.get_compiled(0, False, tuple(dtype_of(x) for x in args))
    finally:
        kernel.compiled_results.clear()
    return built
