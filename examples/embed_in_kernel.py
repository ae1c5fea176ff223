"""Call a compiled network from your own LuisaCompute kernel.

A small MLP maps a 2-D position to an RGB colour (a "neural image"). Instead of net.run, a user
kernel computes each pixel's input itself, calls the network's @luisa.func `forward`, and writes
the colour; the result equals net.run on the same inputs. Run: python examples/embed_in_kernel.py
"""
import os
import sys
import tempfile

import luisa
import numpy as np
import torch

import luisaml

WIDTH, HEIGHT = 96, 64


def make_model(path: str) -> torch.nn.Module:
    """Export a random 2 -> 3 MLP with a dynamic batch dimension."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(2, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                            torch.nn.Linear(32, 3), torch.nn.Sigmoid())
    torch.onnx.export(m, (torch.zeros(2, 2),), path, dynamo=False, input_names=["uv"], output_names=["rgb"],
                      dynamic_axes={"uv": {0: "n"}, "rgb": {0: "n"}})
    return m


# Names a @luisa.func uses must be plain module globals: bind them after compiling.
forward = UV = RGB = None


@luisa.func
def shade(image, weights):
    """One thread per pixel: uv in [-1, 1]^2 -> network -> colour."""
    p = dispatch_id().xy
    uv = UV()
    uv[0] = (float(p.x) + 0.5) / float(dispatch_size().x) * 2.0 - 1.0
    uv[1] = (float(p.y) + 0.5) / float(dispatch_size().y) * 2.0 - 1.0
    rgb = RGB()
    forward(uv, rgb, weights)
    image.write(p.y * dispatch_size().x + p.x, make_float4(rgb[0], rgb[1], rgb[2], 1.0))


def render(net) -> np.ndarray:
    """Return the HEIGHT x WIDTH x 3 image the user kernel computes."""
    global forward, UV, RGB
    forward, UV, RGB = net.forward, net.input_type("uv"), net.output_type("rgb")
    image = luisa.Buffer(WIDTH * HEIGHT, luisa.float4)
    shade(image, net.weights, dispatch_size=(WIDTH, HEIGHT))
    out = np.empty((HEIGHT * WIDTH, 4), np.float32)
    image.copy_to(out)
    return out[:, :3].reshape(HEIGHT, WIDTH, 3)


def grid_inputs() -> np.ndarray:
    ys, xs = np.mgrid[0:HEIGHT, 0:WIDTH].astype(np.float32)
    u = (xs + 0.5) / WIDTH * 2 - 1
    v = (ys + 0.5) / HEIGHT * 2 - 1
    return np.stack([u, v], -1).reshape(-1, 2).astype(np.float32)


def main(out_dir: str) -> tuple[float, float]:
    """Render, compare, write the picture; return (the largest difference from net.run's per-sample
    kernel, which runs `forward` itself: 0; the largest difference from net.run's stages, which
    sum the same products in another order: float rounding)."""
    path = os.path.join(out_dir, "neural_image.onnx")
    model = make_model(path)
    net = luisaml.compile(path)
    image = render(net)
    stages = net.run({"uv": grid_inputs()})["rgb"].reshape(HEIGHT, WIDTH, 3)
    per_sample = luisaml.compile(path, schedule="per-sample").run({"uv": grid_inputs()})["rgb"].reshape(HEIGHT, WIDTH, 3)
    exact, close = float(np.abs(image - per_sample).max()), float(np.abs(image - stages).max())
    torch_ref = model(torch.from_numpy(grid_inputs())).detach().numpy().reshape(HEIGHT, WIDTH, 3)
    print(f"user kernel vs net.run, per-sample kernel: largest difference {exact:.3g}")
    print(f"user kernel vs net.run, stages:            largest difference {close:.3g}")
    print(f"user kernel vs torch:                      largest difference {np.abs(image - torch_ref).max():.3g}")
    from PIL import Image

    png = os.path.join(out_dir, "neural_image.png")
    Image.fromarray((np.clip(image, 0.0, 1.0) * 255 + 0.5).astype(np.uint8)).save(png)
    print(f"wrote {png}")
    return exact, close


if __name__ == "__main__":
    exact, close = main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())
    sys.exit(0 if exact == 0.0 and close < 1e-5 else 1)
