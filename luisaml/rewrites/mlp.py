"""MLP fusion: a graph rewrite. A chain of dense layers (Gemm, or MatMul + an Add of a constant
bias) from the batched graph input to the batched graph output, each layer followed by any
elementwise nodes (its activation: Relu, Softplus, SiLU's Sigmoid and Mul, Sin, GELU's pieces...),
is replaced by one FusedMLP node (operators/mlp.py), which plans and emits the cooperative kernel.
`fuse` says why a graph is not such a chain (inspect prints it; precision="fp16" needs it).

precision="fp16" with the FP16 tensor-core tile (tensor cores on, CUDA's blocks stages: `f16_stages`) declines
the fused kernel: the chain's layers run as stages, their products on operators/tiled_mma.py's "f16" kind, the
graph's float input and output half in their buffers (Plan.half_io), as the fused kernel's are. The fused
kernel is FP32 arithmetic on half inputs (0.29-0.51x torch fp16 on the H200), an HMMA does a TF32 mma's work
twice over (benchmarks/NOTES.md, "The fp16 MLPs against torch fp16")."""
from __future__ import annotations

import numpy as np

from luisaml import dtypes
from luisaml.errors import CompileError
from luisaml.lowering import plan_storage
from luisaml.model import Node
from luisaml.operator import Operator
from luisaml.operators.mlp import PRECISIONS, Activation, FusedMLP, Layer, MLPConfig, NotFusable
from luisaml.plan import Plan
from luisaml.storage import Tensor

DENSE = ("Gemm", "MatMul")

# precision="fp16" with tensor cores: the layers as stages on the FP16 mma tile (True), or the fused kernel as
# before (False: an A/B switch for the GPU session, read when a plan is built)
FP16_STAGES = True
# and the activations between those stages in half buffers (True; Plan.half_activations): half the bytes a hidden
# layer moves (63-256x4-4 at 1M samples: 2 GB -> 1 GB a layer), no product changed (the next tile rounds its A to
# half where it copies it); False: float buffers (an A/B switch)
FP16_HALF_ACTIVATIONS = True


def f16_stages(precision: str, tensor_cores: bool, blocks: bool, stages: bool) -> bool:
    """Whether a plan built under these options runs precision="fp16"'s layers as stages on the FP16 mma tile."""
    return FP16_STAGES and precision == "fp16" and tensor_cores and blocks and stages


def _const(t: Tensor | None, what: str) -> np.ndarray:
    if t is None or t.value is None:
        raise NotFusable(f"{what} is not a constant")
    return np.asarray(t.value)


def _bias_row(value: np.ndarray, n: int, what: str) -> np.ndarray:
    """Return a constant broadcast to one row of n (per-sample shapes (n,), (1, n), scalars)."""
    v = np.asarray(value, np.float64)
    try:
        return np.broadcast_to(v, (1, n)).reshape(n).astype(np.float64)
    except ValueError:
        raise NotFusable(f"{what} of shape {list(v.shape)} does not broadcast to [1, {n}]") from None


def find_chain(plan: Plan) -> tuple[list[Layer], list[tuple[Node, Operator]], list[Tensor]]:
    """Return (layers, the chain's nodes in order, its intermediate tensors) of a plan's graph, or
    raise NotFusable saying why it is not an MLP chain."""
    if plan.symbol is None:
        raise NotFusable("no batch axis (the fused kernel runs one sample per tile row)")
    if len(plan.inputs) != 1 or len(plan.outputs) != 1 or plan.host_outputs:
        raise NotFusable("needs exactly one graph input and one graph output")
    xin, yout = plan.inputs[0], plan.outputs[0]
    for s, role in ((xin, "input"), (yout, "output")):
        if not s.batched or len(s.kernel_shape) != 2 or s.kernel_shape[0] != 1 or s.dtype is not dtypes.FLOAT:
            raise NotFusable(f"{role} '{s.name}' must be float32 [batch, features]")
    users: dict[str, list[tuple[Node, Operator]]] = {}
    for node, op in plan.ops:
        for i in dict.fromkeys(i for i in node.inputs if i):
            users.setdefault(i, []).append((node, op))
    if plan.views:
        raise NotFusable(f"views ({', '.join(plan.views)}) between the layers")
    tensors = plan.tensors
    layers: list[Layer] = []
    chain: list[tuple[Node, Operator]] = []
    cur = xin.name

    def only_user(name: str) -> tuple[Node, Operator]:
        found = users.get(name, [])
        if len(found) != 1:
            raise NotFusable(f"tensor '{name}' has {len(found)} consumers (a chain needs one)")
        return found[0]

    while cur != yout.name:
        node, op = only_user(cur)
        if node.op_type not in DENSE:
            raise NotFusable(f"{node.describe()} is not a dense layer (Gemm or MatMul) after '{cur}'")
        layer, cur = _dense(node, op, cur, only_user, yout.name)
        chain += [(n, o) for n, o in plan.ops if n.name in layer.nodes]
        layer.act, cur = _activation(tensors[cur], users, tensors, yout.name)
        chain += layer.act.nodes
        layers.append(layer)
        if tensors[cur].dtype is not dtypes.FLOAT or tensors[cur].rank != 2:
            raise NotFusable(f"tensor '{cur}' is not a float32 [batch, features] row")
    if not layers:
        raise NotFusable("no dense layer between the input and the output")
    K0 = xin.kernel_shape[1]
    for i, l in enumerate(layers):
        want = K0 if i == 0 else layers[i - 1].N
        if l.K != want:
            raise NotFusable(f"layer {i} ({l.nodes[0]}) takes {l.K} features, the previous gives {want}")
    order = {n.name: k for k, (n, _) in enumerate(plan.ops)}
    chain.sort(key=lambda no: order[no[0].name])
    inter = [tensors[o] for n, _ in chain for o in n.outputs if o and o != yout.name]
    return layers, chain, inter


def _dense(node: Node, op: Operator, cur: str, only_user, y: str) -> tuple[Layer, str]:
    """Return (the layer of a Gemm, or of a MatMul and the Add of a bias after it, its output)."""
    if node.op_type == "Gemm":
        if node.inputs[0] != cur or op.ta:
            raise NotFusable(f"{node.describe()}: the chain must be input A, not transposed")
        b = _const(op.input(1), f"{node.describe()}: B")
        w = (b.T if op.tb else b).astype(np.float64) * op.alpha
        bias = np.zeros(w.shape[1])
        if op.has_input(2) and op.beta != 0:
            bias = _bias_row(_const(op.input(2), f"{node.describe()}: C"), w.shape[1], f"{node.describe()}: C") * op.beta
        return Layer(w.astype(np.float32), bias.astype(np.float32), Activation(), nodes=[node.name]), node.outputs[0]
    if node.inputs[0] != cur or op.input(1).rank != 2 or op.input(0).rank != 2:
        raise NotFusable(f"{node.describe()}: needs [batch, K] x constant [K, N]")
    w = _const(op.input(1), f"{node.describe()}: B").astype(np.float32)
    layer = Layer(w, np.zeros(w.shape[1], np.float32), Activation(), nodes=[node.name])
    out = node.outputs[0]
    if out != y:
        nxt, nop = only_user(out)
        if nxt.op_type == "Add":
            other = nop.inputs[1] if nxt.inputs[0] == out else nop.inputs[0]
            if other is not None and other.value is not None:
                layer.bias = _bias_row(other.value, w.shape[1], f"{nxt.describe()}: bias").astype(np.float32)
                layer.nodes.append(nxt.name)
                out = nxt.outputs[0]
    return layer, out


# how often the layer's row may appear in its activation's one expression (SiLU's x * sigmoid(x): 2)
MAX_ACTIVATION_COPIES = 16


def _activation(h: Tensor, users, tensors, y: str) -> tuple[Activation, str]:
    """Return (the elementwise nodes after a layer's output h, the tensor they end at): every
    reader of h and of what they compute must be an inline elementwise node over those tensors
    and constants that broadcast to one row, until one tensor the next dense layer reads (or
    the graph output). A diamond (SiLU: Sigmoid(h) * h) is fine."""
    region, nodes, seen = {h.name}, [], set()
    ends: set[str] = set()
    pending = [h.name]
    waiting: dict[str, tuple[Node, Operator]] = {}  # readers some of whose inputs are not in yet
    while pending:
        t = pending.pop()
        readers = users.get(t, [])
        if any(n.op_type in DENSE for n, _ in readers) or t == y:
            ends.add(t)
            continue
        if not readers:
            raise NotFusable(f"tensor '{t}' leads nowhere")
        for node, op in readers:
            if node.name not in seen:
                waiting[node.name] = (node, op)
        for name, (node, op) in list(waiting.items()):
            if not (op.inline and op.elementwise and len(node.outputs) == 1):
                raise NotFusable(f"{node.describe()} is not a dense layer or an elementwise activation")
            if any(t_in is not None and t_in.value is None and t_in.name not in region for t_in in op.inputs):
                continue  # another of its inputs is computed later in the activation
            out = op.outputs[0]
            if out.dtype is not dtypes.FLOAT or tuple(out.shape) != tuple(h.shape):
                raise NotFusable(f"{node.describe()}: output '{out.name}' {list(out.shape)} is not a row like '{h.name}'")
            for t_in in op.inputs:
                if t_in is not None and t_in.value is not None:
                    _bias_row(t_in.value, h.shape[-1], f"{node.describe()}: input '{t_in.name}'")
            del waiting[name]
            seen.add(name)
            nodes.append((node, op))
            region.add(out.name)
            pending.append(out.name)
    if waiting:
        node = next(iter(waiting.values()))[0]
        raise NotFusable(f"{node.describe()} reads a tensor that is neither the layer's row, the activation's nor a constant")
    if len(ends) != 1:
        raise NotFusable(f"the activation after '{h.name}' ends in {len(ends)} tensors ({', '.join(sorted(ends))}), not one")
    end = ends.pop()
    for t in region - {end}:
        outside = [n for n, _ in users.get(t, []) if n.name not in seen]
        if outside:
            raise NotFusable(f"tensor '{t}' is read by {outside[0].describe()} outside the activation")
    if len(users.get(end, [])) > 1:
        raise NotFusable(f"tensor '{end}' has {len(users[end])} consumers (a chain needs one)")
    # Activation.expr writes the nodes as one nested expression, so a tensor appears in it once per
    # path to the end: a node reading its input twice (x * x) doubles everything before it
    copies = {h.name: 1}
    for _, op in nodes:
        copies[op.outputs[0].name] = sum(copies.get(t.name, 0) for t in op.inputs if t is not None)
    if copies[end] > MAX_ACTIVATION_COPIES:
        raise NotFusable(f"the activation after '{h.name}' would repeat it {copies[end]} times in one expression "
                         f"(more than {MAX_ACTIVATION_COPIES}): it runs as stages")
    return Activation(h, tensors[end], nodes), end


def fuse(plan: Plan, fuse_mode: str, precision: str, config: MLPConfig | None = None,
         on_f16_tile: bool = False) -> tuple[FusedMLP | None, str]:
    """Return (the FusedMLP now standing for the plan's chain, a note for inspect) and rewrite the
    plan's main graph to that one node; or (None, why not) for fuse_mode "off" or a graph that is
    no MLP chain. fuse_mode: "off", "gpu" or "emulated"; on_f16_tile (f16_stages): precision="fp16"'s chain
    stays as stages, its input and output half (plan.half_io)."""
    if precision not in PRECISIONS:
        raise CompileError(f"precision must be one of {PRECISIONS}, not {precision!r}")
    if on_f16_tile and precision == "fp16":
        try:  # (fp16 stays an MLP chain's precision, whichever form runs it)
            layers, _, _ = find_chain(plan)
        except NotFusable as e:
            raise CompileError(f"precision='{precision}' needs an MLP chain, and this graph is not one: {e}") from None
        plan.half_io, plan.half_activations = True, FP16_HALF_ACTIVATIONS
        return None, (f"not fused: precision='fp16' with tensor cores runs the {len(layers)} layers as stages on the "
                      "FP16 mma tile (half input and output)")
    try:
        layers, chain, inter = find_chain(plan)
        mode = fuse_mode if fuse_mode in ("gpu", "emulated") else "gpu"
        x, y = plan.tensors[plan.inputs[0].name], plan.tensors[plan.outputs[0].name]
        node = Node("fused_mlp", "FusedMLP", "luisaml", [x.name], [y.name])
        fused = FusedMLP(node, x, y, layers, chain, inter).plan(mode, precision, config)
    except NotFusable as e:
        if precision != "fp32":
            raise CompileError(f"precision='{precision}' needs the fused MLP kernel, and this graph is not one: {e}") from None
        return None, f"not fused: {e}"
    if fuse_mode == "off" and precision == "fp32":
        return None, f"fusable (used on the CUDA backend): {fused.describe()}"
    fused.pack_weights(plan.blob)
    main = plan.main
    main.ops = [(node, fused)]
    main.allocation, main.views = plan_storage(main.graph, main.tensors, main.ops, plan.blob)
    return fused, fused.describe()
