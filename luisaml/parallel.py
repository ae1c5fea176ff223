"""One host, several devices: a large batch split over worker processes, one per device (a GPU each on
CUDA; on the CPU backend a count of processes sharing the cores), inputs and outputs through shared
memory, results in order (`run`, `Pool`); and how a batch is cut into runs a network can take
(`max_rows`, `run_rows`, `run_in_chunks`), which luisaml.ray's actors use too.

Each worker loads the `.lml` with `luisaml.load` (data only: luisaml/artifact.py) in a process of its
own (spawned, never forked: a parent that runs LuisaCompute has threads), so a process still runs one
LuisaCompute device. A worker takes a chunk of rows at a time from the parent (whoever finishes takes
the next), reads them from the inputs' shared memory and writes its outputs at their rows' place in
the outputs' shared memory; nothing else crosses the processes but the chunks' bounds.

A "row" is a sample of the batch (for an input of a k*B dimension, k rows of the array)."""
from __future__ import annotations

import math
import multiprocessing
import os
from collections import deque
from dataclasses import dataclass
from multiprocessing import connection, shared_memory
from typing import Any, Mapping, Sequence

import numpy as np

from . import device, errors, memory
from .artifact import load, read
from .errors import InputError, InputNameError, LuisamlError, RunError, UsageError
from .interop import to_numpy
from .limits import INDEX_LIMIT
from .per_batch import PerBatchNetwork

# chunks a worker takes on average from one run: more balance the workers (one may be slower, the
# machine shared), fewer launch less; a chunk is never larger than the network allows (max_rows)
CHUNKS_PER_WORKER = 4
# a row's values are written into an error message up to this many elements
_SHOWN_ELEMENTS = 8


# ---- the batch cut into runs: shared with luisaml.ray ------------------------------------------
def max_rows(net, sharing: int = 1) -> int:
    """Return the most rows one run of `net` may take: what its buffers may hold under 32-bit
    indexing and its Limits (net.check_batch), and half the memory the backend has free, shared by
    `sharing` processes on the host (the CPU backend's workers share the host's memory)."""
    lo, hi = 1, INDEX_LIMIT  # check_batch(lo) passes or nothing does; the largest n it passes
    while lo < hi:
        mid = (lo + hi + 1) // 2
        try:
            net.check_batch(mid)
            lo = mid
        except errors.LimitError:
            hi = mid - 1
    per_row, free = memory.bytes_per_sample(net), memory.free_memory(net.backend)
    if per_row and free:
        lo = min(lo, max(1, free // 2 // max(1, sharing) // per_row))
    return lo


@dataclass(frozen=True)
class Port:
    """A graph input or output as a worker or actor binds it: its numpy dtype, its shape per row
    (k rows of the array for a k*B dimension) and whether the batch runs along its first dimension."""

    name: str
    dtype: str
    row_shape: tuple[int, ...]  # the array's shape past its first dimension
    rows: int  # rows of the array per row of the batch (k of a k*B dimension; 1 when not batched)
    batched: bool

    def array_shape(self, n: int) -> tuple[int, ...]:
        """The shape of this port's array over n rows of the batch."""
        return ((n * self.rows,) + self.row_shape) if self.batched else self.row_shape


def ports(net) -> tuple[list[Port], list[Port]]:
    """Return (inputs, outputs) of a network a batch can be split for; raise UsageError naming what
    makes it run its batch as a whole (a network compiled per batch size, a static batch, an output
    summed over the batch or sized at run time, a sparse network whose batch is a grid's voxels)."""
    if isinstance(net, PerBatchNetwork):
        raise UsageError(f"this network cannot be split by rows of its batch: {net.why} (it compiles per batch "
                         "size); run it with net.run")
    if net.batch_symbol is None:
        raise UsageError("this network's shapes are static (it has no batch dimension to split); run it with net.run")
    plan = net.plan
    if plan.voxel_rows:
        raise UsageError("this sparse network's batch is its grids' voxels, which one run must hold together; "
                         "run it with net.run")
    for s in plan.outputs:
        if s.accumulated:
            raise UsageError(f"output '{s.name}' is summed over the whole batch, so its parts would not add up "
                             "across runs; run it with net.run")
        if s.rows is not None:
            raise UsageError(f"output '{s.name}' is sized at run time; parallel runs need outputs of known size")
    if plan.host_outputs:
        raise UsageError(f"output(s) {plan.host_outputs} no node writes (an input or a constant passed out); "
                         "parallel runs return only what the network computes")
    for s in plan.inputs:
        if s.rows is not None:
            raise UsageError(f"input '{s.name}' takes any number of rows bound at run time, not the batch; "
                             "run it with net.run")

    def port(s) -> Port:
        k = s.kernel_shape[0] if s.batched and s.kernel_shape else 1
        shape = tuple(int(d) for d in (s.kernel_shape[1:] if s.batched else s.kernel_shape))
        return Port(s.name, net.io_dtype(s).numpy.str, shape, int(k), bool(s.batched))

    return [port(s) for s in plan.inputs], [port(s) for s in plan.outputs]


def describe_row(inputs: Mapping[str, np.ndarray], in_ports: Sequence[Port], row: int) -> str:
    """Return the row's values of each batched input, or their shape where they are many."""
    parts = []
    for p in in_ports:
        if not p.batched or p.name not in inputs:
            continue
        v = np.asarray(inputs[p.name][row * p.rows:(row + 1) * p.rows])
        values = v.reshape(-1)[:_SHOWN_ELEMENTS].tolist() if v.size <= _SHOWN_ELEMENTS else None
        parts.append(f"'{p.name}' = {values}" if values is not None else f"'{p.name}' of shape {tuple(v.shape)}")
    return ", ".join(parts)


def _slice(arrays: Mapping[str, np.ndarray], in_ports: Sequence[Port], start: int, stop: int) -> dict:
    by_name = {p.name: p for p in in_ports}
    return {k: (a[start * by_name[k].rows:stop * by_name[k].rows] if k in by_name and by_name[k].batched else a)
            for k, a in arrays.items()}


def run_rows(net, arrays: Mapping[str, np.ndarray], in_ports: Sequence[Port], start: int, stop: int,
             outputs: list[str] | None = None, where: str = "row") -> dict[str, np.ndarray]:
    """Return net.run over rows [start, stop) of the batch `arrays` (every input whole: batched ones
    are cut here). When the run fails, the rows are halved until one row fails alone, and the error
    (its own class) names that row and its inputs' values; a failure no single row has names the rows.
    where: what a row is called in the message ("row", "row 12 of block ...")."""
    try:
        return net.run(_slice(arrays, in_ports, start, stop), outputs)
    except LuisamlError as e:
        raise _name_the_row(net, arrays, in_ports, start, stop, outputs, e, where) from None


def _name_the_row(net, arrays, in_ports, start, stop, outputs, error: LuisamlError, where: str) -> LuisamlError:
    """The error of the first row of [start, stop) that fails alone, with that row in its message."""
    lo, hi = start, stop
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            net.run(_slice(arrays, in_ports, lo, mid), outputs)
            lo = mid  # the first half runs: what fails is in the second
        except LuisamlError as e:
            error, hi = e, mid
    try:
        net.run(_slice(arrays, in_ports, lo, hi), outputs)
    except LuisamlError as e:
        values = describe_row(arrays, in_ports, lo)
        return _same_class(e, f"{where} {lo} of the batch ({values}): {e}")
    return _same_class(error, f"{where}s [{start}, {stop}) of the batch fail together though no row fails "
                              f"alone: {error}")


def _same_class(e: LuisamlError, message: str) -> LuisamlError:
    try:
        return type(e)(message)
    except TypeError:  # a class of another signature
        return RunError(message)


def run_in_chunks(net, arrays: Mapping[str, np.ndarray], in_ports: Sequence[Port], out_ports: Sequence[Port],
                  n: int, chunk: int, outputs: list[str] | None = None, where: str = "row") -> dict[str, np.ndarray]:
    """Return net.run over n rows of `arrays` as runs of at most `chunk` rows, the outputs joined in
    order (one run: its outputs as they are)."""
    if n <= chunk:
        return run_rows(net, arrays, in_ports, 0, n, outputs, where)
    parts = [run_rows(net, arrays, in_ports, a, min(n, a + chunk), outputs, where) for a in range(0, n, chunk)]
    batched = {p.name for p in out_ports if p.batched}
    return {k: (np.concatenate([r[k] for r in parts]) if k in batched else parts[0][k]) for k in parts[0]}


# ---- the workers ---------------------------------------------------------------------------------
def _error_message(e: BaseException) -> tuple[str, str]:
    if isinstance(e, LuisamlError):
        return type(e).__name__, str(e)
    import traceback

    return "RunError", f"{type(e).__name__}: {e}\n{''.join(traceback.format_exception(e))[-2000:]}"


def _raise(kind: str, message: str):
    """Raise the luisaml error class named `kind` (looked up among luisaml's own) with message."""
    cls = getattr(errors, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, LuisamlError)):
        cls = RunError
    raise _same_class(cls(""), message)


class _Blocks:
    """A worker's or the parent's views of a run's shared memory blocks: {name: array}."""

    def __init__(self, layout: Mapping[str, tuple[str, tuple, str]], create: bool = False):
        self.memory: dict[str, shared_memory.SharedMemory] = {}
        self.arrays: dict[str, np.ndarray] = {}
        self.attach(layout, create)

    def attach(self, layout: Mapping[str, tuple[str, tuple, str]], create: bool = False) -> None:
        """Map the blocks of `layout` not mapped yet (create them: the parent)."""
        try:
            for key, (block, shape, dtype) in layout.items():
                if key in self.memory:
                    continue
                nbytes = max(1, int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize)
                m = (shared_memory.SharedMemory(create=True, size=nbytes) if create
                     else shared_memory.SharedMemory(name=block))
                self.memory[key] = m
                self.arrays[key] = np.ndarray(shape, dtype=np.dtype(dtype), buffer=m.buf)
        except BaseException:
            self.close(unlink=create)
            raise

    def layout(self) -> dict[str, tuple[str, tuple, str]]:
        return {k: (self.memory[k].name, a.shape, a.dtype.str) for k, a in self.arrays.items()}

    def close(self, unlink: bool = False) -> None:
        self.arrays.clear()  # (a view still held keeps the block's buffer exported: close would fail)
        for m in self.memory.values():
            m.close()
            if unlink:
                try:
                    m.unlink()
                except FileNotFoundError:
                    pass
        self.memory.clear()


def _serve(conn, path: str, backend: str, env: dict[str, str], sharing: int) -> None:
    """A worker: load the .lml on its device, say its ports and row limit, then run the chunks the
    parent sends until told to stop (or the parent is gone)."""
    os.environ.update(env)  # before the device starts: the GPU it sees, or the CPU threads it starts
    if "LUISA_NUM_THREADS" in env:
        device.request_cpu_threads(int(env["LUISA_NUM_THREADS"]))
    try:
        net = load(path, backend=backend)
        in_ports, out_ports = ports(net)
        conn.send(("ready", in_ports, out_ports, max_rows(net, sharing)))
    except BaseException as e:  # noqa: BLE001 (the parent raises it; a worker has no one else to tell)
        conn.send(("failed",) + _error_message(e))
        return
    blocks: _Blocks | None = None
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            if msg[0] == "release":
                if blocks is not None:
                    blocks.close()
                blocks = None
                continue
            _, layout, start, stop, wanted = msg
            try:
                if blocks is None:
                    blocks = _Blocks(layout)
                blocks.attach(layout)  # (the outputs' blocks come after the inputs' check)
                inputs = {p.name: blocks.arrays["in:" + p.name] for p in in_ports}
                if start is None:  # the whole batch's names, dtypes and shapes, once a run, by the network's own check
                    net.check_feeds(inputs)
                    conn.send(("done", None, None))
                    continue
                out = run_rows(net, inputs, in_ports, start, stop, wanted)
                for k, v in out.items():
                    p = next(p for p in out_ports if p.name == k)
                    target = blocks.arrays["out:" + k]
                    if p.batched:
                        target[start * p.rows:stop * p.rows] = v
                    elif start == 0:
                        target[...] = v
                conn.send(("done", start, stop))
            except BaseException as e:  # noqa: BLE001
                conn.send(("error", start, stop) + _error_message(e))
    except (EOFError, KeyboardInterrupt):
        pass
    finally:
        if blocks is not None:
            blocks.close()


@dataclass
class _Worker:
    process: Any
    conn: Any
    device: str


def _worker_envs(backend: str, devices) -> list[tuple[str, dict[str, str]]]:
    """Return (device's name, environment) of each worker for `devices` on `backend`."""
    if backend == "cuda":
        count = device.cuda_device_count()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = [d.strip() for d in visible.split(",")] if visible else [str(i) for i in range(count)]
        ids = ids[:count]
        if devices == "all":
            chosen = list(range(len(ids)))
        elif isinstance(devices, int) and not isinstance(devices, bool):
            if not 1 <= devices <= len(ids):
                raise UsageError(f"devices={devices}: this host has {len(ids)} CUDA device(s)")
            chosen = list(range(devices))
        elif isinstance(devices, (list, tuple)) and devices:
            bad = [d for d in devices if not isinstance(d, int) or not 0 <= d < len(ids)]
            if bad or len(set(devices)) != len(devices):
                raise UsageError(f"devices={list(devices)}: expected distinct CUDA device indices in 0..{len(ids) - 1}")
            chosen = list(devices)
        else:
            raise UsageError(f"devices must be 'all', a count or a list of CUDA device indices, not {devices!r}")
        if not chosen:
            raise UsageError("no CUDA device was found for devices='all'")
        return [(f"cuda:{i}", {"CUDA_VISIBLE_DEVICES": ids[i]}) for i in chosen]
    # the CPU backend is one device: the count of processes is the user's, the cores split among them
    if devices == "all":
        workers = 1
    elif isinstance(devices, int) and not isinstance(devices, bool) and devices >= 1:
        workers = devices
    else:
        raise UsageError(f"devices={devices!r}: the CPU backend is one device; give the count of worker processes "
                         "(devices=2), each then runs its share of the cores")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = str(max(1, cores // workers))
    return [(f"cpu:{i}", {"LUISA_NUM_THREADS": threads}) for i in range(workers)]


class Pool:
    """Worker processes, one per device, that hold a .lml loaded and run the rows of batches given to
    `run` (start them once, run many batches; `with Pool(...) as pool:` stops them)."""

    def __init__(self, path: str | os.PathLike, devices: str | int | Sequence[int] = "all", *,
                 backend: str | None = None, chunk: int | None = None):
        if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
            raise UsageError(f"chunk={chunk!r}: expected a number of rows >= 1")
        self.path = os.fspath(path)
        self.backend = backend if backend not in (None, "auto") else read(self.path).backend
        self.chunk = chunk
        self.workers: list[_Worker] = []
        ctx = multiprocessing.get_context("spawn")
        try:
            envs = _worker_envs(self.backend, devices)
            sharing = len(envs) if self.backend == "cpu" else 1  # (the CPU's workers share the host's memory)
            for name, env in envs:
                parent_end, child_end = ctx.Pipe()
                p = ctx.Process(target=_serve, args=(child_end, self.path, self.backend, env, sharing),
                                name=f"luisaml-{name}", daemon=True)
                p.start()
                child_end.close()
                self.workers.append(_Worker(p, parent_end, name))
            replies = [self._reply(w, "loading the network") for w in self.workers]
            failed = [r for r in replies if r[0] == "failed"]
            if failed:
                _raise(failed[0][1], f"a worker could not load '{self.path}': {failed[0][2]}")
            self.inputs, self.outputs = replies[0][1], replies[0][2]
            self.max_rows = min(r[3] for r in replies)
        except BaseException:
            self.close()
            raise

    @property
    def devices(self) -> list[str]:
        """The device each worker runs ('cuda:0', 'cpu:1', ...)."""
        return [w.device for w in self.workers]

    def _reply(self, w: _Worker, doing: str):
        """The worker's next message; RunError naming the worker when its process ends first."""
        ready = connection.wait([w.conn, w.process.sentinel])
        if w.conn in ready and w.conn.poll():
            try:
                return w.conn.recv()
            except EOFError:
                pass
        w.process.join(5)
        raise RunError(f"the worker on {w.device} ended (exit code {w.process.exitcode}) while {doing}")

    def run(self, feeds: Mapping[str, Any], outputs: list[str] | None = None) -> dict[str, np.ndarray]:
        """Return {output name: numpy array} over the whole batch, rows in order, as net.run would."""
        if not self.workers:
            raise UsageError("this parallel pool is closed")
        if not isinstance(feeds, Mapping):
            raise InputError(f"feeds must be a dict of input name -> array, got {type(feeds).__name__}")
        names = [p.name for p in self.inputs]
        wanted = list(outputs) if outputs is not None else [p.name for p in self.outputs]
        bad = [o for o in wanted if o not in {p.name for p in self.outputs}]
        if bad:
            raise InputNameError(f"unknown output(s) {bad}; the network's outputs are {[p.name for p in self.outputs]}")
        if set(feeds) != set(names):
            raise InputNameError(f"inputs {sorted(feeds)} given; the network's inputs are {names}")
        arrays = {p.name: to_numpy(feeds[p.name], p.name) for p in self.inputs}
        batched = [p for p in self.inputs if p.batched]
        n = arrays[batched[0].name].shape[0] // batched[0].rows if batched and arrays[batched[0].name].ndim else 0
        blocks_in = _Blocks({"in:" + k: ("", a.shape, a.dtype.str) for k, a in arrays.items()}, create=True)
        blocks_out = None
        try:
            for k, a in arrays.items():
                blocks_in.arrays["in:" + k][...] = a
            self._each(blocks_in.layout(), [(None, None)], wanted, workers=self.workers[:1])  # net.check_feeds
            out_ports = [p for p in self.outputs if p.name in wanted]
            blocks_out = _Blocks({"out:" + p.name: ("", p.array_shape(n), p.dtype) for p in out_ports}, create=True)
            layout = {**blocks_in.layout(), **blocks_out.layout()}
            share = self.chunk or max(1, math.ceil(n / (CHUNKS_PER_WORKER * len(self.workers))))
            step = max(1, min(share, self.max_rows))
            self._each(layout, [(a, min(n, a + step)) for a in range(0, n, step)] or [(0, 0)], wanted)
            return {k[4:]: np.array(a) for k, a in blocks_out.arrays.items()}  # (copied out of the blocks)
        finally:
            for w in self.workers:
                try:
                    w.conn.send(("release",))  # (a worker unmaps this run's blocks before the next)
                except OSError:
                    pass
            blocks_in.close(unlink=True)
            if blocks_out is not None:
                blocks_out.close(unlink=True)

    def _each(self, layout: dict, chunks: list[tuple], wanted: list[str], workers: list[_Worker] | None = None) -> None:
        """Run every chunk on the workers, each taking the next when it is done; raise the first
        chunk's error (by row) once every worker is idle again."""
        todo = deque(chunks)
        busy: dict[int, tuple] = {}
        failures: list[tuple] = []
        workers = workers if workers is not None else self.workers
        by_conn = {id(w.conn): i for i, w in enumerate(workers)}

        def give(i: int) -> None:
            if todo and not failures:
                start, stop = todo.popleft()
                busy[i] = (start, stop)
                try:
                    workers[i].conn.send(("rows", layout, start, stop, wanted))
                except OSError:  # (its process ended: the sentinel below says so, naming these rows)
                    pass

        for i in range(len(workers)):
            give(i)
        while busy:
            # a worker's pipe reads as ended once its process is gone (the parent holds no copy of its end)
            for ready in connection.wait([workers[i].conn for i in busy]):
                i = by_conn[id(ready)]
                try:
                    msg = ready.recv()
                except (EOFError, OSError):
                    (start, stop), w = busy[i], workers[i]
                    w.process.join(5)
                    self.close()
                    raise RunError(f"the worker on {w.device} died (exit code {w.process.exitcode}) running rows "
                                   f"[{start}, {stop}) of the batch; the pool is closed") from None
                del busy[i]
                if msg[0] == "error":
                    failures.append(msg[1:])
                give(i)
        if failures:
            start, stop, kind, message = min(failures, key=lambda f: -1 if f[0] is None else f[0])
            on = "" if start is None else f"rows [{start}, {stop}): "
            _raise(kind, on + message)

    def close(self) -> None:
        """Stop the workers (those that do not stop in a few seconds are terminated)."""
        for w in self.workers:
            try:
                if w.process.is_alive():
                    w.conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
        for w in self.workers:
            w.process.join(5)
            if w.process.is_alive():
                w.process.terminate()
                w.process.join(5)
            w.conn.close()
        self.workers = []

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if getattr(self, "workers", None):
            self.close()


def run(path: str | os.PathLike, feeds: Mapping[str, Any], devices: str | int | Sequence[int] = "all", *,
        outputs: list[str] | None = None, backend: str | None = None, chunk: int | None = None) -> dict[str, np.ndarray]:
    """Return {output name: numpy array} of the .lml at `path` over the feeds' whole batch, its rows
    split over worker processes, one per device, in order: what `luisaml.load(path).run(feeds)` returns.

    devices: on CUDA "all" (every GPU of the host), a count (the first ones) or a list of indices; on
    the CPU backend (one device) the count of worker processes, each running its share of the cores
    ("all": one). chunk: rows a worker runs at a time (default: a quarter of a worker's share, at most
    what the network's buffers allow, `max_rows`). Inputs that are not batched go to every run whole.
    An error names the rows, and where one row fails alone, that row and its inputs' values.
    Workers are spawned: a script calling this needs the `if __name__ == "__main__":` guard."""
    with Pool(path, devices, backend=backend, chunk=chunk) as pool:
        return pool.run(feeds, outputs)
