"""SparseConv3d: the gather-GEMM over a kernel map (SparseConvKernelMap, kernel_map.py).

A layer is a plain items operator whose output takes the usual epilogues (BatchNormalization,
Relu); the map it reads is an edge of the graph that every layer over the same grid pair shares.
Over grids bound at run time the voxels are the batch, and SparseConv3d reads the features of the
sample each tap names (KernelContext.at_sample); it sees the whole batch (VoxelBatch).

A convolution work item is R output voxels x O output channels, the channel blocks of a voxel block
on consecutive threads, weights prepacked [tap][C_in][C_out] so a thread's O weights are consecutive
words and a warp reads whole rows of them. A tap no voxel of the block has is skipped.

A surface's voxel reads few of the 27 taps, so work is cut to the taps read: a GPU tile ORs its
voxels' tap masks and walks k over that list (operators/tiled.py emit's `k_steps`), a CPU item skips
a tap none of its voxels read, and a map known at compile time orders the voxels by tap set (a
derived input, `rows_by_taps`) so that neighbours in a tile share taps (27 -> 12.0 taps a 64-row tile
on the benchmark's shell, 10.5 a voxel), packed into the FP32 tile's 64-row tiles where that runs fewer
(each tap set's whole tiles, then the rest greedily: 11.1). On CUDA the layer is a blocks stage, an implicit GEMM over k = (tap, input
channel), A gathered through the map; over grids bound at run time a grouped one
(operators/tiled.py: a block's tile rows are 64 consecutive samples): 4.53 -> 1.54 ms for the
benchmark's map and layer over 198k voxels. With compile(tensor_cores="auto") the same product runs
on the TF32 mma tile (operators/tiled_mma.py, which has no k_steps): k walks the tile's tap list
compacted, a step past its count loads nothing (zeros into the mma), a folded map's K is the most
taps any tile reads, and over voxels as the batch a tile is 128 consecutive samples.
"""
from __future__ import annotations

import contextlib

import dataclasses

import numpy as np

from luisaml import dtypes
from luisaml import indexing as ix
from luisaml.fvdb.nanovdb import popcount64
from luisaml.fvdb.op_mixins import VoxelBatch
from luisaml.model import shape_str
from luisaml.operator import Derived, Operator
from luisaml.opsets import fvdb as schema
from luisaml.registry import register

from .common import rule_types
from .kernel_map import gather_links, map_index

def rows_by_taps(kernel_map, tile: int = 0) -> np.ndarray:
    """Return the output voxels (int32 [N_out]) ordered by the set of taps each reads (stable).

    Why: a work item (CPU) or a tile (GPU) runs only the taps one of its voxels reads, and voxels
    that read the same taps are scattered over a grid. On a one-voxel sphere shell (~200k voxels,
    10.5 of 27 taps a voxel) a 128-voxel tile in index order reads 20.7 taps, in this order 13.0;
    two voxels 14.1 against 10.5.
    tile (rows, a map of at most 28 taps): packed for tiles of that many rows (`_packed`) where its
    tiles then run fewer taps in all: 12.04 -> 11.06 taps a 64-row tile on bench_fvdb's shell
    (benchmarks/NOTES.md, "addresses a tap, not a step")."""
    active = np.asarray(kernel_map) >= 0
    taps = active.shape[1]
    words = [(active[:, w:w + 32].astype(np.uint64) << np.arange(min(32, taps - w), dtype=np.uint64)).sum(1)
             for w in range(0, taps, 32)]
    order = np.lexsort(words[::-1]).astype(np.int32) if len(active) else np.zeros(0, np.int32)
    if not tile or not 0 < taps <= 28 or not len(active):
        return order
    packed = _packed(active, tile)  # (greedy: on a small grid it may run more taps, 105 against 104)
    return packed if tile_taps(active[packed], tile).sum() < tile_taps(active[order], tile).sum() else order


def tile_taps(active: np.ndarray, tile: int) -> np.ndarray:
    """The taps each `tile`-row tile of rows whose taps are `active` (bool [rows, taps]) reads (the
    last tile padded with rows of none)."""
    a = np.concatenate([active, np.zeros((-len(active) % tile, active.shape[1]), bool)])
    return a.reshape(-1, tile, active.shape[1]).any(1).sum(1)


def _packed(active: np.ndarray, tile: int) -> np.ndarray:
    """The rows in tiles of `tile`: each tap set's whole tiles first (a tile of one set runs its taps
    only), then tiles filled greedily, the largest remainder of a set first, then the remainders whose
    sets add the fewest taps to the tile's (ties: the larger). Tiles in the lexsorted order cut sets
    at arbitrary rows and mix their neighbours' taps in; a row's sum is the same in any tile (the taps
    its voxel lacks add zeros), so the order moves no value."""
    taps = active.shape[1]
    masks = (active.astype(np.int64) << np.arange(taps)).sum(1)
    order = np.argsort(masks, kind="stable")
    m = masks[order]
    starts = np.flatnonzero(np.r_[True, m[1:] != m[:-1]])
    lens = np.diff(np.r_[starts, len(m)])
    whole = lens // tile * tile
    # each set's whole tiles: the rows of its group before its remainder, in the sorted order
    head = order[np.arange(len(m)) - np.repeat(starts, lens) < np.repeat(whole, lens)]
    cut = lens > whole  # (the sets with a remainder: where it starts, its rows, its taps)
    at0, left = (starts + whole)[cut], (lens - whole)[cut]
    rmask = m[at0]
    taken = np.zeros(len(left), np.int64)
    out, union, space = [head], 0, tile
    while left.any():
        if space == tile:
            i = int(np.argmax(left))
        else:  # (the taps each remainder adds to the tile's; one used up: more than any)
            new = np.where(left > 0, popcount64(rmask & ~union), taps + 1)
            i = int(np.lexsort((-left, new))[0])
        n = int(min(space, left[i]))
        at = at0[i] + taken[i]
        out.append(order[at:at + n])
        taken[i] += n
        left[i] -= n
        union |= int(rmask[i])
        space -= n
        if space == 0:
            union, space = 0, tile
    return np.concatenate(out).astype(np.int32)


# Accumulators per thread: R voxels x O channels within 32 (operators/gemm.py: 32 floats keep the
# CPU backend's tiles in vector registers; 32 of a GPU thread's registers).
MAX_ACC = 32
MAX_CHANNELS = 16


def conv_tile(n_out: int, c_out: int) -> tuple[int, int]:
    """Return (R output voxels, O output channels) of a SparseConv3d work item: O a multiple of 4 up
    to MAX_CHANNELS that pads C_out least (then the widest), R the voxels that fill MAX_ACC (at
    most 4: a tap is skipped only when no voxel of the block has it)."""
    n4 = max(-(-c_out // 4), 1) * 4
    O = n4 if n4 <= MAX_CHANNELS else min(range(4, MAX_CHANNELS + 1, 4), key=lambda o: (-(-c_out // o) * o - c_out, -o))
    R = max(1, min(4, MAX_ACC // O, n_out))
    return R, O


@register(schema.SPARSE_CONV, domain="fvdb", since=1)
class SparseConv3d(VoxelBatch, Operator):
    """out[o] = bias + sum over taps t with kernel_map[o, t] >= 0 of weight[:, :, t] @ features[kernel_map[o, t]]."""

    stores_once = True
    # the TF32 mma tile on CUDA's blocks stage (luisaml/rewrites/tensor_cores.py sets it where
    # compile(tensor_cores="auto") found the route live)
    tensor_cores = False

    @classmethod
    def infer(cls, node, inputs):
        return rule_types(node, inputs, lambda ins: [schema.sparse_conv_rule(ins)])

    def check(self):
        x, kmap, w = self.input(0), self.input(1), self.input(2)
        self.expect_dtype(x, ("FLOAT",), "input 0 (features)")
        self.expect_dtype(w, ("FLOAT",), "input 2 (weight)")
        self.expect_dtype(kmap, ("INT32",), "input 1 (kernel_map)")
        # over grids bound at run time the voxels are the batch: features [1, C_in] and map [1, taps] a sample
        self.voxel_batch = x.batched or kmap.batched
        if self.voxel_batch:
            self.expect(x.batched and kmap.batched and x.shape[:1] == (1,) and kmap.shape[:1] == (1,)
                        and x.rank == 2 and kmap.rank == 2,
                        f"features '{x.name}' and kernel_map '{kmap.name}' must both have a row per voxel, the voxels "
                        f"the batch (a kernel map over grids bound at run time), got {shape_str(x.shape)} "
                        f"{'per sample' if x.batched else 'in all'} and {shape_str(kmap.shape)} "
                        f"{'per sample' if kmap.batched else 'in all'}")
            (_, self.c_in), (_, self.taps) = x.shape, kmap.shape
            self.n_in = self.n_out = 1  # (a sample: the batch dimension is 1 per sample)
        else:
            self.expect(x.rank == 2, f"features '{x.name}' must be [N_in, C_in], got {shape_str(x.shape)}")
            self.expect(kmap.rank == 2, f"kernel_map '{kmap.name}' must be [N_out, taps], got {shape_str(kmap.shape)}")
            self.n_in, self.c_in = x.shape
            self.n_out, self.taps = kmap.shape
        self.expect(w.rank == 5, f"weight '{w.name}' must be [C_out, C_in, k0, k1, k2], got {shape_str(w.shape)}")
        self.c_out = w.shape[0]
        self.expect(w.shape[1] == self.c_in, f"weight '{w.name}' {shape_str(w.shape)} has {w.shape[1]} input "
                    f"channels, features '{x.name}' {shape_str(x.shape)} have {self.c_in}")
        self.expect(int(np.prod(w.shape[2:])) == self.taps, f"weight '{w.name}' {shape_str(w.shape)} has "
                    f"{int(np.prod(w.shape[2:]))} taps, kernel_map '{kmap.name}' {shape_str(kmap.shape)} has {self.taps}")
        if self.has_input(3):
            self.expect_dtype(self.input(3), ("FLOAT",), "input 3 (bias)")
            self.expect_shape(self.input(3), (self.c_out,), "input 3 (bias)")
        for k in range(2 if self.voxel_batch else 0, len(self.inputs)):
            t = self.inputs[k]
            self.expect(t is None or not t.batched, f"input {k} '{t.name if t else ''}' follows the batch axis; "
                        "kernel maps, voxel features (over static grids) and weights are shared (give them static "
                        "shapes)")
        y = self.output()
        self.expect_shape(y, (self.n_out, self.c_out), "output")
        if kmap.value is not None:
            v = np.asarray(kmap.value)
            bad = (v < -1) | (v >= self.n_in)
            self.expect(not bad.any(), f"kernel_map '{kmap.name}' holds index "
                        f"{int(v[bad][0]) if bad.any() else 0} outside [-1, {self.n_in}) (the features' rows)")

    def row_links(self):
        return gather_links(self)

    def derived_inputs(self):
        # a kernel map known at compile time: its voxels run in rows_by_taps' order, packed for the FP32
        # tile's rows (the CUDA default; the CPU's items of a few voxels run as many taps either way)
        kmap = self.input(1)
        return ([Derived(rows_by_taps, (1,), dtypes.INT32, (self.n_out,), params=(("tile", self.PACKED_ROWS),))]
                if kmap.value is not None else [])

    def row(self, o: str) -> str:
        """Output voxel of the node's o-th row of work (rows_by_taps' order, when known)."""
        return self.derived[0].load(o) if self.derived else o

    def tiles(self) -> tuple[int, int, int, int]:
        """Return (R voxels, O channels, voxel blocks, channel blocks)."""
        R, O = conv_tile(self.n_out, self.c_out)
        return R, O, -(-self.n_out // R), -(-self.c_out // O)

    def work_items(self):
        _, _, blocks, cblocks = self.tiles()
        return blocks * cblocks

    def packed_weight(self):
        """Return the byte offset in the blob of the weight prepacked as float32 [tap][C_in][channel
        blocks x O], or None when the weight is not a constant of the weight blob."""
        from luisaml.plan import BlobWeight

        w = self.input(2)
        if w.value is None or not isinstance(w.home, BlobWeight):
            return None
        _, O, _, cblocks = self.tiles()

        def pack() -> np.ndarray:
            v = np.asarray(w.value, np.float32).reshape(self.c_out, self.c_in, self.taps).transpose(2, 1, 0)
            packed = np.zeros((self.taps, self.c_in, cblocks * O), np.float32)
            packed[..., : self.c_out] = v
            return packed

        return w.home.blob.add_packed(f"{w.name}/packed[{self.taps}x{self.c_in}x{cblocks * O}]", pack)

    def emit_item(self, ctx, item):
        if self.voxel_batch:
            self._emit_sample_item(ctx, item)
            return
        x, kmap, y = self.input(0), self.input(1), self.output()
        R, O, _, cblocks = self.tiles()
        C_in, C_out, T = self.c_in, self.c_out, self.taps
        cb = ctx.let(ix.mod(item, cblocks), "cb") if cblocks > 1 else "0"
        vb = ix.div(item, cblocks) if cblocks > 1 else item
        n0 = ctx.let(ix.mul(cb, O), "n")
        safe = C_out % O or O  # channels j >= safe may fall past C_out in the last block
        rows_in = self.n_out % R or R  # voxels r >= rows_in may fall past N_out in the last block
        outs = [ctx.let(ix.add(ix.mul(vb, R), str(r)), "o") for r in range(R)]
        loads = [o if r < rows_in else f"min({o}, {self.n_out - 1})" for r, o in enumerate(outs)]
        voxels = [ctx.let(self.row(o), "vox") for o in loads]  # the output voxels of the rows
        acc = [[ctx.fresh("acc") for _ in range(O)] for _ in range(R)]
        bias = self.input(3) if self.has_input(3) else None
        for j in range(O):
            col = ix.add(n0, str(j)) if j < safe else f"min({ix.add(n0, str(j))}, {C_out - 1})"
            init = ctx.let(bias.load(col), "bias") if bias is not None else "0.0"
            for r in range(R):
                ctx.line(f"{acc[r][j]} = {init}")
        packed = self.packed_weight()
        if packed is not None:
            wbase = ctx.let(ix.add(str(packed), ix.mul(cb, O * 4)), "wb")
        else:
            wcols = [ctx.let(ix.add(n0, str(j)) if j < safe else f"min({ix.add(n0, str(j))}, {C_out - 1})", "m")
                     for j in range(O)]
        # a kernel map fed at run time: an index past the features is flagged (run() raises naming
        # this node) and read as missing
        checked = kmap.value is None
        flag = ctx.flag_error(str(self.error(f"kernel_map '{kmap.name}' holds an index outside [-1, {self.n_in}) "
                                             f"(the rows of features '{x.name}')"))) if checked else None
        with ctx.loop(T, "tap") as tap:
            ks = []
            for r in range(R):
                ks.append(map_index(ctx, kmap.load(ix.add(ix.mul(voxels[r], T), tap)), self.n_in, flag, checked))
            if self.n_in > 0:  # (with no input voxels every tap is missing or flagged: the output is the bias)
                ctx.line(f"if {' or '.join(f'{k} >= 0' for k in ks)}:")
                with ctx.indent():
                    rows = [ctx.let(ix.mul(f"max({k}, 0)", C_in), "xr") for k in ks]
                    wt = ctx.let(ix.add(wbase, ix.mul(tap, C_in * cblocks * O * 4)), "wt") if packed is not None else None
                    with ctx.loop(C_in, "c") as c:
                        ws = self._weights_at(ctx, wt, None if packed is not None else wcols, c, tap)
                        for r in range(R):
                            xv = x.load(ix.add(rows[r], c))
                            a = ctx.let(xv if R == 1 else f"({xv} if {ks[r]} >= 0 else 0.0)", "a")
                            for j in range(O):
                                ctx.line(f"{acc[r][j]} = fma({a}, {ws[j]}, {acc[r][j]})")
        for r in range(R):
            for j in range(O):
                col = ix.add(n0, str(j))
                conds = ([] if r < rows_in else [f"{outs[r]} < {self.n_out}"]) + ([] if j < safe else [f"{col} < {C_out}"])
                ctx.line_if(" and ".join(conds) or None, y.store(ix.add(ix.mul(voxels[r], C_out), col), acc[r][j]))

    # ---- the GPU form: an implicit GEMM in blocks through shared memory (operators/tiled.py) ------
    # rows = output voxels (rows_by_taps' order when the map is known), columns = output channels,
    # k = (tap, input channel): A[o, k] is the feature row the kernel map names for tap (0 where it
    # names none), B the prepacked weight. A tile runs only the taps one of its voxels reads: the
    # block ORs its rows' tap masks first and walks k over that list (tiled.emit's k_steps).

    def _weights_at(self, ctx, wt: str | None, wcols: list[str] | None, c: str, tap: str) -> list[str]:
        """Emit the loads of a work item's O weights of input channel c at tap: from the prepacked row
        `wt` of the tap (packed_weight), else from the weight tensor at output channels wcols."""
        _, O, _, cblocks = self.tiles()
        if wt is not None:
            wk = ctx.let(ix.add(wt, ix.mul(c, cblocks * O * 4)), "wk")
            return [ctx.let(f"weights.read(float, {ix.add(wk, str(4 * j))})", "w") for j in range(O)]
        w, T = self.input(2), self.taps
        return [ctx.let(w.load(ix.add(ix.mul(wcols[j], self.c_in * T), ix.mul(c, T), tap)), "w") for j in range(O)]

    def _emit_sample_item(self, ctx, item) -> None:
        """A voxel a sample (grids bound at run time): O output channels of this sample's voxel, each
        tap's features read at the sample the map names (ctx.at_sample)."""
        if ctx.at_sample is None:
            raise self.error("over grids bound at run time it runs over the batch in stages; compile with "
                             "schedule='auto' or 'stages'")
        x, kmap, y = self.input(0), self.input(1), self.output()
        _, O, _, cblocks = self.tiles()
        C_in, C_out, T = self.c_in, self.c_out, self.taps
        cb = ctx.let(ix.mod(item, cblocks), "cb") if cblocks > 1 else "0"
        n0 = ctx.let(ix.mul(cb, O), "n")
        safe = C_out % O or O  # channels j >= safe may fall past C_out in the last block
        cols = [ix.add(n0, str(j)) if j < safe else f"min({ix.add(n0, str(j))}, {C_out - 1})" for j in range(O)]
        bias = self.input(3) if self.has_input(3) else None
        acc = [ctx.fresh("acc") for _ in range(O)]
        for j in range(O):
            ctx.line(f"{acc[j]} = {ctx.let(bias.load(cols[j]), 'bias') if bias is not None else '0.0'}")
        packed = self.packed_weight()
        if packed is not None:
            wbase = ctx.let(ix.add(str(packed), ix.mul(cb, O * 4)), "wb")
        else:
            wcols = [ctx.let(c, "m") for c in cols]
        flag = ctx.flag_error(str(self.error(f"kernel_map '{kmap.name}' holds an index outside [-1, batch) (the rows "
                                             f"of features '{x.name}')")))
        with ctx.loop(T, "tap") as tap:
            k = map_index(ctx, kmap.load(tap), ctx.n_samples, flag)
            ctx.line(f"if {k} >= 0:")
            with ctx.indent():
                wt = ctx.let(ix.add(wbase, ix.mul(tap, C_in * cblocks * O * 4)), "wt") if packed is not None else None
                with ctx.loop(C_in, "c") as c:
                    ws = self._weights_at(ctx, wt, None if packed is not None else wcols, c, tap)
                    with ctx.at_sample(k):  # the features of the voxel this tap reads
                        a = ctx.let(x.load(c), "a")
                    for j in range(O):
                        ctx.line(f"{acc[j]} = fma({a}, {ws[j]}, {acc[j]})")
        for j in range(O):
            col = ix.add(n0, str(j))
            ctx.line_if(None if j < safe else f"{col} < {C_out}", y.store(col, acc[j]))

    # The FP32 tile's form (the A/B of benchmarks/NOTES.md, "The FP32 tile's next step in flight"; the
    # results bit-identical in all four):
    # "early": as before: the tile's list of taps ORed over the rows of all its 128 threads (its 64 and
    #   the next tile's: a superset, 13.0 taps a tile where its own rows read 12.0 on bench_fvdb's
    #   shell), B as 4 loads of a word a thread and k, the gather's map entry and features loaded
    #   together (the features' load waits for the entry's round trip every k step).
    # "rows": the taps of the tile's own rows (8% fewer k steps there), B as one 16-byte load (Conv's
    #   b_quad: 3 fewer loads a step); the gather as early (72 registers, as before).
    # "ahead" (default): as rows, and the map's entries loaded a step ahead of the features
    #   (tiled.gathered), once a tap: no load waits on another within a step, at 79 registers (6 blocks an
    #   SM, not 7). The fastest on an H100 (2026-12-07, bench_fvdb's layer, lexsorted rows): early 0.927 ms,
    #   rows 0.812, ahead 0.746 (NOTES, "The fifth session's GPU run").
    # "uniform": as rows, a step's tap and channel from its first k (tiled.by_step), the same for the whole
    #   block: 375 -> 367 instructions a step, 66 -> 49 integer, 72 registers (NOTES, "addresses a tap, not
    #   a step"; keeping the rows' addresses a tap and bumping them cost 77-89 registers). Not yet on a GPU.
    fp32_form = "ahead"

    # the tile rows_by_taps packs a folded map's voxels for: the FP32 tile's 64 (the mma tile's 128 then
    # read 14.2 taps, most 27, against 13.0 and 24 lexsorted; its route is off by default). 0: lexsorted.
    PACKED_ROWS = 64

    # over voxels as the batch, the tiling is chosen as for a grid of this many voxels; a block then
    # covers BM consecutive samples (block_samples)
    NOMINAL_VOXELS = 1 << 16

    def block_tiling(self):
        from luisaml.operators import tiled

        if self.n_in == 0 or self.n_out == 0:
            return None
        rows = self.NOMINAL_VOXELS if self.voxel_batch else self.n_out
        if self.tensor_cores:  # (luisaml/rewrites/tensor_cores.py; None: too few rows or channels for it)
            mma = self._mma_tiling(rows)
            if mma is not None:
                return mma
        # Conv's double-buffered 64 x 64 tiles (pipelined): 1.100 -> 0.989 ms on the H200 benchmark;
        # their 128 threads of 4 x 8 rather than 64 of 8 x 8: 0.988 -> 0.929 ms (twice the warps to hide
        # the gathers of rows from all over the grid)
        tl = tiled.choose(rows, self.c_out, self.taps * self.c_in, 1, m_fast=False, pipelined=True)
        if tl is not None and self.voxel_batch:
            tl = dataclasses.replace(tl, M=tl.BM)  # one tile of rows: a group of samples
        return tl

    def _mma_tiling(self, rows: int, sides: tuple[int, int] | None = None):
        """The tensor-core tiling (operators/tiled_mma.py) of the gather-GEMM, or None where
        tiled_mma.choose declines it (fewer than 64 voxels or 32 output channels). Over voxels as the
        batch a block's rows are BM consecutive samples. A map known at compile time whose tiles skip
        taps has K cut to the most taps any tile's voxels read (times C_in): the steps past a tile's
        own count run on zeros, so fewer steps in all is less of that waste (24 of 27 taps on the
        benchmark's shell, 128-voxel tiles in rows_by_taps' lexsorted order, PACKED_ROWS = 0; 13.0 on
        average; packed for the FP32 tile's 64 rows, the default: 27, 14.2). sides: (BM, BN)
        in place of choose's (benchmarks/bench_fvdb.py --mma-tiles measures them)."""
        from luisaml.operators import tiled_mma

        sms = 0
        if not self.voxel_batch:  # (a product launched whole: choose may take smaller tiles to fill the SMs)
            from luisaml.device import sm_count

            sms = sm_count()
        tl = tiled_mma.choose(rows, self.c_out, self.taps * self.c_in, 1, sms=sms)
        if tl is None:
            return None
        if sides is not None:
            tl = dataclasses.replace(tl, BM=sides[0], BN=sides[1])
        if self.voxel_batch:
            return dataclasses.replace(tl, M=tl.BM)  # one tile of rows: a group of samples
        if self.input(1).value is not None and self.skips_taps(tl):
            return dataclasses.replace(tl, K=self._most_taps_a_tile(tl.BM) * self.c_in)
        return tl

    def _tile_taps(self, BM: int) -> np.ndarray:
        """The taps the voxels of each BM-row tile of a folded map read (rows_by_taps' order)."""
        cache = self.__dict__.setdefault("_tile_taps_cache", {})
        if BM not in cache:
            kmap = np.asarray(self.input(1).value)
            cache[BM] = tile_taps((kmap >= 0)[rows_by_taps(kmap, self.PACKED_ROWS)], BM)
        return cache[BM]

    def _most_taps_a_tile(self, BM: int) -> int:
        """The most taps the voxels of one BM-row tile read, at least 1: a folded map's mma K in taps."""
        return max(int(self._tile_taps(BM).max(initial=0)), 1)

    # K variants of the mma tile (1: one): a block runs the one of fewest k steps that holds its tile's
    # taps, so that fewer steps run on zeros. Not the default until measured (bench_fvdb --mma-tiles
    # 128,64,3).
    mma_buckets = 1

    def _tap_buckets(self, tl) -> list[int]:
        """The K variants' taps, ascending, the last tl.K / C_in: for a folded map the mma_buckets
        bounds that run the fewest k steps over its tiles; for one built at run time, of unknown tiles,
        at 60% and 80% of the taps (index order: ~20.7 of 27 a 128-voxel tile on the benchmark)."""
        import itertools

        most = tl.K // self.c_in
        n = min(self.mma_buckets, most)
        if n <= 1:
            return [most]
        if self.input(1).value is None or self.voxel_batch:
            return sorted({max(1, round(most * f)) for f in (0.6, 0.8)[-(n - 1):]} - {most}) + [most]
        counts = np.bincount(self._tile_taps(tl.BM), minlength=most + 1)
        seen = [u for u in range(1, most) if counts[u]]  # (a bound no tile has would be a variant never run)

        def steps(bounds) -> int:
            return sum(int(c) * next(b for b in bounds if b >= u) for u, c in enumerate(counts) if c)

        cuts = itertools.combinations(seen, min(n - 1, len(seen)))
        return list(min((cut + (most,) for cut in cuts), key=steps))

    def block_samples(self) -> int:
        tl = self.block_tiling()
        return tl.BM if self.voxel_batch and tl is not None else 1

    def _at_row(self, ctx, o: str):
        """Return (the bindings to enter, the row index under them) of the node's o-th row of work:
        over voxels as the batch, sample `sample + o` itself, at row 0 (a pooled buffer's samples lie
        its slot's size apart, which may be more than a row); otherwise row(o) of the node's tensors."""
        from luisaml.operators import tiled

        if self.voxel_batch:
            return tiled.at_group_sample(ctx, o), "0"
        return contextlib.nullcontext(), self.row(o)

    def skips_taps(self, tl) -> bool:
        """Whether the tiles run only their voxels' taps: a k step must lie within one tap."""
        return self.c_in % tl.BK == 0

    def emit_tile_taps(self, ctx, tl, item: str, thread: str, limit: str | int) -> tuple[str, str]:
        """Emit the tile's list of taps (those some voxel of its rows reads, in tap order) into
        shared memory, `limit` the rows that exist; return (the list's shared array, its length)."""
        T, NT, BM = self.taps, tl.threads, tl.BM
        kmap = self.input(1)
        words = -(-T // 32)
        m0 = ctx.let(ix.mul(ix.div(item, tl.col_blocks) if tl.col_blocks > 1 else item, BM), "tm0")
        masks = ctx.shared_array("uint", NT * words, "tapmask")
        taps = ctx.shared_array("int", T, "taps")
        bits = [ctx.fresh("bits") for _ in range(words)]
        for name in bits:
            ctx.line(f"{name} = uint(0)")
        for e in range(-(-BM // NT)):  # this thread's rows of the tile
            r = ctx.let(ix.add(m0, ix.add(thread, str(e * NT)) if e else thread), "tr")
            at_row, rr = self._at_row(ctx, r)
            # (a block of more threads than rows: the threads past the tile's rows read none, else
            # their rows, the next tile's, add its taps to this one's: 13.0 -> 12.0 taps a 64-row tile
            # on bench_fvdb's shell; the taps dropped are zeros to every row of the tile)
            past = (f"{ix.add(thread, str(e * NT)) if e else thread} < {BM} and "
                    if (e + 1) * NT > BM and self.fp32_form != "early" else "")
            ctx.line(f"if {past}{r} < {limit}:")
            with ctx.indent(), at_row:
                kr = ctx.let(ix.mul(rr, T), "kr")
                for w, name in enumerate(bits):
                    with ctx.loop(min(32, T - 32 * w), "tb") as b:
                        ctx.line(f"if {kmap.load(ix.add(kr, b, str(32 * w)) if w else ix.add(kr, b))} >= 0:")
                        with ctx.indent():
                            ctx.line(f"{name} = {name} | (uint(1) << uint({b}))")
        for w, name in enumerate(bits):
            ctx.line(f"{masks}[{ix.add(ix.mul(thread, words), str(w))}] = {name}")
        for e in range(-(-T // NT)):  # (every entry a valid tap, also past the list's end)
            t = ix.add(thread, str(e * NT)) if e else thread
            ctx.line_if(f"{t} < {T}" if (e + 1) * NT > T else None, f"{taps}[{t}] = 0")
        ctx.line("sync_block()")
        half = NT // 2
        while half:  # a tree OR of the threads' masks into masks[0 .. words)
            ctx.line(f"if {thread} < {half}:")
            with ctx.indent():
                for w in range(words):
                    at = ix.add(ix.mul(thread, words), str(w))
                    ctx.line(f"{masks}[{at}] = {masks}[{at}] | {masks}[{ix.add(at, str(half * words))}]")
            ctx.line("sync_block()")
            half //= 2
        count = ctx.fresh("ntaps")
        ctx.line(f"{count} = " + " + ".join(f"int(popcount({masks}[{w}]))" for w in range(words)))
        for e in range(-(-T // NT)):  # tap t goes to the number of the union's taps below it
            t = ctx.let(ix.add(thread, str(e * NT)) if e else thread, "tt")
            ctx.line(f"if {t} < {T}:")
            with ctx.indent():
                word = ctx.let(f"{t} >> 5", "tw")
                u = ctx.let(f"{masks}[{word}]", "u")
                below = ctx.let(f"int(popcount({u} & ((uint(1) << uint({t} & 31)) - uint(1))))", "below")
                for w in range(words - 1):
                    ctx.line(f"if {word} > {w}:")
                    with ctx.indent():
                        ctx.line(f"{below} += int(popcount({masks}[{w}]))")
                ctx.line(f"if ((({u} >> uint({t} & 31)) & uint(1)) != uint(0)):")
                with ctx.indent():
                    ctx.line(f"{taps}[{below}] = {t}")
        ctx.line("sync_block()")
        return taps, count

    def emit_block(self, ctx, item, thread):
        from luisaml.operators import tiled

        x, kmap, w, y = self.input(0), self.input(1), self.input(2), self.output()
        C_in, C_out, T = self.c_in, self.c_out, self.taps
        tl = self.block_tiling()
        if getattr(tl, "mma", False):
            self._emit_mma_block(ctx, tl, item, thread)
            return
        checked = kmap.value is None  # a map fed at run time: an index past the features is flagged
        # over voxels as the batch the block's rows are samples from `sample` on, each read and written
        # at its own sample, and a tap reads the features at the sample its map entry names
        rows_in = ctx.n_samples if self.voxel_batch else self.n_in
        limit = "[-1, batch)" if self.voxel_batch else f"[-1, {self.n_in})"
        flag = ctx.flag_error(str(self.error(f"kernel_map '{kmap.name}' holds an index outside {limit} "
                                             f"(the rows of features '{x.name}')"))) if checked else None
        taps, k_steps = None, None
        group_rows = tiled.group_rows(ctx, tl.BM) if self.voxel_batch else None
        if self.skips_taps(tl):
            taps, count = self.emit_tile_taps(ctx, tl, item, thread, group_rows or self.n_out)
            k_steps = ctx.let(ix.mul(count, C_in // tl.BK), "ksteps")

        # "uniform": the loaders take a whole step's first k beside k (tiled.by_step), for tap_of
        stepped = tiled.by_step if self.fp32_form == "uniform" else (lambda load: load)

        def tap_of(k: str, step: tiled.Step | None = None) -> tuple[str, str]:
            """(tap, input channel) of k: the compacted k's tap is the tile's list's entry (with its
            whole step, "uniform": from the step's first k where the step lies within one tap, the same
            for the whole block)."""
            split = step.divmod(C_in) if step is not None else None
            at, c = split or (ix.div(k, C_in), None)
            at = ctx.let(at, "kt")
            return (ctx.let(f"{taps}[{at}]", "tap") if taps else at), ctx.let(c or ix.mod(k, C_in), "c")

        # A's element at k: the map's entry for k's tap (the index), then the features' row it names;
        # tiled.gathered hands the tile the two halves, which it loads a step apart (fp32_form "ahead")
        def a_row(_, o):
            if self.voxel_batch:  # the map's row at sample + o; the features at the sample it names
                s = ctx.let(ix.add(ctx.sample, o), "rs")

                def index(k):
                    tap, _ = tap_of(k)
                    with ctx.at_sample(s):  # (s named once: entered at every k step)
                        return map_index(ctx, kmap.load(tap), rows_in, flag, checked)

                def value(k, v, c=None):
                    c = c or ctx.let(ix.mod(k, C_in), "c")
                    with ctx.at_sample(f"max({v}, 0)"):
                        return f"({x.load(c)} if {v} >= 0 else 0.0)"
            else:
                row = ctx.let(ix.mul(self.row(o), T), "kr")

                def index(k):
                    tap, _ = tap_of(k)
                    return map_index(ctx, kmap.load(ix.add(row, tap)), rows_in, flag, checked)

                def value(k, v, c=None):
                    c = c or ctx.let(ix.mod(k, C_in), "c")
                    return f"({x.load(ix.add(ix.mul(f'max({v}, 0)', C_in), c))} if {v} >= 0 else 0.0)"

            def load(k, step=None):  # (the early fetch's text, as before the split: tap_of's c reused)
                tap, c = tap_of(k, step)
                if self.voxel_batch:
                    with ctx.at_sample(s):
                        v = map_index(ctx, kmap.load(tap), rows_in, flag, checked)
                else:
                    v = map_index(ctx, kmap.load(ix.add(row, tap)), rows_in, flag, checked)
                return value(k, v, c)

            if self.fp32_form == "ahead":
                return tiled.gathered(load, index, value, period=C_in)
            return stepped(load)

        def store(_, o, n, v):
            at_row, rr = self._at_row(ctx, o)
            with at_row:
                return y.store(ix.add(ix.mul(rr, C_out), n), v)

        packed = self.packed_weight()
        _, O, _, cblocks = self.tiles()

        def b_column(_, n):
            if packed is not None:  # [tap][C_in][channel blocks x O]: k = tap * C_in + c is its row
                base = ctx.let(ix.add(str(packed), ix.mul(n, 4)), "wb")

                def load(k, step=None):
                    tap, c = tap_of(k, step)
                    return f"weights.read(float, {ix.add(base, ix.mul(ix.add(ix.mul(tap, C_in), c), cblocks * O * 4))})"

                return stepped(load)
            base = ctx.let(ix.mul(n, C_in * T), "wb")  # weight [C_out, C_in, taps]: element (n, c, tap)

            def load(k, step=None):
                tap, c = tap_of(k, step)
                return w.load(ix.add(base, ix.mul(c, T), tap))

            return stepped(load)

        b_quad = None
        if self.fp32_form != "early" and packed is not None and packed % 16 == 0 and (cblocks * O) % 4 == 0:
            def b_quad(_, n):  # n a multiple of 4: 4 consecutive packed columns, one 16-byte load
                base = ctx.let(ix.add(str(packed), ix.mul(n, 4)), "wq")
                if self.fp32_form == "uniform":
                    def quad(k, step=None):
                        tap, c = tap_of(k, step)
                        return f"weights.read(float4, {ix.add(base, ix.mul(ix.add(ix.mul(tap, C_in), c), cblocks * O * 4))})"

                    return tiled.by_step(quad)
                return lambda k: (f"weights.read(float4, "
                                  f"{ix.add(base, ix.mul(ix.add(ix.mul(tap_of(k)[0], C_in), ix.mod(k, C_in)), cblocks * O * 4))})")

        bias = self.input(3) if self.has_input(3) else None
        tiled.emit(ctx, tl, item, thread, a_row, b_column,
                   lambda _, o, n, acc: f"{acc} + {bias.load(n)}" if bias is not None else acc,
                   store, a_m_contiguous=False, b_quad=b_quad,
                   k_steps=k_steps, m_limit=group_rows)

    def _emit_mma_block(self, ctx, tl, item: str, thread: str) -> None:
        """emit_block on the tensor-core tile (tiled_mma.emit: no k_steps there). The tile's tap list
        is made as for the FP32 tile; k walks it compacted, and a k step past the tile's count (k's
        tap index at or past it: uniform in the block, a step lies within one tap) loads nothing, A
        and B zero, so its mma adds exact zeros. A missing neighbour loads nothing either: its A is
        0.0. Rows past the voxels (m_limit, the group's samples over voxels as the batch) store
        nothing. With mma_buckets > 1, copies of the tile at several K, a block running one
        (_tap_buckets)."""
        from luisaml.operators import tiled, tiled_mma

        x, kmap, w, y = self.input(0), self.input(1), self.input(2), self.output()
        C_in, C_out, T = self.c_in, self.c_out, self.taps
        checked = kmap.value is None  # a map fed at run time: an index past the features is flagged
        rows_in = ctx.n_samples if self.voxel_batch else self.n_in
        limit = "[-1, batch)" if self.voxel_batch else f"[-1, {self.n_in})"
        flag = ctx.flag_error(str(self.error(f"kernel_map '{kmap.name}' holds an index outside {limit} "
                                             f"(the rows of features '{x.name}')"))) if checked else None
        group_rows = tiled.group_rows(ctx, tl.BM) if self.voxel_batch else None
        taps = count = None
        if self.skips_taps(tl):
            taps, count = self.emit_tile_taps(ctx, tl, item, thread, group_rows or self.n_out)

        def guarded(k: str, value) -> str:
            """Emit v = value(tap, c) for compacted k where the tile has k's tap, else v = 0.0 (no
            load: loads, not a select over them); return v."""
            v = ctx.fresh("v")
            ctx.line(f"{v} = 0.0")
            if taps is None:  # every tap in order (C_in not a multiple of BK): k's tap is k / C_in
                value(v, ctx.let(ix.div(k, C_in), "kt"), ctx.let(ix.mod(k, C_in), "c"))
                return v
            j = ctx.let(ix.div(k, C_in), "kt")
            ctx.line(f"if {j} < {count}:")
            with ctx.indent():
                value(v, ctx.let(f"{taps}[{j}]", "tap"), ctx.let(ix.mod(k, C_in), "c"))
            return v

        def a_row(_, o):
            if self.voxel_batch:  # the map's row at sample + o; the features at the sample it names
                s = ctx.let(ix.add(ctx.sample, o), "rs")

                def value(v, tap, c):
                    with ctx.at_sample(s):
                        k = map_index(ctx, kmap.load(tap), rows_in, flag, checked)
                    ctx.line(f"if {k} >= 0:")
                    with ctx.indent(), ctx.at_sample(k):
                        ctx.line(f"{v} = {x.load(c)}")
            else:
                row = ctx.let(ix.mul(self.row(o), T), "kr")

                def value(v, tap, c):
                    k = map_index(ctx, kmap.load(ix.add(row, tap)), rows_in, flag, checked)
                    ctx.line(f"if {k} >= 0:")
                    with ctx.indent():
                        ctx.line(f"{v} = {x.load(ix.add(ix.mul(k, C_in), c))}")

            return lambda k: guarded(k, value)

        packed = self.packed_weight()
        _, O, _, cblocks = self.tiles()

        def b_column(_, n):
            if packed is not None:  # [tap][C_in][channel blocks x O]: k = tap * C_in + c is its row
                base = ctx.let(ix.add(str(packed), ix.mul(n, 4)), "wb")

                def value(v, tap, c):
                    at = ix.add(base, ix.mul(ix.add(ix.mul(tap, C_in), c), cblocks * O * 4))
                    ctx.line(f"{v} = weights.read(float, {at})")
            else:
                base = ctx.let(ix.mul(n, C_in * T), "wb")  # weight [C_out, C_in, taps]: element (n, c, tap)

                def value(v, tap, c):
                    ctx.line(f"{v} = {w.load(ix.add(base, ix.mul(c, T), tap))}")

            return lambda k: guarded(k, value)

        def store(_, o, n, v):
            at_row, rr = self._at_row(ctx, o)
            with at_row:
                return y.store(ix.add(ix.mul(rr, C_out), n), v)

        bias = self.input(3) if self.has_input(3) else None

        def emit(K: int) -> None:
            tiled_mma.emit(ctx, dataclasses.replace(tl, K=K), item, thread, a_row, b_column,
                           lambda _, o, n, acc: f"{acc} + {bias.load(n)}" if bias is not None else acc,
                           store, a_m_contiguous=False, m_limit=group_rows)

        buckets = self._tap_buckets(tl) if count is not None else [tl.K // C_in]
        if len(buckets) == 1:
            emit(tl.K)
            return
        # K variants, one a block (the count is the block's): each emit's shared buffers are the same
        # sizes whatever K, so they share one set (two 128 x 64 tiles' would pass 48 KiB), declared
        # before the branches from what a dry run of the emit asked for (its lines then dropped)
        mark, level, asked = len(ctx.out), ctx.level, []
        ctx.shared_array = lambda dsl, n, prefix="sh": asked.append((dsl, n)) or ctx.fresh(prefix)
        try:
            emit(tl.K)
        finally:
            del ctx.shared_array
        del ctx.out[mark:]
        ctx.level = level
        shared = [(dsl, n, ctx.shared_array(dsl, n, "mma_sh")) for dsl, n in asked]
        low = None
        for taps_k in buckets:
            handed = iter(shared)

            def reuse(dsl, n, prefix="sh", handed=handed):
                d0, n0, name = next(handed)
                if (d0, n0) != (dsl, n):  # (tiled_mma's buffers would depend on K: one emit, not variants)
                    raise AssertionError(f"tiled_mma.emit asked for shared {dsl}[{n}] where a dry run asked {d0}[{n0}]")
                return name

            ctx.line(f"if {count} <= {taps_k}:" if low is None else f"if {count} > {low} and {count} <= {taps_k}:")
            ctx.shared_array = reuse
            try:
                with ctx.indent():
                    emit(taps_k * C_in)
            finally:
                del ctx.shared_array
            low = taps_k

    def forward(self, ctx):
        with ctx.loop(self.work_items(), "item") as item:
            self.emit_item(ctx, item)

    def describe(self):
        R, O, _, _ = self.tiles()
        per = (f"{O} channels of a voxel (a voxel a sample: grids bound at run time)" if self.voxel_batch
               else f"{R} output voxels x {O} channels")
        return f"gather-GEMM over a kernel map of {self.taps} taps, {self.c_in}->{self.c_out} channels: a thread per {per}"

    def describe_block(self):
        group = (f", a block's rows {self.block_samples()} consecutive samples (voxels as the batch)"
                 if self.voxel_batch else "")
        return (f"gather-GEMM over a kernel map of {self.taps} taps, {self.c_in}->{self.c_out} channels: "
                f"{self.block_tiling().describe()}, only the taps a tile's voxels read{group}")
