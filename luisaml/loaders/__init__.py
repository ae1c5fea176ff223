"""Loaders: every model source becomes one onnx ModelProto with its initializer data bound."""
from __future__ import annotations

import math
import os

import numpy as np
import onnx

from .. import dtypes
from ..errors import ModelError, WeightsError
from ..limits import DEFAULT, Limits
from ..model import shape_str
from .proto_model import check_tensor
from .json_model import _fill_from_array, parse_json_model, to_json_model
from .weights import WeightSource, read_weights
from ..opsets import luisaml as luisaml_domain

# onnx's checker and shape inference accept luisaml.* nodes once the domain's schemas are registered;
# the opset module leaves that to whoever imports onnx (a .lml load does not)
luisaml_domain.register()


def load_proto(model, weights=None, *, limits: Limits = DEFAULT) -> onnx.ModelProto:
    """Return the ModelProto of a path (.onnx or .json), JSON text or ModelProto, weights bound."""
    src = read_weights(weights, limits=limits)
    if isinstance(model, onnx.ModelProto):
        proto = onnx.ModelProto()
        proto.CopyFrom(model)
    elif isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        where = f"model file '{path}'"
        if not os.path.exists(path):
            raise ModelError(f"{where} does not exist")
        if not os.path.isfile(path):
            raise ModelError(f"{where} is not a file")
        if os.path.getsize(path) == 0:
            raise ModelError(f"{where} is empty (0 bytes)")
        if path.endswith(".json"):
            try:
                with open(path, "rb") as f:
                    text = f.read()
            except OSError as e:
                raise ModelError(f"cannot read {where}: {e.strerror}") from e
            proto = parse_json_model(text, src, origin=where, limits=limits)
            check_references(proto.graph)
            return proto
        try:
            proto = onnx.load(path, load_external_data=False)
        except Exception as e:  # protobuf's DecodeError, OSError
            raise ModelError(f"cannot read ONNX {where}: {e}") from e
        if not proto.HasField("graph"):
            raise ModelError(f"{where} holds no ONNX graph (is it an ONNX model?)")
        if _check_external_size(proto, path, where, limits):
            try:
                onnx.external_data_helper.load_external_data_for_model(proto, os.path.dirname(path))
            except Exception as e:  # onnx's checks of the location (outside the folder, missing), OSError
                raise ModelError(f"cannot read ONNX {where}: {e}") from e
    else:
        raise TypeError(f"model must be a path or an onnx.ModelProto, not {type(model).__name__}")
    if src is not None:
        bind_weights(proto, src)
    check_references(proto.graph)
    return proto


def _tensors(g: onnx.GraphProto):
    """Yield every TensorProto of a graph and its subgraphs: initializers and attribute tensors."""
    yield from g.initializer
    for n in g.node:
        for a in n.attribute:
            if a.HasField("t"):
                yield a.t
            yield from a.tensors
            for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                yield from _tensors(sub)


def _check_external_size(proto: onnx.ModelProto, path: str, where: str, limits: Limits) -> bool:
    """Raise LimitError naming the file and its largest tensor if the initializers, external data
    included, exceed Limits.weight_bytes (before that data is read); return whether there is any."""
    total, largest, external = 0, (0, ""), False
    for t in _tensors(proto.graph):
        if t.data_location != onnx.TensorProto.EXTERNAL:
            total += len(t.raw_data)
            continue
        external = True
        info = {e.key: e.value for e in t.external_data}
        try:
            offset = int(info.get("offset", 0))
            if "length" in info:
                length = int(info["length"])
            else:  # to the end of its file; a file that is not there is onnx's to report
                location = os.path.join(os.path.dirname(path), info.get("location", ""))
                length = max(os.path.getsize(location) - offset, 0) if os.path.isfile(location) else 0
        except ValueError:
            raise ModelError(f"{where}: initializer '{t.name}' has external_data offset or length that is not a number "
                             f"({info.get('offset')!r}, {info.get('length')!r})") from None
        total += length
        largest = max(largest, (length, f"initializer '{t.name}' in '{info.get('location', '')}'"))
    if total > limits.weight_bytes:
        limits.check_bytes(f"{where} (its largest: {largest[1]}, {largest[0]:,} bytes)", total, "weight_bytes")
    return external


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
    n = math.prod(int(d) for d in t.dims)
    fields = (t.raw_data, t.float_data, t.int32_data, t.int64_data, t.double_data, t.uint64_data, t.string_data)
    return n > 0 and not any(len(f) for f in fields) and t.data_location != onnx.TensorProto.EXTERNAL


def bind_weights(proto: onnx.ModelProto, src: WeightSource) -> None:
    """Fill a protobuf model's data-less initializers (and graph inputs named like weights) from
    src: by name from safetensors or a dict; from a header-less blob, which must hold exactly the
    data-less initializers sorted by name, back to back."""
    g = proto.graph
    empty = [t for t in g.initializer if _is_empty(t)]
    if src.by_name:
        for t in empty:
            if t.name not in src.tensors:
                raise src.missing(t.name, "initializer")
            _fill_from_array(t, src.tensors[t.name], src.origin)
        # weights exported as graph inputs (export_params=False) become initializers
        for vi in [i for i in g.input if i.name in src.tensors]:
            arr = src.tensors[vi.name]
            want = dtypes.SUPPORTED.get(vi.type.tensor_type.elem_type)
            if want is not None and arr.dtype != want.numpy:
                raise WeightsError(f"graph input '{vi.name}': {src.origin} holds {arr.dtype}, expected {want.numpy}")
            dims = vi.type.tensor_type.shape.dim
            declared = [d.dim_value if d.HasField("dim_value") else None for d in dims]
            if vi.type.tensor_type.HasField("shape") and (
                len(declared) != arr.ndim or any(d is not None and d != s for d, s in zip(declared, arr.shape))
            ):
                raise WeightsError(
                    f"graph input '{vi.name}': {src.origin} holds {arr.dtype}{shape_str(arr.shape)}, "
                    f"expected {shape_str(tuple(d if d is not None else '?' for d in declared))}"
                )
            g.initializer.append(onnx.numpy_helper.from_array(np.ascontiguousarray(arr), vi.name))
            g.input.remove(vi)
        return
    # a header-less blob: the data-less initializers, sorted by name, back to back
    if not empty:
        raise src.misfit("the model has no initializer without data to fill from a blob")
    spans, offset = [], 0
    for t in sorted(empty, key=lambda t: t.name):
        try:
            dt = dtypes.from_onnx(t.data_type)
        except dtypes.UnsupportedDType as e:
            raise ModelError(f"initializer '{t.name}': {e}") from None
        nbytes = math.prod(int(d) for d in t.dims) * dt.numpy.itemsize
        spans.append((t, dt, offset, nbytes))
        offset += nbytes
    if offset != len(src.data):
        if src.looks_like_safetensors:
            raise src.misfit("")
        short = next(((t, dt, o, n) for t, dt, o, n in spans if o + n > len(src.data)), None)
        if short is not None:
            t, dt, o, n = short
            raise WeightsError(
                f"initializer '{t.name}' {dt.name.lower()}{shape_str(tuple(t.dims))}: needs bytes "
                f"[{o}, {o + n}) but {src.origin} has {len(src.data)} (the model's {len(spans)} initializers "
                f"without data take {offset} bytes, sorted by name, back to back)"
            )
        raise src.misfit(
            f"it has {len(src.data)} bytes, but the model's {len(spans)} initializers without data take "
            f"{offset} (sorted by name, back to back)"
        )
    for t, _, o, n in spans:
        t.raw_data = src.data[o : o + n]


__all__ = ["load_proto", "read_weights", "WeightSource", "parse_json_model", "to_json_model", "bind_weights"]
