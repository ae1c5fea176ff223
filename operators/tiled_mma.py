"""Tensor-core GEMM tiles for CUDA: a block of warps computes a BM x BN tile of C[bi] = A[bi] B[bi]
through shared memory, each warp a 64 x 32 tile as 4 x 4 mma tiles of 16 x 8 (TF32 m16n8k8, the
marked callable of shaders/tensor_cores.py that luisaml's compiler front turns into `mma.sync`,
luisaml/tensor_cores.py). Gemm and MatMul (operators/gemm.py), Conv's implicit GEMM (operators/
conv_tiles.py) and Winograd's products (operators/winograd.py) choose it where compile(tensor_cores=
"auto") found the route live; the loads of A and B and the store of a finished value are theirs,
as for operators/tiled.py's FP32 tile (same RowLoader / Finish interface, and its m_limit for a
tile whose rows are the positions of several samples).

Per k step of BK = 16 the block copies A's BM x BK and B's BK x BN tiles into shared memory (each
thread a fixed set of elements, consecutive threads on consecutive addresses of A's contiguous
dimension, of B's columns), double-buffered with one barrier a step; the next step's operands are
loaded into registers while this step's mma tiles run (as tiled.py's double-buffered tiles do).
Shared memory: A row-major with rows BK + 4 floats apart, B k-major with rows BN + 8 apart, so the
fragment reads of a warp (A[g][t], B[t][g], g = lane / 4, t = lane % 4) hit 32 different banks;
2 x (128 x 20 + 16 x 136) floats = 37,888 bytes for 128 x 128 tiles (the static cap is 48 KiB).

Per k8 sub-step a lane fills the contract's arrays (shaders/tensor_cores.py: its rows g, g + 8 of
each 16-row tile and its columns 2t, 2t + 1, g of each 8-column tile, k rotated by t) and calls the
callable 16 times; in the rewritten kernel only the mma fragments of those arrays are live (6 of
40 shared loads a tile pair) and the CUDA compiler drops the rest. Where the front did not rewrite
(the self-test would have said so, and "auto" keeps tiled.py then), the DSL body computes the same
product in FP32: correct, slow.
"""
from __future__ import annotations

from dataclasses import dataclass

from luisaml import indexing as ix

from .tiled import MIN_FILL, BlockGrid, Finish, RowLoader

WARP_M, WARP_N = 64, 32  # a warp's tile: (WARP_M / 16) x (WARP_N / 8) mma tiles
PAD_A, PAD_B = 4, 8  # shared rows of A (BK + 4) and of B (BN + 8): conflict-free fragment reads
KIND_K = {"tf32": 8}


@dataclass(frozen=True)
class MmaTiling(BlockGrid):
    """The tensor-core block tiling of nbatch products of M x K by K x N."""

    M: int
    N: int
    K: int
    nbatch: int
    BM: int
    BN: int
    BK: int = 16
    kind: str = "tf32"
    mma = True  # (what operators/gemm.py's emit_block asks)

    @property
    def threads(self) -> int:
        return 32 * (self.BM // WARP_M) * (self.BN // WARP_N)

    @property
    def shared_bytes(self) -> int:
        return 4 * 2 * (self.BM * (self.BK + PAD_A) + self.BK * (self.BN + PAD_B))

    def describe(self) -> str:
        return (f"blocks of {self.threads} threads ({self.threads // 32} warps of {WARP_M} x {WARP_N}) on {self.BM} x "
                f"{self.BN} tiles through shared memory (double-buffered), {self.kind} mma.sync m16n8k"
                f"{KIND_K[self.kind]} tiles (tensor cores), k steps of {self.BK}")


# a whole launch whose 128 x 128 tiles leave multiprocessors idle tries these sides, largest first, as
# tiled.py's FP32 tile does (tiled.filling): the first whose blocks cover every SM, else the last
FILL_SIDES = ((128, 64), (64, 128), (64, 64))


def choose(M: int, N: int, K: int, nbatch: int, kind: str = "tf32", sms: int = 0) -> MmaTiling | None:
    """Return the tensor-core tiling of a product, or None where it is too small for one (a side
    under a warp's tile, or padding past MIN_FILL): the caller keeps tiled.py's FP32 tile then.
    sms: as tiled.choose's (the launch is this product alone on a GPU of `sms` multiprocessors)."""
    if M < WARP_M or N < WARP_N or K < KIND_K[kind]:
        return None
    BM = 128 if M >= 128 else 64
    BN = 128 if N >= 128 else 64 if N >= 64 else 32
    if M * N < MIN_FILL * (-(-M // BM) * BM) * (-(-N // BN) * BN):
        return None
    tl = MmaTiling(M, N, K, nbatch, BM, BN, kind=kind)
    if sms and tl.blocks < sms:
        for bm, bn in FILL_SIDES:
            if bm <= BM and bn <= BN and (bm, bn) != (BM, BN):
                tl = MmaTiling(M, N, K, nbatch, bm, bn, kind=kind)
                if tl.blocks >= sms:
                    break
    return tl


def emit(ctx, tl: MmaTiling, item: str, thread: str, a: RowLoader, b: RowLoader, finish: Finish, store: Finish,
         a_m_contiguous: bool, m_limit: str | None = None) -> None:
    """Emit block `item`'s tile (item < tl.blocks) for thread `thread` of tl.threads (tiled.emit's
    arguments: a(bi, m) -> k -> A[bi, m, k], b(bi, n) -> k -> B[bi, k, n], finish, store;
    a_m_contiguous: A's consecutive rows are consecutive in memory; m_limit, optional: the rows that
    exist, a run-time expression of at least 1 (a Winograd product's tile of samples at the batch's
    end): rows at or past it load row m_limit - 1 and store nothing)."""
    M, N, K, BM, BN, BK = tl.M, tl.N, tl.K, tl.BM, tl.BN, tl.BK
    NT = tl.threads
    SA, SB = BK + PAD_A, BN + PAD_B
    a_size, b_size = BM * SA, BK * SB
    MI, NI = WARP_M // 16, WARP_N // 8
    mma = ctx.use_helper("mma_tf32_m16n8k8", "tensor_cores")

    cb = ctx.let(ix.mod(item, tl.col_blocks), "cb") if tl.col_blocks > 1 else "0"
    rest = ix.div(item, tl.col_blocks)
    rb = ctx.let(ix.mod(rest, tl.row_blocks), "rb") if tl.row_blocks > 1 else "0"
    bi = ctx.let(ix.div(rest, tl.row_blocks), "bi") if tl.nbatch > 1 else "0"
    m0 = ctx.let(ix.mul(rb, BM), "m0")
    n0 = ctx.let(ix.mul(cb, BN), "n0")
    warp, lane = ctx.let(ix.div(thread, 32), "wp"), ctx.let(ix.mod(thread, 32), "ln")
    wn = BN // WARP_N
    wm0 = ctx.let(ix.mul(ix.div(warp, wn), WARP_M), "wm") if BM > WARP_M else "0"
    wn0 = ctx.let(ix.mul(ix.mod(warp, wn), WARP_N), "wn") if wn > 1 else "0"
    g, t = ctx.let(ix.div(lane, 4), "g"), ctx.let(ix.mod(lane, 4), "t")
    a_sh = ctx.shared_array("float", 2 * a_size, "ash")
    b_sh = ctx.shared_array("float", 2 * b_size, "bsh")

    # ---- the copies: this thread's elements of each step's tiles, fixed over k -----------------------
    def copies(side: int, m_fast: bool, base: str, limit: int | str, loader: RowLoader, of_a: bool):
        """Return [(shared index, k offset within the step, k -> load)] of this thread's elements."""
        out = []
        for e in range(side * BK // NT):
            u = f"({ix.add(thread, str(e * NT))})" if e else thread
            q, kk = (ix.mod(u, side), ix.div(u, side)) if m_fast else (ix.div(u, BK), ix.mod(u, BK))
            q, kk = ctx.let(q, "q"), ctx.let(kk, "kk")
            row = ctx.let(ix.add(base, q), "g")
            if isinstance(limit, str):  # (m_limit: known at run time only, every row clamped)
                load = loader(bi, f"min({row}, {limit} - 1)")
            else:
                load = loader(bi, row if limit % side == 0 else f"min({row}, {limit - 1})")
            out.append((ctx.let(ix.add(ix.mul(q, SA), kk) if of_a else ix.add(ix.mul(kk, SB), q), "sh"), kk, load))
        return out

    ahead = [(a_sh, a_size, *c) for c in copies(BM, a_m_contiguous, m0, m_limit or M, a, True)] + \
            [(b_sh, b_size, *c) for c in copies(BN, True, n0, N, b, False)]
    regs = [ctx.fresh("pf") for _ in ahead]

    def fetch(k0: str, ragged: bool) -> None:
        for (_, _, _, kk, load), name in zip(ahead, regs):
            k = ctx.let(ix.add(k0, kk), "k")
            ctx.line(f"{name} = ({load(f'min({k}, {K - 1})')} if {k} < {K} else 0.0)" if ragged else f"{name} = {load(k)}")

    def put(buf: str) -> None:
        for (dst, size, idx, _, _), name in zip(ahead, regs):
            ctx.line(f"{dst}[{ix.add(idx, ix.mul(buf, size)) if buf != '0' else idx}] = {name}")

    # ---- the lane's fixed offsets, the contract's arrays, the accumulators ----------------------------
    rot = [t] + [ctx.let(f"({i} + {t}) % 8", "rk") for i in range(1, 8)]
    a_rows = [ctx.let(ix.mul(ix.add(wm0, g, str(16 * mi)), SA), "ar") for mi in range(MI)]
    b_cols = [(ctx.let(ix.add(wn0, ix.mul(t, 2), str(8 * ni)), "bc"), ctx.let(ix.add(wn0, g, str(8 * ni)), "bg"))
              for ni in range(NI)]
    fa = [ctx.local_array("float", 16, "fa") for _ in range(MI)]
    fb = [ctx.local_array("float", 24, "fb") for _ in range(NI)]
    acc = [[ctx.fresh("acc") for _ in range(NI)] for _ in range(MI)]
    for row in acc:
        for name in row:
            ctx.line(f"{name} = float4(0.0)")

    def tiles(ao: str, bo: str) -> None:
        """The step's mma tiles from shared buffer offsets ao, bo."""
        for k8 in range(0, BK, 8):
            kb = [ctx.let(ix.add(bo, ix.mul(ix.add(str(k8), r), SB)), "kb") for r in rot]
            for mi in range(MI):
                r0 = ctx.let(ix.add(ao, a_rows[mi], str(k8)), "r0")
                for i in range(8):
                    ctx.line(f"{fa[mi]}[{i}] = {a_sh}[{ix.add(r0, rot[i])}]")
                    ctx.line(f"{fa[mi]}[{8 + i}] = {a_sh}[{ix.add(r0, rot[i], str(8 * SA))}]")
            for ni in range(NI):
                c2, cg = b_cols[ni]
                for i in range(8):
                    ctx.line(f"{fb[ni]}[{i}] = {b_sh}[{ix.add(kb[i], c2)}]")
                    ctx.line(f"{fb[ni]}[{8 + i}] = {b_sh}[{ix.add(kb[i], c2, '1')}]")
                    ctx.line(f"{fb[ni]}[{16 + i}] = {b_sh}[{ix.add(kb[i], cg)}]")
            for mi in range(MI):
                for ni in range(NI):
                    ctx.line(f"{acc[mi][ni]} = {mma}({fa[mi]}, {fb[ni]}, {acc[mi][ni]})")

    steps = -(-K // BK)
    fetch("0", K < BK)
    put("0")
    ctx.line("sync_block()")
    with ctx.loop(steps, "kt") as kt:
        if steps > 1:
            cur = ctx.let(ix.mod(kt, 2), "cur")
            ctx.line(f"if {kt} + 1 < {steps}:")
            with ctx.indent():
                fetch(ctx.let(ix.mul(ix.add(kt, "1"), BK), "k0"), K % BK != 0)
            tiles(ctx.let(ix.mul(cur, a_size), "ao"), ctx.let(ix.mul(cur, b_size), "bo"))
            ctx.line(f"if {kt} + 1 < {steps}:")
            with ctx.indent():
                put(f"(1 - {cur})")
            ctx.line("sync_block()")
        else:
            tiles("0", "0")

    # ---- the stores: a lane's (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1) of each tile ----------
    for mi in range(MI):
        for h in range(2):
            m = ctx.let(ix.add(m0, wm0, g, str(16 * mi + 8 * h)), "m")
            for ni in range(NI):
                for j in range(2):
                    n = ctx.let(ix.add(n0, b_cols[ni][0], str(j)), "n")
                    conds = [c for c in (f"{m} < {m_limit}" if m_limit else f"{m} < {M}" if M % BM else None,
                                         f"{n} < {N}" if N % BN else None) if c]
                    if conds:
                        ctx.line(f"if {' and '.join(conds)}:")
                        ctx.level += 1
                    value = f"{acc[mi][ni]}.{'xyzw'[2 * h + j]}"
                    ctx.line(store(bi, m, n, ctx.let(finish(bi, m, n, value), "f")))
                    if conds:
                        ctx.level -= 1
