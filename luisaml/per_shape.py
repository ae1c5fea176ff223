"""PerShapeNetwork: a graph with dynamic dimensions besides the batch (a sequence length, an image's
height and width), compiled for each shape it runs with: the first run at new sizes of those
dimensions compiles the model with them fixed (a CompiledNetwork, or a PerBatchNetwork where the
batch moves: the batch keeps its own handling), and the last SPECIALISATIONS_KEPT are kept.

A sequence length or an image size left dynamic stops the passes (passes/infer.py raises
DynamicDimsError, naming the inputs); compile then returns a PerShapeNetwork. A kept shape costs a
dictionary look-up, a dropped one a pass over the model and build_plan (its kernels are in the
kernel cache). An input whose values reach a node of another domain than ONNX's keeps the refusal:
such a node may hold the exported example's sizes in its attributes (fVDB's `total_voxels`).
`batch_axis=None` keeps it too: the graph as its shapes say.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from types import SimpleNamespace
from typing import Any, Callable, Mapping

import numpy as np

from . import device
from .dtypes import shape_str
from .errors import InputError, InputNameError, UsageError
from .feeds import feeds_and_outputs
from .interop import is_torch
from .network import CompiledNetwork

# how many specialisations a PerShapeNetwork keeps (least recently run dropped first; its
# `specialisations_kept` changes it per network). Compiling a dropped one again is one pass over the
# model and build_plan: its kernels are in the on-disk kernel cache.
SPECIALISATIONS_KEPT = 8


class OneShapeNeeded(UsageError, AttributeError):
    """What a PerShapeNetwork raises for what only one shape has (a plan, `forward`, a saved
    artifact): a UsageError, and an AttributeError, so that hasattr() and getattr(net, name, None)
    answer as for an attribute it lacks."""


class PerShapeNetwork:
    """A network whose inputs have dynamic dimensions besides the batch: `run` compiles it for the
    sizes of those dimensions each feed has (the first run at new sizes; a CompiledNetwork, or a
    PerBatchNetwork where the batch moves) and keeps the last `specialisations_kept` (8). Inputs
    that share a dimension's name must agree on its size. What exists only for one shape (plan,
    source, inputs, `forward`, save) is `specialise(seq=128)`'s, the network of one shape."""

    artifact = None  # (as a CompiledNetwork that was not loaded from a .lml)

    # a CompiledNetwork's attributes that only one shape has
    _ONE_SHAPE = frozenset({
        "plan", "module", "path", "kernels", "kernel", "build_workers", "source", "allocation", "inputs", "outputs",
        "output_names", "weight_layout", "weight_bytes", "weights", "io_dtype", "input_type", "output_type",
        "plan_array_type", "check_feeds", "derived_arguments", "run_hashed", "check_batch", "launch", "pool", "bound",
        "launcher", "forward", "probe", "batch_of", "network_for",
    })

    def __init__(self, why: str, symbol: str | None, dynamic_inputs: dict[str, list], input_names: list[str],
                 backend: str, compile_at: Callable[[dict[str, list]], CompiledNetwork]):
        """why: the compiler's message naming the dynamic dimensions; symbol: the batch symbol (None:
        no batch); dynamic_inputs: {input: dims} of the inputs with dynamic dimensions besides the
        batch (ints, the batch symbol, a name or None for the others); compile_at(input_shapes): the
        network of the model with those inputs' shapes (the batch symbol kept) fixed."""
        self.why = why
        self.symbol = symbol
        self.backend = backend
        self.input_shapes = {k: list(v) for k, v in dynamic_inputs.items()}
        self._input_names = list(input_names)
        # (input, axis, the dimension's name) of every dynamic dimension besides the batch; an
        # unnamed one is named after its place, 'x[2]' (two unnamed dimensions are not the same one)
        self._dynamic = [(name, axis, d if isinstance(d, str) else f"{name}[{axis}]")
                         for name, dims in self.input_shapes.items() for axis, d in enumerate(dims)
                         if not isinstance(d, (int, np.integer)) and (d is None or d != symbol)]
        self.symbols = tuple(dict.fromkeys(s for _, _, s in self._dynamic))
        self.specialisations_kept = SPECIALISATIONS_KEPT
        self._compile_at = compile_at
        self._nets: OrderedDict[tuple[int, ...], CompiledNetwork] = OrderedDict()  # sizes -> network, oldest first

    def __getattr__(self, name: str) -> Any:
        if name in PerShapeNetwork._ONE_SHAPE:
            raise OneShapeNeeded(self._one_shape(f"`{name}` exists for one shape", "there"))
        raise AttributeError(f"'PerShapeNetwork' object has no attribute '{name}'")

    def _one_shape(self, what: str, where: str) -> str:
        """The message of `what` (an attribute, save) a network of one shape has: why, and how to get one."""
        dims = ", ".join(f"'{k}' {_dims_str(v)}" for k, v in self.input_shapes.items())
        static = (f"only the batch dimension '{self.symbol}' may be dynamic" if self.symbol is not None
                  else "no dimension may be dynamic")
        return (f"{what}: {static} {where}, and this network compiles per shape of {', '.join(self.symbols)} "
                f"({dims}); {self._specialise_call()} returns the network of one shape, or compile with "
                "input_shapes={name: [...]} fixing them")

    def _specialise_call(self) -> str:
        """net.specialise(...) with this network's dimensions, as messages write it."""
        kw = [f"{s}=..." for s in self.symbols if s.isidentifier()]
        named = [f"{s!r}: ..." for s in self.symbols if not s.isidentifier()]
        if named:
            kw.append("**{" + ", ".join(named) + "}")
        return f"net.specialise({', '.join(kw)})"

    @property
    def batch_symbol(self) -> str | None:
        """The symbol of the batch dimension (as in every specialisation)."""
        return self.symbol

    @property
    def specialisations(self) -> dict[tuple[tuple[str, int], ...], CompiledNetwork]:
        """The networks kept, least recently run first: {((dimension, size), ...): network}."""
        return {tuple(zip(self.symbols, key)): net for key, net in self._nets.items()}

    def sizes_of(self, feeds: Mapping[str, Any]) -> dict[str, int]:
        """Return {dimension: size} the feeds carry; raise InputError where inputs sharing a dimension
        disagree on its size or an input's rank is not the model's, InputNameError for a missing input."""
        missing = [k for k in self.input_shapes if k not in feeds]
        if missing:
            raise InputNameError(f"missing input(s) {missing}; the network's inputs are {self._input_names}")
        shapes = {k: tuple(feeds[k].shape) if is_torch(feeds[k]) else np.shape(feeds[k]) for k in self.input_shapes}
        for k, dims in self.input_shapes.items():
            if len(shapes[k]) != len(dims):
                raise InputError(f"input '{k}': expected rank {len(dims)} ({_dims_str(dims)}), got shape "
                                 f"{shape_str(shapes[k])}")
        sizes: dict[str, tuple[int, str, int]] = {}  # dimension -> (size, the input that set it, its axis)
        for name, axis, sym in self._dynamic:
            n = int(shapes[name][axis])
            if sym not in sizes:
                sizes[sym] = (n, name, axis)
            elif sizes[sym][0] != n:
                m, other, other_axis = sizes[sym]
                raise InputError(f"inputs '{other}' and '{name}' disagree on dimension '{sym}': '{other}' has {m} "
                                 f"(axis {other_axis} of {shape_str(shapes[other])}), '{name}' has {n} (axis {axis} of "
                                 f"{shape_str(shapes[name])})")
        return {s: v[0] for s, v in sizes.items()}

    def specialise(self, **sizes: int) -> CompiledNetwork:
        """Return the network of one shape, every dynamic dimension besides the batch given its size
        (net.specialise(seq=128); an unnamed one by its place, **{'x[2]': 32}): a CompiledNetwork
        (or a PerBatchNetwork) with a plan, source, `forward` where the model has one, and save."""
        unknown = [s for s in sizes if s not in self.symbols]
        missing = [s for s in self.symbols if s not in sizes]
        if unknown or missing:
            raise UsageError(f"specialise takes a size for each dynamic dimension besides the batch, "
                             f"{list(self.symbols)}; " + (f"unknown: {unknown}" if unknown else f"missing: {missing}"))
        for s, n in sizes.items():
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
                raise UsageError(f"specialise: the size of '{s}' must be an int >= 0, not {n!r}")
        return self.network_at(tuple(int(sizes[s]) for s in self.symbols))

    def network_at(self, key: tuple[int, ...]) -> CompiledNetwork:
        """Return the network at the sizes `key` (one per symbol, in order), compiling it on first use
        and dropping the least recently run past specialisations_kept."""
        with device.stream_lock:
            net = self._nets.get(key)
            if net is not None:
                self._nets.move_to_end(key)
                return net
            net = self._compile_at(self._fixed_shapes(dict(zip(self.symbols, key))))
            if isinstance(net, PerShapeNetwork):  # (a bug: the fixed shapes left a dimension dynamic)
                raise UsageError(f"the model still has dynamic dimensions with {dict(zip(self.symbols, key))} fixed: "
                                 f"{net.why}")
            self._nets[key] = net
            while len(self._nets) > max(1, self.specialisations_kept):
                self._nets.popitem(last=False)
            return net

    def _fixed_shapes(self, sizes: dict[str, int]) -> dict[str, list]:
        """input_shapes fixing the dynamic inputs' dimensions to `sizes`, the batch symbol kept."""
        fixed = {k: list(dims) for k, dims in self.input_shapes.items()}
        for name, axis, sym in self._dynamic:
            fixed[name][axis] = sizes[sym]
        return fixed

    def run(self, feeds: Mapping[str, Any], outputs: list[str] | None = None) -> dict[str, Any]:
        """Return {output name: array}: the network at the feeds' shape runs them."""
        feeds, outputs = feeds_and_outputs(feeds, outputs, [SimpleNamespace(name=n) for n in self._input_names])
        sizes = self.sizes_of(feeds)
        return self.network_at(tuple(sizes[s] for s in self.symbols)).run(feeds, outputs)

    def profile(self, feeds: Mapping[str, Any], repeat: int = 5) -> list[tuple[str, float]]:
        """Return (stage, median milliseconds) of each kernel the network at the feeds' shape launches
        for them (CompiledNetwork.profile)."""
        sizes = self.sizes_of(feeds)
        return self.network_at(tuple(sizes[s] for s in self.symbols)).profile(feeds, repeat)

    def save(self, path: str | os.PathLike, *, model_name: str | None = None):
        """Refuse with UsageError, saying why: an artifact holds the network of one shape."""
        raise OneShapeNeeded(self._one_shape("cannot save this network", "in an artifact"))

    def __call__(self, **feeds):
        """Run and return the output (one) or a tuple of outputs in graph order."""
        res = self.run(feeds)
        vals = list(res.values())
        return vals[0] if len(vals) == 1 else tuple(vals)

    def __repr__(self) -> str:
        dims = ", ".join(f"{k}: {_dims_str(v)}" for k, v in self.input_shapes.items())
        return (f"<PerShapeNetwork {dims} on {self.backend}: compiled per shape of {', '.join(self.symbols)}, "
                f"{len(self._nets)} kept>")


def _dims_str(dims: list) -> str:
    """A model's dims as messages write them, an unnamed dynamic one '?'."""
    return shape_str(["?" if d is None else d for d in dims])


# a PerShapeNetwork is taken wherever a compiled network is (isinstance says so): what it cannot do
# for more than one shape raises OneShapeNeeded, saying how to fix a shape
CompiledNetwork.register(PerShapeNetwork)
