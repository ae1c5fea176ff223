"""NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss over [N, C, d1, ...] scores and [N, d1, ...]
integer targets: optional class weights, ignore_index, reductions none, sum and mean (the weighted
mean: divided by the sum of the weights the targets select). Softmax cross-entropy takes the log
softmax over C first (and can return it). Float and half accumulate in float.

A stage runs one thread per loss element (reduction none) or one thread for the reduction; a
SoftmaxCrossEntropyLoss that returns its log-probabilities too has two outputs, which a stage of
one thread per element cannot write, so it runs whole."""
from __future__ import annotations

import numpy as np

from luisaml import dtypes
from luisaml import indexing as ix
from luisaml.operator import Operator
from luisaml.registry import register

from .common import compute_dtype, convert, upcast

F = dtypes.FLOAT


@register("NegativeLogLikelihoodLoss", since=12)
class NegativeLogLikelihoodLoss(Operator):
    """loss[n, d] = -weight[t] * input[n, t, d] for t = target[n, d] (0 where t is ignore_index).
    A target outside [0, C) that is not ignore_index is clamped into it (a kernel cannot raise)."""

    log_softmax = False

    def check(self):
        x, t, y = self.input(0), self.input(1), self.output(0)
        self.expect_dtype(x, ("float",), "input 0 (scores)")
        self.expect_dtype(t, ("int",), "input 1 (target)")
        self.expect(x.rank >= 2, f"input '{x.name}' has rank {x.rank}, expected [N, C, ...]")
        self.n, self.c = x.shape[0], x.shape[1]
        self.d = int(np.prod(x.shape[2:], dtype=np.int64))
        want = (x.shape[0],) + tuple(x.shape[2:])
        self.expect(tuple(t.shape) == want, f"target '{t.name}' has shape {list(t.shape)}, expected {list(want)}")
        if self.has_input(2):
            w = self.input(2)
            self.expect(tuple(w.shape) == (self.c,), f"weight '{w.name}' has shape {list(w.shape)}, expected [{self.c}]")
            self.expect(w.dtype == x.dtype, f"weight '{w.name}' has type {w.dtype.name.lower()}, scores {x.dtype.name.lower()}")
        self.reduction = self.attr("reduction", "mean")
        self.expect(self.reduction in ("none", "sum", "mean"), f"reduction {self.reduction!r} is not none, sum or mean")
        self.ignore = self.attr("ignore_index", None)
        if self.reduction != "none" and x.batched:
            raise self.mixing(f"reduction {self.reduction!r} sums over N, the batch axis: it mixes samples")
        want_y = want if self.reduction == "none" else ()
        self.expect(y.numel == int(np.prod(want_y, dtype=np.int64)), f"output '{y.name}' {list(y.shape)} is not {list(want_y)}")

    def loss_lines(self, ctx, n: str, d: str, log_prob=None) -> tuple[list[str], str, str]:
        """Return (lines, loss variable, weight variable) of the loss at (n, d); with log_prob
        (SoftmaxCrossEntropyLoss's output 1) the lines also store its log-probabilities."""
        x, t = self.input(0), self.input(1)
        acc = compute_dtype(x.dtype)
        C, D = self.c, self.d
        at = ix.add(ix.mul(n, C * D), d)  # element (n, 0, d) of the scores; class c adds c * D

        def score(c: str) -> str:
            return upcast(x.load(ix.add(at, ix.mul(c, D))), x.dtype)

        body = []
        lp_off = "0.0"  # what turns a score into a log-probability
        if self.log_softmax:
            m, s, c = ctx.fresh("m"), ctx.fresh("s"), ctx.fresh("c")
            body += [f"{m} = {score('0')}", f"for {c} in range({C}):", f"    {m} = max({m}, {score(c)})",
                     f"{s} = 0.0", f"for {c} in range({C}):", f"    {s} = {s} + exp({score(c)} - {m})"]
            lp_off = ctx.fresh("off")
            body.append(f"{lp_off} = {m} + log({s})")
            if log_prob is not None:
                body += [f"for {c} in range({C}):",
                         f"    {log_prob.store(ix.add(at, ix.mul(c, D)), convert(f'{score(c)} - {lp_off}', acc, log_prob.dtype))}"]
        tgt, tc, w, loss = ctx.fresh("t"), ctx.fresh("tc"), ctx.fresh("w"), ctx.fresh("loss")
        body += [f"{tgt} = {t.load(ix.add(ix.mul(n, D), d))}", f"{tc} = clamp({tgt}, 0, {C - 1})"]
        weight = upcast(self.input(2).load(tc), self.input(2).dtype) if self.has_input(2) else "1.0"
        if self.ignore is not None:
            weight = f"(0.0 if {tgt} == {int(self.ignore)} else {weight})"
        return body + [f"{w} = {weight}", f"{loss} = -({score(tc)} - {lp_off}) * {w}"], loss, w

    def total(self, ctx, log_prob=None) -> str:
        """Emit the sum of the losses (and of their weights) over every (n, d); return the
        reduction's result."""
        tot, wsum = ctx.fresh("tot"), ctx.fresh("wsum")
        ctx.line(f"{tot} = 0.0")
        ctx.line(f"{wsum} = 0.0")
        loops = [(ctx.fresh("n"), self.n), (ctx.fresh("d"), self.d)]
        n, d = (v if k > 1 else "0" for v, k in loops)
        body, loss, w = self.loss_lines(ctx, n, d, log_prob)
        body += [f"{tot} = {tot} + {loss}", f"{wsum} = {wsum} + {w}"]
        ctx.render("nest.py.j2", loops=[(v, k) for v, k in loops if k > 1], body=body)
        return convert(f"{tot} / {wsum}" if self.reduction == "mean" else tot, F, self.output(0).dtype)

    def forward(self, ctx):
        y = self.output(0)
        log_prob = self.outputs[1] if len(self.outputs) > 1 else None
        if self.reduction != "none":
            ctx.line(y.store("0", self.total(ctx, log_prob)))
            return
        loops = [(ctx.fresh("n"), self.n), (ctx.fresh("d"), self.d)]
        n, d = (v if k > 1 else "0" for v, k in loops)
        body, loss, _ = self.loss_lines(ctx, n, d, log_prob)
        body.append(y.store(ix.add(ix.mul(n, self.d), d), convert(loss, F, y.dtype)))
        ctx.render("nest.py.j2", loops=[(v, k) for v, k in loops if k > 1], body=body)

    def element(self, ctx, i, k=0):
        """The loss at flat index i = n * D + d, or the reduction (one element); a stage runs this
        only when the node has one output (SoftmaxCrossEntropyLoss's log_prob keeps it whole)."""
        if self.reduction != "none":
            return self.total(ctx)
        i = ctx.let(i, "i")
        n = ctx.let(ix.div(i, self.d), "n")
        lines, loss, _ = self.loss_lines(ctx, n, ix.mod(i, self.d))
        ctx.lines("\n".join(lines))
        return convert(loss, F, self.output(0).dtype)


@register("SoftmaxCrossEntropyLoss", since=12)
class SoftmaxCrossEntropyLoss(NegativeLogLikelihoodLoss):
    """The negative log-likelihood of log_softmax(scores) over C; output 1 (optional) is that
    log-probability tensor."""

    log_softmax = True

    def check(self):
        super().check()
        if len(self.outputs) > 1 and self.outputs[1] is not None:
            lp = self.outputs[1]
            self.expect(tuple(lp.shape) == tuple(self.input(0).shape),
                        f"output 1 '{lp.name}' has shape {list(lp.shape)}, expected the scores' {list(self.input(0).shape)}")

