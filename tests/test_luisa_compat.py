"""Each luisa-python 0.3.7 workaround in luisaml/luisa_compat.py, with a test that fails the day the
bug is fixed upstream (then the shim and its test can go)."""
import luisa
import numpy as np
import pytest

from luisaml import luisa_compat


def _download(buf, dtype, count: int) -> np.ndarray:
    """A buffer's contents through a download into a typed array, as luisaml/launch.py reads outputs."""
    out = np.empty(count, dtype=dtype)
    buf.copy_to(out, sync=True)
    return out


def test_bytebuffer_type_lacks_name_upstream():
    """Bug: passing a ByteBuffer to a kernel fails: to_lctype looks for __name__ on the instance."""
    from luisa.types import to_lctype

    buf = luisa.ByteBuffer(16)
    with pytest.raises(TypeError, match="is not a valid data type"):
        to_lctype(buf.bufferType)
    luisa_compat.fix_byte_buffer(buf)
    assert to_lctype(buf.bufferType).description() == "buffer<void>"


def test_bytebuffer_numpy_is_broken_upstream():
    """Bug: ByteBuffer.numpy() reads a dtype the class never sets; a typed download reads it."""
    buf = luisa_compat.byte_buffer(np.arange(8, dtype=np.uint8))
    with pytest.raises(AttributeError):
        buf.numpy()
    np.testing.assert_array_equal(_download(buf, np.uint8, 8), np.arange(8, dtype=np.uint8))


def test_uint_buffer_numpy_is_broken_upstream():
    """Bug: Buffer.numpy() maps only int/float/bool element types."""
    buf = luisa_compat.upload(np.array([1, 2, 3], np.uint32), "uint")
    with pytest.raises(KeyError):
        buf.numpy()
    np.testing.assert_array_equal(_download(buf, np.uint32, 3), [1, 2, 3])


def test_from_array_infers_the_wrong_type_upstream():
    """Bug: Buffer.from_array takes the element type of arr[0].item(), so float16 becomes float."""
    half = np.array([1.5, -2.0], np.float16)
    with pytest.raises(AssertionError):  # 2 halves are 4 bytes, a 2-float buffer is 8
        luisa.Buffer.from_array(half)
    buf = luisa_compat.upload(half, "half")
    np.testing.assert_array_equal(_download(buf, np.float16, 2), half)


def test_bytebuffer_from_uint64_is_broken_upstream():
    """Bug: ByteBuffer.from_array cannot take numpy scalar types (np.uint64 here)."""
    with pytest.raises(Exception):
        luisa.ByteBuffer.from_array(np.arange(4, dtype=np.uint64))
    buf = luisa_compat.byte_buffer(np.arange(4, dtype=np.uint64))
    np.testing.assert_array_equal(_download(buf, np.uint64, 4), np.arange(4, dtype=np.uint64))


# ---- LuisaCompute's llvm_paths.json (luisa_compat.settle_cpu_backend) ---------------------------
_START_TOGETHER = r"""
import os, sys, time
from luisaml import device, luisa_compat
folder, me, mode = sys.argv[1:]
if mode == "unsettled":
    luisa_compat.settle_cpu_backend = lambda: None
open(os.path.join(folder, "ready_" + me), "w").close()
while not os.path.exists(os.path.join(folder, "go")):  # all wait here, then start at once
    time.sleep(0.001)
device.init("cpu")
import luisa

@luisa.func
def store(b):
    b.write(dispatch_id().x, 7)  # a DSL builtin

b = luisa.Buffer(1, int)
store(b, dispatch_size=1)
luisa.synchronize()
assert b.numpy()[0] == 7
"""


def start_together(folder, n: int, mode: str = "settled") -> list[int]:
    """Exit codes of n processes that, once all have imported luisaml, start the CPU device and build
    a kernel at the same moment (mode "unsettled": without luisa_compat.settle_cpu_backend)."""
    import subprocess
    import sys
    import time

    script = folder / "start.py"  # a file: luisa.func reads its function's source
    script.write_text(_START_TOGETHER)
    procs = [subprocess.Popen([sys.executable, str(script), str(folder), str(i), mode],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(n)]
    deadline = time.monotonic() + 120
    while len(list(folder.glob("ready_*"))) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    (folder / "go").touch()
    return [p.wait(timeout=300) for p in procs]


def test_processes_building_their_first_kernel_together_do_not_abort(tmp_path):
    """Bug (LuisaCompute's CPU backend): every process's first kernel build parses and then rewrites
    llvm_paths.json beside the Python executable, and one that reads it mid-rewrite aborts: of 12
    plain processes started together 1 to 5 aborted, and CI lost a test worker to it. luisaml's
    device start does that first build under an inter-process lock."""
    assert start_together(tmp_path, 12) == [0] * 12


def test_func_decorator_walks_the_whole_stack_upstream():
    """luisa.func.__init__ calls inspect.stack() for its caller's file and line (every frame's
    FrameInfo: 5-20 ms a decorator); luisa_compat's shim reads one frame and gives the same values."""
    import inspect
    import sys

    from luisaml import device

    device.init("cpu")
    func_class = sys.modules["luisa.func"].func
    upstream = func_class.__init__._upstream
    assert "inspect.stack()" in inspect.getsource(upstream)

    def f(x):
        return x

    theirs = object.__new__(func_class)
    ours, _ = func_class(f), upstream(theirs, f)  # (one line: both callers' line is this one)
    assert (ours.filename, ours.lineno, ours.__name__) == (theirs.filename, theirs.lineno, theirs.__name__)
    assert ours.filename == __file__


_FUNCS = """
import inspect, json, sys
real_stack = inspect.stack
if sys.argv[1] == "luisaml":
    import luisaml
import luisa
funcs = {f"{m.__name__}.{k}": [v.filename, v.lineno] for m in list(sys.modules.values())
         if getattr(m, "__name__", "").startswith("luisa.") for k, v in vars(m).items() if isinstance(v, luisa.func)}
print(json.dumps({"funcs": funcs, "stack_restored": inspect.stack is real_stack,
                  "hooks_left": [type(f).__name__ for f in sys.meta_path if "Luisa" in type(f).__name__],
                  "shim": getattr(sys.modules["luisa.func"].func.__init__, "_luisaml_shim", False)}))
"""


def test_luisas_own_import_after_luisaml_gives_the_same_funcs_without_the_stack_walk():
    """`import luisaml` then `import luisa` (luisa_compat.hook_luisa_import): every @luisa.func of
    luisa's own modules has the file and line a plain `import luisa` gives it, inspect.stack is
    inspect's own again, the hook is gone and the func shim is installed."""
    import json
    import subprocess
    import sys

    def run(first):
        r = subprocess.run([sys.executable, "-c", _FUNCS, first], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout.strip().splitlines()[-1])

    plain, ours = run("luisa"), run("luisaml")
    assert len(plain["funcs"]) >= 20 and ours["funcs"] == plain["funcs"]
    assert ours["stack_restored"] and not ours["hooks_left"] and ours["shim"]
    assert not plain["shim"]  # (a plain import is upstream's: the shim comes from luisaml)
