"""Shared fixtures: the CPU device, and the split between the CI run and the full run.

CI runs the suite without the tests marked `full` (the larger cases of suites that keep a small one
in CI: today four of the ONNX suite's nine real models) and with the robustness sample;
`bash scripts/test.sh --full` (pytest's `--full`) runs every test, every robustness case and the
artifact fuzzer's full run (hours on 2 cores).

LUISAML_FAILURE_LOG=path appends each failure's report to that file as it happens (in the xdist
controller too), so a run cut by a time limit on the lent GPU machine still says why its tests
failed (2026-12-07: a run stopped by `timeout` named six failures and none of their messages)."""
from __future__ import annotations

import os

import pytest
from suite_mode import FULL_ENV, full_run

# The ONNX backend suite's recorder must run where results arrive (also the xdist controller).
pytest_plugins = ["conformance.pytest_plugin"]

# Tests run on the CPU backend unless told otherwise; generated modules go to a per-run cache.
os.environ.setdefault("LUISAML_BACKEND", "cpu")


def pytest_addoption(parser) -> None:
    parser.addoption("--full", action="store_true", default=False,
                     help="the full run: tests marked `full`, every robustness case, the full artifact fuzz")


def pytest_configure(config) -> None:
    # set before collection, in the controller and in every xdist worker (they get the same options)
    if config.getoption("--full"):
        os.environ[FULL_ENV] = "full"


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get("LUISAML_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a", encoding="utf-8") as log:
            log.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n")


def pytest_collection_modifyitems(config, items) -> None:
    # deselected, not skipped: the conformance recorder then sees a partial run, not missing passes
    if full_run():
        return
    drop = [item for item in items if item.get_closest_marker("full")]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = [item for item in items if not item.get_closest_marker("full")]


@pytest.fixture(scope="session", autouse=True)
def _device(request):
    import luisaml.device

    # a process (an xdist worker) that runs tensor-core tests starts CUDA in the compiler front's
    # directory (a device starts once: started plainly, those tests could only skip); every other
    # kernel is byte-identical there (luisaml/tensor_cores.py)
    front = any(item.path.name == "test_tensor_cores_cuda.py" for item in request.session.items)
    luisaml.device.init(os.environ["LUISAML_BACKEND"], tensor_cores=front)
    yield
