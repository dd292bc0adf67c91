#pragma once
/// common/kernel_args.hpp: the one argument struct every kernel family's launch and every kernel functor takes:
/// a call's canonical Views (canonical.hpp: unmanaged, inputs const, one layout per call), its softmax scale
/// and softcap in the accumulation type (double for double, else float; softcap 0 = none) and its key mask.
/// Built once per call (forward_run, backward_run); device-copyable, so a functor holds the Views it reads as
/// they come. The static_asserts make the canonical types the only ones a kernel can be instantiated for.
#include <kfa/detail/common/canonical.hpp>
#include <kfa/detail/mask.hpp>
#include <kfa/types.hpp>

#include <type_traits>

namespace kfa {
namespace detail {

template <class V>
constexpr bool is_canonical_view() {
  return V::memory_traits::is_unmanaged && (std::is_same<typename V::array_layout, Kokkos::LayoutRight>::value ||
                                            std::is_same<typename V::array_layout, Kokkos::LayoutStride>::value);
}

/// A forward call: q, k, v [batch, seq, heads, d] in, o out (T, or the accumulation type for the ring
/// layer's partials), lse [batch, heads_q, seq_q] out.
template <class QV, class KV, class VV, class OV, class LV>
struct ForwardArgs {
  static_assert(is_canonical_view<QV>() && is_canonical_view<KV>() && is_canonical_view<VV>() &&
                    is_canonical_view<OV>() && is_canonical_view<LV>(),
                "kfa kernels take canonical Views (canonical.hpp)");
  using q_type = QV;
  using k_type = KV;
  using v_type = VV;
  using o_type = OV;
  using lse_type = LV;
  using T = typename QV::non_const_value_type;
  using Acc = accumulator_t<T>;
  QV q;
  KV k;
  VV v;
  OV o;
  LV lse;
  Acc scale;
  Acc softcap;
  KeyMask mask;
};

/// A backward call: q, k, v, dO, lse and D = rowsum(dO ∘ O) [batch, heads_q, seq_q] in; dq, dk, dv out.
/// A dK/dV kernel does not touch dq, a dQ kernel not dk and dv.
template <class QV, class KV, class VV, class DOV, class LV, class DV, class DQV, class DKV, class DVV>
struct BackwardArgs {
  static_assert(is_canonical_view<QV>() && is_canonical_view<KV>() && is_canonical_view<VV>() &&
                    is_canonical_view<DOV>() && is_canonical_view<LV>() && is_canonical_view<DV>() &&
                    is_canonical_view<DQV>() && is_canonical_view<DKV>() && is_canonical_view<DVV>(),
                "kfa kernels take canonical Views (canonical.hpp)");
  using q_type = QV;
  using k_type = KV;
  using v_type = VV;
  using do_type = DOV;
  using lse_type = LV;
  using d_type = DV;
  using dq_type = DQV;
  using dk_type = DKV;
  using dv_type = DVV;
  using T = typename QV::non_const_value_type;
  using Acc = accumulator_t<T>;
  QV q;
  KV k;
  VV v;
  DOV d_o;
  LV lse;
  DV dd;
  DQV dq;
  DKV dk;
  DVV dv;
  Acc scale;
  Acc softcap;
  KeyMask mask;
};

/// The ForwardArgs of these Views (any spelling; canonicalized here as the API does) and scalars.
template <class QV, class KV, class VV, class OV, class LV, class L = canonical_layout_t<QV, KV, VV, OV>,
          class Args = ForwardArgs<canonical_in_t<L, QV>, canonical_in_t<L, KV>, canonical_in_t<L, VV>,
                                   canonical_out_t<L, OV>, canonical_out_t<canonical_layout_t<LV>, LV>>>
Args forward_args(const QV& q, const KV& k, const VV& v, const OV& o, const LV& lse, typename Args::Acc scale,
                  typename Args::Acc softcap, const KeyMask& mask) {
  return {q, k, v, o, lse, scale, softcap, mask};
}

/// The BackwardArgs of these Views (any spelling; canonicalized here as the API does) and scalars.
template <class QV, class KV, class VV, class DOV, class LV, class DV, class DQV, class DKV, class DVV,
          class L = canonical_layout_t<QV, KV, VV, DOV, DQV, DKV, DVV>,
          class Args =
              BackwardArgs<canonical_in_t<L, QV>, canonical_in_t<L, KV>, canonical_in_t<L, VV>, canonical_in_t<L, DOV>,
                           canonical_in_t<canonical_layout_t<LV>, LV>, canonical_in_t<canonical_layout_t<DV>, DV>,
                           canonical_out_t<L, DQV>, canonical_out_t<L, DKV>, canonical_out_t<L, DVV>>>
Args backward_args(const QV& q, const KV& k, const VV& v, const DOV& d_o, const LV& lse, const DV& dd, const DQV& dq,
                   const DKV& dk, const DVV& dv, typename Args::Acc scale, typename Args::Acc softcap,
                   const KeyMask& mask) {
  return {q, k, v, d_o, lse, dd, dq, dk, dv, scale, softcap, mask};
}

}  // namespace detail
}  // namespace kfa
