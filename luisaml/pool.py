"""The device buffers a network keeps between runs: its weight blob, inputs' and outputs' buffers kept
while the run's size stays within them (a `bucket`: a quarter step of a power of two, down to 1/KEEP
of it), the buffers only kernels use (the stages' pooled slots, scratch) kept likewise, the
fused MLP's tile counter and the run's state (the run-time error flag, the counted outputs'
capacities and totals). Networks that take turns (a device grid build's networks, one a node and
power of two: luisaml/runtime.py) may draw their kernel-only buffers from one `SharedBuffers`, so
that the process holds the largest of them, not their sum (issue 28's detector, benchmarks/NOTES.md)."""
from __future__ import annotations

import contextlib
import weakref
from typing import Any

import numpy as np

from . import counts

# a buffer sized by the run is kept while the run needs at least 1/KEEP of it: a detector's frames vary
# 2.5x in points (60k-150k; bench_detector.py), and a power of two adds up to 2x, so with a quarter (or,
# for the kernels' own buffers, half and exact sizes) 3.3 buffers a frame were made and freed, ~2-3 ms
# of host time a quick frame on the CPU backend (benchmarks/NOTES.md); the memory held is at most
# KEEP times the run's need, never past the largest run's
KEEP = 8


def bucket(count: int) -> int:
    """The elements of a buffer that grows to hold `count`: the next quarter step of its power of two
    (4, 5, 6 or 7 times a power of two: at most 25% past count), not the next power of two (up to
    100% past it: a detector frame of 150k points held its backbone's five 150k-row buffers at 262,144
    rows, 64 MB more than 163,840 rows; issue 28). A count that moves from run to run makes a new one
    only when it passes the largest bucket so far, as with powers of two."""
    count = max(int(count), 1)
    if count <= 8:
        return 1 << (count - 1).bit_length()
    step = 1 << ((count - 1).bit_length() - 3)
    return -(-count // step) * step


def _new_buffer(dsl: str, count: int):
    """A new device buffer of `count` elements (at least one) of kernel type `dsl`; "ubyte": a ByteBuffer
    of `count` bytes in whole words (bytes sized at run time: a new grid's blob)."""
    from .luisa_compat import empty_byte_buffer

    if dsl == "ubyte":
        return empty_byte_buffer(count)
    import luisa
    from luisa.types import half, uint

    kind = {"float": float, "int": int, "uint": uint, "half": half, "bool": bool}[dsl]
    return counts.allocated(luisa.Buffer(max(int(count), 1), kind))


class SharedBuffers:
    """Kernel-only buffers (stage slots, scratch: what `BufferPool.pooled` gives) that the pools of
    several networks draw from by identifier, so that the process holds each identifier's largest
    need among them, not the sum of their buffers. Only for networks whose runs take turns and keep
    nothing in such a buffer from one run to the next: every run holds device.stream_lock from its
    first upload to its last wait, and its stages write what they read; the networks of one device
    grid build node, one a power of two of its source (host_steps.DeviceBuilds), of which a
    detector's frames kept three of 280-559 MB each (issue 28). A buffer is never shrunk (networks
    of different sizes take turns every frame: each would make the other's again) and grows to the
    count asked, the one it replaces dropped first; the pools' kept lists of buffers are then
    dropped, so that none keeps a replaced buffer alive."""

    def __init__(self) -> None:
        self.held: dict[str, Any] = {}  # identifier -> buffer
        self.generation = 0
        self.pools: weakref.WeakSet = weakref.WeakSet()  # the pools drawing from it (their _regions)

    def pooled(self, ident: str, dsl: str, count: int):
        """The buffer `ident` (its elements of kernel type `dsl`, named in ident) of at least count elements."""
        buf = self.held.get(ident)
        if buf is not None and count <= buf.size:
            return buf
        size = max(int(count), 1, buf.size if buf is not None else 0)
        self.held.pop(ident, None)
        del buf
        self.generation += 1
        for pool in list(self.pools):
            pool._regions = {}  # (their lists may name the buffer replaced: dropped with them)
        self.held[ident] = _new_buffer(dsl, size)
        return self.held[ident]

    def nbytes(self) -> int:
        """The bytes of the buffers it holds."""
        return sum(int(b.bytesize) for b in self.held.values())


class BufferPool:
    """Buffers by (identifier, element count): one per identifier, replaced when its count changes
    (`exact`), or kept while the count stays between half of it and all of it (`pooled`); kernel-only
    ones from a `SharedBuffers` where the pool was given one (`share`)."""

    def __init__(self) -> None:
        self.shared: SharedBuffers | None = None
        self.held: dict[tuple[str, int], Any] = {}
        # counts the changes of `held` (exact), which drop _regions: stage_buffers' and scratch's lists kept
        # per (plan, n, kind) while `held` stays, not looked up again every run; so only lists of buffers
        # `held` holds are kept, and no replaced buffer outlives its replacement
        self.generation = 0
        self._regions: dict[tuple, list] = {}
        self._weights = None
        self._tiles = None
        self._errors = None

    def share(self, shared: SharedBuffers) -> None:
        """Draw the kernel-only buffers (`pooled`) from `shared` from now on (before the first run)."""
        assert not any(name.startswith(("buf_", "scratch_")) for name, _ in self.held), "share before the first run"
        self.shared = shared
        self._regions = {}
        shared.pools.add(self)

    @contextlib.contextmanager
    def weights_swapped(self, buffer):
        """Use `buffer` (a ByteBuffer of the plan's blob layout) as the weight blob inside the block,
        the pool's own after it (NetworkInstance.set_weight_buffer); None keeps the pool's own."""
        saved = self._weights
        if buffer is not None:
            self._weights = buffer
        try:
            yield
        finally:
            self._weights = saved

    def weights(self, plan):
        """The plan's weight blob as a luisa.ByteBuffer (uploaded at the first call)."""
        if self._weights is None:
            from .luisa_compat import byte_buffer

            self._weights = byte_buffer(plan.blob.bytes())
        return self._weights

    def sized(self, ident: str, dsl: str, count: int, shrink: bool = True):
        """Return an input's or output's buffer `ident` of at least `count` elements (the host copies
        `count` of them each way: luisa_compat.upload_prefix, launch.download): the one it holds while
        count stays between 1/KEEP of it (any part of it: shrink False, a run-time sized output
        within the run's bound buffer) and all of it, else one of the next `bucket`. A new frame's
        points or grid (a count that moves by tens of percent every run) then neither creates nor
        destroys a buffer: 18 a frame of the detector did, ~0.6 ms each on the CPU backend."""
        for (name, capacity), buf in self.held.items():
            # (a count of 0: a run-time sized output before its rows are known, or nothing to copy: any one)
            if name == ident and count <= capacity and (not shrink or not count or capacity <= KEEP * count):
                return buf
        return self.exact(ident, dsl, bucket(count))

    def exact(self, ident: str, dsl: str, count: int):
        """Return the buffer `ident` of exactly `count` elements of kernel type `dsl` ("ubyte": a
        ByteBuffer of `count` bytes in whole words), replacing one of another count."""
        key = (ident, count)
        if key not in self.held:
            self.held = {k: v for k, v in self.held.items() if k[0] != ident}
            self.generation += 1
            self._regions = {}  # (their lists may name the buffer replaced: not kept alive by them)
            self.held[key] = _new_buffer(dsl, count)
        return self.held[key]

    def pooled(self, ident: str, dsl: str, count: int):
        """Return a buffer only kernels use (a pooled slot, a scratch region) of at least `count`
        elements: the one it has while runs need between 1/KEEP of it and all of it, else a new one:
        of `count` the first time (a network whose batch stays holds no more than it needs), of its
        `bucket` once the count has moved (as `sized`), so that a voxel count moving from
        frame to frame (the batch of a sparse network over grids bound at run time) does not
        reallocate such buffers every few runs. Kernels index within the run's count; the host never
        copies these whole. A pool that shares them (`share`) takes the shared one."""
        if self.shared is not None:
            return self.shared.pooled(ident, dsl, count)
        moved = False
        for (name, capacity), buf in self.held.items():
            if name == ident and count <= capacity <= KEEP * max(count, 1):
                return buf
            moved = moved or name == ident
        return self.exact(ident, dsl, bucket(count) if moved else count)

    def _generations(self) -> tuple[int, int]:
        """Its buffers' changes and its shared store's: a list of buffers made under others may name one gone."""
        return self.generation, self.shared.generation if self.shared is not None else 0

    def stage_buffers(self, plan, n: int) -> list:
        """The stages' pooled buffers for n samples (a region per sample of each slot)."""
        return self._regions_of(plan, n, "stages", lambda: [
            self.pooled(f"buf_{slot.dtype}_{slot.id}", slot.dtype, slot.size * max(n, 1))
            for slot in plan.schedule.buffers.slots])

    def scratch(self, plan, n: int) -> list:
        """The kernels' scratch buffers for n samples, one per kernel dtype in sorted order."""
        return self._regions_of(plan, n, "scratch", lambda: [
            self.pooled(f"scratch_{dsl}", dsl, per_sample * max(n, 1))
            for dsl, per_sample in sorted(plan.kernel_scratch.items())])

    def _regions_of(self, plan, n: int, kind: str, make) -> list:
        """make()'s buffers, kept while no buffer of the pool changes: what `pooled` gives depends on
        n and `held` alone (a run's ~20 slots x every held buffer, and plan.kernel_scratch's walk over
        every stage, each run: benchmarks/NOTES.md, "net.run's host time")."""
        key = (id(plan), n, kind)
        kept = self._regions.get(key)
        if kept is not None:
            return kept
        if len(self._regions) > 16:  # (batches come and go: the old lists are dropped)
            self._regions.clear()
        at = self._generations()
        buffers = make()
        if at == self._generations():
            # (make's pooled calls held no new buffer: else one it gave may be gone)
            self._regions[key] = buffers
        return buffers

    def tile_counter(self):
        """The fused kernel's [next tile, blocks done] counters: zeroed once, and reset by the last
        block of every launch."""
        if self._tiles is None:
            import luisa

            self._tiles = counts.allocated(luisa.Buffer.from_array(np.zeros(2, np.int32)))
        return self._tiles

    def run_state(self, words: np.ndarray):
        """The run's state buffer (the kernels' `errors` argument: the flag run-time checks set,
        KernelContext.flag_error, then the counted outputs' words: luisaml/dynamic.py StateLayout),
        holding `words` once the upload enqueued here has run (no wait)."""
        import luisa

        words = np.ascontiguousarray(words, np.int32).reshape(-1)
        if self._errors is None or self._errors.size != words.size:
            self._errors = counts.allocated(luisa.Buffer(max(words.size, 1), int))
        self._errors.copy_from_array(words, sync=False)  # (the stream keeps words until it has run)
        return self._errors
