"""The recurrent rewrite: every qualifying RNN, GRU and LSTM node of a plan's main graph becomes
its projection GEMM and its phased steps (operators/rnn_stages.py holds both and `qualifies`), with
the exporter's Transposes around it folded into the projection's loads and Y's stores.

torch exports a batch_first nn.GRU / nn.LSTM as Transpose(x, [1, 0, 2]) -> GRU -> Squeeze ->
Transpose([1, 0, 2]) (bidirectional: Transpose, Reshape, Transpose): on the CPU the output's
Transpose was an element stage of its own (1.2-1.4 ms of a 64-row GRU of 128 units), the input's
index arithmetic in every load of the projection. The projection reads X's source in the source's
row order instead (`RecurrentProjection.swapped`), and the steps store Y's elements where the chain of layout nodes puts
them (`RecurrentSteps.y_strides`), the chain's nodes removed; `forward` (the whole form) stores the same way.
On CUDA the block loop may take the projection inside its steps (operators/rnn_block.py `BlockLoop.fused`):
then no projection node, the steps read X's source and W themselves."""
from __future__ import annotations

import numpy as np

from luisaml import dtypes
from luisaml.lowering import plan_storage
from luisaml.model import Node
from luisaml.operators import rnn_block
from luisaml.operators.rnn_stages import RecurrentProjection, RecurrentSteps, qualifies
from luisaml.rewrites import new_tensor
from luisaml.storage import Tensor

F32 = dtypes.FLOAT


# a chain of layout nodes is folded when the index check it takes is at most this many elements
FOLD_ELEMENTS = 1 << 24


def _readers(ops) -> dict[str, list]:
    out: dict[str, list] = {}
    for node, op in ops:
        for name in node.inputs:
            if name:
                out.setdefault(name, []).append((node, op))
    return out


def _layout(node, op) -> tuple[int, ...] | None:
    """Return the axes' permutation a layout node applies (() for a view: its elements in order), or
    None when it is no layout node."""
    if node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type == "Transpose":
        return tuple(op.perm)
    return () if getattr(op, "view", False) or node.op_type == "Identity" else None


def x_source(x, producers) -> Tensor | None:
    """Return X's source when X is Transpose(source, [1, 0, 2]) (the first two axes swapped), else None."""
    made = producers.get(x.name)
    if made is None or x.batched:
        return None
    node, op = made
    if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx") or tuple(op.perm) != (1, 0, 2):
        return None
    src = op.input(0)
    return src if not src.batched and src.dtype == x.dtype else None


def y_chain(y, readers, outputs: set[str]):
    """Return (Z, strides of Y's axes in Z, the chain's nodes) when Y's only reader starts a chain of
    layout nodes, each tensor read once and no graph output but the last, whose end Z is a
    permutation of Y's axes; else None."""
    if y is None or y.batched or y.name in outputs or y.numel > FOLD_ELEMENTS:
        return None
    chain, t = [], y
    while len(readers.get(t.name, [])) == 1 and t.name not in outputs:
        node, op = readers[t.name][0]
        if _layout(node, op) is None or node.inputs[0] != t.name or op.output().batched:
            break
        chain.append((node, op))
        t = op.output()
    if not chain:
        return None
    idx = np.arange(y.numel, dtype=np.int64).reshape(y.shape)
    for node, op in chain:
        perm = _layout(node, op)
        idx = np.transpose(idx, perm) if perm else idx
        idx = idx.reshape(op.output().shape)
    pos = np.empty(y.numel, np.int64)
    pos[idx.reshape(-1)] = np.arange(y.numel)  # pos[Y's flat index] = its flat index in Z
    pos = pos.reshape(y.shape)
    strides = tuple(int(pos[tuple(1 if a == k else 0 for a in range(len(y.shape)))]) if y.shape[k] > 1 else 0
                    for k in range(len(y.shape)))
    want = sum(np.arange(n, dtype=np.int64).reshape([-1 if a == k else 1 for a in range(len(y.shape))]) * st
               for k, (n, st) in enumerate(zip(y.shape, strides)))
    if not np.array_equal(pos, np.broadcast_to(want, y.shape)):
        return None
    return t, strides, chain


def rewrite(plan, gpu: bool, form: str = "auto") -> list[str]:
    """Replace every qualifying RNN, GRU and LSTM node of the plan's main graph by its projection and
    its steps (above); return the names of the nodes rewritten (the plan's storage is planned again).
    form: CUDA's steps (compile's `recurrent`, operators/rnn_block.py FORMS)."""
    main = plan.main
    ops, done = [], []

    def tensor(name: str, shape: tuple[int, ...], batched: bool) -> Tensor:
        return new_tensor(main, name, F32, shape, batched)

    producers = {o.name: (node, op) for node, op in main.ops for o in op.outputs if o is not None}
    readers = _readers(main.ops)
    outputs = set(main.graph.outputs)
    dropped: set[str] = set()  # the layout nodes folded into Y's stores
    for node, op in main.ops:
        if node.name in dropped:
            continue
        if node.op_type not in ("RNN", "GRU", "LSTM") or node.domain not in ("", "ai.onnx") or qualifies(op) is not None:
            if node.op_type in ("RNN", "GRU", "LSTM") and node.domain in ("", "ai.onnx"):
                op.whole_note = qualifies(op)
            ops.append((node, op))
            continue
        x = op.input(0)
        batched = x.batched
        D, G, H, B = op.D, op.gates, op.H, op.B
        base = node.outputs[0] or node.name
        split = op.cell == "gru" and not op.linear_before_reset
        # CUDA: the whole sequence in one launch, the state on chip, where it fits (operators/rnn_block.py)
        block = rnn_block.choose(op, split, batched, form) if gpu else None
        fused = block is not None and block.fused
        proj = None if fused else tensor(f"{base}/projection", (x.numel // op.I, D * G * H), batched)
        extra = []
        if block is None:
            extra.append(tensor(f"{base}/h_state", (2, D, B, H), batched))
            if op.cell == "lstm":
                extra.append(tensor(f"{base}/c_state", (D, B, H), batched))
                if not gpu:  # the CPU's loop form: a step's four gate pre-activations (rnn_step.Step.gate_loop)
                    extra.append(tensor(f"{base}/gates", (D, B, H, 4), batched))
            elif split:
                extra.append(tensor(f"{base}/z_rh", (2, D, B, H), batched))
        bias = op.inputs[3] if op.has_input(3) else None
        src = x_source(x, producers)
        opt = [op.inputs[k] if op.has_input(k) and k < op.n_inputs() else None for k in range(3, 8)]
        # fused (rnn_block: the projection inside the steps): X's rows for P's, W after X
        step_ins = [(src or x) if fused else proj, op.input(2)] + opt + [x] + ([op.input(1)] if fused else [])
        outs = [op.outputs[k] if k < len(op.outputs) else None for k in range(3)]
        chain = y_chain(outs[0], readers, outputs)
        y_strides = None
        if chain is not None:
            z, strides, nodes = chain
            outs[0] = z
            # Y's axes: (S, D, B, H) in layout 0, (B, S, D, H) in layout 1; the steps take (t, d, b, u)
            y_strides = strides if op.layout == 0 else (strides[1], strides[2], strides[0], strides[3])
            dropped |= {n.name for n, _ in nodes}
        n_steps = Node(node.name, f"{node.op_type}Steps", "luisaml", [t.name if t is not None else "" for t in step_ins],
                       [t.name if t is not None else "" for t in outs] + [t.name for t in extra])
        if not fused:
            n_proj = Node(f"{node.name}/projection", "RecurrentProjection", "luisaml",
                          [(src or x).name, op.input(1).name] + ([bias.name] if bias is not None else []), [proj.name])
            ops.append((n_proj, RecurrentProjection(n_proj, [src or x, op.input(1)] + ([bias] if bias is not None else []),
                                                    [proj], op, swapped=src is not None)))
        ops.append((n_steps, RecurrentSteps(n_steps, step_ins, outs + extra, op, gpu, plan.blob, swapped=src is not None,
                                            y_strides=y_strides, block=block)))
        done.append(node.name)
    if done:
        main.ops = ops
        main.allocation, main.views = plan_storage(main.graph, main.tensors, main.ops, plan.blob)
    return done
