#pragma once
/// kfa::dist ring attention forward.
#include <Kokkos_Core.hpp>
#include <kfa/attention.hpp>
#include <kfa/compat.hpp>
#include <kfa/detail/common/ranges.hpp>
#include <kfa/detail/mask.hpp>
#include <kfa/distributed/ring/buffers.hpp>
#include <kfa/distributed/ring/communicator.hpp>
#include <kfa/distributed/ring/steps.hpp>
#include <kfa/distributed/ring/transport.hpp>
#include <kfa/merge.hpp>
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

/// ring_attention_forward after its checks, on the agreed shard map (and, for a variable-length call, its
/// documents; docs.device.count = 0 for one sequence).
template <class ExecSpace, class QV, class KV, class VV, class OV, class LV>
void ring_forward(const char* fn, const ExecSpace& space, const Ring& ring, const ShardMap& map,
                  const RingDocuments& docs, const QV& q, const KV& k, const VV& v, const OV& o, const LV& lse,
                  const AttentionOptions& opts, RingStats* stats) {
  using T = typename QV::non_const_value_type;
  using Acc = accumulator_t<T>;
  using Mem = typename ExecSpace::memory_space;
  compat::ScopedRegion region(std::string(fn) + "[" + to_string(ring.layout()) + ",P" + std::to_string(ring.size()) +
                              "," + dtype_name<T>() + "]");
  const long b = q.extent(0), nq = q.extent(1), hq = q.extent(2), hkv = k.extent(2), d = q.extent(3);
  const int p = ring.size(), me = ring.rank();
  const bool timed = stats != nullptr;
  if (timed) stats->transport = ring.transport<Mem>();
  const double t_begin = stamp(space, timed);

  if (p == 1) {  // the whole sequence is here: one kernel call, straight into o and lse, nothing sent
    single_rank(space, ring, fn, stats, t_begin, [&] {
      kfa::detail::forward_impl(fn, space, q, k, v, o, lse, opts,
                                kfa::detail::Positions{0, 0, nq, static_cast<long>(k.extent(1)), docs.device});
    });
    return;
  }

  prepare_transport<Mem>(ring, fn);
  constexpr bool host_space = Kokkos::SpaceAccessibility<Kokkos::HostSpace, Mem>::accessible;
  // Timing single blocks' merges needs fences; on a device those would stall the host's MPI progress.
  const bool fence_blocks = timed && host_space;
  using Kv = KvBuffer<T, Mem>;
  const int last = last_needed_step(map, opts, docs, p);
  const auto tables = document_tables_in<Mem>(docs);  // where the kernels read them
  long seg_max = 0;                                   // partial results are per (query segment, key segment) block
  for (const Segment& qs : map.q_segments(me)) seg_max = std::max(seg_max, qs.length);
  const ReleaseWorkBuffers release(ring);  // declared first: runs after the buffers' users are gone
  std::unique_ptr<Kv> cur, nxt;
  std::unique_ptr<Exchanger<ExecSpace, T>> ex;
  Kokkos::View<Acc****, Kokkos::LayoutRight, Mem, Kokkos::MemoryUnmanaged> o_acc, o_part;
  Kokkos::View<Acc***, Kokkos::LayoutRight, Mem, Kokkos::MemoryUnmanaged> lse_acc, lse_part;
  agreed_allocation(ring, fn, [&] {  // kept by the Ring for its next call (the backward's too)
    cur.reset(new Kv(ring, "kfa::dist::buffer::kv_a", b, map.k_length_max(), hkv, d));
    nxt.reset(new Kv(ring, "kfa::dist::buffer::kv_b", b, map.k_length_max(), hkv, d));
    ex.reset(
        new Exchanger<ExecSpace, T>(space, ring, cur->count(map.k_length_max()), "kfa::dist::ring_forward::exchange"));
    o_acc = kept_tensor<Acc, Mem>(ring, "kfa::dist::buffer::acc_q", b, nq, hq, d);
    o_part = kept_tensor<Acc, Mem>(ring, "kfa::dist::buffer::part_q", b, seg_max, hq, d);
    lse_acc = kept_tensor<Acc, Mem>(ring, "kfa::dist::buffer::lse_acc", b, hq, nq);
    lse_part = kept_tensor<Acc, Mem>(ring, "kfa::dist::buffer::lse_part", b, hq, seg_max);
  });
  Kokkos::deep_copy(space, o_acc, Acc(0));  // the empty state (with lse_acc = −inf below)
  Kokkos::deep_copy(space, o_part, Acc(0));
  Kokkos::deep_copy(space, lse_part, Acc(0));
  copy_into(space, cur->tile(map.k_length(me), 0), k, "kfa::dist::ring_forward::load_k");
  copy_into(space, cur->tile(map.k_length(me), 1), v, "kfa::dist::ring_forward::load_v");
  Kokkos::deep_copy(space, lse_acc, -compat::infinity<Acc>());  // the empty state: merges as the identity
  if (timed) stats->steps.assign(p, RingStepStats{});

  for (int s = 0; s <= last; ++s) {
    const double t0 = stamp(space, timed);
    int blocks = 0;
    double merge_s = 0;
    const int owner = (me - s + p) % p, incoming = (me - s - 1 + 2 * p) % p;
    // Every rank posts its transfer before any work that can fail, so the transfer always completes.
    if (s < last)
      ex->start(cur->data, cur->count(map.k_length(owner)), nxt->data, nxt->count(map.k_length(incoming)), s);
    const std::string err = capture([&] {
      injected_fault(ring, s);
      const long nk = map.k_length(owner);
      const auto kt = cur->tile(nk, 0), vt = cur->tile(nk, 1);
      for (int qi = 0; qi < static_cast<int>(map.q_segments(me).size()); ++qi)
        for (int ki = 0; ki < static_cast<int>(map.k_segments(owner).size()); ++ki) {
          const Segment &qs = map.q_segments(me)[qi], &ks = map.k_segments(owner)[ki];
          if (!block_visible(block_positions(map, docs.host(), docs.tables.data(), p, me, qi, owner, ki), qs.length,
                             ks.length, opts))
            continue;  // fully masked: skipped
          const kfa::detail::Positions pos = block_positions(map, docs.device, tables.data(), p, me, qi, owner, ki);
          const Segment part{qs.global_begin, qs.length, 0};
          const auto op = seq_slice(o_part, part);
          const auto lp = lse_slice(lse_part, part);
          kfa::detail::forward_impl(fn, space, seq_slice(q, qs), seq_slice(kt, ks), seq_slice(vt, ks), op, lp, opts,
                                    pos);
          const double tm0 = stamp(space, fence_blocks);
          kfa::merge_attention(space, seq_slice(o_acc, qs), lse_slice(lse_acc, qs), op, lp);
          merge_s += stamp(space, fence_blocks) - tm0;
          ++blocks;
          if (s < last) ex->test();
        }
      // On a device the kernels above run asynchronously: drive MPI now, while they compute.
      if (s < last && !host_space) ex->wait_transfer();
    });
    const double t1 = stamp(space, timed);
    if (s < last) ex->finish(timed);
    const double t2 = stamp(space, timed);
    agree_on_step(ring, fn, s, err);
    if (s < last) std::swap(cur, nxt);
    if (timed)
      stats->steps[s] = {t1 - t0 - merge_s,          merge_s, t2 - t1,
                         s < last ? ex->bytes() : 0, blocks,  stamp(space, true) - t2};
    if (timed && stats->on_step) stats->on_step(s + 1, last + 1);
  }
  copy_into(space, o, o_acc, "kfa::dist::ring_forward::store_o");
  Kokkos::parallel_for(
      "kfa::dist::ring_forward::store_lse", kfa::detail::range_like(space, lse),
      KOKKOS_LAMBDA(const std::int64_t x, const std::int64_t h, const std::int64_t i) {
        lse(x, h, i) = lse_acc(x, h, i);
      });
  space.fence();
  if (timed) stats->total_s = stamp(space, true) - t_begin;
}

}  // namespace detail

/// Ring attention forward over the ranks of `ring`: each rank passes its shard of q [batch, n_q(rank),
/// heads_q, d] and of k, v [batch, n_k(rank), heads_kv, d] in ring.layout() and gets its shard of
/// o and lse [batch, heads_q, n_q(rank)] — equal to attention_forward on the gathered sequence up to
/// rounding. Collective over ring.comm(); a bad argument on any rank throws the same kfa::Error on all.
/// Synchronous: the results are complete on return.
template <class ExecSpace, class QV, class KV, class VV, class OV, class LV>
void ring_attention_forward(const ExecSpace& space, const Ring& ring, const QV& q, const KV& k, const VV& v,
                            const OV& o, const LV& lse, const AttentionOptions& opts = {}, RingStats* stats = nullptr) {
  kfa::detail::static_check_forward<ExecSpace, QV, KV, VV, OV, LV>();
  constexpr const char* fn = "kfa::dist::ring_attention_forward";
  detail::collective_check(ring, fn, [&] { kfa::detail::check_forward(fn, q, k, v, o, lse, opts); });
  const ShardMap map = detail::agree_on_shapes(ring, fn, q, k, opts);
  detail::ring_forward(fn, space, ring, map, detail::RingDocuments{}, q, k, v, o, lse, opts, stats);
}

}  // namespace dist
}  // namespace kfa
