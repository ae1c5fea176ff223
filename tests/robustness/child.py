"""A fresh process that compiles and runs one model and writes what happened to a JSON file:
`python -m tests.robustness.child JOB.json`.

Cache faults and multi-process cases need a process of their own (a fresh import of the generated
module, another Python executable whose kernel cache is a copy, several compiles at once). The
parent recipe reads the report; no report at all means the child died (FAIL_ABORT).

JOB: {"model": path, "feeds": .npz path, "report": .json path, "outputs": .npz path,
      "options": compile keyword arguments, "repeat": runs}
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from .harness import FAIL_ABORT, REPO, Fail, crash_summary, short


def main(job_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    report: dict = {"pid": os.getpid()}
    try:
        import luisaml

        with np.load(job["feeds"]) as z:
            feeds = {k: z[k] for k in z.files}
        t0 = time.perf_counter()
        net = luisaml.compile(job["model"], job.get("weights"), **job.get("options", {}))
        outputs = {}
        for _ in range(int(job.get("repeat", 1))):
            outputs = net.run(feeds)
        report["seconds"] = time.perf_counter() - t0
        np.savez(job["outputs"], **outputs)
        report["ok"] = True
        report["source"] = net.source
    except BaseException as e:  # noqa: BLE001 - reported, classified by the parent
        import traceback

        report["ok"] = False
        report["type"] = f"{type(e).__module__}.{type(e).__qualname__}"
        try:
            import luisaml

            report["luisaml"] = isinstance(e, luisaml.LuisamlError)
        except BaseException:  # noqa: BLE001
            report["luisaml"] = False
        report["message"] = str(e)
        report["traceback"] = traceback.format_exc(limit=-5)
    Path(job["report"]).write_text(json.dumps(report))
    return 0


class ChildResult:
    def __init__(self, report: dict | None, code: int, stderr: str, outputs: dict | None):
        self.report, self.code, self.stderr, self.outputs = report, code, stderr, outputs


def start(folder: Path, tag: str, model: str, feeds: dict, options=None, weights=None, python=None, env=None,
          wrap=None, repeat: int = 1) -> tuple[subprocess.Popen, dict]:
    """Start a child on a model and feeds; return (process, job). wrap: a command prefix (unshare)."""
    folder.mkdir(parents=True, exist_ok=True)
    np.savez(folder / f"{tag}_feeds.npz", **feeds)
    job = {"model": model, "weights": weights, "feeds": str(folder / f"{tag}_feeds.npz"),
           "report": str(folder / f"{tag}_report.json"), "outputs": str(folder / f"{tag}_out.npz"),
           "options": options or {}, "repeat": repeat}
    job_path = folder / f"{tag}_job.json"
    job_path.write_text(json.dumps(job))
    cmd = [python or sys.executable, "-m", "tests.robustness.child", str(job_path)]
    if wrap:
        cmd = [*wrap, *cmd]
    full_env = dict(os.environ, **(env or {}))
    full_env.setdefault("PYTHONFAULTHANDLER", "1")
    proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return proc, job


def finish(proc: subprocess.Popen, job: dict, timeout: float = 240) -> ChildResult:
    """Wait for a child; raise Fail(FAIL_ABORT) when it died or exited without a report."""
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise Fail(FAIL_ABORT, f"a child process hung: killed after {timeout:.0f} s") from None
    stderr = err.decode("utf-8", "replace")
    report_path = Path(job["report"])
    if not report_path.exists():
        how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit status {proc.returncode}"
        raise Fail(FAIL_ABORT, f"a child process died ({how}) without a report: {short(crash_summary(stderr, 4), 500)}")
    report = json.loads(report_path.read_text())
    outputs = None
    if report.get("ok"):
        with np.load(job["outputs"]) as z:
            outputs = {k: z[k] for k in z.files}
    return ChildResult(report, proc.returncode, stderr, outputs)


def run(folder: Path, tag: str, model: str, feeds: dict, timeout: float = 240, **kw) -> ChildResult:
    proc, job = start(folder, tag, model, feeds, **kw)
    return finish(proc, job, timeout)


def python_copy(folder: Path) -> tuple[str, dict]:
    """Return (a copy of this Python executable, the environment it needs): LuisaCompute keeps its
    kernel cache next to the executable (<dir of /proc/self/exe>/.cache), so the copy's cache is a
    private folder this case may damage without touching the real one other processes use."""
    import shutil

    real = os.path.realpath(sys.executable)
    bindir = folder / "pybin"
    bindir.mkdir(parents=True, exist_ok=True)
    copy = bindir / os.path.basename(real)
    shutil.copy2(real, copy)
    # the copy finds the standard library through PYTHONHOME; this environment's packages (a virtual
    # environment's site-packages, not under the base prefix, with the .pth of luisaml's editable
    # install) through a sitecustomize that adds them as site folders
    import site

    hook = folder / "pyhook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text("import site\n" + "".join(
        f"site.addsitedir({d!r})\n" for d in site.getsitepackages()))
    env = {"PYTHONHOME": sys.base_prefix, "PYTHONPATH": os.pathsep.join([str(hook), str(REPO)])}
    return str(copy), env


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
