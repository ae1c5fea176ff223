"""Index arithmetic rendered as DSL int expressions: unravel a flat index over a shape, ravel
coordinates with strides, and the broadcast index of an input inside an output's loop."""
from __future__ import annotations

from .storage import row_major_strides


def _p(e: str) -> str:
    """Parenthesise an expression unless it is a name or a number."""
    return e if e.replace("_", "").isalnum() else f"({e})"


def mul(e: str, k: int) -> str:
    """Return the DSL of e * k, simplified."""
    if k == 0 or e == "0":
        return "0"
    if k == 1:
        return e
    if e.isdigit():
        return str(int(e) * k)
    return f"{_p(e)} * {k}"


def add(*terms: str) -> str:
    """Return the DSL sum of the terms, dropping zeros."""
    nums = sum(int(t) for t in terms if t.isdigit())
    rest = [t for t in terms if not t.isdigit()]
    if nums:
        rest.append(str(nums))
    return " + ".join(rest) if rest else "0"


def div(e: str, k: int) -> str:
    return e if k == 1 else (str(int(e) // k) if e.isdigit() else f"{_p(e)} // {k}")


def mod(e: str, k: int) -> str:
    if k == 1:
        return "0"
    return str(int(e) % k) if e.isdigit() else f"{_p(e)} % {k}"


def coord(i: str, shape: tuple[int, ...], d: int) -> str:
    """Return coordinate d of flat index i over a C-ordered shape."""
    strides = row_major_strides(shape)
    if shape[d] == 1:
        return "0"
    c = div(i, strides[d])
    return c if all(s == 1 for s in shape[:d]) else mod(c, shape[d])


def unravel(i: str, shape: tuple[int, ...]) -> list[str]:
    """Return the coordinates of flat index i over a C-ordered shape."""
    return [coord(i, shape, d) for d in range(len(shape))]


def ravel(coords: list[str], strides: tuple[int, ...]) -> str:
    """Return the flat index of coordinates under strides."""
    return add(*(mul(c, s) for c, s in zip(coords, strides)))


def broadcast_index(i: str, out_shape: tuple[int, ...], in_shape: tuple[int, ...]) -> str:
    """Return the flat index into an input broadcast (numpy rules) to the output, at output index i."""
    if tuple(in_shape) == tuple(out_shape):
        return i
    r = len(out_shape)
    padded = (1,) * (r - len(in_shape)) + tuple(in_shape)
    # coalesce runs of dims that are all broadcast or all kept, ignoring size-1 output dims
    segs: list[list] = []  # [size, broadcast]
    for s, t in zip(out_shape, padded):
        if s == 1:
            continue
        b = t == 1
        if segs and segs[-1][1] == b:
            segs[-1][0] *= s
        else:
            segs.append([s, b])
    if not segs or all(b for _, b in segs):
        return "0"
    sizes = tuple(s for s, _ in segs)
    out_strides = row_major_strides(sizes)
    kept = [k for k, (_, b) in enumerate(segs) if not b]
    terms = []
    in_stride = 1
    for k in reversed(kept):
        c = div(i, out_strides[k])
        if k > 0:
            c = mod(c, sizes[k])
        terms.append(mul(c, in_stride))
        in_stride *= sizes[k]
    return add(*reversed(terms))
