"""Index arithmetic rendered as DSL int expressions: unravel a flat index over a shape, ravel
coordinates with strides, and the broadcast index of an input inside an output's loop; `Affine`
indices, whose divisions and remainders fold where the bounds of their terms prove them exact."""
from __future__ import annotations

from .storage import row_major_strides


def _p(e: str) -> str:
    """Parenthesise an expression unless it is a name or a number."""
    return e if e.replace("_", "").isalnum() else f"({e})"


class Affine(str):
    """An index sum(atom * coefficient) + const whose atoms (names or expressions) lie in [0, bound):
    its text is that sum, so it reads as any index does; mul, add, div and mod keep it affine where
    they can, and fold `e // d` and `e % d` when the terms d does not divide stay below d. A
    flat index of a CPU GEMM tile's operand, read through inline Split and Transpose, then loses its
    unravel's divisions: each remap's `(f // 197) % 64` of `bi * 12608 + k * 197 + n` is `k`
    (operators/gemm.py, Dense.affine_loads; benchmarks/NOTES.md, "Attention products on the CPU")."""

    terms: dict
    bounds: dict
    const: int

    def __new__(cls, terms: dict, bounds: dict, const: int = 0):
        terms = {a: c for a, c in terms.items() if c}
        parts = [a if c == 1 else f"{_p(a)} * {c}" for a, c in terms.items()] + ([str(const)] if const or not terms else [])
        s = super().__new__(cls, " + ".join(parts))
        s.terms, s.bounds, s.const = terms, {a: bounds[a] for a in terms}, const
        return s

    @staticmethod
    def atom(name: str, bound: int) -> "Affine":
        """Return the index `name`, known to lie in [0, bound) (a number: that constant)."""
        return Affine({}, {}, int(name)) if name.isdigit() else Affine({name: 1}, {name: bound})

    def _split(self, d: int):
        """Return (quotient, remainder) Affines of an exact division by d, or None."""
        if self.const < 0 or any(c < 0 for c in self.terms.values()):
            return None
        q = {a: c // d for a, c in self.terms.items() if c % d == 0}
        r = {a: c for a, c in self.terms.items() if c % d}
        if self.const % d + sum(c * (self.bounds[a] - 1) for a, c in r.items()) >= d:
            return None
        return Affine(q, self.bounds, self.const // d), Affine(r, self.bounds, self.const % d)


def _affine(e: str) -> Affine | None:
    """Return e as an Affine (a number is a constant one), or None."""
    if isinstance(e, Affine):
        return e
    return Affine({}, {}, int(e)) if e.isdigit() else None


def mul(e: str, k: int) -> str:
    """Return the DSL of e * k, simplified."""
    if isinstance(e, Affine):
        return Affine({a: c * k for a, c in e.terms.items()}, e.bounds, e.const * k)
    if k == 0 or e == "0":
        return "0"
    if k == 1:
        return e
    if e.isdigit():
        return str(int(e) * k)
    return f"{_p(e)} * {k}"


def add(*terms: str) -> str:
    """Return the DSL sum of the terms, dropping zeros."""
    if any(isinstance(t, Affine) for t in terms):
        parts = [_affine(t) for t in terms]
        if all(p is not None for p in parts):
            out: dict = {}
            for p in parts:
                for a, c in p.terms.items():
                    out[a] = out.get(a, 0) + c
            return Affine(out, {a: b for p in parts for a, b in p.bounds.items()}, sum(p.const for p in parts))
    nums = sum(int(t) for t in terms if t.isdigit())
    rest = [t for t in terms if not t.isdigit()]
    if nums:
        rest.append(str(nums))
    return " + ".join(rest) if rest else "0"


def div(e: str, k: int) -> str:
    if isinstance(e, Affine) and k != 1:
        qr = e._split(k)
        if qr is not None:
            return qr[0]
    return e if k == 1 else (str(int(e) // k) if e.isdigit() else f"{_p(e)} // {k}")


def mod(e: str, k: int) -> str:
    if k == 1:
        return "0"
    if isinstance(e, Affine):
        qr = e._split(k)
        if qr is not None:
            return qr[1]
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
