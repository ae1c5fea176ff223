"""The recurrent block loop's machine code without a GPU (benchmarks/NOTES.md, "Why the unrolled k loop
bought nothing"): a recurrent node's blocks stage (operators/rnn_block.py) planned for CUDA, translated from
the plan's DSL to CUDA C++ in two dialects and compiled for sm_90: ptxas -v's registers, stack and spills,
and in the step's k loop the loads of R (LDG / LD / LDL) against the FMAs: how many loads are issued before
the first FMA that uses one, and the instructions a k.

    python benchmarks/experiments/rnn_sass.py bilstm1 bilstm2 gru lstm [--forms block,unrolled,auto] [--dialects lc,plain]
        [--cuobjdump /path/to/cuobjdump] [--ptxas /path/to/ptxas] [--nvrtc] [--keep DIR]

Shapes: bilstm1 / bilstm2 the zoo's BiLSTM tagger's layers (64 rows, 128 -> 256 and 512 -> 256 units a
direction, 64 steps, bidirectional); gru / lstm the zoo's (1,024 rows, 64 -> 128, 32 steps; torch's export
where torch is installed, else the same shapes as one ONNX node, GRU with linear_before_reset as torch's).

Dialects: "lc" as LuisaCompute's CUDA backend emits and builds it (the wheel's device library, read from
liblc-backend-cuda.so's strings): the kernel's arguments one `Params` struct by value whose buffers are
`LCBuffer {T *__restrict__ ptr; size_t size_bytes;}`, the weight blob a byte buffer read through
`lc_byte_buffer_read<T>` (the address an integer turned back into a pointer), NVRTC's options
(--use_fast_math -restrict -extra-device-vectorization) to PTX, then ptxas at -O3 as the driver's JIT
(--ptxas: another one, e.g. CUDA 12.1's from the nvidia-cuda-nvcc-cu12==12.1.105 wheel, the release of the
wheel's NVRTC; the PTX's .version is then lowered to 8.1 as LuisaCompute retries a load). --nvrtc: the PTX
from the wheel's own compiler, luisa/dylibs/luisa_nvrtc (NVRTC 12.1, through the protocol of luisaml/
nvrtc_front.py) in place of nvcc's; it names libcuda.so.1 but calls nothing in it, so on a machine without a
driver an empty library of that name on LD_LIBRARY_PATH lets it start
(`echo 'int x;' | gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o DIR/libcuda.so.1 -x c -`).
"plain": mma_sass.py's dialect (bare __restrict__ pointers, the blob indexed as floats from its base).
Compare the dialects and forms with each other, not with a measured kernel."""
from __future__ import annotations

import argparse
import os
import re
import struct
import subprocess
import sys
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "tests"))
sys.path.insert(0, str(HERE.parents[1] / "tests" / "operators"))
from mma_sass import INTEGER, _close, _ternaries, compiler_args, compilers  # noqa: E402

PRELUDE = r"""
typedef unsigned long long lc_ulong;
typedef unsigned char lc_ubyte;
typedef unsigned int uint;
struct alignas(16) lc_float4 { float x, y, z, w; };
__device__ __forceinline__ lc_float4 lc_make_float4(float x, float y, float z, float w) { return lc_float4{x, y, z, w}; }
__device__ __forceinline__ lc_float4 lc_make_float4(float x) { return lc_float4{x, x, x, x}; }
__device__ __forceinline__ float lc_select(float f, float t, bool p) { return p ? t : f; }
__device__ __forceinline__ float lc_clamp(float x, float a, float b) { return fminf(fmaxf(x, a), b); }
"""

# LuisaCompute's buffers and byte-buffer reads (liblc-backend-cuda.so's device library, luisa-python 0.3.7)
LC_PRELUDE = r"""
template<typename T> struct LCBuffer { T *__restrict__ ptr; size_t size_bytes; };
template<typename T> struct LCBuffer<const T> {
  const T *__restrict__ ptr; size_t size_bytes;
  __device__ LCBuffer(LCBuffer<T> b) : ptr{b.ptr}, size_bytes{b.size_bytes} {}
  LCBuffer() = default;
};
template<typename T, typename I> __device__ inline T lc_buffer_read(LCBuffer<T> b, I i) {
  __builtin_assume(__isGlobal(b.ptr)); return b.ptr[i]; }
template<typename T, typename I> __device__ inline void lc_buffer_write(LCBuffer<T> b, I i, T v) {
  __builtin_assume(__isGlobal(b.ptr)); b.ptr[i] = v; }
template<typename T> __device__ inline T lc_byte_buffer_read(LCBuffer<const lc_ubyte> buffer, lc_ulong offset) {
  __builtin_assume(__isGlobal(buffer.ptr));
  auto address = reinterpret_cast<lc_ulong>(buffer.ptr + offset);
  return *reinterpret_cast<T *>(address);
}
"""

FUNCS = {"fma": "fmaf", "exp": "__expf", "tanh": "tanhf", "min": "min", "max": "max", "clamp": "lc_clamp",
         "isnan": "isnan", "select": "lc_select", "abs": "fabsf", "popcount": "__popc"}


def _calls(s: str, name: str, fn) -> str:
    """Rewrite every call name(args) in s as fn(args), the calls inside args first."""
    out = ""
    while m := re.search(rf"(?<![\w.]){re.escape(name)}\(", s):
        o = m.end() - 1
        c = _close(s, o)
        out += s[:m.start()] + fn(_calls(s[o + 1:c], name, fn))  # (a call inside the arguments: a read's address)
        s = s[c + 1:]
    return out + s


def translate(src: str, stage: str, dialect: str) -> str:
    """The CUDA C++ of DSL function `stage` of a plan's source in a dialect ("lc" or "plain")."""
    lines = src.splitlines()
    i = next(j for j, line in enumerate(lines) if line.startswith(f"def {stage}("))
    params = re.match(r"def \w+\((.*)\):", lines[i]).group(1).split(", ")
    shared = {m[0]: (m[2], m[1]) for m in re.findall(r"^(Shared_(\w+?)_\d+) = luisa.SharedArrayType\((\d+), \w+\)", src, re.M)}
    bufs = {p for p in params if not p.endswith(": int")}
    out, declared, stack, threads = [], set(), [4], 256
    for line in lines[i + 1:]:
        if line.strip() and not line.startswith(" "):
            break
        s, ind = line.strip(), len(line) - len(line.lstrip())
        if not s or s.startswith(("#", '"""')):
            continue
        while ind < stack[-1]:
            stack.pop()
            out.append(" " * stack[-1] + "}")
        if m := re.match(r"set_block_size\((\d+)", s):
            threads = int(m.group(1))
            continue
        pad = " " * ind
        if s == "else:":
            out[-1] += " else {"
            stack.append(ind + 4)
            continue
        s = s.replace("int(thread_id().x)", "(int)threadIdx.x").replace("int(block_id().x)", "(int)blockIdx.x")
        # the blob: a byte offset
        s = _calls(s, "weights.read", lambda a: (f"lc_byte_buffer_read<{a.split(', ', 1)[0].replace('float4', 'lc_float4')}>(weights, (lc_ulong)({a.split(', ', 1)[1]}))"
                                                 if dialect == "lc" else
                                                 f"(*(const float *)((const char *)weights + ({a.split(', ', 1)[1]})))"))
        for b in bufs - {"weights"}:
            s = _calls(s, f"{b}.read", lambda a, b=b: f"lc_buffer_read({b}, {a})" if dialect == "lc" else f"{b}[{a}]")
        for name, fn in FUNCS.items():
            s = _calls(s, name, lambda a, fn=fn: f"{fn}({a})")
        s = _calls(s, "float4", lambda a: f"lc_make_float4({a})")
        for cast, ctype in (("uint", "unsigned"), ("int", "int")):  # (SparseConv3d's tap masks: tile_sass.py)
            s = _calls(s, cast, lambda a, ctype=ctype: f"(({ctype})({a}))")
        s = re.sub(r"(?<![\w.])(\d+\.\d*(?:e-?\d+)?)(?![\w.])", r"\1f", s)  # (python floats: the DSL's float)
        s = s.replace("//", "/").replace(" and ", " && ").replace(" or ", " || ").replace("not ", "!")
        if m := re.match(r"(\w+)\.write\((.*)\)$", s):
            at, value = m.group(2).rsplit(", ", 1) if "(" not in m.group(2).rsplit(", ", 1)[1] else (None, None)
            if at is None:  # (a value with a comma inside: split at the top level)
                body, depth = m.group(2), 0
                for j, ch in enumerate(body):
                    depth += {"(": 1, ")": -1, "[": 1, "]": -1}.get(ch, 0)
                    if ch == "," and depth == 0:
                        at, value = body[:j], body[j + 2:]
            out.append(f"{pad}lc_buffer_write({m.group(1)}, {at}, {value});" if dialect == "lc"
                       else f"{pad}{m.group(1)}[{at}] = {value};")
        elif m := re.match(r"for (\w+) in range\((\w+)\):", s):
            out.append(f"{pad}for (int {m.group(1)} = 0; {m.group(1)} < {m.group(2)}; ++{m.group(1)}) {{")
            stack.append(ind + 4)
        elif m := re.match(r"if (.*):$", s):
            out.append(f"{pad}if ({m.group(1)}) {{")
            stack.append(ind + 4)
        elif s == "sync_block()":
            out.append(f"{pad}__syncthreads();")
        elif m := re.match(r"(\w+) = (Shared_\w+_\d+)\(\)", s):
            n, dsl = shared[m.group(2)]
            out.append(f"{pad}__shared__ {'lc_float4' if dsl == 'float4' else dsl} {m.group(1)}[{n}];")
            declared.add(m.group(1))
        elif m := re.match(r"(\w+) = Arr_(\w+?)_(\d+)\(\)", s):
            out.append(f"{pad}{'lc_float4' if m.group(2) == 'float4' else m.group(2)} {m.group(1)}[{m.group(3)}];")
            declared.add(m.group(1))
        elif m := re.match(r"(\w+)(\[.*\])? = (.*)$", s):
            name, index, e = m.groups()
            e = _ternaries(f"({e})")
            first = not index and name not in declared
            declared.add(name)
            out.append(f"{pad}{'auto ' if first else ''}{name}{index or ''} = {e};")
        else:
            raise ValueError(f"not translated: {s}")
    out += ["  }"] * (len(stack) - 1)
    # (LuisaCompute declares every local at the function's top; declared at the first assignment here:
    # the same SSA once NVVM promotes them)
    body = "\n".join(out)
    if dialect == "lc":
        fields = "".join(f"  int {p.split(':')[0]};\n" if p.endswith(": int") else
                         f"  LCBuffer<{'const lc_ubyte' if p == 'weights' else 'float'}> {p};\n" for p in params)
        unpack = "".join(f"  auto {p.split(':')[0]} = params.{p.split(':')[0]};\n" for p in params)
        head = (LC_PRELUDE + f"struct alignas(16) Params {{\n{fields}}};\n"
                f'extern "C" __global__ void kernel_main(const Params params) {{\n{unpack}')
    else:
        args = ", ".join(f"int {p.split(':')[0]}" if p.endswith(": int") else
                         f"const void *__restrict__ {p}" if p == "weights" else
                         f"const float *__restrict__ {p}" if p.startswith("x_") else f"float *__restrict__ {p}" for p in params)
        head = f'extern "C" __global__ void __launch_bounds__({threads}) kernel_main({args}) {{\n'
    return PRELUDE + head + body + "\n}\n"


def wheel_nvrtc(cu: Path, ptx: Path):
    """Compile cu to ptx with the luisa-python wheel's luisa_nvrtc and LuisaCompute's options (the strings of
    liblc-backend-cuda.so): on stdin the file name and the source, each an 8-byte little-endian size (NUL
    included) and its bytes; PTX on stdout."""
    import luisa

    exe = Path(luisa.__file__).parent / "dylibs" / "luisa_nvrtc"

    def blob(text: str) -> bytes:
        data = text.encode() + b"\0"
        return struct.pack("<Q", len(data)) + data

    opts = ["-arch=compute_90", "--std=c++17", "--use_fast_math", "-default-device", "-restrict",
            "-extra-device-vectorization", "-dw", "-ewp"]
    r = subprocess.run([str(exe), *opts], input=blob(cu.name) + blob(cu.read_text()), capture_output=True, timeout=600)
    ptx.write_bytes(r.stdout)
    ok = r.returncode == 0 and b".target" in r.stdout
    return subprocess.CompletedProcess(r.args, 0 if ok else 1, "", r.stderr.decode(errors="replace"))


def lc_cubin(cu: Path, nvcc: str, ptxas: str | None, nvrtc: bool, old_ptxas: bool):
    """Build cu (LuisaCompute's dialect) as the driver would: PTX from the wheel's NVRTC (nvrtc) or from nvcc
    with NVRTC's options, then ptxas -O3 -v (ptxas, default nvcc's; old_ptxas: an older one, given the
    .version LuisaCompute retries a load with) into cu's .cubin; ptxas -v's report in the result's stderr."""
    ptx, cubin = cu.with_suffix(".ptx"), cu.with_suffix(".cubin")
    r = (wheel_nvrtc(cu, ptx) if nvrtc else
         subprocess.run([nvcc, "-arch=compute_90", "-ptx", "-std=c++17", "--use_fast_math", "-restrict",
                         "-extra-device-vectorization", "-o", str(ptx), str(cu)], capture_output=True, text=True, timeout=600))
    if not r.returncode and old_ptxas:
        ptx.write_text(re.sub(r"^\.version .*$", ".version 8.1", ptx.read_text(), count=1, flags=re.M))
    if not r.returncode:
        r = subprocess.run([ptxas or nvcc.replace("nvcc", "ptxas"), "-arch=sm_90", "-O3", "-v", "-o", str(cubin), str(ptx)],
                           capture_output=True, text=True, timeout=600)
    return r


def ptxas_usage(report: str) -> str:
    """ptxas -v's registers, stack frame and spills: "N registers, stack S B, spill stores/loads B"."""
    regs = re.search(r"Used (\d+) registers", report)
    stack = re.search(r"(\d+) bytes stack frame", report)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    return (f"{regs.group(1) if regs else '?'} registers, stack {stack.group(1) if stack else '?'} B, "
            f"spill {spill.group(1) + '/' + spill.group(2) if spill else '?'} B")


def sass_of(cubin: Path, cuobjdump: str) -> str:
    """cubin's machine code (cuobjdump -sass; nvdisasm beside it where cuobjdump 13 reads no cubin of an
    older ptxas), also written beside it as .sass."""
    env = dict(os.environ, PATH=os.path.dirname(cuobjdump) + os.pathsep + os.environ.get("PATH", ""))
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, env=env, timeout=300).stdout
    if not opcode_lines(sass):
        sass = nvdisasm(os.path.join(os.path.dirname(cuobjdump), "nvdisasm"), cubin)
    cubin.with_suffix(".sass").write_text(sass)
    return sass


def plan_stage(shape: str, form: str):
    """(plan, the steps' stage name, its BlockLoop) of a shape under compile's recurrent form."""
    from test_rnn import case, merge
    from util import graph_model, split_rnn_feeds

    from luisaml.runtime import analyze

    if shape.startswith("bilstm"):
        I = 128 if shape == "bilstm1" else 512
        nodes, feeds = merge(case("LSTM", 0, S=64, B=64, I=I, H=256, use=("B",), seed=11, direction="bidirectional"))
    else:
        try:
            import torch  # noqa: F401

            sys.path.insert(0, str(HERE.parent))
            import bench_rnn

            model = bench_rnn.export(bench_rnn.module(shape), 1024)
            nodes = None
        except ImportError:
            extra = {"linear_before_reset": 1} if shape == "gru" else {}
            nodes, feeds = merge(case(shape.upper(), 0, S=32, B=1024, I=64, H=128, use=("B",), **extra))
    if nodes is not None:
        feeds, inits = split_rnn_feeds(feeds)
        model = graph_model(nodes, feeds, inits, opset=22)
    plan = analyze(model, batch_axis=None, target="cuda", recurrent=form)
    k, st = next((k, s) for k, s in enumerate(plan.schedule.stages) if s.root[0].op_type.endswith("Steps"))
    return plan, f"stage_{k}", st.root[1].block


def plan_gates(plan, stage: str) -> int:
    """The gates of the recurrent node of a stage."""
    st = plan.schedule.stages[int(stage.split("_")[1])]
    return st.root[1].cell.gates


def opcode_lines(sass: str) -> list[str]:
    return [s for s in sass.splitlines() if opcode(s)]


def nvdisasm(path: str, cubin: Path) -> str:
    """nvdisasm's listing of a cubin, its branch labels (`(.L_x_N)) as the addresses they mark."""
    text = subprocess.run([path, str(cubin)], capture_output=True, text=True, timeout=300).stdout
    marks, pending = {}, []
    for line in text.splitlines():
        if m := re.match(r"^(\.L_x_\d+):", line):
            pending.append(m.group(1))
        elif (m := re.search(r"/\*([0-9a-f]{4,})\*/", line)) and pending:
            marks.update((p, m.group(1)) for p in pending)
            pending = []
    return re.sub(r"`\((\.L_x_\d+)\)", lambda m: "0x" + marks.get(m.group(1), "0"), text)


def opcode(s: str) -> str | None:
    m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[0-9T] )?([A-Z0-9_.]+)", s)
    return m.group(1) if m else None


def k_loops(sass: list[str]) -> list[list[str]]:
    """The opcodes of each k loop: each backward branch's range (its target to it) holding global loads
    and at least 16 FFMA and no other such range (the step loop around them holds them all)."""
    ops = [(int(m.group(1), 16), s) for s in sass if (m := re.search(r"/\*([0-9a-f]{4,})\*/", s)) and opcode(s)]
    found = []
    for i, (addr, s) in enumerate(ops):
        b = re.search(r"BRA 0x([0-9a-f]+)", s)
        if b and int(b.group(1), 16) < addr:
            lo = int(b.group(1), 16)
            base = [opcode(t).split(".")[0] for a, t in ops[:i + 1] if a >= lo]
            if base.count("FFMA") >= 16 and (base.count("LDG") or base.count("LD")):
                found.append((lo, addr, [opcode(t) for a, t in ops[:i + 1] if a >= lo]))
    return [body for lo, hi, body in found if not any(lo <= l2 and h2 <= hi and (l2, h2) != (lo, hi) for l2, h2, _ in found)]


def loop_report(body: list[str]) -> str:
    base = [o.split(".")[0] for o in body]
    c = Counter(base)
    loads = [i for i, o in enumerate(base) if o in ("LDG", "LD", "LDL")]
    first_ffma = next((i for i, o in enumerate(base) if o == "FFMA"), len(base))
    before = sum(1 for i in loads if i < first_ffma)
    # the longest run of global loads with no FFMA between
    runs, run = [], 0
    for o in base:
        if o in ("LDG", "LD"):
            run += 1
        elif o == "FFMA":
            runs.append(run)
            run = 0
    runs.append(run)
    kinds = Counter(o for o in body if o.split(".")[0] in ("LDG", "LD", "LDL", "STL", "LDS"))
    return (f"k loop {len(body)} instr, FFMA {c['FFMA']}, LDG {c['LDG']}, LD {c['LD']}, LDL {c['LDL']}, STL {c['STL']}, "
            f"LDS {c['LDS']}, integer {sum(c[o] for o in INTEGER)}; loads before the first FFMA {before}, "
            f"most loads in a row {max(runs)}; {dict(kinds)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("shapes", nargs="+")
    ap.add_argument("--forms", default="block,unrolled,auto")
    ap.add_argument("--dialects", default="lc,plain")
    compiler_args(ap)
    args = ap.parse_args()
    tools = compilers(args, "rnn-sass-")
    if tools is None:
        return 1
    nvcc, cuobjdump, ptxas, folder = tools
    for shape in args.shapes:
        for form in args.forms.split(","):
            plan, stage, bl = plan_stage(shape, form)
            for dialect in args.dialects.split(","):
                cu = folder / f"{shape}-{form}-{dialect}.cu"
                cu.write_text(translate(plan.source, stage, dialect))
                cubin = cu.with_suffix(".cubin")
                if dialect == "lc":  # NVRTC's options to PTX, then ptxas as the driver's JIT (-O3)
                    r = lc_cubin(cu, nvcc, ptxas, args.nvrtc, bool(args.ptxas))
                else:
                    r = subprocess.run([nvcc, "-arch=sm_90", "-cubin", "-O3", "-std=c++17", "-Xptxas", "-v", "-o",
                                        str(cubin), str(cu)], capture_output=True, text=True, timeout=600)
                if r.returncode:
                    print(f"{shape} {form} {dialect}: build failed\n{r.stderr[-3000:]}")
                    return 1
                proj = f" +proj {bl.UI}k" if bl.fused else ""
                line = (f"{shape:8s} {form:8s} {dialect:5s} {bl.SB}r x {bl.U}k{proj}, {bl.blocks} blocks of {bl.TU}: "
                        f"{ptxas_usage(r.stderr)}")
                if cuobjdump:
                    sass = sass_of(cubin, cuobjdump)
                    # (a k: the gates x rows x units multiply-adds of one k; GRU's split parts use fewer gates)
                    for body in k_loops(sass.splitlines()):
                        ks = sum(o.startswith("FFMA") for o in body) / (plan_gates(plan, stage) * bl.SB * bl.UB)
                        line += f"\n    {loop_report(body)}; {ks:g} k's, {len(body) / ks:.1f} instr a k"
                print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
