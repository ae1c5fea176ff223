"""The compiler's driver: a ModelProto through the passes to a prepared Model (`prepare`), and that
through lowering, fusion, scheduling and emission to a Plan that holds the generated source
(`build_plan`; see DESIGN.md for the flow)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from . import operators as _shipped  # noqa: F401  (importing the package registers the shipped operators)
from . import registry
from .codegen import collect_oversized
from .emission import generate
from .dynamic import Readback, readback_of
from .errors import CompileError
from .limits import DEFAULT as DEFAULT_LIMITS
from .limits import Limits
from .log import phase
from .operators.mlp import MLPConfig
from .rewrites import mlp as mlp_rewrite
from .rewrites import rnn as rnn_rewrite
from .rewrites import rows_kept as rows_kept_rewrite
from .rewrites import tensor_cores as tensor_cores_rewrite
from .rewrites import winograd as winograd_rewrite
from .lowering import bind_derived, build_graph_code, check_sizes, io_spec, mark_accumulated, unsupported_nodes
from .passes import Prepared
from .plan import BLOB_ALIGN, BLOB_ALIGN_CPU, Blob, Plan
from . import schedule as schedule_pass
from .schedule import Schedule
from .fvdb import voxel_rows
from .safe_source import Identifiers


def prepare(proto, batch_axis="auto", input_shapes=None, *, limits: Limits = DEFAULT_LIMITS) -> Prepared:
    """Return the prepared Model of a ModelProto (consumed: it is modified): the passes in order, each
    node's operator class bound once after the opset upgrade (registry.Binding) and handed to the
    passes that follow, to lowering (Prepared.operators) and to the host steps."""
    # (imported here: they read protobuf, and a .lml artifact's Prepared is rebuilt without onnx)
    from .fvdb import host_steps
    from .model import model_from_proto
    from .passes.batch import annotate
    from .opsets.fvdb import DOMAIN as FVDB
    from .passes.cleanup import fold_batchnorm, merge_equal_nodes, remove_dead, remove_passthrough
    from .passes.functions import expand_functions
    from .passes.infer import Specialised, find_batch_symbol, set_input_shapes, specialise
    from .passes.upgrade import upgrade_opset
    from .passes.validate import validate_model

    validate_model(proto, limits=limits)
    proto = upgrade_opset(proto)
    operators = registry.Binding({o.domain: o.version for o in proto.opset_import})
    expand_functions(proto, lambda op_type, domain, opset: operators(op_type, domain) is not None)
    if input_shapes:
        set_input_shapes(proto, input_shapes)
    merge_equal_nodes(proto, lambda n: n.domain == FVDB)  # (fVDB's ops are pure: one neighbour map a geometry)
    steps = host_steps.split(proto, operators)
    symbol = find_batch_symbol(proto, batch_axis, operators)
    spec: Specialised = specialise(proto, symbol, limits=limits, operators=operators)
    model = model_from_proto(spec.proto)
    remove_passthrough(model)
    remove_dead(model)
    fold_batchnorm(model)
    return Prepared(model, annotate(model, symbol, spec.shapes_b, spec.values_b), operators,
                    bound=dict(spec.bound or {}), host_steps=steps)


@dataclass(frozen=True)
class BuildOptions:
    """build_plan's options, each one decided (luisaml/planning.py CompileOptions.resolve): what a .lml
    stores to build the plan again.

    fuse: "off", "gpu" or "emulated" (luisaml/rewrites/mlp.py: a recognised MLP gets the cooperative
    batch kernel); precision: "fp32", or "fp16" (half inputs and outputs; needs the fused kernel);
    limits: size limits (luisaml.Limits); check_indices: run-time gather/scatter indices flag an
    error the runtime raises (False: they are clamped without a word); schedule: "stages" (the
    graph as parallel stages, schedule.py) or "per-sample" (one kernel, a thread per sample); mlp:
    the fused MLP kernel's knobs (luisaml.operators.mlp.MLPConfig; None: chosen per shape); merge_stages:
    one kernel for every stage (a stage index picks the body) rather than a kernel each; blocks:
    large GEMMs and convolutions run as cooperative blocks through shared memory (CUDA only:
    operators/tiled.py); winograd: the tile m of 3x3 stride-1 convolutions as Winograd F(m x m, 3 x 3)
    (operators/winograd.py), 0 for the direct form; tensor_cores: Gemm, MatMul, Conv, Winograd
    products' and SparseConv3d's blocks stages as TF32 mma tiles (operators/tiled_mma.py, luisaml/rewrites/tensor_cores.py;
    not stored in a .lml: a loaded network runs the FP32 tiles); schedules: tuned schedules, ((node name, ((knob, value), ...)), ...),
    each set as the node's Operator.schedule (luisaml/tune.py; not stored in a .lml yet: a loaded
    network runs the rules' choices); recurrent: CUDA's recurrent steps (operators/rnn_block.py FORMS:
    "auto", "unfused", "unrolled" auto without the loads a k loop iteration ahead, "block" the block loop as first
    built, "steps" a phase a step; not stored in a .lml); rows_kept: a 1 x 1 Conv's channels read only at
    run-time gathered rows computed at those rows only (luisaml/rewrites/rows_kept.py; bit-identical, so not
    stored in a .lml: a loaded network rewrites)."""

    fuse: str = "off"
    precision: str = "fp32"
    limits: Limits = DEFAULT_LIMITS
    check_indices: bool = True
    schedule: str = "stages"
    mlp: MLPConfig | None = None
    merge_stages: bool = True
    blocks: bool = False
    winograd: int = 0
    tensor_cores: bool = False
    schedules: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()
    recurrent: str = "auto"
    rows_kept: bool = True

    def as_dict(self) -> dict[str, Any]:
        """The options by name, values as they are (what luisaml/artifact_model.py encodes)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def build_plan(prep: Prepared, model_name: str = "model", options: BuildOptions = BuildOptions(),
               on_schedule: Callable[[Schedule], None] | None = None) -> Plan:
    """Return the full compile plan of a prepared model, generated source included, built with
    `options` (BuildOptions); on_schedule: called with the first schedule, before the code is
    generated (the runtime starts its kernel-build workers there, luisaml/parallel_build.py)."""
    g = prep.model.graph
    missing = unsupported_nodes(g, prep)
    if missing:
        raise CompileError(f"{len(missing)} unsupported node(s):\n  " + "\n  ".join(missing))
    blob = Blob(BLOB_ALIGN if options.blocks else BLOB_ALIGN_CPU)  # (no blocks stages: the CPU backend)
    main = build_graph_code(g, prep, blob)
    check_sizes(main, options.limits)
    tensors = main.tensors
    producers = g.producers()
    written = {o for n in g.nodes for o in n.outputs if o}
    names = Identifiers()
    inputs = [io_spec(tensors[n], g.var(n), prep, names.get(n, "x"), producers) for n in g.inputs]
    outputs = [io_spec(tensors[n], g.var(n), prep, names.get(n, "y"), producers)
               for n in dict.fromkeys(g.outputs) if n in written]
    for s in outputs:
        if s.dtype.is_byte and s.rows is None:  # (bytes sized at run time: a new grid's blob, written word-wise)
            raise CompileError(f"output '{s.name}': uint8 outputs are not supported")
    plan = Plan(prep.model, prep.symbol, main, inputs, outputs, blob, names=names, limits=options.limits,
                check_indices=options.check_indices, host_steps=prep.host_steps)
    mark_accumulated(plan)
    bind_derived(plan)
    plan.voxel_rows = voxel_rows.find(plan)
    if options.winograd and options.schedule == "stages":
        plan.winograd = winograd_rewrite.rewrite(plan, options.winograd)
    on_f16_tile = mlp_rewrite.f16_stages(options.precision, options.tensor_cores, options.blocks,
                                         options.schedule == "stages")
    if options.tensor_cores and options.blocks and options.schedule == "stages":
        tensor_cores_rewrite.mark(plan, "f16" if on_f16_tile else "tf32")
    if not options.blocks:  # (the CPU backend: Gemm and MatMul items forms take the CPU's tiles at any size)
        for _, op in plan.main.ops:
            if hasattr(op, "no_blocks"):
                op.no_blocks = True
    if options.schedules:  # (before the schedule: a node's tiling decides its stage's items and blocks)
        chosen = dict(options.schedules)
        for node, op in plan.main.ops:
            if node.name in chosen:
                op.schedule = dict(chosen[node.name])
    if options.rows_kept and options.schedule == "stages":  # (after no_blocks and tensor cores: it reads the forms)
        plan.rows_kept = rows_kept_rewrite.rewrite(plan)
    if options.schedule == "stages":  # RNN, GRU, LSTM: a GEMM and a phase per step (operators/rnn_stages.py)
        rnn_rewrite.rewrite(plan, gpu=options.blocks, form=options.recurrent)
    plan.fused, plan.fusion_note = mlp_rewrite.fuse(plan, options.fuse, options.precision, options.mlp, on_f16_tile)
    if options.schedule != "stages":
        with phase("codegen"):
            plan.source = generate(plan, model_name)
    else:
        # shared memory and a block size belong to a whole kernel: the GPU's fused MLP stays apart
        plan.merged_stages = options.merge_stages and not (plan.fused is not None and plan.fused.mode == "gpu")
        materialise: set[str] = set()
        while True:  # ends: `materialise` grows every round
            with phase("schedule"):
                plan.schedule = schedule_pass.build(main, set(g.outputs), per_sample=prep.symbol is not None,
                                                    materialise=frozenset(materialise), blocks=options.blocks,
                                                    half_buffers=plan.half_activations)
            if on_schedule is not None and not materialise:
                on_schedule(plan.schedule)
            with phase("codegen"), collect_oversized() as oversized:
                plan.source = generate(plan, model_name)
            if not oversized:
                break
            if oversized <= materialise:  # long, but not an inline tensor (an epilogue's): keep it
                with phase("codegen"):
                    plan.source = generate(plan, model_name)
                break
            materialise |= oversized
        plan.readbacks = readbacks(plan)
    options.limits.check_bytes("the weight blob (all the model's constants)", plan.blob.size, "weight_bytes")
    return plan




def readbacks(plan: Plan) -> list[Readback]:
    """Return what the runtime reads back between stages: after each phase that reads back, the
    row count of its node's run-time sized outputs (luisaml/dynamic.py)."""
    out = []
    for st in plan.schedule.stages:
        if not st.readback:
            continue
        node, op = st.root
        out.append(readback_of(st.index, node, op, op.phases()[st.phase]))
    return out
