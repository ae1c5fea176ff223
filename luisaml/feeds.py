"""What a run binds: the feeds checked against the plan's inputs, the digests by which a bound input
is known (its bytes', once a run per memory), and the inputs kept on the device while their bytes
stay (byte inputs such as a grid's blob, host-derived inputs such as its metadata)."""
from __future__ import annotations

import hashlib
import itertools
import os
import weakref
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from . import dtypes, resident
from .fvdb import voxel_rows
from .fvdb.checked import frozen
from .dtypes import shape_str
from .errors import InputError, InputNameError, InputTypeError
from .interop import is_torch, to_numpy

if TYPE_CHECKING:  # (not imported at run time: a network loaded from a .lml runs without onnx)
    from .plan import IOSpec, Plan

# an array of more bytes than this is hashed in chunks of HASH_CHUNK by a few threads (hashlib
# releases the GIL): a grid's blob is megabytes, hashed at every run that binds it from numpy
PARALLEL_HASH_BYTES = 2 << 20
HASH_CHUNK = 1 << 20
_hash_pool = None
# ByteBuffers a network keeps for the next new grids once no input holds them (BoundInputs.byte_input)
SPARE_BYTE_BUFFERS = 2
# the digests of device tensors that changed since the last run (interop.zero_copy_host): unique, never hashed
ZERO_COPY_TOKENS = itertools.count()


def feeds_and_outputs(feeds, outputs, inputs: list[IOSpec]) -> tuple[Mapping[str, Any], list[str] | None]:
    """Return (feeds, outputs) from run()'s arguments in luisaml's order or onnxruntime's
    (output names or None first); raise InputTypeError when feeds are not a mapping."""
    if not isinstance(feeds, Mapping) and isinstance(outputs, Mapping):
        feeds, outputs = outputs, feeds
    if not isinstance(feeds, Mapping):
        raise InputTypeError(f"feeds must be a dict of input name -> array, got {type(feeds).__name__}; the "
                             f"network's inputs are {[s.name for s in inputs]}")
    if isinstance(outputs, str):
        outputs = [outputs]
    return feeds, outputs


def expected(spec: IOSpec) -> str:
    """The shape an input or output has, as error messages and repr write it."""
    return shape_str(spec.shape)


def io_dtype(plan: Plan, s: IOSpec) -> dtypes.DType:
    """The element type `run` takes or returns for an input or output of plan (half in fp16 mode: the fused
    kernel's, or the layers' as stages, Plan.half_io)."""
    fused = plan.fused
    if (plan.half_io or fused is not None and fused.precision == "fp16") and s.dtype is dtypes.FLOAT:
        return dtypes.FLOAT16
    return s.dtype


def check_feeds(plan: Plan, feeds: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], int, bool]:
    """Return (numpy feeds, batch size, any torch input), checking names, dtypes and shapes."""
    names = [s.name for s in plan.inputs]
    unknown = [k for k in feeds if k not in names]
    if unknown:
        raise InputNameError(f"unknown input(s) {unknown}; the network's inputs are {names}")
    missing = [k for k in names if k not in feeds]
    if missing:
        raise InputNameError(f"missing input(s) {missing}; the network's inputs are {names}")
    arrays: dict[str, np.ndarray] = {}
    torch_in = False
    batch = None
    for s in plan.inputs:
        x = feeds[s.name]
        torch_in |= is_torch(x)
        a = to_numpy(x, s.name)
        if a.dtype != io_dtype(plan, s).numpy:
            raise InputTypeError(f"input '{s.name}': expected dtype {io_dtype(plan, s).numpy}, got {a.dtype}")
        if s.batched:
            want, rows = tuple(s.kernel_shape[1:]), s.kernel_shape[0]  # rows: k of a k*B dimension
            if a.ndim != len(s.kernel_shape) or tuple(a.shape[1:]) != want or a.shape[0] % rows:
                raise InputError(f"input '{s.name}': expected shape {expected(s)}, got {shape_str(a.shape)}")
            n = a.shape[0] // rows
            if batch is not None and n != batch[1]:
                raise InputError(
                    f"input '{s.name}': batch dimension '{plan.symbol}' is {n}, but input "
                    f"'{batch[0]}' has {batch[1]}"
                )
            batch = batch or (s.name, n)
        elif s.rows is not None:  # rows bound at run time: any number of them
            if a.ndim != len(s.kernel_shape) or tuple(a.shape[1:]) != tuple(s.kernel_shape[1:]):
                raise InputError(f"input '{s.name}': expected shape {shape_str(s.shape)} (any number of "
                                 f"rows), got {shape_str(a.shape)}")
            plan.limits.check_elements(f"input '{s.name}' {shape_str(a.shape)}", a.size, io_dtype(plan, s).itemsize)
        elif tuple(a.shape) != tuple(s.kernel_shape):
            raise InputError(f"input '{s.name}': expected shape {expected(s)}, got {shape_str(a.shape)}")
        arrays[s.name] = a
    return arrays, (batch[1] if batch else 1), torch_in


def host_feeds(plan: Plan, feeds: Mapping[str, Any], seen: dict | None = None) -> Mapping[str, Any]:
    """The feeds with the grids the plan's host steps build from them (luisaml/fvdb/host_steps.py). seen:
    the run's memo of digests (bytes_digest), which the run's binding reads after: a grid the steps
    and the kernels both read is hashed once."""
    steps = getattr(plan, "host_steps", None)
    if steps is None:
        return feeds

    def digest(name: str, a: np.ndarray) -> bytes:
        whole = np.ascontiguousarray(a)
        return bytes_digest(whole, seen if whole is feeds.get(name) else None)  # (the caller's own array)

    def remember(a: np.ndarray, d: bytes) -> None:  # (a step's output: the step's cache holds it)
        seen[memory_key(a)] = d

    def token(name: str, a: np.ndarray) -> bytes:  # (an input no step's cache can answer for: not read)
        whole = np.ascontiguousarray(a)
        return token_digest(whole, seen if whole is feeds.get(name) else None)

    return steps.complete(feeds, {s.name: s for s in plan.inputs}, digest, remember if seen is not None else None,
                          token)


def voxel_batch(plan: Plan, n: int, bound) -> voxel_rows.RunRows:
    """Check the run's grids against its inputs' batch n; return the run's batch (more than n where a
    grid of a sparse network has more voxels than the inputs' rows) and {output: rows} of the outputs
    to cut (luisaml/fvdb/voxel_rows.py). bound(name): a graph input's host array."""
    if not plan.voxel_rows:
        return voxel_rows.RunRows(n, {})
    graph = plan.model.graph

    def values(name: str):
        return bound(name) if name in graph.inputs else graph.var(name).value

    batched = {s.name: s.kernel_shape[0] for s in plan.outputs if s.batched}
    return voxel_rows.rows_at_run(plan.voxel_rows, values, n, batched)


def padded_inputs(plan: Plan, arrays: dict[str, np.ndarray], n: int, batch: int) -> dict[str, np.ndarray]:
    """The arrays with every batched input's n samples followed by zero samples up to `batch` (a
    sparse network's run whose largest grid has more voxels than the inputs' rows: voxel_batch)."""
    if batch == n:
        return arrays
    out = dict(arrays)
    for s in plan.inputs:
        if s.batched:
            a = arrays[s.name]
            out[s.name] = np.concatenate([a, np.zeros(((batch - n) * s.kernel_shape[0],) + a.shape[1:], a.dtype)])
    return out


def memory_key(a: np.ndarray) -> tuple:
    """The key under which bytes_digest memoises an array's digest in a run: its memory."""
    return ("bytes", a.__array_interface__["data"][0], a.nbytes)


def bytes_digest(a: np.ndarray, seen: dict | None) -> bytes:
    """Return a 16-byte blake2b digest of a contiguous array's bytes; a large one as a tree (the
    digest of its chunks' digests, computed in parallel). With seen (this run's memo; only for an
    array the caller holds, so its memory cannot be another's later in the run), memory hashed once
    in the run is not hashed again: a fine and a coarse map's bundles are views of one grid's blob."""
    global _hash_pool
    where = memory_key(a)
    if seen is not None and where in seen:
        return seen[where]
    known = _FROZEN_DIGESTS.get(id(a))
    if known is not None and known[0]() is a:
        if frozen(a):
            if seen is not None:
                seen[where] = known[1]
            return known[1]
        del _FROZEN_DIGESTS[id(a)]  # (made writeable again: hashed from now on, until frozen and hashed again)
    view = memoryview(a.reshape(-1)).cast("B")  # (flat: memoryview cannot cast a shape with a zero, [0, 1])
    if a.nbytes <= PARALLEL_HASH_BYTES:
        digest = hashlib.blake2b(view, digest_size=16).digest()
    else:
        if _hash_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            _hash_pool = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="luisaml-hash")
        parts = _hash_pool.map(lambda i: hashlib.blake2b(view[i:i + HASH_CHUNK], digest_size=16).digest(),
                               range(0, a.nbytes, HASH_CHUNK))
        digest = hashlib.blake2b(b"".join(parts), digest_size=16, person=b"luisaml-tree").digest()
    if seen is not None:
        seen[where] = digest
    if frozen(a):  # (its bytes cannot change while it lives: a later run, of any network, need not hash it)
        key = id(a)
        _FROZEN_DIGESTS[key] = (weakref.ref(a, lambda _r, key=key: _FROZEN_DIGESTS.pop(key, None)), digest)
    return digest


def token_digest(a: np.ndarray, seen: dict | None) -> bytes:
    """Return a digest standing for a's bytes without reading them, equal to no other array's digest or
    token (a counter's): for an input whose bytes no cache can know (luisaml/fvdb/host_steps.py: a step
    input of a shape its caches never saw, a new cloud of points every frame), so that its consumers key
    it as new. As bytes_digest: the run's memo (seen) gives its memory the same token for the rest of the
    run, and a frozen array keeps its token (or the digest it was given before) while it lives."""
    where = memory_key(a)
    if seen is not None and where in seen:
        return seen[where]
    known = _FROZEN_DIGESTS.get(id(a))
    if known is not None and known[0]() is a and frozen(a):
        digest = known[1]
    else:
        digest = b"unread " + next(_UNREAD).to_bytes(9, "little")
        if frozen(a):
            key = id(a)
            _FROZEN_DIGESTS[key] = (weakref.ref(a, lambda _r, key=key: _FROZEN_DIGESTS.pop(key, None)), digest)
    if seen is not None:
        seen[where] = digest
    return digest


_UNREAD = itertools.count()  # token_digest's

# the digests of frozen arrays (fvdb/checked.py: read-only, their memory no writeable array's) by identity while
# they live: a detector's frame, its points frozen, is hashed by network A and not again by B. (Code that makes
# such an array writeable, writes it and freezes it again with no run in between defeats this, as it would
# any cache: the read-only flag is the contract.)
_FROZEN_DIGESTS: dict[int, tuple] = {}


def input_digest(arrays: dict[str, np.ndarray], name: str, shape_only: bool, seen: dict) -> bytes:
    """Return the digest of input `name` (its dtype and shape, and unless shape_only its bytes),
    computed once per run: seen memoises it (a grid's bytes feed several derived inputs)."""
    key = (name, shape_only)
    if key not in seen:
        given = arrays[name]
        h = hashlib.blake2b(digest_size=16)
        h.update(f"{name}:{given.dtype.str}:{given.shape};".encode())
        if not shape_only:  # (voxel data whose rows alone are checked: not hashed per run)
            a = np.ascontiguousarray(given)
            h.update(bytes_digest(a, seen if a is given else None))
        seen[key] = h.digest()
    return seen[key]


def computation_key(d, arrays: dict[str, np.ndarray], seen: dict) -> tuple | None:
    """The key of derived input d's computation over these arrays, by content, not by input name:
    its function, parameters, type, each input source's dtype, shape and (unless its shape alone
    matters) bytes' digest, and each constant source itself (the plan's, never hashed). None when a
    parameter is not a plain value."""
    def plain(v) -> bool:
        return isinstance(v, (int, float, str, bool, type(None))) or (
            isinstance(v, tuple) and all(plain(x) for x in v))

    if not all(plain(v) for v in d.params.values()):
        return None
    parts: list = []
    for name in d.sources:
        if name in d.constants:
            parts.append(("constant", id(d.constants[name])))  # (the plan holds it: the same every run)
            continue
        given = arrays[name]
        if name in d.shape_only:  # (a stand-in of its shape on the zero-copy path: never made whole)
            parts.append((given.dtype.str, given.shape, None))
            continue
        whole = np.ascontiguousarray(given)
        parts.append((whole.dtype.str, whole.shape, bytes_digest(whole, seen if whole is given else None)))
    return ("derived", d.compute, tuple(sorted(d.params.items())), d.dtype.name, d.shape, tuple(parts))


class BoundInputs:
    """The inputs a network keeps between runs, known by their bytes' digest: byte inputs (a grid's
    blob, uploaded again only when its bytes change; one buffer for equal bytes under two names),
    host-derived inputs (recomputed only when their sources change) and the host copies of device
    tensors the host reads (luisaml/zero_copy.py)."""

    def __init__(self) -> None:
        self.derived: dict[str, tuple[tuple, Any, np.ndarray]] = {}  # ident -> (its computation's key, buffer, values)
        self.byte_inputs: dict[str, tuple[tuple, Any]] = {}  # byte input's ident -> (its bytes' key, ByteBuffer)
        self.spare_bytes: list = []  # ByteBuffers no byte input holds any more, newest first (byte_input)
        self.device_copies = 0  # byte inputs filled from a device buffer, not uploaded (byte_input, resident.py)
        # input -> (device tensor's clone, host copy, its digest, its bytes' digest): zero_copy._host_arrays
        self.host_copies: dict[str, tuple] = {}
        # input -> (the device tensor the last zero-copy run bound, its luisa Buffer): zero_copy._input_buffer
        self.shared_inputs: dict[str, tuple] = {}

    def derived_buffers(self, plan: Plan, arrays: dict[str, np.ndarray], seen: dict | None = None) -> list:
        """Return the buffers of the plan's host-derived inputs, recomputed only when their sources
        change, and once a run for equal computations over equal bytes (a fine and a coarse map's
        bundles of one grid: one check and layout of the blob). Keyed by content (computation_key),
        or, for a computation with parameters that are not plain values, by its sources' digests
        (input_digest); seen: the run's memo of digests and values."""
        from .luisa_compat import upload

        seen = {} if seen is None else seen
        out = []
        for d in plan.derived:
            key = computation_key(d, arrays, seen)
            if key is None:
                h = hashlib.blake2b(digest_size=16)
                for name in d.sources:
                    if name not in d.constants:
                        h.update(input_digest(arrays, name, name in d.shape_only, seen))
                key = (d.ident, h.digest())
            cached = self.derived.get(d.ident)
            if cached is None or cached[0] != key:
                value = seen.get(key)
                if value is None:
                    value = np.ascontiguousarray(
                        dtypes.to_kernel(d.value(arrays), d.dtype, f"derived input {d.ident}").reshape(-1))
                    seen[key] = value
                if cached is not None and value.size and cached[1].size == value.size:
                    # a new grid of the same layout: its values into the same buffer (the copy is
                    # ordered after the kernels of earlier runs on the one stream), not a new buffer
                    cached[1].copy_from_array(value, sync=False)
                    cached = (key, cached[1], value)  # (the host copy kept while the upload may be queued)
                else:
                    cached = (key, upload(value, d.dtype.dsl), value)
                self.derived[d.ident] = cached
            out.append(cached[1])
        return out

    def byte_input(self, s: IOSpec, k: np.ndarray, seen: dict | None):
        """Return the ByteBuffer of byte input s (a grid's blob) holding k: uploaded again only when
        its bytes change (no kernel writes an input), and one buffer for inputs of the same bytes (a
        fine and a coarse map's bundles of one grid: two inputs, one upload). seen: the run's memo
        of digests, for a k that is the caller's own array (alive for the whole run)."""
        from .luisa_compat import byte_buffer, byte_size, empty_byte_buffer, refill_byte_buffer

        whole = np.ascontiguousarray(k)
        key = (whole.dtype.str, whole.shape, bytes_digest(whole, seen if whole is k else None))
        buf = next((b for kk, b in self.byte_inputs.values() if kk == key), None)
        if buf is None:
            size = byte_size(whole)
            spare = next((b for b in self.spare_bytes if size <= b.bytesize <= 2 * size), None)
            # bytes a device buffer still holds (a grid built on the device: resident.py): copied there
            held = resident.source(whole) if whole.nbytes else None
            if spare is not None:  # a blob no input holds any more, of about this size: written over
                self.spare_bytes.remove(spare)
                buf = spare
            else:
                buf = empty_byte_buffer(size) if held is not None else byte_buffer(whole)
            if held is not None:
                self.device_copies += 1
                resident.copy_bytes(held[0], held[1], buf, 0, whole.nbytes)
            elif spare is not None:
                refill_byte_buffer(spare, whole)
        old = self.byte_inputs.get(s.ident)
        self.byte_inputs[s.ident] = (key, buf)
        if old is not None and all(b is not old[1] for _, b in self.byte_inputs.values()):
            # no input holds it now (a new grid took its place): kept for the next new grid, since a
            # ByteBuffer of megabytes took 9 ms to create on the H200 (a new grid every frame)
            self.spare_bytes = [old[1]] + self.spare_bytes[:SPARE_BYTE_BUFFERS - 1]
        return buf
