"""The case model: what a case is, how its outcome is classified, and the checks recipes use.

A case is a recipe name plus JSON-able parameters (so a worker process can rebuild it from one line
of text) and the family it belongs to. A recipe builds its inputs in the case's own folder, runs one
luisaml action through `attempt`, and judges the attempt with `judge` (or raises `Fail` itself).
Anything a recipe does not catch is classified by where it came from: an exception raised inside
luisaml is FAIL_ERROR, one raised by the recipe's own code is FAIL_HARNESS (a bug in this suite).

The outcomes, in the words of the issue:
- PASS: a correct result (checked against an outside reference: onnxruntime, numpy, the
  safetensors library, onnx.reference) or a luisaml error whose message names the offender.
- FAIL_ABORT: the worker process died (a signal, an exit without a report) or hung past its timeout.
- FAIL_INJECTION: a marker file that only code smuggled into a name could have created exists.
- FAIL_WRONG: a wrong result, or a malformed input accepted as if it were valid.
- FAIL_ERROR: an exception that is not a luisaml.LuisamlError, or one whose message does not name
  the offender, or a luisaml error for a valid input that must work.
- FAIL_HARNESS: the recipe itself broke (fix the suite, not luisaml).
"""
from __future__ import annotations

import dataclasses
import json
import os
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np

PASS = "PASS"
FAIL_ABORT = "FAIL_ABORT"
FAIL_INJECTION = "FAIL_INJECTION"
FAIL_WRONG = "FAIL_WRONG"
FAIL_ERROR = "FAIL_ERROR"
FAIL_HARNESS = "FAIL_HARNESS"
OUTCOMES = (PASS, FAIL_ABORT, FAIL_INJECTION, FAIL_WRONG, FAIL_ERROR, FAIL_HARNESS)

REPO = Path(__file__).resolve().parents[2]
# where luisaml's code lives (operators/, opsets/ and shaders/ ship as luisaml.operators, ...)
LUISAML_DIRS = tuple(str(REPO / d) + os.sep for d in ("luisaml", "operators", "opsets", "shaders"))


@dataclass(frozen=True)
class Case:
    """One recipe run with one set of parameters; `id` is stable across runs (reports, -k)."""

    id: str
    family: str
    recipe: str
    params: dict = field(default_factory=dict, hash=False, compare=False)
    timeout: float = 90.0
    ci: bool = False  # always part of the CI sample (a probe finding, or a class representative)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @staticmethod
    def from_json(text: str) -> "Case":
        return Case(**json.loads(text))


@dataclass
class Result:
    case_id: str
    family: str
    outcome: str
    detail: str = ""
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)  # per-family data (the fuzz's mismatch records)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), default=str)

    @staticmethod
    def from_json(text: str) -> "Result":
        return Result(**json.loads(text))


class Fail(Exception):
    """Raised by a recipe to end its case with a failing outcome."""

    def __init__(self, outcome: str, detail: str):
        super().__init__(detail)
        self.outcome, self.detail = outcome, detail


# ---- recipes ---------------------------------------------------------------------------------

RECIPES: dict[str, Callable] = {}


def recipe(name: str):
    """Register a recipe function `fn(ctx, **params)` under `name` (what a Case names)."""

    def deco(fn):
        if name in RECIPES:
            raise ValueError(f"recipe {name!r} registered twice")
        RECIPES[name] = fn
        return fn

    return deco


@dataclass
class Context:
    """What a recipe gets: its folder (removed after the case), the marker file an injected
    payload would create, and where to dump reproducers."""

    dir: Path
    case: Case
    dump_dir: Path | None = None
    extra: dict = field(default_factory=dict)

    @property
    def marker(self) -> str:
        return str(self.dir / "INJECTED")

    def path(self, name: str) -> Path:
        return self.dir / name


# ---- attempts and verdicts ---------------------------------------------------------------------


@dataclass
class Attempt:
    """The outcome of one luisaml action: a value, or the exception it raised."""

    value: Any = None
    error: BaseException | None = None
    tb: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def luisaml_error(self) -> bool:
        import luisaml

        return isinstance(self.error, luisaml.LuisamlError)

    def describe(self) -> str:
        if self.error is None:
            return "no error"
        return f"{type(self.error).__module__}.{type(self.error).__qualname__}: {short(str(self.error))}"


def attempt(fn: Callable, *args, **kwargs) -> Attempt:
    """Run a luisaml action and return what happened (SystemExit and KeyboardInterrupt included:
    luisaml must raise neither)."""
    try:
        return Attempt(value=fn(*args, **kwargs))
    except Fail:
        raise  # a check inside the action (smuggled code in the generated source) decided already
    except BaseException as e:  # noqa: BLE001 - classifying every escape is the point
        if isinstance(e, KeyboardInterrupt) and os.environ.get("ROBUSTNESS_INPROCESS"):
            raise
        return Attempt(error=e, tb=traceback.format_exc(limit=-6))


def short(text: str, n: int = 300) -> str:
    """Return text on one line, cut to about n characters."""
    text = ascii(text)[1:-1] if any(c in text for c in "\r\n\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029") else text
    return text if len(text) <= n else text[: n - 3] + "..."


def name_forms(name: str) -> set[str]:
    """Return the ways a message may legitimately spell a name: as is, or escaped (repr, ascii,
    JSON); a long name may be cut, so its first 24 characters in any form also count."""
    forms = {name, repr(name)[1:-1], ascii(name)[1:-1], json.dumps(name)[1:-1],
             name.encode("unicode_escape").decode("ascii")}
    if len(name) > 40:
        forms |= {f[:24] for f in list(forms)}
    return {f for f in forms if f}


def names_offender(message: str, offender: str | Iterable[str]) -> bool:
    """Return whether message names the offender (any one of them when several are acceptable)."""
    alts = [offender] if isinstance(offender, str) else list(offender)
    return any(form in message for name in alts for form in name_forms(name))


class MustFail:
    """The reference of an input that is not valid: any result at all is wrong."""

    def __init__(self, why: str):
        self.why = why


def compare_outputs(got: Mapping[str, Any], want: Mapping[str, np.ndarray], rtol: float = 1e-5,
                    atol: float = 1e-6) -> str | None:
    """Return a description of the first difference between got and want, or None when they agree
    (dtype, shape, NaN and infinity positions exactly; finite floats to rtol/atol; others exactly)."""
    for name, w in want.items():
        if name not in got:
            return f"output {name!r} is missing (got {sorted(got)})"
        g = got[name]
        if type(g).__module__.startswith("torch"):
            g = g.numpy()
        g, w = np.asarray(g), np.asarray(w)
        if g.dtype != w.dtype:
            return f"output {name!r}: dtype {g.dtype}, expected {w.dtype}"
        if g.shape != w.shape:
            return f"output {name!r}: shape {g.shape}, expected {w.shape}"
        diff = array_difference(g, w, rtol, atol)
        if diff:
            return f"output {name!r}: {diff}"
    return None


def array_difference(g: np.ndarray, w: np.ndarray, rtol: float, atol: float) -> str | None:
    """Return how two same-shape arrays differ, or None."""
    if w.dtype.kind not in "fc":
        bad = np.argwhere(g != w)
        if len(bad):
            i = _index(bad[0])
            return f"{len(bad)} of {w.size} elements differ; at {i}: {g[i].item()!r}, expected {w[i].item()!r}"
        return None
    g64, w64 = g.astype(np.float64), w.astype(np.float64)
    gn, wn = np.isnan(g64), np.isnan(w64)
    if (gn != wn).any():
        i = _index(np.argwhere(gn != wn)[0])
        kind = "NaN dropped" if wn[i] else "spurious NaN"
        return f"{kind}: {int((gn != wn).sum())} of {w.size} elements; at {i}: {g[i].item()!r}, expected {w[i].item()!r}"
    gi, wi = np.isinf(g64), np.isinf(w64)
    both = ~(gn | wn)
    inf_bad = both & (gi | wi) & (g64 != w64)
    if inf_bad.any():
        i = _index(np.argwhere(inf_bad)[0])
        return f"infinity differs in {int(inf_bad.sum())} elements; at {i}: {g[i].item()!r}, expected {w[i].item()!r}"
    fin = both & ~(gi | wi)
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.abs(g64 - w64) > atol + rtol * np.abs(w64)
    err &= fin
    if err.any():
        i = _index(np.argwhere(err)[0])
        return (f"{int(err.sum())} of {w.size} elements beyond rtol={rtol:g} atol={atol:g}; at {i}: "
                f"{g[i].item()!r}, expected {w[i].item()!r}")
    return None


def _index(i) -> tuple[int, ...]:
    return tuple(int(v) for v in i)


def judge(a: Attempt, *, offender: str | Iterable[str] | None = None,
          reference: Mapping[str, np.ndarray] | MustFail | Callable | None = None,
          error_ok: bool = True, rtol: float = 1e-5, atol: float = 1e-6, what: str = "") -> None:
    """Raise Fail unless the attempt is acceptable.

    offender: the name(s) a luisaml error must mention (None: an error is never acceptable).
    reference: the outputs a success must equal (a dict, or a callable returning one, computed only
    when needed), MustFail (no success is acceptable), or None (a success needs no check).
    error_ok: False when the input is valid and must work (a luisaml error is then FAIL_ERROR)."""
    label = f"{what}: " if what else ""
    if a.ok:
        if isinstance(reference, MustFail):
            raise Fail(FAIL_WRONG, f"{label}accepted {reference.why}")
        if callable(reference):
            reference = reference()
        if reference is not None:
            if not isinstance(a.value, Mapping):
                raise Fail(FAIL_HARNESS, f"{label}action returned {type(a.value).__name__}, not outputs")
            diff = compare_outputs(a.value, reference, rtol, atol)
            if diff:
                raise Fail(FAIL_WRONG, f"{label}{diff}")
        return
    if not a.luisaml_error:
        raise Fail(FAIL_ERROR, f"{label}{a.describe()}{_where(a)}")
    if not error_ok or offender is None:
        raise Fail(FAIL_ERROR, f"{label}a valid input was refused: {a.describe()}")
    if not names_offender(str(a.error), offender):
        alts = [offender] if isinstance(offender, str) else list(offender)
        names = ", ".join(short(ascii(o), 40) for o in alts[:4])
        raise Fail(FAIL_ERROR, f"{label}the message does not name {names}: {a.describe()}")


def _where(a: Attempt) -> str:
    return where(a.error) if a.error is not None else ""


def where(exc: BaseException) -> str:
    """Return ' (at file:line in fn)' for the innermost frame of an exception's traceback, and the
    innermost frame in luisaml's code when that is another one."""
    tb = exc.__traceback__
    frames = []
    while tb is not None:
        frames.append((tb.tb_frame.f_code, tb.tb_lineno))
        tb = tb.tb_next
    if not frames:
        return ""

    def fmt(frame) -> str:
        code, line = frame
        return f"{os.path.relpath(code.co_filename, REPO)}:{line} in {code.co_name}"

    ours = [f for f in frames if f[0].co_filename.startswith(LUISAML_DIRS)]
    where = f" (at {fmt(frames[-1])}"
    if ours and ours[-1] is not frames[-1]:
        where += f", from {fmt(ours[-1])}"
    return where + ")"


def raised_in_luisaml(exc: BaseException) -> bool:
    """Return whether an exception's traceback passes through luisaml's own code."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.startswith(LUISAML_DIRS):
            return True
        tb = tb.tb_next
    return False


def crash_summary(text: str, lines: int = 6) -> str:
    """Return the telling part of a dead process's output on one line: what it printed before
    "Fatal Python error" and the innermost frames faulthandler lists, else its last lines."""
    kept = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("=== case")]
    fatal = next((k for k, ln in enumerate(kept) if ln.startswith("Fatal Python error")), None)
    if fatal is not None:
        # faulthandler prints the innermost frame first
        frames = [ln for ln in kept[fatal + 1:] if ln.startswith("File ")][:3]
        return " | ".join(kept[max(0, fatal - 3):fatal + 1] + frames)[:1200]
    return " | ".join(kept[-lines:])[-1200:] or "(nothing)"
