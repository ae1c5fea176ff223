"""Control flow: If, Loop and Scan run their subgraphs inside the kernel."""
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
        cond = ctx.fresh("cond")
        ctx.line(f"{cond} = {self.input(0).load('0')}")
        for keyword, name in ((f"if {cond}:", "then_branch"), ("else:", "else_branch")):
            ctx.line(keyword)
            with ctx.indent():
                ctx.line("pass")
                code = self.subgraphs[name]
                with ctx.emit_subgraph(code):
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
            with ctx.emit_subgraph(body, {n: s.storage if isinstance(s, Tensor) else s for n, s in binds.items()}):
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


def _strided_slice_index(shape: tuple[int, ...], axis: int, pos: str, j: str) -> str:
    """Return the flat index in a tensor of `shape` of element j of its slice at `pos` along axis
    (the slice is the tensor without that axis, row-major)."""
    from luisaml import indexing as ix

    inner = int(np.prod(shape[axis + 1:], dtype=np.int64))
    length = shape[axis]
    if axis == 0:
        return ix.add(ix.mul(pos, str(inner)), j)
    outer_j, inner_j = f"({j}) // {inner}", f"({j}) % {inner}"
    return ix.add(ix.add(ix.mul(outer_j, str(length * inner)), ix.mul(pos, str(inner))), inner_j)


@register("Scan", since=9)
class Scan(Operator):
    """N carried state values and M scan inputs; the body runs once per position along the scan
    inputs' axes (a static length), and its K scan outputs are stacked along their own axes.
    Directions reverse the order an input is read or an output written. Slices are copied into
    local arrays, so any axis works."""

    def check(self):
        body = self.subgraphs.get("body")
        self.expect(body is not None, "attribute 'body' is required")
        self.M = int(self.attr("num_scan_inputs"))
        self.N = len(self.inputs) - self.M
        g = body.graph
        self.expect(self.N >= 0 and self.M >= 1, f"num_scan_inputs={self.M} with {len(self.inputs)} inputs")
        self.expect(len(g.inputs) == self.N + self.M,
                    f"body has {len(g.inputs)} inputs, expected {self.N} states + {self.M} scan inputs")
        self.K = len(g.outputs) - self.N
        self.expect(self.K >= 0, f"body has {len(g.outputs)} outputs, fewer than the {self.N} states")
        in_axes = list(self.attr("scan_input_axes", [0] * self.M))
        self.in_dirs = list(self.attr("scan_input_directions", [0] * self.M))
        out_axes = list(self.attr("scan_output_axes", [0] * self.K))
        self.out_dirs = list(self.attr("scan_output_directions", [0] * self.K))
        self.in_axes, self.length = [], None
        for m in range(self.M):
            t = self.input(self.N + m)
            a = self.axis(in_axes[m], t.rank, t.batched, f"scan_input_axes[{m}]")
            self.in_axes.append(a)
            if self.length is None:
                self.length = t.shape[a]
            self.expect(t.shape[a] == self.length,
                        f"scan input {m} '{t.name}' has {t.shape[a]} positions along axis {a}, scan input 0 has "
                        f"{self.length}")
        self.out_axes = []
        for j in range(self.K):
            out = self.outputs[self.N + j] if self.N + j < len(self.outputs) else None
            if out is None:
                self.out_axes.append(None)
                continue
            b = self.axis(out_axes[j], out.rank, out.batched, f"scan_output_axes[{j}]")
            self.expect(out.shape[b] == self.length,
                        f"scan output {j} '{out.name}' has {out.shape[b]} positions along axis {b}, expected "
                        f"{self.length}")
            self.out_axes.append(b)
        for k in range(self.N):
            out = self.outputs[k] if k < len(self.outputs) else None
            if out is not None and out.numel != self.input(k).numel:
                raise self.error(f"state {k} changes shape ({list(self.input(k).shape)} -> {list(out.shape)})")

    def forward(self, ctx):
        from luisaml.storage import Local

        body, g, N = self.subgraphs["body"], self.subgraphs["body"].graph, self.N
        states = []
        for k in range(N):
            out = self.outputs[k] if k < len(self.outputs) else None
            if out is not None:
                states.append(out.storage)
            else:  # a state nobody reads afterwards still carries from one step to the next
                t = self.input(k)
                states.append(Local(ctx.local_array(t.dtype.dsl, t.numel, "state")))
        for k in range(N):
            src = self.input(k)
            with ctx.loop(src.numel) as i:
                ctx.line(states[k].store(i, src.load(i)))
        slices = []
        for m in range(self.M):
            t = self.input(N + m)
            n = t.numel // self.length
            slices.append((t, n, Local(ctx.local_array(t.dtype.dsl, n, "slice"))))
        it = ctx.fresh("it")
        ctx.line(f"for {it} in range({self.length}):")
        with ctx.indent():
            ctx.line("pass")
            for m, (t, n, dst) in enumerate(slices):
                pos = f"({self.length - 1} - {it})" if self.in_dirs[m] else it
                with ctx.loop(n) as j:
                    ctx.line(dst.store(j, t.load(_strided_slice_index(t.shape, self.in_axes[m], pos, j))))
            binds = {g.inputs[k]: states[k] for k in range(N)}
            binds.update({g.inputs[N + m]: slices[m][2] for m in range(self.M)})
            with ctx.emit_subgraph(body, binds):
                outs = g.outputs
                for j in range(self.K):
                    dst = self.outputs[N + j] if N + j < len(self.outputs) else None
                    if dst is None:
                        continue
                    src = body.tensors[outs[N + j]]
                    pos = f"({self.length - 1} - {it})" if self.out_dirs[j] else it
                    with ctx.loop(src.numel) as e:
                        ctx.store(dst, _strided_slice_index(dst.shape, self.out_axes[j], pos, e), src.load(e))
                # new states after the whole body (a body output may read, or be, another state)
                new = [body.tensors[outs[k]] for k in range(N)]
                staged = []
                for k in range(N):
                    if any(new[k].storage is states[q] for q in range(N) if q != k):
                        tmp = Local(ctx.local_array(new[k].dtype.dsl, new[k].numel, "next"))
                        with ctx.loop(new[k].numel) as e:
                            ctx.line(tmp.store(e, new[k].load(e)))
                        staged.append(tmp)
                    else:
                        staged.append(new[k].storage)
                for k in range(N):
                    if staged[k] is not states[k]:
                        with ctx.loop(self.input(k).numel) as e:
                            ctx.line(states[k].store(e, staged[k].load(e)))
