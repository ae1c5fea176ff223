"""A fast run of examples/neural_sdf.py: narrow-band grid, torch training through the fvdb torch functions,
export with fvdb.* nodes, luisaml compile, and a user kernel that sphere-traces the field via net.forward."""
import numpy as np
import pytest

from util import example_module


@pytest.fixture(scope="module")
def example():
    with example_module("neural_sdf.py") as module:
        yield module


def test_neural_sdf_trains_compiles_and_renders(example, tmp_path):
    cfg = example.Settings(resolution=24, steps=80, batch=2048, image=48, march_steps=48)
    r = example.main(str(tmp_path), cfg)
    assert r["loss_last"] < r["loss_first"] / 3  # it learned
    assert r["mean_abs_error_vs_shape"] < 0.25 * 2.0 / cfg.resolution  # within a quarter voxel of the shape
    assert r["max_diff_vs_torch"] < 1e-5 and r["inside_equal"]  # the compiled network is the torch model
    image = r["image"]
    assert image.shape == (48, 48, 3)
    background = image[0, 0]
    hit = np.abs(image - background).max(axis=2) > 0.1
    assert hit[24, 24] and not hit[0, -1] and 0.15 < hit.mean() < 0.8  # the shape in the middle, sky around it
    from PIL import Image

    with Image.open(r["png"]) as png:  # the image as 8-bit RGB, as Pillow reads the file back
        assert png.format == "PNG"
        np.testing.assert_array_equal(np.asarray(png), (np.clip(image, 0, 1) * 255 + 0.5).astype(np.uint8))
