"""NetworkInstance: the C++ LuisaML API (set_model, set_input, set_output, set_weight_buffer, forward)."""
import numpy as np
import pytest
import torch

import luisaml


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 3))
    path = tmp_path_factory.mktemp("ni") / "m.onnx"
    torch.onnx.export(m, (torch.zeros(2, 6),), str(path), dynamo=False, input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "n"}, "y": {0: "n"}})
    return path, m


def test_forward_fills_bound_output(model_path):
    path, m = model_path
    inst = luisaml.NetworkInstance()
    inst.set_model(path)
    inst.set_warp_size(1)
    x = np.random.default_rng(0).standard_normal((5, 6)).astype(np.float32)
    y = np.zeros((5, 3), np.float32)
    inst.set_input("x", x)
    inst.set_output("y", y)
    inst.forward()
    np.testing.assert_allclose(y, m(torch.from_numpy(x)).detach().numpy(), rtol=1e-5, atol=1e-6)


def test_unbound_input_and_bad_output_are_errors(model_path):
    path, _ = model_path
    inst = luisaml.NetworkInstance(path)
    with pytest.raises(RuntimeError, match=r"input\(s\) \['x'\] are not bound"):
        inst.forward()
    with pytest.raises(KeyError, match="'z' is not an input"):
        inst.set_input("z", np.zeros(1))
    inst.set_input("x", np.zeros((2, 6), np.float32))
    inst.set_output("y", np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match=r"output 'y': bound array is float32\[2, 4\], the network produces float32\[2, 3\]"):
        inst.forward()


def test_set_weight_buffer_swaps_weights_without_recompiling(model_path):
    path, m = model_path
    net = luisaml.compile(path)
    inst = luisaml.NetworkInstance(net)
    x = np.random.default_rng(1).standard_normal((4, 6)).astype(np.float32)
    inst.set_input("x", x)
    before = inst.forward()["y"]
    # scale every weight of the blob by 2: each Linear layer doubles, so y = 4*W2 relu(W1 x + b1) + 2*b2
    layout = net.weight_layout
    blob = bytearray(net.weight_bytes())
    for name, (off, n, dtype, shape) in layout.items():
        arr = np.frombuffer(blob, np.float32, n // 4, off) * 2
        blob[off:off + n] = arr.tobytes()
    inst.set_weight_buffer(bytes(blob))
    after = inst.forward()["y"]
    with torch.no_grad():
        lin1, lin2 = m[0], m[2]
        h = torch.relu(2 * lin1(torch.from_numpy(x)))
        want = 2 * (h @ lin2.weight.T + lin2.bias)
    np.testing.assert_allclose(after, want.numpy(), rtol=1e-5, atol=1e-5)
    assert not np.allclose(before, after)
    with pytest.raises(ValueError, match="weight buffer has 8 bytes"):
        inst.set_weight_buffer(b"\0" * 8)


def test_warp_size_one_turns_off_the_cooperative_kernel(model_path):
    path, m = model_path
    inst = luisaml.NetworkInstance(path, fuse=True)  # fuse=True: the fused kernel, emulated on the CPU
    assert inst.net.plan.fused is not None
    inst.set_warp_size(1)
    assert inst.net.plan.fused is None
    x = np.random.default_rng(2).standard_normal((3, 6)).astype(np.float32)
    inst.set_input("x", x)
    np.testing.assert_allclose(inst.forward()["y"], m(torch.from_numpy(x)).detach().numpy(), rtol=1e-5, atol=1e-6)
    inst.set_warp_size(32)
    assert inst.net.plan.fused is not None


def test_a_read_only_output_binding_is_an_input_error_naming_the_output(model_path):
    """issue 25: a read-only array bound with set_output surfaced numpy's "assignment destination is read-only"
    from forward(); it is refused by name at set_output, and again at forward if it became read-only since.
    A writable binding is then filled as torch computes it."""
    from luisaml.errors import InputError

    path, m = model_path
    inst = luisaml.NetworkInstance(path)
    x = np.random.default_rng(1).standard_normal((2, 6)).astype(np.float32)
    inst.set_input("x", x)
    frozen = np.zeros((2, 3), np.float32)
    frozen.flags.writeable = False
    with pytest.raises(InputError, match=r"output 'y': the bound array is read-only"):
        inst.set_output("y", frozen)
    with pytest.raises(InputError, match=r"output 'y': set_output takes a numpy array or torch tensor .* got list"):
        inst.set_output("y", [[0.0] * 3] * 2)
    y = np.zeros((2, 3), np.float32)
    inst.set_output("y", y)
    y.flags.writeable = False
    with pytest.raises(InputError, match=r"output 'y': the bound array is read-only"):
        inst.forward()
    y.flags.writeable = True
    inst.forward()
    np.testing.assert_allclose(y, m(torch.from_numpy(x)).detach().numpy(), rtol=1e-5, atol=1e-6)
