"""luisaml as an `onnx.backend.base.Backend`, so that onnx's backend test suite can run it.

Each model is compiled as one instance of the graph (`batch_axis=None`) on the CPU backend, with
float64 computed in float32 (`float64="float32"`: LuisaCompute has no double).
Two things a luisaml model fixes at compile time that the suite's models leave to run time:
- input shapes: a model whose input shapes are not all known is compiled when it runs, for the
  shapes of the arrays it is given (once per distinct set of shapes);
- inputs an operator needs as constants (axes, pads, shapes, ...): when compiling fails because
  a graph input must be a constant (or an output's shape depends on one), that input is compiled
  in with the value the run gives it, as a real model carries it as an initializer (once per
  distinct value). The operator's data inputs stay inputs, so its kernel is still what runs."""
from __future__ import annotations

import re
from typing import Any, Sequence

import numpy as np
import onnx
from onnx import numpy_helper
from onnx.backend.base import Backend, BackendRep

from . import device, runtime
from .model import ModelError
from .operator import CompileError

BACKEND = "cpu"
_NEEDS_CONSTANT = re.compile(r"input \d+ \('([^']+)'(?:, [^)]*)?\) must be a constant known at compile time")
_UNKNOWN_SHAPE = re.compile(r"tensor '([^']+)' \(output of node [^\n]*?(?:its shape|dimension \d+ of .*) could not be inferred")
_INT_TYPES = (onnx.TensorProto.INT64, onnx.TensorProto.INT32)


def _static_dims(vi: onnx.ValueInfoProto) -> list[int] | None:
    """Return the dims of a tensor input when all are numbers, else None."""
    t = vi.type.tensor_type
    if not vi.type.HasField("tensor_type") or not t.HasField("shape"):
        return None
    dims = list(t.shape.dim)
    if not all(d.HasField("dim_value") and d.dim_value >= 0 for d in dims):
        return None
    return [int(d.dim_value) for d in dims]


def needed_constants(error: Exception, model: onnx.ModelProto) -> list[str]:
    """Return the graph inputs that compiling must know the values of, by the error it raised:
    the graph inputs that the tensor an operator says must be a constant is computed from, or the
    integer graph inputs that the shape-giving inputs of a node whose output shape is unknown are
    computed from (Reshape's shape, ReduceSum's axes, the pads a function body derives from a
    target shape, an If's condition)."""
    m = _NEEDS_CONSTANT.search(str(error))
    if m:
        return _sources(model, [m.group(1)], integer_only=False)
    m = _UNKNOWN_SHAPE.search(str(error))
    if not m:
        return []
    node = next((n for n in model.graph.node if m.group(1) in n.output), None)
    if node is None:  # a tensor of an inlined If branch or an expanded function: any integer input
        return _sources(model, [vi.name for vi in model.graph.input], integer_only=True)
    # an If's condition and the outer tensors its branches read decide its shape (a Loop's too);
    # elsewhere input 0 is the data
    shaping = list(node.input) + _outer_reads(node) if node.op_type in ("If", "Loop", "Scan") else list(node.input[1:])
    return _sources(model, shaping, integer_only=True)


def _outer_reads(node: onnx.NodeProto) -> list[str]:
    """Return the tensor names a node's subgraphs read (their own tensors included: harmless,
    as only names of the main graph's inputs are bound)."""
    names = []
    for a in node.attribute:
        for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
            for n in g.node:
                names += [i for i in n.input if i] + _outer_reads(n)
    return names


def _sources(model: onnx.ModelProto, names: list[str], integer_only: bool) -> list[str]:
    """Return the graph inputs among `names` and among the tensors they are computed from (only
    the integer ones with integer_only: a guess at shape arithmetic must not bind data)."""
    types = {vi.name: vi.type.tensor_type.elem_type for vi in model.graph.input}
    producer = {o: n for n in model.graph.node for o in n.output}
    found, seen, todo = [], set(), [n for n in names if n]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in types:
            if not integer_only or types[name] in _INT_TYPES:
                found.append(name)
        elif name in producer:
            todo += [i for i in producer[name].input if i]
    return sorted(found)


def specialise(model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]], values: dict[str, np.ndarray]) -> onnx.ModelProto:
    """Return a copy of model whose graph inputs have the given shapes, and whose inputs named in
    `values` are initializers holding them."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for vi in list(m.graph.input):
        if vi.name in values:
            m.graph.input.remove(vi)
            m.graph.initializer.append(numpy_helper.from_array(np.asarray(values[vi.name]), vi.name))
        elif vi.name in shapes and vi.type.HasField("tensor_type"):
            shape = vi.type.tensor_type.shape
            del shape.dim[:]
            for d in shapes[vi.name]:
                shape.dim.add().dim_value = int(d)
    return m


class LuisaBackendRep(BackendRep):
    """A prepared model: takes arrays in the order of the graph inputs that are not initializers
    (or a dict by name), returns the outputs in graph-output order."""

    def __init__(self, model: onnx.ModelProto, **compile_kw: Any) -> None:
        self.model = model
        self.compile_kw = compile_kw
        inits = {t.name for t in model.graph.initializer}
        self.real_inputs = [vi.name for vi in model.graph.input if vi.name not in inits]
        self.output_names = [vi.name for vi in model.graph.output]
        self.bound: list[str] = []  # graph inputs compiled in as constants
        self._nets: dict[tuple, runtime.CompiledNetwork] = {}
        self.static = all(_static_dims(vi) is not None for vi in model.graph.input if vi.name not in inits)
        if self.static:
            # compile now, so that an unsupported model fails in prepare(), unless a constant input
            # has to wait for its value
            try:
                self._nets[()] = self._compile(model)
            except (CompileError, ModelError) as e:
                names = [n for n in needed_constants(e, model) if n in self.real_inputs]
                if not names:
                    raise
                self.bound += names

    def _compile(self, model: onnx.ModelProto) -> runtime.CompiledNetwork:
        return runtime.compile(model, batch_axis=None, backend=BACKEND, **self.compile_kw)

    def network(self, feeds: dict[str, np.ndarray]) -> runtime.CompiledNetwork:
        """Return the network for these feeds: compiled for their shapes (unless static) and for
        the values of the bound inputs."""
        if () in self._nets:
            return self._nets[()]
        while True:
            shapes = {} if self.static else {k: tuple(v.shape) for k, v in feeds.items() if k not in self.bound}
            values = {k: feeds[k] for k in self.bound}
            key = (tuple(sorted(shapes.items())), tuple((k, v.dtype.str, v.shape, v.tobytes()) for k, v in sorted(values.items())))
            if key in self._nets:
                return self._nets[key]
            try:
                net = self._compile(specialise(self.model, shapes, values))
            except (CompileError, ModelError) as e:
                names = [n for n in needed_constants(e, self.model) if n in feeds and n not in self.bound]
                if not names:
                    raise
                self.bound += names
                continue
            self._nets[key] = net
            return net

    def run(self, inputs: Sequence[np.ndarray] | dict[str, np.ndarray], **kwargs: Any) -> list[np.ndarray]:
        """Return the outputs, in graph-output order, for inputs in the order of the graph inputs
        that are not initializers (as onnxruntime's backend does), or by name."""
        if isinstance(inputs, dict):
            feeds = {k: np.asarray(v) for k, v in inputs.items()}
        else:
            if len(inputs) != len(self.real_inputs):
                raise ValueError(f"{len(inputs)} inputs given, the model has {len(self.real_inputs)}: {self.real_inputs}")
            feeds = {k: np.asarray(v) for k, v in zip(self.real_inputs, inputs)}
        net = self.network(feeds)
        results = net.run({k: v for k, v in feeds.items() if k not in self.bound})
        return [np.asarray(results[name]) for name in self.output_names]


class LuisaBackend(Backend):
    """The onnx backend API over luisaml.compile (CPU backend, one graph instance)."""

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> LuisaBackendRep:
        """Return a LuisaBackendRep; a static-shaped model is compiled here, others at first run."""
        if not cls.supports_device(device):
            raise RuntimeError(f"luisaml's onnx backend runs on CPU only, not {device}")
        _init_device()
        kwargs = {k: v for k, v in kwargs.items() if k not in ("rtol", "atol")}
        # LuisaCompute has no double: float64 models compute in float32, which the suite's
        # tolerance (rtol 1e-3) is written for; a user asks for it the same way
        kwargs.setdefault("float64", "float32")
        return LuisaBackendRep(model, **kwargs)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        """Return True for "CPU" only: the suite runs on LuisaCompute's CPU backend."""
        return str(device).upper().split(":")[0] == "CPU"


def _init_device() -> None:
    device.init(BACKEND)


prepare = LuisaBackend.prepare
run_model = LuisaBackend.run_model
run_node = LuisaBackend.run_node
supports_device = LuisaBackend.supports_device
