#pragma once
/// exp(x) for the softmax inner loop. On host a branch-free polynomial that compilers vectorize (glibc's
/// expf only vectorizes under -ffast-math, which would break our −inf handling); on device the native exp.
/// Accuracy: ≤ 2 ulp for float, ≤ 4 ulp for double on the whole range; exp(−inf) = 0, exp(x) = 0 for
/// x below the smallest normal's log (softmax arguments are ≤ 0, so underflow to 0 is what we want).
#include <kfa/compat.hpp>

namespace kfa {
namespace detail {

KOKKOS_INLINE_FUNCTION float fast_exp(float x) {
#if KFA_ON_DEVICE
  return compat::exp(x);
#else
  // Branch-free so that loops calling it vectorize: clamp, round x·log2(e) to n with the 1.5·2^23 trick
  // (n then sits in the low mantissa bits of t, no float→int conversion), exp(r) by polynomial, times 2^n.
  const float lo = -87.0f, hi = 88.0f, magic = 12582912.0f;
  float xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;  // NaN passes both compares unchanged and propagates through p
  const float t = xc * 1.44269504088896341f + magic;
  const float n = t - magic;
  float r = xc - n * 0.693145751953125f;  // ln2 split in two: n·ln2_hi is exact
  r = r - n * 1.428606765330187045e-06f;
  // Taylor to degree 7 on |r| ≤ ln2/2: truncation < 2e-9 relative.
  float p = 1.98412698e-4f;
  p = p * r + 1.38888889e-3f;
  p = p * r + 8.33333333e-3f;
  p = p * r + 4.16666667e-2f;
  p = p * r + 1.66666667e-1f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  // Unsigned arithmetic: for NaN input t's bits are arbitrary and must wrap, not overflow.
  std::uint32_t tb;
  std::memcpy(&tb, &t, sizeof(tb));
  const std::uint32_t bits = (tb - 0x4B400000u + 127u) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  const float y = p * two_n;
  return x < lo ? 0.0f : y;
#endif
}

KOKKOS_INLINE_FUNCTION double fast_exp(double x) {
#if KFA_ON_DEVICE
  return compat::exp(x);
#else
  const double lo = -708.0, hi = 709.0, magic = 6755399441055744.0;  // 1.5·2^52
  double xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  const double t = xc * 1.4426950408889634074 + magic;
  const double n = t - magic;
  double r = xc - n * 6.93147180369123816490e-01;
  r = r - n * 1.90821492927058770002e-10;
  // Taylor to degree 13 on |r| ≤ ln2/2: truncation < 2e-17 relative.
  double p = 1.0 / 6227020800.0;
  p = p * r + 1.0 / 479001600.0;
  p = p * r + 1.0 / 39916800.0;
  p = p * r + 1.0 / 3628800.0;
  p = p * r + 1.0 / 362880.0;
  p = p * r + 1.0 / 40320.0;
  p = p * r + 1.0 / 5040.0;
  p = p * r + 1.0 / 720.0;
  p = p * r + 1.0 / 120.0;
  p = p * r + 1.0 / 24.0;
  p = p * r + 1.0 / 6.0;
  p = p * r + 0.5;
  p = p * r + 1.0;
  p = p * r + 1.0;
  std::uint64_t tb, mb;
  std::memcpy(&tb, &t, sizeof(tb));
  std::memcpy(&mb, &magic, sizeof(mb));
  const std::uint64_t bits = (tb - mb + 1023u) << 52;
  double two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  const double y = p * two_n;
  return x < lo ? 0.0 : y;
#endif
}

}  // namespace detail
}  // namespace kfa
