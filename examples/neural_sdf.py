"""A neural signed-distance field on a sparse voxel grid, sphere-traced inside your own kernel.

1. A narrow band of voxels around an analytic shape becomes an fVDB-style grid (luisaml.fvdb).
2. Per-voxel features + a small MLP are fitted with torch on the CPU: sdf(p) = MLP(trilinear(features, p)),
   the sampling done by luisaml.fvdb.torch_ops (fVDB's sample_trilinear, differentiable in the features).
3. The model is exported to ONNX (fvdb.SampleTrilinear, fvdb.PointsInGrid, Gemm, Relu) with the grid and
   features as initializers, and compiled by luisaml into one @luisa.func.
4. A user kernel, one thread per pixel, sphere-traces the field by calling `net.forward` and shades the
   hits with normals from central differences, then the image is written as a PNG.

Run: python examples/neural_sdf.py [out_dir]   (the README picture: examples/images/neural_sdf.png)
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass

import luisa
import numpy as np
import torch
from PIL import Image

import luisaml
from luisaml.fvdb import GridBatch
from luisaml.fvdb import torch_ops as F
from luisaml.opsets import fvdb as schema


@dataclass
class Settings:
    """How big everything is; the test uses a small version."""

    resolution: int = 64  # voxels across [-1, 1]
    band: float = 2.5  # half-width of the narrow band, in voxels
    channels: int = 8
    hidden: int = 32
    steps: int = 600
    batch: int = 8192
    image: int = 256
    march_steps: int = 96
    seed: int = 0


# ---- the shape ----------------------------------------------------------------------------------


def shape_sdf(p: np.ndarray) -> np.ndarray:
    """Signed distance of a sphere smoothly joined to a tilted torus and a smaller ring (float64)."""
    p = np.asarray(p, np.float64)
    sphere = np.linalg.norm(p, axis=-1) - 0.32
    c, s = math.cos(0.45), math.sin(0.45)
    q = np.stack([p[..., 0], c * p[..., 1] - s * p[..., 2], s * p[..., 1] + c * p[..., 2]], -1)
    torus = np.hypot(np.hypot(q[..., 0], q[..., 2]) - 0.6, q[..., 1]) - 0.14
    ring = np.hypot(np.hypot(p[..., 1], p[..., 2] + 0.05) - 0.42, p[..., 0]) - 0.07
    return _smooth_min(_smooth_min(sphere, torus, 0.12), ring, 0.08)


def _smooth_min(a: np.ndarray, b: np.ndarray, k: float) -> np.ndarray:
    h = np.clip(0.5 + 0.5 * (b - a) / k, 0.0, 1.0)
    return b + (a - b) * h - k * h * (1.0 - h)


def narrow_band(cfg: Settings) -> GridBatch:
    """Return the grid of voxels whose centres lie within cfg.band voxels of the surface."""
    h = 2.0 / cfg.resolution
    half = cfg.resolution // 2
    ijk = np.stack(np.meshgrid(*[np.arange(-half, half)] * 3, indexing="ij"), -1).reshape(-1, 3)
    origin = np.full(3, h / 2)  # voxel (0,0,0) is centred at h/2: the grid spans [-1, 1]^3
    centres = ijk * h + origin
    keep = np.abs(shape_sdf(centres)) < cfg.band * h
    return GridBatch.from_ijk(ijk[keep].astype(np.int32), voxel_sizes=h, origins=origin)


# ---- the model ------------------------------------------------------------------------------------


class NeuralSDF(torch.nn.Module):
    """sdf(x) = MLP(sample_trilinear(grid, x, features)); also returns whether x lies in the band."""

    def __init__(self, grid: GridBatch, cfg: Settings):
        super().__init__()
        for name, t in zip(schema.BUNDLE, F.bundle_tensors(grid)):
            self.register_buffer(name, t)
        torch.manual_seed(cfg.seed)
        self.features = torch.nn.Parameter(0.01 * torch.randn(grid.total_voxels, cfg.channels))
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(cfg.channels, cfg.hidden), torch.nn.ReLU(),
            torch.nn.Linear(cfg.hidden, cfg.hidden), torch.nn.ReLU(),
            torch.nn.Linear(cfg.hidden, 1),
        )
        empty = torch.zeros(0, dtype=torch.int32)
        self.register_buffer("no_jidx", empty)
        self.register_buffer("no_jlidx", torch.zeros((0, 1), dtype=torch.int32))

    def forward(self, x: torch.Tensor):
        bundle = [getattr(self, n) for n in schema.BUNDLE]
        offsets = self.batch_offsets  # one grid, so the points' joffsets have the same shape [2]
        points = (x, offsets, self.no_jidx, self.no_jlidx)
        feats = (self.features, offsets, self.no_jidx, self.no_jlidx)
        sdf = self.mlp(F.sample_trilinear(bundle, points, feats))
        return sdf, F.points_in_grid(bundle, points)


def train(model: NeuralSDF, grid: GridBatch, cfg: Settings) -> list[float]:
    """Fit features and MLP to the analytic distances of points in the band; return the losses."""
    rng = np.random.default_rng(cfg.seed)
    centres = grid.voxel_to_world(grid.ijk.jdata)
    h = grid.voxel_sizes[0]
    opt = torch.optim.Adam([{"params": [model.features], "lr": 2e-2},
                            {"params": model.mlp.parameters(), "lr": 3e-3}])
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, cfg.steps)
    losses = []
    threads = torch.get_num_threads()
    # a step is small (a few thousand points, a 32-wide MLP): more threads only add synchronisation
    torch.set_num_threads(1)
    try:
        for _ in range(cfg.steps):
            losses.append(_step(model, opt, sched, centres, h, rng, cfg))
    finally:
        torch.set_num_threads(threads)
    return losses


def _step(model, opt, sched, centres, h, rng, cfg) -> float:
    """One Adam step on a fresh batch of points near the surface; return the L1 loss."""
    pick = centres[rng.integers(0, len(centres), cfg.batch)]
    p = (pick + rng.uniform(-0.5, 0.5, pick.shape) * h).astype(np.float32)
    target = torch.from_numpy(shape_sdf(p).astype(np.float32))[:, None]
    sdf, _ = model(torch.from_numpy(p))
    loss = torch.nn.functional.l1_loss(sdf, target)
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return float(loss.detach())


def export(model: NeuralSDF, path: str) -> None:
    """Export with a dynamic number of points; grid, features and MLP become initializers."""
    F.export_onnx(model.eval(), (torch.zeros(4, 3),), path, input_names=["x"], output_names=["sdf", "inside"],
                  dynamic_axes={"x": {0: "N"}, "sdf": {0: "N"}, "inside": {0: "N"}})


# ---- the user kernel ---------------------------------------------------------------------------------

# Names a @luisa.func uses must be plain module globals: bind them after compiling.
forward = X = SDF = INSIDE = None
MARCH_STEPS = 96
OUTSIDE_STEP = 0.05  # how far a ray may step where the field is not defined (outside the band)
EPSILON = 1e-3
NORMAL_STEP = 0.01  # central differences over about a third of a voxel: smooth across trilinear cells


@luisa.func
def field(p, weights):
    """The network's distance at p (a luisa float3); a safe step size outside the narrow band."""
    x = X()
    x[0] = p.x
    x[1] = p.y
    x[2] = p.z
    sdf = SDF()
    inside = INSIDE()
    forward(x, sdf, inside, weights)
    d = OUTSIDE_STEP
    if inside[0]:
        d = sdf[0]
    return d


@luisa.func
def render_kernel(image, weights, eye, right, up, ahead):
    """One thread per pixel: sphere-trace the neural field inside [-1, 1]^3, shade the hit."""
    px = dispatch_id().xy
    size = dispatch_size().xy
    u = (float(px.x) + 0.5) / float(size.x) * 2.0 - 1.0
    v = 1.0 - (float(px.y) + 0.5) / float(size.y) * 2.0
    d = normalize(ahead + u * right + v * up)
    # the box [-1, 1]^3: slab intersection
    t0 = (make_float3(-1.0) - eye) / d
    t1 = (make_float3(1.0) - eye) / d
    tmin = max(max(min(t0.x, t1.x), min(t0.y, t1.y)), min(t0.z, t1.z))
    tmax = min(min(max(t0.x, t1.x), max(t0.y, t1.y)), max(t0.z, t1.z))
    colour = lerp(make_float3(0.93, 0.95, 0.98), make_float3(0.62, 0.70, 0.82), v * 0.5 + 0.5)
    t = max(tmin, 0.0)
    hit = False
    if tmax > t:
        for _step in range(MARCH_STEPS):
            if not hit and t < tmax:
                s = field(eye + t * d, weights)
                if s < EPSILON:
                    hit = True
                else:
                    t += s
    if hit:
        p = eye + t * d
        e = NORMAL_STEP
        n = normalize(make_float3(
            field(p + make_float3(e, 0.0, 0.0), weights) - field(p - make_float3(e, 0.0, 0.0), weights),
            field(p + make_float3(0.0, e, 0.0), weights) - field(p - make_float3(0.0, e, 0.0), weights),
            field(p + make_float3(0.0, 0.0, e), weights) - field(p - make_float3(0.0, 0.0, e), weights)))
        light = normalize(make_float3(0.5, 0.8, 0.6))
        diffuse = max(dot(n, light), 0.0)
        rim = pow(1.0 - max(dot(n, -d), 0.0), 3.0)
        base = make_float3(0.85, 0.45, 0.25) * (0.5 + 0.5 * n.y) + make_float3(0.15, 0.3, 0.45) * (0.5 - 0.5 * n.y)
        colour = base * (0.25 + 0.75 * diffuse) + make_float3(0.3) * rim
    image.write(px.y * size.x + px.x, make_float4(colour, 1.0))


def render(net, size: int, march_steps: int = 96) -> np.ndarray:
    """Return the size x size x 3 image the user kernel draws with `net.forward`."""
    global forward, X, SDF, INSIDE, MARCH_STEPS
    forward, X, SDF, INSIDE = net.forward, net.input_type("x"), net.output_type("sdf"), net.output_type("inside")
    MARCH_STEPS = march_steps
    eye = np.array([0.3, 1.5, 2.0])
    ahead = -eye / np.linalg.norm(eye)
    right = np.cross(ahead, [0.0, 1.0, 0.0])
    right /= np.linalg.norm(right)
    up = np.cross(right, ahead)
    fov = math.tan(math.radians(21))
    image = luisa.Buffer(size * size, luisa.float4)
    f3 = lambda a: luisa.float3(*map(float, a))  # noqa: E731
    render_kernel(image, net.weights, f3(eye), f3(right * fov), f3(up * fov), f3(ahead), dispatch_size=(size, size))
    luisa.synchronize()
    out = np.empty((size * size, 4), np.float32)
    image.copy_to(out)
    return out[:, :3].reshape(size, size, 3)


def main(out_dir: str, cfg: Settings = Settings(), png: str | None = None) -> dict:
    """Build, train, export, compile and render; return timings and checks (seconds, errors)."""
    os.makedirs(out_dir, exist_ok=True)
    report: dict = {}
    t = time.perf_counter()
    grid = narrow_band(cfg)
    model = NeuralSDF(grid, cfg)
    report["voxels"] = grid.total_voxels
    report["grid_s"] = time.perf_counter() - t
    t = time.perf_counter()
    losses = train(model, grid, cfg)
    report["train_s"] = time.perf_counter() - t
    report["loss_first"], report["loss_last"] = losses[0], float(np.mean(losses[-10:]))
    path = os.path.join(out_dir, "neural_sdf.onnx")
    t = time.perf_counter()
    export(model, path)
    net = luisaml.compile(path)
    report["compile_s"] = time.perf_counter() - t
    # the compiled network against torch, on points in the band
    rng = np.random.default_rng(1)
    centres = grid.voxel_to_world(grid.ijk.jdata)
    p = (centres[rng.integers(0, len(centres), 2000)] + rng.uniform(-0.5, 0.5, (2000, 3)) * grid.voxel_sizes[0])
    p = p.astype(np.float32)
    with torch.no_grad():
        sdf_torch, inside_torch = model(torch.from_numpy(p))
    out = net.run({"x": p})
    report["max_diff_vs_torch"] = float(np.abs(out["sdf"] - sdf_torch.numpy()).max())
    report["inside_equal"] = bool((out["inside"] == inside_torch.numpy()).all())
    report["mean_abs_error_vs_shape"] = float(np.abs(out["sdf"][:, 0] - shape_sdf(p)).mean())
    t = time.perf_counter()
    image = render(net, cfg.image, cfg.march_steps)
    report["render_s"] = time.perf_counter() - t
    report["image"] = image
    png = png or os.path.join(out_dir, "neural_sdf.png")
    Image.fromarray((np.clip(image, 0.0, 1.0) * 255 + 0.5).astype(np.uint8)).save(png)
    report["png"] = png
    return report


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", nargs="?", default=tempfile.mkdtemp(prefix="neural_sdf_"))
    ap.add_argument("--png", help="where to write the picture (default: out_dir/neural_sdf.png)")
    ap.add_argument("--image", type=int, default=Settings.image)
    ap.add_argument("--steps", type=int, default=Settings.steps)
    args = ap.parse_args()
    r = main(args.out_dir, Settings(image=args.image, steps=args.steps), args.png)
    print(f"grid: {r['voxels']} voxels in the band ({r['grid_s']:.2f} s)")
    print(f"train: {r['train_s']:.1f} s, L1 loss {r['loss_first']:.4f} -> {r['loss_last']:.4f}")
    print(f"export + compile: {r['compile_s']:.2f} s; compiled vs torch: max |diff| {r['max_diff_vs_torch']:.2e}, "
          f"band flags equal: {r['inside_equal']}; mean |sdf error| vs the shape {r['mean_abs_error_vs_shape']:.4f}")
    print(f"render {args.image}x{args.image}: {r['render_s']:.2f} s -> {r['png']}")
    sys.exit(0 if r["max_diff_vs_torch"] < 1e-4 and r["inside_equal"] else 1)
