"""TopK over one line of 80,000 (the detector head's, k = 64) on the CUDA backend: the stage's
milliseconds as a block per line (operators/topk_block.py) and as one thread per line (the items
form, topk_block.MIN_LENGTH raised past the line), each checked against onnxruntime
(benchmarks/NOTES.md, "TopK over a long line").

    LUISAML_BACKEND=cuda python benchmarks/experiments/micro_topk.py [length] [k]"""
import sys

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import luisaml
from luisaml.operators import topk_block

n = int(sys.argv[1]) if len(sys.argv) > 1 else 80000
k = int(sys.argv[2]) if len(sys.argv) > 2 else 64
node = helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=-1)
g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, n])],
                      [helper.make_tensor_value_info("v", TensorProto.FLOAT, [1, k]),
                       helper.make_tensor_value_info("i", TensorProto.INT64, [1, k])],
                      [numpy_helper.from_array(np.array([k], np.int64), "k")])
model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 11)])
model.ir_version = 10
x = np.random.default_rng(0).random((1, n)).astype(np.float32)
want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
for min_length in (topk_block.MIN_LENGTH, n + 1):
    topk_block.MIN_LENGTH = min_length
    net = luisaml.compile(model, batch_axis=None)
    got = net.run({"x": x})
    ok = np.array_equal(got["v"], want[0]) and np.array_equal(got["i"], want[1])
    (stage, ms), = net.profile({"x": x}, repeat=3 if min_length > n else 11)
    print(f"{net.plan.schedule.stages[0].domain:6s} n={n} k={k}: {ms:.3f} ms ({stage}); equal to onnxruntime: {ok}")
