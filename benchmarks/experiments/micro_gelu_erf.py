"""The GELU MatMul stage of Mixer-S/16's channel MLP on the CPU backend: MatMul [196, 512] x [512,
2048] + bias, then GELU as torch exports nn.GELU (Div, Erf, Add, Mul, Mul: the MatMul's epilogue),
with dsl_lib.erf_f32 (Erf.fast_erf off: CUDA's) and the epilogue straight-line (Dense.epilogue_loop
off), with math_lib.erf_vec_f32 (the CPU's branch-free erf) straight-line, and as the CPU has it now
(erf_vec_f32, the epilogue a loop), and the MatMul + bias alone; interleaved in one process, medians
of rounds of whole runs (one stage each), each checked against onnxruntime, whose time is printed
beside (benchmarks/NOTES.md, "A branch-free erf").

    python benchmarks/experiments/micro_gelu_erf.py [rounds] [m]"""
import math
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import luisaml
from luisaml.operators.elementwise import Erf
from luisaml.operators.gemm import Dense

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_models' timing
from bench_models import interleaved  # noqa: E402

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 15
m, k, n = (int(sys.argv[2]) if len(sys.argv) > 2 else 196), 512, 2048
rng = np.random.default_rng(0)
consts = {"w": (rng.standard_normal((k, n)) / math.sqrt(k)).astype(np.float32),
          "b": (rng.standard_normal(n) * 0.1).astype(np.float32), "r2": np.float32(math.sqrt(2)),
          "one": np.float32(1), "half": np.float32(0.5)}


def model(gelu: bool):
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["h" if gelu else "y"])]
    if gelu:
        nodes += [helper.make_node("Div", ["h", "r2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
                  helper.make_node("Add", ["e", "one"], ["e1"]), helper.make_node("Mul", ["h", "e1"], ["p"]),
                  helper.make_node("Mul", ["p", "half"], ["y"])]
    used = {i for nd in nodes for i in nd.input}
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])],
                          [numpy_helper.from_array(v, name) for name, v in consts.items() if name in used])
    p = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    p.ir_version = 9
    return p


x = rng.standard_normal((m, k)).astype(np.float32)
variants = {}
for name, gelu, fast, loop in (("matmul + bias", False, True, False), ("gelu, erf_f32", True, False, False),
                               ("gelu, erf_vec_f32", True, True, False), ("gelu, vec + loop", True, True, "gelu")):
    Erf.fast_erf, Dense.epilogue_loop = fast, loop
    proto = model(gelu)
    net = luisaml.compile(proto, batch_axis=None)
    Erf.fast_erf, Dense.epilogue_loop = True, "gelu"
    so = ort.SessionOptions()
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")  # (its spinning threads took our cores)
    sess = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    want = sess.run(None, {"x": x})[0]
    err = float(np.abs(net.run({"x": x})["y"] - want).max())
    variants[name] = (net, sess, err, len(net.plan.schedule.stages))
# interleaved: each round runs every variant once, then onnxruntime's session of it
fns = {}
for name, (net, sess, _, _) in variants.items():
    fns[name, "ours"] = lambda net=net: net.run({"x": x})
    fns[name, "ort"] = lambda sess=sess: sess.run(None, {"x": x})
times = interleaved(fns, rounds, warmup=0)
for name, (net, sess, err, stages) in variants.items():
    ours, theirs = (float(np.median(times[name, side])) for side in ("ours", "ort"))
    print(f"{name:18s} [{m}, {k}] x [{k}, {n}]: {ours:7.2f} ms ({stages} stage(s)), onnxruntime {theirs:6.2f} ms; "
          f"max |difference| {err:.2g}")
