"""luisaml: compile ONNX models into LuisaCompute kernels that run as one launch.

`import luisaml` imports neither onnx nor torch: what compiles (`compile`, `CompileOptions`,
`Operator`, `register`, `MLPConfig`, `NetworkInstance`) and the onnxruntime-style session
(`InferenceSession`, `NodeArg`, `SessionOptions`, which sit above the compiler) are imported on first
use, so that `luisaml.load("model.lml")` runs a built artifact without them."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from . import luisa_compat
from .artifact import load
from .errors import (ArtifactError, BackendUnavailable, BatchMixingError, CompileError, IncompatibleArtifact,
                     InputError, LimitError, LuisamlError, ModelError, RunError, UsageError, WeightsError)
from .limits import Limits
from .network import CompiledNetwork
from .per_batch import PerBatchNetwork
from .per_shape import PerShapeNetwork
from .version import __version__

luisa_compat.hook_luisa_import()  # (luisa's own import, when it comes, without a stack walk a decorator)

if TYPE_CHECKING:
    from .instance import NetworkInstance
    from .operators.mlp import MLPConfig
    from .operator import Operator
    from .registry import register
    from .runtime import CompileOptions, compile
    from .session import InferenceSession, NodeArg, SessionOptions

__all__ = [
    "compile", "CompileOptions", "MLPConfig", "CompiledNetwork", "PerBatchNetwork", "PerShapeNetwork", "NetworkInstance", "Operator", "register",
    "Limits", "LuisamlError", "ModelError", "CompileError", "BatchMixingError", "WeightsError", "LimitError",
    "InputError", "RunError", "UsageError", "BackendUnavailable", "InferenceSession", "NodeArg", "SessionOptions", "load", "ArtifactError",
    "IncompatibleArtifact",
]

# public name -> the module that defines it, imported on first use (most import onnx; the session
# module does not, but it is the top of the house: the package's own import stays below it)
_LAZY = {
    "compile": "runtime", "CompileOptions": "runtime", "MLPConfig": "operators.mlp", "NetworkInstance": "instance",
    "Operator": "operator", "register": "registry",
    "InferenceSession": "session", "NodeArg": "session", "SessionOptions": "session",
}


def __getattr__(name: str):
    """Import what compiles on first use (`luisaml.compile`, `luisaml.torch.compile`, ...) and the
    submodules (`luisaml.model`), so that `import luisaml` imports neither onnx nor torch."""
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    if not name.startswith("__"):
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module 'luisaml' has no attribute {name!r}")
