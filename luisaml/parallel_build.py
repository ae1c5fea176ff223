"""Builds a network's stage kernels in worker processes before its first launch, on CUDA.

Why: LuisaCompute builds a kernel (NVRTC, then the driver's JIT) when the kernel is first
launched, one after another in one process. ResNet-18's 23 stage kernels took 44 s on a fresh
H200 machine, the transformer's 36 kernels 39 s. LuisaCompute's kernel cache is on disk and
shared by every process of one installation. So workers that each build a disjoint share of the
kernels leave the main process nothing but cache hits.

A worker that fails, or runs past the time limit, costs only its time: the main process builds
whatever is still missing itself, as before. The CPU backend merges a network's stages into one
kernel, so there it has nothing to split (and its cache writes are not safe across processes
compiling the same kernel: network.CompiledNetwork._compile_lock).

    python -m luisaml.parallel_build MODULE.py BACKEND ARGS_JSON NAME...   (a worker; see build())
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from .log import logger

# fewer kernels than this build in the main process: a worker's device start-up (about 0.5 s) and
# module import would eat the gain
MIN_KERNELS = 6
MAX_WORKERS = 8
TIMEOUT_S = 600.0


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
    """Return how many worker processes build `kernels` kernels (0: build them in this process)."""
    if kernels < MIN_KERNELS:
        return 0
    return max(0, min(kernels // 2, MAX_WORKERS, (os.cpu_count() or 1) - 1))


def build(path: str, backend: str, names: Sequence[str], args: Sequence, workers: int,
          timeout: float = TIMEOUT_S) -> int:
    """Build the kernels `names` of the generated module at `path` (called with `args`) in
    `workers` processes, round robin; return how many workers finished cleanly. The caller then
    launches as usual: what a worker built is a cache hit, what it did not is built then."""
    if workers < 1 or not names:
        return 0
    try:
        descs = json.dumps([describe(a) for a in args])
    except TypeError:  # an argument no worker can stand in for: the launches build everything
        return 0
    shares = [list(names[k::workers]) for k in range(workers)]
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    with tempfile.TemporaryDirectory() as cwd:  # (the caller's folder must not shadow the package)
        logs = [open(os.path.join(cwd, f"worker{k}.log"), "w+b") for k in range(len(shares))]
        procs = [subprocess.Popen([sys.executable, "-m", "luisaml.parallel_build", path, backend, descs, *share],
                                  cwd=cwd, env=env, stdout=log, stderr=log)
                 for share, log in zip(shares, logs)]
        deadline = time.monotonic() + timeout
        ok = 0
        for p, log in zip(procs, logs):
            try:
                code = p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
                code = p.wait()
            ok += code == 0
            if code:
                log.seek(0)
                tail = log.read().decode(errors="replace").strip().splitlines()[-3:]
                logger.debug("kernel build worker exited with %s: %s", code, " | ".join(tail))
            log.close()
    return ok


def main(argv: Sequence[str]) -> int:
    """A worker: start the backend, import the module, build each named kernel for the arguments'
    types (luisa's own first-launch path, get_compiled) without launching it."""
    path, backend, descs, *names = argv
    from luisa.types import dtype_of

    from . import cache, device

    device.init(backend)
    module = cache.import_module(Path(path))
    argtypes = tuple(dtype_of(_stand_in(d)) for d in json.loads(descs))
    for name in names:
        getattr(module, name).get_compiled(0, False, argtypes)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
