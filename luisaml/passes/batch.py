"""Batch-axis annotation: each variable's shape per sample, found once from the two probe batches.

The model is specialised to two batch sizes (PROBE_A and PROBE_B, passes/infer.py) and folded at
each; a dimension that is PROBE_A in the first and PROBE_B in the second is the batch dimension,
k·PROBE_A / k·PROBE_B is k rows per sample of it. This pass turns that comparison into one
`BatchDim` per variable (main graph and subgraphs), so the compiler never compares probe shapes:

- `shape` is the per-sample shape (the batch dimension replaced by its rows per sample);
- `batched` says the tensor holds one region per sample (its batch dimension at axis 0, the layout
  per-sample code indexes as `sample * numel + i`);
- `onnx_shape` is the shape with the batch symbol (what inspect and error messages show);
- `dependent` marks a folded constant whose value changes with the batch size (Shape(x) used as
  data): per-sample code can only use it as a shape.

A tensor whose batch dimension is not a leading k·B (a Transpose moved it, or a Reshape merged it
with another axis) cannot be indexed per sample: `BatchPlan.moved` says which and why, and the
compiler then runs the graph with its shapes fixed at the batch size of each run instead.

A graph whose tensors all keep the batch leading runs per sample for any batch size (stages dispatch
items x samples) and has a `forward`. A graph whose batch moves (attention's [B,S,D] -> [S,B,D]) or
that mixes samples (a mean over the batch) compiles for each batch size it runs with
(luisaml/per_batch.py's PerBatchNetwork): shapes fixed, still stages; it has no per-sample
`forward`, and asking for one names the node.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..model import Graph, Model, ModelError, Variable, shape_str, subgraphs

# The two batch sizes a batched model is specialised to (passes/infer.py): a dimension that is 2 in
# the first and 3 in the second is the batch dimension; one that is equal in both is static.
# (Here, not in infer.py: this module and the compiler import no onnx, so that luisaml.load does not.)
PROBE_A, PROBE_B = 2, 3


@dataclass(frozen=True)
class BatchDim:
    """A variable's relation to the batch (see the module docstring)."""

    shape: tuple[int, ...]
    batched: bool
    onnx_shape: tuple
    dependent: bool = False  # a constant whose value depends on the batch size
    value: np.ndarray | None = field(default=None, compare=False)  # the per-sample value of a constant


@dataclass
class BatchPlan:
    """The batch symbol, every variable's BatchDim, and why per-sample execution is impossible
    (None when it is possible)."""

    symbol: str | None
    dims: dict[str, BatchDim]
    moved: str | None = None

    @property
    def per_sample(self) -> bool:
        return self.symbol is not None and self.moved is None


def annotate(model: Model, symbol: str | None, shapes_b: dict[str, list], values_b: dict[str, np.ndarray]) -> BatchPlan:
    """Return the BatchPlan of a model specialised at PROBE_A, given the shapes and folded
    constants of the same model at PROBE_B."""
    plan = BatchPlan(symbol, {})
    for g in _graphs(model.graph):
        producers = g.producers()
        for name, v in g.vars.items():
            if v.shape is None or not all(isinstance(d, int) for d in v.shape):
                continue  # the compiler reports an untyped tensor where it needs it
            dim, moved = _batch_dim(v, symbol, shapes_b.get(name), values_b.get(name))
            plan.dims[name] = dim
            if moved and plan.moved is None:
                n = producers.get(name)
                plan.moved = f"tensor '{name}'{f' (output of {n.describe()})' if n else ''}: {moved}"
    return plan


def _graphs(g: Graph):
    yield g
    for node in g.nodes:
        for sub in subgraphs(node):
            yield from _graphs(sub)


def _batch_dim(v: Variable, symbol: str | None, other: list | None, value_b) -> tuple[BatchDim, str | None]:
    """Return (the BatchDim, why this tensor cannot be indexed per sample or None)."""
    dims, onnx_dims, batched, moved = [], [], False, None
    for k, a in enumerate(v.shape):
        b = other[k] if (other is not None and k < len(other)) else a
        if symbol is None or a == b or b is None:
            dims.append(a)
            onnx_dims.append(a)
            continue
        mult = _batch_multiple(a, b)
        if mult is not None:
            onnx_dims.append(symbol if mult == 1 else f"{mult}*{symbol}")
            if k == 0:
                # k*B at axis 0 keeps each sample's elements together (a reshape of [B, k, ...])
                batched = True
                dims.append(mult)
                continue
            dims.append(a)
            moved = moved or f"the batch dimension '{symbol}' is axis {k} of {shape_str(tuple(onnx_dims) + ('...',))}"
            continue
        onnx_dims.append(f"?{k}")
        dims.append(a)
        moved = moved or (f"dimension {k} is {a} at batch {PROBE_A} and {b} at batch {PROBE_B}: it mixes the "
                          f"batch dimension '{symbol}' with other axes")
    value, dependent = _per_sample_value(v, value_b, batched)
    return BatchDim(tuple(dims), batched and moved is None, tuple(onnx_dims), dependent, value), moved


def _batch_multiple(a: int, b: int) -> int | None:
    """Return k when a dimension is k*B (k*PROBE_A and k*PROBE_B at the two probes), else None."""
    if a % PROBE_A or b % PROBE_B or a // PROBE_A != b // PROBE_B:
        return None
    return a // PROBE_A


def _per_sample_value(v: Variable, other, batched: bool) -> tuple[np.ndarray | None, bool]:
    """Return (the per-sample value, batch-dependent?) of a folded constant."""
    if v.value is None:
        return None, False
    if other is None or (other.shape == v.value.shape and np.array_equal(other, v.value, equal_nan=True)):
        return v.value, False
    if batched and v.value.ndim and np.all(v.value == v.value[:1]) and np.all(other == other[:1]):
        return v.value[:1], False  # the same row for every sample
    return None, True


def require(plan: BatchPlan, name: str, where: str) -> BatchDim:
    """Return a variable's BatchDim, or raise naming the tensor (its shape was not inferred)."""
    try:
        return plan.dims[name]
    except KeyError:
        raise ModelError(f"{where}: its shape could not be inferred") from None
