"""Schedules searched, not guessed: `compile(tune="fast" | "full")` measures candidate schedules of
a plan's GEMM and convolution stages on the device it compiles for, keeps the fastest that computes
what the rules' schedule computes, and remembers the choice in the tuning cache
(luisaml/tune_cache.py), so that a second compile of the same shapes measures nothing.

What is searched is what an operator offers (`Operator.schedules`): the rules' choice first (the
search's starting point), then a bounded set near it — "fast" 4 a node, "full" up to 16 — for the
stage form the node runs in: a cooperative blocks tiling on CUDA (operators/tiled.py `candidates`:
tile sides, a thread's share, k steps, double buffering), a work item's tile on the CPU backend
(Gemm/MatMul's rows x columns, Conv's positions x channels). Only nodes that are a stage's root
and that the prepared model holds as they are (not made by a rewrite) are searched.

A node's candidates are measured together: one network of the node alone, once per candidate
(copies named cand0.., the copy's schedule set by name through BuildOptions.schedules), over its
constant inputs as they are and random inputs for the rest, `TUNE_BATCH` samples. It is compiled
like any network (one kernel on the CPU backend, a kernel a stage on CUDA), run once: a candidate
whose outputs differ from the rules' (copy 0) by more than RTOL of their largest magnitude is
rejected and never chosen. Each stage is then launched alone, round robin over the candidates
(a noisy host slows all of them alike), REPEAT times, and the medians compared; a candidate must
beat the rules' by MARGIN to replace it (noise does not flip a choice). A copy whose key differs
from the node's (its shapes did not come out the same alone) is not measured.

The key of a measurement is JSON data: luisaml's version, the device's name (device.device_name),
the stage form, the node's op type, its inputs' per-sample shapes, dtypes, which are constant and
which batched, its outputs, its attributes, the batch measured and the mode. A cached choice is
used only when it is one of the node's own candidates; anything else is measured again."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from . import device, tune_cache
from .log import logger, note, phase
from .version import __version__

MODES = ("fast", "full")
# samples a candidate runs over, when the graph has a batch (without one: its shapes as they are)
TUNE_BATCH = {"cpu": 1, "cuda": 32}
# launches of each candidate's stage alone (the median kept)
REPEAT = {"fast": 5, "full": 9}
# a candidate's outputs may differ from the rules' by this much of their largest magnitude (the
# order of a sum may change with the tile: chains of accumulators)
RTOL = 1e-4
# a candidate replaces the rules' choice only when its median is this much lower
MARGIN = 0.03
# a note on progress at most this often while a search runs
NOTE_EVERY_S = 5.0


@dataclass
class Tuned:
    """One searched node: what was chosen and why (the report's "tuning")."""

    node: str
    op_type: str
    form: str  # the stage form: "items" or "blocks"
    choice: dict  # the schedule the network runs (the rules' when it won)
    rule: dict
    source: str  # "measured" in this compile, or "cache"
    rule_ms: float
    best_ms: float
    candidates: int
    rejected: int = 0  # candidates whose outputs differed from the rules'

    def describe(self) -> str:
        what = "the rules' choice" if self.choice == self.rule else _knobs(self.choice) + f" (rules: {_knobs(self.rule)})"
        return (f"node '{self.node}' ({self.op_type}, {self.form}): {what}; {self.best_ms:.4f} ms vs "
                f"{self.rule_ms:.4f} ms ({self.source}, {self.candidates} candidates"
                + (f", {self.rejected} rejected)" if self.rejected else ")"))


@dataclass
class Tuning:
    """A compile's search: its mode, the device, each searched node, and how many kernel shapes
    were measured now (0: every choice came from the tuning cache)."""

    mode: str
    device: str
    nodes: list[Tuned] = field(default_factory=list)
    measured: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """The search as plain data (the report's "tuning" key)."""
        return {"mode": self.mode, "device": self.device, "measured": self.measured, "seconds": round(self.seconds, 3),
                "nodes": [{**t.__dict__} for t in self.nodes]}


def _knobs(choice: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(choice.items()) if k != "form")


def _plain(v: Any) -> Any:
    """An attribute's value as JSON data (a key's part)."""
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, bytes):
        return v.decode(errors="replace")
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, np.ndarray) and v.size <= 64:
        return v.tolist()
    return repr(type(v).__name__)


def node_key(node, op, form: str, device_name: str, batch: int, mode: str) -> dict[str, Any]:
    """Return the tuning cache's key of a node's measurement (see the module docstring)."""

    def tensor(t) -> list:
        return [list(t.shape), t.dtype.name.lower(), t.value is not None, bool(t.batched)]

    ins = [tensor(op.input(k)) if op.has_input(k) else None for k in range(len(node.inputs))]
    return {"luisaml": __version__, "device": device_name, "form": form, "mode": mode, "batch": batch,
            "op": f"{node.domain or 'ai.onnx'}::{node.op_type}", "class": type(op).__name__, "inputs": ins,
            "output": [list(op.output().shape), op.output().dtype.name.lower()],
            "attrs": {k: _plain(v) for k, v in sorted(node.attrs.items())},
            "tensor_cores": bool(getattr(op, "tensor_cores", False))}


@dataclass
class _Job:
    """A kernel shape to search: its key, candidates, and the nodes that share it."""

    key: dict
    form: str
    candidates: list[dict]
    nodes: list = field(default_factory=list)  # (node, op)


def searchable(plan, prep) -> list[tuple[Any, Any, str]]:
    """Return (node, operator, stage form) of each stage root a search may tune: an items or blocks
    stage's root that the prepared model holds as it is (not a node a rewrite made)."""
    if plan.schedule is None:
        return []
    held = {n.name: n for n in prep.model.graph.nodes}
    names = [n.name for n in prep.model.graph.nodes]
    out = []
    for st in plan.schedule.stages:
        if st.domain not in ("items", "blocks") or getattr(st, "phase", None):
            continue
        node, op = st.root
        if held.get(node.name) is node and names.count(node.name) == 1:
            out.append((node, op, st.domain))
    return out


def search(plan, opts, backend: str, make_network: Callable, measure: Callable | None = None) -> tuple[tuple, Tuning]:
    """Return (BuildOptions.schedules for the choices that differ from the rules', the search's
    record) of a plan compiled under resolved options `opts` (opts.tune the mode). make_network(plan)
    returns a CompiledNetwork of a plan on the device; measure(job, ...): how a kernel shape is
    measured (`measure_job`; tests replace it)."""
    t0 = time.perf_counter()
    mode = opts.tune
    wide = mode == "full"
    name = device.device_name(backend)
    prep = plan.built_from[0]
    batch = TUNE_BATCH.get(backend, 1) if plan.symbol is not None else 1
    record = Tuning(mode, name)
    jobs: dict[str, _Job] = {}
    for node, op, form in searchable(plan, prep):
        cands = op.schedules(form == "blocks", wide)
        if len(cands) < 2:
            continue
        key = node_key(node, op, form, name, batch, mode)
        job = jobs.setdefault(tune_cache.key_digest(key), _Job(key, form, cands))
        job.nodes.append((node, op))
    chosen: list[tuple[str, tuple]] = []
    todo = []
    for job in jobs.values():
        hit = tune_cache.load(job.key)
        if hit is not None and hit["choice"] not in job.candidates:
            logger.warning("tuning cache: the choice %s of %s is not one of its candidates; measuring again",
                           hit["choice"], job.nodes[0][0].describe())
            hit = None
        if hit is None:
            todo.append(job)
            continue
        _record(record, job, hit["choice"], "cache", hit["rule_ms"], min(hit["ms"] or [hit["rule_ms"]]), 0)
    if todo:
        note("tuning %d kernel shape(s) (tune=%r on %s): each candidate built, checked against the rules' "
             "schedule and timed; later compiles read the choices from %s", len(todo), mode, name, tune_cache.folder())
    last = time.perf_counter()
    for i, job in enumerate(todo):
        node = job.nodes[0][0]
        with phase("tune", node=node.name, candidates=len(job.candidates)):
            try:
                times, rejected = (measure or measure_job)(job, plan, opts, batch, make_network, mode)
            except Exception as e:  # (a candidate that cannot build or run: the rules' schedule stays)
                logger.warning("tuning %s failed (%s: %s); it keeps the rules' schedule", node.describe(),
                               type(e).__name__, str(e).splitlines()[0] if str(e) else "")
                continue
        record.measured += 1
        best = _best(job.candidates, times, rejected)
        ok = [times[c] for c in range(len(times)) if c not in rejected]
        tune_cache.store(job.key, job.candidates[best], ok, times[0])
        _record(record, job, job.candidates[best], "measured", times[0], times[best], len(rejected))
        if time.perf_counter() - last > NOTE_EVERY_S:
            note("tuning: %d/%d kernel shapes measured (%.0f s)", i + 1, len(todo), time.perf_counter() - t0)
            last = time.perf_counter()
    for t in record.nodes:
        if t.choice != t.rule:
            chosen.append((t.node, tuple(sorted(t.choice.items()))))
    record.seconds = time.perf_counter() - t0
    if todo:
        note("tuning: %d kernel shape(s) measured in %.1f s, %d node(s) off the rules' schedule", record.measured,
             record.seconds, len(chosen))
    return tuple(chosen), record


def _best(candidates: list[dict], times: list[float], rejected: set[int]) -> int:
    """Return the index of the candidate to keep: the fastest checked one, when it beats the rules'
    (index 0) by MARGIN."""
    ok = [c for c in range(len(candidates)) if c not in rejected]
    best = min(ok, key=lambda c: times[c])
    return best if times[best] < (1 - MARGIN) * times[0] else 0


def _record(record: Tuning, job: _Job, choice: dict, source: str, rule_ms: float, best_ms: float, rejected: int) -> None:
    for node, _ in job.nodes:
        record.nodes.append(Tuned(node.name, node.op_type, job.form, dict(choice), dict(job.candidates[0]), source,
                                  float(rule_ms), float(best_ms), len(job.candidates), rejected))


# ---- measuring one kernel shape ------------------------------------------------------------------


def node_model(node, op, prep, copies: int):
    """Return (the ONNX model of `copies` copies of a node over the same inputs, copy c named cand{c}
    writing out{c}_{j}; the names of its non-constant inputs and their per-sample shapes), or None
    when the node cannot stand alone this way (an input with several rows a sample)."""
    import onnx
    from onnx import helper, numpy_helper

    def sample_shape(t) -> list | None:
        # the shape with its batch dimension named (what finds the batch axis); None: several rows a sample
        shape = list(t.shape)
        if t.batched:
            if not shape or shape[0] != 1:
                return None
            shape = ["N"] + shape[1:]
        return shape

    inits, inputs, names, feeds = [], [], [], {}
    for k, name in enumerate(node.inputs):
        if not name or not op.has_input(k):
            names.append("")
            continue
        t = op.input(k)
        arg = f"in_{k}"
        names.append(arg)
        if t.value is not None:
            inits.append(numpy_helper.from_array(np.asarray(t.value).astype(t.dtype.numpy), arg))
            continue
        shape = sample_shape(t)
        if shape is None:
            return None
        inputs.append(helper.make_tensor_value_info(arg, t.dtype.onnx, shape))
        feeds[arg] = (list(t.shape), t.batched, t.dtype.numpy)
    nodes, outputs = [], []
    for c in range(copies):
        outs = [f"out{c}_{j}" if o else "" for j, o in enumerate(node.outputs)]
        nodes.append(helper.make_node(node.op_type, names, outs, name=f"cand{c}", domain=node.domain or "",
                                      **node.attrs))
        for j, o in enumerate(outs):
            if not o:
                continue
            if j == 0:  # (typed)
                shape = sample_shape(op.output())
                if shape is None:
                    return None
                outputs.append(helper.make_tensor_value_info(o, op.output().dtype.onnx, shape))
            else:
                outputs.append(onnx.ValueInfoProto(name=o))
    g = helper.make_graph(nodes, f"tune {node.op_type}", inputs, outputs, inits)
    opsets = [helper.make_opsetid("" if d == "ai.onnx" else d, v) for d, v in sorted(prep.model.opsets.items())]
    return helper.make_model(g, opset_imports=opsets), feeds


def measure_job(job: _Job, plan, opts, batch: int, make_network: Callable, mode: str) -> tuple[list[float], set[int]]:
    """Return (each candidate's median milliseconds, the candidates rejected for their outputs) of
    a kernel shape: one network of the node once per candidate, built, run, checked, timed."""
    from .planning import plan_for

    node, op = job.nodes[0]
    prep = plan.built_from[0]
    n = len(job.candidates)
    made = node_model(node, op, prep, n)
    if made is None:
        raise ValueError("the node cannot run alone (an input with several rows a sample)")
    proto, specs = made
    sched = tuple((f"cand{c}", tuple(sorted(ch.items()))) for c, ch in enumerate(job.candidates) if c)
    topts = replace(opts, tune=False, schedules=sched, input_shapes=None, fuse="off", winograd=0,
                    batch_axis="auto" if plan.symbol is not None else None)
    tplan, why, _ = plan_for(proto, f"tune-{node.op_type}", topts)
    if why is not None:
        raise ValueError(f"its network alone does not run per sample ({why})")
    stage_of = {}
    for st in tplan.schedule.stages:
        tnode, top = st.root
        if tnode.name.startswith("cand") and st.domain == job.form:
            if node_key(tnode, top, job.form, job.key["device"], batch, mode) != job.key:
                raise ValueError(f"{tnode.name} alone has another key than the node")
            stage_of[int(tnode.name[4:])] = st.index
    if sorted(stage_of) != list(range(n)):
        raise ValueError("a candidate is not a stage of its own")
    rng = np.random.default_rng(0)
    feeds = {}
    for arg, (shape, batched, dt) in specs.items():
        full = [batch] + shape[1:] if batched else shape
        feeds[arg] = rng.standard_normal(full).astype(dt)
    net = make_network(tplan)
    got = net.run(feeds)
    outs = [[got[o] for o in sorted(got) if o.startswith(f"out{c}_")] for c in range(n)]
    rejected = {c for c in range(1, n) if not _same(outs[c], outs[0])}
    timer = net.stage_timer(feeds)
    for c in range(n):  # warm: caches, clocks
        timer(stage_of[c])
    times: list[list[float]] = [[] for _ in range(n)]
    for r in range(REPEAT[mode]):
        for c in [(r + i) % n for i in range(n)]:
            if c not in rejected:
                times[c].append(timer(stage_of[c]))
    return [float(np.median(t)) if t else float("inf") for t in times], rejected


def _same(got: list[np.ndarray], want: list[np.ndarray]) -> bool:
    """Whether a candidate's outputs are the rules' within RTOL of their largest magnitude."""
    if len(got) != len(want):
        return False
    for a, b in zip(got, want):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.shape != b.shape or not np.array_equal(np.isnan(a), np.isnan(b)):
            return False
        fin = np.isfinite(b)
        if not np.array_equal(a[~fin], b[~fin]):
            return False
        scale = float(np.abs(b[fin]).max()) if fin.any() else 0.0
        if fin.any() and float(np.abs(a[fin] - b[fin]).max()) > RTOL * max(scale, 1e-30):
            return False
    return True


__all__ = ["search", "Tuning", "Tuned", "node_key", "measure_job", "MODES", "TUNE_BATCH"]
