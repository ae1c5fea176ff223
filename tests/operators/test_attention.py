"""Attention (opsets 23, 24, 25) against onnxruntime on random data: 4-D and 3-D inputs, grouped
query heads, different value head sizes, scale, softcap, causal masks, float and boolean masks of
every rank, the past/present cache, qk_matmul_output in its four modes, nonpad_kv_seqlen,
sliding windows, half, and per-sample execution. Where onnxruntime does not implement what the
specification says (a mask shorter than the keys, present outputs without a past cache), the
ONNX reference implementation is the reference."""

import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from util import assert_matches_ort, graph_model, ort_run, rand, value_info

import luisaml

INPUTS = ["Q", "K", "V", "attn_mask", "past_key", "past_value", "nonpad_kv_seqlen"]


def attention(k: int, feeds: dict[str, str], outputs=("Y",), **attrs):
    """Return Attention node k reading the named graph inputs by role (absent roles are empty);
    its outputs are suffixed with k ("" keeps an output out)."""
    ins = [feeds.get(role, "") for role in INPUTS]
    while ins[-1] == "":
        ins.pop()
    return helper.make_node("Attention", ins, [f"{o}{k}" if o else "" for o in outputs], name=f"Attention_{k}", **attrs)


def model(nodes, feeds, opset=23, batch=None):
    return graph_model(nodes, feeds, opset=opset, batch=batch)


def assert_matches_reference(m, feeds, rtol=1e-5, atol=1e-6, **compile_kw):
    """Compile and run, and compare every output with onnx's reference implementation."""
    got = luisaml.compile(m, batch_axis=None, **compile_kw).run(feeds)
    names = [o.name for o in m.graph.output]
    for name, want in zip(names, ReferenceEvaluator(m).run(names, feeds)):
        assert got[name].shape == want.shape, name
        np.testing.assert_allclose(got[name], want, rtol=rtol, atol=atol, err_msg=name)


def test_attention_4d_variants():
    """Plain, scaled, softcap, causal (also more queries than keys), grouped-query heads and a
    value head size that differs from the key's, in one graph."""
    f = {
        "q": rand((2, 3, 4, 8), seed=1), "k": rand((2, 3, 6, 8), seed=2), "v": rand((2, 3, 6, 8), seed=3),
        "q6": rand((2, 6, 4, 8), seed=4), "v10": rand((2, 3, 6, 10), seed=5), "q7": rand((2, 3, 7, 8), seed=6),
    }
    qkv = {"Q": "q", "K": "k", "V": "v"}
    nodes = [
        attention(0, qkv),
        attention(1, qkv, scale=0.05),
        attention(2, qkv, softcap=1.5),
        attention(3, qkv, is_causal=1),
        attention(4, {**qkv, "Q": "q6"}, is_causal=1, softcap=3.0),
        attention(5, {**qkv, "V": "v10"}, scale=0.3),
        attention(6, {**qkv, "Q": "q7"}, is_causal=1),
    ]
    assert_matches_ort(model(nodes, f), f, batch_axis=None)


def test_attention_3d_variants():
    """[batch, seq, heads * head_size] inputs: multi-head, grouped-query (causal, wider values) and
    multi-query (one kv head, with a mask)."""
    f = {
        "q": rand((2, 4, 24), seed=1), "k": rand((2, 5, 24), seed=2), "v": rand((2, 5, 24), seed=3),
        "q6": rand((2, 4, 48), seed=4), "k2": rand((2, 5, 16), seed=5), "v2": rand((2, 5, 20), seed=6),
        "k1": rand((2, 5, 8), seed=7), "v1": rand((2, 5, 8), seed=8), "mask": rand((4, 5), seed=9),
    }
    nodes = [
        attention(0, {"Q": "q", "K": "k", "V": "v"}, q_num_heads=3, kv_num_heads=3),
        attention(1, {"Q": "q6", "K": "k2", "V": "v2"}, q_num_heads=6, kv_num_heads=2, is_causal=1),
        attention(2, {"Q": "q", "K": "k1", "V": "v1", "attn_mask": "mask"}, q_num_heads=3, kv_num_heads=1),
    ]
    assert_matches_ort(model(nodes, f), f, batch_axis=None)


def test_attention_masks():
    """Float masks of rank 2, 3 and 4 (one with -inf entries), boolean masks of rank 2 and 4 (a row
    masked everywhere gives zeros), and a mask composed with the causal one."""
    f = {"q": rand((2, 3, 4, 8), seed=1), "k": rand((2, 3, 6, 8), seed=2), "v": rand((2, 3, 6, 8), seed=3)}
    minf = rand((2, 1, 4, 6), seed=13)
    minf[0, 0, 1, 2:] = -np.inf
    b2 = rand((4, 6), np.bool_, seed=14)
    b2[2] = False
    b2[:, 0] = True
    b2[2, 0] = False
    f.update(m2=rand((4, 6), seed=11), m3=rand((3, 4, 6), seed=12), minf=minf, b2=b2,
             b4=rand((2, 3, 4, 6), np.bool_, seed=15) | np.eye(4, 6, dtype=bool))
    qkv = {"Q": "q", "K": "k", "V": "v"}
    nodes = [attention(k, {**qkv, "attn_mask": m}) for k, m in enumerate(["m2", "m3", "minf", "b2", "b4"])]
    nodes += [attention(5, {**qkv, "attn_mask": "minf"}, is_causal=1), attention(6, {**qkv, "attn_mask": "b4"}, is_causal=1)]
    _, got = assert_matches_ort(model(nodes, f), f, batch_axis=None)
    assert np.all(got["Y3"][:, :, 2] == 0)  # the fully masked row


def test_attention_kv_cache():
    """past_key/past_value concatenated in front of K/V (present outputs), with a mask, causal
    (bottom-right: the queries follow the past keys) and grouped-query heads; 3-D Q/K/V too."""
    f = {
        "q": rand((2, 3, 4, 8), seed=1), "k": rand((2, 3, 2, 8), seed=2), "v": rand((2, 3, 2, 10), seed=3),
        "pk": rand((2, 3, 5, 8), seed=4), "pv": rand((2, 3, 5, 10), seed=5), "mask": rand((4, 7), seed=6),
        "q3": rand((2, 2, 48), seed=7), "k3": rand((2, 2, 24), seed=8), "v3": rand((2, 2, 30), seed=9),
    }
    cache = {"past_key": "pk", "past_value": "pv"}
    nodes = [
        attention(0, {"Q": "q", "K": "k", "V": "v", "attn_mask": "mask", **cache}, ("Y", "PK", "PV")),
        attention(1, {"Q": "q", "K": "k", "V": "v", **cache}, ("Y", "PK", "PV"), is_causal=1),
        attention(2, {"Q": "q3", "K": "k3", "V": "v3", **cache}, ("Y", "PK", "PV"), q_num_heads=6, kv_num_heads=3, is_causal=1),
    ]
    assert_matches_ort(model(nodes, f), f, batch_axis=None)


def test_attention_present_without_past():
    """present_key/present_value without a past cache are K/V as 4-D (onnxruntime cannot type them)."""
    f = {"q": rand((2, 4, 24), seed=1), "k": rand((2, 5, 8), seed=2), "v": rand((2, 5, 12), seed=3)}
    node = attention(0, {"Q": "q", "K": "k", "V": "v"}, ("Y", "PK", "PV"), q_num_heads=6, kv_num_heads=2)
    outs = [value_info("Y0", np.float32, [2, 4, 36]), value_info("PK0", np.float32, [2, 2, 5, 4]),
            value_info("PV0", np.float32, [2, 2, 5, 6])]
    graph = helper.make_graph([node], "g", [value_info(k, v.dtype, v.shape) for k, v in f.items()], outs)
    assert_matches_reference(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]), f)


@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_attention_qk_matmul_output(softcap):
    """Modes 0 (scaled QK^T), 1 (after softcap), 2 (plus the mask) and 3 (the softmax), with a float
    mask; mode 3 with causal and boolean masks (zero on a fully masked row)."""
    f = {"q": rand((2, 3, 4, 8), seed=1), "k": rand((2, 3, 6, 8), seed=2), "v": rand((2, 3, 6, 8), seed=3),
         "m": rand((4, 6), seed=4), "b": rand((2, 1, 4, 6), np.bool_, seed=5)}
    f["b"][1, 0, 3] = False
    f["b"][0, 0, :, 0] = True
    qkv = {"Q": "q", "K": "k", "V": "v"}
    out = ("Y", "", "", "QK")
    kw = {"softcap": softcap} if softcap else {}
    nodes = [attention(mode, {**qkv, "attn_mask": "m"}, out, qk_matmul_output_mode=mode, **kw) for mode in range(4)]
    nodes.append(attention(4, {**qkv, "attn_mask": "b"}, out, qk_matmul_output_mode=3, is_causal=1, **kw))
    _, got = assert_matches_ort(model(nodes, f), f, batch_axis=None)
    assert np.all(got["QK4"][1, :, 3] == 0)


def test_attention_qk_matmul_output_masked_scores():
    """Mode 2 where the boolean and causal masks forbid a key: -inf, as the specification's bias
    and the reference say (onnxruntime writes the lowest float instead)."""
    f = {"q": rand((2, 3, 4, 8), seed=1), "k": rand((2, 3, 6, 8), seed=2), "v": rand((2, 3, 6, 8), seed=3),
         "b": rand((2, 1, 4, 6), np.bool_, seed=5), "m": rand((3, 4, 6), seed=6)}
    qkv = {"Q": "q", "K": "k", "V": "v"}
    nodes = [attention(0, {**qkv, "attn_mask": "b"}, ("Y", "", "", "QK"), qk_matmul_output_mode=2, is_causal=1, softcap=2.0),
             attention(1, {**qkv, "attn_mask": "m"}, ("Y", "", "", "QK"), qk_matmul_output_mode=2, is_causal=1)]
    m = model(nodes, f)
    assert_matches_reference(m, f)
    assert np.isneginf(luisaml.compile(m, batch_axis=None).run(f)["QK1"]).sum() == 2 * 3 * (5 + 4 + 3 + 2)


def test_attention_nonpad_kv_seqlen():
    """Opset 24: keys past nonpad_kv_seqlen[b] are padding; causal is aligned to the valid keys
    (bottom-right), also with a boolean mask and more queries than valid keys."""
    f = {"q": rand((2, 4, 3, 8), seed=1), "k": rand((2, 2, 6, 8), seed=2), "v": rand((2, 2, 6, 8), seed=3),
         "n": np.array([6, 4], np.int64), "n2": np.array([2, 5], np.int64), "b": rand((2, 1, 3, 6), np.bool_, seed=4) | True}
    f["b"][0, 0, 1, :3] = False
    qkv = {"Q": "q", "K": "k", "V": "v"}
    nodes = [
        attention(0, {**qkv, "nonpad_kv_seqlen": "n"}),
        attention(1, {**qkv, "nonpad_kv_seqlen": "n"}, is_causal=1),
        attention(2, {**qkv, "nonpad_kv_seqlen": "n2", "attn_mask": "b"}, is_causal=1),
    ]
    assert_matches_ort(model(nodes, f, opset=24), f, batch_axis=None)


def test_attention_sliding_window():
    """Opset 25: left/right window sizes, alone, with causal, and with a past cache; against ONNX's
    reference, and onnxruntime where it knows opset 25."""
    f = {"q": rand((2, 3, 5, 8), seed=1), "k": rand((2, 3, 5, 8), seed=2), "v": rand((2, 3, 5, 8), seed=3),
         "pk": rand((2, 3, 4, 8), seed=4), "pv": rand((2, 3, 4, 8), seed=5)}
    qkv = {"Q": "q", "K": "k", "V": "v"}
    nodes = [
        attention(0, qkv, left_window_size=1, right_window_size=2),
        attention(1, qkv, left_window_size=2, is_causal=1),
        attention(2, {**qkv, "past_key": "pk", "past_value": "pv"}, ("Y", "PK", "PV"), left_window_size=3, is_causal=1),
    ]
    m = model(nodes, f, opset=25)
    assert_matches_reference(m, f)
    from onnxruntime.capi.onnxruntime_pybind11_state import InvalidGraph

    try:
        ort_run(m, f)
    except InvalidGraph as e:  # an onnxruntime older than Attention-25 rejects the window attributes
        assert "left_window_size" in str(e), e
        return
    assert_matches_ort(m, f, batch_axis=None)


def test_attention_short_mask_is_padded():
    """A mask shorter than the keys masks the keys past its end (onnxruntime rejects it)."""
    f = {"q": rand((2, 3, 4, 8), seed=1), "k": rand((2, 3, 6, 8), seed=2), "v": rand((2, 3, 6, 8), seed=3),
         "m": rand((2, 1, 4, 4), seed=4), "b": rand((4, 5), np.bool_, seed=5) | np.eye(4, 5, dtype=bool)}
    qkv = {"Q": "q", "K": "k", "V": "v"}
    nodes = [attention(0, {**qkv, "attn_mask": "m"}), attention(1, {**qkv, "attn_mask": "b"}, is_causal=1)]
    assert_matches_reference(model(nodes, f), f)


def test_attention_half():
    """float16 Q/K/V and mask, computed in float and rounded once."""
    h = np.float16
    f = {"q": rand((2, 6, 4, 8), h, seed=1), "k": rand((2, 3, 6, 8), h, seed=2), "v": rand((2, 3, 6, 8), h, seed=3),
         "m": rand((4, 6), h, seed=4), "pk": rand((2, 3, 2, 8), h, seed=5), "pv": rand((2, 3, 2, 8), h, seed=6)}
    qkv = {"Q": "q", "K": "k", "V": "v"}
    nodes = [
        attention(0, {**qkv, "attn_mask": "m"}, ("Y", "", "", "QK"), is_causal=1, qk_matmul_output_mode=3, softmax_precision=TensorProto.FLOAT),
        attention(1, {**qkv, "past_key": "pk", "past_value": "pv"}, ("Y", "PK", "PV"), softcap=2.0),
    ]
    assert_matches_ort(model(nodes, f), f, batch_axis=None, rtol=2e-3, atol=2e-3)


def test_attention_per_sample():
    """One thread per sample: Q/K/V (4-D and 3-D), past cache and nonpad_kv_seqlen carry the batch
    dimension; the mask is shared by every sample."""
    def feeds(n, seed):
        return {"q": rand((n, 2, 4, 8), seed=seed), "k": rand((n, 2, 5, 8), seed=seed + 1), "v": rand((n, 2, 5, 8), seed=seed + 2),
                "pk": rand((n, 2, 3, 8), seed=seed + 3), "pv": rand((n, 2, 3, 8), seed=seed + 4),
                "q3": rand((n, 4, 16), seed=seed + 5), "nonpad": np.arange(n, dtype=np.int64) % 4 + 1}

    mask = rand((4, 8), seed=99)
    nodes = [
        attention(0, {"Q": "q", "K": "k", "V": "v", "attn_mask": "mask", "past_key": "pk", "past_value": "pv"},
                  ("Y", "PK", "PV"), is_causal=1),
        attention(1, {"Q": "q3", "K": "q3", "V": "q3", "nonpad_kv_seqlen": "nonpad"}, q_num_heads=2, kv_num_heads=2, is_causal=1),
    ]
    m = graph_model(nodes, feeds(2, 0), {"mask": mask}, opset=24, batch="N")
    for n in (1, 3):
        net, _ = assert_matches_ort(m, feeds(n, 10 * n))
        assert net.batch_symbol == "N"


@pytest.mark.parametrize(
    "build,message",
    [
        (lambda: (attention(0, {"Q": "q3", "K": "q3", "V": "q3"}), {"q3": rand((1, 2, 6))}),
         "3-D Q, K, V need the attributes q_num_heads and kv_num_heads"),
        (lambda: (attention(0, {"Q": "q3", "K": "q3", "V": "q3"}, q_num_heads=4, kv_num_heads=4), {"q3": rand((1, 2, 6))}),
         r"Q 'q3' \[1, 2, 6\]: hidden size 6 is not a multiple of 4 heads"),
        (lambda: (attention(0, {"Q": "q", "K": "k", "V": "k"}), {"q": rand((1, 3, 2, 4)), "k": rand((1, 2, 2, 4))}),
         "q_num_heads 3 is not a multiple of kv_num_heads 2"),
        (lambda: (attention(0, {"Q": "q", "K": "q", "V": "q", "attn_mask": "m"}), {"q": rand((1, 2, 3, 4)), "m": rand((2, 4, 3))}),
         r"attn_mask 'm' of shape \[2, 4, 3\] does not broadcast to \(batch, q_heads, q_seq, total_seq\) = \[1, 2, 3, 3\]"),
        (lambda: (attention(0, {"Q": "q", "K": "q", "V": "q", "attn_mask": "m"}), {"q": rand((1, 2, 3, 4)), "m": rand((3, 3), np.int32)}),
         "attn_mask 'm' has type int32; a boolean or a float mask is supported"),
    ],
)
def test_attention_errors(build, message):
    node, f = build()
    ins = [value_info(k, v.dtype, v.shape) for k, v in f.items()]
    y = helper.make_tensor_value_info("Y0", TensorProto.FLOAT, next(iter(f.values())).shape)  # Q's shape: checked last
    graph = helper.make_graph([node], "g", ins, [y])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    with pytest.raises(luisaml.CompileError, match=r"node 'Attention_0' \(Attention\): " + message):
        luisaml.compile(m, batch_axis=None)


def test_attention_per_sample_mask_with_batch_is_an_error():
    """In per-sample execution a mask that holds every sample's rows (not batched) cannot be read."""
    q = rand((2, 2, 3, 4))
    m = graph_model([attention(0, {"Q": "q", "K": "q", "V": "q", "attn_mask": "m"})], {"q": q}, {"m": rand((2, 1, 3, 3))},
                    opset=23, batch="N")
    with pytest.raises(luisaml.CompileError, match=r"attn_mask 'm' of shape \[2, 1, 3, 3\] does not broadcast .* \[1, 2, 3, 3\] \(per sample the batch dimension is 1"):
        luisaml.compile(m, batch_axis=0)
