"""luisaml: compile ONNX models into LuisaCompute kernels that run as one launch."""
from __future__ import annotations

from .errors import (BackendUnavailable, BatchMixingError, CompileError, InputError, LimitError, LuisamlError,
                     ModelError, RunError, UsageError, WeightsError)
from .instance import NetworkInstance
from .limits import Limits
from .mlp import MLPConfig
from .network import CompiledNetwork, PerBatchNetwork
from .operator import Operator
from .registry import register
from .runtime import CompileOptions, compile
from .session import InferenceSession, NodeArg

__version__ = "0.1.0"
__all__ = [
    "compile", "CompileOptions", "MLPConfig", "CompiledNetwork", "PerBatchNetwork", "NetworkInstance", "Operator", "register",
    "Limits", "LuisamlError", "ModelError", "CompileError", "BatchMixingError", "WeightsError", "LimitError",
    "InputError", "RunError", "UsageError", "BackendUnavailable", "InferenceSession", "NodeArg",
]


def __getattr__(name: str):
    """Import `luisaml.torch` on first use (`luisaml.torch.compile`), so that `import luisaml` does
    not import torch."""
    if name == "torch":
        import importlib

        return importlib.import_module(".torch", __name__)
    raise AttributeError(f"module 'luisaml' has no attribute {name!r}")
