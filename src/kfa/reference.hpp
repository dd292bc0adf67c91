#pragma once
/// Standard ("materialized") attention: S = scale·Q·Kᵀ and P = softmax(S) are stored for one (batch, head)
/// at a time and the products go through Kokkos Kernels gemm. Same signature and semantics as
/// attention_forward; it is the benchmark baseline and a second oracle, and it needs seq_q·seq_k memory.
#include <kfa/config.hpp>
#if !KFA_HAVE_KOKKOS_KERNELS
#error "kfa/reference.hpp needs Kokkos Kernels, and this kfa was configured with KFA_ENABLE_KOKKOS_KERNELS=OFF"
#endif
#include <kfa/compat.hpp>
#include <kfa/detail/common/checks.hpp>     // the argument checks attention_forward/backward make
#include <kfa/detail/common/recompute.hpp>  // zero4
#include <kfa/detail/mask.hpp>
#include <kfa/online_softmax.hpp>
#include <kfa/types.hpp>

#include <KokkosBlas3_gemm.hpp>  // Kokkos Kernels: this is the one kfa header that needs it

#include <string>

namespace kfa {

namespace compat {
/// C = alpha op(A) op(B) + beta C on `space` (KokkosBlas::gemm; kernels_call holds the Kokkos 3.4 quirk).
template <class ExecSpace, class AV, class BV, class CV, class Scalar>
void gemm(const ExecSpace& space, const char* trans_a, const char* trans_b, Scalar alpha, const AV& a, const BV& b,
          Scalar beta, const CV& c) {
  kernels_call(space, [&](const auto&... on) { KokkosBlas::gemm(on..., trans_a, trans_b, alpha, a, b, beta, c); });
}
}  // namespace compat

namespace detail {
/// Applies softcap and mask to row i of a materialized score matrix in place; returns the row maximum
/// (−inf when the row sees no key).
template <class Mat, class Acc>
KOKKOS_INLINE_FUNCTION Acc finish_score_row(const Mat& s, int i, int nk, Acc softcap, const KeyMask& mask) {
  Acc mx = -compat::infinity<Acc>();
  for (int j = 0; j < nk; ++j) {
    Acc x = s(i, j);
    if (softcap > Acc(0)) x = softcap * compat::tanh(x / softcap);
    if (!mask.visible(i, j)) x = -compat::infinity<Acc>();
    s(i, j) = x;
    mx = x > mx ? x : mx;
  }
  return mx;
}
}  // namespace detail

/// Materialized attention forward; shapes and options as attention_forward. Allocates [seq_q, seq_k].
template <class ExecSpace, class QV, class KV, class VV, class OV, class LV>
void reference_attention(const ExecSpace& space, const QV& q, const KV& k, const VV& v, const OV& o, const LV& lse,
                         const AttentionOptions& opts = {}) {
  detail::static_check_forward<ExecSpace, QV, KV, VV, OV, LV>();
  constexpr const char* fn = "kfa::reference_attention";
  detail::check_forward(fn, q, k, v, o, lse, opts);
  using T = typename QV::non_const_value_type;
  using Acc = accumulator_t<T>;
  using Mem = typename ExecSpace::memory_space;
  using Mat = Kokkos::View<Acc**, Kokkos::LayoutRight, Mem>;
  compat::ScopedRegion region(std::string(fn) + "[materialized," + dtype_name<T>() + ",d" +
                              std::to_string(q.extent(3)) + "]");
  const int batch = static_cast<int>(q.extent(0)), nq = static_cast<int>(q.extent(1));
  const int hq = static_cast<int>(q.extent(2)), d = static_cast<int>(q.extent(3));
  const int nk = static_cast<int>(k.extent(1)), group = hq > 0 ? hq / static_cast<int>(k.extent(2)) : 1;
  if (batch == 0 || nq == 0 || hq == 0) return;

  const Acc scale = static_cast<Acc>(detail::resolved_scale<T>(opts, q.extent(3)));
  const Acc softcap = static_cast<Acc>(opts.softcap);
  const detail::KeyMask mask(nq, nk, opts.causal, opts.window_left, opts.window_right);
  Mat qh(Kokkos::view_alloc(space, "kfa::reference_attention::q"), nq, d);
  Mat kh(Kokkos::view_alloc(space, "kfa::reference_attention::k"), nk, d);
  Mat vh(Kokkos::view_alloc(space, "kfa::reference_attention::v"), nk, d);
  Mat s(Kokkos::view_alloc(space, "kfa::reference_attention::s"), nq, nk);
  Mat oh(Kokkos::view_alloc(space, "kfa::reference_attention::o"), nq, d);
  using Range2 = Kokkos::MDRangePolicy<ExecSpace, Kokkos::Rank<2>>;

  for (int b = 0; b < batch; ++b) {
    for (int h = 0; h < hq; ++h) {
      const int hk = h / group;
      Kokkos::parallel_for(
          "kfa::reference_attention::load_q", Range2(space, {0, 0}, {nq, d}),
          KOKKOS_LAMBDA(const int i, const int c) { qh(i, c) = static_cast<Acc>(q(b, i, h, c)); });
      if (nk > 0)
        Kokkos::parallel_for(
            "kfa::reference_attention::load_kv", Range2(space, {0, 0}, {nk, d}),
            KOKKOS_LAMBDA(const int j, const int c) {
              kh(j, c) = static_cast<Acc>(k(b, j, hk, c));
              vh(j, c) = static_cast<Acc>(v(b, j, hk, c));
            });
      if (nk > 0) compat::gemm(space, "N", "T", scale, qh, kh, Acc(0), s);
      Kokkos::parallel_for(
          "kfa::reference_attention::softmax", Kokkos::RangePolicy<ExecSpace>(space, 0, nq),
          KOKKOS_LAMBDA(const int i) {
            const Acc mx = detail::finish_score_row(s, i, nk, softcap, mask);
            Acc sum = 0;
            for (int j = 0; j < nk; ++j) {
              const Acc p = mx == -compat::infinity<Acc>() ? Acc(0) : compat::exp(s(i, j) - mx);
              s(i, j) = p;
              sum += p;
            }
            for (int j = 0; j < nk; ++j) s(i, j) = sum == Acc(0) ? Acc(0) : s(i, j) / sum;
            lse(b, h, i) = SoftmaxState<Acc>{mx, sum}.lse();
          });
      if (nk > 0) {
        compat::gemm(space, "N", "N", Acc(1), s, vh, Acc(0), oh);
      } else {
        Kokkos::deep_copy(space, oh, Acc(0));
      }
      Kokkos::parallel_for(
          "kfa::reference_attention::store_o", Range2(space, {0, 0}, {nq, d}),
          KOKKOS_LAMBDA(const int i, const int c) { o(b, i, h, c) = static_cast<T>(oh(i, c)); });
    }
  }
}

/// Materialized attention backward: S, P = softmax(S) and dP = dO·Vᵀ are stored ([seq_q, seq_k] each, one
/// (batch, head) at a time), dS = P ∘ (dP − rowsum(P ∘ dP)), and the four products go through Kokkos
/// Kernels gemm. Shapes and options as attention_backward; o and lse are accepted for the same signature
/// but not needed (P is recomputed from scratch, as autograd of the materialized forward would).
template <class ExecSpace, class QV, class KV, class VV, class OV, class DOV, class LV, class DQV, class DKV, class DVV>
void reference_attention_backward(const ExecSpace& space, const QV& q, const KV& k, const VV& v, const OV& o,
                                  const DOV& d_o, const LV& lse, const DQV& dq, const DKV& dk, const DVV& dv,
                                  const AttentionOptions& opts = {}) {
  detail::static_check_backward<ExecSpace, QV, KV, VV, OV, DOV, LV, DQV, DKV, DVV>();
  constexpr const char* fn = "kfa::reference_attention_backward";
  detail::check_backward(fn, q, k, v, o, d_o, lse, dq, dk, dv, opts);
  using T = typename QV::non_const_value_type;
  using Acc = accumulator_t<T>;
  using Mem = typename ExecSpace::memory_space;
  using Mat = Kokkos::View<Acc**, Kokkos::LayoutRight, Mem>;
  compat::ScopedRegion region(std::string(fn) + "[materialized," + dtype_name<T>() + ",d" +
                              std::to_string(q.extent(3)) + "]");
  const int batch = static_cast<int>(q.extent(0)), nq = static_cast<int>(q.extent(1));
  const int hq = static_cast<int>(q.extent(2)), d = static_cast<int>(q.extent(3));
  const int nk = static_cast<int>(k.extent(1)), hkv = static_cast<int>(k.extent(2));
  if (batch == 0) return;
  if (hq == 0 || nq == 0 || nk == 0) {  // nothing attends: all gradients are zero
    detail::zero4(space, dq, "kfa::reference_attention_backward::zero_dq");
    detail::zero4(space, dk, "kfa::reference_attention_backward::zero_dk");
    detail::zero4(space, dv, "kfa::reference_attention_backward::zero_dv");
    return;
  }
  const int group = hq / hkv;
  const Acc scale = static_cast<Acc>(detail::resolved_scale<T>(opts, q.extent(3)));
  const Acc softcap = static_cast<Acc>(opts.softcap);
  const detail::KeyMask mask(nq, nk, opts.causal, opts.window_left, opts.window_right);
  auto alloc = [&](const std::string& label, int r, int c) { return Mat(Kokkos::view_alloc(space, label), r, c); };
  Mat qh = alloc("kfa::reference_attention_backward::q", nq, d),
      doh = alloc("kfa::reference_attention_backward::do", nq, d);
  Mat kh = alloc("kfa::reference_attention_backward::k", nk, d),
      vh = alloc("kfa::reference_attention_backward::v", nk, d);
  Mat s = alloc("kfa::reference_attention_backward::s", nq, nk),
      p = alloc("kfa::reference_attention_backward::p", nq, nk);
  Mat dp = alloc("kfa::reference_attention_backward::dp", nq, nk);
  Mat dqh = alloc("kfa::reference_attention_backward::dq", nq, d);
  Mat dkh = alloc("kfa::reference_attention_backward::dk", nk, d),
      dvh = alloc("kfa::reference_attention_backward::dv", nk, d);
  using Range2 = Kokkos::MDRangePolicy<ExecSpace, Kokkos::Rank<2>>;

  for (int b = 0; b < batch; ++b)
    for (int hk = 0; hk < hkv; ++hk) {
      Kokkos::parallel_for(
          "kfa::reference_attention_backward::load_kv", Range2(space, {0, 0}, {nk, d}),
          KOKKOS_LAMBDA(const int j, const int c) {
            kh(j, c) = static_cast<Acc>(k(b, j, hk, c));
            vh(j, c) = static_cast<Acc>(v(b, j, hk, c));
          });
      for (int g = 0; g < group; ++g) {  // dK, dV of the shared KV head summed over its query heads in order
        const int h = hk * group + g;
        Kokkos::parallel_for(
            "kfa::reference_attention_backward::load_q", Range2(space, {0, 0}, {nq, d}),
            KOKKOS_LAMBDA(const int i, const int c) {
              qh(i, c) = static_cast<Acc>(q(b, i, h, c));
              doh(i, c) = static_cast<Acc>(d_o(b, i, h, c));
            });
        compat::gemm(space, "N", "T", scale, qh, kh, Acc(0), s);
        compat::gemm(space, "N", "T", Acc(1), doh, vh, Acc(0), dp);
        Kokkos::parallel_for(
            "kfa::reference_attention_backward::softmax", Kokkos::RangePolicy<ExecSpace>(space, 0, nq),
            KOKKOS_LAMBDA(const int i) {
              const Acc mx = detail::finish_score_row(s, i, nk, softcap, mask);
              Acc sum = 0;
              for (int j = 0; j < nk; ++j) {
                p(i, j) = mx == -compat::infinity<Acc>() ? Acc(0) : compat::exp(s(i, j) - mx);
                sum += p(i, j);
              }
              Acc pdp = 0;
              for (int j = 0; j < nk; ++j) {
                p(i, j) = sum == Acc(0) ? Acc(0) : p(i, j) / sum;
                pdp += p(i, j) * dp(i, j);
              }
              for (int j = 0; j < nk; ++j) {
                const Acc t = softcap > Acc(0) ? s(i, j) / softcap : Acc(0);
                const Acc deriv = (softcap > Acc(0) && p(i, j) != Acc(0)) ? Acc(1) - t * t : Acc(1);
                dp(i, j) = p(i, j) * (dp(i, j) - pdp) * deriv;  // dS, w.r.t. the uncapped scaled score
              }
            });
        compat::gemm(space, "T", "N", Acc(1), p, doh, g == 0 ? Acc(0) : Acc(1), dvh);
        compat::gemm(space, "N", "N", scale, dp, kh, Acc(0), dqh);
        compat::gemm(space, "T", "N", scale, dp, qh, g == 0 ? Acc(0) : Acc(1), dkh);
        Kokkos::parallel_for(
            "kfa::reference_attention_backward::store_dq", Range2(space, {0, 0}, {nq, d}),
            KOKKOS_LAMBDA(const int i, const int c) { dq(b, i, h, c) = static_cast<T>(dqh(i, c)); });
      }
      Kokkos::parallel_for(
          "kfa::reference_attention_backward::store_dkdv", Range2(space, {0, 0}, {nk, d}),
          KOKKOS_LAMBDA(const int j, const int c) {
            dk(b, j, hk, c) = static_cast<T>(dkh(j, c));
            dv(b, j, hk, c) = static_cast<T>(dvh(j, c));
          });
    }
}

}  // namespace kfa
