"""Gemm and MatMul: a stage thread computes a tile of outputs with scalar accumulators, constant
weights prepacked at compile time (shaders/matmul.py.j2); accumulated in float for float and half
(rounded to half once), in int for integers. Their GPU form (blocks stages) is operators/gemm_blocks.py's."""
from __future__ import annotations

import contextlib

import numpy as np

from luisaml import indexing as ix
from luisaml.operator import Operator
from luisaml.registry import register
from luisaml.storage import bind, literal

from .common import compute_dtype, convert, emit_epilogue_loop, loops_epilogue, upcast
from .gemm_blocks import DenseBlocks
from .gemm_shapes import (  # noqa: F401 (the shapes' rules, importable from here as before)
    CPU_NARROW_ACC, MAX_ACC, MAX_TUNED_ACC, MAX_TUNED_ROWS, NARROW, SQUARE, UNALIGNED_ROWS, WIDE, block_columns, chains, item_candidates, item_choice, tile_shape)


def _same_types(op: Operator, names: list[tuple[int, str]]) -> None:
    """Raise unless the inputs (index, role) present all have input 0's dtype."""
    first = op.input(0)
    for k, role in names:
        if op.has_input(k):
            t = op.input(k)
            op.expect(
                t.dtype == first.dtype,
                f"input {k} ({role}) '{t.name}' has type {t.dtype.name.lower()}, but A '{first.name}' has "
                f"{first.dtype.name.lower()}; they must match",
            )


class Dense(DenseBlocks, Operator):
    """The stage form Gemm and MatMul share: a work item computes an R x O tile of one batch
    entry's output (shaders/matmul.py.j2, tile), consecutive items along the columns (consecutive
    GPU threads read consecutive weights and share the A row). A constant B of the weight blob is
    prepacked once at compile time (packed_b: float32 [B batch][K][columns padded to whole tiles],
    or each column block's K x O panel contiguous for the CPU backend's tiles), so a tile's row of
    B is O consecutive words; any other B is read where it is, on the CPU by tiles of SQUARE
    (square_tiles). Subclasses set M, N,
    K and nbatch (the batch entries per sample) and implement loaders() and b_matrix()."""

    stores_once = True

    def loaders(self):
        """Return (load_a(bi, m, k), load_b(bi, k, n), finish(bi, m, n, acc) -> the output value,
        accumulator dtype): scalar loads in the accumulator's dtype."""
        raise NotImplementedError

    def b_matrix(self, value: np.ndarray) -> np.ndarray:
        """Return B's value as [B batch entries, K, N]."""
        raise NotImplementedError

    def b_entry(self, bi: str) -> str:
        """Return B's batch entry for batch entry bi of the output."""
        return "0"

    def tiles(self) -> tuple[int, int, int, int]:
        """Return (R, O, row blocks, column blocks) of this node's work items."""
        tuned = item_choice(self.schedule, self.M)
        if tuned is not None:  # (a ragged last row block, as square tiles have)
            R, O = tuned
            return R, O, -(-self.M // R), -(-self.N // O)
        if self.square_tiles():
            rows = UNALIGNED_ROWS if self.shift_last and self.N % 8 else SQUARE[0]
            R, O = min(rows, self.M), block_columns(self.N, SQUARE[1])
            return R, O, -(-self.M // R), -(-self.N // O)
        R, O = tile_shape(self.M, self.N, narrow=self.K >= 128 and self.N >= 128 and self.input(1).value is not None,
                          ragged=self.no_blocks and self.cpu_items())
        return R, O, -(-self.M // R), -(-self.N // O)

    # On the CPU backend (no_blocks) the rules' tile takes all the rows tile_shape allows, its last
    # row block ragged as square tiles' is, instead of rows that divide M: ViT's 197 tokens (a prime)
    # gave 1 x 16 tiles, each B load feeding one row ([197, 192] x [192, 768]: 43.6 GFLOP/s, 67.0
    # as 2 x 16; ViT-Ti 150 -> 115 ms; benchmarks/NOTES.md, "Ragged row blocks")

    def reads_per_element(self, k: int) -> float:
        """A's elements are read once a column, B's once a row."""
        return float(self.N if k == 0 else self.M if k == 1 else 0)

    def square_tiles(self) -> bool:
        """Whether the items form takes R x O tiles of SQUARE, its last row block ragged, instead of
        tile_shape's: for a B that is not a constant (attention's Q K^T and attn V, read through the
        exporter's inline Split, Transpose and Mul, at folded indices: affine_loads), rows that
        divide M leave a prime M (ViT's 197 tokens) one row a tile, where each B load feeds one
        multiply-add. Only where cpu_items (a product with a block tiling)."""
        return not self.packable_b() and self.M > 1 and self.cpu_items()

    def work_items(self) -> int:
        _, _, rows, cols = self.tiles()
        return self.nbatch * rows * cols

    def packable_b(self) -> bool:
        """Whether B is a float constant of the weight blob (what packed_b packs)."""
        from luisaml.plan import BlobWeight

        b = self.input(1)
        return b.value is not None and isinstance(b.home, BlobWeight) and compute_dtype(b.dtype).dsl == "float"

    def cpu_items(self) -> bool:
        """Whether this node's items form is the CPU backend's: it has a block tiling, so on CUDA it
        runs as blocks (emit_block) and its items form is emitted on the CPU backend only (and on
        CUDA with blocks turned off). The CPU's tile choices below (panels, square tiles) take this
        gate, so that CUDA's items form of a product too small for a block stays as it was; such
        products keep the older choices on the CPU too, unless the plan has no blocks stages
        (`no_blocks`: the CPU backend), where every float product takes them."""
        if self.no_blocks:
            return all(t.dtype.dsl == "float" for t in (self.input(0), self.input(1), self.output()))
        tl = self.block_tiling()
        # (a warp a sample, gemm_rows.py: a head that ran as items before; with blocks off it keeps CUDA's items form)
        return tl is not None and not getattr(tl, "warp_rows", False)

    def packed_b(self, panels: bool = False):
        """Return (byte offset in the blob, words per k row, words per batch entry of B, words per
        column block) of B prepacked, or None when B is not a float constant of the weight blob.
        As float32 [B batch][K][columns padded to whole tiles] (a column block's k row O words
        inside a row of all columns), or with `panels` [B batch][column block][K][O]: a column
        block's K x O panel contiguous. The CPU backend's tiles read panels: rows of all columns
        1,024 or 2,048 words long put a tile's K rows a multiple of 4 KB apart, into one L1 set
        ([1568, 128] x [128, 1024] 7.5 GFLOP/s, 76 as panels; [196, 512] x [512, 2048] 21 -> 53;
        benchmarks/NOTES.md, "Column-block panels and square tiles")."""
        if not self.packable_b():
            return None
        b = self.input(1)
        _, O, _, cols = self.tiles()
        Np = cols * O

        def pack() -> np.ndarray:
            w = self.b_matrix(np.asarray(b.value, dtype=np.float32))
            packed = np.zeros((w.shape[0], self.K, Np), np.float32)
            packed[:, :, : self.N] = w
            if panels:
                packed = np.ascontiguousarray(packed.reshape(w.shape[0], self.K, cols, O).transpose(0, 2, 1, 3))
            return packed

        if panels:
            return b.home.blob.add_packed(f"{b.name}/panels[{cols}x{self.K}x{O}]", pack), O, self.K * Np, self.K * O
        return b.home.blob.add_packed(f"{b.name}/packed[{self.K}x{Np}]", pack), Np, self.K * Np, O

    def samples_per_item(self) -> int:
        # one row a sample (an MLP layer run per sample): two samples a work item read each row of
        # the prepacked B once for both (CPU backend, 63-256x4-4 at batch 512: 5.9-6.9 -> 3.0-3.5 ms
        # the whole model, 63-128x4-4 3.4-3.8 -> 2.0-2.1 ms; benchmarks/NOTES.md, "Two samples a work item")
        wide = self.K >= 128 and self.N >= 128
        return 2 if self.M == 1 and self.nbatch == 1 and wide and self.packable_b() else 1

    def emit_item(self, ctx, item: str, rows: list | None = None) -> None:
        """rows (samples_per_item > 1): per sample of the tile, (its store condition or None, its
        binding table); the tile's rows are those samples' single rows."""
        y = self.output()
        M, N, K = self.M, self.N, self.K
        load_a, load_b, finish, acc_dt = self.loaders()
        R, O, nrows, cols = self.tiles()
        packed = self.packed_b(panels=self.cpu_items())
        loops = self.cpu_items() and loops_epilogue(self.epilogue_loop, y) and all(b is None for _, b in rows or [])
        target = self._loop_target(y) if loops else None
        # (shift_last) the last row and column blocks end at M and N: their first rows and columns
        # are the blocks before's again, computed and stored twice (the same values), none clamped
        shift = self.shift_last and packed is None and not rows and target is None and self._rewrites_same(y)
        if self.rows_fast and self.cpu_items() and self.packable_b():
            rb = ctx.let(ix.mod(item, nrows), "rb") if nrows > 1 else "0"
            rest = ix.div(item, nrows)
            cb = ctx.let(ix.mod(rest, cols), "cb") if cols > 1 else "0"
            bi = ctx.let(ix.div(rest, cols), "bi") if self.nbatch > 1 else "0"
        else:
            cb = ctx.let(ix.mod(item, cols), "cb") if cols > 1 else "0"
            rest = ix.div(item, cols)
            rb = ctx.let(ix.mod(rest, nrows), "rb") if nrows > 1 else "0"
            # (row_bases) `% nbatch`, a no-op, bounds bi for LLVM (_finish)
            bi = ctx.let(f"({ix.div(rest, nrows)}) % {self.nbatch}" if shift and N % 8 else ix.div(rest, nrows), "bi") if self.nbatch > 1 else "0"
        if shift and M % R and M > R:
            m0 = ctx.let(f"min({ix.mul(rb, R)}, {M - R})", "m")
            ms = [ctx.let(ix.add(m0, str(r)), "m") for r in range(R)]
            rows = [(None, None)] * R
        elif rows:  # M == 1: row r of the tile is row 0 of sample r
            R = len(rows)
            ms = ["0"] * R
        else:
            # a ragged last row block (square_tiles): its rows past M are row M - 1 again, computed
            # and stored twice by the same thread (the same values), so no store needs a condition
            ragged = M % R != 0
            ms = [ctx.let(f"min({ix.add(ix.mul(rb, R), str(r))}, {M - 1})" if ragged and r else ix.add(ix.mul(rb, R), str(r)), "m")
                  for r in range(R)]
            rows = [(None, None)] * R

        def at_row(r, emit):
            # what row r's sample reads and writes is bound in its own table
            if rows[r][1] is None:
                return emit()
            with bind(rows[r][1]):
                return emit()
        n0 = ctx.let(f"min({ix.mul(cb, O)}, {N - O})" if shift and N % O and N > O else ix.mul(cb, O), "n")
        # the columns that may fall past N (in the last column block only)
        safe = O if shift and N > O else N % O or O
        affine = self.affine_loads and self.cpu_items()
        if affine:
            # the operands' indices as ix.Affine sums of atoms in range, so that the unravels of the
            # inline nodes A and B are read through (Split, Transpose, Reshape) fold their divisions
            a_bi = ix.Affine.atom(bi, self.nbatch)
            a_ms = [ix.Affine.atom(m, M) for m in ms]
            a_k = lambda k: ix.Affine.atom(k, K) if k.isidentifier() else k
            loads_a = load_a
            load_a = lambda _, m, k: loads_a(a_bi, a_ms[ms.index(m)] if m in ms else m, a_k(k))
        pre = lambda k: []
        if packed is not None:
            off, row, entry, block = packed
            base = ctx.let(ix.add(str(off), ix.mul(self.b_entry(bi), entry * 4), ix.mul(cb, block * 4)), "wb")
            wk = ctx.fresh("wk")
            pre = lambda k: [f"{wk} = {ix.add(base, ix.mul(k, row * 4))}"]

            def bv(k, j):
                return f"weights.read(float, {ix.add(wk, str(4 * j))})"
        else:
            cols_of = [ctx.let(ix.add(n0, str(j)) if j < safe else f"min({ix.add(n0, str(j))}, {N - 1})", "c")
                       for j in range(O)]
            if affine:
                a_cols = [ix.Affine.atom(c, N) for c in cols_of]
                loads_b = load_b
                load_b = lambda _, k, n: loads_b(a_bi, a_k(k), a_cols[cols_of.index(n)])

            def bv(k, j):
                return load_b(bi, k, cols_of[j])

        def mad(a, w, acc):
            # fma: one instruction in the CPU backend's x86 code (a multiply and an add otherwise)
            return f"fma({a}, {w}, {acc})" if acc_dt.dsl == "float" else f"{acc} + {a} * {w}"

        acc = [[[ctx.fresh("acc") for _ in range(O)] for _ in range(R)] for _ in range(chains(R, O, K))]
        # (the CPU's tiles, one accumulator set, a straight-line epilogue) the epilogue and stores
        # inside the k loop's last step: after the loop, clang's SLP vectoriser seeded from the stores
        # re-did the last step's multiply-adds from the loop's values, which then lived through the
        # loop: a register copy a multiply-add (16 vmovaps to 8 vfmadd in a 4 x 16 tile; [197, 768] x
        # [768, 192] + bias 1.47 -> 1.19 ms; benchmarks/NOTES.md, "GEMM tiles on AVX-512")
        tail = self.stores_in_loop and self.cpu_items() and (not loops or target is not None) and len(acc) == 1 and K > 0
        ctx.render("matmul.py.j2", tile=True, acc=acc, K=K, zero=literal(0, acc_dt), pre=pre, bv=bv,
                   a=lambda r, k: at_row(r, lambda: load_a(bi, ms[r], k)), mad=mad, tail=tail)
        if loops and target is None:
            self._epilogue_loop(ctx, y, acc[0], finish, bi, ms, n0, rows, acc_dt, O, M, N, safe)
            return
        with contextlib.ExitStack() as inside:
            if tail:  # under the template's `if k == K - 1:`
                inside.enter_context(ctx.indent())
                inside.enter_context(ctx.indent())
            if target is None:
                self._finish(ctx, y, acc, finish, bi, ms, n0, rows, at_row, R, O, M, N, safe, shift and N % 8)
                return
            # the finished values into the epilogue's output, straight-line (vector stores)
            done = [[ctx.let(finish(bi, ms[r], ix.add(n0, str(j)), acc[0][r][j]), "f") for j in range(O)] for r in range(R)]
            for r in range(R):
                for j in range(O):
                    n = ix.add(n0, str(j))
                    ctx.line_if(None if j < safe else f"{n} < {N}",
                                target.store(ix.add(ix.mul(bi, M * N), ix.mul(ms[r], N), n), done[r][j]))
        # a ragged last row block's rows past M are row M - 1 again: its epilogue must run once
        live = [f"{ix.add(ix.mul(rb, R), str(r))} < {M}" if M % R and r else None for r in range(R)]
        self._epilogue_in_place(ctx, y, target, bi, ms, live, n0, O, M, N, safe)

    def _loop_target(self, y):
        """Return the tensor an epilogue loop may run in place over (epilogue_in_place): the end of
        y's epilogue in a plain buffer, of y's float dtype; or None."""
        from luisaml.storage import Buffer

        target = getattr(y.storage, "target", None)
        if not self.epilogue_in_place or target is None or type(target.storage) is not Buffer:
            return None
        return target if target.dtype == y.dtype and y.dtype.dsl == "float" else None

    def _rewrites_same(self, y) -> bool:
        """Whether a column computed twice (shift_last) is stored twice with the same value: y is a
        plain buffer, or its epilogue's end is one that no input of the epilogue is read from."""
        from luisaml.storage import Buffer

        st = y.storage
        if type(st).__name__ != "Epilogue":  # (luisaml/emission.py's, which operators do not import)
            return type(st) is Buffer
        end = st.target.storage
        reads = [t.storage for _, op in st.chain for t in op.inputs if t is not None and t is not st.root_out]
        return type(end) is Buffer and all(r is None or type(r).__name__ in ("Weight", "Value", "Scalar", "Linear")
                                           or type(r) is Buffer and r.buffer != end.buffer for r in reads)

    def _epilogue_in_place(self, ctx, y, target, bi, ms, live, n0, O, M, N, safe) -> None:
        """(epilogue_in_place) Per row of the tile (where live[r], a condition or None) a loop over
        its columns that reads each finished value back from the epilogue's output, applies the
        epilogue and writes the end there."""
        for r in range(len(ms)):
            jv = ctx.fresh("j")
            inside = contextlib.ExitStack()
            if live[r]:
                ctx.line(f"if {live[r]}:")
                inside.enter_context(ctx.indent())
            ctx.line(f"for {jv} in range({str(O) if safe == O else f'min({O}, {N} - {n0})'}):")
            with inside, ctx.indent():
                i = self._column_index(bi, ms[r], ix.add(n0, jv))
                lets, write = y.store_parts(i, ctx.let(target.load(i), "f"))
                for line in lets:
                    ctx.line(line)
                ctx.line(write)

    def _column_index(self, bi: str, m: str, n: str) -> str:
        """Return the flat index of output (bi, m, n) for an epilogue loop's store: with
        affine_epilogue an ix.Affine whose column n (n0 + j) is known below N, so that the epilogue's
        bias loads at n0 + j, not at the flat index's `% N`, which the loop vectoriser could not bound
        against the loop's writes ("cannot identify array bounds": the loop ran scalar;
        benchmarks/NOTES.md, "Attention products on the CPU")."""
        M, N = self.M, self.N
        if not self.affine_epilogue:
            return ix.add(ix.mul(bi, M * N), ix.mul(m, N), n)
        return ix.add(ix.mul(ix.Affine.atom(bi, self.nbatch), M * N), ix.mul(ix.Affine.atom(m, M), N), ix.Affine.atom(n, N))

    def _finish(self, ctx, y, acc, finish, bi, ms, n0, rows, at_row, R, O, M, N, safe, row_bases=False) -> None:
        """Emit the tile's epilogue and stores, straight-line, from its accumulators."""
        # the finished values first, one statement each, then the stores: an expression per store
        # (bias, alpha, an epilogue's select) kept clang from vectorising the tile at all (63-256x4-4:
        # 20 ms a layer instead of 7, benchmarks/NOTES.md)
        done = [[ctx.let(at_row(r, lambda: finish(bi, ms[r], ix.add(n0, str(j)), acc[0][r][j])), "f")
                 for j in range(O)] for r in range(R)]
        # (the CPU's tiles) every store's statements (an epilogue's loads: a residual, a bias of
        # another buffer) before the first write: LLVM cannot move a load of another buffer across a
        # write it cannot prove distinct, and loads between the writes kept the tile from vectorising
        # (Mixer-S/16 2141 -> 1264 ms; benchmarks/NOTES.md, "GEMM tiles: stores after the epilogue's
        # loads"). A column past N keeps its store whole under its condition (its loads would read
        # past the row); a row's sample condition moves to the write (its loads read a clamped sample).
        # (row_bases: rows of N words, N not a multiple of 8) each row's writes at `min(its first
        # element, a bound it never passes) + j`: LLVM proves `+ j` does not wrap from the min's
        # range, so the writes are consecutive and seed the SLP vectoriser; at `... + m * 197 + n0 +
        # j` they were not (no known low zero bits to make `+ j` an `or`): scalar code (a Q K^T as
        # ViT-Ti's, 4 x 8 tiles: 1.78 -> 0.52 ms; benchmarks/NOTES.md, "Q K^T: consecutive stores")
        bases = [ctx.let(f"min({ix.add(ix.mul(bi, M * N), ix.mul(m, N), n0)}, {self.nbatch * M * N - min(O, N)})", "yb")
                 for m in ms] if row_bases and self.stores_last else None
        writes = []
        for r in range(R):
            for j in range(O):
                n = ix.add(n0, str(j))
                i = ix.add(ix.mul(bi, M * N), ix.mul(ms[r], N), n)
                if self.cpu_items() and self.stores_last and j < safe:
                    at = ix.add(bases[r], str(j)) if bases else None
                    lets, write = at_row(r, lambda: y.store_parts(i, done[r][j], at))
                    for line in lets:
                        ctx.line(line)
                    writes.append((rows[r][0], write))
                    continue
                store = at_row(r, lambda: y.store(i, done[r][j]))
                conds = [c for c in (rows[r][0], None if j < safe else f"{n} < {N}") if c]
                ctx.line_if(" and ".join(f"({c})" for c in conds) if conds else None, store)
        for cond, write in writes:
            ctx.line_if(cond, write)

    def _epilogue_loop(self, ctx, y, acc, finish, bi, ms, n0, rows, acc_dt, O, M, N, safe) -> None:
        """(epilogue_loop) The tile's epilogue as a loop over each row's columns (common.emit_epilogue_loop)."""
        def store(r, jv, value):
            n = ix.add(n0, jv)
            f = ctx.let(finish(bi, ms[r], n, value), "f")
            lets, write = y.store_parts(self._column_index(bi, ms[r], n), f)
            for line in lets:
                ctx.line(line)
            ctx.line_if(rows[r][0], write)

        emit_epilogue_loop(ctx, acc, acc_dt.dsl, str(O) if safe == O else f"min({O}, {N} - {n0})", store)

    # (the CPU's tiles) the epilogue as a loop over the tile's columns instead of straight-line
    # statements (common.loops_epilogue's rule: "gelu"; True: every epilogue, False: none, A/B
    # switches): [196,512]x[512,2048] + bias + torch's GELU 26.5 ms straight-line, 10.9 as a loop,
    # the MatMul + bias 6.4
    epilogue_loop: bool | str = "gelu"

    # set on a plan without blocks stages (the CPU backend; luisaml/compiler.py): the items form
    # is the CPU's at any size (a product too small for a block tile gains the panels and square
    # tiles too: [9, 768] x [768, 3072] 3.9 -> 20.7 GFLOP/s)
    no_blocks = False
    # the CPU's tiles (cpu_items) write after all the epilogue's loads (emit_item); off: the stores
    # one after another as CUDA's items form has them (an A/B switch, benchmarks/NOTES.md)
    stores_last = True
    # the CPU's tiles over a constant B take consecutive work items down a column block's rows, not
    # along its columns: a block of CPU_BLOCK items (one worker) then reads one K x O panel of B,
    # from L1, where each item read another panel ([196, 512] x [512, 2048]: 58 -> 81 GFLOP/s, [32,
    # 768] x [768, 3072] + GELU 30 -> 46; benchmarks/NOTES.md, "GEMM tiles on AVX-512"); an A/B switch
    rows_fast = True
    # the CPU's straight-line epilogue inside the k loop's last step (emit_item's `tail`); an A/B switch
    stores_in_loop = True
    # the CPU's tiles read A (and a B that is not a constant) at ix.Affine indices: the unravels of
    # the inline Split, Transpose and Reshape they read through fold away (ViT-Ti's Q K^T 4.4 -> 2.0
    # ms with 16 x 8 tiles; benchmarks/NOTES.md, "Attention products on the CPU"); an A/B switch
    affine_loads = True
    # (the CPU's tiles, B not a constant) the last row and column blocks shifted to end at M and N,
    # so that nothing is clamped (`min(n0 + j, N - 1)` in every block's loads broke the SLP
    # vectoriser's chains), the rows' writes at row bases where N is not a multiple of 8 (_finish),
    # and 8 rows a tile there (UNALIGNED_ROWS): ViT-Ti's 12 Q K^T stages 8.4 -> 4.3 ms (emit_item;
    # benchmarks/NOTES.md, "Q K^T: consecutive stores"); an A/B switch
    shift_last = True
    # (the epilogue loops) their stores' index as an ix.Affine (_column_index); an A/B switch
    affine_epilogue = True
    # (the epilogue loop, its end in a plain float buffer) the tile's finished values stored there
    # first, then the loop reads them back and writes the epilogue's values in place: its values
    # from a local array were a copy of the whole array a read (the CPU backend's `const lc_array f =
    # *v; f[j]`), which kept the loop scalar ("unsafe dependent memory operations"); an A/B switch
    epilogue_in_place = True

    def schedules(self, blocks: bool, wide: bool) -> list[dict]:
        from . import tiled

        def items() -> list[dict]:
            if self.samples_per_item() > 1:
                return []
            R, O, _, _ = self.tiles()
            return item_candidates(self.M, self.N, (R, O), wide)

        # neither the tensor cores' tile nor a tile of samples has knobs searched
        return tiled.product_schedules(self, blocks, wide, items,
                                       fixed=lambda tl: getattr(tl, "mma", False) or self.sample_rows())


@register("Gemm", since=7)
class Gemm(Dense):
    """Y = alpha * A' B' + beta * C, A' = A or A^T, B' = B or B^T, C broadcast to [M, N]
    (C is optional from opset 11; opsets 7-10 only require it, with the same meaning)."""

    nbatch = 1

    def check(self):
        a, b = self.input(0), self.input(1)
        self.expect_dtype(a, ("float", "int"), "input 0 (A)")
        _same_types(self, [(1, "B"), (2, "C")])
        self.expect(
            a.rank == 2 and b.rank == 2, f"A '{a.name}' and B '{b.name}' must be 2-D, got shapes {list(a.shape)} and {list(b.shape)}"
        )
        self.ta, self.tb = int(self.attr("transA", 0)), int(self.attr("transB", 0))
        self.alpha, self.beta = float(self.attr("alpha", 1.0)), float(self.attr("beta", 1.0))
        self.M, K = (a.shape[1], a.shape[0]) if self.ta else a.shape
        K2, self.N = (b.shape[1], b.shape[0]) if self.tb else b.shape
        self.expect(
            K == K2, f"inner dimensions differ: A {list(a.shape)} (transA={self.ta}), B {list(b.shape)} (transB={self.tb})"
        )
        self.K = K
        if self.has_input(2):
            c = self.input(2)
            ok = c.rank <= 2 and all(d in (1, w) for d, w in zip(reversed(c.shape), (self.N, self.M)))
            self.expect(ok, f"C '{c.name}' of shape {list(c.shape)} does not broadcast to [M, N] = [{self.M}, {self.N}]")
        if a.dtype.is_int:
            for name, v in (("alpha", self.alpha), ("beta", self.beta)):
                self.expect(v == int(v), f"integer Gemm needs a whole {name}, got {v}")

    def loaders(self):
        a, b, y = self.input(0), self.input(1), self.output()
        c = self.input(2) if self.has_input(2) and self.beta != 0 else None
        M, N, K = self.M, self.N, self.K
        acc_dt = compute_dtype(y.dtype)

        def load_a(_, m, k):
            return upcast(a.load(ix.add(ix.mul(k, M), m) if self.ta else ix.add(ix.mul(m, K), k)), a.dtype)

        def load_b(_, k, n):
            return upcast(b.load(ix.add(ix.mul(n, K), k) if self.tb else ix.add(ix.mul(k, N), n)), b.dtype)

        def scaled(v, s):
            return v if s == 1 else f"{literal(s, acc_dt)} * {v}"

        def finish(_, m, n, acc):
            v = scaled(acc, self.alpha)
            if c is not None:
                cv = upcast(c.load(ix.broadcast_index(ix.add(ix.mul(m, N), n), (M, N), c.shape)), c.dtype)
                v = f"{v} + {scaled(cv, self.beta)}"
            return convert(v, acc_dt, y.dtype)

        return load_a, load_b, finish, acc_dt

    def b_matrix(self, value):
        return (value.T if self.tb else value)[None]

    def forward(self, ctx):
        y = self.output()
        load_a, load_b, finish, acc_dt = self.loaders()
        ctx.render("matmul.py.j2", tile=False, batch=1, M=self.M, N=self.N, K=self.K, zero=literal(0, acc_dt),
                   a=load_a, bm=load_b,
                   store=lambda b, m, n, acc: y.store(ix.add(ix.mul(m, self.N), n), finish(b, m, n, acc)))

    def describe(self):
        R, O, _, _ = self.tiles()
        return f"M={self.M} N={self.N} K={self.K}: a thread per tile of {R}x{O} outputs{self.tuned_note()}"

    def describe_block(self):
        return f"M={self.M} N={self.N} K={self.K}: {self.block_tiling().describe()}{self.tuned_note()}"


@register("MatMul", since=1)
class MatMul(Dense):
    """numpy matmul: 1-D operands promoted (and the added dimension dropped), leading (batch)
    dimensions broadcast."""

    def check(self):
        a, b = self.input(0), self.input(1)
        self.expect_dtype(a, ("float", "int"), "input 0 (A)")
        _same_types(self, [(1, "B")])
        self.expect(a.rank >= 1 and b.rank >= 1, f"MatMul operands must have rank >= 1, got {list(a.shape)} x {list(b.shape)}")
        ash = (1,) + a.shape if a.rank == 1 else a.shape
        bsh = b.shape + (1,) if b.rank == 1 else b.shape
        self.M, self.K = ash[-2], ash[-1]
        self.N = bsh[-1]
        self.expect(bsh[-2] == self.K, f"inner dimensions differ: A {list(a.shape)} x B {list(b.shape)}")
        self.a_batch, self.b_batch = ash[:-2], bsh[:-2]
        try:
            self.batch_shape = tuple(np.broadcast_shapes(self.a_batch, self.b_batch))
        except ValueError:
            raise self.error(f"batch dimensions do not broadcast: A {list(a.shape)} x B {list(b.shape)}") from None
        self.nbatch = int(np.prod(self.batch_shape, dtype=np.int64))
        if self.nbatch > 1 and int(np.prod(self.b_batch, dtype=np.int64)) == 1:
            # one B for every batch entry (a Linear over [..., M, K]: ConvNeXt's channels-last MLP over
            # [H, W, C], a sequence-first projection over [T, B, D]): A's entries are consecutive rows
            # of one [nbatch * M, K] product. As nbatch products of M rows, M = 14 or 7 (ConvNeXt's
            # last stages) or 8 (BERT's qkv at batch 8) fell under tiled.MIN_SIDE into the items form
            self.M, self.nbatch, self.batch_shape, self.a_batch, self.b_batch = self.nbatch * self.M, 1, (), (), ()
        y = self.output()
        want = self.nbatch * self.M * self.N
        self.expect(y.numel == want, f"output '{y.name}' has shape {list(y.shape)}, expected {want} elements")

    def loaders(self):
        a, b, y = self.input(0), self.input(1), self.output()
        M, N, K = self.M, self.N, self.K
        acc_dt = compute_dtype(y.dtype)

        def base(t_batch, bi, size):
            idx = ix.broadcast_index(bi, self.batch_shape, t_batch) if self.batch_shape else "0"
            return ix.mul(idx, size)

        def load_a(bi, m, k):
            return upcast(a.load(ix.add(base(self.a_batch, bi, M * K), ix.mul(m, K), k)), a.dtype)

        def load_b(bi, k, n):
            return upcast(b.load(ix.add(base(self.b_batch, bi, K * N), ix.mul(k, N), n)), b.dtype)

        return load_a, load_b, (lambda bi, m, n, acc: convert(acc, acc_dt, y.dtype)), acc_dt

    def b_matrix(self, value):
        return value.reshape(-1, self.K, self.N)

    def b_entry(self, bi):
        return ix.broadcast_index(bi, self.batch_shape, self.b_batch) if self.batch_shape else "0"

    def forward(self, ctx):
        y = self.output()
        M, N, K = self.M, self.N, self.K
        load_a, load_b, finish, acc_dt = self.loaders()

        def store(bi, m, n, acc):
            return y.store(ix.add(ix.mul(bi, M * N), ix.mul(m, N), n), finish(bi, m, n, acc))

        ctx.render("matmul.py.j2", tile=False, batch=self.nbatch, M=M, N=N, K=K, zero=literal(0, acc_dt), a=load_a,
                   bm=load_b, store=store)

    def describe(self):
        R, O, _, _ = self.tiles()
        return (f"batch={list(self.batch_shape)} M={self.M} N={self.N} K={self.K}: a thread per tile of {R}x{O} outputs"
                f"{self.tuned_note()}")

    def describe_block(self):
        return (f"batch={list(self.batch_shape)} M={self.M} N={self.N} K={self.K}: {self.block_tiling().describe()}"
                f"{self.tuned_note()}")
