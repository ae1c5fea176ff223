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
while tile kt's multiply-adds run. A product of few tiles (DEEP_TILES) and 64 x 64 tiles keep two
shared buffers (tile kt + 1 stored into the other while kt is read: one barrier a step instead of
two) and load B as float4s where the operator offers them (Conv's prepacked weights); Conv and
fvdb's SparseConv3d ask for them (choose's `pipelined`). A product may also skip whole k steps
(emit's k_steps: SparseConv3d runs only the taps its tile's voxels read), and load an operand read
through an index (`gathered`: SparseConv3d's map entry, then the features it names) with the index a
step ahead of the value, so that no load of a step waits for another. Inside a whole step a loader
marked `by_step` also takes the step (a `Step`: its first k), from which k // d and k % d are then the
same for the whole block.

Tiles of samples. A blocks stage may cover several samples a block (`Operator.block_samples`,
`Stage.grouped`: ceil(n / samples) groups, the batch an argument `n` of the kernel,
`Schedule.takes_batch`; emit's `m_limit` stops the rows past the batch): SparseConv3d over voxels (a
voxel a sample, 64 a tile), a Winograd product whose samples have few tiles, and a Gemm or MatMul of
one row a sample with constant weights (a classifier head: 64 samples a tile, 128 on tiled_mma.py's). A row of another
sample is read and written through `KernelContext.at_sample(s)`, never at an offset from the group's
first sample: a pooled buffer's samples lie its slot's size apart, and a slot is as large as its
largest tensor. An artifact stores such a stage's dispatch as groups.
"""
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


class BlockGrid:
    """The blocks of an M x N product in BM x BN tiles, over nbatch products (a tiling's fields)."""

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


@dataclass(frozen=True)
class Tiling(BlockGrid):
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
    double: bool = False  # two shared buffers, one barrier a step; B as float4 loads where offered

    @property
    def threads(self) -> int:
        return (self.BM // self.TM) * (self.BN // self.TN)

    def describe(self) -> str:
        return (f"blocks of {self.threads} threads on {self.BM} x {self.BN} tiles through shared memory"
                f"{' (double-buffered)' if self.double else ''}, {self.TM} x {self.TN} a thread, k steps of {self.BK}")


def _side(n: int) -> int:
    return 128 if n >= 96 else 64 if n >= 48 else 32


# a product of at most this many tiles (per sample) leaves most SMs one block at batch 32 (ResNet-18's
# layer3 and layer4: 128 blocks of 128-256 threads, a warp or two per scheduler): latency-bound, it
# takes k steps of 16 and double-buffered shared memory (layer4 0.435 -> 0.325 ms, layer3 0.346 -> 0.281)
DEEP_TILES = 4


def choose(M: int, N: int, K: int, nbatch: int, m_fast: bool, pipelined: bool = False,
           narrow: bool = False) -> Tiling | None:
    """Return the tiling of a product, or None when it is too small for a block (MIN_SIDE,
    MIN_FILL). pipelined: the product may take 64 x 64 tiles (4 x 8 a thread) for 64 columns, k
    steps of 16 when it has few tiles, and double-buffered shared memory for both (measured on Conv
    and fvdb's SparseConv3d, which ask for it: Gemm and MatMul keep the single-buffered tiles until
    measured).
    narrow (with pipelined): 64 columns a tile whatever N (Winograd's products, below)."""
    if M < MIN_SIDE or N < MIN_SIDE or K < 1:
        return None
    # Winograd's 36 products (ResNet-18, batch 32, H200): 64 x 64 tiles beat 64 x 128 and 128 x 128 at
    # every width from 128 to 512 channels, by 7-14% (benchmarks/NOTES.md, "Thread tiles of 4 x 8")
    BN = 64 if narrow and pipelined and N >= 48 else _side(N)
    # 64 columns: 64 x 64 tiles rather than 128 x 64 (ResNet-18's layer1 at batch 32: 1,568 blocks of
    # 64 threads fill two waves, 800 of 128 two and a sliver; 0.326 -> 0.245 ms with double buffers)
    BM = 64 if pipelined and BN == 64 and M >= 48 else _side(M)
    if M * N < MIN_FILL * (-(-M // BM) * BM) * (-(-N // BN) * BN):
        return None
    # a double-buffered 64 x 64 tile: 4 x 8 a thread (128 threads, half the accumulators: more warps an
    # SM to hide the loads) rather than 8 x 8 (64 threads): ResNet-18's stem 0.338 -> 0.297 ms, its
    # layer1 Winograd products 0.164 -> 0.143, fvdb's SparseConv3d layer 0.988 -> 0.929
    TM = 4 if pipelined and (BM, BN) == (64, 64) else 8 if BM >= 64 else 4
    TN = 8 if BN >= 64 else 4
    # Gemm and MatMul (not pipelined): 64 x 128 tiles with k steps of 16 where the sides would be 128 x 128
    # (128 threads, 8 x 8 a thread): over ten transformer products of 48-600 such tiles (BERT, ViT, DeiT
    # shapes; benchmarks/experiments/sweep_gemm.py, H100) 1.04x the best of 36 tilings on geomean, worst
    # 1.13x, where 128 x 128 with k steps of 8 took 1.24x, worst 1.52x (a wave's blocks, and shared loads)
    wide_k = not pipelined and (BM, BN) == (128, 128)
    if wide_k:
        BM = 64
    NT = (BM // TM) * (BN // TN)
    # (not a narrow product: Winograd's 36 fill the GPU however few tiles each has; k steps of 8 measured)
    deep = pipelined and not narrow and -(-M // BM) * -(-N // BN) <= DEEP_TILES
    # every thread copies whole float4s of both tiles each step: BK grows until they divide evenly
    BK = next(bk for bk in ((16, 32, 8) if deep or wide_k else (8, 16, 32))
              if (BM * bk // 4) % NT == 0 and (BN * bk // 4) % NT == 0)
    return Tiling(M, N, K, nbatch, BM, BN, TM, TN, BK, m_fast, double=deep or (pipelined and (BM, BN) == (64, 64)))


# ---- the search space of a tiling (luisaml/tune.py measures it) -------------------------------------

# a tuned tiling's bounds: shared memory well under the 48 KiB a kernel gets without opting in, and a
# thread's accumulators (TM x TN) at most the rules' 64
MAX_SHARED_BYTES = 32 * 1024
_SIDES, _THREAD_SIDES, _STEPS = (32, 64, 128), (4, 8), (8, 16, 32)


def as_choice(tl: Tiling) -> dict:
    """Return a tiling's schedule as data (Operator.schedule of a blocks stage)."""
    return {"form": "blocks", "BM": tl.BM, "BN": tl.BN, "TM": tl.TM, "TN": tl.TN, "BK": tl.BK, "double": tl.double}


def _valid(BM: int, BN: int, TM: int, TN: int, BK: int, double: bool) -> bool:
    if BM not in _SIDES or BN not in _SIDES or TM not in _THREAD_SIDES or TN not in _THREAD_SIDES or BK not in _STEPS:
        return False
    if BM % TM or BN % TN or TM * TN > 64:
        return False
    NT = (BM // TM) * (BN // TN)
    if not 32 <= NT <= 512 or (BM * BK // 4) % NT or (BN * BK // 4) % NT:
        return False
    return (2 if double else 1) * BK * (BM + BN) * 4 <= MAX_SHARED_BYTES


def tuned(tl: Tiling | None, choice: dict | None) -> Tiling | None:
    """Return the tiling with a tuned schedule's tile sizes (the rules' tiling where there is none,
    or where it is not a valid blocks schedule: a hand-edited cache entry cannot make a bad kernel)."""
    if tl is None or not choice or choice.get("form") != "blocks":
        return tl
    try:
        v = (int(choice["BM"]), int(choice["BN"]), int(choice["TM"]), int(choice["TN"]), int(choice["BK"]),
             bool(choice["double"]))
    except (KeyError, TypeError, ValueError):
        return tl
    if not _valid(*v):
        return tl
    BM, BN, TM, TN, BK, double = v
    return Tiling(tl.M, tl.N, tl.K, tl.nbatch, BM, BN, TM, TN, BK, tl.m_fast, double=double)


def candidates(tl: Tiling, wide: bool) -> list[dict]:
    """Return the schedules a search measures for a product the rules tile as `tl`: the rules'
    first, then tilings near it (k steps, double buffering, the tile's sides and a thread's share),
    4 in all or (wide) up to 16; every one a valid tiling (`_valid`), none with a side past twice
    the product's."""
    rule = (tl.BM, tl.BN, tl.TM, tl.TN, tl.BK, tl.double)
    out = [rule]

    def add(*v) -> None:
        BM, BN = v[0], v[1]
        if v not in out and _valid(*v) and BM <= max(32, 2 * tl.M) and BN <= max(32, 2 * tl.N):
            out.append(v)

    BM, BN, TM, TN, BK, double = rule
    for bm, bn in ((BM, BN // 2), (BM // 2, BN)):  # smaller tiles: more blocks (a product that fills few waves)
        add(bm, bn, 4 if bm <= 32 else 8, 4 if bn <= 32 else 8, BK, double)
    for bk in _STEPS:
        add(BM, BN, TM, TN, bk, double)
    add(BM, BN, TM, TN, BK, not double)
    for bm, bn in ((BM, BN // 2), (BM // 2, BN), (BM, BN * 2), (BM * 2, BN), (BM // 2, BN // 2), (BM * 2, BN * 2)):
        for tm, tn in ((TM, TN), (4 if bm <= 32 else 8, 4 if bn <= 32 else 8), (4, 8), (8, 4), (4, 4)):
            for bk in (BK,) + _STEPS:
                for d in (double, not double):
                    add(bm, bn, tm, tn, bk, d)
    out = out[:16 if wide else 4]
    keys = ("BM", "BN", "TM", "TN", "BK", "double")
    return [{"form": "blocks", **dict(zip(keys, v))} for v in out]


def product_schedules(op, blocks: bool, wide: bool, items: Callable[[], list[dict]],
                      fixed: Callable[[Tiling], bool] | None = None) -> list[dict]:
    """Return the candidate schedules (Operator.schedules) of a product whose operands are inputs 0
    and 1 (Gemm, MatMul, Conv): none unless they and the output are float; else, with the node's
    tuned schedule set aside so that the rules' choice comes first, the blocks form's `candidates`
    of its block_tiling() (none without one, or where `fixed(tiling)`: a tiling with no knob
    searched), or the items form's `items()`."""
    if any(t.dtype.dsl != "float" for t in (op.input(0), op.input(1), op.output())):
        return []
    saved, op.schedule = op.schedule, None
    try:
        if blocks:
            tl = op.block_tiling()
            return [] if tl is None or (fixed is not None and fixed(tl)) else candidates(tl, wide)
        return items()
    finally:
        op.schedule = saved


# ---- tiles whose rows are samples (a grouped blocks stage: Operator.block_samples) -----------------


def group_rows(ctx, samples: int, rows_per_sample: int = 1) -> str:
    """Return the rows of this block's group that exist (emit's m_limit): `samples` samples from the
    group's first, fewer in the last group of a batch, `rows_per_sample` rows each."""
    rows = f"min(n_samples - sample, {samples})"
    return ctx.let(f"{rows} * {rows_per_sample}" if rows_per_sample > 1 else rows, "grows")


def at_group_sample(ctx, u: str, name: bool = True):
    """Return the bindings of sample `sample + u` of the group (to enter with `with`): another
    sample's rows are read and written there, never at an offset from the group's first sample (a
    pooled buffer's samples lie its slot's size apart, and a slot is as large as its largest tensor).
    name: the sample's index in a variable of its own (for bindings entered many times)."""
    s = ix.add(ctx.sample, u)
    return ctx.at_sample(ctx.let(s, "rs") if name else s)


# A gathered operand (a RowLoader's function made by `gathered`: fvdb's SparseConv3d, whose A row is
# read through the kernel map) may be loaded a step apart: the index (the map's entry) of step kt + 2
# during step kt, into registers that step does not use, so that step kt + 1's value loads read an
# index already there. Loaded together (a plain loader), the value's load waits for the index's round
# trip, and every k step each warp stalls a lookup's latency before its first FFMA (ptxas keeps the
# loads before the FFMAs, but cannot issue the second before the first returns: benchmarks/NOTES.md,
# "The FP32 tile's next step in flight"). The same loads of the same elements, the same sums: the
# results are bit-identical; it costs the index registers (SparseConv3d: 72 -> 79 a thread).


def gathered(load: Callable[[str], str], index: Callable[[str], str], value: Callable[[str, str], str],
             period: int | None = None):
    """Return `load` (k -> the element of a row read through an index) marked as a gather: index(k) the
    index's expression (an int; it may emit lets), value(k, i) the element at index i. load(k) must be
    value(k, index(k)) (what a tile that does not split the loads emits).
    period (optional): index(k) depends on k // period only (SparseConv3d: a tap's C_in channels read
    one map entry), so the tile loads it again only where a step starts a new period."""
    load.index, load.value, load.period = index, value, period
    return load


@dataclass(frozen=True)
class Step:
    """A whole k step, as a loader marked `by_step` takes it beside its k: the step's first k, k0 (a
    multiple of BK), and kk = k - k0 (in [0, BK)). For a period d that BK divides, k // d = k0 // d and
    k % d = k0 % d + kk (`divmod`): k0's part is the same for every thread of the block, so the
    compilers compute it once a step (uniform registers, one shared read of SparseConv3d's tap) rather
    than once a lane from each thread's k (benchmarks/NOTES.md, "addresses a tap, not a step")."""

    k0: str
    kk: str
    BK: int

    def divmod(self, d: int) -> tuple[str, str] | None:
        """(k // d, k % d) through k0, or None where BK does not divide d."""
        if d % self.BK:
            return None
        return ix.div(self.k0, d), ix.add(ix.mod(self.k0, d), self.kk)


def by_step(load: Callable[..., str]):
    """Return `load` (k -> an element) marked to take, inside a whole k step, the step too: load(k, step)
    with step a `Step` there, load(k) in a ragged step (k may pass K)."""
    load.by_step = True
    return load


# a(bi, m) emits what row m of A needs once (before the k loop) and returns k -> A[bi, m, k];
# b(bi, n) the same for column n of B; finish(bi, m, n, acc) the value of a finished sum (bias,
# scale) and store(bi, m, n, value) the line storing it
RowLoader = Callable[[str, str], Callable[[str], str]]
Finish = Callable[[str, str, str, str], str]


def emit(ctx, tl: Tiling, item: str, thread: str, a: RowLoader, b: RowLoader, finish: Finish, store: Finish,
         a_m_contiguous: bool, b_quad: RowLoader | None = None, k_steps: str | None = None,
         m_limit: str | None = None) -> None:
    """Emit block `item`'s tile (item < tl.blocks) for thread `thread` of tl.threads.
    a_m_contiguous: A's consecutive rows are consecutive in memory (Conv's im2col view of NCHW);
    otherwise its consecutive k are (a row-major Gemm A): the copy then walks k fastest.
    b_quad(bi, n) (optional, n a multiple of 4): k -> the float4 B[bi, k, n .. n + 3] in one load.
    k_steps (optional): the tile's number of k steps, a run-time expression, for a product that
    skips whole steps of its k range (fvdb's SparseConv3d runs only the taps its tile's voxels
    read): a and b then receive the compacted k (below k_steps x BK), which they map to the real
    one, and K must be a multiple of BK (every step whole).
    m_limit (optional): the rows of the product that exist, a run-time expression of at least 1 (a
    tile of samples at the end of the batch: SparseConv3d over voxels as the batch); rows at or past
    it load row m_limit - 1 and store nothing."""
    M, N, K, BM, BN, TM, TN, BK = tl.M, tl.N, tl.K, tl.BM, tl.BN, tl.TM, tl.TN, tl.BK
    if k_steps is not None and K % BK:
        raise ValueError(f"k_steps needs whole k steps: K = {K} is not a multiple of BK = {BK}")
    NT = tl.threads
    double = tl.double
    if not double or N % BN or K % BK:
        b_quad = None
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
    nbuf = 2 if double else 1
    a_size, b_size = BK * BM // 4, BK * BN // 4
    a_sh = ctx.shared_array("float4", nbuf * a_size, "ash")
    b_sh = ctx.shared_array("float4", nbuf * b_size, "bsh")

    def copies(side: int, quad_fast: bool, base: str, limit: int | str, loader: RowLoader, quad: RowLoader | None):
        """Return this thread's float4s of a tile, fixed over k: [(shared index, k offset within the
        step, [(in-range condition or None, k -> load)] x 4, or one k -> float4 load)]."""
        quads = side // 4
        out = []
        for e in range(side * BK // 4 // NT):
            u = f"({ix.add(thread, str(e * NT))})" if e else thread
            q, kk = (ix.mod(u, quads), ix.div(u, quads)) if quad_fast else (ix.div(u, BK), ix.mod(u, BK))
            q, kk = ctx.let(q, "q"), ctx.let(kk, "kk")
            if quad is not None:
                lanes = [(None, quad(bi, ctx.let(ix.add(base, ix.mul(q, 4)), "g")))]
            else:
                lanes = []
                for lane in range(4):
                    g = ctx.let(ix.add(base, ix.mul(q, 4), str(lane)), "g")
                    cond = f"{g} < {limit}" if isinstance(limit, str) or limit % side else None
                    last = limit - 1 if isinstance(limit, int) else f"{limit} - 1"
                    lanes.append((cond, loader(bi, g if cond is None else f"min({g}, {last})")))
            out.append((ctx.let(ix.add(ix.mul(kk, quads), q), "sh"), kk, lanes))
        return out

    ahead = [(a_sh, a_size, *c) for c in copies(BM, a_m_contiguous, m0, m_limit or M, a, None)] + \
            [(b_sh, b_size, *c) for c in copies(BN, True, n0, N, b, b_quad)]
    regs = [[ctx.fresh("pf") for _ in lanes] for (_, _, _, _, lanes) in ahead]
    steps = -(-K // BK) if k_steps is None else k_steps
    many = k_steps is not None or steps > 1  # (with k_steps: a tile may have 0 or 1 steps as well)
    # the gathered lanes' indices of the step after the one the registers hold next
    split = many and any(hasattr(ld, "index") for c in ahead for _, ld in c[4])
    index_regs = [[ctx.fresh("pi") if split and hasattr(ld, "index") else None for _, ld in lanes]
                  for (_, _, _, _, lanes) in ahead]

    def fetch(k0: str, ragged: bool, indexed: bool = False) -> None:
        """Load the step at k0 into the registers (ragged: k may pass K); indexed: the gathered lanes'
        values at the indices already in their index registers."""
        for (_, _, _, kk, lanes), names, inames in zip(ahead, regs, index_regs):
            k = ctx.let(ix.add(k0, kk), "k")
            step = None if ragged else Step(k0, kk, BK)  # (a whole step: its loaders may take k's tap from k0)
            for (cond, load), name, iname in zip(lanes, names, inames):
                conds = [c for c in (cond, f"{k} < {K}" if ragged else None) if c]
                kc = f"min({k}, {K - 1})" if ragged else k
                if indexed and iname:
                    value = load.value(kc, iname)
                else:
                    value = load(kc, step) if step and getattr(load, "by_step", False) else load(kc)
                ctx.line(f"{name} = " + (f"({value} if {' and '.join(conds)} else 0.0)" if conds else value))

    def fetch_index(k0: str, ragged: bool) -> None:
        """Load the gathered lanes' indices of the step at k0 into their index registers (the same
        clamped k as its values will read: an index past K or past the rows is read, never used)."""
        for (_, _, _, kk, lanes), inames in zip(ahead, index_regs):
            if not any(inames):
                continue
            k = ctx.let(ix.add(k0, kk), "k")
            for (_, load), iname in zip(lanes, inames):
                if iname:
                    ctx.line(f"{iname} = {load.index(f'min({k}, {K - 1})' if ragged else k)}")

    def put(buf: str | None) -> None:
        """Store the registers into shared buffer `buf` (0 or 1; None: the only one)."""
        for (dst, size, idx, _, _), names in zip(ahead, regs):
            at = idx if buf is None else ix.add(idx, ix.mul(buf, size))
            ctx.line(f"{dst}[{at}] = " + (names[0] if len(names) == 1 else f"float4({', '.join(names)})"))

    acc = [[ctx.fresh("acc") for _ in range(TN)] for _ in range(TM)]
    for row in acc:
        for name in row:
            ctx.line(f"{name} = 0.0")
    fetch("0", K < BK)
    if split:  # step 1's indices (0 where there is no step 1: started by no load, which LLVM would
        # fold with the loop's into one load at the loop's top, where it waits again: NOTES, "Why the
        # unrolled k loop bought nothing")
        for iname in (i for names in index_regs for i in names if i):
            ctx.line(f"{iname} = 0")
        ctx.line(f"if {steps} > 1:")
        with ctx.indent():
            fetch_index(str(BK), K % BK != 0)
    if double:
        put(None)
        ctx.line("sync_block()")
    with ctx.loop(steps, "kt") as kt:
        a_off = b_off = "0"
        if not double:
            put(None)
            ctx.line("sync_block()")
        elif many:
            cur = ctx.let(ix.mod(kt, 2), "cur")
            a_off, b_off = ctx.let(ix.mul(cur, a_size), "ao"), ctx.let(ix.mul(cur, b_size), "bo")
        if many:  # the next step's operands, in flight during this step's multiply-adds
            ctx.line(f"if {kt} + 1 < {steps}:")
            with ctx.indent():
                fetch(ctx.let(ix.mul(ix.add(kt, "1"), BK), "k0"), K % BK != 0, split)
                if split:  # (after the values: they read the index registers these loads replace)
                    periods = {ld.period for c in ahead for _, ld in c[4] if hasattr(ld, "index")}
                    period = periods.pop() if len(periods) == 1 else None
                    new = (f" and ({ix.mul(ix.add(kt, '2'), BK)}) % {period} == 0"
                           if period and period % BK == 0 and K % BK == 0 and period > BK else "")
                    ctx.line(f"if {kt} + 2 < {steps}{new}:")
                    with ctx.indent():
                        fetch_index(ctx.let(ix.mul(ix.add(kt, "2"), BK), "k0"), K % BK != 0)
        for kk in range(BK):
            av = [ctx.let(f"{a_sh}[{ix.add(tr, a_off, str(kk * BM // 4 + g * rows))}]", "a") for g in range(TM // 4)]
            bv = [ctx.let(f"{b_sh}[{ix.add(tc, b_off, str(kk * BN // 4 + g * cols))}]", "b") for g in range(TN // 4)]
            for i in range(TM):
                for j in range(TN):
                    ctx.line(f"{acc[i][j]} = fma({av[i // 4]}.{'xyzw'[i % 4]}, {bv[j // 4]}.{'xyzw'[j % 4]}, {acc[i][j]})")
        if not double:
            ctx.line("sync_block()")
        elif many:
            ctx.line(f"if {kt} + 1 < {steps}:")
            with ctx.indent():
                put(f"(1 - {cur})")
            ctx.line("sync_block()")
    for i in range(TM):  # row i of the thread: lane i % 4 of group i // 4
        m = ctx.let(ix.add(m0, ix.mul(tr, 4), str((i // 4) * rows * 4 + i % 4)), "m")
        for j in range(TN):
            n = ctx.let(ix.add(n0, ix.mul(tc, 4), str((j // 4) * cols * 4 + j % 4)), "n")
            conds = [c for c in (f"{m} < {m_limit}" if m_limit else f"{m} < {M}" if M % BM else None,
                                 f"{n} < {N}" if N % BN else None) if c]
            if conds:
                ctx.line(f"if {' and '.join(conds)}:")
                ctx.level += 1
            # the finished value first, one statement: an epilogue (Relu) may read it twice
            ctx.line(store(bi, m, n, ctx.let(finish(bi, m, n, acc[i][j]), "f")))
            if conds:
                ctx.level -= 1
