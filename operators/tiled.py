"""Cooperative GEMM tiles for GPUs: a block of threads computes a BM x BN tile of one matrix
product C[bi] = A[bi] B[bi] through shared memory, each thread a TM x TN register tile. Gemm and
MatMul (operators/gemm.py) and Conv as an implicit GEMM (operators/conv.py) supply the loads of A
and B and the store of a finished value; this module owns the loop.

The schedule gives such a node a "blocks" stage on the CUDA backend only (luisa-python's CPU
backend cannot compile shared memory or barriers; there the same nodes keep their per-thread
items form). Per k step of BK the block copies A's BM x BK and B's BK x BN tiles into shared
memory (each thread a fixed set of elements, consecutive threads on consecutive addresses of the
operand's contiguous dimension), waits, and every thread does BK x TM x TN multiply-adds from
shared memory. Shared memory holds float4s of 4 consecutive rows (of A) or columns (of B) at one
k, and a thread's TM rows are TM / 4 such groups, BM / (TM / 4) apart (its columns likewise): per
k a thread reads (TM + TN) / 4 float4s for TM x TN multiply-adds, a warp's float4 loads are
consecutive or broadcast (no bank conflicts). Tile kt + 1's operands are loaded into registers
while tile kt's multiply-adds run."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from luisaml import indexing as ix

# a product smaller than this along M or N keeps the per-thread items form: a block's tile would be
# mostly padding (ResNet-18's classifier, M = 1 a sample)
MIN_SIDE = 16
# nor when padding would make up more than half the tiles: LeNet's second conv (100 positions x 16
# channels in one 128 x 32 tile, 39% used) ran 1.31 ms in blocks against 1.00 ms as items
MIN_FILL = 0.5


@dataclass(frozen=True)
class Tiling:
    """The block tiling of nbatch products of M x K by K x N."""

    M: int
    N: int
    K: int
    nbatch: int
    BM: int
    BN: int
    TM: int  # a thread's rows: TM / 4 groups of 4
    TN: int
    BK: int  # k per shared-memory step
    m_fast: bool  # consecutive threads take consecutive rows (Conv's NCHW stores) or columns (Gemm)

    @property
    def threads(self) -> int:
        return (self.BM // self.TM) * (self.BN // self.TN)

    @property
    def row_blocks(self) -> int:
        return -(-self.M // self.BM)

    @property
    def col_blocks(self) -> int:
        return -(-self.N // self.BN)

    @property
    def blocks(self) -> int:
        """Blocks per sample."""
        return self.nbatch * self.row_blocks * self.col_blocks

    def describe(self) -> str:
        return (f"blocks of {self.threads} threads on {self.BM} x {self.BN} tiles through shared memory, "
                f"{self.TM} x {self.TN} a thread, k steps of {self.BK}")


def _side(n: int) -> int:
    return 128 if n >= 96 else 64 if n >= 48 else 32


def choose(M: int, N: int, K: int, nbatch: int, m_fast: bool) -> Tiling | None:
    """Return the tiling of a product, or None when it is too small for a block (MIN_SIDE,
    MIN_FILL)."""
    if M < MIN_SIDE or N < MIN_SIDE or K < 1:
        return None
    BM, BN = _side(M), _side(N)
    if M * N < MIN_FILL * (-(-M // BM) * BM) * (-(-N // BN) * BN):
        return None
    TM = 8 if BM >= 64 else 4
    TN = 8 if BN >= 64 else 4
    NT = (BM // TM) * (BN // TN)
    # every thread copies whole float4s of both tiles each step: BK grows until they divide evenly
    BK = next(bk for bk in (8, 16, 32) if (BM * bk // 4) % NT == 0 and (BN * bk // 4) % NT == 0)
    return Tiling(M, N, K, nbatch, BM, BN, TM, TN, BK, m_fast)


# a(bi, m) emits what row m of A needs once (before the k loop) and returns k -> A[bi, m, k];
# b(bi, n) the same for column n of B; finish(bi, m, n, acc) the value of a finished sum (bias,
# scale) and store(bi, m, n, value) the line storing it
RowLoader = Callable[[str, str], Callable[[str], str]]
Finish = Callable[[str, str, str, str], str]


def emit(ctx, tl: Tiling, item: str, thread: str, a: RowLoader, b: RowLoader, finish: Finish, store: Finish,
         a_m_contiguous: bool) -> None:
    """Emit block `item`'s tile (item < tl.blocks) for thread `thread` of tl.threads.
    a_m_contiguous: A's consecutive rows are consecutive in memory (Conv's im2col view of NCHW);
    otherwise its consecutive k are (a row-major Gemm A): the copy then walks k fastest."""
    M, N, K, BM, BN, TM, TN, BK = tl.M, tl.N, tl.K, tl.BM, tl.BN, tl.TM, tl.TN, tl.BK
    NT = tl.threads
    cb = ctx.let(ix.mod(item, tl.col_blocks), "cb") if tl.col_blocks > 1 else "0"
    rest = ix.div(item, tl.col_blocks)
    rb = ctx.let(ix.mod(rest, tl.row_blocks), "rb") if tl.row_blocks > 1 else "0"
    bi = ctx.let(ix.div(rest, tl.row_blocks), "bi") if tl.nbatch > 1 else "0"
    m0 = ctx.let(ix.mul(rb, BM), "m0")
    n0 = ctx.let(ix.mul(cb, BN), "n0")
    rows, cols = BM // TM, BN // TN  # threads along each side
    if tl.m_fast:
        tr, tc = ctx.let(ix.mod(thread, rows), "tr"), ctx.let(ix.div(thread, rows), "tc")
    else:
        tc, tr = ctx.let(ix.mod(thread, cols), "tc"), ctx.let(ix.div(thread, cols), "tr")
    a_sh = ctx.shared_array("float4", BK * BM // 4, "ash")
    b_sh = ctx.shared_array("float4", BK * BN // 4, "bsh")

    def copies(side: int, quad_fast: bool, base: str, limit: int, loader: RowLoader):
        """Return this thread's float4s of a tile, fixed over k: [(shared index, k offset within the
        step, [(in-range condition or None, k -> load)] x 4)]."""
        quads = side // 4
        out = []
        for e in range(side * BK // 4 // NT):
            u = f"({ix.add(thread, str(e * NT))})" if e else thread
            q, kk = (ix.mod(u, quads), ix.div(u, quads)) if quad_fast else (ix.div(u, BK), ix.mod(u, BK))
            q, kk = ctx.let(q, "q"), ctx.let(kk, "kk")
            lanes = []
            for lane in range(4):
                g = ctx.let(ix.add(base, ix.mul(q, 4), str(lane)), "g")
                cond = f"{g} < {limit}" if limit % side else None
                lanes.append((cond, loader(bi, g if cond is None else f"min({g}, {limit - 1})")))
            out.append((ctx.let(ix.add(ix.mul(kk, quads), q), "sh"), kk, lanes))
        return out

    ahead = [(a_sh, *c) for c in copies(BM, a_m_contiguous, m0, M, a)] + \
            [(b_sh, *c) for c in copies(BN, True, n0, N, b)]
    regs = [[ctx.fresh("pf") for _ in range(4)] for _ in ahead]

    def fetch(k0: str, ragged: bool) -> None:
        """Load the step at k0 into the registers (ragged: k may pass K)."""
        for (_, _, kk, lanes), names in zip(ahead, regs):
            k = ctx.let(ix.add(k0, kk), "k")
            for (cond, load), name in zip(lanes, names):
                conds = [c for c in (cond, f"{k} < {K}" if ragged else None) if c]
                value = load(f"min({k}, {K - 1})" if ragged else k)
                ctx.line(f"{name} = " + (f"({value} if {' and '.join(conds)} else 0.0)" if conds else value))

    acc = [[ctx.fresh("acc") for _ in range(TN)] for _ in range(TM)]
    for row in acc:
        for name in row:
            ctx.line(f"{name} = 0.0")
    steps = -(-K // BK)
    fetch("0", K < BK)
    with ctx.loop(steps, "kt") as kt:
        for (dst, idx, _, _), names in zip(ahead, regs):
            ctx.line(f"{dst}[{idx}] = float4({', '.join(names)})")
        ctx.line("sync_block()")
        if steps > 1:  # the next step's operands, in flight during this step's multiply-adds
            ctx.line(f"if {kt} + 1 < {steps}:")
            with ctx.indent():
                fetch(ctx.let(ix.mul(ix.add(kt, "1"), BK), "k0"), K % BK != 0)
        for kk in range(BK):
            av = [ctx.let(f"{a_sh}[{ix.add(tr, str(kk * BM // 4 + g * rows))}]", "a") for g in range(TM // 4)]
            bv = [ctx.let(f"{b_sh}[{ix.add(tc, str(kk * BN // 4 + g * cols))}]", "b") for g in range(TN // 4)]
            for i in range(TM):
                for j in range(TN):
                    ctx.line(f"{acc[i][j]} = fma({av[i // 4]}.{'xyzw'[i % 4]}, {bv[j // 4]}.{'xyzw'[j % 4]}, {acc[i][j]})")
        ctx.line("sync_block()")
    for i in range(TM):  # row i of the thread: lane i % 4 of group i // 4
        m = ctx.let(ix.add(m0, ix.mul(tr, 4), str((i // 4) * rows * 4 + i % 4)), "m")
        for j in range(TN):
            n = ctx.let(ix.add(n0, ix.mul(tc, 4), str((j // 4) * cols * 4 + j % 4)), "n")
            conds = [c for c in (f"{m} < {M}" if M % BM else None, f"{n} < {N}" if N % BN else None) if c]
            if conds:
                ctx.line(f"if {' and '.join(conds)}:")
                ctx.level += 1
            # the finished value first, one statement: an epilogue (Relu) may read it twice
            ctx.line(store(bi, m, n, ctx.let(finish(bi, m, n, acc[i][j]), "f")))
            if conds:
                ctx.level -= 1
