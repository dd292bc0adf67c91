#pragma once
/// Public attention API: exact softmax(scale·q·kᵀ + mask)·v without ever storing the seq_q × seq_k matrix.
#include <kfa/detail/common/checks.hpp>
#include <kfa/detail/instances.hpp>
#include <kfa/options.hpp>
#include <kfa/paths.hpp>
#include <kfa/plan.hpp>
#include <kfa/tiling.hpp>
#include <kfa/types.hpp>

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
