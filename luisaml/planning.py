"""From a loaded model to its Plan, without a device: compile's options (`CompileOptions`), whatever
they leave to the backend decided once (`resolve`), the passes at the batch found or, for a graph
whose batch moves, fixed at a probe size (`plan_for`), and build_plan under those options."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Literal, Mapping, Optional

import numpy as np
import onnx

from . import compiler
from .compiler import BuildOptions
from .errors import BatchMixingError, UsageError
from .limits import DEFAULT as DEFAULT_LIMITS
from .limits import Limits
from .log import phase
from .operators.mlp import MLPConfig
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
TensorCores = Literal["auto", False]
Tune = Literal["fast", "full", False]
Recurrent = Literal["auto", "unfused", "unrolled", "block", "steps"]

# the Winograd tile "auto" takes on CUDA (benchmarks/NOTES.md, "Winograd convolutions"); the CPU
# backend keeps the direct form unless asked
AUTO_WINOGRAD = 4


@dataclass(frozen=True)
class CompileOptions:
    """What compile() takes besides the model: see compile's docstring for each. Those left to the
    backend ("auto", None) are decided by `resolve(backend)`, once, for everything that plans."""

    batch_axis: BatchAxis = "auto"
    input_shapes: Mapping[str, list] | None = None
    precision: Precision = "fp32"
    # compile's choice; once resolved, the fused-kernel mode ("off", "gpu" or "emulated")
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
    # 3x3 stride-1 convolutions as Winograd F(m x m, 3 x 3) (operators/winograd.py): "auto" decides by
    # backend; once resolved, the tile m (0: the direct form)
    winograd: Winograd | int = "auto"
    # where topology ops over grids bound at run time build their grids (luisaml/host_steps.py):
    # "device", "host", or "auto" (decided by backend)
    grid_build: GridBuild = "auto"
    # Gemm, MatMul, Conv and Winograd products' blocks stages as TF32 mma tiles (operators/tiled_mma.py):
    # "auto" where the CUDA device runs luisaml's compiler front and its self-test passes
    # (luisaml/tensor_cores.py), False never; once resolved, True or False
    tensor_cores: TensorCores | bool = False
    # measure candidate schedules of GEMM and convolution stages on the device (luisaml/tune.py):
    # "fast" (a handful a node), "full" (more), False (the rules' choices, no tuning cache read)
    tune: Tune = False
    # the tuned schedules build_plan sets (compiler.BuildOptions.schedules); tune.py fills them
    schedules: tuple = ()
    # CUDA's recurrent steps (operators/rnn_block.py FORMS): "auto", "unfused" (the input projection
    # always a GEMM stage), "unrolled" ("auto" without the loads of R a k loop iteration ahead), "block"
    # (the block loop as first built), "steps" (a phase a step); the CPU backend's loop form either way
    recurrent: Recurrent = "auto"
    # a 1 x 1 Conv's channels read only at run-time gathered rows computed at those rows only, bit-identical
    # (luisaml/rewrites/rows_kept.py); False: every row
    rows_kept: bool = True

    def check(self) -> None:
        """Raise UsageError for an option value luisaml does not know."""
        if self.float64 not in ("reject", "float32"):
            raise UsageError(f"float64 must be 'reject' or 'float32', not {self.float64!r}")
        if self.schedule not in ("auto", "stages", "per-sample"):
            raise UsageError(f"schedule must be 'auto', 'stages' or 'per-sample', not {self.schedule!r}")
        if self.batch_axis not in ("auto", 0, None):
            raise UsageError(f"batch_axis must be 'auto', 0 or None, not {self.batch_axis!r}")
        check_input_shapes(self.input_shapes)
        if self.winograd is True or self.winograd not in ("auto", 0, 2, 4):
            raise UsageError(f"winograd must be 'auto', False, 2 or 4, not {self.winograd!r}")
        if self.tune not in ("fast", "full", False):
            raise UsageError(f"tune must be 'fast', 'full' or False, not {self.tune!r}")
        if self.recurrent not in ("auto", "unfused", "unrolled", "block", "steps"):
            raise UsageError(f"recurrent must be 'auto', 'unfused', 'unrolled', 'block' or 'steps', not {self.recurrent!r}")
        if self.rows_kept not in (True, False):
            raise UsageError(f"rows_kept must be True or False, not {self.rows_kept!r}")
        if self.grid_build not in ("auto", "device", "host"):
            raise UsageError(f"grid_build must be 'auto', 'device' or 'host', not {self.grid_build!r}")

    def resolve(self, backend: str) -> CompileOptions:
        """Return these options on `backend` ("cpu" or "cuda") with every choice left to it made: one
        merged kernel (the CPU backend), cooperative blocks (CUDA), the Winograd tile (winograd_tile),
        where grids are built (the device on CUDA) and the fused-kernel mode (fusion_mode); raise
        UsageError for a value luisaml does not know."""
        if self.tensor_cores not in ("auto", False, True):
            raise UsageError(f"tensor_cores must be 'auto' or False, not {self.tensor_cores!r}")
        decided = replace(self, merge_stages=backend == "cpu" if self.merge_stages is None else self.merge_stages,
                          blocks=backend == "cuda" if self.blocks is None else self.blocks,
                          winograd=winograd_tile(self.winograd, backend),
                          grid_build=("device" if backend == "cuda" else "host") if self.grid_build == "auto"
                          else self.grid_build,
                          tensor_cores=self.tensor_cores is True or (self.tensor_cores == "auto" and tensor_cores_live(
                              backend, "f16" if self.precision == "fp16" else "tf32")))
        decided.check()
        return replace(decided, fuse=fusion_mode(self.fuse, backend, self.precision))

    def build_options(self) -> BuildOptions:
        """build_plan's options (compiler.BuildOptions) of these options, resolved."""
        if self.fuse not in ("off", "gpu", "emulated") or self.winograd == "auto":
            raise UsageError("compile options must be resolved for a backend first (CompileOptions.resolve)")
        return BuildOptions(fuse=self.fuse, precision=self.precision, limits=self.limits,
                            check_indices=self.check_indices,
                            schedule="per-sample" if self.schedule == "per-sample" else "stages", mlp=self.mlp,
                            merge_stages=self.merge_stages is not False, blocks=self.blocks is True,
                            winograd=self.winograd, tensor_cores=self.tensor_cores is True,
                            schedules=tuple(self.schedules), recurrent=self.recurrent, rows_kept=self.rows_kept)


def tensor_cores_live(backend: str, kind: str = "tf32") -> bool:
    """Whether mma tiles of `kind` run on tensor cores on `backend` (CUDA: the start-up self-test, run
    once a process; the CPU backend: never). precision="fp16" asks for "f16": its layers run on that tile
    (luisaml/rewrites/mlp.py), and a process where it is not live keeps the fused kernel."""
    if backend != "cuda":
        return False
    from . import tensor_cores

    return tensor_cores.live(kind)


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


def winograd_tile(winograd, backend: str) -> int:
    """Return the Winograd tile m compile() uses on a backend (0: the direct form)."""
    if winograd == "auto":
        return AUTO_WINOGRAD if backend == "cuda" else 0
    if winograd is False or winograd is None:
        return 0
    if winograd is True:
        raise UsageError("winograd must be 'auto', False, 2 or 4 (the tile size), not True")
    return winograd


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


# compile_grid_step(model, limits, workers): the network of a device grid build (runtime's), which
# a plan whose topology ops build grids on the device keeps for its runs
GridStepCompiler = Callable[[onnx.ModelProto, Limits, bool], Any]


def _no_device(model: onnx.ModelProto, limits: Limits, workers: bool):
    raise UsageError("this plan was made without a device (analyze, inspect): its grid builds cannot run")


def plan_for(proto: onnx.ModelProto, name: str, opts: CompileOptions, on_schedule=None,
             compile_grid_step: GridStepCompiler = _no_device) -> tuple[Plan, str | None, str | None]:
    """Return (the plan, None, its batch symbol), or for a graph that cannot run one sample at a
    time (its batch moves, or a node mixes samples) (its plan at batch PROBE_A, why, the symbol).
    opts: resolved (CompileOptions.resolve); on_schedule: build_plan's hook, for the plan that runs
    (not a probe's); compile_grid_step: what builds grids on the device (build's)."""
    with phase("passes"):
        prep = compiler.prepare(copy.deepcopy(proto), batch_axis=opts.batch_axis, input_shapes=opts.input_shapes,
                                limits=opts.limits)
    prep.float64_as_float = opts.float64 == "float32"
    try:
        return build(prep, name, opts, on_schedule, compile_grid_step), None, prep.symbol
    except BatchMixingError as e:
        if prep.symbol is None:
            raise
        why = str(e)
    shapes = fixed_shapes(proto, prep.symbol, PROBE_A, opts.input_shapes)
    with phase("passes", batch=PROBE_A):
        fixed = compiler.prepare(copy.deepcopy(proto), batch_axis=None, input_shapes=shapes, limits=opts.limits)
    fixed.float64_as_float = prep.float64_as_float
    return build(fixed, name, fixed_batch(opts), None, compile_grid_step), why, prep.symbol


def fixed_batch(opts: CompileOptions) -> CompileOptions:
    """The resolved options of a graph compiled at a fixed batch size: no fused kernel unless its
    precision needs one."""
    return replace(opts, fuse="off") if opts.precision == "fp32" else opts


def build(prep, name: str, opts: CompileOptions, on_schedule=None,
          compile_grid_step: GridStepCompiler = _no_device) -> Plan:
    """Return the plan build_plan makes of a prepared model under resolved options, with what a .lml
    stores to make it again (`built_from`) and, when its topology ops build grids on the device, what
    builds them (host_steps.DeviceBuilds over compile_grid_step)."""
    # one kernel for all stages on the CPU backend, where every kernel is a clang run of its own
    # (10 small kernels: 30 s apart, 3.5 s merged); compile() says no on CUDA, where each stage keeps
    # its own registers, and build_plan keeps a GPU fused MLP apart in any case
    options = opts.build_options()
    plan = compiler.build_plan(prep, name, options, on_schedule)
    plan.built_from = (prep, name, options)  # what a .lml stores as data, for load to call build_plan again
    if plan.host_steps is not None and opts.grid_build == "device":
        from .fvdb.host_steps import DeviceBuilds

        plan.host_steps.device = DeviceBuilds(lambda m, workers: compile_grid_step(m, opts.limits, workers),
                                              repr(opts.limits))
    return plan


def fixed_shapes(proto: onnx.ModelProto, symbol: str, n: int, given: Mapping | None) -> dict[str, list]:
    """Return input_shapes fixing the batch symbol to n in every graph input (and the caller's)."""
    shapes = {k: list(v) for k, v in (given or {}).items()}
    for name, dims in declared_shapes(proto).items():
        base = shapes.get(name, dims)
        shapes[name] = [n if d == symbol else d for d in base]
    return shapes
