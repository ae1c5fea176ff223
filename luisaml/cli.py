"""The command line: `luisaml run | inspect | emit | bench MODEL`."""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import numpy as np


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="an .onnx file or a LuisaML .json model")
    p.add_argument("--weights", "-w", help="a safetensors file or a header-less weight blob")
    p.add_argument("--batch-axis", default="auto", choices=["auto", "0", "none"],
                   help="auto: one thread per sample along the symbolic leading dimension; none: one instance")


def _batch_axis(s: str):
    return {"auto": "auto", "0": 0, "none": None}[s]


def _parse_inputs(items: list[str]) -> dict[str, np.ndarray]:
    feeds = {}
    for item in items or []:
        if "=" not in item:
            raise SystemExit(f"--input expects NAME=FILE.npy, got {item!r}")
        name, path = item.split("=", 1)
        feeds[name] = np.load(path)
    return feeds


def _random_feeds(net, batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Return random inputs for every input not given (batch dimension = `batch`)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for s in net.inputs:
        shape = tuple(batch if not isinstance(d, int) else d for d in s.shape)
        dt = s.dtype.numpy
        if dt == np.bool_:
            feeds[s.name] = rng.random(shape) > 0.5
        elif dt.kind in "iu":
            feeds[s.name] = rng.integers(0, 4, shape).astype(dt)
        else:
            feeds[s.name] = rng.standard_normal(shape).astype(dt)
    return feeds


def cmd_run(a) -> int:
    import luisaml

    net = luisaml.compile(a.model, a.weights, backend=a.backend, batch_axis=_batch_axis(a.batch_axis), verbose=True)
    feeds = _parse_inputs(a.input)
    missing = {k: v for k, v in _random_feeds(net, a.batch).items() if k not in feeds}
    if missing:
        print(f"random inputs for {sorted(missing)} (batch {a.batch}, seed 0)", file=sys.stderr)
    feeds.update(missing)
    out = net.run(feeds)
    np.set_printoptions(precision=6, suppress=True, threshold=64, edgeitems=4)
    ref = None
    if a.compare:
        ref = _onnxruntime(a.model, a.weights, feeds)
    for name, v in out.items():
        print(f"{name}: {v.dtype}{list(v.shape)}")
        print(v)
        if ref is not None and name in ref:
            r = ref[name]
            diff = float(np.max(np.abs(v.astype(np.float64) - r.astype(np.float64)))) if v.size else 0.0
            print(f"onnxruntime {name}:")
            print(r)
            print(f"largest difference from onnxruntime: {diff:.3g}")
        if a.out:
            os.makedirs(a.out, exist_ok=True)
            np.save(os.path.join(a.out, f"{name.replace('/', '_')}.npy"), v)
    return 0


def _onnxruntime(model, weights, feeds):
    """Return onnxruntime's outputs for the same model and feeds (weights bound the same way)."""
    import onnxruntime as ort

    from .loaders import load_proto

    proto = load_proto(model, weights)
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


def cmd_inspect(a) -> int:
    from . import passes
    from .compiler import build_plan, unsupported_nodes
    from .loaders import load_proto

    proto = load_proto(a.model, a.weights)
    prep = passes.prepare(proto, batch_axis=_batch_axis(a.batch_axis))
    g = prep.model.graph
    print(f"model: {a.model}")
    opsets = ", ".join(f"{d or 'ai.onnx'} {v}" for d, v in sorted(prep.model.opsets.items()))
    print(f"opsets: {opsets}")
    print(f"batch axis: {prep.symbol or 'none (one instance)'}")
    for kind, names in (("inputs", g.inputs), ("outputs", g.outputs)):
        print(f"{kind}:")
        for n in names:
            print(f"  {_describe(g.var(n), prep)}")
    counts = collections.Counter(f"{n.domain + '::' if n.domain else ''}{n.op_type}" for n in g.nodes)
    print(f"nodes after folding: {len(g.nodes)}")
    for op, c in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {op:28s} {c}")
    missing = unsupported_nodes(g, prep.model)
    if missing:
        print(f"unsupported nodes ({len(missing)}):")
        for line in missing:
            print(f"  {line}")
        return 1
    plan = build_plan(prep, os.path.basename(str(a.model)))
    notes = [(n, op.describe()) for n, op in plan.ops if op.describe()]
    if notes:
        print("how nodes compile:")
        for n, d in notes:
            print(f"  {n.describe()}: {d}")
    print("register allocation: " + plan.allocation.report())
    if plan.fusion_note:
        print("batch kernel: " + plan.fusion_note)
    print(f"weight blob: {plan.blob.size} bytes in {len(plan.blob.layout)} tensors")
    return 0


def _describe(v, prep) -> str:
    """Return "'name': dtype[shape]" with the batch dimension shown as its symbol."""
    from .compiler import _kernel_shape
    from .model import shape_str, type_str

    try:
        _, _, shape = _kernel_shape(v, prep, {})
    except Exception:  # a shape that does not compile is shown as inferred
        shape = v.shape
    return f"'{v.name}': {type_str(v.elem_type)}{shape_str(shape)}"


def cmd_emit(a) -> int:
    from .runtime import analyze

    sys.stdout.write(analyze(a.model, a.weights, batch_axis=_batch_axis(a.batch_axis)).source)
    return 0


def cmd_bench(a) -> int:
    import luisa

    import luisaml

    t0 = time.perf_counter()
    net = luisaml.compile(a.model, a.weights, backend=a.backend, batch_axis=_batch_axis(a.batch_axis))
    feeds = _random_feeds(net, a.batch)
    net.run(feeds)  # the first run compiles the kernel
    print(f"compile + first run: {time.perf_counter() - t0:.2f} s on {net.backend}")
    times = []
    for _ in range(a.repeat):
        t = time.perf_counter()
        net.run(feeds)
        times.append((time.perf_counter() - t) * 1e3)
    p50, p95, p99 = np.percentile(times, [50, 95, 99])
    print(f"net.run, batch {a.batch}, {a.repeat} runs (host copies included): "
          f"P50 {p50:.3f} ms  P95 {p95:.3f} ms  P99 {p99:.3f} ms")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `luisaml` command."""
    ap = argparse.ArgumentParser(prog="luisaml", description="Compile ONNX models into one LuisaCompute kernel.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run", help="compile and run a model, print its outputs")
    _common(p)
    p.add_argument("--input", "-i", action="append", metavar="NAME=FILE.npy", help="an input (default: random)")
    p.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--batch", type=int, default=4, help="batch size of random inputs")
    p.add_argument("--out", help="folder to write each output as NAME.npy")
    p.add_argument("--compare", action="store_true", help="also run onnxruntime and print the largest difference")
    p.set_defaults(fn=cmd_run)
    p = sub.add_parser("inspect", help="inputs, outputs, op counts, unsupported nodes, register allocation")
    _common(p)
    p.set_defaults(fn=cmd_inspect)
    p = sub.add_parser("emit", help="print the generated module")
    _common(p)
    p.set_defaults(fn=cmd_emit)
    p = sub.add_parser("bench", help="time net.run on random inputs")
    _common(p)
    p.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--batch", type=int, default=65536)
    p.add_argument("--repeat", type=int, default=20)
    p.set_defaults(fn=cmd_bench)
    a = ap.parse_args(argv)
    from .model import ModelError

    try:
        return a.fn(a)
    except (ModelError, FileNotFoundError) as e:
        print(f"luisaml: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
