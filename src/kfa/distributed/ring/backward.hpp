#pragma once
/// kfa::dist ring attention backward.
#include <Kokkos_Core.hpp>
#include <kfa/attention.hpp>
#include <kfa/compat.hpp>
#include <kfa/detail/common/recompute.hpp>
#include <kfa/detail/mask.hpp>
#include <kfa/distributed/ring/buffers.hpp>
#include <kfa/distributed/ring/communicator.hpp>
#include <kfa/distributed/ring/steps.hpp>
#include <kfa/distributed/ring/transport.hpp>
#include <kfa/mpi/shard.hpp>
#include <kfa/options.hpp>
#include <kfa/types.hpp>

#include <algorithm>
#include <cstddef>
#include <memory>
#include <string>
#include <utility>

namespace kfa {
namespace dist {

namespace detail {

/// D = rowsum(dO ∘ O) [batch, heads_q, n] of a rank's query rows, once for its whole shard (not once per
/// block); a failure to allocate it on one rank throws on every rank of `ring`. Collective.
template <class ExecSpace, class OV, class DOV>
auto agreed_row_dot(const ExecSpace& space, const Ring& ring, const char* fn, const OV& o, const DOV& d_o) {
  decltype(kfa::detail::backward_row_dot(space, o, d_o)) dd;
  agreed_allocation(ring, fn, [&] { dd = kfa::detail::backward_row_dot(space, o, d_o); });
  return dd;
}

/// ring_attention_backward after its checks, on the agreed shard map (and documents, as ring_forward), with
/// the rows' D = rowsum(dO ∘ O) given (agreed_row_dot).
template <class ExecSpace, class QV, class KV, class VV, class DD, class DOV, class LV, class DQV, class DKV, class DVV>
void ring_backward(const char* fn, const ExecSpace& space, const Ring& ring, const ShardMap& map,
                   const RingDocuments& docs, const QV& q, const KV& k, const VV& v, const DD& dd, const DOV& d_o,
                   const LV& lse, const DQV& dq, const DKV& dk, const DVV& dv, const AttentionOptions& opts,
                   RingStats* stats) {
  using T = typename QV::non_const_value_type;
  using Acc = accumulator_t<T>;
  using Mem = typename ExecSpace::memory_space;
  compat::ScopedRegion region(std::string(fn) + "[" + to_string(ring.layout()) + ",P" + std::to_string(ring.size()) +
                              "," + dtype_name<T>() + "]");
  const long b = q.extent(0), nq = q.extent(1), hq = q.extent(2), hkv = k.extent(2), d = q.extent(3);
  const long nmax = map.k_length_max();
  const int p = ring.size(), me = ring.rank();
  const bool timed = stats != nullptr;
  if (timed) stats->transport = ring.transport<Mem>();
  const double t_begin = detail::stamp(space, timed);

  if (p == 1) {  // the whole sequence is here: one kernel call, straight into dq, dk, dv, nothing sent
    detail::single_rank(space, ring, fn, stats, t_begin, [&] {
      kfa::detail::backward_impl_d(fn, space, q, k, v, d_o, lse, dd, dq, dk, dv, opts,
                                   kfa::detail::Positions{0, 0, nq, static_cast<long>(k.extent(1)), docs.device});
    });
    return;
  }

  detail::prepare_transport<Mem>(ring, fn);
  // K/V travel one hop per step (posted at the step's start). The dK/dV accumulator of the shard visiting
  // at step s > 0 arrives while step s's first kernels compute (sent by the previous rank at the end of its
  // step s − 1); this rank's contributions are added into it once it has arrived (at step 0 into a zeroed
  // one: the rank's own shard); then it moves on (or home after the last needed step) while the
  // next step computes. The last step runs its dK/dV kernels first, so that the accumulators go home while
  // its dQ kernels compute.
  constexpr bool host_space = Kokkos::SpaceAccessibility<Kokkos::HostSpace, Mem>::accessible;
  using Kv = detail::KvBuffer<T, Mem>;
  using KvAcc = detail::KvBuffer<Acc, Mem>;
  using Part = Kokkos::View<Acc****, Kokkos::LayoutRight, Mem, Kokkos::MemoryUnmanaged>;
  const int last = detail::last_needed_step(map, opts, docs, p);
  const auto tables = detail::document_tables_in<Mem>(docs);  // where the kernels read them
  long qseg_max = 0, kseg_max = 0;  // partial results are per (query segment, key segment) block
  for (const Segment& qs : map.q_segments(me)) qseg_max = std::max(qseg_max, qs.length);
  for (int r = 0; r < p; ++r)
    for (const Segment& ks : map.k_segments(r)) kseg_max = std::max(kseg_max, ks.length);
  const detail::ReleaseWorkBuffers release(ring);  // declared first: runs after the buffers' users are gone
  std::unique_ptr<Kv> kv, kv_next;
  std::unique_ptr<KvAcc> acc_a, acc_b;  // the accumulator leaving (acc_a) and the one arriving / visiting (acc_b)
  std::unique_ptr<detail::Exchanger<ExecSpace, T>> ex_kv;
  std::unique_ptr<detail::Exchanger<ExecSpace, Acc>> ex_acc;
  Part dq_acc, dq_part, dk_part, dv_part;
  detail::agreed_allocation(ring, fn, [&] {
    kv.reset(new Kv(ring, "kfa::dist::buffer::kv_a", b, nmax, hkv, d));  // kept by the Ring, as the forward's
    kv_next.reset(new Kv(ring, "kfa::dist::buffer::kv_b", b, nmax, hkv, d));
    acc_a.reset(new KvAcc(ring, "kfa::dist::buffer::dkv_a", b, nmax, hkv, d));
    acc_b.reset(new KvAcc(ring, "kfa::dist::buffer::dkv_b", b, nmax, hkv, d));
    ex_kv.reset(new detail::Exchanger<ExecSpace, T>(space, ring, kv->count(nmax), "kfa::dist::ring_backward::kv"));
    ex_acc.reset(
        new detail::Exchanger<ExecSpace, Acc>(space, ring, acc_a->count(nmax), "kfa::dist::ring_backward::dkv"));
    dq_acc = detail::kept_tensor<Acc, Mem>(ring, "kfa::dist::buffer::acc_q", b, nq, hq, d);
    dq_part = detail::kept_tensor<Acc, Mem>(ring, "kfa::dist::buffer::part_q", b, qseg_max, hq, d);
    dk_part = detail::kept_tensor<Acc, Mem>(ring, "kfa::dist::buffer::part_k", b, kseg_max, hkv, d);
    dv_part = detail::kept_tensor<Acc, Mem>(ring, "kfa::dist::buffer::part_v", b, kseg_max, hkv, d);
  });
  for (const Part& x : {dq_acc, dq_part, dk_part, dv_part}) Kokkos::deep_copy(space, x, Acc(0));
  detail::copy_into(space, kv->tile(map.k_length(me), 0), k, "kfa::dist::ring_backward::load_k");
  detail::copy_into(space, kv->tile(map.k_length(me), 1), v, "kfa::dist::ring_backward::load_v");
  if (timed) stats->steps.assign(p, RingStepStats{});

  for (int s = 0; s <= last; ++s) {
    const double t0 = detail::stamp(space, timed);
    int blocks = 0;
    const int owner = (me - s + p) % p, incoming = (me - s - 1 + 2 * p) % p;
    const long nk = map.k_length(owner);
    if (s < last) ex_kv->start(kv->data, kv->count(nk), kv_next->data, kv_next->count(map.k_length(incoming)), 2 * s);
    const auto kt = kv->tile(nk, 0), vt = kv->tile(nk, 1);  // element type T
    bool dq_pending = false;                                // the last step's dQ kernels, after the accumulators left
    bool acc_arrived = s == 0;  // s > 0: the visiting shard's accumulator in acc_b (and acc_a's send) complete
    auto arrive = [&] {
      if (acc_arrived) return;
      ex_acc->finish(timed);
      acc_arrived = true;
    };
    // This step's visible blocks: their contributions into dq_acc and into the visiting shard's dK/dV
    // accumulator acc_b, for `parts`.
    auto run_blocks = [&](kfa::detail::BackwardParts parts) {
      for (int qi = 0; qi < static_cast<int>(map.q_segments(me).size()); ++qi)
        for (int ki = 0; ki < static_cast<int>(map.k_segments(owner).size()); ++ki) {
          const Segment &qs = map.q_segments(me)[qi], &ks = map.k_segments(owner)[ki];
          if (!detail::block_visible(
                  detail::block_positions(map, docs.host(), docs.tables.data(), p, me, qi, owner, ki), qs.length,
                  ks.length, opts))
            continue;  // fully masked: skipped
          const kfa::detail::Positions pos =
              detail::block_positions(map, docs.device, tables.data(), p, me, qi, owner, ki);
          const Segment qpart{qs.global_begin, qs.length, 0}, kpart{ks.global_begin, ks.length, 0};
          const auto dqp = detail::seq_slice(dq_part, qpart);
          const auto dkp = detail::seq_slice(dk_part, kpart), dvp = detail::seq_slice(dv_part, kpart);
          const bool wrote_dq = kfa::detail::backward_impl_d(
              fn, space, detail::seq_slice(q, qs), detail::seq_slice(kt, ks), detail::seq_slice(vt, ks),
              detail::seq_slice(d_o, qs), detail::lse_slice(lse, qs), detail::lse_slice(dd, qs), dqp, dkp, dvp, opts,
              pos, parts);
          if (wrote_dq) detail::add_into(space, detail::seq_slice(dq_acc, qs), dqp, "kfa::dist::ring_backward::add_dq");
          if (parts == kfa::detail::BackwardParts::dkdv && !wrote_dq) dq_pending = true;
          if (parts != kfa::detail::BackwardParts::dq) {
            arrive();  // enqueued after this block's kernels: on a device they hide the rest of the transfer
            detail::add_into(space, detail::seq_slice(acc_b->tile(nk, 0), ks), dkp, "kfa::dist::ring_backward::add_dk");
            detail::add_into(space, detail::seq_slice(acc_b->tile(nk, 1), ks), dvp, "kfa::dist::ring_backward::add_dv");
            ++blocks;
          }
          if (s < last) ex_kv->test();
        }
    };
    const std::string err = detail::capture([&] {
      detail::injected_fault(ring, s);
      if (s == 0)
        Kokkos::deep_copy(space, Kokkos::subview(acc_b->data, std::make_pair(std::size_t(0), acc_b->count(nk))),
                          Acc(0));
      run_blocks(s < last ? kfa::detail::BackwardParts::all : kfa::detail::BackwardParts::dkdv);
      if (!host_space && s < last) ex_kv->wait_transfer();  // device: drive MPI while the kernels above compute
    });
    const double t1 = detail::stamp(space, timed);
    if (s < last) ex_kv->finish(timed);
    if (!acc_arrived) ex_acc->finish(timed);  // no visible block, or a failure before the first one
    const double t2 = detail::stamp(space, timed);
    detail::agree_on_step(ring, fn, s, err);
    const double t3 = detail::stamp(space, timed);
    std::size_t bytes = s < last ? ex_kv->bytes() : 0;
    double dq_s = 0, dq_sync = 0;  // the last step's dQ kernels (while the accumulators go home), their agreement
    if (s < last) {
      // on to the next rank; the accumulator of the next visiting shard comes into acc_a
      ex_acc->start(acc_b->data, acc_b->count(nk), acc_a->data, acc_a->count(map.k_length(incoming)), 2 * s + 1);
      std::swap(acc_a, acc_b);  // acc_b: the one arriving; acc_a: the one leaving
      std::swap(kv, kv_next);
    } else {
      // home: this rank's own accumulator comes from rank me + last into acc_a while dQ computes
      ex_acc->start(acc_b->data, acc_b->count(nk), acc_a->data, acc_a->count(map.k_length(me)), 2 * s + 1, -last);
      const double t4 = detail::stamp(space, timed);
      const std::string dq_err = detail::capture([&] {
        if (dq_pending) run_blocks(kfa::detail::BackwardParts::dq);
        detail::copy_into(space, dq, dq_acc, "kfa::dist::ring_backward::store_dq");
        if (!host_space) ex_acc->wait_transfer();
      });
      const double t5 = detail::stamp(space, timed);
      detail::agree_on_step(ring, fn, s, dq_err);
      const double t6 = detail::stamp(space, timed);
      dq_s = t5 - t4, dq_sync = t6 - t5;
      ex_acc->finish(timed);
    }
    bytes += ex_acc->bytes();  // the accumulator sent at the end of this step (0 for a local copy)
    if (timed)
      stats->steps[s] = {t1 - t0 + dq_s, 0.0,    (t2 - t1) + (detail::stamp(space, true) - t3) - dq_s - dq_sync,
                         bytes,          blocks, t3 - t2 + dq_sync};
    if (timed && stats->on_step) stats->on_step(s + 1, last + 1);
  }
  detail::copy_into(space, dk, acc_a->tile(map.k_length(me), 0), "kfa::dist::ring_backward::store_dk");
  detail::copy_into(space, dv, acc_a->tile(map.k_length(me), 1), "kfa::dist::ring_backward::store_dv");
  space.fence();
  if (timed) stats->total_s = detail::stamp(space, true) - t_begin;
}

}  // namespace detail

/// Ring attention backward: every rank passes its shards of q, k, v, the ring forward's o and lse, and
/// d_o, and gets its shards of dq, dk, dv. dQ stays local; the dK/dV accumulators travel with K/V and come
/// home after P steps. Deterministic for a fixed rank count and layout. Collective over ring.comm().
template <class ExecSpace, class QV, class KV, class VV, class OV, class DOV, class LV, class DQV, class DKV, class DVV>
void ring_attention_backward(const ExecSpace& space, const Ring& ring, const QV& q, const KV& k, const VV& v,
                             const OV& o, const DOV& d_o, const LV& lse, const DQV& dq, const DKV& dk, const DVV& dv,
                             const AttentionOptions& opts = {}, RingStats* stats = nullptr) {
  kfa::detail::static_check_backward<ExecSpace, QV, KV, VV, OV, DOV, LV, DQV, DKV, DVV>();
  constexpr const char* fn = "kfa::dist::ring_attention_backward";
  detail::collective_check(ring, fn, [&] { kfa::detail::check_backward(fn, q, k, v, o, d_o, lse, dq, dk, dv, opts); });
  const ShardMap map = detail::agree_on_shapes(ring, fn, q, k, opts);
  const auto dd = detail::agreed_row_dot(space, ring, fn, o, d_o);
  detail::ring_backward(fn, space, ring, map, detail::RingDocuments{}, q, k, v, dd, d_o, lse, dq, dk, dv, opts, stats);
}

}  // namespace dist
}  // namespace kfa
