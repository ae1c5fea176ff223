"""What a network's launches keep between runs (luisaml/launch.py KernelLauncher._enqueue,
luisaml/dispatch.py Launcher.rebind and Prepared): the shared arguments' encodings, each stage's prepared
launch and the dispatch counts of the last batch, and the pool's lists of stage and scratch buffers
(luisaml/pool.py). A run at another batch, over other buffers (a zero-copy run's fresh output tensors, a
swapped weight blob) or with other argument types must work them out again: each such run here equals
onnxruntime's answer and a fresh network's bit for bit."""
import numpy as np
import pytest
import torch
from onnx import helper

import luisaml
from luisaml import zero_copy

from util import graph_model, ort_run, rand


def _model():
    w1, w2 = rand((6, 5), seed=1), rand((5, 4), seed=2)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w2"], ["m"], name="mm2"),
             helper.make_node("Tanh", ["m"], ["y"], name="tanh")]
    return graph_model(nodes, {"x": rand((3, 6))}, {"w1": w1, "w2": w2}, batch="N")


@pytest.fixture(scope="module")
def model():
    return _model()


def _check(net, model, x, fresh):
    got = net.run({"x": x})["y"]
    want = ort_run(model, {"x": x})["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert got.tobytes() == fresh.run({"x": x})["y"].tobytes()  # (the same kernels, nothing cached)


def test_a_new_batch_works_out_the_counts_again(model):
    net, fresh = luisaml.compile(model, schedule="stages"), luisaml.compile(model, schedule="stages")
    assert net.plan.schedule is not None and len(net.plan.schedule.stages) > 1
    for n in (2, 5, 2, 1, 7):  # (a smaller batch after a larger one: counts of the stale batch would write past)
        _check(net, model, rand((n, 6), seed=n), fresh)
        assert net.launcher._counts[0] == n
        assert all(p is None or p.count == st.dispatch(n)
                   for p, st in zip(net.launcher._prepared, net.plan.schedule.stages))
        # the pool's kept lists (pool._regions_of) name only buffers it holds: none replaced is kept alive
        held = [id(b) for b in net.pool.held.values()]
        assert all(id(b) in held for kept in net.pool._regions.values() for b in kept)
        assert net.pool.stage_buffers(net.plan, n) == [net.pool.pooled(f"buf_{sl.dtype}_{sl.id}", sl.dtype, sl.size * n)
                                                        for sl in net.plan.schedule.buffers.slots]


def test_other_buffers_are_encoded_again(model, monkeypatch):
    """Zero-copy runs bind a fresh tensor for every output each run: the encodings follow it, the
    prepared launches (the same types) stay."""
    monkeypatch.setattr(zero_copy, "SHARED_DEVICES", {"cuda": "cuda", "cpu": "cpu"})
    net, fresh = luisaml.compile(model, schedule="stages"), luisaml.compile(model, schedule="stages")
    prepared = None
    for n in (3, 3, 4):
        x = rand((n, 6), seed=10 + n)
        got = net.run({"x": torch.from_numpy(x)})["y"]
        assert isinstance(got, torch.Tensor)
        np.testing.assert_allclose(got.numpy(), ort_run(model, {"x": x})["y"], rtol=1e-5, atol=1e-6)
        assert got.numpy().tobytes() == fresh.run({"x": x})["y"].tobytes()
        kept = [p for p in net.launcher._prepared if p is not None]
        if prepared is not None:  # (a rebinding of buffers of the same types prepares nothing again)
            assert [p.function for p in kept] == [p.function for p in prepared]
        prepared = kept


def test_a_zero_copy_input_fed_again_is_read_in_place(model, monkeypatch):
    """The same input tensor fed again keeps its luisa buffer (zero_copy._input_buffer): the run reads
    what the tensor holds now, written in place since; another tensor of the same shape gets its own."""
    monkeypatch.setattr(zero_copy, "SHARED_DEVICES", {"cuda": "cuda", "cpu": "cpu"})
    net = luisaml.compile(model, schedule="stages")
    t = torch.from_numpy(rand((3, 6), seed=20))
    for k in range(3):
        if k:
            t.copy_(torch.from_numpy(rand((3, 6), seed=20 + k)))  # (in place: the same memory)
        got = net.run({"x": t})["y"].numpy()
        np.testing.assert_allclose(got, ort_run(model, {"x": t.numpy()})["y"], rtol=1e-5, atol=1e-6)
    kept = net.bound.shared_inputs["x"][1]
    other = torch.from_numpy(rand((3, 6), seed=30))
    got = net.run({"x": other})["y"].numpy()
    np.testing.assert_allclose(got, ort_run(model, {"x": other.numpy()})["y"], rtol=1e-5, atol=1e-6)
    assert net.bound.shared_inputs["x"][1] is not kept


def test_a_swapped_weight_blob_is_read(model):
    """NetworkInstance-style weights (pool.weights_swapped): the run inside reads the other blob, the
    run after it the network's own again."""
    net, fresh = luisaml.compile(model, schedule="stages"), luisaml.compile(model, schedule="stages")
    x = rand((2, 6), seed=3)
    _check(net, model, x, fresh)
    from luisaml.luisa_compat import byte_buffer

    zeros = byte_buffer(np.zeros(len(net.weight_bytes()), np.uint8))
    with net.pool.weights_swapped(zeros):
        y = net.run({"x": x})["y"]
    assert not y.any()  # (every weight 0: tanh(0 @ ...) is 0)
    _check(net, model, x, fresh)


def test_the_launcher_types_only_what_changed():
    """dispatch.Launcher.rebind: the same objects keep their encodings, another buffer of the same type
    is encoded again without changing the types, another type changes them."""
    luisaml.device.init("auto")
    import luisa

    from luisaml.dispatch import Launcher

    a, b, c = luisa.Buffer(4, int), luisa.Buffer(4, int), luisa.Buffer(4, float)
    launch = Launcher([a, 3])
    first = list(launch.encodings)
    assert launch.rebind([a, 3]) is False and launch.encodings == first
    assert launch.rebind([b, 3]) is False and launch.encodings[0] != first[0] and launch.encodings[1] is first[1]
    assert launch.rebind([b, 4]) is False and launch.encodings[1] != first[1]
    assert launch.rebind([c, 4]) is True
    assert launch.rebind([c, 4, b]) is True and len(launch.encodings) == 3
