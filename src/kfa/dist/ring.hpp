#pragma once
/// kfa::dist — ring attention over MPI: one sequence sharded over the ranks of a communicator.
///
/// Each rank holds a shard of Q, K, V (and O, LSE, dO, dQ, dK, dV). K/V shards travel around the ring with
/// nonblocking point-to-point messages, double-buffered so the next shard's transfer overlaps the compute
/// on the current one. Every step's partial (O, LSE) for the local queries merges into the running result
/// with kfa::merge_lse — the same combine rule the kernel applies per tile — in fp32 (fp64 for double).
/// In the backward pass dQ stays local while the dK/dV accumulators travel with K/V and come home.
/// Masks use global token positions, so causal and sliding windows are exact for any shard sizes.
#include <mpi.h>
#if defined(OPEN_MPI) && defined(__has_include)
#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>  // MPIX_Query_cuda_support
#endif
#endif

#include <kfa/kfa.hpp>
#include <kfa/dist/shard.hpp>

#include <array>
#include <functional>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace kfa {
namespace dist {

/// Whether device buffers may go to MPI directly.
enum class GpuAwareMpi {
  automatic,  ///< ask the MPI library at run time (Open MPI's MPIX_Query_cuda_support); no if it can't say
  yes,
  no  ///< stage device buffers through host mirrors
};

/// What the MPI library says about CUDA-aware transfers (false when it has no way to tell).
inline bool mpi_reports_gpu_aware() {
#if defined(MPIX_CUDA_AWARE_SUPPORT) && MPIX_CUDA_AWARE_SUPPORT
  return MPIX_Query_cuda_support() == 1;
#else
  return false;
#endif
}

/// A ring over a duplicate of the user's communicator. Collective over comm.
class Ring {
 public:
  /// Duplicates `comm` (freed with the last copy of this Ring). Device buffers go to MPI directly when
  /// `gpu_aware` resolves to yes, else through host mirrors (host-accessible buffers always go directly).
  explicit Ring(MPI_Comm comm, Layout layout = Layout::contiguous, GpuAwareMpi gpu_aware = GpuAwareMpi::automatic)
      : m_layout(layout),
        m_gpu_aware(gpu_aware == GpuAwareMpi::yes || (gpu_aware == GpuAwareMpi::automatic && mpi_reports_gpu_aware())) {
    MPI_Comm dup;
    check_mpi(MPI_Comm_dup(comm, &dup), "MPI_Comm_dup");
    m_comm = std::shared_ptr<MPI_Comm>(new MPI_Comm(dup), [](MPI_Comm* c) {
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (!finalized) MPI_Comm_free(c);
      delete c;
    });
    MPI_Comm_rank(dup, &m_rank);
    MPI_Comm_size(dup, &m_size);
  }
  MPI_Comm comm() const { return *m_comm; }
  int rank() const { return m_rank; }
  int size() const { return m_size; }
  Layout layout() const { return m_layout; }
  bool gpu_aware() const { return m_gpu_aware; }

  static void check_mpi(int rc, const char* call) {
    if (rc != MPI_SUCCESS) {
      char msg[MPI_MAX_ERROR_STRING];
      int len = 0;
      MPI_Error_string(rc, msg, &len);
      throw std::runtime_error(std::string("kfa::dist: ") + call + " failed: " + std::string(msg, len));
    }
  }

 private:
  std::shared_ptr<MPI_Comm> m_comm;
  Layout m_layout;
  bool m_gpu_aware;
  int m_rank = 0, m_size = 1;
};

/// Per-step timings a ring call can report (pass a RingStats* as the last argument). Collecting them
/// adds a fence after each step's compute.
struct RingStepStats {
  double compute_s = 0;  ///< this step's block computations (attention kernels)
  double merge_s = 0;    ///< this step's merges of partial results (forward only)
  double wait_s = 0;     ///< time blocked waiting for this step's transfers after the compute
  std::size_t bytes = 0; ///< bytes this rank sent in this step
  int blocks = 0;        ///< (query segment, key segment) blocks computed; fully masked ones are skipped
};
struct RingStats {
  std::vector<RingStepStats> steps;
  double total_s = 0;
  /// Called on every rank after each ring step with (steps done, steps in all); e.g. a progress bar.
  std::function<void(int, int)> on_step;
};

namespace detail {

/// Runs `local_check` on every rank and agrees on the outcome: if any rank failed, every rank throws the
/// same kfa::Error naming the first failing rank. Collective; never leaves a rank waiting.
template <class F>
void collective_check(const Ring& ring, const char* fn, F&& local_check) {
  std::string msg;
  try {
    local_check();
  } catch (const kfa::Error& e) {
    msg = e.what();
  }
  constexpr int cap = 512;
  std::array<char, cap> mine{};
  std::snprintf(mine.data(), cap, "%s", msg.c_str());
  std::vector<char> all(static_cast<std::size_t>(cap) * ring.size());
  Ring::check_mpi(MPI_Allgather(mine.data(), cap, MPI_CHAR, all.data(), cap, MPI_CHAR, ring.comm()), "MPI_Allgather");
  for (int r = 0; r < ring.size(); ++r) {
    const char* m = all.data() + static_cast<std::size_t>(r) * cap;
    if (m[0] != '\0') kfa::detail::fail(fn, ": rank ", r, " of ", ring.size(), ": ", std::string(m, strnlen(m, cap)));
  }
}

/// Throws (on every rank) unless `values` are the same on all ranks; names[i] says what values[i] is.
inline void check_same_everywhere(const Ring& ring, const char* fn, const std::vector<long>& values,
                                  const std::vector<const char*>& names) {
  std::vector<long> lo(values.size()), hi(values.size());
  Ring::check_mpi(MPI_Allreduce(values.data(), lo.data(), static_cast<int>(values.size()), MPI_LONG, MPI_MIN, ring.comm()),
                  "MPI_Allreduce");
  Ring::check_mpi(MPI_Allreduce(values.data(), hi.data(), static_cast<int>(values.size()), MPI_LONG, MPI_MAX, ring.comm()),
                  "MPI_Allreduce");
  for (std::size_t i = 0; i < values.size(); ++i)
    if (lo[i] != hi[i])
      kfa::detail::fail(fn, ": ", names[i], " differs across ranks (from ", lo[i], " to ", hi[i], "; this rank has ",
                        values[i], ")");
}

template <class T>
long dtype_code() {
  return static_cast<long>(sizeof(T)) * 16 + (std::is_same<T, double>::value ? 1 : std::is_same<T, float>::value ? 2 : 3);
}

inline long bits_of(double x) {
  long b;
  static_assert(sizeof(b) == sizeof(x), "64-bit long");
  std::memcpy(&b, &x, sizeof(b));
  return b;
}

/// Shapes and options every rank must agree on, then the shard lengths; returns the global layout.
template <class QV, class KV>
ShardMap agree_on_shapes(const Ring& ring, const char* fn, const QV& q, const KV& k, const AttentionOptions& opts) {
  using T = typename QV::non_const_value_type;
  check_same_everywhere(ring, fn,
                        {dtype_code<T>(), static_cast<long>(q.extent(0)), static_cast<long>(q.extent(2)),
                         static_cast<long>(k.extent(2)), static_cast<long>(q.extent(3)), opts.causal ? 1L : 0L,
                         opts.window_left, opts.window_right, bits_of(opts.softmax_scale), bits_of(opts.softcap),
                         static_cast<long>(ring.layout())},
                        {"element type", "batch (q.extent(0))", "heads_q (q.extent(2))", "heads_kv (k.extent(2))",
                         "head_dim (q.extent(3))", "opts.causal", "opts.window_left", "opts.window_right",
                         "opts.softmax_scale", "opts.softcap", "layout"});
  std::array<long, 2> mine{static_cast<long>(q.extent(1)), static_cast<long>(k.extent(1))};
  std::vector<long> all(2 * static_cast<std::size_t>(ring.size()));
  Ring::check_mpi(MPI_Allgather(mine.data(), 2, MPI_LONG, all.data(), 2, MPI_LONG, ring.comm()), "MPI_Allgather");
  std::vector<long> q_len(ring.size()), k_len(ring.size());
  for (int r = 0; r < ring.size(); ++r) q_len[r] = all[2 * r], k_len[r] = all[2 * r + 1];
  ShardMap map;
  collective_check(ring, fn, [&] { map = ShardMap(ring.layout(), q_len, k_len); });
  return map;
}

/// dst(b, i, h, c) (+)= src(b, i, h, c) for rank-4 Views on `space`.
template <class ExecSpace, class Dst, class Src>
void add_into(const ExecSpace& space, const Dst& dst, const Src& src, const char* label) {
  using D = typename Dst::non_const_value_type;
  if (dst.size() == 0) return;
  Kokkos::parallel_for(label,
                       Kokkos::MDRangePolicy<ExecSpace, Kokkos::Rank<4>>(
                           space, {0, 0, 0, 0},
                           {static_cast<long>(dst.extent(0)), static_cast<long>(dst.extent(1)),
                            static_cast<long>(dst.extent(2)), static_cast<long>(dst.extent(3))}),
                       KOKKOS_LAMBDA(const long a, const long b, const long c, const long d) {
                         dst(a, b, c, d) += static_cast<D>(src(a, b, c, d));
                       });
}

/// dst = src (rank 4), converting element types.
template <class ExecSpace, class Dst, class Src>
void copy_into(const ExecSpace& space, const Dst& dst, const Src& src, const char* label) {
  using D = typename Dst::non_const_value_type;
  if (dst.size() == 0) return;
  Kokkos::parallel_for(label,
                       Kokkos::MDRangePolicy<ExecSpace, Kokkos::Rank<4>>(
                           space, {0, 0, 0, 0},
                           {static_cast<long>(dst.extent(0)), static_cast<long>(dst.extent(1)),
                            static_cast<long>(dst.extent(2)), static_cast<long>(dst.extent(3))}),
                       KOKKOS_LAMBDA(const long a, const long b, const long c, const long d) {
                         dst(a, b, c, d) = static_cast<D>(src(a, b, c, d));
                       });
}

/// Nonblocking exchange of one contiguous buffer: send `send` to the next rank, receive `recv` from the
/// previous one, through host mirrors unless the ring is GPU-aware. Keeps everything alive until wait().
template <class ExecSpace, class View>
class RingExchange {
 public:
  /// Sends to rank + shift and receives from rank − shift (mod size); shift 1 is one step around the ring.
  RingExchange(const ExecSpace& space, const Ring& ring, const View& send, std::size_t send_count, const View& recv,
               std::size_t recv_count, int tag, int shift = 1)
      : m_space(space), m_send(send), m_recv(recv) {
    using T = typename View::non_const_value_type;
    constexpr bool host = Kokkos::SpaceAccessibility<Kokkos::HostSpace, typename View::memory_space>::accessible;
    const bool stage = !host && !ring.gpu_aware();
    const std::size_t sb = send_count * sizeof(T), rb = recv_count * sizeof(T);
    if (sb > 2147483647UL || rb > 2147483647UL)
      kfa::detail::fail("kfa::dist: a ring message of ", std::max(sb, rb), " bytes exceeds 2^31 - 1; use more ranks");
    m_space.fence();  // the data to send is complete before MPI reads it
    const int sz = ring.size(), sh = ((shift % sz) + sz) % sz;
    const int next = (ring.rank() + sh) % sz, prev = (ring.rank() + sz - sh) % sz;
    if (stage) {
      m_send_host = Kokkos::create_mirror_view(send);
      m_recv_host = Kokkos::create_mirror_view(recv);
      Kokkos::deep_copy(m_send_host, send);
    }
    void* rptr = stage ? static_cast<void*>(m_recv_host.data()) : static_cast<void*>(recv.data());
    const void* sptr = stage ? static_cast<const void*>(m_send_host.data()) : static_cast<const void*>(send.data());
    m_staged = stage;
    Ring::check_mpi(MPI_Irecv(rptr, static_cast<int>(rb), MPI_BYTE, prev, tag, ring.comm(), &m_req[0]), "MPI_Irecv");
    Ring::check_mpi(MPI_Isend(sptr, static_cast<int>(sb), MPI_BYTE, next, tag, ring.comm(), &m_req[1]), "MPI_Isend");
  }
  /// Lets MPI progress the transfer (between block computations).
  void poke() {
    int done = 0;
    Ring::check_mpi(MPI_Testall(2, m_req, &done, MPI_STATUSES_IGNORE), "MPI_Testall");
    m_done = done != 0;
  }
  void wait() {
    if (!m_done) Ring::check_mpi(MPI_Waitall(2, m_req, MPI_STATUSES_IGNORE), "MPI_Waitall");
    if (m_staged) Kokkos::deep_copy(m_recv, m_recv_host);
  }

 private:
  ExecSpace m_space;
  View m_send, m_recv;
  typename View::HostMirror m_send_host, m_recv_host;
  bool m_staged = false;
  bool m_done = false;
  MPI_Request m_req[2];
};

/// Wall-clock stopwatch for RingStats; fences `space` first so device work is counted where it ran.
template <class ExecSpace>
double stamp(const ExecSpace& space, bool on) {
  if (!on) return 0;
  space.fence();
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// Buffers of one traveling K/V shard (and, in the backward pass, its dK/dV accumulators), sized for the
/// longest shard; a shard of n tokens uses the first 2·B·n·H_kv·d elements as [2][B][n][H_kv][d].
template <class T, class Mem>
struct KvBuffer {
  using Flat = Kokkos::View<T*, Kokkos::LayoutRight, Mem>;
  using Tile = Kokkos::View<T****, Kokkos::LayoutRight, Mem, Kokkos::MemoryUnmanaged>;
  Flat data;
  long batch = 0, heads = 0, dim = 0;
  KvBuffer(const std::string& label, long b, long n_max, long h, long d)
      : data(Kokkos::view_alloc(label, Kokkos::WithoutInitializing), static_cast<std::size_t>(2 * b * n_max * h * d)),
        batch(b), heads(h), dim(d) {}
  std::size_t count(long n) const { return static_cast<std::size_t>(2 * batch * n * heads * dim); }
  /// which = 0: K (or dK), 1: V (or dV), for a shard of n tokens.
  Tile tile(long n, int which) const {
    return Tile(data.data() + which * batch * n * heads * dim, batch, n, heads, dim);
  }
};

template <class V>
auto seq_slice(const V& x, const Segment& s) {
  return Kokkos::subview(x, Kokkos::ALL, std::make_pair(s.local_begin, s.local_begin + s.length), Kokkos::ALL,
                         Kokkos::ALL);
}
template <class V>
auto lse_slice(const V& x, const Segment& s) {
  return Kokkos::subview(x, Kokkos::ALL, Kokkos::ALL, std::make_pair(s.local_begin, s.local_begin + s.length));
}

/// Positions of a (query segment, key segment) block, and whether any query of it sees any key.
inline bool block_visible(const Segment& qs, const Segment& ks, const ShardMap& map, const AttentionOptions& opts,
                          kfa::detail::Positions& pos) {
  pos = {qs.global_begin, ks.global_begin, map.q_total(), map.k_total()};
  if (qs.length == 0 || ks.length == 0) return false;
  const kfa::detail::KeyMask mask(qs.length, ks.length, pos, opts.causal, opts.window_left, opts.window_right);
  return mask.key_begin(0) < mask.key_end(qs.length);
}

/// The last ring step at which any rank sees any key of the shard visiting it. Beyond it (a sliding window
/// shorter than the ring, say) every block is masked, so the ring stops there and exchanges nothing more.
/// Every rank computes the same answer from the shared shard map, without communicating.
inline int last_needed_step(const ShardMap& map, const AttentionOptions& opts, int p) {
  int last = 0;
  for (int s = 1; s < p; ++s)
    for (int r = 0; r < p && last < s; ++r)
      for (const Segment& qs : map.q_segments(r))
        for (const Segment& ks : map.k_segments((r - s + p) % p)) {
          kfa::detail::Positions pos;
          if (block_visible(qs, ks, map, opts, pos)) last = s;
        }
  return last;
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
  using T = typename QV::non_const_value_type;
  using Acc = accumulator_t<T>;
  using Mem = typename ExecSpace::memory_space;
  compat::ScopedRegion region(std::string(fn) + "[" + to_string(ring.layout()) + ",P" + std::to_string(ring.size()) +
                              "," + dtype_name<T>() + "]");
  const long b = q.extent(0), nq = q.extent(1), hq = q.extent(2), hkv = k.extent(2), d = q.extent(3);
  const int p = ring.size(), me = ring.rank();

  detail::KvBuffer<T, Mem> cur("kfa::dist::ring_forward::kv_a", b, map.k_length_max(), hkv, d),
      nxt("kfa::dist::ring_forward::kv_b", b, map.k_length_max(), hkv, d);
  detail::copy_into(space, cur.tile(map.k_length(me), 0), k, "kfa::dist::ring_forward::load_k");
  detail::copy_into(space, cur.tile(map.k_length(me), 1), v, "kfa::dist::ring_forward::load_v");
  Kokkos::View<Acc****, Kokkos::LayoutRight, Mem> o_acc("kfa::dist::ring_forward::o_acc", b, nq, hq, d),
      o_part("kfa::dist::ring_forward::o_part", b, nq, hq, d);
  Kokkos::View<Acc***, Kokkos::LayoutRight, Mem> lse_acc("kfa::dist::ring_forward::lse_acc", b, hq, nq),
      lse_part("kfa::dist::ring_forward::lse_part", b, hq, nq);
  Kokkos::deep_copy(space, lse_acc, -compat::infinity<Acc>());  // the empty state: merges as the identity
  const bool timed = stats != nullptr;
  if (timed) stats->steps.assign(p, RingStepStats{});
  const double t_begin = detail::stamp(space, timed);

  const int last = detail::last_needed_step(map, opts, p);
  for (int s = 0; s <= last; ++s) {
    const double t0 = detail::stamp(space, timed);
    int blocks = 0;
    double merge_s = 0;
    const int owner = (me - s + p) % p, incoming = (me - s - 1 + 2 * p) % p;
    std::unique_ptr<detail::RingExchange<ExecSpace, typename decltype(cur)::Flat>> ex;
    if (s < last)
      ex.reset(new detail::RingExchange<ExecSpace, typename decltype(cur)::Flat>(
          space, ring, cur.data, cur.count(map.k_length(owner)), nxt.data, nxt.count(map.k_length(incoming)), s));
    const long nk = map.k_length(owner);
    const auto kt = cur.tile(nk, 0), vt = cur.tile(nk, 1);
    for (const Segment& qs : map.q_segments(me))
      for (const Segment& ks : map.k_segments(owner)) {
        kfa::detail::Positions pos;
        if (!detail::block_visible(qs, ks, map, opts, pos)) continue;  // fully masked: skipped
        const auto op = detail::seq_slice(o_part, qs);
        const auto lp = detail::lse_slice(lse_part, qs);
        kfa::detail::forward_impl(fn, space, detail::seq_slice(q, qs), detail::seq_slice(kt, ks),
                                  detail::seq_slice(vt, ks), op, lp, opts, pos);
        const double tm0 = detail::stamp(space, timed);
        kfa::merge_attention(space, detail::seq_slice(o_acc, qs), detail::lse_slice(lse_acc, qs), op, lp);
        merge_s += detail::stamp(space, timed) - tm0;
        ++blocks;
        if (ex) ex->poke();
      }
    const double t1 = detail::stamp(space, timed);
    if (ex) {
      ex->wait();
      std::swap(cur, nxt);
    }
    if (timed)
      stats->steps[s] = {t1 - t0 - merge_s, merge_s, detail::stamp(space, true) - t1,
                         s < last ? cur.count(map.k_length(owner)) * sizeof(T) : 0, blocks};
    if (timed && stats->on_step) stats->on_step(s + 1, last + 1);
  }
  detail::copy_into(space, o, o_acc, "kfa::dist::ring_forward::store_o");
  Kokkos::parallel_for("kfa::dist::ring_forward::store_lse",
                       Kokkos::MDRangePolicy<ExecSpace, Kokkos::Rank<3>>(space, {0, 0, 0}, {b, hq, nq}),
                       KOKKOS_LAMBDA(const long x, const long h, const long i) { lse(x, h, i) = lse_acc(x, h, i); });
  space.fence();
  if (timed) stats->total_s = detail::stamp(space, true) - t_begin;
}

/// Ring attention backward: every rank passes its shards of q, k, v, the ring forward's o and lse, and
/// d_o, and gets its shards of dq, dk, dv. dQ stays local; the dK/dV accumulators travel with K/V and come
/// home after P steps. Deterministic for a fixed rank count and layout. Collective over ring.comm().
template <class ExecSpace, class QV, class KV, class VV, class OV, class DOV, class LV, class DQV, class DKV,
          class DVV>
void ring_attention_backward(const ExecSpace& space, const Ring& ring, const QV& q, const KV& k, const VV& v,
                             const OV& o, const DOV& d_o, const LV& lse, const DQV& dq, const DKV& dk, const DVV& dv,
                             const AttentionOptions& opts = {}, RingStats* stats = nullptr) {
  kfa::detail::static_check_backward<ExecSpace, QV, KV, VV, OV, DOV, LV, DQV, DKV, DVV>();
  constexpr const char* fn = "kfa::dist::ring_attention_backward";
  detail::collective_check(ring, fn, [&] { kfa::detail::check_backward(fn, q, k, v, o, d_o, lse, dq, dk, dv, opts); });
  const ShardMap map = detail::agree_on_shapes(ring, fn, q, k, opts);
  using T = typename QV::non_const_value_type;
  using Acc = accumulator_t<T>;
  using Mem = typename ExecSpace::memory_space;
  compat::ScopedRegion region(std::string(fn) + "[" + to_string(ring.layout()) + ",P" + std::to_string(ring.size()) +
                              "," + dtype_name<T>() + "]");
  const long b = q.extent(0), nq = q.extent(1), hq = q.extent(2), hkv = k.extent(2), d = q.extent(3);
  const long nmax = map.k_length_max();
  const int p = ring.size(), me = ring.rank();

  detail::KvBuffer<T, Mem> kv("kfa::dist::ring_backward::kv_a", b, nmax, hkv, d),
      kv_next("kfa::dist::ring_backward::kv_b", b, nmax, hkv, d);
  detail::KvBuffer<Acc, Mem> dkv("kfa::dist::ring_backward::dkv_a", b, nmax, hkv, d),
      dkv_next("kfa::dist::ring_backward::dkv_b", b, nmax, hkv, d);
  detail::copy_into(space, kv.tile(map.k_length(me), 0), k, "kfa::dist::ring_backward::load_k");
  detail::copy_into(space, kv.tile(map.k_length(me), 1), v, "kfa::dist::ring_backward::load_v");
  Kokkos::deep_copy(space, dkv.data, Acc(0));
  Kokkos::View<Acc****, Kokkos::LayoutRight, Mem> dq_acc("kfa::dist::ring_backward::dq_acc", b, nq, hq, d),
      dq_part("kfa::dist::ring_backward::dq_part", b, nq, hq, d), dk_part("kfa::dist::ring_backward::dk_part", b, nmax, hkv, d),
      dv_part("kfa::dist::ring_backward::dv_part", b, nmax, hkv, d);
  const bool timed = stats != nullptr;
  if (timed) stats->steps.assign(p, RingStepStats{});
  const double t_begin = detail::stamp(space, timed);

  const int last = detail::last_needed_step(map, opts, p);
  for (int s = 0; s <= last; ++s) {
    const double t0 = detail::stamp(space, timed);
    int blocks = 0;
    const int owner = (me - s + p) % p, incoming = (me - s - 1 + 2 * p) % p;
    using Ex = detail::RingExchange<ExecSpace, typename decltype(kv)::Flat>;
    std::unique_ptr<Ex> ex;
    if (s < last)
      ex.reset(new Ex(space, ring, kv.data, kv.count(map.k_length(owner)), kv_next.data,
                      kv_next.count(map.k_length(incoming)), 2 * s));
    const long nk = map.k_length(owner);
    const auto kt = kv.tile(nk, 0), vt = kv.tile(nk, 1);      // element type T
    const auto dkt = dkv.tile(nk, 0), dvt = dkv.tile(nk, 1);  // accumulation type
    for (const Segment& qs : map.q_segments(me))
      for (const Segment& ks : map.k_segments(owner)) {
        kfa::detail::Positions pos;
        if (!detail::block_visible(qs, ks, map, opts, pos)) continue;
        const auto dqp = detail::seq_slice(dq_part, qs);
        const Segment kpart{ks.global_begin, ks.length, 0};
        const auto dkp = detail::seq_slice(dk_part, kpart), dvp = detail::seq_slice(dv_part, kpart);
        kfa::detail::backward_impl(fn, space, detail::seq_slice(q, qs), detail::seq_slice(kt, ks),
                                   detail::seq_slice(vt, ks), detail::seq_slice(o, qs), detail::seq_slice(d_o, qs),
                                   detail::lse_slice(lse, qs), dqp, dkp, dvp, opts, pos);
        detail::add_into(space, detail::seq_slice(dq_acc, qs), dqp, "kfa::dist::ring_backward::add_dq");
        detail::add_into(space, detail::seq_slice(dkt, ks), dkp, "kfa::dist::ring_backward::add_dk");
        detail::add_into(space, detail::seq_slice(dvt, ks), dvp, "kfa::dist::ring_backward::add_dv");
        ++blocks;
        if (ex) ex->poke();
      }
    const double t1 = detail::stamp(space, timed);
    // The accumulators move one hop per step with K/V; after the last needed step they go straight home
    // (one hop when the ring went all the way round, back `last` ranks when it stopped early).
    using ExA = detail::RingExchange<ExecSpace, typename decltype(dkv)::Flat>;
    const bool home = s == last;
    ExA ex_acc(space, ring, dkv.data, dkv.count(nk), dkv_next.data,
               dkv_next.count(map.k_length(home ? me : incoming)), 2 * s + 1, home ? -last : 1);
    ex_acc.wait();
    std::swap(dkv, dkv_next);
    if (ex) {
      ex->wait();
      std::swap(kv, kv_next);
    }
    if (timed)
      stats->steps[s] = {t1 - t0, 0.0, detail::stamp(space, true) - t1,
                         (s < last ? kv.count(nk) * sizeof(T) : 0) + dkv.count(nk) * sizeof(Acc), blocks};
    if (timed && stats->on_step) stats->on_step(s + 1, last + 1);
  }
  detail::copy_into(space, dq, dq_acc, "kfa::dist::ring_backward::store_dq");
  detail::copy_into(space, dk, dkv.tile(map.k_length(me), 0), "kfa::dist::ring_backward::store_dk");
  detail::copy_into(space, dv, dkv.tile(map.k_length(me), 1), "kfa::dist::ring_backward::store_dv");
  space.fence();
  if (timed) stats->total_s = detail::stamp(space, true) - t_begin;
}

}  // namespace dist
}  // namespace kfa
