"""The fuzz's triage: every known class of mismatch between luisaml and onnxruntime, and why it is
not (or not yet) a luisaml bug. A mismatch that no class matches fails its fuzz case.

A mismatch record (fuzz.localise) says which op first differs (`culprit`), how (`kind`:
nan_dropped, spurious_nan, inf, value, dtype, shape, missing, error, crash), whether that node's
inputs held NaN or infinities (`input_special`), whether luisaml agrees with onnx.reference there
(`reference_agrees`), and the magnitude of integer results (`int_range`); and the node evaluated
alone by onnx.reference on each engine's own input values (fuzz.node_evidence: `upstream_differs`,
`own_inputs_agree`, `ort_own_inputs_agree`, `amplification`). `fused_only`: the node differs only when
its output is the graph's only one (luisaml or onnxruntime fused it into its reader), its inputs taken
from the run with every intermediate exposed. A class matches on those fields. Keep each class narrow and its reason true: a class that hides a real bug is worse
than a failing case. The NaN drops the outside probe found (Relu, Max, Min, HardSigmoid, Clip,
ReduceMax) are deliberately absent: they are bugs.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

INT32_MAX = 2**31 - 1
AMPLIFIED = 10.0  # ill_conditioned_after_upstream_rounding: the output's relative difference over the inputs'


@dataclass(frozen=True)
class Known:
    name: str
    reason: str
    ops: frozenset = frozenset()  # culprit op types; empty: any op
    kinds: frozenset = frozenset()  # mismatch kinds; empty: any kind
    when: Callable[[dict], bool] = field(default=lambda r: True)

    def matches(self, r: dict) -> bool:
        return ((not self.ops or r.get("culprit") in self.ops) and (not self.kinds or r.get("kind") in self.kinds)
                and bool(self.when(r)))


def _float_to_int(r: dict) -> bool:
    dts = r.get("input_dtypes") or []
    return bool(dts) and dts[0] in ("float32", "float16")


KNOWN: list[Known] = [
    Known("onnxruntime_differs_from_reference",
          "onnxruntime and onnx.reference disagree on NaN/infinity handling here and luisaml follows the ONNX "
          "reference (e.g. onnxruntime's ReduceMax and MaxPool skip a NaN in some positions)",
          kinds=frozenset({"nan_dropped", "spurious_nan", "inf", "value"}),
          when=lambda r: r.get("reference_agrees") is True
          and (r.get("input_special") is True or r.get("kind") == "value")),
    Known("cast_undefined",
          "Cast of NaN, infinity or a float beyond the target's range to an integer type is undefined in ONNX "
          "(C++ conversion UB); onnxruntime's result is whatever its compiler emitted",
          ops=frozenset({"Cast"}), kinds=frozenset({"value"}),
          when=lambda r: _float_to_int(r) and (r.get("input_special") or (r.get("largest_input") or 0) > INT32_MAX)),
    Known("int64_wraps_at_32_bits",
          "int64 tensors live in 32 bits inside kernels; arithmetic whose true result passes int32 wraps "
          "(documented in README: only values entering the kernel are range-checked)",
          kinds=frozenset({"value"}), when=lambda r: (r.get("int_range") or 0) > INT32_MAX),
    Known("maxpool_window_nan",
          "MaxPool over a window holding NaN: ONNX does not say; onnxruntime keeps the NaN in some window "
          "positions and skips it in others (and gives -FLT_MAX for a window of padding only), onnx.reference "
          "always skips it (its padding is NaN); luisaml propagates it, as torch's max_pool does",
          ops=frozenset({"MaxPool", "GlobalMaxPool"}), kinds=frozenset({"spurious_nan", "nan_dropped"}),
          when=lambda r: r.get("input_special") is True),
    Known("reduce_extreme_of_nan",
          "ReduceMax/ReduceMin over NaN: luisaml gives NaN, as numpy and onnx.reference do; onnxruntime's "
          "vectorised max/min keeps or drops the NaN by its position (tests/operators/test_nan.py)",
          ops=frozenset({"ReduceMax", "ReduceMin"}), kinds=frozenset({"spurious_nan"}),
          when=lambda r: r.get("input_special") is True),
    Known("maxpool_padding_only_window",
          "MaxPool over a window that holds only padding: ONNX does not say; onnxruntime gives -FLT_MAX, "
          "onnx.reference fails (an empty max), torch refuses such pads; luisaml gives -inf, the identity of max",
          ops=frozenset({"MaxPool"}), kinds=frozenset({"inf"}),
          when=lambda r: "expected -3.4028234663852886e+38" in (r.get("detail") or "")),
    Known("maxpool_all_negative_infinity",
          "a MaxPool or GlobalMaxPool window whose every element is -inf: onnxruntime gives -FLT_MAX (its max "
          "starts at the lowest finite float), numpy, torch and onnx.reference -inf; luisaml gives -inf",
          ops=frozenset({"MaxPool", "GlobalMaxPool"}), kinds=frozenset({"inf"}),
          when=lambda r: r.get("input_special") is True
          and "-inf, expected -3.4028234663852886e+38" in (r.get("detail") or "")),
    Known("hardmax_of_nan",
          "Hardmax of a line holding NaN: ONNX does not say; onnxruntime's vectorised max keeps or drops the NaN "
          "by its position, onnx.reference marks the first NaN; luisaml gives the line all 0 (onnxruntime's "
          "answer for a line of NaN; tests/operators/test_nan.py)",
          ops=frozenset({"Hardmax"}), kinds=frozenset({"value"}), when=lambda r: r.get("input_special") is True),
    Known("cuda_transcendental_accuracy",
          "the CUDA backend's sin/cos/tan/pow differ from onnxruntime's by a few ulp (the same graphs match on "
          "the CPU backend); "
          "where the result is ill-conditioned (tan near a pole, cos near a zero, a Mod of a power) the "
          "difference passes the fuzz's tolerance. Only under LUISAML_BACKEND=cuda",
          ops=frozenset({"Sin", "Cos", "Tan", "Pow", "Mod"}), kinds=frozenset({"value"}),
          when=lambda r: os.environ.get("LUISAML_BACKEND") == "cuda" and not r.get("input_special")),
    Known("trig_of_a_large_argument",
          "Sin/Cos/Tan of an argument beyond 1000 computed upstream (a Pow, say): one ulp of such an argument "
          "is 6e-5 rad or more, so an upstream result equal within the tolerance but not to the bit moves the "
          "sine past it",
          ops=frozenset({"Sin", "Cos", "Tan"}), kinds=frozenset({"value"}),
          when=lambda r: (r.get("largest_input") or 0) > 1000),
    Known("ill_conditioned_after_upstream_rounding",
          "the node's inputs differ between the engines only within the fuzz's tolerance (each graph input is the "
          "same; upstream ops rounded differently), each engine computes the node right from its own inputs "
          "(onnx.reference, numpy underneath, evaluating the node alone on luisaml's inputs gives luisaml's "
          "output, on onnxruntime's inputs onnxruntime's), and the node amplifies the inputs' relative difference "
          "at least tenfold: an ill-conditioned op (a Cos of ~60 after a Tan near its pole and a Conv, 11:87). "
          "onnx.reference on the whole graph decides nothing here: it rounds upstream its own way too",
          kinds=frozenset({"value"}),
          when=lambda r: r.get("upstream_differs") is True and r.get("own_inputs_agree") is True
          and r.get("ort_own_inputs_agree") is True and not r.get("input_special")
          and (r.get("amplification") or 0) >= AMPLIFIED),
    Known("argmax_of_nan",
          "ArgMax/ArgMin/TopK over NaN: ONNX does not define the order of NaN, onnxruntime's comparisons make "
          "an arbitrary choice",
          ops=frozenset({"ArgMax", "ArgMin", "TopK"}), kinds=frozenset({"value"}),
          when=lambda r: r.get("input_special") is True),
]


def classify(r: dict) -> str | None:
    """Return the name of the first known class that matches a mismatch record, or None."""
    for k in KNOWN:
        if k.matches(r):
            return k.name
    return None
