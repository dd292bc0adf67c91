#pragma once
/// Public attention API: exact softmax(scale·q·kᵀ + mask)·v without ever storing the seq_q × seq_k matrix.
#include <kfa/detail/common/checks.hpp>
#include <kfa/detail/common/packed.hpp>
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
/// D = rowsum(dO ∘ O) [batch, heads_q, seq_q]. With opts.deterministic = false the tensor-core family may
/// accumulate dq in any order (where faster; see AttentionOptions::deterministic). Asynchronous on `space`.
template <class ExecSpace, class QV, class KV, class VV, class OV, class DOV, class LV, class DQV, class DKV, class DVV>
void attention_backward(const ExecSpace& space, const QV& q, const KV& k, const VV& v, const OV& o, const DOV& d_o,
                        const LV& lse, const DQV& dq, const DKV& dk, const DVV& dv, const AttentionOptions& opts = {}) {
  detail::static_check_backward<ExecSpace, QV, KV, VV, OV, DOV, LV, DQV, DKV, DVV>();
  constexpr const char* fn = "kfa::attention_backward";
  detail::check_backward(fn, q, k, v, o, d_o, lse, dq, dk, dv, opts);
  detail::backward_impl(fn, space, q, k, v, o, d_o, lse, dq, dk, dv, opts, detail::Positions{});
}

// ---- Variable-length batches: packed sequences with FlashAttention's cu_seqlens ----

/// Which kernel family attention_forward_varlen(space, q, k, v, o, lse, ...) runs (the one the fixed-length
/// call on the packed tensors as one sequence runs), with its tiles and profiling region.
template <class ExecSpace, class QV, class KV, class VV, class OV>
ForwardPlan plan_forward_varlen(const ExecSpace& space, const QV& q, const KV& k, const VV& v, const OV& o,
                                const AttentionOptions& opts = {}) {
  constexpr const char* fn = "kfa::attention_forward_varlen";
  detail::check_packed_qkv(fn, q, k, v);
  detail::check_packed_like(fn, "o", o, "q", q);
  const auto q4 = detail::with_batch_of_one(q);
  detail::check_qkv_and_options(fn, q4, detail::with_batch_of_one(k), detail::with_batch_of_one(v), opts);
  return detail::forward_plan(
      fn, detail::forward_call(fn, space, q4, detail::with_batch_of_one(k), detail::with_batch_of_one(v),
                               detail::with_batch_of_one(o), opts));
}

/// Exact attention forward over a batch of sequences of different lengths, packed without padding (as
/// FlashAttention's flash_attn_varlen_func). Sequence s holds queries [cu_seqlens_q(s), cu_seqlens_q(s+1)) of
/// q [total_q, heads_q, d] and keys [cu_seqlens_k(s), cu_seqlens_k(s+1)) of k, v [total_k, heads_kv, d]; it
/// attends to its own keys only, with every option of attention_forward applied per sequence (causal is
/// bottom-right aligned in each sequence whose query and key lengths differ). o like q (output); lse
/// [heads_q, total_q] (output). cu_seqlens_*: int32 prefix sums, batch + 1 entries starting at 0, in memory
/// `space` reads, contiguous; sequences may be empty. max_seqlen_*: at least the longest sequence's length.
/// The arguments are checked before any kernel runs (cu_seqlens with one small copy to the host); then
/// asynchronous on `space`, and every View, cu_seqlens included, must live until the kernels finish.
template <class ExecSpace, class QV, class KV, class VV, class OV, class LV, class CQ, class CK>
void attention_forward_varlen(const ExecSpace& space, const QV& q, const KV& k, const VV& v, const OV& o, const LV& lse,
                              const CQ& cu_seqlens_q, const CK& cu_seqlens_k, long max_seqlen_q, long max_seqlen_k,
                              const AttentionOptions& opts = {}) {
  constexpr const char* fn = "kfa::attention_forward_varlen";
  detail::static_check_cu_seqlens<ExecSpace, CQ>();
  detail::static_check_cu_seqlens<ExecSpace, CK>();
  detail::check_packed_qkv(fn, q, k, v);
  detail::check_packed_like(fn, "o", o, "q", q);
  detail::check_packed_lse(fn, lse, q);
  const auto q4 = detail::with_batch_of_one(q);
  const auto k4 = detail::with_batch_of_one(k);
  const auto v4 = detail::with_batch_of_one(v);
  const auto o4 = detail::with_batch_of_one(o);
  const auto lse3 = detail::with_batch_of_one(lse);
  detail::static_check_forward<ExecSpace, decltype(q4), decltype(k4), decltype(v4), decltype(o4), decltype(lse3)>();
  detail::check_forward(fn, q4, k4, v4, o4, lse3, opts);
  detail::Positions pos;
  pos.docs =
      detail::check_cu_seqlens(fn, cu_seqlens_q, cu_seqlens_k, q.extent(0), k.extent(0), max_seqlen_q, max_seqlen_k);
  detail::forward_impl(fn, space, q4, k4, v4, o4, lse3, opts, pos);
}

/// Which kernel family attention_backward_varlen runs, with its tiles and profiling region.
template <class ExecSpace, class QV, class KV, class VV, class DOV, class DQV, class DKV, class DVV>
BackwardPlan plan_backward_varlen(const ExecSpace& space, const QV& q, const KV& k, const VV& v, const DOV& d_o,
                                  const DQV& dq, const DKV& dk, const DVV& dv, const AttentionOptions& opts = {}) {
  constexpr const char* fn = "kfa::attention_backward_varlen";
  detail::check_packed_qkv(fn, q, k, v);
  detail::check_packed_like(fn, "d_o", d_o, "q", q);
  detail::check_packed_like(fn, "dq", dq, "q", q);
  detail::check_packed_like(fn, "dk", dk, "k", k);
  detail::check_packed_like(fn, "dv", dv, "k", k);
  using detail::with_batch_of_one;
  detail::check_qkv_and_options(fn, with_batch_of_one(q), with_batch_of_one(k), with_batch_of_one(v), opts);
  return detail::backward_plan(
      fn, detail::backward_call(fn, space, with_batch_of_one(q), with_batch_of_one(k), with_batch_of_one(v),
                                with_batch_of_one(d_o), with_batch_of_one(dq), with_batch_of_one(dk),
                                with_batch_of_one(dv), opts));
}

/// Exact attention backward of attention_forward_varlen (same packing, cu_seqlens, lengths and options):
/// dq like q, dk and dv like k (outputs, overwritten) from q, k, v, that forward's o and lse, and d_o (like q).
/// Deterministic by default, as attention_backward. Checked first, then asynchronous on `space`.
template <class ExecSpace, class QV, class KV, class VV, class OV, class DOV, class LV, class DQV, class DKV, class DVV,
          class CQ, class CK>
void attention_backward_varlen(const ExecSpace& space, const QV& q, const KV& k, const VV& v, const OV& o,
                               const DOV& d_o, const LV& lse, const DQV& dq, const DKV& dk, const DVV& dv,
                               const CQ& cu_seqlens_q, const CK& cu_seqlens_k, long max_seqlen_q, long max_seqlen_k,
                               const AttentionOptions& opts = {}) {
  constexpr const char* fn = "kfa::attention_backward_varlen";
  detail::static_check_cu_seqlens<ExecSpace, CQ>();
  detail::static_check_cu_seqlens<ExecSpace, CK>();
  detail::check_packed_qkv(fn, q, k, v);
  detail::check_packed_like(fn, "o", o, "q", q);
  detail::check_packed_like(fn, "d_o", d_o, "q", q);
  detail::check_packed_lse(fn, lse, q);
  detail::check_packed_like(fn, "dq", dq, "q", q);
  detail::check_packed_like(fn, "dk", dk, "k", k);
  detail::check_packed_like(fn, "dv", dv, "k", k);
  using detail::with_batch_of_one;
  const auto q4 = with_batch_of_one(q), k4 = with_batch_of_one(k), v4 = with_batch_of_one(v);
  const auto o4 = with_batch_of_one(o), do4 = with_batch_of_one(d_o);
  const auto dq4 = with_batch_of_one(dq), dk4 = with_batch_of_one(dk), dv4 = with_batch_of_one(dv);
  const auto lse3 = with_batch_of_one(lse);
  detail::static_check_backward<ExecSpace, decltype(q4), decltype(k4), decltype(v4), decltype(o4), decltype(do4),
                                decltype(lse3), decltype(dq4), decltype(dk4), decltype(dv4)>();
  detail::check_backward(fn, q4, k4, v4, o4, do4, lse3, dq4, dk4, dv4, opts);
  detail::Positions pos;
  pos.docs =
      detail::check_cu_seqlens(fn, cu_seqlens_q, cu_seqlens_k, q.extent(0), k.extent(0), max_seqlen_q, max_seqlen_k);
  detail::backward_impl(fn, space, q4, k4, v4, o4, do4, lse3, dq4, dk4, dv4, opts, pos);
}

}  // namespace kfa
