"""Control flow: If and Loop run their subgraphs inside the kernel."""
from __future__ import annotations

import numpy as np

from luisaml.operator import Operator
from luisaml.registry import register
from luisaml.storage import Tensor, Value


def _copy(ctx, dst: Tensor, src: Tensor, dst_offset: str = "0") -> None:
    """Emit dst[offset + i] = src[i] for every element of src."""
    from luisaml import indexing as ix

    with ctx.loop(src.numel) as i:
        ctx.store(dst, ix.add(dst_offset, i) if dst_offset != "0" else i, src.load(i))


@register("If", since=1)
class If(Operator):
    """Both branches are compiled; the condition picks one at run time."""

    def check(self):
        self.expect_dtype(self.input(0), ("bool",), "cond")
        for name in ("then_branch", "else_branch"):
            code = self.subgraphs.get(name)
            self.expect(code is not None, f"attribute '{name}' is required")
            self.expect(len(code.graph.outputs) == len(self.outputs),
                        f"{name} has {len(code.graph.outputs)} outputs, the node {len(self.outputs)}")
            for out, sub in zip(self.outputs, code.graph.outputs):
                t = code.tensors[sub]
                if out is not None and t.numel != out.numel:
                    raise self.error(
                        f"{name} output '{sub}' has shape {list(t.shape)} but the node's output '{out.name}' has "
                        f"{list(out.shape)}: both branches must give the same static shapes"
                    )

    def forward(self, ctx):
        from luisaml.compiler import emit_graph

        cond = ctx.fresh("cond")
        ctx.line(f"{cond} = {self.input(0).load('0')}")
        for keyword, name in ((f"if {cond}:", "then_branch"), ("else:", "else_branch")):
            ctx.line(keyword)
            with ctx.indent():
                ctx.line("pass")
                code = self.subgraphs[name]
                emit_graph(ctx, code, {})
                for out, sub in zip(self.outputs, code.graph.outputs):
                    if out is not None:
                        _copy(ctx, out, code.tensors[sub])


@register("Loop", since=1)
class Loop(Operator):
    """A counted and/or conditional loop. Scan outputs need a static trip count (their shape), and
    the loop stops after that many iterations."""

    def check(self):
        body = self.subgraphs.get("body")
        self.expect(body is not None, "attribute 'body' is required")
        n_carried = len(self.inputs) - 2
        self.expect(len(body.graph.inputs) == n_carried + 2,
                    f"body has {len(body.graph.inputs)} inputs, expected {n_carried + 2}")
        self.n_scan = len(body.graph.outputs) - 1 - n_carried
        self.cap = None
        for k in range(self.n_scan):
            out = self.outputs[n_carried + k]
            if out is not None:
                self.cap = out.shape[0] if self.cap is None else min(self.cap, out.shape[0])
        for k in range(n_carried):
            v_in, out = self.inputs[2 + k], self.outputs[k]
            if v_in is not None and out is not None and v_in.numel != out.numel:
                raise self.error(f"loop-carried value {k} changes shape ({list(v_in.shape)} -> {list(out.shape)})")

    def forward(self, ctx):
        from luisaml.compiler import emit_graph

        body = self.subgraphs["body"]
        n_carried = len(self.inputs) - 2
        it, keep = ctx.fresh("it"), ctx.fresh("keep")
        ctx.line(f"{it} = 0")
        ctx.line(f"{keep} = {self.input(1).load('0') if self.has_input(1) else 'True'}")
        bounds = []
        if self.has_input(0):
            bounds.append(f"({it} < {self.input(0).load('0')})")
        if self.cap is not None:
            bounds.append(f"({it} < {self.cap})")
        carried = [self.outputs[k] for k in range(n_carried)]
        for k, out in enumerate(carried):
            if out is not None:
                _copy(ctx, out, self.input(2 + k))
        ctx.line(f"while {' and '.join(bounds + [keep])}:")
        with ctx.indent():
            binds = {body.graph.inputs[0]: Value(it), body.graph.inputs[1]: Value(keep)}
            for k, out in enumerate(carried):
                binds[body.graph.inputs[2 + k]] = out
            emit_graph(ctx, body, {n: s.storage if isinstance(s, Tensor) else s for n, s in binds.items()})
            outs = body.graph.outputs
            for k in range(self.n_scan):
                dst = self.outputs[n_carried + k]
                if dst is not None:
                    src = body.tensors[outs[1 + n_carried + k]]
                    _copy(ctx, dst, src, f"{it} * {src.numel}")
            for k, out in enumerate(carried):  # after the whole body: v_out may read v_in
                if out is not None:
                    _copy(ctx, out, body.tensors[outs[1 + k]])
            ctx.line(f"{keep} = {body.tensors[outs[0]].load('0')}")
            ctx.line(f"{it} += 1")
