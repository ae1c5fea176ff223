"""Concurrency: threads sharing one network, and processes compiling the same model at once.

Threads: N threads call run() on one CompiledNetwork with different inputs and batch sizes (a
model with per-sample scratch buffers and one without), or compile models at the same time, or
each drive a NetworkInstance over the shared network. Every result is checked against
onnxruntime: a race shows up as a wrong result (the outside probe saw 4 threads get wrong
results), a crash as an abort.

Processes: 2-3 child processes compile and run the same model at once with an empty
LUISAML_CACHE, either with LuisaCompute's kernel cache in a private copy of the Python executable
(empty too, so they race to write the same kernel file) or with the real kernel cache and a
kernel no one has compiled before.
"""
from __future__ import annotations

import threading
import uuid

import numpy as np
from onnx import helper

from .. import child
from ..harness import (
    FAIL_ERROR,
    FAIL_WRONG,
    Case,
    Fail,
    attempt,
    compare_outputs,
    judge,
    recipe,
)
from ..models import F, make_model, ort_outputs, save, vi
from .cache import judge_child


def scratch_model(nonce: float = 0.0):
    """x[N,64] -> MatMul to [N,4096+] (past the register limit: per-sample scratch) -> ReduceSum ->
    Add -> y[N,1]: threads sharing the scratch buffers would mix samples."""
    rng = np.random.default_rng(7)
    w = rng.uniform(-0.1, 0.1, (64, 4160)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"), helper.make_node("Tanh", ["h"], ["t"], name="tanh"),
             helper.make_node("ReduceSum", ["t", "axes"], ["s"], name="rsum", keepdims=1),
             helper.make_node("Add", ["s", "bias"], ["y"], name="add")]
    inits = {"W": w, "axes": np.array([1], np.int64), "bias": np.array([nonce], np.float32)}
    return make_model(nodes, [vi("x", F, ["N", 64])], [vi("y", F, ["N", 1])], inits, name="scratch")


def small_model(nonce: float = 0.0):
    rng = np.random.default_rng(8)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"), helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("Add", ["r", "bias"], ["y"], name="add")]
    inits = {"W": rng.uniform(-1, 1, (64, 8)).astype(np.float32), "bias": np.full(8, nonce, np.float32)}
    return make_model(nodes, [vi("x", F, ["N", 64])], [vi("y", F, ["N", 8])], inits, name="small")


MODELS = {"scratch": scratch_model, "small": small_model}


def _inputs(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, (n, 64)).astype(np.float32)


def _threads(target, count: int) -> list[BaseException]:
    """Run target(k) in `count` threads at once; return the exceptions they raised."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(count)

    def body(k):
        try:
            barrier.wait()
            target(k)
        except BaseException as e:  # noqa: BLE001 - collected and judged
            errors.append(e)

    ts = [threading.Thread(target=body, args=(k,)) for k in range(count)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return errors


@recipe("concurrency.threads_run")
def threads_run(ctx, model: str, threads: int, runs: int, seed: int, instance: bool = False) -> None:
    import luisaml

    m = MODELS[model]()
    a = attempt(luisaml.compile, save(m, ctx.path("model.onnx")))
    judge(a, error_ok=False, what="compile")
    net = a.value
    # references first, in this thread: onnxruntime's, and luisaml's own run alone, which every
    # threaded run of the same input must equal bit for bit (the same kernel on the same data; a
    # race shows as any difference, however small)
    plans = {(k, r): _inputs(seed * 1000 + k * 100 + r, 1 + (k * 7 + r * 3) % 9) for k in range(threads) for r in range(runs)}
    alone = {}
    for key, x in plans.items():
        a = attempt(net.run, {"x": x})
        judge(a, error_ok=False, reference=ort_outputs(m, {"x": x}), rtol=1e-3, atol=1e-4, what="a run alone")
        alone[key] = a.value
    wrong: list[str] = []

    def work(k):
        inst = luisaml.NetworkInstance(net) if instance else None
        for r in range(runs):
            x = plans[(k, r)]
            if inst is not None:
                inst.set_input("x", x)
                got = inst.forward()
            else:
                got = net.run({"x": x})
            diff = compare_outputs(got, alone[(k, r)], 0.0, 0.0)
            if diff:
                wrong.append(f"thread {k} run {r} (batch {len(x)}), against the same run alone: {diff}")

    errors = _threads(work, threads)
    if errors:
        e = errors[0]
        raise Fail(FAIL_ERROR, f"{len(errors)} of {threads} threads raised; first: {type(e).__name__}: {e}")
    if wrong:
        raise Fail(FAIL_WRONG, f"{len(wrong)} of {threads * runs} results wrong; first: {wrong[0]}")


@recipe("concurrency.threads_compile")
def threads_compile(ctx, same: bool, threads: int) -> None:
    """Threads compiling (the same model, or each its own) and running at once."""
    import luisaml

    models = [small_model(0.0 if same else 0.5 + k) for k in range(threads)]
    paths = [save(models[k], ctx.path(f"m{k}.onnx")) for k in range(threads)]
    x = _inputs(1, 5)
    want = [ort_outputs(m, {"x": x}) for m in models]
    wrong: list[str] = []

    def work(k):
        got = luisaml.compile(paths[k]).run({"x": x})
        diff = compare_outputs(got, want[k], 1e-3, 1e-4)
        if diff:
            wrong.append(f"thread {k}: {diff}")

    errors = _threads(work, threads)
    if errors:
        e = errors[0]
        raise Fail(FAIL_ERROR, f"{len(errors)} of {threads} threads raised; first: {type(e).__name__}: {e}")
    if wrong:
        raise Fail(FAIL_WRONG, f"{len(wrong)} of {threads} results wrong; first: {wrong[0]}")


@recipe("concurrency.processes")
def processes(ctx, count: int, kernel_cache: str, model: str, same: bool = True) -> None:
    """`count` processes compile and run at once with an empty LUISAML_CACHE."""
    env = {"LUISAML_CACHE": str(ctx.path("shared-cache")), "LUISAML_BACKEND": "cpu"}
    python = None
    if kernel_cache == "copy":
        python, extra = child.python_copy(ctx.dir)
        env.update(extra)
    # a kernel no process on this machine has compiled yet: the processes race to write it
    nonce = (uuid.uuid4().int % 100_000) / 7.0
    procs = []
    for k in range(count):
        m = MODELS[model](nonce if same else nonce + k)
        path = save(m, ctx.path(f"model{k}.onnx"))
        x = _inputs(k, 4 + k)
        procs.append((child.start(ctx.path("runs"), f"p{k}", path, {"x": x}, python=python, env=env),
                      ort_outputs(m, {"x": x})))
    results = [(child.finish(p, job), ref) for (p, job), ref in procs]
    for k, (res, ref) in enumerate(results):
        judge_child(res, (), ref, f"process {k} of {count}")


_CI = {"threads_run/scratch/4/0", "processes/3/copy/small"}


def cases() -> list[Case]:
    out = []
    for model in MODELS:
        for threads in (2, 4, 8):
            for seed in range(3):
                cid = f"threads_run/{model}/{threads}/{seed}"
                out.append(Case(f"concurrency/{cid}", "concurrency", "concurrency.threads_run",
                                dict(model=model, threads=threads, runs=12, seed=seed), timeout=240, ci=cid in _CI))
        out.append(Case(f"concurrency/threads_instance/{model}/4", "concurrency", "concurrency.threads_run",
                        dict(model=model, threads=4, runs=12, seed=9, instance=True), timeout=240))
    for same in (True, False):
        out.append(Case(f"concurrency/threads_compile/{'same' if same else 'different'}/4", "concurrency",
                        "concurrency.threads_compile", dict(same=same, threads=4), timeout=240))
    for count in (2, 3):
        for kc in ("copy", "real"):
            for model in MODELS:
                cid = f"processes/{count}/{kc}/{model}"
                out.append(Case(f"concurrency/{cid}", "concurrency", "concurrency.processes",
                                dict(count=count, kernel_cache=kc, model=model), timeout=300, ci=cid in _CI))
    out.append(Case("concurrency/processes/3/copy/small/different", "concurrency", "concurrency.processes",
                    dict(count=3, kernel_cache="copy", model="small", same=False), timeout=300))
    return out
