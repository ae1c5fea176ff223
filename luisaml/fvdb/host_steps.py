"""Grid ops over grids bound at run time that run when a run binds new grids, before the kernels:
the pass that cuts them out of the graph, and what a run does with them.

fVDB's topology ops (CoarsenedGrid, RefinedGrid, DilatedGrid, PrunedGrid, ConvGrid,
ConvTransposeGrid) build a new GridBatch bundle whose size depends on the data. Over constant
grids they fold when the model is compiled. Over a grid given as an input of any size (a U-Net's
coarse level made from the fine grid inside the model), they become steps. The same holds for
the GridBatchFrom* constructors when their input has a dynamic size or another node reads the
grid they build: the device builder needs a fixed point count, and its grid can only be a graph
output (Operator.runtime_sized).

- **Compile.** `split` takes such nodes out of the ONNX graph before inference. Their outputs
  become graph inputs of the compiled network, with their rows bound at run time, so every node
  after them reads them exactly as it reads a grid the user binds. The graph inputs that only the
  steps read leave the graph. The grid count may be bound at run time too (the source's
  grid_byte_offsets, voxel_sizes, origins and batch_offsets, or a GridBatchFrom*'s joffsets, with a
  dynamic first dimension: operators/fvdb/grid_count.py): the new bundle's count inputs then take the
  source's symbols, and its readers must take any count (else the passes name the one that does not).
- **Run.** `HostSteps.complete` runs the steps on the host arrays of their inputs and adds the new
  bundles to the feeds, after checking those inputs against their declared types. A topology step
  builds on the device when the network was compiled with grid_build="device" (`DeviceBuilds`: a
  network of the node alone, with the attribute voxel_capacity, per power of two of the source's
  voxels: operators/fvdb/topology_device.py; for a GridBatchFrom*, of its points, counted on the
  device by joffsets), else with the project's builder on the host (luisaml/fvdb/topology.py, the
  code that folds them at compile time). Both give the same bytes. A step whose count is bound at
  run time first checks the source bundle's count inputs against its blob's grids (an InputError
  naming the input); a device build's network is then per grid count too (its scratch and read-back
  are sized by it). A step whose inputs have the same bytes as at its last run gives its last result
  back, so a grid bound again costs one hash (torch tensors: one comparison where they live, no copy);
  so does a step of another network whose op (its attributes, constants, where it builds) last ran,
  anywhere in the process, on the same bytes: a detector's backbone and head, each making the coarse
  grid of one fine grid, build it once (a weak registry, `_LIVE`: a network dropped takes its steps'
  results with it). A step's new bundle is frozen (read-only) and known as luisaml's own (fvdb/checked.py):
  whoever binds it reads its headers, not its tree.

Why a step and not a stage of the main network: a grid built on the device is sized at run time,
and no node may read a tensor sized at run time (its buffer cannot be pooled before its size is
known). The host's builder is vectorised numpy: CoarsenedGrid and ConvGrid 2/2 take 11-170 ms for
17k-200k voxels on this project's 2-core CI machine (DilatedGrid more: its output is 15x its input).

A GridBatchFromPoints whose grid a ConvGrid step reads (a detector's fine grid and its coarse one)
builds with that ConvGrid in one network run (`DeviceBuilds.run_pair`): the points' node and a second
node over the same points that appends each point's voxel's ConvGrid candidates (operators/fvdb/topology.py,
CONV_OF_POINTS), the same voxels as the candidates of the fine grid's voxels; one wait, one run and one
binding for both grids, the ConvGrid's source metadata not derived, the fine blob not uploaded to it. Its
keys are sized by the points (8 a point for 3/2, where the separate build's were 8 a fine voxel), at a
quarter step of a power of two (pool.bucket: 163,840 for 150k points, not 262,144), so the ConvGrid node
holds half of that (CONV_ROOM: a point's voxel has 1 or 2 candidates an axis, 3.4 on average) until a run
counts more (KeysPastRoom at that run's end: the pair runs again at the quarter step above the keys it
counted, kept until a frame counts an eighth under the half room again; nothing is cut).

Device builds are compiled per power of two of the source's voxels (at least 1024; a DilatedGrid of
n is n passes of 1) and kept for the process (a model compiled again, or per batch size, shares
them): the device builder's scratch is sized when a network is compiled, and the bucket bounds the
compiles to ~20 ever, each the same kernel text as the others (compiled once). A build's radix
passes that the host knows do nothing (from the points' or the source grid's root tiles:
fvdb/radix_passes.py) are not launched. Their outputs come back to the host, the voxel sizes and
origins as the host's doubles; the blob also stays in the build's output buffer (its headers written
there by the device), and a network binding it next copies it from there on the device instead of uploading it
(luisaml/resident.py: a detector frame's 9.8 MB of uploads). grid_build="device" is the
default on CUDA, "host" on the CPU backend, where numpy is 2-9x faster than the CPU backend's
kernels (benchmarks/bench_topology.py). Rejected: the device grid as an input of the main network's
later stages in one launch (no copies): a node would have to read a tensor sized at run time, which
the runtime does not allow, and the host steps already give the API it would have.
"""
from __future__ import annotations

import contextlib
import hashlib
import itertools
import weakref
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .. import dtypes, pool, resident
from ..errors import InputError, InputNameError, InputTypeError, LimitError, LuisamlError
from ..interop import is_torch, same_tensor, to_numpy
from ..model import ModelError, Node, _attr_value, shape_str
from ..opsets import fvdb as schema
from ..opsets import fvdb_grids as grid_schema
from . import checked, radix_passes

DOMAIN = "fvdb"
BUNDLE = len(schema.BUNDLE)


@dataclass(frozen=True)
class HostInput:
    """A graph input a host step reads: its name, dtype and shape (None: any number of rows)."""

    name: str
    dtype: dtypes.DType
    shape: tuple

    def check(self, a: np.ndarray) -> None:
        if a.dtype != self.dtype.numpy:
            raise InputTypeError(f"input '{self.name}': expected dtype {self.dtype.numpy}, got {a.dtype}")
        if a.ndim != len(self.shape) or any(isinstance(d, int) and d != n for d, n in zip(self.shape, a.shape)):
            raise InputError(f"input '{self.name}': expected shape {shape_str(self.shape)}, got {shape_str(a.shape)}")


@dataclass
class HostStep:
    """One grid op the host runs: its node, its operator class (the model's binding of it), the values
    of its constant inputs, and its last result."""

    node: Node
    operator: type
    constants: dict[str, np.ndarray]
    # a grid count bound at run time: the names of grid_blob and the count inputs, checked against
    # the blob's grids before the step runs (operators/fvdb/grid_count.py); None: a fixed count
    counted: tuple[str, ...] | None = None
    _last: tuple | None = field(default=None, repr=False)  # (key of the inputs' bytes, {output: array})
    # where it builds (None: the host; else the device builds' config) -> its op's _Latest in _LIVE: the
    # step holds it, so the registry keeps an op's entry exactly while a step of that op lives
    _latest: dict = field(default_factory=dict, repr=False, compare=False)
    _ops: dict = field(default_factory=dict, repr=False, compare=False)  # where -> _op(where), made once
    # built by the step before this one in the same network run (DeviceBuilds.run_pair): (the source arrays it
    # was built from, by identity, and the arrays), taken by this step's next run over those very arrays
    _given: tuple | None = field(default=None, repr=False, compare=False)

    def run(self, values: Mapping[str, np.ndarray], digests: Mapping[str, bytes],
            device: "DeviceBuilds | None" = None,
            then: "HostStep | None" = None) -> tuple[dict[str, np.ndarray], tuple]:
        """Return ({output name: array}, the key of this computation) for the node's inputs in values
        (or its constants); digests: each input's bytes' digest (or a token standing for them);
        device: where the grid ops build on the device (None: on the host); then: a later step, a ConvGrid
        of this step's grid, that a device build makes in the same network run (HostSteps._pairs): its
        arrays handed to it (`_given`), which its run takes when its source is this run's result."""
        arrays = [None if not name else self.constants.get(name, values.get(name)) for name in self.node.inputs]
        key = tuple(None if a is None or name in self.constants else (a.dtype.str, a.shape, digests[name])
                    for name, a in zip(self.node.inputs, arrays))
        given, self._given = self._given, None
        if self._last is not None and self._last[0] == key:
            return self._last[1], key
        if self.counted is not None:
            self._check_count(arrays)
        latest = self._latest_of(None if device is None else (device.config,))
        then_out = None
        if latest.value is not None and latest.value[0] == key:  # another network's step built it from these bytes
            out = latest.value[1]
        else:
            if given is not None and len(given[0]) == len(arrays) and all(a is b for a, b in zip(given[0], arrays)):
                out = given[1]  # (built with the step before it, from these arrays)
            elif device is not None and then is not None:
                out, then_out = device.run_pair(self.node, self.operator, arrays,
                                                [None if k is None else k[2] for k in key], then.node)
            elif device is not None:
                out = device.run(self.node, self.operator, arrays, [None if k is None else k[2] for k in key])
            else:
                out = on_host(self.node, self.operator, arrays)
            # frozen, and known as luisaml's own grid: every network binding it reads its headers, not its
            # whole tree, ~3 ms a grid of 30k voxels once a binding (fvdb/checked.py). Not a result that is
            # an input's memory (a DilatedGrid of 0 on the device gives its input back): copied, so that the
            # user's array is not frozen, and checked where it is bound as any grid the user binds
            given = [a for a in arrays if isinstance(a, np.ndarray)]
            theirs = [any(a is b or np.may_share_memory(a, b) for b in given) for a in out]  # (a is b: an empty one)
            out = [checked.freeze(np.array(a) if mine else a) for a, mine in zip(out, theirs)]
            if not theirs[0]:  # (the blob luisaml's: the small arrays are checked at every binding anyway)
                checked.built(out[:BUNDLE - 1])
        result = {name: a for name, a in zip(self.node.outputs, out) if name}
        latest.value = (key, [result.get(name) for name in self.node.outputs])
        self._last = (key, result)
        if then_out is not None:  # (its source: this result, read by name as its run will read it)
            source = [result.get(name) if name in result else then.constants.get(name) for name in then.node.inputs]
            then._given = (source, then_out)
        return result, key

    def _latest_of(self, where: tuple | None) -> "_Latest":
        """Return the latest result of this step's op built `where` (None: the host), shared with every
        live step of the same op in the process (_LIVE), registered on first use."""
        latest = self._latest.get(where)
        if latest is None:
            op = self._op(where)
            latest = _LIVE.get(op)
            if latest is None:
                latest = _LIVE[op] = _Latest()
            self._latest[where] = latest
        return latest

    def _op(self, where: tuple | None) -> tuple:
        """What the step is, whatever the network and its names: the op, its attributes, its constants'
        bytes by position, and where it builds (None: the host; else the device builds' config, their
        limits among it). Made once per `where`: the node and its constants are the plan's."""
        op = self._ops.get(where)
        if op is None:
            op = self._ops[where] = self._make_op(where)
        return op

    def _make_op(self, where: tuple | None) -> tuple:
        consts = []
        for k, name in enumerate(self.node.inputs):
            a = self.constants.get(name)
            if a is not None:
                digest = hashlib.blake2b(np.ascontiguousarray(a).tobytes(), digest_size=16).digest()
                consts.append((k, a.dtype.str, a.shape, digest))
        return (self.node.op_type, repr(sorted(self.node.attrs.items())), tuple(consts), where)

    def _check_count(self, arrays: list) -> None:
        """Raise InputError naming the count input that disagrees with the number of grids in the blob."""
        from ..operators.fvdb.grid_count import check_blob_count

        by_name = dict(zip(self.node.inputs, arrays))
        try:
            check_blob_count(self.counted, *(by_name[n] for n in self.counted))
        except InputError as e:
            raise InputError(f"{self.node.describe()}: {e}") from None
        except LuisamlError as e:  # (a damaged blob: NanoVDBError)
            raise InputError(f"{self.node.describe()}: {e} (its grid is bound at run time)") from None


class _Latest:
    """The latest (key of the inputs' bytes, [output arrays]) of one step op, shared by its live steps."""

    __slots__ = ("value", "__weakref__")

    def __init__(self) -> None:
        self.value: tuple | None = None


# The latest result of each step op (HostStep._op: the op, attributes, constants, where it builds) that a
# live step has, process-wide by design: two networks building the same grid from the same bytes in turn
# (a detector's backbone and head) build it once, and no network knows the other. Weak: an entry lives as
# long as a step of its op holds it (HostStep._latest), so a network dropped takes its op's results with it
# (a cache bounded by a count kept the grids of dead networks alive). A network given grid A, B, A builds
# A twice, as before.
_LIVE: "weakref.WeakValueDictionary[tuple, _Latest]" = weakref.WeakValueDictionary()

CAPACITY = grid_schema.CAPACITY  # the voxels or points a device build's network takes
MIN_CAPACITY = 1024  # the smallest bucket: small grids share one network


class DeviceBuilds:
    """The topology steps built on the device: per node and power of two V of the source grid's
    voxels, a network of the node alone with the attribute voxel_capacity V (its inputs bound at run
    time), compiled by `compile_model(model, workers)` when a grid of that size first arrives and
    kept (workers: whether its kernels are worth building in worker processes: not for a later V of
    the same node, whose kernels are the same text). A DilatedGrid of n runs n passes of 1 (a pass
    has 27 candidates a voxel; one of n, (2n + 1)^3). The networks are shared by every DeviceBuilds
    of the process with the same `config` (what compile_model depends on besides the model): a
    model compiled again, or once per batch size, compiles no bucket twice."""

    _shared: dict[tuple, Any] = {}  # (config, the bucket model's bytes' digest) -> its network
    # a GridBatchFromPoints and the ConvGrid of its grid built in one network run (run_pair; HostSteps._pairs);
    # False: each its own run, as before (kept for an A/B on a GPU: the pair's scratch is sized by the points,
    # the separate ConvGrid's by the fine voxels, benchmarks/NOTES.md "Both grids of a frame in one run")
    PAIRS = True

    def __init__(self, compile_model, config: str = "") -> None:
        self.compile_model = compile_model
        self.config = config
        self.networks: dict[tuple, Any] = {}  # this network's buckets: (node, capacity, attrs, inputs) -> network
        self._rooms: dict[tuple, int] = {}  # (points node, ConvGrid node, capacity) -> the pair's ConvGrid keys, grown
        # past the half room (run_pair)

    def run(self, node: Node, operator: type, arrays: list, digests: list | None = None) -> list[np.ndarray]:
        """Return the seven bundle arrays node (of operator class `operator`) builds from arrays (its
        inputs, None where absent); digests: the digest of each one's bytes where the run knows it
        (None: hashed here)."""
        digests = list(digests or [None] * len(arrays))
        if not _from_grid(node.op_type):
            return self._build_from_points(node, operator, arrays, digests)
        attrs = dict(node.attrs)
        if node.op_type in ("DilatedGrid", "RefinedGrid"):  # a result past the limits: refused before any build
            from .topology import check_result_size

            offsets = np.asarray(arrays[5], np.int64).reshape(-1)
            counts = np.diff(offsets) if node.op_type == "DilatedGrid" or len(arrays) <= BUNDLE or \
                arrays[BUNDLE] is None else [int(np.count_nonzero(arrays[BUNDLE]))]
            try:
                check_result_size(node.op_type, attrs, [int(c) for c in counts])
            except LimitError as e:
                raise LimitError(f"{node.describe()}: {e}") from None
            except ValueError:
                pass  # (attributes out of range: the build's own check names them)
        passes = 1
        if node.op_type == "DilatedGrid":
            passes = int(attrs.get("dilation", 1))
            if passes < 0:
                raise InputError(f"{node.describe()}: dilation must be non-negative, got {passes}")
            if passes == 0:
                return [np.ascontiguousarray(a) for a in arrays[:BUNDLE]]
            attrs["dilation"] = 1
        out, known = list(arrays), digests
        for _ in range(passes):  # (a pass's voxel sizes and origins are its input's)
            out = self._build(node, operator, attrs, out[:2] + list(arrays[2:4]) + out[4:BUNDLE] + list(arrays[BUNDLE:]), known)
            known = [None] * 2 + digests[2:4] + [None] * (BUNDLE - 4) + digests[BUNDLE:]
        # the voxel sizes and origins as the host's doubles: the kernels compute in float32
        from .topology import new_transforms

        h, o = new_transforms(node.op_type, node.attrs, np.asarray(arrays[2], np.float64), np.asarray(arrays[3], np.float64))
        out[2], out[3] = np.ascontiguousarray(h, np.float64), np.ascontiguousarray(o, np.float64)
        return out

    def _build_from_points(self, node: Node, operator: type, arrays: list, digests: list) -> list[np.ndarray]:
        """A GridBatchFrom* of any number of points: jdata's rows bound at run time, counted by
        joffsets (checked here first), jidx not read (the device reads the grids off joffsets)."""
        arrays, n = _points_checked(node, arrays, digests)
        out = self._build(node, operator, dict(node.attrs), arrays, digests, n, (0,))
        out[2], out[3] = _points_transforms(arrays)
        return out

    def run_pair(self, node: Node, operator: type, arrays: list, digests: list | None,
                 conv: Node) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
        """Return (the seven bundle arrays of GridBatchFromPoints `node` over arrays, those of ConvGrid `conv`
        over that grid) built in one network run: the grid's node and a second GridBatchFromPoints with
        CONV_OF_POINTS (operators/fvdb/topology.py), which appends each point's voxel's ConvGrid candidates,
        over the same points (one wait, no download and upload of the fine grid between the builds), its keys
        at a room (CONV_ROOM; a run past it raises KeysPastRoom and runs again with room for the keys it
        counted, a quarter step above them). Where
        the pair cannot (its keys past what a build holds: the ConvGrid's candidates a point, not a voxel), the
        grid alone and None."""
        from ..operators.fvdb.topology import CONV_OF_POINTS, CONV_ROOM, KeysPastRoom

        digests = list(digests or [None] * len(arrays))
        if node.op_type != "GridBatchFromPoints" or conv.op_type != "ConvGrid":
            return self.run(node, operator, arrays, digests), None
        arrays, n = _points_checked(node, arrays, digests)
        conv_attrs = {CONV_OF_POINTS[0]: conv.attrs.get("kernel_size", ()),
                      CONV_OF_POINTS[1]: conv.attrs.get("stride", 1)}
        attrs = dict(node.attrs)
        # (a quarter step of a power of two, not the next power: the ConvGrid node's scratch is sized by the points,
        # ~80 words a key at 4 keys a point, 330 MB at 150k points in the power of two's 262,144, 206 MB at 163,840)
        capacity = max(pool.bucket(n), MIN_CAPACITY)
        try:
            every = operator.keys_for(node.op_type, conv_attrs, capacity)  # (every point's every candidate)
        except ValueError:
            every = None  # (attributes out of range: the ConvGrid's own build names them)
        if every is None or every > operator.MAX_KEYS:
            return self.run(node, operator, arrays, digests), None
        # the ConvGrid's keys at half of every candidate's room (a point's voxel has 1 or 2 candidates an axis: 3.4
        # a point on average); past it (KeysPastRoom: that run is repeated) at the quarter step above the keys the
        # run counted, until a run counts an eighth under the half room again
        half, grown = max(every // 2, 1), (node.name, conv.name, capacity)
        room = self._rooms.get(grown, half)
        # the passes idle for both grids (the ConvGrid's bound: the points' through its candidates)
        idle = radix_passes.idle_passes(node.op_type, {**attrs, **conv_attrs}, arrays, False, True)
        while True:
            net = self._pair_network(node, conv, attrs, {**conv_attrs, CONV_ROOM: room} if room < every else conv_attrs,
                                     capacity, arrays)
            try:
                got = self._run_net(node, net, arrays, digests, idle)
                break
            except KeysPastRoom as e:
                if room >= every:
                    raise
                room = self._rooms[grown] = min(pool.bucket(e.keys), every)
        counted = net.plan.ops[1][1].keys_counted
        if room > half and counted is not None and counted <= half - half // 8:
            del self._rooms[grown]  # (a frame that fits the half room again: the room is not kept for good)
        fine = self._outputs(net, got, 0)
        coarse = self._outputs(net, got, BUNDLE)
        fine[2], fine[3] = _points_transforms(arrays)
        from .topology import new_transforms

        h, o = new_transforms("ConvGrid", conv.attrs, fine[2], fine[3])
        coarse[2], coarse[3] = np.ascontiguousarray(h, np.float64), np.ascontiguousarray(o, np.float64)
        return fine, coarse

    def _build(self, node: Node, operator: type, attrs: dict, arrays: list, digests: list, count: int | None = None,
               bound: tuple = None) -> list[np.ndarray]:
        """Run the node's network for the capacity of `count` (the source grid's voxels when None)
        over arrays, the rows of `bound` (default _BOUND_ROWS) bound at run time."""
        bound = _BOUND_ROWS if bound is None else bound
        if count is None:
            offsets = np.asarray(arrays[5]).reshape(-1)
            count = int(offsets[-1]) if len(offsets) else 0
        capacity = _bucket(count)
        key = (node.name, capacity, tuple(sorted((k, repr(v)) for k, v in attrs.items())),
               tuple((a.dtype.str, a.shape[1:] if k in bound else a.shape) if a is not None else None
                     for k, a in enumerate(arrays)))
        if key not in self.networks and self._too_large(node, operator, attrs, capacity):
            return self._on_host(node, operator, attrs, arrays, capacity)
        net = self._network(key, lambda: _build_model(node, attrs, capacity, arrays, bound))
        # the radix passes the host knows do nothing are not launched (~90 of ~210 launches at 100k points);
        # a source bundle of the user's (writeable, never remembered) walked here first, so that its
        # leaves bound them too, and known as checked to the network's metadata for this build only
        from_grid = _from_grid(node.op_type)
        source = [np.ascontiguousarray(a) if a is not None else None for a in arrays[:6]] if from_grid else arrays
        walk = _walked(source) if from_grid and checked.known(source) is None else contextlib.nullcontext()
        with walk:
            idle = radix_passes.idle_passes(node.op_type, attrs, source, from_grid)
            got = self._run_net(node, net, arrays, digests, idle)
        return self._outputs(net, got, 0)

    def _run_net(self, node: Node, net, arrays: list, digests: list, idle: frozenset) -> dict:
        """Run a build's network over arrays (in_k), its stages of the `idle` radix passes left out; return its
        outputs."""
        feeds = {f"in_{k}": np.ascontiguousarray(a) for k, a in enumerate(arrays) if a is not None}
        known = {f"in_{k}": d for k, (a, d) in enumerate(zip(arrays, digests)) if d is not None and feeds.get(f"in_{k}") is a}
        try:
            net.launcher.skipped = radix_passes.idle_stages(net, idle)
            return net.run_hashed(feeds, known)
        except ModelError as e:  # (the bundle's checks when its metadata is derived: NanoVDBError)
            raise InputError(f"{node.describe()}: {e} (built on the device: its grid is bound at run time)") from None
        finally:
            net.launcher.skipped = frozenset()

    @staticmethod
    def _outputs(net, got: dict, first: int) -> list[np.ndarray]:
        """The seven bundle arrays out_first.. of a build's run; the blob frozen here, before anyone sees it,
        and known to be in the build's output buffer: a network binding it copies it there on the device,
        not from the host (luisaml/resident.py)."""
        out = [np.ascontiguousarray(got[f"out_{first + k}"]) for k in range(BUNDLE)]
        held = net.launcher.resident_copy(f"out_{first}", out[0])
        if held is not None and checked.freeze(out[0]) is out[0]:  # (not a copy: its memory the download's)
            resident.remember(out[0], *held)
        return out

    def _pair_network(self, node: Node, conv: Node, attrs: dict, conv_attrs: dict, capacity: int, arrays: list):
        """The network of run_pair's two nodes at this capacity (and the ConvGrid's room), compiled once."""
        key = (("pair", node.name, conv.name), capacity, tuple(sorted((k, repr(v)) for k, v in attrs.items())),
               tuple(sorted((k, repr(v)) for k, v in conv_attrs.items())),
               tuple((a.dtype.str, a.shape[1:] if k == 0 else a.shape) if a is not None else None
                     for k, a in enumerate(arrays)))
        return self._network(key, lambda: _build_model(node, attrs, capacity, arrays, (0,),
                                                       then=(conv.name, conv_attrs)))

    def _network(self, key: tuple, make_model):
        """The build network under key, compiled once from make_model() (a later capacity of the same node:
        the same kernels, cached, so no build workers; equal models' networks shared)."""
        net = self.networks.get(key)
        if net is None:
            model = make_model()
            shared = (self.config, hashlib.blake2b(model.SerializeToString(), digest_size=16).digest())
            net = self._shared.get(shared)
            if net is None:
                first = not any(k[0] == key[0] and k[2:] == key[2:] for k in self.networks)
                net = self._shared[shared] = self.compile_model(model, first)
            self.networks[key] = net
        return net

    @staticmethod
    def _too_large(node: Node, operator: type, attrs: dict, capacity: int) -> bool:
        """Whether the node's device build of this capacity would hold more voxel keys than one holds
        (its scratch is indexed with 32-bit integers): a dilation of a 1M-voxel grid, say."""
        try:
            return operator.keys_for(node.op_type, attrs, capacity) > operator.MAX_KEYS
        except ValueError:
            return False  # (attributes out of range: the device build's own check names them)

    def _on_host(self, node: Node, operator: type, attrs: dict, arrays: list, capacity: int) -> list[np.ndarray]:
        from ..log import logger

        logger.warning("%s: a grid of %s voxels or points is past what a device build holds; built on the host",
                       node.describe(), f"{capacity:,}")
        bare = Node(node.name, node.op_type, node.domain, node.inputs, node.outputs)
        bare.attrs = dict(attrs)  # (a dilation pass's)
        return on_host(bare, operator, arrays)


def _bucket(count: int) -> int:
    """The capacity of a device build's network for `count` voxels or points: a power of two, at least
    MIN_CAPACITY."""
    capacity = MIN_CAPACITY
    while capacity < count:
        capacity *= 2
    return capacity


def _points_checked(node: Node, arrays: list, digests: list) -> tuple[list, int]:
    """Return (a GridBatchFrom*'s inputs as its device build takes them: jidx not read, the device reads the
    grids off joffsets; the points' count), after checking joffsets against jdata (InputError naming the
    node). digests' entry of jidx is dropped with it."""
    jdata, offsets = np.asarray(arrays[0]), np.asarray(arrays[1]).reshape(-1)
    n = len(jdata)
    if offsets.dtype != np.int64 or len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != n \
            or (np.diff(offsets) < 0).any():
        raise InputError(f"{node.describe()}: joffsets must be int64 [B + 1] rising from 0 to {n} (the rows of "
                         f"jdata), got {offsets.tolist() if len(offsets) <= 8 else shape_str(offsets.shape)}")
    arrays = list(arrays)
    arrays[2], digests[2] = np.zeros(0, np.int32), None
    return arrays, n


def _points_transforms(arrays: list) -> tuple[np.ndarray, np.ndarray]:
    """The voxel sizes and origins of a GridBatchFrom*'s grids as the host's doubles (the kernels compute in
    float32)."""
    from . import topology as T

    grids = len(np.asarray(arrays[1]).reshape(-1)) - 1
    sizes, origins = (arrays[k] if len(arrays) > k and arrays[k] is not None else None for k in (4, 5))
    return (T.per_grid(1.0 if sizes is None else sizes, grids, "voxel_sizes", True).astype(np.float64),
            T.per_grid(0.0 if origins is None else origins, grids, "origins", False).astype(np.float64))


def _walked(source: list):
    """checked.walked over the source bundle (six arrays) after checking it in full (bundle_grids' walk),
    or nothing where that check fails or cannot run: the network's own checks then name the fault, as
    without this."""
    from ..operators.fvdb.common import bundle_grids

    if any(not isinstance(a, np.ndarray) for a in source):
        return contextlib.nullcontext()
    count: list[int] = []
    try:
        grids = bundle_grids(*source, check_count=count.append)  # (told the blob's grid count)
    except (LuisamlError, ValueError, TypeError, IndexError):
        return contextlib.nullcontext()
    return checked.walked(source, grids, count[0])


def on_host(node: Node, operator: type, arrays: list) -> list[np.ndarray]:
    """Return the bundle arrays the node (of operator class `operator`) builds from arrays with the
    project's builder (the code that folds it over constants: the class's evaluate)."""
    try:
        return operator.evaluate(node, arrays)
    except LimitError:
        raise  # (it names the node and the limit already)
    except LuisamlError as e:  # (the builder's messages name the node: a CompileError when folding)
        raise InputError(f"{e} (run on the host: its grid is bound at run time)") from None


_BOUND_ROWS = (0, 4, 6, 7)  # grid_blob, leaf_batch_indices, list_indices, mask: any number of rows


def _build_model(node: Node, attrs: dict, capacity: int, arrays: list, bound: tuple,
                 then: tuple | None = None) -> onnx.ModelProto:
    """The model of node alone over inputs in_k (rows bound at run time where `bound` says) and
    outputs out_k, with the attribute voxel_capacity; then: (a name, attributes) of a second node of node's
    op over the same inputs, with those attributes too, its outputs out_{7 + k} (DeviceBuilds.run_pair)."""
    inputs = []
    for k, a in enumerate(arrays):
        if a is None:
            continue
        dims = [f"rows of in_{k}"] + list(a.shape[1:]) if k in bound else list(a.shape)
        inputs.append(helper.make_tensor_value_info(f"in_{k}", dtypes.from_numpy(a.dtype).onnx, dims))
    names = [f"in_{k}" if a is not None else "" for k, a in enumerate(arrays)]
    outputs = [f"out_{k}" for k in range(BUNDLE)]
    nodes = [helper.make_node(node.op_type, names, outputs, name=node.name, domain=DOMAIN,
                              **{**attrs, CAPACITY: capacity})]
    if then is not None:
        more = [f"out_{BUNDLE + k}" for k in range(BUNDLE)]
        nodes.append(helper.make_node(node.op_type, names, more, name=then[0], domain=DOMAIN,
                                      **{**attrs, **then[1], CAPACITY: capacity}))
        outputs += more
    g = helper.make_graph(nodes, f"{node.name} on the device", inputs, [onnx.ValueInfoProto(name=o) for o in outputs])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])


@dataclass
class HostSteps:
    """The host steps of a network, in graph order, and the graph inputs only they read."""

    steps: list[HostStep]
    host_only: list[HostInput]  # graph inputs no compiled node reads
    made: dict[str, str]  # each step output the network reads -> the describe() of its node
    device: DeviceBuilds | None = None  # where the topology steps build on the device (else the host)
    _tensors: dict = field(default_factory=dict, repr=False)  # (output, torch device) -> (array, its tensor)
    _copies: dict = field(default_factory=dict, repr=False)  # torch input -> (its clone, host copy, token)
    _paired: dict | None = field(default=None, repr=False)  # _pairs(), found once

    def inputs(self, compiled: list) -> list:
        """Return the network's inputs as a user feeds them (IOSpecs): the compiled network's inputs
        (`compiled`) but the grids the steps build, and the inputs only the steps read."""
        from ..plan import IOSpec

        host = [IOSpec(h.name, "", h.dtype, h.shape, tuple(d if isinstance(d, int) else 0 for d in h.shape), False,
                       rows=h.shape[0] if h.shape and not isinstance(h.shape[0], int) else None)
                for h in self.host_only]
        return [s for s in compiled if s.name not in self.made] + host

    def describe(self) -> list[str]:
        """One line a step, for inspect."""
        def where(s: HostStep) -> str:
            return "on the device" if self.device is not None else "on the host"
        return [f"{s.node.describe()} {where(s)} when its inputs change -> "
                + ", ".join(o for o in s.node.outputs if o in self.made) for s in self.steps]

    def complete(self, feeds: Mapping[str, Any], specs: Mapping[str, Any], digest, remember=None,
                 token=None) -> dict[str, Any]:
        """Return the feeds of the compiled network: these feeds without the inputs only the steps
        read, plus every step output it reads (torch tensors on the feeds' device when the feeds
        are torch tensors). specs: the compiled network's input specs by name, which check the
        steps' inputs that compiled nodes also read; digest(name, array): a hash of its bytes;
        remember(array, digest) (optional): told the digest standing for each numpy step output, so
        that the run does not hash what the steps made; token(name, array) (optional): a digest that
        stands for a large frozen input's bytes unread, taken where no step's cache holds an input of its
        dtype and shape (`_unseen`): a detector's new cloud of points every frame is not hashed."""
        given = [k for k in feeds if k in self.made]
        if given:
            raise InputNameError(f"input '{given[0]}' is not an input: {self.made[given[0]]} computes it before the kernels "
                                 "from the grid it reads")
        host_only = {h.name: h for h in self.host_only}
        values: dict[str, np.ndarray] = {}
        digests: dict[str, bytes] = {}
        for step in self.steps:
            for name in step.node.inputs:
                if not name or name in step.constants or name in values:
                    continue
                if name not in feeds:
                    raise InputNameError(f"missing input '{name}' ({step.node.describe()} reads it)")
                a, digests[name] = self._host_array(name, feeds[name], self._digest_of(digest, token))
                check = host_only.get(name)
                if check is not None:
                    check.check(a)
                elif name in specs:
                    _check_spec(specs[name], a)
                values[name] = a
            result, key = step.run(values, digests, self.device, self._pairs().get(id(step)))
            values.update(result)
            # (a later step reading these: they follow from this computation's key, never hashed; from
            # the op and its inputs' bytes, not the network's names, so that a step of another network
            # fed by the same computation finds its latest result: a detector's B after its A)
            origin = hashlib.blake2b(repr((step._op(None), key)).encode(), digest_size=16).digest()
            digests.update({name: origin + bytes([j]) for j, name in enumerate(step.node.outputs) if name in result})
        out = {k: v for k, v in feeds.items() if k not in host_only}
        device = next((v.device for v in feeds.values() if is_torch(v)), None)
        for name in self.made:
            a = values[name]
            if device is not None:  # the same result again is the same tensor (no copy to the device)
                cached = self._tensors.get((name, str(device)))
                if cached is None or cached[0] is not a:
                    import torch

                    cached = (a, torch.from_numpy(np.array(a)).to(device))
                    self._tensors[(name, str(device))] = cached
                a = cached[1]
            elif remember is not None:
                remember(a, digests[name])
            out[name] = a
        return out

    def _pairs(self) -> dict[int, HostStep]:
        """{id of a GridBatchFromPoints step: the ConvGrid step of its grid} where the steps build on the
        device: the two built in one network run (DeviceBuilds.run_pair). A ConvGrid whose source bundle is
        exactly the points step's seven outputs (no mask, no constant among them)."""
        if self.device is None or not self.device.PAIRS:
            return {}
        pairs = self._paired
        if pairs is None:
            pairs = {}
            for k, step in enumerate(self.steps):
                outs = step.node.outputs[:BUNDLE]
                if step.node.op_type != "GridBatchFromPoints" or len(outs) < BUNDLE or not all(outs):
                    continue
                conv = next((s for s in self.steps[k + 1:] if s.node.op_type == "ConvGrid"
                             and list(s.node.inputs) == list(outs) and not s.constants), None)
                if conv is not None:
                    pairs[id(step)] = conv
            self._paired = pairs
        return pairs

    def _digest_of(self, digest, token):
        """digest, or where token is given, a function that gives a large frozen input (read-only: it keeps
        its token while it lives, so binding it again still finds the step's result) whose dtype and shape
        no step's cache has seen token's digest instead (the bytes unread). A writeable array is hashed: a
        token would make its next binding, of the same bytes, build again."""
        if token is None:
            return digest

        def pick(name: str, a: np.ndarray) -> bytes:
            unread = a.nbytes >= UNREAD_BYTES and checked.frozen(a) and self._unseen(name, a)
            return token(name, a) if unread else digest(name, a)
        return pick

    def _unseen(self, name: str, a: np.ndarray) -> bool:
        """Whether no step reading `name` holds a result (its own last, or its op's latest in the process:
        _LIVE) of an input there of a's dtype and shape: no cache can answer for a, whatever its bytes."""
        where = None if self.device is None else (self.device.config,)
        for step in self.steps:
            for k, n in enumerate(step.node.inputs):
                if n != name or n in step.constants:
                    continue
                latest = step._latest_of(where)
                for held in (step._last, latest.value):
                    if held is not None and held[0][k] is not None and held[0][k][:2] == (a.dtype.str, a.shape):
                        return False
        return True

    def _host_array(self, name: str, x, digest) -> tuple[np.ndarray, bytes]:
        """Return (input x as a host array, its digest). A torch tensor equal (compared where it
        lives) to the one the last run copied gives that copy back, and one that changed gets a
        token never used before: a grid bound again on the GPU is neither copied nor hashed."""
        if not is_torch(x):
            a = np.asarray(to_numpy(x, name))
            return a, digest(name, a)
        t = x.detach()
        last = self._copies.get(name)
        if same_tensor(last[0] if last else None, t):
            return last[1], last[2]
        a = np.array(to_numpy(t, name), copy=True)
        token = b"host step " + next(_TOKENS).to_bytes(8, "little")
        self._copies[name] = (t.clone(), a, token)
        return a, token


_TOKENS = itertools.count()  # the digests of torch inputs that changed since the last run
UNREAD_BYTES = 256 << 10  # a frozen step input this large whose dtype and shape no step's cache holds: not hashed


def _check_spec(spec, a: np.ndarray) -> None:
    """Check a step's input against the compiled network's spec of it (dtype, and every dimension
    but rows bound at run time)."""
    if a.dtype != spec.dtype.numpy:
        raise InputTypeError(f"input '{spec.name}': expected dtype {spec.dtype.numpy}, got {a.dtype}")
    fixed = spec.shape[1:] if spec.rows is not None else spec.shape
    got = a.shape[1:] if spec.rows is not None else a.shape
    if a.ndim != len(spec.shape) or any(isinstance(d, int) and d != n for d, n in zip(fixed, got)):
        raise InputError(f"input '{spec.name}': expected shape {shape_str(spec.shape)}, got {shape_str(a.shape)}")


# ---- the pass -------------------------------------------------------------------------------


def _dims(vi: onnx.ValueInfoProto) -> tuple:
    return tuple(int(d.dim_value) if d.HasField("dim_value") else (d.dim_param or None)
                 for d in vi.type.tensor_type.shape.dim)


def split(proto: onnx.ModelProto, operators) -> HostSteps | None:
    """Take the grid ops that must run before the kernels out of proto (module docstring); return them,
    or None when there are none. proto is modified; operators: the model's Binding (luisaml.registry),
    which gives each step its operator class."""
    g = proto.graph
    init = {t.name: t for t in g.initializer}
    constants = set(init)  # (Constant nodes' outputs too; their values read when a step needs them)
    constant_nodes = {}
    for n in g.node:
        if n.op_type == "Constant" and n.domain in ("", "ai.onnx"):
            for a in n.attribute:
                if a.name == "value" and a.type == onnx.AttributeProto.TENSOR:
                    constants.add(n.output[0])
                    constant_nodes[n.output[0]] = a.t
    inputs = {vi.name: vi for vi in g.input if vi.name not in init}
    shapes = {name: _dims(vi) for name, vi in inputs.items()}
    readers: dict[str, list] = {}
    for n in g.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    outputs = {o.name for o in g.output}
    chosen, made, elems = [], {}, {}
    computed: dict[str, onnx.NodeProto] = {}  # tensors the kernels compute from run-time data -> their node
    for k, n in enumerate(g.node):
        ins = [i for i in n.input if i]
        if n.domain != DOMAIN or n.op_type not in grid_schema.GRID_OPS or any(a.name == CAPACITY for a in n.attribute):
            if any(i in inputs or i in made or i in computed for i in ins):
                computed.update({o: n for o in n.output if o})
            continue
        late = [i for i in ins if i in computed]
        if late and any(i in inputs or i in made for i in ins):
            p = computed[late[0]]
            raise ModelError(
                f"node '{n.name or n.op_type}' ({DOMAIN}::{n.op_type}): input '{late[0]}' is computed by the kernels "
                f"(node '{p.name or p.op_type}' ({p.op_type})), but the grid this node reads is bound at run time, so the "
                "node runs on the host before the kernels: its inputs must be graph inputs, constants or grids that "
                "other such nodes build")
        if all(i in constants for i in ins) or not all(i in constants or i in inputs or i in made for i in ins):
            if late:
                computed.update({o: n for o in n.output if o})
            continue  # folds when compiled, or reads a tensor the kernels compute (the op's own error)
        if not _from_grid(n.op_type) and not _needs_host(n, shapes, readers):
            continue  # the device builder takes it (a fixed number of points, its grid a graph output)
        node = Node(n.name or f"{n.op_type}_{k}", n.op_type, DOMAIN, list(n.input), list(n.output))
        node.attrs = {a.name: _attr_value(a, None, node.describe()) for a in n.attribute}  # (as model_from_proto reads them)
        values = {i: numpy_helper.to_array(init[i] if i in init else constant_nodes[i]) for i in ins if i in constants}
        grids, plus_one = _grid_count(node, shapes)
        counted = _counted(node) if not isinstance(grids, int) else None
        chosen.append((n, HostStep(node, operators(n.op_type, DOMAIN), values, counted)))
        for j, name in enumerate(n.output):
            if not name:
                continue
            part = schema.BUNDLE[j]
            dims = {"grid_blob": (f"rows of {name}",), "grid_byte_offsets": (grids,), "voxel_sizes": (grids, 3),
                    "origins": (grids, 3), "leaf_batch_indices": (f"rows of {name}",), "batch_offsets": (plus_one,),
                    "list_indices": (f"rows of {name}",)}[part]
            shapes[name] = dims
            elems[name] = schema.BUNDLE_ELEM[j]
            made[name] = node.describe()
    if not chosen:
        return None
    removed = {id(n) for n, _ in chosen}
    kept = [n for n in g.node if id(n) not in removed]
    read = {i for n in kept for i in n.input} | outputs
    host_only = [HostInput(vi.name, _dtype(vi.type.tensor_type.elem_type, vi.name), _dims(vi))
                 for vi in g.input if vi.name in inputs and vi.name not in read]
    del g.node[:]
    g.node.extend(kept)
    keep_inputs = [vi for vi in g.input if not (vi.name in inputs and vi.name not in read)]
    del g.input[:]
    g.input.extend(keep_inputs)
    made = {name: where for name, where in made.items() if name in read}
    for name in made:
        g.input.append(helper.make_tensor_value_info(name, elems[name], list(shapes[name])))
    stale = [vi for vi in g.value_info if vi.name in made]
    for vi in stale:  # (an exporter's shapes of the traced example's grid)
        g.value_info.remove(vi)
    return HostSteps([s for _, s in chosen], host_only, made)


def _from_grid(op_type: str) -> bool:
    """Whether the grid op builds from a grid (the topology ops), not from ijk or points."""
    return grid_schema.GRID_OPS[op_type].inputs[0][0] == "grid_blob"


def _dtype(elem: int, name: str) -> dtypes.DType:
    dt = dtypes.SUPPORTED.get(elem)
    if dt is None:
        raise ModelError(f"input '{name}': element type {elem} is not supported")
    return dt


def _needs_host(n: onnx.NodeProto, shapes: dict, readers: dict) -> bool:
    """Whether a GridBatchFrom* node must be a step (before the kernels, not a stage of theirs): an
    input of dynamic size, or a grid another node reads."""
    dynamic = any(i and any(not isinstance(d, int) for d in shapes.get(i, ())) for i in n.input)
    return dynamic or any(readers.get(o) for o in n.output if o)


def _grid_count(node: Node, shapes: dict) -> tuple[int | str, int | str]:
    """Return the number of grids the node builds and that number + 1 (the rows of its outputs): its
    bundle's (grid_byte_offsets [B]) or its jagged input's (joffsets [B + 1]), numbers when that is
    fixed, else the symbols of a grid count bound at run time (operators/fvdb/grid_count.py: the nodes
    reading the new grid take any count, or the passes name the one that does not)."""
    topology = _from_grid(node.op_type)
    name = node.inputs[1] if len(node.inputs) > 1 else ""
    dims = shapes.get(name)
    what = "grid_byte_offsets" if topology else "joffsets"
    if not dims or len(dims) != 1:
        raise ModelError(f"{node.describe()}: its input '{name}' ({what}) must be 1-D (the number of grids"
                         f"{'' if topology else ' + 1'}), got {shape_str(dims) if dims else 'no shape'}")
    if topology:  # a count bound at run time is the whole bundle's (grid_count.py), or none of it
        from ..operators.fvdb.grid_count import COUNT_INPUTS

        parts = [(part, node.inputs[schema.BUNDLE.index(part)]) for part in COUNT_INPUTS]
        fixed = {isinstance((shapes.get(i) or (0,))[0], int) for _, i in parts}
        if len(fixed) > 1:
            (pa, a), (pb, b) = (next(p for p in parts if isinstance((shapes.get(p[1]) or (0,))[0], int) == f)
                                for f in (False, True))
            raise ModelError(f"{node.describe()}: its input '{a}' ({pa}) has a grid count bound at run time "
                             f"{shape_str(shapes.get(a))}, but '{b}' ({pb}) a fixed one {shape_str(shapes.get(b))}: give "
                             f"{', '.join(COUNT_INPUTS)} a dynamic first dimension (the grid count), or none of them")
    if not isinstance(dims[0], int):  # the grid count bound at run time: the outputs' rows its symbols
        sym = dims[0] or f"grids of {name}"
        if topology:
            offsets = shapes.get(node.inputs[5]) if len(node.inputs) > 5 else None
            other = offsets[0] if offsets and len(offsets) == 1 and isinstance(offsets[0], str) else None
            return sym, other if other and other != sym else f"{sym} + 1"
        return f"{sym} - 1", sym
    count = dims[0] if topology else dims[0] - 1
    if count < 1 or count > _max_grids():
        raise ModelError(f"{node.describe()}: {count} grids; a bundle holds 1 to {_max_grids()}")
    return count, count + 1


def _counted(node: Node) -> tuple[str, ...] | None:
    """The graph names of grid_blob and the count inputs (grid_count.COUNT_INPUTS' order) of a topology
    node whose grid count is bound at run time, which its step checks against the blob; None for a
    GridBatchFrom* (its joffsets give the count)."""
    from ..operators.fvdb.grid_count import COUNT_INPUTS

    if not _from_grid(node.op_type):
        return None
    return tuple(node.inputs[k] for k in (0,) + tuple(schema.BUNDLE.index(n) for n in COUNT_INPUTS))


def _max_grids() -> int:
    from .grid_batch import MAX_GRIDS_PER_BATCH

    return MAX_GRIDS_PER_BATCH
