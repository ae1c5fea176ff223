"""Einsum (any equation: repeated labels, ellipses with broadcasting, implicit outputs) and Det.

An output element of Einsum is its contraction: a loop per summed label accumulating the product
of the operands' elements (shaders/accumulate.py.j2); forward() nests that under a loop per output
label, a stage runs one thread per output element. Float and half accumulate in float, integers
in int. Det is one elimination per output element too."""
from __future__ import annotations

import numpy as np

from luisaml import indexing as ix
from luisaml.operator import Operator
from luisaml.registry import register
from luisaml.storage import literal

from .common import compute_dtype, convert, upcast

ELLIPSIS = "..."


def parse_equation(equation: str, ranks: list[int]) -> tuple[list[list[str]], list[str]]:
    """Return (the labels of each operand's axes, the output's labels) of an einsum equation; an
    ellipsis becomes labels '@0', '@1', ... aligned to the right across operands. Raises
    ValueError for a malformed equation."""
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        raise ValueError(f"equation {equation!r} has {len(terms)} operands, the node {len(ranks)} inputs")
    width = 0  # the most axes an ellipsis stands for
    for term, rank in zip(terms, ranks):
        letters = len(term.replace(ELLIPSIS, ""))
        if ELLIPSIS in term:
            width = max(width, rank - letters)
        elif letters != rank:
            raise ValueError(f"term {term!r} names {letters} axes of an operand of rank {rank}")
    ell = [f"@{k}" for k in range(width)]
    operands = []
    for term, rank in zip(terms, ranks):
        if not all(c.isalpha() for c in term.replace(ELLIPSIS, "")):
            raise ValueError(f"term {term!r} has a character that is not a letter")
        head, _, tail = term.partition(ELLIPSIS)
        middle = ell[width - (rank - len(head) - len(tail)):] if ELLIPSIS in term else []
        operands.append(list(head) + middle + list(tail))
    if arrow:
        head, _, tail = rhs.partition(ELLIPSIS)
        out = list(head) + (ell if ELLIPSIS in rhs else []) + list(tail)
    else:  # implicit: the ellipsis, then the letters that appear once, in alphabetical order
        counts: dict[str, int] = {}
        for labels in operands:
            for c in labels:
                counts[c] = counts.get(c, 0) + 1
        out = ell + sorted(c for c, n in counts.items() if n == 1 and not c.startswith("@"))
    if len(set(out)) != len(out):
        raise ValueError(f"the output of {equation!r} names a label twice")
    known = {c for labels in operands for c in labels}
    missing = [c for c in out if c not in known]
    if missing:
        raise ValueError(f"output labels {missing} of {equation!r} appear in no operand")
    return operands, out


@register("Einsum", since=12)
class Einsum(Operator):
    """Einsum: sum over the labels the output leaves out of the product of the operands."""

    @classmethod
    def infer(cls, node, inputs):
        """Return the output's type and shape (onnx's inference gives up on broadcast ellipses)."""
        ins = [t for t in inputs if t is not None]
        if not ins or any(t.shape is None for t in ins):
            return None
        try:
            labels, out = parse_equation(node.attrs.get("equation", ""), [len(t.shape) for t in ins])
        except ValueError:
            return None
        sizes: dict[str, object] = {}
        for t, ls in zip(ins, labels):
            for c, n in zip(ls, t.shape):
                sizes[c] = n if sizes.get(c) in (None, 1) else sizes[c]
        return [(ins[0].elem_type, tuple(sizes[c] for c in out))]

    def check(self):
        ins = [t for t in self.inputs if t is not None]
        y = self.output()
        self.expect(len(ins) > 0, "Einsum needs at least one input")
        for k, t in enumerate(ins):
            self.expect_dtype(t, ("float", "int"), f"input {k}")
            self.expect(t.dtype == ins[0].dtype, f"input {k} '{t.name}' has type {t.dtype.name.lower()}, "
                                                 f"input 0 {ins[0].dtype.name.lower()}")
        try:
            self.labels, self.out = parse_equation(self.attr("equation"), [t.rank for t in ins])
        except ValueError as e:
            raise self.error(str(e)) from None
        sizes: dict[str, int] = {}
        for k, (t, labels) in enumerate(zip(ins, self.labels)):
            for c, n in zip(labels, t.shape):
                # ellipsis axes broadcast (numpy rules); a letter has one length everywhere
                if c in sizes and n != sizes[c] and not (c.startswith("@") and 1 in (n, sizes[c])):
                    raise self.error(f"label {c!r} is {sizes[c]} long elsewhere but {n} in input {k} '{t.name}' {list(t.shape)}")
                sizes[c] = max(sizes.get(c, n), n)
        self.sizes = sizes
        want = [sizes[c] for c in self.out]
        self.expect(y.numel == int(np.prod(want, dtype=np.int64)), f"output '{y.name}' {list(y.shape)} is not {want}")
        for k, (t, labels) in enumerate(zip(ins, self.labels)):
            if t.batched and (not self.out or labels[0] != self.out[0]):
                raise self.mixing(f"input {k} '{t.name}': its batch axis (label {labels[0]!r}) is not the output's first "
                                  "axis: the contraction mixes samples")
        self.summed = [c for c in dict.fromkeys(c for labels in self.labels for c in labels) if c not in self.out]

    def contraction(self, ctx, out: list[str]) -> tuple[list[tuple[str, int]], list[str], list[str], str]:
        """Return (summed loops, head, body, result) of the output element at coordinates `out`
        (one per output label): accumulate.py.j2's pieces."""
        ins = [t for t in self.inputs if t is not None]
        y = self.output()
        var = dict(zip(self.out, out))
        var.update({c: ctx.fresh("e") if self.sizes[c] > 1 else "0" for c in self.summed})
        acc_dt = compute_dtype(ins[0].dtype)
        acc = ctx.fresh("acc")
        factors = []
        for t, labels in zip(ins, self.labels):
            # a broadcast (size-1) ellipsis axis reads its only element
            coords = [var[c] if n > 1 else "0" for c, n in zip(labels, t.shape)]
            factors.append(upcast(t.load(ix.ravel(coords, t.strides)), t.dtype))
        inner = [(var[c], self.sizes[c]) for c in self.summed if self.sizes[c] > 1]
        return (inner, [f"{acc} = {literal(0, acc_dt)}"], [f"{acc} = {acc} + {' * '.join(factors)}"],
                convert(acc, acc_dt, y.dtype))

    def forward(self, ctx):
        y = self.output()
        if y.numel == 0:
            return
        out = [ctx.fresh("e") if self.sizes[c] > 1 else "0" for c in self.out]
        inner, head, body, result = self.contraction(ctx, out)
        outer = [(v, self.sizes[c]) for v, c in zip(out, self.out) if self.sizes[c] > 1]
        out_strides = [int(np.prod([self.sizes[c] for c in self.out[k + 1:]], dtype=np.int64)) for k in range(len(self.out))]
        ctx.render("accumulate.py.j2", outer=outer, inner=inner, head=head, body=body,
                   tail=[y.store(ix.ravel(out, out_strides), result)])

    def element(self, ctx, i, k=0):
        i = ctx.let(i, "i")
        out = [ctx.let(c, "c") for c in ix.unravel(i, tuple(self.sizes[c] for c in self.out))]
        inner, head, body, result = self.contraction(ctx, out)
        ctx.render("accumulate.py.j2", outer=[], inner=inner, head=head, body=body, tail=[])
        return result


@register("Det", since=11)
class Det(Operator):
    """Determinants of the square matrices in the last two axes: Gaussian elimination with partial
    pivoting on a float copy of each matrix (half through float)."""

    def check(self):
        x, y = self.input(0), self.output()
        self.expect_dtype(x, ("float",), "input 0 (X)")
        self.expect(x.rank >= 2 and x.shape[-1] == x.shape[-2], f"input '{x.name}' {list(x.shape)} is not [*, M, M]")
        self.expect(y.numel == x.numel // max(x.shape[-1] ** 2, 1), f"output '{y.name}' {list(y.shape)} is not {list(x.shape[:-2])}")
        if x.batched and x.rank == 2:
            raise self.mixing(f"the rows of '{x.name}' are the batch axis: the determinant mixes samples")

    def determinant(self, ctx, b: str) -> str:
        """Emit the elimination of matrix b and return the variable holding its determinant."""
        x = self.input(0)
        m = x.shape[-1]
        if m == 0:
            return "1.0"
        a = ctx.local_array("float", m * m, "mat")
        with ctx.loop(m * m, "e") as e:
            ctx.line(f"{a}[{e}] = {upcast(x.load(ix.add(ix.mul(b, m * m), e)), x.dtype)}")
        det, k, i, j, p, pv, piv, f, tmp = (ctx.fresh(n) for n in ("det", "k", "i", "j", "p", "pv", "piv", "f", "tmp"))
        ctx.lines(f"""
{det} = 1.0
for {k} in range({m}):
    {p} = {k}
    {pv} = abs({a}[{k} * {m} + {k}])
    for {i} in range({k} + 1, {m}):
        if abs({a}[{i} * {m} + {k}]) > {pv}:
            {pv} = abs({a}[{i} * {m} + {k}])
            {p} = {i}
    if {p} != {k}:
        {det} = -{det}
        for {j} in range({m}):
            {tmp} = {a}[{k} * {m} + {j}]
            {a}[{k} * {m} + {j}] = {a}[{p} * {m} + {j}]
            {a}[{p} * {m} + {j}] = {tmp}
    {piv} = {a}[{k} * {m} + {k}]
    {det} = {det} * {piv}
    if {piv} != 0.0:
        for {i} in range({k} + 1, {m}):
            {f} = {a}[{i} * {m} + {k}] / {piv}
            for {j} in range({k} + 1, {m}):
                {a}[{i} * {m} + {j}] = {a}[{i} * {m} + {j}] - {f} * {a}[{k} * {m} + {j}]""")
        return det

    def forward(self, ctx):
        y = self.output()
        if y.numel == 0:
            return
        with ctx.loop(y.numel, "b") as b:
            ctx.line(y.store(b, self.element(ctx, b)))

    def element(self, ctx, i, k=0):
        x, y = self.input(0), self.output()
        return convert(self.determinant(ctx, i), compute_dtype(x.dtype), y.dtype)
