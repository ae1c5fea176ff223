"""luisaml/parallel_build.py: worker processes build a generated module's kernels into LuisaCompute's
disk cache before the first launch (on CUDA, for networks of many stage kernels). Here on the CPU
backend, over a module of kernels of its own: the worker exits cleanly, each kernel gains a cached
build, and the kernels then launch and compute what numpy does; a worker that fails is harmless."""
import io
import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

import luisaml
from luisaml import cache, parallel_build

KERNELS = 3


def _module(tmp_path, tag: str) -> str:
    """A generated-style module of KERNELS kernels y = x * (k + tag), unique to this test run."""
    # fresh code, not in the cache yet: one of a million scales (of a thousand, earlier runs had
    # cached some of the kernels of later ones); below 2**24, exact in float32
    scale = int(uuid.uuid4().int % 1_000_000) + 2
    lines = ["import luisa", "from luisa.types import uint  # noqa: F401", ""]
    for k in range(KERNELS):
        lines += ["@luisa.func", f"def k{k}(x, y, n: int):",
                  "    i = int(dispatch_id().x)",
                  "    if i < n:",
                  f"        y.write(i, x.read(i) * {float(k + scale)!r})", ""]
    path = tmp_path / f"pb_{tag}.py"
    path.write_text("\n".join(lines))
    return str(path), scale


def _cached() -> set:
    d = cache.kernel_cache_dir()
    return set(os.listdir(d)) if d.is_dir() else set()


def test_workers_build_the_kernels_the_main_process_then_launches(tmp_path, caplog):
    luisaml.device.init("cpu")
    import luisa

    path, scale = _module(tmp_path, "ok")
    x = np.arange(8, dtype=np.float32)
    bx, by = luisa.Buffer.from_array(x), luisa.Buffer(8, float)
    args = [bx, by, 8]
    assert [parallel_build.describe(a) for a in args] == [["buffer", "float"], ["buffer", "float"], ["int"]]
    before = _cached()
    names = [f"k{k}" for k in range(KERNELS)]
    # one worker: the CPU backend's first writes into a fresh cache are not safe across processes
    # starting together (a worker aborted in 1 of 4 runs with two); CUDA is where workers pay
    module = cache.import_module(Path(path))
    kernels = [getattr(module, name) for name in names]
    built: list = []  # the main process builds the kernels' IR while the worker runs
    with caplog.at_level(logging.DEBUG, logger="luisaml"):
        assert parallel_build.build(path, "cpu", names, args, workers=1,
                                    meanwhile=lambda: built.extend(parallel_build.build_ir(kernels, args))) == 1, caplog.text
    assert len(built) == KERNELS and all(k.compiled_results[key].shader_handle is None for k, key in built)
    assert len(_cached() - before) >= KERNELS  # (other tests may add more, never fewer)
    parallel_build.create_shaders(built)
    for k in range(KERNELS):
        getattr(module, f"k{k}")(*args, dispatch_size=8)
        luisa.synchronize()
        np.testing.assert_array_equal(by.numpy(), x * np.float32(k + scale))


def test_a_worker_that_fails_is_harmless(tmp_path):
    luisaml.device.init("cpu")
    import luisa

    path, _ = _module(tmp_path, "bad")
    args = [luisa.Buffer(1, float), luisa.Buffer(1, float), 1]
    assert parallel_build.build(path, "cpu", ["no_such_kernel"], args, workers=1) == 0
    assert parallel_build.build(str(tmp_path / "missing.py"), "cpu", ["k0"], args, workers=1) == 0


def test_how_many_workers():
    assert parallel_build.workers_for(parallel_build.MIN_KERNELS - 1) == 0
    assert 0 <= parallel_build.workers_for(40) <= parallel_build.MAX_WORKERS
    with pytest.raises(TypeError):
        parallel_build.describe(1.5)


def test_ir_built_ahead_leaves_nothing_half_built_on_an_error(tmp_path):
    """A kernel whose IR fails (here an undeclared name) makes build_ir give up on all of them: every
    kernel is as before, so its launch builds it and reports the error the usual way."""
    luisaml.device.init("cpu")
    import luisa

    path, scale = _module(tmp_path, "ir")
    text = Path(path).read_text() + "\n@luisa.func\ndef broken(x, y, n: int):\n    y.write(0, no_such_name)\n"
    Path(path).write_text(text)
    module = cache.import_module(Path(path))
    x = np.arange(4, dtype=np.float32)
    args = [luisa.Buffer.from_array(x), luisa.Buffer(4, float), 4]
    kernels = [module.k0, module.broken, module.k1]
    assert parallel_build.build_ir(kernels, args) == []
    assert all(not k.compiled_results for k in kernels)
    module.k1(*args, dispatch_size=4)
    luisa.synchronize()
    np.testing.assert_array_equal(args[1].numpy(), x * np.float32(1 + scale))


def test_shares_are_balanced_by_cost():
    shares = parallel_build.shares_of(["a", "b", "c", "d", "e"], [10, 1, 6, 5, 2], 2)
    assert sorted(map(sorted, shares)) == [["a", "e"], ["b", "c", "d"]]  # 12 and 12
    assert parallel_build.shares_of(["a"], [1], 4) == [["a"]]  # no empty share


def test_workers_started_ahead_wait_for_their_shares(tmp_path):
    """Workers are started before the module exists (as compile starts them once the stages are
    known), then sent their shares: two workers, three kernels, every kernel built and right."""
    luisaml.device.init("cpu")
    import luisa

    pool = parallel_build.Workers("cpu", 2)
    path, scale = _module(tmp_path, "ahead")  # (written after the workers started)
    x = np.arange(8, dtype=np.float32)
    args = [luisa.Buffer.from_array(x), luisa.Buffer(8, float), 8]
    names = [f"k{k}" for k in range(KERNELS)]
    before = _cached()
    assert pool.build(path, names, args, costs=[3, 1, 1]) == 2
    assert all(p.returncode == 0 for p in pool.procs)
    import importlib.util  # the workers were handed bytecode to load, not the source to compile

    assert Path(importlib.util.cache_from_source(path)).is_file()
    assert len(_cached() - before) >= KERNELS
    module = cache.import_module(Path(path))
    for k in range(KERNELS):
        getattr(module, f"k{k}")(*args, dispatch_size=8)
        luisa.synchronize()
        np.testing.assert_array_equal(args[1].numpy(), x * np.float32(k + scale))


def test_workers_never_sent_a_share_exit_when_dismissed():
    luisaml.device.init("cpu")
    pool = parallel_build.Workers("cpu", 2)
    procs = list(pool.procs)
    pool.close()
    assert [p.returncode for p in procs] == [0, 0]
    pool.close()  # (idempotent)


def test_compile_starts_no_workers_on_the_cpu_backend():
    from luisaml import runtime

    ahead = runtime._WorkersAhead("cpu")
    ahead(None)
    assert ahead.workers is None


def test_a_worker_never_sent_a_share_exits_on_its_own():
    """A network compiled and never run must not keep device contexts: a worker that waits past its
    idle time exits by itself, without close()."""
    import time

    luisaml.device.init("cpu")
    pool = parallel_build.Workers("cpu", 1, idle_s=0.5)
    t = time.monotonic()
    assert pool.procs[0].wait(timeout=120) == 0
    assert time.monotonic() - t < 60
    pool.close()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("terminal", [True, False])
def test_a_build_shows_the_kernels_built_on_a_terminal_only(tmp_path, monkeypatch, terminal):
    """The workers' kernels counted in a progress bar on stderr, once the build has run
    PROGRESS_AFTER_S (0 here; a worker's start alone takes longer than the default second); where
    stderr is not a terminal (a log file, CI), nothing."""
    luisaml.device.init("cpu")
    import luisa

    path, _ = _module(tmp_path, f"bar{int(terminal)}")
    args = [luisa.Buffer(8, float), luisa.Buffer(8, float), 8]
    err = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(parallel_build, "PROGRESS_AFTER_S", 0.0)
    assert parallel_build.build(path, "cpu", [f"k{k}" for k in range(KERNELS)], args, workers=1) == 1
    if terminal:
        assert "luisaml: building kernels" in err.getvalue()
        assert f"{KERNELS}/{KERNELS}" in err.getvalue()  # every kernel the worker built, counted
    else:
        assert err.getvalue() == ""


_FIRST_RUN = """
import sys
import numpy as np
import luisaml
from luisaml import parallel_build
parallel_build.PROGRESS_AFTER_S = 0.0
net = luisaml.compile(sys.argv[1], backend="cpu")
y = net.run({"x": np.full((2, 5), -1.5, np.float32)})["y"]
print("ran", y.tolist(), file=sys.stderr)
"""


@pytest.mark.parametrize("terminal", [True, False])
def test_a_build_in_the_main_process_gets_a_bar_drawn_by_a_child_on_a_terminal_only(tmp_path, terminal):
    """The CPU backend's merged kernel builds in the main process, whose native build holds the GIL:
    its bar is drawn by a child process (parallel_build.outside_bar) on the terminal the run's stderr
    is (a pseudo-terminal here), and counts the kernel; on a pipe nothing is drawn and no child starts."""
    import fcntl
    import pty
    import struct
    import termios

    import onnx
    from onnx import TensorProto, helper

    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 5])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 5])])
    path = tmp_path / "relu.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    env = dict(os.environ, LUISAML_BACKEND="cpu")
    if not terminal:
        r = subprocess.run([sys.executable, "-c", _FIRST_RUN, str(path)], capture_output=True, text=True, env=env,
                           timeout=300)
        assert r.returncode == 0 and "ran [[0.0" in r.stderr, r.stderr
        assert "building kernels" not in r.stderr
        return
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # (tqdm draws nothing in 0 columns)
    p = subprocess.Popen([sys.executable, "-c", _FIRST_RUN, str(path)], stderr=slave, stdout=subprocess.DEVNULL,
                         env=env)
    os.close(slave)
    said = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # (EIO: every writer of the terminal has closed it)
            break
        if not chunk:
            break
        said += chunk
    os.close(master)
    assert p.wait(timeout=300) == 0, said
    text = said.decode(errors="replace")
    assert "ran [[0.0" in text
    assert "luisaml: building kernels" in text and "1/1" in text, text


@pytest.mark.parametrize("front", [None, Path("/front")])
def test_workers_start_their_device_where_this_process_did(monkeypatch, front):
    """A process whose CUDA device runs in the tensor-core front's runtime directory starts its
    kernel-build workers there too (else their builds of a marked mma callable are its FP32 body, and
    cached so: compile(tensor_cores="auto") on the zoo's transformers ran FP32 arithmetic, slower)."""
    from luisaml import tensor_cores

    monkeypatch.setattr(tensor_cores, "_started_in", [front])
    started = []

    class Proc:
        def __init__(self, argv, **kw):
            started.append(argv)

        def poll(self):
            return 0

    monkeypatch.setattr(parallel_build.subprocess, "Popen", Proc)
    parallel_build.Workers("cuda", 2)
    assert len(started) == 2
    for argv in started:
        assert argv[2:5] == ["luisaml.parallel_build", "--serve", "cuda"]
        assert ("--tensor-cores" in argv) == (front is not None)
    # and the worker's own command line takes the flag (anything else is refused with the usage)
    assert parallel_build.main(["--serve", "cpu", "0.1", "--bogus"]) == 2
