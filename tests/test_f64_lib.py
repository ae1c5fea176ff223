"""shaders/f64.py, binary64 on 64-bit integer words, against numpy's float64 arithmetic bit for bit:
an int32 times a double and the sum of two doubles over a large random set (every exponent, both
signs, subnormals) and crafted edges (ties to even, carries into the exponent, exact cancellation,
overflow, the smallest subnormals, signed zeros, infinities and NaN), each in one kernel launch on
the CPU backend; and luisa_compat's 64-bit typing, without which the library computes in 32 bits."""
import luisa
import numpy as np
import pytest
from luisa.types import ulong

from luisaml import luisa_compat
from luisaml.luisa_compat import byte_buffer
from luisaml.shaders.f64 import f64_add, f64_bits, f64_hi, f64_lo, f64_mul_i32

MAX = np.finfo(np.float64).max
TINY = np.float64(5e-324)  # the smallest subnormal
NORMAL = np.finfo(np.float64).tiny  # the smallest normal, 2^-1022


@luisa.func
def arithmetic_kernel(ints, xs, ys, out):
    t = int(dispatch_id().x)
    i = ints.read(int, 4 * t)
    x = xs.read(ulong, 8 * t)
    y = ys.read(ulong, 8 * t)
    out.write(24 * t, f64_mul_i32(i, x))
    out.write(24 * t + 8, f64_add(x, y))
    # through the two 32-bit words a scratch buffer holds, as the header stage reads h and o
    prod = f64_mul_i32(i, f64_bits(int(f64_lo(x)), int(f64_hi(x))))
    out.write(24 * t + 16, f64_add(prod, y))


def device_arithmetic(i: np.ndarray, x: np.ndarray, y: np.ndarray):
    """(fl(i * x), fl(x + y), fl(fl(i * x) + y)) as uint64 bits, computed by shaders/f64.py in one launch."""
    n = len(i)
    out = byte_buffer(np.zeros(24 * n, np.uint8))
    arithmetic_kernel(byte_buffer(np.ascontiguousarray(i, np.int32)), byte_buffer(np.ascontiguousarray(x, np.float64)),
                      byte_buffer(np.ascontiguousarray(y, np.float64)), out, dispatch_size=n)
    got = np.zeros(24 * n, np.uint8)
    out.copy_to(got)
    got = got.view(np.uint64).reshape(n, 3)
    return got[:, 0], got[:, 1], got[:, 2]


def numpy_arithmetic(i, x, y):
    with np.errstate(all="ignore"):
        prod = i.astype(np.int32) * x  # (int32 array times float64 array: numpy's product, the builder's)
        return prod.view(np.uint64), (x + y).view(np.uint64), (prod + y).view(np.uint64)


def assert_bits_equal(got, want, i, x, y, what: str) -> None:
    bad = np.flatnonzero(got != want)
    if len(bad):
        k = bad[0]
        raise AssertionError(f"{what}: {len(bad)} of {len(got)} differ; first i={i[k]} x={x[k]!r} ({x.view(np.uint64)[k]:#x}) "
                             f"y={y[k]!r}: got {got[k]:#018x}, numpy {want[k]:#018x}")


def check(i, x, y) -> None:
    got = device_arithmetic(i, x, y)
    want = numpy_arithmetic(i, x, y)
    for g, w, what in zip(got, want, ("i * x", "x + y", "fl(i * x) + y")):
        assert_bits_equal(g, w, i, x, y, what)


def random_doubles(rng, n: int) -> np.ndarray:
    """Doubles of every exponent and sign (random bits, NaN kept out: the edges cover it), and values of
    the magnitudes a voxel size and origin take."""
    bits = rng.integers(0, 2**64, n, dtype=np.uint64)
    out = bits.view(np.float64).copy()
    out[np.isnan(out)] = 1.5
    k = n // 4
    out[:k] = rng.choice([-1, 1], k) * 10.0 ** rng.uniform(-6, 6, k)
    out[k:2 * k] = rng.uniform(-1000, 1000, k)
    return out


def random_ints(rng, n: int) -> np.ndarray:
    i = rng.integers(-2**31, 2**31, n, dtype=np.int64)
    k = n // 3
    i[:k] = rng.integers(-5000, 5000, k)  # what a voxel index usually is
    return i.astype(np.int32)


def test_random_products_and_sums_equal_numpy():
    rng = np.random.default_rng(64)
    n = 400_000
    x = random_doubles(rng, n)
    y = random_doubles(rng, n)
    # half the sums between numbers of near magnitudes (cancellation, carries), a quarter of opposite sign
    near = rng.random(n) < 0.5
    y[near] = x[near] * (1 + rng.normal(0, 1e-3, near.sum())) * rng.choice([-1, 1], near.sum())
    close = rng.random(n) < 0.1  # a few ulps apart
    y[close] = -np.nextafter(x[close], rng.choice([-np.inf, np.inf], close.sum()))
    check(random_ints(rng, n), x, y)


def test_subnormal_operands_and_results_equal_numpy():
    rng = np.random.default_rng(65)
    n = 100_000
    sub = rng.integers(1, 2**52, (2, n), dtype=np.uint64).view(np.float64) * rng.choice([-1, 1], (2, n))
    x, y = sub[0].copy(), sub[1].copy()
    y[: n // 4] = rng.choice([-1, 1], n // 4) * NORMAL * rng.uniform(1, 4, n // 4)  # across the normal boundary
    x[n // 2: 3 * n // 4] *= 2.0 ** 1000  # products that leave the subnormals
    i = random_ints(rng, n)
    i[: n // 2] = rng.integers(-8, 9, n // 2)  # products that stay subnormal
    check(i, x, y)


def crafted():
    """(i, x, y) edges: ties to even at both parities, carries into the next binade and to infinity,
    exact and near cancellation, the subnormal boundary, signed zeros, extreme ints, inf and NaN."""
    ulp = 2.0 ** -52
    cases = [
        (1, 1.0, ulp / 2), (1, 1.0 + ulp, ulp / 2), (1, 1.0, 3 * ulp / 2), (1, 1.0, -ulp / 4),
        (1, 2.0 - ulp, ulp / 2), (1, 2.0 - ulp, ulp / 4), (1, -(2.0 - ulp), -ulp / 2), (1, 1.0, -ulp / 2),
        (1, 1.0, -1.0), (1, -1.0, 1.0), (1, 0.1, -0.1), (1, 1e300, -1e300), (1, MAX, MAX), (1, -MAX, -MAX),
        (1, MAX, -MAX), (1, MAX, np.nextafter(MAX, 0) - MAX), (1, 2.0 ** 970, 2.0 ** 1023 * (1 - 2.0 ** -53)),
        (3, 2.0 ** 1022, 0.0), (2, MAX, 0.0), (-2, MAX, 1.0), (2**31 - 1, MAX / 2**30, 0.0),
        (2, NORMAL, -NORMAL), (1, NORMAL, -TINY), (1, TINY, TINY), (1, -TINY, TINY), (-1, TINY, -0.0),
        (3, TINY, 0.0), (2**31 - 1, TINY, 0.0), (-2**31, TINY, 0.0), (-2**31, NORMAL, NORMAL), (7, 2.0 ** -1070, 0.0),
        (0, 1.5, 0.0), (0, -1.5, -0.0), (0, -1.5, 0.0), (-1, 0.0, -0.0), (1, -0.0, -0.0), (5, -0.0, 0.0), (0, -0.0, -0.0),
        (-2**31, 1.0, 2.0 ** 31), (2**31 - 1, 1.0, -(2.0 ** 31 - 1)), (-2**31, -0.1, 0.0), (2**31 - 1, 1 / 3, 1 / 3),
        (-2**31, 1e-3, -1e-3), (1, 2.0 ** 53, 1.0), (1, 2.0 ** 53, 3.0), (1, 2.0 ** 53 + 2, 1.0), (1, -(2.0 ** 53), -1.0),
        (1, 2.0 ** 60, -1.0), (1, 2.0 ** 52, -0.5), (1, 2.0 ** 52, -0.25), (1, 1.0, -(2.0 ** -200)),
        # products rounding with their dropped bits at exactly half the last place, both parities
        (3, 1.0 + ulp, 0.0), (3, 1.0 + 3 * ulp, 0.0), (5, 1.0 + ulp, 0.0), (2**31 - 1, 1.0 + ulp, 0.0),
        (-2**31 + 1, 1.0 + 5 * ulp, 0.0), (3, -(1.0 + ulp), 0.0),
        # infinities and NaN (the builder meets none: voxel sizes and origins are finite)
        (1, np.inf, 1.0), (-3, np.inf, 1.0), (0, np.inf, 1.0), (0, -np.inf, 1.0), (1, np.inf, -np.inf),
        (1, -np.inf, -np.inf), (1, 1.0, np.inf), (1, 1.0, -np.inf), (1, np.nan, 1.0), (2, 1.0, np.nan),
        (1, -np.inf, np.inf), (1, MAX, np.inf),
    ]
    i = np.array([c[0] for c in cases], np.int64).astype(np.int32)
    x = np.array([c[1] for c in cases], np.float64)
    y = np.array([c[2] for c in cases], np.float64)
    # each case with both orders of the sum and both signs of x
    return np.concatenate([i, i, -i.astype(np.int64).clip(-2**31 + 1)]).astype(np.int32), \
        np.concatenate([x, y, -x]), np.concatenate([y, x, y])


def test_crafted_edges_equal_numpy():
    check(*crafted())


def test_a_wrong_rounding_fails_the_check():
    """The comparison sees one wrong bit: numpy's product with its last bit flipped is refused."""
    i, x, y = crafted()
    want = numpy_arithmetic(i, x, y)[0].copy()
    want[3] ^= np.uint64(1)
    with pytest.raises(AssertionError, match="1 of"):
        assert_bits_equal(device_arithmetic(i, x, y)[0], want, i, x, y, "i * x")


def test_upstream_types_64_bit_operations_as_uint():
    """luisa-python's upper_scalar_dtype answers uint for two ulongs (the bug luisa_compat's shim fixes:
    this fails the day it is fixed upstream); with the shim, a product of two ulongs keeps its 64 bits."""
    import luisa.builtin
    from luisa.types import long, uint

    shim = luisa.builtin.upper_scalar_dtype
    assert getattr(shim, "_luisaml_shim", False), "luisaml.device.init installs the shim"
    assert shim._upstream(ulong, ulong) is uint and shim._upstream(long, long) is uint
    assert shim(ulong, ulong) is ulong and shim(long, int) is long and shim(ulong, long) is ulong
    assert shim(int, int) is int and shim(float, long) is float and shim(uint, uint) is uint
    luisa_compat.apply()  # (idempotent)
    assert luisa.builtin.upper_scalar_dtype is shim
    # fl(3 * (2^53 - 1)) needs the 64-bit product of the significand
    got = device_arithmetic(np.int32([3]), np.float64([2.0 ** 53 - 1]), np.float64([0.0]))[0]
    assert got[0] == (np.float64(3) * np.float64(2.0 ** 53 - 1)).view(np.uint64)
