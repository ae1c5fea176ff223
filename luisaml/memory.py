"""What a run of a network needs in memory and what the backend has free: the bytes a sample of the
batch allocates, the free bytes, and the batch `luisaml bench` runs (refused past what fits);
luisaml.parallel cuts its runs by the same sizes."""
from __future__ import annotations

import os

import numpy as np

from .errors import UsageError
from .log import note


def bytes_per_sample(net) -> int:
    """Return the device bytes a run allocates per sample of the batch: the batched inputs and
    outputs, the kernels' scratch and the stage buffers (what check_batch bounds, in bytes)."""
    plan = net.plan
    total = sum(s.numel * net.io_dtype(s).itemsize for s in plan.inputs + plan.outputs if s.batched)
    total += sum(per_sample * 4 for per_sample in plan.kernel_scratch.values())
    if plan.schedule is not None:
        total += sum(slot.size * slot.itemsize for slot in plan.schedule.buffers.slots)
    return int(total)


def free_memory(backend: str) -> int | None:
    """Return the bytes the backend can still allocate (the host's available memory on the CPU
    backend, the device's free memory on CUDA), or None where it cannot be asked."""
    import ctypes

    if backend == "cuda":
        try:
            cuda = ctypes.CDLL("libcuda.so.1")
            free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
            if cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) == 0:
                return int(free.value)
        except (OSError, AttributeError):
            pass
        return None
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def bench_batch(net, asked: int | None) -> tuple[int, str]:
    """Return (the batch bench runs, why that one): the model's own where its shapes are static,
    else --batch (1 when not given), refused with the largest batch that fits when a run of it
    would need more memory than the backend has free (or than 32-bit indexing reaches)."""
    if net.batch_symbol is None:
        lead = [s.shape[0] for s in net.inputs if s.shape and isinstance(s.shape[0], int)]
        n = lead[0] if lead else 1
        if asked is not None:
            note("the model's shapes are static (batch %d): --batch %d ignored", n, asked)
        return n, "the model's static batch"
    n = 1 if asked is None else asked
    per_sample = bytes_per_sample(net)
    free = free_memory(net.backend)
    if free is not None and per_sample * n > free // 2:  # half: the host copies and the runtime need the rest
        fits = 1 << max(0, int(np.log2(max(1, free // 2 // max(per_sample, 1)))))
        raise UsageError(f"--batch {n} needs about {mib(per_sample * n)} on the {net.backend} backend "
                         f"({mib(per_sample)} a sample), and {mib(free)} is free; try --batch {fits}")
    net.check_batch(n)  # a LimitError naming the buffer past 32-bit indexing
    return n, "--batch" if asked is not None else "the default; --batch sets it"


def mib(n: int) -> str:
    """A byte count as people read it: B, KiB, MiB or GiB."""
    if n >= 2**30:
        return f"{n / 2**30:.1f} GiB"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB" if n >= 1024 else f"{n} B"
