#pragma once
/// kfa::dist ring attention over packed variable-length sequences: the packed token stream of
/// attention_forward_varlen sharded over the ranks as kfa::dist::document_shard cuts it in ring.layout()
/// (contiguous runs of the stream, or every document in 2P zigzag chunks), cu_seqlens over the whole stream
/// on every rank. The ring runs as for one sequence; each block carries its documents
/// (kfa::detail::Positions::docs, with where each document's pieces lie for the zigzag), so no query sees a
/// key of another sequence and every mask applies per sequence, and blocks in which no sequence has both
/// queries and keys are skipped.
#include <kfa/attention.hpp>
#include <kfa/detail/common/packed.hpp>
#include <kfa/distributed/ring/backward.hpp>
#include <kfa/distributed/ring/forward.hpp>
#include <kfa/distributed/ring/steps.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace kfa {
namespace dist {
namespace detail {

/// Checks cu_seqlens on every rank against the shard map's totals and the longest lengths, agrees that they
/// are the same everywhere, and returns them for the ring; `map` (of the ranks' lengths) becomes the map over
/// the documents (document_shard) that the ranks' shards must fit. Collective.
template <class CQ, class CK>
RingDocuments agree_on_documents(const Ring& ring, const char* fn, ShardMap& map, const CQ& cu_q, const CK& cu_k,
                                 long max_seqlen_q, long max_seqlen_k) {
  RingDocuments docs;
  collective_check(ring, fn, [&] {
    docs.device = kfa::detail::check_cu_seqlens(fn, cu_q, cu_k, static_cast<std::size_t>(map.q_total()),
                                                static_cast<std::size_t>(map.k_total()), max_seqlen_q, max_seqlen_k,
                                                "the ranks' q shards", "the ranks' k shards");
  });
  const auto hq = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), cu_q);
  const auto hk = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), cu_k);
  docs.cu_q.assign(hq.data(), hq.data() + hq.extent(0));
  docs.cu_k.assign(hk.data(), hk.data() + hk.extent(0));
  std::uint64_t h = 1469598103934665603ull;  // FNV-1a over both arrays
  for (const std::vector<int>* a : {&docs.cu_q, &docs.cu_k})
    for (int x : *a) h = (h ^ static_cast<std::uint32_t>(x)) * 1099511628211ull;
  check_same_everywhere(ring, fn, {static_cast<long>(docs.cu_q.size()), static_cast<long>(h >> 1)},
                        {"cu_seqlens_q.extent(0)", "the contents of cu_seqlens_q and cu_seqlens_k"});
  std::vector<long> q_len(ring.size()), k_len(ring.size());
  for (int r = 0; r < ring.size(); ++r) q_len[r] = map.q_length(r), k_len[r] = map.k_length(r);
  collective_check(ring, fn, [&] { map = ShardMap(ring.layout(), docs.cu_q, docs.cu_k, q_len, k_len); });
  docs.tables = document_tables(map, docs.cu_q, docs.cu_k, ring.size());
  return docs;
}

/// The argument checks of a varlen forward, at compile time and on every rank of `ring` (a bad argument on any
/// rank throws the same kfa::Error on all): the packed shapes, then the fixed-length checks on the batch-of-one
/// views.
template <class ExecSpace, class QV, class KV, class VV, class OV, class LV, class CQ, class CK>
void check_varlen_forward(const Ring& ring, const char* fn, const QV& q, const KV& k, const VV& v, const OV& o,
                          const LV& lse, const AttentionOptions& opts) {
  kfa::detail::static_check_cu_seqlens<ExecSpace, CQ>();
  kfa::detail::static_check_cu_seqlens<ExecSpace, CK>();
  using kfa::detail::with_batch_of_one;
  const auto q4 = with_batch_of_one(q), k4 = with_batch_of_one(k), v4 = with_batch_of_one(v);
  const auto o4 = with_batch_of_one(o);
  const auto lse3 = with_batch_of_one(lse);
  kfa::detail::static_check_forward<ExecSpace, decltype(q4), decltype(k4), decltype(v4), decltype(o4),
                                    decltype(lse3)>();
  collective_check(ring, fn, [&] {
    kfa::detail::check_packed_qkv(fn, q, k, v);
    kfa::detail::check_packed_like(fn, "o", o, "q", q);
    kfa::detail::check_packed_lse(fn, lse, q);
    kfa::detail::check_forward(fn, q4, k4, v4, o4, lse3, opts);
  });
}

/// The same for a varlen backward.
template <class ExecSpace, class QV, class KV, class VV, class OV, class DOV, class LV, class DQV, class DKV, class DVV,
          class CQ, class CK>
void check_varlen_backward(const Ring& ring, const char* fn, const QV& q, const KV& k, const VV& v, const OV& o,
                           const DOV& d_o, const LV& lse, const DQV& dq, const DKV& dk, const DVV& dv,
                           const AttentionOptions& opts) {
  kfa::detail::static_check_cu_seqlens<ExecSpace, CQ>();
  kfa::detail::static_check_cu_seqlens<ExecSpace, CK>();
  using kfa::detail::with_batch_of_one;
  const auto q4 = with_batch_of_one(q), k4 = with_batch_of_one(k), v4 = with_batch_of_one(v);
  const auto o4 = with_batch_of_one(o), do4 = with_batch_of_one(d_o);
  const auto dq4 = with_batch_of_one(dq), dk4 = with_batch_of_one(dk), dv4 = with_batch_of_one(dv);
  const auto lse3 = with_batch_of_one(lse);
  kfa::detail::static_check_backward<ExecSpace, decltype(q4), decltype(k4), decltype(v4), decltype(o4), decltype(do4),
                                     decltype(lse3), decltype(dq4), decltype(dk4), decltype(dv4)>();
  collective_check(ring, fn, [&] {
    kfa::detail::check_packed_qkv(fn, q, k, v);
    kfa::detail::check_packed_like(fn, "o", o, "q", q);
    kfa::detail::check_packed_like(fn, "d_o", d_o, "q", q);
    kfa::detail::check_packed_lse(fn, lse, q);
    kfa::detail::check_packed_like(fn, "dq", dq, "q", q);
    kfa::detail::check_packed_like(fn, "dk", dk, "k", k);
    kfa::detail::check_packed_like(fn, "dv", dv, "k", k);
    kfa::detail::check_backward(fn, q4, k4, v4, o4, do4, lse3, dq4, dk4, dv4, opts);
  });
}

}  // namespace detail

/// Ring attention forward over packed variable-length sequences. Each rank passes its shard (document_shard in
/// ring.layout(): of the queries' stream by cu_seqlens_q, of the keys' by cu_seqlens_k) of q [n_q(rank),
/// heads_q, d] and of k, v [n_k(rank), heads_kv, d], and cu_seqlens_q, cu_seqlens_k (int32, batch + 1
/// entries) and the longest lengths of the whole batch, the same on every rank;
/// gets its shard of o and lse [heads_q, n_q(rank)]: equal to attention_forward_varlen on the gathered tensors
/// up to rounding. Collective; a bad argument on any rank throws the same kfa::Error on all. Synchronous.
template <class ExecSpace, class QV, class KV, class VV, class OV, class LV, class CQ, class CK>
void ring_attention_forward_varlen(const ExecSpace& space, const Ring& ring, const QV& q, const KV& k, const VV& v,
                                   const OV& o, const LV& lse, const CQ& cu_seqlens_q, const CK& cu_seqlens_k,
                                   long max_seqlen_q, long max_seqlen_k, const AttentionOptions& opts = {},
                                   RingStats* stats = nullptr) {
  constexpr const char* fn = "kfa::dist::ring_attention_forward_varlen";
  detail::check_varlen_forward<ExecSpace, QV, KV, VV, OV, LV, CQ, CK>(ring, fn, q, k, v, o, lse, opts);
  using kfa::detail::with_batch_of_one;
  const auto q4 = with_batch_of_one(q), k4 = with_batch_of_one(k), v4 = with_batch_of_one(v);
  const auto o4 = with_batch_of_one(o);
  const auto lse3 = with_batch_of_one(lse);
  ShardMap map = detail::agree_on_shapes(ring, fn, q4, k4, opts, true);
  const detail::RingDocuments docs =
      detail::agree_on_documents(ring, fn, map, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  detail::ring_forward(fn, space, ring, map, docs, q4, k4, v4, o4, lse3, opts, stats);
}

/// Ring attention backward over packed variable-length sequences (the shards, cu_seqlens and lengths of
/// ring_attention_forward_varlen, and that call's o and lse): each rank gets its shards of dq, dk, dv.
/// Deterministic for a fixed rank count and layout. Collective.
template <class ExecSpace, class QV, class KV, class VV, class OV, class DOV, class LV, class DQV, class DKV, class DVV,
          class CQ, class CK>
void ring_attention_backward_varlen(const ExecSpace& space, const Ring& ring, const QV& q, const KV& k, const VV& v,
                                    const OV& o, const DOV& d_o, const LV& lse, const DQV& dq, const DKV& dk,
                                    const DVV& dv, const CQ& cu_seqlens_q, const CK& cu_seqlens_k, long max_seqlen_q,
                                    long max_seqlen_k, const AttentionOptions& opts = {}, RingStats* stats = nullptr) {
  constexpr const char* fn = "kfa::dist::ring_attention_backward_varlen";
  detail::check_varlen_backward<ExecSpace, QV, KV, VV, OV, DOV, LV, DQV, DKV, DVV, CQ, CK>(ring, fn, q, k, v, o, d_o,
                                                                                           lse, dq, dk, dv, opts);
  using kfa::detail::with_batch_of_one;
  const auto q4 = with_batch_of_one(q), k4 = with_batch_of_one(k), v4 = with_batch_of_one(v);
  const auto o4 = with_batch_of_one(o), do4 = with_batch_of_one(d_o);
  const auto dq4 = with_batch_of_one(dq), dk4 = with_batch_of_one(dk), dv4 = with_batch_of_one(dv);
  const auto lse3 = with_batch_of_one(lse);
  ShardMap map = detail::agree_on_shapes(ring, fn, q4, k4, opts, true);
  const detail::RingDocuments docs =
      detail::agree_on_documents(ring, fn, map, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  const auto dd = detail::agreed_row_dot(space, ring, fn, o4, do4);
  detail::ring_backward(fn, space, ring, map, docs, q4, k4, v4, dd, do4, lse3, dq4, dk4, dv4, opts, stats);
}

}  // namespace dist
}  // namespace kfa
