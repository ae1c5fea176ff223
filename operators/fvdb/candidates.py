"""The candidate voxels of a topology op: which voxels of the new grid one voxel of the source grid can
make (`Candidates`, `candidates`), and their emission into a device build's key list (`emit_candidates`):
topology_device.py's keys phase over a source grid's voxels, and topology.py's over points (a ConvGrid of
the grid the points make, built with it: luisaml/fvdb/host_steps.py's pair of builds)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from luisaml.fvdb import topology as T
from luisaml.fvdb.sparse_conv import conv_geometry
from luisaml.shaders import grid_layout as G

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


def emit_candidates(ctx, cand: "Candidates", S, b: str, c: list[str], room: int | None = None) -> None:
    """Candidate u = (u0 * m1 + u1) * m2 + u2 (Candidates.m). Along a strided axis (exact division,
    step -1) it is the tap t = r + div * u_a, r = y mod div of y = c_a * scale + base, where t < n:
    the voxel (y - t) / div = floor(y / div) - u_a; along any other axis the tap t = u_a as written.
    room: the keys the scratch holds where fewer than every candidate's (None): a key past it is counted,
    not written (the build's host step reads the count and runs again with room)."""
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
                _append(ctx, append, S, b, q, room)
        else:
            _append(ctx, append, S, b, q, room)


def _append(ctx, append: str, S, b: str, q: list[str], room: int | None) -> None:
    if room is None:
        ctx.line(f"{append}(scratch_int, {S.vox}, {S.keys.at}, {b}, {q[0]}, {q[1]}, {q[2]})")
        return
    k = ctx.let(f"scratch_int.atomic_fetch_add({S.keys.at}, 1)", "k")
    ctx.line(f"if {k} < {room}:")
    with ctx.indent():
        for a, v in enumerate([b] + list(q)):
            ctx.line(f"scratch_int.write({S.vox} + 4 * {k} + {a}, {v})")


def emit_source_voxel(ctx, cand: "Candidates", S, b: str, c: list[str], room: int | None = None) -> None:
    """Source voxel c (ijk names) of grid b: its candidates that exist appended to the keys (S: the build's
    Scratch; room: emit_candidates'); a source voxel whose candidates' coordinates would pass int32 flags
    ERR_COORDS."""
    guards = [f"{c[a]} < {lo}" if lo > _I32_MIN else "" for a, (lo, _) in enumerate(map(cand.bounds, range(3)))]
    guards += [f"{c[a]} > {hi}" if hi < _I32_MAX else "" for a, (_, hi) in enumerate(map(cand.bounds, range(3)))]
    guards = [g for g in guards if g]
    if guards:
        ctx.line(f"if {' or '.join(guards)}:")
        with ctx.indent():
            ctx.line(f"{ctx.use_helper('gb_error', 'grid_build')}(scratch_int, {S.ctr}, {G.ERR_COORDS})")
    emit_candidates(ctx, cand, S, b, c, room)
