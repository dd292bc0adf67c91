#pragma once
/// kfa::dist Ulysses and hybrid attention, forward and backward. Sequence shards in, sequence shards out, in
/// the layouts of the ring (contiguous or zigzag over all P ranks): an all-to-all inside each group of U
/// ranks gives every member its H/U heads of the group's tokens; the ring of the P/U groups (one kernel
/// call when U = P) computes them; an all-to-all brings the results home. The backward sends
/// D = rowsum(dO ∘ O) instead of O (one value per row, not d), and sums the gradients of key/value heads that
/// several members held. Each stage ends in an agreement over all P ranks: a failure anywhere (a bad
/// argument, an allocation, a fault in one ring) throws the same kfa::Error on every rank, none left waiting.
#include <Kokkos_Core.hpp>
#include <kfa/attention.hpp>
#include <kfa/compat.hpp>
#include <kfa/distributed/ring/backward.hpp>
#include <kfa/distributed/ring/buffers.hpp>
#include <kfa/distributed/ring/forward.hpp>
#include <kfa/distributed/ring/steps.hpp>
#include <kfa/distributed/ring/varlen.hpp>
#include <kfa/distributed/ulysses/exchange.hpp>
#include <kfa/distributed/ulysses/group.hpp>
#include <kfa/mpi/agreement.hpp>
#include <kfa/mpi/shard.hpp>
#include <kfa/options.hpp>
#include <kfa/types.hpp>

#include <cstddef>
#include <memory>
#include <string>

namespace kfa {
namespace dist {

/// What a Ulysses call did, by stage (pass a UlyssesStats* as the last argument; collecting them adds fences).
struct UlyssesStats {
  double to_heads_s = 0;     ///< the all-to-all to heads: packing, transfers, unpacking (forward q, k, v;
                             ///< backward q, k, v, dO, lse and D), and its agreements
  double attention_s = 0;    ///< the attention between: the ring of P/U ranks (its steps in `ring`), or one
                             ///< kernel call when U = P
  double to_sequence_s = 0;  ///< the all-to-all back (forward o and lse; backward dq, dk, dv)
  double total_s = 0;
  std::size_t a2a_bytes = 0;  ///< bytes this rank sent in the all-to-alls (the ring's are in `ring`)
  HeadPlan heads;             ///< the heads each rank held between the all-to-alls
  std::string transport;      ///< how the all-to-all's blocks travelled (Ring::transport of the group)
  RingStats ring;             ///< the ring's steps (one step when U = P); ring.on_step is called as for a ring
};

namespace detail {

/// The end of a Ulysses stage: every rank throws the first failing rank's error, or all go on. Collective.
inline void agree_on_stage(const Ulysses& u, const char* fn, const char* stage, const std::string& err) {
  kfa::dist::agree(u.all().comm(), err, std::string(fn) + ": " + stage + ": ");
}

/// The documents as the ring of the groups reads them: the stream's (its map holds runs of the stream, so the
/// kernels place each block's documents from the runs' positions), without the zigzag's tables.
inline RingDocuments group_documents(const RingDocuments& docs) {
  RingDocuments g = docs;
  g.tables.clear();
  return g;
}

template <class ExecSpace, class E>
using HeadExchangePtr = std::unique_ptr<HeadExchange<ExecSpace, E>>;

/// Moves a set of exchanges (posted together, completed together) and ends the stage: agreement after the
/// packing, the transfers, agreement after the unpacking. Returns the bytes sent.
template <class Pack, class Start, class Finish, class Unpack>
void exchange_stage(const Ulysses& u, const char* fn, const char* stage, Pack&& pack, Start&& start, Finish&& finish,
                    Unpack&& unpack) {
  agree_on_stage(u, fn, stage, capture(pack));
  start();  // every rank posts and completes its transfers: nothing is left posted when a later step fails
  finish();
  agree_on_stage(u, fn, stage, capture(unpack));
}

template <class ExecSpace, class QV, class KV, class VV, class OV, class LV>
void ulysses_forward(const char* fn, const ExecSpace& space, const Ulysses& u, const ShardMap& map, const HeadPlan& hp,
                     const RingDocuments& docs, const QV& q, const KV& k, const VV& v, const OV& o, const LV& lse,
                     const AttentionOptions& opts, UlyssesStats* stats) {
  using T = typename QV::non_const_value_type;
  using Acc = accumulator_t<T>;
  using Mem = typename ExecSpace::memory_space;
  compat::ScopedRegion region(std::string(fn) + "[" + to_string(u.layout()) + ",U" + std::to_string(u.degree()) + ",R" +
                              std::to_string(u.ring_degree()) + "," + dtype_name<T>() + "]");
  const long b = q.extent(0), d = q.extent(3);
  const int du = u.degree(), g = u.group_index();
  const bool timed = stats != nullptr;
  if (du == 1) {  // no all-to-all: the ring of all ranks on the shards as they are
    if (timed) stats->heads = hp, stats->transport = u.group().transport<Mem>();
    const double t = stamp(space, timed);
    agree_on_stage(u, fn, "attention", capture([&] { u.injected_fault(1); }));
    ring_forward(fn, space, u.ring(), map, docs, q, k, v, o, lse, opts, timed ? &stats->ring : nullptr);
    if (timed) stats->attention_s = stats->total_s = stamp(space, true) - t;
    return;
  }
  const double t0 = stamp(space, timed);
  // the group's transport (NCCL's communicator on first use), agreed over all ranks: a group that fails to set up
  // throws on all of its members together, which must not leave the other groups waiting
  agree_on_stage(u, fn, "all-to-all to heads", capture([&] { prepare_transport<Mem>(u.group(), fn); }));
  GroupTokens tq, tk;
  group_runs(map, false, du, g, &tq), group_runs(map, true, du, g, &tk);
  const ShardMap rmap = ring_map_of(map, du, u.ring_degree());
  const auto qh = [&](int m, int h) { return hp.q_head(m, h); };
  const auto kvh = [&](int m, int j) { return hp.kv_head(m, j); };
  const ReleaseWorkBuffers release(u.group());
  Kokkos::View<T****, Kokkos::LayoutRight, Mem, Kokkos::MemoryUnmanaged> qy, ky, vy, oy;
  Kokkos::View<Acc***, Kokkos::LayoutRight, Mem, Kokkos::MemoryUnmanaged> ly;
  HeadExchangePtr<ExecSpace, T> xq, xk, xv, xo;
  HeadExchangePtr<ExecSpace, Acc> xl;
  const char* key = "kfa::dist::buffer::ulysses::heads_";
  exchange_stage(
      u, fn, "all-to-all to heads",
      [&] {
        u.injected_fault(0);
        qy = kept_tensor<T, Mem>(u.group(), std::string(key) + "q", b, tq.total, hp.q_local, d);
        ky = kept_tensor<T, Mem>(u.group(), std::string(key) + "k", b, tk.total, hp.kv_local, d);
        vy = kept_tensor<T, Mem>(u.group(), std::string(key) + "v", b, tk.total, hp.kv_local, d);
        xq.reset(new HeadExchange<ExecSpace, T>(space, u.group(), tq, b, d, hp.q_local, qh, hp.heads_q, true, "q", 0));
        xk.reset(
            new HeadExchange<ExecSpace, T>(space, u.group(), tk, b, d, hp.kv_local, kvh, hp.heads_kv, true, "k", 1));
        xv.reset(
            new HeadExchange<ExecSpace, T>(space, u.group(), tk, b, d, hp.kv_local, kvh, hp.heads_kv, true, "v", 2));
        xq->pack_shard(q), xk->pack_shard(k), xv->pack_shard(v);
      },
      [&] { xq->start(), xk->start(), xv->start(); }, [&] { xq->finish(), xk->finish(), xv->finish(); },
      [&] {
        xq->unpack_heads(qy), xk->unpack_heads(ky), xv->unpack_heads(vy);
        space.fence();
      });
  const double t1 = stamp(space, timed);
  agree_on_stage(u, fn, "attention", capture([&] {
                   u.injected_fault(1);
                   oy = kept_tensor<T, Mem>(u.group(), std::string(key) + "o", b, tq.total, hp.q_local, d);
                   ly = kept_tensor<Acc, Mem>(u.group(), std::string(key) + "lse", b, hp.q_local, tq.total);
                 }));
  // every rank enters its ring (whose failures its ranks agree on), then all P agree
  agree_on_stage(u, fn, "attention", capture([&] {
                   ring_forward(fn, space, u.ring(), rmap, group_documents(docs), qy, ky, vy, oy, ly, opts,
                                timed ? &stats->ring : nullptr);
                 }));
  const double t2 = stamp(space, timed);
  exchange_stage(
      u, fn, "all-to-all to the sequence",
      [&] {
        u.injected_fault(2);
        xo.reset(new HeadExchange<ExecSpace, T>(space, u.group(), tq, b, d, hp.q_local, qh, hp.heads_q, false, "o", 3));
        xl.reset(
            new HeadExchange<ExecSpace, Acc>(space, u.group(), tq, b, 1, hp.q_local, qh, hp.heads_q, false, "lse", 4));
        xo->pack_heads(oy), xl->pack_heads(ly);
      },
      [&] { xo->start(), xl->start(); }, [&] { xo->finish(), xl->finish(); },
      [&] {
        xo->template unpack_sequence<Acc>(o), xl->template unpack_sequence<Acc>(lse);
        space.fence();
      });
  if (timed) {
    const double t3 = stamp(space, true);
    stats->to_heads_s = t1 - t0, stats->attention_s = t2 - t1, stats->to_sequence_s = t3 - t2, stats->total_s = t3 - t0;
    stats->a2a_bytes = xq->bytes() + xk->bytes() + xv->bytes() + xo->bytes() + xl->bytes();
    stats->heads = hp;
    stats->transport = u.group().transport<Mem>();
  }
}

template <class ExecSpace, class QV, class KV, class VV, class OV, class DOV, class LV, class DQV, class DKV, class DVV>
void ulysses_backward(const char* fn, const ExecSpace& space, const Ulysses& u, const ShardMap& map, const HeadPlan& hp,
                      const RingDocuments& docs, const QV& q, const KV& k, const VV& v, const OV& o, const DOV& d_o,
                      const LV& lse, const DQV& dq, const DKV& dk, const DVV& dv, const AttentionOptions& opts,
                      UlyssesStats* stats) {
  using T = typename QV::non_const_value_type;
  using Acc = accumulator_t<T>;
  using Mem = typename ExecSpace::memory_space;
  compat::ScopedRegion region(std::string(fn) + "[" + to_string(u.layout()) + ",U" + std::to_string(u.degree()) + ",R" +
                              std::to_string(u.ring_degree()) + "," + dtype_name<T>() + "]");
  const long b = q.extent(0), d = q.extent(3);
  const int du = u.degree(), g = u.group_index();
  const bool timed = stats != nullptr;
  if (du == 1) {  // no all-to-all: the ring of all ranks on the shards as they are
    if (timed) stats->heads = hp, stats->transport = u.group().transport<Mem>();
    const double t = stamp(space, timed);
    agree_on_stage(u, fn, "attention", capture([&] { u.injected_fault(1); }));
    const auto dd = agreed_row_dot(space, u.ring(), fn, o, d_o);
    ring_backward(fn, space, u.ring(), map, docs, q, k, v, dd, d_o, lse, dq, dk, dv, opts,
                  timed ? &stats->ring : nullptr);
    if (timed) stats->attention_s = stats->total_s = stamp(space, true) - t;
    return;
  }
  const double t0 = stamp(space, timed);
  // the group's transport (NCCL's communicator on first use), agreed over all ranks: a group that fails to set up
  // throws on all of its members together, which must not leave the other groups waiting
  agree_on_stage(u, fn, "all-to-all to heads", capture([&] { prepare_transport<Mem>(u.group(), fn); }));
  GroupTokens tq, tk;
  group_runs(map, false, du, g, &tq), group_runs(map, true, du, g, &tk);
  const ShardMap rmap = ring_map_of(map, du, u.ring_degree());
  const auto qh = [&](int m, int h) { return hp.q_head(m, h); };
  const auto kvh = [&](int m, int j) { return hp.kv_head(m, j); };
  const ReleaseWorkBuffers release(u.group());
  using Y4 = Kokkos::View<T****, Kokkos::LayoutRight, Mem, Kokkos::MemoryUnmanaged>;
  using Y3 = Kokkos::View<Acc***, Kokkos::LayoutRight, Mem, Kokkos::MemoryUnmanaged>;
  Y4 qy, ky, vy, doy, dqy, dky, dvy;
  Y3 ly, ddy;
  HeadExchangePtr<ExecSpace, T> xq, xk, xv, xdo, xdq, xdk, xdv;
  HeadExchangePtr<ExecSpace, Acc> xl, xd;
  const char* key = "kfa::dist::buffer::ulysses::heads_";
  exchange_stage(
      u, fn, "all-to-all to heads",
      [&] {
        u.injected_fault(0);
        const auto dd = kfa::detail::backward_row_dot(space, o, d_o);  // D: one value per row travels, not O
        qy = kept_tensor<T, Mem>(u.group(), std::string(key) + "q", b, tq.total, hp.q_local, d);
        ky = kept_tensor<T, Mem>(u.group(), std::string(key) + "k", b, tk.total, hp.kv_local, d);
        vy = kept_tensor<T, Mem>(u.group(), std::string(key) + "v", b, tk.total, hp.kv_local, d);
        doy = kept_tensor<T, Mem>(u.group(), std::string(key) + "do", b, tq.total, hp.q_local, d);
        ly = kept_tensor<Acc, Mem>(u.group(), std::string(key) + "lse", b, hp.q_local, tq.total);
        ddy = kept_tensor<Acc, Mem>(u.group(), std::string(key) + "D", b, hp.q_local, tq.total);
        xq.reset(new HeadExchange<ExecSpace, T>(space, u.group(), tq, b, d, hp.q_local, qh, hp.heads_q, true, "q", 0));
        xk.reset(
            new HeadExchange<ExecSpace, T>(space, u.group(), tk, b, d, hp.kv_local, kvh, hp.heads_kv, true, "k", 1));
        xv.reset(
            new HeadExchange<ExecSpace, T>(space, u.group(), tk, b, d, hp.kv_local, kvh, hp.heads_kv, true, "v", 2));
        xdo.reset(
            new HeadExchange<ExecSpace, T>(space, u.group(), tq, b, d, hp.q_local, qh, hp.heads_q, true, "do", 3));
        xl.reset(
            new HeadExchange<ExecSpace, Acc>(space, u.group(), tq, b, 1, hp.q_local, qh, hp.heads_q, true, "lse", 4));
        xd.reset(
            new HeadExchange<ExecSpace, Acc>(space, u.group(), tq, b, 1, hp.q_local, qh, hp.heads_q, true, "D", 5));
        xq->pack_shard(q), xk->pack_shard(k), xv->pack_shard(v), xdo->pack_shard(d_o), xl->pack_shard(lse);
        xd->pack_shard(dd);
        space.fence();  // dd is released here
      },
      [&] { xq->start(), xk->start(), xv->start(), xdo->start(), xl->start(), xd->start(); },
      [&] { xq->finish(), xk->finish(), xv->finish(), xdo->finish(), xl->finish(), xd->finish(); },
      [&] {
        xq->unpack_heads(qy), xk->unpack_heads(ky), xv->unpack_heads(vy), xdo->unpack_heads(doy);
        xl->unpack_heads(ly), xd->unpack_heads(ddy);
        space.fence();
      });
  const double t1 = stamp(space, timed);
  agree_on_stage(u, fn, "attention", capture([&] {
                   u.injected_fault(1);
                   dqy = kept_tensor<T, Mem>(u.group(), std::string(key) + "dq", b, tq.total, hp.q_local, d);
                   dky = kept_tensor<T, Mem>(u.group(), std::string(key) + "dk", b, tk.total, hp.kv_local, d);
                   dvy = kept_tensor<T, Mem>(u.group(), std::string(key) + "dv", b, tk.total, hp.kv_local, d);
                 }));
  agree_on_stage(u, fn, "attention", capture([&] {
                   ring_backward(fn, space, u.ring(), rmap, group_documents(docs), qy, ky, vy, ddy, doy, ly, dqy, dky,
                                 dvy, opts, timed ? &stats->ring : nullptr);
                 }));
  const double t2 = stamp(space, timed);
  exchange_stage(
      u, fn, "all-to-all to the sequence",
      [&] {
        u.injected_fault(2);
        xdq.reset(
            new HeadExchange<ExecSpace, T>(space, u.group(), tq, b, d, hp.q_local, qh, hp.heads_q, false, "dq", 6));
        xdk.reset(
            new HeadExchange<ExecSpace, T>(space, u.group(), tk, b, d, hp.kv_local, kvh, hp.heads_kv, false, "dk", 7));
        xdv.reset(
            new HeadExchange<ExecSpace, T>(space, u.group(), tk, b, d, hp.kv_local, kvh, hp.heads_kv, false, "dv", 8));
        xdq->pack_heads(dqy), xdk->pack_heads(dky), xdv->pack_heads(dvy);
      },
      [&] { xdq->start(), xdk->start(), xdv->start(); }, [&] { xdq->finish(), xdk->finish(), xdv->finish(); },
      [&] {
        xdq->template unpack_sequence<Acc>(dq), xdk->template unpack_sequence<Acc>(dk);
        xdv->template unpack_sequence<Acc>(dv);
        space.fence();
      });
  if (timed) {
    const double t3 = stamp(space, true);
    stats->to_heads_s = t1 - t0, stats->attention_s = t2 - t1, stats->to_sequence_s = t3 - t2, stats->total_s = t3 - t0;
    std::size_t bytes = 0;
    for (const auto* x : {xq.get(), xk.get(), xv.get(), xdo.get(), xdq.get(), xdk.get(), xdv.get()})
      bytes += x->bytes();
    stats->a2a_bytes = bytes + xl->bytes() + xd->bytes();
    stats->heads = hp;
    stats->transport = u.group().transport<Mem>();
  }
}

/// The agreed shard map and head plan of a Ulysses call (arguments checked on every rank before); with
/// `documents` the map is of the ranks' lengths, to be made the map over the documents (agree_on_documents).
template <class QV, class KV>
std::pair<ShardMap, HeadPlan> ulysses_plan(const Ulysses& u, const char* fn, const QV& q, const KV& k,
                                           const AttentionOptions& opts, bool documents = false) {
  const ShardMap map = agree_on_shapes(u.all(), fn, q, k, opts, documents);
  HeadPlan hp;
  collective_check(u.all(), fn, [&] {
    hp = plan_heads(fn, static_cast<int>(q.extent(2)), static_cast<int>(k.extent(2)), u.degree());
  });
  return {map, hp};
}

}  // namespace detail

/// Ulysses (U = P) or hybrid (U < P: Ulysses inside groups of U ranks, the ring across the P/U groups)
/// attention forward: each rank passes its shard of q [batch, n_q(rank), heads_q, d] and of k, v [batch,
/// n_k(rank), heads_kv, d] in u.layout() (as for a Ring of all P ranks) and gets its shard of o and lse
/// [batch, heads_q, n_q(rank)]: equal to attention_forward on the gathered sequence up to rounding. heads_q
/// must be a multiple of U (the error names both); key/value heads are split, shared or expanded (HeadPlan).
/// Collective over the Ulysses' communicator; a bad argument on any rank throws the same kfa::Error on all.
template <class ExecSpace, class QV, class KV, class VV, class OV, class LV>
void ulysses_attention_forward(const ExecSpace& space, const Ulysses& u, const QV& q, const KV& k, const VV& v,
                               const OV& o, const LV& lse, const AttentionOptions& opts = {},
                               UlyssesStats* stats = nullptr) {
  kfa::detail::static_check_forward<ExecSpace, QV, KV, VV, OV, LV>();
  constexpr const char* fn = "kfa::dist::ulysses_attention_forward";
  detail::collective_check(u.all(), fn, [&] { kfa::detail::check_forward(fn, q, k, v, o, lse, opts); });
  const auto plan = detail::ulysses_plan(u, fn, q, k, opts);
  detail::ulysses_forward(fn, space, u, plan.first, plan.second, detail::RingDocuments{}, q, k, v, o, lse, opts, stats);
}

/// Ulysses or hybrid attention backward: the shards of q, k, v, the forward's o and lse, and d_o in; the
/// shards of dq, dk, dv out. Deterministic for a fixed P, U and layout. Collective.
template <class ExecSpace, class QV, class KV, class VV, class OV, class DOV, class LV, class DQV, class DKV, class DVV>
void ulysses_attention_backward(const ExecSpace& space, const Ulysses& u, const QV& q, const KV& k, const VV& v,
                                const OV& o, const DOV& d_o, const LV& lse, const DQV& dq, const DKV& dk, const DVV& dv,
                                const AttentionOptions& opts = {}, UlyssesStats* stats = nullptr) {
  kfa::detail::static_check_backward<ExecSpace, QV, KV, VV, OV, DOV, LV, DQV, DKV, DVV>();
  constexpr const char* fn = "kfa::dist::ulysses_attention_backward";
  detail::collective_check(u.all(), fn,
                           [&] { kfa::detail::check_backward(fn, q, k, v, o, d_o, lse, dq, dk, dv, opts); });
  const auto plan = detail::ulysses_plan(u, fn, q, k, opts);
  detail::ulysses_backward(fn, space, u, plan.first, plan.second, detail::RingDocuments{}, q, k, v, o, d_o, lse, dq, dk,
                           dv, opts, stats);
}

/// Ulysses or hybrid attention forward over packed variable-length sequences: each rank passes its shard of the
/// packed stream (kfa::dist::document_shard in u.layout(), as for ring_attention_forward_varlen) of q
/// [n_q(rank), heads_q, d] and of k, v [n_k(rank), heads_kv, d], cu_seqlens_q, cu_seqlens_k (int32, the same on
/// every rank) and the longest lengths; gets its shard of o and lse [heads_q, n_q(rank)]: equal to
/// attention_forward_varlen on the gathered stream up to rounding. Between the all-to-alls each member holds its
/// heads of the group's tokens: with U = P the whole stream, every document whole. Collective.
template <class ExecSpace, class QV, class KV, class VV, class OV, class LV, class CQ, class CK>
void ulysses_attention_forward_varlen(const ExecSpace& space, const Ulysses& u, const QV& q, const KV& k, const VV& v,
                                      const OV& o, const LV& lse, const CQ& cu_seqlens_q, const CK& cu_seqlens_k,
                                      long max_seqlen_q, long max_seqlen_k, const AttentionOptions& opts = {},
                                      UlyssesStats* stats = nullptr) {
  constexpr const char* fn = "kfa::dist::ulysses_attention_forward_varlen";
  detail::check_varlen_forward<ExecSpace, QV, KV, VV, OV, LV, CQ, CK>(u.all(), fn, q, k, v, o, lse, opts);
  using kfa::detail::with_batch_of_one;
  const auto q4 = with_batch_of_one(q), k4 = with_batch_of_one(k), v4 = with_batch_of_one(v);
  const auto o4 = with_batch_of_one(o);
  const auto lse3 = with_batch_of_one(lse);
  auto plan = detail::ulysses_plan(u, fn, q4, k4, opts, true);
  const detail::RingDocuments docs =
      detail::agree_on_documents(u.all(), fn, plan.first, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  detail::ulysses_forward(fn, space, u, plan.first, plan.second, docs, q4, k4, v4, o4, lse3, opts, stats);
}

/// Ulysses or hybrid attention backward over packed variable-length sequences (the shards, cu_seqlens and
/// lengths of ulysses_attention_forward_varlen, and that call's o and lse): each rank gets its shards of dq,
/// dk, dv. Deterministic for a fixed P, U and layout. Collective.
template <class ExecSpace, class QV, class KV, class VV, class OV, class DOV, class LV, class DQV, class DKV, class DVV,
          class CQ, class CK>
void ulysses_attention_backward_varlen(const ExecSpace& space, const Ulysses& u, const QV& q, const KV& k, const VV& v,
                                       const OV& o, const DOV& d_o, const LV& lse, const DQV& dq, const DKV& dk,
                                       const DVV& dv, const CQ& cu_seqlens_q, const CK& cu_seqlens_k, long max_seqlen_q,
                                       long max_seqlen_k, const AttentionOptions& opts = {},
                                       UlyssesStats* stats = nullptr) {
  constexpr const char* fn = "kfa::dist::ulysses_attention_backward_varlen";
  detail::check_varlen_backward<ExecSpace, QV, KV, VV, OV, DOV, LV, DQV, DKV, DVV, CQ, CK>(u.all(), fn, q, k, v, o, d_o,
                                                                                           lse, dq, dk, dv, opts);
  using kfa::detail::with_batch_of_one;
  const auto q4 = with_batch_of_one(q), k4 = with_batch_of_one(k), v4 = with_batch_of_one(v);
  const auto o4 = with_batch_of_one(o), do4 = with_batch_of_one(d_o);
  const auto dq4 = with_batch_of_one(dq), dk4 = with_batch_of_one(dk), dv4 = with_batch_of_one(dv);
  const auto lse3 = with_batch_of_one(lse);
  auto plan = detail::ulysses_plan(u, fn, q4, k4, opts, true);
  const detail::RingDocuments docs =
      detail::agree_on_documents(u.all(), fn, plan.first, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  detail::ulysses_backward(fn, space, u, plan.first, plan.second, docs, q4, k4, v4, o4, do4, lse3, dq4, dk4, dv4, opts,
                           stats);
}

}  // namespace dist
}  // namespace kfa
