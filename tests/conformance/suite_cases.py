"""What the ONNX backend suite holds: every case's kind, op types and element types, read from
the models themselves, so that the triage and the report speak about ops and dtypes, not names."""
from __future__ import annotations

import functools
import os
import re
import warnings
from dataclasses import dataclass

import onnx
from onnx import TensorProto
from onnx.backend.test.loader import load_model_tests

# kind as onnx names it -> the test class BackendTest generates for it
KINDS = {
    "node": "OnnxBackendNodeModelTest",
    "simple": "OnnxBackendSimpleModelTest",
    "pytorch-converted": "OnnxBackendPyTorchConvertedModelTest",
    "pytorch-operator": "OnnxBackendPyTorchOperatorModelTest",
    "real": "OnnxBackendRealModelTest",
}
KIND_OF_CLASS = {v: k for k, v in KINDS.items()}
ONNX_ROOT = os.path.dirname(os.path.dirname(onnx.__file__))
HERE = os.path.dirname(os.path.abspath(__file__))
EXPECTED = os.path.join(HERE, "expected_counts.json")  # the recorded pass counts per kind
RESULTS_ENV = "LUISAML_CONFORMANCE_RESULTS"  # where the pytest plugin writes each case's outcome
NO_TRIAGE_ENV = "LUISAML_CONFORMANCE_NO_TRIAGE"  # set: run every case, triage ignored


@dataclass(frozen=True)
class Case:
    """One case of the suite, as the triage and the report see it."""

    name: str  # as onnx names it, without the _cpu / _cuda suffix
    kind: str
    op: str  # the op type the case is about ("Conv"; "model" for whole-model cases)
    ops: frozenset[str]  # every op type its graphs use ("domain::Op" outside ai.onnx)
    types: frozenset[str]  # every ONNX element/container type it touches ("FLOAT", "DOUBLE", "SEQUENCE")


def op_name(domain: str, op_type: str) -> str:
    """Return 'Op' for ai.onnx and 'domain::Op' for other domains."""
    return op_type if domain in ("", "ai.onnx") else f"{domain}::{op_type}"


def _type_names(tp: onnx.TypeProto, out: set[str]) -> None:
    which = tp.WhichOneof("value")
    if which == "tensor_type":
        out.add(TensorProto.DataType.Name(tp.tensor_type.elem_type))
    elif which == "sparse_tensor_type":
        out.add("SPARSE_TENSOR")
    elif which == "sequence_type":
        out.add("SEQUENCE")
        _type_names(tp.sequence_type.elem_type, out)
    elif which == "optional_type":
        out.add("OPTIONAL")
        _type_names(tp.optional_type.elem_type, out)
    elif which == "map_type":
        out.add("MAP")


def _scan_graph(g: onnx.GraphProto, ops: set[str], types: set[str]) -> None:
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        _type_names(vi.type, types)
    for t in g.initializer:
        types.add(TensorProto.DataType.Name(t.data_type))
    for n in g.node:
        ops.add(op_name(n.domain, n.op_type))
        for a in n.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                types.add(TensorProto.DataType.Name(a.t.data_type))
            elif a.type == onnx.AttributeProto.GRAPH:
                _scan_graph(a.g, ops, types)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for sub in a.graphs:
                    _scan_graph(sub, ops, types)
            elif a.name in ("to", "dtype", "output_dtype") and a.type == onnx.AttributeProto.INT and a.i:
                types.add(TensorProto.DataType.Name(a.i))


def scan_model(model: onnx.ModelProto) -> tuple[frozenset[str], frozenset[str]]:
    """Return (op types, element types) a model uses, its local functions included."""
    ops: set[str] = set()
    types: set[str] = set()
    _scan_graph(model.graph, ops, types)
    for f in model.functions:
        for n in f.node:
            ops.add(op_name(n.domain, n.op_type))
    ops -= {op_name(f.domain, f.name) for f in model.functions}
    return frozenset(ops), frozenset(types)


def _model_of(tc) -> onnx.ModelProto:
    if tc.model is not None:
        return tc.model
    if tc.model_dir is not None:
        return onnx.load(os.path.join(tc.model_dir, "model.onnx"))
    return onnx.load(os.path.join(ONNX_ROOT, tc.url))  # the local `light` models of the real kind


def _expanded_base(name: str, names: set[str]) -> str | None:
    """Return the non-expanded case an *_expanded case runs through its function body."""
    for cand in (name.replace("_expanded", ""), re.sub(r"_expanded.*$", "", name)):
        if cand in names:
            return cand
    return None


@functools.lru_cache(maxsize=1)
def all_cases() -> dict[str, Case]:
    """Return every case of the suite by name (node cases are built in memory: ~8 s)."""
    out: dict[str, Case] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the case generators overflow casts on purpose
        for kind in KINDS:
            tcs = load_model_tests(kind=kind)
            scanned = {tc.name: scan_model(_model_of(tc)) for tc in tcs}
            for tc in tcs:
                ops, types = scanned[tc.name]
                if kind != "node":
                    op = "model"
                else:
                    base = _expanded_base(tc.name, set(scanned)) if "_expanded" in tc.name else tc.name
                    main = scanned[base][0] if base else ops
                    op = sorted(main)[0] if len(main) == 1 else "+".join(sorted(main))
                out[tc.name] = Case(tc.name, kind, op, ops, types)
    return out


def strip_device(test_name: str) -> str:
    """Return a runner test name without its _cpu / _cuda suffix."""
    return re.sub(r"_(cpu|cuda)$", "", test_name)
