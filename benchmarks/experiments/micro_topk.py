"""TopK over long lines on the CUDA backend: each stage's milliseconds in the chunked form
(operators/topk_chunks.py), the block per line before it (operators/topk_block.py) and, asked for,
one thread a line (the items form, topk_block.MIN_LENGTH raised past the line), each checked against
onnxruntime, and torch.topk over the same line (benchmarks/NOTES.md, "TopK over a long line: chunks
over the SMs").

Shapes are LINESxLENGTH:K, the detector head's (1x80000:64) first. A luisaml stage is timed alone
(net.profile: launch and synchronise, the median of `repeat`), so the floor that costs is printed too:
a one-element Relu's stage the same way. torch.topk is timed both ways: launch and synchronise, and
CUDA events over 100 calls back to back (the kernels alone).

    LUISAML_BACKEND=cuda python benchmarks/experiments/micro_topk.py [SHAPES...] [--forms chunks,block,items]
        [--share S]

--forms sets LUISAML_TOPK (operators/topk.py's A/B switch, read when a plan is built) for each form in
turn; --share fixes the chunked form's elements a lane (topk_chunks.SHARE; default ~sqrt(n / 1024))."""
import argparse
import os
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import luisaml
from luisaml.operators import topk_block, topk_chunks


def model(lines: int, n: int, k: int):
    node = helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=-1)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [lines, n])],
                          [helper.make_tensor_value_info("v", TensorProto.FLOAT, [lines, k]),
                           helper.make_tensor_value_info("i", TensorProto.INT64, [lines, k])],
                          [numpy_helper.from_array(np.array([k], np.int64), "k")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 11)])
    m.ir_version = 10  # the lent machine's onnxruntime reads IR 10 at most
    return m


def floor_ms(repeat: int) -> float:
    """A one-element Relu's stage, timed as a TopK stage is: what launch and synchronise cost."""
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 10
    (_, ms), = luisaml.compile(m, batch_axis=None).profile({"x": np.ones(1, np.float32)}, repeat=repeat)
    return ms


def time_luisaml(m, x, want, form: str, repeat: int) -> str:
    min_length = topk_block.MIN_LENGTH
    os.environ["LUISAML_TOPK"] = "block" if form == "items" else form
    if form == "items":
        topk_block.MIN_LENGTH = x.shape[-1] + 1
    try:
        net = luisaml.compile(m, batch_axis=None)
        got = net.run({"x": x})
        ok = np.array_equal(got["v"], want[0]) and np.array_equal(got["i"], want[1])
        stages = net.profile({"x": x}, repeat=3 if form == "items" else repeat)
    finally:
        topk_block.MIN_LENGTH = min_length
    parts = " + ".join(f"{ms:.3f}" for _, ms in stages)
    return (f"  luisaml {form:6s}: {sum(ms for _, ms in stages):8.3f} ms ({parts}; run {stages.run_ms:.3f}); "
            f"equal to onnxruntime: {ok}")


def time_torch(x, k: int, want, repeat: int) -> str:
    try:
        import torch
    except ImportError:
        return "  torch.topk: torch not installed"
    if not torch.cuda.is_available():
        return "  torch.topk: no CUDA device for torch"
    t = torch.from_numpy(x).cuda()
    v, i = torch.topk(t, k)
    torch.cuda.synchronize()
    same = np.array_equal(v.cpu().numpy(), want[0]) and np.array_equal(i.cpu().numpy(), want[1])
    walls = []
    for _ in range(repeat):
        s = time.perf_counter()
        torch.topk(t, k)
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - s) * 1e3)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(100):
        torch.topk(t, k)
    end.record()
    torch.cuda.synchronize()
    return (f"  torch.topk     : {np.median(walls):8.3f} ms launched and synchronised, "
            f"{start.elapsed_time(end) / 100:.4f} ms a call back to back; the same picks: {same}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("shapes", nargs="*", default=["1x80000:64", "1x200000:100", "8x20000:32", "1x80000:1"])
    p.add_argument("--forms", default="chunks,block")
    p.add_argument("--repeat", type=int, default=21)
    p.add_argument("--share", type=int, default=None)
    a = p.parse_args()
    topk_chunks.SHARE = a.share
    print(f"launch and synchronise floor: {floor_ms(a.repeat):.3f} ms (a one-element Relu's stage)")
    for shape in a.shapes:
        lines, rest = shape.split("x")
        n, k = (int(v) for v in rest.split(":"))
        m = model(int(lines), n, k)
        # distinct values (torch's ties go its own way; the tests hold the ties)
        x = np.random.default_rng(0).permutation(int(lines) * n).reshape(int(lines), n).astype(np.float32) / (int(lines) * n)
        want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
        tiling = topk_chunks.choose(int(lines), n, k, luisaml.dtypes.FLOAT)
        print(f"{lines} x {n}, k = {k} (chunked: S {tiling.share}, C {tiling.chunks}, G {tiling.lists}):")
        for form in a.forms.split(","):
            print(time_luisaml(m, x, want, form, a.repeat), flush=True)
        print(time_torch(x, k, want, a.repeat), flush=True)


if __name__ == "__main__":
    main()
