"""Passes from a loaded model to one ready to compile: opset upgrade, expansion of ONNX function ops
luisaml has no operator for, shape/dtype inference with constant folding, batch-dimension
discovery and annotation (batch.py), grid ops over grids bound at run time cut out to run on the
host (luisaml/fvdb/host_steps.py), Identity/Dropout and dead-node removal, BatchNormalization
folded into a convolution."""
from __future__ import annotations

from dataclasses import dataclass, field

from typing import TYPE_CHECKING

from ..limits import DEFAULT, Limits
from ..model import Model
from .batch import PROBE_A, PROBE_B, BatchPlan

if TYPE_CHECKING:
    from ..fvdb.host_steps import HostSteps


@dataclass
class Prepared:
    """A Model ready to compile, and what the batch probes found."""

    model: Model
    batch: BatchPlan  # every variable's shape per sample (passes/batch.py)
    float64_as_float: bool = False  # compile(float64="float32"): float64 tensors compute in float32
    bound: dict[str, str] = field(default_factory=dict)  # inputs with rows bound at run time -> their symbol
    host_steps: HostSteps | None = None  # grid ops over grids bound at run time, run before the kernels (host_steps.py)

    @property
    def symbol(self) -> str | None:
        return self.batch.symbol


def prepare(proto, batch_axis="auto", input_shapes=None, *, limits: Limits = DEFAULT) -> Prepared:
    """Return the prepared Model of a ModelProto (consumed: it is modified)."""
    # (imported here: they read protobuf, and a .lml artifact's Prepared is rebuilt without onnx)
    from ..fvdb import host_steps
    from ..model import model_from_proto
    from .batch import annotate
    from .cleanup import fold_batchnorm, remove_dead, remove_passthrough
    from .functions import expand_functions
    from .infer import Specialised, find_batch_symbol, set_input_shapes, specialise
    from .upgrade import upgrade_opset
    from .validate import validate_model

    validate_model(proto, limits=limits)
    proto = upgrade_opset(proto)
    expand_functions(proto, _implemented)
    if input_shapes:
        set_input_shapes(proto, input_shapes)
    steps = host_steps.split(proto)
    symbol = find_batch_symbol(proto, batch_axis)
    spec: Specialised = specialise(proto, symbol, limits=limits)
    model = model_from_proto(spec.proto)
    remove_passthrough(model)
    remove_dead(model)
    fold_batchnorm(model)
    return Prepared(model, annotate(model, symbol, spec.shapes_b, spec.values_b), bound=dict(spec.bound or {}),
                    host_steps=steps)


def _implemented(op_type: str, domain: str, opset: int) -> bool:
    from .. import registry

    registry._load_builtin()
    return registry.resolve(op_type, domain, opset) is not None


__all__ = ["prepare", "Prepared", "PROBE_A", "PROBE_B"]
