"""InferenceSession: onnxruntime's session API (get_inputs, get_outputs, run, get_providers,
get_provider_options, get_modelmeta, get_session_options, end_profiling) and its SessionOptions
over a compiled network or a built .lml artifact, so that code written for onnxruntime runs
unchanged with `luisaml.InferenceSession` in place of `onnxruntime.InferenceSession`."""
from __future__ import annotations

import json
import os
import time
import warnings
from dataclasses import dataclass, field
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


@dataclass
class SessionOptions:
    """onnxruntime's SessionOptions, the settings luisaml reads (an onnxruntime.SessionOptions is
    read the same way, by these names): intra_op_num_threads (the CPU backend's worker threads; 0:
    one per core), enable_profiling and profile_file_prefix (end_profiling writes the trace),
    optimized_model_filepath (refused: luisaml writes no ONNX model; `luisaml build` writes a .lml).
    The others are kept so that code setting them runs, and change nothing in luisaml: it always
    optimises the graph and runs one stream (onnxruntime's sequential execution)."""

    intra_op_num_threads: int = 0
    inter_op_num_threads: int = 0
    enable_profiling: bool = False
    profile_file_prefix: str = "onnxruntime_profile_"
    optimized_model_filepath: str = ""
    graph_optimization_level: Any = None
    execution_mode: Any = None
    log_severity_level: int = -1  # (onnxruntime: -1, its default, warning)
    log_verbosity_level: int = 0
    logid: str = ""
    enable_cpu_mem_arena: bool = True
    enable_mem_pattern: bool = True
    use_deterministic_compute: bool = False


@dataclass(frozen=True)
class ModelMetadata:
    """onnxruntime's ModelMetadata: what the ModelProto says about itself."""

    producer_name: str = ""
    graph_name: str = ""
    domain: str = ""
    description: str = ""
    graph_description: str = ""
    version: int = 0
    custom_metadata_map: dict[str, str] = field(default_factory=dict)


def _metadata(proto: onnx.ModelProto) -> ModelMetadata:
    return ModelMetadata(proto.producer_name, proto.graph.name, proto.domain, proto.doc_string, proto.graph.doc_string,
                         int(proto.model_version), {p.key: p.value for p in proto.metadata_props})


# onnxruntime's provider names for luisaml's backends (what get_providers lists, as onnxruntime
# lists the CPU provider last as every session's fallback)
_PROVIDERS = {"cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"], "cpu": ["CPUExecutionProvider"]}
_KNOWN = {"CUDAExecutionProvider", "CPUExecutionProvider"}


def _provider_options(providers: Sequence | None, provider_options) -> dict[str, dict[str, str]]:
    """Return {provider: {option: value as a string}} from onnxruntime's two ways of giving them
    ((name, options) pairs, or a parallel provider_options list); warn naming the providers luisaml
    does not have (onnxruntime warns too, and falls back), refuse options it cannot honour."""
    names, given = [], {}
    for k, p in enumerate(providers or ()):
        name, opts = (p[0], p[1]) if isinstance(p, (tuple, list)) else (p, None)
        if opts is None and provider_options is not None and k < len(provider_options):
            opts = provider_options[k]
        names.append(name)
        given[name] = {str(a): str(v) for a, v in dict(opts or {}).items()}
    unknown = [n for n in names if n not in _KNOWN]
    if unknown:
        warnings.warn(f"luisaml runs its own kernels and ignores the execution providers {unknown}; it maps "
                      "'CUDAExecutionProvider' to its cuda backend and 'CPUExecutionProvider' to its cpu backend",
                      UserWarning, stacklevel=3)
    for name, opts in given.items():
        bad = {a: v for a, v in opts.items() if not (name == "CUDAExecutionProvider" and a == "device_id" and v == "0")}
        if bad and name in _KNOWN:
            raise UsageError(f"provider options {bad} of {name}: luisaml has no such settings (it runs on CUDA "
                             "device 0; device_id '0' is the one option it takes)")
    return given


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
    (["CUDAExecutionProvider", ...] CUDA where it works, ["CPUExecutionProvider"] the CPU; any other
    provider is named in a warning and ignored); `sess_options` (SessionOptions, or onnxruntime's)
    is honoured where it means something in luisaml and refused where it cannot be (see
    SessionOptions); `provider_options` takes only CUDA's device_id 0."""

    def __init__(self, path_or_bytes, weights=None, *ort_args, sess_options=None, providers: Sequence | None = None,
                 provider_options=None, **compile_options: Any):
        if ort_args or type(weights).__name__ == "SessionOptions":  # onnxruntime's positional order
            if weights is not None and type(weights).__name__ != "SessionOptions":
                raise UsageError("InferenceSession takes (model, weights, **compile_options) or onnxruntime's "
                                 "(model, sess_options, providers, provider_options), not weights and providers")
            if len(ort_args) > 2:
                raise UsageError(f"InferenceSession takes at most 4 positional arguments, got {2 + len(ort_args)}")
            sess_options, weights = weights, None
            providers = ort_args[0] if ort_args else providers
            provider_options = ort_args[1] if len(ort_args) > 1 else provider_options
        self._start = time.perf_counter()
        self._options = sess_options if sess_options is not None else SessionOptions()
        self._given_provider_options = _provider_options(providers, provider_options)
        backend = self._apply_session_options(compile_options.get("backend") or (
            backend_for(providers) if providers is not None else "auto"))
        self._profile: list[dict] | None = [] if getattr(self._options, "enable_profiling", False) else None
        try:
            self._open(path_or_bytes, weights, providers, compile_options)
        finally:
            self._span("session_initialization", self._start)

    def _apply_session_options(self, backend: str) -> str:
        """Honour the session options luisaml has a meaning for, refuse the ones it cannot; return
        the backend the session will run on."""
        from . import device

        o = self._options
        if getattr(o, "optimized_model_filepath", ""):
            raise UsageError(f"sess_options.optimized_model_filepath={o.optimized_model_filepath!r}: luisaml writes "
                             "no optimised ONNX model; `luisaml build MODEL -o FILE.lml` (or net.save) writes the "
                             "compiled model")
        threads = int(getattr(o, "intra_op_num_threads", 0) or 0)
        want = device.current() or device.choose_backend(backend)
        if threads > 0 and want == "cpu" and not device.request_cpu_threads(threads):
            warnings.warn(f"sess_options.intra_op_num_threads={threads} cannot take effect: LuisaCompute's CPU "
                          f"backend started in this process with {device.cpu_threads()} threads, and its thread "
                          "pool is the process's (set it in the first session, or LUISA_NUM_THREADS)",
                          UserWarning, stacklevel=3)
        elif threads > 0 and want != "cpu":
            warnings.warn(f"sess_options.intra_op_num_threads={threads} has no effect on the {want} backend "
                          "(it sets the CPU backend's worker threads)", UserWarning, stacklevel=3)
        return want

    def _open(self, path_or_bytes, weights, providers, compile_options: dict) -> None:
        from .artifact import is_artifact

        if is_artifact(path_or_bytes):
            self._load_artifact(path_or_bytes, weights, providers, compile_options)
            return
        # what compiles imports onnx: only here, so that a session over a .lml runs without it
        import onnx

        from .limits import DEFAULT
        from .loaders import load_proto
        from .runtime import compile

        model = path_or_bytes
        if isinstance(model, (bytes, bytearray, memoryview)):
            try:
                model = onnx.load_from_string(bytes(model))
            except Exception as e:  # protobuf's DecodeError
                raise ModelError(f"the model bytes are not a serialised ONNX ModelProto: {e}") from e
        if "backend" not in compile_options and providers is not None:
            compile_options["backend"] = backend_for(providers)
        proto = load_proto(model, weights, limits=compile_options.get("limits") or DEFAULT)
        self._meta = _metadata(proto)  # (before the graph is named after its file: onnxruntime shows it unnamed)
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
        `input_feed` ({input name: array, or a nested Python list as onnxruntime takes it: made an
        array of the input's type}); run_options is accepted and ignored."""
        start = time.perf_counter()
        names = list(output_names) if output_names is not None else [a.name for a in self._outputs]
        feeds = {k: v for k, v in input_feed.items() if k not in self._unused} if self._unused else input_feed
        results = self._net.run(self._arrays(feeds), names)
        self._span("model_run", start)
        return [results[n] for n in names]

    def _arrays(self, feeds: Mapping[str, Any]) -> Mapping[str, Any]:
        """Return the feeds with each Python list, tuple or scalar made an array of its input's
        dtype (onnxruntime converts them so: [[1, 2]] feeds a float input); a ragged list is an
        InputError naming the input."""
        import numpy as np

        from .errors import InputError

        if all(hasattr(v, "shape") for v in feeds.values()):
            return feeds
        dtypes = {s.name: self._net.io_dtype(s).numpy for s in self._net.inputs}
        out = dict(feeds)
        for name, v in feeds.items():
            if hasattr(v, "shape") or name not in dtypes:
                continue
            try:
                out[name] = np.array(v, dtype=dtypes[name])
            except (ValueError, TypeError) as e:
                raise InputError(f"input '{name}': a {type(v).__name__} that is not a rectangular array of "
                                 f"{np.dtype(dtypes[name])} ({' '.join(str(e).split())})") from None
        return out

    # ---- onnxruntime's other session methods ----------------------------------------------
    def get_providers(self) -> list[str]:
        """Return onnxruntime's names of the providers this session runs on: the CUDA and CPU
        providers on the cuda backend (host steps run on the CPU), the CPU provider on the cpu one."""
        return list(_PROVIDERS[self._net.backend])

    def get_provider_options(self) -> dict[str, dict[str, str]]:
        """Return {provider: {option: value}} of get_providers(), as onnxruntime does (the options
        given for them; luisaml adds none of its own)."""
        return {p: dict(self._given_provider_options.get(p, {})) for p in self.get_providers()}

    def get_modelmeta(self) -> ModelMetadata:
        """Return the model's metadata (producer, graph name, domain, description, version, custom
        metadata_props) as onnxruntime's ModelMetadata has it; for a .lml, the model's file name."""
        meta = getattr(self, "_meta", None)
        if meta is None:
            meta = ModelMetadata(graph_name=str(getattr(getattr(self._net, "artifact", None), "model", "") or ""))
        return meta

    def get_session_options(self):
        """Return the session's options: the SessionOptions given (onnxruntime's or luisaml's), or
        luisaml's defaults, which are onnxruntime's."""
        return self._options

    def end_profiling(self) -> str:
        """Write the profile recorded since the session started (enable_profiling: its
        initialisation and each run, as onnxruntime's Chrome-trace events "model_run" and
        "session_initialization") to PREFIX_<date>_<time>.json and return that path; return ""
        when profiling is off or ended already, as onnxruntime does."""
        if self._profile is None:
            return ""
        now = time.time()
        stamp = time.strftime("%Y-%m-%d_%H-%M-%S", time.localtime(now)) + f"_{int(now * 1e3) % 1000:03d}"
        path = f"{getattr(self._options, 'profile_file_prefix', 'onnxruntime_profile_')}_{stamp}.json"
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self._profile, f)
        self._profile = None
        return path

    def _span(self, name: str, start: float) -> None:
        """Record a Chrome-trace complete event from `start` to now (times in µs since the session began)."""
        if self._profile is None:
            return
        end = time.perf_counter()
        self._profile.append({"cat": "Session", "pid": os.getpid(), "tid": os.getpid(), "dur": int((end - start) * 1e6),
                              "ts": int((start - self._start) * 1e6), "ph": "X", "name": name, "args": {}})

    def __repr__(self) -> str:
        ins = ", ".join(f"{a.name}: {a.type}{a.shape}" for a in self._inputs)
        outs = ", ".join(f"{a.name}: {a.type}{a.shape}" for a in self._outputs)
        return f"<luisaml.InferenceSession ({ins}) -> ({outs}) on {self._net.backend}>"
