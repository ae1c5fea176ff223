"""compile() and analyze(): from a model file to a CompiledNetwork (or a plan, without a device).

The options travel as one `CompileOptions`, so that a network whose batch moves (its shapes are
fixed per run: per_batch.PerBatchNetwork) can compile itself again at another batch size, and one
with other dynamic dimensions (per_shape.PerShapeNetwork) at another shape; they are
resolved for the backend once (planning.CompileOptions.resolve), and planned by luisaml/planning.py."""
from __future__ import annotations

import copy
import os
import time
from dataclasses import replace
from typing import Any, Mapping, Union

import onnx

from . import artifact, cache, compiler, device, loaders, tune as tuner
from .errors import UsageError
from .limits import DEFAULT as DEFAULT_LIMITS
from .limits import Limits
from .log import logger, phase
from .network import CompiledNetwork
from .operators.mlp import MLPConfig
from .passes.infer import DynamicDimsError
from .passes.infer import input_shapes as declared_shapes
from .per_batch import PerBatchNetwork
from .per_shape import PerShapeNetwork
from .plan import Plan
from .pool import SharedBuffers
from .planning import (Backend, BatchAxis, CompileOptions, Float64, Fuse, FuseMode, GridBuild, Precision, Recurrent,
                       Schedule, TensorCores, Tune, Winograd, build, fixed_batch, fixed_shapes, plan_for)

ModelSource = Union[str, "os.PathLike[str]", onnx.ModelProto]
WeightsSource = Union[str, "os.PathLike[str]", bytes, Mapping[str, Any], None]


def _model_name(model) -> str:
    if isinstance(model, (str, os.PathLike)):
        return os.path.basename(os.fspath(model))
    return getattr(getattr(model, "graph", None), "name", None) or "model"


def analyze(model: ModelSource, weights: WeightsSource = None, *, batch_axis: BatchAxis = "auto",
            input_shapes: Mapping[str, list] | None = None, fuse: FuseMode = "off", precision: Precision = "fp32",
            float64: Float64 = "reject", limits: Limits | None = None, check_indices: bool = True,
            schedule: Schedule = "auto", mlp: MLPConfig | None = None, target: str = "cpu",
            winograd: Winograd = "auto", recurrent: Recurrent = "auto", rows_kept: bool = True) -> Plan:
    """Return the compile plan of a model without starting a device (what `inspect` shows); a
    graph whose batch moves is planned at batch 2 (it compiles per batch size when it runs).

    fuse: "off", "gpu" or "emulated"; target: the backend the plan is for, "cpu" (stages merged
    into one kernel) or "cuda" (cooperative blocks stages); the other options as `compile` takes
    them."""
    if target not in ("cpu", "cuda"):
        raise UsageError(f"target must be 'cpu' or 'cuda', not {target!r}")
    # (its fuse is the mode itself; its grid ops are shown as built on the host, as compile's "host")
    opts = replace(CompileOptions(batch_axis, input_shapes, precision, float64=float64, limits=limits or DEFAULT_LIMITS,
                                  check_indices=check_indices, schedule=schedule, mlp=mlp, winograd=winograd,
                                  grid_build="host", recurrent=recurrent, rows_kept=rows_kept).resolve(target),
                   fuse=fuse)
    with phase("load", model=_model_name(model)):
        proto = loaders.load_proto(model, weights, limits=opts.limits)
    plan, _, _ = plan_for(proto, _model_name(model), opts)
    return plan


# the kernel-only buffers (stage slots, scratch) of every device grid build's network: kept for the
# process, one network a node and power of two, they run one at a time (each run under
# device.stream_lock, before the kernels of the run that asked for it), so the process holds the
# largest build's scratch, not every capacity's (issue 28: a detector's ConvGrid builds of 2^15 and
# 2^16 voxels held 280 and 559 MB of int scratch side by side)
GRID_BUILD_BUFFERS = SharedBuffers()


def _compile_grid_step(model: onnx.ModelProto, limits: Limits, workers: bool) -> CompiledNetwork:
    """Return the network of a device grid build (luisaml/host_steps.py DeviceBuilds: the node alone,
    no batch) on the process's backend, its kernel-only buffers GRID_BUILD_BUFFERS'. workers: build its
    kernels in worker processes; a later capacity of the same node is the same kernels, cached on disk,
    which workers (2-3 s to start) would only delay (on the H200: a new capacity's first run 4.65 s
    with them, 2.47 s without)."""
    backend = device.current() or device.init("auto")
    opts = CompileOptions(batch_axis=None, fuse=False, limits=limits, winograd=False, grid_build="host").resolve(backend)
    ahead = _WorkersAhead(backend) if workers else None
    proto = loaders.load_proto(model, None, limits=limits)
    plan, _, _ = plan_for(proto, model.graph.name, opts, ahead, _compile_grid_step)
    net = _network(plan, backend, ahead)
    net.pool.share(GRID_BUILD_BUFFERS)
    if not workers:
        net.build_workers = False
    return net


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
    tensor_cores: TensorCores = False,
    tune: Tune = False,
    recurrent: Recurrent = "auto",
    rows_kept: bool = True,
) -> CompiledNetwork:
    """Return the model compiled for the chosen backend (a PerBatchNetwork or PerShapeNetwork
    where it compiles per batch size or per shape: both are CompiledNetworks to isinstance).

    model: a path (.onnx or LuisaML .json), or an onnx.ModelProto.
    weights: a safetensors file, a header-less blob, bytes, or a dict of arrays (optional).
    backend: "auto" (LUISAML_BACKEND when set, else CUDA where a CUDA device works, else the CPU),
    "cpu" or "cuda". A process runs one LuisaCompute device: the first compile picks it.
    batch_axis: "auto" (the symbolic dimension leading an input and an output is the batch), 0,
    or None (one instance of the graph as its shapes say). A graph whose nodes keep samples
    apart runs per sample for any batch size; one that moves the batch axis (attention's
    [B,S,D] -> [S,B,D]) or mixes samples (a mean over the batch) compiles for each batch size it
    is run with.
    input_shapes: fix dynamic dimensions, e.g. {"x": [None, 16, 3]} (None keeps a dimension). A
    dynamic dimension besides the batch left unfixed (a sequence length, an image size) makes a
    PerShapeNetwork: it compiles for each shape it runs with and keeps the last 8 (luisaml/per_shape.py);
    with batch_axis=None such a dimension is refused instead.
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
    tensor_cores: Gemm, MatMul, Conv (its implicit GEMM, and a Winograd form's products) and fVDB's
    SparseConv3d (its gather-GEMM over a kernel map) on CUDA
    as TF32 mma.sync tiles through luisaml's compiler front (operators/tiled_mma.py,
    luisaml/tensor_cores.py): "auto" (where the front runs and its start-up self-test passes; else
    the FP32 tiles, said once), or False (the FP32 tiles). A product too small for the tile (a
    grouped Conv's few channels a group, a depthwise Conv, a SparseConv3d of under 32 output channels) keeps the FP32 tile. TF32 rounds A and B
    to 10 bits of mantissa: about 1e-3 of a product's norm, as torch with TF32 on; the Winograd
    F(4x4) form's transforms make that ~3e-3 a layer (winograd=0: the direct form).
    tune: search the schedules of GEMM and convolution stages on this device (luisaml/tune.py):
    "fast" (4 candidates a kernel shape), "full" (up to 16), or False (the rules' choices, and the
    tuning cache is not read). Each candidate is built, checked against the rules' schedule and
    timed; the choices are kept in the tuning cache, so a second compile measures nothing. The
    plan's `tuning` says what was chosen (inspect shows it).
    recurrent: on CUDA, how RNN, GRU and LSTM run their steps (operators/rnn_block.py): "auto" (one
    launch of every step where it fits, the input projection inside it where that is estimated cheaper,
    else a launch a step), "unfused" (the projection always a GEMM stage of its own), "unrolled" ("auto"
    without its loads of R a k loop iteration ahead), "block" (that launch as first built; these two for
    comparisons) or "steps" (a launch a step); the CPU backend ignores it.
    A saved .lml runs "auto".
    rows_kept: True (a 1 x 1 Conv's output channels that the graph reads only through a Gather at run-time
    rows of its positions, a CenterPoint head's regression maps at the TopK cells, are computed at those rows
    only, bit-identical to every row; luisaml/rewrites/rows_kept.py says where it applies) or False (every row).
    A saved .lml rewrites.
    verbose: log the compile's phases at INFO (same as logging.getLogger("luisaml").setLevel)."""
    t0 = time.perf_counter()
    if verbose and not logger.isEnabledFor(20):
        import logging

        logging.basicConfig()
        logger.setLevel(logging.INFO)
    name = device.init(backend, tensor_cores=tensor_cores is not False)
    opts = CompileOptions(batch_axis, input_shapes, precision, fuse, float64, limits or DEFAULT_LIMITS, check_indices,
                          schedule, mlp, winograd=winograd, grid_build=grid_build,
                          tensor_cores=tensor_cores, tune=tune, recurrent=recurrent,
                          rows_kept=rows_kept).resolve(name)
    with phase("load", model=_model_name(model)):
        proto = loaders.load_proto(model, weights, limits=opts.limits)
    net = _compile_loaded(proto, _model_name(model), opts, name)
    logger.info("compiled %s in %.2f s -> %s", _model_name(model), time.perf_counter() - t0,
                getattr(net, "path", "(per shape: at each run's shape)"))
    return net


def _compile_loaded(proto: onnx.ModelProto, model_name: str, opts: CompileOptions,
                    backend: str) -> CompiledNetwork | PerBatchNetwork | PerShapeNetwork:
    """Return the network of a loaded model under resolved options: a CompiledNetwork; a
    PerBatchNetwork where the batch moves; a PerShapeNetwork where inputs have dynamic dimensions
    besides the batch (and batch_axis is not None: the model's shapes as they are), which calls
    this again with them fixed at each new shape it runs with."""
    workers = _WorkersAhead(backend)
    try:
        plan, why, symbol = plan_for(proto, model_name, opts, workers, _compile_grid_step)
    except DynamicDimsError as e:
        if opts.batch_axis is None:
            raise
        given = dict(opts.input_shapes or {})
        return PerShapeNetwork(str(e), e.symbol, e.inputs, list(declared_shapes(proto)), backend,
                               lambda shapes: _compile_loaded(proto, model_name,
                                                              replace(opts, input_shapes={**given, **shapes}), backend))
    if why is None:
        plan = _tuned(plan, opts, backend)
    net = _network(plan, backend, workers if why is None else None)
    if why is not None:  # (the probe plan runs only if asked to; its per-batch builds start their own)
        if workers.workers is not None:
            workers.workers.close()
        net = PerBatchNetwork(net, why, symbol, declared_shapes(proto),
                              lambda n: _compile_fixed(proto, model_name, opts, backend, symbol, n),
                              save=artifact.save)
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


def _compile_fixed(proto, name: str, opts: CompileOptions, backend: str, symbol: str, n: int) -> CompiledNetwork:
    """Return the network of a graph whose batch moves, compiled with its batch size fixed at n
    (opts: resolved)."""
    shapes = fixed_shapes(proto, symbol, n, opts.input_shapes)
    fixed = fixed_batch(replace(opts, batch_axis=None, input_shapes=shapes))
    with phase("passes", batch=n):
        prep = compiler.prepare(copy.deepcopy(proto), batch_axis=None, input_shapes=shapes, limits=opts.limits)
    prep.float64_as_float = opts.float64 == "float32"
    ahead = _WorkersAhead(backend)
    plan = _tuned(build(prep, name, fixed, ahead, _compile_grid_step), fixed, backend)
    return _network(plan, backend, ahead)


def _tuned(plan: Plan, opts: CompileOptions, backend: str) -> Plan:
    """Return the plan with the schedules a search chose (luisaml/tune.py) where opts.tune asks for
    one: built again when a choice is not the rules', with its `tuning` record either way."""
    if not opts.tune:
        return plan
    with phase("tune", mode=opts.tune):
        schedules, record = tuner.search(plan, opts, backend, lambda p: _network(p, backend))
    if schedules:
        prep, name, _ = plan.built_from
        plan = build(prep, name, replace(opts, schedules=schedules), None, _compile_grid_step)
    plan.tuning = record
    return plan
