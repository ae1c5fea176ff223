"""Recurrent stages: an RNN, GRU or LSTM node as two nodes, a GEMM and its steps, in place of one
thread walking the whole sequence (operators/rnn.py's form, which `forward` keeps).

1. `RecurrentProjection`: P = X W^T + biases for every step and direction at once, one matrix
   product over the rows of X ((step, batch row) pairs) on the ordinary Gemm form (operators/gemm.py's
   Dense: prepacked weights, a thread per register tile, on CUDA the cooperative tile of
   operators/tiled.py). The recurrent biases go in too, but for GRU's hidden gate with
   linear_before_reset, where r multiplies them.
2. `RecurrentSteps`: the recurrence, one items stage per step (a phase each: luisaml/dynamic.py's
   stages without a read-back), all steps of one body that reads its step from the stage index (the
   CPU's merged kernel and CUDA's shared kernel hold it once: emission._runs). A thread computes a tile
   of SB batch rows x UB hidden units of one direction: the gates' pre-activations start from P, take
   h_{t-1} . R^T (R prepacked as [direction][k][gate, unit], so a thread's UB units are consecutive
   words) and go through the cell's activations. h lives in a ping-pong buffer [2, D, B, H] (a step
   reads all units of h_{t-1} while others write h_t), c in [D, B, H] (only its own thread reads a
   unit's c); a first phase copies the initial states in. GRU without linear_before_reset takes two
   phases a step: z and r . h_{t-1} (every unit's, which the hidden gate sums over), then the rest.
   Steps past a row's sequence length keep its state and write zeros to Y, as onnxruntime does.
   The step itself (gates, cell, stores) is operators/rnn_step.py's, shared by every form; a form
   says where the state lives (its `State`).
   On the CPU backend the steps are one phase instead: a thread per (direction, row group) runs
   every step of its rows, whose states no other thread reads (no phase boundary needed), so the
   recurrence costs one dispatch instead of S (`RecurrentSteps.loop`). On CUDA, where it fits, the
   steps are one blocks phase: a block per (direction, row group) runs every step with h in shared
   memory and a barrier a step, the state on chip (operators/rnn_block.py, `RecurrentSteps.block`);
   where its estimate says so the projection runs inside that launch (`BlockLoop.fused`: no
   RecurrentProjection node; the steps' input 0 is X in P's row order, input 8 W).

Every attribute of operators/rnn.py is kept (directions, layouts, activations with alpha/beta, clip,
linear_before_reset, input_forget, peepholes, sequence_lens, initial states, all outputs). A node is
left in its whole form only when its sequence or hidden size is 0 (`qualifies`), which inspect says.
luisaml/rewrites/rnn.py puts them in the graph for the stages schedule."""
from __future__ import annotations

from functools import partial

from luisaml import codegen, dtypes
from luisaml import indexing as ix
from luisaml.dynamic import Phase
from luisaml.model import Node
from luisaml.operator import Operator
from luisaml.storage import Tensor

from . import rnn_block
from .common import upcast
from .gemm import Dense
from .rnn_block import BlockLoop
from .rnn_step import BufferState, Step

F32 = dtypes.FLOAT


def tile(gpu: bool, B: int, H: int) -> tuple[int, int]:
    """Return (SB batch rows, UB hidden units) of a work item's register tile. The CPU backend: up to
    4 rows x 4 units (a float4 accumulator a row and gate; each R load feeds 4 rows), which a
    micro-kernel of a GRU step (64 rows, 128 units) measured at 25 GFLOP/s of one core against 15-20
    for 1 x 8, 20 for 2 x 8, 17 for 4 x 8 and 8 x 4 (spilled); CUDA: 2 rows x 4 units (one float4 of R
    per gate and k serves both rows; a GRU of 1,024 rows and 128 units then has 16k threads a step)."""
    units = next(u for u in (4, 2, 1) if H % u == 0)
    rows = min(2 if gpu else 4, B)
    return rows, units


# the threads of a block of the CPU backend's kernels (codegen.CPU_BLOCK, which the merged kernel
# sets): one block runs on one worker thread, so a work item of the whole sequence gets a block of
# its own (the other threads of its block return at once) to spread the items over cores
CPU_BLOCK = codegen.CPU_BLOCK


def qualifies(op) -> str | None:
    """Return why a recurrent node keeps its whole form, or None when it runs as stages."""
    if op.S < 1 or op.H < 1 or op.B < 1:
        return "an empty sequence, batch or hidden state"
    return None


class RecurrentProjection(Dense):
    """P[row][d, g, u] = X[row] . W[d, g * H + u] + Wb + Rb (row: X's rows in its own order)."""

    nbatch = 1

    def __init__(self, node: Node, inputs, outputs, cell, swapped: bool = False):
        self.cell = cell
        self.swapped = swapped  # input 0 is X's source, its first two axes swapped (rows (b, t) for (t, b))
        x = cell.input(0)
        self.M, self.K = x.numel // cell.I, cell.I
        self.N = cell.D * cell.gates * cell.H
        super().__init__(node, inputs, outputs, cell.opset)

    def check(self) -> None:
        pass  # built from a checked recurrent node

    def forward(self, ctx) -> None:
        ctx.comment("recurrent projection: in `forward` the whole form computes it, in the steps node")

    def loaders(self):
        x, w = self.input(0), self.input(1)
        bias = self.input(2) if self.has_input(2) else None
        I, GH = self.K, self.cell.gates * self.cell.H
        H = self.cell.H
        lbr = self.cell.cell == "gru" and getattr(self.cell, "linear_before_reset", False)

        def load_a(_, m, k):
            return upcast(x.load(ix.add(ix.mul(m, I), k)), x.dtype)

        def load_b(_, k, n):
            return upcast(w.load(ix.add(ix.mul(n, I), k)), w.dtype)

        def finish(_, m, n, acc):
            if bias is None:
                return acc
            # Wb[d][row] at n + d * GH, Rb[d][row] GH further (d = n // GH)
            at = ix.add(n, ix.mul(ix.div(n, GH), GH))
            wb = upcast(bias.load(at), bias.dtype)
            rb = upcast(bias.load(ix.add(at, str(GH))), bias.dtype)
            if lbr:  # GRU's hidden gate adds Rb inside r * (h R^T + Rb): the steps add it
                rb = f"({rb} if {ix.mod(n, GH)} < {2 * H} else 0.0)"
            return f"{acc} + {wb} + {rb}"

        return load_a, load_b, finish, F32

    def b_matrix(self, value):
        return value.reshape(self.N, self.K).T[None]

    def describe(self) -> str:
        c = self.cell
        return (f"{c.cell.upper()} input projection: X W^T + biases for {c.S} steps x {c.B} rows and {c.D} direction(s) "
                f"at once ({self.M} x {self.K} by {self.K} x {self.N}), {super().describe()}")

    def describe_block(self) -> str:
        c = self.cell
        return f"{c.cell.upper()} input projection ({self.M} x {self.K} by {self.K} x {self.N}): {self.block_tiling().describe()}"


class RecurrentSteps(Operator):
    """The recurrence over a projection P: a phase per step (two for GRU without
    linear_before_reset), a first phase for the initial states; on the CPU one phase of them all, on
    CUDA one blocks phase of them all where `block` is given (operators/rnn_block.py). Inputs: P, R,
    B, sequence_lens, initial_h, initial_c, peepholes, X (kept live for `forward`'s whole form), and
    block.fused (the projection inside the steps): X's rows in P's place and W a ninth input;
    outputs: Y, Y_h, Y_c, then (not the block loop) the h ping-pong buffer, c, GRU's [z, r . h] buffer."""

    phased = True
    shared_kernel = "recurrent"

    def __init__(self, node: Node, inputs, outputs, cell, gpu: bool, blob, swapped: bool = False,
                 y_strides: tuple[int, int, int, int] | None = None, block: BlockLoop | None = None):
        """swapped: P's rows are X's source's (RecurrentProjection.swapped); y_strides: where output 0
        takes Y's (step, direction, batch row, unit), None: Y's own layout; block: CUDA's block loop
        (rnn_block.choose), which keeps its state on chip (no state outputs)."""
        self.cell, self.blob = cell, blob
        self.block = block
        self.swapped = swapped
        self.y_strides = y_strides
        self.SB, self.UB = tile(gpu, cell.B, cell.H)
        self.gpu = gpu
        # the CPU backend: all steps in one phase, a thread a row group (GRU 64 rows, 128 units, 32
        # steps on the busy 2-core host, CPU time of the recurrence: 35 phases of 1 x 8 tiles ~25 ms,
        # one phase of 4 x 4 tiles 19.5 ms, 8.3 ms with the float4 activations; benchmarks/NOTES.md). A lone
        # row of a wide cell runs on one thread: batch 1, 512 units 19.8 ms against 19.3 a phase a step
        self.loop = not gpu
        self.split = cell.cell == "gru" and not cell.linear_before_reset
        super().__init__(node, inputs, outputs, cell.opset)

    def check(self) -> None:
        pass

    def forward(self, ctx) -> None:
        # one thread a sample: the whole form, from X (the last input), Y where output 0 takes it
        y = self._out(0)
        self.cell.forward(ctx, y_to=(y, self.y_strides) if y is not None and self.y_strides is not None else None)

    # ---- geometry -----------------------------------------------------------------------------
    @property
    def row_groups(self) -> int:
        return -(-self.cell.B // self.SB)

    def step_items(self) -> int:
        c = self.cell
        return c.D * self.row_groups * (c.H // self.UB)

    def phases(self):
        c = self.cell
        if self.block is not None:
            return [Phase(f"all {c.S} steps, a block per row group", self.block.blocks, partial(rnn_block.emit, self),
                          threads=self.block.TU)]
        if self.loop:
            return [Phase(f"all {c.S} steps", c.D * self.row_groups * CPU_BLOCK, self._emit_loop)]
        steps = c.S * (2 if self.split else 1)
        init = Phase("initial states", c.D * c.B * c.H, self._emit_init)
        names = ([f"step {k // 2 + 1} of {c.S}, {'z and r . h' if k % 2 == 0 else 'the hidden gate'}" for k in range(steps)]
                 if self.split else [f"step {k + 1} of {c.S}" for k in range(steps)])
        return [init] + [Phase(name, self.step_items(), self._emit_step) for name in names]

    def packed_r(self) -> int | None:
        """Return the byte offset of R^T [D][H (k)][G * H] in the weight blob, or None when R is not a
        constant (then read where it is)."""
        r = self.input(1)
        if r.value is None:
            return None
        c = self.cell
        G, H = c.gates, c.H
        import numpy as np

        return self.blob.add_packed(f"{r.name}/recurrent[{c.D}x{H}x{G * H}]",
                                    lambda: np.ascontiguousarray(np.asarray(r.value, np.float32).transpose(0, 2, 1)))

    def packed_w(self) -> int | None:
        """Return the byte offset of W^T [D][I (k)][G * H] in the weight blob (the block loop's projection
        inside the step: input 8), or None when W is not a constant."""
        w = self.input(8)
        if w.value is None:
            return None
        c = self.cell
        import numpy as np

        return self.blob.add_packed(f"{w.name}/input[{c.D}x{c.I}x{c.gates * c.H}]",
                                    lambda: np.ascontiguousarray(np.asarray(w.value, np.float32).transpose(0, 2, 1)))

    # ---- indices --------------------------------------------------------------------------------
    def _state_index(self, d: str, b: str, u: str) -> str:
        c = self.cell
        if c.layout == 0:
            return ix.add(ix.mul(ix.add(ix.mul(d, c.B), b), c.H), u)
        return ix.add(ix.mul(ix.add(ix.mul(b, c.D), d), c.H), u)

    def _hbuf(self, slot: str, d: str, b: str, u: str) -> str:
        c = self.cell
        return ix.add(ix.mul(ix.add(ix.mul(ix.add(ix.mul(slot, c.D), d), c.B), b), c.H), u)

    def _dbh(self, d: str, b: str, u: str) -> str:
        c = self.cell
        return ix.add(ix.mul(ix.add(ix.mul(d, c.B), b), c.H), u)

    def _row(self, t: str, b: str) -> str:
        c = self.cell
        return ix.add(ix.mul(t, c.B), b) if (c.layout == 0) != self.swapped else ix.add(ix.mul(b, c.S), t)

    def _y_index(self, t: str, d: str, b: str, u: str) -> str:
        st, sd, sb, su = self.y_strides or self.cell.y_strides()
        return ix.add(ix.mul(t, st), ix.mul(d, sd), ix.mul(b, sb), ix.mul(u, su))

    def _out(self, k: int) -> Tensor | None:
        return self.outputs[k] if k < len(self.outputs) and self.outputs[k] is not None and k < 3 else None

    def _opt(self, k: int) -> Tensor | None:
        return self.inputs[k] if k < len(self.inputs) and self.inputs[k] is not None else None

    # ---- the first phase ------------------------------------------------------------------------
    def _emit_init(self, ctx, item: str) -> None:
        c = self.cell
        hs, cs = self.outputs[3], self.outputs[4] if c.cell == "lstm" else None
        d, b, u = (ctx.let(e, "w") for e in ix.unravel(item, (c.D, c.B, c.H)))
        h0, c0 = self._opt(4), self._opt(5)
        at = self._state_index(d, b, u)
        ctx.line(hs.store(self._hbuf("0", d, b, u), upcast(h0.load(at), h0.dtype) if h0 is not None else "0.0"))
        if cs is not None:
            ctx.line(cs.store(self._dbh(d, b, u), upcast(c0.load(at), c0.dtype) if c0 is not None else "0.0"))

    # ---- the CPU's form: a row group's whole sequence ---------------------------------------------
    def _emit_loop(self, ctx, item: str) -> None:
        """One phase: a thread per (direction, row group) runs every step of its rows (their states are
        its own: no other thread reads them), its initial states first."""
        c = self.cell
        ctx.line(f"if {ix.mod(item, CPU_BLOCK)} == 0:")
        with ctx.indent():
            self._loop(ctx, ctx.let(ix.div(item, CPU_BLOCK), "it"))

    def _loop(self, ctx, item: str) -> None:
        c = self.cell
        bg = ctx.let(ix.mod(item, self.row_groups), "bg") if self.row_groups > 1 else "0"
        d = ctx.let(ix.div(item, self.row_groups), "d") if c.D > 1 else "0"
        rows, ok = self._rows(ctx, bg)
        hs, cs = self.outputs[3], self.outputs[4] if c.cell == "lstm" else None
        h0, c0 = self._opt(4), self._opt(5)
        with ctx.loop(c.H, "u") as u:
            for b, cond in zip(rows, ok):
                at = self._state_index(d, b, u)
                ctx.line_if(cond, hs.store(self._hbuf("0", d, b, u), upcast(h0.load(at), h0.dtype) if h0 is not None else "0.0"))
                if cs is not None:
                    ctx.line_if(cond, cs.store(self._dbh(d, b, u), upcast(c0.load(at), c0.dtype) if c0 is not None else "0.0"))
        with ctx.loop(c.S, "s") as s:
            for part in ((0, 1) if self.split else (None,)):
                with ctx.loop(c.H // self.UB, "ug") as ug:
                    gates = self._step(ctx, d, rows, ok, s, part, ug)
            if gates:
                # the LSTM's activations, a loop over each row's units (rnn_step.Step.gate_loop); the
                # last step's loop apart (Y_h, Y_c: their conditional stores kept clang's loop scalar)
                ctx.line(f"if {s} == {c.S - 1}:")
                with ctx.indent():
                    self._gate_acts(ctx, d, rows, ok, s, True)
                ctx.line("else:")
                with ctx.indent():
                    self._gate_acts(ctx, d, rows, ok, s, False)

    def _gate_acts(self, ctx, d: str, rows: list[str], ok: list[str | None], s: str, last: bool) -> None:
        for j in range(len(rows)):
            with ctx.loop(self.cell.H, "u") as u:
                Step(self, ctx, d, [rows[j]], [ok[j]], s, [u]).gate_acts(BufferState(self, ctx, d, [rows[j]], [u], s), last)

    # ---- a step ---------------------------------------------------------------------------------
    def _emit_step(self, ctx, item: str) -> None:
        """A phase: one step (split: one part of one step) of every (direction, row group, unit group)."""
        c = self.cell
        # the step (and, split, the part) from the stage index: one body for every step
        first = getattr(ctx, "first_phase_stage", None)
        phase = ctx.let(f"stage - {first + 1}", "ph") if first is not None else "0"
        s, part = (ctx.let(ix.div(phase, 2), "st"), ctx.let(ix.mod(phase, 2), "pt")) if self.split else (phase, None)
        ug = ctx.let(ix.mod(item, c.H // self.UB), "ug") if c.H // self.UB > 1 else "0"
        rest = ix.div(item, c.H // self.UB)
        bg = ctx.let(ix.mod(rest, self.row_groups), "bg") if self.row_groups > 1 else "0"
        d = ctx.let(ix.div(rest, self.row_groups), "d") if c.D > 1 else "0"
        rows, ok = self._rows(ctx, bg)
        self._step(ctx, d, rows, ok, s, part, ug)

    def _rows(self, ctx, bg: str, SB: int | None = None) -> tuple[list[str], list[str | None]]:
        """Return the SB (default: the tile's) rows of row group bg (clamped to the last) and, per row,
        None or whether it exists."""
        B, SB = self.cell.B, SB or self.SB
        rows, ok = [], []
        for j in range(SB):
            bj = ix.add(ix.mul(bg, SB), str(j)) if SB > 1 else bg
            if SB > 1 and B % SB:
                ok.append(ctx.let(f"{bj} < {B}", "ok"))
                bj = f"min({bj}, {B - 1})"
            else:
                ok.append(None)
            rows.append(ctx.let(bj, "b"))
        return rows, ok

    def _step(self, ctx, d: str, rows: list[str], ok: list[str | None], s: str, part, ug: str) -> None:
        """Step s of rows `rows` of direction d, units ug * UB.. + UB, the state in this form's buffers
        (operators/rnn_step.py); part (GRU without linear_before_reset): None (unsplit), 0 or 1
        (that part), or an expression (a branch on it). Return whether the step only stored its gates
        (the CPU's LSTM: the caller then loops over each row's units)."""
        u0 = ctx.let(ix.mul(ug, self.UB), "u0")
        units = [ctx.let(ix.add(u0, str(i)), "u") if i else u0 for i in range(self.UB)]
        step = Step(self, ctx, d, rows, ok, s, units)
        state = BufferState(self, ctx, d, rows, units, s)
        step.weights()
        if self.loop and step.gate_loop():
            step.put_gates(state)
            return True
        if part is None or part in (0, 1):
            step.cell(state, part if self.split else None)
            return False
        ctx.line(f"if {part} == 0:")
        with ctx.indent():
            step.cell(state, 0)
        ctx.line("else:")
        with ctx.indent():
            step.cell(state, 1)

    def describe(self) -> str:
        c = self.cell
        if self.block is not None:
            return f"{c.cell.upper()} steps, {c.describe()}: {self.block.describe()}, h_(t-1) . R^T from R prepacked"
        if self.loop:
            return (f"{c.cell.upper()} steps, {c.describe()}: one phase, a thread per {self.SB} row(s) of a direction "
                    f"running every step, {self.UB} unit(s) at a time, h_(t-1) . R^T from R prepacked")
        per = " (two phases a step: z and r . h, then the hidden gate)" if self.split else ""
        return (f"{c.cell.upper()} steps, {c.describe()}: a phase per step{per}, a thread per {self.SB} row(s) x "
                f"{self.UB} unit(s) of a direction, h_(t-1) . R^T from R prepacked")

    def describe_block(self) -> str:
        return self.describe()
