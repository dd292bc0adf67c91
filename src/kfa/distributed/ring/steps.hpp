#pragma once
/// kfa::dist ring steps — what the forward and backward ring share around their kernels: statistics, the
/// collective checks of arguments and shapes, the agreement at the end of every step (with the fault
/// injection hook that tests it), the ring of one rank, and which blocks of a step any query sees.
#include <Kokkos_Core.hpp>
#include <kfa/detail/mask.hpp>
#include <kfa/distributed/ring/communicator.hpp>
#include <kfa/error.hpp>
#include <kfa/mpi/agreement.hpp>
#include <kfa/mpi/shard.hpp>
#include <kfa/options.hpp>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

namespace kfa {
namespace dist {

/// Per-step timings a ring call can report (pass a RingStats* as the last argument). Collecting them
/// adds a fence after each step's compute.
struct RingStepStats {
  double compute_s = 0;   ///< this step's block computations (attention kernels); on device backends, where
                          ///< the host drives MPI while the kernels run, also any transfer time they did not hide
  double merge_s = 0;     ///< this step's merges of partial results (forward, host backends only)
  double wait_s = 0;      ///< time blocked waiting for this step's transfers after the compute (not hidden)
  std::size_t bytes = 0;  ///< bytes this rank sent in this step
  int blocks = 0;         ///< (query segment, key segment) blocks computed; fully masked ones are skipped
  double sync_s = 0;      ///< the end-of-step agreement: waiting for the slowest rank (load imbalance)
};
struct RingStats {
  std::vector<RingStepStats> steps;
  double total_s = 0;
  std::string transport;  ///< how K/V (and dK/dV) travelled (Ring::transport)
  /// Called on every rank after each ring step with (steps done, steps in all); e.g. a progress bar.
  std::function<void(int, int)> on_step;
};

namespace detail {

/// Runs `local_check` on every rank and agrees on the outcome: if any rank failed, every rank throws the
/// same kfa::Error naming the first failing rank. Collective; never leaves a rank waiting.
template <class F>
void collective_check(const Ring& ring, const char* fn, F&& local_check) {
  kfa::dist::agree(ring.comm(), capture(local_check), std::string(fn) + ": ");
}

/// Throws (on every rank) unless `values` are the same on all ranks; names[i] says what values[i] is.
inline void check_same_everywhere(const Ring& ring, const char* fn, const std::vector<long>& values,
                                  const std::vector<const char*>& names) {
  std::vector<long> lo(values.size()), hi(values.size());
  Ring::check_mpi(
      MPI_Allreduce(values.data(), lo.data(), static_cast<int>(values.size()), MPI_LONG, MPI_MIN, ring.comm()),
      "MPI_Allreduce");
  Ring::check_mpi(
      MPI_Allreduce(values.data(), hi.data(), static_cast<int>(values.size()), MPI_LONG, MPI_MAX, ring.comm()),
      "MPI_Allreduce");
  for (std::size_t i = 0; i < values.size(); ++i)
    if (lo[i] != hi[i])
      kfa::detail::fail(fn, ": ", names[i], " differs across ranks (from ", lo[i], " to ", hi[i], "; this rank has ",
                        values[i], ")");
}

template <class T>
long dtype_code() {
  return static_cast<long>(sizeof(T)) * 16 + (std::is_same<T, double>::value  ? 1
                                              : std::is_same<T, float>::value ? 2
                                                                              : 3);
}

inline long bits_of(double x) {
  long b;
  static_assert(sizeof(b) == sizeof(x), "64-bit long");
  std::memcpy(&b, &x, sizeof(b));
  return b;
}

/// Shapes and options every rank must agree on, then the shard lengths; returns the global layout (of the
/// lengths alone, as contiguous, for a variable-length call: its documents fix the rest).
template <class QV, class KV>
ShardMap agree_on_shapes(const Ring& ring, const char* fn, const QV& q, const KV& k, const AttentionOptions& opts,
                         bool documents = false) {
  using T = typename QV::non_const_value_type;
  check_same_everywhere(
      ring, fn,
      {dtype_code<T>(), static_cast<long>(q.extent(0)), static_cast<long>(q.extent(2)), static_cast<long>(k.extent(2)),
       static_cast<long>(q.extent(3)), opts.causal ? 1L : 0L, opts.window_left, opts.window_right,
       bits_of(opts.softmax_scale), bits_of(opts.softcap), static_cast<long>(ring.layout())},
      {"element type", "batch (q.extent(0))", "heads_q (q.extent(2))", "heads_kv (k.extent(2))",
       "head_dim (q.extent(3))", "opts.causal", "opts.window_left", "opts.window_right", "opts.softmax_scale",
       "opts.softcap", "layout"});
  std::array<long, 2> mine{static_cast<long>(q.extent(1)), static_cast<long>(k.extent(1))};
  std::vector<long> all(2 * static_cast<std::size_t>(ring.size()));
  Ring::check_mpi(MPI_Allgather(mine.data(), 2, MPI_LONG, all.data(), 2, MPI_LONG, ring.comm()), "MPI_Allgather");
  std::vector<long> q_len(ring.size()), k_len(ring.size());
  for (int r = 0; r < ring.size(); ++r) q_len[r] = all[2 * r], k_len[r] = all[2 * r + 1];
  ShardMap map;
  collective_check(ring, fn, [&] { map = ShardMap(documents ? Layout::contiguous : ring.layout(), q_len, k_len); });
  return map;
}

/// End of a ring step: agrees on whether any rank failed during it; if so, every rank throws the same
/// kfa::Error naming the first failing rank. The step's transfers must be complete (finish()) before.
inline void agree_on_step(const Ring& ring, const char* fn, int step, const std::string& local_error) {
  kfa::dist::agree(ring.comm(), local_error, std::string(fn) + ": ring step " + std::to_string(step) + ": ");
}

/// The KFA_RING_FAULT test hook: throws on the chosen rank at the chosen step.
inline void injected_fault(const Ring& ring, int step) {
  if (ring.fault_at(step))
    kfa::detail::fail("kfa::dist: fault injected at ring step ", step, " on rank ", ring.rank(), " (KFA_RING_FAULT)");
}

/// Allocations of a ring call, agreed: when one rank cannot allocate, every rank throws.
template <class F>
void agreed_allocation(const Ring& ring, const char* fn, F&& alloc) {
  const std::string err = capture(alloc);
  agree_on_step(ring, fn, -1, err.empty() ? err : "allocating the ring buffers: " + err);
}

/// Wall-clock stopwatch for RingStats; fences `space` first so device work is counted where it ran.
template <class ExecSpace>
double stamp(const ExecSpace& space, bool on) {
  if (!on) return 0;
  space.fence();
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// A ring of one rank: `kernel` (one call over the whole sequence) as ring step 0, with the same failure
/// agreement and statistics as a longer ring.
template <class ExecSpace, class F>
void single_rank(const ExecSpace& space, const Ring& ring, const char* fn, RingStats* stats, double t_begin,
                 F&& kernel) {
  const std::string err = capture([&] {
    injected_fault(ring, 0);
    kernel();
    space.fence();
  });
  agree_on_step(ring, fn, 0, err);
  if (stats) {
    stats->steps.assign(1, RingStepStats{stamp(space, true) - t_begin, 0.0, 0.0, 0, 1});
    stats->total_s = stats->steps[0].compute_s;
    if (stats->on_step) stats->on_step(1, 1);
  }
}

/// The documents of a variable-length ring call: cu_seqlens over the whole packed sequence (the same on every
/// rank), on the host for the ring's own decisions and where the kernels read them. count = 0: one sequence.
/// Over a map of documents (zigzag), `tables` holds what a block's kernels need to know of its documents: per
/// rank and segment the bounds of its pieces and where they sit in their documents (document_tables); one copy
/// of it goes where the kernels run.
struct RingDocuments {
  std::vector<int> cu_q, cu_k;
  kfa::detail::Documents device;
  std::vector<int> tables;
  kfa::detail::Documents host() const { return {cu_q.data(), cu_k.data(), device.count}; }
};

/// The tables of a map over documents: for each rank and segment its queries' table as a sharded
/// kfa::detail::Documents reads it (count + 1 prefix sums of the pieces, then for each document its length
/// less the position in it of its piece's first token), then the same of the keys.
inline std::vector<int> document_tables(const ShardMap& map, const std::vector<int>& cu_q, const std::vector<int>& cu_k,
                                        int p) {
  const int n = map.documents();
  std::vector<int> t;
  if (n == 0) return t;
  for (const bool keys : {false, true})
    for (int r = 0; r < p; ++r)
      for (int seg = 0; seg < 2; ++seg) {
        const std::vector<Segment> pieces = keys ? map.k_pieces(r, seg) : map.q_pieces(r, seg);
        const std::vector<int>& cu = keys ? cu_k : cu_q;
        int local = 0;
        t.push_back(0);
        for (const Segment& x : pieces) t.push_back(local += static_cast<int>(x.length));
        for (int s = 0; s < n; ++s) t.push_back(cu[s + 1] - static_cast<int>(pieces[s].global_begin));
      }
  return t;
}

/// A copy of docs.tables in memory space Mem (empty without tables).
template <class Mem>
Kokkos::View<const int*, Mem> document_tables_in(const RingDocuments& docs) {
  Kokkos::View<int*, Mem> t("kfa::dist::documents", docs.tables.size());
  Kokkos::deep_copy(
      t, Kokkos::View<const int*, Kokkos::HostSpace, Kokkos::MemoryUnmanaged>(docs.tables.data(), docs.tables.size()));
  return t;
}

/// The positions of the block (rank qr's query segment qi, rank kr's key segment ki): `whole` are the
/// documents of the stream and `tables` the document_tables, where the reader of the positions reads them.
inline kfa::detail::Positions block_positions(const ShardMap& map, const kfa::detail::Documents& whole,
                                              const int* tables, int p, int qr, int qi, int kr, int ki) {
  const Segment &qs = map.q_segments(qr)[qi], &ks = map.k_segments(kr)[ki];
  const int n = map.documents();
  if (n == 0) return {qs.global_begin, ks.global_begin, map.q_total(), map.k_total(), whole};
  const int* q = tables + (2 * qr + qi) * (2 * n + 1);
  const int* k = tables + (2 * p + 2 * kr + ki) * (2 * n + 1);
  return {0, 0, map.q_total(), map.k_total(), {q, k, n, 1}};
}

/// Whether any query of a block of nq queries and nk keys at `pos` may see any key (exact for one sequence;
/// with documents, false only where no document has both). Reads `pos` on the host.
inline bool block_visible(const kfa::detail::Positions& pos, long nq, long nk, const AttentionOptions& opts) {
  if (nq == 0 || nk == 0) return false;
  const kfa::detail::KeyMask mask(nq, nk, pos, opts.causal, opts.window_left, opts.window_right);
  return mask.key_begin(0) < mask.key_end(nq);
}

/// The last ring step at which any rank sees any key of the shard visiting it. Beyond it (a sliding window
/// shorter than the ring, say) every block is masked, so the ring stops there and exchanges nothing more.
/// Every rank computes the same answer from the shared shard map, without communicating.
inline int last_needed_step(const ShardMap& map, const AttentionOptions& opts, const RingDocuments& docs, int p) {
  int last = 0;
  for (int s = 1; s < p; ++s)
    for (int r = 0; r < p && last < s; ++r) {
      const int kr = (r - s + p) % p;
      for (std::size_t qi = 0; qi < map.q_segments(r).size(); ++qi)
        for (std::size_t ki = 0; ki < map.k_segments(kr).size(); ++ki) {
          const kfa::detail::Positions pos = block_positions(map, docs.host(), docs.tables.data(), p, r,
                                                             static_cast<int>(qi), kr, static_cast<int>(ki));
          if (block_visible(pos, map.q_segments(r)[qi].length, map.k_segments(kr)[ki].length, opts)) last = s;
        }
    }
  return last;
}

}  // namespace detail
}  // namespace dist
}  // namespace kfa
