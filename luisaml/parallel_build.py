"""Builds a network's stage kernels in worker processes before its first launch, on CUDA.

Why: LuisaCompute builds a kernel (NVRTC, then the driver's JIT) when the kernel is first
launched, one after another in one process. ResNet-18's 23 stage kernels took 44 s on a fresh
H200 machine, the transformer's 36 kernels 39 s. LuisaCompute's kernel cache is on disk and
shared by every process of one installation. So workers that each build a disjoint share of the
kernels leave the main process nothing but cache hits. The workers are started while the plan is
still generated (runtime._WorkersAhead) and wait for their shares. Shares are balanced by the kernels' source
lengths (a 3x3 convolution's unrolled tile is several times a pooling stage's). While the workers
run, the main process builds every kernel's IR (luisa's Python AST walk, 0.1-0.4 s a kernel: 3 s of
ResNet-18's) and leaves only the shaders' creation, then cache hits, for after them (build_ir).

A worker that fails, or runs past the time limit, costs only its time: the main process builds
whatever is still missing itself, as before. The CPU backend merges a network's stages into one
kernel, so there it has nothing to split (and its cache writes are not safe across processes
compiling the same kernel: launch.KernelLauncher._compile_lock).

A build that runs past a second shows a progress bar of the kernels the workers have built (tqdm,
on stderr when it is a terminal; `progress`). LuisaCompute's native build of a kernel holds the GIL
of the process that runs it, so a build in the main process (the CPU backend's merged kernel, CUDA
networks of few kernels: `build_here`) gets its bar from a child process (`outside_bar`) that
draws it, its time moving, while the main process sends it the phase and the kernels done.

    python -m luisaml.parallel_build --serve BACKEND IDLE_S   (a worker: its job comes on stdin; see main())
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

from .log import logger

# fewer kernels than this build in the main process: a worker's device start-up (about 0.5 s) and
# module import would eat the gain
MIN_KERNELS = 6
MAX_WORKERS = 16
TIMEOUT_S = 600.0
IDLE_S = 120.0  # a started worker sent no kernels within this exits
# a kernel build shows its progress bar once it has run this long
PROGRESS_AFTER_S = 1.0


def describe(arg) -> list:
    """Return a JSON-able description of a kernel argument, from which a worker makes a stand-in of
    the same type: ["buffer", element type], ["bytes"] or ["int"]."""
    kind = type(arg).__name__
    if kind == "ByteBuffer":
        return ["bytes"]
    if kind == "Buffer":
        return ["buffer", arg.bufferType.dtype.__name__]
    if isinstance(arg, bool) or not isinstance(arg, int):
        raise TypeError(f"a kernel argument of type {kind} has no stand-in")
    return ["int"]


def _stand_in(desc: list):
    import luisa
    from luisa.types import half, uint

    from .luisa_compat import fix_byte_buffer

    if desc[0] == "bytes":
        buf = luisa.ByteBuffer(4)
        fix_byte_buffer(buf)
        return buf
    if desc[0] == "buffer":
        kinds = {"float": float, "int": int, "uint": uint, "half": half, "bool": bool}
        return luisa.Buffer(1, kinds[desc[1]])
    return 0


def workers_for(kernels: int) -> int:
    """Return how many worker processes build `kernels` kernels (0: build them in this process): one
    for every kernel up to the cores but one (the main process builds IR meanwhile)."""
    if kernels < MIN_KERNELS:
        return 0
    return max(0, min(kernels, MAX_WORKERS, (os.cpu_count() or 1) - 1))


def shares_of(names: Sequence[str], costs: Sequence[int], workers: int) -> list[list[str]]:
    """Split the kernels among `workers` by their costs (source lengths): the costliest first, each
    to the least loaded worker (longest processing time first); no share is empty."""
    loads = [(0, k) for k in range(min(workers, len(names)))]
    shares: list[list[str]] = [[] for _ in loads]
    for cost, name in sorted(zip(costs, names), key=lambda c: -c[0]):
        load, k = min(loads)
        shares[k].append(name)
        loads[k] = (load + cost, k)
    return shares


class Workers:
    """Worker processes started ahead of a network's first launch. Each imports luisaml and starts
    the device (1-3 s, most of it CUDA's context creation, slower when 15 start at once) while the
    main process still generates the module, then waits on its stdin for the share of kernels it is
    to build. A worker sent nothing exits: at close(), when the pool is collected, or on its own
    after idle_s (a network compiled and never run must not hold device contexts)."""

    def __init__(self, backend: str, count: int, idle_s: float = IDLE_S) -> None:
        self._dir = tempfile.TemporaryDirectory()  # (the caller's folder must not shadow the package)
        from . import tensor_cores

        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
        self.logs = [open(os.path.join(self._dir.name, f"worker{k}.log"), "w+b") for k in range(count)]
        # a worker starts its device as this process did: a kernel with a marked mma callable built in
        # luisa's own runtime directory gets the callable's FP32 body, not the tensor cores (and is
        # cached so), which is what compile(tensor_cores="auto") ran on the zoo's transformers before
        self.procs = [subprocess.Popen([sys.executable, "-m", "luisaml.parallel_build", "--serve", backend,
                                        repr(float(idle_s))] + (["--tensor-cores"] if tensor_cores.in_front() else []),
                                       cwd=self._dir.name, env=env, stdin=subprocess.PIPE, stdout=log, stderr=log)
                      for log in self.logs]
        self._finalizer = weakref.finalize(self, _dismiss, list(self.procs), list(self.logs), self._dir)

    def build(self, path: str, names: Sequence[str], args: Sequence, timeout: float = TIMEOUT_S,
              costs: Sequence[int] | None = None, meanwhile: Callable[[], None] | None = None) -> int:
        """Send each worker its share of the kernels `names` of the module at `path` (called with
        `args`), balanced by `costs` (default: equal); call `meanwhile` while they build; return how
        many workers finished cleanly. The pool is spent afterwards."""
        try:
            descs = [describe(a) for a in args]
        except TypeError:  # an argument no worker can stand in for: the launches build everything
            self.close()
            return 0
        from . import cache

        cache.write_bytecode(Path(path))  # (the workers then load bytecode, not 1 MB of source each)
        shares = shares_of(names, costs or [1] * len(names), len(self.procs)) if names else []
        sent = []
        for k, p in enumerate(self.procs):
            job = {"path": path, "descs": descs, "names": shares[k] if k < len(shares) else []}
            try:
                p.stdin.write((json.dumps(job) + "\n").encode())
                p.stdin.close()
            except OSError:  # the worker is gone (it failed to start): its share is built at launch
                continue
            if job["names"]:
                sent.append(k)
        deadline = time.monotonic() + timeout
        with _watched([self.logs[k] for k in sent], len(names)):
            if meanwhile is not None:
                meanwhile()
            ok = self._wait(sent, deadline)
        self.close()
        return ok

    def _wait(self, sent: list[int], deadline: float) -> int:
        """Wait for the workers `sent` a share until the deadline (then kill them); return how many
        finished cleanly."""
        ok = 0
        for k in sent:
            p, log = self.procs[k], self.logs[k]
            try:
                code = p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
                code = p.wait()
            ok += code == 0
            log.seek(0)
            tail = log.read().decode(errors="replace").strip().splitlines()[-3:]
            if code:
                logger.debug("kernel build worker exited with %s: %s", code, " | ".join(tail))
            else:  # its last line: where its time went (main)
                logger.debug("kernel build worker: %s", tail[-1] if tail else "")
        return ok

    def close(self) -> None:
        """Dismiss the workers not yet sent a share, and clean up."""
        self._finalizer()


def _quiet() -> bool:
    """No progress bar where stderr is not a terminal or luisaml logs only errors (`-q`)."""
    return not getattr(sys.stderr, "isatty", lambda: False)() or not logger.isEnabledFor(logging.WARNING)


def progress(total: int, what: str = "building kernels"):
    """Return a tqdm bar over `total` kernels on stderr that shows once it has run PROGRESS_AFTER_S
    seconds, and never where stderr is not a terminal or luisaml logs only errors (`-q`)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=f"luisaml: {what}", unit="kernel", delay=PROGRESS_AFTER_S, file=sys.stderr,
                disable=_quiet(), leave=False)


# the child process of outside_bar: a tqdm bar on the stderr it shares with luisaml, drawn from
# PROGRESS_AFTER_S on and redrawn every 0.2 s; stdin lines "n K" (K more kernels built) and
# "phase TEXT"; at the end of stdin it clears its line and exits
_BAR = r"""
import select, sys, time
from tqdm import tqdm
total, desc, delay = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
t0, n, phase, bar = time.monotonic(), 0, "", None
while True:
    if select.select([sys.stdin], [], [], 0.2)[0]:
        line = sys.stdin.readline()
        if not line:
            break
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "n":
            n += int(arg)
        elif cmd == "phase":
            phase = arg
    if bar is None and time.monotonic() - t0 >= delay:
        bar = tqdm(total=total, desc=desc, unit="kernel", file=sys.stderr, leave=False, initial=0)
    if bar is not None:
        bar.n = n
        bar.set_postfix_str(phase, refresh=False)
        bar.refresh()
if bar is not None:
    bar.close()
"""


@contextlib.contextmanager
def outside_bar(total: int, what: str = "building kernels"):
    """Yield say(line) that moves a progress bar over `total` kernels ("n 1", "phase TEXT"), drawn
    on stderr by a child process: the main process's native kernel build holds its GIL, so no thread
    of it could draw meanwhile. Nothing (no child) where progress() would show nothing."""
    if _quiet() or total <= 0:
        yield lambda line: None
        return
    sys.stderr.flush()
    proc = subprocess.Popen([sys.executable, "-c", _BAR, str(total), f"luisaml: {what}", str(PROGRESS_AFTER_S)],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)

    def say(line: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            proc.stdin.write(line + "\n")
            proc.stdin.flush()

    try:
        yield say
    finally:
        with contextlib.suppress(OSError, ValueError):
            proc.stdin.close()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def build_here(kernels: Sequence, args: Sequence, backend: str) -> None:
    """Build `kernels` for the types of `args` in this process before their first launch, as the
    launch would (build_ir, then create_shaders: the same compiled results and cache keys), under
    outside_bar; what build_ir leaves undone (an error) the launch builds and reports."""
    with outside_bar(len(kernels)) as say:
        say("phase front end")
        built = build_ir(kernels, args)
        say("phase " + ("LLVM" if backend == "cpu" else "NVRTC"))
        for item in built:
            create_shaders([item])
            say("n 1")


@contextlib.contextmanager
def _watched(logs: list, total: int):
    """Show the kernels the workers writing `logs` have built (a `built` line each) in a progress
    bar while the block runs. A thread moves it: the main process meanwhile builds kernels' IR."""
    bar, stop = progress(total), threading.Event()

    def built() -> int:
        return sum(line.startswith(b"built ") for log in logs for line in Path(log.name).read_bytes().splitlines())

    def watch() -> None:
        while not stop.wait(0.2):
            bar.update(max(0, min(built(), total) - bar.n))

    thread = threading.Thread(target=watch, name="luisaml-build-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        bar.update(max(0, min(built(), total) - bar.n))
        bar.refresh()  # (the count it ends at, however soon after the last one)
        bar.close()


def _dismiss(procs, logs, folder) -> None:
    for p in procs:
        if p.stdin is not None and not p.stdin.closed:
            try:
                p.stdin.close()  # EOF: a waiting worker exits
            except OSError:
                pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for log in logs:
        log.close()
    folder.cleanup()


def build(path: str, backend: str, names: Sequence[str], args: Sequence, workers: int,
          timeout: float = TIMEOUT_S, costs: Sequence[int] | None = None,
          meanwhile: Callable[[], None] | None = None) -> int:
    """Start `workers` processes and have them build the kernels `names` (Workers.build); return how
    many finished cleanly. The caller then launches as usual: what a worker built is a cache hit,
    what it did not is built then."""
    if workers < 1 or not names:
        return 0
    return Workers(backend, workers).build(path, names, args, timeout, costs, meanwhile)


class _NoShaders:
    """Stands in for luisa's device while build_ir runs: a kernel's IR is built, its shader is not."""

    def impl(self):
        return self

    def create_shader(self, function):
        return None

    def destroy_shader(self, handle) -> None:
        """A shader freed meanwhile (a compiled result collected during build_ir) goes as it would."""
        from luisa.globalvars import get_global_device

        get_global_device().impl().destroy_shader(handle)


def build_ir(kernels: Sequence, args: Sequence) -> list:
    """Build each kernel's IR for the types of `args` as its first launch would (luisa's
    func.get_compiled), but not its shader; return what create_shaders must finish. Nothing is left
    half-built: on any error the kernels are as before (their launch then builds them, and reports
    the error as it always does)."""
    from luisa.types import dtype_of

    luisa_func = sys.modules["luisa.func"]  # (the module; `luisa.func` the attribute is the class)
    argtypes = tuple(dtype_of(a) for a in args)
    key = (0,) + argtypes  # get_compiled's key for a kernel launched from the host
    real, built = luisa_func.get_global_device, []
    luisa_func.get_global_device = _NoShaders
    try:
        for kernel in kernels:
            if key not in kernel.compiled_results:
                kernel.get_compiled(0, False, argtypes)
                built.append((kernel, key))
    except Exception as e:  # noqa: BLE001 (the launch reports it)
        logger.debug("building kernel IR ahead of the launches failed: %s", e)
        for kernel, k in built:
            del kernel.compiled_results[k]
        built = []
    finally:
        luisa_func.get_global_device = real
    return built


def create_shaders(built: list) -> None:
    """Create the shaders of what build_ir built (cache hits where a worker built them)."""
    from luisa.globalvars import get_global_device

    impl = get_global_device().impl()
    for kernel, key in built:
        info = kernel.compiled_results[key]
        info.shader_handle = impl.create_shader(info.function)


def main(argv: Sequence[str]) -> int:
    """A worker: `--serve BACKEND IDLE_S` starts the backend, then reads its job from stdin (one JSON
    line: the module's path, the arguments' descriptions, the kernels' names; nothing within IDLE_S
    seconds, or no kernels: exit), imports the module and builds each named kernel for the
    arguments' types (luisa's own first-launch path, get_compiled) without launching it."""
    import select

    t0 = time.perf_counter()
    if argv[:1] != ["--serve"] or len(argv) not in (3, 4) or argv[3:] not in ([], ["--tensor-cores"]):
        print("usage: python -m luisaml.parallel_build --serve BACKEND IDLE_S [--tensor-cores] (a job on stdin)",
              file=sys.stderr)
        return 2
    idle_s = float(argv[2])
    backend = argv[1]
    from luisa.types import dtype_of

    from . import cache, device

    t_import = time.perf_counter()
    device.init(backend, tensor_cores=argv[3:] == ["--tensor-cores"])
    t_device = time.perf_counter()
    if not select.select([sys.stdin], [], [], idle_s)[0]:
        return 0
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    job = json.loads(line)
    if not job["names"]:
        return 0
    t_job = time.perf_counter()
    module = cache.import_module(Path(job["path"]))
    t_module = time.perf_counter()
    argtypes = tuple(dtype_of(_stand_in(d)) for d in job["descs"])
    each = []
    for name in job["names"]:
        t = time.perf_counter()
        getattr(module, name).get_compiled(0, False, argtypes)
        each.append(f"{name} {time.perf_counter() - t:.2f}")
        print(f"built {each[-1]} s", flush=True)  # (counted by the main process's progress bar)
    print(f"imports {t_import - t0:.2f} s, device {t_device - t_import:.2f} s, waited {t_job - t_device:.2f} s, "
          f"module {t_module - t_job:.2f} s, kernels: {', '.join(each)} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
