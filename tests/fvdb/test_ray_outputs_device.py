"""Run-time sized outputs (fVDB's rays) returned as torch tensors: with torch CUDA tensors in, `net.run`
returns torch CUDA tensors written in place through DLPack (luisaml/zero_copy.py), a fresh
tensor for each run-time sized output (allocated at its capacity, returned as the view of its rows),
and no host copy of the data (the run's end, which reads the totals back, is its one round trip).

On the CPU backend: torch CPU tensors in give torch tensors equal to the numpy path; the shared path
itself runs here too with the CPU backend mapped to torch's CPU tensors (`zero_copy.SHARED_DEVICES`, what the
CUDA backend does with CUDA tensors), checking its values, that no output is downloaded (one download a run:
the state words, the totals among them; one host synchronisation), and that two runs of different row counts
never share an output's memory. The CUDA tests skip without a GPU."""
from __future__ import annotations

import numpy as np
import pytest

import luisaml
from luisaml import counts, zero_copy
from luisaml.fvdb import GridBatch, JaggedTensor

from fvdb_reference import bundle_feeds, fvdb_model, ray_node

torch = pytest.importorskip("torch")

SEGMENT_OUTS = ["segments", "seg_joffsets", "seg_jidx", "seg_jlidx"]
VOXEL_OUTS = ["voxels", "times", "vox_joffsets", "vox_jidx", "vox_jlidx"]


@pytest.fixture(scope="module")
def case():
    """A shell grid; three sets of 64 rays: a few hits, more hits, none; the network of both ray ops."""
    rng = np.random.default_rng(3)
    p = rng.normal(size=(20000, 3))  # a closed shell of radius 10 voxels around (20, 20, 20)
    shell = np.round(p / np.linalg.norm(p, axis=1, keepdims=True) * 10).astype(np.int32) + 20
    gb = GridBatch.from_ijk([shell], voxel_sizes=[[0.5, 0.5, 0.5]], origins=[[0.0, 0.0, 0.0]])
    n = 64
    origins = np.tile(np.array([[10.0, 10.0, -10.0]], np.float32), (n, 1))  # world space: voxel (20, 20, -20)
    aim = np.stack([rng.uniform(-4, 4, n), rng.uniform(-4, 4, n), np.zeros(n)], 1)
    wide = (aim * 3 + [0.0, 0.0, 20.0]).astype(np.float32)  # most of them pass the shell by
    near = (aim * 0.3 + [0.0, 0.0, 20.0]).astype(np.float32)  # near the axis: in and out of the shell
    miss = np.tile(np.array([[1.0, 0.0, 0.0]], np.float32), (n, 1))  # away from the grid: no rows
    feeds = [bundle_feeds(gb, ray_origins=JaggedTensor.from_list([origins]), ray_directions=JaggedTensor.from_list([d]))
             for d in (wide, near, miss)]
    nodes = [ray_node("SegmentsAlongRays", SEGMENT_OUTS, eps=1e-3), ray_node("VoxelsAlongRays", VOXEL_OUTS, eps=1e-3)]
    net = luisaml.compile(fvdb_model(nodes, feeds[0]))
    return net, feeds


def _torch(feeds, device="cpu"):
    return {k: torch.from_numpy(np.array(v)).to(device) for k, v in feeds.items()}


def _assert_same(got: dict, want: dict):
    assert list(got) == list(want)
    for k, w in want.items():
        g = got[k]
        assert isinstance(g, torch.Tensor), k
        assert g.dtype == torch.from_numpy(np.asarray(w)).dtype and tuple(g.shape) == w.shape, k
        np.testing.assert_array_equal(g.cpu().numpy(), w, err_msg=k)


def _span(t) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def test_rows_differ_between_the_feeds(case):
    net, feeds = case
    rows = [int(net.run(f)["seg_joffsets"][-1]) for f in feeds]
    assert 0 < rows[0] < rows[1] and rows[2] == 0, rows


def test_torch_cpu_tensors_give_torch_tensors_equal_to_numpy(case):
    net, feeds = case
    first = net.run(_torch(feeds[0]))
    keep = {k: v.clone() for k, v in first.items()}
    _assert_same(first, net.run(feeds[0]))
    second = net.run(_torch(feeds[1]))
    _assert_same(second, net.run(feeds[1]))
    _assert_same(first, {k: v.numpy() for k, v in keep.items()})  # a later run changed nothing of the first's


@pytest.fixture
def shared_on_cpu(monkeypatch, case):
    """The DLPack path on the CPU backend: its kernels read and write torch's CPU tensors in place. Counts
    the runs that take it."""
    net, _ = case
    if net.backend != "cpu":
        pytest.skip("maps the CPU backend's buffers onto torch CPU tensors")
    monkeypatch.setattr(zero_copy, "SHARED_DEVICES", {"cuda": "cuda", "cpu": "cpu"})
    calls = {"dlpack": 0}
    run_dlpack = zero_copy.run

    def counted(*a, **k):
        calls["dlpack"] += 1
        return run_dlpack(*a, **k)

    monkeypatch.setattr(zero_copy, "run", counted)
    return calls


def test_shared_path_equals_numpy_and_downloads_nothing_but_the_totals(case, shared_on_cpu):
    net, feeds = case
    want = [net.run(f) for f in feeds]  # numpy in: the host path
    calls = shared_on_cpu
    calls.update(dlpack=0)
    assert all(rb.counted for rb in net.plan.readbacks) and len(net.plan.readbacks) == 2
    for f, w in zip(feeds, want):
        with counts.measure() as c:
            got = net.run(_torch(f))
        _assert_same(got, w)
        # the two ray nodes' totals stay on the device: read with the flag in one download at the end
        assert c.downloads == 1, "an output was downloaded through the host"
        assert c.syncs == 1


def test_shared_path_outputs_are_fresh_tensors_never_aliased_across_runs(case, shared_on_cpu):
    net, feeds = case
    first = net.run(_torch(feeds[0]))
    keep = {k: v.clone() for k, v in first.items()}
    second = net.run(_torch(feeds[1]))  # more rows: a capacity buffer would have been reused or regrown
    third = net.run(_torch(feeds[0]))  # as many rows as the first run: the same size, still its own memory
    for k in first:
        torch.testing.assert_close(first[k], keep[k], rtol=0, atol=0)
        torch.testing.assert_close(third[k], keep[k], rtol=0, atol=0)
        spans = [_span(r[k]) for r in (first, second, third) if r[k].numel()]
        for i, (a0, a1) in enumerate(spans):
            for b0, b1 in spans[i + 1:]:
                assert a1 <= b0 or b1 <= a0, f"{k}: two runs share output memory"
    assert int(second["seg_joffsets"][-1]) > int(first["seg_joffsets"][-1])
    io = {s.ident for s in net.outputs}
    # the host runs above made the network's own output buffers; the shared runs never grew them
    sizes = {k: v.size for k, v in net.pool.held.items() if k[0] in io}
    net.run(_torch(feeds[1]))
    assert {k: v.size for k, v in net.pool.held.items() if k[0] in io} == sizes


def test_shared_path_reads_the_grid_on_the_host_once_and_again_when_it_changes(case, shared_on_cpu, monkeypatch):
    net, feeds = case
    copied = []
    to_numpy = zero_copy.to_numpy
    def counted(x, name):
        if isinstance(x, torch.Tensor):  # (run() on numpy feeds passes arrays)
            copied.append(name)
        return to_numpy(x, name)

    monkeypatch.setattr(zero_copy, "to_numpy", counted)
    tf = _torch(feeds[1])
    net.run(tf)
    copied.clear()
    _assert_same(net.run(_torch(feeds[1])), net.run(feeds[1]))  # other tensors, the same contents
    assert copied == [], "an unchanged grid was copied to the host again"
    moved = dict(feeds[1], origins=feeds[1]["origins"] + 0.25)  # the grid moved: other metadata
    with torch.no_grad():
        tf["origins"] += 0.25  # in place: the same tensor, new contents
    got, want = net.run(tf), net.run(moved)
    assert "origins" in copied
    _assert_same(got, want)
    assert not np.array_equal(want["segments"], net.run(feeds[1])["segments"])  # the change mattered


def test_shared_path_with_no_rows(case, shared_on_cpu):
    net, feeds = case
    out = net.run(_torch(feeds[2]))
    assert out["segments"].shape == (0, 2) and out["voxels"].shape == (0, 3) and out["times"].shape == (0, 2)
    _assert_same(out, net.run(feeds[2]))


def test_torch_function_eager_on_cpu_tensors(case):
    from luisaml.fvdb import torch_ops as F

    net, feeds = case
    from luisaml.opsets.fvdb import BUNDLE, JAGGED

    f = _torch(feeds[1])
    bundle = [f[k] for k in BUNDLE]
    o = [f[f"ray_origins_{p}"] for p in JAGGED]
    d = [f[f"ray_directions_{p}"] for p in JAGGED]
    got = F.segments_along_rays(bundle, o, d, eps=1e-3)
    want = net.run(feeds[1])
    for g, name in zip(got, SEGMENT_OUTS):
        assert isinstance(g, torch.Tensor) and g.device.type == "cpu"
        np.testing.assert_array_equal(g.numpy(), want[name], err_msg=name)


# ---- CUDA ----------------------------------------------------------------------------------------


def _cuda():
    import os

    from luisaml import device

    if os.environ.get("LUISAML_BACKEND") != "cuda" or device.cuda_device_count() == 0 or not torch.cuda.is_available():
        pytest.skip("needs a CUDA device and LUISAML_BACKEND=cuda (one LuisaCompute backend per process)")


def _on_torch_device_memory(t) -> bool:
    """True when t's memory lies in a segment torch's CUDA caching allocator holds (device memory)."""
    lo, hi = _span(t)
    for seg in torch.cuda.memory_snapshot():
        if seg["address"] <= lo and hi <= seg["address"] + seg["total_size"]:
            return True
    return False


@pytest.mark.gpu
def test_cuda_tensors_in_give_cuda_tensors_out(case, monkeypatch):
    _cuda()
    net, feeds = case
    results = []
    for f in feeds:
        want = net.run(f)
        with counts.measure() as c:
            got = net.run(_torch(f, "cuda"))
        assert c.downloads == 1, "an output was downloaded through the host"  # (the state words: the totals)
        for k, g in got.items():
            assert g.is_cuda, k
            if g.numel():
                assert _on_torch_device_memory(g), f"{k}: not in torch's device memory"
        _assert_same(got, want)
        results.append((got, {k: v.clone() for k, v in got.items()}))
    for got, kept in results:  # later runs overwrote nothing of an earlier one's outputs
        for k in got:
            assert torch.equal(got[k], kept[k]), k


@pytest.mark.gpu
def test_cuda_torch_function_eager_stays_on_the_device(case):
    _cuda()
    from luisaml.fvdb import torch_ops as F
    from luisaml.opsets.fvdb import BUNDLE, JAGGED

    net, feeds = case
    f = _torch(feeds[1], "cuda")
    got = F.voxels_along_rays([f[k] for k in BUNDLE], [f[f"ray_origins_{p}"] for p in JAGGED],
                              [f[f"ray_directions_{p}"] for p in JAGGED], eps=1e-3)
    want = net.run(feeds[1])
    for g, name in zip(got, VOXEL_OUTS):
        assert g.is_cuda, name
        np.testing.assert_array_equal(g.cpu().numpy(), want[name], err_msg=name)
