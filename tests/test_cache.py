"""luisaml/cache.py and luisaml/bitcode.py: the fallback folder, damaged and evicted generated
modules, info/clear, and LuisaCompute's kernel cache (writability, free space, truncated bitcode found and removed).
Every test works on temporary folders; the real kernel cache is only read."""
import inspect
import logging
import os
import shutil
import stat
import struct
import subprocess
import sys
import time

from pathlib import Path

import numpy as np
import pytest

import luisaml
from luisaml import bitcode, cache


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A process state that has resolved no cache root yet, with the fallback under tmp_path."""
    monkeypatch.setattr(cache, "_roots", {})
    monkeypatch.setattr(cache, "_written", {})
    monkeypatch.setattr(cache, "fallback_root", lambda: tmp_path / "fallback")
    return tmp_path


def _unwritable(tmp_path, how: str):
    if how == "chmod":
        if os.geteuid() == 0:
            pytest.skip("root writes through chmod 0o500: the path under a regular file stands in for it")
        d = tmp_path / "ro"
        d.mkdir()
        d.chmod(stat.S_IRUSR | stat.S_IXUSR)
        return d / "luisaml"
    return "/dev/null/luisaml"  # mkdir fails (ENOTDIR) for every user, root included


# ---- luisaml's own folders -------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["chmod", "under-a-file"])
def test_unwritable_folder_falls_back_once(fresh, caplog, how):
    bad = _unwritable(fresh, how)
    caplog.set_level(logging.WARNING, logger="luisaml")
    path = cache.write_module("x = 1\n", bad)
    assert path.parent == fresh / "fallback" / "generated" and path.read_text() == "x = 1\n"
    assert cache.cache_dir(bad) == fresh / "fallback" / "generated"
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and f"'{bad}' cannot be written" in warnings[0] and str(fresh / "fallback") in warnings[0]
    assert stat.S_IMODE((fresh / "fallback").stat().st_mode) == 0o700  # luisaml imports what it finds there


def test_no_writable_folder_is_a_clear_error(fresh, monkeypatch):
    monkeypatch.setattr(cache, "fallback_root", lambda: cache.Path("/dev/null/fallback"))
    with pytest.raises(luisaml.LuisamlError, match="'/dev/null/a' cannot be written .*nor can the fallback "
                                                   "'/dev/null/fallback'.*LUISAML_CACHE"):
        cache.cache_dir("/dev/null/a")


def test_fallback_others_can_write_is_refused(fresh):
    (fresh / "fallback").mkdir(mode=0o777)
    os.chmod(fresh / "fallback", 0o777)
    with pytest.raises(cache.CacheError, match="writable by other users"):
        cache.cache_dir("/dev/null/a")


def test_env_var_read_at_import_and_fallback_in_a_subprocess(tmp_path):
    code = ("import logging; logging.basicConfig(format='%(name)s %(levelname)s %(message)s'); "
            "from luisaml import cache; print(cache.write_module('y = 2\\n')); print(cache.MAX_BYTES)")
    env = dict(os.environ, LUISAML_CACHE="/dev/null/x", LUISAML_CACHE_MAX_MB="1.5", TMPDIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    path, bound = r.stdout.split()
    assert path.startswith(str(tmp_path / f"luisaml-{os.getuid()}" / "generated")) and int(bound) == 3 * 2**19
    assert "luisaml WARNING cache folder '/dev/null/x' cannot be written" in r.stderr


def test_bad_max_mb_is_reported_when_needed(fresh, monkeypatch):
    monkeypatch.setattr(cache, "_MAX_ERROR", "LUISAML_CACHE_MAX_MB='lots' is not a number of MiB")
    with pytest.raises(luisaml.UsageError, match="LUISAML_CACHE_MAX_MB='lots'"):
        cache.write_module("z = 3\n", fresh / "c")


def test_damaged_module_is_rewritten(fresh):
    src = "def f():\n    return 'é'\n"
    path = cache.write_module(src, fresh / "c")
    path.write_bytes(b"def f():\n    return '\xff\xfe'\n")  # bad UTF-8, same length
    pyc = path.parent / "__pycache__" / f"{path.stem}.cpython-311.pyc"
    pyc.parent.mkdir()
    pyc.write_bytes(b"stale")
    assert cache.write_module(src, fresh / "c") == path
    assert path.read_bytes() == src.encode() and not pyc.exists()
    assert cache.import_module(path).f() == "é"


def test_import_writes_the_bytecode_the_workers_load_once(fresh, monkeypatch):
    """Importing a generated module writes its .pyc from the code it compiled, also where Python
    writes none (PYTHONDONTWRITEBYTECODE, as on the GPU machine); write_bytecode, which the
    kernel-build workers wait on, then keeps it instead of compiling the module again."""
    import importlib.util

    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    path = cache.write_module("def h(a):\n    return a * 3\n", fresh / "c")
    pyc = Path(importlib.util.cache_from_source(str(path)))
    assert not pyc.exists()
    assert cache.import_module(path).h(2) == 6
    assert pyc.exists()
    before = pyc.stat().st_mtime_ns
    time.sleep(0.01)
    cache.write_bytecode(path)
    assert pyc.stat().st_mtime_ns == before
    out = subprocess.run([sys.executable, "-c", f"import marshal; d = open({str(pyc)!r}, 'rb').read(); "
                          "ns = {}; exec(marshal.loads(d[16:]), ns); print(ns['h'](5))"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "15"


def test_imported_module_survives_eviction(fresh):
    path = cache.write_module("def g(a):\n    return a + 1\n", fresh / "c")
    module = cache.import_module(path)
    path.unlink()  # another process evicted it before luisa-python read the source
    assert inspect.getsource(module.g).startswith("def g(a):")


def _aged(path, age_s):
    t = time.time() - age_s
    os.utime(path, (t, t))


def test_least_recently_used_modules_are_evicted(fresh):
    root = fresh / "c"
    paths = [cache.write_module(f"# module {k}\n" + "x = 0\n" * 1700, root) for k in range(10)]  # ~10 KiB each
    size = paths[0].stat().st_size
    for k, p in enumerate(paths):
        _aged(p, 1000 - 10 * k)  # module 0 is the oldest
    pyc = root / "generated" / "__pycache__" / f"{paths[0].stem}.cpython-311.pyc"
    pyc.parent.mkdir(exist_ok=True)
    pyc.write_bytes(b"0" * 10)
    os.utime(paths[2], (time.time() - 500, paths[2].stat().st_mtime))  # used later than 3..6
    _aged(root / "generated", 0)
    (root / "generated" / ".net_x.py.123.tmp").write_text("half")  # an interrupted write, an hour old
    _aged(root / "generated" / ".net_x.py.123.tmp", 7200)
    (root / "locks" / "old.lock").touch()
    _aged(root / "locks" / "old.lock", 2 * 86400)
    (root / "locks" / "new.lock").touch()
    removed = cache.prune(root, max_bytes=int(5.5 * size))
    # (by name: reading a file would count as a use, its access time being the record)
    left = [k for k, p in enumerate(paths) if p.exists()]
    assert left == [2, 7, 8, 9]  # down to 90% of the bound, least recently used first
    assert not pyc.exists() and removed == 6 + 1 + 2
    assert sorted(p.name for p in (root / "locks").iterdir()) == ["new.lock"]
    # a process's first new module prunes; the module just written, and those used within
    # GRACE_S, stay whatever the bound
    recent = paths[8]
    _aged(recent, 5)
    cache._written.clear()
    new = cache.write_module("# the newest\n", root, max_bytes=1)
    assert sorted(p.name for p in (root / "generated").glob("net_*.py")) == sorted([new.name, recent.name])
    _aged(new, 1000)
    assert cache.prune(root, max_bytes=1, keep=new) == 0 and new.exists()


# ---- info and clear ----------------------------------------------------------------------------------
def test_info_and_clear(fresh, monkeypatch):
    root, kernels = fresh / "c", fresh / "k"
    monkeypatch.setattr(cache, "kernel_cache_dir", lambda: kernels)
    monkeypatch.setattr(cache, "_runtime_cache_dir", lambda: None)
    for k in range(3):
        cache.write_module(f"v = {k}\n", root)
    (cache.locks_dir(root) / "a.lock").touch()
    kernels.mkdir()
    with cache.llvm_paths_lock():  # (its lock file is luisaml's own; taking it checks the folder first)
        pass
    (kernels / "kernel_A.bc").write_bytes(b"1234")
    (kernels / "kernel_A.hash").write_bytes(b"12")
    (kernels / "notes.txt").write_text("not LuisaCompute's")
    (kernels / ".luisaml-checked.json").write_text("{}")  # luisaml's own files there go too
    got = {f.what: (f.path, f.files, f.bytes) for f in cache.info(root)}
    assert got["generated modules"] == (root / "generated", 3, 18)
    assert got["build locks"] == (root / "locks", 1, 0)
    assert got["LuisaCompute kernels"] == (kernels, 4, 8)
    assert "generated modules (fallback)" not in got
    removed = {f.what: (f.files, f.bytes) for f in cache.clear(root, kernels=False)}
    assert removed["generated modules"] == (3, 18) and "LuisaCompute kernels" not in removed
    assert (kernels / "kernel_A.bc").exists() and not list((root / "generated").iterdir())
    removed = {f.what: (f.files, f.bytes) for f in cache.clear(root)}
    assert removed["LuisaCompute kernels"] == (4, 8)
    assert [p.name for p in kernels.iterdir()] == ["notes.txt"]
    assert cache.write_module("v = 0\n", root).exists()  # the folders stay usable


def test_the_default_root_is_the_platforms_user_cache_folder(tmp_path):
    """Without LUISAML_CACHE the root is $XDG_CACHE_HOME/luisaml (the XDG base directory spec)."""
    env = {k: v for k, v in os.environ.items() if k != "LUISAML_CACHE"}
    code = "from luisaml import cache; print(cache.ROOT)"
    for xdg, want in ((str(tmp_path / "xdg"), tmp_path / "xdg" / "luisaml"),
                      (None, Path(os.path.expanduser("~")) / ".cache" / "luisaml")):
        e = dict(env, XDG_CACHE_HOME=xdg) if xdg else {k: v for k, v in env.items() if k != "XDG_CACHE_HOME"}
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=120)
        assert r.returncode == 0, r.stderr
        assert Path(r.stdout.strip()) == want


HOLD = """
import sys, time
from luisaml import cache
with cache.build_lock(sys.argv[2], sys.argv[1]):
    print("held", flush=True)
    time.sleep(float(sys.argv[3]))
"""


def test_build_locks_exclude_other_processes_and_stay_a_bounded_set(fresh):
    root = fresh / "c"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(root), "kernel source", "1.0"], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        same = cache.build_lock("kernel source", root)
        with pytest.raises(luisaml.cache.filelock.Timeout):
            same.acquire(timeout=0.2)  # another process builds the same code
        start = time.perf_counter()
        with same:  # until it is done
            assert time.perf_counter() - start > 0.3
    finally:
        holder.wait(timeout=60)
    assert holder.returncode == 0
    for k in range(500):  # a lock file per kernel used to stay behind for a day
        with cache.build_lock(f"kernel {k}", root):
            pass
    files = sorted(p.name for p in (root / "locks").iterdir())
    assert len(files) <= cache.LOCK_SLOTS and all(n.startswith("build-") for n in files)


def test_clear_removes_everything_luisaml_made(tmp_path):
    """`luisaml cache clear` in a fresh process: nothing of luisaml's cache is left, not a folder or
    a lock file, and a folder of the user's that LUISAML_CACHE names keeps its own files."""
    for own in (None, "notes.txt"):
        root = tmp_path / ("own" if own else "c")
        env = dict(os.environ, LUISAML_CACHE=str(root), LUISAML_BACKEND="cpu")
        make = ("from luisaml import cache, codegen; cache.write_module('v = 1\\n')\n"
                "e = codegen.template_env(); e.get_template(e.list_templates()[0])\n"
                "with cache.build_lock('k'):\n    pass")
        r = subprocess.run([sys.executable, "-c", make], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        if own:
            (root / own).write_text("the user's")
        assert {p.parent.name for p in root.rglob("*") if p.is_file()} >= {"generated", "locks", "templates"}
        r = subprocess.run([sys.executable, "-m", "luisaml", "cache", "clear", "--keep-kernels"], capture_output=True,
                           text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        assert "build locks: removed 1 files" in r.stdout
        assert (sorted(p.name for p in root.rglob("*")) == [own]) if own else not root.exists()



def test_clear_with_kernels_leaves_no_folder_and_removes_the_tensor_core_fronts(tmp_path):
    """`luisaml cache clear` as a user types it (kernels too) in a fresh process: the cache root is
    gone (its folders were made again by the clear itself before), the tensor-core fronts' runtime
    folders with it, and of LuisaCompute's folder only its kernel files and luisaml's. The kernel
    folder is a temporary one standing in for the shared one beside the Python executable."""
    root, kdir = tmp_path / "c", tmp_path / "kernels"
    kdir.mkdir()
    for name in ("kernel_abc.bc", "kernel_abc.hash", ".luisaml-llvm-paths.lock", "data.mdb", "lock.mdb",
                 "someone_elses.txt"):
        (kdir / name).write_text("x")
    env = dict(os.environ, LUISAML_CACHE=str(root), LUISAML_BACKEND="cpu")
    make = ("from luisaml import cache\ncache.write_module('v = 1\\n')\n"
            "with cache.build_lock('k'):\n    pass\n"
            "d = cache.root() / 'tensor-cores' / 'cuda-0123' / '.cache'\nd.mkdir(parents=True)\n"
            "(d / 'data.mdb').write_bytes(b'x')\n(d.parent / 'luisa_nvrtc').write_text('#!')")
    r = subprocess.run([sys.executable, "-c", make], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    clear = ("import sys; from pathlib import Path; from luisaml import cache, cli\n"
             f"cache.kernel_cache_dir = lambda: Path({str(kdir)!r}); cache._runtime_cache_dir = lambda: None\n"
             "sys.exit(cli.main(['cache', 'clear']))")
    r = subprocess.run([sys.executable, "-c", clear], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "tensor-core runtime folders: removed 2 files" in r.stdout
    assert not root.exists(), sorted(map(str, root.rglob("*")))
    assert sorted(p.name for p in kdir.iterdir()) == ["someone_elses.txt"]

# ---- LuisaCompute's kernel cache ---------------------------------------------------------------------
def _real_bitcode() -> list:
    """Kernel files LuisaCompute built in this Python (one tiny network is run to be sure)."""
    net = luisaml.compile(luisaml.loaders.load_proto(_tiny_model()))
    net.run({"x": np.ones((2, 3), np.float32)})
    files = sorted(cache.kernel_cache_dir().glob("kernel_*.bc"), key=lambda p: p.stat().st_size)
    if not files:
        pytest.skip(f"no kernel_*.bc in {cache.kernel_cache_dir()} (a backend that caches elsewhere)")
    return files


def _tiny_model():
    from onnx import TensorProto, helper

    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "tiny",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_every_truncation_of_real_bitcode_is_found(tmp_path):
    files = _real_bitcode()
    src = next((f for f in files if f.stat().st_size > 1000), files[-1])
    data = shutil.copy(src, tmp_path / "k.bc") and (tmp_path / "k.bc").read_bytes()
    assert bitcode.bitcode_problem(tmp_path / "k.bc") is None and bitcode.bitcode_problem(data) is None
    assert all(bitcode.bitcode_problem(data[:n]) for n in range(len(data)))
    # the same module in the wrapper format (magic 0x0B17C0DE, offset, size), padded to 16 bytes
    wrapped = struct.pack("<5I", 0x0B17C0DE, 0, 20, len(data), 7) + data
    wrapped += bytes(-len(wrapped) % 16)
    assert bitcode.bitcode_problem(wrapped) is None
    assert all(bitcode.bitcode_problem(wrapped[:n]) for n in range(20 + len(data)))
    assert bitcode.bitcode_problem(b"") == "empty" and "magic" in bitcode.bitcode_problem(b"not bitcode")


def test_scan_removes_damaged_kernels_and_remembers_good_ones(tmp_path, monkeypatch):
    good = _real_bitcode()[0].read_bytes()
    for name, data in (("good", good), ("cut", good[: len(good) // 2]), ("empty", b""), ("growing", b"BC")):
        (tmp_path / f"kernel_{name}.bc").write_bytes(data)
        (tmp_path / f"kernel_{name}.hash").write_text(name)
    (tmp_path / "kernel_folder.bc").mkdir()  # LuisaCompute aborts on a folder where a kernel belongs
    real_sleep = bitcode.time.sleep

    def writer_meanwhile(s):  # another process is still writing kernel_growing.bc: left alone
        with open(tmp_path / "kernel_growing.bc", "ab") as f:
            f.write(b"\xc0\xde")
        real_sleep(s)

    monkeypatch.setattr(bitcode.time, "sleep", writer_meanwhile)
    assert sorted(bitcode.scan_kernels(tmp_path)) == ["kernel_cut.bc", "kernel_empty.bc", "kernel_folder.bc"]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "kernel_good.bc", "kernel_good.hash", "kernel_growing.bc", "kernel_growing.hash"]
    # the manifest spares the second scan from reading what it found complete
    monkeypatch.setattr(bitcode, "bitcode_problem", lambda d: pytest.fail(f"read {d} again"))
    (tmp_path / "kernel_growing.bc").unlink()
    assert bitcode.scan_kernels(tmp_path) == []


def test_check_kernel_cache(tmp_path, monkeypatch):
    (tmp_path / "kernel_bad.bc").write_bytes(b"BC\xc0\xde\x01")
    _aged(tmp_path / "kernel_bad.bc", 600)
    assert cache.check_kernel_cache(tmp_path) == tmp_path
    assert not (tmp_path / "kernel_bad.bc").exists()
    (tmp_path / "kernel_bad.bc").write_bytes(b"")
    _aged(tmp_path / "kernel_bad.bc", 600)
    cache.check_kernel_cache(tmp_path)  # once per process and folder: not scanned again
    assert (tmp_path / "kernel_bad.bc").exists()
    with pytest.raises(luisaml.BackendUnavailable, match="'/dev/null/.cache' cannot be written.*venv --copies"):
        cache.check_kernel_cache("/dev/null/.cache")
    with pytest.raises(luisaml.BackendUnavailable, match="MiB are free on the disk of .*luisaml cache clear"):
        cache.check_kernel_cache(tmp_path / "other", min_free_bytes=1 << 62)


def test_kernel_files_beyond_the_bound_go_least_recently_used_first(tmp_path):
    """(.ptx: files the bitcode check leaves alone.) LuisaCompute's folder is kept within LUISAML_KERNEL_CACHE_MAX_MB: whole kernels (all files of a
    kernel_<hash>) leave oldest first, down to 90% of the bound; a kernel used in the last ten minutes and
    every file that is not a kernel stay."""
    import os
    import time

    from luisaml import cache

    now = time.time()
    sizes = {}
    for k, age_h in enumerate([5, 4, 3, 2, 1]):  # kernel_0 the least recently used
        for ext, size in ((".ptx", 3000), (".hash", 100)):
            p = tmp_path / f"kernel_{k}{ext}"
            p.write_bytes(b"x" * size)
            os.utime(p, (now - age_h * 3600, now - age_h * 3600))
            sizes[p.name] = size
    fresh = tmp_path / "kernel_new.ptx"
    fresh.write_bytes(b"x" * 3000)  # old-fashioned big, but used just now
    (tmp_path / "other.bin").write_bytes(b"x" * 9000)  # not LuisaCompute's kernel: never touched
    total = sum(sizes.values()) + 3000
    assert cache.prune_kernels(tmp_path, total) == 0  # within the bound: nothing goes
    removed = cache.prune_kernels(tmp_path, 3 * 3100 + 3000)
    left = sorted(p.name for p in tmp_path.iterdir())
    # 18,500 bytes against a bound of 12,300 (goal 11,070): kernel_0, kernel_1 and kernel_2 go, whole
    assert removed == 6
    assert left == ["kernel_3.hash", "kernel_3.ptx", "kernel_4.hash", "kernel_4.ptx", "kernel_new.ptx", "other.bin"]
    # and the bound is applied when the folder is checked before the first build
    cache._checked.discard(tmp_path)
    cache.check_kernel_cache(tmp_path, min_free_bytes=0, max_bytes=3100)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kernel_new.ptx", "other.bin"]


def test_a_damaged_llvm_paths_file_is_removed_and_a_whole_one_kept(tmp_path, caplog):
    """LuisaCompute's CPU backend aborts on an llvm_paths.json that is not whole JSON (a rewrite cut
    short); without one it finds clang and LLVM again."""
    f = tmp_path / "llvm_paths.json"
    whole = '{"clang":"/usr/bin/clang-14","llvm":"/usr/lib/llvm-14/lib/libLLVM.so"}'
    assert cache.llvm_paths_problem(f) is None  # missing: fine
    for text, why in (("", "empty"), (whole[:30], "not whole JSON"), ('{"clang": 3}', "'clang' and 'llvm'")):
        f.write_text(text)
        assert why in cache.llvm_paths_problem(f)
        with caplog.at_level(logging.WARNING, logger="luisaml"):
            cache.repair_llvm_paths(f)
        assert not f.exists() and "damaged" in caplog.text
    f.write_text(whole)
    cache.repair_llvm_paths(f)
    assert f.read_text() == whole


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_an_unwritable_llvm_paths_file_is_a_clear_error(tmp_path):
    f = tmp_path / "llvm_paths.json"
    f.write_text('{"clang":"c","llvm":"l"}')
    f.chmod(0o444)
    with pytest.raises(luisaml.BackendUnavailable, match="rewrites .* cannot be written"):
        cache.repair_llvm_paths(f)


@pytest.mark.parametrize("name, value", [("LUISAML_KERNEL_CACHE_MAX_MB", "inf"), ("LUISAML_KERNEL_CACHE_MAX_MB", "1e400"),
                                         ("LUISAML_KERNEL_CACHE_MAX_MB", "4096MB"), ("LUISAML_CACHE_MAX_MB", "inf"),
                                         ("LUISAML_CACHE_MAX_MB", "-inf")])
def test_a_bound_that_is_no_number_of_mib_is_named_at_first_use(tmp_path, name, value):
    """issue 25: the import works; the first compile says which variable holds what, and what it takes."""
    import subprocess
    import sys

    code = ("import luisaml, numpy as np\n"
            "from onnx import helper, TensorProto\n"
            "g = helper.make_graph([helper.make_node('Relu', ['x'], ['y'])], 'g',"
            " [helper.make_tensor_value_info('x', TensorProto.FLOAT, ['n', 3])],"
            " [helper.make_tensor_value_info('y', TensorProto.FLOAT, ['n', 3])])\n"
            "m = helper.make_model(g, opset_imports=[helper.make_opsetid('', 17)])\n"
            "try:\n    luisaml.compile(m, backend='cpu').run({'x': np.ones((2, 3), np.float32)})\n"
            "except luisaml.UsageError as e:\n    print('UsageError:', e)\n")
    env = dict(os.environ, LUISAML_CACHE=str(tmp_path / "c"), **{name: value})
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert f"UsageError: {name}={value!r}: expected a number of MiB >= 0 with no unit" in r.stdout, r.stdout + r.stderr
