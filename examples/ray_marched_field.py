"""A neural field on a sparse grid, ray-marched only where the grid has voxels: fvdb.SegmentsAlongRays.

1. The narrow-band grid and neural SDF of examples/neural_sdf.py (a sphere joined to a torus and a ring;
   per-voxel features + a small MLP, fitted with torch on the CPU, exported, compiled by luisaml).
2. One ray per pixel. A second network, one fvdb.SegmentsAlongRays node, walks every ray through the grid
   with NanoVDB's hierarchical DDA and returns the spans [t0, t1] where it is inside active voxels (how
   many spans each ray has is known only once it is walked: the node's outputs are sized at run time).
3. The march: each ray starts at its first span, steps by the field's distance, and jumps to its next
   span when it leaves one, so no step is ever taken through empty space; a hit is shaded with normals
   from central differences of the field. Pixels whose rays cross the band without hitting the surface
   are tinted by how long they spent in it, which shows the spans themselves.

Run: python examples/ray_marched_field.py [--image 256] [--png examples/images/ray_marched_field.png]
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from PIL import Image

import luisaml
from luisaml.opsets import fvdb as schema
from luisaml.opsets import fvdb_rays

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import neural_sdf  # noqa: E402  (the grid, the field and its training)

EPSILON = 1e-3  # a hit: the field's distance below this
SPAN_EPS = 1e-3  # spans shorter than this are dropped (a ray grazing a voxel edge)
MIN_STEP = 2e-3  # never step less than this (where the fitted field is a little off near zero)
NORMAL_STEP = 0.01


@dataclass
class Settings:
    """How big everything is; the test uses a small version."""

    sdf: neural_sdf.Settings = field(default_factory=neural_sdf.Settings)
    image: int = 256
    march_steps: int = 64


def camera(size: int) -> tuple[np.ndarray, np.ndarray]:
    """Return (origins, unit directions), float32 [size * size, 3], of neural_sdf's camera, row by row."""
    eye = np.array([0.3, 1.5, 2.0])
    ahead = -eye / np.linalg.norm(eye)
    right = np.cross(ahead, [0.0, 1.0, 0.0])
    right /= np.linalg.norm(right)
    up = np.cross(right, ahead)
    fov = math.tan(math.radians(21))
    s = (np.arange(size) + 0.5) / size * 2.0 - 1.0
    u, v = np.meshgrid(s, -s)  # v = +1 at the top row
    d = ahead + (u[..., None] * right + v[..., None] * up).reshape(-1, 3) * fov
    d /= np.linalg.norm(d, axis=1, keepdims=True)
    return np.repeat(eye[None], len(d), 0).astype(np.float32), d.astype(np.float32)


def segments_model(grid, rays: int) -> onnx.ModelProto:
    """Return a model of one fvdb.SegmentsAlongRays node: the grid bundle and the rays are its inputs."""
    bundle = dict(zip(schema.BUNDLE, grid.bundle()))
    elem = {np.dtype(np.uint8): TensorProto.UINT8, np.dtype(np.int64): TensorProto.INT64,
            np.dtype(np.float64): TensorProto.DOUBLE, np.dtype(np.int32): TensorProto.INT32,
            np.dtype(np.float32): TensorProto.FLOAT}
    ins = [helper.make_tensor_value_info(n, elem[a.dtype], list(a.shape)) for n, a in bundle.items()]
    inits = []
    for name in ("ray_origins", "ray_directions"):
        ins.append(helper.make_tensor_value_info(f"{name}_jdata", TensorProto.FLOAT, [rays, 3]))
        inits += [numpy_helper.from_array(np.array([0, rays], np.int64), f"{name}_joffsets"),
                  numpy_helper.from_array(np.zeros(0, np.int32), f"{name}_jidx"),
                  numpy_helper.from_array(np.zeros((0, 1), np.int32), f"{name}_jlidx")]
    outs = ["segments", "joffsets", "jidx", "jlidx"]
    node = helper.make_node("SegmentsAlongRays", fvdb_rays.OPS["SegmentsAlongRays"].input_names(), outs,
                            name="segments", domain=schema.DOMAIN, eps=SPAN_EPS)
    g = helper.make_graph([node], "segments_along_rays", ins, [], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(schema.DOMAIN, 1)])
    inferred = onnx.shape_inference.infer_shapes(m)
    types = {v.name: v for v in inferred.graph.value_info}
    m.graph.output.extend([types[o] for o in outs])
    return m


def march(distance, origins, directions, offsets, spans, steps: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Sphere-trace every ray inside its spans only; return (hit mask, hit t, field evaluations).
    distance(points [n, 3]) -> (the field's distance [n], inside the band [n])."""
    n = len(origins)
    first, last = offsets[:-1], offsets[1:]
    seg = first.copy()  # each ray's current span
    live = seg < last
    t = np.where(live, spans[np.minimum(seg, len(spans) - 1), 0] if len(spans) else 0.0, 0.0)
    hit = np.zeros(n, bool)
    evaluations = 0
    for _ in range(steps):
        idx = np.flatnonzero(live)
        if not len(idx):
            break
        d, inside = distance(origins[idx] + t[idx, None] * directions[idx])
        evaluations += len(idx)
        now = inside & (d < EPSILON)
        hit[idx[now]] = True
        live[idx[now]] = False
        go = idx[~now]
        t[go] += np.maximum(np.where(inside[~now], d[~now], MIN_STEP), MIN_STEP)
        # past the span's end: on to the ray's next span (a jump over empty space), or done
        out = go[t[go] > spans[seg[go], 1]]
        seg[out] += 1
        more = seg[out] < last[out]
        live[out[~more]] = False
        t[out[more]] = spans[seg[out[more]], 0]
    return hit, t, evaluations


def shade(distance, p: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Return colours [n, 3] of surface points p seen along d (normals from central differences)."""
    e = NORMAL_STEP
    grad = np.stack([distance(p + e * a)[0] - distance(p - e * a)[0] for a in np.eye(3, dtype=np.float32)], 1)
    nrm = grad / np.maximum(np.linalg.norm(grad, axis=1, keepdims=True), 1e-12)
    light = np.array([0.5, 0.8, 0.6]) / np.linalg.norm([0.5, 0.8, 0.6])
    diffuse = np.maximum(nrm @ light, 0.0)[:, None]
    rim = (1.0 - np.maximum((nrm * -d).sum(1), 0.0))[:, None] ** 3
    ny = nrm[:, 1:2]
    base = np.array([0.85, 0.45, 0.25]) * (0.5 + 0.5 * ny) + np.array([0.15, 0.3, 0.45]) * (0.5 - 0.5 * ny)
    return base * (0.25 + 0.75 * diffuse) + 0.3 * rim


def main(out_dir: str, cfg: Settings = Settings(), png: str | None = None) -> dict:
    """Fit and compile the field, walk the rays, march, shade; return timings, checks and the image."""
    os.makedirs(out_dir, exist_ok=True)
    report: dict = {}
    t = time.perf_counter()
    grid = neural_sdf.narrow_band(cfg.sdf)
    model = neural_sdf.NeuralSDF(grid, cfg.sdf)
    neural_sdf.train(model, grid, cfg.sdf)
    path = os.path.join(out_dir, "neural_sdf.onnx")
    neural_sdf.export(model, path)
    sdf_net = luisaml.compile(path)
    report["field_s"] = time.perf_counter() - t

    def distance(p):
        out = sdf_net.run({"x": np.ascontiguousarray(p, np.float32)})
        return out["sdf"][:, 0], out["inside"].astype(bool).reshape(-1)

    origins, directions = camera(cfg.image)
    t = time.perf_counter()
    ray_net = luisaml.compile(segments_model(grid, len(origins)))
    feeds = dict(zip(schema.BUNDLE, grid.bundle()))
    feeds.update(ray_origins_jdata=origins, ray_directions_jdata=directions)
    walked = ray_net.run(feeds)
    report["segments_s"] = time.perf_counter() - t
    offsets, spans = walked["joffsets"], walked["segments"]
    report["voxels"], report["rays"], report["segments"] = grid.total_voxels, len(origins), len(spans)
    report["rays_in_band"] = int(np.count_nonzero(np.diff(offsets)))
    t = time.perf_counter()
    hit, t_hit, report["evaluations"] = march(distance, origins, directions, offsets, spans, cfg.march_steps)
    p = origins + t_hit[:, None] * directions
    report["march_s"] = time.perf_counter() - t
    report["hits"] = int(hit.sum())
    report["hit_points"] = p[hit]
    report["hit"], report["t"] = hit, t_hit

    sky = np.array([0.93, 0.95, 0.98]) + (np.array([0.62, 0.70, 0.82]) - [0.93, 0.95, 0.98]) * \
        np.linspace(1.0, 0.0, cfg.image)[:, None, None].repeat(cfg.image, 1).reshape(-1, 1)
    image = sky.copy()
    length = np.zeros(len(origins))
    np.add.at(length, walked["jidx"], spans[:, 1] - spans[:, 0])  # time spent in the band, per ray
    band = (length > 0) & ~hit
    image[band] = image[band] * (1 - np.minimum(length[band, None] * 2.0, 0.6)) + \
        np.array([0.2, 0.45, 0.55]) * np.minimum(length[band, None] * 2.0, 0.6)
    if hit.any():
        image[hit] = shade(distance, p[hit], directions[hit])
    image = np.clip(image, 0.0, 1.0).reshape(cfg.image, cfg.image, 3).astype(np.float32)
    report["image"] = image
    png = png or os.path.join(out_dir, "ray_marched_field.png")
    Image.fromarray((np.clip(image, 0.0, 1.0) * 255 + 0.5).astype(np.uint8)).save(png)
    report["png"] = png
    report["offsets"], report["spans"], report["origins"], report["directions"] = offsets, spans, origins, directions
    report["grid"] = grid
    return report


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", nargs="?", default=tempfile.mkdtemp(prefix="ray_marched_field_"))
    ap.add_argument("--png", help="where to write the picture (default: out_dir/ray_marched_field.png)")
    ap.add_argument("--image", type=int, default=Settings.image)
    args = ap.parse_args()
    r = main(args.out_dir, Settings(image=args.image), args.png)
    err = np.abs(neural_sdf.shape_sdf(r["hit_points"])) if r["hits"] else np.zeros(1)
    print(f"field: {r['voxels']} voxels, fitted and compiled in {r['field_s']:.1f} s")
    print(f"SegmentsAlongRays: {r['rays']} rays, {r['rays_in_band']} cross the band, {r['segments']} spans "
          f"({r['segments_s']:.2f} s with its compile)")
    print(f"march: {r['hits']} hits, {r['evaluations']} field evaluations "
          f"({r['evaluations'] / max(r['rays'], 1):.1f} a ray) in {r['march_s']:.2f} s; |shape sdf| at the hits: "
          f"median {np.median(err):.4f}, max {err.max():.4f}")
    print(f"-> {r['png']}")
