"""Shared fixtures: the CPU device, and helpers to build ONNX models and compare with onnxruntime."""
from __future__ import annotations

import os

import pytest

# The ONNX backend suite's recorder must run where results arrive (also the xdist controller).
pytest_plugins = ["conformance.pytest_plugin"]

# Tests run on the CPU backend unless told otherwise; generated modules go to a per-run cache.
os.environ.setdefault("LUISAML_BACKEND", "cpu")


@pytest.fixture(scope="session", autouse=True)
def _device():
    import luisaml.device

    luisaml.device.init(os.environ["LUISAML_BACKEND"])
    yield
