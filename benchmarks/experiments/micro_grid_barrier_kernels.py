"""The kernels of micro_grid_barrier.py (luisa-python compiles @luisa.func from a source file)."""
import luisa
from luisa.mathtypes import *  # noqa: F401,F403

NT = 256
SPIN_LIMIT = 20_000_000  # a barrier that never opens sets the flag instead of hanging the GPU


@luisa.func
def stage_kernel(src, dst, n: int, shift: int):
    i = int(dispatch_id().x)
    if i < n:
        dst.write(i, src.read((i + shift) % n) + 1.0)


@luisa.func
def barrier_kernel(a, b, counter, flag, n: int, shift: int, stages: int):
    set_block_size(256, 1, 1)
    t = int(thread_id().x)
    nblocks = int(dispatch_size().x) // 256
    first = int(block_id().x) * 256 + t
    stride = nblocks * 256
    for s in range(stages):
        i = first
        while i < n:
            if s % 2 == 0:
                b.write(i, a.read((i + shift) % n) + 1.0)
            else:
                a.write(i, b.read((i + shift) % n) + 1.0)
            i += stride
        # grid barrier: every block's thread 0 arrives, then waits for all arrivals of this stage
        sync_block()
        if t == 0:
            arrived = counter.atomic_fetch_add(0, 1)  # noqa: F841 (the DSL refuses a discarded value)
            target = (s + 1) * nblocks
            spins = 0
            while counter.atomic_fetch_add(0, 0) < target and spins < 20000000:
                spins += 1
            if spins >= 20000000:
                flag.write(0, 1)
        sync_block()
    # the last block out resets the counter for the next launch
    if t == 0:
        done = counter.atomic_fetch_add(1, 1)
        if done == nblocks - 1:
            counter.write(0, 0)
            counter.write(1, 0)
