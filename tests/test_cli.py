"""The command line: run (with --compare), inspect, emit."""
import numpy as np
import torch

from luisaml.cli import main


def _export(tmp_path):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 2))
    path = tmp_path / "m.onnx"
    torch.onnx.export(m, (torch.zeros(2, 5),), str(path), dynamo=False, input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "n"}, "y": {0: "n"}})
    return path, m


def test_run_prints_outputs_and_matches_onnxruntime(tmp_path, capsys):
    path, m = _export(tmp_path)
    x = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    assert main(["run", str(path), "--input", f"x={tmp_path / 'x.npy'}", "--compare", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "y: float32[3, 2]" in out
    diff = float(out.split("largest difference from onnxruntime: ")[1].split()[0])
    assert diff < 1e-5
    np.testing.assert_allclose(np.load(tmp_path / "out" / "y.npy"), m(torch.from_numpy(x)).detach().numpy(), rtol=1e-5, atol=1e-6)


def test_inspect_and_emit(tmp_path, capsys):
    path, _ = _export(tmp_path)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "'x': float[n, 5]" in out and "Gemm" in out and "register allocation: 1 slot, 28 bytes" in out
    assert main(["emit", str(path)]) == 0
    src = capsys.readouterr().out
    assert "def forward(" in src and "def batch_kernel(" in src


def test_inspect_lists_unsupported_nodes(tmp_path, capsys):
    import onnx
    from onnx import TensorProto, helper

    g = helper.make_graph([helper.make_node("NotAnOp", ["x"], ["y"], name="mystery", domain="acme")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("acme", 1)]),
              tmp_path / "u.onnx")
    assert main(["inspect", str(tmp_path / "u.onnx")]) == 1
    assert "node 'mystery' (acme::NotAnOp)" in capsys.readouterr().out
