"""The marked tile callables of the tensor-core route: a warp's m16n8k8 TF32 and m16n8k16 FP16 matrix
product, D = A B + C for A 16 x K, B K x 8, written as their FP32 equivalent in the DSL.

On CUDA, luisaml's compiler front (luisaml/tensor_cores.py) finds these callables in the generated
source by their marker (a constant in the body, below) and replaces the body with one `mma.sync`;
everywhere else (the CPU backend, a device without the front, a kernel whose rewrite did not
compile) the DSL body below runs. Both give the same answer within TF32 (FP16) rounding.

The contract, lane l of a warp of 32 (all 32 call together, convergent: mma.sync is a warp
instruction), g = l // 4 and t = l % 4, r = t * K / 8 (the lane's rotation of k):

  a[i]          = A[g][(i + r) % K]        a[K + i]  = A[g + 8][(i + r) % K]      (i < K)
  b[i]          = B[(i + r) % K][2t]       b[K + i]  = B[(i + r) % K][2t + 1]
  b[2K + i]     = B[(i + r) % K][g]
  c, result     = (C[g][2t], C[g][2t + 1], C[g + 8][2t], C[g + 8][2t + 1])

so every lane holds what its own four outputs need (the DSL body is a dot product per output, no
lane reads another's values) and the mma fragments sit at fixed indices (the rotation puts k = r
at index 0): TF32 a[0], a[8], a[4], a[12] and b[16], b[20]; FP16 a[0, 1, 16, 17, 8, 9, 24, 25] and
b[32, 33, 40, 41]. The rest of a and b is dead in the rewritten kernel and the CUDA compiler drops
its loads.
"""
# ruff: noqa: F821  (fma, dispatch_id, set_block_size are DSL builtins the luisa compiler resolves)
import luisa
from luisa.mathtypes import float4  # noqa: F401
from luisa.types import half  # noqa: F401  (f16_round's DSL body)

# The markers: constants below 2^31 (a DSL int) whose bit 30 is set, so (MARK >> 30) == 1. The body
# multiplies its result by float(MARK >> 30): exact, and the literal survives into the CUDA source
# (LuisaCompute prints an int literal in decimal). The front looks for these decimal strings.
MARK_TF32 = 1511506921  # 0x5A17C3E9
MARK_F16 = 1526097219  # 0x5AF66943
MARK_TF32R = 1530699303  # 0x5B3C9E27: mma_tf32_m16n8k8_rounded (operands already rounded by tf32_round)
MARK_ROUND = 1548561009  # 0x5C4D2A71: tf32_round
MARK_F16ROUND = 1568545589  # 0x5D7E1B35: f16_round

# (rows of A, columns of B, k) of each shape, and the array lengths of a and b
SHAPES = {"tf32": (16, 8, 8), "f16": (16, 8, 16)}


def array_sizes(kind: str) -> tuple[int, int]:
    """Return the lengths of the a and b arrays the callable of `kind` ("tf32", "f16") takes."""
    k = SHAPES[kind][2]
    return 2 * k, 3 * k


A_TF32 = luisa.ArrayType(16, float)
B_TF32 = luisa.ArrayType(24, float)
A_F16 = luisa.ArrayType(32, float)
B_F16 = luisa.ArrayType(48, float)


def _fp32_tile(k: int, mark: int, name: str, doc: str):
    """Return the marked tile callable `name` of depth k (8: TF32's m16n8k8, 16: FP16's m16n8k16) and marker
    `mark`: its DSL body the FP32 product, one body for every marked tile. A factory, not a shared callable
    the marked ones call: the front finds a marker in the body of the callable that holds it and swaps that
    body (luisaml/nvrtc_front.py), and a shared callable would add a function to every kernel's source; as
    here, each callable's emitted function is the one written out before, byte for byte (k and mark are
    the literals they were)."""

    def tile(a, b, c):
        x = c.x
        y = c.y
        z = c.z
        w = c.w
        for i in range(k):
            x = fma(a[i], b[i], x)
            y = fma(a[i], b[k + i], y)
            z = fma(a[k + i], b[i], z)
            w = fma(a[k + i], b[k + i], w)
        return float4(x, y, z, w) * float(mark >> 30)

    tile.__name__ = tile.__qualname__ = name
    tile.__doc__ = doc
    return luisa.func(tile)


mma_tf32_m16n8k8 = _fp32_tile(8, MARK_TF32, "mma_tf32_m16n8k8", """A lane's four outputs of D = A B + C, a warp's
    16 x 8 x 8 product (contract: module docstring); the tensor-core route rounds A and B to TF32, this body
    keeps them in FP32.""")

mma_tf32_m16n8k8_rounded = _fp32_tile(8, MARK_TF32R, "mma_tf32_m16n8k8_rounded", """mma_tf32_m16n8k8 for
    operands already rounded to TF32 (tf32_round, once where a tile copies them to shared memory, not once a
    fragment an mma: operators/tiled_mma.py's "w64r"): the tensor-core body hands the bits to mma.sync as
    they are; this body is the FP32 product, as the other's.""")


@luisa.func
def tf32_round(x):
    """x made ready for mma_tf32_m16n8k8_rounded on the tensor-core route: half a TF32 ulp added to its bits, which
    the mma's truncation to TF32 turns into cvt.rna's rounding (to nearest, ties away); x where the DSL
    body runs (with mma_tf32_m16n8k8_rounded's FP32 body the product is then FP32's, as with the route off)."""
    return x * float(MARK_ROUND >> 30)


mma_f16_m16n8k16 = _fp32_tile(16, MARK_F16, "mma_f16_m16n8k16", """A lane's four outputs of D = A B + C, a warp's
    16 x 8 x 16 product (contract: module docstring); the tensor-core route rounds A and B to half, this body
    keeps them in FP32 (so the start-up self-test can tell which of the two ran).""")


@luisa.func
def f16_round(x):
    """x rounded to half where the DSL body runs (operators/tiled_mma.py's FP16 kind rounds each element it copies,
    so that mma_f16_m16n8k16's FP32 body multiplies the HMMA's operands); x as it is on the tensor-core route,
    where the mma's own cvt.rn.f16x2 rounds it the same way (to nearest even), so the copies spend nothing on it."""
    return float(half(x * float(MARK_F16ROUND >> 30)))


# ---- one warp's tile, the contract's loads from buffers: the start-up self-test and the tests ----
# A is 16 x K, B K x 8, C and D 16 x 8, row-major; dispatch 32 threads (one warp).


@luisa.func
def warp_tile_tf32(A, B, C, D):
    set_block_size(32, 1, 1)
    lane = int(dispatch_id().x) % 32
    g = lane // 4
    t = lane % 4
    a = A_TF32()
    b = B_TF32()
    for i in range(8):
        k = (i + t) % 8
        a[i] = A.read(g * 8 + k)
        a[8 + i] = A.read((g + 8) * 8 + k)
        b[i] = B.read(k * 8 + 2 * t)
        b[8 + i] = B.read(k * 8 + 2 * t + 1)
        b[16 + i] = B.read(k * 8 + g)
    c = float4(C.read(g * 8 + 2 * t), C.read(g * 8 + 2 * t + 1), C.read((g + 8) * 8 + 2 * t),
               C.read((g + 8) * 8 + 2 * t + 1))
    d = mma_tf32_m16n8k8(a, b, c)
    D.write(g * 8 + 2 * t, d.x)
    D.write(g * 8 + 2 * t + 1, d.y)
    D.write((g + 8) * 8 + 2 * t, d.z)
    D.write((g + 8) * 8 + 2 * t + 1, d.w)


@luisa.func
def warp_tile_f16(A, B, C, D):
    set_block_size(32, 1, 1)
    lane = int(dispatch_id().x) % 32
    g = lane // 4
    t = lane % 4
    a = A_F16()
    b = B_F16()
    for i in range(16):
        k = (i + 2 * t) % 16
        a[i] = A.read(g * 16 + k)
        a[16 + i] = A.read((g + 8) * 16 + k)
        b[i] = B.read(k * 8 + 2 * t)
        b[16 + i] = B.read(k * 8 + 2 * t + 1)
        b[32 + i] = B.read(k * 8 + g)
    c = float4(C.read(g * 8 + 2 * t), C.read(g * 8 + 2 * t + 1), C.read((g + 8) * 8 + 2 * t),
               C.read((g + 8) * 8 + 2 * t + 1))
    d = mma_f16_m16n8k16(a, b, c)
    D.write(g * 8 + 2 * t, d.x)
    D.write(g * 8 + 2 * t + 1, d.y)
    D.write((g + 8) * 8 + 2 * t, d.z)
    D.write((g + 8) * 8 + 2 * t + 1, d.w)
