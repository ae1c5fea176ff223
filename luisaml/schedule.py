"""The schedule: a graph grouped into stages, each one parallel loop over its own domain.

A node runs in one of seven ways, by what its operator offers (luisaml/operator.py); four of them:

- **inline** (`Operator.inline`, an `element()` that is a pure expression: elementwise maps,
  views, transposes, slices): its output gets no buffer; whoever reads it computes it there
  (virtual), or it is the epilogue of the stage that computes its input;
- **element**: one thread per output element computes it with `element()` (Conv, Gemm, a
  reduction), an epilogue of elementwise nodes applied before the store;
- **items**: one thread per work item writes a piece of the output with `emit_item()` (a row of
  a Softmax);
- **whole**: the node's `forward()` runs one thread per sample (per-sample mode) or one thread in
  all; consecutive such nodes share a stage and keep what passes between them in registers.

Tensors that cross stages live in device buffers pooled by the register allocator's colouring
(a stage is a step, a buffer a slot), so peak device memory is the largest live set. On the CPU
backend a Concat whose inputs stages store takes no stage: they store into its buffer, each at its
offset (`_in_place`, `Schedule.aliases`), and a sample's region is whole 64-byte lines. A stage is
dispatched over `items` per sample times the batch (per-sample mode) or `items` (shapes fixed).

Three more forms make seven: **blocks** -- on CUDA only, a block of threads per tile of a Gemm,
MatMul, Conv, Winograd product or fvdb SparseConv3d through shared memory (operators/tiled.py), or a
warp per row of a normalization or Softmax, or per output of a global pool or reduction over a
contiguous run, a block of warps for a long one (operators/rows.py: lanes stride the row, warp
reductions combine their sums); the CPU backend cannot compile shared memory, and a product that
would leave most of a tile empty, or a row shorter than 16, keeps its items (a reduction its element)
form; **fused** -- a kernel of its own (`Operator.own_kernel`, `kernel_counters`, `dispatch_size`,
`emit_kernel`: the FusedMLP's cooperative kernel); **phased** -- a node with outputs sized at run time, a recurrence or
(CUDA) a long TopK line (operators/topk_chunks.py), one items stage per phase, or a blocks stage where the phase asks
for blocks (luisaml/dynamic.py). An items stage may also run a register tile of a Gemm or Conv; on the CPU
backend a per-sample layer of one row computes two samples an item (`Operator.samples_per_item`), so
each weight it loads serves both. `whole` is the fallback every operator has (control flow,
recurrences, user plugins).

Fusion without a fusion table. The elementwise nodes after a root become its epilogue: a chain
(Conv -> BatchNorm -> Relu), or a region of them that all of the root's readers start and one
tensor leaves (`x * f(x)`: SiLU, GELU, HardSwish, Mish written as graphs, whose x has two readers);
the root's value is bound to the region's input and each node's element() applied in turn before
the store, every region tensor one variable (emission.epilogue_lets), so a node reading one twice
costs a name, not a copy (not for a root whose other outputs are read: TopK's indices would be
read before the deferred root writes them). An inline node read by another is inlined, within a budget
(expression size; cheap-only where the reader reads each element several times, and where it reads
each many times, a Conv's taps or a GEMM's columns, only an expression of one stored tensor read in
the output's order, `Operator.in_order`: a sum of stored tensors, or a Transpose that moves the
innermost axis, gets a buffer there); an expression
whose text still grows past codegen.INLINE_CHARS (index arithmetic repeats geometrically through
nested remaps) is materialised and the schedule built again.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from . import across
from .dynamic import HostRead
from .model import Node, shape_str
from .operator import Operator
from .plan import GraphCode
from .regalloc import Allocation, Request, Step, allocate

# On the CPU backend a thread of an element stage computes this many consecutive elements, in a
# loop: a thread costs ~7 ns before its work (benchmarks/NOTES.md, "How the CPU backend runs a
# kernel"), more than a Relu or a copy; DenseNet's BatchNorm + Relu stages, ShuffleNet's slices
# (benchmarks/NOTES.md, "Element stages in runs")
ELEMENTS = 16

# Inline expressions are rebuilt wherever they are read: a budget keeps one from growing without
# bound (a chain of 100 Adds becomes a buffer somewhere), and a node that reads its inputs many
# times per output (a Conv: k*k*C times) only inlines producers at most this cheap.
INLINE_BUDGET = 64
CHEAP_FOR_MULTI_READ = 2
# A reader of at least this many reads of each input element (Operator.reads_per_element: a Conv's
# taps times its channels a group, a GEMM's columns) inlines an expression of at most one stored tensor
# read in order (_multi_read_inlines). Recomputing L loads at R reads costs R x L loads against
# L + 1 + R for a buffer: for L = 2 the break-even is R = 3, where a normalization or Softmax sits
# (3-4 passes) and a stage's launch tips it to inline (BERT's residual Adds before LayerNorm: 2%
# slower stored); 8 leaves that margin (benchmarks/NOTES.md, "Inlining into multi-read stages")
MANY_READS = 8


@dataclass
class Stage:
    """One parallel loop: its domain, the nodes emitted in it, the buffers it touches."""

    index: int
    domain: str  # "element" | "items" | "blocks" | "sample" (whole nodes, a thread per sample) | "single" | "fused"
    nodes: list[tuple[Node, Operator]]  # the root (or the whole group), then its epilogue
    items: int  # work items per sample (element: the output's elements; items: work_items())
    batched: bool  # dispatched over the batch (items per sample x samples)
    out: str | None = None  # element/items: the tensor the stage materialises (the epilogue's end)
    epilogue: list[tuple[Node, Operator]] = field(default_factory=list)
    reads: list[str] = field(default_factory=list)  # materialised tensors read
    writes: list[str] = field(default_factory=list)  # materialised tensors written
    inlined: list[str] = field(default_factory=list)  # nodes computed inline where this stage reads them
    allocation: Allocation | None = None  # registers of a whole group's internal tensors
    internal: list[str] = field(default_factory=list)  # a whole group's tensors kept in registers
    threads: int = 1  # threads per work item: a "blocks" stage's block size, else 1
    phase: int | None = None  # a phase of a node with run-time sized outputs (luisaml/dynamic.py)
    phase_name: str = ""
    readback: object = None  # where the total this stage completes is (dynamic.TotalRead, ScratchTotal or HostRead)
    # samples a work item covers (Operator.samples_per_item): items of the others idle; of a blocks
    # stage, the samples a block's tile covers (Operator.block_samples): the stage dispatches
    # ceil(n / samples) groups of `items` blocks and its kernel takes the batch as an argument
    samples: int = 1
    # an element stage's consecutive elements a thread computes (the CPU backend: ELEMENTS): items
    # is then the output's elements over this, rounded up
    elements: int = 1
    # on CUDA, a stage reading a stored tensor across through shared memory (luisaml/across.py): an
    # ElementTile, or the root's across_tiling()
    across: object = None

    @property
    def root(self) -> tuple[Node, Operator]:
        return self.nodes[0]

    def dispatch(self, n: int) -> int:
        """Threads to dispatch for n samples."""
        if self.domain == "fused":
            return self.root[1].dispatch_size(n) if n else 0
        if self.grouped:
            return -(-n // self.samples) * self.items * self.threads
        return (self.items * n if self.batched else self.items) * self.threads

    @property
    def grouped(self) -> bool:
        """A blocks stage whose blocks cover `samples` samples each (their tile's rows)."""
        return self.domain == "blocks" and self.batched and self.samples > 1

    def describe(self) -> str:
        """One line for inspect."""
        names = ", ".join(f"{nd.op_type} '{nd.name}'" for nd, _ in self.nodes)
        extra = []
        if self.epilogue:
            extra.append("epilogue " + ", ".join(f"{nd.op_type} '{nd.name}'" for nd, _ in self.epilogue))
        if self.inlined:
            extra.append("inline " + ", ".join(self.inlined))
        if self.samples > 1:
            extra.append(f"{self.samples} samples a {'block' if self.domain == 'blocks' else 'work item'}")
        per = (f"{self.items:,} per {self.samples} samples" if self.grouped else
               f"{self.items:,} per sample" if self.batched else f"{self.items:,} in all")
        where = {"element": f"one thread per {self.elements} elements of" if self.elements > 1 else "one thread per element of",
                 "items": "one thread per work item of",
                 "blocks": f"a block of {self.threads} threads per {'work item' if self.phase is not None else 'tile'} of",
                 "sample": "one thread per sample", "single": "one thread",
                 "fused": "blocks of threads on tiles of samples of"}[self.domain]
        target = f" '{self.out}'" if self.out else ""
        if self.phase is not None:
            target = f" ({self.phase_name}{_after(self.readback) if self.readback else ''})"
        return f"stage {self.index} [{self.domain}, {per}] {where}{target}: {names}" + (
            f" ({'; '.join(extra)})" if extra else "")


@dataclass
class Schedule:
    """The stages in launch order, the tensors computed inline, and the pooled buffers."""

    stages: list[Stage]
    virtual: dict[str, tuple[Node, Operator, int]]  # tensor -> (producer, its operator, output index)
    chained: dict[str, str]  # epilogue tensor (virtual inside its stage only) -> the stage's root node
    buffers: Allocation  # cross-stage tensors in pooled device buffers (space "buffer")
    # tensors stored in place inside another's buffer (the CPU backend: _in_place): tensor ->
    # (the pooled tensor whose buffer holds it, its first element's offset in a sample's region)
    aliases: dict[str, tuple[str, int]] = field(default_factory=dict)

    @property
    def takes_batch(self) -> bool:
        """Whether the kernels take the batch size as an argument (`n`): a kernel of its own (the
        fused MLP's), and a blocks stage of sample groups, whose dispatch size does not give it."""
        return any(st.domain == "fused" or st.grouped for st in self.stages)

    @property
    def counters(self) -> list[str]:
        """The int buffers every stage kernel takes after the pooled buffers: those of the nodes
        that own their kernel (Operator.kernel_counters), in stage order."""
        return list(dict.fromkeys(c for st in self.stages if st.domain == "fused" for c in st.root[1].kernel_counters))

    def describe(self) -> str:
        lines = [s.describe() for s in self.stages]
        lines.append("buffers: " + self.buffers.report())
        if self.aliases:
            lines.append(f"in place: {len(self.aliases)} tensors inside another's buffer: " + ", ".join(
                f"'{a}' at '{r}' + {off}" for a, (r, off) in self.aliases.items()))
        return "\n".join(lines)


def _after(readback) -> str:
    """How a phase's description ends where it completes a total (luisaml/dynamic.py)."""
    if isinstance(readback, HostRead):
        return ", the host reading its words at the run's end" if readback.at_end else ", then the host reads its words back"
    return ", its total kept on the device"


def kind(op: Operator, per_sample: bool) -> str:
    """Return how a node can run: "inline", "element", "items", "whole", or "fused" (a kernel of
    its own: Operator.own_kernel, as the fused MLP's cooperative kernel)."""
    if op.own_kernel:
        return "fused"
    if op.runtime_sized or op.phased:
        return "phased"
    # (derived inputs are kernel parameters or constants: every stage kernel has them)
    if op.subgraphs or op.accumulates:
        return "whole"
    if op.inline and type(op).has_element():
        return "inline"
    if type(op).has_element() and len([t for t in op.outputs if t is not None]) == 1:
        return "element"
    if op.work_items() is not None:
        return "items"
    return "whole"


def build(code: GraphCode, graph_outputs: set[str], per_sample: bool, fuse: bool = True,
          materialise: frozenset[str] = frozenset(), blocks: bool = False, half_buffers: bool = False) -> Schedule:
    """Return the schedule of a lowered main graph (`fuse=False`: every node its own stage, no
    inline tensors: what the fusion tests compare against; `materialise`: tensors that get a
    buffer although they could be inline, those whose expression emission found too long;
    `blocks`: nodes with a cooperative form (Operator.block_tiling) take it, GPUs only;
    `half_buffers`: float tensors crossing stages pooled in half buffers, Plan.half_activations)."""
    ops = [(n, op) for n, op in code.ops if not (op.view and n.outputs[0] in code.views)]
    views = dict(code.views)
    kinds = {n.name: kind(op, per_sample) for n, op in ops}
    producer: dict[str, tuple[Node, Operator, int]] = {}
    for n, op in ops:
        for k, o in enumerate(n.outputs):
            if o:
                producer[o] = (n, op, k)
    readers = _readers(code, ops, views)
    pinned = set(graph_outputs) | _subgraph_reads(code)

    # 1. epilogues: the elementwise inline nodes closing over a root's only output (a chain, or a
    # region such as SiLU's Sigmoid and Mul that both read it), applied before the root's store
    chained: dict[str, str] = {}
    claimed: set[str] = set()
    epilogue_of: dict[str, list[tuple[Node, Operator]]] = {}
    end_of: dict[str, str] = {}
    if fuse:
        # tensor -> its producer's place in graph order (views' too: an epilogue may take one in)
        order = {o: k for k, (n, _) in enumerate(code.ops) for o in n.outputs if o}
        view_nodes = {n.outputs[0]: (n, op) for n, op in code.ops if op.view and n.outputs[0] in views}
        for n, op in ops:
            if kinds[n.name] not in ("element", "items") or (kinds[n.name] == "items" and not op.stores_once):
                continue
            # the root is emitted where its epilogue ends (step 3): a reader of another output
            # (TopK's indices) placed before that end would run before the root has written it
            if any(o and o in readers for o in n.outputs[1:]):
                continue
            chain, end = _epilogue(n.outputs[0], code, kinds, readers, pinned, claimed, order, views, view_nodes)
            if chain:
                claimed.update(c.name for c, _ in chain)
                for t in [n.outputs[0]] + [c.outputs[0] for c, _ in chain]:
                    if t != end:
                        chained[t] = n.name
                epilogue_of[n.name] = chain
                end_of[n.name] = end
    in_chain = {c.name for chain in epilogue_of.values() for c, _ in chain}

    # 2. inline tensors: computed where they are read, within the budget
    virtual: dict[str, tuple[Node, Operator, int]] = {}
    size: dict[str, int] = {}
    cost: dict[str, int] = {}
    loaded: dict[str, set[str]] = {}
    in_order: dict[str, bool] = {}
    if fuse:
        for n, op in ops:
            if kinds[n.name] != "inline" or n.name in in_chain:
                continue
            for k, o in enumerate(n.outputs):
                if not o or o in pinned or o in materialise or o not in readers:
                    continue
                ins = [_root(i, views) for i in n.inputs if i]
                s = 1 + sum(size.get(i, 0) for i in ins)
                c = op.inline_cost + sum(cost.get(i, 0) for i in ins)
                # the stored tensors the expression loads as many elements of as it computes (not a
                # constant; not a smaller operand: one broadcast, SE's channel scales, stays in cache,
                # and a Concat's pieces add up to one tensor's traffic, its selects priced by its
                # inline_cost), and whether it loads them in the output's order (in_order throughout)
                full = [i for i in ins if _numel(code, i) >= op.outputs[k].numel]
                stored = {i for i in full if i not in virtual and _stored(code, i)}
                loads = stored.union(*(loaded[i] for i in full if i in virtual))
                ordered = (op.in_order or not stored) and all(in_order[i] for i in full if i in virtual)
                stage_readers = [(r, r_op) for r, r_op in readers[o] if kinds[r.name] != "inline"]
                many = any(_reads_per_element(r, r_op, o, views) >= MANY_READS for r, r_op in stage_readers)
                if s > INLINE_BUDGET or (stage_readers and c > CHEAP_FOR_MULTI_READ) or (
                        many and not _multi_read_inlines(c, loads, ordered)):
                    continue
                virtual[o] = (n, op, k)
                size[o], cost[o], loaded[o], in_order[o] = s, c, loads, ordered

    # 2b. in place (the CPU backend): a Concat whose inputs are all stored by stages takes no stage;
    # each input is stored at its offset in the Concat's buffer
    aliases: dict[str, tuple[str, int]] = {}
    placed: set[str] = set()
    if fuse and not blocks:
        aliases, placed = _in_place(ops, code, kinds, virtual, chained, pinned | set(code.graph.inputs), views)
        for name in aliases.keys() | {n.outputs[0] for n, _ in ops if n.name in placed}:
            virtual.pop(name, None)
    roots = dict(views) | {a: r for a, (r, _) in aliases.items()}  # (_root through both)

    # 3. stages, in the order of the graph
    stages: list[Stage] = []
    group: list[tuple[Node, Operator]] = []

    def close_group() -> None:
        if group:
            stages.append(_whole_stage(len(stages), list(group), code, per_sample))
            group.clear()

    # a root with an epilogue is emitted where its epilogue ends: what the epilogue's other
    # inputs need (a residual computed after the root) is computed by then
    deferred = {chain[-1][0].name: root for root, chain in epilogue_of.items()}
    by_name = {n.name: (n, op) for n, op in ops}
    for n0, op0 in ops:
        n, op = by_name[deferred[n0.name]] if n0.name in deferred else (n0, op0)
        k = kinds[n.name]
        if n.name in epilogue_of and n0 is n:
            continue  # waits for the end of its epilogue
        if n0.name in in_chain and n0.name not in deferred:
            continue
        if k == "inline" and all(o in virtual for o in n.outputs if o) or n.name in placed:
            continue
        if k == "whole":
            if group and _batched(group[-1][1], per_sample) != _batched(op, per_sample):
                close_group()
            group.append((n, op))
            continue
        close_group()
        if k == "phased":  # count, prefix sum, (the host reads the total back), fill: luisaml/dynamic.py
            # (a recurrence's steps run per sample; a node sized at run time over the whole batch)
            batched = per_sample and not op.runtime_sized and any(x is not None and x.batched for x in op.outputs)
            for j, ph in enumerate(op.phases()):
                stages.append(Stage(len(stages), "blocks" if ph.threads else "items", [(n, op)], int(ph.items), batched,
                                    phase=j, phase_name=ph.name, readback=ph.readback, threads=ph.threads or 1))
            continue
        if k == "fused":
            stages.append(Stage(len(stages), "fused", [(n, op)], 1, True, out=n.outputs[0]))
            continue
        if k == "inline":  # an inline node whose output must be materialised: an element stage of its own
            for j, o in enumerate(n.outputs):
                if o and o not in virtual:
                    t = code.tensors[o]
                    tiles = op.work_items() if op.stored_as_items and not blocks else None  # (a Transpose's CPU tiles)
                    tile = across.choose(code, n, op, k, o, virtual, views) if blocks else None
                    if tile is not None:
                        stages.append(Stage(len(stages), "blocks", [(n, op)], tile.blocks, per_sample and t.batched,
                                            out=o, threads=tile.threads, across=tile))
                        continue
                    if tiles is not None:
                        stages.append(Stage(len(stages), "items", [(n, op)], int(tiles), per_sample and t.batched, out=o))
                        continue
                    e = 1 if blocks else ELEMENTS
                    stages.append(Stage(len(stages), "element", [(n, op)], -(-max(t.numel, 0) // e), per_sample and t.batched,
                                        out=o, elements=e))
            continue
        out = end_of.get(n.name, n.outputs[0])
        t = code.tensors[out]
        tile = across.choose(code, n, op, k, out, virtual, views) if blocks else None
        if tile is not None:  # (on CUDA, a stored tensor read across: through shared tiles)
            stages.append(Stage(len(stages), "blocks", [(n, op)], tile.blocks, per_sample and t.batched, out=out,
                                epilogue=epilogue_of.get(n.name, []), threads=tile.threads, across=tile))
            continue
        # (a reduction over a long contiguous run, an element node, takes its row form on the GPU)
        if k == "element" and not (blocks and op.block_tiling()):
            e = 1 if blocks else ELEMENTS
            stages.append(Stage(len(stages), "element", [(n, op)], -(-t.numel // e), per_sample and t.batched, out=out,
                                epilogue=epilogue_of.get(n.name, []), elements=e))
        else:
            tiling = op.block_tiling() if blocks else None
            batched = per_sample and any(x is not None and x.batched for x in op.outputs)
            stages.append(Stage(len(stages), "blocks" if tiling else "items", [(n, op)],
                                int(tiling.blocks if tiling else op.work_items()), batched, out=out,
                                epilogue=epilogue_of.get(n.name, []), threads=tiling.threads if tiling else 1,
                                samples=(op.block_samples() if tiling else 1 if blocks else op.samples_per_item())
                                if batched else 1))
    close_group()
    for st in stages:
        _fill_io(st, code, virtual, roots, readers, pinned)
    buffers = _pool(stages, code, set(graph_outputs) | set(code.graph.inputs), roots, align=not blocks,
                    half=half_buffers)
    return Schedule(stages, virtual, chained, buffers, aliases)


# SqueezeNet's fire modules and ShuffleNet's blocks concatenate two convolutions' outputs, which an
# element stage then copied at ~8 ns an element (3.1 ms of SqueezeNet's 10.7 in such stages); DenseNet's
# dense layers each concatenate all the layers before them, which every BatchNorm + Relu stage read
# inline, a select over up to 32 inputs an element (benchmarks/NOTES.md, "Concats in place")
def _in_place(ops, code: GraphCode, kinds: dict[str, str], virtual: dict, chained: dict[str, str], fixed: set[str],
              views: dict[str, str]) -> tuple[dict[str, tuple[str, int]], set[str]]:
    """Return (aliases: tensor -> (the tensor whose buffer holds it, element offset); the Concat
    nodes that take no stage): for a node whose output is its inputs end to end (Operator.pieces),
    largest first, whose inputs a stage each stores whole (element or items stages, or an inline
    node's own; not virtual, not an epilogue's inside, not a view, not a graph input or output, not a
    constant, each once, batched as the output is): the inputs are stored at their offsets in the
    output's buffer. A Concat whose inputs are already placed in one buffer at the same distances
    apart (DenseNet's, whose inputs are the start of the next layer's) is itself a region of that
    buffer; an output placed inside a larger one places its inputs there too."""
    kind_of = {o: kinds[n.name] for n, _ in ops for o in n.outputs if o}
    aliases: dict[str, tuple[str, int]] = {}
    placed: set[str] = set()

    def storable(i: str, batched: bool) -> bool:
        t = code.tensors.get(i)
        return (t is not None and t.value is None and t.batched == batched and i not in fixed and i not in virtual
                and i not in chained and i not in views and kind_of.get(i) in ("element", "items", "inline"))

    cands = [(n, op) for n, op in ops if kinds[n.name] == "inline" and op.pieces() is not None]
    for n, op in sorted(cands, key=lambda c: -c[1].outputs[0].numel):
        c = n.outputs[0]
        if c in fixed or c in views:
            continue
        out = op.outputs[0]
        pcs = [(n.inputs[k], off) for k, off in op.pieces() if op.inputs[k].numel]
        names = [i for i, _ in pcs]
        if not pcs or len(set(names)) < len(names) or not all(storable(i, out.batched) for i in names):
            continue
        if not any(i in aliases for i in names):
            root, base = aliases.get(c, (c, 0))
            aliases.update({i: (root, base + off) for i, off in pcs})
            placed.add(n.name)
        elif all(i in aliases for i in names):
            root, base = aliases[names[0]][0], aliases[names[0]][1] - pcs[0][1]
            if all(aliases[i] == (root, base + off) for i, off in pcs) and aliases.get(c, (root, base)) == (root, base):
                aliases[c] = (root, base)
                placed.add(n.name)
    return aliases, placed


def _epilogue(start: str, code: GraphCode, kinds: dict[str, str], readers: dict, pinned: set[str],
              claimed: set[str], order: dict[str, int], views: dict[str, str],
              view_nodes: dict[str, tuple[Node, Operator]]) -> tuple[list[tuple[Node, Operator]], str]:
    """Return (the epilogue of a root whose output is `start`, in graph order; the tensor it ends
    at): the largest region of elementwise inline nodes, grown from `start` by taking in every
    reader of a tensor at once, of which exactly one tensor is read outside (or is a graph
    output). A chain (Conv -> BatchNorm -> Relu) is such a region; so is `x * f(x)` of one x
    (SiLU's Sigmoid and Mul, GELU's Div, Erf, Add and two Muls, HardSwish), which would
    otherwise leave x two readers and the root no epilogue. Every region tensor has the root's
    element count and is read at the element the root stores, so emission can hold each in one
    variable: directly, or through views (Reshape, Flatten, Squeeze, Unsqueeze, Identity: element i
    of a view is element i of what it views), which then join the region as nodes whose element()
    names the variable. An exported GroupNorm is Reshape, InstanceNormalization, Reshape, then its
    affine Mul and Add: through the views the affine (and a GELU after it) is the norm's epilogue,
    not an element stage re-reading the norm's output (wav2vec2's first layer: benchmarks/NOTES.md,
    issue 27). The end's producer is the last region node in graph order: an outside tensor a
    region node reads is then computed before the end, never from it."""
    numel = code.tensors[start].numel
    region, taken = {start}, set()
    nodes: list[tuple[Node, Operator]] = []  # in the order taken in
    best = (0, start)  # (how many of `nodes`, the end) at the last state with one open tensor
    last = -1  # the latest place in graph order of a node taken in

    def is_open(t: str) -> bool:  # read outside the region, or a graph output
        return t in pinned or any(r.name not in taken for r, _ in readers.get(t, []))

    def joins(r: Node, r_op: Operator) -> bool:
        out = r_op.outputs[0] if r_op.outputs else None
        return (kinds[r.name] == "inline" and r_op.elementwise and out is not None and len(r.outputs) == 1
                and out.numel == numel and r.name not in claimed  # (a node joins one epilogue)
                and all(v in view_nodes and view_nodes[v][0].name not in claimed for v in through(r)))

    def through(r: Node) -> list[str]:
        """The views between the region and r's inputs that read a region tensor through them."""
        out = []
        for i in dict.fromkeys(i for i in r.inputs if i):
            if i not in region and _root(i, views) in region:
                while i not in region and i not in out:
                    out.append(i)
                    i = views[i]
        return out

    frontier = [start]  # the open region tensors
    while True:
        step = None
        for t in sorted(frontier, key=lambda t: order.get(t, -1)):  # the earliest computed first
            rs = [(r, r_op) for r, r_op in readers.get(t, []) if r.name not in taken]
            if t not in pinned and rs and all(joins(r, r_op) for r, r_op in rs):
                step = rs
                break
        if step is None:
            break
        for r, r_op in step:
            for v in reversed(through(r)):  # (the views it reads through, outermost first)
                taken.add(view_nodes[v][0].name)
                nodes.append(view_nodes[v])
                region.add(v)
            taken.add(r.name)
            nodes.append((r, r_op))
            region.add(r.outputs[0])
            frontier.append(r.outputs[0])
            last = max(last, order[r.outputs[0]])
        frontier = [t for t in frontier if is_open(t)]
        if len(frontier) == 1 and order[frontier[0]] == last:
            best = (len(nodes), frontier[0])
    return sorted(nodes[:best[0]], key=lambda x: order[x[0].outputs[0]]), best[1]


def _batched(op: Operator, per_sample: bool) -> bool:
    return per_sample and any(t is not None and t.batched for t in list(op.inputs) + list(op.outputs))


def _root(name: str, views: dict[str, str]) -> str:
    while name in views:
        name = views[name]
    return name


def _multi_read_inlines(cost: int, loads: set[str], ordered: bool) -> bool:
    """Whether an inline expression may be recomputed at each of the many reads a stage root makes
    of an element (MANY_READS: a Conv's taps, a GEMM's columns): cheap arithmetic, and memory
    that a buffer would not read better -- at most one stored tensor, read in the output's order.
    Each more tensor is loaded again at every read, and an out-of-order one (an NHWC -> NCHW
    Transpose) a row apart at every read, neighbouring threads' loads in different lines; a buffer
    pays one ordered load per read after one pass. ConvNeXt's depthwise 7 x 7 Convs inlined its
    residual Adds of Transposes, 3 tensors 49 times an output (benchmarks/NOTES.md, "Inlining into
    multi-read stages")."""
    return cost <= CHEAP_FOR_MULTI_READ and len(loads) <= 1 and ordered


def _reads_per_element(node: Node, op: Operator, name: str, views: dict[str, str]) -> float:
    """About how many times a node reads each element of the tensor `name` (Operator.reads_per_element
    of each input that is it or a view of it); 0 where the operator does not say (the arithmetic
    budget alone then applies: pools, normalizations)."""
    return max((op.reads_per_element(k) for k, i in enumerate(node.inputs) if i and _root(i, views) == name),
               default=0.0)


def _numel(code: GraphCode, name: str) -> int:
    t = code.tensors.get(name)
    return t.numel if t is not None else 0


def _stored(code: GraphCode, name: str) -> bool:
    """Whether reading a tensor loads device memory: not a constant (a literal or a small
    parameter buffer that stays in cache)."""
    t = code.tensors.get(name)
    return t is not None and t.value is None


def _readers(code: GraphCode, ops, views: dict[str, str]) -> dict[str, list[tuple[Node, Operator]]]:
    """Return tensor -> the scheduled nodes reading it (a view's readers read the tensor it views)."""
    out: dict[str, list[tuple[Node, Operator]]] = {}
    for n, op in ops:
        for i in dict.fromkeys(i for i in n.inputs if i):
            out.setdefault(i, []).append((n, op))
            r = _root(i, views)
            if r != i:
                out.setdefault(r, []).append((n, op))
    return out


def _subgraph_reads(code: GraphCode) -> set[str]:
    """Return the main-graph tensors subgraphs read (they must have storage of their own)."""
    from .model import outer_reads

    names: set[str] = set()
    for n, _ in code.ops:
        names |= outer_reads(n)
    return names


def _whole_stage(index: int, group: list[tuple[Node, Operator]], code: GraphCode, per_sample: bool) -> Stage:
    batched = _batched(group[0][1], per_sample)
    return Stage(index, "sample" if batched else "single", group, 1, batched)


def _fill_io(st: Stage, code: GraphCode, virtual: dict, views: dict[str, str], readers: dict, pinned: set[str]) -> None:
    """Set the materialised tensors a stage reads and writes, the nodes it computes inline, and a
    whole group's tensors that stay in registers (read only inside the group)."""
    from .model import outer_reads

    nodes = st.nodes + st.epilogue
    here = {n.name for n, _ in nodes}
    written_here = {o for n, _ in nodes for o in n.outputs if o}
    reads, inlined, seen = [], [], set()

    def visit(name: str) -> None:
        name = _root(name, views)
        if name in seen:
            return
        seen.add(name)
        t = code.tensors.get(name)
        if t is None or t.value is not None:
            return
        if name in virtual:
            n, _, _ = virtual[name]
            inlined.append(f"{n.op_type} '{n.name}'")
            for i in n.inputs:
                if i:
                    visit(i)
            return
        if name not in written_here:
            reads.append(name)

    for n, _ in nodes:
        for i in list(n.inputs) + sorted(outer_reads(n)):
            if i:
                visit(i)
    st.inlined = inlined
    if st.phase is not None:
        # every phase writes the node's static outputs (offsets, counts) and the later ones read
        # what the earlier wrote, which keeps them in their buffers from the first phase to the
        # last; the run-time sized outputs are the runtime's own buffers, never pooled
        node, op = st.root
        static = [o for k, o in enumerate(node.outputs) if o and o not in virtual and k not in op.runtime_sized]
        st.reads = reads + (static if st.phase > 0 else [])
        st.writes = static
        return
    st.reads = reads
    if st.domain in ("element", "fused"):
        st.writes = [st.out]
        return
    if st.domain in ("items", "blocks"):  # every output needs a home, also one nobody reads (TopK's indices)
        root_outs = [o for o in st.root[0].outputs if o and o not in virtual]
        st.writes = [st.out] + [o for o in root_outs if o != st.root[0].outputs[0] and o != st.out]
        return
    outs = [o for n, _ in st.nodes for o in n.outputs if o and o not in virtual]
    # a view of a group's tensor read outside the group keeps its root out of registers
    leaves = {_root(o, views) for o in outs if o in pinned or any(r.name not in here for r, _ in readers.get(o, []))}
    st.writes = [o for o in outs if o in leaves]
    st.internal = [o for o in outs if o not in leaves]
    st.allocation = _group_registers(st, code, views)


def _group_registers(st: Stage, code: GraphCode, views: dict[str, str]) -> Allocation:
    """Pool a whole group's internal tensors in local arrays (scratch regions when large), as the
    per-sample kernel does for a whole graph."""
    from .lowering import LOCAL_LIMIT
    from .model import outer_reads

    internal = set(st.internal)
    steps = []
    for n, op in st.nodes:
        # a view was not scheduled: reading it reads the tensor it views; a subgraph's reads count
        reads = [_root(i, views) for i in list(n.inputs) + sorted(outer_reads(n)) if i]
        step = Step(n.name, reads, [o for o in n.outputs if o])
        out0 = op.outputs[0] if op.outputs else None
        for k in op.inplace:
            t = op.inputs[k] if k < len(op.inputs) else None
            if t is not None and out0 is not None and t.shape == out0.shape and t.dtype == out0.dtype:
                step.inplace.append((out0.name, _root(t.name, views)))
        steps.append(step)
    requests = []
    for name in st.internal:
        t = code.tensors[name]
        if name in views and _root(name, views) in internal:
            continue
        space = "local" if t.numel <= LOCAL_LIMIT else "scratch"
        requests.append(Request(name, space, t.dtype.dsl, max(t.numel, 1), t.dtype.itemsize))
    return allocate(steps, requests)


# On the CPU backend a batched tensor's region in a pooled buffer is a whole number of 64-byte
# lines (its per-sample size rounded up), so that no two samples share a line: NeRF's 256-wide
# layers writing a buffer of 283-float rows (a tensor of 283 sharing it) ran at 16 GFLOP/s, each
# row's stores split over lines that the neighbouring samples' threads write too, against 57 for
# the same layers into 256-float rows (benchmarks/NOTES.md, "Sample regions on whole lines")
REGION_ALIGN_BYTES = 64


def _pool(stages: list[Stage], code: GraphCode, io: set[str], views: dict[str, str], align: bool = False,
          half: bool = False) -> Allocation:
    """Pool the tensors that cross stages into device buffers: one Step per stage, the colouring of
    regalloc.allocate (two tensors share a buffer only when no stage range overlaps); with `align`
    (the CPU backend), a batched tensor of a line or more takes whole lines a sample; with `half`, a
    float tensor's buffer holds halves (emission reads them as float: storage.Buffer.held)."""
    steps = [Step(f"stage {s.index}", [_root(r, views) for r in s.reads], [_root(w, views) for w in s.writes])
             for s in stages]
    requests, seen = [], set()
    for s in stages:
        for w in s.writes:
            w = _root(w, views)
            t = code.tensors[w]
            if w in io or w in seen or t.value is not None:
                continue
            seen.add(w)
            size = max(t.numel, 1)
            line = REGION_ALIGN_BYTES // t.dtype.itemsize
            if align and line and t.batched and size >= line:  # (REGION_ALIGN_BYTES = 0: packed regions)
                size = -(-size // line) * line
            dsl, itemsize = ("half", 2) if half and t.dtype.dsl == "float" else (t.dtype.dsl, t.dtype.itemsize)
            requests.append(Request(w, "buffer", dsl, size, itemsize))
    return allocate(steps, requests)


def check(sched: Schedule, code: GraphCode) -> None:
    """Raise AssertionError if two tensors sharing a buffer are live in one stage (the property the
    tests check over random graphs)."""
    alloc = sched.buffers
    for slot in alloc.slots:
        members = slot.members
        for a in range(len(members)):
            for b in range(a + 1, len(members)):
                ra, rb = alloc.live[members[a]], alloc.live[members[b]]
                if ra[0] <= rb[1] and rb[0] <= ra[1]:
                    raise AssertionError(
                        f"buffer {slot.id}: '{members[a]}' {shape_str(code.tensors[members[a]].shape)} live {ra} "
                        f"overlaps '{members[b]}' live {rb}"
                    )
