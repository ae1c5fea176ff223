"""IEEE-754 binary64 arithmetic on 64-bit integer words, for kernels that must write a double exactly
as numpy computes it on the host (the DSL has `ulong` but no `double`): an int32 times a double
(`f64_mul_i32`) and the sum of two doubles (`f64_add`), correctly rounded to nearest, ties to even,
bit for bit numpy's results on x86 -- signed zeros, exact cancellation (+0.0), subnormal results,
overflow to infinity, and NaN as SSE makes it (a NaN operand's bits quieted, the first's where both
are; 0 x inf and inf - inf the default NaN, 0xfff8000000000000). A double is held as its bits in a
ulong (`f64_bits` from the two int words a scratch buffer holds). A grid header's world bbox, numpy's
fl(fl(i * h) + o) (grid_write.gb_write_header), is what needs it.

The arithmetic is exact integer work on the significands: a product of at most 31 x 53 bits in two
64-bit halves, a sum aligned with 10 guard bits, every bit shifted out folded into the lowest kept bit
("jamming": the rounding point always lies at least 2 bits above it, so the rounding decision is the
exact value's), then one rounding (`f64_round_pack`) with the subnormal quantum 2^-1074 and
overflow. It needs luisaml.luisa_compat's 64-bit typing of binary operations (luisa-python types an
operation on two ulongs as uint otherwise), which luisaml.device.init installs."""
# ruff: noqa: F821  (clz, select, dispatch_id are DSL builtins the luisa compiler resolves)
import luisa
from luisa.types import long, uint, ulong  # noqa: F401


@luisa.func
def f64_bits(lo, hi):
    """The 64-bit word whose low and high halves are the 32-bit words lo and hi (int or uint)."""
    return ulong(uint(lo)) | (ulong(uint(hi)) << ulong(32))


@luisa.func
def f64_const(lo, hi):
    """The 64-bit word of 32-bit halves lo and hi, made at run time: LuisaCompute folds a 64-bit
    constant expression stored in a local in 32 bits (`m = (ulong(1) << ulong(52)) - ulong(1)` became
    0xfffff on the CPU backend), so every 64-bit constant here is built on a zero it cannot see through."""
    return f64_bits(lo, hi) | ulong(uint(dispatch_id().x) * uint(0))


@luisa.func
def f64_lo(x):
    """The low 32 bits of a 64-bit word, as a uint."""
    return uint(x & f64_const(-1, 0))


@luisa.func
def f64_hi(x):
    """The high 32 bits of a 64-bit word, as a uint."""
    return uint(x >> ulong(32))


@luisa.func
def f64_clz(x):
    """The leading zeros of a 64-bit word (64 for 0; the DSL's clz takes 32 bits)."""
    hi = uint(x >> ulong(32))
    lo = uint(x & f64_const(-1, 0))
    n = 64
    if hi != uint(0):
        n = int(clz(hi))
    elif lo != uint(0):
        n = 32 + int(clz(lo))
    return n


@luisa.func
def f64_round_pack(sign, m, e):
    """The double nearest sign * m * 2^e (m > 0; sign 0 or the sign bit), rounded to nearest, ties to
    even: a normal number's 53 bits, the subnormal quantum 2^-1074 below 2^-1022, infinity past the
    largest double. m's lowest bit may be a sticky bit (some lower bits were not zero) where the
    rounding point lies at least 2 bits above it (f64_mul_i32 and f64_add keep 10 or more)."""
    p = 63 - f64_clz(m)
    top = p + e  # m * 2^e lies in [2^top, 2^(top + 1))
    out = sign | f64_const(0, 2146435072)  # past the largest double: infinity (0x7ff00000 high)
    if top <= 1023:
        s = p - 52  # the bits below the 53 kept
        base = top + 1022  # the exponent field less the hidden bit, which the significand adds
        if top < -1022:  # subnormal: the quantum is 2^-1074, the exponent field 0
            s = -1074 - e
            base = 0
        q = ulong(0)
        if s <= 0:
            q = m << ulong(-s)
        elif s < 64:
            q = m >> ulong(s)
            rest = m - (q << ulong(s))
            half = ulong(1) << ulong(s - 1)
            if rest > half or (rest == half and (q & ulong(1)) != ulong(0)):
                q += ulong(1)  # (a carry to 2^53 moves into the exponent field: the next binade, or infinity)
        elif s == 64:
            if m > f64_const(0, -2147483647 - 1):  # above half the quantum, 2^63
                q = ulong(1)
        out = sign | ((ulong(base) << ulong(52)) + q)
    return out


@luisa.func
def f64_mul_i32(i, x):
    """fl(i * x): an int32 times the double whose bits are x, correctly rounded (numpy's int32 array
    times a float64 array: i converted exactly, one product)."""
    sign_bit = f64_const(0, -2147483647 - 1)
    frac_bits = f64_const(-1, 1048575)
    ex = int(uint(x >> ulong(52)) & uint(2047))
    frac = x & frac_bits
    sign = (x & sign_bit) ^ select(ulong(0), sign_bit, i < 0)
    out = sign  # a signed zero: i or x is zero
    if ex == 2047:
        if frac != ulong(0):
            out = x | f64_const(0, 524288)  # NaN, quieted (bit 51)
        elif i == 0:
            out = f64_const(0, -524288)  # 0 x inf: the default NaN (0xfff80000 high)
        else:
            out = sign | f64_const(0, 2146435072)
    elif i != 0 and (x & (sign_bit - ulong(1))) != ulong(0):
        wide = long(i)
        if wide < long(0):
            wide = -wide
        a = ulong(wide)  # |i| <= 2^31
        m = frac
        e = -1074
        if ex != 0:
            m = frac | f64_const(0, 1048576)
            e = ex - 1075
        # the exact product a * m < 2^84, as hi * 2^64 + lo, from m's two 32-bit halves
        low = a * (m & f64_const(-1, 0))  # < 2^63
        mid = a * (m >> ulong(32))  # < 2^52
        lo = low + (mid << ulong(32))
        hi = (mid >> ulong(32)) + select(ulong(0), ulong(1), lo < low)
        if hi != ulong(0):
            # to 64 bits, the bits shifted out jammed into the lowest (the rounding point 11 bits above it)
            sh = 64 - f64_clz(hi)
            cut = lo & ((ulong(1) << ulong(sh)) - ulong(1))
            lo = (lo >> ulong(sh)) | (hi << ulong(64 - sh)) | select(ulong(0), ulong(1), cut != ulong(0))
            e += sh
        out = f64_round_pack(sign, lo, e)
    return out


@luisa.func
def f64_add(x, y):
    """fl(x + y) of the doubles whose bits are x and y, correctly rounded (numpy's float64 add)."""
    sign_bit = f64_const(0, -2147483647 - 1)
    magnitude = f64_const(-1, 2147483647)
    frac_bits = f64_const(-1, 1048575)
    inf = f64_const(0, 2146435072)
    out = ulong(0)
    x_nan = (x & magnitude) > inf
    y_nan = (y & magnitude) > inf
    x_inf = (x & magnitude) == inf
    y_inf = (y & magnitude) == inf
    if x_nan:
        out = x | f64_const(0, 524288)
    elif y_nan:
        out = y | f64_const(0, 524288)
    elif x_inf and y_inf and x != y:
        out = f64_const(0, -524288)  # inf - inf: the default NaN
    elif x_inf:
        out = x
    elif y_inf:
        out = y
    else:
        # a: the operand of the larger magnitude, whose sign the sum takes (unless it cancels to zero)
        a = x
        b = y
        if (y & magnitude) > (x & magnitude):
            a = y
            b = x
        ea = int(a >> ulong(52)) & 2047
        eb = int(b >> ulong(52)) & 2047
        ma = a & frac_bits
        mb = b & frac_bits
        if ea != 0:
            ma = ma | f64_const(0, 1048576)
        else:
            ea = 1  # (a subnormal's exponent is the smallest normal's)
        if eb != 0:
            mb = mb | f64_const(0, 1048576)
        else:
            eb = 1
        d = ea - eb  # >= 0
        big = ma << ulong(10)  # 10 guard bits, at a's exponent - 10
        small = mb << ulong(10)
        sticky = ulong(0)
        if d >= 64:
            sticky = select(ulong(0), ulong(1), small != ulong(0))
            small = ulong(0)
        elif d > 0:
            shifted = small >> ulong(d)
            sticky = select(ulong(0), ulong(1), (shifted << ulong(d)) != small)
            small = shifted
        m = big + small
        if (a & sign_bit) != (b & sign_bit):
            m = big - small - sticky  # (the exact difference lies in (m, m + 1) where sticky is set)
        m = m | sticky
        if m == ulong(0):
            out = x & y & sign_bit  # exact cancellation: +0; -0 only from -0 + -0
        else:
            out = f64_round_pack(a & sign_bit, m, ea - 1075 - 10)
    return out
