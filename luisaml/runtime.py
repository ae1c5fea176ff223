"""compile() and analyze(): from a model file to a CompiledNetwork (or a plan, without a device).

The options travel as one `CompileOptions`, so that a network whose batch moves (its shapes are
fixed per run: network.PerBatchNetwork) can compile itself again at another batch size."""
from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Mapping, Optional, Union

import numpy as np
import onnx

from . import artifact, cache, compiler, device, loaders, passes
from .errors import BatchMixingError, UsageError
from .limits import DEFAULT as DEFAULT_LIMITS
from .limits import Limits
from .log import logger, phase
from .operators.mlp import MLPConfig
from .network import CompiledNetwork
from .per_batch import PerBatchNetwork
from .passes.infer import PROBE_A, input_shapes as declared_shapes
from .plan import Plan

# the string (and literal) options of compile() and analyze(), for type checkers and editors
Backend = Literal["auto", "cpu", "cuda"]
BatchAxis = Optional[Literal["auto", 0]]
Precision = Literal["fp32", "fp16"]
Float64 = Literal["reject", "float32"]
Fuse = Literal["auto", True, False]
FuseMode = Literal["off", "gpu", "emulated"]
Schedule = Literal["auto", "stages", "per-sample"]
Winograd = Literal["auto", False, 2, 4]
GridBuild = Literal["auto", "device", "host"]
ModelSource = Union[str, "os.PathLike[str]", onnx.ModelProto]
WeightsSource = Union[str, "os.PathLike[str]", bytes, Mapping[str, Any], None]


@dataclass(frozen=True)
class CompileOptions:
    """What compile() takes besides the model: see compile's docstring for each."""

    batch_axis: BatchAxis = "auto"
    input_shapes: Mapping[str, list] | None = None
    precision: Precision = "fp32"
    fuse: Fuse | FuseMode = "auto"
    float64: Float64 = "reject"
    limits: Limits = field(default_factory=lambda: DEFAULT_LIMITS)
    check_indices: bool = True
    schedule: Schedule = "auto"
    mlp: MLPConfig | None = None
    # one kernel for every stage: None decides by backend (the CPU backend: yes)
    merge_stages: bool | None = None
    # cooperative blocks through shared memory for large GEMMs and convolutions (operators/tiled.py):
    # None decides by backend (CUDA: yes; the CPU backend cannot compile shared memory)
    blocks: bool | None = None
    # 3x3 stride-1 convolutions as Winograd F(m x m, 3 x 3) (operators/winograd.py): the tile m, 0 off
    winograd: int = 0
    # where topology ops over grids bound at run time build their grids (luisaml/host_steps.py):
    # "device" or "host" (compile() resolves "auto")
    grid_build: str = "host"

    def check(self) -> None:
        """Raise UsageError for an option value luisaml does not know."""
        if self.float64 not in ("reject", "float32"):
            raise UsageError(f"float64 must be 'reject' or 'float32', not {self.float64!r}")
        if self.schedule not in ("auto", "stages", "per-sample"):
            raise UsageError(f"schedule must be 'auto', 'stages' or 'per-sample', not {self.schedule!r}")
        if self.batch_axis not in ("auto", 0, None):
            raise UsageError(f"batch_axis must be 'auto', 0 or None, not {self.batch_axis!r}")
        check_input_shapes(self.input_shapes)
        if self.winograd not in (0, 2, 4):
            raise UsageError(f"winograd must be 'auto', False, 2 or 4, not {self.winograd!r}")
        if self.grid_build not in ("device", "host"):
            raise UsageError(f"grid_build must be 'auto', 'device' or 'host', not {self.grid_build!r}")


def check_input_shapes(shapes) -> None:
    """Raise UsageError unless input_shapes is None or {input name: a list of dims}, each dim an int, a
    name (a symbolic dim) or None (kept as the model has it)."""
    if shapes is None:
        return
    want = 'input_shapes must be {input name: [dim, ...]} with each dim an int, a name or None, e.g. {"x": [None, 16]}'
    if not isinstance(shapes, Mapping):
        raise UsageError(f"{want}; got {type(shapes).__name__} {shapes!r:.80}")
    for name, dims in shapes.items():
        if not isinstance(name, str):
            raise UsageError(f"{want}; got the key {name!r:.80} ({type(name).__name__})")
        if isinstance(dims, (str, bytes)) or not isinstance(dims, (list, tuple)):
            raise UsageError(f"{want}; got input_shapes[{name!r}] = {dims!r:.80} ({type(dims).__name__})")
        for d in dims:
            if not (d is None or isinstance(d, str) or (isinstance(d, (int, np.integer)) and not isinstance(d, bool))):
                raise UsageError(f"{want}; got input_shapes[{name!r}] = {list(dims)!r:.80}, whose dim {d!r:.40} is a "
                                 f"{type(d).__name__}")


# the Winograd tile "auto" takes on CUDA (benchmarks/NOTES.md, "Winograd convolutions"); the CPU
# backend keeps the direct form unless asked
AUTO_WINOGRAD = 4


def winograd_tile(winograd, backend: str) -> int:
    """Return the Winograd tile m compile() uses on a backend (0: the direct form)."""
    if winograd == "auto":
        return AUTO_WINOGRAD if backend == "cuda" else 0
    if winograd is False or winograd is None:
        return 0
    if winograd is True:
        raise UsageError("winograd must be 'auto', False, 2 or 4 (the tile size), not True")
    return winograd


def _model_name(model) -> str:
    if isinstance(model, (str, os.PathLike)):
        return os.path.basename(os.fspath(model))
    return getattr(getattr(model, "graph", None), "name", None) or "model"


def analyze(model: ModelSource, weights: WeightsSource = None, *, batch_axis: BatchAxis = "auto",
            input_shapes: Mapping[str, list] | None = None, fuse: FuseMode = "off", precision: Precision = "fp32",
            float64: Float64 = "reject", limits: Limits | None = None, check_indices: bool = True,
            schedule: Schedule = "auto", mlp: MLPConfig | None = None, target: str = "cpu",
            winograd: Winograd = "auto") -> Plan:
    """Return the compile plan of a model without starting a device (what `inspect` shows); a
    graph whose batch moves is planned at batch 2 (it compiles per batch size when it runs).

    fuse: "off", "gpu" or "emulated"; target: the backend the plan is for, "cpu" (stages merged
    into one kernel) or "cuda" (cooperative blocks stages); the other options as `compile` takes
    them."""
    if target not in ("cpu", "cuda"):
        raise UsageError(f"target must be 'cpu' or 'cuda', not {target!r}")
    opts = CompileOptions(batch_axis, input_shapes, precision, fuse, float64, limits or DEFAULT_LIMITS,
                          check_indices, schedule, mlp, merge_stages=target == "cpu", blocks=target == "cuda",
                          winograd=winograd_tile(winograd, target))
    opts.check()
    with phase("load", model=_model_name(model)):
        proto = loaders.load_proto(model, weights, limits=opts.limits)
    plan, _, _ = plan_for(proto, _model_name(model), opts, fuse)
    return plan


def plan_for(proto: onnx.ModelProto, name: str, opts: CompileOptions, fuse_mode: str,
             on_schedule=None) -> tuple[Plan, str | None, str | None]:
    """Return (the plan, None, its batch symbol), or for a graph that cannot run one sample at a
    time (its batch moves, or a node mixes samples) (its plan at batch PROBE_A, why, the symbol).
    on_schedule: build_plan's hook, for the plan that runs (not a probe's)."""
    with phase("passes"):
        prep = passes.prepare(copy.deepcopy(proto), batch_axis=opts.batch_axis, input_shapes=opts.input_shapes,
                              limits=opts.limits)
    prep.float64_as_float = opts.float64 == "float32"
    try:
        return _build(prep, name, opts, fuse_mode, on_schedule), None, prep.symbol
    except BatchMixingError as e:
        if prep.symbol is None:
            raise
        why = str(e)
    shapes = fixed_shapes(proto, prep.symbol, PROBE_A, opts.input_shapes)
    with phase("passes", batch=PROBE_A):
        fixed = passes.prepare(copy.deepcopy(proto), batch_axis=None, input_shapes=shapes, limits=opts.limits)
    fixed.float64_as_float = prep.float64_as_float
    return _build(fixed, name, opts, "off" if opts.precision == "fp32" else fuse_mode), why, prep.symbol


def _build(prep, name: str, opts: CompileOptions, fuse_mode: str, on_schedule=None) -> Plan:
    schedule = "per-sample" if opts.schedule == "per-sample" else "stages"
    # one kernel for all stages on the CPU backend, where every kernel is a clang run of its own
    # (10 small kernels: 30 s apart, 3.5 s merged); compile() says no on CUDA, where each stage keeps
    # its own registers, and build_plan keeps a GPU fused MLP apart in any case
    merge = opts.merge_stages is not False
    options = dict(fuse=fuse_mode, precision=opts.precision, limits=opts.limits, check_indices=opts.check_indices,
                   schedule=schedule, mlp=opts.mlp, merge_stages=merge, blocks=opts.blocks is True,
                   winograd=opts.winograd)
    plan = compiler.build_plan(prep, name, on_schedule=on_schedule, **options)
    plan.built_from = (prep, name, options)  # what a .lml stores as data, for load to call build_plan again
    if plan.host_steps is not None and opts.grid_build == "device":
        from .host_steps import DeviceBuilds

        plan.host_steps.device = DeviceBuilds(lambda m, workers: _compile_grid_step(m, opts.limits, workers),
                                              repr(opts.limits))
    return plan


def _compile_grid_step(model: onnx.ModelProto, limits: Limits, workers: bool) -> CompiledNetwork:
    """Return the network of a device grid build (luisaml/host_steps.py DeviceBuilds: the node alone,
    no batch) on the process's backend. workers: build its kernels in worker processes; a later
    capacity of the same node is the same kernels, cached on disk, which workers (2-3 s to start)
    would only delay (on the H200: a new capacity's first run 4.65 s with them, 2.47 s without)."""
    backend = device.current() or device.init("auto")
    opts = CompileOptions(batch_axis=None, limits=limits, merge_stages=backend == "cpu", blocks=backend == "cuda")
    ahead = _WorkersAhead(backend) if workers else None
    proto = loaders.load_proto(model, None, limits=limits)
    plan, _, _ = plan_for(proto, model.graph.name, opts, "off", ahead)
    net = _network(plan, backend, ahead)
    if not workers:
        net.build_workers = False
    return net


def fixed_shapes(proto: onnx.ModelProto, symbol: str, n: int, given: Mapping | None) -> dict[str, list]:
    """Return input_shapes fixing the batch symbol to n in every graph input (and the caller's)."""
    shapes = {k: list(v) for k, v in (given or {}).items()}
    for name, dims in declared_shapes(proto).items():
        base = shapes.get(name, dims)
        shapes[name] = [n if d == symbol else d for d in base]
    return shapes


def fusion_mode(fuse, backend: str, precision: str = "fp32") -> str:
    """Return the fused-kernel mode for a backend: "gpu" (shared memory, CUDA), "emulated" (the CPU
    backend, which cannot compile shared memory) or "off"."""
    if fuse in (False, "off", None):
        if precision != "fp32":
            raise UsageError(f"precision='{precision}' needs the fused MLP kernel; it cannot be used with fuse={fuse!r}")
        return "off"
    if fuse not in ("auto", True):
        raise UsageError(f"fuse must be 'auto', True or False, not {fuse!r}")
    if backend == "cuda":
        return "gpu"
    # on the CPU backend the fused kernel is a correctness path: only when asked for
    return "emulated" if (fuse is True or precision != "fp32") else "off"


def compile(
    model: ModelSource,
    weights: WeightsSource = None,
    *,
    backend: Backend = "auto",
    batch_axis: BatchAxis = "auto",
    input_shapes: Mapping[str, list] | None = None,
    verbose: bool = False,
    precision: Precision = "fp32",
    fuse: Fuse = "auto",
    float64: Float64 = "reject",
    limits: Limits | None = None,
    check_indices: bool = True,
    schedule: Schedule = "auto",
    mlp: MLPConfig | None = None,
    winograd: Winograd = "auto",
    grid_build: GridBuild = "auto",
) -> CompiledNetwork:
    """Return the model compiled for the chosen backend.

    model: a path (.onnx or LuisaML .json), or an onnx.ModelProto.
    weights: a safetensors file, a header-less blob, bytes, or a dict of arrays (optional).
    backend: "auto" (LUISAML_BACKEND when set, else CUDA where a CUDA device works, else the CPU),
    "cpu" or "cuda". A process runs one LuisaCompute device: the first compile picks it.
    batch_axis: "auto" (the symbolic dimension leading an input and an output is the batch), 0,
    or None (one instance of the graph as its shapes say). A graph whose nodes keep samples
    apart runs per sample for any batch size; one that moves the batch axis (attention's
    [B,S,D] -> [S,B,D]) or mixes samples (a mean over the batch) compiles for each batch size it
    is run with.
    input_shapes: fix dynamic dimensions, e.g. {"x": [None, 16, 3]} (None keeps a dimension).
    precision: "fp32", or "fp16": float inputs and outputs are half (the fused MLP kernel only;
    never chosen implicitly).
    fuse: "auto" (an MLP gets the fused cooperative kernel on CUDA), True (also on the CPU
    backend, emulated), False (never).
    float64: "reject" (operators other than fVDB's refuse float64 tensors), or "float32": compute
    them in float32 (LuisaCompute has no double); inputs and outputs stay float64 on the host.
    limits: luisaml.Limits, the sizes a model may make luisaml allocate (README: Security and limits).
    check_indices: True (an out-of-range runtime index of Gather, GatherElements, GatherND,
    ScatterElements or ScatterND makes run() raise RunError naming the node), or False (such an
    index is clamped into range without a word: one flag store less per index).
    schedule: "auto" or "stages" (the graph runs as parallel stages, luisaml/schedule.py), or
    "per-sample" (one kernel, one thread running a whole sample).
    mlp: the fused MLP kernel's knobs (luisaml.MLPConfig) for measurements; None: chosen per shape.
    winograd: 3x3 stride-1 convolutions of 16 channels or more as Winograd F(m x m, 3 x 3)
    (operators/winograd.py): "auto" (F(4x4) on CUDA, the direct form on the CPU), 4, 2, or False.
    F(4x4) does a quarter of the multiply-adds and rounds to about 2e-6 of a layer's largest output
    (the direct form ~2e-7); F(2x2) is in between.
    grid_build: where fVDB's topology ops over grids bound at run time (CoarsenedGrid, ConvGrid, ...:
    a U-Net's coarse levels made in the model) build their grids when a run binds a new grid
    (luisaml/host_steps.py): "auto" (the device on CUDA, the host's numpy builder on the CPU),
    "device" (a network of the op alone, compiled once per power of two of the source's voxels)
    or "host".
    verbose: log the compile's phases at INFO (same as logging.getLogger("luisaml").setLevel)."""
    t0 = time.perf_counter()
    if verbose and not logger.isEnabledFor(20):
        import logging

        logging.basicConfig()
        logger.setLevel(logging.INFO)
    name = device.init(backend)
    opts = CompileOptions(batch_axis, input_shapes, precision, fuse, float64, limits or DEFAULT_LIMITS,
                          check_indices, schedule, mlp, merge_stages=name == "cpu",
                          blocks=name == "cuda", winograd=winograd_tile(winograd, name),
                          grid_build=("device" if name == "cuda" else "host") if grid_build == "auto" else grid_build)
    opts.check()
    mode = fusion_mode(fuse, name, precision)
    with phase("load", model=_model_name(model)):
        proto = loaders.load_proto(model, weights, limits=opts.limits)
    workers = _WorkersAhead(name)
    plan, why, symbol = plan_for(proto, _model_name(model), opts, mode, workers)
    net = _network(plan, name, workers if why is None else None)
    if why is not None:  # (the probe plan runs only if asked to; its per-batch builds start their own)
        if workers.workers is not None:
            workers.workers.close()
        net = PerBatchNetwork(net, why, symbol, declared_shapes(proto),
                              lambda n: _compile_fixed(proto, _model_name(model), opts, mode, name, symbol, n),
                              save=artifact.save)
    logger.info("compiled %s in %.2f s -> %s", _model_name(model), time.perf_counter() - t0, net.path)
    return net


class _WorkersAhead:
    """build_plan's on_schedule on CUDA: once the stages are known, start the processes that will
    build their kernels (parallel_build.Workers), so that their start-up (2-3 s each, 15 at once)
    overlaps code generation and the module's import. Measured on the H200, ResNet-18's cold compile
    in bench_models: 13.4 s with the workers started at the first launch, 10.6 s started here."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.workers = None

    def __call__(self, schedule) -> None:
        from . import parallel_build

        if self.backend != "cuda" or self.workers is not None:
            return
        count = parallel_build.workers_for(sum(st.domain != "fused" for st in schedule.stages))
        if count:
            self.workers = parallel_build.Workers(self.backend, count)


def _network(plan: Plan, backend: str, ahead: _WorkersAhead | None = None) -> CompiledNetwork:
    with phase("codegen write"):
        path = cache.write_module(plan.source)
        module = cache.import_module(path)
    net = CompiledNetwork(plan, module, str(path), backend, save=artifact.save)
    if ahead is not None and ahead.workers is not None:
        if plan.merged_stages or plan.schedule is None:  # one kernel: nothing to share out
            ahead.workers.close()
        else:
            net.build_workers = ahead.workers
    return net


def _compile_fixed(proto, name: str, opts: CompileOptions, mode: str, backend: str, symbol: str, n: int) -> CompiledNetwork:
    """Return the network of a graph whose batch moves, compiled with its batch size fixed at n."""
    shapes = fixed_shapes(proto, symbol, n, opts.input_shapes)
    fixed = replace(opts, batch_axis=None, input_shapes=shapes)
    with phase("passes", batch=n):
        prep = passes.prepare(copy.deepcopy(proto), batch_axis=None, input_shapes=shapes, limits=opts.limits)
    prep.float64_as_float = opts.float64 == "float32"
    ahead = _WorkersAhead(backend)
    return _network(_build(prep, name, fixed, "off" if opts.precision == "fp32" else mode, ahead), backend, ahead)
