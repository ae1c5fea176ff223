"""CUDA's block loop: a recurrence's whole sequence in one launch (issue 27 item 3).

The phase-a-step form (operators/rnn_stages.py) launches S + 1 kernels of tiny work (a step of a GRU
of 1,024 rows and 128 units is 50M multiply-adds); on an H100 the phases, ~35 us each, were most of
the zoo's GRU (1.14 ms against torch's 0.63). A batch row's recurrence never reads another row's
state, so here one blocks phase runs every step: a block of TU threads per (direction, group of SB
batch rows), a thread per unit (UB units a thread where H passes MAX_THREADS: thread t has units
t, t + TU, ...; consecutive threads on consecutive units, so the loads of P and R and the stores of
Y are coalesced), each thread all SB rows of its units (each R load feeds SB rows in registers).

h_{t-1} of the block's rows lives in shared memory, [2 slots][H][SB] (float4s of 4 rows where SB is
a multiple of 4: a thread reads a float4 for 4 rows' h at one k, the same address for the whole warp).
Step s reads slot s % 2 and writes the other, so the one barrier at the end of a step orders both the
reads of step s + 1 after the writes of step s and the writes of step s + 1 (into slot s % 2) after
the reads of step s. GRU without linear_before_reset needs r . h_{t-1} of every unit before
its hidden gate: a third array [H][SB] and a barrier between the two parts (no extra launch). c and
GRU's z stay in the registers of the thread that owns the unit. R is the per-step form's prepacked
[D][k][gate * H + unit], read from global memory (L1 and L2) every step: a block reads all of its
direction's R once a step, each value for SB rows. The k loop takes U k's an iteration, all their
loads of R first (`unroll`): a k an iteration waited one L2 round trip a k, which made the zoo's steps
5x slower than their bytes (the BiLSTM tagger 44 us a step, the GRU 18: benchmarks/NOTES.md). Written
first in one iteration, the loads did not stay first: the compiler sinks each to its multiply-adds
(NVVM's PTX already interleaves them; ptxas then keeps ~6 in flight), so the unroll alone bought
nothing on the H100. With `prefetch` each iteration loads the NEXT iteration's U k's into registers
carried round the loop: nothing in the iteration uses them, so all of them are in flight at once.

Where the estimate says so (`BlockLoop.fused`), the input projection X W^T runs inside the step too:
each thread computes P of its rows and units from X's row (read in P's row order, the exporter's
Transpose folded as the projection stage does) and W prepacked as R is, U k's an iteration, into
registers; the node then has no projection stage and no P buffer (the zoo's GRU: one launch in all).

Rows past the batch (the last group of a ragged batch) are the last row again: computed like it,
their slots the thread's own, stored nowhere. The step itself, its gates, every attribute and the
stores of Y, Y_h and Y_c are operators/rnn_step.py's, as the other forms; only the state differs
(`SharedState`)."""
from __future__ import annotations

from dataclasses import dataclass

from luisaml import indexing as ix

from .common import upcast
from .rnn_step import State, Step

# a block's threads along the units at most (then UB units a thread)
MAX_THREADS = 256
# a block's rows at most, and a thread's accumulators (rows x gates x units) at most: LSTM's 8 rows x
# 4 gates = 32, GRU's 24, and c with them, well inside the registers of 256 threads
MAX_ROWS = 8
MAX_ACCUMULATORS = 64
# static shared memory of a kernel (luisa launches with no dynamic shared memory)
SHARED_BYTES = 48 * 1024

# How many rows a block: the fewest clocks a step by an estimate of an H100 or H200: the multiply-adds
# spread over the SMs in use (SMS, FMA_CLOCK each), R, which every block reads whole every step (as
# many times as there are blocks), through L2 in all (L2_CLOCK) and into each SM (SM_CLOCK), and the
# k loop's round trips to L2 (LOAD_LATENCY each, H / U of them a gemv: a thread's loads of U k's are in
# flight together, `unroll`). More rows a block read R fewer times but use fewer SMs. A tie takes the
# fewer rows (more blocks, fewer registers).
SMS = 132
FMA_CLOCK = 128
SM_CLOCK = 64
# ~5.5 TB/s of L2 (what H100 microbenchmarks report) at ~1.98 GHz; the first estimate's 4,096 (A100's
# whitepaper figure) is kept for the form as it was (`form="block"`)
L2_CLOCK = 2800
L2_CLOCK_BLOCK = 4096
# a k an iteration, the zoo's steps measured one L2 round trip a k (NOTES.md, the H200 zoo: the BiLSTM
# 44 us a step = 256 k x ~340 clocks at 1.98 GHz; the GRU 18 us = 128 k x ~275 clocks)
LOAD_LATENCY = 300
# k's an iteration at most, and R's registers a thread (gates x units x k's) at most
MAX_UNROLL = 8
UNROLL_REGISTERS = 64
# The phase-a-step form instead where it is cheaper by the same estimate, with a phase costing at least
# PHASE_CLOCKS (~35 us a phase of the zoo's GRU on an H100, benchmarks/NOTES.md): its tiles of 2 rows
# read R half as many times as there are rows, spread over every SM. Only a wide cell over few rows
# gets there (an LSTM of 4,096 units over 1 row: 2.3 ms a step on one SM against ~0.1 ms).
PHASE_CLOCKS = 63_000
# The input projection inside the block loop (`BlockLoop.fused`: each block computes X W^T of its rows a
# step, W streamed like R) where the extra W bytes and round trips of S steps cost less than the
# projection's stage: its GEMM by a fit of the H200 zoo's three (tensor cores; zoo-h200-tc.json: 12.6M
# outputs of K = 64 in 0.19 ms, 8.4M of K = 128 in 0.19, 8.4M of K = 512 in 0.36): PROJ_OUTPUTS_CLOCK
# outputs a clock (the tile's fixed work an output) plus PROJ_FLOP_CLOCK flops a clock; its P read back
# by the steps (HBM_CLOCK bytes a clock, ~3.3 TB/s); a stage's launch and host work (STAGE_CLOCKS,
# ~20 us: NOTES.md "net.run's wall time")
PROJ_OUTPUTS_CLOCK = 32
PROJ_FLOP_CLOCK = 19_000
HBM_CLOCK = 1700
STAGE_CLOCKS = 40_000
# compile(recurrent=...): "auto" (this estimate, the k loops unrolled with their loads an iteration
# ahead, the projection fused where cheaper), "unfused" (the same, the projection always its own GEMM
# stage), "unrolled" ("auto" with each iteration's loads in that iteration, as merged in rnngpu: the
# compiler sinks them to their multiply-adds; for A/B runs), "block" (the block loop as first built: a k
# an iteration, rows by the first estimate; for A/B runs), "steps" (the phase-a-step form)
FORMS = ("auto", "unfused", "unrolled", "block", "steps")


def unroll(G: int, H: int, UB: int) -> int:
    """Return the k's an iteration of the block loop's gemv: the most (MAX_UNROLL at most) dividing H
    whose loads of R fit UNROLL_REGISTERS."""
    return next(u for u in (8, 4, 2, 1) if u <= MAX_UNROLL and H % u == 0 and (u == 1 or G * UB * u <= UNROLL_REGISTERS))


def step_clocks(G: int, H: int, D: int, B: int, SB: int, U: int | None = 1, passes: int = 1, I: int = 0,
                UI: int = 1) -> float:
    """Return the estimated clocks of a step of the block loop of SB rows a block (the rule above), its
    gemv U k's an iteration in `passes` k loops (GRU without linear_before_reset: 2); U None: the first
    estimate (no round trips, L2_CLOCK_BLOCK). I: the input projection's k's inside the step (fused;
    UI k's an iteration), 0 where it is a GEMM stage of its own."""
    blocks = D * -(-B // SB)
    r_bytes = 4 * G * H * (H + I)
    fma = blocks * SB * G * H * (H + I) / (min(blocks, SMS) * FMA_CLOCK)
    sm = -(-blocks // SMS) * r_bytes / SM_CLOCK
    if U is None:
        return max(fma, blocks * r_bytes / L2_CLOCK_BLOCK, sm)
    trips = passes * (H // U) + (I // UI if I else 0)
    return max(fma, blocks * r_bytes / L2_CLOCK, sm, trips * LOAD_LATENCY)


def projection_clocks(G: int, H: int, D: int, B: int, S: int, I: int) -> float:
    """Return the estimated clocks of the input projection as a stage (the rule above PROJ_FLOP_CLOCK)."""
    outputs = S * B * D * G * H
    return outputs / PROJ_OUTPUTS_CLOCK + 2 * outputs * I / PROJ_FLOP_CLOCK + 4 * outputs / HBM_CLOCK + STAGE_CLOCKS


def phase_clocks(G: int, H: int, D: int, B: int, l2: float = L2_CLOCK) -> float:
    """Return the estimated clocks of a phase of the phase-a-step form (tiles of 2 rows; l2: L2's bytes
    a clock)."""
    return PHASE_CLOCKS + max(D * B * G * H * H / (SMS * FMA_CLOCK), D * -(-B // 2) * 4 * G * H * H / l2)


@dataclass(frozen=True)
class BlockLoop:
    """The block loop's geometry: SB rows and TU threads a block (UB units a thread), its blocks
    (per sample where the steps run per sample), shared memory, U k's an iteration of its gemv."""

    SB: int
    TU: int
    UB: int
    blocks: int
    shared_bytes: int
    U: int = 1
    # the input projection X W^T inside the step (no projection stage), its k loop UI k's an iteration
    fused: bool = False
    UI: int = 1
    # the k loops' loads of R (and W) one iteration ahead (Step.gemv_unrolled)
    prefetch: bool = False

    @property
    def quad(self) -> bool:
        """Whether shared memory holds float4s of 4 rows."""
        return self.SB % 4 == 0

    def describe(self) -> str:
        units = f"{self.UB} units" if self.UB > 1 else "a unit"
        ks = (f", {self.U} k's an iteration (R's loads {'an iteration ahead' if self.prefetch else 'first'})"
              if self.U > 1 else "")
        if self.fused:
            ks += f", X W^T inside the step ({self.UI} k's an iteration)"
        return (f"one launch for every step: {self.blocks} block(s) of {self.TU} threads, a block {self.SB} row(s) of a "
                f"direction, a thread {units} of them, h in {self.shared_bytes:,} bytes of shared memory, a barrier a step{ks}")


def choose(cell, split: bool, batched: bool, form: str = "auto") -> BlockLoop | None:
    """Return the block loop of a recurrent node on CUDA (cell: its operators/rnn.py operator;
    split: GRU without linear_before_reset; batched: its steps run per sample; form: compile's
    `recurrent`, FORMS), or None where it keeps the phase-a-step form: form "steps", shared memory over
    SHARED_BYTES or accumulators over MAX_ACCUMULATORS at one row a block, or (a fixed batch) a step
    estimated slower than a phase of that form."""
    if form == "steps":
        return None
    prefetch = form in ("auto", "unfused")
    form = "auto" if form == "unrolled" else form  # (the same choices, the loads where written)
    G, H, D, B, S, I = cell.gates, cell.H, cell.D, cell.B, cell.S, cell.I
    UB = -(-H // MAX_THREADS)
    TU = -(-H // UB)
    if G * UB > MAX_ACCUMULATORS:  # (LSTM past 4,096 units, GRU past 5,376: registers would spill)
        return None
    slots = 3 if split else 2
    U = unroll(G, H, UB) if form != "block" else 1
    UI = unroll(G, I, UB)

    def shared(sb: int) -> int:
        return 4 * slots * sb * H

    def clocks(sb: int, fused: bool = False) -> float:
        return step_clocks(G, H, D, B, sb, U if form != "block" else None, 2 if split else 1, I if fused else 0, UI)

    cap = min(MAX_ROWS, MAX_ACCUMULATORS // (G * UB))
    sides = [sb for sb in (1, 2, 4, 8) if sb <= cap and (sb == 1 or shared(sb) <= SHARED_BYTES)]
    if shared(1) > SHARED_BYTES:
        return None
    if batched:  # a sample's rows (the batch fills the GPU): as many as it has
        SB = max(sb for sb in sides if sb <= B or sb == 1)
    else:
        SB = min(sides, key=lambda sb: (clocks(sb), sb))
        if clocks(SB) > phase_clocks(G, H, D, B, L2_CLOCK if form != "block" else L2_CLOCK_BLOCK):
            return None
    fused = False
    # the projection inside: its own rows a block (W's bytes read by each). Not per sample: the estimate
    # sees a sample's rows, not the batch's blocks that would each read W
    if form == "auto" and I > 0 and not batched:
        FB = min(sides, key=lambda sb: (clocks(sb, True), sb))
        if S * clocks(FB, True) < S * clocks(SB) + projection_clocks(G, H, D, B, S, I):
            SB, fused = FB, True
    return BlockLoop(SB, TU, UB, D * -(-B // SB), shared(SB), U, fused, UI if fused else 1, prefetch)


class SharedState(State):
    """The block loop's state: h_{t-1} and h_t in two slots of shared memory, GRU's r . h in a third
    array, c and z in the registers of the unit's thread."""

    def __init__(self, op, ctx, bl: BlockLoop, units: list[str], unit_ok: list[str | None]):
        self.op, self.ctx, self.bl, self.units, self.unit_ok = op, ctx, bl, units, unit_ok
        c = op.cell
        self.H, self.q = c.H, 4 if bl.quad else 1
        dsl = "float4" if bl.quad else "float"
        self.hsh = ctx.shared_array(dsl, 2 * c.H * bl.SB // self.q, "hsh")
        self.rsh = ctx.shared_array(dsl, c.H * bl.SB // self.q, "rsh") if op.split else None
        self.cur = self.nxt = "0"
        self.pending: dict[tuple, dict[int, str]] = {}
        self.quads: dict[tuple, str] = {}
        self.c_regs: dict[tuple[int, int], str] = {}
        self.z_regs: dict[tuple[int, int], str] = {}

    def step(self, s: str) -> None:
        """Enter step s: its slots, and GRU's z registers (declared before the branches that set them)."""
        ctx = self.ctx
        self.cur = ctx.let(ix.mod(s, 2), "cur")
        self.nxt = ctx.let(f"1 - {self.cur}", "nx")
        if self.op.split:
            for j in range(self.bl.SB):
                for i in range(len(self.units)):
                    self.z_regs[j, i] = ctx.fresh("z")
                    ctx.line(f"{self.z_regs[j, i]} = 0.0")

    def _at(self, slot: str, k: str, j: int) -> str:
        """The shared index of unit k, row j (its float4 where 4 rows share one) in slot `slot`."""
        return ix.add(ix.mul(ix.add(ix.mul(slot, self.H), k), self.bl.SB // self.q), str(j // self.q))

    def _read(self, arr: str, slot: str, k: str, j: int, cache: bool = False) -> str:
        """Row j of unit k; cache: the float4 loaded once for its 4 rows (a gemv's k loop, whose k
        names one loop: its body is one scope)."""
        if self.q == 1:
            return f"{arr}[{self._at(slot, k, j)}]"
        key = (arr, slot, k, j // 4)
        quad = self.quads.get(key) if cache else None
        if quad is None:
            quad = self.ctx.let(f"{arr}[{self._at(slot, k, j)}]", "hq")
            if cache:
                self.quads[key] = quad
        return f"{quad}.{'xyzw'[j % 4]}"

    def _write(self, arr: str, slot: str, j: int, i: int, value: str) -> None:
        """Row j of unit i into shared memory; float4s once their 4 rows are in (rows in order)."""
        cond = self.unit_ok[i]
        if self.q == 1:
            self.ctx.line_if(cond, f"{arr}[{self._at(slot, self.units[i], j)}] = {value}")
            return
        got = self.pending.setdefault((arr, slot, i, j // 4), {})
        got[j % 4] = value
        if len(got) == 4:
            del self.pending[arr, slot, i, j // 4]
            self.ctx.line_if(cond, f"{arr}[{self._at(slot, self.units[i], j)}] = float4({', '.join(got[e] for e in range(4))})")

    def h(self, j, i):
        return self._read(self.hsh, self.cur, self.units[i], j)

    def h_k(self, j, k):
        return self._read(self.hsh, self.cur, k, j, cache=True)

    def put_h(self, j, i, value, cond):
        self._write(self.hsh, self.nxt, j, i, value)  # (a row past the batch: its own slot; cond is Y's)

    def set_h0(self, j, i, value):
        self._write(self.hsh, "0", j, i, value)

    def c(self, j, i):
        return self.c_regs[j, i]

    def put_c(self, j, i, value, cond):
        self.ctx.line(f"{self.c_regs[j, i]} = {value}")

    def z(self, j, i):
        return self.z_regs[j, i]

    def put_z(self, j, i, value, cond):
        self.ctx.line(f"{self.z_regs[j, i]} = {value}")

    def rh_k(self, j, k):
        return self._read(self.rsh, "0", k, j, cache=True)

    def put_rh(self, j, i, value, cond):
        self._write(self.rsh, "0", j, i, value)


def emit(op, ctx, item: str, thread: str) -> None:
    """Thread `thread` of block `item` (of op.block.blocks: direction-major row groups) runs every
    step of its group's rows (op: a RecurrentSteps with op.block)."""
    bl, c = op.block, op.cell
    H, D, B, S = c.H, c.D, c.B, c.S
    groups = -(-B // bl.SB)
    bg = ctx.let(ix.mod(item, groups), "bg") if groups > 1 else "0"
    d = ctx.let(ix.div(item, groups), "d") if D > 1 else "0"
    rows, ok = op._rows(ctx, bg, bl.SB)
    units, unit_ok = [], []
    for i in range(bl.UB):
        u = ix.add(thread, str(i * bl.TU))
        if (i + 1) * bl.TU > H:  # some threads have no unit i: theirs is the last, computed and not stored
            unit_ok.append(ctx.let(f"{u} < {H}", "uok"))
            units.append(ctx.let(f"min({u}, {H - 1})", "u"))
        else:
            unit_ok.append(None)
            units.append(ctx.let(u, "u") if i else thread)
    st = SharedState(op, ctx, bl, units, unit_ok)
    h0, c0 = op._opt(4), op._opt(5)
    for j in range(bl.SB):
        for i in range(bl.UB):
            at = op._state_index(d, rows[j], units[i])
            st.set_h0(j, i, ctx.let(upcast(h0.load(at), h0.dtype), "h0") if h0 is not None else "0.0")
            if c.cell == "lstm":
                st.c_regs[j, i] = ctx.fresh("c")
                ctx.line(f"{st.c_regs[j, i]} = {upcast(c0.load(at), c0.dtype) if c0 is not None else '0.0'}")
    seq = op._opt(3)
    lens = [ctx.let(f"min({seq.load(b)}, {S})", "n") if seq is not None else str(S) for b in rows]
    ctx.line("sync_block()")
    with ctx.loop(S, "s") as s:
        st.step(s)
        step = Step(op, ctx, d, rows, ok, s, units, consecutive=False, unit_ok=unit_ok, lens=lens, unroll=bl.U,
                    prefetch=bl.prefetch)
        if bl.fused:
            step.project(bl.UI)
        if op.split:
            step.cell(st, 0)
            ctx.line("sync_block()")  # every unit's r . h_{t-1} before the hidden gate reads them
            step.cell(st, 1)
        else:
            step.cell(st)
        ctx.line("sync_block()")  # h_t in before step s + 1 reads it; slot s % 2 read before s + 1 writes it
