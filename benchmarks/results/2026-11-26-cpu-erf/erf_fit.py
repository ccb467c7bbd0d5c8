"""The coefficients of the fused row kernels' fp32 erf (templates/fused_rows.py.jinja, ``erf32``) and
its error, evaluated in float32 as the kernel evaluates it (Horner, fp32 exp) against math.erf.

    python benchmarks/results/2026-11-26-cpu-erf/erf_fit.py

|x| < 1: erf(x) = x·P(x²), P of degree 5; 1 <= |x| < 4: erf(x) = 1 − exp(−x²)·Q(1/|x|), Q of degree 8
(erfc(x)·exp(x²) is smooth in 1/x); beyond, ±1 (erfc(4) = 1.5e-8). Each polynomial is a least-squares
fit on 2000 Chebyshev nodes in float64 (numpy), its coefficients then rounded to float32.
"""
import math

import numpy as np

erf, erfc = np.vectorize(math.erf), np.vectorize(math.erfc)


def fit(f, lo, hi, degree, nodes=2000):
    t = np.cos(np.pi * (np.arange(nodes) + 0.5) / nodes)
    z = (lo + hi) / 2 + (hi - lo) / 2 * t
    coefficients, *_ = np.linalg.lstsq(np.vander(z, degree + 1, increasing=True), f(z), rcond=None)
    return [float(np.float32(c)) for c in coefficients]


def horner(coefficients, v):
    out = np.float32(coefficients[-1])
    for c in coefficients[-2::-1]:
        out = (out * v + np.float32(c)).astype(np.float32)
    return out


P = fit(lambda z: erf(np.sqrt(z)) / np.sqrt(z), 1e-12, 1.0, 5)
Q = fit(lambda u: erfc(1 / u) * np.exp(1 / u**2), 0.25, 1.0, 8)


def erf32(x):
    x = x.astype(np.float32)
    ax, z = np.abs(x), (x * x).astype(np.float32)
    small = (x * horner(P, z)).astype(np.float32)
    tail = (np.float32(1) - np.exp(-z).astype(np.float32) * horner(Q, (np.float32(1) / np.maximum(ax, 1)).astype(np.float32)))
    tail = np.where(x < 0, -tail, tail).astype(np.float32)
    return np.where(ax < 1, small, np.where(ax < 4, tail, np.sign(x))).astype(np.float32)


if __name__ == "__main__":
    print("P =", P)
    print("Q =", Q)
    x = np.linspace(-6, 6, 1_200_001)
    err = np.abs(erf32(x).astype(np.float64) - erf(x.astype(np.float32).astype(np.float64)))
    print(f"max |erf32(x) - erf(x)| over [-6, 6]: {err.max():.3g} (float32's spacing at 1: {np.spacing(np.float32(1)):.3g})")
    small = np.abs(x) < 1
    rel = err[small & (np.abs(x) > 1e-6)] / np.abs(erf(x[small & (np.abs(x) > 1e-6)]))
    print(f"max relative error for 1e-6 < |x| < 1: {rel.max():.3g}")
