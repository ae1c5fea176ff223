"""DSL functions shared by operators; a generated module imports the ones it uses."""
# ruff: noqa: F821  (exp, copysign, isnan, ... are DSL builtins the luisa compiler resolves)
import luisa
from luisa.builtin import bitwise_cast
from luisa.types import half  # noqa: F401

# erf_f32: piecewise polynomial fits by tests/operators/fit_erf.py (which reproduces them and
# reports the float32 error: under 1 ulp against scipy's erf when exp is correctly rounded).
#   |x| < 0.84375:     x + x * R(x^2)
#   [0.84375, 1.25):   E + P(|x| - 1), E = erf(1) rounded to float32
#   [1.25, 4):         1 - exp(-x^2) * G(1/|x|), G approximates erfcx(x) = exp(x^2) erfc(x)
#   [4, inf]:          1 (erf(x) rounds to 1.0 in float32)
# The sign is copied from x; NaN falls through every comparison and is returned as it is.


@luisa.func
def erf_f32(x):
    """erf(x) for a float x, within about one ulp."""
    a = abs(x)
    r = x
    if a < 0.84375:
        t = x * x
        p = -0.0006314516649581492
        p = p * t + 0.00504771713167429
        p = p * t + -0.02679784595966339
        p = p * t + 0.11282509565353394
        p = p * t + -0.37612542510032654
        p = p * t + 0.12837915122509003
        r = x + x * p
    elif a < 1.25:
        s = a - 1.0
        q = 0.01310824230313301
        q = q * s + 0.004531008191406727
        q = q * s + -0.06909216195344925
        q = q * s + 0.06918270885944366
        q = q * s + 0.1383678913116455
        q = q * s + -0.41510745882987976
        q = q * s + 0.41510748863220215
        q = q * s + 1.3474187099404844e-08
        r = copysign(0.8427007794380188 + q, x)
    elif a < 4.0:
        w = 1.0 / a
        g = -0.045652810484170914
        g = g * w + 0.18442876636981964
        g = g * w + -0.2637253403663635
        g = g * w + 0.05425279214978218
        g = g * w + 0.31081056594848633
        g = g * w + -0.39862191677093506
        g = g * w + 0.024557236582040787
        g = g * w + 0.5613656044006348
        g = g * w + 0.000138443720061332
        r = copysign(1.0 - exp(-(a * a)) * g, x)
    elif a >= 4.0:
        r = copysign(1.0, x)
    return r


@luisa.func
def pow_i32(x, y):
    """x ** y for ints by repeated squaring, wrapping like int32; y < 0 truncates 1 / x ** -y."""
    r = 1
    if y < 0:
        r = 0
        if x == 1:
            r = 1
        if x == -1:
            r = 1 - 2 * ((-y) % 2)
    else:
        b = x
        e = y
        while e > 0:
            if e % 2 == 1:
                r = r * b
            b = b * b
            e = e // 2
    return r


# The max/min/clamp builtins are C's fmax/fmin: they return the other operand when one is NaN. ONNX
# follows numpy (np.maximum, np.minimum), where NaN wins; these are the float forms that keep it.
# isnan, not x != x: a backend may fold the comparison away.


@luisa.func
def max_nan(a, b):
    """The larger of a and b (float or half); NaN when either is."""
    return a if a > b or isnan(a) else b


@luisa.func
def min_nan(a, b):
    """The smaller of a and b (float or half); NaN when either is."""
    return a if a < b or isnan(a) else b


@luisa.func
def clamp_nan(x, lo, hi):
    """x clamped to [lo, hi] (float or half); NaN stays NaN."""
    return x if isnan(x) else clamp(x, lo, hi)


@luisa.func
def order_key(x):
    """An int that orders float x as TopK does (operators/topk.py's Order): -0 equal to +0, every NaN
    above +inf; taken from x's bits (integer comparisons, which fast math cannot flush to zero, and
    one warp reduction: operators/topk_chunks.py). A negative's bits b give b ^ 0x7fffffff = -1 - |b|."""
    b = bitwise_cast(int, x)
    m = b & 2147483647
    k = b
    if b < 0:
        k = b ^ 2147483647
    if m == 0:
        k = 0
    if m > 2139095040:  # above +inf's bits: a NaN
        k = 2147483647
    return k


@luisa.func
def max_first(a, b):
    """C++'s std::max(a, b) = (a < b) ? b : a: a NaN a stays, a NaN b is dropped (for matching
    onnxruntime's kernels that fold with it)."""
    return b if a < b else a  # noqa: FURB136 (the max builtin is fmax, which differs on NaN)


@luisa.func
def softplus(x):
    """log(1 + e^x) in float, without overflow or underflow: max(x, 0) + log1p(e^-|x|), with log1p
    as Goldberg's log(u) e / (u - 1) for u = 1 + e (log(1 + e) alone is 0 below e = 6e-8: softplus
    of -20 came out 0 instead of 2e-9, and Cast of it to bool False). NaN reaches it through exp."""
    e = exp(-abs(x))
    u = 1.0 + e
    small = e
    if u != 1.0:
        small = log(u) * (e / (u - 1.0))
    return max(x, 0.0) + small


@luisa.func
def pow_f32(x, y):
    """x ** y as C's pow, also where y is not finite (the CPU backend's pow gave 0 for every x
    there, NaN included): NaN in, NaN out, except 1 ** y and x ** 0 (1); for y = +-inf, 1 where
    |x| = 1, +inf where |x| < 1 and y = -inf or |x| > 1 and y = +inf, else 0."""
    r = pow(x, y)
    if isnan(x) or isnan(y):
        r = x + y  # NaN
        if x == 1.0 or y == 0.0:
            r = 1.0
    elif isinf(y):
        ax = abs(x)
        if ax == 1.0:
            r = 1.0
        elif (ax < 1.0 and y < 0.0) or (ax > 1.0 and y > 0.0):
            r = abs(y)  # +inf
        else:
            r = 0.0
    return r
