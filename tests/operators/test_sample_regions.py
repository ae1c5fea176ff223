"""Whole 64-byte lines on the CPU: a batched tensor's region in a pooled stage buffer is a whole
number of lines (luisaml/schedule.py REGION_ALIGN_BYTES): a NeRF-like MLP whose layers are 283 and
37 wide (a skip Concat of the input and a hidden layer, an int tensor among them) over an odd
batch, against onnxruntime; tensors under a line keep their size. Every constant of the weight blob
starts on a line (luisaml/plan.py BLOB_ALIGN_CPU)."""
from onnx import helper

from util import assert_matches_ort, graph_model, rand


def test_batched_regions_take_whole_lines():
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h1"], name="l1"),
             helper.make_node("Relu", ["h1"], ["r1"], name="r1"),
             helper.make_node("Concat", ["x", "r1"], ["c"], name="cat", axis=1),
             helper.make_node("Gemm", ["c", "w2"], ["h2"], name="l2"),
             helper.make_node("Relu", ["h2"], ["r2"], name="r2"),
             helper.make_node("Gemm", ["r2", "w3"], ["h3"], name="l3"),
             helper.make_node("ArgMax", ["h3"], ["am"], name="am", axis=1),
             helper.make_node("Cast", ["am"], ["amf"], name="cast", to=1),
             helper.make_node("Gemm", ["h3", "w4"], ["y"], name="l4")]
    inits = {"w1": rand((6, 277), seed=1, low=-0.3, high=0.3), "b1": rand((277,), seed=2),
             "w2": rand((283, 37), seed=3, low=-0.1, high=0.1), "w3": rand((37, 5), seed=4),
             "w4": rand((5, 3), seed=5)}
    model = graph_model(nodes, {"x": rand((5, 6))}, inits, batch="N", outputs=["y", "amf"])
    net, _ = assert_matches_ort(model, {"x": rand((5, 6), seed=6)}, rtol=1e-4, atol=1e-4)
    tensors = net.plan.tensors
    for slot in net.plan.schedule.buffers.slots:
        line = 64 // slot.itemsize
        numels = [tensors[m].numel for m in slot.members]
        if max(numels) >= line:
            assert slot.size % line == 0, (slot.members, slot.size)
        else:
            assert slot.size == max(numels), (slot.members, slot.size)


def test_cpu_weights_start_on_lines():
    """The CPU plan's weight blob starts every constant (the prepacked panels among them) on a
    64-byte line (plan.BLOB_ALIGN_CPU), a CUDA plan's on 16 bytes; the results equal onnxruntime."""
    from luisaml.runtime import analyze

    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], name="l1"),
             helper.make_node("Gemm", ["h", "w2", "b2"], ["y"], name="l2")]
    inits = {"w1": rand((6, 37), seed=1), "b1": rand((37,), seed=2), "w2": rand((37, 33), seed=3),
             "b2": rand((33,), seed=4)}
    model = graph_model(nodes, {"x": rand((3, 6))}, inits, batch="N")
    net, _ = assert_matches_ort(model, {"x": rand((3, 6), seed=5)}, rtol=1e-4, atol=1e-4)
    offsets = [off for off, *_ in net.plan.blob.layout.values()]
    assert len(offsets) >= 4 and all(off % 64 == 0 for off in offsets), net.plan.blob.layout
    cuda = analyze(model, target="cuda")
    assert cuda.blob.align == 16
