"""Shared fixtures for the fVDB host tests: warp-lang (CPU) as the outside NanoVDB reference."""

from __future__ import annotations

import numpy as np
import pytest

try:  # warp is the outside reference; its tests skip cleanly where it is not installed
    import warp as wp
except ImportError:  # pragma: no cover - exercised only without warp
    wp = None

def assert_floats_equal(got, want, err_msg: str = "") -> None:
    """Equal to the last bit on the CPU backend (the same float32 operations in the same order);
    within a few ulps on CUDA, whose compiler contracts multiply-adds into FMAs."""
    import os

    if os.environ.get("LUISAML_BACKEND", "cpu") == "cuda":
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=err_msg)
    else:
        np.testing.assert_array_equal(got, want, err_msg=err_msg)


if wp is not None:
    wp.config.quiet = True

    @wp.kernel
    def _lookup_index_kernel(volume: wp.uint64, ijk: wp.array(dtype=wp.vec3i), out: wp.array(dtype=wp.int64)):
        t = wp.tid()
        c = ijk[t]
        out[t] = wp.int64(wp.volume_lookup_index(volume, c[0], c[1], c[2]))


class WarpRef:
    """Thin wrapper over warp's CPU NanoVDB support, used as the reference reader and writer."""

    def __init__(self) -> None:
        wp.init()
        self.wp = wp
        self.device = "cpu"

    def volume_from_ijk(self, ijk: np.ndarray, voxel_size: float = 1.0, translation=(0.0, 0.0, 0.0)):
        """Return a warp OnIndex Volume built by warp's own host builder from ijk."""
        arr = wp.array(np.ascontiguousarray(ijk, np.int32), dtype=wp.vec3i, device=self.device)
        return wp.Volume.allocate_by_voxels(
            arr, voxel_size=voxel_size, translation=translation, device=self.device
        )

    def volume_from_tiles(self, tiles: np.ndarray, voxel_size: float = 1.0):
        """Return a warp Index Volume (every voxel of each 8^3 tile) from index-space tile points."""
        arr = wp.array(np.ascontiguousarray(tiles, np.int32), dtype=wp.vec3i, device=self.device)
        return wp.Volume.allocate_by_tiles(arr, voxel_size=voxel_size, bg_value=None, device=self.device)

    def load_nvdb(self, data: bytes):
        """Return warp's Volume for .nvdb file bytes (warp validates the grids on the way in)."""
        return wp.Volume.load_from_nvdb(data)

    def volume_bytes(self, vol) -> bytes:
        """Return the raw grid bytes of a warp Volume."""
        return vol.array().numpy().tobytes()

    def lookup_index(self, vol, ijk: np.ndarray) -> np.ndarray:
        """Return warp's volume_lookup_index (int64, -1 inactive) at each ijk, run in a CPU kernel."""
        ijk = np.ascontiguousarray(ijk, np.int32)
        out = wp.zeros(len(ijk), dtype=wp.int64, device=self.device)
        if len(ijk):
            src = wp.array(ijk, dtype=wp.vec3i, device=self.device)
            wp.launch(_lookup_index_kernel, dim=len(ijk), inputs=[vol.id, src, out], device=self.device)
        return out.numpy()


@pytest.fixture(scope="session")
def warp_ref() -> WarpRef:
    """Return the warp reference, skipping the test when warp-lang cannot be imported."""
    if wp is None:
        pytest.skip("warp-lang is not installed (pip install warp-lang)")
    return WarpRef()


def _random_voxels(
    rng: np.random.Generator, n_near: int = 2000, n_far: int = 200, spread: int = 20000
) -> np.ndarray:
    """Return int32 ijk: a cluster around the origin (negatives included) plus far voxels in other root tiles."""
    near = rng.integers(-200, 200, (n_near, 3))
    far = rng.integers(-spread, spread, (n_far, 3))
    corners = np.array([[-4097, 0, 0], [4096, 4095, -1], [-1, -4096, 8191], [0, 0, 0], [7, 7, 7]])
    return np.concatenate([near, far, corners]).astype(np.int32)


def _probes_around(ijk: np.ndarray, rng: np.random.Generator, n_random: int = 3000) -> np.ndarray:
    """Return lookup probes: every voxel, its +-1 neighbours along each axis, and random points."""
    steps = np.array([[1, 0, 0], [-1, 0, 0], [0, 1, 0], [0, -1, 0], [0, 0, 1], [0, 0, -1], [9, -9, 130]])
    neighbours = (ijk[:, None, :].astype(np.int64) + steps[None]).reshape(-1, 3)
    far = rng.integers(-30000, 30000, (n_random, 3))
    extremes = np.array([[2**31 - 1] * 3, [-(2**31)] * 3, [2**31 - 1, -(2**31), 0]])
    return np.clip(np.concatenate([ijk, neighbours, far, extremes]), -(2**31), 2**31 - 1).astype(np.int32)


@pytest.fixture
def random_voxels():
    """Return the voxel-set generator (rng, n_near, n_far, spread) -> int32 [N,3]."""
    return _random_voxels


@pytest.fixture
def probes_around():
    """Return the probe generator (ijk, rng, n_random) -> int32 [M,3]."""
    return _probes_around
