"""The topology ops (CoarsenedGrid, RefinedGrid, DilatedGrid, PrunedGrid, ConvGrid, ConvTransposeGrid)
built on the device over a grid bound at run time: the device grid build of topology.py, its voxel
keys read from the source grid.

Over constants they fold on the host (topology.GridOp). Over a grid bound at run time,
luisaml/fvdb/host_steps.py cuts the node out of the model and runs it, when a run binds a new grid, as a
network of its own: the node alone, with the attribute `voxel_capacity` V (the source voxels the
network takes, a power of two), compiled once per V. That node builds here, as DeviceGridBuild's
phases with one phase changed: "voxel keys" runs a thread per source voxel, which finds the voxel's
ijk in the source blob (the grid whose batch range holds it, the leaf whose index range holds it,
the bit of its rank), forms the op's candidate voxels (`Candidates`) and appends those that exist
to the key list with an atomic counter: the table word the later phases read as the key count
(`Scratch.keys`, operators/fvdb/build_scratch.py). The phases after it are the builder's, so the bytes are the host builder's; the
candidates' order varies from run to run, the grids do not (leaves are deduplicated, then sorted).

Scratch is sized for V times the candidates per voxel (coarsening and pruning 1, ConvGrid whose
kernel fits its stride 1, refinement f^3, dilation 27 a pass, ConvTransposeGrid the kernel's taps,
ConvGrid the taps that can divide: ceil(k_a / s_a) along each axis, 8 for a 3/2 kernel where every
tap was a candidate before, issue 28): about 79 int words a key.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from luisaml import dtypes
from luisaml.dynamic import Phase
from luisaml.fvdb import topology as T
from luisaml.fvdb.sparse_conv import conv_geometry
from luisaml.operator import Derived
from luisaml.opsets import fvdb as schema
from luisaml.opsets import fvdb_grids as grid_schema
from luisaml.registry import register
from luisaml.shaders import grid_layout as G

from .build_scratch import Scratch
from .common import META_FIELDS, GridOp as BundleOp, Meta, grid_metadata, voxel_of_index
from .topology import (BUNDLE, CAPACITY, TRANSFORM_WORDS, DeviceGridBuild, GridOp, grid_transforms,
                       runtime_bundle)

OPS = ("CoarsenedGrid", "RefinedGrid", "DilatedGrid", "PrunedGrid", "ConvGrid", "ConvTransposeGrid")
_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1


@dataclass(frozen=True)
class Candidates:
    """The candidate voxels of a source voxel c, t = (t0 * n1 + t1) * n2 + t2 for 0 <= t_a < n_a:
    x_a = c_a * scale_a + base_a + step_a * t_a, the voxel floor(x_a / div_a) where every remainder
    x_a mod div_a is below keep_a."""

    n: tuple[int, int, int]
    scale: tuple[int, int, int] = (1, 1, 1)
    base: tuple[int, int, int] = (0, 0, 0)
    step: tuple[int, int, int] = (0, 0, 0)
    div: tuple[int, int, int] = (1, 1, 1)
    keep: tuple[int, int, int] = (1, 1, 1)

    def __post_init__(self):
        for a in range(3):  # the strided form (step -1, exact division) is the only one with div > 1 over n > 1
            if self.n[a] > 1 and self.div[a] > 1 and (self.step[a] != -1 or self.keep[a] != 1):
                raise ValueError(f"no candidate form for n {self.n}, step {self.step}, div {self.div}, keep {self.keep}")

    def strided(self, a: int) -> bool:
        """Whether axis a divides exactly over n > 1 taps: of the taps t, only those with
        t = (c_a * scale_a + base_a) mod div_a + div_a * u can divide, at most ceil(n_a / div_a) of them."""
        return self.n[a] > 1 and self.div[a] > 1

    @property
    def m(self) -> tuple[int, int, int]:
        """The candidates a source voxel can have along each axis: n_a, or ceil(n_a / div_a) where strided."""
        return tuple(-(-self.n[a] // self.div[a]) if self.strided(a) else self.n[a] for a in range(3))

    @property
    def count(self) -> int:
        """The candidate keys a source voxel emits at most (the scratch holds V times this)."""
        return int(np.prod(self.m))

    def bounds(self, a: int) -> tuple[int, int]:
        """The source coordinates c_a for which every x_a fits int32."""
        ends = (self.base[a], self.base[a] + self.step[a] * (self.n[a] - 1))
        return -((_I32_MAX + 1 + min(ends)) // self.scale[a]), (_I32_MAX - max(ends)) // self.scale[a]


def _ints(v) -> tuple[int, int, int]:
    return tuple(int(x) for x in v)


def candidates(op_type: str, attrs: dict) -> Candidates:
    """The candidates of fVDB's op (luisaml/fvdb/topology.py has the host's form of each); raise
    ValueError for attributes out of range. DilatedGrid is one pass (dilation 0 or 1): the runner
    repeats it."""
    one = (1, 1, 1)
    if op_type == "CoarsenedGrid":
        f = _ints(T.factor3(attrs.get("coarsening_factor", ()), "coarsening_factor"))
        return Candidates(one, div=f, keep=f)
    if op_type == "RefinedGrid":
        f = _ints(T.factor3(attrs.get("subdiv_factor", ()), "subdiv_factor"))
        return Candidates(f, scale=f, step=one)
    if op_type == "DilatedGrid":
        d = int(attrs.get("dilation", 1))
        if d not in (0, 1):
            raise ValueError(f"a device pass dilates by 0 or 1, got {d}")
        return Candidates((2 * d + 1,) * 3, base=(-d,) * 3, step=one)
    if op_type == "PrunedGrid":
        return Candidates(one)
    geo = conv_geometry(attrs.get("kernel_size", ()), attrs.get("stride", 1))
    K, S, P = geo.kernel, geo.stride, geo.padding
    if op_type == "ConvGrid":
        if all(k <= s for k, s in zip(K, S)):  # one tap a voxel divides: its parent floor((f + P) / S)
            return Candidates(one, base=_ints(P), div=_ints(S), keep=_ints(K))
        # c = (f - (t - P)) / S wherever that divides
        return Candidates(_ints(K), base=_ints(P), step=(-1, -1, -1), div=_ints(S))
    return Candidates(_ints(K), scale=_ints(S), base=_ints(-p for p in P), step=one)  # f = S*c + t - P


def topology_transforms(voxel_sizes, origins, *, grids: int, op: str, attrs: tuple) -> np.ndarray:
    """grid_transforms of the new grids: the source's voxel sizes and origins through the op's rule."""
    h, o = T.new_transforms(op, dict(attrs), np.asarray(voxel_sizes, np.float64).reshape(-1, 3),
                            np.asarray(origins, np.float64).reshape(-1, 3))
    return grid_transforms(h, o, grids=grids, has=(True, True))


def source_metadata(*arrays, capacity: int) -> np.ndarray:
    """grid_metadata of the source bundle (the first six arrays; a mask after them is checked to
    hold a row per voxel), its voxels checked against the network's capacity."""
    from luisaml.errors import InputError

    rows = int(np.shape(arrays[6])[0]) if len(arrays) > 6 else None
    meta = grid_metadata(*arrays[:6], expect_voxels=rows)
    total = int(meta[:, Meta.VOXEL_COUNT].sum())
    if total > capacity:
        raise InputError(f"the grid has {total:,} voxels; this network takes at most {capacity:,} "
                         "(luisaml/fvdb/host_steps.py compiles one per power of two)")
    return meta


class DeviceTopology(DeviceGridBuild):
    """A topology op: folds over constants (GridOp); with `voxel_capacity`, built on the device over a
    grid bound at run time (module docstring)."""

    OPS = OPS
    check_bundle = BundleOp.check_bundle  # (the query ops' bundle checks: they need only expect*, input)

    @classmethod
    def infer(cls, node, inputs):
        offsets = inputs[1] if len(inputs) > 1 else None
        if CAPACITY not in node.attrs or offsets is None or offsets.shape is None or len(offsets.shape) != 1 \
                or not isinstance(offsets.shape[0], int):
            return GridOp.infer.__func__(cls, node, inputs)  # folds (or stays untyped: the op's error)
        return runtime_bundle(int(offsets.shape[0]))

    @classmethod
    def keys_for(cls, op_type: str, attrs: dict, capacity: int) -> int:
        return capacity * candidates(op_type, attrs).count

    @classmethod
    def reads_bound_rows(cls, op_type: str, k: int) -> bool:
        return k == BUNDLE or (k < BUNDLE and schema.BUNDLE[k] in ("grid_blob", "leaf_batch_indices", "list_indices"))

    def check(self):
        if CAPACITY not in self.node.attrs:
            return GridOp.check(self)
        spec = grid_schema.GRID_OPS[self.node.op_type]
        self.expect(BUNDLE <= len(self.inputs) <= len(spec.inputs),
                    f"takes {', '.join(spec.input_names())}, got {len(self.inputs)} inputs")
        self.B = self.check_bundle()
        self.mask = self.input(BUNDLE) if self.has_input(BUNDLE) else None
        self.expect(self.mask is not None or self.node.op_type != "PrunedGrid", "takes a mask (input 7)")
        if self.mask is not None:
            self.expect_dtype(self.mask, ("BOOL",), "mask")
            self.expect(self.mask.rank == 1 and not self.mask.batched,
                        f"mask '{self.mask.name}' must be [N] (one entry per voxel)")
        V = self.node.attrs[CAPACITY]
        self.expect(isinstance(V, int) and V >= 1, f"{CAPACITY} must be a positive integer, got {V!r}")
        try:
            self.cand = candidates(self.node.op_type, self.node.attrs)
        except ValueError as e:
            raise self.error(str(e)) from None
        self.V, self.N, self.K = V, V, V * self.cand.count
        self.expect(self.K <= self.MAX_KEYS, f"{V:,} voxels of {self.cand.count} candidates each exceed the "
                    f"{self.MAX_KEYS:,} candidate voxels a device build holds")
        self.check_outputs()
        self.points = self.nearest = False
        self.S = Scratch(self.K, self.B)

    def derived_inputs(self):
        if CAPACITY not in self.node.attrs:
            return []
        attrs = tuple(sorted((k, tuple(v) if isinstance(v, (list, tuple)) else v) for k, v in self.node.attrs.items()
                             if k != CAPACITY))
        sources = tuple(range(6)) + ((BUNDLE,) if self.mask is not None else ())
        return [Derived(topology_transforms, (2, 3), dtypes.INT32, (self.B, TRANSFORM_WORDS),
                        (("grids", self.B), ("op", self.node.op_type), ("attrs", attrs))),
                Derived(source_metadata, sources, dtypes.INT32, (self.B, META_FIELDS), (("capacity", self.V),),
                        shape_only=(BUNDLE,) if self.mask is not None else ())]

    def describe(self):
        return (f"{self.node.op_type} built on the device over a grid bound at run time (up to {self.V:,} voxels, "
                f"{self.cand.count} candidate voxel(s) each) into {self.B} grid(s): hash, radix sort, nodes, "
                f"{self.layout_said}, write")

    def coords_error(self) -> str:
        return "a new voxel's coordinates do not fit int32"

    def phases(self):
        out = super().phases()
        k = next(k for k, p in enumerate(out) if p.name == "voxel keys")
        out[k] = Phase("voxel keys", max(self.V, 1), self._emit_source_keys)
        return out

    def _emit_clear(self, ctx, t) -> None:
        super()._emit_clear(ctx, t)
        ctx.line(f"if {t} == 0:")  # the keys phase counts its keys up from 0
        with ctx.indent():
            ctx.line(f"scratch_int.write({self.S.keys.at}, 0)")

    def _emit_source_keys(self, ctx, v) -> None:
        """Source voxel v: its grid b, leaf and ijk c, then each candidate that exists appended."""
        meta, B, F, S, cand = self.derived[1], self.B, META_FIELDS, self.S, self.cand
        last = (B - 1) * F
        total = f"({meta.load(str(last + int(Meta.VOXEL_OFFSET)))} + {meta.load(str(last + int(Meta.VOXEL_COUNT)))})"
        ctx.line(f"if {v} < {total}" + (f" and {self.mask.load(v)}:" if self.mask is not None else ":"))
        with ctx.indent():
            b, _, c = voxel_of_index(ctx, meta, B, *self.input(0).storage.byte_address(), v)
            guards = [f"{c[a]} < {lo}" if lo > _I32_MIN else "" for a, (lo, _) in enumerate(map(cand.bounds, range(3)))]
            guards += [f"{c[a]} > {hi}" if hi < _I32_MAX else "" for a, (_, hi) in enumerate(map(cand.bounds, range(3)))]
            guards = [g for g in guards if g]
            if guards:
                ctx.line(f"if {' or '.join(guards)}:")
                with ctx.indent():
                    ctx.line(f"{ctx.use_helper('gb_error', 'grid_build')}(scratch_int, {S.ctr}, {G.ERR_COORDS})")
            self._emit_candidates(ctx, b, c)

    def _emit_candidates(self, ctx, b: str, c: list[str]) -> None:
        """Candidate u = (u0 * m1 + u1) * m2 + u2 (Candidates.m). Along a strided axis (exact division,
        step -1) it is the tap t = r + div * u_a, r = y mod div of y = c_a * scale + base, where t < n:
        the voxel (y - t) / div = floor(y / div) - u_a; along any other axis the tap t = u_a as written."""
        cand, S = self.cand, self.S
        fdiv = ctx.use_helper("floor_div", "nanovdb")
        append = ctx.use_helper("gb_append_voxel", "grid_build")
        m0, m1, m2 = cand.m
        with ctx.loop(cand.count, "t") as t:
            parts = [f"{t} // {m1 * m2}", f"({t} // {m2}) % {m1}", f"{t} % {m2}"]
            q, keep = [], []
            for a in range(3):
                x = c[a] if cand.scale[a] == 1 else f"{c[a]} * {cand.scale[a]}"
                if cand.base[a]:
                    x = f"{x} + {cand.base[a]}"
                if cand.strided(a):
                    y = ctx.let(f"({x})", "y")
                    q0 = ctx.let(f"{fdiv}({y}, {cand.div[a]})", "q")
                    u = ctx.let(f"({parts[a]})", "u")
                    q.append(ctx.let(f"({q0} - {u})", "q"))
                    if cand.div[a] * cand.m[a] > cand.n[a]:  # some remainders leave the last u past the kernel
                        keep.append(f"{y} - {q0} * {cand.div[a]} + {cand.div[a]} * {u} < {cand.n[a]}")
                    continue
                if cand.n[a] > 1 and cand.step[a]:
                    x = f"{x} + {cand.step[a]} * ({parts[a]})"
                x = ctx.let(f"({x})", "x")
                if cand.div[a] == 1:
                    q.append(x)
                    continue
                q.append(ctx.let(f"{fdiv}({x}, {cand.div[a]})", "q"))
                if cand.keep[a] < cand.div[a]:
                    keep.append(f"{x} - {q[a]} * {cand.div[a]} < {cand.keep[a]}")
            if keep:
                ctx.line(f"if {' and '.join(keep)}:")
                with ctx.indent():
                    ctx.line(f"{append}(scratch_int, {S.vox}, {S.keys.at}, {b}, {q[0]}, {q[1]}, {q[2]})")
            else:
                ctx.line(f"{append}(scratch_int, {S.vox}, {S.keys.at}, {b}, {q[0]}, {q[1]}, {q[2]})")

for _name in OPS:
    register(_name, domain="fvdb", since=1)(type(_name, (DeviceTopology,), {"__doc__": grid_schema.GRID_OPS[_name].doc}))
