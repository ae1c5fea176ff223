"""The FP32 tile's machine code without a GPU (benchmarks/NOTES.md, "The FP32 tile's next step in
flight"): the blocks stage of fvdb's SparseConv3d (bench_fvdb.py's `layer`: 3x3x3, 64 -> 64 over a
one-voxel shell, its map folded) and of a plain Conv (ResNet-18's layer1 3x3, 64 -> 64 on 56 x 56,
batch 32, Winograd off) on operators/tiled.py's pipelined tile, translated to CUDA C++ by
rnn_sass.py (its "lc" dialect: LuisaCompute's buffers and NVRTC's options) and compiled for sm_90.
Reported a k step (the tile's `kt` loop): registers, stack and spills; the global loads and where
they sit against the step's FFMAs (issued before the first FFMA, between, after the last); the
dependent pairs (a load whose address needs another load of the same step: the gather's map
lookup then its feature row); instructions a FFMA. (The layer's loop is the same at radius 40 and
126, the benchmark's: only constants move.)

    LD_LIBRARY_PATH=<stub> python benchmarks/experiments/tile_sass.py sparse conv [--nvrtc]
        [--ptxas /path/to/ptxas-12.1] [--cuobjdump /path/to/cuobjdump] [--radius 126] [--keep DIR]

--forms: SparseConv3d.fp32_form's values (operators/fvdb/conv.py: "early" the tile as it was, "rows"
its own rows' taps and B in 16-byte loads, "ahead" also the map's entries a step ahead of the features,
"uniform" rows with each step's tap and channel from its first k);
a Conv has no gather (its kernel is the same in all three).
Compare the forms with each other, not with a measured kernel."""
from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parents[1] / "tests" / "fvdb"))
from mma_sass import INTEGER, compiler_args, compilers  # noqa: E402
from rnn_sass import lc_cubin, opcode, ptxas_usage, sass_of, translate  # noqa: E402


def sparse_model(radius: float):
    """bench_fvdb's `layer` over a shell of `radius` (the tile's code does not depend on the voxels'
    count beyond its constants)."""
    import bench_fvdb as bf
    import numpy as np

    from luisaml.fvdb import GridBatch

    gb = GridBatch.from_ijk([bf.shell_voxels(radius)])
    rng = np.random.default_rng(0)
    C, K = bf.CHANNELS, bf.KERNEL
    w = (rng.standard_normal((C, C, K, K, K)) / np.sqrt(C * 27)).astype(np.float32)
    b = rng.standard_normal(C).astype(np.float32)
    bn = [np.ones(C, np.float32)] * 4
    return bf._models(gb, w, b, bn)[0]


def conv_model():
    """ResNet-18's layer1 3x3 Conv, 64 -> 64 on 56 x 56 at batch 32, with a bias."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((64, 64, 3, 3)) / 24).astype(np.float32)
    b = rng.standard_normal(64).astype(np.float32)
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1, 1, 1, 1], name="conv")
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64, 56, 56])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 64, 56, 56])],
                          [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def plan_stage(shape: str, form: str, radius: float):
    """(plan, the blocks stage's function name, its tiling) of a shape with SparseConv3d.fp32_form = form."""
    from luisaml.operators.fvdb.conv import SparseConv3d
    from luisaml.runtime import analyze

    SparseConv3d.fp32_form = form
    model = sparse_model(radius) if shape == "sparse" else conv_model()
    plan = analyze(model, batch_axis=None if shape == "sparse" else 0, target="cuda", winograd=False)
    k, st = next((k, s) for k, s in enumerate(plan.schedule.stages)
                 if s.root[0].op_type in ("SparseConv3d", "Conv") and s.domain == "blocks")
    return plan, f"stage_{k}", st.root[1].block_tiling()


def kt_loop(sass: list[str]) -> list[tuple[int, str]]:
    """(address, line) of the tile's k-step loop: the backward branch whose range holds the most FFMA."""
    ops = [(int(m.group(1), 16), s) for s in sass if (m := re.search(r"/\*([0-9a-f]{4,})\*/", s)) and opcode(s)]
    best = []
    for i, (addr, s) in enumerate(ops):
        b = re.search(r"BRA 0x([0-9a-f]+)", s)
        if b and int(b.group(1), 16) < addr:
            body = [(a, t) for a, t in ops[:i + 1] if a >= int(b.group(1), 16)]
            if sum(opcode(t).startswith("FFMA") for _, t in body) > sum(opcode(t).startswith("FFMA") for _, t in best):
                best = body
    return best


def _regs(s: str) -> tuple[set[str], set[str]]:
    """(registers written, registers read) of an instruction (the first operand written)."""
    m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[0-9T] )?[A-Z0-9_.]+\s+(.*?)\s*;", s)
    if not m:
        return set(), set()
    ops = [o.strip() for o in m.group(1).split(",")]
    regs = [set(re.findall(r"\bR(\d+)\b", o)) for o in ops]
    if opcode(s).split(".")[0] in ("STG", "STS", "ST", "BAR", "BRA", "EXIT", "ISETP", "FSETP"):
        return set(), set().union(*regs) if regs else set()
    written = regs[0] if regs else set()
    if opcode(s).split(".")[0] in ("LDG", "LDS", "LD") and ".128" in opcode(s):
        written = {str(int(r) + d) for r in written for d in range(4)}
    elif ".64" in opcode(s) and written:
        written = {str(int(r) + d) for r in written for d in range(2)}
    return written, set().union(*regs[1:]) if len(regs) > 1 else set()


def report(body: list[tuple[int, str]]) -> str:
    """The loop's loads against its FFMAs."""
    lines = [s for _, s in body]
    base = [opcode(s).split(".")[0] for s in lines]
    c = Counter(base)
    ffma = [i for i, o in enumerate(base) if o == "FFMA"]
    loads = [i for i, o in enumerate(base) if o in ("LDG", "LD")]
    first, last = (ffma[0], ffma[-1]) if ffma else (len(base), -1)
    before = sum(i < first for i in loads)
    after = sum(i > last for i in loads)
    # a load whose address registers were written by an earlier load of the loop (through integer ops):
    # the gather's second half, which cannot issue before the first's round trip
    from_load: dict[str, bool] = {}
    dependent = []
    for i, s in enumerate(lines):
        w, r = _regs(s)
        fed = any(from_load.get(x) for x in r)
        if base[i] in ("LDG", "LD") and fed:
            dependent.append(i)
        for x in w:
            from_load[x] = base[i] in ("LDG", "LD") or (fed and base[i] in INTEGER + ("IMAD", "ISCADD"))
    dep_before = sum(i < first for i in dependent)
    ffma_before_dep = [sum(j < i for j in ffma) for i in dependent]
    # the forward branches inside the step (the fetch's guard, and the ahead form's index loads, once
    # a tap): the instructions each skips
    addrs = [a for a, _ in body]
    skips = [sum(1 for a in addrs if a0 < a < int(m.group(1), 16)) for a0, s in body
             if (m := re.search(r"BRA 0x([0-9a-f]+)", s)) and addrs[0] < int(m.group(1), 16) <= addrs[-1]]
    kinds = Counter(o for o in (opcode(s) for s in lines) if o.split(".")[0] in ("LDG", "LD", "LDL", "STL", "LDS", "STS"))
    return (f"k step {len(lines)} instr, FFMA {c['FFMA']}, {len(lines) / max(c['FFMA'], 1):.2f} instr a FFMA; "
            f"global loads {len(loads)} ({before} before the first FFMA, {len(loads) - before - after} between, "
            f"{after} after the last); dependent loads {len(dependent)} ({dep_before} before the first FFMA; FFMAs "
            f"before each: {ffma_before_dep}); LDS {c['LDS']}, STS {c['STS']}, BAR {c['BAR']}, "
            f"integer {sum(c[o] for o in INTEGER)}; {dict(kinds)}; forward branches skip {skips} instr")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("shapes", nargs="+", choices=("sparse", "conv"))
    ap.add_argument("--forms", default="early,rows,ahead,uniform")
    ap.add_argument("--radius", type=float, default=126.0)  # (bench_fvdb.GPU_RADIUS)
    compiler_args(ap)
    args = ap.parse_args()
    tools = compilers(args, "tile-sass-")
    if tools is None:
        return 1
    nvcc, cuobjdump, ptxas, folder = tools
    for shape in args.shapes:
        for form in args.forms.split(","):
            plan, stage, tl = plan_stage(shape, form, args.radius)
            cu = folder / f"{shape}-{form}.cu"
            cu.write_text(translate(plan.source, stage, "lc"))
            r = lc_cubin(cu, nvcc, ptxas, args.nvrtc, bool(args.ptxas))
            if r.returncode:
                print(f"{shape} {form}: build failed\n{r.stderr[-3000:]}")
                return 1
            line = f"{shape:6s} {form:6s} {tl.describe()}: {ptxas_usage(r.stderr)}"
            if cuobjdump:
                sass = sass_of(cu.with_suffix(".cubin"), cuobjdump)
                line += "\n    " + report(kt_loop(sass.splitlines()))
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
