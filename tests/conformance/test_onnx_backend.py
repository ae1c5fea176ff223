"""onnx's backend test suite (node, simple, pytorch-converted, pytorch-operator, real) run on
luisaml through luisaml.onnx_backend, with the triage of triage.py applied.

The cases run only on the CPU device (the `_cuda` variants are dropped). The pass counts per
kind are checked against expected_counts.json by this folder's conftest when the whole suite
ran; `python tests/conformance/report.py` prints them per op type."""
from __future__ import annotations

import os
import re
import unittest
import warnings

import onnx.backend.test
import pytest

import triage
from suite_cases import KIND_OF_CLASS, NO_TRIAGE_ENV, all_cases, strip_device
from luisaml import registry
from luisaml.onnx_backend import LuisaBackend


def registered_ops() -> set[str]:
    """Return the op types luisaml registers ("domain::Op" outside ai.onnx)."""
    from luisaml import operators  # noqa: F401  (importing the package registers the shipped operators)
    return {op if dom == "" else f"{dom}::{op}" for dom, op in registry.registered()}


def triage_decision(name: str, registered: set[str]) -> tuple[str, str] | None:
    """Return ("skip" | "xfail", reason) for a case name (no device suffix), or None to run it."""
    if os.environ.get(NO_TRIAGE_ENV):
        return None
    case = all_cases()[name]
    bad_types = sorted(t for t in case.types if t in triage.UNSUPPORTED_TYPES)
    if bad_types and not any(re.search(p, name) for p in triage.TYPE_EXCEPTIONS):
        return "skip", f"{bad_types[0]}: {triage.UNSUPPORTED_TYPES[bad_types[0]]}"
    for pattern, reason in triage.EXCLUDED.items():
        if re.search(pattern, name):
            return "skip", reason
    missing = sorted(op for op in case.ops if op in triage.NOT_IMPLEMENTED and op not in registered)
    if missing:
        return "skip", "; ".join(f"{op}: {triage.NOT_IMPLEMENTED[op]}" for op in missing)
    for pattern, reason in triage.KNOWN_FAILURES.items():
        if re.search(pattern, name):
            return "xfail", reason
    return None


# The real models CI leaves to the full run (bash scripts/test.sh --full): the four slowest of the
# nine (63 of their 93 s of test time on 2 cores, 2026-12-05).
FULL_RUN_ONLY = {"test_vgg19", "test_densenet121", "test_inception_v2", "test_zfnet512"}


def _build_test_classes() -> dict[str, type]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # onnx's case generators overflow casts on purpose
        backend_test = onnx.backend.test.BackendTest(LuisaBackend, __name__)
    registered = registered_ops()
    classes = backend_test.test_cases
    for cls_name, cls in classes.items():
        assert cls_name in KIND_OF_CLASS, f"onnx added a test kind luisaml does not know: {cls_name}"
        cls.pytestmark = [pytest.mark.slow]
        for attr in [a for a in vars(cls) if a.startswith("test_")]:
            if attr.endswith("_cuda"):
                delattr(cls, attr)  # luisaml's suite measures the CPU backend only
                continue
            if strip_device(attr) in FULL_RUN_ONLY:
                setattr(cls, attr, pytest.mark.full(getattr(cls, attr)))
            decision = triage_decision(strip_device(attr), registered)
            if decision is None:
                continue
            what, reason = decision
            func = getattr(cls, attr)
            if what == "skip":
                setattr(cls, attr, unittest.skip(reason)(func))
            else:
                setattr(cls, attr, pytest.mark.xfail(reason=reason, strict=True)(func))
    return classes


globals().update(_build_test_classes())


def test_triage_is_current():
    """Every NOT_IMPLEMENTED op is still unregistered and used by a case; every pattern matches a case."""
    registered = registered_ops()
    stale = sorted(op for op in triage.NOT_IMPLEMENTED if op in registered)
    assert not stale, f"registered now: remove them from triage.NOT_IMPLEMENTED so that their cases run: {stale}"
    known = {op for c in all_cases().values() for op in c.ops}
    phantom = sorted(op for op in triage.NOT_IMPLEMENTED if op not in known)
    assert not phantom, f"triage.NOT_IMPLEMENTED names op types no case uses: {phantom}"
    names = list(all_cases())
    patterns = list(triage.EXCLUDED) + list(triage.KNOWN_FAILURES) + list(triage.TYPE_EXCEPTIONS)
    unused = [p for p in patterns if not any(re.search(p, n) for n in names)]
    assert not unused, f"triage patterns that match no case: {unused}"


def test_unimplemented_ops_are_triaged():
    """Every op type a case uses is registered or has a NOT_IMPLEMENTED line (with its reason)."""
    registered = registered_ops()
    used = {op for c in all_cases().values() for op in c.ops}
    triaged = set(triage.NOT_IMPLEMENTED) | set(triage.HANDLED_BY_PASSES)
    untriaged = sorted(op for op in used if op not in registered and op not in triaged)
    assert not untriaged, f"op types with neither an operator nor a triage.NOT_IMPLEMENTED line: {untriaged}"
