"""FMA throughput of the arithmetic the DSL can express (float, half, half2), to decide whether an
fp16 mode with half arithmetic can pay: LuisaCompute's half2 fma is two scalar __hfma calls, and
only a packed HFMA2 would double the float rate. python benchmarks/experiments/micro_fma.py (CUDA)."""
from __future__ import annotations

import json
import sys
import time

import luisa
from luisa.mathtypes import *
from luisa.types import half

ITERS = 256


@luisa.func
def fma_float(out, seed):
    i = int(dispatch_id().x)
    a0 = float(i) * 1e-7
    a1 = a0 + 0.1
    a2 = a0 + 0.2
    a3 = a0 + 0.3
    a4 = a0 + 0.4
    a5 = a0 + 0.5
    a6 = a0 + 0.6
    a7 = a0 + 0.7
    for k in range(ITERS):
        a0 = fma(a0, seed, 0.5)
        a1 = fma(a1, seed, 0.5)
        a2 = fma(a2, seed, 0.5)
        a3 = fma(a3, seed, 0.5)
        a4 = fma(a4, seed, 0.5)
        a5 = fma(a5, seed, 0.5)
        a6 = fma(a6, seed, 0.5)
        a7 = fma(a7, seed, 0.5)
    out.write(i, a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7)


@luisa.func
def fma_half2(out, seed):
    i = int(dispatch_id().x)
    s = make_half2(half(seed), half(seed))
    h = make_half2(half(0.5), half(0.5))
    a0 = make_half2(half(float(i % 7) * 0.01), half(0.1))
    a1 = a0 + h
    a2 = a1 + h
    a3 = a2 + h
    a4 = a3 + h
    a5 = a4 + h
    a6 = a5 + h
    a7 = a6 + h
    for k in range(ITERS):
        a0 = fma(a0, s, h)
        a1 = fma(a1, s, h)
        a2 = fma(a2, s, h)
        a3 = fma(a3, s, h)
        a4 = fma(a4, s, h)
        a5 = fma(a5, s, h)
        a6 = fma(a6, s, h)
        a7 = fma(a7, s, h)
    t = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7
    out.write(i, float(t.x) + float(t.y))


def main() -> int:
    luisa.init("cuda")
    n = 1 << 24
    out = luisa.Buffer(n, float)
    res = {}
    for name, k, flops_per_thread in (("float", fma_float, 2 * 8 * ITERS), ("half2", fma_half2, 2 * 2 * 8 * ITERS)):
        k(out, 0.999, dispatch_size=n)
        luisa.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            k(out, 0.999, dispatch_size=n)
        luisa.synchronize()
        dt = (time.perf_counter() - t) / 10
        res[name] = {"ms": dt * 1e3, "tflops": n * flops_per_thread / dt / 1e12}
    print("MICRO " + json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
