"""The Operator base class: one instance per node, parsed at compile time, emitting DSL in forward()."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import numpy as np

from .dtypes import DType
from .model import ModelError, Node, shape_str
from .storage import Tensor

if TYPE_CHECKING:
    from .codegen import KernelContext

_REQUIRED = object()


class CompileError(ModelError):
    """A node that cannot be compiled; the message names the node, its op type and what failed."""


@dataclass(frozen=True)
class Derived:
    """An input a node reads that the host computes from some of the node's inputs, once when they
    are bound rather than per node or per sample (fVDB's grid metadata): compute(*arrays, **params)
    returns an array of `dtype` and `shape`. From constants it is a compile-time constant; from
    graph inputs it is an extra shared kernel argument, recomputed when their contents change."""

    compute: Callable[..., np.ndarray]
    sources: tuple[int, ...]  # the node's input indices whose host arrays compute() takes
    dtype: DType
    shape: tuple[int, ...]
    params: tuple[tuple[str, Any], ...] = ()  # keyword arguments, part of the identity


class Operator:
    """Base of every operator. Subclasses set `inplace`/`view` and implement forward(ctx)."""

    # inputs whose storage output 0 may take over when they die at this node (same-index access)
    inplace: ClassVar[tuple[int, ...]] = ()
    # output 0 is input 0 with another shape: same elements in the same order
    view: ClassVar[bool] = False
    # outputs every sample adds into when the node reads per-sample inputs in batch mode (atomics
    # into a buffer the runtime zeroes first); such an output must be a graph output
    accumulates: ClassVar[tuple[int, ...]] = ()

    def __init__(
        self,
        node: Node,
        inputs: list[Tensor | None],
        outputs: list[Tensor | None],
        opset: int,
        subgraphs: dict | None = None,
    ):
        self.node = node
        self.inputs = inputs
        self.outputs = outputs
        self.opset = opset
        # attribute name -> compiled subgraph (luisaml.compiler.GraphCode), for If, Loop, Scan
        self.subgraphs = subgraphs or {}
        # tensors of derived_inputs(), in order, bound by the compiler before forward()
        self.derived: list[Tensor] = []
        self.check()

    # ---- attributes and inputs ----------------------------------------------------------
    def attr(self, name: str, default: Any = _REQUIRED) -> Any:
        """Return an attribute's value, or the default; a missing required one is an error."""
        if name in self.node.attrs:
            return self.node.attrs[name]
        if default is _REQUIRED:
            raise self.error(f"attribute '{name}' is required")
        return default

    def error(self, message: str) -> CompileError:
        """Return a CompileError that names this node."""
        return CompileError(f"{self.node.describe()}: {message}")

    def has_input(self, i: int) -> bool:
        return i < len(self.inputs) and self.inputs[i] is not None

    def input(self, i: int) -> Tensor:
        if not self.has_input(i):
            raise self.error(f"input {i} is required")
        return self.inputs[i]

    def output(self, i: int = 0) -> Tensor:
        return self.outputs[i]

    def const(self, i: int, what: str | None = None) -> np.ndarray:
        """Return the host value of input i, which must be a constant known at compile time."""
        t = self.input(i)
        if t.value is None:
            raise self.error(
                f"input {i} ('{t.name}'{', ' + what if what else ''}) must be a constant known at compile "
                "time (an initializer or computed from constants and static shapes)"
            )
        return t.value

    def optional_const(self, i: int, default=None):
        """Return the host value of an optional constant input, or the default when absent."""
        return self.const(i) if self.has_input(i) else default

    def axis(self, axis: int, rank: int, batched: bool = False, what: str = "axis") -> int:
        """Return a normalised axis; in batch mode the batch axis of a batched tensor is an error."""
        a = int(axis)
        if not -rank <= a < rank:
            raise self.error(f"{what} {axis} is out of range for rank {rank}")
        a %= rank
        if batched and a == 0:
            raise self.error(
                f"{what} {axis} is the batch axis: this operator mixes samples across the batch "
                "(compile with batch_axis=None to run the graph as one instance)"
            )
        return a

    def expect(self, cond: bool, message: str) -> None:
        if not cond:
            raise self.error(message)

    def expect_dtype(self, t: Tensor, allowed, role: str) -> None:
        """Raise unless t's dtype is one of `allowed` (names like 'float', 'int', 'bool')."""
        kinds = {"float": t.dtype.is_float, "int": t.dtype.is_int, "bool": t.dtype.is_bool}
        if not any(kinds.get(a, t.dtype.name == a) for a in allowed):
            hint = " (compile with float64='float32' to compute float64 in float32)" if t.dtype.name == "DOUBLE" else ""
            raise self.error(
                f"{role} '{t.name}' has type {t.dtype.name.lower()}, expected {' or '.join(allowed)}{hint}"
            )

    def expect_shape(self, t: Tensor, shape: tuple[int, ...], role: str) -> None:
        if tuple(t.shape) != tuple(shape):
            raise self.error(f"{role} '{t.name}' has shape {shape_str(t.shape)}, expected {shape_str(shape)}")

    # ---- what subclasses implement ------------------------------------------------------
    def check(self) -> None:
        """Validate attributes and input types; raise self.error(...) on a problem."""

    def forward(self, ctx: "KernelContext") -> None:
        """Emit this node's DSL through ctx."""
        raise NotImplementedError

    def describe(self) -> str:
        """Return a short note on how this node is compiled (shown by inspect)."""
        return ""

    def derived_inputs(self) -> list[Derived]:
        """Return the host-derived inputs this node reads (bound to self.derived, in order)."""
        return []

    def cooperative(self, k: int = 0) -> bool:
        """Return whether every sample of a batch adds into output k (see `accumulates`)."""
        return k in self.accumulates and any(t is not None and t.batched for t in self.inputs)

    @classmethod
    def infer(cls, node: Node, inputs: list) -> list | None:
        """Return [(elem_type, shape)] per output for ops onnx cannot infer (custom domains)."""
        return None

    @classmethod
    def evaluate(cls, node: Node, inputs: list) -> list | None:
        """Return the outputs (numpy arrays) of a custom-domain node whose inputs are all constant,
        folding it on the host, or None to leave it to the kernel."""
        return None
