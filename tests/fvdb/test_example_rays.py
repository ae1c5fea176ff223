"""A small run of examples/ray_marched_field.py: the neural SDF's narrow band walked by fvdb.SegmentsAlongRays
(one ray per pixel), the field marched inside the spans only, the hits shaded."""
import numpy as np
import pytest

from luisaml.fvdb import JaggedTensor

from fvdb_reference import segments_along_rays
from util import example_module


@pytest.fixture(scope="module")
def example():
    with example_module("ray_marched_field.py") as module:
        yield module


def test_ray_marched_field_walks_the_band_and_hits_the_shape(example, tmp_path):
    sdf = example.neural_sdf.Settings(resolution=24, steps=80, batch=2048)
    r = example.main(str(tmp_path), example.Settings(sdf=sdf, image=48, march_steps=48))
    offsets, spans, origins, directions = r["offsets"], r["spans"], r["origins"], r["directions"]
    # the spans against the numpy reference walk, on every other ray
    sample = np.arange(0, len(origins), 2)
    ref = segments_along_rays(r["grid"], JaggedTensor.from_list([origins[sample]]),
                              JaggedTensor.from_list([directions[sample]]), eps=example.SPAN_EPS)
    assert sum(map(len, ref)) > 100
    for ray, want in zip(sample, ref):
        got = spans[offsets[ray]:offsets[ray + 1]]
        np.testing.assert_allclose(got, np.array(want).reshape(-1, 2), rtol=2e-5, atol=2e-5, err_msg=f"ray {ray}")
    # every hit lies on the analytic surface (within a quarter voxel) and inside one of its ray's spans
    h = 2.0 / sdf.resolution
    assert r["hits"] > 200
    assert np.abs(example.neural_sdf.shape_sdf(r["hit_points"])).max() < 0.25 * h
    for ray in np.flatnonzero(r["hit"]):
        mine = spans[offsets[ray]:offsets[ray + 1]]
        assert ((mine[:, 0] <= r["t"][ray]) & (r["t"][ray] <= mine[:, 1] + example.MIN_STEP)).any(), f"ray {ray}"
    image = r["image"]
    assert image.shape == (48, 48, 3)
    background = image[0, 0]
    hit = np.abs(image - background).max(axis=2) > 0.1
    assert hit[24, 24] and not hit[0, -1]  # the shape in the middle, sky around it
    from PIL import Image

    with Image.open(r["png"]) as png:  # the image as 8-bit RGB, as Pillow reads the file back
        assert png.format == "PNG"
        np.testing.assert_array_equal(np.asarray(png), (np.clip(image, 0, 1) * 255 + 0.5).astype(np.uint8))
