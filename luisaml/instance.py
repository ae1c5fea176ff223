"""NetworkInstance: the C++ LuisaML runtime's API (set_model, set_input, set_output,
set_weight_buffer, set_warp_size, forward) on luisaml's compiled networks."""
from __future__ import annotations

from typing import Any

import numpy as np

from . import device
from .errors import InputError, InputNameError, RunError, UsageError, WeightsError
from .interop import is_torch
from .model import shape_str
from .network import CompiledNetwork
from .runtime import compile


class NetworkInstance:
    """The C++ LuisaML API on luisaml's machinery: bind inputs, outputs and weights, then forward()."""

    def __init__(self, model=None, weights=None, **options):
        self.net: CompiledNetwork | None = None
        self._inputs: dict[str, Any] = {}
        self._outputs: dict[str, Any] = {}
        self._weights = None
        self._source = None  # (model, weights, options) when this instance compiled the model
        self.warp_size = 32
        if model is not None:
            self.set_model(model, weights, **options)

    def set_model(self, model, weights=None, **options) -> None:
        """Compile (or adopt a CompiledNetwork) and clear the bindings."""
        self._source = None if isinstance(model, CompiledNetwork) else (model, weights, dict(options))
        self.net = model if self._source is None else self._compile()
        self._inputs.clear()
        self._outputs.clear()
        self._weights = None

    def _compile(self) -> CompiledNetwork:
        model, weights, options = self._source
        if self.warp_size <= 1:  # as in the C++ runtime: no paths where threads cooperate
            options = dict(options, fuse=False)
        return compile(model, weights, **options)

    def _need_model(self) -> CompiledNetwork:
        if self.net is None:
            raise RunError("no model: call set_model first")
        return self.net

    def set_input(self, name: str, tensor) -> None:
        """Bind a graph input to an array or torch tensor (checked at forward)."""
        net = self._need_model()
        if name not in [s.name for s in net.inputs]:
            raise InputNameError(f"'{name}' is not an input; inputs are {[s.name for s in net.inputs]}")
        self._inputs[name] = tensor

    def set_output(self, name: str, tensor=None) -> None:
        """Bind a graph output to a numpy array written in place (or None to allocate one)."""
        net = self._need_model()
        if name not in net.output_names:
            raise InputNameError(f"'{name}' is not an output; outputs are {net.output_names}")
        if tensor is not None:
            _check_writable(name, tensor)
        self._outputs[name] = tensor

    def set_weight_buffer(self, buffer) -> None:
        """Use another weight blob laid out as `net.weight_layout` (bytes or a luisa.ByteBuffer)."""
        net = self._need_model()
        want = len(net.weight_bytes())
        if isinstance(buffer, (bytes, bytearray, np.ndarray)):
            raw = bytes(buffer) if not isinstance(buffer, np.ndarray) else buffer.tobytes()
            if len(raw) < want:
                raise WeightsError(f"weight buffer has {len(raw)} bytes, the network's layout needs {want}")
            from .luisa_compat import byte_buffer

            buffer = byte_buffer(raw)
        elif getattr(buffer, "bytesize", want) < want:
            raise WeightsError(f"weight buffer has {buffer.bytesize} bytes, the network's layout needs {want}")
        self._weights = buffer

    def set_warp_size(self, warp_size: int) -> None:
        """Set whether threads may cooperate: <= 1 compiles the one-thread-per-sample kernel only
        (no fused cooperative kernel), as warp_size 1 disables the warp paths of the C++ runtime."""
        if int(warp_size) < 0:
            raise UsageError("warp size must be >= 0")
        cooperative = self.warp_size > 1
        self.warp_size = int(warp_size)
        if self._source is not None and cooperative != (self.warp_size > 1):
            self.net = self._compile()

    def forward(self) -> dict[str, np.ndarray]:
        """Run the bound inputs through the network; fill bound outputs in place; return all outputs."""
        net = self._need_model()
        unbound = [s.name for s in net.inputs if s.name not in self._inputs]
        if unbound:
            raise RunError(f"input(s) {unbound} are not bound: call set_input for each")
        with device.stream_lock:  # the weight swap must not leak into another thread's run
            with net.pool.weights_swapped(self._weights):
                results = net.run(self._inputs)
        for name, target in self._outputs.items():
            if target is None:
                continue
            value = results[name]
            _check_writable(name, target)  # (its flags may have changed since set_output)
            arr = target.detach().numpy() if is_torch(target) else target
            if tuple(arr.shape) != tuple(value.shape) or arr.dtype != np.asarray(value).dtype:
                raise InputError(
                    f"output '{name}': bound array is {arr.dtype}{shape_str(arr.shape)}, "
                    f"the network produces {np.asarray(value).dtype}{shape_str(np.asarray(value).shape)}"
                )
            arr[...] = value if not is_torch(value) else value.numpy()
        return results


def _check_writable(name: str, target) -> None:
    """Raise InputError unless an output binding is an array forward() can write in place."""
    if is_torch(target):
        return
    if not isinstance(target, np.ndarray):
        raise InputError(f"output '{name}': set_output takes a numpy array or torch tensor to write into (or None), "
                         f"got {type(target).__name__}")
    if not target.flags.writeable:
        raise InputError(f"output '{name}': the bound array is read-only (flags.writeable is False), so forward() "
                         "cannot write the output into it; bind a writable array or None")
