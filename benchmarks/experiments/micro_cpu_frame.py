"""The CPU backend's merged kernel and big local arrays (issue 27, item 5): a GELU stage over 93k
elements timed alone and beside `--lstm` LSTM stages whose whole form declares local arrays (a
Sequencer2D-like bidirectional LSTM, hidden 48, seq 18: its Y of 1,728 floats kept in registers
between two LSTMs of one whole group). On the CPU backend every stage is one branch of one merged
function, so its frame holds every stage's local arrays and each thread of every stage pays for it.

    PYTHONPATH=$PWD python3 -P benchmarks/experiments/micro_cpu_frame.py --lstm 0 1 8

Prints the GELU stage's median milliseconds (net.profile) per LSTM count and which kernels the
network has."""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
from onnx import TensorProto, helper, numpy_helper

S, D, H, I = 18, 2, 48, 96
GELU = 93_000


def model(n_lstm: int):
    """X [N, 93000] -> Gelu -> Y; and n_lstm branches Xs [N, S, I] -> LSTM -> LSTM (layout 1)."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Gelu", ["x"], ["y"], name="gelu")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", GELU])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", GELU])]
    inits = []
    for k in range(n_lstm):
        inputs.append(helper.make_tensor_value_info(f"s{k}", TensorProto.FLOAT, ["N", S, I]))
        prev = f"s{k}"
        for j in range(2):
            w = rng.uniform(-0.2, 0.2, (D, 4 * H, I)).astype(np.float32)
            r = rng.uniform(-0.2, 0.2, (D, 4 * H, H)).astype(np.float32)
            inits += [numpy_helper.from_array(w, f"w{k}_{j}"), numpy_helper.from_array(r, f"r{k}_{j}")]
            y = f"l{k}_{j}"
            nodes.append(helper.make_node("LSTM", [prev, f"w{k}_{j}", f"r{k}_{j}"], [y], name=f"lstm{k}_{j}",
                                          hidden_size=H, direction="bidirectional", layout=1))
            nodes.append(helper.make_node("Reshape", [y, "shape"], [y + "r"], name=f"reshape{k}_{j}"))
            prev = y + "r"
        outputs.append(helper.make_tensor_value_info(prev, TensorProto.FLOAT, None))
    inits.append(numpy_helper.from_array(np.array([0, S, D * H], np.int64), "shape"))
    g = helper.make_graph(nodes, "frame", inputs, outputs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 22)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lstm", type=int, nargs="+", default=[0, 1, 8])
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    sys.path.insert(0, os.getcwd())
    import luisaml

    for n in args.lstm:
        net = luisaml.compile(model(n), backend="cpu")
        feeds = {"x": np.random.default_rng(1).standard_normal((1, GELU)).astype(np.float32)}
        for k in range(n):
            feeds[f"s{k}"] = np.random.default_rng(2 + k).standard_normal((1, S, I)).astype(np.float32)
        prof = net.profile(feeds, repeat=args.repeat)
        gelu = [ms for name, ms in prof if "gelu" in name.lower()]
        print(f"{n} LSTM: GELU stage {gelu[0] if gelu else float('nan'):.3f} ms; kernels {net.plan.kernels}; "
              f"stages: {[name[:60] for name, _ in prof]}", flush=True)


if __name__ == "__main__":
    main()
