"""Batch inference on Ray (`pip install luisaml[ray]`): `Predictor`, a callable class for
`ray.data.Dataset.map_batches` that loads a .lml once per actor (a GPU each on CUDA, CPU actors on
the CPU backend) and maps batches whose columns are the network's inputs to its outputs as columns,
rows in order; `map_batches(ds, "model.lml")`, the one-line form with the actors' resources and
Ray's restarts set.

Ray is imported only where it is needed (`map_batches`, an actor's CPU count), so the class itself
runs wherever a batch of columns does. Runs are cut by the network's own limits (luisaml.parallel's
`max_rows`), and a run that fails is halved until one row fails alone, which the error names."""
from __future__ import annotations

import os
from typing import Any, Mapping

import numpy as np

from . import device
from .artifact import load, read
from .errors import InputError, UsageError
from .parallel import Port, max_rows, ports, run_in_chunks


def _ray():
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError as e:
        raise UsageError(f"luisaml.ray needs Ray Data: pip install 'luisaml[ray]' ({e})") from None
    return ray


def _actor_cpus() -> int | None:
    """The CPUs Ray gave this actor (None outside Ray, or when it gave none)."""
    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:  # (the driver: no resources of its own)
        return None
    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
    return max(1, int(cpus)) if cpus else None


def _columns(batch) -> dict[str, np.ndarray]:
    """The batch as {column: numpy array} (a dict of arrays as it is; a pandas or pyarrow batch
    through Ray's own conversion, which knows its tensor columns)."""
    if isinstance(batch, Mapping):
        return {k: np.asarray(v) if not isinstance(v, np.ndarray) else v for k, v in batch.items()}
    from ray.data.block import BlockAccessor

    return dict(BlockAccessor.for_block(batch).to_numpy())


class Predictor:
    """Runs a .lml over batches of a Ray Dataset: `ds.map_batches(Predictor, fn_constructor_args=(path,),
    concurrency=2)`, or luisaml.ray.map_batches. Each column named like a network input holds one row
    of the batch per dataset row (a scalar, or the input's shape past its batch dimension); each
    output becomes a column of the same name, a row per dataset row; other columns pass through.

    constants: the inputs that are not batched ({name: array}, given to every run). frames=True: each
    row holds a whole batch of the network (a frame: a point cloud, a frame's voxels), run one after
    another, each output a column of one array per row. row_id: a column whose value names a failing
    row in errors (default: its place in the batch). chunk: rows a run takes at most (default: what
    the network's buffers allow). Torch is never needed; the batch's dtypes must be the network's."""

    def __init__(self, path: str | os.PathLike, *, backend: str | None = None, constants: Mapping[str, Any] | None = None,
                 frames: bool = False, row_id: str | None = None, chunk: int | None = None,
                 outputs: list[str] | None = None):
        cpus = _actor_cpus()
        if cpus is not None:  # a CPU actor runs as many threads as Ray gave it cores, not one per core of the host
            device.request_cpu_threads(cpus)
        self.net = load(path, backend=backend)
        self.inputs, self.outputs = ports(self.net)
        self.constants = {k: np.asarray(v) for k, v in (constants or {}).items()}
        fixed = [p.name for p in self.inputs if not p.batched]
        if sorted(self.constants) != sorted(fixed):
            raise UsageError(f"constants {sorted(self.constants)} given; the network's inputs that are not batched are "
                             f"{fixed} (give each as constants={{name: array}})")
        self.frames = bool(frames)
        self.row_id = row_id
        self.wanted = list(outputs) if outputs is not None else [p.name for p in self.outputs]
        self.chunk = min(chunk or max_rows(self.net), max_rows(self.net))

    def _where(self, cols: Mapping[str, np.ndarray], row: int) -> str:
        if self.row_id is not None and self.row_id in cols:
            value = cols[self.row_id][row]
            return f"row {row} of the batch ({self.row_id} {value.item() if isinstance(value, np.generic) else value!r})"
        return f"row {row} of the batch"

    def _input(self, p: Port, cols: Mapping[str, np.ndarray], n: int) -> np.ndarray:
        """The column of input p as the network's array over n rows: [n * k, ...]; a row of another
        shape or dtype is an InputError naming it."""
        if p.name not in cols:
            raise InputError(f"the batch has no column '{p.name}' (a network input); its columns are {sorted(cols)}")
        col = cols[p.name]
        want = ((p.rows,) if p.rows != 1 else ()) + p.row_shape
        if col.dtype == object:  # rows Ray could not stack: say which one differs
            for r, v in enumerate(col):
                v = np.asarray(v)
                if v.shape != want or v.dtype != np.dtype(p.dtype):
                    raise InputError(f"{self._where(cols, r)}: input '{p.name}' expected {np.dtype(p.dtype)} of shape "
                                     f"{want}, got {v.dtype} of shape {v.shape}")
            col = np.stack(list(col)) if n else np.zeros((0,) + want, np.dtype(p.dtype))
        if col.dtype != np.dtype(p.dtype):
            raise InputError(f"input '{p.name}': expected dtype {np.dtype(p.dtype)}, got {col.dtype} (column "
                             f"'{p.name}'); cast the column first")
        if tuple(col.shape[1:]) != want:
            raise InputError(f"input '{p.name}': each row holds shape {want}, the column's rows hold "
                             f"{tuple(col.shape[1:])}")
        return col.reshape((n * p.rows,) + p.row_shape)

    def __call__(self, batch) -> dict[str, np.ndarray]:
        """Return the batch's other columns and the network's outputs as columns, rows in order."""
        cols = _columns(batch)
        n = len(next(iter(cols.values()))) if cols else 0
        if self.frames:
            out = self._frames(cols, n)
        else:
            arrays = {p.name: self._input(p, cols, n) for p in self.inputs if p.batched}
            arrays.update(self.constants)
            got = run_in_chunks(self.net, arrays, self.inputs, self.outputs, n, self.chunk, self.wanted)
            out = {}
            for p in self.outputs:
                if p.name in got:
                    v = got[p.name]
                    # one row per dataset row: [n, k, ...] for k rows a row, a non-batched output repeated
                    out[p.name] = (v.reshape((n,) + ((p.rows,) if p.rows != 1 else ()) + p.row_shape) if p.batched
                                   else np.broadcast_to(v, (n,) + v.shape).copy())
        return {**{k: v for k, v in cols.items() if k not in out}, **out}

    def _frames(self, cols: Mapping[str, np.ndarray], n: int) -> dict[str, np.ndarray]:
        """Each row a whole batch of the network, run one after another: each output one array a row."""
        results: dict[str, list] = {k: [] for k in self.wanted}
        for r in range(n):
            feeds = dict(self.constants)
            for p in self.inputs:
                if p.batched:
                    if p.name not in cols:
                        raise InputError(f"the batch has no column '{p.name}' (a network input); its columns are "
                                         f"{sorted(cols)}")
                    feeds[p.name] = np.asarray(cols[p.name][r])
            frame_rows = next((len(feeds[p.name]) // p.rows for p in self.inputs if p.batched), 0)
            got = run_in_chunks(self.net, feeds, self.inputs, self.outputs, frame_rows, self.chunk, self.wanted,
                                where=f"{self._where(cols, r)}: frame row")
            for k in self.wanted:
                results[k].append(got[k])
        out = {}
        for k, vs in results.items():
            column = np.empty(n, dtype=object)  # one array a row, of its frame's rows (Ray: a ragged tensor column)
            column[:] = vs if n else []
            out[k] = column
        return out


# the rows of a batch Ray hands a GPU actor when the user gives none (Ray refuses whole blocks with
# num_gpus): enough to fill a GPU with a small network; the actor still cuts it by the network's limits
GPU_BATCH_ROWS = 1 << 20


def map_batches(ds, path: str | os.PathLike, *, actors: int | None = None, backend: str | None = None,
                constants: Mapping[str, Any] | None = None, frames: bool = False, row_id: str | None = None,
                outputs: list[str] | None = None, chunk: int | None = None, batch_size: int | None = None,
                num_cpus: float | None = None, num_gpus: float | None = None, **ray_remote_args):
    """Return `ds` mapped through the .lml at `path` by `actors` Predictor actors: one GPU each on CUDA
    (default: every GPU of the cluster), `num_cpus` CPUs each on the CPU backend (default 1 CPU each, as
    many actors as the cluster has CPUs but one, which the dataset's own tasks need). Ray's whole blocks are the batches unless batch_size is given
    (on CUDA GPU_BATCH_ROWS: Ray wants a number there); each is run in runs the network's limits allow. An actor that dies is restarted and its block run
    again (max_restarts=-1, max_task_retries=-1 unless given in ray_remote_args). Rows keep their order
    within a block; for the order across blocks set Ray's DataContext execution_options.preserve_order."""
    ray = _ray()
    backend = backend if backend not in (None, "auto") else read(path).backend
    if backend == "cuda":
        batch_size = GPU_BATCH_ROWS if batch_size is None else batch_size  # (Ray wants a number with num_gpus)
        num_gpus = 1 if num_gpus is None else num_gpus
        num_cpus = 1 if num_cpus is None else num_cpus
        if actors is None:
            actors = max(1, int(ray.cluster_resources().get("GPU", 1) // max(num_gpus, 1e-9)))
    else:
        num_cpus = 1 if num_cpus is None else num_cpus
        if actors is None:  # (one CPU left to the dataset's own tasks: actors holding every CPU starve its reads)
            actors = max(1, int((ray.cluster_resources().get("CPU", 1) - 1) // num_cpus))
    return ds.map_batches(
        Predictor, fn_constructor_args=(os.fspath(path),),
        fn_constructor_kwargs=dict(backend=backend, constants=constants, frames=frames, row_id=row_id, chunk=chunk,
                                   outputs=outputs),
        batch_size=batch_size, batch_format="numpy", compute=ray.data.ActorPoolStrategy(size=actors),
        num_cpus=num_cpus, num_gpus=num_gpus or None, udf_modifying_row_count=False, **ray_remote_args)
