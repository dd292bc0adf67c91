#pragma once
/// Standard ("materialized") attention: S = scale·Q·Kᵀ and P = softmax(S) are stored for one (batch, head)
/// at a time and the products go through Kokkos Kernels gemm. Same signature and semantics as
/// attention_forward; it is the benchmark baseline and a second oracle, and it needs seq_q·seq_k memory.
#include <kfa/attention.hpp>
#include <kfa/compat.hpp>
#include <kfa/detail/mask.hpp>
#include <kfa/online_softmax.hpp>

namespace kfa {

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
  compat::ScopedRegion region(std::string(fn) + "[materialized," + dtype_name<T>() + ",d" + std::to_string(q.extent(3)) + "]");
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
            "kfa::reference_attention::load_kv", Range2(space, {0, 0}, {nk, d}), KOKKOS_LAMBDA(const int j, const int c) {
              kh(j, c) = static_cast<Acc>(k(b, j, hk, c));
              vh(j, c) = static_cast<Acc>(v(b, j, hk, c));
            });
      if (nk > 0) compat::gemm(space, "N", "T", scale, qh, kh, Acc(0), s);
      Kokkos::parallel_for(
          "kfa::reference_attention::softmax", Kokkos::RangePolicy<ExecSpace>(space, 0, nq), KOKKOS_LAMBDA(const int i) {
            Acc mx = -compat::infinity<Acc>();
            for (int j = 0; j < nk; ++j) {
              Acc x = s(i, j);
              if (softcap > Acc(0)) x = softcap * compat::tanh(x / softcap);
              if (!mask.visible(i, j)) x = -compat::infinity<Acc>();
              s(i, j) = x;
              mx = x > mx ? x : mx;
            }
            Acc sum = 0;
            for (int j = 0; j < nk; ++j) {
              const Acc p = mx == -compat::infinity<Acc>() ? Acc(0) : compat::exp(s(i, j) - mx);
              s(i, j) = p;
              sum += p;
            }
            for (int j = 0; j < nk; ++j) s(i, j) = sum > Acc(0) ? s(i, j) / sum : Acc(0);
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

}  // namespace kfa
