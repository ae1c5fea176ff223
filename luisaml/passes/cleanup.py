"""Graph clean-up on the Model: Identity and inference-mode Dropout removal, dead-node removal."""
from __future__ import annotations

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
