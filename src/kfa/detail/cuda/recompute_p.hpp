#pragma once
/// cuda/recompute_p.hpp: the recomputation of P from raw scores and the saved log-sum-exp, shared by every
/// tensor-core backward kernel (constants computed once on the host, the per-element step on the device).
#include <kfa/compat.hpp>
#include <kfa/detail/cuda/mma.hpp>

namespace kfa {
namespace detail {

#if KFA_HAS_TENSOR_CORES
/// The constants of P = exp(softcap(s·scale) − lse) in base 2, computed once on the host (kernel parameters,
/// so they take no registers): without softcap 2^(s·scale_log2 − lse·log2e), one FFMA and one MUFU.EX2.
struct TcRecomputeConsts {
  float scale_log2;  // scale·log2(e)
  float cap_in;      // scale / softcap: tanh's argument is s·cap_in
  float cap_log2;    // softcap·log2(e): softcap(x)·log2(e) = tanh(s·cap_in)·cap_log2
  TcRecomputeConsts(float scale, float softcap)
      : scale_log2(scale * tc::log2e), cap_in(softcap > 0.f ? scale / softcap : 0.f), cap_log2(softcap * tc::log2e) {}
};
#if KFA_TC_DEVICE
/// Pᵀ or P entries from raw scores: scale, softcap, mask (masked → 0), exp(x − lse). `lse2_row` is the row's
/// lse·log2(e) (+inf for a row that is not there). Also returns the softcap derivative factor 1 − tanh²
/// (1 without softcap) through `dcap`. `CapDiv` divides tanh's argument (s·scale_log2 / cap_log2 = s·scale /
/// softcap) instead of multiplying by cap_in: the same value within rounding; which form leaves an instance
/// without register spills differs between instances (ptxas, CUDA 13.0: d = 64 needs the division).
template <bool Softcap, bool CapDiv = false>
__device__ __forceinline__ float tc_recompute_p(float s, const TcRecomputeConsts& c, float lse2_row, bool visible,
                                                float& dcap) {
  dcap = 1.f;
  float x;
  if (Softcap) {
    const float th = tanhf(CapDiv ? s * c.scale_log2 / c.cap_log2 : s * c.cap_in);
    dcap = 1.f - th * th;
    x = fmaf(th, c.cap_log2, -lse2_row);
  } else {
    x = fmaf(s, c.scale_log2, -lse2_row);
  }
  // Selecting the exponent, not the result, leaves the d = 128 dK/dV kernels without spills (ptxas, CUDA 13.0).
  return tc::exp2_approx(visible ? x : -compat::infinity<float>());
}
#endif
#endif  // KFA_HAS_TENSOR_CORES

}  // namespace detail
}  // namespace kfa
