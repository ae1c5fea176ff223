"""Resize (opsets 10-19), Upsample (7-10), GridSample (16-22) and RoiAlign (10-22).

Shapes, scales and sizes are static, so where each output element reads from is known when
compiling: the host computes, per resized axis, each output coordinate's source indices and
interpolation weights (float64, as ONNX's reference does, rounded once to float32) and the kernel
reads them from constant tables (shaders/accumulate.py.j2). Interpolation is separable: an output
element is the sum over every combination of taps of the product of the axes' weights times the
input element. Nearest modes keep one index per axis and copy the element (exact for every dtype);
linear and cubic accumulate in float (half is rounded once at the end).

In stages, an output element is one thread (element()); nearest Resize is a pure expression of
the index (inline, like a Gather). GridSample and RoiAlign run one thread per output element too."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from luisaml import dtypes
from luisaml import indexing as ix
from luisaml.operator import Derived, Operator
from luisaml.registry import register
from luisaml.storage import literal

from .common import compute_dtype, convert, loop_vars

MODES = ("nearest", "linear", "cubic")
TRANSFORMS = ("half_pixel", "asymmetric", "align_corners", "pytorch_half_pixel", "tf_crop_and_resize",
              "half_pixel_symmetric", "tf_half_pixel_for_nn")
NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")


@dataclass(frozen=True)
class AxisSpec:
    """How one axis is resized: everything its host tables depend on."""

    mode: str
    transform: str
    in_w: int
    out_w: int
    scale: float
    roi: tuple[float, float] = (0.0, 1.0)
    nearest_mode: str = "round_prefer_floor"
    cubic_a: float = -0.75
    exclude_outside: bool = False
    antialias: bool = False


def source_coords(s: AxisSpec) -> tuple[np.ndarray, np.ndarray]:
    """Return (the input coordinate of every output coordinate, whether it lies outside the
    region tf_crop_and_resize samples) along one axis, in float64."""
    y = np.arange(s.out_w, dtype=np.float64)
    # align_corners, pytorch_half_pixel and tf_crop_and_resize take the resized length as scale *
    # length, unrounded (ONNX's reference and its node tests); onnxruntime and PyTorch take the
    # output's length, which differs only when scale * length is not a whole number
    length = s.scale * s.in_w
    outside = np.zeros(s.out_w, dtype=bool)
    t = s.transform
    if t == "align_corners":
        x = np.zeros(s.out_w) if length == 1 else y * (s.in_w - 1) / (length - 1)
    elif t == "asymmetric":
        x = y / s.scale
    elif t == "tf_crop_and_resize":
        lo, hi = s.roi
        if length == 1:
            x = np.full(s.out_w, (hi - lo) * (s.in_w - 1) / 2)
        else:
            x = y * (hi - lo) * (s.in_w - 1) / (length - 1)
        x = x + lo * (s.in_w - 1)
        outside = (x < 0) | (x > s.in_w - 1)
    elif t == "pytorch_half_pixel":
        x = np.full(s.out_w, -0.5) if length == 1 else (y + 0.5) / s.scale - 0.5
    elif t == "half_pixel":
        x = (y + 0.5) / s.scale - 0.5
    elif t == "half_pixel_symmetric":
        offset = s.in_w / 2 * (1 - s.out_w / length)
        x = offset + (y + 0.5) / s.scale - 0.5
    elif t == "tf_half_pixel_for_nn":  # opset 11-12
        x = (y + 0.5) / s.scale
    else:
        raise ValueError(f"unknown coordinate_transformation_mode {t!r}")
    return x, outside


def _cubic(d: np.ndarray, a: float) -> np.ndarray:
    """The cubic convolution kernel at distances d (Keys, parameter a)."""
    d = np.abs(d)
    near = ((a + 2) * d - (a + 3)) * d * d + 1
    far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    return np.where(d <= 1, near, np.where(d < 2, far, 0.0))


def _coeffs(s: AxisSpec, ratio: np.ndarray) -> np.ndarray:
    """Return the [O, n] interpolation weights of the taps around the source coordinate, ratio
    (in [0, 1]) being its distance from the tap just left of it."""
    r = ratio[:, None]
    if s.mode == "linear" and not s.antialias:
        return np.concatenate([1 - r, r], axis=1)
    if s.mode == "cubic" and not s.antialias:
        return _cubic(np.concatenate([r + 1, r, 1 - r, 2 - r], axis=1), s.cubic_a)
    scale = min(s.scale, 1.0)  # antialiasing widens the kernel by 1 / scale when downsampling
    support = 1 if s.mode == "linear" else 2
    start = int(np.floor(-support / scale) + 1)
    d = (np.arange(start, 2 - start)[None, :] - r) * scale
    c = np.clip(1 - np.abs(d), 0, 1) if s.mode == "linear" else _cubic(d, s.cubic_a)
    return c / c.sum(axis=1, keepdims=True)


def axis_taps(s: AxisSpec) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """Return (indices [O, n] clamped into the input, weights [O, n] or None for nearest,
    outside [O]) of one resized axis. Taps beyond the edges read the edge element (ONNX's edge
    padding); exclude_outside drops them and renormalises instead."""
    x, outside = source_coords(s)
    fl = np.floor(x)
    whole = x == fl
    if s.mode == "nearest":
        frac = x - fl
        up = {
            "round_prefer_floor": frac > 0.5,
            "round_prefer_ceil": frac >= 0.5,
            "floor": np.zeros_like(whole),
            "ceil": ~whole,
        }[s.nearest_mode]
        idx = (fl + up).astype(np.int64)[:, None]
        return np.clip(idx, 0, s.in_w - 1), None, outside
    # A tap of weight 0 is still read, and a NaN or inf there makes NaN, so which taps are read
    # matters: linear and cubic read onnxruntime's ones, not ONNX's reference's (same values else)
    if s.mode == "linear" and not s.antialias:
        # the coordinate clamped into the input, its floor and the next element (the last one
        # twice at the right edge, weighed 1/2 and 1/2)
        xc = np.clip(x, 0, s.in_w - 1)
        x1 = np.minimum(np.floor(xc), s.in_w - 1)
        x2 = np.minimum(x1 + 1, s.in_w - 1)
        w = np.where((x1 == x2)[:, None], 0.5, np.stack([x2 - xc, xc - x1], axis=1))
        return np.stack([x1, x2], axis=1).astype(np.int64), w, outside
    if s.mode == "cubic" and not s.antialias:
        # floor(x) - 1 .. floor(x) + 2 (a whole x weighs its neighbours 0), edge-padded
        w, start = _coeffs(s, x - fl), fl - 1
    else:
        w = _coeffs(s, np.where(whole, 1.0, x - fl))
        # the n taps nearest to x, ties to the lower index (ONNX's reference, edge-padded by ceil(n/2))
        n = w.shape[1]
        if n % 2 == 0:
            start = fl - n // 2 + np.where(whole, 0, 1)
        else:
            start = fl - (n - 1) // 2 + np.where(x - fl <= 0.5, 0, 1)
    idx = start.astype(np.int64)[:, None] + np.arange(w.shape[1])[None, :]
    if s.exclude_outside:
        w = np.where((idx < 0) | (idx >= s.in_w), 0.0, w)
        total = w.sum(axis=1, keepdims=True)
        w = w / np.where(total == 0, 1.0, total)
    return np.clip(idx, 0, s.in_w - 1), w, outside


def output_geometry(shape: tuple[int, ...], axes: list[int], scales: list[float] | None, sizes: list[int] | None,
                    policy: str) -> tuple[list[float], list[int]]:
    """Return (the scale of every axis, the output shape) from scales or sizes on `axes`: a scaled
    axis is floor(scale * length) long; sizes under not_larger / not_smaller share the smallest /
    largest ratio over the axes and round each length half up."""
    full_scale, out = [1.0] * len(shape), list(shape)
    if scales is not None:
        for d, s in zip(axes, scales):
            full_scale[d], out[d] = s, math.floor(s * shape[d])
        return full_scale, out
    ratios = {d: n / shape[d] for d, n in zip(axes, sizes)}
    if policy != "stretch":
        common = (min if policy == "not_larger" else max)(ratios.values())
        ratios = dict.fromkeys(axes, common)
        sizes = [int(common * shape[d] + 0.5) for d in axes]
    for d, n in zip(axes, sizes):
        full_scale[d], out[d] = ratios[d], n
    return full_scale, out


def resize_indices(spec: AxisSpec) -> np.ndarray:
    """Return one axis's tap indices, flat [O * n] int32 (a derived constant)."""
    return axis_taps(spec)[0].astype(np.int32).reshape(-1)


def resize_weights(spec: AxisSpec) -> np.ndarray:
    """Return one axis's tap weights, flat [O * n] float32 (a derived constant)."""
    return axis_taps(spec)[1].astype(np.float32).reshape(-1)


def resize_outside(spec: AxisSpec) -> np.ndarray:
    """Return whether each output coordinate of one axis lies outside the crop region (int32)."""
    return axis_taps(spec)[2].astype(np.int32)


def _floats(v) -> list[float]:
    return [float(a) for a in np.asarray(v, dtype=np.float64).reshape(-1)]


def _ints(v) -> list[int]:
    return [int(a) for a in np.asarray(v).reshape(-1)]


@register("Resize", since=11)
class Resize(Operator):
    """Resize with roi, scales and sizes as constant inputs (opset 11 on; axes,
    keep_aspect_ratio_policy and antialias from opset 18)."""

    def params(self) -> tuple[list[float] | None, list[float] | None, list[int] | None]:
        """Return (roi, scales, sizes) from the inputs, None where absent or empty."""
        got = []
        for k, what in ((1, "roi"), (2, "scales"), (3, "sizes")):
            v = self.const(k, what) if self.has_input(k) else None
            got.append(None if v is None or np.asarray(v).size == 0 else v)
        roi, scales, sizes = got
        return (None if roi is None else _floats(roi), None if scales is None else _floats(scales),
                None if sizes is None else _ints(sizes))

    def attrs(self) -> dict:
        return {
            "mode": self.attr("mode", "nearest"),
            "transform": self.attr("coordinate_transformation_mode", "half_pixel"),
            "nearest_mode": self.attr("nearest_mode", "round_prefer_floor"),
            "cubic_a": float(self.attr("cubic_coeff_a", -0.75)),
            "exclude_outside": bool(self.attr("exclude_outside", 0)),
            "antialias": bool(self.attr("antialias", 0)),
            "extrapolation": float(self.attr("extrapolation_value", 0.0)),
            "policy": self.attr("keep_aspect_ratio_policy", "stretch"),
            "axes": self.attr("axes", None),
        }

    def check(self):
        x, y = self.input(0), self.output()
        a = self.attrs()
        for key, allowed in (("mode", MODES), ("transform", TRANSFORMS), ("nearest_mode", NEAREST_MODES)):
            self.expect(a[key] in allowed, f"{key.replace('transform', 'coordinate_transformation_mode')} "
                                           f"{a[key]!r} is not one of {', '.join(allowed)}")
        self.expect(a["policy"] in ("stretch", "not_larger", "not_smaller"),
                    f"keep_aspect_ratio_policy {a['policy']!r} is not stretch, not_larger or not_smaller")
        self.expect(not (a["antialias"] and a["mode"] == "nearest"), "antialias applies to linear and cubic modes only")
        if a["mode"] != "nearest":
            self.expect_dtype(x, ("float",), "input 0 (X) of a linear or cubic Resize")
        r = x.rank
        axes = list(range(r)) if a["axes"] is None else [self.axis(d, r, what="axis of axes") for d in a["axes"]]
        self.expect(len(set(axes)) == len(axes), f"axes {a['axes']} name an axis twice")
        roi, scales, sizes = self.params()
        self.expect((scales is None) != (sizes is None), "exactly one of scales and sizes must be given")
        given = scales if scales is not None else sizes
        self.expect(len(given) == len(axes),
                    f"{'scales' if scales is not None else 'sizes'} has {len(given)} values for {len(axes)} axes")
        if scales is not None:
            self.expect(all(v > 0 for v in scales), f"scales {scales} must be positive")
        full_scale, out = output_geometry(tuple(x.shape), axes, scales, sizes, a["policy"])
        for d in axes:  # onnx's shape inference multiplies in float32: take its length where it differs so
            if scales is not None and y.shape[d] == math.floor(np.float32(full_scale[d]) * np.float32(x.shape[d])):
                out[d] = y.shape[d]
        self.expect(tuple(out) == tuple(y.shape), f"computed output shape {out} differs from the inferred {list(y.shape)}")
        full_roi = [(0.0, 1.0)] * r
        if a["transform"] == "tf_crop_and_resize":
            self.expect(roi is not None and len(roi) == 2 * len(axes),
                        f"tf_crop_and_resize needs roi of {2 * len(axes)} values, got {0 if roi is None else len(roi)}")
            for k, d in enumerate(axes):
                full_roi[d] = (roi[k], roi[len(axes) + k])
        self.specs: dict[int, AxisSpec] = {}
        for d in axes:
            if full_scale[d] == 1.0 and out[d] == x.shape[d] and full_roi[d] == (0.0, 1.0):
                continue  # identity along this axis (as the reference: no interpolation at all)
            if x.batched and d == 0:
                self.axis(0, r, batched=True, what="resized axis")
            self.specs[d] = AxisSpec(a["mode"], a["transform"], x.shape[d], out[d], full_scale[d], full_roi[d],
                                     self.nearest_mode(a, full_scale[d]), a["cubic_a"], a["exclude_outside"],
                                     a["antialias"])
        self.specs = dict(sorted(self.specs.items()))  # forward() reads the tables in axis order
        self.extrapolation = a["extrapolation"]
        self.outside = {d: bool(axis_taps(s)[2].any()) for d, s in self.specs.items()}
        # nearest (or nothing resized) reads one tap per axis from the index tables: an inline
        # remap, like a Gather
        self.nearest = all(s.mode == "nearest" for s in self.specs.values())
        self.inline = self.nearest

    def derived_inputs(self):
        out = []
        for d, s in self.specs.items():
            n = self.taps(s)
            out.append(Derived(resize_indices, (), dtypes.INT32, (s.out_w * n,), (("spec", s),)))
            if s.mode != "nearest":
                out.append(Derived(resize_weights, (), dtypes.FLOAT, (s.out_w * n,), (("spec", s),)))
            if self.outside[d]:
                out.append(Derived(resize_outside, (), dtypes.INT32, (s.out_w,), (("spec", s),)))
        return out

    def nearest_mode(self, a: dict, scale: float) -> str:
        """Return how nearest mode rounds along an axis resized by `scale`."""
        return a["nearest_mode"]

    @staticmethod
    def taps(s: AxisSpec) -> int:
        """Return how many taps an axis reads per output coordinate."""
        return 1 if s.mode == "nearest" else axis_taps(s)[0].shape[1]

    def interpolate(self, ctx, coord: list[str]) -> tuple[list[tuple[str, int]], list[str], list[str], str]:
        """Return (tap loops, head lines, body lines, result) of the output element at `coord`
        (accumulate.py.j2's pieces): the body runs for every combination of the resized axes'
        taps. Nearest modes read one tap per axis: no loops nor lines, a pure expression."""
        x, y = self.input(0), self.output()
        tables = iter(self.derived)
        acc_dt = compute_dtype(x.dtype)
        head, body, taps, src, weights, outs = [], [], [], [], [], []
        for d in range(x.rank):
            if d not in self.specs:
                src.append(ix.mul(coord[d], x.strides[d]))
                continue
            s = self.specs[d]
            n = self.taps(s)
            index_t = next(tables)
            weight_t = None if s.mode == "nearest" else next(tables)
            if self.outside[d]:
                outs.append(next(tables).load(coord[d]))
            t = ctx.fresh("t") if n > 1 else "0"
            if n > 1:
                taps.append((t, n))
            at = ix.add(ix.mul(coord[d], n), t)
            if self.nearest:
                src.append(ix.mul(index_t.load(at), x.strides[d]))
                continue
            i, w = ctx.fresh("ix"), ctx.fresh("w")
            body += [f"{i} = {index_t.load(at)}", f"{w} = {weight_t.load(at)}"]
            src.append(ix.mul(i, x.strides[d]))
            weights.append(w)
        result = x.load(ix.add(*src))
        if not self.nearest:
            acc = ctx.fresh("acc")
            head.append(f"{acc} = {literal(0, acc_dt)}")
            body.append(f"{acc} = {acc} + {' * '.join(weights)} * {convert(result, x.dtype, acc_dt)}")
            result = convert(acc, acc_dt, y.dtype)
        if outs:
            result = f"({literal(self.extrapolation, y.dtype)} if {' + '.join(outs)} > 0 else {result})"
        return taps, head, body, result

    def forward(self, ctx):
        y = self.output()
        if y.numel == 0:
            return
        outer = loop_vars(ctx, [n for n in y.shape])
        coord = [v if n > 1 else "0" for v, n in outer]
        taps, head, body, result = self.interpolate(ctx, coord)
        ctx.render("accumulate.py.j2", outer=[(v, n) for v, n in outer if n > 1], inner=taps, head=head, body=body,
                   tail=[y.store(ix.ravel(coord, y.strides), result)])

    def element(self, ctx, i, k=0):
        i = ctx.let(i, "i")
        taps, head, body, result = self.interpolate(ctx, [ctx.let(c, "c") for c in ix.unravel(i, self.output().shape)])
        if head or body:
            ctx.render("accumulate.py.j2", outer=[], inner=taps, head=head, body=body, tail=[])
        return result


@register("Resize", since=10)
class Resize10(Resize):
    """Resize-10: X and scales; asymmetric coordinates; nearest rounds down when upsampling and up
    when downsampling an axis (onnxruntime's opset-10 kernel). Models below opset 13 are upgraded
    first (luisaml/passes/upgrade.py keeps these semantics), so this serves un-upgradable ones."""

    def nearest_mode(self, a, scale):
        return "ceil" if scale < 1 else "floor"

    def params(self):
        return None, _floats(self.const(1, "scales")), None

    def attrs(self):
        a = super().attrs()
        a.update(transform="asymmetric", nearest_mode="floor", cubic_a=-0.75, exclude_outside=False,
                 antialias=False, policy="stretch", axes=None)
        return a


@register("Upsample", since=9)
class Upsample(Resize10):
    """Upsample-9/10: scales as input 1; modes nearest and linear (bilinear in opset 7)."""

    def attrs(self):
        a = super().attrs()
        a["mode"] = {"bilinear": "linear"}.get(a["mode"], a["mode"])
        return a


@register("Upsample", since=7)
class Upsample7(Upsample):
    """Upsample-7: scales as an attribute."""

    def params(self):
        return None, _floats(self.attr("scales")), None


# ---- GridSample ------------------------------------------------------------------------------------

GRID_MODES = {"bilinear": "linear", "bicubic": "cubic", "nearest": "nearest", "linear": "linear", "cubic": "cubic"}


@register("GridSample", since=16)
class GridSample(Operator):
    """Sample X [N, C, D1..Dk] at the normalised coordinates of grid [N, O1..Ok, k] (x first, as
    ONNX orders them): nearest (halves to even), linear or cubic (a = -0.75) interpolation,
    padding zeros, border or reflection, align_corners; opset 16 is 2-d only, 20 on any k.
    Border and reflection padding move only coordinates past the borders, as ONNX's reference does
    (onnxruntime clamps every cubic coordinate, which changes taps near an edge). The coordinates
    are computed once per output position; the channels reuse them."""

    def check(self):
        x, grid, y = self.input(0), self.input(1), self.output()
        self.expect_dtype(x, ("float",), "input 0 (X)")
        self.expect_dtype(grid, ("float",), "input 1 (grid)")
        self.k = x.rank - 2
        self.expect(self.k >= 1, f"input '{x.name}' has rank {x.rank}, expected [N, C, D1, ...]")
        self.expect(self.opset >= 20 or self.k == 2, f"GridSample-{self.opset} takes 4-d inputs; '{x.name}' has rank {x.rank}")
        self.expect(grid.rank == x.rank and grid.shape[0] == x.shape[0] and grid.shape[-1] == self.k,
                    f"grid '{grid.name}' has shape {list(grid.shape)}, expected [{x.shape[0]}, ..., {self.k}]")
        want = (x.shape[0], x.shape[1]) + tuple(grid.shape[1:-1])
        self.expect(tuple(y.shape) == want, f"output shape {list(y.shape)} is not {list(want)}")
        mode = self.attr("mode", "bilinear" if self.opset < 20 else "linear")
        self.expect(mode in GRID_MODES, f"mode {mode!r} is not one of {', '.join(GRID_MODES)}")
        self.mode = GRID_MODES[mode]
        self.padding = self.attr("padding_mode", "zeros")
        self.expect(self.padding in ("zeros", "border", "reflection"), f"padding_mode {self.padding!r} is not zeros, border or reflection")
        self.align = bool(int(self.attr("align_corners", 0)))
        if x.batched != grid.batched:
            raise self.mixing(f"X '{x.name}' and grid '{grid.name}' must both be per-sample or both shared: each "
                              "sample's grid reads its own image")

    def axis_taps(self, ctx, g: str, size: int) -> tuple[list[str], list[tuple[str, str | None, str | None]]]:
        """Return (lines, [(index, in-range condition or None, weight or None)] per tap) of one
        spatial axis of `size` elements whose normalised coordinate is the DSL float g."""
        lines = []
        c = ctx.fresh("gx")
        lo, hi = (0.0, size - 1.0) if self.align else (-0.5, size - 0.5)
        # in the order ONNX's reference and onnxruntime compute it (nearest rounds the result)
        if self.align:
            lines.append(f"{c} = ({g} + 1.0) / 2.0 * {literal(size - 1.0, dtypes.FLOAT)}")
        else:
            lines.append(f"{c} = (({g} + 1.0) * {literal(float(size), dtypes.FLOAT)} - 1.0) / 2.0")
        if self.mode == "nearest":
            lines.append(f"{c} = {ctx.use_helper('round_even_f32', 'math_lib')}({c})")
        if self.padding == "border":  # only coordinates past the borders move
            lines.append(f"{c} = (clamp({c}, 0.0, {literal(size - 1.0, dtypes.FLOAT)}) if {c} < {literal(lo, dtypes.FLOAT)} "
                         f"or {c} > {literal(hi, dtypes.FLOAT)} else {c})")
        elif self.padding == "reflection":
            refl = ctx.use_helper("reflect_f32", "math_lib")
            lines.append(f"{c} = {refl}({c}, {literal(lo, dtypes.FLOAT)}, {literal(hi, dtypes.FLOAT)})")
        if self.mode == "nearest":
            first, weights = ctx.fresh("i"), [None]
            lines.append(f"{first} = int({c})")
            starts = [first]
        else:
            f, base = ctx.fresh("f"), ctx.fresh("i")
            lines += [f"{base} = int(floor({c}))", f"{f} = {c} - floor({c})"]
            if self.mode == "linear":
                starts = [base, f"{base} + 1"]
                weights = [f"(1.0 - {f})", f]
            else:
                starts = [f"{base} - 1", base, f"{base} + 1", f"{base} + 2"]
                a = -0.75
                ws = [ctx.fresh("w") for _ in range(4)]
                lines += [
                    f"{ws[0]} = (({a} * ({f} + 1.0) - {5 * a}) * ({f} + 1.0) + {8 * a}) * ({f} + 1.0) - {4 * a}",
                    f"{ws[1]} = ({a + 2} * {f} - {a + 3}) * {f} * {f} + 1.0",
                    f"{ws[2]} = ({a + 2} * (1.0 - {f}) - {a + 3}) * (1.0 - {f}) * (1.0 - {f}) + 1.0",
                    f"{ws[3]} = (({a} * (2.0 - {f}) - {5 * a}) * (2.0 - {f}) + {8 * a}) * (2.0 - {f}) - {4 * a}",
                ]
                weights = ws
        taps = []
        for s, w in zip(starts, weights):
            i = ctx.fresh("t")
            ok = None
            if self.padding == "zeros":
                ok = ctx.fresh("ok")
                lines += [f"{i} = {s}", f"{ok} = {i} >= 0 and {i} < {size}", f"{i} = clamp({i}, 0, {size - 1})"]
            elif self.padding == "border":
                lines.append(f"{i} = clamp({s}, 0, {size - 1})")
            else:  # a tap beyond the edge reflects too (an index, so the reflection is exact)
                refl = ctx.use_helper("reflect_f32", "math_lib")
                lines.append(f"{i} = clamp(int({refl}(float({s}), {literal(lo, dtypes.FLOAT)}, "
                             f"{literal(hi, dtypes.FLOAT)})), 0, {size - 1})")
            taps.append((i, ok, w))
        return lines, taps

    def sample(self, ctx, n: str, s: str):
        """Return (lines computing the taps of output position s of image n, the value at channel
        c as a function of c): the channels share the taps."""
        import itertools

        x, grid, y = self.input(0), self.input(1), self.output()
        c_ = x.shape[1]
        spatial = x.shape[2:]
        s_out = int(np.prod(grid.shape[1:-1], dtype=np.int64))
        head, per_axis = [], []
        at = ix.mul(ix.add(ix.mul(n, s_out), s), self.k)
        for d, size in enumerate(spatial):
            g = ctx.fresh("g")
            head.append(f"{g} = {convert(grid.load(ix.add(at, str(self.k - 1 - d))), grid.dtype, dtypes.FLOAT)}")
            lines, taps = self.axis_taps(ctx, g, size)
            head += lines
            per_axis.append(taps)

        def value(c: str) -> str:
            base = ix.add(ix.mul(n, c_ * int(np.prod(spatial, dtype=np.int64))), ix.mul(c, x.strides[1]))
            terms = []
            for combo in itertools.product(*per_axis):
                src = ix.add(base, *(ix.mul(i, st) for (i, _, _), st in zip(combo, x.strides[2:])))
                v = convert(x.load(src), x.dtype, dtypes.FLOAT)
                oks = [ok for _, ok, _ in combo if ok is not None]
                ws = [w for _, _, w in combo if w is not None]
                term = " * ".join(ws + [v])
                terms.append(f"({term} if {' and '.join(oks)} else 0.0)" if oks else term)
            return convert(" + ".join(terms), dtypes.FLOAT, y.dtype)

        return head, value

    def forward(self, ctx):
        x, grid, y = self.input(0), self.input(1), self.output()
        if y.numel == 0:
            return
        c_ = x.shape[1]
        s_out = int(np.prod(grid.shape[1:-1], dtype=np.int64))
        loops = [(ctx.fresh("n"), x.shape[0]), (ctx.fresh("s"), s_out)]
        n, s = (v if k > 1 else "0" for v, k in loops)
        head, value = self.sample(ctx, n, s)
        c = ctx.fresh("c") if c_ > 1 else "0"
        store = y.store(ix.add(ix.mul(n, c_ * s_out), ix.mul(c, s_out), s), value(c))
        body = head + ([f"for {c} in range({c_}):", "    " + store] if c_ > 1 else [store])
        ctx.render("nest.py.j2", loops=[(v, k) for v, k in loops if k > 1], body=body)

    def element(self, ctx, i, k=0):
        """One output element (n, c, s): its own taps (a thread per element recomputes them per
        channel, the price of the parallelism)."""
        n_, c_, *rest = self.output().shape
        n, c, s = ix.unravel(ctx.let(i, "i"), (n_, c_, int(np.prod(rest, dtype=np.int64))))
        head, value = self.sample(ctx, ctx.let(n, "n"), ctx.let(s, "s"))
        ctx.lines("\n".join(head))
        return value(ctx.let(c, "c"))


@register("RoiAlign", since=10)
class RoiAlign(Operator):
    """Y[r, c, ph, pw]: the average (or max) of bilinear samples of X[batch_indices[r], c] on a
    regular grid inside bin (ph, pw) of region of interest r, as ONNX's reference computes it (max
    mode takes the largest weighted corner, sampling_ratio 0 sizes each ROI's grid by the ROI;
    output_half_pixel is opset 10's coordinate mode, half_pixel opset 16's default). NaN and inf
    go where onnxruntime puts them: max mode folds with std::max, a sample outside the image
    weighs X[b, c, 0, 0] by 0."""

    def check(self):
        x, rois, idx, y = self.input(0), self.input(1), self.input(2), self.output()
        self.expect_dtype(x, ("float",), "input 0 (X)")
        self.expect_dtype(rois, ("float",), "input 1 (rois)")
        self.expect(x.rank == 4, f"X '{x.name}' has rank {x.rank}, expected [N, C, H, W]")
        self.expect(rois.rank == 2 and rois.shape[1] == 4, f"rois '{rois.name}' has shape {list(rois.shape)}, expected [R, 4]")
        self.expect(idx.numel == rois.shape[0], f"batch_indices '{idx.name}' has {idx.numel} values for {rois.shape[0]} ROIs")
        self.mode = self.attr("mode", "avg")
        self.expect(self.mode in ("avg", "max"), f"mode {self.mode!r} is not avg or max")
        default = "half_pixel" if self.opset >= 16 else "output_half_pixel"
        ctm = self.attr("coordinate_transformation_mode", default)
        self.expect(ctm in ("half_pixel", "output_half_pixel"), f"coordinate_transformation_mode {ctm!r} is not half_pixel "
                    "or output_half_pixel")
        self.half_pixel = ctm == "half_pixel"
        self.oh, self.ow = int(self.attr("output_height", 1)), int(self.attr("output_width", 1))
        self.ratio = int(self.attr("sampling_ratio", 0))
        self.scale = float(self.attr("spatial_scale", 1.0))
        want = (rois.shape[0], x.shape[1], self.oh, self.ow)
        self.expect(tuple(y.shape) == want, f"output '{y.name}' has shape {list(y.shape)}, expected {list(want)}")
        if x.batched:
            raise self.mixing(f"X '{x.name}' is per-sample, but batch_indices picks images across the batch")

    def forward(self, ctx):
        y = self.output()
        if y.numel == 0:
            return
        with ctx.loop(y.numel) as i:
            ctx.store(y, i, self.element(ctx, i))

    def element(self, ctx, i, k=0):
        """Output element i: its bin's samples, pooled."""
        x, rois, idx, y = self.input(0), self.input(1), self.input(2), self.output()
        _, C, H, W = x.shape
        f = lambda v: literal(v, dtypes.FLOAT)  # noqa: E731
        up = lambda e, t: convert(e, t.dtype, dtypes.FLOAT)  # noqa: E731
        r, c, ph, pw = (ctx.let(e, n) for e, n in zip(ix.unravel(ctx.let(i, "i"), tuple(y.shape)), ("r", "c", "ph", "pw")))
        v = {k: ctx.fresh(k) for k in ("b", "x1", "y1", "rw", "rh", "bw", "bh", "gw", "gh", "acc", "yy", "xx",
                                       "yl", "xl", "yh", "xh", "ly", "lx", "base")}
        off = 0.5 if self.half_pixel else 0.0
        ctx.line(f"{v['b']} = {convert(idx.load(r), idx.dtype, dtypes.INT32)}")
        coords = [up(rois.load(ix.add(ix.mul(r, 4), str(k))), rois) for k in range(4)]
        ctx.line(f"{v['x1']} = {coords[0]} * {f(self.scale)} - {f(off)}")
        ctx.line(f"{v['y1']} = {coords[1]} * {f(self.scale)} - {f(off)}")
        ctx.line(f"{v['rw']} = {coords[2]} * {f(self.scale)} - {f(off)} - {v['x1']}")
        ctx.line(f"{v['rh']} = {coords[3]} * {f(self.scale)} - {f(off)} - {v['y1']}")
        if not self.half_pixel:  # malformed ROIs become 1x1
            ctx.line(f"{v['rw']} = max({v['rw']}, 1.0)")
            ctx.line(f"{v['rh']} = max({v['rh']}, 1.0)")
        ctx.line(f"{v['bw']} = {v['rw']} / {f(self.ow)}")
        ctx.line(f"{v['bh']} = {v['rh']} / {f(self.oh)}")
        for g, size, out in (("gw", "rw", self.ow), ("gh", "rh", self.oh)):
            ctx.line(f"{v[g]} = {self.ratio}" if self.ratio > 0 else f"{v[g]} = int(ceil({v[size]} / {f(out)}))")
        ctx.line(f"{v['acc']} = 0.0")
        ctx.line(f"{v['base']} = ({v['b']} * {C} + {c}) * {H * W}")
        first = ctx.fresh("first")
        ctx.line(f"{first} = True")
        iy, jx = ctx.fresh("iy"), ctx.fresh("jx")
        ctx.line(f"for {iy} in range({v['gh']}):")
        with ctx.indent():
            ctx.line(f"{v['yy']} = {v['y1']} + {ph} * {v['bh']} + (float({iy}) + 0.5) * {v['bh']} / float({v['gh']})")
            ctx.line(f"for {jx} in range({v['gw']}):")
            with ctx.indent():
                self._sample(ctx, x, v, jx, pw, H, W, first)
        if self.mode == "avg":
            ctx.line(f"{v['acc']} = {v['acc']} / float(max({v['gh']} * {v['gw']}, 1))")
        return convert(v["acc"], dtypes.FLOAT, y.dtype)

    def _sample(self, ctx, x, v, jx, pw, H, W, first):
        """One bilinear sample: its four weighted corners into the running average or max."""
        ctx.line(f"{v['xx']} = {v['x1']} + {pw} * {v['bw']} + (float({jx}) + 0.5) * {v['bw']} / float({v['gw']})")
        val = ctx.fresh("val")
        ctx.line(f"{val} = 0.0")
        ctx.line(f"if {v['yy']} >= -1.0 and {v['yy']} <= {float(H)!r} and {v['xx']} >= -1.0 and {v['xx']} <= {float(W)!r}:")
        with ctx.indent():
            yy, xx = ctx.fresh("sy"), ctx.fresh("sx")
            ctx.line(f"{yy} = max({v['yy']}, 0.0)")
            ctx.line(f"{xx} = max({v['xx']}, 0.0)")
            ctx.line(f"{v['yl']} = int({yy})")
            ctx.line(f"{v['xl']} = int({xx})")
            ctx.line(f"{v['yh']} = {v['yl']} + 1")
            ctx.line(f"{v['xh']} = {v['xl']} + 1")
            for lo, hi, s, n in (("yl", "yh", yy, H), ("xl", "xh", xx, W)):
                ctx.line(f"if {v[lo]} >= {n - 1}:")
                with ctx.indent():
                    ctx.line(f"{v[lo]} = {n - 1}")
                    ctx.line(f"{v[hi]} = {n - 1}")
                    ctx.line(f"{s} = float({n - 1})")
            ctx.line(f"{v['ly']} = {yy} - float({v['yl']})")
            ctx.line(f"{v['lx']} = {xx} - float({v['xl']})")
            load = lambda a, b: convert(x.load(f"{v['base']} + {v[a]} * {W} + {v[b]}"), x.dtype, dtypes.FLOAT)  # noqa: E731
            terms = [f"(1.0 - {v['ly']}) * (1.0 - {v['lx']}) * {load('yl', 'xl')}",
                     f"(1.0 - {v['ly']}) * {v['lx']} * {load('yl', 'xh')}",
                     f"{v['ly']} * (1.0 - {v['lx']}) * {load('yh', 'xl')}",
                     f"{v['ly']} * {v['lx']} * {load('yh', 'xh')}"]
            if self.mode == "avg":
                ctx.line(f"{val} = {' + '.join(terms)}")
            else:
                # onnxruntime folds the corners, then the samples, with std::max: a NaN met first
                # stays, a later one is dropped
                smax = ctx.use_helper("max_first")
                ctx.line(f"{val} = {smax}({smax}({smax}({terms[0]}, {terms[1]}), {terms[2]}), {terms[3]})")
        # onnxruntime's samples outside the image weigh X[b, c, 0, 0] by 0: NaN or inf there gives NaN
        ctx.line("else:")
        with ctx.indent():
            ctx.line(f"{val} = 0.0 * {convert(x.load(v['base']), x.dtype, dtypes.FLOAT)}")
        if self.mode == "avg":
            ctx.line(f"{v['acc']} = {v['acc']} + {val}")
        else:
            ctx.line(f"{v['acc']} = {val} if {first} else {ctx.use_helper('max_first')}({v['acc']}, {val})")
            ctx.line(f"{first} = False")
