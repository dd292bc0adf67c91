#pragma once
/// Public attention API: exact softmax(scale·q·kᵀ + mask)·v without ever storing the seq_q × seq_k matrix.
#include <kfa/detail/common/canonical.hpp>
#include <kfa/detail/common/checks.hpp>
#include <kfa/detail/common/kernel_args.hpp>
#include <kfa/detail/common/ranges.hpp>
#include <kfa/detail/dispatch.hpp>
#include <kfa/options.hpp>
#include <kfa/paths.hpp>
#include <kfa/plan.hpp>
#include <kfa/tiling.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>

namespace kfa {

/// Tiles the portable forward kernel would use for these inputs on `space` (see TileConfig). The CUDA
/// kernels (tensor-core half/bfloat16, fp32 SIMT) have fixed tiles per head dim, named in the profiling
/// region of each call and in README.md.
template <class ExecSpace, class QV, class KV>
TileConfig forward_tile_config(const ExecSpace& space, const QV& q, const KV& k, const AttentionOptions& opts = {}) {
  using Acc = accumulator_t<typename QV::non_const_value_type>;
  return forward_tile_config<ExecSpace, Acc>(space, static_cast<int>(q.extent(3)), static_cast<long>(q.extent(1)),
                                             static_cast<long>(k.extent(1)),
                                             static_cast<long>(q.extent(0) * q.extent(2)), opts);
}

namespace detail {
/// What a forward family looks at to decide whether it can run a call, size its tiles and launch it.
template <class ExecSpace, class QV, class KV, class VV, class OV>
struct ForwardCall {
  using exec_space = ExecSpace;
  using q_type = QV;
  using k_type = KV;
  using v_type = VV;
  using o_type = OV;
  using T = typename QV::non_const_value_type;
  const char* fn;  ///< the API function the call came through (its errors name it)
  const ExecSpace& space;
  QV q;  // canonical (unmanaged) Views, held by value: see forward_call
  KV k;
  VV v;
  OV o;
  const AttentionOptions& opts;
  int d;
  long seq_k;
  std::string views_why;  ///< why the tensor-core kernels cannot read or write these views ("" when they can)
  ForwardCall(const char* f, const ExecSpace& s, const QV& q_, const KV& k_, const VV& v_, const OV& o_,
              const AttentionOptions& op)
      : fn(f),
        space(s),
        q(q_),
        k(k_),
        v(v_),
        o(o_),
        opts(op),
        d(static_cast<int>(q_.extent(3))),
        seq_k(static_cast<long>(k_.extent(1))) {
    tc_add_forward_view_problems(views_why, q, k, v, o);
  }
  /// The tensor-core families' common problem: the space and element type, the head dim, the views.
  std::string tc_problem(bool fa2_head_dims) const {
    std::string why = tc_space_problem<ExecSpace, T>(space, d, fa2_head_dims);
    return why.empty() ? views_why : why;
  }
};

/// The ForwardCall of these arguments on their canonical Views (canonical.hpp): every kernel family, its
/// checks and its launch are instantiated for those types only.
template <class ExecSpace, class QV, class KV, class VV, class OV, class L = canonical_layout_t<QV, KV, VV, OV>>
ForwardCall<ExecSpace, canonical_in_t<L, QV>, canonical_in_t<L, KV>, canonical_in_t<L, VV>, canonical_out_t<L, OV>>
forward_call(const char* fn, const ExecSpace& space, const QV& q, const KV& k, const VV& v, const OV& o,
             const AttentionOptions& opts) {
  return {fn, space, q, k, v, o, opts};
}

template <class Call>
ForwardPlan forward_plan(const char* fn, const Call& c) {
  using T = typename Call::T;
  ForwardPlan plan;
  plan.family = choose_family<ForwardFamilies>(fn, c, c.opts.path, c.opts.path);
  with_family<ForwardFamilies>(plan.family, [&](auto family) { plan.tiles = decltype(family)::tiles(c); });
  plan.region = std::string(fn) + "[" + to_string(plan.family) + "," + dtype_name<T>() + ",d" + std::to_string(c.d) +
                "," + to_string(plan.tiles) + "]";
  return plan;
}

/// forward_impl on canonical Views (c from forward_call; lse canonical too).
template <class Call, class LV>
void forward_run(const Call& c, const LV& lse, const Positions& pos) {
  using T = typename Call::T;
  const ForwardPlan plan = forward_plan(c.fn, c);
  compat::ScopedRegion region(plan.region);
  const auto& q = c.q;
  if (q.extent(0) == 0 || q.extent(1) == 0 || q.extent(2) == 0) return;
  using Acc = accumulator_t<T>;
  const Acc scale = static_cast<Acc>(resolved_scale<T>(c.opts, q.extent(3)));
  const KeyMask mask(static_cast<long>(q.extent(1)), static_cast<long>(c.k.extent(1)), pos, c.opts.causal,
                     c.opts.window_left, c.opts.window_right);
  const auto args = forward_args(c.q, c.k, c.v, c.o, lse, scale, static_cast<Acc>(c.opts.softcap), mask);
  with_family<ForwardFamilies>(plan.family, [&](auto family) { decltype(family)::launch(c, args, plan.tiles); });
}

/// attention_forward after its checks, for a block at `pos` of a longer sequence (the ring layer's entry).
template <class ExecSpace, class QV, class KV, class VV, class OV, class LV>
void forward_impl(const char* fn, const ExecSpace& space, const QV& q, const KV& k, const VV& v, const OV& o,
                  const LV& lse, const AttentionOptions& opts, const Positions& pos) {
  forward_run(forward_call(fn, space, q, k, v, o, opts), canonical_out_t<canonical_layout_t<LV>, LV>(lse), pos);
}
}  // namespace detail

/// Which kernel family attention_forward(space, q, k, v, o, lse, opts) runs, with its tiles and profiling
/// region; throws the kfa::Error the call would throw when opts.path names a family that cannot run.
template <class ExecSpace, class QV, class KV, class VV, class OV>
ForwardPlan plan_forward(const ExecSpace& space, const QV& q, const KV& k, const VV& v, const OV& o,
                         const AttentionOptions& opts = {}) {
  constexpr const char* fn = "kfa::attention_forward";
  detail::check_qkv_and_options(fn, q, k, v, opts);
  detail::check_extents(fn, "o", o, {q.extent(0), q.extent(1), q.extent(2), q.extent(3)});
  return detail::forward_plan(fn, detail::forward_call(fn, space, q, k, v, o, opts));
}

/// Exact attention forward. q [batch, seq_q, heads_q, d]; k, v [batch, seq_k, heads_kv, d];
/// o [batch, seq_q, heads_q, d] (output); lse [batch, heads_q, seq_q] (output, natural-log log-sum-exp of
/// the scaled, softcapped, masked scores; −inf for a row that sees no key, whose o row is 0).
/// heads_q must be a multiple of heads_kv (GQA/MQA). Asynchronous on `space`, like any Kokkos kernel.
template <class ExecSpace, class QV, class KV, class VV, class OV, class LV>
void attention_forward(const ExecSpace& space, const QV& q, const KV& k, const VV& v, const OV& o, const LV& lse,
                       const AttentionOptions& opts = {}) {
  detail::static_check_forward<ExecSpace, QV, KV, VV, OV, LV>();
  constexpr const char* fn = "kfa::attention_forward";
  detail::check_forward(fn, q, k, v, o, lse, opts);
  detail::forward_impl(fn, space, q, k, v, o, lse, opts, detail::Positions{});
}

/// Tiles the portable backward kernels would use for these inputs on `space` (see BackwardTileConfig);
/// the tensor-core kernels' fixed tiles are named in their profiling region.
template <class ExecSpace, class QV, class KV>
BackwardTileConfig backward_tile_config(const ExecSpace& space, const QV& q, const KV& k,
                                        const AttentionOptions& opts = {}) {
  using Acc = accumulator_t<typename QV::non_const_value_type>;
  return backward_tile_config<ExecSpace, Acc>(
      space, static_cast<int>(q.extent(3)), static_cast<long>(q.extent(1)), static_cast<long>(k.extent(1)),
      static_cast<long>(q.extent(0) * q.extent(2)), static_cast<long>(k.extent(0) * k.extent(2)), opts);
}

namespace detail {
/// D[b, h, i] = Σ_c dO ∘ O over the rows of o, in the accumulation type (the backward's row term).
template <class ExecSpace, class OV, class DOV>
Kokkos::View<accumulator_t<typename OV::non_const_value_type>***, Kokkos::LayoutRight, typename ExecSpace::memory_space>
backward_row_dot(const ExecSpace& space, const OV& o, const DOV& d_o) {
  using Acc = accumulator_t<typename OV::non_const_value_type>;
  const int batch = static_cast<int>(o.extent(0)), nq = static_cast<int>(o.extent(1)),
            hq = static_cast<int>(o.extent(2));
  Kokkos::View<Acc***, Kokkos::LayoutRight, typename ExecSpace::memory_space> dd(
      Kokkos::view_alloc(space, Kokkos::WithoutInitializing, "kfa::attention_backward::D"), batch, hq, nq);
  // One warp per row on a GPU: coalesced reads of each row (one thread per row would read d elements apart
  // from its neighbours').
  for_each_row_sum4<Acc>(
      "kfa::attention_backward::D", space, o,
      KOKKOS_LAMBDA(const std::int64_t b, const std::int64_t i, const std::int64_t h, const std::int64_t c) {
        return static_cast<Acc>(d_o(b, i, h, c)) * static_cast<Acc>(o(b, i, h, c));
      },
      KOKKOS_LAMBDA(const std::int64_t b, const std::int64_t i, const std::int64_t h, const Acc s) {
        dd(b, h, i) = s;
      });
  return dd;
}

/// What a backward family looks at to decide whether it can run a call, size its tiles and launch it.
template <class ExecSpace, class QV, class KV, class VV, class DOV, class DQV, class DKV, class DVV>
struct BackwardCall {
  using exec_space = ExecSpace;
  using q_type = QV;
  using k_type = KV;
  using v_type = VV;
  using do_type = DOV;
  using dq_type = DQV;
  using dk_type = DKV;
  using dv_type = DVV;
  using T = typename QV::non_const_value_type;
  const char* fn;  ///< the API function the call came through (its errors name it)
  const ExecSpace& space;
  QV q;  // canonical (unmanaged) Views, held by value: see backward_call
  KV k;
  VV v;
  DOV d_o;
  DQV dq;
  DKV dk;
  DVV dv;
  const AttentionOptions& opts;
  int d;
  BackwardCall(const char* f, const ExecSpace& s, const QV& q_, const KV& k_, const VV& v_, const DOV& do_,
               const DQV& dq_, const DKV& dk_, const DVV& dv_, const AttentionOptions& op)
      : fn(f),
        space(s),
        q(q_),
        k(k_),
        v(v_),
        d_o(do_),
        dq(dq_),
        dk(dk_),
        dv(dv_),
        opts(op),
        d(static_cast<int>(q_.extent(3))) {}
};

/// The BackwardCall of these arguments on their canonical Views (canonical.hpp), as forward_call.
template <class ExecSpace, class QV, class KV, class VV, class DOV, class DQV, class DKV, class DVV,
          class L = canonical_layout_t<QV, KV, VV, DOV, DQV, DKV, DVV>>
BackwardCall<ExecSpace, canonical_in_t<L, QV>, canonical_in_t<L, KV>, canonical_in_t<L, VV>, canonical_in_t<L, DOV>,
             canonical_out_t<L, DQV>, canonical_out_t<L, DKV>, canonical_out_t<L, DVV>>
backward_call(const char* fn, const ExecSpace& space, const QV& q, const KV& k, const VV& v, const DOV& d_o,
              const DQV& dq, const DKV& dk, const DVV& dv, const AttentionOptions& opts) {
  return {fn, space, q, k, v, d_o, dq, dk, dv, opts};
}

/// The backward's plan: one tensor-core family serves every 16-bit forward family (opts.path tensor_core_team,
/// tensor_core_fa2 and tensor_core_wgmma name it; its kernels are the wgmma ones where those can run, except
/// when opts.path names tensor_core_fa2 or tensor_core_team), then tensor_core_tf32x3, simt_fp32, portable.
template <class Call>
BackwardPlan backward_plan(const char* fn, const Call& c) {
  using P = TileProductPath;
  const P shown = c.opts.path;
  const bool names_tc_backward =
      shown == P::tensor_core_team || shown == P::tensor_core_fa2 || shown == P::tensor_core_wgmma;
  const P asked = names_tc_backward ? P::tensor_core : shown;
  BackwardPlan plan;
  plan.family = choose_family<BackwardFamilies>(fn, c, asked, shown);
  with_family<BackwardFamilies>(plan.family, [&](auto family) { decltype(family)::plan(c, plan); });
  plan.region = std::string(fn) + "[" + to_string(plan.family) +
                (plan.atomic_dq ? ",atomic_dq,"
                 : plan.wgmma   ? ",wgmma,"
                                : ",") +
                dtype_name<typename Call::T>() + ",d" + std::to_string(c.d) + "," + to_string(plan.tiles) + "]";
  return plan;
}

/// backward_impl_d on canonical Views (c from backward_call; lse and dd canonical too).
template <class Call, class LV, class DD>
bool backward_run(const Call& c, const LV& lse, const DD& dd, const Positions& pos, BackwardParts parts) {
  using T = typename Call::T;
  const BackwardPlan plan = backward_plan(c.fn, c);
  compat::ScopedRegion region(plan.region);
  const bool dq_with_dkdv = plan.family == TileProductPath::tensor_core && plan.atomic_dq;
  const bool wrote_dq = parts == BackwardParts::all || (parts == BackwardParts::dkdv) == dq_with_dkdv;
  const auto& opts = c.opts;
  const int batch = static_cast<int>(c.q.extent(0)), nq = static_cast<int>(c.q.extent(1));
  const int hq = static_cast<int>(c.q.extent(2)), nk = static_cast<int>(c.k.extent(1));
  if (batch == 0) return wrote_dq;
  if (hq == 0) {  // no query head uses k and v: their gradients are zero
    if (parts == BackwardParts::dq) return wrote_dq;
    zero4(c.space, c.dk, "kfa::attention_backward::zero_dk");
    zero4(c.space, c.dv, "kfa::attention_backward::zero_dv");
    return wrote_dq;
  }
  using Acc = accumulator_t<T>;
  const Acc scale = static_cast<Acc>(resolved_scale<T>(opts, c.q.extent(3)));
  const KeyMask mask(nq, nk, pos, opts.causal, opts.window_left, opts.window_right);
  const auto args =
      backward_args(c.q, c.k, c.v, c.d_o, lse, dd, c.dq, c.dk, c.dv, scale, static_cast<Acc>(opts.softcap), mask);
  with_family<BackwardFamilies>(plan.family, [&](auto family) { decltype(family)::launch(c, args, plan, parts); });
  return wrote_dq;
}

/// backward_impl with D = rowsum(dO ∘ O) given (`dd` [batch, heads_q, seq_q] of these query rows): the ring
/// computes D once for a rank's whole shard instead of once per block. `parts` picks the kernels (see
/// BackwardParts); returns whether this call wrote dq.
template <class ExecSpace, class QV, class KV, class VV, class DOV, class LV, class DD, class DQV, class DKV, class DVV>
bool backward_impl_d(const char* fn, const ExecSpace& space, const QV& q, const KV& k, const VV& v, const DOV& d_o,
                     const LV& lse, const DD& dd, const DQV& dq, const DKV& dk, const DVV& dv,
                     const AttentionOptions& opts, const Positions& pos, BackwardParts parts = BackwardParts::all) {
  return backward_run(backward_call(fn, space, q, k, v, d_o, dq, dk, dv, opts),
                      canonical_in_t<canonical_layout_t<LV>, LV>(lse), canonical_in_t<canonical_layout_t<DD>, DD>(dd),
                      pos, parts);
}

/// attention_backward after its checks, for a block at `pos` of a longer sequence (lse and o of the whole
/// rows, so P and D are exact): overwrites dq, dk, dv with this block's contributions.
template <class ExecSpace, class QV, class KV, class VV, class OV, class DOV, class LV, class DQV, class DKV, class DVV>
void backward_impl(const char* fn, const ExecSpace& space, const QV& q, const KV& k, const VV& v, const OV& o,
                   const DOV& d_o, const LV& lse, const DQV& dq, const DKV& dk, const DVV& dv,
                   const AttentionOptions& opts, const Positions& pos) {
  using L = canonical_layout_t<OV, DOV>;
  const auto dd = backward_row_dot(space, canonical_in_t<L, OV>(o), canonical_in_t<L, DOV>(d_o));
  backward_impl_d(fn, space, q, k, v, d_o, lse, dd, dq, dk, dv, opts, pos);
}

}  // namespace detail

/// Which kernel family attention_backward(space, q, k, v, o, d_o, lse, dq, dk, dv, opts) runs, with its
/// tiles and profiling region; throws the kfa::Error the call would throw when opts.path cannot be honoured.
template <class ExecSpace, class QV, class KV, class VV, class DOV, class DQV, class DKV, class DVV>
BackwardPlan plan_backward(const ExecSpace& space, const QV& q, const KV& k, const VV& v, const DOV& d_o, const DQV& dq,
                           const DKV& dk, const DVV& dv, const AttentionOptions& opts = {}) {
  constexpr const char* fn = "kfa::attention_backward";
  detail::check_qkv_and_options(fn, q, k, v, opts);
  detail::check_extents(fn, "d_o", d_o, {q.extent(0), q.extent(1), q.extent(2), q.extent(3)});
  detail::check_extents(fn, "dq", dq, {q.extent(0), q.extent(1), q.extent(2), q.extent(3)});
  detail::check_extents(fn, "dk", dk, {k.extent(0), k.extent(1), k.extent(2), k.extent(3)});
  detail::check_extents(fn, "dv", dv, {k.extent(0), k.extent(1), k.extent(2), k.extent(3)});
  return detail::backward_plan(fn, detail::backward_call(fn, space, q, k, v, d_o, dq, dk, dv, opts));
}

/// Exact attention backward by recomputation: dq [batch, seq_q, heads_q, d], dk and dv
/// [batch, seq_k, heads_kv, d] (outputs, overwritten) from q, k, v, the forward's o and lse, and d_o
/// (like q). Same options as the forward call that produced o and lse. Deterministic by default: no
/// atomics; dK and dV of a shared KV head are summed over its query heads in a fixed order; allocates only
/// D = rowsum(dO ∘ O) [batch, heads_q, seq_q]. With opts.deterministic = false the tensor-core family
/// accumulates dq with atomics (faster; see AttentionOptions::deterministic). Asynchronous on `space`.
template <class ExecSpace, class QV, class KV, class VV, class OV, class DOV, class LV, class DQV, class DKV, class DVV>
void attention_backward(const ExecSpace& space, const QV& q, const KV& k, const VV& v, const OV& o, const DOV& d_o,
                        const LV& lse, const DQV& dq, const DKV& dk, const DVV& dv, const AttentionOptions& opts = {}) {
  detail::static_check_backward<ExecSpace, QV, KV, VV, OV, DOV, LV, DQV, DKV, DVV>();
  constexpr const char* fn = "kfa::attention_backward";
  detail::check_backward(fn, q, k, v, o, d_o, lse, dq, dk, dv, opts);
  detail::backward_impl(fn, space, q, k, v, o, d_o, lse, dq, dk, dv, opts, detail::Positions{});
}

}  // namespace kfa
