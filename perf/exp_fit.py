#!/usr/bin/env python3
"""The float exp polynomial of src/kfa/detail/common/fast_exp.hpp (exp_reduced_f32): a degree-6 polynomial
p(r) = 1 + r·(c1 + c2·r + … + c6·r⁵) minimizing the largest relative error |p(r) − eʳ| / eʳ on the reduced
range |r| ≤ ln2/2 (Lawson's iteratively reweighted least squares on Chebyshev points), then the float32
coefficients evaluated in float32 Horner steps as the kernels do.

    python3 perf/exp_fit.py        # needs numpy (a development tool, not a dependency of kfa)

Prints the coefficients (c1 … c6, as float32 values) and both errors.
"""
import numpy as np

DEG = 6
A_MAX = np.log(2.0) / 2 * 1.0001  # the reduction's |r| bound, with room for its rounding


def fit():
    x = np.cos(np.linspace(0.0, np.pi, 4001)) * A_MAX
    f = np.exp(x)
    a = np.stack([x**k for k in range(1, DEG + 1)], axis=1) / f[:, None]
    b = (f - 1.0) / f
    w = np.ones_like(x) / len(x)
    for _ in range(400):
        sw = np.sqrt(w)
        c, *_ = np.linalg.lstsq(a * sw[:, None], b * sw, rcond=None)
        err = np.abs(a @ c - b)
        w = w * err
        w /= w.sum()
    return c, float(np.max(np.abs(a @ c - b)))


def float32_error(c):
    c32 = [np.float32(v) for v in c]
    r = np.linspace(-A_MAX, A_MAX, 2_000_001).astype(np.float32)
    p = c32[-1] * r + c32[-2]
    for k in range(DEG - 3, -1, -1):
        p = (p * r + c32[k]).astype(np.float32)
    p = (p * r + np.float32(1.0)).astype(np.float32)
    ref = np.exp(r.astype(np.float64))
    return float(np.max(np.abs(p.astype(np.float64) - ref) / ref))


if __name__ == "__main__":
    coeffs, rel = fit()
    print("c1..c6 (float32):", ", ".join(repr(float(np.float32(v))) for v in coeffs))
    print(f"relative error of the polynomial: {rel:.3g}")
    print(f"relative error in float32 Horner steps: {float32_error(coeffs):.3g}")
