#pragma once
/// common/fast_exp.hpp: exp(x) for the softmax inner loop. On host a branch-free polynomial (glibc's expf only
/// vectorizes under -ffast-math, which would break our −inf handling); on device the native exp. The host
/// kernels call the vector form (fast_exp_vec and the lane loops below) on GCC/Clang vector types: under the
/// default -ftrapping-math GCC will not if-convert the scalar form's selects on non-AVX-512 targets, so a loop
/// of scalar calls stays scalar there (measured: x86-64 and x86-64-v3 builds, GCC 12); vector selects never
/// become branches.
/// Accuracy: ≤ 2 ulp for float, ≤ 4 ulp for double on the whole range; exp(−inf) = 0, exp(x) = 0 for
/// x below the smallest normal's log (softmax arguments are ≤ 0, so underflow to 0 is what we want).
#include <kfa/compat.hpp>
#include <kfa/detail/common/host_simd.hpp>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace kfa {
namespace detail {

/// exp on the reduced range, shared by the scalar form and the vector form (V = float or double, or a
/// vector of them): sets t = xc·log2(e) + magic (n = t − magic is xc·log2(e) rounded, sitting in t's low
/// mantissa bits) and p = exp(r), r = xc − n·ln2, by polynomial. xc is already clamped. Results by
/// reference: a vector returned by value draws GCC -Wpsabi notes in baseline (non-AVX) instances.
template <class V>
KOKKOS_FORCEINLINE_FUNCTION void exp_reduced_f32(const V& xc, V& t, V& p) {
  t = xc * 1.44269504088896341f + 12582912.0f;  // 1.5·2^23
  const V n = t - 12582912.0f;
  V r = xc - n * 0.693145751953125f;  // ln2 split in two: n·ln2_hi is exact
  r = r - n * 1.428606765330187045e-06f;
  // Degree 6, minimax for the relative error on |r| ≤ ln2/2 (fitted by perf/exp_fit.py): 2.0e-9, below the
  // Taylor polynomial of degree 7 (5e-9) with one step less. p(0) = 1 exactly.
  p = r * 1.384364441037178e-3f + 8.374163880944252e-3f;
  p = p * r + 4.166800156235695e-2f;
  p = p * r + 1.6666431725025177e-1f;
  p = p * r + 4.999999403953552e-1f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
}
template <class V>
KOKKOS_FORCEINLINE_FUNCTION void exp_reduced_f64(const V& xc, V& t, V& p) {
  t = xc * 1.4426950408889634074 + 6755399441055744.0;  // 1.5·2^52
  const V n = t - 6755399441055744.0;
  V r = xc - n * 6.93147180369123816490e-01;
  r = r - n * 1.90821492927058770002e-10;
  // Taylor to degree 13 on |r| ≤ ln2/2: truncation < 2e-17 relative.
  p = r * (1.0 / 6227020800.0) + 1.0 / 479001600.0;
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
}

KOKKOS_INLINE_FUNCTION float fast_exp(float x) {
#if KFA_ON_DEVICE
  return compat::exp(x);
#else
  // Branch-free so that loops calling it vectorize: clamp, round x·log2(e) to n with the 1.5·2^23 trick
  // (n then sits in the low mantissa bits of t, no float→int conversion), exp(r) by polynomial, times 2^n.
  const float lo = -87.0f, hi = 88.0f;
  float xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;  // NaN passes both compares unchanged and propagates through p
  float t, p;
  exp_reduced_f32(xc, t, p);
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
  double t, p;
  exp_reduced_f64(xc, t, p);
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

#if defined(__GNUC__) && !defined(__CUDACC__)
// Vector arguments and returns below are only ever inlined into functions of the matching ISA (the
// standalone instances GCC warns about when it compiles them for the baseline are never called).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
#if KFA_HOST_VECTOR_EXT && !defined(__CUDACC__)
#define KFA_HOST_LANES 1
/// fast_exp on a GCC/Clang vector of float or double (any width): the same arithmetic as the scalar form,
/// with the selects as vector operations. `Bounded`: the caller's arguments are at most 88 (float) / 709
/// (double) or NaN, so the upper clamp is left out (softmax arguments, a score less its row's maximum or
/// log-sum-exp, are ≤ 0 up to rounding); the result is then the same as the full form's.
template <bool Bounded = false, class V>
__attribute__((always_inline)) inline void fast_exp_vec(V& x) {
  using E = std::remove_cv_t<std::remove_reference_t<decltype(x[0])>>;
  constexpr bool f32 = sizeof(E) == 4;
  using UE = std::conditional_t<f32, std::uint32_t, std::uint64_t>;
  typedef UE U __attribute__((vector_size(sizeof(V))));
  const V zero = V{};
  const V lo = zero + E(f32 ? -87.0 : -708.0), hi = zero + E(f32 ? 88.0 : 709.0);
  const V magic = zero + (f32 ? E(12582912.0f) : E(6755399441055744.0));
  V xc = x < lo ? lo : x;
  if constexpr (!Bounded) xc = xc > hi ? hi : xc;
  V t, p;
  U bits;
  if constexpr (f32) {
    exp_reduced_f32(xc, t, p);
    bits = ((U)t - 0x4B400000u + 127u) << 23;
  } else {
    exp_reduced_f64(xc, t, p);
    bits = ((U)t - (U)magic + 1023u) << 52;
  }
  const V y = p * (V)bits;
  x = x < lo ? zero : y;
}

/// VB-byte vectors of Acc, loaded and stored without alignment assumptions.
template <int VB, class Acc>
struct LaneVec {
  typedef Acc type __attribute__((vector_size(VB)));
  typedef Acc unaligned __attribute__((vector_size(VB), aligned(alignof(Acc)), __may_alias__));
  static constexpr int width = VB / static_cast<int>(sizeof(Acc));
  // By reference, not by value: vector arguments and returns wider than the baseline's registers draw
  // GCC's -Wpsabi notes for the instances it compiles for the baseline (never called: always inlined).
  __attribute__((always_inline)) static void load(type& out, const Acc* p) {
    out = *reinterpret_cast<const unaligned*>(p);
  }
  __attribute__((always_inline)) static void store(Acc* p, const type& v) { *reinterpret_cast<unaligned*>(p) = v; }
};
#else
#define KFA_HOST_LANES 0
#endif

/// Bytes per vector for W lanes of Acc under `isa`: the ISA's register, at most the W lanes (0: scalar).
template <int W, class Acc>
KOKKOS_INLINE_FUNCTION constexpr int lane_bytes(HostIsa isa) {
  return KFA_HOST_LANES == 0 || W == 1 || isa == HostIsa::scalar
             ? 0
             : (isa_vector_bytes(isa) < W * static_cast<int>(sizeof(Acc)) ? isa_vector_bytes(isa)
                                                                          : W * static_cast<int>(sizeof(Acc)));
}

/// The element-wise steps of the kernels over W query rows stored as W consecutive lanes of each of n
/// rows of a transposed tile (row j at s + j·ld), for the ISA of the with_host_isa() tag: vectors of that
/// ISA's width on host, plain loops on device (and for the scalar level).
///
/// tmax[x] = max(tmax[x], max_j s[j·ld + x])
template <int W, class Tag, class Acc>
KOKKOS_FORCEINLINE_FUNCTION void lanes_max(Tag, const Acc* s, int ld, int n, Acc* tmax) {
  constexpr int VB = lane_bytes<W, Acc>(Tag::value);
#if KFA_HOST_LANES
  if constexpr (VB > 0) {
    using L = LaneVec<VB, Acc>;
    constexpr int NV = W / L::width;
    // C independent chains of maxima per vector (rows j ≡ c mod C), so the loop runs at the loads' rate
    // instead of the max instruction's latency; joined at the end.
    constexpr int C = NV >= 4 ? 1 : 4 / NV;
    typename L::type m[C][NV];
    for (int u = 0; u < NV; ++u) L::load(m[0][u], tmax + u * L::width);
    for (int c = 1; c < C; ++c)
      for (int u = 0; u < NV; ++u) m[c][u] = m[0][u];
    int j = 0;
    for (; j + C <= n; j += C)
      for (int c = 0; c < C; ++c)
        for (int u = 0; u < NV; ++u) {
          typename L::type v;
          L::load(v, s + static_cast<long>(j + c) * ld + u * L::width);
          m[c][u] = v > m[c][u] ? v : m[c][u];
        }
    for (; j < n; ++j)
      for (int u = 0; u < NV; ++u) {
        typename L::type v;
        L::load(v, s + static_cast<long>(j) * ld + u * L::width);
        m[0][u] = v > m[0][u] ? v : m[0][u];
      }
    for (int c = 1; c < C; ++c)
      for (int u = 0; u < NV; ++u) m[0][u] = m[c][u] > m[0][u] ? m[c][u] : m[0][u];
    for (int u = 0; u < NV; ++u) L::store(tmax + u * L::width, m[0][u]);
    return;
  }
#endif
  for (int j = 0; j < n; ++j)
    for (int x = 0; x < W; ++x) tmax[x] = s[j * ld + x] > tmax[x] ? s[j * ld + x] : tmax[x];
}

/// p = exp(s[j·ld + x] − m[x]) stored over s, and sum[x] += Σ_j p.
template <int W, class Tag, class Acc>
KOKKOS_FORCEINLINE_FUNCTION void lanes_exp_sum(Tag, Acc* s, int ld, int n, const Acc* m, Acc* sum) {
  constexpr int VB = lane_bytes<W, Acc>(Tag::value);
#if KFA_HOST_LANES
  if constexpr (VB > 0) {
    using L = LaneVec<VB, Acc>;
    constexpr int NV = W / L::width;
    typename L::type mv[NV], acc[NV];
    for (int u = 0; u < NV; ++u) L::load(mv[u], m + u * L::width), L::load(acc[u], sum + u * L::width);
    for (int j = 0; j < n; ++j)
      for (int u = 0; u < NV; ++u) {
        Acc* const p = s + static_cast<long>(j) * ld + u * L::width;
        typename L::type e;
        L::load(e, p);
        e -= mv[u];
        fast_exp_vec<true>(e);
        L::store(p, e);
        acc[u] += e;
      }
    for (int u = 0; u < NV; ++u) L::store(sum + u * L::width, acc[u]);
    return;
  }
#endif
  for (int j = 0; j < n; ++j)
    for (int x = 0; x < W; ++x) {
      const Acc p = fast_exp(s[j * ld + x] - m[x]);
      s[j * ld + x] = p;
      sum[x] += p;
    }
}

/// P and dS from S and dP: p = exp(s[j·ld + x] − lse[x]) stored over s, and
/// ds[j·ld + x] = p · (ds[j·ld + x] − dd[x]) (ds holds dP on entry).
template <int W, class Tag, class Acc>
KOKKOS_FORCEINLINE_FUNCTION void lanes_p_ds(Tag, Acc* s, Acc* ds, int ld, int n, const Acc* lse, const Acc* dd) {
  constexpr int VB = lane_bytes<W, Acc>(Tag::value);
#if KFA_HOST_LANES
  if constexpr (VB > 0) {
    using L = LaneVec<VB, Acc>;
    constexpr int NV = W / L::width;
    typename L::type lv[NV], dv[NV];
    for (int u = 0; u < NV; ++u) L::load(lv[u], lse + u * L::width), L::load(dv[u], dd + u * L::width);
    for (int j = 0; j < n; ++j)
      for (int u = 0; u < NV; ++u) {
        const long o = static_cast<long>(j) * ld + u * L::width;
        typename L::type p, dp;
        L::load(p, s + o);
        p -= lv[u];
        fast_exp_vec<true>(p);
        L::store(s + o, p);
        L::load(dp, ds + o);
        dp = p * (dp - dv[u]);
        L::store(ds + o, dp);
      }
    return;
  }
#endif
  for (int j = 0; j < n; ++j)
    for (int x = 0; x < W; ++x) {
      const Acc p = fast_exp(s[j * ld + x] - lse[x]);
      s[j * ld + x] = p;
      ds[j * ld + x] = p * (ds[j * ld + x] - dd[x]);
    }
}

#if defined(__GNUC__) && !defined(__CUDACC__)
#pragma GCC diagnostic pop
#endif

}  // namespace detail
}  // namespace kfa
