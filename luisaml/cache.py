"""luisaml's on-disk caches: the content-hashed folder of generated modules (bounded, least
recently used first out), its inter-process locks (a bounded set of files, through filelock) and
template folders, the per-user fallback when that folder is not writable, and the health of
LuisaCompute's kernel cache (checked once per process before the first kernel build).

Environment, read once when this module is imported:
  LUISAML_CACHE         the cache root (default: the platform's user cache folder from platformdirs,
                        on Linux $XDG_CACHE_HOME/luisaml, else ~/.cache/luisaml); it holds
                        generated/, locks/ and templates/
  LUISAML_CACHE_MAX_MB  the bound on generated/ in MiB (default 512): beyond it the least recently
                        used modules are removed
  LUISAML_KERNEL_CACHE_MAX_MB  the bound on LuisaCompute's kernel files in MiB (default 4096), applied
                        once per process before the first kernel build, least recently used first
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib.util
import json
import linecache
import os
import shutil
import struct
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import filelock
import platformdirs

from .bitcode import MANIFEST as _MANIFEST
from .bitcode import scan_kernels
from .errors import BackendUnavailable, CacheError, UsageError
from .log import logger

ROOT = Path(os.environ.get("LUISAML_CACHE") or platformdirs.user_cache_dir("luisaml", appauthor=False))


def _mib_setting(name: str, default: str) -> tuple[int | None, str | None]:
    """Return (bytes, None) for the environment variable `name` in MiB (default `default`), or
    (None, why) naming the variable and what it takes: a finite number >= 0 with no unit (it is
    reported when the bound is first needed, not as an import error of luisaml)."""
    text = os.environ.get(name, default)
    try:
        mib = float(text)
    except ValueError:
        mib = None
    if mib is None or not (0 <= mib < 2**44):  # (inf, nan, 1e400 and negative numbers too)
        return None, (f"{name}={text!r}: expected a number of MiB >= 0 with no unit (e.g. {name}={default}); "
                      "unset it for the default")
    return int(mib * 2**20), None


MAX_BYTES, _MAX_ERROR = _mib_setting("LUISAML_CACHE_MAX_MB", "512")
KERNEL_MAX_BYTES, _KERNEL_MAX_ERROR = _mib_setting("LUISAML_KERNEL_CACHE_MAX_MB", "4096")
MAX_ENTRIES = 20_000  # generated modules kept at most, whatever their size (a folder stays listable)
# a module used this recently is never evicted: another process may be between writing and importing it
GRACE_S = 60.0
# LuisaCompute aborts the process when it cannot write a kernel; refuse to start below this much space
MIN_FREE_BYTES = 64 * 2**20


# ---- luisaml's own folders ------------------------------------------------------------------
_roots: dict[Path, Path] = {}  # configured root -> the root in use (itself, or the fallback)
_roots_lock = threading.Lock()


def fallback_root() -> Path:
    """Return the per-user folder used when the configured cache root is not writable."""
    return Path(tempfile.gettempdir()) / f"luisaml-{os.getuid()}"


def root(path: str | os.PathLike | None = None) -> Path:
    """Return the writable cache root: `path` (default ROOT), else the per-user fallback folder
    (said once through the logger); raise CacheError naming both when neither can be written."""
    want = Path(path) if path is not None else ROOT
    got = _roots.get(want)
    if got is not None:
        return got
    with _roots_lock:
        if want not in _roots:
            try:
                _probe(want, private=False)
                _roots[want] = want
            except OSError as e:
                _roots[want] = _fall_back(want, e)
        return _roots[want]


def _fall_back(want: Path, why: OSError) -> Path:
    alt = fallback_root()
    try:
        _probe(alt, private=True)
    except OSError as e2:
        raise CacheError(
            f"luisaml's cache folder '{want}' cannot be written ({_reason(why)}), nor can the fallback "
            f"'{alt}' ({_reason(e2)}); set LUISAML_CACHE to a writable folder"
        ) from e2
    logger.warning("cache folder '%s' cannot be written (%s); using '%s' instead (set LUISAML_CACHE to choose)",
                   want, _reason(why), alt)
    return alt


def _reason(e: OSError) -> str:
    return e.strerror or str(e)


def _probe(path: Path, private: bool) -> None:
    """Create the root with its folders and write a byte into it; raise OSError if that fails. A
    private root (the fallback in the shared temp folder) must be ours and closed to others, since
    luisaml imports the code it finds there."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700 if private else 0o777)
    for sub in ("generated", "locks", "templates"):
        (path / sub).mkdir(exist_ok=True)
    if private:
        st = path.stat()
        if st.st_uid != os.getuid():
            raise PermissionError(errno.EPERM, f"owned by uid {st.st_uid}, not by this user")
        if st.st_mode & 0o022:
            raise PermissionError(errno.EPERM, "writable by other users")
    _write_probe(path / "generated", ".probe-")


def _write_probe(folder: Path, prefix: str) -> None:
    """Write a byte to a new file in `folder` and remove it; raise OSError if that fails."""
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=prefix)
    try:
        os.write(fd, b"x")
    finally:
        os.close(fd)
        os.unlink(tmp)


def cache_dir(path: str | os.PathLike | None = None) -> Path:
    """Return the folder generated modules are written to (LUISAML_CACHE overrides the root)."""
    return root(path) / "generated"


def locks_dir(path: str | os.PathLike | None = None) -> Path:
    """Return the folder of the inter-process kernel-build locks."""
    return root(path) / "locks"


# a kernel build locks one of this many files, picked by its code's hash: two processes building
# the same kernel wait for each other, different kernels rarely do, and locks/ never holds more
# files than this (a lock file per kernel was never removed: it may be held)
LOCK_SLOTS = 64


def build_lock(code: str, path: str | os.PathLike | None = None) -> filelock.FileLock:
    """Return the inter-process lock held while the kernels of `code` are built (LuisaCompute's CPU
    backend writes its cached kernels non-atomically, and a process reading a half-written one
    aborts): one of LOCK_SLOTS files in locks/, the same for the same code."""
    folder = locks_dir(path)
    folder.mkdir(parents=True, exist_ok=True)  # (cleared under a running process: made again)
    return filelock.FileLock(folder / f"build-{int(digest(code), 16) % LOCK_SLOTS:02d}.lock")


def templates_dir(path: str | os.PathLike | None = None) -> Path:
    """Return the folder of jinja2's compiled templates."""
    return root(path) / "templates"


def digest(source: str) -> str:
    """Return the content hash that names a generated module."""
    return hashlib.sha256(source.encode()).hexdigest()[:20]


def write_module(source: str, path: str | os.PathLike | None = None, *, max_bytes: int | None = None) -> Path:
    """Write source to a file named by its content hash (atomically, unless an identical file is
    there) and return the path; a new file may evict the least recently used ones (`prune`)."""
    if max_bytes is None and _MAX_ERROR:  # every compile writes or finds its module: named at the first
        raise UsageError(_MAX_ERROR)
    data = source.encode()
    want = Path(path) if path is not None else ROOT
    try:
        return _write_module(data, cache_dir(path), max_bytes)
    except CacheError:
        raise
    except FileNotFoundError:  # the folder was removed under a running process: make it again
        cache_dir(path).mkdir(parents=True, exist_ok=True)
        return _write_module(data, cache_dir(path), max_bytes)
    except OSError as e:  # writable when probed, then a full disk or a revoked permission
        with _roots_lock:
            if _roots.get(want) == fallback_root():
                raise CacheError(f"cannot write a generated module to '{fallback_root()}': {_reason(e)}") from e
            _roots[want] = _fall_back(want, e)
        return _write_module(data, cache_dir(path), max_bytes)


def find_module(source: str, path: str | os.PathLike | None = None) -> Path | None:
    """Return the cached file holding exactly `source` (its use recorded), or None. A module gets
    into the cache only after safe_source.check_source passed it (compile() and luisaml.load check
    before they write), so the caller may import the file without parsing it again: the cache
    folder is as trusted as luisaml, which imports what it finds there."""
    data = source.encode()
    out = cache_dir(path) / _module_name(data)
    try:
        same = out.stat().st_size == len(data) and out.read_bytes() == data
    except OSError:
        return None
    if same:
        _mark_used(out)
        return out
    return None


def _module_name(data: bytes) -> str:
    return f"net_{hashlib.sha256(data).hexdigest()[:20]}.py"


def _write_module(data: bytes, folder: Path, max_bytes: int | None) -> Path:
    out = folder / _module_name(data)
    try:
        # bytes, not text: a damaged file (bad UTF-8 included) is simply rewritten
        same = out.stat().st_size == len(data) and out.read_bytes() == data
    except FileNotFoundError:
        same = False
    if same:
        _mark_used(out)
        return out
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    for pyc in _pycs(out):  # compiled from the damaged file: same name, maybe the same mtime
        pyc.unlink(missing_ok=True)
    _maybe_prune(folder.parent, len(data), max_bytes, out)
    return out


# root -> (bytes, modules) this process wrote there since it last pruned it
_written: dict[Path, tuple[int, int]] = {}


def _maybe_prune(r: Path, n: int, max_bytes: int | None, keep: Path) -> None:
    """Prune on a process's first new module and after every tenth of the bounds it writes: a
    scan of a full cache costs tens of milliseconds, too much for every compile."""
    bound = max_bytes if max_bytes is not None else (MAX_BYTES or 0)
    since = _written.get(r)
    if since is not None and since[0] + n < bound // 10 and since[1] + 1 < MAX_ENTRIES // 10:
        _written[r] = (since[0] + n, since[1] + 1)
        return
    _written[r] = (0, 0)
    prune(r, max_bytes=max_bytes, keep=keep)


def _mark_used(path: Path) -> None:
    """Record a use in the access time (the modification time stays: .pyc files are keyed by it)."""
    try:
        st = path.stat()
        os.utime(path, ns=(time.time_ns(), st.st_mtime_ns))
    except OSError:
        pass


def _pycs(py: Path) -> list[Path]:
    cache = py.parent / "__pycache__"
    try:
        return [cache / n for n in os.listdir(cache) if n.startswith(py.stem + ".")]
    except OSError:
        return []


def write_bytecode(path: Path, code=None) -> None:
    """Write a generated module's .pyc into its __pycache__ (as an import does without
    PYTHONDONTWRITEBYTECODE, which the GPU machine sets), so that the kernel-build workers importing
    it (luisaml/parallel_build.py) load bytecode instead of compiling 1 MB of source each; a failure
    costs only that. Keyed by the source's mtime and size, which _mark_used keeps. code: the module's
    code object when the caller has compiled it (import_module), else the source is compiled; a .pyc
    already valid for the source is kept (a second compile of ResNet-18's 1.6 MB module: ~0.8 s)."""
    import marshal

    try:
        cfile = Path(importlib.util.cache_from_source(str(path)))
        st = os.stat(path)
        header = importlib.util.MAGIC_NUMBER + struct.pack("<III", 0, int(st.st_mtime) & 0xFFFFFFFF,
                                                           st.st_size & 0xFFFFFFFF)
        with contextlib.suppress(OSError):
            with open(cfile, "rb") as f:
                if f.read(16) == header:
                    return
        if code is None:
            # dont_inherit: not this file's `from __future__ import annotations` (luisa-python checks
            # a kernel's parameter annotations as types, not strings)
            code = compile(Path(path).read_text(), str(path), "exec", dont_inherit=True)
        cfile.parent.mkdir(exist_ok=True)
        tmp = cfile.with_name(f"{cfile.name}.{os.getpid()}.tmp")
        tmp.write_bytes(header + marshal.dumps(code))
        os.replace(tmp, cfile)
    except (OSError, SyntaxError, ValueError):
        pass


def import_module(path: Path):
    """Import a generated module from its file (once per process)."""
    name = f"luisaml_generated.{path.stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        code = spec.loader.get_code(name)  # (its .pyc when valid, else the source compiled once)
        exec(code, module.__dict__)
    except BaseException:
        del sys.modules[name]
        raise
    write_bytecode(Path(path), code)  # (the kernel-build workers import it: bytecode, not a compile each)
    # luisa-python reads a function's source when it first builds the kernel, which may be long
    # after this import: keep the lines in linecache (an entry without mtime is never dropped) so
    # an eviction by another process in between does no harm
    try:
        text = Path(path).read_text()
        linecache.cache[str(path)] = (len(text), None, text.splitlines(True), str(path))
    except (OSError, UnicodeDecodeError):
        pass
    return module


# ---- the bound ------------------------------------------------------------------------------
@dataclass
class Entry:
    """One generated module: its file, its compiled .pyc files, their bytes, its last use."""

    path: Path
    pycs: list[Path]
    size: int
    used: float


def entries(path: str | os.PathLike | None = None) -> list[Entry]:
    """Return the generated modules of the cache, least recently used first."""
    folder = cache_dir(path)
    pycs: dict[str, list[tuple[Path, int]]] = {}
    for e in _scandir(folder / "__pycache__"):
        pycs.setdefault(e.name.split(".", 1)[0], []).append((Path(e.path), _size(e)))
    out = []
    for e in _scandir(folder):
        if not (e.name.startswith("net_") and e.name.endswith(".py")):
            continue
        try:
            st = e.stat()
        except FileNotFoundError:
            continue
        extra = pycs.get(e.name[:-3], [])
        out.append(Entry(Path(e.path), [p for p, _ in extra], st.st_size + sum(s for _, s in extra),
                         max(st.st_atime, st.st_mtime)))
    out.sort(key=lambda en: en.used)
    return out


def _scandir(folder: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(folder) as it:
            return list(it)
    except OSError:
        return []


def _size(e: os.DirEntry) -> int:
    try:
        return e.stat().st_size
    except OSError:
        return 0


def prune(path: str | os.PathLike | None = None, *, max_bytes: int | None = None, max_entries: int = MAX_ENTRIES,
          keep: Path | None = None) -> int:
    """Remove the least recently used generated modules until the cache is within max_bytes
    (default: LUISAML_CACHE_MAX_MB) and max_entries, down to 90% so that not every new module
    prunes again; modules used in the last GRACE_S seconds and `keep` stay. Also removes
    temporary files of interrupted writes, and per-kernel lock files (what a network's first
    launch made before build_lock) nobody took for a day. Return files removed."""
    if max_bytes is None:
        if _MAX_ERROR:
            raise UsageError(_MAX_ERROR)
        max_bytes = MAX_BYTES
    r = root(path)
    # ".tmp" anywhere: older luisaml versions named them net_<hash>.tmp<pid>
    removed = (_remove_stale(r / "generated", lambda n: ".tmp" in n, 3600)
               + _remove_stale(r / "locks", lambda n: n.endswith(".lock") and not n.startswith("build-"), 86400))
    gone, total, n = _evict([(e.used, e.size, [e.path, *e.pycs]) for e in entries(r)], max_bytes, max_entries,
                            GRACE_S, keep)
    if gone:
        logger.debug("cache: pruned to %d modules, %.1f MiB in '%s'", n, total / 2**20, r / "generated")
    return removed + gone


def _evict(groups: list[tuple[float, int, list]], max_bytes: int, max_count: float, grace_s: float,
           keep: Path | None = None) -> tuple[int, int, int]:
    """Remove the least recently used groups of files (last use, bytes, paths) until they fit in
    max_bytes and max_count, down to 90% so that not every write evicts again; groups used in the
    last grace_s seconds, and the one holding `keep`, stay. Return (files removed, bytes and groups left)."""
    total, n, removed = sum(g[1] for g in groups), len(groups), 0
    if total <= max_bytes and n <= max_count:
        return 0, total, n
    now = time.time()
    for used, size, paths in sorted(groups, key=lambda g: g[0]):
        if total <= max_bytes * 0.9 and n <= max_count * 0.9:
            break
        if now - used < grace_s or keep in paths:
            continue
        for p in paths:
            with contextlib.suppress(OSError):  # gone already, or another user's file in a shared folder
                os.unlink(p)
                removed += 1
        total, n = total - size, n - 1
    return removed, total, n


def _remove_stale(folder: Path, match, age_s: float) -> int:
    n = 0
    now = time.time()
    for e in _scandir(folder):
        try:
            if match(e.name) and now - e.stat().st_mtime > age_s:
                os.unlink(e.path)
                n += 1
        except OSError:
            pass
    return n


# ---- info and clear -------------------------------------------------------------------------
@dataclass
class Folder:
    """One cache folder: what it holds, where, how many files and bytes (0 when absent)."""

    what: str
    path: Path
    files: int
    bytes: int


def kernel_cache_dir() -> Path:
    """Return the folder where LuisaCompute's CPU backend (and its CUDA backend) cache compiled
    kernels: .cache beside the real Python executable (its choice; it cannot be moved)."""
    exe = "/proc/self/exe" if os.path.exists("/proc/self/exe") else sys.executable
    return Path(os.path.dirname(os.path.realpath(exe))) / ".cache"


def _runtime_cache_dir() -> Path | None:
    """LuisaCompute's runtime-directory cache (beside its shared libraries), where some versions
    and backends also write."""
    spec = importlib.util.find_spec("luisa")
    if spec is None or not spec.origin:
        return None
    return Path(spec.origin).parent / "dylibs" / ".cache"


def _kernel_dirs() -> list[tuple[str, Path]]:
    dirs = [("LuisaCompute kernels", kernel_cache_dir())]
    rt = _runtime_cache_dir()
    if rt is not None and rt.is_dir() and rt != dirs[0][1]:
        dirs.append(("LuisaCompute runtime cache", rt))
    # (the tensor-core fronts' CUDA kernel caches are inside their runtime folders: `info` counts
    # those whole, without root(), which would make the folders `clear` has just removed)
    return dirs


def _count(folder: Path, match=lambda name: True) -> tuple[int, int]:
    files = size = 0
    for dirpath, _, names in os.walk(folder):
        for n in names:
            if match(n):
                try:
                    size += os.lstat(os.path.join(dirpath, n)).st_size
                    files += 1
                except OSError:
                    pass
    return files, size


def _is_kernel_file(name: str) -> bool:
    """True for LuisaCompute's kernel files and luisaml's own files in its folder (the CPU backend's
    kernel_<hash>.bc/.hash; the CUDA backend's PTX cache, an LMDB database of 0.3.7's runtime folder)."""
    return name.startswith("kernel_") or name in (_MANIFEST, _LLVM_LOCK, "data.mdb", "lock.mdb")


def info(path: str | os.PathLike | None = None, *, kernels: bool = True) -> list[Folder]:
    """Return every cache folder luisaml uses with its file count and bytes: the generated modules,
    locks and templates (and the fallback folder, if it was used), and LuisaCompute's kernel caches."""
    want = Path(path) if path is not None else ROOT
    out = []
    roots = [want] + ([fallback_root()] if fallback_root().is_dir() and fallback_root() != want else [])
    for r in roots:
        tag = "" if r == want else " (fallback)"
        subs = [("generated", "generated modules"), ("templates", "compiled templates"), ("locks", "build locks"),
                ("tuning", "tuned schedules")]
        if kernels and (r / "tensor-cores").is_dir():  # (the tensor-core fronts' runtime folders, kernels included)
            subs.append(("tensor-cores", "tensor-core runtime folders"))
        for sub, what in subs:
            out.append(Folder(what + tag, r / sub, *_count(r / sub)))
    if kernels:
        for what, d in _kernel_dirs():
            out.append(Folder(what, d, *_count(d, _is_kernel_file)))
    return out


def clear(path: str | os.PathLike | None = None, *, kernels: bool = True) -> list[Folder]:
    """Remove what luisaml's caches made: the generated/, templates/, locks/ and tuning/ folders of its
    cache folder and of the fallback (each folder then too, when nothing else is left in it) and,
    with kernels, LuisaCompute's kernel files (kernel_*: rebuilt on next use) with luisaml's own
    files beside them (the manifest of kernels found complete, the llvm_paths.json lock) and the
    tensor-core fronts' runtime folders (luisaml/tensor_cores.py, their kernels with them); return
    what was removed, per folder. A process that goes on using the cache makes its folders again.
    Run it while no luisaml process is compiling."""
    want = Path(path) if path is not None else ROOT
    before = info(path, kernels=kernels)
    for f in before:
        if not f.what.startswith("LuisaCompute"):
            shutil.rmtree(f.path, ignore_errors=True)
            with contextlib.suppress(OSError):
                f.path.parent.rmdir()  # (only when empty: LUISAML_CACHE may name a folder of the user's)
            continue
        for dirpath, _, names in os.walk(f.path):  # the folder is LuisaCompute's: only these files go
            for n in filter(_is_kernel_file, names):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(dirpath, n))
    with _roots_lock:
        in_use = want in _roots
        _roots.clear()
    _written.clear()
    _checked.clear()
    if in_use:
        root(want)
    left = {f.path: f for f in info(path, kernels=kernels)}
    return [Folder(f.what, f.path, f.files - getattr(left.get(f.path), "files", 0),
                   f.bytes - getattr(left.get(f.path), "bytes", 0)) for f in before]


# ---- LuisaCompute's kernel cache ----------------------------------------------------------------
_checked: set[Path] = set()
_checked_lock = threading.Lock()


def check_kernel_cache(folder: str | os.PathLike | None = None, *, min_free_bytes: int = MIN_FREE_BYTES,
                       max_bytes: int | None | str = "env") -> Path:
    """Make LuisaCompute's kernel cache safe to use before a kernel build and return its folder
    (once per process and folder). LuisaCompute exits the process on a truncated cached kernel and
    aborts when it cannot write one, so: raise BackendUnavailable when the folder cannot be created
    or written or its disk has less than min_free_bytes free, and delete every kernel_*.bc that is
    not a complete LLVM bitcode file (with its .hash: LuisaCompute then rebuilds it); then keep its
    kernel files within max_bytes (prune_kernels; None: no bound; "env": LUISAML_KERNEL_CACHE_MAX_MB,
    a UsageError naming it when it holds no number of MiB)."""
    if max_bytes == "env":
        if _KERNEL_MAX_ERROR:
            raise UsageError(_KERNEL_MAX_ERROR)
        max_bytes = KERNEL_MAX_BYTES
    d = Path(folder) if folder is not None else kernel_cache_dir()
    if d in _checked:
        return d
    with _checked_lock:
        if d in _checked:
            return d
        _check_writable(d)
        free = shutil.disk_usage(d).free
        if free < min_free_bytes:
            raise BackendUnavailable(
                f"only {free / 2**20:.0f} MiB are free on the disk of LuisaCompute's kernel cache '{d}' "
                f"(at least {min_free_bytes / 2**20:.0f} MiB needed: LuisaCompute aborts the process when it "
                "cannot write a compiled kernel); free some space, e.g. with `luisaml cache clear`"
            )
        bad = scan_kernels(d)
        if max_bytes is not None:
            prune_kernels(d, max_bytes)
        if bad:
            logger.warning("removed %d damaged kernel(s) from LuisaCompute's cache '%s' (they are rebuilt): %s",
                           len(bad), d, ", ".join(sorted(bad)[:5]) + (" ..." if len(bad) > 5 else ""))
        _checked.add(d)
    return d


# a kernel file used this recently is never pruned: another process may be building or loading it
KERNEL_GRACE_S = 600.0


def prune_kernels(d: Path, max_bytes: int) -> int:
    """Remove LuisaCompute's least recently used kernels (a kernel_<hash>.* group of files: used =
    the latest access or change of any of them) until its kernel files fit in max_bytes, down to 90%
    so that not every process prunes again; groups used in the last KERNEL_GRACE_S seconds stay, and
    nothing but kernel_* files is touched (the folder is LuisaCompute's). Return files removed."""
    groups: dict[str, list] = {}  # stem -> [used, bytes, paths]
    for e in _scandir(d):
        if not e.name.startswith("kernel_"):
            continue
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        g = groups.setdefault(e.name.split(".", 1)[0], [0.0, 0, []])
        g[0] = max(g[0], st.st_atime, st.st_mtime)
        g[1] += st.st_size
        g[2].append(e.path)
    removed, total, _ = _evict(list(groups.values()), max_bytes, float("inf"), KERNEL_GRACE_S)
    if removed:
        logger.info("kernel cache: removed %d least recently used kernel files from '%s' (%.0f MiB left, bound "
                    "%.0f MiB: LUISAML_KERNEL_CACHE_MAX_MB)", removed, d, total / 2**20, max_bytes / 2**20)
    return removed


def _check_writable(d: Path) -> None:
    try:
        d.mkdir(parents=True, exist_ok=True)
        _write_probe(d, ".luisaml-probe-")
    except OSError as e:
        raise BackendUnavailable(
            f"LuisaCompute's kernel cache folder '{d}' cannot be written ({_reason(e)}); LuisaCompute "
            "puts it beside the Python executable and it cannot be moved, and it aborts the process when "
            f"it cannot write there. Make the folder writable (e.g. chown/chmod '{d.parent}'), or run "
            "from a virtual environment in a writable place created with `python -m venv --copies`"
        ) from e


# ---- LuisaCompute's llvm_paths.json ------------------------------------------------------------
# LuisaCompute's CPU backend keeps where it found clang and LLVM in llvm_paths.json beside the Python
# executable. At every process's first kernel build it parses the file (unwrap: a panic, the
# process aborts, on a file that is not whole JSON) and then rewrites it in place (truncate, then
# write). Two processes starting together can so read each other's half-written file.
_LLVM_PATHS = "llvm_paths.json"
_LLVM_LOCK = ".luisaml-llvm-paths.lock"


def llvm_paths_file() -> Path:
    """Return LuisaCompute's llvm_paths.json (beside the real Python executable)."""
    return kernel_cache_dir().parent / _LLVM_PATHS


def llvm_paths_problem(path: str | os.PathLike) -> str | None:
    """Return why LuisaCompute's CPU backend would abort on the llvm_paths.json at `path`, or None
    when it would not (a missing file is fine: it finds clang and LLVM again)."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None if os.access(path.parent, os.W_OK) else f"'{path.parent}' cannot be written"
    except (OSError, UnicodeDecodeError) as e:
        return f"unreadable ({e})"
    if not os.access(path, os.W_OK):
        return "cannot be written"
    try:
        data = json.loads(text)
    except ValueError:
        return "not whole JSON (an interrupted rewrite)" if text.strip() else "empty"
    if not (isinstance(data, dict) and all(isinstance(data.get(k), str) for k in ("clang", "llvm"))):
        return "not an object of 'clang' and 'llvm' paths"
    return None


def repair_llvm_paths(path: str | os.PathLike | None = None) -> None:
    """Delete a damaged llvm_paths.json (LuisaCompute writes a new one); raise BackendUnavailable
    when it cannot be written (LuisaCompute would abort rewriting it)."""
    path = Path(path) if path is not None else llvm_paths_file()
    problem = llvm_paths_problem(path)
    if problem is None:
        return
    if "cannot be written" not in problem:
        logger.warning("removed LuisaCompute's damaged '%s' (%s); it finds clang and LLVM again", path, problem)
        path.unlink(missing_ok=True)
        problem = llvm_paths_problem(path)
    if problem is not None:
        raise BackendUnavailable(
            f"LuisaCompute's CPU backend rewrites '{path}' at every process's first kernel build and aborts "
            f"the process when it cannot: {problem}. Make it writable, or run from a virtual environment in "
            "a writable place created with `python -m venv --copies`"
        )


def llvm_paths_lock() -> filelock.FileLock:
    """Return the inter-process lock (a file in LuisaCompute's kernel cache folder, so shared by every
    process of one Python installation) under which a process's first CPU kernel build reads and
    rewrites llvm_paths.json."""
    return filelock.FileLock(check_kernel_cache() / _LLVM_LOCK)


__all__ = [
    "ROOT", "MAX_BYTES", "CacheError", "root", "fallback_root", "cache_dir", "locks_dir", "templates_dir",
    "build_lock", "digest", "write_module", "find_module", "import_module", "entries", "prune", "info", "clear",
    "Folder", "kernel_cache_dir", "check_kernel_cache", "llvm_paths_file",
    "llvm_paths_problem", "repair_llvm_paths", "llvm_paths_lock",
]
