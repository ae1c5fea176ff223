"""Attention (opsets 23, 24 and 25): scaled dot-product attention over Q, K, V given 3-D
[batch, seq, heads * head_size] (with q_num_heads / kv_num_heads) or 4-D [batch, heads, seq,
head_size], with an additive or boolean mask (broadcast, its last dimension possibly shorter),
bottom-right causal masking, softcap, a past key/value cache and the present outputs, grouped
query heads, qk_matmul_output in its four modes, nonpad_kv_seqlen (24) and sliding windows (25).

Every query row is one online softmax (shaders/attention.py.j2): the scores are computed key by
key, in float for float and half, with the running maximum subtracted, and the value rows are
accumulated as they come, so nothing of size [q_seq, kv_seq] is held. Masked keys are skipped, and
a row whose keys are all masked is zero, as the specification says since onnx 1.23."""
from __future__ import annotations

import math

from luisaml import indexing as ix
from luisaml.dtypes import ONNX_TYPES
from luisaml.model import shape_str
from luisaml.operator import Operator
from luisaml.registry import register
from luisaml.storage import Tensor, literal, row_major_strides

from .common import compute_dtype, convert, emit_copy, upcast

# (element type numbers from dtypes, not onnx: a loaded .lml builds its plan without onnx)
_SOFTMAX_PRECISIONS = {ONNX_TYPES[t] for t in ("FLOAT", "FLOAT16", "DOUBLE", "BFLOAT16")}


def head_strides(shape: tuple[int, ...], heads: int) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]]:
    """Return ((batch, heads, seq, head_size), strides of those four) of a Q/K/V/Y-like tensor:
    4-D is [batch, heads, seq, head_size]; 3-D is [batch, seq, heads * head_size]."""
    if len(shape) == 4:
        return tuple(shape), row_major_strides(tuple(shape))
    b, s, hidden = shape
    d = hidden // heads
    return (b, heads, s, d), (s * hidden, d, hidden, 1)


def mask_strides(shape: tuple[int, ...], full: tuple[int, int, int, int]) -> tuple[int, ...] | None:
    """Return the strides (0 where broadcast) of a mask right-aligned against the four dims
    `full` (batch, q_heads, q_seq, total_seq), or None when it does not broadcast. The last
    dimension may be shorter than total_seq (it is padded with masked keys)."""
    if len(shape) > 4 or len(shape) == 0:
        return None
    padded = (1,) * (4 - len(shape)) + tuple(shape)
    strides = row_major_strides(padded)
    out = []
    for k, (n, f) in enumerate(zip(padded, full)):
        if k == 3:
            if n > f:
                return None
            out.append(strides[k] if n > 1 else 0)
        elif n == f:
            out.append(strides[k] if n > 1 else 0)
        elif n == 1:
            out.append(0)
        else:
            return None
    return tuple(out)


class Attention(Operator):
    """Opset 23 on; 24 adds nonpad_kv_seqlen (input 6), 25 left/right_window_size."""

    def opt_output(self, k: int) -> Tensor | None:
        return self.outputs[k] if k < len(self.outputs) else None

    def check(self) -> None:
        q, k, v = self.input(0), self.input(1), self.input(2)
        for t, role in ((q, "Q"), (k, "K"), (v, "V")):
            self.expect_dtype(t, ("float",), f"input {role}")
        self.expect(k.dtype == q.dtype, f"K '{k.name}' has type {k.dtype.name.lower()}, Q '{q.name}' {q.dtype.name.lower()}; they must match")
        self.expect(
            q.rank in (3, 4) and k.rank == q.rank and v.rank == q.rank,
            f"Q, K and V must all be 3-D or all 4-D, got {shape_str(q.shape)}, {shape_str(k.shape)}, {shape_str(v.shape)}",
        )
        if q.rank == 3:
            hq, hk = int(self.attr("q_num_heads", 0)), int(self.attr("kv_num_heads", 0))
            self.expect(hq > 0 and hk > 0, "3-D Q, K, V need the attributes q_num_heads and kv_num_heads")
            for t, h, role in ((q, hq, "Q"), (k, hk, "K"), (v, hk, "V")):
                self.expect(t.shape[2] % h == 0, f"{role} '{t.name}' {shape_str(t.shape)}: hidden size {t.shape[2]} is not a multiple of {h} heads")
        else:
            hq, hk = q.shape[1], k.shape[1]
            for name, want in (("q_num_heads", hq), ("kv_num_heads", hk)):
                got = self.attr(name, None)
                self.expect(got is None or int(got) == want, f"{name}={got} contradicts the 4-D inputs' {want} heads")
        (self.B, self.Hq, self.Sq, self.D), self.q_strides = head_strides(q.shape, hq)
        (bk, _, self.Skv, dk), self.k_strides = head_strides(k.shape, hk)
        (bv, hv, sv, self.Dv), self.v_strides = head_strides(v.shape, hk)
        self.Hk = hk
        batch_hint = self._batch_hint()
        self.expect(bk == self.B and bv == self.B, f"batch sizes differ: Q {shape_str(q.shape)}, K {shape_str(k.shape)}, V {shape_str(v.shape)}{batch_hint}")
        self.expect(v.rank == 3 or hv == hk, f"K '{k.name}' has {hk} heads, V '{v.name}' {hv}; they must match")
        self.expect(dk == self.D, f"Q head size {self.D} differs from K head size {dk} (Q {shape_str(q.shape)}, K {shape_str(k.shape)})")
        self.expect(sv == self.Skv, f"K '{k.name}' has {self.Skv} keys, V '{v.name}' {sv} values")
        self.expect(self.Hq % self.Hk == 0, f"q_num_heads {self.Hq} is not a multiple of kv_num_heads {self.Hk}")
        self._check_cache()
        self.T = self.P + self.Skv
        self._check_mask_and_lengths()
        self._check_attributes()
        self._check_outputs()

    def _batch_hint(self) -> str:
        """Return a note for batch-size mismatches under per-sample execution."""
        if any(t is not None and t.batched for t in self.inputs):
            return (" (per sample the batch dimension is 1, and an input without the batch dimension is "
                    "shared by every sample; compile with batch_axis=None to run the graph as one instance)")
        return ""

    def _check_cache(self) -> None:
        past = [self.has_input(4), self.has_input(5)]
        self.expect(past[0] == past[1], "past_key and past_value must be given together")
        self.P = 0
        if past[0]:
            pk, pv = self.input(4), self.input(5)
            self.expect(pk.rank == 4 and pv.rank == 4, f"past_key {shape_str(pk.shape)} and past_value {shape_str(pv.shape)} must be 4-D")
            self.P = pk.shape[2]
            want_k, want_v = (self.B, self.Hk, self.P, self.D), (self.B, self.Hk, self.P, self.Dv)
            self.expect(tuple(pk.shape) == want_k, f"past_key '{pk.name}' has shape {shape_str(pk.shape)}, expected {shape_str(want_k)}{self._batch_hint()}")
            self.expect(tuple(pv.shape) == want_v, f"past_value '{pv.name}' has shape {shape_str(pv.shape)}, expected {shape_str(want_v)}{self._batch_hint()}")
            self.expect(pk.dtype == self.input(1).dtype and pv.dtype == self.input(2).dtype, "past_key/past_value must have the types of K/V")

    def _check_mask_and_lengths(self) -> None:
        self.mask_st = None
        if self.has_input(3):
            m = self.input(3)
            self.expect(
                m.dtype.is_bool or m.dtype.is_float,
                f"attn_mask '{m.name}' has type {m.dtype.name.lower()}; a boolean or a float mask is supported",
            )
            full = (self.B, self.Hq, self.Sq, self.T)
            self.mask_st = mask_strides(m.shape, full)
            self.expect(
                self.mask_st is not None,
                f"attn_mask '{m.name}' of shape {shape_str(m.shape)} does not broadcast to (batch, q_heads, q_seq, "
                f"total_seq) = {shape_str(full)}{self._batch_hint()}",
            )
        self.nonpad = self.has_input(6)
        if self.nonpad:
            self.expect(self.opset >= 24, "nonpad_kv_seqlen (input 6) needs opset 24")
            n = self.input(6)
            self.expect_dtype(n, ("INT64", "INT32"), "nonpad_kv_seqlen")
            self.expect(tuple(n.shape) == (self.B,), f"nonpad_kv_seqlen '{n.name}' has shape {shape_str(n.shape)}, expected [{self.B}]{self._batch_hint()}")
            self.expect(self.P == 0, "nonpad_kv_seqlen cannot be combined with past_key/past_value")

    def _check_attributes(self) -> None:
        self.causal = bool(self.attr("is_causal", 0))
        self.mode = int(self.attr("qk_matmul_output_mode", 0))
        self.expect(self.mode in (0, 1, 2, 3), f"qk_matmul_output_mode {self.mode} is not one of 0, 1, 2, 3")
        self.softcap = float(self.attr("softcap", 0.0))
        self.expect(self.softcap >= 0, f"softcap {self.softcap} must not be negative")
        scale = self.attr("scale", None)
        self.scale = 1.0 / math.sqrt(self.D) if scale is None else float(scale)
        precision = self.attr("softmax_precision", None)
        # the softmax runs in float: the precision asked for when it is float, more than asked for
        # when it is half or bfloat16; double is held as float like everywhere in luisaml
        self.expect(
            precision is None or int(precision) in _SOFTMAX_PRECISIONS,
            f"softmax_precision {precision} is not a floating-point type (FLOAT, FLOAT16, DOUBLE or BFLOAT16)",
        )
        self.left = int(self.attr("left_window_size", -1))
        self.right = int(self.attr("right_window_size", -1))
        if self.opset < 25:
            self.expect(self.left == -1 and self.right == -1, "left/right_window_size need opset 25")
        self.expect(self.left >= -1 and self.right >= -1, f"window sizes must be -1 or non-negative, got {self.left}, {self.right}")

    def _check_outputs(self) -> None:
        q = self.input(0)
        y = self.output(0)
        want = (self.B, self.Sq, self.Hq * self.Dv) if q.rank == 3 else (self.B, self.Hq, self.Sq, self.Dv)
        self.expect_shape(y, want, "output Y")
        for k, d in ((1, self.D), (2, self.Dv)):
            t = self.opt_output(k)
            if t is not None:
                self.expect_shape(t, (self.B, self.Hk, self.T, d), f"output {('present_key', 'present_value')[k - 1]}")
        qk = self.opt_output(3)
        if qk is not None:
            self.expect_shape(qk, (self.B, self.Hq, self.Sq, self.T), "output qk_matmul_output")

    # ---- code ------------------------------------------------------------------------------
    def forward(self, ctx) -> None:
        q, k, v = self.input(0), self.input(1), self.input(2)
        y = self.output(0)
        self._emit_present(ctx)
        if y.numel == 0:
            return
        acc = compute_dtype(q.dtype)  # float for float and half
        b, h, i = (ctx.fresh(p) if n > 1 else "0" for p, n in (("b", self.B), ("h", self.Hq), ("i", self.Sq)))
        outer = [(var, n) for var, n in ((b, self.B), (h, self.Hq), (i, self.Sq)) if n > 1]
        rep = self.Hq // self.Hk
        pre = []
        hk = h
        if rep > 1 and h != "0":
            hk = ctx.fresh("hk")
            pre.append(f"{hk} = {h} // {rep}")

        def at(strides, *coords):
            return ix.add(*(ix.mul(c, s) for c, s in zip(coords, strides)))

        def loader(t: Tensor, strides, head):
            return lambda j, d: upcast(t.load(at(strides, b, head, j, d)), t.dtype)

        kp = loader(self.input(4), self.input(4).strides, hk) if self.P else None
        vp = loader(self.input(5), self.input(5).strides, hk) if self.P else None
        kn, vn = loader(k, self.k_strides, hk), loader(v, self.v_strides, hk)
        y_strides = head_strides(y.shape, self.Hq)[1]
        qk = self.opt_output(3)
        qk_strides = row_major_strides((self.B, self.Hq, self.Sq, self.T))

        # the causal / window frontier: key j is allowed up to i + offset (bottom-right alignment)
        offset, nonpad = (str(self.P) if self.P else None), None
        if self.nonpad:
            nonpad = ctx.fresh("nonpad")
            pre.append(f"{nonpad} = {self.input(6).load(b)}")
            offset = f"{nonpad} - {self.Sq}"
        allowed, bias = self._masks(b, h, i, offset, nonpad)

        ctx.render(
            "attention.py.j2",
            outer=outer,
            pre=pre,
            D=self.D,
            Dv=self.Dv,
            T=self.T,
            P=self.P,
            qrow_type=ctx.module.array_type(acc.dsl, self.D),
            acc_type=ctx.module.array_type(acc.dsl, self.Dv),
            q=lambda d: upcast(q.load(at(self.q_strides, b, h, i, d)), q.dtype),
            kp=kp, vp=vp, kn=kn, vn=vn,
            allowed=allowed,
            bias=bias,
            scale=literal(self.scale, acc),
            softcap=literal(self.softcap, acc) if self.softcap > 0 else None,
            qk_mode=self.mode,
            qk_store=(lambda j, val: qk.store(at(qk_strides, b, h, i, j), convert(val, acc, qk.dtype))) if qk is not None else None,
            y_store=lambda d, val: y.store(at(y_strides, b, h, i, d), convert(val, acc, y.dtype)),
        )

    def _masks(self, b: str, h: str, i: str, offset: str | None, nonpad: str | None):
        """Return (allowed(j), bias(j)): the DSL of the boolean conditions on key j (or None when
        every key is allowed) and of the float mask's value at j (or None)."""
        conds = []  # functions of j
        bias = None
        if self.has_input(3):
            m = self.input(3)
            tm = m.shape[-1]
            s = self.mask_st

            def index(j):
                jj = j if tm == self.T else f"min({j}, {tm - 1})"  # keys past the mask are masked below
                return ix.add(ix.mul(b, s[0]), ix.mul(h, s[1]), ix.mul(i, s[2]), ix.mul(jj, s[3]) if s[3] else "0")

            if tm < self.T:
                conds.append(lambda j: f"{j} < {tm}")
            if m.dtype.is_bool:
                conds.append(lambda j: m.load(index(j)))
            else:
                bias = lambda j: upcast(m.load(index(j)), m.dtype)
        frontier = f"{i} + {offset}" if offset else i
        if self.causal:
            conds.append(lambda j: f"{j} <= {frontier}")
        if self.left >= 0:
            conds.append(lambda j: f"{frontier} - {j} <= {self.left}")
        if self.right >= 0:
            conds.append(lambda j: f"{j} - ({frontier}) <= {self.right}")
        if nonpad is not None:
            conds.append(lambda j: f"{j} < {nonpad}")
        allowed = (lambda j: " and ".join(f"({c(j)})" for c in conds)) if conds else None
        return allowed, bias

    def _emit_present(self, ctx) -> None:
        """Copy past_key/past_value and K/V (as 4-D) into present_key/present_value."""
        for out_k, new_k, past_k, d, strides in ((1, 1, 4, self.D, self.k_strides), (2, 2, 5, self.Dv, self.v_strides)):
            out = self.opt_output(out_k)
            if out is None or out.numel == 0:
                continue
            dst = out.strides
            if self.P:
                past = self.input(past_k)
                emit_copy(ctx, (self.B, self.Hk, self.P, d), dst, 0, past.strides, 0, past.load, out.store)
            new = self.input(new_k)
            emit_copy(ctx, (self.B, self.Hk, self.Skv, d), dst, self.P * d, strides, 0, new.load, out.store)

    def describe(self) -> str:
        text = (f"online softmax, {self.Hq} q heads / {self.Hk} kv heads, q_seq={self.Sq} total_seq={self.T} "
                f"head={self.D}/{self.Dv}")
        return text + (", causal" if self.causal else "")

register("Attention", since=23)(Attention)
register("Attention", since=24)(type("Attention", (Attention,), {}))
register("Attention", since=25)(type("Attention", (Attention,), {}))
