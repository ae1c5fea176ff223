"""One step of a recurrent cell for one thread's rows and units, shared by every stage form of
operators/rnn_stages.py (a phase a step, the CPU's loop) and operators/rnn_block.py (CUDA's block
loop): the gates' pre-activations from P and h_{t-1} . R^T, the cell's activations, clip, GRU's
reset (both linear_before_reset values: the second part's h~ from (r . h) R_h^T), LSTM's peepholes
and input_forget, the hold past a row's sequence length, and the stores of Y, Y_h and Y_c.

Where the state lives is the form's: a `State` says where h_{t-1}, c_{t-1} and GRU's z and r . h
are read and where h_t, c_t, z and r . h go (`BufferState`: the per-step form's buffers; the block
loop's shared memory and registers in operators/rnn_block.py)."""
from __future__ import annotations

from luisaml import dtypes
from luisaml import indexing as ix

from .common import convert, upcast

F32 = dtypes.FLOAT

# tanh(x) ~ x P(x^2) / Q(x^2) on [-9, 9], the rational form vectorised math libraries use (Eigen's fast
# float tanh): within 3.5e-7 of tanh, sigmoid(x) = (1 + tanh(x / 2)) / 2 within 2.3e-7 (checked in
# float32 against numpy's float64 over [-12, 12], 2M points)
TANH_RANGE = 9.0
TANH_P = (4.89352455891786e-03, 6.37261928875436e-04, 1.48572235717979e-05, 5.12229709037114e-08,
          -8.60467152213735e-11, 2.00018790482477e-13, -2.76076847742355e-16)
TANH_Q = (4.89352518554385e-03, 2.26843463243900e-03, 1.18534705686654e-04, 1.19825839466702e-06)

# the CPU's LSTM: a step's activations as a loop over the row's units after its gemv (Step.gate_loop)
GATE_LOOP = True


class State:
    """Where a step reads h_{t-1} and c_{t-1} and puts h_t and c_t (j: the thread's row index, i: its
    unit index, k: a unit expression, the gemv's); GRU without linear_before_reset also keeps z and
    r . h_{t-1} between its two parts. cond: None, or whether the row and unit exist."""

    def h(self, j: int, i: int) -> str:
        raise NotImplementedError

    def h_k(self, j: int, k: str) -> str:
        raise NotImplementedError

    def c(self, j: int, i: int) -> str:
        raise NotImplementedError

    def put_h(self, j: int, i: int, value: str, cond: str | None) -> None:
        raise NotImplementedError

    def put_c(self, j: int, i: int, value: str, cond: str | None) -> None:
        raise NotImplementedError

    def z(self, j: int, i: int) -> str:
        raise NotImplementedError

    def put_z(self, j: int, i: int, value: str, cond: str | None) -> None:
        raise NotImplementedError

    def rh_k(self, j: int, k: str) -> str:
        raise NotImplementedError

    def put_rh(self, j: int, i: int, value: str, cond: str | None) -> None:
        raise NotImplementedError


class BufferState(State):
    """The per-step form's state: h in the ping-pong buffer [2, D, B, H] (slot s % 2 read, the other
    written), c in [D, B, H], GRU's z and r . h in [2, D, B, H]."""

    def __init__(self, op, ctx, d: str, rows: list[str], units: list[str], s: str):
        self.op, self.ctx, self.d, self.rows, self.units = op, ctx, d, rows, units
        c = op.cell
        self.hs = op.outputs[3]
        self.cs = op.outputs[4] if c.cell == "lstm" else None
        self.zr = op.outputs[4] if op.split else None
        self.cur = ctx.let(ix.mod(s, 2), "cur")
        self.nxt = ctx.let(f"1 - {self.cur}", "nx")

    def h(self, j, i):
        return self.h_k(j, self.units[i])

    def h_k(self, j, k):
        return self.hs.load(self.op._hbuf(self.cur, self.d, self.rows[j], k))

    def c(self, j, i):
        return self.cs.load(self.op._dbh(self.d, self.rows[j], self.units[i]))

    def put_h(self, j, i, value, cond):
        self.ctx.line_if(cond, self.hs.store(self.op._hbuf(self.nxt, self.d, self.rows[j], self.units[i]), value))

    def put_c(self, j, i, value, cond):
        self.ctx.line_if(cond, self.cs.store(self.op._dbh(self.d, self.rows[j], self.units[i]), value))

    def z(self, j, i):
        return self.zr.load(self.op._hbuf("0", self.d, self.rows[j], self.units[i]))

    def put_z(self, j, i, value, cond):
        self.ctx.line_if(cond, self.zr.store(self.op._hbuf("0", self.d, self.rows[j], self.units[i]), value))

    def rh_k(self, j, k):
        return self.zr.load(self.op._hbuf("1", self.d, self.rows[j], k))

    def put_rh(self, j, i, value, cond):
        self.ctx.line_if(cond, self.zr.store(self.op._hbuf("1", self.d, self.rows[j], self.units[i]), value))


class Step:
    """Step s of a thread's rows (`rows`, `ok`: per row None or whether it exists) and units of
    direction d (op: a RecurrentSteps). units: DSL expressions, consecutive from the first
    (`consecutive`, the per-step tile: R read as float4s where prepacked) or any (the block loop's,
    a block's threads apart); unit_ok: per unit None or whether it exists. lens: per row its
    sequence length (None: loaded here)."""

    def __init__(self, op, ctx, d: str, rows: list[str], ok: list[str | None], s: str, units: list[str],
                 consecutive: bool = True, unit_ok: list[str | None] | None = None, lens: list[str] | None = None,
                 unroll: int = 1, prefetch: bool = False):
        self.op, self.ctx, self.d, self.rows, self.ok, self.s, self.units = op, ctx, d, rows, ok, s, units
        self.consecutive = consecutive
        # the scalar gemv's k's a loop iteration, R's loads of all of them first (the block loop's:
        # rnn_block.unroll); 1: a k an iteration
        self.unroll = unroll
        # gemv_unrolled's loads one iteration ahead (the block loop's BlockLoop.prefetch)
        self.prefetch = prefetch
        # False: a step known not to be the last (no Y_h / Y_c stores: clang's loop vectoriser does not
        # take gate_acts' loop with them)
        self.last = None
        self.unit_ok = unit_ok or [None] * len(units)
        c = op.cell
        S = c.S
        if any(fn.name == "softplus" for acts in c.acts for fn in acts):
            ctx.use_helper("softplus")
        seq = op._opt(3)
        # per row: its length, whether this step is inside it, the time it reads
        self.reverse = {"forward": "False", "reverse": "True"}.get(c.direction, f"{d} == 1")
        self.lens = lens if lens is not None else [ctx.let(f"min({seq.load(b)}, {S})", "n") if seq is not None else str(S)
                                                   for b in rows]
        self.valid = [ctx.let(f"{s} < {n}", "v") if seq is not None else None for n in self.lens]
        self.times = []
        for n in self.lens:
            # reverse: step s reads time n - 1 - s; past a row's length (s >= n) the step is discarded,
            # but its loads of P still run, so the time is held at 0: n - 1 - s would read up to S - 1
            # rows before P (a fault on the device once P is large: the zoo's bidirectional LSTM)
            back = f"max({n} - 1 - {s}, 0)" if seq is not None else f"{n} - 1 - {s}"
            self.times.append(s if self.reverse == "False" else
                              ctx.let(back if self.reverse == "True" else f"({back}) if {self.reverse} else {s}", "t"))

    # ---- loads ------------------------------------------------------------------------------------
    def pload(self, j: int, g: int, u: str) -> str:
        if getattr(self, "p_regs", None) is not None:  # the projection inside the step (`project`)
            return self.p_regs[g, j, self.units.index(u)]
        op, c = self.op, self.op.cell
        D, G, H = c.D, c.gates, c.H
        return op.input(0).load(ix.add(ix.mul(op._row(self.times[j], self.rows[j]), D * G * H), ix.mul(self.d, G * H),
                                       str(g * H), u))

    def rb(self, g: int, u: str) -> str:
        c, bias = self.op.cell, self.op._opt(2)
        return upcast(bias.load(ix.add(ix.mul(self.d, 2 * c.gates * c.H), str(c.gates * c.H + g * c.H), u)), bias.dtype)

    def clipped(self, v: str) -> str:
        c = self.op.cell
        if c.clip is None:
            return v
        from .rnn import _f

        clamp = self.ctx.use_helper("clamp_nan")
        return f"{clamp}({v}, {_f(-float(c.clip))}, {_f(float(c.clip))})"

    # ---- h_{t-1} . R^T --------------------------------------------------------------------------
    def gemv(self, gates: list[int], init, src) -> dict:
        """Return acc[g, j, i] = init(g, j, i) + sum over k of src(j, k) R[d, g * H + u_i, k] (scalar
        accumulators; with R prepacked and the units consecutive float4s of 4: `gemv4`)."""
        ctx, c = self.ctx, self.op.cell
        G, H = c.gates, c.H
        SB, UB = len(self.rows), len(self.units)
        packed = self.packed
        if self.vector:
            return self.gemv4(gates, init, src)
        acc = {}
        for g in gates:
            for j in range(SB):
                for i in range(UB):
                    acc[g, j, i] = ctx.fresh("acc")
                    ctx.line(f"{acc[g, j, i]} = {init(g, j, i)}")
        U = self.unroll if H % self.unroll == 0 else 1
        if U > 1:
            self.gemv_unrolled(gates, src, acc, U)
            return acc
        with ctx.loop(H, "k") as k:
            hv = [ctx.let(src(j, k), "hv") for j in range(SB)]
            vals = {}  # R[d, g * H + u_i, k], each loaded once
            if packed is not None:
                kb = ctx.let(ix.add(self.pbase, ix.mul(k, G * H * 4)), "rk")
                # (the per-step tile loads every gate's R: unused loads are dead code to the backends)
                for g in (range(G) if self.consecutive else gates):
                    if self.consecutive:
                        at = ctx.let(ix.add(kb, ix.mul(ix.add(str(g * H), self.units[0]), 4)), "ra")
                    for i in range(UB):
                        if not self.consecutive:
                            at = ctx.let(ix.add(kb, ix.mul(ix.add(str(g * H), self.units[i]), 4)), "ra")
                        vals[g, i] = ctx.let(f"weights.read(float, {ix.add(at, str(4 * i))})" if i and self.consecutive
                                             else f"weights.read(float, {at})", "rw")
            else:
                r = self.op.input(1)
                for g in range(G):
                    for i in range(UB):
                        at = ix.add(ix.mul(ix.add(ix.mul(self.d, G * H), str(g * H), self.units[i]), H), k)
                        vals[g, i] = ctx.let(upcast(r.load(at), r.dtype), "rw")
            for g in gates:
                for j in range(SB):
                    for i in range(UB):
                        ctx.line(f"{acc[g, j, i]} = fma({hv[j]}, {vals[g, i]}, {acc[g, j, i]})")
        return acc

    def r_loads(self, gates: list[int], k: str) -> dict:
        """Emit the loads of R[d, g * H + u_i, k] for the gates and this thread's units (any units: the
        block loop's); return them by (g, i)."""
        ctx, c = self.ctx, self.op.cell
        G, H = c.gates, c.H
        vals = {}
        if self.packed is not None:
            kb = ctx.let(ix.add(self.pbase, ix.mul(k, G * H * 4)), "rk")
            for g in gates:
                for i in range(len(self.units)):
                    at = ix.add(kb, ix.mul(ix.add(str(g * H), self.units[i]), 4))
                    vals[g, i] = ctx.let(f"weights.read(float, {at})", "rw")
            return vals
        r = self.op.input(1)
        for g in gates:
            for i in range(len(self.units)):
                at = ix.add(ix.mul(ix.add(ix.mul(self.d, G * H), str(g * H), self.units[i]), H), k)
                vals[g, i] = ctx.let(upcast(r.load(at), r.dtype), "rw")
        return vals

    def gemv_unrolled(self, gates: list[int], src, acc: dict, U: int, K: int | None = None, loads=None) -> None:
        """gemv's k loop, U k's an iteration: the loads of R for all U first, then each k's multiply-adds
        in k order (each accumulator sums in the same order as a k an iteration: the same bits). A k an
        iteration waited one L2 round trip per k (~300 clocks: the zoo's steps on the H100/H200,
        benchmarks/NOTES.md); U k's put U times the loads in flight before the first wait. K, loads:
        another matrix's k's and loads (`project`'s W; default H and R).

        The loads written first do not stay first: NVVM sinks each to its multiply-adds and ptxas keeps
        ~6 in flight a warp (benchmarks/experiments/rnn_sass.py), so on the H100 the unrolled loop ran as
        slowly as a k an iteration. With self.prefetch the loads are an iteration ahead: the loop runs
        n + 1 times; iteration kq loads k's kq U .. kq U + U - 1 into named registers (rn, carried round
        the loop; the last iteration reloads the last k's: no read past the matrix) and, from the second
        on, multiplies the previous iteration's (rc, copies taken at its top). Nothing in an iteration
        uses what it loads, so neither compiler can sink a load to its use: all G x units x U are issued
        together and in flight across the multiply-adds. The registers start at 0.0, not with loads
        before the loop: where every value entering a loop-carried register is a load, LLVM's InstCombine
        folds them into one load at the loop's top (a phi of loads into a load of a phi), which ptxas
        interleaves again. The same sums in the same order: the same bits."""
        ctx = self.ctx
        K, loads = K or self.op.cell.H, loads or self.r_loads
        SB, UB = len(self.rows), len(self.units)
        n = K // U
        if not self.prefetch:
            with ctx.loop(n, "kq") as kq:
                ks = [ctx.let(ix.add(ix.mul(kq, U), str(e)), "k") for e in range(U)]
                self._fmas(gates, src, acc, ks, [loads(gates, k) for k in ks])
            return
        ahead = {}
        for e in range(U):
            for g in gates:
                for i in range(UB):
                    ahead[e, (g, i)] = ctx.fresh("rn")
                    ctx.line(f"{ahead[e, (g, i)]} = 0.0")
        with ctx.loop(n + 1, "kq") as kq:
            vals = [{} for _ in range(U)]
            for (e, key), r in ahead.items():  # (a copy: let returns a bare name as it is)
                vals[e][key] = ctx.fresh("rc")
                ctx.line(f"{vals[e][key]} = {r}")
            kn = ctx.let(ix.mul(f"min({kq}, {n - 1})", U), "kn")
            for e in range(U):
                for key, v in loads(gates, ix.add(kn, str(e))).items():
                    ctx.line(f"{ahead[e, key]} = {v}")
            ctx.line(f"if {kq} > 0:")
            with ctx.indent():
                kp = ctx.let(ix.mul(f"{kq} - 1", U), "kp")
                self._fmas(gates, src, acc, [ctx.let(ix.add(kp, str(e)), "k") for e in range(U)], vals)

    def _fmas(self, gates: list[int], src, acc: dict, ks: list[str], vals: list[dict]) -> None:
        """The multiply-adds of k's ks in k order (vals[e][g, i]: R's value of ks[e], gate g, unit i)."""
        ctx, SB, UB = self.ctx, len(self.rows), len(self.units)
        for e, k in enumerate(ks):
            hv = [ctx.let(src(j, k), "hv") for j in range(SB)]
            for g in gates:
                for j in range(SB):
                    for i in range(UB):
                        ctx.line(f"{acc[g, j, i]} = fma({hv[j]}, {vals[e][g, i]}, {acc[g, j, i]})")

    def gemv4(self, gates: list[int], init, src) -> dict:
        ctx, c = self.ctx, self.op.cell
        G, H = c.gates, c.H
        SB, UB = len(self.rows), len(self.units)
        acc = {}
        for g in gates:
            for j in range(SB):
                for q in range(UB // 4):
                    acc[g, j, q] = ctx.fresh("acc")
                    ctx.line(f"{acc[g, j, q]} = float4({', '.join(init(g, j, 4 * q + e) for e in range(4))})")
        with ctx.loop(H, "k") as k:
            hv = [ctx.let(f"float4({src(j, k)})", "hv") for j in range(SB)]
            kb = ctx.let(ix.add(self.pbase, ix.mul(k, G * H * 4)), "rk")
            for g in gates:
                for q in range(UB // 4):
                    rq = ctx.let(f"weights.read(float4, {ix.add(kb, ix.mul(ix.add(str(g * H + 4 * q), self.units[0]), 4))})", "rq")
                    for j in range(SB):
                        ctx.line(f"{acc[g, j, q]} = fma({hv[j]}, {rq}, {acc[g, j, q]})")
        lanes = {(g, j, i): f"{acc[g, j, i // 4]}.{'xyzw'[i % 4]}" for g in gates for j in range(SB) for i in range(UB)}
        return {**lanes, **{("float4", g, j, q): v for (g, j, q), v in acc.items()}}

    def project(self, U: int) -> None:
        """The block loop's input projection inside the step (rnn_block.BlockLoop.fused; op's input 0 is
        X in P's row order, input 8 W): P of this thread's rows, every gate and unit, x_t W^T + Wb + Rb
        (GRU's hidden gate with linear_before_reset without Rb, as RecurrentProjection's), into registers
        that pload reads; its k loop U k's an iteration, W prepacked as R is (op.packed_w)."""
        ctx, op, c = self.ctx, self.op, self.op.cell
        G, H, I = c.gates, c.H, c.I
        x, w, bias = op.input(0), op.input(8), op._opt(2)
        packed = op.packed_w()
        wbase = ctx.let(ix.add(str(packed), ix.mul(ix.mul(self.d, I * G * H), 4)), "wp") if packed is not None else None
        lbr = c.cell == "gru" and c.linear_before_reset

        def w_loads(gates, k):
            vals = {}
            kb = ctx.let(ix.add(wbase, ix.mul(k, G * H * 4)), "wk") if wbase is not None else None
            for g in gates:
                for i, u in enumerate(self.units):
                    if kb is not None:
                        vals[g, i] = ctx.let(f"weights.read(float, {ix.add(kb, ix.mul(ix.add(str(g * H), u), 4))})", "ww")
                    else:
                        vals[g, i] = ctx.let(upcast(w.load(ix.add(ix.mul(ix.add(ix.mul(self.d, G * H), str(g * H), u), I), k)),
                                                    w.dtype), "ww")
            return vals

        def x_k(j, k):
            return upcast(x.load(ix.add(ix.mul(op._row(self.times[j], self.rows[j]), I), k)), x.dtype)

        acc = {}
        for g in range(G):
            for j in range(len(self.rows)):
                for i in range(len(self.units)):
                    acc[g, j, i] = ctx.fresh("pacc")
                    ctx.line(f"{acc[g, j, i]} = 0.0")
        self.gemv_unrolled(list(range(G)), x_k, acc, U, I, w_loads)
        self.p_regs = {}
        for (g, j, i), a in acc.items():
            if bias is None:
                self.p_regs[g, j, i] = a
                continue
            at = ix.add(ix.mul(self.d, 2 * G * H), str(g * H), self.units[i])
            wb = upcast(bias.load(at), bias.dtype)
            rb = "" if lbr and g == 2 else f" + {upcast(bias.load(ix.add(at, str(G * H))), bias.dtype)}"
            self.p_regs[g, j, i] = ctx.let(f"{a} + {wb}{rb}", "p")

    # ---- activations ------------------------------------------------------------------------------
    def tanh4(self, x: str, k=lambda v: f"float4({v!r})") -> str:
        """tanh of a float4 as a rational function (TANH_P / TANH_Q, within 3.5e-7 of tanh; NaN kept):
        the backend's exp and tanh are a libm call a lane, 8 of the GRU step's 16 ms of CPU time.
        k: a constant's DSL (the scalar form's: a float literal, the same operations per lane)."""
        ctx = self.ctx
        xc = ctx.let(f"clamp({x}, {k(-TANH_RANGE)}, {k(TANH_RANGE)})", "tc")
        x2 = ctx.let(f"{xc} * {xc}", "t2")
        p = k(TANH_P[-1])
        for coef in TANH_P[-2::-1]:
            p = f"({p} * {x2} + {k(coef)})"
        q = k(TANH_Q[-1])
        for coef in TANH_Q[-2::-1]:
            q = f"({q} * {x2} + {k(coef)})"
        return f"select({ctx.let(f'{xc} * {p} / {q}', 'th')}, {x}, isnan({x}))"

    def act4(self, fn, k=lambda v: f"float4({v!r})"):
        """The float4 form of a sigmoid or tanh activation (k a scalar's: the rational form a lane)."""
        if fn.name == "tanh":
            return lambda x: self.tanh4(x, k)
        return lambda x: f"({k(0.5)} * {self.tanh4(self.ctx.let(f'{k(0.5)} * {x}', 'sx'), k)} + {k(0.5)})"

    def by_direction(self, emit) -> None:
        """emit(acts) under the direction's activations (a branch on d when they differ)."""
        c, ctx = self.op.cell, self.ctx
        acts = ([[self.act4(fn) for fn in a] for a in c.acts] if self.quads else
                [[self.act4(fn, repr) for fn in a] for a in c.acts] if getattr(self, "rational", False) else c.acts)
        if c.D == 1 or all(a.args == b.args for a, b in zip(c.acts[0], c.acts[1])):
            emit(acts[0])
            return
        ctx.line(f"if {self.d} == 0:")
        with ctx.indent():
            emit(acts[0])
        ctx.line("else:")
        with ctx.indent():
            emit(acts[1])

    def lanes(self, acc):
        """Yield (j, A, L, each) per row j and unit, or per row and float4 of units: A(g) gate g's
        pre-activation, L(f) the units' f(i) (i a unit index), each(v) [(unit index i, v's value at unit i)]."""
        SB, UB = len(self.rows), len(self.units)
        for j in range(SB):
            if not self.quads:
                for i in range(UB):
                    yield (j, (lambda g, j=j, i=i: acc[g, j, i]), (lambda f, i=i: f(i)), (lambda v, i=i: [(i, v)]))
                continue
            for q in range(UB // 4):
                yield (j, (lambda g, j=j, q=q: acc["float4", g, j, q]),
                       (lambda f, q=q: f"float4({', '.join(f(i) for i in range(4 * q, 4 * q + 4))})"),
                       (lambda v, q=q: [(4 * q + e, f"{v}.{'xyzw'[e]}") for e in range(4)]))

    # ---- stores -----------------------------------------------------------------------------------
    def finish(self, st: State, j: int, i: int, h_new: str, c_new: str | None) -> None:
        """Store unit i of row j: the state (held past the row's length), Y, and at the last step Y_h / Y_c."""
        ctx, op, c = self.ctx, self.op, self.op.cell
        b, u, s = self.rows[j], self.units[i], self.s
        valid = self.valid[j]
        y, yh, yc = op._out(0), op._out(1), op._out(2) if c.cell == "lstm" else None
        if valid is not None:
            h_new = ctx.let(f"{h_new} if {valid} else {st.h(j, i)}", "hn")
            if c_new is not None:
                c_new = ctx.let(f"{c_new} if {valid} else {st.c(j, i)}", "cn")
        cond = " and ".join(x for x in (self.ok[j], self.unit_ok[i]) if x) or None
        st.put_h(j, i, h_new, cond)
        if c_new is not None:
            st.put_c(j, i, c_new, cond)
        if y is not None:
            if valid is not None:
                ty = ctx.let(f"{self.times[j]} if {valid} else {s}", "ty")
                yv = ctx.let(f"{h_new} if {valid} else 0.0", "yv")
            else:
                ty, yv = self.times[j], h_new
            ctx.line_if(cond, y.store(op._y_index(ty, self.d, b, u), convert(yv, F32, y.dtype)))
        last = [(yh, h_new)] + ([(yc, c_new)] if yc is not None else [])
        for out, v in last:
            if out is not None and self.last is not False:
                conds = " and ".join(x for x in (cond, f"{s} == {c.S - 1}") if x)
                ctx.line_if(conds, out.store(op._state_index(self.d, b, u), convert(v, F32, out.dtype)))

    def store(self, st: State, j: int, each, h_new: str, c_new: str | None) -> None:
        for (i, h), (_, cn) in zip(each(h_new), each(c_new) if c_new is not None else [(None, None)] * len(self.units)):
            self.finish(st, j, i, h, cn)

    # ---- the cell ---------------------------------------------------------------------------------
    def weights(self) -> None:
        """Emit where direction d's prepacked R starts (once, before the first gemv) and decide the
        vector forms."""
        if hasattr(self, "packed"):
            return
        ctx, c = self.ctx, self.op.cell
        packed = self.packed = self.op.packed_r()
        self.pbase = None
        if packed is not None:
            self.pbase = ctx.let(ix.add(str(packed), ix.mul(ix.mul(self.d, c.H * c.gates * c.H), 4)), "rp")
        # R prepacked, 4 consecutive units a float4: the accumulators are float4s too (explicit vectors:
        # the CPU backend's clang did not vectorise the scalar tile)
        self.vector = packed is not None and self.consecutive and len(self.units) % 4 == 0 and packed % 16 == 0
        # the gates' activations on float4s of units where every activation is one the DSL applies to
        # a float4 as written (sigmoid, tanh) and nothing clips: a third of a CPU GRU step's time
        # went to its scalar activations and loads (64 rows x 128 units: 0.61 ms against 0.25 for
        # its multiply-adds)
        # LSTM on the CPU (4 gates): the float4 gemv in two passes of two gates (cell)
        self.gate_passes = self.vector and c.gates == 4 and not getattr(self.op, "gpu", True) and len(self.rows) > 2
        self.quads = self.vector and c.clip is None and all(fn.name in ("sigmoid", "tanh") for acts in c.acts for fn in acts)

    def cell(self, st: State, part: int | None = None) -> None:
        """Emit the step (part, GRU without linear_before_reset: 0 z and r . h_{t-1} into the state,
        1 the hidden gate and the stores; None for every other cell)."""
        ctx, op, c = self.ctx, self.op, self.op.cell
        H = c.H
        bias = op._opt(2)
        self.weights()
        units, clipped, pload = self.units, self.clipped, self.pload
        h_k = st.h_k

        if c.cell == "rnn":
            acc = self.gemv([0], lambda g, j, i: pload(j, 0, units[i]), h_k)

            def emit(acts):
                for j, A, L, each in self.lanes(acc):
                    self.store(st, j, each, ctx.let(acts[0](ctx.let(clipped(A(0)), "g")), "h"), None)
            self.by_direction(emit)
        elif c.cell == "lstm":
            self.lstm_acts(st, self.lstm_gemv(st))
        elif not op.split:  # GRU, linear_before_reset: h~ = g(P_h + r * (h R_h^T + Rb_h))
            acc = self.gemv([0, 1, 2], lambda g, j, i: (pload(j, g, units[i]) if g < 2 else
                                                       (self.rb(2, units[i]) if bias is not None else "0.0")), h_k)

            def emit(acts):
                for j, A, L, each in self.lanes(acc):
                    z = ctx.let(acts[0](ctx.let(clipped(A(0)), "g")), "z")
                    rr = ctx.let(acts[0](ctx.let(clipped(A(1)), "g")), "r")
                    hh = ctx.let(acts[1](ctx.let(clipped(f"{L(lambda i: pload(j, 2, units[i]))} + {rr} * {A(2)}"), "g")), "hh")
                    self.store(st, j, each, ctx.let(f"(1.0 - {z}) * {hh} + {z} * {L(lambda i: st.h(j, i))}", "h"), None)
            self.by_direction(emit)
        elif part == 0:  # GRU: z and r . h_{t-1} into the state
            acc = self.gemv([0, 1], lambda g, j, i: pload(j, g, units[i]), h_k)

            def emit0(acts):
                for j, A, L, each in self.lanes(acc):
                    z = ctx.let(acts[0](ctx.let(clipped(A(0)), "g")), "z")
                    rr = ctx.let(acts[0](ctx.let(clipped(A(1)), "g")), "r")
                    rh = ctx.let(f"{rr} * {L(lambda i: st.h(j, i))}", "rh")
                    for (i, zi), (_, ri) in zip(each(z), each(rh)):
                        cond = " and ".join(x for x in (self.ok[j], self.unit_ok[i]) if x) or None
                        st.put_z(j, i, zi, cond)
                        st.put_rh(j, i, ri, cond)
            self.by_direction(emit0)
        else:  # GRU, part 1: h~ = g(P_h + (r . h) R_h^T)
            acc = self.gemv([2], lambda g, j, i: pload(j, 2, units[i]), st.rh_k)

            def emit1(acts):
                for j, A, L, each in self.lanes(acc):
                    z = ctx.let(L(lambda i: st.z(j, i)), "z")
                    hh = ctx.let(acts[1](ctx.let(clipped(A(2)), "g")), "hh")
                    self.store(st, j, each, ctx.let(f"(1.0 - {z}) * {hh} + {z} * {L(lambda i: st.h(j, i))}", "h"), None)
            self.by_direction(emit1)

    def lstm_gemv(self, st: State) -> dict:
        init = lambda g, j, i: self.pload(j, g, self.units[i])  # noqa: E731
        if self.gate_passes:
            # the CPU's float4 tile in two k loops of two gates: 16 float4 accumulators (4 rows x 4
            # gates) are 32 registers in clang's 2-wide halves, spilled every k step; 8 fit (the
            # zoo LSTM's steps 6.2 -> 3.6 ms; each accumulator's order unchanged: bit-identical)
            return {**self.gemv([0, 1], init, st.h_k), **self.gemv([2, 3], init, st.h_k)}
        return self.gemv([0, 1, 2, 3], init, st.h_k)

    # ---- the CPU's LSTM: the activations as a loop over units (gate_loop) --------------------------
    def gate_loop(self) -> bool:
        """Whether this LSTM tile only stores its gates' pre-activations (put_gates) and a loop over each
        row's units applies the activations (gate_acts): the CPU's loop form, float4 gemv and
        activations; clang vectorises that loop 8 wide where the float4s' activations ran a lane at a time."""
        self.weights()
        return (GATE_LOOP and self.op.cell.cell == "lstm" and self.quads and not getattr(self.op, "gpu", True)
                and len(self.op.outputs) > 5)

    def gate_at(self, g: int, j: int, u: str) -> str:
        """Gate g's pre-activation of row j, unit u in the gates' buffer [D, B, H, 4]."""
        return ix.add(ix.mul(self.op._dbh(self.d, self.rows[j], u), 4), str(g))

    def put_gates(self, st: BufferState) -> None:
        acc = self.lstm_gemv(st)
        for g in range(4):
            for j in range(len(self.rows)):
                # a ragged last row group's repeated row stores the same values again
                for i, u in enumerate(self.units):
                    self.ctx.line(self.op.outputs[5].store(self.gate_at(g, j, u), acc[g, j, i]))

    def gate_acts(self, st: BufferState, last: bool) -> None:
        """This Step's one unit (a loop variable) and one row: its activations from put_gates' values,
        scalar (the float4 rational tanh's operations a lane, in the same order); last: whether this
        is the last step (else Y_h and Y_c are not stored)."""
        self.weights()
        self.last = last
        self.quads, self.rational = False, True
        gates = self.op.outputs[5]
        acc = {(g, 0, 0): self.ctx.let(gates.load(self.gate_at(g, 0, self.units[0])), "pa") for g in range(4)}
        self.lstm_acts(st, acc)

    def lstm_acts(self, st: State, acc: dict) -> None:
        ctx, op, c = self.ctx, self.op, self.op.cell
        H, units, clipped = c.H, self.units, self.clipped
        peep = op._opt(6)

        def emit(acts):
            for j, A, L, each in self.lanes(acc):
                c_prev = ctx.let(L(lambda i: st.c(j, i)), "cp")

                def peep_of(g, cv):
                    if peep is None:
                        return ""
                    return (f" + {L(lambda i: upcast(peep.load(ix.add(ix.mul(self.d, 3 * H), str(g * H), units[i])), peep.dtype))}"
                            f" * {cv}")
                gi = ctx.let(acts[0](ctx.let(clipped(A(0) + peep_of(0, c_prev)), "g")), "gi")
                if c.input_forget:
                    gf = ctx.let(f"1.0 - {gi}", "gf")
                else:
                    gf = ctx.let(acts[0](ctx.let(clipped(A(2) + peep_of(2, c_prev)), "g")), "gf")
                gc = ctx.let(acts[1](ctx.let(clipped(A(3)), "g")), "gc")
                c_new = ctx.let(f"{gf} * {c_prev} + {gi} * {gc}", "cn")
                go = ctx.let(acts[0](ctx.let(clipped(A(1) + peep_of(1, c_new)), "g")), "go")
                self.store(st, j, each, ctx.let(f"{go} * {acts[2](c_new)}", "h"), c_new)
        self.by_direction(emit)
