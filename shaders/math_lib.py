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
