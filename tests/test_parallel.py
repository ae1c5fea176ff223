"""luisaml.parallel: a batch split over worker processes (CPU workers here) returns what one net.run
returns, bit for bit and in order; a row that fails is named with its inputs."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

import luisaml
from luisaml import parallel
from util import export_batched, graph_model, torch_mlp

I64 = np.int64


@pytest.fixture(scope="module")
def mlp_lml(tmp_path_factory):
    """(the .lml of a batched MLP 3 -> 64 -> 64 -> 4, the compiled network, the torch module)."""
    d = tmp_path_factory.mktemp("parallel")
    module = torch_mlp([3, 64, 64, 4])
    net = luisaml.compile(export_batched(module, 3, d / "mlp.onnx"))
    return str(net.save(d / "mlp.lml")), net, module


def test_two_cpu_workers_equal_one_run_bit_for_bit_in_order(mlp_lml):
    """10,001 rows in chunks of 1,000 over two worker processes: every row equals the single process's
    net.run (bit for bit, so in order), and torch's within float32 rounding."""
    import torch

    path, net, module = mlp_lml
    x = np.random.default_rng(1).standard_normal((10_001, 3)).astype(np.float32)
    want = net.run({"x": x})["y"]
    with parallel.Pool(path, devices=2, chunk=1_000) as pool:
        assert pool.devices == ["cpu:0", "cpu:1"]
        got = pool.run({"x": x})
        again = pool.run({"x": x[::-1].copy()})["y"]  # a second batch on the same workers
    assert list(got) == ["y"] and got["y"].dtype == np.float32 and got["y"].shape == (10_001, 4)
    np.testing.assert_array_equal(got["y"], want)
    np.testing.assert_array_equal(again, want[::-1])
    with torch.no_grad():
        np.testing.assert_allclose(got["y"], module(torch.from_numpy(x)).numpy(), rtol=1e-5, atol=1e-5)


def test_a_failing_row_a_bad_input_and_a_dead_worker_are_named(tmp_path):
    """A run-time index out of range in row 37 of 100 (one chunk of 50 holds it): the error is the
    network's own RunError naming the node, the row and the input's value there; a bad dtype is named
    by input before any row runs; the pool runs on after both. A worker killed between runs: the next
    run's error names its device, exit code and rows, and the pool is closed (not hung)."""
    import os
    import signal

    nodes = [helper.make_node("GatherElements", ["x", "i"], ["y"], axis=1, name="pick")]
    x = np.arange(400, dtype=np.float32).reshape(100, 4)
    i = (np.arange(100, dtype=I64) % 4).reshape(100, 1)
    model = graph_model(nodes, {"x": x, "i": i}, opset=13, batch="B")
    path = str(luisaml.compile(model).save(tmp_path / "pick.lml"))
    bad = i.copy()
    bad[37] = 9
    with parallel.Pool(path, devices=2, chunk=50) as pool:
        np.testing.assert_array_equal(pool.run({"x": x, "i": i})["y"], np.take_along_axis(x, i, axis=1))
        with pytest.raises(luisaml.RunError, match=r"rows \[0, 50\): row 37 of the batch \('x' = \[148\.0, 149\.0, "
                                                   r"150\.0, 151\.0\], 'i' = \[9\]\): .*'pick'"):
            pool.run({"x": x, "i": bad})
        with pytest.raises(luisaml.InputError, match=r"input 'i': expected dtype int64, got int32"):
            pool.run({"x": x, "i": i.astype(np.int32)})
        with pytest.raises(luisaml.errors.InputNameError, match=r"the network's inputs are \['x', 'i'\]"):
            pool.run({"x": x})
        np.testing.assert_array_equal(pool.run({"x": x[:3], "i": i[:3]})["y"], np.take_along_axis(x[:3], i[:3], axis=1))
        victim = pool.workers[1].process
        os.kill(victim.pid, signal.SIGKILL)  # (a process this test started, through the pool)
        victim.join(10)
        with pytest.raises(luisaml.RunError, match=r"the worker on cpu:1 died \(exit code -9\) running rows \[\d+, \d+\)"):
            pool.run({"x": x, "i": i})
        with pytest.raises(luisaml.UsageError, match="closed"):
            pool.run({"x": x, "i": i})


def test_devices_on_the_cpu_backend_are_a_count_of_workers(mlp_lml):
    """The CPU backend is one device: a count of processes splits its cores; a list is refused."""
    path, _, _ = mlp_lml
    with pytest.raises(luisaml.UsageError, match=r"the CPU backend is one device; give the count"):
        parallel.run(path, {"x": np.zeros((4, 3), np.float32)}, devices=[0, 1])
    with pytest.raises(luisaml.UsageError, match=r"chunk=0"):
        parallel.Pool(path, devices=1, chunk=0)


def test_a_network_that_mixes_its_batch_is_refused_by_name():
    """A mean over the batch cannot be cut into runs: ports() says why, naming the node's reason."""
    x = np.ones((3, 4), np.float32)
    nodes = [helper.make_node("ReduceMean", ["x", "axes"], ["m"], keepdims=1), helper.make_node("Sub", ["x", "m"], ["y"])]
    net = luisaml.compile(graph_model(nodes, {"x": x}, {"axes": np.array([0], I64)}, batch="B"))
    assert isinstance(net, luisaml.PerBatchNetwork)
    with pytest.raises(luisaml.UsageError, match=r"cannot be split by rows of its batch: .*ReduceMean.*mixes samples"):
        parallel.ports(net)


def test_max_rows_is_what_check_batch_allows(mlp_lml):
    """The largest run the network's buffers allow under 32-bit indexing passes check_batch; one more
    row does not (or the host's free memory bounds it first)."""
    _, net, _ = mlp_lml
    n = parallel.max_rows(net)
    net.check_batch(n)
    if n < luisaml.limits.INDEX_LIMIT // 64:  # (bounded by free memory: check_batch still passes above)
        return
    with pytest.raises(luisaml.LimitError):
        net.check_batch(n + 1)

