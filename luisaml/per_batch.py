"""PerBatchNetwork: a graph that cannot run one sample at a time (its batch axis moves, or a node
mixes samples), compiled for each batch size it runs with: it wraps one CompiledNetwork per batch
size, the first of them the probe at batch 2 (what it shows: plan, source, inputs)."""
from __future__ import annotations

import os
from typing import Any, Callable, Mapping

import numpy as np

from . import device
from .dtypes import shape_str
from .errors import InputError, InputNameError, UsageError
from .feeds import feeds_and_outputs
from .interop import is_torch
from .network import CompiledNetwork


class PerBatchNetwork:
    """A network that cannot run one sample at a time (its batch axis moves, or a node mixes
    samples): it compiles itself for each batch size it runs with, shapes fixed, and runs those
    as parallel stages. Its plan, source and allocation are those at batch 2 (what inspect shows);
    `forward` does not exist, since no per-sample function does."""

    # what it answers with its probe's (the network at batch 2): what the network is, and the
    # operations over one plan (a check, a launch) that take that plan's shapes
    _FROM_PROBE = frozenset({
        "plan", "module", "path", "backend", "artifact", "kernels", "kernel", "build_workers", "source",
        "allocation", "inputs", "outputs", "output_names", "weight_layout", "weight_bytes", "weights", "io_dtype",
        "input_type", "output_type", "plan_array_type", "check_feeds", "derived_arguments", "run_hashed",
        "check_batch", "launch", "pool", "bound", "launcher",
    })

    def __init__(self, probe: CompiledNetwork, why: str, symbol: str, declared: dict[str, list],
                 compile_at: Callable[[int], CompiledNetwork], save: Callable | None = None):
        from .passes.infer import PROBE_A

        self.probe = probe
        self.why = why
        self.symbol = symbol
        # (input, axis of the batch symbol) of every input that has it
        self._batch_axes = [(k, dims.index(symbol)) for k, dims in declared.items() if symbol in dims]
        self._compile_at = compile_at
        self._nets: dict[int, CompiledNetwork] = {PROBE_A: probe}  # the probe plan is batch PROBE_A
        self._save = save  # luisaml/artifact.py's save (which refuses it, saying why), as CompiledNetwork's

    def __getattr__(self, name: str) -> Any:
        if name in PerBatchNetwork._FROM_PROBE:
            return getattr(self.probe, name)
        raise AttributeError(f"'PerBatchNetwork' object has no attribute '{name}'")

    @property
    def forward(self):
        """Raise UsageError: a network whose batch moves has no per-sample function."""
        raise UsageError(
            f"this network has no per-sample `forward`: {self.why}; it runs with its batch size fixed per run "
            "(net.run), which a user kernel calling one sample cannot do"
        )

    @property
    def batch_symbol(self) -> str | None:
        """The symbol of the batch dimension its shapes are fixed along at each run."""
        return self.symbol

    def network_for(self, n: int) -> CompiledNetwork:
        """Return the network compiled for batch size n (compiling it on first use)."""
        with device.stream_lock:
            if n not in self._nets:
                self._nets[n] = self._compile_at(n)
            return self._nets[n]

    def batch_of(self, feeds: Mapping[str, Any]) -> int:
        """Return the batch size the feeds carry (the batch symbol's extent in the inputs)."""
        n = None
        for name, axis in self._batch_axes:
            if name in feeds:
                shape = np.shape(feeds[name]) if not is_torch(feeds[name]) else tuple(feeds[name].shape)
                if axis >= len(shape):
                    raise InputError(f"input '{name}': expected rank > {axis} (axis {axis} is the batch '{self.symbol}'), "
                                     f"got shape {shape_str(shape)}")
                if n is not None and shape[axis] != n[1]:
                    raise InputError(f"input '{name}': batch dimension '{self.symbol}' is {shape[axis]}, but input "
                                     f"'{n[0]}' has {n[1]}")
                n = n or (name, int(shape[axis]))
        if n is None:
            names = [k for k, _ in self._batch_axes]
            raise InputNameError(f"missing input(s) {names}; the network's inputs are {[s.name for s in self.inputs]}")
        return n[1]

    def run(self, feeds: Mapping[str, Any], outputs: list[str] | None = None) -> dict[str, Any]:
        """Return {output name: array}: the network at this batch size runs the feeds."""
        feeds, outputs = feeds_and_outputs(feeds, outputs, self.plan.inputs)
        return self.network_for(self.batch_of(feeds)).run(feeds, outputs)

    def profile(self, feeds: Mapping[str, Any], repeat: int = 5) -> list[tuple[str, float]]:
        """Return (stage, median milliseconds) of each kernel the network at the feeds' batch size
        launches for them (CompiledNetwork.profile)."""
        return self.network_for(self.batch_of(feeds)).profile(feeds, repeat)

    def save(self, path: str | os.PathLike, *, model_name: str | None = None):
        """Refuse with UsageError, saying why: an artifact holds one network, and this one compiles
        per batch size (luisaml/artifact.py names the options that fix it)."""
        if self._save is None:
            raise UsageError("cannot save this network: it was not made by luisaml.compile or luisaml.load")
        return self._save(self, path, model_name=model_name)

    def __call__(self, **feeds):
        """Run and return the output (one) or a tuple of outputs in graph order."""
        res = self.run(feeds)
        vals = list(res.values())
        return vals[0] if len(vals) == 1 else tuple(vals)

    def __repr__(self) -> str:
        return repr(self.probe).replace("<CompiledNetwork", "<PerBatchNetwork", 1)


# a PerBatchNetwork answers everything a CompiledNetwork does (isinstance says so, as it did when it
# was a subclass): callers that take "a compiled network" take either
CompiledNetwork.register(PerBatchNetwork)
