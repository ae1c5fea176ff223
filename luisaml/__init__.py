"""luisaml: compile ONNX models into one LuisaCompute kernel."""
from __future__ import annotations

from .model import ModelError
from .operator import CompileError, Operator
from .registry import register
from .runtime import CompiledNetwork, NetworkInstance, compile

__version__ = "0.1.0"
__all__ = ["compile", "CompiledNetwork", "NetworkInstance", "Operator", "register", "CompileError", "ModelError"]
