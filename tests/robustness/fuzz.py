"""Fuzz: random valid small graphs of supported ops, compared with onnxruntime, in mixed batches.

A graph is (seed, index): its own random generator builds 1-6 nodes over 1-3 inputs with a
symbolic batch dimension N and random static per-sample shapes (broadcasting included), float
inputs with NaN and infinities sprinkled in, int and bool tensors where the ops take them. Every
op keeps the batch axis first and never mixes samples, as luisaml's batch kernels require.
onnxruntime must accept each graph alone (those it refuses are the generator's fault: counted,
not compared).

To pay for one kernel compile per several graphs, a case puts BATCH graphs into one model (each
with its own inputs and outputs, names prefixed g<index>_) and runs it at one random batch size.
When that model fails to compile, the case bisects to the graph(s) at fault. A mismatching graph
is compiled alone with every intermediate as an output to find the first node that differs (the
culprit), and the mismatch is matched against fuzz_triage.py; an untriaged mismatch fails the
case. A batch whose worker dies is re-run graph by graph by the runner (__main__) to find the
graph that kills the process.

`python -m tests.robustness --fuzz-graph SEED:INDEX --dump DIR` writes one graph as DIR/*.onnx with
its feeds (.npz) for a bug report and compares it again.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .fuzz_ops import BOOL, F32, GENERATORS, INTS, ONNX_OF, Builder, T
from .harness import (
    FAIL_ERROR,
    FAIL_WRONG,
    Case,
    Fail,
    array_difference,
    recipe,
    short,
    where,
)

OPSET = 20
BATCH = 8  # graphs per model
# float32 outputs of chains of a few ops, onnxruntime's kernels against LLVM's: a few ulps per op
RTOL, ATOL = 2e-4, 2e-5


@dataclass
class Graph:
    """One generated graph: nodes, graph inputs (with their feeds), initializers, outputs."""

    seed: int
    index: int
    nodes: list = field(default_factory=list)
    inputs: list[T] = field(default_factory=list)
    inits: dict = field(default_factory=dict)
    outputs: list[str] = field(default_factory=list)
    feeds: dict = field(default_factory=dict)  # per-sample rows for batch 64; a model takes the first n

    @property
    def ops(self) -> list[str]:
        return [n.op_type for n in self.nodes]

    @property
    def gid(self) -> str:
        return f"{self.seed}:{self.index}"


# ---- graphs ---------------------------------------------------------------------------------------

def input_values(rng: np.random.Generator, dtype, shape, special: bool) -> np.ndarray:
    """64 sample rows of an input: ordinary values, sometimes exact halves (Round's ties) or large
    ones, and with `special` some NaN and infinities."""
    full = (64,) + tuple(shape)
    if dtype == BOOL:
        return rng.random(full) > 0.5
    if dtype in INTS:
        return rng.integers(-5, 6, full).astype(dtype)
    style = rng.random()
    if style < 0.15:
        v = (rng.integers(-8, 9, full) / 2).astype(np.float32)
    elif style < 0.25:
        v = (rng.uniform(-1, 1, full) * 10 ** rng.uniform(1, 4)).astype(np.float32)
    else:
        v = rng.uniform(-3, 3, full).astype(np.float32)
    if special:
        mask = rng.random(full) < 0.08
        v[mask] = rng.choice(np.array([np.nan, np.inf, -np.inf], np.float32), int(mask.sum()))
    return v


def generate(seed: int, index: int) -> Graph:
    """Return graph (seed, index): the same every time."""
    rng = np.random.default_rng([seed, index])
    b = Builder(rng, f"g{index}_")
    base = b.shape()
    for k in range(int(rng.integers(1, 4))):
        kind = rng.random()
        dtype = F32 if kind < 0.8 or k == 0 else (b.choice(INTS) if kind < 0.92 else BOOL)
        # a second input of the same rank, broadcastable against the first
        shape = base if k == 0 else tuple(1 if rng.random() < 0.25 else d for d in base)
        b.add_input(dtype, shape)
    special = rng.random() < 0.4
    gens, weights = list(GENERATORS), np.array(list(GENERATORS.values()), float)
    for _ in range(int(rng.integers(1, 7))):
        for _attempt in range(8):
            g = gens[int(rng.choice(len(gens), p=weights / weights.sum()))]
            if g(b) is not None:
                break
    g = Graph(seed, index, b.g_nodes, b.inputs, b.inits)
    read = {i for n in g.nodes for i in n.input}
    made = [o for n in g.nodes for o in n.output]
    outs = [o for o in made if o not in read] or made[-1:]
    g.outputs = outs[-2:]
    g.feeds = {t.name: input_values(rng, t.dtype, t.shape, special) for t in g.inputs}
    return g


def to_model(graphs: list[Graph], batch: int, intermediates: bool = False) -> tuple[onnx.ModelProto, dict]:
    """Return (model, feeds) of graphs side by side at one batch size; with intermediates, every
    node output is a graph output too (to find the first node that differs)."""
    nodes, ins, inits, outs, feeds = [], [], [], [], {}
    for g in graphs:
        nodes += g.nodes
        for t in g.inputs:
            ins.append(helper.make_tensor_value_info(t.name, ONNX_OF[t.dtype], ["N", *t.shape]))
            feeds[t.name] = np.ascontiguousarray(g.feeds[t.name][:batch])
        inits += [numpy_helper.from_array(v, k) for k, v in g.inits.items()]
        names = [o for n in g.nodes for o in n.output] if intermediates else g.outputs
        outs += [o for o in names if o not in outs]
    graph = helper.make_graph(nodes, "fuzz", ins, [helper.make_tensor_value_info(o, 0, None) for o in outs], inits)
    opsets = [helper.make_opsetid("", OPSET)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=9)
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    typed = {o.name: o for o in list(inferred.graph.output) + list(inferred.graph.value_info)}
    del model.graph.output[:]
    model.graph.output.extend([typed[o] for o in outs])
    return model, feeds


def ort_run(model: onnx.ModelProto, feeds: dict) -> dict:
    from .models import ort_outputs

    return ort_outputs(model, feeds)


def valid_graph(seed: int, index: int) -> tuple[Graph | None, str]:
    """Return (graph, "") when onnx and onnxruntime accept it alone, else (None, why)."""
    g = generate(seed, index)
    try:
        model, feeds = to_model([g], 3)
        onnx.checker.check_model(model, full_check=True)
        ort_run(model, feeds)
    except Exception as e:  # noqa: BLE001 - the generator made something invalid
        return None, f"{type(e).__name__}: {short(str(e), 200)}"
    return g, ""


# ---- comparing, localising, triaging ------------------------------------------------------------

def difference(got: dict, want: dict, names) -> tuple[str, str] | None:
    """Return (kind, detail) of the first output that differs, or None."""
    for name in names:
        if name not in got:
            return "missing", f"output {name!r} missing"
        g, w = np.asarray(got[name]), np.asarray(want[name])
        if g.dtype != w.dtype:
            return "dtype", f"{name}: dtype {g.dtype}, expected {w.dtype}"
        if g.shape != w.shape:
            return "shape", f"{name}: shape {g.shape}, expected {w.shape}"
        diff = array_difference(g, w, RTOL, ATOL)
        if diff:
            kind = ("nan_dropped" if diff.startswith("NaN dropped") else "spurious_nan" if diff.startswith("spurious")
                    else "inf" if diff.startswith("infinity") else "value")
            return kind, f"{name}: {diff}"
    return None


def _reference_evaluator(model, feeds) -> dict | None:
    try:
        from onnx.reference import ReferenceEvaluator

        with np.errstate(all="ignore"):
            outs = ReferenceEvaluator(model).run(None, feeds)
        return {o.name: np.asarray(v) for o, v in zip(model.graph.output, outs)}
    except Exception:  # noqa: BLE001 - the reference cannot run every op
        return None


def localise(g: Graph, batch: int, got_error: bool = False) -> dict:
    """Return what the first differing node of graph g is: compile g alone with its intermediates
    as outputs and compare node by node with onnxruntime (and with onnx.reference). When every node
    agrees that way, each node's output is tried as the only output (what luisaml fuses or inlines
    depends on which tensors are outputs): the first that differs alone is the culprit, `fused_only`."""
    import luisaml

    info: dict = {"culprit": None}
    model, feeds = to_model([g], batch, intermediates=True)
    want = ort_run(model, feeds)
    try:
        got = luisaml.compile(model).run(feeds)
    except Exception as e:  # noqa: BLE001 - recorded: the graph with its intermediates does not compile
        info["localise_error"] = f"{type(e).__name__}: {short(str(e), 200)}"
        return info
    ref = _reference_evaluator(model, feeds)
    for n in g.nodes:
        for o in n.output:
            d = difference(got, want, [o])
            if d:
                info.update(_culprit(g, n, o, d, got, want, feeds, ref))
                return info
    for n in g.nodes:  # every node agrees with its output exposed: try each output as the only one
        for o in n.output:
            alone = Graph(g.seed, g.index, g.nodes, g.inputs, g.inits, [o], g.feeds)
            m1, f1 = to_model([alone], batch)
            w1 = ort_run(m1, f1)
            try:
                g1 = luisaml.compile(m1).run(f1)
            except Exception as e:  # noqa: BLE001
                info["localise_error"] = f"{type(e).__name__}: {short(str(e), 200)}"
                return info
            d = difference(g1, w1, [o])
            if d:
                # the node's inputs as the all-outputs run computed them (they agreed there)
                info.update(_culprit(g, n, o, d, {**got, **g1}, {**want, **w1}, feeds, _reference_evaluator(m1, f1)),
                            fused_only=True)
                return info
    info["mixed_only"] = True  # alone, every node agrees: the difference needs the other graphs
    return info


def _culprit(g: Graph, n, o: str, d: tuple[str, str], got: dict, want: dict, feeds: dict, ref: dict | None) -> dict:
    """Return the record fields of culprit node n whose output o differs (d: kind, detail): the
    node's inputs as onnxruntime computed them (special values, dtypes, largest magnitude), whether
    luisaml agrees with onnx.reference on the whole graph, and the node evaluated by onnx.reference
    on each engine's own inputs (_node_evidence)."""
    values = [want.get(i, feeds.get(i, g.inits.get(i))) for i in n.input if i]
    special = [v is not None and v.dtype.kind == "f" and bool(np.any(~np.isfinite(v))) for v in values]
    w = np.asarray(want[o])
    int_range = int(np.abs(w.astype(np.float64)).max()) if w.dtype.kind in "iu" and w.size else None
    info = dict(culprit=n.op_type, culprit_node=n.name, kind=d[0], detail=d[1],
                attrs={a.name: helper.get_attribute_value(a) for a in n.attribute},
                input_special=any(special),
                input_dtypes=[str(v.dtype) for v in values if v is not None], int_range=int_range,
                largest_input=max((float(np.nanmax(np.abs(v[np.isfinite(v)]))) for v in values
                                   if v is not None and v.dtype.kind == "f" and np.isfinite(v).any()),
                                  default=None),
                reference_agrees=_agrees(got.get(o), ref.get(o) if ref else None))
    ours = {i: got.get(i, feeds.get(i, g.inits.get(i))) for i in n.input if i}
    theirs = {i: want.get(i, feeds.get(i, g.inits.get(i))) for i in n.input if i}
    info.update(node_evidence(n, o, ours, got.get(o), theirs, want.get(o)))
    return info


def node_evidence(node, output: str, ours: dict, our_out, theirs: dict, their_out) -> dict:
    """Return what decides between the engines at one node, from each engine's own input values:
    upstream_differs (the node's inputs are not bit-identical between luisaml and onnxruntime),
    own_inputs_agree / ort_own_inputs_agree (onnx.reference, numpy underneath, evaluating the node
    alone on luisaml's / onnxruntime's inputs gives that engine's output; None when it cannot run the
    node), amplification (the output's relative difference over the inputs' largest relative one)."""
    if any(v is None for v in list(ours.values()) + list(theirs.values())) or our_out is None or their_out is None:
        return {}
    upstream = any(not np.array_equal(np.asarray(ours[k]), np.asarray(theirs[k]),
                                      equal_nan=np.asarray(ours[k]).dtype.kind == "f") for k in ours)
    ev = {"upstream_differs": upstream,
          "own_inputs_agree": _agrees(our_out, _node_reference(node, output, ours)),
          "ort_own_inputs_agree": _agrees(their_out, _node_reference(node, output, theirs))}
    rel_in = max((_relative(ours[k], theirs[k]) for k in ours if np.asarray(ours[k]).dtype.kind == "f"), default=0.0)
    rel_out = _relative(our_out, their_out) if np.asarray(our_out).dtype.kind == "f" else None
    if rel_out is not None:
        ev["amplification"] = float("inf") if rel_in == 0 else rel_out / rel_in
    return ev


def _relative(a, b) -> float:
    """The largest |a - b| / (|b| + ATOL) over the elements finite in both (0 when there are none)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return float("inf")
    ok = np.isfinite(a) & np.isfinite(b)
    return float((np.abs(a[ok] - b[ok]) / (np.abs(b[ok]) + ATOL)).max()) if ok.any() else 0.0


def _node_reference(node, output: str, values: dict):
    """Return onnx.reference's value of one node's output for the given input values, or None."""
    try:
        from onnx.reference import ReferenceEvaluator

        ins = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(np.asarray(v).dtype), np.shape(v))
               for k, v in values.items()]
        graph = helper.make_graph([node], "node", ins, [helper.make_tensor_value_info(output, 0, None)])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=9)
        with np.errstate(all="ignore"):
            return np.asarray(ReferenceEvaluator(model).run([output], {k: np.asarray(v) for k, v in values.items()})[0])
    except Exception:  # noqa: BLE001 - the reference cannot run every op
        return None


def _agrees(got, ref) -> bool | None:
    """Whether luisaml's value equals onnx.reference's within the fuzz's tolerance, NaN exactly where
    it has NaN (a NaN on one side only is a disagreement, whichever side), or None."""
    if got is None or ref is None:
        return None
    got, ref = np.asarray(got), np.asarray(ref)
    if got.shape != ref.shape:
        return False
    if got.dtype.kind == "f":
        gn, rn = np.isnan(got), np.isnan(ref.astype(got.dtype))
        if (rn != gn).any():
            return False
        ok = gn | np.isclose(got.astype(np.float64), ref.astype(np.float64), RTOL, ATOL, equal_nan=True)
        return bool(ok.all())
    return bool((got == ref).all())


def _jsonable(v):
    if isinstance(v, (np.generic,)):
        return v.item()
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v


def record(g: Graph, kind: str, detail: str, **extra) -> dict:
    r = {"graph": g.gid, "ops": g.ops, "kind": kind, "detail": detail, **extra}
    if "attrs" in r:
        r["attrs"] = {k: _jsonable(v) for k, v in r["attrs"].items()}
    return r


def dump(g: Graph, batch: int, folder: Path, rec: dict) -> None:
    """Write graph g alone as an .onnx file with its feeds and what went wrong (for a bug report)."""
    folder.mkdir(parents=True, exist_ok=True)
    model, feeds = to_model([g], batch)
    stem = f"fuzz_{g.seed}_{g.index}"
    onnx.save(model, folder / f"{stem}.onnx")
    np.savez(folder / f"{stem}_feeds.npz", **feeds)
    (folder / f"{stem}.json").write_text(json.dumps(rec, indent=1, default=str))


# ---- the case ------------------------------------------------------------------------------------

def batch_size(seed: int, start: int) -> int:
    rng = np.random.default_rng([seed, start, 99])
    return int(rng.choice([0, 1, 2, 3, 5, 8], p=[0.03, 0.2, 0.2, 0.27, 0.15, 0.15]))


def failing(graphs: list[Graph], batch: int) -> list[tuple[Graph, BaseException]]:
    """Return the graphs that fail to compile or run, bisecting a failing group down to single
    graphs (a group that fails only as a whole blames its first graph)."""
    import luisaml

    try:
        model, feeds = to_model(graphs, batch)
        luisaml.compile(model).run(feeds)
        return []
    except Exception as e:  # noqa: BLE001 - bisected below
        if len(graphs) == 1:
            return [(graphs[0], e)]
        half = len(graphs) // 2
        found = failing(graphs[:half], batch) + failing(graphs[half:], batch)
        return found or [(graphs[0], e)]


def references(graphs: list[Graph], batch: int) -> tuple[list[Graph], dict, int]:
    """Return (the graphs onnxruntime runs at this batch size, its outputs, how many it refused)."""
    try:
        model, feeds = to_model(graphs, batch)
        return graphs, ort_run(model, feeds), 0
    except Exception:  # noqa: BLE001 - one graph onnxruntime refuses at this batch size: find it
        kept, want = [], {}
        for g in graphs:
            try:
                model, feeds = to_model([g], batch)
                want.update(ort_run(model, feeds))
                kept.append(g)
            except Exception:  # noqa: BLE001
                pass
        return kept, want, len(graphs) - len(kept)


@recipe("fuzz.batch")
def fuzz_batch(ctx, seed: int, start: int, count: int) -> None:
    import luisaml

    from . import fuzz_triage

    graphs, invalid = [], 0
    for index in range(start, start + count):
        g, _why = valid_graph(seed, index)
        if g is None:
            invalid += 1
        else:
            graphs.append(g)
    n = batch_size(seed, start)
    graphs, want, refused = references(graphs, n)
    invalid += refused
    records: list[dict] = []
    compared = 0
    ok_graphs = list(graphs)
    got = None
    if graphs:
        model, feeds = to_model(graphs, n)
        try:
            got = luisaml.compile(model).run(feeds)
        except Exception:  # noqa: BLE001 - find which graphs are at fault
            bad = failing(graphs, n)
            for g, err in bad:
                kind = "error" if isinstance(err, luisaml.LuisamlError) else "crash"
                records.append(record(g, kind, f"{type(err).__name__}: {short(str(err), 300)}{where(err)}",
                                      culprit=_op_of(err, g), error_type=type(err).__name__))
            bad_ids = {id(g) for g, _ in bad}
            ok_graphs = [g for g in graphs if id(g) not in bad_ids]
            if ok_graphs:
                model, feeds = to_model(ok_graphs, n)
                try:
                    got = luisaml.compile(model).run(feeds)
                except Exception as e2:  # noqa: BLE001
                    records.append(record(ok_graphs[0], "crash", f"the graphs that work alone fail together: "
                                          f"{type(e2).__name__}: {short(str(e2), 200)}"))
                    ok_graphs = []
        for g in ok_graphs:
            compared += 1
            d = difference(got, want, g.outputs)
            if d:
                info = localise(g, n)
                info["culprit_detail"] = info.pop("detail", None)
                records.append(record(g, info.pop("kind", d[0]), d[1], **info))
    triaged: dict[str, int] = {}
    untriaged = []
    for r in records:
        cls = fuzz_triage.classify(r)
        r["triage"] = cls
        if cls:
            triaged[cls] = triaged.get(cls, 0) + 1
        else:
            untriaged.append(r)
    ctx.extra.update(graphs=count, invalid=invalid, compared=compared, batch=n, triaged=triaged,
                     untriaged=[{k: v for k, v in r.items() if k != "traceback"} for r in untriaged])
    if ctx.dump_dir is not None:
        by_id = {g.gid: g for g in graphs}
        for r in untriaged:
            dump(by_id[r["graph"]], max(n, 1), ctx.dump_dir / "fuzz", r)
    if untriaged:
        r = untriaged[0]
        outcome = FAIL_ERROR if r["kind"] in ("error", "crash") else FAIL_WRONG
        raise Fail(outcome, f"{len(untriaged)} untriaged of {len(records)} mismatches; first: graph {r['graph']} "
                            f"(repro: python -m tests.robustness --fuzz-graph {r['graph']} --dump DIR) "
                            f"culprit {r.get('culprit')} {r['kind']}: {short(r['detail'], 300)}")


def _op_of(err: BaseException, g: Graph) -> str | None:
    """The op type of the node an error message names, if it names one of g's nodes."""
    msg = str(err)
    for n in g.nodes:
        if f"'{n.name}'" in msg:
            return n.op_type
    return None


def cases(graphs: int, seed: int = 0, per_batch: int = BATCH) -> list[Case]:
    return [Case(f"fuzz/s{seed}/{start:05d}+{min(per_batch, graphs - start)}", "fuzz", "fuzz.batch",
                 dict(seed=seed, start=start, count=min(per_batch, graphs - start)), timeout=600)
            for start in range(0, graphs, per_batch)]


def single_cases(case: Case) -> list[Case]:
    """One case per graph of a fuzz batch (to find the graph whose batch killed its worker)."""
    p = case.params
    return [Case(f"fuzz/s{p['seed']}/{i:05d}+1", "fuzz", "fuzz.batch", dict(seed=p["seed"], start=i, count=1),
                 timeout=300) for i in range(p["start"], p["start"] + p["count"])]


def reproduce(seed: int, index: int, folder: Path) -> int:
    """Write graph (seed, index) alone with its feeds to folder, compare it, print the verdict."""
    import os

    import luisaml.device

    os.environ.setdefault("LUISAML_BACKEND", "cpu")
    luisaml.device.init(os.environ["LUISAML_BACKEND"])
    g, why = valid_graph(seed, index)
    if g is None:
        print(f"graph {seed}:{index} is not valid (the generator's fault): {why}")
        return 2
    n = max(batch_size(seed, index - index % BATCH), 1)
    rec = {"graph": g.gid, "ops": g.ops, "batch": n}
    dump(g, n, folder, rec)
    print(f"wrote {folder}/fuzz_{seed}_{index}.onnx (+ _feeds.npz); ops {g.ops}, batch {n}")
    model, feeds = to_model([g], n)
    want = ort_run(model, feeds)
    try:
        got = luisaml.compile(model).run(feeds)
    except Exception as e:  # noqa: BLE001
        print(f"luisaml: {type(e).__name__}: {e}")
        return 1
    d = difference(got, want, g.outputs)
    if not d:
        print("matches onnxruntime")
        return 0
    from . import fuzz_triage

    info = localise(g, n)
    print(f"differs: {d[1]}\nfirst differing node: {json.dumps(info, default=str)}")
    print(f"triage: {fuzz_triage.classify({'kind': d[0], **info}) or 'untriaged (a mismatch no known class explains)'}")
    return 1


__all__ = ["cases", "single_cases", "reproduce", "generate", "to_model", "Graph", "T"]
