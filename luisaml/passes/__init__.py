"""Passes from a loaded model to one ready to compile: validation, opset upgrade, expansion of ONNX
function ops luisaml has no operator for, shape/dtype inference with constant folding, batch-dimension
discovery and annotation (batch.py), Identity/Dropout and dead-node removal, BatchNormalization
folded into a convolution; and `Prepared`, what they make.

The passes know no operator: what they ask of one (does it exist, its shape rule, its host
evaluation, which inputs may have rows bound at run time) they ask the model's Binding
(luisaml.registry), which the compiler makes after the opset upgrade and hands them
(luisaml/compiler.py `prepare`, which runs them in order)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..model import Model
from .batch import PROBE_A, PROBE_B, BatchPlan


@dataclass
class Prepared:
    """A Model ready to compile, and what the batch probes found."""

    model: Model
    batch: BatchPlan  # every variable's shape per sample (passes/batch.py)
    # each node's operator class: (op_type, domain) -> the class at the model's opsets (luisaml.registry.Binding)
    operators: Callable[[str, str], type | None]
    float64_as_float: bool = False  # compile(float64="float32"): float64 tensors compute in float32
    bound: dict[str, str] = field(default_factory=dict)  # inputs with rows bound at run time -> their symbol
    # grid ops over grids bound at run time, run before the kernels (luisaml/fvdb/host_steps.py HostSteps)
    host_steps: Any = None

    @property
    def symbol(self) -> str | None:
        return self.batch.symbol


__all__ = ["Prepared", "PROBE_A", "PROBE_B"]
