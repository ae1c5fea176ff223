"""ScatterElements, ScatterND and Scatter: the output starts as a copy of data, then each update is
written (or combined, by `reduction`) at the position its index gives, in order, by one thread:
duplicate indices resolve as onnxruntime does (the last update wins; reductions accumulate).
Runtime indices wrap when negative; an out-of-range one fails the run naming the node (it is
clamped first, so the write stays in bounds)."""
from __future__ import annotations

import numpy as np

from luisaml import indexing as ix
from luisaml.operator import Operator
from luisaml.registry import register

from .common import emit_map
from .indexing import check_constant_indices, element_nest, index_flag, index_lines

REDUCTIONS = ("none", "add", "mul", "max", "min")


def combine(reduction: str, old: str, new: str, bool_data: bool) -> str:
    """Return the DSL of an element after an update under a reduction."""
    if reduction == "none":
        return new
    if bool_data:  # numeric reductions of bools: add is or, mul is and, as onnxruntime does
        return f"({old} {'or' if reduction in ('add', 'max') else 'and'} {new})"
    # max/min as onnxruntime folds them, update by update (a > b ? a : b): a NaN update is taken,
    # and replaced by the next update; the DSL's max() would drop it
    return {"add": f"{old} + {new}", "mul": f"{old} * {new}", "max": f"({old} if {old} > {new} else {new})",
            "min": f"({old} if {old} < {new} else {new})"}[reduction]


class Scatter(Operator):
    """Shared checks: updates of data's type, integer indices, a known reduction."""

    inplace = (0,)
    since_reductions = ("add", "mul")  # opset 16; max and min from 18

    def check_common(self):
        x, idx, upd, y = self.input(0), self.input(1), self.input(2), self.output()
        self.expect_dtype(idx, ("int",), "input 1 (indices)")
        self.expect(upd.dtype == x.dtype, f"updates '{upd.name}' has type {upd.dtype.name.lower()}, data {x.dtype.name.lower()}")
        self.expect(tuple(y.shape) == tuple(x.shape), f"output shape {list(y.shape)} is not data's {list(x.shape)}")
        self.reduction = self.attr("reduction", "none")
        self.expect(self.reduction in REDUCTIONS, f"reduction {self.reduction!r} is not one of {', '.join(REDUCTIONS)}")

    def update(self, dst: str, value: str) -> str:
        """Return the line applying one update at output index dst."""
        y = self.output()
        return y.store(dst, combine(self.reduction, y.load(dst), value, y.dtype.is_bool))


@register("ScatterElements", since=11)
class ScatterElements(Scatter):
    """out = data; out[i with its axis coordinate replaced by indices[i]] (op)= updates[i]."""

    def check(self):
        self.check_common()
        x, idx, upd = self.input(0), self.input(1), self.input(2)
        self.ax = self.axis(self.attr("axis", 0), x.rank, batched=x.batched)
        self.expect(tuple(idx.shape) == tuple(upd.shape), f"indices {list(idx.shape)} and updates {list(upd.shape)} differ")
        self.expect(idx.rank == x.rank, f"indices '{idx.name}' has rank {idx.rank}, data '{x.name}' {x.rank}")
        for d in range(x.rank):
            self.expect(d == self.ax or idx.shape[d] <= x.shape[d],
                        f"indices {list(idx.shape)} is larger than data {list(x.shape)} on axis {d}")
        check_constant_indices(self, idx, x.shape[self.ax])

    def forward(self, ctx):
        x, idx, upd, y = self.input(0), self.input(1), self.input(2), self.output()
        emit_map(ctx, y, [x], lambda v: v, broadcast=False)
        if idx.numel == 0:
            return
        loops, coords, i, g, body = element_nest(ctx, idx, x.shape[self.ax], index_flag(ctx, self, 1, x.shape[self.ax]))
        dst = ctx.fresh("d")
        body.append(f"{dst} = {ix.ravel([g if d == self.ax else c for d, c in enumerate(coords)], y.strides)}")
        body.append(self.update(dst, upd.load(i)))
        ctx.render("nest.py.j2", loops=loops, body=body)


@register("Scatter", since=9)
class ScatterLegacy(ScatterElements):
    """Scatter-9/10: ScatterElements without reduction (deprecated in opset 11)."""


@register("ScatterND", since=11)
class ScatterND(Scatter):
    """out = data; for each index tuple j (the last axis of indices), the slice of out it names
    (op)= updates[j]."""

    def check(self):
        self.check_common()
        x, idx, upd = self.input(0), self.input(1), self.input(2)
        self.expect(idx.rank >= 1, f"indices '{idx.name}' must have rank >= 1")
        self.m = idx.shape[-1]
        self.expect(self.m <= x.rank, f"index tuples of {self.m} values reach past the rank {x.rank} of '{x.name}'")
        want = tuple(idx.shape[:-1]) + tuple(x.shape[self.m:])
        self.expect(tuple(upd.shape) == want, f"updates '{upd.name}' has shape {list(upd.shape)}, expected {list(want)}")
        if x.batched and self.m > 0:
            self.axis(0, x.rank, batched=True, what="indexed axis")
        check_constant_indices(self, idx, list(x.shape[: self.m]))

    def forward(self, ctx):
        x, idx, upd, y = self.input(0), self.input(1), self.input(2), self.output()
        emit_map(ctx, y, [x], lambda v: v, broadcast=False)
        count = int(np.prod(idx.shape[:-1], dtype=np.int64))
        inner = int(np.prod(x.shape[self.m:], dtype=np.int64))
        if count == 0 or inner == 0:
            return
        j, r = ctx.fresh("j") if count > 1 else "0", ctx.fresh("r") if inner > 1 else "0"
        terms, body = [], []
        for k in range(self.m):
            g = ctx.fresh("g")
            body += index_lines(g, idx.load(ix.add(ix.mul(j, self.m), str(k))), x.shape[k], index_flag(ctx, self, 1, x.shape[k]))
            terms.append(ix.mul(g, x.strides[k]))
        base = ctx.fresh("base")
        body.append(f"{base} = {ix.add(*terms) if terms else '0'}")
        line = self.update(ix.add(base, r), upd.load(ix.add(ix.mul(j, inner), r)))
        body += [f"for {r} in range({inner}):", "    " + line] if inner > 1 else [line]
        ctx.render("nest.py.j2", loops=[(j, count)] if count > 1 else [], body=body)


@register("TensorScatter", since=24)
class TensorScatter(Operator):
    """present = past, with update written along `axis` (the sequence axis) from write_indices[b]
    for each batch entry b (0 when absent); mode circular wraps the position, linear clamps it
    into the cache (a kernel cannot raise)."""

    inplace = (0,)

    def check(self):
        past, upd, y = self.input(0), self.input(1), self.output()
        self.ax = self.axis(self.attr("axis", -2), past.rank, batched=past.batched, what="axis")
        self.expect(self.ax > 0, "axis 0 is the batch axis of the cache, not a sequence axis")
        self.expect(upd.dtype == past.dtype, f"update '{upd.name}' has type {upd.dtype.name.lower()}, cache {past.dtype.name.lower()}")
        self.expect(upd.rank == past.rank and all(u == p for d, (u, p) in enumerate(zip(upd.shape, past.shape)) if d != self.ax),
                    f"update '{upd.name}' {list(upd.shape)} must match the cache {list(past.shape)} outside axis {self.ax}")
        self.expect(upd.shape[self.ax] <= past.shape[self.ax],
                    f"update '{upd.name}' holds {upd.shape[self.ax]} positions, the cache {past.shape[self.ax]}")
        self.mode = self.attr("mode", "linear")
        self.expect(self.mode in ("linear", "circular"), f"mode {self.mode!r} is not linear or circular")
        self.expect(tuple(y.shape) == tuple(past.shape), f"output shape {list(y.shape)} is not the cache's {list(past.shape)}")
        if self.has_input(2):
            w = self.input(2)
            self.expect_dtype(w, ("int",), "input 2 (write_indices)")
            self.expect(w.numel == past.shape[0], f"write_indices has {w.numel} values for {past.shape[0]} batch entries")
            if past.batched and not w.batched:
                raise self.mixing(f"write_indices '{w.name}' is shared by every sample but indexed by the batch axis")

    def forward(self, ctx):
        past, upd, y = self.input(0), self.input(1), self.output()
        emit_map(ctx, y, [past], lambda v: v, broadcast=False)
        if upd.numel == 0:
            return
        loops = [(ctx.fresh("o"), n) for n in upd.shape]
        coords = [v if n > 1 else "0" for v, n in loops]
        cap, p = past.shape[self.ax], ctx.fresh("p")
        start = self.input(2).load(coords[0]) if self.has_input(2) else "0"
        pos = f"{start} + {coords[self.ax]}"
        body = [f"{p} = ((({pos}) % {cap}) + {cap}) % {cap}" if self.mode == "circular" else f"{p} = clamp({pos}, 0, {cap - 1})"]
        dst = ix.ravel([p if d == self.ax else c for d, c in enumerate(coords)], y.strides)
        body.append(y.store(dst, upd.load(ix.ravel(coords, upd.strides))))
        ctx.render("nest.py.j2", loops=[(v, n) for v, n in loops if n > 1], body=body)
