"""The tensor-core tile's machine code without a GPU (benchmarks/NOTES.md, "A faster tensor-core tile"): a
MatMul's or Conv's blocks stage, planned for CUDA with tensor cores under a variant of operators/
tiled_mma.py, translated from the plan's DSL to CUDA C++ close to LuisaCompute's emission (the front's
bodies, luisaml/tensor_cores.py, in place of the marked callables), compiled by nvcc for sm_90: ptxas -v's
registers and spills, and where cuobjdump (and nvdisasm) is found, the k loop's instructions by opcode.

    python benchmarks/experiments/mma_sass.py mm:4096:4096:4096 cv:16:128:28:128:3 --variants w64,w32
        [--cuobjdump /path/to/cuobjdump] [--keep DIR] [--nvrtc [--ptxas /path/to/ptxas-12.1]]

--nvrtc compiles the translation as LuisaCompute does (rnn_sass.py's wheel_nvrtc: the wheel's NVRTC 12.1 with its
options, no __launch_bounds__; then ptxas -O3, --ptxas e.g. CUDA 12.1's); with cuobjdump each k loop's line adds
where its global loads sit against its HMMAs (`schedule`: issued before the first, in flight, HMMA before their
stores).

mm:M:K:N is a MatMul by a constant B (no batch axis: the plan knows the grid), f16:M:K:N the same on the tile's
FP16 kind (m16n8k16, operands rounded to half where copied), mlp16:W:L stage L of precision="fp16"'s MLP
63-Wx4-4 on the FP16 tile (a sample-row Gemm: 0 the first layer, reading the half input; 1-3 W -> W; the
activations in half buffers, luisaml/rewrites/mlp.py FP16_HALF_ACTIVATIONS, as the module's default), mlp32:W:L
the same layer of the fp32 MLP compiled unfused (fuse=False: the sample-row Gemms on the TF32 tile);
cv:n:C:H:K:k[:s[:p]] a k x k
Conv (stride s, default 1; padding p, default k // 2) of C -> K channels on H x H (c1:C:L:K:k:s a 1-d one,
no padding: wav2vec2's encoder), compiled with a batch axis as the zoo's (n unused by the
plan). The translation covers what these stages use (lets, reads, writes, shared and local arrays, for
and if, barriers); LuisaCompute's own code declares everything at the top and may compile differently:
compare variants with each other, not with a measured kernel. The loop's range is from the first
barrier to the last backward branch, which may hold more than one copy of the loop body."""
from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tests"))  # the tests' model builders

PRELUDE = r"""
#include <cuda_fp16.h>
struct alignas(16) lc_float4 { float x, y, z, w; };
__device__ inline lc_float4 lc_splat4(float v) { return lc_float4{v, v, v, v}; }
template<typename T, unsigned long N> struct lc_array {
  T _d[N];
  __device__ T &operator[](unsigned long i) { return _d[i]; }
  __device__ T operator[](unsigned long i) const { return _d[i]; }
};
__device__ __forceinline__ lc_float4 mma_tf32_m16n8k8(const lc_array<float, 16> &a, const lc_array<float, 24> &b,
                                                       lc_float4 c) {@TF32@
}
__device__ __forceinline__ lc_float4 mma_tf32_m16n8k8_rounded(const lc_array<float, 16> &a, const lc_array<float, 24> &b,
                                                        lc_float4 c) {@TF32R@
}
__device__ __forceinline__ float tf32_round(float x) {@ROUND@
}
__device__ __forceinline__ lc_float4 mma_f16_m16n8k16(const lc_array<float, 32> &a, const lc_array<float, 48> &b,
                                                      lc_float4 c) {@F16@
}
__device__ __forceinline__ float f16_round(float x) {@F16ROUND@
}
// the DSL's float(half(x)) (the FP16 kind's copies before f16_round)
__device__ __forceinline__ float lc_f16_round(float x) { return __half2float(__float2half_rn(x)); }
"""


def _close(s: str, i: int) -> int:
    """The index of the parenthesis closing the one at i."""
    depth = 0
    for j in range(i, len(s)):
        depth += {"(": 1, ")": -1}.get(s[j], 0)
        if depth == 0:
            return j
    raise ValueError(f"unbalanced: {s}")


def _reads(s: str) -> str:
    """buf.read(i) -> buf[i] (weights.read(float, i) -> weights[i])."""
    while m := re.search(r"(\w+)\.read\(", s):
        o = m.end() - 1
        c = _close(s, o)
        s = s[:m.start()] + f"{m.group(1)}[" + s[o + 1:c].replace("float, ", "", 1) + "]" + s[c + 1:]
    return s


def _ternaries(s: str) -> str:
    """(a if c else b) -> ((c) ? (a) : (b)), innermost first."""
    out, i = "", 0
    while i < len(s):
        if s[i] != "(":
            out, i = out + s[i], i + 1
            continue
        c = _close(s, i)
        inner, depth, cut = _ternaries(s[i + 1:c]), 0, None
        for j, ch in enumerate(inner):
            depth += {"(": 1, ")": -1, "[": 1, "]": -1}.get(ch, 0)
            if depth == 0 and cut is None and inner.startswith(" if ", j):
                cut = j
            elif depth == 0 and cut is not None and inner.startswith(" else ", j):
                inner = f"({inner[cut + 4:j]}) ? ({inner[:cut]}) : ({inner[j + 6:]})"
                break
        out, i = out + "(" + inner + ")", c + 1
    return out


def translate(src: str, stage: str) -> str:
    """The CUDA C++ of DSL function `stage` of a plan's source."""
    from luisaml import tensor_cores

    lines = src.splitlines()
    i = next(j for j, line in enumerate(lines) if line.startswith(f"def {stage}("))
    params = re.match(r"def \w+\((.*)\):", lines[i]).group(1).split(", ")
    shared = dict(re.findall(r"^(Shared_float_\d+) = luisa.SharedArrayType\((\d+), float\)", src, re.M))
    out, declared, stack, threads = [], set(), [4], 256
    body = []
    for line in lines[i + 1:]:
        if line.strip() and not line.startswith(" "):
            break
        pad = line[:len(line) - len(line.lstrip())]  # (an epilogue's `e = ...; buf.write(...)`: two statements)
        split = "; " in line and not line.lstrip().startswith(("#", "\"\"\""))
        body += [pad + part for part in line.strip().split("; ")] if split else [line]
    for line in body:
        s, ind = line.strip(), len(line) - len(line.lstrip())
        if not s or s.startswith(("#", '"""')):
            continue
        while ind < stack[-1]:
            stack.pop()
            out.append(" " * stack[-1] + "}")
        if m := re.match(r"set_block_size\((\d+)", s):
            threads = int(m.group(1))
            continue
        s = s.replace("int(thread_id().x)", "(int)threadIdx.x").replace("int(block_id().x)", "(int)blockIdx.x")
        s = re.sub(r"(?<![\w.])0\.0(?![\w.])", "0.0f", _ternaries(_reads(s)))
        s = s.replace("//", "/").replace(" and ", " && ").replace("float4(0.0f)", "lc_splat4(0.0f)")
        s = s.replace("float(half(", "(lc_f16_round(").replace("half(", "__float2half_rn(")
        s = s.replace("float(x_", "__half2float(x_")
        s = s.replace("float(buf_half_", "__half2float(buf_half_")
        pad = " " * ind
        if m := re.match(r"(\w+)\.write\((.*), (\w+|__float2half_rn\(\w+\))\)$", s):
            out.append(f"{pad}{m.group(1)}[{m.group(2)}] = {m.group(3)};")
        elif m := re.match(r"for (\w+) in range\((\d+)\):", s):
            out.append(f"{pad}for (int {m.group(1)} = 0; {m.group(1)} < {m.group(2)}; ++{m.group(1)}) {{")
            stack.append(ind + 4)
        elif m := re.match(r"if (.*):$", s):
            out.append(f"{pad}if ({m.group(1)}) {{")
            stack.append(ind + 4)
        elif s == "sync_block()":
            out.append(f"{pad}__syncthreads();")
        elif m := re.match(r"(\w+) = (Shared_float_\d+)\(\)", s):
            out.append(f"{pad}__shared__ float {m.group(1)}[{shared[m.group(2)]}];")
            declared.add(m.group(1))
        elif m := re.match(r"(\w+) = Arr_float_(\d+)\(\)", s):
            out.append(f"{pad}lc_array<float, {m.group(2)}> {m.group(1)}{{}};")
            declared.add(m.group(1))
        elif m := re.match(r"(\w+)(\[.*\])? = (.*)$", s):
            name, index, e = m.groups()
            first = not index and name not in declared
            declared.add(name)
            out.append(f"{pad}{'auto ' if first else ''}{name}{index or ''} = {e};")
        else:
            raise ValueError(f"not translated: {s}")
    out += ["  }"] * (len(stack) - 1)
    half_io = "__half2float(x_" in "\n".join(out) or "__float2half_rn(" in "\n".join(out)  # (Plan.half_io)
    io = "__half" if half_io else "float"
    args = ", ".join(f"int {p.split(':')[0]}" if p.endswith(": int") else f"{io} *__restrict__ {p}"
                     if p.startswith("y_") else f"const {io} *__restrict__ {p}" if p.startswith("x_")
                     else f"const float *__restrict__ {p}" if not p.startswith("buf_")
                     else f"{'__half' if p.startswith('buf_half_') else 'float'} *__restrict__ {p}" for p in params)
    head = "" if "sample" in declared else "  int sample = 0;\n"
    bodies = {"@TF32@": tensor_cores.BODY_TF32, "@TF32R@": tensor_cores.BODY_TF32R, "@ROUND@": tensor_cores.BODY_ROUND,
              "@F16@": tensor_cores.BODY_F16, "@F16ROUND@": tensor_cores.BODY_F16ROUND}
    prelude = PRELUDE
    for key, body in bodies.items():
        body = body.replace("@A@", "a").replace("@B@", "b").replace("@C@", "c").replace("@X@", "x")
        prelude = prelude.replace(key, body.replace("lc_float ", "float ").replace("lc_float4 ", "lc_float4 "))
    return (prelude + f'extern "C" __global__ void __launch_bounds__({threads}) kernel_main({args}) {{\n'
            + head + "\n".join(out) + "\n}\n")


def plan_stage(shape: str, variant: str):
    """(plan, stage name, tiling) of a shape under a variant."""
    os.environ["LUISAML_MMA_TILE"] = variant
    kind, *dims = shape.split(":")
    if kind in ("mm", "f16"):
        from test_tiled_mma import _model, _plan

        M, K, N = map(int, dims)
        mark = _f16_marks() if kind == "f16" else None
        try:
            plan = _plan(_model("MatMul", M, K, N)[0])
        finally:
            if mark is not None:
                mark()
    elif kind in ("mlp16", "mlp32"):  # (precision="fp16"'s MLP: its layer L's stage, a sample-row Gemm on the FP16
        # tile; mlp32: the fp32 MLP unfused, its layers on the TF32 tile)
        import onnx
        from util import export_batched, plan_of, torch_mlp

        W, L = map(int, dims)
        path = export_batched(torch_mlp([63, W, W, W, W, 4]), 63, Path(tempfile.mkdtemp()) / "mlp.onnx")
        precision, fuse = ("fp16", "auto") if kind == "mlp16" else ("fp32", False)
        plan = plan_of(onnx.load(path), "cuda", precision=precision, tensor_cores=True, fuse=fuse)
        st = plan.schedule.stages[L]
        return plan, f"stage_{L}", st.nodes[0][1].block_tiling()
    elif kind == "c1":  # (c1:C:L:K:k:stride, a 1-d Conv without pads over a batch axis: wav2vec2's encoder)
        import onnx
        from onnx import TensorProto, helper, numpy_helper
        from test_conv_mma import _plan

        import numpy as np

        C, L, K, k, s = map(int, dims)
        # (not zeros: an all-zero W's loads fold away, and the count missed B's copies)
        w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((K, C, k)).astype(np.float32), "Wt")
        g = helper.make_graph([helper.make_node("Conv", ["X", "Wt"], ["Y"], kernel_shape=[k], strides=[s])], "g",
                              [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", C, L])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", K, (L - k) // s + 1])], [w])
        model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = onnx.IR_VERSION if onnx.IR_VERSION < 10 else 10
        plan = _plan(model)
    else:
        import test_conv_mma as conv

        n, C, H, K, k, *rest = map(int, dims)  # (cv:n:C:H:K:k[:stride[:pads]])
        s, p = (rest + [1])[0], (rest[1:] + [k // 2])[0]
        plan = conv._plan(conv._conv_model(n, C, H, H, K, k=k, strides=s, pads=p, batch="N")[0])
    st = next(s for s in plan.schedule.stages if s.domain == "blocks")
    return plan, f"stage_{plan.schedule.stages.index(st)}", st.nodes[0][1].block_tiling()


def _f16_marks():
    """Make compile mark products with the FP16 kind (as precision="fp16" marks an MLP's layers); return the undo."""
    import luisaml.rewrites.tensor_cores as tc_rewrite

    mark = tc_rewrite.mark
    tc_rewrite.mark = lambda plan, kind="tf32": mark(plan, "f16")
    return lambda: setattr(tc_rewrite, "mark", mark)


INTEGER = ("IMAD", "IADD3", "LEA", "LOP3", "SHF", "ISETP", "VIMNMX", "IABS", "SEL", "MOV", "PLOP3", "I2F", "F2I")


def k_loop_lines(sass: list[str]) -> list[str]:
    """The SASS lines of the k loop: the backward branch's range (from its target to it) with the most HMMA."""
    ops = [(int(m.group(1), 16), m.group(2).split(".")[0], s) for s in sass
           if (m := re.search(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[0-9T] )?([A-Z0-9_.]+)", s))]
    best: list[tuple[str, str]] = []
    for i, (addr, _, s) in enumerate(ops):
        b = re.search(r"BRA 0x([0-9a-f]+)", s)
        if b and int(b.group(1), 16) < addr:
            body = [(op, line) for a, op, line in ops[:i + 1] if a >= int(b.group(1), 16)]
            if sum(op == "HMMA" for op, _ in body) > sum(op == "HMMA" for op, _ in best):
                best = body
    return [line for _, line in best]


def k_loop(sass: list[str]) -> list[str]:
    """The opcodes of the k loop (k_loop_lines)."""
    return [m.group(1).split(".")[0] for s in k_loop_lines(sass)
            if (m := re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[0-9T] )?([A-Z0-9_.]+)", s))]


def schedule(lines: list[str]) -> dict:
    """Where the k loop's global loads sit against its HMMAs (NOTES.md, "Why the unrolled k loop bought nothing":
    loads written first may be sunk next to their uses). In address order: each LDG's destination register and
    the first later instruction that reads it (for the tile's prefetch registers, the STS into the other
    buffer). ldg: global loads; before_hmma: issued before the loop's first HMMA; in_flight: the most loads
    issued and not yet read at any point (a warp's loads in flight, as the schedule allows); cover: the fewest
    HMMA between a load and its first reader (the mma work hiding its latency); sts_before_last_hmma: shared
    stores placed before the loop's last HMMA."""
    ins = []
    for s in lines:
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(@!?U?P[0-9T] )?([A-Z0-9_.]+)\s*([^;]*);", s)
        if m:
            ins.append((m.group(2).split(".")[0], m.group(3)))
    hmma = [i for i, (op, _) in enumerate(ins) if op == "HMMA"]
    if not hmma:
        return {}
    pending, most, cover, ldg = {}, 0, None, 0
    for i, (op, args) in enumerate(ins):
        parts = args.split(",", 1)
        sources = args if op.startswith("ST") or len(parts) < 2 else parts[1]
        for reg, at in list(pending.items()):
            if re.search(rf"\b{reg}\b", sources):
                n = sum(at < h < i for h in hmma)
                cover = n if cover is None else min(cover, n)
                del pending[reg]
        if op == "LDG":
            ldg += 1
            pending[parts[0].strip()] = i
        most = max(most, len(pending))
    sts = [i for i, (op, _) in enumerate(ins) if op == "STS"]
    return {"ldg": ldg, "before_hmma": sum(1 for i, (op, _) in enumerate(ins) if op == "LDG" and i < hmma[0]),
            "in_flight": most, "cover": cover, "hmma": len(hmma),
            "sts_before_last_hmma": sum(1 for i in sts if i < hmma[-1])}


def tool(name: str, given: str | None) -> str | None:
    if given:
        return given
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/local/cuda*/bin/{name}"))), None)
    if found:
        return found
    for root in sys.path:
        hits = glob.glob(os.path.join(root, "nvidia", "*", "bin", name))
        if hits:
            return hits[0]
    return None

def compiler_args(ap) -> None:
    """The options every *_sass.py script takes: the tools (default: found by `tool`), the wheel's NVRTC
    route and a folder to keep what was built."""
    ap.add_argument("--cuobjdump", default=None)
    ap.add_argument("--ptxas", default=None, help="the lc (--nvrtc) PTX's ptxas (default nvcc's), e.g. CUDA 12.1's")
    ap.add_argument("--nvrtc", action="store_true", help="PTX from the wheel's luisa_nvrtc with LuisaCompute's options "
                    "(rnn_sass.py: it needs an empty libcuda.so.1 on LD_LIBRARY_PATH where no driver is)")
    ap.add_argument("--keep", type=Path, default=None, help="a folder for the .cu, .ptx, .cubin and .sass files")


def compilers(args, prefix: str):
    """(nvcc, cuobjdump, ptxas, the folder to build in) for compiler_args' options, or None (said why) without nvcc."""
    nvcc = tool("nvcc", None)
    if not nvcc:
        print("nvcc not found")
        return None
    folder = args.keep or Path(tempfile.mkdtemp(prefix=prefix))
    folder.mkdir(parents=True, exist_ok=True)
    return nvcc, tool("cuobjdump", args.cuobjdump), tool("ptxas", args.ptxas), folder



def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("shapes", nargs="+")
    ap.add_argument("--variants", default="w32-first,w32,w64,w64r")
    compiler_args(ap)
    args = ap.parse_args()
    tools = compilers(args, "mma-sass-")
    if tools is None:
        return 1
    nvcc, cuobjdump, ptxas, folder = tools
    for shape in args.shapes:
        for v in args.variants.split(","):
            plan, stage, tl = plan_stage(shape, v)
            cu = folder / f"{shape.replace(':', '_')}-{v}.cu"
            cu.write_text(translate(plan.source, stage))
            if args.nvrtc:  # (the real tool chain: rnn_sass.py's wheel_nvrtc, then ptxas as the driver's JIT)
                from rnn_sass import lc_cubin

                # (LuisaCompute's kernels carry no __launch_bounds__: python's create_shader passes no options)
                text = re.sub(r"__launch_bounds__\(\d+\) ", "", cu.read_text())
                if "__float2half_rn(" not in text.split("kernel_main", 1)[1]:  # (NVRTC finds no cuda_fp16.h here)
                    text = re.sub(r"#include <cuda_fp16.h>\n|.*lc_f16_round.*\n", "", text)
                cu.write_text(text)
                r = lc_cubin(cu, nvcc, ptxas, True, bool(args.ptxas))
            else:
                r = subprocess.run([nvcc, "-arch=sm_90", "-cubin", "-O3", "-std=c++17", "-Xptxas", "-v", "-o",
                                    str(cu.with_suffix(".cubin")), str(cu)], capture_output=True, text=True, timeout=600)
            if r.returncode:
                print(f"{shape} {v}: nvcc failed\n{r.stderr[-2000:]}")
                return 1
            regs = re.search(r"Used (\d+) registers", r.stderr)
            spill = re.search(r"(\d+) bytes spill stores", r.stderr)
            line = (f"{shape:22s} {v:9s} {tl.BM}x{tl.BN}, {tl.threads // 32} warps of {tl.WM}x{tl.WN}: "
                    f"{regs.group(1) if regs else '?'} registers, {spill.group(1) if spill else '?'} B spilled")
            if cuobjdump:
                from rnn_sass import sass_of

                sass = sass_of(cu.with_suffix(".cubin"), cuobjdump).splitlines()
                bar = [i for i, s in enumerate(sass) if "BAR.SYNC" in s]
                back = [i for i, s in enumerate(sass) if re.search(r"BRA 0x", s)]
                if bar and len(back) >= 2:
                    ops = Counter(m.group(1).split(".")[0] for s in sass[bar[0]:back[-2] + 1]
                                  if (m := re.search(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P[0-9T] )?([A-Z0-9_.]+)", s)))
                    total, hmma = sum(ops.values()), ops["HMMA"]
                    line += (f"; loop {total} instructions / {hmma} HMMA = {total / max(hmma, 1):.1f} (LDS {ops['LDS']}, "
                             f"LDG {ops['LDG']}, STS {ops['STS']}, FSETP {ops['FSETP']}, F2F {ops['F2F']}, "
                             f"F2FP {ops['F2FP']}, HADD2 {ops['HADD2']})")
                body = k_loop(sass)
                if body:  # (the k loop alone: the range above also takes the epilogue's stores where it is short)
                    ops = Counter(body)
                    line += (f"; k loop {len(body)} / {ops['HMMA']} HMMA = {len(body) / max(ops['HMMA'], 1):.1f} "
                             f"(LDG {ops['LDG']}, integer {sum(ops[o] for o in INTEGER)}, LDS {ops['LDS']}, "
                             f"STS {ops['STS']}, BAR {ops['BAR']}, LDL {ops['LDL']})")
                    sc = schedule(k_loop_lines(sass))
                    line += (f"\n    loads: {sc['ldg']} LDG, {sc['before_hmma']} before the first HMMA, {sc['in_flight']} in "
                             f"flight at most, >= {sc['cover']} HMMA between a load and its reader; "
                             f"{sc['sts_before_last_hmma']} STS before the last HMMA")
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
