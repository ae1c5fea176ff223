"""A small sparse 3-D U-Net over a grid built from a point cloud, exported from torch and run by luisaml.

1. A random point cloud on a sphere becomes a grid inside the model (fvdb.GridBatchFromPoints: the
   voxel round((p - origin) / h) of every point); its stride-2 convolution grid (fvdb.ConvGrid) is
   the coarse level. Both are built from the module's constant points, so luisaml folds them, and
   every kernel and pooling map over them, on the host when it compiles the model.
2. The network: two 3x3x3 sparse convolutions at the fine level, down to the coarse level by a
   stride-2 convolution plus a 2x2x2 max pool, a 3x3x3 convolution there, back up by a transposed
   convolution plus fVDB's refine (nearest upsampling), then the skip connection (the fine
   features concatenated) and a last 3x3x3 convolution. Random weights.
3. Exported with fvdb.* nodes, compiled by luisaml, run, and compared with the torch module.

4. --any-grid: the same layers over a fine grid given as an input of any size, its coarse level made
   inside the model (FineGridUNet; luisaml builds that ConvGrid's grid, on the device on CUDA and on
   the host on the CPU backend, when a run binds a new
   grid): one compiled network serves every point cloud, a new grid per call as a perception
   pipeline sees them; the voxels are the batch (README, "Grids of any size"). GridInputUNet takes
   both grids as inputs instead.

Run: python examples/sparse_unet.py [--points 20000] [--voxel-size 0.02] [--channels 16] [--any-grid]
"""
from __future__ import annotations

import argparse
import io
import time
from dataclasses import dataclass

import numpy as np
import onnx
import torch

import luisaml
from luisaml.fvdb import torch_ops as F


@dataclass
class Settings:
    """How big everything is; the test uses a small version."""

    points: int = 20000
    voxel_size: float = 0.02  # the sphere has radius 1
    in_channels: int = 4
    channels: int = 16
    out_channels: int = 3
    seed: int = 0
    repeats: int = 5


def sphere_points(n: int, rng: np.random.Generator) -> np.ndarray:
    """Return n float32 points near the unit sphere (a surface, like a scan)."""
    p = rng.standard_normal((n, 3))
    p /= np.linalg.norm(p, axis=1, keepdims=True)
    return (p * (1.0 + 0.01 * rng.standard_normal((n, 1)))).astype(np.float32)


class SparseUNet(torch.nn.Module):
    """conv-conv at the fine level; down (stride-2 conv + max pool); conv; up (transposed conv +
    refine); skip; conv. The grids come from the constant points inside forward()."""

    def __init__(self, points: np.ndarray, voxel_size: float, c_in: int, c: int, c_out: int):
        super().__init__()
        self.register_buffer("points", torch.from_numpy(points))
        self.voxel_size = voxel_size
        self.conv_in, self.conv1 = F.SparseConv3d(c_in, c, 3), F.SparseConv3d(c, c, 3)
        self.down, self.coarse_conv = F.SparseConv3d(c, c, 2), F.SparseConv3d(c, c, 3)
        self.up = F.SparseConv3d(c, c, 2)
        self.conv_out = F.SparseConv3d(2 * c, c_out, 3)

    def grids(self):
        """Return the fine grid (voxels of the points) and the coarse one (its stride-2 conv grid)."""
        fine = F.gridbatch_from_points(F.jagged_tensors(self.points), self.voxel_size, 0.0)
        return fine, F.conv_grid(fine, 2, 2)

    def maps(self) -> dict:
        """Return the grids and every kernel and pooling map the layers read (built once per pair)."""
        fine, coarse = self.grids()
        return {"same_fine": F.sparse_conv_kernel_map(fine, fine, 3),  # read by the three fine-level convs
                "same_coarse": F.sparse_conv_kernel_map(coarse, coarse, 3),
                "down": F.sparse_conv_kernel_map(fine, coarse, 2, 2),
                "pool": F.pooling_map(fine, coarse, 2),
                "up": F.sparse_conv_kernel_map(coarse, fine, 2, 2, transposed=True),
                "parent": F.refine_map(coarse, fine, 2)}

    def layers(self, x: torch.Tensor, m: dict) -> torch.Tensor:
        h = torch.relu(self.conv_in(x, m["same_fine"]))
        h = torch.relu(self.conv1(h, m["same_fine"]))
        d = torch.relu(self.down(h, m["down"])) + F.pool_over_map("MaxPool", h, m["pool"])
        d = torch.relu(self.coarse_conv(d, m["same_coarse"]))
        u = torch.relu(self.up(d, m["up"])) + F.pool_over_map("Refine", d, m["parent"])
        return self.conv_out(torch.cat([u, h], dim=1), m["same_fine"])  # the skip connection

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x, self.maps())


class GridInputUNet(SparseUNet):
    """SparseUNet's layers over a fine grid and its coarse level given as inputs: forward(x, *fine,
    *coarse), seven bundle tensors each, any size (the maps are built from them per call)."""

    def forward(self, x: torch.Tensor, *grids) -> torch.Tensor:
        fine, coarse = grids[:7], grids[7:]
        return self.layers(x, {"same_fine": F.sparse_conv_kernel_map(fine, fine, 3),
                               "same_coarse": F.sparse_conv_kernel_map(coarse, coarse, 3),
                               "down": F.sparse_conv_kernel_map(fine, coarse, 2, 2),
                               "pool": F.pooling_map(fine, coarse, 2),
                               "up": F.sparse_conv_kernel_map(coarse, fine, 2, 2, transposed=True),
                               "parent": F.refine_map(coarse, fine, 2)})


class FineGridUNet(SparseUNet):
    """SparseUNet's layers over a fine grid given as an input, any size: forward(x, *fine). The coarse
    level is fVDB's stride-2 conv grid of it, made inside the model; luisaml runs that op when a run
    binds a new grid (luisaml/fvdb/host_steps.py: on the device on CUDA, the host's builder on the CPU
    backend), and everything else in the kernels."""

    def forward(self, x: torch.Tensor, *fine) -> torch.Tensor:
        coarse = F.conv_grid(fine, 2, 2)
        return GridInputUNet.forward(self, x, *fine, *coarse)


GRID_PARTS = ("grid_blob", "leaf_batch_indices", "list_indices")  # the bundle tensors that grow with the grid


def grid_pair(points: np.ndarray, voxel_size: float) -> tuple[tuple, tuple]:
    """The fine grid of a point cloud and its stride-2 coarse level, as bundle tensors."""
    fine = F.gridbatch_from_points(F.jagged_tensors(torch.from_numpy(points)), voxel_size, 0.0)
    return fine, F.conv_grid(fine, 2, 2)


def grid_feeds(x: torch.Tensor, fine, coarse) -> dict:
    from luisaml.opsets.fvdb import BUNDLE

    return {"features": x.numpy(), **{f"fine_{n}": t.numpy() for n, t in zip(BUNDLE, fine)},
            **{f"coarse_{n}": t.numpy() for n, t in zip(BUNDLE, coarse)}}


def fine_feeds(x: torch.Tensor, fine) -> dict:
    from luisaml.opsets.fvdb import BUNDLE

    return {"features": x.numpy(), **{f"fine_{n}": t.numpy() for n, t in zip(BUNDLE, fine)}}


def export_fine_grid_unet(model: FineGridUNet, x: torch.Tensor, fine) -> onnx.ModelProto:
    """Export with the features' rows and the fine grid's growing parts dynamic."""
    from luisaml.opsets.fvdb import BUNDLE

    names = ["features"] + [f"fine_{n}" for n in BUNDLE]
    dynamic = {"features": {0: "voxels"}, **{f"fine_{n}": {0: f"fine_{n}_rows"} for n in GRID_PARTS}}
    buf = io.BytesIO()
    F.export_onnx(model, (x, *fine), buf, input_names=names, output_names=["out"], dynamic_axes=dynamic)
    return onnx.load_from_string(buf.getvalue())


def export_grid_input_unet(model: GridInputUNet, x: torch.Tensor, fine, coarse) -> onnx.ModelProto:
    """Export with the features' rows and the grids' growing parts dynamic."""
    from luisaml.opsets.fvdb import BUNDLE

    names = ["features"] + [f"{lv}_{n}" for lv in ("fine", "coarse") for n in BUNDLE]
    dynamic = {"features": {0: "voxels"},
               **{f"{lv}_{n}": {0: f"{lv}_{n}_rows"} for lv in ("fine", "coarse") for n in GRID_PARTS}}
    buf = io.BytesIO()
    F.export_onnx(model, (x, *fine, *coarse), buf, input_names=names, output_names=["out"], dynamic_axes=dynamic)
    return onnx.load_from_string(buf.getvalue())


def any_grid(cfg: Settings = Settings(), clouds: int = 3, verbose: bool = True) -> dict:
    """Compile GridInputUNet once and run it on `clouds` point clouds of different sizes, each against
    the torch module; return what the test checks and the timings."""
    rng = np.random.default_rng(cfg.seed)
    torch.manual_seed(cfg.seed)
    model = FineGridUNet(sphere_points(8, rng), cfg.voxel_size, cfg.in_channels, cfg.channels,
                         cfg.out_channels).eval()
    fine, _ = grid_pair(sphere_points(cfg.points, rng), cfg.voxel_size)
    t0 = time.perf_counter()
    net = luisaml.compile(export_fine_grid_unet(model, torch.zeros(int(fine[5][-1]), cfg.in_channels), fine))
    result = {"compile_s": time.perf_counter() - t0, "clouds": [], "backend": net.backend}
    for k in range(clouds):
        points = sphere_points(int(cfg.points * (0.5 + k)), rng)  # a new scan, another size
        fine, coarse = grid_pair(points, cfg.voxel_size)  # (the coarse grid: only its size is printed)
        x = torch.from_numpy(rng.standard_normal((int(fine[5][-1]), cfg.in_channels)).astype(np.float32))
        feeds = fine_feeds(x, fine)
        t1 = time.perf_counter()
        got = net.run(feeds)["out"]  # the first run of a grid also builds its coarse level
        first_s = time.perf_counter() - t1
        with torch.no_grad():
            want = model(x, *fine).numpy()
        row = {"points": len(points), "fine_voxels": int(fine[5][-1]), "coarse_voxels": int(coarse[5][-1]),
               "max_rel_diff_vs_torch": float(np.abs(got - want).max()) / max(float(np.abs(want).max()), 1e-30),
               "luisaml_first_run_s": first_s,  # (the grid new: its coarse level built first)
               "luisaml_run_s": _best_of(lambda: net.run(feeds), cfg.repeats),
               "torch_s": _best_of(lambda: model(x, *fine), cfg.repeats)}
        result["clouds"].append(row)
        if verbose:
            print(f"cloud {k}: {row['points']} points, {row['fine_voxels']} fine / {row['coarse_voxels']} coarse "
                  f"voxels: max relative difference vs torch {row['max_rel_diff_vs_torch']:.2e}; luisaml "
                  f"{row['luisaml_first_run_s'] * 1e3:.1f} ms the first run of this grid, then "
                  f"{row['luisaml_run_s'] * 1e3:.1f} ms on {net.backend}, torch (CPU, maps built per call) "
                  f"{row['torch_s'] * 1e3:.1f} ms")
    if verbose:
        print(f"one network for all of them, compiled once in {result['compile_s']:.2f} s")
    return result


def _best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(cfg: Settings = Settings(), verbose: bool = True) -> dict:
    """Build, export, compile and run the U-Net; return what the test checks and the timings."""
    rng = np.random.default_rng(cfg.seed)
    torch.manual_seed(cfg.seed)
    model = SparseUNet(sphere_points(cfg.points, rng), cfg.voxel_size, cfg.in_channels, cfg.channels,
                       cfg.out_channels).eval()
    fine, coarse = model.grids()
    n_fine, n_coarse = int(fine[5][-1]), int(coarse[5][-1])
    x = torch.from_numpy(rng.standard_normal((n_fine, cfg.in_channels)).astype(np.float32))

    buf = io.BytesIO()
    F.export_onnx(model, (x,), buf, input_names=["features"], output_names=["out"])
    proto = onnx.load_from_string(buf.getvalue())
    t0 = time.perf_counter()
    net = luisaml.compile(proto, batch_axis=None)
    compile_s = time.perf_counter() - t0

    got = net.run({"features": x.numpy()})["out"]  # the first run builds the kernels
    with torch.no_grad():
        want = model(x).numpy()
        maps = model.maps()
    scale = max(float(np.abs(want).max()), 1e-30)
    result = {
        "fine_voxels": n_fine,
        "coarse_voxels": n_coarse,
        "ops": [n.op_type for n, _ in net.plan.ops],
        "onnx_ops": sorted({n.op_type for n in proto.graph.node if n.domain == "fvdb"}),
        "max_rel_diff_vs_torch": float(np.abs(got - want).max()) / scale,
        "compile_s": compile_s,
        "luisaml_run_s": _best_of(lambda: net.run({"features": x.numpy()}), cfg.repeats),
        "torch_s": _best_of(lambda: model(x), cfg.repeats),  # grids and maps rebuilt on the host per call
        "torch_layers_s": _best_of(lambda: model.layers(x, maps), cfg.repeats),  # with the maps built once
        "backend": net.backend,
    }
    if verbose:
        print(f"grid from {cfg.points} points: {n_fine} fine voxels, {n_coarse} coarse voxels; "
              f"{cfg.in_channels}->{cfg.channels}->{cfg.out_channels} channels")
        print(f"exported fvdb ops: {', '.join(result['onnx_ops'])}")
        print(f"compiled ops (grids and maps folded): {', '.join(result['ops'])}")
        print(f"max relative difference vs torch: {result['max_rel_diff_vs_torch']:.2e}")
        print(f"compile {compile_s:.2f} s; run on {net.backend}: luisaml {result['luisaml_run_s'] * 1e3:.1f} ms; "
              f"torch (CPU) {result['torch_layers_s'] * 1e3:.1f} ms with the maps built once, "
              f"{result['torch_s'] * 1e3:.1f} ms building grids and maps per call (best of {cfg.repeats})")
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", type=int, default=Settings.points)
    ap.add_argument("--voxel-size", type=float, default=Settings.voxel_size)
    ap.add_argument("--channels", type=int, default=Settings.channels)
    ap.add_argument("--any-grid", action="store_true", help="grids as inputs of any size: one network, several clouds")
    args = ap.parse_args()
    settings = Settings(points=args.points, voxel_size=args.voxel_size, channels=args.channels)
    any_grid(settings) if args.any_grid else main(settings)
