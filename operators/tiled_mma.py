"""Tensor-core GEMM tiles for CUDA: a block of warps computes a BM x BN tile of C[bi] = A[bi] B[bi] through
shared memory, each warp a WM x WN tile (64 x 64 by default, 64 x 48 for 96-column blocks, 64 x 32 on
short grids and in the first tile's variants: VARIANTS below) as mma tiles of 16 x 8 (TF32 m16n8k8, or
under the kind "f16" FP16 m16n8k16 with FP32 accumulation: the marked callables of shaders/tensor_cores.py
that luisaml's compiler front turns into `mma.sync`, luisaml/tensor_cores.py). Gemm and MatMul
(operators/gemm.py), Conv's implicit GEMM (operators/conv_tiles.py) and Winograd's products
(operators/winograd.py) choose it where compile(tensor_cores="auto") found the route live; the loads of A
and B and the store of a finished value are theirs, as for operators/tiled.py's FP32 tile (same RowLoader
/ Finish interface, and its m_limit for a tile whose rows are the positions of several samples).

Per k step of BK = 16 the block copies A's BM x BK and B's BK x BN tiles into shared memory (each
thread a fixed set of elements, consecutive threads on consecutive addresses of A's contiguous
dimension, of B's columns; a thread's elements are its first plus constant offsets, so each copy's
addresses are one register and an immediate), double-buffered with one barrier a step; the next step's
operands are loaded into registers while this step's mma tiles run. Shared memory: B k-major with rows
BN + 8 apart; A row-major with rows BK + 4 apart, or k-major with rows BM + 8 apart where A's rows are
contiguous in memory (Conv's gather: a warp's stores then hit 32 banks); either way the fragment reads
of a warp (A[g][t], B[t][g], g = lane / 4, t = lane % 4) hit 32 different banks. At most
2 x (128 x 20 + 16 x 136) floats = 37,888 bytes for 128 x 128 tiles (the static cap is 48 KiB).

Per sub-step of the mma's k (TF32 two k8 a step, FP16 one k16) a lane fills the contract's arrays
(shaders/tensor_cores.py: its rows g, g + 8 of each 16-row tile and its columns 2t, 2t + 1, g of each
8-column tile, k rotated by t k / 8) and calls the callable (WM / 16) x (WN / 8) times; in the rewritten
kernel only the mma fragments of those arrays are live (TF32 6 of 40 shared loads a tile pair, FP16 12 of
80) and the CUDA compiler drops the rest. FP16 operands are rounded to half where a thread copies them
(f16_round: float(half(x)) in the DSL body, nothing on the tensor-core route, where the mma's own
conversion rounds them alike; kept as float in shared memory), so the DSL body multiplies the HMMA's
operands. Where the front did not rewrite (the self-test would have said so, and "auto" keeps tiled.py
then), the DSL body computes the same product in FP32: correct, slow. Why these shapes:
benchmarks/NOTES.md, "A faster tensor-core tile"; the FP16 kind: "The fp16 MLPs on the FP16 mma tile".
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from luisaml import indexing as ix

from .tiled import MIN_FILL, BlockGrid, Finish, RowLoader

WARP_M, WARP_N = 64, 32  # the smallest warp tile: (WARP_M / 16) x (WARP_N / 8) mma tiles
PAD_A, PAD_B = 4, 8  # shared rows of A (BK + 4) and of B (BN + 8): conflict-free fragment reads
# the mma tile's k of each kind (shaders/tensor_cores.py's SHAPES): TF32's m16n8k8 and FP16's m16n8k16, whose
# operands the copies round to half (so the DSL body, the CPU's and the emulator's, multiplies what the HMMA
# does: two halves' product is exact in FP32, and the sums differ only in their order)
KIND_K = {"tf32": 8, "f16": 16}
KIND_CALLABLE = {"tf32": "mma_tf32_m16n8k8", "f16": "mma_f16_m16n8k16"}

# The tile's variants (NOTES.md, "A faster tensor-core tile"): "w32", the first tile's warps of 64 x 32 (8 a
# 128 x 128 block); "w64", warps of 64 x 64 (4 a 128 x 128 block: a k8 step reads 128 bytes of shared
# memory an mma instead of 192 and converts one fragment element an mma instead of 1.5) and column sides
# that pad N least (96: warps of 64 x 48); "w32-first", the first tile exactly as merged (per-element copy
# addresses live across the k loop: 166 registers, one block an SM; A row-major in shared memory always),
# kept to measure against; "w64r", "w64" with A and B rounded to TF32 where a thread copies them to shared
# memory (shaders/tensor_cores.py's tf32_round, once an element) and mma_tf32_m16n8k8_rounded (no conversion: the
# fragments' two instructions an element, a third of the k loop's, leave it). choose() takes
# LUISAML_MMA_TILE where set, else TILE (benchmarks/experiments/sweep_mma.py, bench_zoo: one process, one
# variant, no code change).
VARIANTS = ("w64", "w32", "w32-first", "w64r")
TILE = "w64"


@dataclass(frozen=True)
class MmaTiling(BlockGrid):
    """The tensor-core block tiling of nbatch products of M x K by K x N; a warp computes WM x WN."""

    M: int
    N: int
    K: int
    nbatch: int
    BM: int
    BN: int
    BK: int = 16
    kind: str = "tf32"
    WM: int = WARP_M
    WN: int = WARP_N
    variant: str = "w32"  # (of VARIANTS: "w32-first" emits the first tile's copies and layout)
    mma = True  # (what operators/gemm_blocks.py's emit_block asks)

    @property
    def threads(self) -> int:
        return 32 * (self.BM // self.WM) * (self.BN // self.WN)

    @property
    def shared_bytes(self) -> int:
        """The double-buffered tiles, A row-major (emit's k-major A, for rows contiguous in memory, is smaller)."""
        return 4 * 2 * (self.BM * (self.BK + PAD_A) + self.BK * (self.BN + PAD_B))

    def describe(self) -> str:
        return (f"blocks of {self.threads} threads ({self.threads // 32} warps of {self.WM} x {self.WN}) on {self.BM} x "
                f"{self.BN} tiles through shared memory (double-buffered), {self.kind} mma.sync m16n8k"
                f"{KIND_K[self.kind]} tiles (tensor cores), k steps of {self.BK}")


# a whole launch whose 128 x 128 tiles leave multiprocessors idle tries these sides, largest first, as
# tiled.py's FP32 tile does (tiled.filling): the first whose blocks cover every SM, else the last
FILL_SIDES = ((128, 64), (64, 128), (64, 64))


def warp_n(BN: int, tile: str) -> int:
    """The warp tile's columns for a block of BN columns under variant `tile`."""
    if not tile.startswith("w64") or BN < 64:
        return WARP_N
    return 48 if BN % 64 else 64


def column_side(N: int, tile: str) -> int:
    """The block's columns: "w32" 128, 64 or 32 (the first tile's); "w64" the side of 128, 96 or 64 that
    pads N least (ConvNeXt's 96 and BERT's 768 columns, a ResNet's 64s: no empty warps), larger first."""
    if N < 64:
        return 32
    if not tile.startswith("w64") or N < 96:
        return 128 if N >= 128 else 64
    return min((128, 96, 64), key=lambda s: (-(-N // s) * s, -s))


def choose(M: int, N: int, K: int, nbatch: int, kind: str = "tf32", sms: int = 0,
           tile: str | None = None) -> MmaTiling | None:
    """Return the tensor-core tiling of a product, or None where it is too small for one (a side
    under a warp's tile, or padding past MIN_FILL): the caller keeps tiled.py's FP32 tile then.
    sms: as tiled.choose's (the launch is this product alone on a GPU of `sms` multiprocessors);
    tile: a variant of VARIANTS (default TILE)."""
    tile = tile or os.environ.get("LUISAML_MMA_TILE") or TILE
    if tile not in VARIANTS:
        raise ValueError(f"tiled_mma: unknown tile variant {tile!r} (one of {VARIANTS})")
    if M < WARP_M or N < WARP_N or K < KIND_K[kind]:
        return None
    BM = 128 if M >= 128 else 64
    BN = column_side(N, tile)
    if M * N < MIN_FILL * (-(-M // BM) * BM) * (-(-N // BN) * BN):
        return None
    tl = MmaTiling(M, N, K, nbatch, BM, BN, kind=kind, WN=warp_n(BN, tile), variant=tile)
    if sms and tl.blocks < sms:
        # a short grid: warps of 64 x 32 (twice the warps a block: "w64"'s 64 x 64 would leave an SM 2-3
        # warps), then smaller blocks
        tl = MmaTiling(M, N, K, nbatch, BM, BN, kind=kind, WN=WARP_N, variant=tile)
        for bm, bn in FILL_SIDES:
            if bm <= BM and bn <= BN and (bm, bn) != (BM, BN):
                tl = MmaTiling(M, N, K, nbatch, bm, bn, kind=kind, WN=WARP_N, variant=tile)
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
    # A k-major (as B) where its rows are contiguous (Conv's gather): a warp's stores of 32 consecutive
    # rows then hit 32 banks, where rows BK + 4 apart would put 4 rows on a bank
    first = tl.variant == "w32-first"
    a_kmajor = a_m_contiguous and not first
    SA, SB = (BM + PAD_B) if a_kmajor else BK + PAD_A, BN + PAD_B
    a_size, b_size = (BK if a_kmajor else BM) * SA, BK * SB
    WM, WN = tl.WM, tl.WN
    MI, NI = WM // 16, WN // 8
    KK = KIND_K[tl.kind]  # (an mma's k: a k step of BK is BK / KK sub-steps)
    rounded = tl.variant == "w64r" and tl.kind == "tf32"  # (the copies round, the mma does not)
    mma = ctx.use_helper("mma_tf32_m16n8k8_rounded" if rounded else KIND_CALLABLE[tl.kind], "tensor_cores")
    tf32 = ctx.use_helper("tf32_round", "tensor_cores") if rounded else None
    # FP16: each copied element rounded to half once where the DSL body runs (shaders/tensor_cores.py f16_round: so
    # the FP32 body multiplies the HMMA's operands), on the tensor-core route left as it is (the mma's cvt.rn.f16x2
    # rounds it the same way: 2 instructions an element saved, NOTES.md); the shared tiles stay float either way
    f16 = ctx.use_helper("f16_round", "tensor_cores") if tl.kind == "f16" else None

    cb = ctx.let(ix.mod(item, tl.col_blocks), "cb") if tl.col_blocks > 1 else "0"
    rest = ix.div(item, tl.col_blocks)
    rb = ctx.let(ix.mod(rest, tl.row_blocks), "rb") if tl.row_blocks > 1 else "0"
    bi = ctx.let(ix.div(rest, tl.row_blocks), "bi") if tl.nbatch > 1 else "0"
    m0 = ctx.let(ix.mul(rb, BM), "m0")
    n0 = ctx.let(ix.mul(cb, BN), "n0")
    warp, lane = ctx.let(ix.div(thread, 32), "wp"), ctx.let(ix.mod(thread, 32), "ln")
    wn = BN // WN
    wm0 = ctx.let(ix.mul(ix.div(warp, wn), WM), "wm") if BM > WM else "0"
    wn0 = ctx.let(ix.mul(ix.mod(warp, wn), WN), "wn") if wn > 1 else "0"
    g, t = ctx.let(ix.div(lane, 4), "g"), ctx.let(ix.mod(lane, 4), "t")
    a_sh = ctx.shared_array("float", 2 * a_size, "ash")
    b_sh = ctx.shared_array("float", 2 * b_size, "bsh")

    # ---- the copies: this thread's elements of each step's tiles, fixed over k -----------------------
    def copies(side: int, m_fast: bool, base: str, limit: int | str, loader: RowLoader, of_a: bool):
        """Return [(shared index, k offset within the step, k -> load)] of this thread's elements.
        Element e is u = thread + e * NT of the tile's side x BK; where NT divides the fast side's
        length or the other way round, its row and k are the thread's first plus constants, so each
        load's and store's address is one register plus an immediate (no per-element registers live
        across the k loop: ptxas -v, NOTES.md "A faster tensor-core tile")."""
        fast = side if m_fast else BK
        if not first and NT % fast == 0:  # u % fast = thread % fast for every e; u // fast = thread // fast + e * NT / fast
            r0, s0 = ctx.let(ix.mod(thread, fast), "q"), ctx.let(ix.div(thread, fast), "kk")
            split = [(r0, ix.add(s0, str(e * NT // fast))) for e in range(side * BK // NT)]
        elif not first and fast % NT == 0:  # u < fast for e < fast / NT
            split = [(ix.add(thread, str(e * NT % fast)), str(e * NT // fast)) for e in range(side * BK // NT)]
        elif not first and (side * BK // NT) % (fast // math.gcd(NT, fast)) == 0:
            # (96 columns, 128 threads) runs of G = gcd(NT, fast) consecutive threads (a warp) on G consecutive
            # elements; run r = thread // G takes the E run slots r * E + e, whose fast index is
            # (e % (fast / G)) * G + lane and slow index e // (fast / G) + r * E / (fast / G): constants again
            G = math.gcd(NT, fast)
            E, per = side * BK // NT, fast // G
            lo, hi = ctx.let(ix.mod(thread, G), "q"), ctx.let(ix.div(thread, G), "kk")
            split = [(ix.add(lo, str(e % per * G)), ix.add(str(e // per), ix.mul(hi, E // per))) for e in range(E)]
        else:
            split = [(ix.mod(f"({ix.add(thread, str(e * NT))})" if e else thread, fast),
                      ix.div(f"({ix.add(thread, str(e * NT))})" if e else thread, fast)) for e in range(side * BK // NT)]
        out = []
        for fast_i, slow_i in split:
            q, kk = (fast_i, slow_i) if m_fast else (slow_i, fast_i)
            q, kk = ctx.let(q, "q"), ctx.let(kk, "kk")
            row = ctx.let(ix.add(base, q), "g")
            if isinstance(limit, str):  # (m_limit: known at run time only, every row clamped)
                load = loader(bi, f"min({row}, {limit} - 1)")
            else:
                load = loader(bi, row if limit % side == 0 else f"min({row}, {limit - 1})")
            index = ix.add(ix.mul(q, SA), kk) if of_a and not a_kmajor else ix.add(ix.mul(kk, SA if of_a else SB), q)
            out.append((ctx.let(index, "sh"), kk, load))
        return out

    ahead = [(a_sh, a_size, *c) for c in copies(BM, a_m_contiguous, m0, m_limit or M, a, True)] + \
            [(b_sh, b_size, *c) for c in copies(BN, True, n0, N, b, False)]
    regs = [ctx.fresh("pf") for _ in ahead]

    def fetch(k0: str, ragged: bool) -> None:
        for (_, _, _, kk, load), name in zip(ahead, regs):
            # a loader with at_step(k0, kk) is told its k is the step's k0 (a multiple of BK) plus kk < BK, so
            # it may decompose k0 once a step (conv_tiles' gather); other loaders see k alone, as before
            at_step = None if ragged else getattr(load, "at_step", None)
            if at_step is not None:
                ctx.line(f"{name} = {at_step(k0, kk)}")
                continue
            k = ctx.let(ix.add(k0, kk), "k")
            ctx.line(f"{name} = ({load(f'min({k}, {K - 1})')} if {k} < {K} else 0.0)" if ragged else f"{name} = {load(k)}")

    def put(buf: str) -> None:
        for (dst, size, idx, _, _), name in zip(ahead, regs):
            value = f"{tf32}({name})" if tf32 else f"{f16}({name})" if f16 else name
            ctx.line(f"{dst}[{ix.add(idx, ix.mul(buf, size)) if buf != '0' else idx}] = {value}")

    # ---- the lane's fixed offsets, the contract's arrays, the accumulators ----------------------------
    # the contract's rotation r = t KK / 8 (shaders/tensor_cores.py): (i + r) % KK is i + r where i + 3 KK / 8 < KK
    # (TF32: i < 5; FP16: i < 10), so the live fragments' offsets (TF32 i = 0, 4; FP16 0, 1, 8, 9) are r plus constants
    r = t if KK == 8 else ctx.let(ix.mul(t, KK // 8), "r")
    rot = [r] + [ctx.let(ix.add(r, str(i)) if i < KK - 3 * KK // 8 and not first else f"({i} + {r}) % {KK}", "rk")
                 for i in range(1, KK)]
    a_rows = [ctx.let(ix.add(wm0, g, str(16 * mi)) if a_kmajor else ix.mul(ix.add(wm0, g, str(16 * mi)), SA), "ar")
              for mi in range(MI)]
    b_cols = [(ctx.let(ix.add(wn0, ix.mul(t, 2), str(8 * ni)), "bc"), ctx.let(ix.add(wn0, g, str(8 * ni)), "bg"))
              for ni in range(NI)]
    fa = [ctx.local_array("float", 2 * KK, "fa") for _ in range(MI)]
    fb = [ctx.local_array("float", 3 * KK, "fb") for _ in range(NI)]
    acc = [[ctx.fresh("acc") for _ in range(NI)] for _ in range(MI)]
    for row in acc:
        for name in row:
            ctx.line(f"{name} = float4(0.0)")

    def tiles(ao: str, bo: str) -> None:
        """The step's mma tiles from shared buffer offsets ao, bo."""
        for ks in range(0, BK, KK):
            kb = [ctx.let(ix.add(bo, ix.mul(ix.add(str(ks), r), SB)), "kb") for r in rot]
            ka = [ctx.let(ix.add(ao, ix.mul(ix.add(str(ks), r), SA)), "ka") for r in rot] if a_kmajor else None
            for mi in range(MI):
                if a_kmajor:  # (A[g][k] at k * SA + g)
                    for i in range(KK):
                        ctx.line(f"{fa[mi]}[{i}] = {a_sh}[{ix.add(ka[i], a_rows[mi])}]")
                        ctx.line(f"{fa[mi]}[{KK + i}] = {a_sh}[{ix.add(ka[i], a_rows[mi], '8')}]")
                    continue
                r0 = ctx.let(ix.add(ao, a_rows[mi], str(ks)), "r0")
                for i in range(KK):
                    ctx.line(f"{fa[mi]}[{i}] = {a_sh}[{ix.add(r0, rot[i])}]")
                    ctx.line(f"{fa[mi]}[{KK + i}] = {a_sh}[{ix.add(r0, rot[i], str(8 * SA))}]")
            for ni in range(NI):
                c2, cg = b_cols[ni]
                for i in range(KK):
                    ctx.line(f"{fb[ni]}[{i}] = {b_sh}[{ix.add(kb[i], c2)}]")
                    ctx.line(f"{fb[ni]}[{KK + i}] = {b_sh}[{ix.add(kb[i], c2, '1')}]")
                    ctx.line(f"{fb[ni]}[{2 * KK + i}] = {b_sh}[{ix.add(kb[i], cg)}]")
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
