"""The worker pool: long-lived worker processes that run cases one at a time, so that a case
which kills its process is a FAIL_ABORT result instead of the end of the run.

Each worker reports every result on a pipe of its own before it reads the next case; the pool
waits on all pipes at once. A pipe that closes without a result means the worker died in the
middle of the case it held: that case is FAIL_ABORT (with the signal and the last lines the case
printed) and a fresh worker takes its place. A case past its timeout is killed the same way.
"""
from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from .harness import FAIL_ABORT, REPO, Case, Result, crash_summary

# A worker is replaced after this many cases: leaks of one case (buffers, modules) stay bounded.
RECYCLE_AFTER = 150
START_TIMEOUT = 180.0


@dataclass
class _Worker:
    proc: subprocess.Popen
    fd: int  # the read end of its result pipe
    log: Path
    buf: bytes = b""
    case: Case | None = None
    deadline: float = 0.0
    started: float = 0.0
    log_offset: int = 0
    done: int = 0
    ready: bool = False

    def send(self, case: Case) -> None:
        self.case = case
        self.started = time.monotonic()
        self.deadline = self.started + case.timeout
        self.log_offset = self.log.stat().st_size if self.log.exists() else 0
        self.proc.stdin.write((case.to_json() + "\n").encode())
        self.proc.stdin.flush()


class Pool:
    """A pool of `workers` worker processes (their own LUISAML_CACHE, removed on close)."""

    def __init__(self, workers: int = 2, dump_dir: str | os.PathLike | None = None, keep_logs: bool = False):
        self.size = max(1, int(workers))
        self.root = Path(tempfile.mkdtemp(prefix="luisaml-robustness-"))
        self.dump_dir = Path(dump_dir).resolve() if dump_dir else None
        if self.dump_dir:
            self.dump_dir.mkdir(parents=True, exist_ok=True)
        self.keep_logs = keep_logs
        self.env = dict(os.environ)
        self.env.setdefault("LUISAML_BACKEND", "cpu")
        # a cache of the run's own: generated modules of hostile names never land in the user's
        self.env["LUISAML_CACHE"] = str(self.root / "luisaml-cache")
        self.env["PYTHONFAULTHANDLER"] = "1"
        self.env.pop("PYTEST_XDIST_WORKER", None)
        self._workers: list[_Worker] = []
        self._serial = 0
        self._failed_starts = 0

    # ---- workers ---------------------------------------------------------------------------------
    def _start(self) -> _Worker:
        self._serial += 1
        workdir = self.root / f"w{self._serial}"
        workdir.mkdir()
        log = self.root / f"worker{self._serial}.log"
        r, w = os.pipe()
        with open(log, "wb") as logf:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.robustness.worker", str(w), str(workdir), str(self.dump_dir or "")],
                cwd=REPO, env=self.env, stdin=subprocess.PIPE, stdout=logf, stderr=subprocess.STDOUT,
                pass_fds=(w,), start_new_session=True,
            )
        os.close(w)
        worker = _Worker(proc, r, log)
        worker.deadline = time.monotonic() + START_TIMEOUT
        return worker

    def _kill(self, worker: _Worker) -> None:
        try:
            os.killpg(worker.proc.pid, signal.SIGKILL)  # its children (a case's subprocesses) too
        except (ProcessLookupError, PermissionError):
            pass
        try:
            worker.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        try:
            worker.proc.stdin.close()
        except OSError:
            pass
        self._close_fd(worker)

    @staticmethod
    def _close_fd(worker: _Worker) -> None:
        if worker.fd >= 0:
            os.close(worker.fd)
            worker.fd = -1

    def _retire(self, worker: _Worker) -> None:
        try:
            worker.proc.stdin.close()
            worker.proc.wait(timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self._kill(worker)

    def close(self) -> None:
        for w in self._workers:
            self._retire(w)
        self._workers = []
        if not self.keep_logs:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- running ---------------------------------------------------------------------------------
    def run(self, cases: Iterable[Case], on_result: Callable[[Result], None] | None = None) -> list[Result]:
        """Run the cases (at most `size` at a time) and return their results in completion order."""
        todo = list(cases)[::-1]
        results: list[Result] = []
        while todo or any(w.case for w in self._workers):
            # keep `size` workers while there is work (one that could not start left a gap)
            while len(self._workers) < min(self.size, len(todo) + sum(w.case is not None for w in self._workers)):
                self._workers.append(self._start())
            for w in self._workers:
                if w.ready and w.case is None and todo:
                    w.send(todo.pop())
            busy = [w for w in self._workers if w.case is not None or not w.ready]
            if not busy:
                break
            timeout = max(0.0, min(w.deadline for w in busy) - time.monotonic())
            readable, _, _ = select.select([w.fd for w in busy], [], [], min(timeout, 5.0))
            now = time.monotonic()
            for w in busy:
                if w.fd in readable:
                    chunk = os.read(w.fd, 1 << 20)
                    if chunk:
                        w.buf += chunk
                        self._drain(w, results, on_result)
                        continue
                    self._died(w, results, on_result, "")
                elif now > w.deadline:
                    self._died(w, results, on_result, "timeout")
        return results

    def run_one(self, case: Case) -> Result:
        return self.run([case])[0]

    def _drain(self, w: _Worker, results: list[Result], on_result) -> None:
        while b"\n" in w.buf:
            line, w.buf = w.buf.split(b"\n", 1)
            text = line.decode("utf-8", "replace")
            if text == "READY":
                w.ready = True
                self._failed_starts = 0
                continue
            result = Result.from_json(text)
            w.case = None
            w.done += 1
            self._deliver(result, results, on_result)
        if w.ready and w.case is None and w.done >= RECYCLE_AFTER:
            self._replace(w, retire=True)

    def _deliver(self, result: Result, results: list[Result], on_result) -> None:
        results.append(result)
        if on_result:
            on_result(result)

    def _died(self, w: _Worker, results: list[Result], on_result, why: str) -> None:
        case = w.case
        if why == "timeout":
            self._kill(w)
        else:
            try:
                w.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._kill(w)
        code = w.proc.returncode
        tail = self._tail(w)
        if case is None:  # died between cases or before READY
            self._close_fd(w)
            self._workers.remove(w)
            if not w.ready:
                self._failed_starts += 1
                if self._failed_starts >= 3:
                    raise RuntimeError(f"the robustness worker cannot start (exit {code}): {tail}")
            return
        if why == "timeout":
            detail = f"hung: killed after {case.timeout:.0f} s"
        elif code is not None and code < 0:
            detail = f"killed by {signal.Signals(-code).name}"
        else:
            detail = f"the worker exited with status {code} without reporting"
        elapsed = time.monotonic() - w.started
        self._deliver(Result(case.id, case.family, FAIL_ABORT, f"{detail}; last output: {tail}", round(elapsed, 3)),
                      results, on_result)
        self._replace(w, retire=False)

    def _replace(self, w: _Worker, retire: bool) -> None:
        if retire:
            self._retire(w)
        else:
            self._close_fd(w)
        self._workers[self._workers.index(w)] = self._start()

    @staticmethod
    def _tail(w: _Worker, lines: int = 6) -> str:
        """Return the last lines the worker printed during its current case, on one line."""
        try:
            with open(w.log, "rb") as f:
                f.seek(w.log_offset)
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return "(no log)"
        return crash_summary(text, lines)
