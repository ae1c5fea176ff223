"""The warp-splits-k forms' machine code without a GPU (benchmarks/NOTES.md, "The warp forms' loads: in
flight or sunk"): operators/gemm_heads.py (ResNet-50's 2,048 -> 1,000 Gemm head, EfficientNet-B0's 1,280 ->
1,000 MatMul), operators/gemm_rows.py (cifar-cnn's 2,048 -> 10) and conv_tiles.py's dot form through
rows.fold_row (EfficientNet's SE 1,152 -> 48 -> 1,152), each planned for CUDA, its stage translated to
CUDA C++ by rnn_sass.py's "lc" dialect and compiled for sm_90 (--nvrtc: the wheel's NVRTC 12.1; --ptxas:
CUDA 12.1's). Reports ptxas -v's registers, stack and spills and, in each k loop, the loads issued before
the first FFMA (loads a warp has in flight when it first waits on one).

    LD_LIBRARY_PATH=<stub> python benchmarks/experiments/heads_sass.py [heads50 heads_eff rows se1 se2]
        [--ahead 0,1] --nvrtc --ptxas <12.1 ptxas> --cuobjdump <cuobjdump> [--keep DIR]

--ahead: GemmHeads.AHEAD (gemm_heads.py's A/B switch: 0 the loads where written, 1 loaded an iteration ahead)."""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from mma_sass import compiler_args, compilers  # noqa: E402
from rnn_sass import k_loops, lc_cubin, loop_report, ptxas_usage, sass_of, translate  # noqa: E402

# luisa's warp_active_sum as the wheel's device library writes it (liblc-backend-cuda.so's strings:
# lc_warp_active_reduce_impl over __activemask(); the k loop ends before it, its own code is not measured)
WARP_SUM = r"""
__device__ __forceinline__ float warp_active_sum(float x) {
  unsigned mask = __activemask(), lane = threadIdx.x % 32u;
  for (unsigned o = 16u; o; o >>= 1) { float y = __shfl_xor_sync(mask, x, o); if (mask & (1u << (lane ^ o))) x = x + y; }
  return x; }
"""


def _model(shape: str):
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    if shape.startswith("se"):
        c, s = 1152, 48
        inits = {"w1": rng.standard_normal((s, c, 1, 1), dtype=np.float32), "b1": np.zeros(s, np.float32),
                 "w2": rng.standard_normal((c, s, 1, 1), dtype=np.float32), "b2": np.zeros(c, np.float32)}
        nodes = [helper.make_node("GlobalAveragePool", ["x"], ["p"]),
                 helper.make_node("Conv", ["p", "w1", "b1"], ["h"], name="fc1"), helper.make_node("Relu", ["h"], ["r"]),
                 helper.make_node("Conv", ["r", "w2", "b2"], ["e"], name="fc2"),
                 helper.make_node("Sigmoid", ["e"], ["g"]), helper.make_node("Mul", ["x", "g"], ["y"])]
        xin, yout = ["N", c, 14, 14], ["N", c, 14, 14]
        target = "fc1" if shape == "se1" else "fc2"
    else:
        K, N, op = {"heads50": (2048, 1000, "Gemm"), "heads_eff": (1280, 1000, "MatMul"), "rows": (2048, 10, "Gemm"),
                    "ragged": (1100, 1003, "Gemm")}[shape]
        if op == "Gemm":
            inits = {"W": rng.standard_normal((N, K), dtype=np.float32), "C": np.zeros(N, np.float32)}
            nodes = [helper.make_node("Relu", ["x"], ["r"]),
                     helper.make_node("Gemm", ["r", "W", "C"], ["y"], name="head", transB=1)]
        else:
            inits = {"W": rng.standard_normal((K, N), dtype=np.float32)}
            nodes = [helper.make_node("MatMul", ["x", "W"], ["y"], name="head")]
        xin, yout, target = ["N", K], ["N", N], "head"
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, xin)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, yout)],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), target


def in_flight_at_waits(sass: str) -> list[int]:
    """For each instruction that reads a register a global load of the kernel's longest straight-line or
    innermost k loop run has not yet delivered (a scoreboard wait), the loads issued and not yet read at
    that point: the loads a warp has in flight when it stalls. Walked once in address order from each
    backward branch's target (a loop: its body; without a loop, the whole kernel)."""
    ops = []
    for line in sass.splitlines():
        if (m := re.search(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[0-9T] )?([A-Z0-9_.]+)\s*([^;]*);", line)):
            ops.append((int(m.group(1), 16), m.group(3), m.group(4)))
    loops = [(int(b.group(1), 16), a) for a, o, args in ops if o == "BRA" and (b := re.search(r"0x([0-9a-f]+)", args))
             and int(b.group(1), 16) < a]
    body = [op for op in ops if any(lo <= op[0] <= hi for lo, hi in loops)] if loops else ops
    pending, waits = set(), []
    for _, o, args in body:
        regs = re.findall(r"\bR(\d+)\b", args)
        if o.startswith("LDG"):
            pending.add(regs[0])
            continue
        used = {r for r in regs[1:] if r in pending} if regs else set()
        if used:
            waits.append(len(pending))
            pending -= used
    return waits


def split_statements(src: str) -> str:
    """The DSL's `a; b` lines (the dot form's epilogue) one statement a line, as rnn_sass.translate reads them."""
    out = []
    for line in src.splitlines():
        pad = line[:len(line) - len(line.lstrip())]
        parts, depth, cur = [], 0, ""
        for ch in line.strip():
            depth += {"(": 1, ")": -1, "[": 1, "]": -1}.get(ch, 0)
            if ch == ";" and depth == 0:
                parts.append(cur.strip())
                cur = ""
            else:
                cur += ch
        parts.append(cur.strip())
        out += [pad + q for q in parts if q] if len(parts) > 1 else [line]
    return "\n".join(out)


def plan_stage(shape: str):
    from luisaml.planning import CompileOptions, plan_for

    model, target = _model(shape)
    plan = plan_for(model, "m", CompileOptions(batch_axis=0, fuse="off").resolve("cuda"))[0]
    k, st = next((k, s) for k, s in enumerate(plan.schedule.stages) if any(n.name == target for n, _ in s.nodes))
    return plan, f"stage_{k}", st


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("shapes", nargs="*", default=["heads50", "heads_eff", "rows", "se1", "se2"])
    ap.add_argument("--ahead", default="0,1")
    compiler_args(ap)
    args = ap.parse_args()
    tools = compilers(args, "heads-sass-")
    if tools is None:
        return 1
    nvcc, cuobjdump, ptxas, folder = tools
    from luisaml.operators import gemm_heads

    for shape in args.shapes:
        for ahead in args.ahead.split(","):
            if ahead != "0" and not shape.startswith(("heads", "ragged")):
                continue  # (AHEAD is the heads form's alone)
            gemm_heads.Heads.AHEAD = bool(int(ahead))
            plan, stage, st = plan_stage(shape)
            cu = folder / f"{shape}-ahead{ahead}.cu"
            src = translate(split_statements(plan.source), stage, "lc")
            src = src.replace("typedef unsigned int uint;\n", "typedef unsigned int uint;\n" + WARP_SUM, 1)
            cu.write_text(src)
            r = lc_cubin(cu, nvcc, ptxas, args.nvrtc, bool(args.ptxas))
            if r.returncode:
                print(f"{shape}: build failed\n{r.stderr[-3000:]}")
                return 1
            line = (f"{shape:9s} ahead={ahead} ({st.tiling.describe() if getattr(st, 'tiling', None) else st.domain}): "
                    f"{ptxas_usage(r.stderr)}")
            if cuobjdump:
                sass = sass_of(cu.with_suffix(".cubin"), cuobjdump)
                for body in k_loops(sass.splitlines()):
                    line += f"\n    {loop_report(body)}"
                w = in_flight_at_waits(sass)
                if w:
                    line += (f"\n    loads in flight at each wait on one: first {w[0]}, median {sorted(w)[len(w) // 2]}, "
                             f"min {min(w)}, {len(w)} waits")
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
