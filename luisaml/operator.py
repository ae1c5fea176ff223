"""The Operator base class: one instance per node, parsed at compile time, emitting DSL in forward()."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import numpy as np

from .dtypes import DType
from .errors import BatchMixingError, CompileError
from .model import Node, shape_str
from .storage import Tensor

if TYPE_CHECKING:
    from .codegen import KernelContext

_REQUIRED = object()




@dataclass(frozen=True)
class Derived:
    """An input a node reads that the host computes from some of the node's inputs, once when they
    are bound rather than per node or per sample (fVDB's grid metadata): compute(*arrays, **params)
    returns an array of `dtype` and `shape`. From constants it is a compile-time constant; from
    graph inputs it is an extra shared kernel argument, recomputed when their contents change."""

    compute: Callable[..., np.ndarray]
    sources: tuple[int, ...]  # the node's input indices whose host arrays compute() takes
    dtype: DType
    shape: tuple[int, ...]
    params: tuple[tuple[str, Any], ...] = ()  # keyword arguments, part of the identity
    shape_only: tuple[int, ...] = ()  # sources whose shape alone compute() uses (their contents are not hashed)
    any_rows: bool = False  # shape[0] follows inputs with rows bound at run time (a grid count): any, when bound


class Operator:
    """Base of every operator. Subclasses set `inplace`/`view` and implement forward(ctx); to run in
    parallel stages (schedule.py) they also implement element() or work_items()/emit_item()."""

    # inputs whose storage output 0 may take over when they die at this node (same-index access)
    inplace: ClassVar[tuple[int, ...]] = ()
    # output 0 is input 0 with another shape: same elements in the same order
    view: ClassVar[bool] = False
    # outputs every sample adds into when the node reads per-sample inputs in batch mode (atomics
    # into a buffer the runtime zeroes first); such an output must be a graph output
    accumulates: ClassVar[tuple[int, ...]] = ()
    # outputs whose first dimension is known only at run time (luisaml/dynamic.py): the node runs
    # as phases(), the host reads their row count back before the phase that fills them; no other
    # node may read them, so they are graph outputs or dropped
    runtime_sized: ClassVar[tuple[int, ...]] = ()
    # the dimension of those outputs that the run-time count sizes: the first (rows), or another
    # whose lower dimensions are static (NonZero's [rank, N]: its last); the rest are static
    runtime_axis: ClassVar[int] = 0
    # the node runs as phases() (an items stage each, in order) though no output is sized at run time:
    # a recurrence's steps (operators/rnn_stages.py); a phase reads its number from the stage index
    phased: ClassVar[bool] = False
    # some inputs may have rows bound at run time (any number, one compiled network for all): the
    # class is a luisaml.fvdb.op_mixins.BoundRows, whose rules passes/infer.py asks only then
    bound_rows: ClassVar[bool] = False
    # the node sees the whole batch, not one sample: it reads rows of other samples of a batched
    # input at indices it computes, or checks the batch size (fVDB's sparse convolution over grids
    # bound at run time, a voxel a sample: luisaml.fvdb.op_mixins.VoxelBatch). It then runs only
    # in batched items stages (KernelContext.at_sample, n_samples); the module has no per-sample
    # `forward`.
    spans_batch: bool = False

    # ---- how a stage may run this node (luisaml/schedule.py) ----------------------------------
    # element() is a cheap expression of its inputs with no statements when ctx.pure: its outputs
    # need no buffer, the nodes that read them compute them where they read (Relu, Add, Transpose)
    inline: ClassVar[bool] = False
    # output element i reads each input only at broadcast_index(i): the node can be fused into the
    # stage of the node that produces its input (an epilogue: Conv then Relu then Add)
    elementwise: ClassVar[bool] = False
    # forward()/emit_item() store each output element once and never read it back, so a stage may
    # route those stores through an epilogue
    stores_once: ClassVar[bool] = False
    # arithmetic per output element of an inline node, for the schedule's inlining budget
    inline_cost: ClassVar[int] = 1

    # element() reads its inputs in the output's order: output elements consecutive along the last
    # axis read consecutive (or the same, broadcast) input elements. A remap that moves the
    # innermost axis (ConvNeXt's NHWC -> NCHW Transpose) reads them a row apart: the schedule
    # inlines such a read only into readers of few reads an element (schedule.MANY_READS)
    @property
    def in_order(self) -> bool:
        return self.elementwise

    def axis_map(self, k: int) -> list[int] | None:
        """For an inline node: the axis of input k that each output axis steps, where element() reads
        input k at the output's coordinates so permuted (an elementwise node's input of the output's
        shape: the same axes; a Transpose: its perm); None otherwise (luisaml/across.py follows a
        stored tensor's strides through such nodes)."""
        x, y = (self.inputs[k] if k < len(self.inputs) else None), (self.outputs[0] if self.outputs else None)
        if self.elementwise and x is not None and y is not None and tuple(x.shape) == tuple(y.shape):
            return list(range(len(y.shape)))
        return None

    def reads_per_element(self, k: int) -> float:
        """About how many times a stage running this node reads each element of input k (a Conv:
        its taps times its output channels a group; a GEMM: its columns): the schedule inlines into
        a reader of many reads only what a buffer would not read better. 0 when not known."""
        return 0.0
    # on CUDA, the items stages of nodes naming the same kernel here are one kernel with a stage
    # argument (a kernel build each costs a worker about a second: Winograd's 26 transforms of ResNet-18)
    shared_kernel: ClassVar[str | None] = None
    # the node runs as a kernel of its own (the schedule's "fused" domain): emit_kernel() writes its
    # body, dispatch_size(n) says how many threads a launch for n samples takes, and every stage
    # kernel then takes the batch size and these int buffers (zeroed once; the kernel leaves them
    # zero between launches) as parameters. The fused MLP (operators/mlp.py) is one.
    own_kernel: ClassVar[bool] = False
    kernel_counters: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        node: Node,
        inputs: list[Tensor | None],
        outputs: list[Tensor | None],
        opset: int,
        subgraphs: dict | None = None,
    ):
        self.node = node
        self.inputs = inputs
        self.outputs = outputs
        self.opset = opset
        # attribute name -> compiled subgraph (luisaml.compiler.GraphCode), for If, Loop, Scan
        self.subgraphs = subgraphs or {}
        # tensors of derived_inputs(), in order, bound by the compiler before forward()
        self.derived: list[Tensor] = []
        self.check()

    # ---- attributes and inputs ----------------------------------------------------------
    def attr(self, name: str, default: Any = _REQUIRED) -> Any:
        """Return an attribute's value, or the default; a missing required one is an error."""
        if name in self.node.attrs:
            return self.node.attrs[name]
        if default is _REQUIRED:
            raise self.error(f"attribute '{name}' is required")
        return default

    def error(self, message: str) -> CompileError:
        """Return a CompileError that names this node."""
        return CompileError(f"{self.node.describe()}: {message}")

    def has_input(self, i: int) -> bool:
        """Return whether input i is given (optional inputs may be absent)."""
        return i < len(self.inputs) and self.inputs[i] is not None

    def input(self, i: int) -> Tensor:
        """Return input i; an absent one is an error naming the node."""
        if not self.has_input(i):
            raise self.error(f"input {i} is required")
        return self.inputs[i]

    def output(self, i: int = 0) -> Tensor:
        """Return output i."""
        return self.outputs[i]

    def const(self, i: int, what: str | None = None) -> np.ndarray:
        """Return the host value of input i, which must be a constant known at compile time."""
        t = self.input(i)
        if t.value is None:
            raise self.error(
                f"input {i} ('{t.name}'{', ' + what if what else ''}) must be a constant known at compile "
                "time (an initializer or computed from constants and static shapes)"
            )
        return t.value

    def optional_const(self, i: int, default=None):
        """Return the host value of an optional constant input, or the default when absent."""
        return self.const(i) if self.has_input(i) else default

    def axis(self, axis: int, rank: int, batched: bool = False, what: str = "axis") -> int:
        """Return a normalised axis; in batch mode the batch axis of a batched tensor is an error."""
        a = int(axis)
        if not -rank <= a < rank:
            raise self.error(f"{what} {axis} is out of range for rank {rank}")
        a %= rank
        if batched and a == 0:
            raise self.mixing(f"{what} {axis} is the batch axis: this operator mixes samples across the batch")
        return a

    def mixing(self, message: str) -> BatchMixingError:
        """Return the error of a node that cannot run one sample at a time (the compiler then fixes
        the batch size per run instead: errors.BatchMixingError)."""
        return BatchMixingError(f"{self.node.describe()}: {message}")

    def expect_per_sample(self, cond: bool, message: str) -> None:
        """Raise BatchMixingError (see mixing) unless cond."""
        if not cond:
            raise self.mixing(message)

    def expect(self, cond: bool, message: str) -> None:
        """Raise a CompileError naming the node with `message` unless cond."""
        if not cond:
            raise self.error(message)

    def expect_dtype(self, t: Tensor, allowed, role: str) -> None:
        """Raise unless t's dtype is one of `allowed` (names like 'float', 'int', 'bool')."""
        kinds = {"float": t.dtype.is_float, "int": t.dtype.is_int, "bool": t.dtype.is_bool}
        if not any(kinds.get(a, t.dtype.name == a) for a in allowed):
            hint = " (compile with float64='float32' to compute float64 in float32)" if t.dtype.name == "DOUBLE" else ""
            raise self.error(
                f"{role} '{t.name}' has type {t.dtype.name.lower()}, expected {' or '.join(allowed)}{hint}"
            )

    def expect_shape(self, t: Tensor, shape: tuple[int, ...], role: str) -> None:
        """Raise unless tensor t (input `role`) has this shape."""
        if tuple(t.shape) != tuple(shape):
            raise self.error(f"{role} '{t.name}' has shape {shape_str(t.shape)}, expected {shape_str(shape)}")

    # ---- what subclasses implement ------------------------------------------------------
    def check(self) -> None:
        """Validate attributes and input types; raise self.error(...) on a problem."""

    def forward(self, ctx: "KernelContext") -> None:
        """Emit this node's DSL through ctx."""
        raise NotImplementedError

    def describe(self) -> str:
        """Return a short note on how this node is compiled (shown by inspect)."""
        return ""

    def derived_inputs(self) -> list[Derived]:
        """Return the host-derived inputs this node reads (bound to self.derived, in order)."""
        return []

    def cooperative(self, k: int = 0) -> bool:
        """Return whether every sample of a batch adds into output k (see `accumulates`)."""
        return k in self.accumulates and any(t is not None and t.batched for t in self.inputs)

    def element(self, ctx: "KernelContext", i: str, k: int = 0) -> str:
        """Return the DSL expression of output k at flat index i (per sample), emitting any
        statements it needs through ctx first (none when ctx.pure). A node that implements it runs
        one thread per output element in a stage; the default says it cannot."""
        raise NotImplementedError

    def pieces(self) -> list[tuple[int, int]] | None:
        """Return [(input index, element offset)] when output 0 is those inputs laid end to end in
        each sample's elements (a Concat along its first per-sample dimension), else None: on the
        CPU the schedule may then store the inputs in place in the output's buffer (schedule.py)."""
        return None

    # an inline node that a stage stores on its own runs its work items there (when work_items() gives
    # some), not the element stage: the CPU's Transpose tiles (operators/indexing.py); False elsewhere,
    # where work items mean another form (BatchNormalization's training groups)
    stored_as_items = False

    def work_items(self) -> int | None:
        """Return into how many independent pieces of work per sample emit_item() splits this node
        (the rows of a Softmax), or None when it does not."""
        return None

    def emit_item(self, ctx: "KernelContext", item: str) -> None:
        """Emit the code of work item `item` (a DSL int expression) of work_items()."""
        raise NotImplementedError

    def phases(self) -> list:
        """Return the luisaml.dynamic.Phase list of a node with runtime_sized outputs, in launch order."""
        raise NotImplementedError

    def scratch(self) -> dict[str, int]:
        """Return DSL type -> elements of device memory a phased node keeps across its phases (the
        `scratch_<type>` kernel argument, from element 0; luisaml/dynamic.py); none by default."""
        return {}

    def samples_per_item(self) -> int:
        """Return how many samples one work item of a batched items stage computes (emit_item then
        gets their bindings as `rows`); 1 unless a tile across samples reuses loads (Dense on the CPU)."""
        return 1

    def block_tiling(self):
        """Return the cooperative GPU form's tiling (operators/tiled.py: a block of threads per
        tile, through shared memory), or None when this node has none or is too small for it."""
        return None

    # the tuned schedule of this node's stage form (luisaml/tune.py): a dict of small ints and bools,
    # one of schedules()'s candidates, set by build_plan (BuildOptions.schedules) before the
    # schedule is built; None: the rules' choice
    schedule: dict | None = None

    def schedules(self, blocks: bool, wide: bool) -> list[dict]:
        """Return the candidate schedules of this node's stage form (blocks: the cooperative GPU
        form, else the items form), the rules' choice first, a few more or (wide) more; [] where
        the form has no knob to search. Each is a dict of small ints and bools (JSON data)."""
        return []

    def tuned_note(self) -> str:
        """Return ' (tuned)' when a tuned schedule replaced the rules' choice, for describe()."""
        return " (tuned)" if self.schedule is not None else ""

    def across_tiling(self, axis: int):
        """Return the GPU form that reads input 0 (an inline expression contiguous along its `axis`)
        through shared memory (luisaml/across.py), emitted by emit_across; None where the node has none."""
        return None

    def emit_across(self, ctx: "KernelContext", item: str, thread: str, tiling) -> None:
        """Emit thread `thread` of block `item` of across_tiling()."""
        raise NotImplementedError

    def block_samples(self) -> int:
        """Return how many samples one block of a batched blocks stage covers: 1 (the block works
        within its sample), or its tile's rows when they are samples (fvdb's SparseConv3d over voxels
        as the batch). With more than 1, emit_block runs at the group's first sample, `ctx.n_samples`
        is the batch, and `ctx.at_sample` reads any sample."""
        return 1

    def emit_block(self, ctx: "KernelContext", item: str, thread: str) -> None:
        """Emit thread `thread` of block `item` of block_tiling().blocks."""
        raise NotImplementedError

    def describe_block(self) -> str:
        """Return the note of describe() for the node in its cooperative form (inspect's CUDA plan)."""
        return self.block_tiling().describe()

    @classmethod
    def has_element(cls) -> bool:
        """Return whether the class implements element()."""
        return cls.element is not Operator.element

    def emit_kernel(self, module, x: str, y: str, n: str) -> tuple[str, list[tuple[str, str]]]:
        """Return (the body, type declarations) of the kernel of an own_kernel node reading the
        buffer named x and writing y for n samples."""
        raise CompileError(f"{self.node.describe()}: internal error: no kernel of its own")

    def dispatch_size(self, n: int) -> int:
        """Threads an own_kernel node's launch for n samples dispatches."""
        raise CompileError(f"{self.node.describe()}: internal error: no kernel of its own")

    # the class's own shape rule, for ops onnx cannot infer (custom domains) or whose dims it leaves
    # unknown: a classmethod infer(node, inputs) -> [(elem_type, shape)] per output, or None for no
    # answer; None here: the class has no rule (passes/infer.py asks only those that have one)
    infer: ClassVar[Callable[..., list | None] | None] = None

    @classmethod
    def evaluate(cls, node: Node, inputs: list) -> list | None:
        """Return the outputs (numpy arrays) of a custom-domain node whose inputs are all constant,
        folding it on the host, or None to leave it to the kernel."""
        return None
