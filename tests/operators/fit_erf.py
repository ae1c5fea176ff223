"""Fit the coefficients of shaders/dsl_lib.py::erf_f32 and report its float32 error (a dev tool,
not a test): `python tests/operators/fit_erf.py`. Needs scipy (the float64 reference erf).

erf_f32 is piecewise: |x| < 0.84375: x + x * R(x^2); [0.84375, 1.25): E + P(|x| - 1);
[1.25, 4): 1 - exp(-x^2) * G(1/|x|) with G = erfcx; |x| >= 4: 1 (erf rounds to 1 in float32).
Each piece is a least-squares fit on Chebyshev nodes, converted to monomials for Horner."""
from __future__ import annotations

import numpy as np
import numpy.polynomial.chebyshev as C
import numpy.polynomial.polynomial as P
from scipy.special import erf, erfcx

E = float(np.float32(erf(1.0)))


def fit(f, a: float, b: float, deg: int, relative: bool = True, n: int = 4000) -> np.ndarray:
    """Return monomial coefficients (lowest first) of a degree-`deg` fit of f on [a, b]."""
    u = np.cos(np.pi * (np.arange(n) + 0.5) / n)
    x = (a + b) / 2 + (b - a) / 2 * u
    y = f(x)
    cheb = C.chebfit(u, y, deg, w=1 / np.abs(y) if relative else None)
    mono = np.zeros(1)
    for k, ck in enumerate(C.cheb2poly(cheb)):  # substitute u = (2x - a - b) / (b - a)
        mono = P.polyadd(mono, ck * P.polypow([-(a + b) / (b - a), 2 / (b - a)], k))
    return mono.astype(np.float32)


def pieces() -> dict[str, np.ndarray]:
    """Return the coefficient sets R, P, G."""
    def r(t):
        s = np.sqrt(np.maximum(t, 1e-300))
        return erf(s) / s - 1

    return {
        "R": fit(r, 0.0, 0.84375**2, 5),
        "P": fit(lambda s: erf(s + 1.0) - E, 0.84375 - 1, 0.25, 7, relative=False),
        "G": fit(lambda w: erfcx(1 / w), 1 / 4.0, 1 / 1.25, 8),
    }


def horner(c: np.ndarray, u: np.ndarray) -> np.ndarray:
    acc = np.full_like(u, c[-1])
    for ck in c[-2::-1]:
        acc = (acc * u + ck).astype(np.float32)
    return acc


def erf32(x: np.ndarray, c: dict[str, np.ndarray]) -> np.ndarray:
    """Evaluate erf_f32's formula in float32 numpy (what the DSL computes)."""
    x = x.astype(np.float32)
    a = np.abs(x)
    one = np.float32(1)
    small = x + x * horner(c["R"], x * x)
    mid = np.float32(E) + horner(c["P"], a - one)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        tail = one - np.exp(-(a * a)).astype(np.float32) * horner(c["G"], one / a)
    r = np.where(a < 0.84375, small, np.copysign(np.where(a < 1.25, mid, np.where(a < 4, tail, one)), x))
    return r.astype(np.float32)


def ulp_error(got: np.ndarray, x: np.ndarray) -> np.ndarray:
    want = erf(x.astype(np.float64))
    return np.abs(got.astype(np.float64) - want) / np.spacing(np.abs(want.astype(np.float32)))


if __name__ == "__main__":
    c = pieces()
    print(f"E = {E!r}")
    for k, v in c.items():
        print(k, "=", [float(x) for x in v])
    x = np.linspace(-5, 5, 4_000_001).astype(np.float32)
    print("max error over [-5, 5]:", ulp_error(erf32(x, c), x).max(), "ulp")
