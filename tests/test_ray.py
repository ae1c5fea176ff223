"""luisaml.ray: a .lml mapped over a Ray Dataset by actors (CPU actors here) returns what one net.run
returns, in order, even when an actor is killed mid-job; Predictor on plain batches (no cluster): frames
of different sizes, a bad row named, pandas batches. The cluster tests skip where Ray is not installed."""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

import luisaml
from luisaml.ray import Predictor
from util import export_batched, torch_mlp

ROWS = 100_000
BLOCKS = 20


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    """(the .lml of a batched MLP 3 -> 64 -> 64 -> 4, the compiled network, the torch module)."""
    d = tmp_path_factory.mktemp("ray")
    module = torch_mlp([3, 64, 64, 4], seed=3)
    net = luisaml.compile(export_batched(module, 3, d / "mlp.onnx"))
    return str(net.save(d / "mlp.lml")), net, module


def points(ids: np.ndarray) -> np.ndarray:
    """The input row of each id (a pure function of it, so the driver and Ray's tasks agree)."""
    t = ids.astype(np.float64)
    return np.stack([np.sin(0.1 * t), np.cos(0.37 * t), (ids * 7919 % 1000) / 500.0 - 1.0], axis=-1).astype(np.float32)


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster of 3 CPU slots: two for the actors, one for the tasks that make the rows."""
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    ray.init(num_cpus=3, include_dashboard=False, object_store_memory=256 << 20, log_to_driver=False,
             configure_logging=False)
    import sys

    # the functions that make the rows travel by value: the workers cannot import this test module
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # rows in order across blocks (within one, luisaml keeps it)
    ctx.enable_progress_bars = False
    yield ray
    ray.shutdown()


def _dataset(ray, rows: int, blocks: int, delay: float = 0.0):
    def make(batch):
        time.sleep(delay)  # (a source that delivers over time, so the job is still running when an actor dies)
        return {"id": batch["id"], "x": points(batch["id"])}

    return ray.data.range(rows, override_num_blocks=blocks).map_batches(make, batch_size=None)


def _check_every_row(batches, net, rows: int) -> None:
    ids = np.concatenate([b["id"] for b in batches])
    got = np.concatenate([b["y"] for b in batches])
    np.testing.assert_array_equal(ids, np.arange(rows))  # every row once, in order
    np.testing.assert_array_equal(got, net.run({"x": points(np.arange(rows))})["y"])


def test_two_cpu_actors_map_100k_rows_like_one_run(cluster, mlp):
    """100k rows in 20 blocks over two CPU actors: the ids come back in order, each once, and every
    output equals the single process's net.run bit for bit (and torch's within rounding)."""
    import torch

    import luisaml.ray

    path, net, module = mlp
    out = luisaml.ray.map_batches(_dataset(cluster, ROWS, BLOCKS), path, actors=2)
    batches = list(out.iter_batches(batch_size=None, batch_format="numpy"))
    _check_every_row(batches, net, ROWS)
    with torch.no_grad():
        want = module(torch.from_numpy(points(np.arange(ROWS)))).numpy()
    np.testing.assert_allclose(np.concatenate([b["y"] for b in batches]), want, rtol=1e-5, atol=1e-5)


def _actor_pids() -> set[int]:
    """The pids of this cluster's map actors: processes descended from this test process (which
    started the cluster) whose title Ray set to its MapWorker (read from /proc: Linux)."""
    parent, title = {}, {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    title[int(d)] = f.read().decode(errors="replace")
            except (OSError, IndexError, ValueError):
                pass

    def ours(pid: int) -> bool:
        while pid > 1:
            pid = parent.get(pid, 0)
            if pid == os.getpid():
                return True
        return False

    return {pid for pid, t in title.items() if "MapWorker" in t and ours(pid)}


def test_an_actor_killed_mid_job_is_restarted_and_no_row_is_dropped(cluster, mlp):
    """SIGKILL one of the two actors once the first block's outputs are back: Ray restarts it (a new
    process) and runs its block again; every row's output is there once, in order, equal to net.run."""
    import luisaml.ray

    path, net, _ = mlp
    rows = 20_000
    out = luisaml.ray.map_batches(_dataset(cluster, rows, BLOCKS, delay=0.1), path, actors=2)
    batches, killed, seen = [], [], set()
    for b in out.iter_batches(batch_size=None, batch_format="numpy"):
        batches.append(b)
        if not killed:
            first = sorted(_wait_for(lambda: _actor_pids() if len(_actor_pids()) == 2 else None, 60) or _actor_pids())
            assert len(first) == 2, f"actor processes found: {first}"
            os.kill(first[0], signal.SIGKILL)
            killed.append(first[0])
        seen |= _actor_pids()
    _check_every_row(batches, net, rows)
    # on a loaded machine the job may end before Ray has restarted the actor: wait for it a while
    seen |= _wait_for(lambda: (_actor_pids() - set(first)) or None, 60) or set()
    assert seen - set(first), "no actor was started again after the kill"


def _wait_for(probe, seconds: float):
    """Return probe()'s first truthy value within `seconds` (polled every 0.2 s), else None."""
    end = time.monotonic() + seconds
    while True:
        got = probe()
        if got or time.monotonic() > end:
            return got or None
        time.sleep(0.2)


# ---- Predictor on plain batches: no cluster needed --------------------------------------------
def test_predictor_maps_a_dict_batch_and_passes_other_columns(mlp):
    path, net, _ = mlp
    x = points(np.arange(1000))
    p = Predictor(path, chunk=300)  # four runs of at most 300 rows, joined in order
    out = p({"x": x, "id": np.arange(1000)})
    assert sorted(out) == ["id", "x", "y"]
    np.testing.assert_array_equal(out["y"], net.run({"x": x})["y"])
    np.testing.assert_array_equal(out["id"], np.arange(1000))


def test_a_bad_row_is_named_by_its_row_id(mlp):
    """A row of another shape (Ray hands such a column as objects) is an InputError naming the row,
    its id column's value and the input; a float64 column is refused naming the input."""
    path, _, _ = mlp
    p = Predictor(path, row_id="id")
    col = np.empty(3, dtype=object)
    col[:] = [np.zeros(3, np.float32), np.zeros(4, np.float32), np.zeros(3, np.float32)]
    with pytest.raises(luisaml.InputError, match=r"row 1 of the batch \(id 11\): input 'x' expected float32 of shape "
                                                 r"\(3,\), got float32 of shape \(4,\)"):
        p({"x": col, "id": np.array([10, 11, 12])})
    with pytest.raises(luisaml.InputError, match=r"input 'x': expected dtype float32, got float64"):
        p({"x": np.zeros((2, 3))})


def test_frames_of_different_sizes_run_one_after_another(mlp):
    """frames=True: each row a whole batch (a frame of its own number of points); each output is one
    array a row, equal to net.run over that frame."""
    path, net, _ = mlp
    frames = [points(np.arange(a, a + k)) for a, k in ((0, 5), (100, 17), (7, 1))]
    col = np.empty(3, dtype=object)
    col[:] = frames
    out = Predictor(path, frames=True)({"x": col})
    assert out["y"].dtype == object and [y.shape for y in out["y"]] == [(5, 4), (17, 4), (1, 4)]
    for f, y in zip(frames, out["y"]):
        np.testing.assert_array_equal(y, net.run({"x": f})["y"])


def test_a_pyarrow_batch_with_a_tensor_column_is_read_through_rays_conversion(mlp):
    pytest.importorskip("ray.data")
    import pyarrow as pa
    from ray.data.extensions import ArrowTensorArray

    path, net, _ = mlp
    x = points(np.arange(64))
    table = pa.table({"x": ArrowTensorArray.from_numpy(x), "id": pa.array(np.arange(64))})
    out = Predictor(path)(table)
    np.testing.assert_array_equal(out["y"], net.run({"x": x})["y"])
    np.testing.assert_array_equal(out["id"], np.arange(64))


def test_a_pandas_batch_is_read_through_rays_conversion(mlp):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("ray.data")
    path, net, _ = mlp
    x = points(np.arange(50))
    df = pd.DataFrame({"x": list(x), "id": np.arange(50)})
    out = Predictor(path)(df)
    np.testing.assert_array_equal(out["y"], net.run({"x": x})["y"])
