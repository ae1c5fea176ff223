"""The one LuisaCompute device of the process: backend choice, and the system libraries each
backend needs checked *before* luisa.init (a backend that fails to load aborts the process)."""
from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import shutil
import sys
import tempfile
import threading

# shared library -> the Debian package that provides it
_COMMON_LIBS = {
    "libvulkan.so.1": "libvulkan1",
    "libX11.so.6": "libx11-6",
    "libXext.so.6": "libxext6",
    "libSM.so.6": "libsm6",
    "libICE.so.6": "libice6",
}
_BACKENDS = ("cpu", "cuda")
_current: str | None = None
# LuisaCompute's stream (one per process) is not safe to use from two threads at once: every
# upload, launch, synchronisation and readback of a run happens under this lock
stream_lock = threading.RLock()


from .errors import BackendUnavailable


def _can_load(soname: str) -> bool:
    try:
        ctypes.CDLL(soname)
        return True
    except OSError:
        return False


def missing_libraries() -> list[str]:
    """Return 'library (package)' for each shared library the backends link that is missing."""
    return [f"{lib} (Debian package {pkg})" for lib, pkg in _COMMON_LIBS.items() if not _can_load(lib)]


def clang_path() -> str | None:
    """Return the clang++ the CPU backend will run, or None."""
    env = os.environ.get("LUISA_CLANG_PATH")
    if env:
        return env if os.path.exists(env) else None
    return shutil.which("clang++")


def cuda_device_count() -> int:
    """Return the number of CUDA devices the driver reports (0 without a driver)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    if cuda.cuInit(0) != 0:
        return 0
    count = ctypes.c_int(0)
    if cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


_SM_COUNT: int | None = None


def sm_count() -> int:
    """Return the multiprocessor count of CUDA device 0 (persistent blocks fill every SM); 132
    where the driver cannot say."""
    global _SM_COUNT
    if _SM_COUNT is None:
        _SM_COUNT = 132
        try:
            cuda = ctypes.CDLL("libcuda.so.1")
            dev, v = ctypes.c_int(0), ctypes.c_int(0)
            if cuda.cuInit(0) == 0 and cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0:
                if cuda.cuDeviceGetAttribute(ctypes.byref(v), 16, dev) == 0 and v.value > 0:
                    _SM_COUNT = v.value  # CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
        except OSError:
            pass
    return _SM_COUNT


def check_backend(backend: str) -> None:
    """Raise BackendUnavailable naming what is missing for `backend` (and the Debian packages
    that provide it, for what a package provides)."""
    missing = missing_libraries()
    packages = [pkg for lib, pkg in _COMMON_LIBS.items() if not _can_load(lib)]
    if backend == "cpu" and clang_path() is None:
        missing.append("clang++ (Debian package clang, or set LUISA_CLANG_PATH)")
        packages.append("clang")
    if backend == "cuda" and cuda_device_count() == 0:
        missing.insert(0, "no CUDA device was found (libcuda.so.1 not loadable)" if not _can_load("libcuda.so.1")
                       else "no CUDA device was found (the CUDA driver reports none)")
    if missing:
        hint = f". On Debian/Ubuntu: apt-get install -y {' '.join(packages)}" if packages else \
            "; use --backend cpu (backend='cpu'), or run where a CUDA GPU and its driver are"
        raise BackendUnavailable(f"the LuisaCompute {backend} backend cannot start: " + ", ".join(missing) + hint)


def backend_from_environment() -> str:
    """Return LUISAML_BACKEND ('auto' when unset); raise UsageError naming the variable when it
    holds something else than auto, cpu or cuda (an empty value included)."""
    value = os.environ.get("LUISAML_BACKEND")
    if value is None:
        return "auto"
    if value.strip().lower() not in ("auto",) + _BACKENDS:
        from .errors import UsageError

        raise UsageError(f"LUISAML_BACKEND={value!r}: expected auto, cpu or cuda (or leave it unset)")
    return value.strip().lower()


def choose_backend(backend: str = "auto") -> str:
    """Return the backend to use: 'auto' is LUISAML_BACKEND when set, else CUDA where a CUDA
    device works, else CPU."""
    backend = (backend or "auto").lower()
    if backend == "auto":
        backend = backend_from_environment()
    if backend == "auto":
        return "cuda" if cuda_device_count() > 0 and not missing_libraries() else "cpu"
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be 'auto', 'cpu' or 'cuda', not {backend!r}")
    return backend


def cpu_threads() -> int:
    """Return the worker threads LuisaCompute's CPU backend starts (LUISA_NUM_THREADS, which it
    reads once when the device starts; else one per core); raise UsageError naming the variable
    for a value it would abort the process on (empty, not a positive whole number)."""
    value = os.environ.get("LUISA_NUM_THREADS")
    if value is None:
        return os.cpu_count() or 1
    if not value.strip().isdigit() or int(value) < 1:
        from .errors import UsageError

        raise UsageError(f"LUISA_NUM_THREADS={value!r}: expected a whole number of threads >= 1, or leave it "
                         "unset (one per core); LuisaCompute's CPU backend aborts the process on this value")
    return int(value)


def request_cpu_threads(n: int) -> bool:
    """Ask for n worker threads on the CPU backend (onnxruntime's intra_op_num_threads). Return
    True when the process's CPU backend runs (or will start with) n threads; False when it started
    already with another count (LuisaCompute's thread pool is the process's and cannot change)."""
    if _current is not None:
        return _current == "cpu" and cpu_threads() == n
    os.environ["LUISA_NUM_THREADS"] = str(int(n))
    return True


def init(backend: str = "auto", tensor_cores: bool = False) -> str:
    """Start the process's LuisaCompute device (once) and return its backend name. tensor_cores:
    start CUDA in the runtime directory of luisaml's compiler front (luisaml/tensor_cores.py), so
    that compile(tensor_cores="auto") can use mma tiles; off by default until the front has been
    measured on a device (a process started without it runs the FP32 tiles)."""
    global _current
    want = choose_backend(backend)
    if _current is not None:
        if want != _current:
            raise BackendUnavailable(
                f"this process already runs the {_current} backend; LuisaCompute allows one device per "
                f"process, so backend='{want}' needs a new process"
            )
        return _current
    check_backend(want)
    if want == "cpu":
        cpu_threads()  # a bad LUISA_NUM_THREADS named here, not a panic in the backend
    import luisa
    from luisa import lcapi

    from . import counts, luisa_compat

    if not os.environ.get("LUISAML_VERBOSE"):
        lcapi.log_level_warning()
    with _filtered_stderr("failed to load swapchain"):
        if want == "cuda" and tensor_cores:  # in the runtime directory of luisaml's compiler front, where it runs
            from . import tensor_cores

            tensor_cores.start_cuda_device(support_gui=False)
        else:
            luisa.init(want, support_gui=False)
    luisa_compat.apply()
    counts.install()  # (net.profile's launches and synchronisations: luisaml/counts.py)
    if want == "cpu":
        luisa_compat.settle_cpu_backend()
    _current = want
    return want


@contextlib.contextmanager
def _filtered_stderr(noise: str):
    """Drop lines containing `noise` that native code writes to stderr (fd 2) inside the block."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [ln for ln in tmp.read().decode(errors="replace").splitlines(True) if noise not in ln]
            if kept:
                sys.stderr.write("".join(kept))


def current() -> str | None:
    """Return the running backend, or None before init."""
    return _current


def device_name(backend: str) -> str:
    """Return the name of the device a backend runs on, as a tuning cache key holds it: CUDA device
    0's name from the driver; for the CPU backend the processor's model and the backend's thread
    count (a schedule measured on 2 threads is not one for 64)."""
    if backend == "cuda":
        try:
            cuda = ctypes.CDLL("libcuda.so.1")
            dev, buf = ctypes.c_int(0), ctypes.create_string_buffer(256)
            if cuda.cuInit(0) == 0 and cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0 and \
                    cuda.cuDeviceGetName(buf, 256, dev) == 0:
                return buf.value.decode(errors="replace")
        except OSError:
            pass
        return "cuda"
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    return f"cpu: {model}, {cpu_threads()} threads"
