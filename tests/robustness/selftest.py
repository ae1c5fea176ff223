"""Recipes that misbehave on purpose, one per outcome class: the harness must classify each right.

They are not part of any family (no run reports them); test_robustness.py runs them through a pool.
"""
from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

import numpy as np

from .harness import Case, MustFail, attempt, judge, recipe


class _NotLuisaml(Exception):
    pass


@recipe("selftest.pass")
def _pass(ctx) -> None:
    judge(attempt(lambda: {"y": np.array([1.0, np.nan])}), reference={"y": np.array([1.0, np.nan])})


@recipe("selftest.abort")
def _abort(ctx) -> None:
    os.abort()


@recipe("selftest.segfault")
def _segfault(ctx) -> None:
    ctypes.string_at(0)


@recipe("selftest.exit")
def _exit(ctx) -> None:
    os._exit(3)


@recipe("selftest.hang")
def _hang(ctx) -> None:
    time.sleep(3600)


@recipe("selftest.inject")
def _inject(ctx) -> None:
    Path(ctx.marker).touch()


@recipe("selftest.wrong")
def _wrong(ctx) -> None:
    judge(attempt(lambda: {"y": np.array([1.0, 0.0])}), reference={"y": np.array([1.0, np.nan])})


@recipe("selftest.accepts")
def _accepts(ctx) -> None:
    judge(attempt(lambda: {}), reference=MustFail("a model with a cycle"))


@recipe("selftest.foreign_error")
def _foreign(ctx) -> None:
    def act():
        raise _NotLuisaml("boom")

    judge(attempt(act), offender="x")


@recipe("selftest.unnamed")
def _unnamed(ctx) -> None:
    import luisaml

    def act():
        raise luisaml.ModelError("something is wrong")

    judge(attempt(act), offender="node_7")


@recipe("selftest.harness_bug")
def _harness_bug(ctx) -> None:
    {}["missing"]


SELFTESTS = {
    "selftest.pass": "PASS", "selftest.abort": "FAIL_ABORT", "selftest.segfault": "FAIL_ABORT",
    "selftest.exit": "FAIL_ABORT", "selftest.hang": "FAIL_ABORT", "selftest.inject": "FAIL_INJECTION",
    "selftest.wrong": "FAIL_WRONG", "selftest.accepts": "FAIL_WRONG", "selftest.foreign_error": "FAIL_ERROR",
    "selftest.unnamed": "FAIL_ERROR", "selftest.harness_bug": "FAIL_HARNESS",
}


def cases() -> list[Case]:
    return [Case(f"selftest/{name.split('.')[1]}", "selftest", name, timeout=8 if name.endswith("hang") else 60)
            for name in SELFTESTS]
