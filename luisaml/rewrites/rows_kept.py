"""Rows kept: the output channels of a pointwise Conv that the graph reads only at run-time gathered rows are
computed only at those rows (issue 28 item 6; compile(rows_kept=False) switches it off).

The pattern (a CenterPoint head: examples/lidar_detector.py `Head.from_bev`): a 1 x 1 Conv (stride 1, no
padding, one group, float, its input [1, C, *S] not batched, constant W and B) whose output Y [1, M, *S] is
read along one path of single-reader nodes --
  - the leading unit axis dropped (a Gather of constant index 0 on axis 0, or a view of shape Y's[1:]),
  - a Slice of a channel range [c0, c1) (the other axes whole, step 1),
  - elementwise maps whose other inputs are scalar constants (Sigmoid, Exp, x * 2 + 1: any position the same),
  - a view flattening the positions into one axis ([c, prod S]),
-- to a Gather of that flattened axis at indices computed at run time (TopK's cells). Channels the path does
not read may be read by Slices of channels outside [c0, c1) where the path branches (the heat map's classes).
Then the Conv keeps the side Slices' channels over every position (the path's nodes before the branch and the
Slices made again over it), and the channels [c0, c1) are computed at the gathered rows only, by one node that
gathers X's rows and sums (operators/rows_kept.py RowsKeptConv: the Gather's index rules, a bad index naming
that Gather node), then the path's maps (the detector at 100k points: 8 of 10 channels at 64 rows, not 41,209).

Bit-identical to computing every row: each kept output must be the same floating-point operations in the same
order as every row's Conv makes it. The Conv's forms (operators/conv.py, conv_tiles.py): the items form (the
CPU backend's tiles, and CUDA's direct form and products under tiled.MIN_SIDE columns) starts at B[m] and does
fma(x[c], W[m, c], acc) for c = 0..C-1 in order, whatever the tile's P and O; tiled.py's FP32 tile does the
same fmas from 0 in k order (k = c for a 1 x 1, step after step, no split of k) and adds B[m] last.
RowsKeptConv sums in the order of the form every row's Conv takes ("items" or "fp32"), and the Conv left over
the side channels must take that form too. Where every row's Conv takes the TF32 mma tile (tensor cores: its
products round A and B to TF32 and sum in the mma's own order) or the dot form (a 1 x 1 input: lanes split
k), or the side channels' Conv another form, the rewrite does not fire (the note says why); nor in a plan
without stages (schedule="per-sample"). The tests check the CPU backend bit for bit, and both CUDA orders in
tests/gpu_emulator.py (tests/core/test_rows_kept.py); tests/gpu/test_rows_kept_cuda.py runs them on a GPU.

A path with other readers, a graph output on it, a Slice of the side channels overlapping [c0, c1), a
per-channel constant in a map (it would need slicing), a 3 x 3 Conv or a Gather of another axis: no rewrite."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from luisaml import dtypes
from luisaml.lowering import plan_storage
from luisaml.model import Node
from luisaml.operator import Operator
from luisaml.operators.conv import Conv
from luisaml.operators.indexing import Gather, Slice
from luisaml.operators.rows_kept import RowsKeptConv
from luisaml.operators.shape import View
from luisaml.rewrites import new_tensor
from luisaml.storage import Tensor

ONNX = ("", "ai.onnx")
# the settings build_plan gives an operator before this rewrite runs, which its copies keep (compiler.build_plan)
FLAGS = ("no_blocks", "tensor_cores")


@dataclass
class Path:
    """The walk from a Conv's output along single readers: the nodes in order, and where it stands."""

    lead: bool  # the leading unit axis still there
    chan: tuple[int, int]  # the channel range [c0, c1) of Y the current tensor holds
    flat: bool  # the positions one axis
    nodes: list = field(default_factory=list)  # (node, op) of the path
    maps: list = field(default_factory=list)  # (node, op) of its elementwise maps, in order


def _squeeze(op: Operator, path: Path) -> bool:
    """Whether op drops the path's leading unit axis (Gather of constant index 0 on axis 0, or a view)."""
    x, y = op.inputs[0], op.outputs[0]
    if not path.lead or x.shape[0] != 1 or tuple(y.shape) != tuple(x.shape[1:]):
        return False
    if isinstance(op, Gather):
        return op.ax == 0 and op.fixed is not None and op.inputs[1].shape == () and int(op.fixed[0]) == 0
    return bool(getattr(op, "view", False)) and isinstance(op, View)


def _scalar_map(op: Operator, cur: str) -> bool:
    """Whether op is an elementwise map of the path's tensor and scalar constants, same shape, float."""
    if not (getattr(op, "elementwise", False) and op.inline and len(op.outputs) == 1 and not op.subgraphs):
        return False
    y = op.outputs[0]
    ins = [t for t in op.inputs if t is not None]
    if sum(t.name == cur for t in ins) != 1 or y.dtype is not dtypes.FLOAT:
        return False
    x = next(t for t in ins if t.name == cur)
    return tuple(y.shape) == tuple(x.shape) and all(t.name == cur or (t.value is not None and t.numel == 1)
                                                   for t in ins)


def _channel_slice(op: Operator, path: Path) -> tuple[int, int] | None:
    """The channel range [f, f + n) of the path's tensor a Slice takes, the other axes whole, step 1; else None."""
    if not isinstance(op, Slice) or path.flat:
        return None
    x, y = op.inputs[0], op.outputs[0]
    ca = 1 if path.lead else 0
    if any(a != ca and (x.shape[a] != y.shape[a] or op.first[a] != 0 or op.step[a] != 1) for a in range(x.rank)):
        return None
    if op.step[ca] != 1:
        return None
    return op.first[ca], op.first[ca] + y.shape[ca]


def _flatten(op: Operator, path: Path) -> bool:
    """Whether op is a view flattening the positions into one axis."""
    if path.flat or not isinstance(op, View):
        return False
    x, y = op.inputs[0], op.outputs[0]
    lead = list(x.shape[:2 if path.lead else 1])
    return list(y.shape) == lead + [int(np.prod(x.shape[len(lead):], dtype=np.int64))]


def _gather(op: Operator, path: Path) -> bool:
    """Whether op gathers the flattened positions at run-time indices."""
    if not isinstance(op, Gather) or not path.flat or op.fixed is not None:
        return False
    x, idx = op.inputs[0], op.inputs[1]
    return op.ax == x.rank - 1 and not idx.batched and idx.value is None


def _step(node: Node, op: Operator, cur: str, path: Path) -> str | None:
    """Advance the path over one node reading `cur`: 'gather' at the end, 'ok' on, None where it leaves."""
    if op.subgraphs or not op.outputs or op.outputs[0] is None or not op.inputs or op.inputs[0] is None:
        return None
    if _scalar_map(op, cur):
        path.maps.append((node, op))
    elif op.inputs[0].name != cur:
        return None
    elif _squeeze(op, path):
        path.lead = False
    elif (ch := _channel_slice(op, path)) is not None:
        path.chan = (path.chan[0] + ch[0], path.chan[0] + ch[1])
    elif _flatten(op, path):
        path.flat = True
    elif _gather(op, path):
        path.nodes.append((node, op))
        return "gather"
    else:
        return None
    path.nodes.append((node, op))
    return "ok"


def _form(conv: Conv) -> str | None:
    """How a Conv's stage sums an output: "items" (B first, then fma over c in order), "fp32" (tiled.py's tile:
    the fmas in k order from 0, B last), or None (the mma tile, the dot form: no order this rewrite can match)."""
    from luisaml.operators import tiled

    if conv.no_blocks:
        return "items"
    tl = conv.block_tiling()
    if tl is None:
        return "items"
    if isinstance(tl, tiled.Tiling) and not getattr(tl, "mma", False):
        return "fp32"
    return None


def _const(main, name: str, value: np.ndarray) -> Tensor:
    """A new constant tensor of main's (its storage placed when plan_storage runs again)."""
    t = new_tensor(main, name, dtypes.from_numpy(value.dtype), tuple(value.shape), False)
    t.value = value
    return t


def _copy(node: Node, op: Operator, name: str, ins: list, outs: list) -> tuple[Node, Operator]:
    """A copy of (node, op) over other tensors (the same class, attributes and opset)."""
    n = Node(name, node.op_type, node.domain, [t.name if t is not None else "" for t in ins], [t.name for t in outs],
             dict(node.attrs))
    new = type(op)(n, ins, outs, op.opset)
    for flag in FLAGS:  # (what build_plan set on the node before this rewrite: the CPU's tiles, tensor cores)
        if flag in vars(op):
            setattr(new, flag, getattr(op, flag))
    return n, new


def rewrite(plan) -> list[str]:
    """Rewrite every Conv of the plan's main graph that qualifies (see the module docstring); return one note a
    rewrite (inspect's lines) or a note of why a matched pattern was left (the plan's storage planned again)."""
    main = plan.main
    if any(op.subgraphs for _, op in main.ops):
        return []
    outputs = set(main.graph.outputs)
    notes: list[str] = []
    for conv_node, conv in list(main.ops):
        if conv_node.op_type != "Conv" or conv_node.domain not in ONNX or not isinstance(conv, Conv):
            continue
        note = _one(plan, main, conv_node, conv, outputs)
        if note:
            notes.append(note)
    return notes


def _qualifies(conv: Conv) -> bool:
    x, w, y = conv.input(0), conv.input(1), conv.output()
    g = conv.geo
    return (all(k == 1 for k in conv.kernel) and all(s == 1 for s in g.strides) and not any(g.pads_begin + g.pads_end)
            and conv.group == 1 and not x.batched and not y.batched and x.shape[0] == 1
            and all(t.dtype is dtypes.FLOAT for t in (x, w, y)) and w.value is not None
            and (not conv.has_input(2) or conv.input(2).value is not None))


def _one(plan, main, conv_node: Node, conv: Conv, outputs: set[str]) -> str:
    if not _qualifies(conv):
        return ""
    users: dict[str, list] = {}
    for node, op in main.ops:
        for i in dict.fromkeys(i for i in node.inputs if i):
            users.setdefault(i, []).append((node, op))
    y = conv.output()
    M = conv.M
    path = Path(lead=True, chan=(0, M), flat=len(y.shape) == 3)
    cur, prefix, sides, lead_at_branch = y.name, 0, [], True
    while True:
        if cur in outputs:
            return ""
        readers = users.get(cur, [])
        if len(readers) > 1 and not sides and path.chan == (0, M) and not path.flat:
            # the branch: one reader goes on, the others must be Slices of channels (the side channels)
            prefix, lead_at_branch = len(path.nodes), path.lead
            on = []
            for node, op in readers:
                probe = Path(path.lead, path.chan, path.flat)
                ch = _channel_slice(op, probe) if op.inputs[0] is not None and op.inputs[0].name == cur else None
                (sides if ch is not None else on).append((node, op, ch))
            if len(on) > 1:
                return ""
            if not on:
                # (Slices only: the one the gather path takes is the one whose output goes on to a Gather)
                kept = [s for s in sides if _reaches_gather(s, cur, path, users, outputs)]
                if len(kept) != 1:
                    return ""
                on = kept
                sides = [s for s in sides if s is not kept[0]]
                if len(on) + len(sides) != len(readers):
                    return ""
            readers = [(on[0][0], on[0][1])]
        if len(readers) != 1:
            return ""
        node, op = readers[0]
        got = _step(node, op, cur, path)
        if got is None:
            return ""
        cur = op.outputs[0].name
        if got == "gather":
            break
    c0, c1 = path.chan
    side_ranges = [ch for _, _, ch in sides]
    if any(not (e <= c0 or s >= c1) for s, e in side_ranges):
        return ""
    p0 = min((s for s, _ in side_ranges), default=0)
    p1 = max((e for _, e in side_ranges), default=0)
    if side_ranges and not (p1 <= c0 or p0 >= c1):
        return ""
    gnode, gop = path.nodes[-1]
    idx, out = gop.input(1), gop.output()
    x = conv.input(0)
    C, S = x.shape[1], x.shape[2:]
    P = int(np.prod(S, dtype=np.int64))
    K = idx.numel
    if K == 0 or K >= P:
        return ""  # (no row saved)
    w = np.asarray(conv.input(1).value, np.float32)
    b = np.asarray(conv.input(2).value, np.float32) if conv.has_input(2) else None
    base = conv_node.name
    before = set(main.tensors)
    new_ops: dict[str, list] = {}  # the node name after which (or in place of which) the new nodes go

    said = {None: "on the TF32 mma tile or the dot form (their own order)", "items": "in the items form (B first)",
            "fp32": "on tiled.py's FP32 tile (B last)"}
    form = _form(conv)
    if form is None:
        return (f"Conv '{conv_node.name}': {c1 - c0} of {M} output channels read only at {K} gathered rows; "
                f"not rewritten: every row's Conv sums {said[form]}")
    # the kept rows: one node gathers X's rows as the Gather did (its node named by a bad index) and sums each
    # output in the order of every row's Conv (operators/rows_kept.py), then the path's maps
    w_k = _const(main, f"{base}/rows_kept/W", np.ascontiguousarray(w[c0:c1]))
    b_k = _const(main, f"{base}/rows_kept/B", np.ascontiguousarray(b[c0:c1])) if b is not None else None
    y_k = out if not path.maps else new_tensor(main, f"{base}/rows_kept", dtypes.FLOAT, tuple(out.shape), False)
    n_k = Node(f"{base}/rows_kept", "RowsKeptConv", "luisaml",
               [x.name, idx.name, w_k.name] + ([b_k.name] if b_k is not None else []), [y_k.name])
    kept = [(n_k, RowsKeptConv(n_k, [x, idx, w_k] + ([b_k] if b_k is not None else []), [y_k], gop, form))]
    t_cur = y_k
    for k, (mnode, mop) in enumerate(path.maps):
        t_next = out if k == len(path.maps) - 1 else new_tensor(main, f"{base}/rows_kept/map{k}", dtypes.FLOAT,
                                                                 tuple(out.shape), False)
        src = next(t for t in mop.inputs if t is not None and t.value is None)
        kept.append(_copy(mnode, mop, f"{mnode.name}/rows_kept", [t_cur if t is src else t for t in mop.inputs],
                          [t_next]))
        t_cur = t_next
    new_ops[gnode.name] = kept

    # the side channels [p0, p1) over every position: the Conv, the path's nodes before the branch, the Slices
    side: list = []
    if sides:
        w_s = _const(main, f"{base}/side/W", np.ascontiguousarray(w[p0:p1]))
        b_s = _const(main, f"{base}/side/B", np.ascontiguousarray(b[p0:p1])) if b is not None else None
        y_s = new_tensor(main, f"{y.name}/side", dtypes.FLOAT, (1, p1 - p0) + tuple(S), False)
        side_conv = _copy(conv_node, conv, base, [x, w_s, b_s] if b_s is not None else [x, w_s], [y_s])
        side.append(side_conv)
        t_cur = y_s
        for pnode, pop in path.nodes[:prefix]:
            src = pop.inputs[0] if not getattr(pop, "elementwise", False) else next(
                t for t in pop.inputs if t is not None and t.value is None)
            shape = tuple(t_cur.shape if getattr(pop, "elementwise", False) else t_cur.shape[1:])
            t_next = new_tensor(main, f"{pop.outputs[0].name}/side", dtypes.FLOAT, shape, False)
            ins = [t_cur if t is src else t for t in pop.inputs]
            if pnode.op_type == "Reshape":  # (a Squeeze's axes, a Flatten's axis stay as they were)
                ins = [t_cur, _const(main, f"{pnode.name}/side_shape", np.array(shape, np.int64))]
            side.append(_copy(pnode, pop, f"{pnode.name}/side", ins, [t_next]))
            t_cur = t_next
        ca = 1 if lead_at_branch else 0
        for snode, sop, (s, e) in sides:
            rank = sop.inputs[0].rank
            starts = np.array([sop.first[a] - (p0 if a == ca else 0) for a in range(rank)], np.int64)
            ends = np.array([sop.first[a] + sop.outputs[0].shape[a] - (p0 if a == ca else 0) for a in range(rank)],
                            np.int64)
            st = _const(main, f"{snode.name}/side_starts", starts)
            en = _const(main, f"{snode.name}/side_ends", ends)
            n = Node(snode.name, "Slice", "", [t_cur.name, st.name, en.name], list(snode.outputs))
            side.append((n, Slice(n, [t_cur, st, en], [sop.outputs[0]], 13)))
    # the side channels' Conv must sum as every row's did (a narrower product may take another form)
    if side and _form(side[0][1]) != form:
        for name in set(main.tensors) - before:
            main.tensors.pop(name)
            main.graph.vars.pop(name, None)
        return (f"Conv '{conv_node.name}': {c1 - c0} of {M} output channels read only at {K} gathered rows; "
                f"not rewritten: every row's Conv sums {said[form]}, the side channels' would sum "
                f"{said[_form(side[0][1])]}")
    drop = {n.name for n, _ in path.nodes} | {conv_node.name} | {n.name for n, _, _ in sides}
    ops = []
    for node, op in main.ops:
        if node.name == conv_node.name:
            ops += side
        if node.name == gnode.name:
            ops += new_ops[gnode.name]
            continue
        if node.name not in drop:
            ops.append((node, op))
    main.ops = ops
    read = {i for n, _ in ops for i in n.inputs if i} | {o for n, _ in ops for o in n.outputs if o} | outputs
    for t in [y.name] + [o for n, _ in path.nodes[:-1] for o in n.outputs] + [i for i in conv_node.inputs if i]:
        if t not in read:  # (the full Conv's output, the path's tensors, W and B: nothing reads them now)
            main.tensors.pop(t, None)
    main.allocation, main.views = plan_storage(main.graph, main.tensors, main.ops, plan.blob)
    rest = f"the other {p1 - p0} over every row" if sides else "no other channel is read"
    return (f"Conv '{conv_node.name}': {c1 - c0} of {M} output channels evaluated at {K} gathered rows, not "
            f"{P:,} (Gather '{gnode.name}'); {rest}")


def _reaches_gather(side, cur: str, path: Path, users, outputs) -> bool:
    """Whether a Slice reader of the branch leads on along single readers to the path's Gather."""
    node, op, _ = side
    probe = Path(path.lead, path.chan, path.flat)
    t, n, o = cur, node, op
    while True:
        got = _step(n, o, t, probe)
        if got is None:
            return False
        if got == "gather":
            return True
        t = o.outputs[0].name
        if t in outputs:
            return False
        readers = users.get(t, [])
        if len(readers) != 1:
            return False
        n, o = readers[0]
