"""Reading an onnx ModelProto into luisaml's Model (luisaml/model.py): tensors checked against their
dims, attributes as plain Python values, initializers as numpy arrays, subgraphs as Graphs."""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from .. import dtypes
from ..errors import ModelError
from ..model import Dim, Graph, Model, Node, Shape, Variable, shape_str, type_str



def check_tensor(t: onnx.TensorProto, where: str) -> None:
    """Raise ModelError if a TensorProto's element type is not ONNX's, its dims are negative, or
    its data (raw_data, or the typed field of its element type) does not match its dims."""
    dims = tuple(int(d) for d in t.dims)
    if any(d < 0 for d in dims):
        raise ModelError(f"{where} '{t.name}': dims {list(dims)} has a negative dimension")
    if t.data_type not in _ELEMENT_TYPES:
        raise ModelError(f"{where} '{t.name}': element type {t.data_type} is not an ONNX element type")
    if t.data_location == onnx.TensorProto.EXTERNAL:
        raise ModelError(f"{where} '{t.name}': external data was not loaded (load the model from its path)")
    dt = dtypes.SUPPORTED.get(t.data_type)
    if dt is None:
        # a type luisaml does not hold (the operator that meets it says so): onnx's decoder is the
        # judge of its data, and such tensors are rare and small
        try:
            numpy_helper.to_array(t)
        except Exception as e:  # ValueError/TypeError from reshaping data that does not fit
            raise ModelError(
                f"{where} '{t.name}': cannot decode {type_str(t.data_type)}{shape_str(dims)}: {e}"
            ) from e
        return
    # Python integers: a product of hostile dims must not wrap around as int64 would
    numel = math.prod(dims)
    if t.HasField("raw_data"):
        want = numel * dt.numpy.itemsize
        if len(t.raw_data) != want:
            raise ModelError(
                f"{where} '{t.name}': raw_data has {len(t.raw_data)} bytes, expected {want} "
                f"for {type_str(t.data_type)}{shape_str(dims)}"
            )
        return
    field_name = onnx.helper.tensor_dtype_to_field(t.data_type)
    count = len(getattr(t, field_name))
    if count == 0 and numel > 0:
        raise ModelError(
            f"{where} '{t.name}': has no data, but {type_str(t.data_type)}{shape_str(dims)} holds {numel:,} "
            "elements (stored in a weights file? pass it to luisaml)"
        )
    if count != numel:
        raise ModelError(
            f"{where} '{t.name}': {field_name} holds {count} values, expected {numel} for "
            f"{type_str(t.data_type)}{shape_str(dims)}"
        )


_ELEMENT_TYPES = frozenset(v for v in onnx.TensorProto.DataType.values() if v != onnx.TensorProto.UNDEFINED)


def tensor_to_array(t: onnx.TensorProto, where: str) -> np.ndarray:
    """Return the data of a TensorProto as numpy, checking its byte length against its dims."""
    dims = tuple(int(d) for d in t.dims)
    check_tensor(t, where)
    try:
        return numpy_helper.to_array(t)
    except Exception as e:  # onnx raises ValueError/TypeError with little context
        raise ModelError(f"{where} '{t.name}': cannot decode {type_str(t.data_type)}{shape_str(dims)}: {e}") from e


def _shape_of(tp: onnx.TypeProto) -> Shape | None:
    if not tp.HasField("tensor_type") or not tp.tensor_type.HasField("shape"):
        return None
    dims: list[Dim] = []
    for i, d in enumerate(tp.tensor_type.shape.dim):
        if d.HasField("dim_value") and d.dim_value >= 0:
            dims.append(int(d.dim_value))
        elif d.HasField("dim_param") and d.dim_param:
            dims.append(d.dim_param)
        else:
            dims.append(f"?{i}")  # unknown and unnamed
    return tuple(dims)


def _var_from_type(name: str, tp: onnx.TypeProto) -> Variable:
    elem = tp.tensor_type.elem_type if tp.HasField("tensor_type") else 0
    dt = dtypes.SUPPORTED.get(elem)
    return Variable(name, dt, _shape_of(tp), elem_type=elem)


def _attr_value(a: onnx.AttributeProto, parent: Graph, where: str) -> Any:
    A = onnx.AttributeProto
    if a.type == A.FLOAT:
        return float(a.f)
    if a.type == A.INT:
        return int(a.i)
    if a.type == A.STRING:
        return a.s.decode("utf-8", errors="replace")
    if a.type == A.TENSOR:
        return tensor_to_array(a.t, f"{where} attribute '{a.name}'")
    if a.type == A.GRAPH:
        return graph_from_proto(a.g, parent)
    if a.type == A.FLOATS:
        return [float(x) for x in a.floats]
    if a.type == A.INTS:
        return [int(x) for x in a.ints]
    if a.type == A.STRINGS:
        return [s.decode("utf-8", errors="replace") for s in a.strings]
    if a.type == A.TENSORS:
        return [tensor_to_array(t, f"{where} attribute '{a.name}'") for t in a.tensors]
    if a.type == A.GRAPHS:
        return [graph_from_proto(g, parent) for g in a.graphs]
    if a.type == A.SPARSE_TENSOR:  # dense values only; checked by ops
        return tensor_to_array(a.sparse_tensor.values, f"{where} attribute '{a.name}' values")
    if a.type == A.TYPE_PROTO:
        return a.tp
    raise ModelError(f"{where}: attribute '{a.name}' has unknown type {a.type}")


def graph_from_proto(g: onnx.GraphProto, parent: Graph | None = None) -> Graph:
    """Return a Graph for a GraphProto; initializer data wins over a value_info of the same name."""
    graph = Graph(g.name or "graph", [], [i.name for i in g.input], [o.name for o in g.output], {}, parent)
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        if vi.name not in graph.vars:
            graph.vars[vi.name] = _var_from_type(vi.name, vi.type)
    for t in g.initializer:
        arr = tensor_to_array(t, f"graph '{graph.name}' initializer")
        v = graph.vars.get(t.name) or Variable(t.name)
        v.elem_type = t.data_type
        v.dtype = dtypes.SUPPORTED.get(t.data_type)
        v.shape = tuple(int(d) for d in t.dims)
        v.value = arr
        graph.vars[t.name] = v
    # an initializer listed among the inputs (old exporters) is a constant, not a feed
    graph.inputs = [i for i in graph.inputs if graph.vars[i].value is None]
    for k, n in enumerate(g.node):
        name = n.name or f"{n.op_type}_{k}"
        node = Node(name, n.op_type, n.domain or "", list(n.input), list(n.output))
        for a in n.attribute:
            node.attrs[a.name] = _attr_value(a, graph, node.describe())
        graph.nodes.append(node)
        for o in node.outputs:
            if o and o not in graph.vars:
                graph.vars[o] = Variable(o)
    return graph


def model_from_proto(m: onnx.ModelProto) -> Model:
    """Return the Model of a ModelProto (types as annotated; run the passes for the rest)."""
    opsets = {(o.domain if o.domain != "ai.onnx" else ""): int(o.version) for o in m.opset_import}
    return Model(graph_from_proto(m.graph), opsets, m.producer_name, int(m.ir_version))
