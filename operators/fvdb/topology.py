"""The topology ops (CoarsenedGrid, RefinedGrid, DilatedGrid, PrunedGrid, ConvGrid, ConvTransposeGrid)
and the grid constructors (GridBatchFromIJK, GridBatchFromPoints, GridBatchFromNearestVoxelsToPoints):
a new GridBatch bundle.

Over constant inputs every one of them folds on the host when the model is compiled, with the
project's builder (luisaml/fvdb/topology.py, builder.py), as GridFromNanoVDB does.

GridBatchFromIJK, GridBatchFromPoints and GridBatchFromNearestVoxelsToPoints (8 voxel keys a point) also
build on the device, over ijk or points bound at run time (`DeviceGridBuild`): the new bundle's sizes
depend on the data, so the node runs as phases (luisaml/dynamic.py) over its own int scratch: voxel
keys, leaves deduplicated by a hash table, leaf masks, a radix sort of the distinct leaves into
NanoVDB's order, lower and upper nodes as runs of that order, a summary per grid; one thread lays the
grids out from the summaries, a thread a grid writes its 832-byte header as builder.grid_header does (the
world bbox's doubles numpy's, through shaders/f64.py: build_layout.py, which keeps the older form too, the
host's layout and headers between two phases), and the device writes every node
(shaders/grid_build.py owns the stages' DSL, grid_write.py the last, grid_layout.py the words they
share). The bytes equal the host builder's. Voxel sizes and origins may be constants or graph inputs:
they reach the kernels as a table derived on the host (grid_transforms: float32 for the arithmetic and
the voxel_sizes / origins outputs, float64 bits of h, o and 1/h: the first stage copies the row into the
summaries, where the header stage reads the map's exact words). Float64 points are refused (the kernels compute in
float32, fVDB in double for them). Over grids bound at run time the topology ops, and the constructors
whose input has a dynamic size or whose grid other nodes read, are steps that run when a run binds their
inputs (luisaml/fvdb/host_steps.py cuts them out of the graph): the topology ops and the constructors
build on the device with these phases (a network of the node alone with the attribute voxel_capacity:
topology_device.py for the topology ops; here the constructors' points are then counted by joffsets[B],
jdata's rows bound at run time) or on the host. A GridBatchFromPoints with the attributes CONV_OF_POINTS
(the kernel_size and stride of a ConvGrid) builds the ConvGrid of the grid its points make instead: its
keys phase a thread a point, the point's voxel rounded as gb_store_voxel rounds it, then that voxel's
ConvGrid candidates appended (candidates.py, as topology_device.py appends a source grid's voxel's), its
keys sized for the candidates of every point (8 a point for 3/2), or fewer (CONV_ROOM: a key past the room
counted, not written, the key count clamped to it by the next phase's thread 0, and the run's end raising
KeysPastRoom, so that the builder runs again with room); host_steps.py runs it beside the
points' own node in one network (DeviceBuilds.run_pair), the two nodes' phases one after the other over
the one int scratch.

The device build in detail: voxel keys (8 a point for the nearest voxels); leaves deduplicated by a hash
table (a slot claimed by a compare-and-swap of the point's index, a key compared with the owner point's,
which an earlier stage wrote, so nothing waits on another thread); leaf ids by a prefix sum over the
owners; leaf masks by atomic OR, in one stage with the leaves' keys and sort keys; the distinct leaves
sorted into NanoVDB's order by an LSD radix sort (a chunk of leaves per thread: histograms, the first
pass's counted as the leaves' keys are written and each later pass's by the scatter before it, a prefix
sum's up stages over (digit, chunk), a stable scatter that makes every addition of the sum; a byte a pass
of a key packed from the slot key, then root tile k, j, i and the grid, each relative to its minimum in
the bits its span takes, the passes past the key doing nothing); lower and upper nodes as runs of that
order, their bboxes by atomic min/max from the leaves; the grids laid out (the blob's bytes and the leaves
are counted totals: the blob at a capacity, a run past it repeated); every leaf, node and root tile writes
its own bytes and its parent's table entry, a thread per child-mask word its word, and a thread a grid
its header (one stage). The stages read their regions' offsets from a layout
table at the scratch's start (the first stage writes it) and the radix pass number from two counters, so
the ~80 stages of a 1M-point build with every radix pass are ~20 distinct kernels, the same text in every
network of the op: the CUDA backend compiles each once (its compile cache is keyed by the source's hash).
The bundle equals the host builder's, the blob byte for byte; its voxel_sizes / origins outputs are their
float32 values (the blob's map holds the doubles)."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto

from luisaml import dtypes
from luisaml.dynamic import HostRead, HostResult, Phase
from luisaml.errors import LimitError, RunError
from luisaml.fvdb import topology as T
from luisaml.fvdb.grid_batch import MAX_GRIDS_PER_BATCH
from luisaml.fvdb.layout import NanoVDBError
from luisaml.fvdb.op_mixins import BoundRows
from luisaml.fvdb.jagged import JaggedTensor
from luisaml.dtypes import from_numpy
from luisaml.model import Node, shape_str
from luisaml.operator import CompileError, Derived, Operator
from luisaml.opsets import fvdb as schema
from luisaml.opsets import fvdb_grids as grid_schema
from luisaml.registry import register
from luisaml.shaders import grid_layout as G

from .build_layout import GridLayout
from .build_scratch import Scratch, scan_levels
from .candidates import candidates, emit_source_voxel
from .common import bundle_grids

BUNDLE = len(schema.BUNDLE)
GRID_BYTES, GRID_LEAVES = "grid_bytes", "grid_leaves"  # the symbolic rows of the outputs sized at run time
CAPACITY = grid_schema.CAPACITY  # (a node built on the device as a network of its own: its capacity)
MAX_KEYS = 1 << 24  # voxel keys a device build holds (~59 int32 words each: 3.9 GB of scratch, below 2^31 words)


def runtime_bundle(grids: int) -> list[tuple]:
    """Operator.infer's types and shapes of the bundle of `grids` grids a device build writes (its
    blob and leaf indices sized at run time)."""
    return [(TensorProto.UINT8, (GRID_BYTES,)), (TensorProto.INT64, (grids,)), (TensorProto.DOUBLE, (grids, 3)),
            (TensorProto.DOUBLE, (grids, 3)), (TensorProto.INT32, (GRID_LEAVES,)), (TensorProto.INT64, (grids + 1,)),
            (TensorProto.INT32, (0,))]


def _masks(node, mask, counts) -> list[np.ndarray]:
    """Return mask (bool [N], index order) cut into one piece per grid of voxel counts."""
    m = np.asarray(mask).reshape(-1)
    if m.dtype != np.bool_ or len(m) != int(sum(counts)):
        raise CompileError(f"{node.describe()}: mask '{node.inputs[BUNDLE]}' must be bool [{int(sum(counts))}] (one "
                           f"entry per active voxel), got {m.dtype} {list(np.shape(mask))}")
    return np.split(m, np.cumsum(counts)[:-1])


def _from_grids(node, inputs) -> T.GridBatch:
    try:
        grids = bundle_grids(*inputs[:6])
    except NanoVDBError as e:
        raise CompileError(f"{node.describe()}: {e}") from None
    voxels = T.voxels_of(grids)
    h, o = np.asarray(inputs[2], np.float64), np.asarray(inputs[3], np.float64)
    a = node.attrs
    op = node.op_type
    if op == "CoarsenedGrid":
        return T.to_batch(*T.coarsened(voxels, h, o, a.get("coarsening_factor", ())))
    if op == "RefinedGrid":
        mask = inputs[BUNDLE] if len(inputs) > BUNDLE and inputs[BUNDLE] is not None else None
        masks = None if mask is None else _masks(node, mask, [len(v) for v in voxels])
        return T.to_batch(*T.refined(voxels, h, o, a.get("subdiv_factor", ()), masks))
    if op == "DilatedGrid":
        return T.to_batch(*T.dilated(voxels, h, o, a.get("dilation", 1)))
    if op == "PrunedGrid":
        return T.to_batch(*T.pruned(voxels, h, o, _masks(node, inputs[BUNDLE], [len(v) for v in voxels])))
    if op == "ConvGrid":
        return T.to_batch(*T.conv_grid(voxels, h, o, a.get("kernel_size", ()), a.get("stride", 1)))
    return T.to_batch(*T.conv_transpose_grid(voxels, h, o, a.get("kernel_size", ()), a.get("stride", 1)))


def _from_jagged(node, inputs) -> T.GridBatch:
    jdata, joffsets = inputs[0], np.asarray(inputs[1], np.int64).reshape(-1)
    try:
        parts = JaggedTensor.from_data_and_offsets(np.asarray(jdata), joffsets).unbind()
    except ValueError as e:
        raise CompileError(f"{node.describe()}: {e}") from None
    count = len(parts)
    h = T.per_grid(1.0 if len(inputs) < 5 or inputs[4] is None else inputs[4], count, "voxel_sizes", True)
    o = T.per_grid(0.0 if len(inputs) < 6 or inputs[5] is None else inputs[5], count, "origins", False)
    if node.op_type == "GridBatchFromIJK":
        if not np.issubdtype(np.asarray(jdata).dtype, np.integer):
            raise CompileError(f"{node.describe()}: ijk must be integer [N, 3], got {np.asarray(jdata).dtype}")
        return T.to_batch(list(parts), h, o)
    build = T.from_points if node.op_type == "GridBatchFromPoints" else T.from_nearest_voxels
    return T.to_batch(build(list(parts), h, o), h, o)


def evaluate_grid_op(node, inputs) -> list[np.ndarray]:
    """Return the seven bundle arrays of the grids a topology node builds from constant inputs."""
    try:
        batch = _from_grids(node, inputs) if node.op_type in _FROM_GRIDS else _from_jagged(node, inputs)
    except LimitError as e:  # (a LimitError is a ValueError: it stays one, naming the node)
        raise LimitError(f"{node.describe()}: {e}") from None
    except (ValueError, NanoVDBError) as e:
        raise CompileError(f"{node.describe()}: {e}") from None
    return [np.ascontiguousarray(a) for a in batch.bundle()]


_FROM_GRIDS = ("CoarsenedGrid", "RefinedGrid", "DilatedGrid", "PrunedGrid", "ConvGrid", "ConvTransposeGrid")


class GridOp(Operator):
    """A node that builds a new GridBatch bundle on the host (all inputs constants)."""

    @classmethod
    def infer(cls, node, inputs):
        # an input not known yet (a Constant node the fold pass has still to read) leaves the
        # outputs untyped for now; one that is never known fails in check()
        if any(name and (k >= len(inputs) or inputs[k] is None or inputs[k].value is None)
               for k, name in enumerate(node.inputs)):
            return []
        values = [None if v is None else v.value for v in inputs]
        return [(from_numpy(a.dtype).onnx, a.shape) for a in evaluate_grid_op(node, values)]

    @classmethod
    def evaluate(cls, node, inputs):
        return evaluate_grid_op(node, inputs)

    @classmethod
    def untyped_reason(cls, node, graph) -> str:
        """Why the node's outputs have no shapes (lowering's error): an input that is not a constant."""
        return _not_constant([i for i in node.inputs if i and graph.var(i).value is None] or node.inputs)

    def check(self):
        raise self.error(_not_constant([t.name for t in self.inputs if t is not None and t.value is None]
                                       or self.node.inputs))


def _not_constant(names: list[str]) -> str:
    return (f"input '{names[0]}' is not a constant: this op builds grids on the host (the GridBatchFrom* "
            "constructors also on the device), so what it reads must be constants (it is evaluated when the model "
            "is compiled) or graph inputs and grids built from them (it runs when a run binds them: "
            "luisaml/fvdb/host_steps.py), never a tensor the kernels compute")


# ---- building on the device ------------------------------------------------------------------------


TRANSFORM_WORDS = G.T_WORDS  # per grid: h, o as float64 bits (12), float32 bits of 1/h, -o/h, h, o (12), 1/h as float64 bits (6)
# the attributes of a GridBatchFromPoints built on the device (with CAPACITY) that make it build the ConvGrid of
# the grid its points make instead (that ConvGrid's kernel_size and stride): the second node of a device build of
# both grids in one network (luisaml/fvdb/host_steps.py, DeviceBuilds.run_pair)
CONV_OF_POINTS = ("conv_kernel_size", "conv_stride")
# with CONV_OF_POINTS: the candidate keys its scratch holds (default: every candidate of every point, 8 a point
# for 3/2), fewer where a run's candidates are fewer (a point's voxel has 1 or 2 an axis): a key past it is
# counted, not written, and the run raises KeysPastRoom (its builder runs again with room)
CONV_ROOM = "conv_keys"
# what ERR_COORDS means for a topology op built on the device (topology_device.py), a ConvGrid of points too
NEW_COORDS_ERROR = "a new voxel's coordinates do not fit int32"


class KeysPastRoom(RunError):
    """A ConvGrid of points (CONV_OF_POINTS) had more candidate keys than its CONV_ROOM: nothing it built is
    whole; `keys` says how many (luisaml/fvdb/host_steps.py runs the build again with room for them)."""

    def __init__(self, message: str, keys: int):
        super().__init__(message)
        self.keys = keys


def conv_of_points(attrs: dict) -> dict | None:
    """The ConvGrid attributes (kernel_size, stride) a GridBatchFromPoints node's CONV_OF_POINTS give; None
    where it has neither."""
    if not any(k in attrs for k in CONV_OF_POINTS):
        return None
    return {"kernel_size": attrs.get(CONV_OF_POINTS[0], ()), "stride": attrs.get(CONV_OF_POINTS[1], 1)}


def _sizes_and_origins(arrays: tuple, grids: int, has: tuple) -> tuple[np.ndarray, np.ndarray]:
    """The per-grid voxel sizes and origins (float64 [grids, 3]) of a build's optional voxel_sizes / origins
    inputs (`arrays` in that order, where `has` says each is given; else 1 and 0)."""
    from luisaml.errors import InputError

    it = iter(arrays)
    try:
        h = T.per_grid(next(it) if has[0] else 1.0, grids, "voxel_sizes", True)
        o = T.per_grid(next(it) if has[1] else 0.0, grids, "origins", False)
    except ValueError as e:
        raise InputError(f"the device grid build's {e}") from None
    return h, o


def conv_transforms(*arrays, grids: int = 1, has: tuple = (False, False), conv: tuple = ()) -> np.ndarray:
    """grid_transforms of the ConvGrid (attributes `conv`) of the grids the points' voxel sizes and origins
    (as grid_transforms takes them) make: the host's doubles through new_transforms, as a ConvGrid step of
    that grid gives them."""
    h, o = T.new_transforms("ConvGrid", dict(conv), *_sizes_and_origins(arrays, grids, has))
    return grid_transforms(h, o, grids=grids, has=(True, True))


def grid_transforms(*arrays, grids: int = 1, has: tuple = (False, False)) -> np.ndarray:
    """Return int32 [B, TRANSFORM_WORDS] per grid: the voxel size and origin (the arrays given, in that
    order, where `has` says so; else 1 and 0) as float64 bits (what the host step writes into the
    headers, exact), then the float32 bits of fVDB's world-to-voxel float32(1/h), float32(-o/h)
    (computed in double and cast) and of float32(h), float32(o) (the voxel_sizes / origins outputs), then
    1/h as float64 bits (the headers' map, which the device writes: build_layout.py)."""
    h, o = _sizes_and_origins(arrays, grids, has)
    out = np.zeros((grids, TRANSFORM_WORDS), np.int32)
    out[:, 0:6] = np.ascontiguousarray(h, np.float64).view(np.int32)
    out[:, 6:12] = np.ascontiguousarray(o, np.float64).view(np.int32)
    for k, v in enumerate(((1.0 / h), (-o / h), h, o)):
        out[:, 12 + 3 * k:15 + 3 * k] = np.ascontiguousarray(v.astype(np.float32)).view(np.int32)
    out[:, 24:30] = np.ascontiguousarray(1.0 / h, np.float64).view(np.int32)
    return out


class DeviceGridBuild(BoundRows, GridLayout, GridOp):
    """GridBatchFromIJK / GridBatchFromPoints / GridBatchFromNearestVoxelsToPoints: fold on the host over
    constants (GridOp), build on the device over ijk or points bound at run time (the phases below;
    module docstring)."""

    OPS = ("GridBatchFromIJK", "GridBatchFromPoints", "GridBatchFromNearestVoxelsToPoints")
    runtime_sized = (0, 4)  # grid_blob (bytes), leaf_batch_indices (leaves)
    counted = False  # the points are counted at run time (joffsets[B]; CAPACITY: at most that many)
    conv = None  # a ConvGrid of the points' grid (CONV_OF_POINTS): its attributes
    keys_counted: int | None = None  # with conv: the candidate keys its last run counted (at the run's end)
    MAX_KEYS = MAX_KEYS
    ZERO_THREADS = 16384  # threads zeroing the blob, writing child masks (each every ZERO_THREADS-th word)
    # LAYOUT_ON_DEVICE (GridLayout): the grids laid out and their headers written on the device

    @classmethod
    def keys_for(cls, op_type: str, attrs: dict, capacity: int) -> int:
        """The voxel keys a device build of `capacity` points (CAPACITY) holds: at most MAX_KEYS."""
        conv = conv_of_points(attrs)
        if conv is not None:  # (a ConvGrid of the points' grid: its candidates a point's voxel, or its room)
            every = capacity * candidates("ConvGrid", conv).count
            room = attrs.get(CONV_ROOM)
            return every if room is None else min(int(room), every)
        return capacity * (8 if op_type == "GridBatchFromNearestVoxelsToPoints" else 1)

    @classmethod
    def reads_bound_rows(cls, op_type: str, k: int) -> bool:
        # jdata, jidx: any number of points, with CAPACITY (the only way such an input reaches the node:
        # luisaml/fvdb/host_steps.py takes one of dynamic size out of the model and builds it that way)
        return k in (0, 2)

    @classmethod
    def infer(cls, node, inputs):
        if all(not name or (k < len(inputs) and inputs[k] is not None and inputs[k].value is not None)
               for k, name in enumerate(node.inputs)):
            return super().infer(node, inputs)  # folds
        offsets = inputs[1] if len(inputs) > 1 else None
        if offsets is None or offsets.shape is None or len(offsets.shape) != 1 or not isinstance(offsets.shape[0], int):
            return []
        return runtime_bundle(int(offsets.shape[0]) - 1)

    def check(self):
        n_in = len(self.inputs)
        if n_in < 2 or not self.has_input(0) or not self.has_input(1):
            raise self.error("takes the jagged tensor's jdata and joffsets (inputs 0 and 1)")
        jdata, joffsets = self.input(0), self.input(1)
        points = self.node.op_type != "GridBatchFromIJK"
        self.nearest = self.node.op_type == "GridBatchFromNearestVoxelsToPoints"
        what = "points" if points else "ijk"
        if points and jdata.dtype.name == "DOUBLE":
            raise self.error(f"points_jdata '{jdata.name}' is float64: the device builder computes in float32 and "
                             "fVDB in double for float64 points, so they are built on the host only (constants)")
        self.expect_dtype(jdata, ("FLOAT", "FLOAT16") if points else ("INT32", "INT64"), f"{what}_jdata")
        capacity = self.node.attrs.get(CAPACITY)
        self.counted = capacity is not None
        static = self.counted or getattr(jdata, "bound_rows", None) is None
        self.expect(jdata.rank == 2 and jdata.shape[1] == 3 and not jdata.batched and static,
                    f"{what}_jdata '{jdata.name}' must be [N, 3] with a static N, got {shape_str(jdata.shape)}")
        if self.counted:  # (its upper bound: the voxel keys' below)
            self.expect(isinstance(capacity, int) and capacity >= 1,
                        f"{CAPACITY} must be a positive integer, got {capacity!r}")
        self.expect_dtype(joffsets, ("INT64",), f"{what}_joffsets")
        self.expect(joffsets.rank == 1 and 2 <= joffsets.shape[0] <= MAX_GRIDS_PER_BATCH + 1 and not joffsets.batched,
                    f"{what}_joffsets '{joffsets.name}' must be [B + 1] with 1 <= B <= {MAX_GRIDS_PER_BATCH}, got "
                    f"{shape_str(joffsets.shape)}")
        self.N, self.B = int(capacity if self.counted else jdata.shape[0]), int(joffsets.shape[0]) - 1
        for k, name in ((4, "voxel_sizes"), (5, "origins")):
            if not self.has_input(k):
                continue
            t = self.input(k)
            try:  # a constant is checked now; one bound at run time when it is bound (grid_transforms)
                if t.value is not None:
                    T.per_grid(t.value, self.B, name, k == 4)
                elif not (tuple(t.shape) in ((self.B, 3), (3,), ()) and not t.batched):
                    raise ValueError(f"{name} has shape {list(t.shape)}, expected [{self.B}, 3], [3] or a scalar")
            except ValueError as e:
                raise self.error(str(e)) from None
        self.check_outputs()
        self.points = points
        self.conv = conv_of_points(self.node.attrs)
        if self.conv is not None:
            self.expect(self.node.op_type == "GridBatchFromPoints" and self.counted,
                        f"{', '.join(CONV_OF_POINTS)}: only a GridBatchFromPoints with {CAPACITY} builds a ConvGrid")
            try:
                self.cand = candidates("ConvGrid", self.conv)
            except ValueError as e:
                raise self.error(str(e)) from None
            room = self.node.attrs.get(CONV_ROOM)
            self.expect(room is None or (isinstance(room, int) and room >= 1),
                        f"{CONV_ROOM} must be a positive integer, got {room!r}")
        self.K = self.keys_for(self.node.op_type, self.node.attrs, self.N)  # 8 a point for the nearest voxels
        self.expect(self.K <= self.MAX_KEYS, f"{self.K:,} voxel keys exceed the {self.MAX_KEYS:,} a device build "
                    "holds (its scratch is indexed with 32-bit integers)")
        self.S = Scratch(self.K, self.B)

    def check_outputs(self) -> None:
        """Check the static shapes of the bundle outputs of B grids."""
        for k, name in enumerate(schema.BUNDLE):
            t = self.outputs[k] if k < len(self.outputs) else None
            if t is None or k in self.runtime_sized:
                continue
            want = {"grid_byte_offsets": (self.B,), "voxel_sizes": (self.B, 3), "origins": (self.B, 3),
                    "batch_offsets": (self.B + 1,), "list_indices": (0,)}[name]
            self.expect_shape(t, want, f"output {name}")

    def coords_error(self) -> str:
        """What ERR_COORDS means for this op (the run's error)."""
        if self.conv is not None:  # (a point's own voxel off int32 is the points' node's error, raised first)
            return NEW_COORDS_ERROR
        return "points map to voxel coordinates that are not finite or do not fit int32"

    def who(self) -> str:
        # a ConvGrid of points (CONV_OF_POINTS) stands for the user's ConvGrid node, whose name it has
        # (luisaml/fvdb/host_steps.py's pair): its errors name that node and op, not GridBatchFromPoints
        if self.conv is None:
            return super().who()
        return Node(self.node.name, "ConvGrid", self.node.domain, [], []).describe()

    def expect(self, ok: bool, message: str) -> None:
        if not ok:
            raise self.error(message)

    def expect_dtype(self, t, names, what: str) -> None:
        self.expect(t.dtype.name in names, f"{what} '{t.name}' must be {' or '.join(n.lower() for n in names)}, got "
                    f"{t.dtype.name.lower()}")

    def expect_shape(self, t, shape, what: str) -> None:
        self.expect(tuple(t.shape) == tuple(shape), f"{what} '{t.name}' must have shape {list(shape)}, got "
                    f"{shape_str(t.shape)}")

    def derived_inputs(self):
        # the voxel sizes and origins as constants or graph inputs: derived on the host when bound
        has = (self.has_input(4), self.has_input(5))
        sources = tuple(k for k, h in zip((4, 5), has) if h)
        points = Derived(grid_transforms, sources, dtypes.INT32, (self.B, TRANSFORM_WORDS),
                         (("grids", self.B), ("has", has)))
        if self.conv is None:
            return [points]
        # the new grid's transforms first (the clear and write stages read derived[0]), the points' after
        conv = tuple(sorted((k, tuple(int(x) for x in np.atleast_1d(v))) for k, v in self.conv.items()))
        return [Derived(conv_transforms, sources, dtypes.INT32, (self.B, TRANSFORM_WORDS),
                        (("grids", self.B), ("has", has), ("conv", conv))), points]

    def scratch(self):
        return {"int": self.S.words}

    def describe(self):
        what = "grids" if self.conv is None else "the ConvGrid ({}) of the grids".format(
            ", ".join(f"{k} {list(np.atleast_1d(v))}" for k, v in self.conv.items()))
        return (f"{what} built on the device from {self.N:,} {'points' if self.points else 'ijk'} ({self.K:,} voxel "
                f"keys) into {self.B} "
                f"grid(s): hash, radix sort, nodes, {self.layout_said}, write")

    # ---- phases -----------------------------------------------------------------------------
    def _call(self, ctx, helper: str, *args) -> None:
        name = ctx.use_helper(helper, "grid_build")
        ctx.line(f"{name}(scratch_int, {', '.join(str(a) for a in args)})")

    def _ctr(self, word: int) -> str:
        return f"scratch_int.read({self.S.ctr + word})"

    def _aux(self, name: str) -> int:
        """The table word of the upper levels' bases of the prefix sum over region `name`, whose words its
        readers add (_scan: gb_upper_sums; 0 past the last level, none for a sum of one level)."""
        return self.S.levels_at(name)

    def _scan(self, name: str, bases: list[int], size: int, n_expr, level0=None, base0=None) -> list[Phase]:
        """Phases of an exclusive prefix sum in place over the first n (a DSL expression, or a function of
        the emission's context returning one; at most size) words at each base (the same length): its up
        sweep alone, each level's SCAN-word chunks scanned in place and their totals one level up, to a last
        level of at most SCAN words that no stage scans. Every addition is its readers' (gb_prefix and
        gb_upper_sums add a word's upper levels and sum the last level's words before its own; gb_total the
        total): no top-level or down-sweep stage at any size, and none at all for n <= SCAN. level0(ctx,
        item), if given, is emitted in the first level's stage too (its item: SCAN words from item * SCAN);
        base0(ctx), if given, the DSL expression of the words' base (one base), in place of bases[0]'s."""
        sizes = scan_levels(size)
        levels = [self.S.levels(b) for b in bases]
        out = []

        def n_at(ctx, k: int) -> str:
            n = n_expr(ctx) if callable(n_expr) else str(n_expr)
            return n if k == 0 else f"(({n}) + {G.SCAN ** k - 1}) // {G.SCAN ** k}"

        for k in range(len(sizes) - 1):
            def up(ctx, item, k=k):
                nk = ctx.let(n_at(ctx, k), "n")
                for lv in levels:
                    src = base0(ctx) if k == 0 and base0 is not None else lv[k]
                    self._call(ctx, "gb_scan_up", src, lv[k + 1], nk, item)
                if k == 0 and level0 is not None:
                    level0(ctx, item)
            out.append(Phase(f"{name}: sum chunks, level {k}", sizes[k + 1], up))
        return out

    def phases(self):
        S, N, B = self.S, self.K, self.B  # (N: voxel keys)
        leaves = self._ctr(G.C_LEAVES)
        items = max(N, 1)
        keys = Phase("voxel keys", items, self._emit_voxels)
        if self.conv is not None:  # (a thread a point, its candidates appended, their count read: keys_counted)
            keys = Phase("voxel keys", max(self.N, 1), self._emit_conv_keys, readback=HostRead(
                S.keys.at, 1, self._keys_step, at_end=True))

        def insert(ctx, p):
            if self.short:  # (thread 0 clamps the key count to the room: every thread here is below it anyway)
                ctx.line(f"if {p} == 0 and {S.keys} > {self.K}:")
                with ctx.indent():
                    ctx.line(f"scratch_int.write({S.keys.at}, {self.K})")
            self._guarded(ctx, p, "gb_insert", S.vox, S.owner, S.slot, S.ids, S.mask, S.cap, p)
        out = [Phase("clear", max(S.raw["cap"], B, 1), self._emit_clear), keys, Phase("hash leaves", items, insert)]
        # the voxel keys' root tiles and grids are the leaves' (a leaf's are its points'): their ranges, which
        # the sort keys read, fold in the leaf ids' first up stage (a stage of their own below SCAN keys)
        def ranges(ctx, c):  # (and the first radix pass's histograms zeroed: 512 words a thread, 16 a key)
            self._call(ctx, "gb_point_ranges", S.vox, S.ctr, S.keys, c)
            self._call(ctx, "gb_zero_hist", S.hist, S.keys, c)
        ids = self._scan("leaf ids", ["ids"], N, S.keys, level0=ranges)
        out += ids or [Phase("tile ranges", 1, ranges)]
        aux = self._aux("ids")

        def leaves_of(ctx, p):
            # (thread 0: the leaves' count, the sum's total, which the stages after this one read)
            ctx.line(f"if {p} == 0:")
            with ctx.indent():
                total = ctx.use_helper("gb_total", "grid_build")
                ctx.line(f"scratch_int.write({S.ctr + G.C_LEAVES}, {total}(scratch_int, {S.ids}, {aux}, {S.keys}))")
            self._guarded(ctx, p, "gb_leaf", S.vox, S.owner, S.slot, S.ids, aux, S.lkey, S.mask, S.order[0], S.key2,
                          S.ctr, S.hist, S.keys, p)
        out.append(Phase("leaf keys, masks and sort keys", items, leaves_of))
        # the pass number is a counter in ctr, not a literal: the PASSES passes are then the same kernels. Two
        # words, each written by thread 0 of a stage none of whose threads reads it: the up sweep reads
        # C_PASS and its first stage's thread 0 sets C_LATE to it + 1, the scatter reads
        # C_LATE - 1 and its thread 0 sets C_PASS to C_LATE (no stage of their own). The host leaves out only
        # the last passes (fvdb/radix_passes.py), whose counters no stage launched after them reads. Pass p's
        # histograms are in buffer p % 2 (hist, hist2): pass 0's counted by the leaf stage (gb_leaf), every later
        # pass's by the scatter before it into the buffer that scatter's up sweep zeroed (gb_scatter): no
        # histograms stage
        def pass_no(late: bool) -> str:
            return f"(scratch_int.read({S.ctr + G.C_LATE}) - 1)" if late else f"scratch_int.read({S.ctr + G.C_PASS})"

        def hist_n(ctx):
            return f"{ctx.use_helper('gb_hist_words', 'grid_build')}(scratch_int, {S.ctr}, {pass_no(False)})"

        def source(ctx, late) -> str:
            return ctx.let(f"{ctx.use_helper('gb_pass_source', 'grid_build')}(scratch_int, {S.ctr}, {S.order[0]}, "
                           f"{S.order[1]}, {pass_no(late)})", "src")

        def buffer(ctx, late) -> str:  # this pass's histograms: hist or hist2 by its parity
            return ctx.let(f"{S.hist} + ({pass_no(late)} & 1) * ({S.hist2} - {S.hist})", "hist")

        def up_first(ctx, c):  # (the first up stage: the next pass's buffer zeroed, C_LATE set)
            mine = buffer(ctx, False)
            self._call(ctx, "gb_zero_chunk", f"{S.hist} + {S.hist2} - {mine}", hist_n(ctx), c)
            ctx.line(f"if {c} == 0:")
            with ctx.indent():
                ctx.line(f"scratch_int.write({S.ctr + G.C_LATE}, {pass_no(False)} + 1)")

        def scatter(ctx, c):
            src = source(ctx, True)
            dst = ctx.let(f"{S.order[0] + S.order[1]} - {src}", "dst")
            mine = buffer(ctx, True)
            self._call(ctx, "gb_scatter", S.ctr, S.key2, src, dst, mine, f"{S.hist} + {S.hist2} - {mine}",
                       S.levels_at("hist"), pass_no(True), c)
            ctx.line(f"if {c} == 0:")
            with ctx.indent():
                ctx.line(f"scratch_int.write({S.ctr + G.C_PASS}, {pass_no(True)} + 1)")

        for p in range(G.PASSES):
            # (the scatter adds every level of the sum)
            out += self._scan(f"radix pass {p}", ["hist"], 256 * S.chunks, hist_n, level0=up_first,
                              base0=lambda ctx: buffer(ctx, False))
            out.append(Phase(f"radix pass {p}: scatter", S.chunks, scatter))

        def rank(ctx, r):
            # node r's boxes empty (at most as many nodes as keys, a thread a key here; not at "clear": their
            # words are the sort's until now, build_scratch.py): "node ranges and bboxes" folds leaves into them
            self._call(ctx, "gb_node_boxes_init", S.lower_box, S.upper_box, S.keys, r)
            order = ctx.let(f"{ctx.use_helper('gb_pass_source', 'grid_build')}(scratch_int, {S.ctr}, {S.order[0]}, "
                            f"{S.order[1]}, {G.PASSES})", "order")
            self._call(ctx, "gb_rank", S.ctr, S.lkey, S.mask, order, S.skey, S.counts, S.new_lower, S.new_upper,
                       S.leaf_box, r)
        out.append(Phase("leaves in order", items, rank))
        # (its additions and totals made by the stages that read them: gb_sum_at)
        out += self._scan("voxel, lower and upper ids", ["counts", "new_lower", "new_upper"], N, leaves)
        c_aux, lo_aux, up_aux = (self._aux(name) for name in ("counts", "new_lower", "new_upper"))

        def ranges_and_boxes(ctx, r):
            # (one stage: the nodes' boxes start empty from "leaves in order", so leaf r folds its box into its nodes'
            # whatever thread starts them; the grids' boxes too)
            self._call(ctx, "gb_firsts", S.ctr, S.skey, S.new_lower, S.new_upper, lo_aux, up_aux, S.lower_first,
                       S.upper_first, S.upper_lower, S.grid_first, r)
            self._call(ctx, "gb_node_boxes", S.ctr, S.skey, S.new_lower, S.new_upper, lo_aux, up_aux, S.leaf_box,
                       S.lower_box, S.upper_box, S.grid_box, r)
        out += [Phase("node ranges and bboxes", items, ranges_and_boxes),
                *self.layout_phases(lambda ctx, b: self._call(
                    ctx, "gb_summary", S.ctr, S.new_lower, S.new_upper, S.counts, lo_aux, up_aux, c_aux, S.grid_first,
                    S.grid_box, S.summary, b)),  # (then the grids laid out, the blob zeroed: build_layout.py)
                Phase("leaves, nodes, child masks, offsets", max(items, self.ZERO_THREADS, B), self._emit_writes,
                      readback=self.end_read())]
        return out

    def _emit_clear(self, ctx, t) -> None:
        """Thread 0 writes the layout table the later stages read; the stage itself holds literals."""
        S = self.S
        ctx.line(f"if {t} == 0:")
        with ctx.indent():
            for k, value in enumerate(S.table):
                ctx.line(f"scratch_int.write({k}, {value})")
        self._call(ctx, "gb_clear", S.raw["owner"], S.raw["cap"], S.ctr, S.raw["grid_first"], S.raw["grid_box"],
                   self.B, t)
        # grid t's transforms row into its summary row: the header stage reads it (the host's layout: h and o)
        table = self.derived[0]
        ctx.line(f"if {t} < {self.B}:")
        with ctx.indent():
            k = ctx.fresh("w")
            ctx.line(f"for {k} in range(0, {TRANSFORM_WORDS}):")
            with ctx.indent():
                ctx.line(f"scratch_int.write({S.summary} + {G.S_WORDS} * {t} + {G.S_TRANSFORM} + {k}, "
                         f"{table.load(f'{t} * {TRANSFORM_WORDS} + {k}')})")
        if self.conv is not None:  # the keys phase counts its keys up from 0 (after the table's write above)
            ctx.line(f"if {t} == 0:")
            with ctx.indent():
                ctx.line(f"scratch_int.write({S.keys.at}, 0)")

    def _guarded(self, ctx, item: str, helper: str, *args) -> None:
        ctx.line(f"if {item} < {self.S.keys}:")
        with ctx.indent():
            self._call(ctx, helper, *args)

    def _blob(self) -> str:
        blob, base = self.output(0).storage.byte_address()
        assert base == "0", base  # (a run-time sized output is its own ByteBuffer)
        return blob

    def _emit_blob_call(self, ctx, helper: str, *args) -> None:
        name = ctx.use_helper(helper, "grid_build")
        call = f"{name}(scratch_int, {self._blob()}, {', '.join(str(a) for a in args)})"
        if not self.LAYOUT_ON_DEVICE:
            ctx.line(call)
            return
        self.room_guard(ctx)  # (a blob past its capacity: nothing written, the run repeated)
        with ctx.indent():
            ctx.line(call)

    def _emit_writes(self, ctx, t) -> None:
        """Thread t writes leaf t, lower node t, upper node t and its root tile, child-mask words t, t +
        ZERO_THREADS, ... and grid t's offsets and transforms: one stage, not five (five launches a
        build), since each writes its own words of the blob and the outputs and reads only what earlier
        stages wrote."""
        S = self.S
        self._emit_leaves(ctx, t)
        self._emit_blob_call(ctx, "gb_write_lower", S.ctr, S.layout + 16, S.skey, S.lower_first, S.new_upper,
                             self._aux("new_upper"), S.lower_box, t)
        self._emit_blob_call(ctx, "gb_write_upper", S.ctr, S.layout + 16, S.skey, S.upper_first, S.upper_box, t)
        ctx.line(f"if {t} < {self.ZERO_THREADS}:")
        with ctx.indent():
            self._emit_blob_call(ctx, "gb_child_words", S.ctr, S.layout + 16, S.skey, S.lower_first, S.upper_lower,
                                 self.ZERO_THREADS, t)
        ctx.line(f"if {t} < {self.B}:")
        with ctx.indent():
            self._emit_statics(ctx, t)
            self.emit_header(ctx, t)

    def _emit_zero(self, ctx, t) -> None:
        name = ctx.use_helper("gb_zero_blob", "grid_build")
        ctx.line(f"{name}({self._blob()}, scratch_int.read({self.S.layout}), {self.ZERO_THREADS}, {t})")

    def _emit_voxels(self, ctx, q) -> None:
        """Voxel key q: its point p (q, or q // 8 with the nearest voxels' corner q % 8), p's grid (the
        last b with joffsets[b] <= p, a binary search) and the voxel; thread 0 checks that joffsets
        rise from 0 to N."""
        S, B = self.S, self.B
        jdata, joff = self.input(0), self.input(1)
        per = 8 if self.nearest else 1
        self._emit_offsets_check(ctx, q, per)
        keys = f"int({joff.load(str(B))}) * {per}" if self.counted else str(self.K)
        ctx.line(f"if {q} < {keys}:")
        with ctx.indent():
            p = ctx.let(f"{q} // 8", "p") if self.nearest else q
            lo = self._emit_grid_of(ctx, p)
            if self.points:
                xyz = self._emit_position(ctx, p, lo, self.derived[0])
                if self.nearest:
                    self._call(ctx, "gb_store_corner", S.vox, S.ctr, q, lo, *xyz, f"{q} % 8")
                else:
                    self._call(ctx, "gb_store_voxel", S.vox, S.ctr, p, lo, *xyz)
            else:
                ctx.line(f"scratch_int.write({S.vox} + 4 * {p}, {lo})")
                for a in range(3):
                    ctx.line(f"scratch_int.write({S.vox} + 4 * {p} + {1 + a}, {jdata.load(f'{p} * 3 + {a}')})")

    def _emit_conv_keys(self, ctx, p) -> None:
        """Point p (a ConvGrid of the points' grid, CONV_OF_POINTS): its voxel, as _emit_voxels finds it
        (gb_store_voxel's rounding), then that voxel's ConvGrid candidates appended to the keys, as
        topology_device.py appends a source grid's voxel's: the same voxels, for the fine grid's voxels are
        its points' (duplicates are the hash's to fold)."""
        S, B, joff = self.S, self.B, self.input(1)
        self._emit_offsets_check(ctx, p, None)
        ctx.line(f"if {p} < int({joff.load(str(B))}):")
        with ctx.indent():
            lo = self._emit_grid_of(ctx, p)
            xyz = self._emit_position(ctx, p, lo, self.derived[1])
            rnd = ctx.use_helper("gb_round", "grid_build")
            r = [ctx.let(f"{rnd}({x})", "r") for x in xyz]
            ok = ctx.let(" and ".join(f"({v} >= -2147483648.0) and ({v} < 2147483648.0)" for v in r), "ok")
            c = [ctx.fresh("c") for _ in range(3)]
            for v in c:
                ctx.line(f"{v} = 0")
            ctx.line(f"if {ok}:")  # (false for NaN)
            with ctx.indent():
                for v, x in zip(c, r):
                    ctx.line(f"{v} = int({x})")
                emit_source_voxel(ctx, self.cand, S, lo, c, self.K if self.short else None)
            ctx.line("else:")
            with ctx.indent():
                ctx.line(f"{ctx.use_helper('gb_error', 'grid_build')}(scratch_int, {S.ctr}, {G.ERR_COORDS})")

    @property
    def short(self) -> bool:
        """Whether a ConvGrid of points holds fewer keys than every candidate of every point (CONV_ROOM)."""
        return self.conv is not None and self.K < self.N * self.cand.count

    def _keys_step(self, words: np.ndarray) -> HostResult:
        """At the run's end: the candidates counted kept (keys_counted: its host sizes the next run's room by
        them); KeysPastRoom raised where they passed the room."""
        self.keys_counted = int(words[0])
        if int(words[0]) > self.K:
            raise KeysPastRoom(f"{self.who()}: {int(words[0]):,} candidate keys, room for {self.K:,}",
                               int(words[0]))
        return HostResult()

    def _emit_offsets_check(self, ctx, q, per: int | None) -> None:
        """Thread 0: joffsets must rise from 0 to N (at most N where counted), else ERR_OFFSETS; where
        counted, the key count the later phases read: the points bound times `per` (None: the keys are
        appended, counted up from 0 by the clear stage)."""
        S, N, B, joff = self.S, self.N, self.B, self.input(1)
        ctx.line(f"if {q} == 0:")
        with ctx.indent():
            bad = ctx.fresh("bad")
            last = joff.load(str(B))
            ctx.line(f"{bad} = {joff.load('0')} != 0 or " + (f"{last} > {N} or {last} < 0" if self.counted
                                                            else f"{last} != {N}"))
            k = ctx.fresh("k")
            ctx.line(f"for {k} in range(0, {B}):")
            with ctx.indent():
                ctx.line(f"{bad} = {bad} or {joff.load(k)} > {joff.load(f'{k} + 1')}")
            ctx.line(f"if {bad}:")
            with ctx.indent():
                ctx.line(f"{ctx.use_helper('gb_error', 'grid_build')}(scratch_int, {S.ctr}, {G.ERR_OFFSETS})")
            if self.counted and per is not None:  # the key count the later phases read: the points bound
                ctx.line("else:")
                with ctx.indent():
                    ctx.line(f"scratch_int.write({S.keys.at}, int({last}) * {per})")

    def _emit_grid_of(self, ctx, p) -> str:
        """Point p's grid: the last b with joffsets[b] <= p (a binary search); return its name."""
        joff = self.input(1)
        lo, hi = ctx.fresh("lo"), ctx.fresh("hi")
        ctx.line(f"{lo} = 0")
        ctx.line(f"{hi} = {self.B - 1}")
        ctx.line(f"while {lo} < {hi}:")
        with ctx.indent():
            mid = ctx.let(f"({lo} + {hi} + 1) // 2", "mid")
            ctx.line(f"if {joff.load(mid)} <= {p}:")
            with ctx.indent():
                ctx.line(f"{lo} = {mid}")
            ctx.line("else:")
            with ctx.indent():
                ctx.line(f"{hi} = {mid} - 1")
        return lo

    def _emit_position(self, ctx, p, b: str, table) -> list[str]:
        """Point p's voxel-space position in grid b (float32, from `table`: the points' grid_transforms)."""
        jdata, S = self.input(0), self.S
        f = ctx.use_helper("gb_float", "grid_build")
        z = ctx.let(f"{ctx.use_helper('gb_zero', 'grid_build')}(scratch_int, {S.ctr})", "z")
        xyz = []
        for a in range(3):
            v = jdata.load(f"{p} * 3 + {a}")
            if jdata.dtype.dsl != "float":
                v = f"float({v})"
            sc = ctx.let(f"{f}({table.load(f'{b} * {TRANSFORM_WORDS} + {12 + a}')})", "sc")
            tr = ctx.let(f"{f}({table.load(f'{b} * {TRANSFORM_WORDS} + {15 + a}')})", "tr")
            # numpy's float32 p * scale + translate: the product rounded before the sum
            xyz.append(ctx.let(f"({v} * {sc} + {z}) + {tr}", "x"))
        return xyz

    def _emit_leaves(self, ctx, r) -> None:
        S = self.S
        order = ctx.let(f"{ctx.use_helper('gb_pass_source', 'grid_build')}(scratch_int, {S.ctr}, {S.order[0]}, "
                        f"{S.order[1]}, {G.PASSES})", "order")
        self._emit_blob_call(ctx, "gb_write_leaf", S.ctr, S.layout + 16, S.skey, S.mask, order, S.counts,
                             self._aux("counts"), S.new_lower, self._aux("new_lower"), S.leaf_box, r)
        out = self.outputs[4] if len(self.outputs) > 4 else None
        if out is not None:
            ctx.line(f"if {r} < {self._ctr(G.C_LEAVES)}:")
            with ctx.indent():
                ctx.store(out, r, f"scratch_int.read({S.skey} + 4 * {r})")

    def _emit_statics(self, ctx, b) -> None:
        """Grid b's byte offset, first voxel, voxel size and origin (their float32 values: float64
        lives in 32 bits inside kernels)."""
        S = self.S
        row = f"{S.layout + 16} + {G.G_WORDS} * {b}"
        outs = list(self.outputs) + [None] * (len(schema.BUNDLE) - len(self.outputs))
        if outs[1] is not None:
            ctx.store(outs[1], b, f"scratch_int.read({row} + {G.G_OFFSET})")
        if outs[5] is not None:
            ctx.store(outs[5], b, f"scratch_int.read({row} + {G.G_VOXEL_START})")
            ctx.line(f"if {b} == {self.B - 1}:")
            with ctx.indent():
                ctx.store(outs[5], str(self.B), f"scratch_int.read({S.layout + 1})")
        table = self.derived[0]
        f = ctx.use_helper("gb_float", "grid_build")
        for k, col in ((2, 18), (3, 21)):
            if outs[k] is not None:
                for a in range(3):
                    ctx.store(outs[k], f"{b} * 3 + {a}", f"{f}({table.load(f'{b} * {TRANSFORM_WORDS} + {col + a}')})")


for _name in DeviceGridBuild.OPS:  # (the topology ops register in topology_device.py)
    register(_name, domain="fvdb", since=1)(type(_name, (DeviceGridBuild,), {"__doc__": grid_schema.GRID_OPS[_name].doc}))
