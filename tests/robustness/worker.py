"""A long-lived worker process: takes cases one at a time on stdin, reports each result on its own
pipe before reading the next.

The pool (pool.py) starts it as `python -m tests.robustness.worker RESULT_FD WORKDIR [DUMP_DIR]`
with stdout and stderr going to a log file, so that nothing a case prints (or an injected payload
writes) can garble the results. Started once, it pays the imports and the device start for many
cases; a case that kills it is reported by the pool as FAIL_ABORT.

`run_case` is also what `python -m tests.robustness --case ID` calls in-process, for debugging.
"""
from __future__ import annotations

import faulthandler
import os
import resource
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

from . import harness
from .harness import (
    FAIL_ERROR,
    FAIL_HARNESS,
    FAIL_INJECTION,
    PASS,
    Case,
    Context,
    Fail,
    Result,
)

# Each worker may reserve this much address space: a size check that luisaml forgets then fails
# fast as an allocation error instead of taking the (shared, swap-less) machine down.
ADDRESS_SPACE_LIMIT = int(os.environ.get("ROBUSTNESS_MEMORY_LIMIT", 8 << 30))


def limit_resources() -> None:
    """No core files (an abort is an outcome here, not something to debug from a 2 GB core), and
    a cap on address space (not under CUDA: the driver reserves address space for the whole
    device and beyond, and cuInit fails under an 8 GiB cap)."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if os.environ.get("LUISAML_BACKEND") == "cuda":
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard == resource.RLIM_INFINITY or hard > ADDRESS_SPACE_LIMIT:
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_LIMIT, hard))


def load_recipes() -> None:
    """Import every family module so that its recipes register themselves."""
    from . import (
        families,  # noqa: F401
        fuzz,  # noqa: F401
        selftest,  # noqa: F401
    )


def run_case(case: Case, workdir: Path, dump_dir: Path | None = None, keep: bool = False) -> Result:
    """Run one case in this process and return its classified result."""
    fn = harness.RECIPES.get(case.recipe)
    case_dir = Path(tempfile.mkdtemp(prefix="case_", dir=workdir))
    ctx = Context(case_dir, case, dump_dir)
    t0 = time.perf_counter()
    outcome, detail = PASS, ""
    cwd = os.getcwd()
    env = dict(os.environ)
    try:
        if fn is None:
            raise Fail(FAIL_HARNESS, f"no recipe {case.recipe!r}")
        fn(ctx, **case.params)
    except Fail as f:
        outcome, detail = f.outcome, f.detail
    except BaseException as e:  # noqa: BLE001 - anything a recipe lets through is classified
        if isinstance(e, KeyboardInterrupt) and os.environ.get("ROBUSTNESS_INPROCESS"):
            raise
        outcome = FAIL_ERROR if harness.raised_in_luisaml(e) else FAIL_HARNESS
        detail = f"uncaught {type(e).__name__}: {harness.short(str(e))}\n{traceback.format_exc(limit=-4)}"
    finally:
        # a recipe may chdir or set variables (LUISAML_CACHE); the next case must not inherit them
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
    injected = sorted(p for p in case_dir.rglob("INJECTED*"))
    if injected:
        outcome = FAIL_INJECTION
        detail = f"marker {injected[0].relative_to(case_dir)} created" + (f" ({detail})" if detail else "")
    seconds = time.perf_counter() - t0
    if dump_dir is not None and outcome != PASS:
        dest = dump_dir / safe_id(case.id)
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(case_dir, dest, symlinks=True, ignore_dangling_symlinks=True)
        (dest / "CASE.json").write_text(case.to_json() + "\n")
    if not keep:
        _remove(case_dir)
    return Result(case.id, case.family, outcome, detail, round(seconds, 3), ctx.extra)


def _remove(path: Path) -> None:
    """Remove a case folder, read-only parts included."""
    def onerror(fn, p, exc):
        try:
            os.chmod(os.path.dirname(p), 0o755)
            os.chmod(p, 0o755)
            fn(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=onerror)


def safe_id(case_id: str) -> str:
    """Return a case id usable as a folder name."""
    return "".join(c if c.isalnum() or c in "-_.=" else "_" for c in case_id)[:150]


def main(argv: list[str]) -> int:
    result_fd, workdir = int(argv[0]), Path(argv[1])
    dump_dir = Path(argv[2]) if len(argv) > 2 and argv[2] else None
    limit_resources()
    faulthandler.enable()  # a segfault leaves a Python traceback in the log the pool reads
    out = os.fdopen(result_fd, "w", buffering=1)
    os.environ.setdefault("LUISAML_BACKEND", "cpu")
    import luisaml.device

    luisaml.device.init(os.environ["LUISAML_BACKEND"])
    load_recipes()
    out.write("READY\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        case = Case.from_json(line)
        print(f"=== case {case.id}", flush=True)
        result = run_case(case, workdir, dump_dir)
        print(f"=== {result.outcome} {case.id} ({result.seconds:.2f} s)", flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        out.write(result.to_json() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
