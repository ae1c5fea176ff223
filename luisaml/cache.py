"""luisaml's on-disk caches: the content-hashed folder of generated modules (bounded, least
recently used first out), its lock and template folders, the per-user fallback when that folder is
not writable, and the health of LuisaCompute's kernel cache (checked once per process before the
first kernel build).

Environment, read once when this module is imported:
  LUISAML_CACHE         the cache root (default: $XDG_CACHE_HOME/luisaml, else ~/.cache/luisaml);
                        it holds generated/, locks/ and templates/
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

from .errors import BackendUnavailable, CacheError, UsageError
from .log import logger

ROOT = Path(os.environ.get("LUISAML_CACHE") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "luisaml"))


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
    fd, tmp = tempfile.mkstemp(dir=path / "generated", prefix=".probe-")
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
    temporary files of interrupted writes and locks nobody took for a day. Return files removed."""
    if max_bytes is None:
        if _MAX_ERROR:
            raise UsageError(_MAX_ERROR)
        max_bytes = MAX_BYTES
    r = root(path)
    # ".tmp" anywhere: older luisaml versions named them net_<hash>.tmp<pid>
    removed = (_remove_stale(r / "generated", lambda n: ".tmp" in n, 3600)
               + _remove_stale(r / "locks", lambda n: n.endswith(".lock"), 86400))
    es = entries(r)
    total = sum(e.size for e in es)
    if total <= max_bytes and len(es) <= max_entries:
        return removed
    now = time.time()
    goal_bytes, goal_n = int(max_bytes * 0.9), int(max_entries * 0.9)
    n = len(es)
    for e in es:
        if total <= goal_bytes and n <= goal_n:
            break
        if e.path == keep or now - e.used < GRACE_S:
            continue
        for p in [e.path, *e.pycs]:
            try:
                p.unlink()
                removed += 1
            except OSError:  # gone already, or another user's file in a shared folder
                pass
        total -= e.size
        n -= 1
    logger.debug("cache: pruned to %d modules, %.1f MiB in '%s'", n, total / 2**20, r / "generated")
    return removed


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
    return name.startswith("kernel_") or name == _MANIFEST


def info(path: str | os.PathLike | None = None, *, kernels: bool = True) -> list[Folder]:
    """Return every cache folder luisaml uses with its file count and bytes: the generated modules,
    locks and templates (and the fallback folder, if it was used), and LuisaCompute's kernel caches."""
    want = Path(path) if path is not None else ROOT
    out = []
    roots = [want] + ([fallback_root()] if fallback_root().is_dir() and fallback_root() != want else [])
    for r in roots:
        tag = "" if r == want else " (fallback)"
        for sub, what in (("generated", "generated modules"), ("templates", "compiled templates"), ("locks", "build locks")):
            out.append(Folder(what + tag, r / sub, *_count(r / sub)))
    if kernels:
        for what, d in _kernel_dirs():
            out.append(Folder(what, d, *_count(d, _is_kernel_file)))
    return out


def clear(path: str | os.PathLike | None = None, *, kernels: bool = True) -> list[Folder]:
    """Empty luisaml's cache folders (the fallback too) and, with kernels, LuisaCompute's kernel
    files (kernel_*: they are rebuilt on next use); return what was removed, per folder. Run it
    while no luisaml process is compiling."""
    removed = []
    for f in info(path, kernels=kernels):
        files = size = 0
        kernel = f.what.startswith("LuisaCompute")
        for dirpath, _, names in os.walk(f.path, topdown=False):
            for n in names:
                if kernel and not _is_kernel_file(n):
                    continue  # the folder is LuisaCompute's: only its kernel files go
                p = os.path.join(dirpath, n)
                try:
                    s = os.lstat(p).st_size
                    os.unlink(p)
                    files, size = files + 1, size + s
                except OSError:
                    pass
            if not kernel and dirpath != str(f.path):
                shutil.rmtree(dirpath, ignore_errors=True)
        removed.append(Folder(f.what, f.path, files, size))
    _checked.clear()
    return removed


# ---- LuisaCompute's kernel cache ----------------------------------------------------------------
_MANIFEST = ".luisaml-checked.json"  # name -> [size, mtime_ns] of kernel files found complete
_checked: set[Path] = set()
_checked_lock = threading.Lock()
# an incomplete file whose size still changes over this long is being written by another process
_SETTLE_S = 0.05


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
    total = sum(g[1] for g in groups.values())
    if total <= max_bytes:
        return 0
    now, goal, removed = time.time(), int(max_bytes * 0.9), 0
    for used, size, paths in sorted(groups.values(), key=lambda g: g[0]):
        if total <= goal:
            break
        if now - used < KERNEL_GRACE_S:
            continue
        for path in paths:
            try:
                os.unlink(path)
                removed += 1
            except OSError:
                pass
        total -= size
    logger.info("kernel cache: removed %d least recently used kernel files from '%s' (%.0f MiB left, bound "
                "%.0f MiB: LUISAML_KERNEL_CACHE_MAX_MB)", removed, d, total / 2**20, max_bytes / 2**20)
    return removed


def _check_writable(d: Path) -> None:
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".luisaml-probe-")
        try:
            os.write(fd, b"x")
        finally:
            os.close(fd)
            os.unlink(tmp)
    except OSError as e:
        raise BackendUnavailable(
            f"LuisaCompute's kernel cache folder '{d}' cannot be written ({_reason(e)}); LuisaCompute "
            "puts it beside the Python executable and it cannot be moved, and it aborts the process when "
            f"it cannot write there. Make the folder writable (e.g. chown/chmod '{d.parent}'), or run "
            "from a virtual environment in a writable place created with `python -m venv --copies`"
        ) from e


def scan_kernels(d: Path) -> list[str]:
    """Delete every kernel_*.bc in d that is not complete LLVM bitcode, with its .hash; return
    their names. Files found complete are remembered (name, size, mtime) in a manifest in d."""
    manifest_path = d / _MANIFEST
    try:
        known = json.loads(manifest_path.read_text())
        if not isinstance(known, dict):
            known = {}
    except (OSError, ValueError):
        known = {}
    good: dict[str, list[int]] = {}
    bad: list[str] = []
    with os.scandir(d) as it:
        for e in it:
            if not (e.name.startswith("kernel_") and e.name.endswith(".bc")):
                continue
            if e.is_dir(follow_symlinks=False):  # LuisaCompute aborts on a folder where a kernel belongs
                shutil.rmtree(e.path, ignore_errors=True)
                Path(e.path[:-3] + ".hash").unlink(missing_ok=True)
                bad.append(e.name)
                continue
            try:
                st = e.stat()
            except FileNotFoundError:
                continue
            stamp = [st.st_size, st.st_mtime_ns]
            if known.get(e.name) == stamp:
                good[e.name] = stamp
                continue
            try:
                problem = bitcode_problem(e.path)
            except OSError as err:
                problem = f"unreadable ({err.strerror})"
            if problem is None:
                good[e.name] = stamp
                continue
            time.sleep(_SETTLE_S)
            try:
                if os.stat(e.path).st_size != st.st_size:
                    continue  # still growing: another process is writing it
            except FileNotFoundError:
                continue
            logger.debug("kernel cache: %s: %s", e.name, problem)
            for p in (Path(e.path), Path(e.path[:-3] + ".hash")):
                try:
                    p.unlink(missing_ok=True)
                except IsADirectoryError:
                    shutil.rmtree(p, ignore_errors=True)
            bad.append(e.name)
    if good != known:
        tmp = d / f"{_MANIFEST}.{os.getpid()}.tmp"
        try:
            tmp.write_text(json.dumps(good, separators=(",", ":")))
            os.replace(tmp, manifest_path)
        except OSError:
            tmp.unlink(missing_ok=True)
    return bad


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


@contextlib.contextmanager
def llvm_paths_lock():
    """Hold the inter-process lock (a file in LuisaCompute's kernel cache folder, so shared by every
    process of one Python installation) under which a process's first CPU kernel build reads and
    rewrites llvm_paths.json."""
    import fcntl

    d = check_kernel_cache()
    with open(d / _LLVM_LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# LLVM bitcode: https://llvm.org/docs/BitCodeFormat.html
_WRAPPER_MAGIC = 0x0B17C0DE
_RAW_MAGIC = b"BC\xc0\xde"
_MODULE_BLOCK, _STRTAB_BLOCK = 8, 23


def bitcode_problem(data: bytes | str | os.PathLike) -> str | None:
    """Return why `data` (bytes, or a file's path) is not a complete LLVM bitcode file, or None
    when it is.

    Cheap: only the top level is read. It is a sequence of blocks, each ENTER_SUBBLOCK (abbrev id 1
    in 2 bits), a vbr8 block id, a vbr4 abbrev width, 32-bit alignment, and a 32-bit count of the
    words that follow; every block must end inside the file, the last at its end (zero padding
    allowed), and a module must be followed by its string table (module version 2, LLVM >= 5), so
    that a cut between two blocks is caught too."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return _walk(bytes(data).__getitem__, len(data))
    with open(data, "rb") as f:
        size = os.fstat(f.fileno()).st_size

        def read(s: slice) -> bytes:
            f.seek(s.start)
            return f.read(s.stop - s.start)

        return _walk(read, size)


def _walk(read, size: int) -> str | None:
    """bitcode_problem over read(slice) -> bytes of a file of `size` bytes."""
    if size == 0:
        return "empty"
    base, end = 0, size
    head = read(slice(0, 20))
    if len(head) >= 4 and struct.unpack_from("<I", head)[0] == _WRAPPER_MAGIC:
        if len(head) < 20:
            return "truncated wrapper header"
        _, offset, length = struct.unpack_from("<3I", head, 4)
        if offset + length > size:
            return f"the wrapper declares {offset + length} bytes, the file has {size}"
        base, end = offset, offset + length
        head = read(slice(base, base + 4))
    if head[:4] != _RAW_MAGIC:
        return "not LLVM bitcode (no 'BC' 0xC0DE magic)"
    pos = base + 4
    blocks: list[int] = []
    module_version = None
    while pos < end:
        chunk = read(slice(pos, min(pos + 24, end)))
        if not any(chunk) and end - pos <= 4096 and not any(read(slice(pos, end))):
            break  # zero padding to the end
        r = _Bits(chunk, 0, len(chunk))
        try:
            if r.read(2) != 1:
                return f"byte {pos}: a top-level entry that is not a block"
            block_id = r.vbr(8)
            width = r.vbr(4)
            r.align32()
            words = r.read(32)
        except EOFError:
            return f"byte {pos}: truncated block header"
        body = pos + r.bit // 8
        block_end = body + 4 * words
        if block_end > end:
            return f"block {block_id} at byte {pos} declares {block_end - pos} bytes, {end - pos} are left"
        if block_id == _MODULE_BLOCK:
            module_version = _module_version(read(slice(body, min(body + 16, block_end))), width)
        blocks.append(block_id)
        pos = block_end
    if _MODULE_BLOCK not in blocks:
        return "no module block"
    if (module_version is None or module_version >= 2) and _STRTAB_BLOCK not in blocks[blocks.index(_MODULE_BLOCK):]:
        return "no string table after the module (cut between two blocks)"
    return None


def _module_version(data: bytes, width: int) -> int | None:
    """The module block's first record, when it is the unabbreviated VERSION record LLVM writes."""
    r = _Bits(data, 0, len(data))
    try:
        if r.read(width) != 3:  # UNABBREV_RECORD
            return None
        code, nops = r.vbr(6), r.vbr(6)
        return r.vbr(6) if code == 1 and nops >= 1 else None
    except EOFError:
        return None


class _Bits:
    """Little-endian bit reader over data[start:end] (bitcode fields are packed from bit 0 up)."""

    def __init__(self, data: bytes, start: int, end: int):
        self.data, self.bit, self.end = data, start * 8, end * 8

    def read(self, n: int) -> int:
        if self.bit + n > self.end:
            raise EOFError
        first, last = self.bit // 8, (self.bit + n + 7) // 8
        v = int.from_bytes(self.data[first:last], "little") >> (self.bit % 8)
        self.bit += n
        return v & ((1 << n) - 1)

    def vbr(self, n: int) -> int:
        hi = 1 << (n - 1)
        v, shift = 0, 0
        while True:
            chunk = self.read(n)
            v |= (chunk & (hi - 1)) << shift
            if not chunk & hi:
                return v
            shift += n - 1
            if shift > 64:
                raise EOFError

    def align32(self) -> None:
        self.bit = (self.bit + 31) // 32 * 32


__all__ = [
    "ROOT", "MAX_BYTES", "CacheError", "root", "fallback_root", "cache_dir", "locks_dir", "templates_dir",
    "digest", "write_module", "find_module", "import_module", "entries", "prune", "info", "clear", "Folder",
    "kernel_cache_dir", "check_kernel_cache", "scan_kernels", "bitcode_problem", "llvm_paths_file",
    "llvm_paths_problem", "repair_llvm_paths", "llvm_paths_lock",
]
