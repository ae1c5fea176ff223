"""Graph clean-up on the Model: Identity and inference-mode Dropout removal, dead-node removal,
BatchNormalization folded into the convolution before it; on the ModelProto, before the grid steps
are cut out, equal nodes of a pure domain merged (merge_equal_nodes: one neighbour map for every
layer over the same grids with the same kernel geometry, issue 28 item 6)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from ..model import Graph, Model, Node, outer_reads, subgraphs


def _rename_reads(graph: Graph, old: str, new: str) -> None:
    """Make every read of `old` in graph (and its subgraphs) read `new`."""
    for n in graph.nodes:
        n.inputs = [new if i == old else i for i in n.inputs]
        for g in subgraphs(n):
            if old not in g.vars or g.vars[old].value is None and old not in g.inputs:
                _rename_reads(g, old, new)
                g.outputs = [new if o == old else o for o in g.outputs]


def _is_read(name: str, graph: Graph) -> bool:
    """Return whether a graph output or any node (subgraphs included) reads `name`."""
    return name in graph.outputs or any(name in n.inputs or name in outer_reads(n) for n in graph.nodes)


def _is_passthrough(node: Node, graph: Graph) -> bool:
    if node.domain not in ("", "ai.onnx"):
        return False
    if node.op_type == "Identity":
        return True
    if node.op_type == "Dropout":
        mask_used = len(node.outputs) > 1 and node.outputs[1] and _is_read(node.outputs[1], graph)
        training = len(node.inputs) > 2 and node.inputs[2]
        if mask_used:
            return False
        if training:
            v = graph.var(node.inputs[2]).value
            return v is not None and not bool(v)
        return True
    return False


def remove_passthrough(model: Model) -> int:
    """Remove Identity and inference Dropout nodes whose output is not a graph output."""
    g = model.graph
    outputs = set(g.outputs)
    removed = 0
    keep = []
    for n in g.nodes:
        if _is_passthrough(n, g) and n.outputs[0] not in outputs and n.inputs[0]:
            _rename_reads(g, n.outputs[0], n.inputs[0])
            removed += 1
        else:
            keep.append(n)
    g.nodes = keep
    return removed


def remove_dead(model: Model) -> int:
    """Remove nodes none of whose outputs reach a graph output."""
    g = model.graph
    needed = set(g.outputs)
    keep: list[Node] = []
    for n in reversed(g.nodes):
        if any(o in needed for o in n.outputs if o):
            keep.append(n)
            needed |= {i for i in n.inputs if i} | outer_reads(n)
    removed = len(g.nodes) - len(keep)
    g.nodes = list(reversed(keep))
    return removed


def merge_equal_nodes(proto, pure: Callable[[Any], bool]) -> int:
    """Merge nodes for which pure(node) holds (their outputs depend on their inputs and attributes
    only) that read the same tensors with the same attributes: later ones dropped, their outputs'
    readers reading the first's. In graph order, so chains merge too (two ConvGrids of one grid, then
    the kernel maps over their results). A node whose outputs are graph outputs stays; graphs with
    subgraphs are left as they are (their bodies may read the names). Return the nodes removed."""
    import onnx

    g = proto.graph
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in g.node for a in n.attribute):
        return 0
    graph_outputs = {o.name for o in g.output}
    rename: dict[str, str] = {}
    first: dict[tuple, Any] = {}
    keep = []
    for n in g.node:
        if any(i in rename for i in n.input):
            ins = [rename.get(i, i) for i in n.input]
            del n.input[:]
            n.input.extend(ins)
        if pure(n):
            key = (n.domain, n.op_type, tuple(n.input),
                   tuple(a.SerializeToString() for a in sorted(n.attribute, key=lambda a: a.name)))
            earlier = first.get(key)
            if (earlier is not None and len(earlier.output) == len(n.output) and not graph_outputs & set(n.output)
                    and all(e or not o for o, e in zip(n.output, earlier.output))):
                rename.update({o: e for o, e in zip(n.output, earlier.output) if o})
                continue
            first.setdefault(key, n)
        keep.append(n)
    if not rename:
        return 0
    removed = len(g.node) - len(keep)
    kept_infos = [vi for vi in g.value_info if vi.name not in rename]
    del g.value_info[:]
    g.value_info.extend(kept_infos)
    del g.node[:]
    g.node.extend(keep)
    return removed


# (op type, domain) of the convolutions a BatchNormalization folds into: (weight input, bias input);
# both keep output channels on axis 0 of the weight and axis 1 of the output
_FOLDS_INTO = {("Conv", ""): (1, 2), ("SparseConv3d", "fvdb"): (2, 3)}


def fold_batchnorm(model: Model) -> int:
    """Fold each inference BatchNormalization whose parameters are constants into the Conv (or
    fvdb SparseConv3d) it reads, when that is the convolution's only reader and the convolution's
    weight and bias are constants: W' = W * s per output channel, B' = (B - mean) * s + beta,
    s = gamma / sqrt(var + epsilon), computed in float64. Return how many were folded.

    Why: as an epilogue the BatchNormalization costs per-channel loads and index arithmetic at
    every store, which on the CPU backend kept clang from vectorising the convolution's tile
    (fVDB's 64-channel sparse convolution: 124 ms with a BatchNorm + Relu epilogue, 25 ms without);
    folded, the stage is the convolution and a Relu."""
    g = model.graph
    outputs = set(g.outputs)
    readers: dict[str, list[Node]] = {}
    for n in g.nodes:
        for i in set(n.inputs) | outer_reads(n):
            if i:
                readers.setdefault(i, []).append(n)
    producers = g.producers()
    folded, drop = 0, set()
    for bn in g.nodes:
        if bn.op_type != "BatchNormalization" or bn.domain not in ("", "ai.onnx") or len(bn.inputs) != 5:
            continue
        if any(o for o in bn.outputs[1:]) or int(bn.attrs.get("training_mode", 0)):
            continue
        conv = producers.get(bn.inputs[0])
        key = (conv.op_type, "" if conv.domain == "ai.onnx" else conv.domain) if conv is not None else None
        if key not in _FOLDS_INTO or bn.inputs[0] in outputs or len(readers.get(bn.inputs[0], [])) != 1:
            continue
        w_at, b_at = _FOLDS_INTO[key]
        params = [g.var(i) if i and g.has_var(i) else None for i in bn.inputs[1:]]
        w = g.var(conv.inputs[w_at])
        b = g.var(conv.inputs[b_at]) if len(conv.inputs) > b_at and conv.inputs[b_at] else None
        if any(p is None or p.value is None for p in params) or w.value is None or (b is not None and b.value is None):
            continue
        if w.value.dtype.kind != "f" or w.value.ndim < 2:
            continue
        gamma, beta, mean, var = (np.asarray(p.value, np.float64).reshape(-1) for p in params)
        c = w.value.shape[0]
        if not all(a.size == c for a in (gamma, beta, mean, var)):
            continue
        s = gamma / np.sqrt(var + float(bn.attrs.get("epsilon", 1e-5)))
        w_new = (np.asarray(w.value, np.float64) * s.reshape((c,) + (1,) * (w.value.ndim - 1))).astype(w.value.dtype)
        b_old = np.asarray(b.value, np.float64).reshape(-1) if b is not None else np.zeros(c)
        b_new = ((b_old - mean) * s + beta).astype(w.value.dtype)
        w_name, b_name = _fresh(g, f"{w.name}/folded"), _fresh(g, f"{bn.name}/folded_bias")
        g.vars[w_name] = replace(w, name=w_name, value=w_new)
        g.vars[b_name] = replace(w, name=b_name, value=b_new, shape=(c,), symbolic=None)
        inputs = list(conv.inputs) + [""] * (b_at + 1 - len(conv.inputs))
        inputs[w_at], inputs[b_at] = w_name, b_name
        conv.inputs = inputs
        conv.outputs = [bn.outputs[0]] + list(conv.outputs[1:])
        drop.add(id(bn))
        folded += 1
    g.nodes = [n for n in g.nodes if id(n) not in drop]
    return folded


def _fresh(g: Graph, base: str) -> str:
    name, k = base, 1
    while g.has_var(name):
        k += 1
        name = f"{base}{k}"
    return name
