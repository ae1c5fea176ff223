"""Passes from a loaded model to one ready to compile: opset upgrade, shape/dtype inference with
constant folding, batch-dimension discovery, Identity/Dropout and dead-node removal."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..model import Model, model_from_proto
from .cleanup import remove_dead, remove_passthrough
from .infer import PROBE_A, PROBE_B, Specialised, find_batch_symbol, set_input_shapes, specialise
from .upgrade import upgrade_opset


@dataclass
class Prepared:
    """A Model ready to compile, and what the batch probes found."""

    model: Model
    symbol: str | None
    shapes_b: dict[str, list[int | None]]
    values_b: dict[str, np.ndarray]
    float64_as_float: bool = False  # compile(float64="float32"): float64 tensors compute in float32


def prepare(proto, batch_axis="auto", input_shapes=None) -> Prepared:
    """Return the prepared Model of a ModelProto (consumed: it is modified)."""
    proto = upgrade_opset(proto)
    if input_shapes:
        set_input_shapes(proto, input_shapes)
    symbol = find_batch_symbol(proto, batch_axis)
    spec: Specialised = specialise(proto, symbol)
    model = model_from_proto(spec.proto)
    remove_passthrough(model)
    remove_dead(model)
    return Prepared(model, symbol, spec.shapes_b, spec.values_b)


__all__ = ["prepare", "Prepared", "PROBE_A", "PROBE_B"]
