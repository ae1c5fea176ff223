"""Loaders: every model source becomes one onnx ModelProto with its initializer data bound."""
from __future__ import annotations

import os

import numpy as np
import onnx

from .. import dtypes
from ..model import ModelError, check_tensor, shape_str
from .json_model import _fill_from_array, parse_json_model, to_json_model
from .weights import WeightSource, read_weights


def load_proto(model, weights=None) -> onnx.ModelProto:
    """Return the ModelProto of a path (.onnx or .json), JSON text or ModelProto, weights bound."""
    src = read_weights(weights)
    if isinstance(model, onnx.ModelProto):
        proto = onnx.ModelProto()
        proto.CopyFrom(model)
    elif isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if not os.path.exists(path):
            raise ModelError(f"model file '{path}' does not exist")
        if path.endswith(".json"):
            with open(path, "rb") as f:
                proto = parse_json_model(f.read(), src, origin=path)
            check_references(proto.graph)
            return proto
        try:
            proto = onnx.load(path)
        except Exception as e:
            raise ModelError(f"cannot read ONNX model '{path}': {e}") from e
    else:
        raise TypeError(f"model must be a path or an onnx.ModelProto, not {type(model).__name__}")
    if src is not None:
        bind_weights(proto, src)
    check_references(proto.graph)
    return proto


def check_references(g: onnx.GraphProto, outer: frozenset[str] = frozenset()) -> None:
    """Raise ModelError naming the node and input for a name nothing defines; put nodes listed out
    of order into topological order."""
    for t in g.initializer:
        check_tensor(t, f"graph '{g.name}' initializer")
    defined = set(outer) | {i.name for i in g.input} | {t.name for t in g.initializer} | {""}
    produced = {o: k for k, n in enumerate(g.node) for o in n.output if o}
    for k, n in enumerate(g.node):
        for i in n.input:
            if i not in defined and i not in produced:
                kind = f"{n.domain}::{n.op_type}" if n.domain else n.op_type
                raise ModelError(
                    f"node '{n.name or f'#{k}'}' ({kind}) input '{i}': no graph input, initializer or node "
                    "output of that name (a missing initializer? pass the weights file)"
                )
        for a in n.attribute:
            for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                check_references(sub, frozenset(defined | set(produced)))
    if any(produced.get(i, -1) > k for k, n in enumerate(g.node) for i in n.input):
        _toposort(g, defined)


def _toposort(g: onnx.GraphProto, defined: set[str]) -> None:
    """Reorder g.node topologically (stable), raising for a cycle."""
    ready = set(defined)
    todo = list(g.node)
    order = []
    while todo:
        rest = [n for n in todo if not all(i in ready for i in n.input)]
        done = [n for n in todo if all(i in ready for i in n.input)]
        if not done:
            raise ModelError(f"the graph has a cycle through node '{rest[0].name}' ({rest[0].op_type})")
        for n in done:
            ready |= set(n.output)
        order += done
        todo = rest
    del g.node[:]
    g.node.extend(order)


def _is_empty(t: onnx.TensorProto) -> bool:
    """Return whether an initializer carries no data although its dims say it has elements."""
    n = int(np.prod([int(d) for d in t.dims], dtype=np.int64))
    fields = (t.raw_data, t.float_data, t.int32_data, t.int64_data, t.double_data, t.uint64_data, t.string_data)
    return n > 0 and not any(len(f) for f in fields) and t.data_location != onnx.TensorProto.EXTERNAL


def bind_weights(proto: onnx.ModelProto, src: WeightSource) -> None:
    """Fill a protobuf model's data-less initializers (and graph inputs named like weights) from src."""
    g = proto.graph
    empty = [t for t in g.initializer if _is_empty(t)]
    if src.tensors:
        for t in empty:
            if t.name not in src.tensors:
                raise ModelError(f"initializer '{t.name}': has no data and {src.origin} has no tensor of that name")
            _fill_from_array(t, src.tensors[t.name], src.origin)
        # weights exported as graph inputs (export_params=False) become initializers
        for vi in [i for i in g.input if i.name in src.tensors]:
            arr = src.tensors[vi.name]
            want = dtypes.SUPPORTED.get(vi.type.tensor_type.elem_type)
            if want is not None and arr.dtype != want.numpy:
                raise ModelError(f"graph input '{vi.name}': {src.origin} holds {arr.dtype}, expected {want.numpy}")
            g.initializer.append(onnx.numpy_helper.from_array(arr, vi.name))
            g.input.remove(vi)
        return
    # a header-less blob: the data-less initializers, sorted by name, back to back
    if not empty:
        raise ModelError(
            f"{src.origin} is a header-less weight blob, but the model has no initializer without data to fill"
        )
    offset = 0
    for t in sorted(empty, key=lambda t: t.name):
        dt = dtypes.from_onnx(t.data_type)
        nbytes = int(np.prod([int(d) for d in t.dims], dtype=np.int64)) * dt.numpy.itemsize
        if offset + nbytes > len(src.data):
            raise ModelError(
                f"initializer '{t.name}' {dt.name.lower()}{shape_str(tuple(t.dims))}: needs bytes "
                f"[{offset}, {offset + nbytes}) but {src.origin} has {len(src.data)}"
            )
        t.raw_data = src.data[offset : offset + nbytes]
        offset += nbytes
    if offset != len(src.data):
        raise ModelError(f"{src.origin}: {len(src.data)} bytes, but the model's initializers take {offset}")


__all__ = ["load_proto", "read_weights", "WeightSource", "parse_json_model", "to_json_model", "bind_weights"]
