"""InferenceSession: onnxruntime's session API (get_inputs, get_outputs, run) over a compiled
network or a built .lml artifact, so that code written for onnxruntime runs unchanged with
`luisaml.InferenceSession` in place of `onnxruntime.InferenceSession`."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from .dtypes import onnx_name
from .errors import ModelError, UsageError
from .network import CompiledNetwork

if TYPE_CHECKING:  # onnx is imported when a session compiles a model, not for a .lml artifact
    import onnx
    from .plan import IOSpec


@dataclass(frozen=True)
class NodeArg:
    """A graph input or output as onnxruntime's NodeArg shows it: `name`, `shape` (an int per
    fixed dimension, the symbol as a string for a named one, None for one without either) and
    `type` ('tensor(float)', 'tensor(int64)', ...)."""

    name: str
    shape: list[int | str | None]
    type: str


def _node_arg(vi: onnx.ValueInfoProto) -> NodeArg:
    """Return the NodeArg of a declared graph input or output, as onnxruntime reads it."""
    return NodeArg(vi.name, _shape(vi.type), _type(vi.type))


def _spec_arg(s: IOSpec) -> NodeArg:
    """Return the NodeArg of a compiled input or output (what a .lml artifact records)."""
    return NodeArg(s.name, [d if isinstance(d, (int, str)) else None for d in s.shape],
                   f"tensor({s.dtype.name.lower()})")


def _constant_arg(name: str, value) -> NodeArg:
    """Return the NodeArg of a constant the graph passes straight to an output."""
    import numpy as np

    from .dtypes import from_numpy

    a = np.asarray(value)
    return NodeArg(name, list(a.shape), f"tensor({from_numpy(a.dtype).name.lower()})")


def _shape(t: onnx.TypeProto) -> list[int | str | None]:
    if not t.HasField("tensor_type") or not t.tensor_type.HasField("shape"):
        return []
    return [int(d.dim_value) if d.HasField("dim_value") else (d.dim_param if d.HasField("dim_param") else None)
            for d in t.tensor_type.shape.dim]


def _type(t: onnx.TypeProto) -> str:
    if t.HasField("tensor_type"):
        return f"tensor({onnx_name(t.tensor_type.elem_type).lower()})"
    if t.HasField("sequence_type"):
        return f"seq({_type(t.sequence_type.elem_type)})"
    if t.HasField("optional_type"):
        return f"optional({_type(t.optional_type.elem_type)})"
    return "unknown"


def backend_for(providers: Sequence | None) -> str:
    """Return the luisaml backend for onnxruntime's `providers` list: "cuda" where only CUDA is
    listed, "cpu" where only the CPU is, else "auto" (CUDA where it works, as onnxruntime falls back
    to the next provider)."""
    names = {p[0] if isinstance(p, (tuple, list)) else p for p in providers or ()}
    cuda, cpu = "CUDAExecutionProvider" in names, "CPUExecutionProvider" in names
    return "cuda" if cuda and not cpu else "cpu" if cpu and not cuda else "auto"


class InferenceSession:
    """A model compiled by luisaml behind onnxruntime's session API.

    `InferenceSession(path_or_bytes, weights=None, **compile_options)`: the model is a path (.onnx
    or LuisaML .json), the bytes of a serialised ModelProto, or an onnx.ModelProto; `weights` and
    `compile_options` are what `luisaml.compile` takes. A built artifact (`model.lml`) is loaded
    instead (luisaml.load: no onnx, no compile; its options were fixed when it was built). onnxruntime's own arguments are accepted so
    that its code runs unchanged, by keyword or in its positional order (path, sess_options,
    providers, provider_options): `providers` picks the backend when `backend` is not given
    (["CUDAExecutionProvider", ...] CUDA where it works, ["CPUExecutionProvider"] the CPU);
    `sess_options` and `provider_options` are ignored: luisaml has no such settings."""

    def __init__(self, path_or_bytes, weights=None, *ort_args, sess_options=None, providers: Sequence | None = None,
                 provider_options=None, **compile_options: Any):
        from .limits import DEFAULT
        from .loaders import load_proto
        from .runtime import compile

        if ort_args or type(weights).__name__ == "SessionOptions":  # onnxruntime's positional order
            if weights is not None and type(weights).__name__ != "SessionOptions":
                raise UsageError("InferenceSession takes (model, weights, **compile_options) or onnxruntime's "
                                 "(model, sess_options, providers, provider_options), not weights and providers")
            if len(ort_args) > 2:
                raise UsageError(f"InferenceSession takes at most 4 positional arguments, got {2 + len(ort_args)}")
            sess_options, weights = weights, None
            providers = ort_args[0] if ort_args else providers
        del sess_options, provider_options  # nothing in luisaml to set with them
        from .artifact import is_artifact

        if is_artifact(path_or_bytes):
            self._load_artifact(path_or_bytes, weights, providers, compile_options)
            return
        import onnx

        model = path_or_bytes
        if isinstance(model, (bytes, bytearray, memoryview)):
            try:
                model = onnx.load_from_string(bytes(model))
            except Exception as e:  # protobuf's DecodeError
                raise ModelError(f"the model bytes are not a serialised ONNX ModelProto: {e}") from e
        if "backend" not in compile_options and providers is not None:
            compile_options["backend"] = backend_for(providers)
        proto = load_proto(model, weights, limits=compile_options.get("limits") or DEFAULT)
        if isinstance(path_or_bytes, (str, os.PathLike)) and not proto.graph.name:
            proto.graph.name = os.path.basename(os.fspath(path_or_bytes))
        inits = {t.name for t in proto.graph.initializer}
        self._inputs = [_node_arg(vi) for vi in proto.graph.input if vi.name not in inits]
        self._outputs = [_node_arg(vi) for vi in proto.graph.output]
        self._net = compile(proto, **compile_options)
        # a graph input no node reads may be gone from the compiled network; onnxruntime still takes it
        self._unused = {a.name for a in self._inputs} - {s.name for s in self._net.inputs}

    def _load_artifact(self, path, weights, providers: Sequence | None, options: dict) -> None:
        from .artifact import load

        extra = sorted(k for k in options if k != "backend")
        if weights is not None or extra:
            raise UsageError(f"'{os.fspath(path)}' is a built artifact: its weights and compile options were fixed "
                             f"when it was built (got {', '.join(['weights'] * (weights is not None) + extra)})")
        backend = options.get("backend") or (backend_for(providers) if providers is not None else None)
        self._net = load(path, backend=backend)
        self._inputs = [_spec_arg(s) for s in self._net.inputs]
        specs = {s.name: s for s in self._net.inputs + self._net.outputs}
        self._outputs = [_spec_arg(specs[n]) if n in specs else _constant_arg(n, self._net.plan.model.graph.var(n).value)
                         for n in self._net.output_names]
        self._unused = set()

    @property
    def network(self) -> CompiledNetwork:
        """The CompiledNetwork this session runs (its plan, source, `forward`, `profile`)."""
        return self._net

    def get_inputs(self) -> list[NodeArg]:
        """Return the graph's inputs (initializers excluded) as onnxruntime lists them."""
        return list(self._inputs)

    def get_outputs(self) -> list[NodeArg]:
        """Return the graph's outputs as onnxruntime lists them."""
        return list(self._outputs)

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any], run_options=None) -> list:
        """Return the outputs named in `output_names` (None: every output), in that order, for
        `input_feed` ({input name: array}); run_options is accepted and ignored."""
        names = list(output_names) if output_names is not None else [a.name for a in self._outputs]
        feeds = {k: v for k, v in input_feed.items() if k not in self._unused} if self._unused else input_feed
        results = self._net.run(feeds, names)
        return [results[n] for n in names]

    def __repr__(self) -> str:
        ins = ", ".join(f"{a.name}: {a.type}{a.shape}" for a in self._inputs)
        outs = ", ".join(f"{a.name}: {a.type}{a.shape}" for a in self._outputs)
        return f"<luisaml.InferenceSession ({ins}) -> ({outs}) on {self._net.backend}>"
