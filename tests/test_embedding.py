"""Embedding: a user kernel declares the network's arrays, calls `forward`, and gets net.run's numbers."""

import luisa
import numpy as np
import torch

import luisaml



def test_example_user_kernel_equals_net_run(tmp_path):
    import embed_in_kernel

    exact, close = embed_in_kernel.main(str(tmp_path))
    assert exact == 0.0  # the per-sample kernel runs `forward` itself: bit for bit
    assert close < 1e-5  # the stages sum in another order
    from PIL import Image

    with Image.open(tmp_path / "neural_image.png") as png:  # a PNG Pillow reads, of the image's size
        assert png.format == "PNG" and png.mode == "RGB" and png.size == (embed_in_kernel.WIDTH, embed_in_kernel.HEIGHT)


# a kernel over a batch buffer, with a shared (non-batched) input passed as a buffer
forward = X = Y = S = None


@luisa.func
def user_kernel(xs, scale, ys, weights):
    i = dispatch_id().x
    x = X()
    for k in range(4):
        x[k] = xs.read(i * 4 + k)
    y = Y()
    forward(x, scale, y, weights)
    for k in range(2):
        ys.write(i * 2 + k, y[k] * 10.0)


def test_shared_input_is_a_buffer(tmp_path):
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l = torch.nn.Linear(4, 2)

        def forward(self, x, scale):
            return self.l(x * scale)

    torch.manual_seed(0)
    m = M()
    path = tmp_path / "m.onnx"
    torch.onnx.export(m, (torch.zeros(2, 4), torch.ones(4)), str(path), dynamo=False, input_names=["x", "scale"],
                      output_names=["y"], dynamic_axes={"x": {0: "n"}, "y": {0: "n"}})
    net = luisaml.compile(path)
    global forward, X, Y, S
    forward, X, Y = net.forward, net.input_type("x"), net.output_type("y")
    assert net.input_type("scale") == luisa.BufferType(float)
    xs = np.random.default_rng(1).standard_normal((9, 4)).astype(np.float32)
    scale = np.array([1.0, -2.0, 0.5, 3.0], np.float32)
    bx, bs, by = luisa.Buffer.from_array(xs.reshape(-1)), luisa.Buffer.from_array(scale), luisa.Buffer(18, float)
    user_kernel(bx, bs, by, net.weights, dispatch_size=9)
    got = by.numpy().reshape(9, 2) / 10.0
    np.testing.assert_allclose(got, net.run({"x": xs, "scale": scale})["y"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got, m(torch.from_numpy(xs), torch.from_numpy(scale)).detach().numpy(), rtol=1e-5, atol=1e-6)
