"""The Winograd rewrite: every qualifying 2-D 3x3 stride-1 Conv of a plan's main graph becomes the
three stages of F(m x m, 3 x 3) (operators/winograd.py holds the stages and `qualifies`)."""
from __future__ import annotations

from luisaml import dtypes
from luisaml.lowering import plan_storage
from luisaml.model import Node
from luisaml.operators.winograd import TILES, WinogradInput, WinogradOutput, WinogradProduct, qualifies
from luisaml.rewrites import new_tensor


def rewrite(plan, m: int) -> list[str]:
    """Replace every qualifying Conv of the plan's main graph by the three Winograd stages of F(m x m,
    3 x 3); return the names of the nodes rewritten (the plan's storage is planned again)."""
    if m not in TILES:
        raise ValueError(f"Winograd tiles of {m} x {m} are not supported (only {', '.join(map(str, TILES))})")
    main = plan.main
    ops, done = [], []

    for node, op in main.ops:
        if node.op_type != "Conv" or node.domain not in ("", "ai.onnx") or qualifies(op) is not None:
            ops.append((node, op))
            continue
        x, y = op.input(0), op.output()
        a2 = (m + 2) ** 2
        tiles = -(-op.geo.out[0] // m) * -(-op.geo.out[1] // m)
        v = new_tensor(main, f"{y.name}/winograd_in", dtypes.FLOAT, (x.shape[0], a2, x.shape[1], tiles), x.batched)
        prod = new_tensor(main, f"{y.name}/winograd_product", dtypes.FLOAT, (x.shape[0], a2, op.M, tiles), y.batched)
        bias = [op.input(2)] if op.has_input(2) else []
        n_in = Node(f"{node.name}/winograd_in", "WinogradInput", "luisaml", [x.name], [v.name])
        n_mm = Node(f"{node.name}/winograd_product", "WinogradProduct", "luisaml", [v.name], [prod.name])
        n_out = Node(node.name, "WinogradOutput", "luisaml", [prod.name] + [b.name for b in bias], [y.name])
        ops += [(n_in, WinogradInput(n_in, [x], [v], m, op)),
                (n_mm, WinogradProduct(n_mm, [v], [prod], m, op, plan.blob)),
                (n_out, WinogradOutput(n_out, [prod] + bias, [y], m, op))]
        done.append(node.name)
    if done:
        main.ops = ops
        main.allocation, main.views = plan_storage(main.graph, main.tensors, main.ops, plan.blob)
    return done
