"""The in-memory model: Model, Graph, Node and Variable, built once from an onnx ModelProto.

This module imports no onnx (a .lml artifact rebuilds a Model from data without it): reading a
ModelProto into one is luisaml/loaders/proto_model.py, whose names are re-exported here on first use."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import dtypes
from .dtypes import DType, shape_str  # noqa: F401  (shape_str: re-exported, written without onnx)
from .errors import ModelError  # re-exported: luisaml.model.ModelError

# A dimension is a known int, or a symbol (str) such as the batch dimension's name.
Dim = int | str
Shape = tuple[Dim, ...]


@dataclass
class Variable:
    """A named tensor of a graph: its type, and its value when it is known on the host."""

    name: str
    dtype: DType | None = None
    shape: Shape | None = None  # None: rank unknown
    value: np.ndarray | None = None  # constant data (initializers, folded nodes)
    # Shape arithmetic whose value is known only up to symbols: a 1-D list of int | str.
    symbolic: list[Dim] | None = None
    elem_type: int = 0  # the ONNX element type, kept even when DType does not support it

    @property
    def numel(self) -> int:
        """Number of elements of a static shape."""
        # Python integers: int64 arithmetic would wrap a hostile shape around to a small count
        return math.prod(int(d) for d in self.shape) if self.shape else 1

    def describe(self) -> str:
        """Return 'name: dtype[shape]' for messages."""
        return f"'{self.name}': {type_str(self.elem_type)}{shape_str(self.shape)}"


def type_str(elem_type: int) -> str:
    """Return the lower-case ONNX name of an element type."""
    return dtypes.onnx_name(elem_type).lower() if elem_type else "?"


@dataclass
class Node:
    """One operator application."""

    name: str
    op_type: str
    domain: str
    inputs: list[str]  # "" marks an absent optional input
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        """Return "node 'name' (Domain::OpType)" for messages."""
        op = f"{self.domain}::{self.op_type}" if self.domain not in ("", "ai.onnx") else self.op_type
        return f"node '{self.name}' ({op})"


@dataclass
class Graph:
    """Nodes, the graph's interface, and every variable they name; subgraphs link their parent."""

    name: str
    nodes: list[Node]
    inputs: list[str]
    outputs: list[str]
    vars: dict[str, Variable]
    parent: Graph | None = None

    def var(self, name: str) -> Variable:
        """Return the variable of that name here or in an enclosing graph."""
        g: Graph | None = self
        while g is not None:
            if name in g.vars:
                return g.vars[name]
            g = g.parent
        raise ModelError(f"graph '{self.name}': no variable named '{name}'")

    def has_var(self, name: str) -> bool:
        g: Graph | None = self
        while g is not None:
            if name in g.vars:
                return True
            g = g.parent
        return False

    def producers(self) -> dict[str, Node]:
        """Return a map from each node output name to the node that writes it."""
        return {o: n for n in self.nodes for o in n.outputs if o}

    def consumers(self) -> dict[str, list[Node]]:
        """Return a map from a variable name to the nodes that read it (subgraph reads included)."""
        out: dict[str, list[Node]] = {}
        for n in self.nodes:
            for name in dict.fromkeys(list(n.inputs) + sorted(outer_reads(n))):
                if name:
                    out.setdefault(name, []).append(n)
        return out


@dataclass
class Model:
    """A loaded model: its main graph and the opset version of each domain."""

    graph: Graph
    opsets: dict[str, int]
    producer: str = ""
    ir_version: int = 0

    def opset(self, domain: str) -> int:
        return self.opsets.get("" if domain == "ai.onnx" else domain, 0)


def subgraphs(node: Node) -> list[Graph]:
    """Return the graphs held in a node's attributes."""
    out = []
    for v in node.attrs.values():
        if isinstance(v, Graph):
            out.append(v)
        elif isinstance(v, list):
            out.extend(g for g in v if isinstance(g, Graph))
    return out


def outer_reads(node: Node) -> set[str]:
    """Return the names a node's subgraphs read from enclosing graphs."""
    names: set[str] = set()
    for g in subgraphs(node):
        local = set(g.inputs) | {o for n in g.nodes for o in n.outputs} | {
            k for k, v in g.vars.items() if v.value is not None
        }
        for n in g.nodes:
            names |= {i for i in n.inputs if i and i not in local}
            names |= {i for i in outer_reads(n) if i not in local}
        names |= {o for o in g.outputs if o not in local}
    return names


# ---------------------------------------------------------------------------------------------
# From onnx protobuf: luisaml/loaders/proto_model.py (imports onnx), re-exported on first use

_FROM_PROTO = ("check_tensor", "tensor_to_array", "graph_from_proto", "model_from_proto", "_attr_value",
               "_var_from_type", "_shape_of", "_ELEMENT_TYPES")


def __getattr__(name: str):
    """Return a name of luisaml/loaders/proto_model.py (`from luisaml.model import model_from_proto`
    keeps working), importing onnx only then."""
    if name in _FROM_PROTO:
        from .loaders import proto_model

        return getattr(proto_model, name)
    raise AttributeError(f"module 'luisaml.model' has no attribute {name!r}")
