"""The recurrent rewrite: every qualifying RNN, GRU and LSTM node of a plan's main graph becomes
its projection GEMM and its phased steps (operators/rnn_stages.py holds both and `qualifies`)."""
from __future__ import annotations

from luisaml import dtypes
from luisaml.lowering import plan_storage
from luisaml.model import Node, Variable
from luisaml.operators.rnn_stages import RecurrentProjection, RecurrentSteps, qualifies
from luisaml.storage import Tensor

F32 = dtypes.FLOAT


def rewrite(plan, gpu: bool) -> list[str]:
    """Replace every qualifying RNN, GRU and LSTM node of the plan's main graph by its projection and
    its steps (above); return the names of the nodes rewritten (the plan's storage is planned again)."""
    main = plan.main
    ops, done = [], []

    def fresh(name: str) -> str:
        k = 0
        while (candidate := f"{name}{'' if k == 0 else f'.{k}'}") in main.tensors:
            k += 1
        return candidate

    def tensor(name: str, shape: tuple[int, ...], batched: bool) -> Tensor:
        t = Tensor(fresh(name), F32, shape, batched)
        main.tensors[t.name] = t
        main.graph.vars[t.name] = Variable(t.name, t.dtype, list(t.shape))
        return t

    for node, op in main.ops:
        if node.op_type not in ("RNN", "GRU", "LSTM") or node.domain not in ("", "ai.onnx") or qualifies(op) is not None:
            if node.op_type in ("RNN", "GRU", "LSTM") and node.domain in ("", "ai.onnx"):
                op.whole_note = qualifies(op)
            ops.append((node, op))
            continue
        x = op.input(0)
        batched = x.batched
        D, G, H, B = op.D, op.gates, op.H, op.B
        base = node.outputs[0] or node.name
        proj = tensor(f"{base}/projection", (x.numel // op.I, D * G * H), batched)
        hs = tensor(f"{base}/h_state", (2, D, B, H), batched)
        extra = [hs]
        if op.cell == "lstm":
            extra.append(tensor(f"{base}/c_state", (D, B, H), batched))
        elif op.cell == "gru" and not op.linear_before_reset:
            extra.append(tensor(f"{base}/z_rh", (2, D, B, H), batched))
        bias = op.inputs[3] if op.has_input(3) else None
        n_proj = Node(f"{node.name}/projection", "RecurrentProjection", "luisaml",
                      [x.name, op.input(1).name] + ([bias.name] if bias is not None else []), [proj.name])
        opt = [op.inputs[k] if op.has_input(k) and k < op.n_inputs() else None for k in range(3, 8)]
        step_ins = [proj, op.input(2)] + opt + [x]
        outs = [op.outputs[k] if k < len(op.outputs) else None for k in range(3)]
        n_steps = Node(node.name, f"{node.op_type}Steps", "luisaml", [t.name if t is not None else "" for t in step_ins],
                       [t.name if t is not None else "" for t in outs] + [t.name for t in extra])
        ops += [(n_proj, RecurrentProjection(n_proj, [x, op.input(1)] + ([bias] if bias is not None else []), [proj], op)),
                (n_steps, RecurrentSteps(n_steps, step_ins, outs + extra, op, gpu, plan.blob))]
        done.append(node.name)
    if done:
        main.ops = ops
        main.allocation, main.views = plan_storage(main.graph, main.tensors, main.ops, plan.blob)
    return done
