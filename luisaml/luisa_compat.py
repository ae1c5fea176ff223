"""Every workaround for a luisa-python 0.3.7 bug lives here, each with a test that fails the day
the bug is fixed upstream (tests/test_luisa_compat.py)."""
from __future__ import annotations

import numpy as np


def apply() -> None:
    """Install the process-wide shims (idempotent)."""
    _cheap_func_caller()
    _wide_integer_arithmetic()


def hook_luisa_import() -> None:
    """Make luisa's own first import cheap too, where luisaml is imported before it (`import luisaml`
    calls this): luisa/__init__ imports modules that decorate 30 functions with `@luisa.func`, each
    walking the whole stack (_cheap_func_caller), before any shim can be installed. A one-shot
    import hook runs that import with inspect.stack answering luisa.func's call from two frames
    (what it reads: [1][0], the caller's frame; every other caller gets the real stack), then
    installs the shim. ResNet-18's `luisaml.load` (kernels cached): 0.74-0.78 -> 0.60-0.62 s CPU time,
    four processes each, alternated (2026-12-05, this project's 2-core host; the first run unchanged)."""
    import sys

    if "luisa" in sys.modules or any(isinstance(f, _FirstLuisaImport) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _FirstLuisaImport())


class _FirstLuisaImport:
    """The meta path finder of hook_luisa_import: finds luisa once, through the other finders."""

    def find_spec(self, name, path=None, target=None):
        import importlib.util
        import inspect
        import sys

        if name != "luisa":
            return None
        sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
        spec = importlib.util.find_spec("luisa")
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        real_exec, real_stack = loader.exec_module, inspect.stack

        def stack(context=1):
            caller = sys._getframe(1)
            if caller.f_globals.get("__name__") == "luisa.func":  # (func.__init__: inspect.stack()[1][0])
                return [(caller,), (caller.f_back,)]
            return real_stack(context)

        def exec_module(module):
            inspect.stack = stack
            try:
                real_exec(module)
            finally:
                inspect.stack = real_stack
            _cheap_func_caller()

        loader.exec_module = exec_module
        return spec


def _cheap_func_caller() -> None:
    """Make `@luisa.func` learn its caller's file and line from one frame.

    luisa-python's func.__init__ calls inspect.stack(), which builds a FrameInfo (source file,
    module lookup, a line of context) for every frame of the stack, to use the first one: 5-20 ms a
    decorator under an import, and a generated module has one per stage. A 1 MB ResNet-18 module
    imported in 0.43 s, 0.30 s with this (0.57 -> 0.31 s with torch loaded, whose thousand modules
    getmodule scans); the kernel-build workers each import it (luisaml/parallel_build.py). Same
    attributes, same values: getframeinfo of the caller's frame, without context lines."""
    import inspect
    import sys

    import luisa  # noqa: F401  (loads luisa.func)

    func_class = sys.modules["luisa.func"].func
    if getattr(func_class.__init__, "_luisaml_shim", False):
        return
    upstream = func_class.__init__

    def __init__(self, pyfunc):
        self.fence_idx = -1
        self.pyfunc = pyfunc
        self.__name__ = pyfunc.__name__
        if self.__name__ in sys.modules["luisa.func"].builtin_func_names:
            raise RuntimeError(f'Cannot override builtin function "{self.__name__}"')
        self.compiled_results = {}  # maps (arg_type_tuple) to (function, shader_handle)
        frameinfo = inspect.getframeinfo(sys._getframe(1), 0)
        self.filename = frameinfo.filename
        self.lineno = frameinfo.lineno

    __init__._luisaml_shim = True
    __init__._upstream = upstream
    func_class.__init__ = __init__


def _wide_integer_arithmetic() -> None:
    """Give a binary operation on 64-bit scalars a 64-bit type.

    luisa-python's builtin.upper_scalar_dtype, which types every scalar binary operation, knows float,
    int, half, short and ushort and answers uint for everything else: `a * b`, `a >> 7` or `a + a` on
    two ulongs (or longs) is typed uint, computed in 32 bits and widened again (the product of
    0x0123456789abcdef and 3 came back as 0x9d0369cd on the CPU backend). With this, the result takes
    the wider of the two integer types, as C++ does (ulong over long over the 32-bit ones); every other
    pair (a float or half operand among them) keeps upstream's answer, so no kernel without a 64-bit
    operand changes. shaders/f64.py's binary64 arithmetic needs it."""
    import sys

    import luisa  # noqa: F401  (loads luisa.builtin)

    builtin = sys.modules["luisa.builtin"]
    if getattr(builtin.upper_scalar_dtype, "_luisaml_shim", False):
        return
    upstream = builtin.upper_scalar_dtype
    from luisa.types import half, long, ulong

    def upper_scalar_dtype(dtype0, dtype1):
        pair = {dtype0, dtype1}
        if float not in pair and half not in pair and (ulong in pair or long in pair):
            return ulong if ulong in pair else long
        return upstream(dtype0, dtype1)

    upper_scalar_dtype._luisaml_shim = True
    upper_scalar_dtype._upstream = upstream
    builtin.upper_scalar_dtype = upper_scalar_dtype


def settle_cpu_backend() -> None:
    """Build and run a one-word kernel under an inter-process lock, right after the CPU device starts.

    LuisaCompute bug: its CPU backend parses llvm_paths.json beside the Python executable at every
    process's first kernel build and then rewrites it in place; a process that reads it while
    another rewrites it panics and aborts (of 12 processes started together, 2 to 5 aborted; CI lost
    a test worker to it). Under cache.llvm_paths_lock one luisaml process at a time does that first
    build (this one, ~25 ms once cached); later builds in the process never read the file again."""
    import luisa

    from . import cache

    @luisa.func
    def first_build(flag):
        flag.write(dispatch_id().x, 1)  # noqa: F821 (a DSL builtin)

    with cache.llvm_paths_lock():
        cache.repair_llvm_paths()
        flag = luisa.Buffer(1, int)
        first_build(flag, dispatch_size=1)
        luisa.synchronize()


def byte_buffer(data: bytes | np.ndarray):
    """Return a luisa.ByteBuffer holding `data` (padded to 4 bytes), usable as a kernel argument.

    Two bugs: passing a ByteBuffer to a kernel fails because to_lctype looks for `__name__` on the
    ByteBufferType instance; ByteBuffer.from_array cannot take numpy scalar types. The upload is
    enqueued, not waited for: it runs before any later launch on the stream, which keeps the words
    (our own copy of data) until then."""
    import luisa

    from . import counts

    raw = _byte_words(data)
    buf = counts.allocated(luisa.ByteBuffer(raw.size))
    fix_byte_buffer(buf)
    buf.copy_from_array(raw.view(np.uint32), sync=False)
    return buf


def empty_byte_buffer(size: int):
    """Return a luisa.ByteBuffer of size bytes (whole words, at least one), its bytes not written: the
    caller fills it (a copy on the device: feeds.BoundInputs.byte_input; a kernel: pool._new_buffer)."""
    import luisa

    from . import counts

    buf = counts.allocated(luisa.ByteBuffer(max(-(-int(size) // 4) * 4, 4)))
    fix_byte_buffer(buf)
    return buf


def _byte_words(data: bytes | np.ndarray, copy: bool = True) -> np.ndarray:
    """Return data as uint8, padded with zeros to a whole number of 4-byte words (at least one), a
    copy; copy False: a contiguous array of whole words as a view of it (a grid blob of megabytes,
    written into a spare buffer at most twice a detector frame on CUDA)."""
    if not copy and isinstance(data, np.ndarray) and data.flags.c_contiguous and data.nbytes and data.nbytes % 4 == 0:
        return data.reshape(-1).view(np.uint8)
    raw = np.frombuffer(bytes(data) if not isinstance(data, np.ndarray) else data.tobytes(), dtype=np.uint8)
    if raw.size % 4:
        raw = np.concatenate([raw, np.zeros(-raw.size % 4, np.uint8)])
    return raw if raw.size else np.zeros(4, np.uint8)


def byte_size(data: np.ndarray) -> int:
    """Return the bytes of the ByteBuffer byte_buffer(data) makes."""
    return max(-(-int(data.nbytes) // 4) * 4, 4)


def refill_byte_buffer(buf, data: np.ndarray) -> None:
    """Write data (padded as byte_buffer pads it) to the start of a ByteBuffer of at least that size
    (enqueued, as byte_buffer's upload). The bytes past it keep what they held (an older input's): the
    buffer is a uint8 input's, whose kernels read within its elements (a grid blob: within its grids,
    their offsets checked against the blob by operators/fvdb/common.bundle_grids), so they need no
    zeros; filling them copied and uploaded the whole buffer, up to twice the data
    (feeds.BoundInputs.byte_input's spares). data is
    not copied: the caller (a network's run, which waits for the stream before it returns) keeps it
    unchanged until the upload has run."""
    raw = _byte_words(data, copy=False)
    assert raw.size <= buf.bytesize, (raw.size, buf.bytesize)
    upload_prefix(buf, raw.view(np.uint32))


def upload_prefix(buf, array: np.ndarray) -> None:
    """Enqueue the upload of a contiguous array into the first array.nbytes bytes of buf (a pool's
    buffer of at least that size: pool.sized); luisa-python's copy_from_array writes whole buffers only.
    The stream keeps the array until the upload has run."""
    if array.nbytes == buf.bytesize:
        buf.copy_from_array(array, sync=False)
        return
    from luisa import globalvars, lcapi

    assert array.nbytes <= buf.bytesize and array.flags.c_contiguous, (array.nbytes, buf.bytesize)
    stream = globalvars.vars.stream
    stream.add(lcapi.BufferUploadCommand.create(buf.handle, 0, array.nbytes, array))
    stream.add_upload_buffer(array)


def fix_byte_buffer(buf) -> None:
    """Make a ByteBuffer passable to a kernel (its type instance lacks __name__)."""
    buf.bufferType.__name__ = "ByteBufferType"


def upload(array: np.ndarray, dsl: str):
    """Return a new luisa.Buffer of DSL type `dsl` holding `array` (Buffer.from_array infers the
    element type from the first element, which is wrong for half, uint and bool)."""
    import luisa
    from luisa.types import half, uint

    from . import counts

    kind = {"float": float, "int": int, "uint": uint, "half": half, "bool": bool}[dsl]
    buf = counts.allocated(luisa.Buffer(max(array.size, 1), kind))
    if array.size:
        buf.copy_from_array(np.ascontiguousarray(array).reshape(-1), sync=False)
    return buf


def buffer_type(dsl: str):
    """Return luisa.BufferType for a DSL scalar type name."""
    import luisa
    from luisa.types import half, uint

    return luisa.BufferType({"float": float, "int": int, "uint": uint, "half": half, "bool": bool}[dsl])
