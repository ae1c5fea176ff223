"""Large intermediates live in device scratch memory, pooled by the allocator, a region per sample."""
import numpy as np
import torch

import luisaml
from luisaml.lowering import LOCAL_LIMIT


def test_wide_mlp_uses_scratch_and_matches_torch(tmp_path):
    torch.manual_seed(0)
    wide = LOCAL_LIMIT + 8
    m = torch.nn.Sequential(torch.nn.Linear(3, wide), torch.nn.ReLU(), torch.nn.Linear(wide, 16), torch.nn.ReLU(),
                            torch.nn.Linear(16, wide), torch.nn.Tanh(), torch.nn.Linear(wide, 2))
    path = tmp_path / "wide.onnx"
    torch.onnx.export(m, (torch.zeros(2, 3),), str(path), dynamo=False, input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "n"}, "y": {0: "n"}})
    net = luisaml.compile(path)
    spaces = {s.space for s in net.allocation.slots}
    assert spaces == {"local", "scratch"}, net.allocation.report()
    per_sample, offsets = net.plan.scratch["float"]
    assert per_sample == wide  # the two wide activations are never live together: one region
    x = torch.randn(5, 3)
    np.testing.assert_allclose(net.run({"x": x.numpy()})["y"], m(x).detach().numpy(), rtol=1e-4, atol=1e-5)
