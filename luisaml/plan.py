"""The compile plan as data: graph inputs and outputs, the weight blob, each graph's tensors and
operators with their register allocation, the host-derived inputs, and (schedule.py) the stages.

Lowering (lowering.py) fills it, scheduling (schedule.py) groups its nodes into stages, emission
(emission.py) turns it into source, and the runtime (network.py) binds buffers to it. Nothing here
emits code or touches a device."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from . import dtypes
from .dtypes import DType
from .limits import DEFAULT as DEFAULT_LIMITS
from .limits import Limits
from .regalloc import Allocation
from .safe_source import Identifiers
from .storage import Storage, Tensor, Weight

if TYPE_CHECKING:  # annotations only: IOSpec and Blob are also what a .lml artifact loads, without onnx
    from .model import Graph, Model, Node
    from .operator import Operator

BLOB_ALIGN = 16
# the CPU backend's blob (compiler.build_plan): every constant starts on a 64-byte line, so a
# prepacked panel's rows of 16 or 32 floats are whole lines; at 16 bytes most panels started mid-line
# and every 64-byte vector load of B straddled two (ConvNeXt-T's MLP MatMuls 4.1 ms each in the
# network against 1.3 ms alone, where the panel happened to be aligned: benchmarks/NOTES.md,
# "Weights on whole lines")
BLOB_ALIGN_CPU = 64


@dataclass
class IOSpec:
    """A graph input or output as the runtime binds it."""

    name: str
    ident: str  # parameter name in the generated functions
    dtype: DType
    shape: tuple  # the ONNX shape; the batch dimension is the symbol
    kernel_shape: tuple[int, ...]  # per sample (batch dimension 1)
    batched: bool
    accumulated: bool = False  # every sample adds into it (a buffer the runtime zeroes first)
    rows: str | None = None  # the symbol of a first dimension sized at run time (luisaml/dynamic.py)
    rows_axis: int = 0  # the dimension `rows` sizes (Operator.runtime_axis; kernel_shape holds 0 there)

    # (math.prod over the shape's ints, not np.prod: ~30 reads a run of a detector's networks, ~4 us each)
    @property
    def numel(self) -> int:
        return int(math.prod(int(d) for d in self.kernel_shape))

    @property
    def numel_per_row(self) -> int:
        """Elements per row of the first dimension (what a run-time row count multiplies; for a
        count sizing another dimension, the product of the others)."""
        if self.rows is not None:
            return int(math.prod(int(d) for k, d in enumerate(self.kernel_shape) if k != self.rows_axis))
        return int(math.prod(int(d) for d in self.kernel_shape[1:]))

    def sized_shape(self, rows: int) -> tuple[int, ...]:
        """The shape of a run-time sized output once its count, `rows`, is read back."""
        return tuple(int(rows) if k == self.rows_axis else int(d) for k, d in enumerate(self.kernel_shape))

    def batch_shape(self, n: int) -> tuple[int, ...]:
        """The shape a run of n samples binds or returns (k*n rows when batched)."""
        return ((n * self.kernel_shape[0],) + tuple(self.kernel_shape[1:])) if self.batched else tuple(self.kernel_shape)


@dataclass
class DerivedInput:
    """A host-derived shared kernel argument (operator.Derived) computed from graph inputs."""

    ident: str
    dtype: DType
    shape: tuple[int, ...]
    compute: object
    sources: tuple[str, ...]  # graph inputs (or constants), in compute()'s argument order
    params: dict
    constants: dict[str, np.ndarray]  # the sources that are constants
    shape_only: tuple[str, ...] = ()  # sources whose shape alone matters (a change of contents is no change)
    any_rows: bool = False  # shape[0] is the probe's: any number of rows when bound (operator.Derived.any_rows)

    def value(self, arrays: dict[str, np.ndarray]) -> np.ndarray:
        """Return the derived array for the graph inputs' host arrays."""
        args = (self.constants[s] if s in self.constants else arrays[s] for s in self.sources)
        out = np.asarray(self.compute(*args, **self.params))
        if (out.shape[1:] != self.shape[1:] or out.ndim != len(self.shape)) if self.any_rows else out.shape != self.shape:
            raise ValueError(f"derived input {self.ident}: computed shape {out.shape}, expected {self.shape}")
        return out


class Blob:
    """The weight blob: constants appended on first use, aligned, recorded by name."""

    def __init__(self, align: int = BLOB_ALIGN) -> None:
        self.parts: list[bytes] = []
        self.size = 0
        self.align = align  # each constant's first byte: a multiple of this (BLOB_ALIGN or BLOB_ALIGN_CPU)
        self.layout: dict[str, tuple[int, int, DType, tuple[int, ...]]] = {}

    def add(self, t: Tensor) -> int:
        """Return the byte offset of t's data, appending it on first use."""
        if t.name in self.layout:
            return self.layout[t.name][0]
        pad = -self.size % self.align
        if pad:
            self.parts.append(b"\0" * pad)
            self.size += pad
        data = dtypes.to_kernel(t.value, t.dtype, f"constant '{t.name}'").tobytes()
        self.layout[t.name] = (self.size, len(data), t.dtype, tuple(t.shape))
        self.parts.append(data)
        self.size += len(data)
        return self.layout[t.name][0]

    def add_packed(self, name: str, make) -> int:
        """Return the byte offset of the float32 array make() returns, stored as `name`; make runs
        on first use only (an operator's prepacked weights, asked for at every emission)."""
        if name not in self.layout:
            packed = make()
            self.add(Tensor(name, dtypes.FLOAT, packed.shape, False, packed))
        return self.layout[name][0]

    def bytes(self) -> bytes:
        """Return the blob, padded to a multiple of 4 bytes and at least 4 bytes long."""
        raw = b"".join(self.parts)
        return raw + b"\0" * ((-len(raw) % 4) or (4 if not raw else 0))


@dataclass
class BlobWeight(Storage):
    """A constant placed in the blob the first time code reads it."""

    tensor: Tensor
    blob: Blob

    def load(self, i: str) -> str:
        return Weight(self.blob.add(self.tensor), self.tensor.dtype).load(i)

    def byte_address(self) -> tuple[str, str]:
        return Weight(self.blob.add(self.tensor), self.tensor.dtype).byte_address()


@dataclass
class GraphCode:
    """One graph ready to emit: its tensors (outer ones it reads included), operators, storage plan."""

    graph: Graph
    tensors: dict[str, Tensor]
    ops: list[tuple[Node, Operator]]
    allocation: Allocation
    views: dict[str, str]


@dataclass
class Plan:
    """Everything compile() decided, kept for inspect and the runtime."""

    model: Model
    symbol: str | None
    main: GraphCode
    inputs: list[IOSpec]
    outputs: list[IOSpec]
    blob: Blob
    source: str = ""
    derived: list[DerivedInput] = field(default_factory=list)
    names: Identifiers = field(default_factory=Identifiers)  # model names -> parameter identifiers
    fused: Any = None  # luisaml.operators.mlp.FusedMLP when the batch kernel is the fused MLP kernel
    limits: Limits = DEFAULT_LIMITS
    check_indices: bool = True  # run-time index checks flag an `errors` buffer (KernelContext.flag_error)
    checks: list[str] = field(default_factory=list)  # what error code k + 1 of a launch means
    fusion_note: str = ""  # what fusion decided and why, for inspect
    # precision="fp16" without the fused kernel (its layers as stages on the FP16 mma tile, luisaml/rewrites/mlp.py):
    # the float inputs and outputs are half in their buffers (storage.Buffer.held), as the fused kernel's are
    half_io: bool = False
    # and the float tensors crossing its stages pooled in half buffers (schedule.build half_buffers): what the next
    # layer's FP16 tile reads it rounds to half where it copies it anyway, so this changes no product on the tile
    half_activations: bool = False
    schedule: Any = None  # luisaml.schedule.Schedule when the network runs as stages, else one kernel
    plan_note: str = ""  # why this plan (stages or the per-sample kernel), for inspect
    merged_stages: bool = False  # the stages are one kernel dispatched once per stage (kernels: ["stages"])
    # where the totals that size run-time sized outputs are read (luisaml/dynamic.py)
    readbacks: list = field(default_factory=list)
    # run-time sized outputs whose counts stay on the device (luisaml/dynamic.py: allocated at a
    # capacity, their fills' stores guarded by its word of the run's state buffer), in that order
    counted: list = field(default_factory=list)
    # graph inputs and outputs whose rows are a grid's voxels, fewer than the batch at a coarse level
    # (luisaml/fvdb/voxel_rows.py): checked and cut when the grids are bound
    voxel_rows: list = field(default_factory=list)
    # grid ops over grids bound at run time that the host runs per new grid (luisaml/fvdb/host_steps.py)
    host_steps: Any = None
    # the Conv nodes that run as Winograd F(m x m, 3 x 3) stages (operators/winograd.py)
    winograd: list = field(default_factory=list)
    # what the rows-kept rewrite did to each Conv it matched, or why not (luisaml/rewrites/rows_kept.py), for inspect
    rows_kept: list = field(default_factory=list)
    # compile(tune=...)'s search: what it chose per node and whether it measured (luisaml/tune.py Tuning)
    tuning: Any = None
    # the kernel each stage launches when some stages share one (Operator.shared_kernel; every kernel
    # then takes the stage index as its last argument); empty: stage k launches stage_k
    stage_kernels: list = field(default_factory=list)

    @property
    def tensors(self) -> dict[str, Tensor]:
        return self.main.tensors

    @property
    def ops(self) -> list[tuple[Node, Operator]]:
        return self.main.ops

    @property
    def allocation(self) -> Allocation:
        return self.main.allocation

    @property
    def views(self) -> dict[str, str]:
        return self.main.views

    @property
    def scratch(self) -> dict[str, tuple[int, dict[int, int]]]:
        """DSL type -> (elements per sample, {slot id: offset}) of the scratch buffers."""
        return scratch_layout(self.main.allocation)

    @property
    def scratch_params(self) -> list[str]:
        return [f"scratch_{dsl}" for dsl in sorted(self.scratch)]

    @property
    def kernel_scratch(self) -> dict[str, int]:
        """DSL type -> elements per sample of the scratch buffers the launched kernels use (the
        per-sample kernel's, or the largest of the stages' whole groups)."""
        if self.schedule is None:
            return {dsl: size for dsl, (size, _) in self.scratch.items()}
        # computed once per schedule (a finished one is not changed): runs read it ~5 times each, and a
        # device grid build's ~150-210 phased stages took ~0.1 ms a time (~1 ms a detector frame)
        cached = self.__dict__.get("_kernel_scratch")
        if cached is not None and cached[0] is self.schedule:
            return dict(cached[1])
        out: dict[str, int] = {}
        for st in self.schedule.stages:
            if st.allocation is not None:
                for dsl, (size, _) in scratch_layout(st.allocation).items():
                    out[dsl] = max(out.get(dsl, 0), size)
            if st.phase is not None:  # a phased node's own scratch (Operator.scratch, luisaml/dynamic.py)
                for dsl, size in st.root[1].scratch().items():
                    out[dsl] = max(out.get(dsl, 0), int(size))
        self.__dict__["_kernel_scratch"] = (self.schedule, dict(out))
        return out

    @property
    def kernels(self) -> list[str]:
        """The generated kernels the runtime launches, in order."""
        if self.schedule is None:
            return ["batch_kernel"]
        if self.merged_stages:
            return ["stages"] if self.schedule.stages else []
        if self.stage_kernels:
            return list(dict.fromkeys(self.stage_kernels))
        return [f"stage_{st.index}" for st in self.schedule.stages]

    @property
    def host_outputs(self) -> list[str]:
        """Graph outputs no node writes (an input or a constant passed straight out)."""
        written = {s.name for s in self.outputs}
        return [o for o in self.model.graph.outputs if o not in written]




def scratch_layout(allocation: Allocation) -> dict[str, tuple[int, dict[int, int]]]:
    """Return DSL type -> (elements per sample, {slot id: offset}) of the scratch buffers."""
    out: dict[str, tuple[int, dict[int, int]]] = {}
    for slot in allocation.slots:
        if slot.space != "scratch":
            continue
        size, offsets = out.get(slot.dtype, (0, {}))
        offsets[slot.id] = size
        out[slot.dtype] = (size + slot.size, offsets)
    return out
