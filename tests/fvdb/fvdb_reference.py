"""A numpy reference of fVDB's per-point ops, written from fVDB's sources (shared/reference/fvdb-ops.md):
the float32 arithmetic of its CPU path, with C++'s promotions where fVDB mixes in double literals.
Voxel lookups use the host reader (luisaml.fvdb.ijk_to_index), which tests/fvdb checks against warp.
Sparse convolution is written from section 5's relation alone, with loops over ijk dictionaries.
Also: model builders for fvdb.* nodes."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from luisaml.fvdb import GridBatch, JaggedTensor, ijk_to_index
from luisaml.opsets import fvdb as schema
from luisaml.opsets import fvdb_dense, fvdb_grids, fvdb_rays  # noqa: F401 (fvdb_grids: its schemas, for shape inference)

F32 = np.float32

# fVDB's corner order (utils/TrilinearStencil.h)
CORNERS = [(0, 0, 0), (0, 0, 1), (0, 1, 1), (0, 1, 0), (1, 0, 0), (1, 0, 1), (1, 1, 1), (1, 1, 0)]


def grid_ids(points: JaggedTensor) -> np.ndarray:
    """Return each element's tensor id (fVDB's jidx; all 0 when jidx is empty)."""
    return points.jidx.astype(np.int64) if points.jidx.size else np.zeros(len(points.jdata), np.int64)


def transform32(gb: GridBatch) -> tuple[np.ndarray, np.ndarray]:
    """fVDB's VoxelCoordTransform in float32: scale = float(1/h), translate = float(-o/h) (double math)."""
    return (1.0 / gb.voxel_sizes).astype(F32), (-gb.origins / gb.voxel_sizes).astype(F32)


def world_to_voxel(gb: GridBatch, points: JaggedTensor) -> np.ndarray:
    """x * s + t in float32 per point, with the point's grid."""
    s, t = transform32(gb)
    b = grid_ids(points)
    return (points.jdata.astype(F32) * s[b]) + t[b]


def voxel_to_world(gb: GridBatch, coords: JaggedTensor) -> np.ndarray:
    """(x - t) / s in float32 per point."""
    s, t = transform32(gb)
    b = grid_ids(coords)
    return (coords.jdata.astype(F32) - t[b]) / s[b]


def lookup(gb: GridBatch, ijk: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Return the batch-global index (int64) of each ijk in grid b[n], -1 where inactive."""
    out = np.full(len(ijk), -1, np.int64)
    offsets = gb.batch_offsets
    for g in range(gb.grid_count):
        sel = np.flatnonzero(b == g)
        if len(sel):
            idx = ijk_to_index(gb.grids[g], np.asarray(ijk)[sel])
            out[sel] = np.where(idx >= 0, idx + offsets[g], -1)
    return out


def nanovdb_round(x: np.ndarray) -> np.ndarray:
    """NanoVDB's Vec3<float>::round(): Floor(x + 0.5) with the 0.5 a double literal."""
    return np.floor(x.astype(np.float64) + 0.5).astype(np.int64)


def sample_trilinear(gb: GridBatch, points: JaggedTensor, data: np.ndarray) -> np.ndarray:
    """fVDB's SampleTrilinear.cu on the CPU: weights U*V*W (float32), inactive corners weigh 0 and
    read row 0; accumulate in corner order; zero when no corner is active."""
    x = world_to_voxel(gb, points)
    b = grid_ids(points)
    base = np.floor(x)
    u = x - base
    one_minus = F32(1) - u
    d2 = data.reshape(len(data), -1).astype(F32)
    acc = np.zeros((len(x), d2.shape[1]), F32)
    any_active = np.zeros(len(x), bool)
    for di, dj, dk in CORNERS:
        ijk = base.astype(np.int64) + np.array([di, dj, dk])
        idx = lookup(gb, ijk.astype(np.int32), b)
        f = [u[:, a] if d else one_minus[:, a] for a, d in enumerate((di, dj, dk))]
        w = np.where(idx >= 0, (f[0] * f[1]) * f[2], F32(0))
        acc = acc + w[:, None] * d2[np.maximum(idx, 0)]
        any_active |= idx >= 0
    acc[~any_active] = 0
    return acc.reshape((len(x),) + data.shape[1:])


def bezier(t: np.ndarray) -> np.ndarray:
    """fVDB's BezierInterpolationIterator::bezier for float t, with C++'s promotions: the 1.5 literals
    are doubles, `-2 * x * x` stays float."""
    t = t.astype(F32)
    t64 = t.astype(np.float64)
    r1, r2, r3, r4 = t < -1.5, t < -0.5, t < 0.5, t < 1.5
    out = np.zeros(t.shape, F32)
    a = ~r1 & r2
    out[a] = ((t64[a] + 1.5) * (t64[a] + 1.5)).astype(F32)
    c = ~r2 & r3
    out[c] = ((F32(-2) * t[c] * t[c]).astype(np.float64) + 1.5).astype(F32)
    e = ~r3 & r4
    out[e] = ((t64[e] - 1.5) * (t64[e] - 1.5)).astype(F32)
    return out


def bezier_taps(gb: GridBatch, points: JaggedTensor):
    """Yield (global index or -1, float32 weight) of each of the 27 taps (dz fastest) per point."""
    x = world_to_voxel(gb, points)
    b = grid_ids(points)
    c = nanovdb_round(x)
    u = x - c.astype(F32)
    for t in range(27):
        d = np.array([t // 9 - 1, (t // 3) % 3 - 1, t % 3 - 1])
        w = bezier(u[:, 0] - F32(d[0])) * bezier(u[:, 1] - F32(d[1])) * bezier(u[:, 2] - F32(d[2]))
        yield lookup(gb, (c + d).astype(np.int32), b), w


def sample_bezier(gb: GridBatch, points: JaggedTensor, data: np.ndarray) -> np.ndarray:
    """fVDB's SampleBezier.cu: out += w * data[index] over the active taps, in tap order."""
    d2 = data.reshape(len(data), -1).astype(F32)
    acc = np.zeros((len(points.jdata), d2.shape[1]), F32)
    for idx, w in bezier_taps(gb, points):
        on = idx >= 0
        acc[on] = acc[on] + w[on, None] * d2[idx[on]]
    return acc.reshape((len(acc),) + data.shape[1:])


def splat_trilinear(gb: GridBatch, points: JaggedTensor, values: np.ndarray) -> np.ndarray:
    """fVDB's SplatTrilinear.cu: each active corner += w * value (float32 products, summed in float64)."""
    x = world_to_voxel(gb, points)
    b = grid_ids(points)
    base = np.floor(x)
    u = x - base
    one_minus = F32(1) - u
    v2 = values.reshape(len(values), -1).astype(F32)
    out = np.zeros((gb.total_voxels, v2.shape[1]), np.float64)
    for di, dj, dk in CORNERS:
        idx = lookup(gb, (base.astype(np.int64) + np.array([di, dj, dk])).astype(np.int32), b)
        f = [u[:, a] if d else one_minus[:, a] for a, d in enumerate((di, dj, dk))]
        w = (f[0] * f[1]) * f[2]
        on = idx >= 0
        np.add.at(out, idx[on], (w[on, None] * v2[on]).astype(np.float64))
    return out.reshape((gb.total_voxels,) + values.shape[1:])


def splat_bezier(gb: GridBatch, points: JaggedTensor, values: np.ndarray) -> np.ndarray:
    """fVDB's SplatBezier.cu: each active tap += w * value."""
    v2 = values.reshape(len(values), -1).astype(F32)
    out = np.zeros((gb.total_voxels, v2.shape[1]), np.float64)
    for idx, w in bezier_taps(gb, points):
        on = idx >= 0
        np.add.at(out, idx[on], (w[on, None] * v2[on]).astype(np.float64))
    return out.reshape((gb.total_voxels,) + values.shape[1:])


def points_in_grid(gb: GridBatch, points: JaggedTensor) -> np.ndarray:
    """fVDB's PointsInGrid.cu: isActive(round(world_to_voxel(p)))."""
    return lookup(gb, nanovdb_round(world_to_voxel(gb, points)).astype(np.int32), grid_ids(points)) >= 0


def sparse_conv3d(grid_in: GridBatch, features: np.ndarray, grid_out: GridBatch, weight: np.ndarray,
                  bias: np.ndarray | None = None, stride=1, transposed: bool = False) -> np.ndarray:
    """fVDB's sparse convolution (fvdb-ops.md section 5), float64: out[c] = bias + sum over taps t of
    W[:, :, t] @ in[S*c + t - P], P = (K - 1) // 2; transposed: out[f] += W[:, :, t] @ in[c] for
    every active c and f = S*c + t - P, no kernel flip. Rows are batch-global voxel indices; grid b of
    the output pairs with grid b of the input."""
    w = np.asarray(weight, np.float64)
    K = w.shape[2:]
    P = [(k - 1) // 2 for k in K]
    S = [stride] * 3 if np.ndim(stride) == 0 else list(stride)
    x = np.asarray(features, np.float64)
    out = np.zeros((grid_out.total_voxels, w.shape[0]))
    if bias is not None:
        out += np.asarray(bias, np.float64)
    taps = [(a, b, c) for a in range(K[0]) for b in range(K[1]) for c in range(K[2])]
    for g, (vin, vout) in enumerate(zip(grid_in.ijk.unbind(), grid_out.ijk.unbind())):
        rows_in = {tuple(int(u) for u in v): int(grid_in.batch_offsets[g]) + n for n, v in enumerate(vin)}
        rows_out = {tuple(int(u) for u in v): int(grid_out.batch_offsets[g]) + n for n, v in enumerate(vout)}
        if transposed:
            for c, n in rows_in.items():
                for t in taps:
                    o = rows_out.get(tuple(S[a] * c[a] + t[a] - P[a] for a in range(3)))
                    if o is not None:
                        out[o] += w[:, :, t[0], t[1], t[2]] @ x[n]
        else:
            for c, o in rows_out.items():
                for t in taps:
                    n = rows_in.get(tuple(S[a] * c[a] + t[a] - P[a] for a in range(3)))
                    if n is not None:
                        out[o] += w[:, :, t[0], t[1], t[2]] @ x[n]
    return out


# ---- models ------------------------------------------------------------------------------------

ELEM = {np.dtype(np.uint8): TensorProto.UINT8, np.dtype(np.int64): TensorProto.INT64,
         np.dtype(np.float64): TensorProto.DOUBLE, np.dtype(np.int32): TensorProto.INT32,
         np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.bool_): TensorProto.BOOL}


def bundle_feeds(gb: GridBatch, **jagged: JaggedTensor | np.ndarray) -> dict[str, np.ndarray]:
    """Return {input name: array} for the bundle and each named JaggedTensor (name_jdata, ...); a plain
    array is a single-tensor JaggedTensor."""
    feeds = dict(zip(schema.BUNDLE, gb.bundle()))
    for name, jt in jagged.items():
        if not isinstance(jt, JaggedTensor):
            jt = JaggedTensor.from_list([np.asarray(jt)])
        feeds.update({f"{name}_{part}": arr for part, arr in zip(schema.JAGGED, jt.bundle())})
    return feeds


# the OpSpec of every fvdb op that reads a bundle and jagged inputs, whichever family's schema holds it
SPECS = {**schema.OPS, **fvdb_rays.OPS, **fvdb_dense.OPS}


def fvdb_node(op_type: str, output: str, name: str | None = None, **attrs) -> onnx.NodeProto:
    """Return an fvdb.<op_type> node reading the standard input names (bundle, then jagged parts)."""
    return helper.make_node(op_type, SPECS[op_type].input_names(), [output], name=name or output,
                            domain=schema.DOMAIN, **attrs)


def fvdb_model(nodes, feeds: dict[str, np.ndarray], batched=(), constants=(), outputs=None,
               extra_inputs: dict | None = None) -> onnx.ModelProto:
    """Return a model of nodes: feeds named in `constants` become initializers, the others graph inputs
    (first dimension the symbol N for those in `batched`); outputs typed by onnx's inference."""
    read = {i for n in nodes for i in n.input}
    ins, inits = [], []
    for name, arr in feeds.items():
        if name not in read:
            continue
        if name in constants:
            inits.append(numpy_helper.from_array(arr, name))
            continue
        shape = list(arr.shape)
        if name in batched:
            shape[0] = "N"
        ins.append(helper.make_tensor_value_info(name, ELEM[arr.dtype], shape))
    if outputs is None:
        outputs = [o for n in nodes for o in n.output if o not in read]
    g = helper.make_graph(list(nodes), "fvdb_test", ins, [], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(schema.DOMAIN, 1)])
    inferred = onnx.shape_inference.infer_shapes(m)
    types = {vi.name: vi for vi in list(inferred.graph.value_info) + list(inferred.graph.output)}
    m.graph.output.extend([types[o] for o in outputs])
    onnx.checker.check_model(m)
    return m


# ---- pooling and topology (fvdb-ops.md section 3, written from it alone: loops over ijk dictionaries) ----


def _rows(gb: GridBatch, b: int) -> dict[tuple, int]:
    """Return {ijk: batch-global row} of grid b."""
    vox = gb.ijk.unbind()[b]
    return {tuple(int(u) for u in v): int(gb.batch_offsets[b]) + n for n, v in enumerate(vox)}


def _three(v) -> list[int]:
    return [int(v)] * 3 if np.ndim(v) == 0 else [int(u) for u in v]


def pool(fine: GridBatch, features: np.ndarray, coarse: GridBatch, pool_size, stride=0, mode="max") -> np.ndarray:
    """fVDB's max_pool / avg_pool: coarse voxel c pools fine voxels c*S + [0, K)^3 (S = K where the
    stride is 0); max over the active ones (-inf if none), or their float64 sum / (K0*K1*K2)."""
    K = _three(pool_size)
    S = [k if s == 0 else s for k, s in zip(K, _three(stride))]
    x = np.asarray(features, np.float64)
    out = np.zeros((coarse.total_voxels, x.shape[1]))
    for b in range(coarse.grid_count):
        fine_rows = _rows(fine, b)
        for c, o in _rows(coarse, b).items():
            found = [fine_rows[f] for f in ((c[0] * S[0] + i, c[1] * S[1] + j, c[2] * S[2] + k)
                                            for i in range(K[0]) for j in range(K[1]) for k in range(K[2]))
                     if f in fine_rows]
            if mode == "max":
                out[o] = x[found].max(0) if found else -np.inf
            else:
                out[o] = x[found].sum(0) / (K[0] * K[1] * K[2])
    return out


def refine(coarse: GridBatch, features: np.ndarray, fine: GridBatch, factor) -> np.ndarray:
    """fVDB's refine: fine voxel f takes the features of coarse voxel floor(f / S), 0 where inactive."""
    S = _three(factor)
    x = np.asarray(features, np.float64)
    out = np.zeros((fine.total_voxels, x.shape[1]))
    for b in range(fine.grid_count):
        coarse_rows = _rows(coarse, b)
        for f, o in _rows(fine, b).items():
            parent = tuple(f[a] // S[a] for a in range(3))  # Python's // is floor division
            if parent in coarse_rows:
                out[o] = x[coarse_rows[parent]]
    return out


def voxel_sets(gb: GridBatch) -> list[set]:
    """Return the active voxels of each grid as a set of tuples."""
    return [set(_rows(gb, b)) for b in range(gb.grid_count)]


def coarsened_grid(gb: GridBatch, factor):
    """Return (voxel sets, voxel sizes, origins) of fVDB's coarsened_grid."""
    f = np.array(_three(factor))
    sets = [{tuple(v[a] // int(f[a]) for a in range(3)) for v in s} for s in voxel_sets(gb)]
    return sets, gb.voxel_sizes * f, gb.origins + (f - 1) * gb.voxel_sizes / 2


def refined_grid(gb: GridBatch, factor, mask=None):
    """Return (voxel sets, voxel sizes, origins) of fVDB's refined_grid (mask: bool per voxel, index order)."""
    f = _three(factor)
    sets = []
    for b in range(gb.grid_count):
        s = set()
        for v, row in _rows(gb, b).items():
            if mask is None or mask[row]:
                s |= {(v[0] * f[0] + i, v[1] * f[1] + j, v[2] * f[2] + k)
                      for i in range(f[0]) for j in range(f[1]) for k in range(f[2])}
        sets.append(s)
    h = gb.voxel_sizes / np.array(f)
    return sets, h, gb.origins - (np.array(f) - 1) * h / 2


def dilated_grid(gb: GridBatch, n: int):
    """Return the voxel sets of n passes of 26-neighbour dilation."""
    out = []
    for s in voxel_sets(gb):
        for _ in range(n):
            s = {(v[0] + i, v[1] + j, v[2] + k) for v in s for i in (-1, 0, 1) for j in (-1, 0, 1) for k in (-1, 0, 1)}
        out.append(s)
    return out


def conv_grid(gb: GridBatch, K, S, transposed=False):
    """Return the voxel sets of fVDB's conv_grid (every c with f = S*c + t - P for an active f) or
    conv_transpose_grid (every S*c + t - P of an active c)."""
    K, S = _three(K), _three(S)
    P = [(k - 1) // 2 for k in K]
    taps = [(a, b, c) for a in range(K[0]) for b in range(K[1]) for c in range(K[2])]
    out = []
    for s in voxel_sets(gb):
        r = set()
        for v in s:
            for t in taps:
                if transposed:
                    r.add(tuple(S[a] * v[a] + t[a] - P[a] for a in range(3)))
                else:
                    q = [v[a] - t[a] + P[a] for a in range(3)]
                    if all(q[a] % S[a] == 0 for a in range(3)):
                        r.add(tuple(q[a] // S[a] for a in range(3)))
        out.append(r)
    return out


def point_voxels(points: np.ndarray, h, o, nearest: bool = False) -> set:
    """fVDB's from_points (round(x) = floor(double(x) + 0.5)) or from_nearest_voxels_to_points
    (floor(x) + {0,1}^3), x = p * float(1/h) + float(-o/h) in float32 for float32 points."""
    s, t = (1.0 / np.asarray(h, np.float64)).astype(F32), (-np.asarray(o, np.float64) / h).astype(F32)
    out = set()
    for p in np.asarray(points, F32):
        x = [float(p[a] * s[a] + t[a]) for a in range(3)]
        if nearest:
            base = [int(np.floor(u)) for u in x]
            out |= {(base[0] + i, base[1] + j, base[2] + k) for i in (0, 1) for j in (0, 1) for k in (0, 1)}
        else:
            out.add(tuple(int(np.floor(u + 0.5)) for u in x))
    return out


# ---- rays (VoxelsAlongRays, SegmentsAlongRays) ------------------------------------------------------
# Written from the semantics alone (fvdb-ops.md section 3), not from shaders/hdda.py: the ray mapped by
# the dual transform, then a plain voxel-by-voxel Amanatides-Woo walk in float64 through the box of the
# active voxels [min, max + 1), testing each voxel against the set of active ijk.


def dual_ray(gb: GridBatch, b: int, origin, direction) -> tuple[np.ndarray, np.ndarray]:
    """Return (eye, direction) of a world ray in grid b's dual index space (voxel ijk = [ijk, ijk+1))."""
    scale = (1.0 / gb.voxel_sizes[b]).astype(F32).astype(np.float64)
    translate = (-gb.origins[b] / gb.voxel_sizes[b] + 0.5).astype(F32).astype(np.float64)
    return (np.asarray(origin, np.float64) * scale + translate, np.asarray(direction, np.float64) * scale)


def ray_walk(active: set, eye: np.ndarray, d: np.ndarray, lo: np.ndarray, hi: np.ndarray, t_min: float = 0.0,
             t_max: float = np.inf) -> list:
    """Return [(ijk, t0, t1)] of every active voxel the ray eye + t*d (t_min <= t <= t_max) crosses inside
    the box [lo, hi + 1), in order, each with the times it enters and leaves it."""
    if not d.any() or (lo > hi).any():
        return []
    t_in, t_out = float(t_min), float(t_max)
    for a in range(3):
        if d[a] == 0:
            if not lo[a] <= eye[a] <= hi[a] + 1:
                return []
            continue
        ta, tb = sorted(((lo[a] - eye[a]) / d[a], (hi[a] + 1 - eye[a]) / d[a]))
        t_in, t_out = max(t_in, ta), min(t_out, tb)
    if t_in >= t_out:
        return []
    mid = eye + d * (t_in + min(1e-9, (t_out - t_in) / 2))  # a point just inside the first voxel
    if not np.isfinite(mid).all():  # a NaN or infinite ray: no voxel to start from (and no cast of NaN)
        return []
    v = np.floor(mid).astype(np.int64)
    step = np.sign(d).astype(np.int64)
    with np.errstate(divide="ignore", invalid="ignore"):
        t_next = np.where(d > 0, (v + 1 - eye) / d, np.where(d < 0, (v - eye) / d, np.inf))
        t_delta = np.where(d != 0, 1.0 / np.abs(d), np.inf)
    hits, t = [], t_in
    while t < t_out:
        a = int(np.argmin(t_next))
        t_leave = min(t_next[a], t_out)
        if tuple(v) in active:
            hits.append((tuple(int(c) for c in v), t, t_leave))
        t = t_leave
        v[a] += step[a]
        t_next[a] += t_delta[a]
    return hits


def _ray_hits(gb: GridBatch, origins: JaggedTensor, directions: JaggedTensor, spans=None):
    """Yield (ray, grid b, its active-voxel walk) for every ray of a batch; spans: per-ray (t_min, t_max)
    arrays (default: from 0 on)."""
    from luisaml.fvdb.nanovdb_query import active_voxels

    b_of = grid_ids(origins)
    active = [set(map(tuple, active_voxels(g).tolist())) for g in gb.grids]
    for r in range(len(origins.jdata)):
        b = int(b_of[r])
        g = gb.grids[b]
        lo, hi = (g.root_bbox[0], g.root_bbox[1]) if g.voxel_count else (np.ones(3), np.zeros(3))
        eye, d = dual_ray(gb, b, origins.jdata[r], directions.jdata[r])
        span = (0.0, np.inf) if spans is None else (float(spans[0][r]), float(spans[1][r]))
        yield r, b, ray_walk(active[b], eye, d, np.asarray(lo, np.int64), np.asarray(hi, np.int64), *span)


def voxels_along_rays(gb: GridBatch, origins: JaggedTensor, directions: JaggedTensor, max_voxels: int = -1,
                      eps: float = 0.0) -> list[list[tuple]]:
    """Return per ray [(ijk, t0, t1)]: active voxels, hits shorter than eps dropped, a repeat of the previous
    voxel merged into it, at most max_voxels."""
    out = []
    for _, _, hits in _ray_hits(gb, origins, directions):
        kept: list = []
        for ijk, t0, t1 in hits:
            if t1 - t0 < eps:
                continue
            if kept and kept[-1][0] == ijk:
                kept[-1] = (ijk, min(kept[-1][1], t0), max(kept[-1][2], t1))
                continue
            kept.append((ijk, t0, t1))
            if len(kept) == max_voxels:
                break
        out.append(kept)
    return out


def _runs(hits: list) -> list[tuple]:
    """Return the [t0, t1] runs of a walk's hits: consecutive ones (each leaving where the next enters) merged."""
    runs: list = []
    for _, t0, t1 in hits:
        if runs and runs[-1][1] == t0:
            runs[-1] = (runs[-1][0], t1)
        else:
            runs.append((t0, t1))
    return runs


def segments_along_rays(gb: GridBatch, origins: JaggedTensor, directions: JaggedTensor, max_segments: int = -1,
                        eps: float = 0.0) -> list[list[tuple]]:
    """Return per ray [(t0, t1)]: runs of consecutive active voxels (each leaving where the next enters),
    spans shorter than eps dropped, at most max_segments."""
    out = []
    for _, _, hits in _ray_hits(gb, origins, directions):
        kept = []
        for t0, t1 in _runs(hits):
            if t1 - t0 < eps:
                continue
            kept.append((t0, t1))
            if len(kept) == max_segments:
                break
        out.append(kept)
    return out


def eps_ties(gb: GridBatch, origins: JaggedTensor, directions: JaggedTensor, eps: float, runs: bool,
             margin: float = 2e-6) -> list[bool]:
    """Return per ray whether one of its hits (runs: its runs of consecutive active voxels, as
    segments_along_rays makes them) is within `margin` (relative to its times) of eps long: whether
    it is kept is then a matter of float32 rounding, which a float32 walk may decide otherwise (a
    float32 time is within 6e-8 of itself relative; a walk of many steps adds those up)."""
    out = []
    for _, _, hits in _ray_hits(gb, origins, directions):
        spans = _runs(hits) if runs else [(t0, t1) for _, t0, t1 in hits]
        out.append(any(abs((t1 - t0) - eps) <= margin * max(1.0, abs(t1)) for t0, t1 in spans))
    return out


# ---- UniformRaySamples, RaysIntersectVoxels -------------------------------------------------------
# Written from fVDB's source: GridBatch.rays_intersect_voxels (fvdb/grid_batch.py) is voxels_along_rays with
# max_voxels=1 and `count > 0`; uniform_ray_samples is ops/SampleRaysUniform.cu's fill callback (the one that
# writes the rows) run over the runs of active voxels of the walk above, clipped to the ray's [t_min, t_max],
# step by step in float32 (the kernel's ScalarType; _calcDt returns float). Not from our kernel.

NANOVDB_DELTA = F32(1e-5)  # nanovdb::math::Delta<float>::value()


def rays_intersect_voxels(gb: GridBatch, origins: JaggedTensor, directions: JaggedTensor,
                          eps: float = 0.0) -> np.ndarray:
    """Return bool [R]: whether voxels_along_rays(max_voxels=1, eps) finds a voxel for the ray."""
    return np.array([len(v) > 0 for v in voxels_along_rays(gb, origins, directions, max_voxels=1, eps=eps)], bool)


class StalledRay(ValueError):
    """A ray whose float32 step no longer advances its time (fVDB's loop would never end)."""


def uniform_ray_samples(gb: GridBatch, origins: JaggedTensor, directions: JaggedTensor, t_min: np.ndarray,
                        t_max: np.ndarray, step_size: float, cone_angle: float = 0.0,
                        include_end_segments: bool = True, return_midpoints: bool = False, eps: float = 0.0,
                        margin: float = 5e-5) -> tuple[list[list], list[bool]]:
    """Return (per ray its samples: [(t0, t1)], or [mid] with return_midpoints, float32; per ray whether any
    decision of the walk or of the loop lay within `margin` (relative) of its threshold, where a float32 walk,
    whose times differ from this float64 one by ~1e-6, may decide the other way). A ray whose t_min is not
    finite or whose t_max is NaN has no samples (as luisaml documents); a stalled step raises StalledRay."""
    step, cone, big = F32(step_size), F32(cone_angle), F32(1e10)

    def calc_dt(t):  # _calcDt: Clamp(t * coneAngle, minStepSize, maxStepSize) = Min(Max(x, lo), hi)
        return min(max(F32(t * cone), step), big)

    out, unsure = [], []
    for r, _, hits in _ray_hits(gb, origins, directions, spans=(t_min, t_max)):
        lo, hi = F32(t_min[r]), F32(t_max[r])
        if not (np.isfinite(lo) and lo <= hi):
            out.append([])
            unsure.append(False)
            continue
        near = False

        def close(x, y) -> None:
            nonlocal near
            x, y = float(x), float(y)
            near |= abs(x - y) <= margin * max(1.0, abs(x), abs(y))

        for _, h0, h1 in hits:  # a voxel crossed for ~0 time: the walks may differ in it (a corner, a face)
            close(h0, h1)
        runs: list = []
        for _, h0, h1 in hits:
            if runs and runs[-1][1] == h0:
                runs[-1] = (runs[-1][0], h1)
            else:
                if runs:
                    close(runs[-1][1], h0)  # two runs nearly touching: one segment or two
                runs.append((h0, h1))
        rows: list = []

        def add(a, z) -> None:
            rows.append(F32((a + z) / F32(2.0)) if return_midpoints else (a, z))

        t0 = lo
        dt = calc_dt(t0)
        for h0, h1 in runs:
            s0, s1 = F32(h0), F32(h1)
            if eps > 0:
                close(s1 - s0, eps)
            if s1 - s0 < F32(eps):
                continue
            if include_end_segments:
                t0 = F32(t0 + F32(np.ceil(F32(s0 - t0) / dt)) * dt)
                t1 = F32(t0 + dt)
                close(t0, s0), close(t0 - dt, s0), close(t0, s1)
                if t0 > s1:
                    add(s0, s1)
                    continue
                if t0 - s0 > NANOVDB_DELTA:
                    add(s0, t0)
                while True:
                    close(t1, s1)
                    if not t1 < s1:
                        break
                    add(t0, t1)
                    t0 = t1
                    dt = calc_dt(t0)
                    t1 = F32(t1 + dt)
                    if not t1 > t0:
                        raise StalledRay(f"ray {r}: t = {t0}")
                close(s1, t0)
                if s1 - t0 > NANOVDB_DELTA:
                    add(t0, s1)
            else:
                t0 = F32(t0 + F32(np.floor(F32(s0 - t0) / dt + F32(0.5))) * dt)
                close(t0 - dt * F32(0.5), s0)
                dt = calc_dt(t0)
                t1 = F32(t0 + dt)
                while True:
                    mid = F32(t0 + t1) * F32(0.5)
                    close(mid, s1), close(mid, s0)
                    if not (mid < s1 and mid >= s0):
                        break
                    add(t0, t1)
                    t0 = t1
                    dt = calc_dt(t0)
                    t1 = F32(t1 + dt)
                    if not t1 > t0:
                        raise StalledRay(f"ray {r}: t = {t0}")
        out.append(rows)
        unsure.append(near)
    return out, unsure


def ray_node(op_type: str, outputs: list[str], name: str | None = None, **attrs) -> onnx.NodeProto:
    """Return an fvdb ray node (outputs: the op's JaggedTensor parts) reading the standard input names."""
    return helper.make_node(op_type, SPECS[op_type].input_names(), outputs, name=name or outputs[0],
                            domain=schema.DOMAIN, **attrs)
