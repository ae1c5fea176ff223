"""Graph rewrites over a lowered plan: the fused MLP (mlp.py) and Winograd convolutions
(winograd.py) and recurrent cells as a GEMM and phased steps (rnn.py), a 1x1 Conv's channels read only at
gathered rows computed at those rows (rows_kept.py); luisaml/compiler.py runs them before the schedule.
`new_tensor`: a tensor of the graph's own that a rewrite adds (between the nodes it makes)."""
from __future__ import annotations

from luisaml.model import Variable
from luisaml.storage import Tensor


def new_tensor(main, name: str, dtype, shape: tuple[int, ...], batched: bool) -> Tensor:
    """Return a new tensor of main's own (a GraphCode: its tensors and its graph's variables), named
    `name` or, where main has that name, the first free of name.1, name.2, ...: plan_storage places it
    when the rewrite plans the storage again."""
    k = 0
    while (fresh := f"{name}{'' if k == 0 else f'.{k}'}") in main.tensors:
        k += 1
    t = Tensor(fresh, dtype, tuple(shape), batched)
    main.tensors[t.name] = t
    main.graph.vars[t.name] = Variable(t.name, t.dtype, list(t.shape))
    return t
