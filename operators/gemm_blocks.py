"""Gemm and MatMul's GPU form (Dense's blocks stages): the tile a product takes — a block of threads
through shared memory (operators/tiled.py), the tensor-core tile (operators/tiled_mma.py), rows that are
samples, a warp a sample (operators/gemm_rows.py) or a head's blocks (operators/gemm_heads.py) — and its
emission."""
from __future__ import annotations

import numpy as np

from luisaml import indexing as ix
from luisaml.device import sm_count

from . import gemm_heads, gemm_rows


class DenseBlocks:
    """operators/gemm.py's Dense's blocks form (Operator.block_tiling, block_samples, emit_block), a mixin
    over Dense's operands: M, N, K, nbatch, loaders(), packable_b(), packed_b(), b_matrix() and b_entry()."""

    # a layer of one row a sample (a classifier's head, an MLP run per sample) over a batch: a block's
    # tile rows are this many consecutive samples (ResNet-18's 512 -> 1000 Gemm at batch 32: 0.18 ms
    # as items, each sample's thread re-reading the 2 MB of weights)
    GROUP = 64
    # (tensor cores) such a layer's samples a block on the mma tile (operators/tiled_mma.py): its tile's
    # rows, 128 for the 128-row tile of 8 warps that measured 36-73 TFLOP/s on large products on the H100,
    # where the FP32 tile of GROUP samples ran NeRF's 256 -> 256 layers at ~24 (benchmarks/NOTES.md,
    # "Products over samples on the tensor-core tile"); 0 keeps the FP32 tile (an A/B switch)
    MMA_GROUP = 128
    # such a layer of at most gemm_rows.MAX_COLUMNS columns (a head: too narrow for a tile) and K of at
    # least this: a warp a sample, its lanes splitting k (operators/gemm_rows.py; cifar-cnn's 2,048 -> 10
    # took 0.57 ms of the H200's 1.7 as items, a thread's chain of 2,048 loads); 0: the items form (A/B)
    WARP_MIN_K = 256
    # such a layer of more columns whose W has at least this many weights (a classifier's head after the
    # pool: ResNet-50's 2,048 x 1,000): a block per 8 columns and 16 samples (operators/gemm_heads.py),
    # since at the batches CNNs run (8-64) a tile of 64 or 128 samples is a few blocks (0.29 ms at batch
    # 16 on the H100, torch ~15 us). By W's size because the plan has no batch: the form reads W from L2
    # once per 16 samples where a tile reuses it over 128, so layers of small W that run over huge
    # batches (NeRF's 256 -> 256 at 65,536 rays: 65,536 weights) keep the tile; 1 MiB of W and up
    # (ResNet-18's 512 x 1,000 and every head after it) is a head. 0: the tiles (an A/B switch)
    HEAD_MIN_WEIGHTS = 1 << 18
    # the tensor-core tile (operators/tiled_mma.py) where the plan asks for it: its kind ("tf32", or "f16" under
    # precision="fp16": luisaml/rewrites/tensor_cores.py), or False
    tensor_cores = False

    def sample_rows(self) -> bool:
        """Whether the tile's rows are samples: one row a sample, B a constant, the batch batched."""
        return (self.M == 1 and self.nbatch == 1 and self.input(0).batched and self.output().batched
                and self.input(1).value is not None)

    def block_tiling(self):
        from . import tiled

        if any(t.dtype.dsl != "float" for t in (self.input(0), self.input(1), self.output())):
            return None
        if self.sample_rows():
            heads = gemm_heads.choose(self.N, self.K, self.HEAD_MIN_WEIGHTS, gemm_rows.MAX_COLUMNS)
            if heads is not None:  # (a head of a large W, starved on a tile at small batches: gemm_heads.py)
                return heads
            if self.tensor_cores and self.MMA_GROUP:
                from . import tiled_mma

                # the tile's rows are MMA_GROUP samples (block_samples); None where N or K is under a
                # warp's tile (a head of 1-10 outputs, a first layer of 2-3 inputs): the FP32 tile then
                mma = tiled_mma.choose(self.MMA_GROUP, self.N, self.K, 1, kind=self.tensor_cores)
                if mma is not None:
                    return mma
            tl = tiled.choose(self.GROUP, self.N, self.K, 1, m_fast=False)
            return tl if tl is not None else gemm_rows.choose(self.N, self.K, self.WARP_MIN_K)
        if self.tensor_cores:  # (luisaml/rewrites/tensor_cores.py: compile(tensor_cores="auto") found them live)
            from . import tiled_mma

            # a product launched whole (no batch the plan does not know) may take smaller tiles to fill the GPU
            sms = 0 if self.output().batched else sm_count()
            mma = tiled_mma.choose(self.M, self.N, self.K, self.nbatch, kind=self.tensor_cores, sms=sms)
            if mma is not None:
                return mma
        return tiled.tuned(tiled.choose(self.M, self.N, self.K, self.nbatch, m_fast=False), self.schedule)

    def block_samples(self) -> int:
        """A tile of samples (sample_rows): its rows, GROUP on the FP32 tile or MMA_GROUP on the mma tile."""
        tl = self.block_tiling() if self.sample_rows() else None
        return tl.M if tl is not None else 1

    def emit_block(self, ctx, item: str, thread: str) -> None:
        from . import tiled

        y, M, N = self.output(), self.M, self.N
        load_a, load_b, finish, _ = self.loaders()
        tl = self.block_tiling()
        packed = None if getattr(tl, "rows_b", False) else self.packed_b()  # (gemm_rows.py, gemm_heads.py: B as [N][K])
        mma = getattr(tl, "mma", False)
        if self.sample_rows():  # row m of the tile: row 0 of sample `sample + m`, read and written there
            limit = tiled.group_rows(ctx, tl.M)

            def a_row(bi, m):
                s = ctx.let(ix.add(ctx.sample, m), "rs")

                def load(k):
                    with ctx.at_sample(s):
                        return load_a(bi, "0", k)

                return load

            def finish_row(bi, m, n, acc):
                with tiled.at_group_sample(ctx, m, name=False):
                    return finish(bi, "0", n, acc)

            def store_row(bi, m, n, value):
                with tiled.at_group_sample(ctx, m, name=False):
                    return y.store(n, value)

            if getattr(tl, "rows_b", False):
                tl.emit(ctx, item, thread, a_row, self._b_rows(ctx, load_b), finish_row, store_row)
                return
            if mma:  # (the group's one row block: a group holds at least one sample, the tile never idles)
                from . import tiled_mma

                tiled_mma.emit(ctx, tl, item, thread, a_row, self._b_column(ctx, load_b, packed), finish_row,
                               store_row, a_m_contiguous=False, m_limit=limit)
                return
            tiled.emit(ctx, tl, item, thread, a_row, self._b_column(ctx, load_b, packed), finish_row, store_row,
                       a_m_contiguous=False, m_limit=limit)
            return

        def store(bi, m, n, value):
            return y.store(ix.add(ix.mul(bi, M * N), ix.mul(m, N), n), value)

        if mma:
            from . import tiled_mma

            tiled_mma.emit(ctx, tl, item, thread, lambda bi, m: (lambda k: load_a(bi, m, k)),
                           self._b_column(ctx, load_b, packed), finish, store, a_m_contiguous=bool(getattr(self, "ta", 0)))
            return
        tiled.emit(ctx, tl, item, thread, lambda bi, m: (lambda k: load_a(bi, m, k)), self._b_column(ctx, load_b, packed),
                   finish, store, a_m_contiguous=bool(getattr(self, "ta", 0)))

    def _b_rows(self, ctx, load_b):
        """Return gemm_rows.emit's B[k, n]: a constant B of the blob as [N][K] (its rows transposed
        once: a warp's lanes, consecutive k, read consecutive words), else B where it is (a transB Gemm's is [N][K])."""
        if not self.packable_b() or getattr(self, "tb", 0):
            return lambda k, n: load_b("0", k, n)
        b = self.input(1)
        off = b.home.blob.add_packed(f"{b.name}/rows[{self.N}x{self.K}]", lambda: np.ascontiguousarray(
            self.b_matrix(np.asarray(b.value, dtype=np.float32))[0].T))
        return lambda k, n: f"weights.read(float, {ix.add(str(off), ix.mul(n, self.K * 4), ix.mul(k, 4))})"

    def _b_column(self, ctx, load_b, packed):
        """Return tiled.emit's loader of B's columns: the prepacked weights, or B where it is."""

        def b_column(bi, n):
            if packed is None:
                return lambda k: load_b(bi, k, n)
            off, row, entry, _ = packed
            base = ctx.let(ix.add(str(off), ix.mul(self.b_entry(bi), entry * 4), ix.mul(n, 4)), "wb")
            return lambda k: f"weights.read(float, {ix.add(base, ix.mul(k, row * 4))})"

        return b_column
