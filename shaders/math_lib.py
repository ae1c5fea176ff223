"""DSL functions of the second round of operators (float Mod, Round, bit shifts); a generated module
imports the ones it uses."""
# ruff: noqa: F821  (abs, floor, isnan, copysign, ... are DSL builtins the luisa compiler resolves)
import luisa
from luisa.builtin import bitwise_cast
from luisa.types import uint

INF = float("inf")


@luisa.func
def quiet_nan():
    """A float NaN made at run time. LuisaCompute folds a constant stored in a local (`r = INF -
    INF`, or a bitwise_cast of a literal) into a literal, and its CUDA codegen aborts the process on
    a NaN literal; a value that depends on the thread's index is never folded."""
    return bitwise_cast(float, 2143289344 + int(dispatch_id().x) * 0)  # 0x7fc00000


@luisa.func
def sqrt_f32(x):
    """sqrt(x) that a division cannot turn into a reciprocal square root. The backends' fast math
    rewrites a / sqrt(b) as a * rsqrt(b) with a Newton step, which makes NaN of b = 0 and b = inf
    (1 / sqrt(inf) must be 0, 1 / sqrt(0) inf) and is an ulp off elsewhere (3 / sqrt(4) gave
    1.4999999 on the CPU backend): the max hides the sqrt from that rewrite, the select keeps the
    NaN of a negative or NaN x, which the max would drop."""
    s = sqrt(x)
    r = max(s, 0.0)
    if isnan(s):
        r = s
    return r


@luisa.func
def fmod_f32(a, b):
    """C fmod for floats, exact: the remainder of |a| by |b| is taken by subtracting b * 2^k
    (exact by Sterbenz's lemma, as b * 2^k <= r < 2 b * 2^k) from the top exponent down; the sign
    is a's. NaN for a infinite, b zero or either NaN; a when b is infinite."""
    x = abs(a)
    y = abs(b)
    r = x
    if isnan(x) or isnan(y) or isinf(x) or y == 0.0:
        r = quiet_nan()
    elif not isinf(y):
        while r >= y:
            # the largest t = y * 2^k <= r: start near it from the exponents, then correct
            k = max(int(floor(log2(r))) - int(floor(log2(y))) - 1, 0)
            t = y
            while k >= 60:
                t = t * 1152921504606846976.0  # 2^60
                k = k - 60
            p = 1.0  # 2^k by squaring (exp2 is not linked by the CPU backend)
            b = 2.0
            while k > 0:
                if k % 2 == 1:
                    p = p * b
                b = b * b
                k = k // 2
            t = t * p
            while t * 2.0 <= r:
                t = t * 2.0
            while t > r:
                t = t * 0.5
            r = r - t
    return copysign(r, a)


@luisa.func
def pymod_f32(a, b):
    """numpy's float mod (ONNX Mod fmod=0): fmod, moved by b when the signs differ; a zero
    result takes b's sign."""
    r = fmod_f32(a, b)
    if r != 0.0:
        if (r < 0.0 and b > 0.0) or (r > 0.0 and b < 0.0):
            r = r + b
    elif not isnan(b):
        r = copysign(0.0, b)
    return r


@luisa.func
def round_even_f32(x):
    """x rounded to the nearest integer, halves to the even one (ONNX Round); the DSL's round
    takes halves away from zero. x - floor(x) is exact for every float. The result has x's sign, a
    zero too: -0.45 rounds to -0.0, as numpy's rint (1 / Round(x) is then -inf; fuzz graph 20:89)."""
    f = floor(x)
    d = x - f
    r = f
    if d > 0.5:
        r = f + 1.0
    elif d == 0.5:
        r = f + (f - 2.0 * floor(f * 0.5))  # + 1 when f is odd
    return copysign(r, x)


@luisa.func
def shift_left_i32(x, y, width):
    """x << y for a signed int of `width` bits held in an int: 0 when y < 0 or y >= width."""
    r = 0
    if y >= 0 and y < width and y < 32:
        r = x << y
    return r


@luisa.func
def shift_right_i32(x, y, width):
    """x >> y, arithmetic: past the width only the sign fill is left (-1 or 0); y < 0 too."""
    r = 0
    if y >= 0 and y < width:
        r = x >> min(y, 31)
    elif x < 0:
        r = -1
    return r


@luisa.func
def shift_left_u32(x, y):
    """x << y for uint: 0 when y >= 32."""
    r = uint(0)
    if y < uint(32):
        r = x << y
    return r


@luisa.func
def shift_right_u32(x, y):
    """x >> y for uint: 0 when y >= 32."""
    r = uint(0)
    if y < uint(32):
        r = x >> y
    return r


@luisa.func
def reflect_f32(x, lo, hi):
    """x reflected about lo and hi until it lies between them (GridSample's reflection padding);
    lo when the range is empty."""
    r = x
    span = hi - lo
    if span <= 0.0:
        r = lo
    elif x < lo:
        d = lo - x
        n = int(d / span)
        m = d - float(n) * span
        r = lo + m
        if n % 2 == 1:
            r = hi - m
    elif x > hi:
        d = x - hi
        n = int(d / span)
        m = d - float(n) * span
        r = hi - m
        if n % 2 == 1:
            r = lo + m
    return r


@luisa.func
def bits_to_int(x):
    """The bits of a 32-bit value as an int."""
    return bitwise_cast(int, x)


@luisa.func
def bits_to_uint(x):
    """The bits of a 32-bit value as a uint."""
    return bitwise_cast(uint, x)


@luisa.func
def bits_to_float(x):
    """The bits of a 32-bit value as a float."""
    return bitwise_cast(float, x)


@luisa.func
def exp_f32(x):
    """e^x without a call, so that the CPU backend's compiler vectorises the loops it sits in (its
    exp is a scalar libm call; a Softmax row's two exp passes: benchmarks/NOTES.md, "Softmax rows in
    lanes"): x = n ln 2 + r, |r| <= ln 2 / 2 (ln 2 in two parts, Cody and Waite), e^r by Cephes'
    expf polynomial (2 ulp), 2^n from its exponent bits (n = 128 as 2^127 * 2). Branch-free: the
    selects give 0 below -87.34 (no subnormal results; -inf included), inf above 88.72 and NaN for
    NaN."""
    xc = min(max(x, -87.33654022216797), 88.72283172607422)
    n = floor(xc * 1.4426950216293335 + 0.5)
    r = xc - n * 0.693359375
    r = r + n * 0.00021219444170128554
    p = 0.00019875691500
    p = p * r + 0.0013981999507
    p = p * r + 0.0083334519073
    p = p * r + 0.041665795894
    p = p * r + 0.16666665459
    p = p * r + 0.50000001201
    e = p * r * r + r + 1.0
    hi = n > 127.0
    k = n - 1.0 if hi else n
    v = e * bitwise_cast(float, (int(k) + 127) * 8388608)
    v = v * 2.0 if hi else v
    v = 0.0 if x < -87.33654022216797 else v
    v = INF if x > 88.72283172607422 else v
    v = x if isnan(x) else v
    return v


@luisa.func
def erf_vec_f32(x):
    """erf(x) without a branch or a call, so that the CPU backend's compiler vectorises the loops it
    sits in (dsl_lib.erf_f32 branches over four ranges and calls the backend's exp, a scalar libm
    call: a GELU epilogue cost 180 ns an element; benchmarks/NOTES.md, "A branch-free erf"). Every
    lane computes dsl_lib.erf_f32's three pieces (the same coefficients, tests/operators/fit_erf.py)
    and selects one: x + x R(x^2) below 0.84375, E + P(|x| - 1) below 1.25, 1 - e^(-x^2) G(1/|x|)
    below 4 (e^ as exp_f32's: its 2 ulp on a term under 0.08 add a fifth of an ulp), else 1; the
    pieces' arguments are clamped to their ranges, so that no lane makes inf or NaN. The sign is
    x's (-0 stays -0), NaN returns NaN."""
    a = abs(x)
    xs = min(max(x, -0.84375), 0.84375)
    t = xs * xs
    p = -0.0006314516649581492
    p = p * t + 0.00504771713167429
    p = p * t + -0.02679784595966339
    p = p * t + 0.11282509565353394
    p = p * t + -0.37612542510032654
    p = p * t + 0.12837915122509003
    small = xs + xs * p
    s = min(a, 1.25) - 1.0
    q = 0.01310824230313301
    q = q * s + 0.004531008191406727
    q = q * s + -0.06909216195344925
    q = q * s + 0.06918270885944366
    q = q * s + 0.1383678913116455
    q = q * s + -0.41510745882987976
    q = q * s + 0.41510748863220215
    q = q * s + 1.3474187099404844e-08
    mid = 0.8427007794380188 + q
    b = min(max(a, 1.25), 4.0)
    w = 1.0 / b
    g = -0.045652810484170914
    g = g * w + 0.18442876636981964
    g = g * w + -0.2637253403663635
    g = g * w + 0.05425279214978218
    g = g * w + 0.31081056594848633
    g = g * w + -0.39862191677093506
    g = g * w + 0.024557236582040787
    g = g * w + 0.5613656044006348
    g = g * w + 0.000138443720061332
    # e^(-b^2) as exp_f32 computes it, written out: b^2 lies in [1.5625, 16], where exp_f32's
    # selects never fire; a call to it left the MatMul + Erf tile unvectorised (132 ms, 20 written out)
    z = -(b * b)
    n = floor(z * 1.4426950216293335 + 0.5)
    r = z - n * 0.693359375
    r = r + n * 0.00021219444170128554
    e = 0.00019875691500
    e = e * r + 0.0013981999507
    e = e * r + 0.0083334519073
    e = e * r + 0.041665795894
    e = e * r + 0.16666665459
    e = e * r + 0.50000001201
    e = e * r * r + r + 1.0
    tail = 1.0 - e * bitwise_cast(float, (int(n) + 127) * 8388608) * g
    v = mid if a < 1.25 else tail
    v = 1.0 if a >= 4.0 else v
    v = small if a < 0.84375 else copysign(v, x)
    v = x if isnan(x) else v
    return v
