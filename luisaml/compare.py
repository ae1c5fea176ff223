"""`luisaml run --compare`: where an output is furthest past numpy.isclose's tolerance around a
reference, and the reference itself (onnxruntime's outputs of the same model and feeds)."""
from __future__ import annotations

import numpy as np

from .log import phase


class Worst:
    """The element of an output furthest past |got - want| <= atol + rtol * |want|."""

    def __init__(self, got: np.ndarray, want: np.ndarray, atol: float, rtol: float):
        g, w = got.astype(np.float64), want.astype(np.float64)
        same = (g == w) | (np.isnan(g) & np.isnan(w))  # equal infinities and NaN against NaN pass
        # subtracted only where they differ: inf - inf (an invalid operation numpy warns about) is `same`
        diff = np.abs(np.subtract(g, w, out=np.zeros_like(g), where=~same))
        diff = np.where(np.isnan(diff), np.inf, diff)  # NaN against a number: as far as it gets
        allowed = atol + rtol * np.abs(np.where(np.isfinite(w), w, 0.0))
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(diff == 0, 0.0, np.where(allowed > 0, diff / allowed, np.inf))
        flat = int(np.argmax(ratio)) if ratio.size else 0
        self.index = np.unravel_index(flat, got.shape) if got.size else ()
        self.index = tuple(int(i) for i in self.index)
        self.ratio = float(ratio.reshape(-1)[flat]) if got.size else 0.0
        self.diff = float(diff.max()) if got.size else 0.0
        self.got = float(g.reshape(-1)[flat]) if got.size else 0.0
        self.want = float(w.reshape(-1)[flat]) if got.size else 0.0
        self.bad = int(np.count_nonzero(ratio > 1))


def compare_outputs(got: np.ndarray, want: np.ndarray, atol: float, rtol: float) -> Worst:
    """Return where `got` is furthest past numpy.isclose's tolerance around `want` (ratio > 1: it fails)."""
    return Worst(got, want, atol, rtol)


def onnxruntime_outputs(model, weights, feeds) -> dict[str, np.ndarray] | None:
    """Return onnxruntime's outputs for the same model and feeds (weights bound the same way), or
    None after one line on stdout saying why it cannot run the model."""
    from .loaders import load_proto

    try:
        import onnxruntime as ort
    except ImportError:
        print("onnxruntime is not installed (pip install onnxruntime): outputs not compared")
        return None
    proto = load_proto(model, weights)
    try:
        with phase("onnxruntime"):
            sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
            names = [o.name for o in sess.get_outputs()]
            return dict(zip(names, sess.run(names, feeds)))
    except Exception as e:  # onnxruntime raises its own classes (Fail, InvalidGraph, NotImplemented, ...)
        custom = sorted({o.domain for o in proto.opset_import} - {"", "ai.onnx", "ai.onnx.ml", "com.microsoft"})
        why = " ".join(str(e).split())
        if "No Op registered" in why:
            why = why[why.index("No Op registered"):]
        why = why if len(why) <= 160 else why[:157] + "..."
        domains = f"; the model uses the domain {', '.join(repr(d) for d in custom)}" if custom else ""
        print(f"onnxruntime cannot run this model ({why}{domains}): outputs not compared")
        return None
