"""pytest plugin for the ONNX backend suite (loaded by tests/conftest.py, so that it also runs on
the pytest-xdist controller, where every worker's results arrive).

It records each case's outcome, writes them to $LUISAML_CONFORMANCE_RESULTS (JSON) when set,
and after a run that covered a whole kind checks its pass count against expected_counts.json:
fewer passes than recorded fails the session."""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile

import pytest

from .suite_cases import EXPECTED, KIND_OF_CLASS, RESULTS_ENV
_NODEID = re.compile(r"::(OnnxBackend\w+ModelTest)::(test_\w+?)_(cpu|cuda)$")
_RANK = {"failed": 4, "xpassed": 3, "xfailed": 2, "skipped": 1, "passed": 0}


def _phase_outcome(report) -> str | None:
    wasxfail = hasattr(report, "wasxfail")
    if report.failed:
        return "failed"
    if report.skipped:
        return "xfailed" if wasxfail else "skipped"
    if report.when == "call":
        return "xpassed" if wasxfail else "passed"
    return None


def _message(report) -> str:
    if report.skipped:
        if hasattr(report, "wasxfail"):
            return str(report.wasxfail)
        lr = report.longrepr
        return str(lr[2] if isinstance(lr, tuple) and len(lr) == 3 else lr).removeprefix("Skipped: ")
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr or "")
    return " ".join(text.split())[:500]


def load_expected() -> dict:
    """Return expected_counts.json ({"kinds": {kind: {"cases", "passed"}}}), or an empty record."""
    if not os.path.exists(EXPECTED):
        return {"kinds": {}}
    with open(EXPECTED) as f:
        return json.load(f)


class ConformanceRecorder:
    """Collects outcomes per case and checks the pass counts at the end of the session."""

    def __init__(self) -> None:
        self.results: dict[str, dict] = {}
        self.lines: list[str] = []
        self.dropped = False

    def pytest_runtest_logreport(self, report) -> None:
        m = _NODEID.search(report.nodeid)
        outcome = _phase_outcome(report) if m else None
        if outcome is None:
            return
        name = m.group(2)
        prev = self.results.get(name)
        if prev is None or _RANK[outcome] > _RANK[prev["outcome"]]:
            msg = _message(report) if outcome != "passed" else ""
            self.results[name] = {"kind": KIND_OF_CLASS[m.group(1)], "outcome": outcome, "message": msg}

    def counts(self) -> dict[str, dict[str, int]]:
        """Return {kind: {outcome: count, "cases": n}} of what ran."""
        out: dict[str, dict[str, int]] = {}
        for r in self.results.values():
            k = out.setdefault(r["kind"], {"cases": 0})
            k["cases"] += 1
            k[r["outcome"]] = k.get(r["outcome"], 0) + 1
        return out

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session) -> None:
        if hasattr(session.config, "workerinput") or not self.results:
            return  # an xdist worker: the controller sees every result
        path = os.environ.get(RESULTS_ENV)
        if path:
            with open(path, "w") as f:
                json.dump(self.results, f, indent=1, sort_keys=True)
        expected = load_expected()["kinds"]
        for kind, c in sorted(self.counts().items()):
            want = expected.get(kind)
            line = f"{kind}: {c.get('passed', 0)}/{c['cases']} passed"
            extra = [f"{c[o]} {o}" for o in ("failed", "xfailed", "skipped", "xpassed") if c.get(o)]
            line += f" ({', '.join(extra)})" if extra else ""
            if want is None:
                line += "; no expected count recorded"
            elif c["cases"] != want["cases"]:
                line += f"; partial run ({c['cases']} of {want['cases']} cases): count not checked"
            elif c.get("passed", 0) < want["passed"]:
                line += f"; FEWER THAN THE {want['passed']} RECORDED in {os.path.relpath(EXPECTED)}"
                self.dropped = True
            else:
                line += f"; recorded {want['passed']}"
            self.lines.append(line)
        if self.dropped and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.lines:
            return
        terminalreporter.section("ONNX backend suite (luisaml)")
        for line in self.lines:
            terminalreporter.line(line, red="FEWER" in line)


def pytest_configure(config) -> None:
    # The `real` cases write their data sets under $ONNX_HOME: keep them in a temporary folder
    # (made once by the controller or the plain run; xdist workers inherit the environment).
    if not hasattr(config, "workerinput") and not os.environ.get("LUISAML_KEEP_ONNX_HOME"):
        home = tempfile.mkdtemp(prefix="luisaml-onnx-home-")
        os.environ["ONNX_HOME"] = home
        config.add_cleanup(lambda: shutil.rmtree(home, ignore_errors=True))
    config.pluginmanager.register(ConformanceRecorder(), "luisaml-conformance-recorder")
