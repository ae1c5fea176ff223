"""Emission: from a Plan to the source of the generated module. Pure: where each tensor lives in a
function (a local array, a buffer region, the weight blob) is a binding table passed to that
function's emission (storage.bind), never written onto the plan's tensors, so the same graph is
emitted into `forward` and into the kernels without one emission seeing the other's storage.

Kernels shared by stages. On CUDA every stage is a kernel of its own, and each costs a kernel-build
worker about a second. Items stages whose operators name the same `Operator.shared_kernel`
(Winograd's input transforms, its output transforms) are one kernel of flat `if stage == k` blocks
(`_shared`); every kernel then takes the stage index last and `Plan.stage_kernels` says which kernel
a stage launches (an artifact stores it). ResNet-18: 49 stages in 25 kernels.

One launch. On the CPU backend the stages are one merged kernel with a `stage` argument (two levels
of flat ifs; an elif chain nests too deep for LuisaCompute somewhere between 140 and 300 stages); a
stage declaring more than MERGE_LOCAL_BYTES (4 KB) of local arrays is a kernel of its own: a
function's frame holds every branch's arrays, and every thread of every stage would pay for it.
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Iterator

from . import across
from . import indexing as ix
from .codegen import CPU_BLOCK, Inline, KernelContext, Module, render_module
from .dynamic import StateLayout, counted_outputs
from .errors import CompileError
from .model import Node
from .operator import Operator
from .plan import GraphCode, IOSpec, Plan, scratch_layout
from .safe_source import comment_text, docstring_text, quoted
from .schedule import Stage
from .storage import Buffer, Bytes, Capped, CappedBytes, Local, Storage, Tensor, Value, bind


def graph_bindings(ctx: KernelContext, code: GraphCode, io_storage: dict[str, Storage]) -> dict[Tensor, Storage]:
    """Return the binding table of a graph in the function `ctx` emits: its inputs (and, for the
    main graph, outputs) as io_storage says, its pooled slots (local arrays declared here, or
    regions of the scratch buffers) and its views (the storage of the tensor they view)."""
    table: dict[Tensor, Storage] = {code.tensors[name]: st for name, st in io_storage.items()}
    scratch = scratch_layout(code.allocation)
    for sid, slot in enumerate(code.allocation.slots):
        if slot.space == "scratch":
            per_sample, offsets = scratch[slot.dtype]
            storage: Storage = Buffer(f"scratch_{slot.dtype}", ix.add(ix.mul("scratch_region", per_sample), str(offsets[sid])))
        else:
            name = ctx.fresh("s")
            ctx.line(f"{name} = {ctx.module.array_type(slot.dtype, slot.size)}()")
            storage = Local(name)
        for m in slot.members:
            table[code.tensors[m]] = storage
    for out, src in code.views.items():
        root = src
        while root in code.views:
            root = code.views[root]
        st = table.get(code.tensors[root]) or code.tensors[root].storage
        if st is not None:
            table[code.tensors[out]] = st
    return table


@contextlib.contextmanager
def graph_scope(ctx: KernelContext, code: GraphCode, io_storage: dict[str, Storage]) -> Iterator[None]:
    """Emit a graph's nodes with its bindings active, and keep them active for the caller's block
    (a Loop copies its body's outputs after the body)."""
    with bind(graph_bindings(ctx, code, io_storage)):
        for node, op in code.ops:
            if op.view and node.outputs[0] in code.views:
                ctx.comment(f"{quoted(node.name)}: {quoted(node.op_type)} is a view of {quoted(node.inputs[0])}")
                continue
            ctx.comment(f"{quoted(node.name)}: {quoted(node.op_type)}")
            with node_context(node):
                op.forward(ctx)
        yield


def emit_graph(ctx: KernelContext, code: GraphCode, io_storage: dict[str, Storage]) -> None:
    """Emit a graph's code; its inputs (and, for the main graph, outputs) bound to io_storage."""
    with graph_scope(ctx, code, io_storage):
        pass


@contextlib.contextmanager
def node_context(node: Node):
    """Re-raise a luisaml error from inside a node's emission with the node named (a literal out
    of range, say, knows its value but not its node)."""
    try:
        yield
    except CompileError as e:
        if node.describe() in str(e):
            raise
        raise CompileError(f"{node.describe()}: {e}") from e


def generate(plan: Plan, model_name: str) -> str:
    """Return the source of the generated module for a plan: `forward` (one sample, for user
    kernels) and the kernels the runtime launches (the stages, or one per-sample kernel)."""
    module = Module()
    fwd, fwd_params = emit_forward(plan, module)
    type_decls: list[tuple[str, str]] = []
    if plan.schedule is None:
        sized, spans = runtime_sized_node(plan), batch_spanning_node(plan)
        if sized is not None:
            raise CompileError(f"{sized}: its outputs are sized at run time (count, prefix sum, read-back, "
                               "fill), which needs schedule='stages', not one per-sample kernel")
        if spans is not None:
            raise CompileError(f"{spans}: it reads other samples of the batch (a voxel a sample), which needs "
                               "schedule='stages', not one per-sample kernel")
        kernels = [("batch_kernel", kernel_params(plan), "One thread per sample: reads the sample's inputs from "
                    "buffers, writes its outputs.", emit_batch_kernel(plan, module))]
    else:
        kernels = []
        written = {s.name for s in plan.outputs}
        plan.counted = [name for name in counted_outputs(plan.schedule.stages) if name in written]
        counters = plan.schedule.counters
        batch_param = ["n: int"] if plan.schedule.takes_batch else []
        for st in plan.schedule.stages:
            params = kernel_params(plan)
            if st.domain == "fused":  # a kernel of its own (Operator.own_kernel: the fused MLP's)
                op = st.root[1]
                body, decls = op.emit_kernel(module, _io_ident(plan, op.inputs[0]), _io_ident(plan, op.outputs[0]), "n")
                type_decls += decls
            else:
                body = emit_stage(plan, st, module)
            params = params + counters + batch_param
            kernels.append((f"stage_{st.index}", params, st.describe(), body))
        if plan.merged_stages and kernels:
            kernels = _merged_apart(plan, kernels)
        else:
            kernels = _shared(plan, kernels)
    type_decls += [(name, f"luisa.SharedArrayType({n}, {dsl})") for (dsl, n), name in sorted(module.shared_types.items())]
    plan.checks = list(module.checks)
    if plan.checks or plan.counted:  # (the run's state buffer: the error flag, the counted outputs' words)
        kernels = [(name, _with_errors(params), doc, body) for name, params, doc, body in kernels]
    return _render(plan, model_name, module, fwd, fwd_params, kernels, type_decls)


def _with_errors(params: list[str]) -> list[str]:
    """The parameters with the run-time checks' flag buffer, before a merged kernel's stage index."""
    if params and params[-1] == STAGE_PARAM:
        return params[:-1] + [KernelContext.ERRORS, STAGE_PARAM]
    return params + [KernelContext.ERRORS]


STAGE_PARAM = "stage: int"
MERGE_GROUP = 16


# A stage whose local arrays pass this many bytes is a kernel of its own on the CPU backend, not a
# branch of the merged one: a function's frame holds the local arrays of all its branches, and every
# thread of every stage pays for it (a GELU stage over 93k elements: 1.3 ms alone, 88 ms beside eight
# LSTM stages of the old whole form, each with 14 KB of arrays; benchmarks/NOTES.md, "Recurrent stages")
MERGE_LOCAL_BYTES = 4096
_LOCAL_ARRAY = re.compile(r"= (Arr_([a-z0-9]+)_([0-9]+))\(\)")
_ITEM_BYTES = {"half": 2, "bool": 1, "short": 2, "ushort": 2}


def local_bytes(body: str) -> int:
    """Return the bytes of the local arrays a kernel body declares (Module.array_type's names)."""
    return sum(_ITEM_BYTES.get(m.group(2), 4) * int(m.group(3)) for m in _LOCAL_ARRAY.finditer(body))


def _merged_apart(plan: Plan, kernels: list[tuple[str, list[str], str, str]]) -> list[tuple[str, list[str], str, str]]:
    """Return the merged kernel of the stages (_merged) and, apart from it, a kernel of its own for
    each stage whose local arrays pass MERGE_LOCAL_BYTES; with any apart, plan.stage_kernels says
    which kernel a stage launches (every kernel then takes the stage index) and merged_stages is
    False."""
    big = [k for k, (_, _, _, body) in enumerate(kernels) if local_bytes(body) > MERGE_LOCAL_BYTES]
    if not big:
        return [_merged(list(enumerate(kernels)))]
    rest = [(k, kern) for k, kern in enumerate(kernels) if k not in big]
    out = [_merged(rest)] if rest else []
    plan.stage_kernels = ["stages" if k not in big else kernels[k][0] for k in range(len(kernels))]
    plan.merged_stages = False
    return out + [(name, params + [STAGE_PARAM], doc, _cpu_block(body)) for k, (name, params, doc, body) in enumerate(kernels)
                  if k in big]


def _cpu_block(body: str) -> str:
    """The body of a CPU stage kernel with its block size set (codegen.CPU_BLOCK)."""
    return f"    set_block_size({CPU_BLOCK}, 1, 1)\n" + body


def _runs(entries: list[tuple[int, tuple[str, list[str], str, str]]]) -> list[tuple[int, int, str, str]]:
    """Return (first, last stage index, doc, body) of runs of consecutive stages with one body (the
    steps of a recurrent node: identical code, the step read from the stage index)."""
    runs: list[tuple[int, int, str, str]] = []
    for k, (_, _, doc, body) in entries:
        if runs and runs[-1][1] == k - 1 and runs[-1][3] == body:
            runs[-1] = (runs[-1][0], k, runs[-1][2], body)
        else:
            runs.append((k, k, doc, body))
    return runs


def _merged(entries: list[tuple[int, tuple[str, list[str], str, str]]]) -> tuple[str, list[str], str, str]:
    """Return one kernel running stage `stage` of the network: the stages' bodies (entries: (stage
    index, kernel)) under ifs on the index (every stage takes the same parameters); a run of stages
    with one body is one branch. On the CPU backend a kernel costs a clang run of its own (about a
    second each), so a network of 25 stages builds in one instead of 25 (benchmarks/NOTES.md).

    The ifs are two levels of flat `if`s, a range test per MERGE_GROUP branches and a test of the
    index inside, never an elif chain: an elif is an if nested in the else, and LuisaCompute's
    AST-to-IR conversion aborts the process (ExceededDepthLimit) somewhere between 140 and 300 levels
    (DenseNet-121 has 300 stages)."""
    lines = []
    runs = _runs(entries)
    for j in range(0, len(runs), MERGE_GROUP):
        group = runs[j:j + MERGE_GROUP]
        lo, hi = group[0][0], group[-1][1]
        lines.append(f"    if stage < {hi + 1}:" if lo == 0 else f"    if stage >= {lo} and stage < {hi + 1}:")
        for first, last, doc, body in group:
            lines.append(f"        if stage == {first}:" if first == last else
                         f"        if stage >= {first} and stage < {last + 1}:")
            lines.append(f"            # {comment_text(doc)}")
            lines += ["        " + ln for ln in body.splitlines()]
    some = "" if len(entries) == entries[-1][0] + 1 else " (the others are kernels of their own)"
    doc = f"{len(entries)} of the network's stages{some}: launch k runs stage k (each one parallel loop)."
    return ("stages", entries[0][1][1] + [STAGE_PARAM], doc, _cpu_block("\n".join(lines)))


def _shared(plan: Plan, kernels: list[tuple[str, list[str], str, str]]) -> list[tuple[str, list[str], str, str]]:
    """Return the stage kernels with the items stages of nodes naming one Operator.shared_kernel
    merged into that kernel (flat `if stage == k` blocks, k the stage's index), and set
    plan.stage_kernels; when two or more share, every kernel takes the stage index last."""
    plan.stage_kernels = []
    groups: dict[str, list[int]] = {}
    for st in plan.schedule.stages:
        name = st.root[1].shared_kernel if st.domain == "items" else None
        if name is not None:
            groups.setdefault(name, []).append(st.index)
    groups = {g: ks for g, ks in groups.items() if len(ks) > 1}
    if not groups:
        return kernels
    of = {k: g for g, ks in groups.items() for k in ks}
    out, done = [], set()
    for k, (name, params, doc, body) in enumerate(kernels):
        g = of.get(k)
        if g is None:
            out.append((name, params + [STAGE_PARAM], doc, body))
            plan.stage_kernels.append(name)
            continue
        plan.stage_kernels.append(f"shared_{g}")
        if g in done:
            continue
        done.add(g)
        lines = []
        for first, last, doc, body in _runs([(j, kernels[j]) for j in groups[g]]):
            lines.append(f"    if stage == {first}:" if first == last else f"    if stage >= {first} and stage < {last + 1}:")
            lines.append(f"        # {comment_text(doc)}")
            lines += ["        " + ln for ln in body.splitlines()]
        out.append((f"shared_{g}", params + [STAGE_PARAM], f"Stages {', '.join(map(str, groups[g]))}: "
                    f"launch with stage k to run stage k ({g})", "\n".join(lines)))
    return out


def _io_ident(plan: Plan, t: Tensor) -> str:
    """The buffer parameter of a graph input or output tensor."""
    for s in plan.inputs + plan.outputs:
        if s.name == t.name:
            return s.ident
    raise CompileError(f"internal error: '{t.name}' is not a graph input or output")


def kernel_params(plan: Plan) -> list[str]:
    """The parameters every launched kernel takes, in order: inputs, outputs, derived inputs, the
    weight blob, the stages' pooled buffers, the scratch buffers (then `errors` when checked)."""
    params = [s.ident for s in plan.inputs] + [s.ident for s in plan.outputs] + [d.ident for d in plan.derived]
    params.append("weights")
    if plan.schedule is not None:
        params += [buffer_ident(slot) for slot in plan.schedule.buffers.slots]
    return params + [f"scratch_{dsl}" for dsl in sorted(plan.kernel_scratch)]


def buffer_ident(slot) -> str:
    """The kernel parameter of a pooled stage buffer."""
    return f"buf_{slot.dtype}_{slot.id}"


def emit_forward(plan: Plan, module: Module) -> tuple[KernelContext, list[str]]:
    """Emit `forward`: per-sample inputs and outputs are arrays, shared inputs are buffers."""
    fwd = KernelContext(module, subgraph_scope=graph_scope)
    fwd_io: dict[str, Storage] = {}
    fwd_params = []
    symbol = plan.symbol
    for s in plan.inputs:
        fwd_params.append(s.ident)
        if s.dtype.is_byte:
            fwd_io[s.name] = Bytes(s.ident)
        else:
            fwd_io[s.name] = Local(s.ident) if (s.batched or symbol is None) else Buffer(s.ident)
    for s in plan.outputs:
        fwd_params.append(s.ident)
        fwd_io[s.name] = Buffer(s.ident) if s.accumulated else Local(s.ident)
    fwd_params += [d.ident for d in plan.derived]
    fwd_params.append("weights")
    if plan.scratch:  # the caller gives the buffers and which per-sample region to use
        fwd_params += plan.scratch_params + ["scratch_region"]
    sized, spans = runtime_sized_node(plan), batch_spanning_node(plan)
    if sized is not None or spans is not None:  # no per-sample function
        why = f"{sized} has outputs sized at run time" if sized else f"{spans} reads other samples"
        fwd.comment(f"no per-sample forward: {why}")
        fwd.line("pass")
        return fwd, fwd_params
    emit_graph(fwd, plan.main, fwd_io)
    return fwd, fwd_params


def runtime_sized_node(plan: Plan) -> str | None:
    """Return the description of the first node with run-time sized outputs, or None."""
    for node, op in plan.ops:
        if op.runtime_sized:
            return node.describe()
    return None


def batch_spanning_node(plan: Plan) -> str | None:
    """Return the description of the first node that sees the whole batch (Operator.spans_batch), or None."""
    for node, op in plan.ops:
        if op.spans_batch:
            return node.describe()
    return None


def _half_held(in_half: bool, dtype) -> str:
    """The `held` of a float tensor kept in a half buffer (Plan.half_io's inputs and outputs, a half slot of
    Plan.half_activations): "half", the Buffer converting on load and store; "" for anything else."""
    return "half" if in_half and dtype.dsl == "float" else ""


def _io_bindings(plan: Plan, shared_out: bool, sample: str = "sample") -> tuple[dict[str, Storage], list[IOSpec]]:
    """Return the storage of every graph input and output in a launched kernel (a batched one is a
    region `sample * numel` of its buffer, `sample` the variable holding the sample), and, with
    shared_out, the shared outputs that every thread computes and thread 0 writes (the per-sample
    kernel's case)."""
    io: dict[str, Storage] = {}
    shared: list[IOSpec] = []

    for s in plan.inputs:
        base = f"{sample} * {s.numel}" if s.batched and s.numel else "0"
        held = _half_held(plan.half_io, s.dtype)
        io[s.name] = Bytes(s.ident, base) if s.dtype.is_byte else Buffer(s.ident, base, held=held)
    for s in plan.outputs:
        if s.accumulated:  # every thread adds into the zeroed output buffer itself
            io[s.name] = Buffer(s.ident)
        elif s.dtype.is_byte:  # (only sized at run time: compiler.py) a ByteBuffer its node writes word-wise
            io[s.name] = Bytes(s.ident)
        elif s.batched or plan.symbol is None or not shared_out:
            base = f"{sample} * {s.numel}" if s.batched and s.numel else "0"
            io[s.name] = Buffer(s.ident, base, held=_half_held(plan.half_io, s.dtype))
        else:
            shared.append(s)
    return io, shared


def emit_batch_kernel(plan: Plan, module: Module) -> str:
    """Return the body of the per-sample kernel: the whole graph, one thread per sample."""
    ker = KernelContext(module, errors=KernelContext.ERRORS if plan.check_indices else None,
                        subgraph_scope=graph_scope)
    ker.line("sample = int(dispatch_id().x)")
    if plan.scratch:
        ker.line("scratch_region = sample")
    ker_io, shared = _io_bindings(plan, shared_out=True)
    shared_out: list[tuple[IOSpec, Tensor]] = []
    for s in shared:  # computed by every thread, written by thread 0
        ker_io[s.name] = Local(ker.local_array(s.dtype.dsl, s.numel, "shared_out"))
        shared_out.append((s, plan.tensors[s.name]))
    with graph_scope(ker, plan.main, ker_io):
        if shared_out:
            ker.line("if sample == 0:")
            with ker.indent():
                for s, t in shared_out:
                    with ker.loop(s.numel) as i:
                        ker.line(Buffer(s.ident).store(i, t.storage.load(i)))
    return "\n".join(ker.out)


# ---- stages --------------------------------------------------------------------------------------


def epilogue_lets(chain: list[tuple[Node, Operator]], root_out: Tensor, value: str, i: str,
                  module: Module) -> tuple[list[tuple[str, str]], str]:
    """Return (the assignments (name, expression) that apply an epilogue to the value a root
    stores at element i, in order; the name holding the epilogue's end). Each region tensor gets
    a variable of its own, so a node reading one twice (`x * x`, SiLU's `x * sigmoid(x)`) names it
    twice rather than copying its expression: as nested inline expressions, a chain of n such
    nodes was 2^n copies of the root's value (1.4 / 7.1 / 129 s to compile 8 / 12 / 16)."""
    ctx = KernelContext(module)
    ctx.pure = True
    lets = []
    name = value if value.replace("_", "").isalnum() else module.fresh("e")
    if name != value:
        lets.append((name, value))
    table: dict[Tensor, Storage] = {root_out: Value(name)}
    for node, op in chain:
        with bind(table), node_context(node):
            expr = op.element(ctx, i, 0)
        name = expr if expr.replace("_", "").isalnum() else module.fresh("e")
        if name != expr:
            lets.append((name, expr))
        table[op.outputs[0]] = Value(name)
    return lets, name


@dataclass
class Epilogue(Storage):
    """The output of an items stage's root, stored through its epilogue: element i of `target`
    (the epilogue's end) gets the chain applied to the value the root stores at i. The store is
    one line of `;`-separated statements (epilogue_lets, then the store): an operator places a
    store where a statement goes, often inside its template, and a line keeps its indentation."""

    target: Tensor
    chain: list[tuple[Node, Operator]]
    root_out: Tensor
    module: Module

    def store(self, i: str, value: str) -> str:
        lets, end = epilogue_lets(self.chain, self.root_out, value, i, self.module)
        return "; ".join([f"{n} = {e}" for n, e in lets] + [self.target.store(i, end)])

    def store_parts(self, i: str, value: str, at: str | None = None) -> tuple[list[str], str]:
        lets, end = epilogue_lets(self.chain, self.root_out, value, i, self.module)
        return [f"{n} = {e}" for n, e in lets], self.target.store(i if at is None else at, end)


@dataclass
class Dropped(Storage):
    """A run-time sized output that is not a graph output: no node may read it (lowering checks),
    so its stores are dropped rather than given a buffer."""

    writable = True

    def store(self, i: str, value: str) -> str:
        return "pass"


def stage_bindings(plan: Plan, st: Stage, ctx: KernelContext, sample: str = "sample") -> dict[Tensor, Storage]:
    """Return where every tensor a stage touches lives in its kernel: graph inputs and outputs in
    their buffers, tensors crossing stages in pooled buffers, inline tensors as expressions, the
    stage's epilogue tensors inline too, a whole group's internal tensors in registers; batched
    tensors at the sample the variable `sample` holds (or an expression: KernelContext.at_sample)."""
    if not sample.replace("_", "").isalnum():
        sample = f"({sample})"  # (an expression is a factor of the regions' offsets)
    sched = plan.schedule
    tensors = plan.tensors
    io, _ = _io_bindings(plan, shared_out=False, sample=sample)
    table: dict[Tensor, Storage] = {tensors[name]: storage for name, storage in io.items()}

    for slot in sched.buffers.slots:
        for m in slot.members:
            t = tensors[m]
            base = f"{sample} * {slot.size}" if t.batched else "0"
            table[t] = Buffer(buffer_ident(slot), base, held=_half_held(slot.dtype == "half", t.dtype))
    for name, (root, offset) in sched.aliases.items():  # (inside another's region: schedule._in_place)
        slot = sched.buffers.slots[sched.buffers.slot_of[root]]
        base = f"{sample} * {slot.size}" if tensors[name].batched else "0"
        table[tensors[name]] = Buffer(buffer_ident(slot), f"{base} + {offset}" if offset else base,
                                      held=_half_held(slot.dtype == "half", tensors[name].dtype))
    for name, (_, op, k) in sched.virtual.items():
        table[tensors[name]] = Inline(op, k, ctx.module)
    for t in tensors.values():
        if getattr(t, "runtime_rows", None) is not None and t not in table:
            table[t] = Dropped()
    state = StateLayout(tuple(plan.counted), 0)
    for name in plan.counted:  # (at a capacity: stores past it skipped, luisaml/dynamic.py)
        at, limit = table[tensors[name]], f"{KernelContext.ERRORS}.read({state.capacity_word(name)})"
        table[tensors[name]] = (CappedBytes if isinstance(at, Bytes) else Capped)(at.buffer, at.base, limit)
    if st.epilogue:  # (its tensors are variables of the stage's store: epilogue_lets)
        root_out = st.root[1].outputs[0]
        if st.domain in ("items", "blocks"):
            table[root_out] = Epilogue(tensors[st.out], st.epilogue, root_out, ctx.module)
    if st.allocation is not None:
        layout = scratch_layout(st.allocation)
        for sid, slot in enumerate(st.allocation.slots):
            if slot.space == "scratch":
                per_sample, offsets = layout[slot.dtype]
                storage: Storage = Buffer(f"scratch_{slot.dtype}", ix.add(ix.mul("sample", plan.kernel_scratch[slot.dtype]),
                                                                          str(offsets[sid])))
            else:
                name = ctx.fresh("s")
                ctx.line(f"{name} = {ctx.module.array_type(slot.dtype, slot.size)}()")
                storage = Local(name)
            for m in slot.members:
                table[tensors[m]] = storage
    for out, src in plan.main.views.items():
        root = src
        while root in plan.main.views:
            root = plan.main.views[root]
        st_root = table.get(tensors[root]) or tensors[root].storage
        if st_root is not None:
            table[tensors[out]] = st_root
    return table


def emit_stage(plan: Plan, st: Stage, module: Module) -> str:
    """Return the body of one stage's kernel."""
    ctx = KernelContext(module, errors=KernelContext.ERRORS if plan.check_indices else None,
                        subgraph_scope=graph_scope)
    if st.domain == "blocks":  # a block of threads per work item: tid counts blocks
        ctx.line(f"set_block_size({st.threads}, 1, 1)")
        ctx.line("thread = int(thread_id().x)")
        ctx.line("tid = int(block_id().x)")
    else:
        ctx.line("tid = int(dispatch_id().x)")
    item = "tid"
    if st.grouped:  # a group of `items` blocks per `samples` samples: the batch is the argument n
        ctx.line(f"sample = (tid // {st.items}) * {st.samples}")
        ctx.line(f"item = tid % {st.items}")
        item = "item"
        ctx.line("n_samples = n")
        ctx.sample, ctx.n_samples = "sample", "n_samples"
        ctx.at_sample = lambda s: bind(stage_bindings(plan, st, ctx, s))
    elif st.batched and st.domain in ("element", "items", "blocks"):
        ctx.line(f"sample = tid // {st.items}")
        ctx.line(f"item = tid % {st.items}")
        item = "item"
        if st.domain == "items":
            ctx.line(f"n_samples = int(dispatch_size().x) // {st.items}")
            ctx.sample, ctx.n_samples = "sample", "n_samples"
            ctx.at_sample = lambda s: bind(stage_bindings(plan, st, ctx, s))
    elif st.batched:
        ctx.line("sample = tid")
    else:
        ctx.line("sample = 0")
    with bind(stage_bindings(plan, st, ctx)):
        for node, _ in st.nodes + st.epilogue:
            ctx.comment(f"{quoted(node.name)}: {quoted(node.op_type)}")
        if st.domain == "element":
            node, op = st.root
            k = node.outputs.index(st.out) if not st.epilogue and st.out in node.outputs else 0
            out = plan.tensors[st.out]
            run = (ctx.local_array("float", st.elements, "r") if st.elements > 1 and out.dtype.dsl == "float"
                   and _stores_last(st) else None)
            with _element_run(ctx, st, out.numel, item) as i:
                with node_context(node):
                    v = ctx.let(op.element(ctx, i, k), "v")
                if st.epilogue:
                    lets, v = epilogue_lets(st.epilogue, op.outputs[0], v, i, ctx.module)
                    for name, expr in lets:
                        ctx.line(f"{name} = {expr}")
                ctx.line(f"{run}[{i} - {item} * {st.elements}] = {v}" if run else out.store(i, v))
            if run:
                with _element_run(ctx, st, out.numel, item) as i:
                    ctx.line(out.store(i, f"{run}[{i} - {item} * {st.elements}]"))
        elif st.domain == "items" and st.phase is not None:
            node, op = st.root
            ctx.first_phase_stage = st.index - st.phase  # (a phase of identical code reads its number: stage - this)
            with node_context(node):
                op.phases()[st.phase].emit(ctx, item)
        elif st.domain == "items" and st.samples > 1:
            # a work item of the first of every `samples` samples computes all of them (their rows
            # share the loads of B); the others' items idle. Samples past the last read the last
            # one's data and store nothing.
            node, op = st.root
            ctx.line(f"if sample % {st.samples} == 0:")
            with ctx.indent(), node_context(node):
                rows = []
                for r in range(st.samples):
                    s_r = ctx.let(f"min(sample + {r}, n_samples - 1)" if r else "sample", "sr")
                    rows.append((f"sample + {r} < n_samples" if r else None, stage_bindings(plan, st, ctx, s_r)))
                op.emit_item(ctx, item, rows=rows)
        elif st.domain == "items":
            node, op = st.root
            with node_context(node):
                op.emit_item(ctx, item)
        elif st.domain == "blocks" and isinstance(st.across, across.ElementTile):
            node, op = st.root
            k = node.outputs.index(st.out) if not st.epilogue and st.out in node.outputs else 0
            with node_context(node):
                across.emit_element_tile(ctx, st.across, item, "thread", plan.tensors, node, op, k,
                                         plan.tensors[st.out], epilogue_lets, st.epilogue)
        elif st.domain == "blocks" and st.across is not None:
            node, op = st.root
            with node_context(node):
                op.emit_across(ctx, item, "thread", st.across)
        elif st.domain == "blocks" and st.phase is not None:
            node, op = st.root
            with node_context(node):
                op.phases()[st.phase].emit(ctx, item, "thread")
        elif st.domain == "blocks":
            node, op = st.root
            with node_context(node):
                op.emit_block(ctx, item, "thread")
        else:
            for node, op in st.nodes:
                ctx.comment(f"{quoted(node.name)}: {quoted(node.op_type)}")
                with node_context(node):
                    op.forward(ctx)
    return "\n".join(ctx.out)


# an element stage's run with an erf stores after all its values (_stores_last; an A/B switch)
ELEMENT_STORES_LAST = True


def _stores_last(st: Stage) -> bool:
    """Whether an element stage's run (the CPU's) computes its values into a local array before a
    loop of its stores: clang's loop vectoriser cannot bound a gathered load (a per-channel scale at
    i // 799) to check it against the run's stores and left wav2vec2's GroupNorm + GELU run scalar
    (7.5 -> 2.0 ms so); taken where the run has an Erf or a Gelu, the work a vector pays back:
    DenseNet's BatchNorm + Relu runs over a Concat went 61 -> 85 ms (benchmarks/NOTES.md)."""
    erf = ("Erf", "Gelu")
    return ELEMENT_STORES_LAST and (any(n.op_type in erf for n, _ in st.nodes + st.epilogue)
                                    or any(s.split(" ", 1)[0] in erf for s in st.inlined))  # "Erf 'name'"


@contextlib.contextmanager
def _element_run(ctx: KernelContext, st: Stage, numel: int, item: str):
    """Yield the element index an element stage's body computes: the thread's item, or with
    st.elements > 1 each of its run of consecutive elements, in a loop (the last run guarded)."""
    if st.elements <= 1:
        yield item
        return
    e = ctx.fresh("e")
    ctx.line(f"for {e} in range({st.elements}):")
    with ctx.indent():
        i = ctx.let(f"{item} * {st.elements} + {e}", "i")
        if numel % st.elements:
            ctx.line(f"if {i} < {numel}:")
            with ctx.indent():
                yield i
        else:
            yield i


def _render(plan: Plan, model_name: str, module: Module, fwd: KernelContext, fwd_params: list[str],
            kernels: list[tuple[str, list[str], str, str]], type_decls: list[tuple[str, str]]) -> str:
    stages = f"{len(plan.schedule.stages)} stages" if plan.schedule is not None else "one per-sample kernel"
    summary = (
        f"{len(plan.ops)} nodes, {stages}, {len(plan.allocation.slots)} register slots in forward, "
        f"weight blob {plan.blob.size} bytes, batch axis: {plan.symbol or 'none'}"
    )
    return render_module(
        model_name=comment_text(model_name),
        summary=comment_text(summary),
        imports=module.imports(),
        array_types=[(name, dsl, n) for (dsl, n), name in sorted(module.array_types.items(), key=lambda kv: kv[1])],
        type_decls=type_decls,
        forward_params=fwd_params,
        forward_doc=", ".join(p for p in fwd_params),
        forward_body="\n".join(fwd.out) or "    pass",
        kernels=[{"name": name, "params": params, "doc": docstring_text(doc), "body": body or "    pass"}
                 for name, params, doc, body in kernels],
    )
