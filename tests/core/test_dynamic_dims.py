"""Dynamic dimensions besides the batch (luisaml/per_shape.py): a model exported with a dynamic
sequence length or image size compiles with defaults and runs at each shape it is fed, against
onnxruntime; inputs disagreeing on a shared dimension, the bound on the specialisations kept, and
what needs one shape (a plan, `forward`, save) saying how to fix one."""
from __future__ import annotations

import math

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn

import luisaml
from luisaml import CompiledNetwork, NetworkInstance, PerBatchNetwork, PerShapeNetwork, per_shape
from luisaml.errors import InputError, ModelError, UsageError


class _Bert(nn.Module):
    """A BERT-like encoder block: token and position embeddings (the positions sliced to the
    sequence's length), masked multi-head attention, layer norms and a GELU feed-forward.
    seq_first: attention over [S, B, ...] as nn.MultiheadAttention does (the batch moves)."""

    def __init__(self, seq_first: bool, vocab=50, d=16, heads=2, max_len=32):
        super().__init__()
        self.seq_first, self.heads, self.d = seq_first, heads, d
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(max_len, d) * 0.1)
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.ffn = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, ids, mask):
        b, s = ids.shape
        x = self.tok(ids) + self.pos[:s]
        d, dh = self.d, self.d // self.heads
        h = x.transpose(0, 1) if self.seq_first else x
        q, k, v = self.qkv(h).chunk(3, -1)
        if self.seq_first:  # [S, B, D] -> [B, heads, S, dh]
            q, k, v = (t.reshape(s, b, self.heads, dh).permute(1, 2, 0, 3) for t in (q, k, v))
        else:
            q, k, v = (t.reshape(b, s, self.heads, dh).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(dh) + (1.0 - mask[:, None, None, :]) * -1e4
        o = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, s, d)
        x = self.ln1(x + self.out(o))
        return self.ln2(x + self.ffn(x))


def _export_bert(path, seq_first=False) -> str:
    torch.manual_seed(0)
    ids, mask = torch.randint(0, 50, (2, 8)), torch.ones(2, 8)
    torch.onnx.export(_Bert(seq_first).eval(), (ids, mask), str(path), dynamo=False, input_names=["ids", "mask"],
                      output_names=["y"], opset_version=17,
                      dynamic_axes={"ids": {0: "batch", 1: "seq"}, "mask": {0: "batch", 1: "seq"},
                                    "y": {0: "batch", 1: "seq"}})
    return str(path)


def _bert_feeds(batch: int, seq: int, seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed + 97 * seq + batch)
    return {"ids": rng.integers(0, 50, (batch, seq)).astype(np.int64),
            "mask": (rng.random((batch, seq)) > 0.25).astype(np.float32)}


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return _export_bert(tmp_path_factory.mktemp("bert") / "bert.onnx")


@pytest.mark.parametrize("seq_first", [False, True], ids=["batch-first", "batch-moves"])
def test_bert_with_dynamic_batch_and_sequence_runs_at_each_shape(tmp_path, seq_first):
    path = _export_bert(tmp_path / "bert.onnx", seq_first)
    net = luisaml.compile(path)
    assert isinstance(net, PerShapeNetwork) and isinstance(net, CompiledNetwork)
    assert net.symbols == ("seq",) and net.batch_symbol == "batch"
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    shapes = [(2, 8), (5, 13), (5, 8), (2, 13)] if not seq_first else [(2, 8), (5, 13)]
    for batch, seq in shapes:
        feeds = _bert_feeds(batch, seq)
        got = net.run(feeds)["y"]
        assert got.shape == (batch, seq, 16)
        np.testing.assert_allclose(got, sess.run(None, feeds)[0], rtol=1e-4, atol=1e-5,
                                   err_msg=f"batch {batch}, seq {seq}")
    kept = net.specialisations
    assert sorted(kept) == [(("seq", 8),), (("seq", 13),)]  # one per sequence length: the batch is theirs
    # where the batch moves, each sequence length's network compiles per batch size in turn
    assert all(isinstance(n, PerBatchNetwork) == seq_first for n in kept.values())


def test_conv_net_with_dynamic_image_size_runs_at_two_sizes(tmp_path):
    torch.manual_seed(1)
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.ReLU(),
                      nn.Conv2d(8, 4, 1)).eval()
    path = str(tmp_path / "conv.onnx")
    torch.onnx.export(m, (torch.zeros(1, 3, 16, 16),), path, dynamo=False, input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "n", 2: "h", 3: "w"}, "y": {0: "n", 2: "oh", 3: "ow"}})
    net = luisaml.compile(path)
    assert net.symbols == ("h", "w")
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(3)
    for shape in [(2, 3, 16, 16), (3, 3, 12, 20)]:
        x = rng.standard_normal(shape).astype(np.float32)
        got = net.run({"x": x})["y"]
        np.testing.assert_allclose(got, sess.run(None, {"x": x})[0], rtol=1e-4, atol=1e-5, err_msg=str(shape))
    assert sorted(net.specialisations) == [(("h", 12), ("w", 20)), (("h", 16), ("w", 16))]


def test_inputs_that_disagree_on_a_shared_dimension_are_an_input_error(bert):
    net = luisaml.compile(bert)
    feeds = _bert_feeds(2, 8)
    feeds["mask"] = np.ones((2, 9), np.float32)
    with pytest.raises(InputError, match=r"inputs 'ids' and 'mask' disagree on dimension 'seq': 'ids' has 8 "
                                         r"\(axis 1 of \[2, 8\]\), 'mask' has 9 \(axis 1 of \[2, 9\]\)"):
        net.run(feeds)
    feeds["mask"] = np.ones((2, 8, 1), np.float32)
    with pytest.raises(InputError, match=r"input 'mask': expected rank 2 \(\[batch, seq\]\), got shape \[2, 8, 1\]"):
        net.run(feeds)
    with pytest.raises(luisaml.errors.InputNameError, match=r"missing input\(s\) \['mask'\]"):
        net.run({"ids": feeds["ids"]})
    assert net.specialisations == {}  # nothing compiled for feeds that were refused


def test_specialisations_kept_are_bounded_and_a_kept_one_is_not_compiled_again(bert):
    net = luisaml.compile(bert)
    assert net.specialisations_kept == per_shape.SPECIALISATIONS_KEPT == 8
    net.specialisations_kept = 2
    compiled = []
    compile_at = net._compile_at
    net._compile_at = lambda shapes: compiled.append(shapes["ids"][1]) or compile_at(shapes)
    sess = ort.InferenceSession(bert, providers=["CPUExecutionProvider"])
    for seq in (4, 5, 4, 6, 5, 4):
        feeds = _bert_feeds(3, seq)
        np.testing.assert_allclose(net.run(feeds)["y"], sess.run(None, feeds)[0], rtol=1e-4, atol=1e-5)
    # 4 and 5 compiled; 4 again kept; 6 drops 5 (run less recently than 4); 5 compiled again drops 4
    assert compiled == [4, 5, 6, 5, 4]
    assert list(net.specialisations) == [(("seq", 5),), (("seq", 4),)]  # least recently run first
    assert net.specialise(seq=5) is net.specialise(seq=5)


def test_what_needs_one_shape_says_how_to_fix_it(bert):
    net = luisaml.compile(bert)
    for what in (lambda: net.forward, lambda: net.plan, lambda: net.inputs, lambda: net.source):
        with pytest.raises(UsageError, match=r"exists for one shape: only the batch dimension 'batch' may be dynamic "
                                             r"there, and this network compiles per shape of seq \('ids' \[batch, "
                                             r"seq\], 'mask' \[batch, seq\]\); net\.specialise\(seq=\.\.\.\) "
                                             r"returns the network of one shape, or compile with input_shapes="):
            what()
    assert not hasattr(net, "plan") and getattr(net, "source", None) is None  # (an AttributeError too)
    with pytest.raises(UsageError, match=r"cannot save this network: only the batch dimension 'batch' may be "
                                         r"dynamic in an artifact, and this network compiles per shape of seq .*"
                                         r"net\.specialise\(seq=\.\.\.\) returns the network of one shape"):
        net.save("never.lml")
    with pytest.raises(UsageError, match=r"`inputs` exists for one shape: .* net\.specialise\(seq=\.\.\.\)"):
        NetworkInstance(net).set_input("ids", _bert_feeds(2, 8)["ids"])
    with pytest.raises(UsageError, match=r"a size for each dynamic dimension besides the batch, \['seq'\]; "
                                         r"unknown: \['length'\]"):
        net.specialise(length=8)
    one = net.specialise(seq=8)  # the network of one shape: a plan, a per-sample forward
    assert type(one) is CompiledNetwork and one.forward is not None
    assert [s.shape for s in one.inputs] == [("batch", 8), ("batch", 8)]
    feeds = _bert_feeds(4, 8)
    want = ort.InferenceSession(bert, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(one.run(feeds)["y"], want, rtol=1e-4, atol=1e-5)
    # input_shapes fixes the shape up front: one network; batch_axis=None keeps refusing dynamic dims
    fixed = luisaml.compile(bert, input_shapes={"ids": [None, 8], "mask": [None, 8]})
    assert type(fixed) is CompiledNetwork
    np.testing.assert_allclose(fixed.run(feeds)["y"], want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ModelError, match=r"inputs with dynamic dimensions: 'ids' \[batch, seq\]"):
        luisaml.compile(bert, batch_axis=None)
