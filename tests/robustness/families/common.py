"""What most families do with a model: save it, run one luisaml action on it, judge the outcome
against onnxruntime (or a fixed reference), and the expectation a recipe states."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import onnx

from .. import actions
from ..harness import MustFail, attempt, judge
from ..models import ReferenceRejected, ort_outputs, save

ORT = "ort"  # reference: onnxruntime's outputs for the same model and feeds


@dataclass
class Expect:
    """What a case expects: the name(s) an error must mention, the reference a success must equal
    (ORT, a dict, or MustFail), and whether an error is acceptable at all."""

    offender: Any = None
    reference: Any = ORT
    error_ok: bool = True
    rtol: float = 1e-5
    atol: float = 1e-5
    options: dict = field(default_factory=dict)  # luisaml.compile keyword arguments


# What luisaml may accept although onnxruntime refuses the model, because the intent is plain:
# (pattern in onnxruntime's refusal, how to make the model say what it means, the reason)
LENIENCIES = [
    ("Unrecognized attribute", "strip_unknown_attributes",
     "an attribute the op does not have is ignored (the ONNX checker flags it; the computation is unchanged)"),
    ("two nodes with same node name", "rename_nodes",
     "node names are labels: two nodes sharing one change nothing the graph computes"),
]


def strip_unknown_attributes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Return a copy without the attributes its ops' schemas do not define."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    opsets = {o.domain: o.version for o in out.opset_import}
    for n in out.graph.node:
        try:
            schema = onnx.defs.get_schema(n.op_type, opsets.get(n.domain, 1), n.domain)
        except Exception:  # noqa: BLE001 - an op onnx does not know: nothing to strip
            continue
        keep = [a for a in n.attribute if a.name in schema.attributes]
        del n.attribute[:]
        n.attribute.extend(keep)
    return out


def rename_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for k, n in enumerate(out.graph.node):
        n.name = f"{n.name}__{k}"
    return out


def ort_reference(model: onnx.ModelProto | bytes, feeds: Mapping[str, np.ndarray], why: str = "a model onnxruntime rejects"):
    """Return a callable computing onnxruntime's outputs, or MustFail when onnxruntime refuses
    (after the LENIENCIES: a refusal they explain is retried on the model they repair)."""

    def compute():
        # printed so that a crash inside onnxruntime is not mistaken for luisaml's (the abort's
        # detail shows the worker's last lines)
        print("--- computing the onnxruntime reference", flush=True)
        sys.stdout.flush()
        m = model
        for _ in range(len(LENIENCIES) + 1):
            try:
                return ort_outputs(m, feeds)
            except ReferenceRejected as e:
                fix = next((f for pattern, f, _ in LENIENCIES if pattern in str(e)), None)
                if fix is None or isinstance(m, bytes) and not _parses(m):
                    return MustFail(f"{why} ({e})")
                m = globals()[fix](m if isinstance(m, onnx.ModelProto) else onnx.load_from_string(m))
        return MustFail(why)

    return compute


def _parses(raw: bytes) -> bool:
    try:
        onnx.load_from_string(raw)
        return True
    except Exception:  # noqa: BLE001
        return False


def run_and_judge(ctx, model: onnx.ModelProto | None, feeds: Mapping[str, np.ndarray], expect: Expect,
                  action: str = "compile", weights=None, model_path: str | None = None, what: str = "") -> None:
    """Save the model (unless model_path is given), run the action and judge it."""
    path = model_path or save(model, ctx.path("model.onnx"))
    reference = expect.reference
    if reference == ORT:
        reference = _resolving(ort_reference(model if model is not None else open(path, "rb").read(), feeds))
    fn = {"compile": actions.compile_run, "instance": actions.instance_run}[action]
    a = attempt(fn, path, feeds, weights, **expect.options)
    judge(a, offender=expect.offender, reference=reference, error_ok=expect.error_ok, rtol=expect.rtol,
          atol=expect.atol, what=what)


class _resolving:
    """A lazy reference that may turn out to be MustFail (judge asks for it only on success)."""

    def __init__(self, compute):
        self.compute = compute

    def __call__(self):
        ref = self.compute()
        if isinstance(ref, MustFail):
            from ..harness import FAIL_WRONG, Fail

            raise Fail(FAIL_WRONG, f"accepted {ref.why}")
        return ref
