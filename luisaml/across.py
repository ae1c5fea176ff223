"""Reads across, on CUDA: a stage that reads a stored tensor through an inline Transpose that moves
its innermost axis loads, at neighbouring output elements, elements a row apart. ConvNeXt's block
permutes between NCHW (the depthwise Conv) and NHWC (LayerNorm, the Linears): its LayerNorms read the
Conv's output a channel at a time (a warp's 32 lanes 32 channels, H x W floats apart), its residual
Adds and its LayerNorm2d's permutes back read the NHWC tensor C floats apart. Each warp load then
touches 32 sectors for 32 floats (benchmarks/NOTES.md, "Reads across on CUDA").

Here such a stage reads through a tile in shared memory, loaded in the order in which the stored
tensor is contiguous, and read back in the order the stage computes (the tiled transpose):

- an **element stage** (a Transpose stored, an Add of a permuted operand) takes a block of
  ELEMENT_THREADS threads per TILE x TILE tile of the output's two axes that the permutation swaps
  (`ElementTile`): the permuted operand (or the stage's whole value, where every load it makes is
  across) is loaded with lanes along the stored tensor's unit-stride axis into a padded shared
  tile, then each thread computes its outputs along the output's rows from the tile;
- a **normalization over the last axis** whose input's loads are contiguous along the rows
  (ConvNeXt's LayerNorm of a permuted NCHW tensor) takes a block per tile of rows, its rows' whole
  groups loaded into shared memory with lanes along the rows (operators/normalization.py,
  `Norm.across_tiling`), then a warp per row as before, from shared memory.

`strides` follows a stored tensor's element strides through the inline nodes a stage reads
(Operator.axis_map: elementwise nodes keep the axes, a Transpose permutes them); the forms are
chosen only on CUDA (the schedule's blocks), so CPU plans are unchanged. ACROSS (or
LUISAML_ACROSS=off, read at plan time) is the A/B switch that restores the strided reads.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from . import indexing as ix
from .storage import row_major_strides

ACROSS = True
TILE = 32  # an element tile's side: a warp's load is 32 consecutive floats of the stored tensor
ELEMENT_THREADS = 256  # 8 warps: each thread loads and computes TILE * TILE / 256 = 4 elements
# an element stage's axes this short keep the element form: a tile mostly empty
MIN_SIDE = 8


def enabled() -> bool:
    """Whether the across forms are chosen (ACROSS, unless LUISAML_ACROSS is "off")."""
    return ACROSS and os.environ.get("LUISAML_ACROSS", "on") != "off"


def _root(name: str, views: dict[str, str]) -> str:
    while name in views:
        name = views[name]
    return name


def strides(code, name: str, virtual: dict, views: dict[str, str]) -> list[tuple[str, tuple[int, ...]]] | None:
    """Return the stored tensors that an element load of tensor `name` loads as many elements of
    as it has (constants and smaller broadcast operands left out: they stay in cache), each with
    its element strides per axis of `name`; None where some load is not such a map of the
    coordinates (a Gather, a Slice, a view of a permuted tensor)."""
    t = code.tensors[name]
    root = _root(name, views)
    if root not in virtual:
        return [] if code.tensors[root].value is not None else [(root, row_major_strides(tuple(t.shape)))]
    if root != name:  # a view of an inline tensor: its flat index, where the tensor's loads are in order
        inner = strides(code, root, virtual, views)
        rm = row_major_strides(tuple(code.tensors[root].shape))
        if inner is None or any(v != rm for _, v in inner):
            return None
        return [(s, row_major_strides(tuple(t.shape))) for s, _ in inner]
    node, op, _ = virtual[root]
    out: list[tuple[str, tuple[int, ...]]] = []
    for k, i in enumerate(node.inputs):
        if not i or code.tensors[i].numel < t.numel:
            continue
        m = op.axis_map(k)
        sub = None if m is None or len(m) != len(t.shape) else strides(code, i, virtual, views)
        if sub is None:
            return None
        out += [(s, tuple(v[m[a]] for a in range(len(m)))) for s, v in sub]
    return out


def _merge(sizes, *sets) -> tuple[list[int], list[list[int]]]:
    """Return (sizes, strides per set) with size-1 axes dropped and neighbours merged where every
    set walks them as one."""
    out_n: list[int] = []
    out_s: list[list[int]] = [[] for _ in sets]
    for d, n in enumerate(sizes):
        if n == 1:
            continue
        if out_n and all(s[-1] == st[d] * n for s, st in zip(out_s, sets)):
            out_n[-1] *= n
            for s, st in zip(out_s, sets):
                s[-1] = st[d]
        else:
            out_n.append(n)
            for s, st in zip(out_s, sets):
                s.append(st[d])
    return out_n, out_s


def unit_axis(shape: tuple[int, ...], vec: tuple[int, ...]) -> int | None:
    """Return the axis (of size > 1) along which strides `vec` step by 1, or None."""
    return next((d for d, (n, s) in enumerate(zip(shape, vec)) if n > 1 and s == 1), None)


def across_loads(shape: tuple[int, ...], loads) -> list[tuple[str, int]]:
    """Return (stored tensor, its unit-stride axis) of each load that steps by more than 1 along
    the last axis of size > 1 of `shape` and by 1 along another."""
    last = max((d for d, n in enumerate(shape) if n > 1), default=None)
    out = []
    for s, vec in loads:
        b = unit_axis(shape, vec)
        if last is not None and vec[last] != 1 and b is not None:
            out.append((s, b))
    return out


@dataclass(frozen=True)
class ElementTile:
    """An element stage read through shared tiles: the output's axes merged (`sizes`, its strides
    `out`), a its unit-stride axis, b the permuted operand's; `staged`: the tensors read through a
    tile (the root's inputs), or () for the stage's whole value."""

    sizes: tuple[int, ...]
    out: tuple[int, ...]
    a: int
    b: int
    staged: tuple[str, ...]

    threads = ELEMENT_THREADS

    @property
    def tiles_a(self) -> int:
        return -(-self.sizes[self.a] // TILE)

    @property
    def tiles_b(self) -> int:
        return -(-self.sizes[self.b] // TILE)

    @property
    def others(self) -> int:
        n = 1
        for d, s in enumerate(self.sizes):
            if d not in (self.a, self.b):
                n *= s
        return n

    @property
    def blocks(self) -> int:
        return self.others * self.tiles_a * self.tiles_b

    def describe(self) -> str:
        what = "its value" if not self.staged else ", ".join(f"'{s}'" for s in self.staged)
        return (f"a block of {self.threads} threads per {TILE} x {TILE} tile, {what} read through shared "
                f"memory in the order of the stored tensor's rows")


def element_tile(code, node, op, out: str, virtual: dict, views: dict[str, str]) -> ElementTile | None:
    """Return the tiled form of an element stage rooted at node (output `out`, the epilogue's end),
    or None: its root reads its inputs at permuted coordinates (Operator.axis_map), some stored
    tensor across (across_loads), all such along one axis b. The tile stages the root's whole value
    where all its loads are across, else each input of the root's shape whose loads are all across."""
    t = code.tensors[out]
    shape = tuple(t.shape)
    if t.dtype.dsl != "float" or not node.outputs or tuple(code.tensors[node.outputs[0]].shape) != shape:
        return None
    per_input: list[tuple[str, list]] = []
    for k, i in enumerate(node.inputs):
        if not i or code.tensors[i].numel < t.numel:
            continue
        m = op.axis_map(k)
        sub = None if m is None or len(m) != len(shape) else strides(code, i, virtual, views)
        if sub is None:
            return None
        per_input.append((i, [(s, tuple(v[m[a]] for a in range(len(m)))) for s, v in sub]))
    loads = [ld for _, lds in per_input for ld in lds]
    across = across_loads(shape, loads)
    if not across or len({b for _, b in across}) != 1:
        return None
    b_axis = across[0][1]
    if len(across) == len(loads) and op.inline:  # (an inline node's element() is an expression)
        staged: tuple[str, ...] = ()
    else:
        staged = tuple(i for i, lds in per_input if lds and len(across_loads(shape, lds)) == len(lds)
                       and _root(i, views) in virtual and code.tensors[i].dtype.dsl == "float"
                       and op.axis_map(node.inputs.index(i)) == list(range(len(shape))))
        if not staged:
            return None
    vec = next(v for s, v in loads if unit_axis(shape, v) == b_axis)
    sizes, (out_s, in_s) = _merge(shape, row_major_strides(shape), vec)
    if len(sizes) < 2 or out_s[-1] != 1 or 1 not in in_s:
        return None
    a, b = len(sizes) - 1, in_s.index(1)
    if a == b or min(sizes[a], sizes[b]) < MIN_SIDE:
        return None
    return ElementTile(tuple(sizes), tuple(out_s), a, b, staged)


def emit_element_tile(ctx, tile: ElementTile, item: str, thread: str, tensors: dict, node, op, k: int,
                      out_t, epilogue_lets, epilogue) -> None:
    """Emit thread `thread` of block `item` of an element tile: the tile's staged values loaded with
    lanes along axis b into shared memory (a row of TILE + 1: the lanes' reads back along axis a hit
    32 banks), a barrier, then the thread's TILE * TILE / threads outputs computed along axis a from
    the tile, the epilogue applied and stored."""
    from .codegen import Inline
    from .storage import Value, bind

    sizes, a, b = tile.sizes, tile.a, tile.b
    na, nb = tile.tiles_a, tile.tiles_b
    # the element index as an Affine of named coordinates: the permuting reader's divisions fold
    atom = ix.Affine.atom
    item = ctx.let(item, "item")
    ta = atom(ctx.let(ix.mod(item, na), "ta"), na)
    tb = atom(ctx.let(ix.mod(ix.div(item, na), nb) if tile.others > 1 else ix.div(item, na), "tb"), nb)
    parts, rest, inner = [], ix.div(item, na * nb), 1
    for d in reversed([d for d in range(len(sizes)) if d not in (a, b)]):
        c = ix.div(rest, inner)
        c = ix.mod(c, sizes[d]) if inner * sizes[d] < tile.others else c
        parts.append(ix.mul(atom(ctx.let(c, "o"), sizes[d]), tile.out[d]))
        inner *= sizes[d]
    lane = ctx.let(f"{thread} % {TILE}", "lane")
    w = ctx.let(f"{thread} // {TILE}", "w")
    rows = TILE * TILE // tile.threads
    step = tile.threads // TILE
    shared = {s: ctx.shared_array("float", TILE * (TILE + 1), "tile") for s in (tile.staged or ("",))}

    def at(pa: str, pb: str):
        ea = ix.add(ix.mul(ta, TILE), atom(pa, TILE))
        eb = ix.add(ix.mul(tb, TILE), atom(pb, TILE))
        guard = [f"{ea} < {sizes[a]}"] * (sizes[a] % TILE != 0) + [f"{eb} < {sizes[b]}"] * (sizes[b] % TILE != 0)
        return ix.add(*parts, ix.mul(ea, tile.out[a]), ix.mul(eb, tile.out[b])), " and ".join(guard) or None

    def guarded(cond):
        if cond is None:
            return _Nothing()
        ctx.line(f"if {cond}:")
        return ctx.indent()

    for j in range(rows):  # loads: lanes along b (the stored tensor's rows)
        pa, pb = ctx.let(f"{w} + {step * j}", "pa"), lane
        i, cond = at(pa, pb)
        with guarded(cond):
            for s, sh in shared.items():
                v = tensors[s].load(i) if s else Inline(op, k, ctx.module).load(i)
                ctx.line(f"{sh}[{pa} * {TILE + 1} + {pb}] = {v}")
    ctx.line("sync_block()")
    for j in range(rows):  # values: lanes along a (the output's rows)
        pa, pb = lane, ctx.let(f"{w} + {step * j}", "pb")
        i, cond = at(pa, pb)
        with guarded(cond):
            cell = f"{pa} * {TILE + 1} + {pb}"
            i = ctx.let(i, "i")
            if tile.staged:
                with bind({tensors[s]: Value(f"{sh}[{cell}]") for s, sh in shared.items()}):
                    v = ctx.let(op.element(ctx, i, k), "v")
            else:
                v = f"{shared['']}[{cell}]"
            if epilogue:
                lets, v = epilogue_lets(epilogue, op.outputs[0], v, i, ctx.module)
                for name, expr in lets:
                    ctx.line(f"{name} = {expr}")
            ctx.line(out_t.store(i, v))


class _Nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def choose(code, node, op, kind: str, out: str, virtual: dict, views: dict[str, str]):
    """Return the across form of a stage rooted at node on CUDA (its output `out`; kind: the
    schedule's), an ElementTile or the operator's across_tiling, or None (the stage keeps its form)."""
    if not enabled():
        return None
    if kind in ("element", "inline"):
        return element_tile(code, node, op, out, virtual, views)
    x = node.inputs[0] if node.inputs else None
    if kind != "items" or not x or _root(x, views) not in virtual:
        return None
    loads = strides(code, x, virtual, views)
    across = across_loads(tuple(code.tensors[x].shape), loads or [])
    if not across or len({b for _, b in across}) != 1:
        return None
    return op.across_tiling(across[0][1])

