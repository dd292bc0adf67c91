#pragma once
/// kfa::dist — ring attention over MPI: one sequence sharded over the ranks of a communicator.
///
/// Each rank holds a shard of Q, K, V (and O, LSE, dO, dQ, dK, dV). K/V shards travel around the ring with
/// nonblocking point-to-point messages, double-buffered so the next shard's transfer overlaps the compute
/// on the current one. Every step's partial (O, LSE) for the local queries merges into the running result
/// with kfa::merge_lse — the same combine rule the kernel applies per tile — in fp32 (fp64 for double).
/// In the backward pass dQ stays local while the dK/dV accumulators travel with K/V and come home.
/// Masks use global token positions, so causal and sliding windows are exact for any shard sizes.
///
/// Transport (RingTransport; reported by Ring::transport() and RingStats::transport): host memory goes to
/// MPI directly. Device memory goes through NCCL where the build has it (Kokkos CUDA + NCCL found by CMake:
/// ncclSend/ncclRecv on a stream of its own, ordered against the caller's execution-space instance with
/// events, the communicator bootstrapped through the ring's MPI_Comm), else to MPI directly where MPI is
/// GPU-aware, else through host staging buffers (pinned where the backend has pinned memory) kept in the
/// Ring between calls. MPI messages are split into chunks of at most Ring::max_message_bytes() (default
/// 1 GiB), so no message meets MPI's 2^31 count limit (NCCL counts are 64-bit). Nothing is sent at P = 1. A failure on any rank in the middle of a ring is agreed at the end of the step: every rank
/// completes the step's transfers (no request is left posted into freed memory) and throws the same
/// kfa::Error.
#include <mpi.h>
#if defined(OPEN_MPI) && defined(__has_include)
#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>  // MPIX_Query_cuda_support
#endif
#endif

#include <kfa/kfa.hpp>
#include <kfa/detail/ranges.hpp>
#include <kfa/dist/shard.hpp>

#if defined(KFA_HAVE_NCCL) && defined(KOKKOS_ENABLE_CUDA)
#include <nccl.h>
#define KFA_RING_NCCL 1
#endif

#include <array>
#include <functional>
#include <map>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <typeinfo>
#include <vector>

namespace kfa {
namespace dist {

/// Whether device buffers may go to MPI directly.
enum class GpuAwareMpi {
  automatic,  ///< ask the MPI library at run time (Open MPI's MPIX_Query_cuda_support); no if it can't say
  yes,
  no  ///< stage device buffers through host mirrors
};

/// How a ring's buffers travel between ranks.
enum class RingTransport {
  automatic,      ///< host memory: MPI; device memory: NCCL if built and no two ranks share a GPU, else GPU-aware
                  ///< MPI if reported, else staging
  host_memory,    ///< (resolved only) host-accessible buffers go to MPI directly
  nccl,           ///< device buffers through NCCL (needs a build with Kokkos CUDA and NCCL)
  gpu_aware_mpi,  ///< device buffers to MPI directly (the MPI library must be GPU-aware)
  host_staging    ///< device buffers copied to pinned host buffers and sent with MPI
};
inline const char* to_string(RingTransport t) {
  switch (t) {
    case RingTransport::automatic: return "automatic";
    case RingTransport::host_memory: return "host memory (MPI)";
    case RingTransport::nccl: return "NCCL (device memory, own stream)";
    case RingTransport::gpu_aware_mpi: return "device memory (GPU-aware MPI)";
    case RingTransport::host_staging: return "host staging (pinned, allocated once)";
  }
  return "?";
}
/// Whether this build can move buffers of memory space Mem with NCCL.
template <class Mem>
constexpr bool nccl_available() {
#if defined(KFA_RING_NCCL)
  return std::is_same<Mem, Kokkos::CudaSpace>::value;
#else
  return false;
#endif
}

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
  /// `gpu_aware` resolves to yes, else through host staging buffers (host-accessible buffers always go
  /// directly).
  ///
  /// Test hook: `KFA_RING_FAULT=r:s` in the environment makes rank r throw at ring step s of every ring
  /// call (a stand-in for an allocation or kernel failure in the middle of a ring).
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
#if defined(KFA_RING_NCCL)
    m_ranks_share_device = detect_shared_device(dup);
#endif
    if (const char* f = std::getenv("KFA_RING_FAULT")) {
      if (std::sscanf(f, "%d:%d", &m_fault_rank, &m_fault_step) != 2) m_fault_rank = m_fault_step = -1;
    }
    if (gpu_aware == GpuAwareMpi::yes) m_transport = RingTransport::gpu_aware_mpi;
    if (const char* t = std::getenv("KFA_RING_TRANSPORT")) {
      const std::string v(t);
      if (v == "nccl") m_transport = RingTransport::nccl;
      else if (v == "gpu-aware-mpi") m_transport = RingTransport::gpu_aware_mpi;
      else if (v == "staging") m_transport = RingTransport::host_staging;
      else if (v != "auto" && !v.empty())
        kfa::detail::fail("kfa::dist::Ring: KFA_RING_TRANSPORT = '", v, "'; expected auto, nccl, gpu-aware-mpi or staging");
    }
  }
  MPI_Comm comm() const { return *m_comm; }
  int rank() const { return m_rank; }
  int size() const { return m_size; }
  Layout layout() const { return m_layout; }
  bool gpu_aware() const { return m_gpu_aware; }

  /// Largest single MPI message; larger transfers are split into chunks of at most this many bytes
  /// (1 ≤ bytes ≤ 2^31 − 1; default 1 GiB). Small values force many chunks (tests do).
  void set_max_message_bytes(std::size_t bytes) {
    if (bytes < 1 || bytes > static_cast<std::size_t>(INT_MAX))
      kfa::detail::fail("kfa::dist::Ring::set_max_message_bytes: ", bytes, " is outside [1, ", INT_MAX, "]");
    m_max_message_bytes = bytes;
  }
  std::size_t max_message_bytes() const { return m_max_message_bytes; }

  /// The transport for device buffers (default automatic; the environment variable KFA_RING_TRANSPORT =
  /// auto | nccl | gpu-aware-mpi | staging sets it too). Host-accessible buffers always go to MPI directly.
  /// Asking for NCCL in a build without it fails at the next ring call, on every rank.
  void set_transport(RingTransport t) { m_transport = t; }
  RingTransport requested_transport() const { return m_transport; }
  /// Whether two ranks of this ring run on the same GPU (the CUDA device current when the Ring was made; a
  /// build with NCCL asks, others say false). NCCL cannot put them in one communicator: `automatic` then
  /// passes over it, and asking for it is an error on every rank.
  bool ranks_share_device() const { return m_ranks_share_device; }
  /// How buffers in memory space Mem travel with this ring (never `automatic`).
  template <class Mem>
  RingTransport resolved_transport() const {
    if (Kokkos::SpaceAccessibility<Kokkos::HostSpace, Mem>::accessible) return RingTransport::host_memory;
    if (m_transport == RingTransport::nccl ||
        (m_transport == RingTransport::automatic && nccl_available<Mem>() && !m_ranks_share_device))
      return RingTransport::nccl;
    if (m_transport == RingTransport::gpu_aware_mpi || (m_transport == RingTransport::automatic && m_gpu_aware))
      return RingTransport::gpu_aware_mpi;
    return RingTransport::host_staging;
  }
  /// How buffers in memory space Mem travel, in words: "host memory (MPI)", "NCCL (device memory, own
  /// stream)", "device memory (GPU-aware MPI)", "host staging (pinned, allocated once)"; "none (one rank)".
  template <class Mem>
  std::string transport() const;

  /// Whether ring calls keep their work buffers (K/V shards in flight, accumulators, partial results: on a
  /// device, per call cudaMalloc + cudaFree of several GB cost ~3% of a step at 131k tokens per H200) for
  /// the next call of this Ring and its copies. Default on; the memory stays held until release_buffers(),
  /// the last copy of the Ring, or Kokkos::finalize. Host staging buffers are kept either way.
  void set_cache_buffers(bool on) {
    m_cache_buffers = on;
    if (!on) release_buffers();
  }
  bool cache_buffers() const { return m_cache_buffers; }
  /// Frees the work buffers kept by earlier ring calls (not the staging buffers or the NCCL communicator).
  void release_buffers() const {
    for (auto& kv : *m_staging)
      if (kv.first.rfind("kfa::dist::buffer::", 0) == 0) kv.second.reset();
  }

  /// Buffers and handles kept between ring calls, by use: host staging (pinned allocation costs ~0.3 s per
  /// GB on the H200 machines: per call it cost more than the transfer), cached work buffers, the NCCL
  /// channel. Released at Kokkos::finalize at the latest.
  std::shared_ptr<void>& staging_slot(const std::string& key) const {
    if (!m_staging_hooked) {
      std::weak_ptr<std::map<std::string, std::shared_ptr<void>>> w = m_staging;
      Kokkos::push_finalize_hook([w] {
        if (auto c = w.lock()) c->clear();
      });
      m_staging_hooked = true;
    }
    return (*m_staging)[key];
  }

  /// The KFA_RING_FAULT test hook: true when this rank is to fail at `step`.
  bool fault_at(int step) const { return m_fault_rank == m_rank && m_fault_step == step; }

  static void check_mpi(int rc, const char* call) {
    if (rc != MPI_SUCCESS) {
      char msg[MPI_MAX_ERROR_STRING];
      int len = 0;
      MPI_Error_string(rc, msg, &len);
      throw std::runtime_error(std::string("kfa::dist: ") + call + " failed: " + std::string(msg, len));
    }
  }

 private:
#if defined(KFA_RING_NCCL)
  /// Collective over comm: whether two ranks' current CUDA devices have the same UUID (false where a rank
  /// cannot tell, as before this check existed).
  static bool detect_shared_device(MPI_Comm comm) {
    struct {
      unsigned char uuid[16];
      int ok;
    } mine{};
    int dev = -1;
    cudaDeviceProp prop{};
    mine.ok = cudaGetDevice(&dev) == cudaSuccess && cudaGetDeviceProperties(&prop, dev) == cudaSuccess;
    if (mine.ok) std::memcpy(mine.uuid, prop.uuid.bytes, sizeof mine.uuid);
    int size = 1;
    MPI_Comm_size(comm, &size);
    std::vector<decltype(mine)> all(static_cast<std::size_t>(size));
    check_mpi(MPI_Allgather(&mine, sizeof mine, MPI_BYTE, all.data(), sizeof mine, MPI_BYTE, comm), "MPI_Allgather");
    for (int a = 0; a < size; ++a)
      for (int b = a + 1; b < size; ++b)
        if (all[a].ok && all[b].ok && std::memcmp(all[a].uuid, all[b].uuid, sizeof mine.uuid) == 0) return true;
    return false;
  }
#endif
  std::shared_ptr<MPI_Comm> m_comm;
  Layout m_layout;
  bool m_gpu_aware;
  int m_rank = 0, m_size = 1;
  std::size_t m_max_message_bytes = std::size_t(1) << 30;
  int m_fault_rank = -1, m_fault_step = -1;
  RingTransport m_transport = RingTransport::automatic;
  bool m_ranks_share_device = false;
  bool m_cache_buffers = true;
  std::shared_ptr<std::map<std::string, std::shared_ptr<void>>> m_staging =
      std::make_shared<std::map<std::string, std::shared_ptr<void>>>();
  mutable bool m_staging_hooked = false;
};

/// Per-step timings a ring call can report (pass a RingStats* as the last argument). Collecting them
/// adds a fence after each step's compute.
struct RingStepStats {
  double compute_s = 0;  ///< this step's block computations (attention kernels); on device backends, where
                         ///< the host drives MPI while the kernels run, also any transfer time they did not hide
  double merge_s = 0;    ///< this step's merges of partial results (forward, host backends only)
  double wait_s = 0;     ///< time blocked waiting for this step's transfers after the compute (not hidden)
  std::size_t bytes = 0; ///< bytes this rank sent in this step
  int blocks = 0;        ///< (query segment, key segment) blocks computed; fully masked ones are skipped
  double sync_s = 0;     ///< the end-of-step agreement: waiting for the slowest rank (load imbalance)
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
  std::string msg;
  try {
    local_check();
  } catch (const std::exception& e) {  // kfa::Error, and MPI/CUDA/NCCL failures
    msg = e.what()[0] ? e.what() : "unknown error";
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
  kfa::detail::for_each_element4(label, space, dst,
                                 KOKKOS_LAMBDA(const std::int64_t a, const std::int64_t b, const std::int64_t c,
                                               const std::int64_t d) { dst(a, b, c, d) += static_cast<D>(src(a, b, c, d)); });
}

/// dst = src (rank 4), converting element types.
template <class ExecSpace, class Dst, class Src>
void copy_into(const ExecSpace& space, const Dst& dst, const Src& src, const char* label) {
  using D = typename Dst::non_const_value_type;
  if (dst.size() == 0) return;
  kfa::detail::for_each_element4(label, space, dst,
                                 KOKKOS_LAMBDA(const std::int64_t a, const std::int64_t b, const std::int64_t c,
                                               const std::int64_t d) { dst(a, b, c, d) = static_cast<D>(src(a, b, c, d)); });
}

/// Host memory for staging device buffers: pinned where the backend has it (asynchronous copies, DMA).
#if defined(KOKKOS_ENABLE_CUDA)
using StagingSpace = Kokkos::CudaHostPinnedSpace;
constexpr bool staging_is_pinned = true;
#else
using StagingSpace = Kokkos::HostSpace;
constexpr bool staging_is_pinned = false;
#endif

/// A flat buffer of at least `count` elements of T in Mem under `key`, held by the Ring (grown when too
/// small, the smaller one freed first). Keys starting "kfa::dist::buffer::" are work buffers: a ring call
/// releases them at its end (ReleaseWorkBuffers) unless the Ring caches them. Contents are unspecified.
template <class T, class Mem>
Kokkos::View<T*, Kokkos::LayoutRight, Mem> kept_buffer(const Ring& ring, const std::string& key, std::size_t count) {
  using Flat = Kokkos::View<T*, Kokkos::LayoutRight, Mem>;
  // keyed by the exact View type (half and bfloat16 have the same size but are different types)
  std::shared_ptr<void>& slot = ring.staging_slot(key + "::" + typeid(Flat).name());
  auto* v = static_cast<Flat*>(slot.get());
  if (!v || v->extent(0) < count) {
    slot.reset();
    slot = std::make_shared<Flat>(Kokkos::view_alloc(key, Kokkos::WithoutInitializing), count);
    v = static_cast<Flat*>(slot.get());
  }
  return *v;
}

/// Releases the Ring's work buffers when the ring call ends, normally or by an exception, unless the Ring
/// caches them (Ring::cache_buffers).
class ReleaseWorkBuffers {
 public:
  explicit ReleaseWorkBuffers(const Ring& ring) : m_ring(ring) {}
  ~ReleaseWorkBuffers() {
    if (!m_ring.cache_buffers()) m_ring.release_buffers();
  }
  ReleaseWorkBuffers(const ReleaseWorkBuffers&) = delete;
  ReleaseWorkBuffers& operator=(const ReleaseWorkBuffers&) = delete;

 private:
  const Ring& m_ring;
};

/// A rank-4 LayoutRight [n0, n1, n2, n3] View over a kept buffer (see kept_buffer).
template <class T, class Mem>
Kokkos::View<T****, Kokkos::LayoutRight, Mem, Kokkos::MemoryUnmanaged> kept_tensor(const Ring& ring, const std::string& key,
                                                                                  long n0, long n1, long n2, long n3) {
  const auto flat = kept_buffer<T, Mem>(ring, key, static_cast<std::size_t>(n0 * n1 * n2 * n3));
  return Kokkos::View<T****, Kokkos::LayoutRight, Mem, Kokkos::MemoryUnmanaged>(flat.data(), n0, n1, n2, n3);
}
/// A rank-3 LayoutRight View over a kept buffer.
template <class T, class Mem>
Kokkos::View<T***, Kokkos::LayoutRight, Mem, Kokkos::MemoryUnmanaged> kept_tensor(const Ring& ring, const std::string& key,
                                                                                 long n0, long n1, long n2) {
  const auto flat = kept_buffer<T, Mem>(ring, key, static_cast<std::size_t>(n0 * n1 * n2));
  return Kokkos::View<T***, Kokkos::LayoutRight, Mem, Kokkos::MemoryUnmanaged>(flat.data(), n0, n1, n2);
}

#if defined(KFA_RING_NCCL)
inline void check_cuda(cudaError_t rc, const char* call) {
  if (rc != cudaSuccess) throw std::runtime_error(std::string("kfa::dist: ") + call + " failed: " + cudaGetErrorString(rc));
}
inline void check_nccl(ncclResult_t rc, const char* call) {
  if (rc != ncclSuccess)
    throw std::runtime_error(std::string("kfa::dist: ") + call + " failed: " + ncclGetErrorString(rc) +
                             (rc == ncclSystemError || rc == ncclRemoteError ? "" : " (NCCL_DEBUG=WARN says more)"));
}
/// One NCCL communicator over the ring's ranks and the stream its transfers run on; created once per
/// Ring (collectively, by prepare_transport) and kept with the Ring's staging buffers, so it is released at
/// Kokkos::finalize at the latest.
struct NcclChannel {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  ~NcclChannel() {
    if (comm) ncclCommDestroy(comm);
    if (stream) cudaStreamDestroy(stream);
  }
};
inline NcclChannel* nccl_channel(const Ring& ring) {
  return static_cast<NcclChannel*>(ring.staging_slot("kfa::dist::nccl").get());
}
#endif

/// The MPI requests of one transfer, split into chunks of at most `max_bytes`. Messages between one pair
/// with one tag are matched in order, so the chunks of a transfer share its tag.
class Requests {
 public:
  void post_recv(void* p, std::size_t bytes, int from, int tag, MPI_Comm comm, std::size_t max_bytes) {
    for (std::size_t off = 0; off < bytes || (bytes == 0 && off == 0); off += max_bytes) {
      const int n = static_cast<int>(std::min(max_bytes, bytes - off));
      m_req.emplace_back();
      Ring::check_mpi(MPI_Irecv(static_cast<char*>(p) + off, n, MPI_BYTE, from, tag, comm, &m_req.back()), "MPI_Irecv");
      if (bytes == 0) break;
    }
  }
  void post_send(const void* p, std::size_t bytes, int to, int tag, MPI_Comm comm, std::size_t max_bytes) {
    for (std::size_t off = 0; off < bytes || (bytes == 0 && off == 0); off += max_bytes) {
      const int n = static_cast<int>(std::min(max_bytes, bytes - off));
      m_req.emplace_back();
      Ring::check_mpi(MPI_Isend(static_cast<const char*>(p) + off, n, MPI_BYTE, to, tag, comm, &m_req.back()),
                      "MPI_Isend");
      if (bytes == 0) break;
    }
  }
  std::size_t messages() const { return m_req.size(); }
  bool active() const { return !m_req.empty(); }
  /// Lets MPI progress the transfer; true when it is complete.
  bool test() {
    if (m_req.empty()) return true;
    int done = 0;
    Ring::check_mpi(MPI_Testall(static_cast<int>(m_req.size()), m_req.data(), &done, MPI_STATUSES_IGNORE),
                    "MPI_Testall");
    if (done) m_req.clear();
    return done != 0;
  }
  void wait() {
    if (m_req.empty()) return;
    Ring::check_mpi(MPI_Waitall(static_cast<int>(m_req.size()), m_req.data(), MPI_STATUSES_IGNORE), "MPI_Waitall");
    m_req.clear();
  }
  /// On an abnormal exit: cancel what can be cancelled and give MPI up to `seconds` to finish the rest;
  /// true when nothing is left posted (else the caller must keep the buffers alive).
  bool abandon(double seconds = 5.0) noexcept {
    for (MPI_Request& r : m_req)
      if (r != MPI_REQUEST_NULL) MPI_Cancel(&r);
    const auto t0 = std::chrono::steady_clock::now();
    while (!m_req.empty()) {
      int done = 0;
      if (MPI_Testall(static_cast<int>(m_req.size()), m_req.data(), &done, MPI_STATUSES_IGNORE) != MPI_SUCCESS) break;
      if (done) m_req.clear();
      else if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > seconds)
        break;
    }
    return m_req.empty();
  }

 private:
  std::vector<MPI_Request> m_req;
};

/// Buffers that an abandoned transfer may still touch: kept alive until the process ends.
inline std::vector<std::shared_ptr<void>>& graveyard() {
  static std::vector<std::shared_ptr<void>> g;
  return g;
}

/// Moves one flat buffer per ring step to a peer and receives one from another, for the whole of one ring
/// call: the host staging buffers (device memory without GPU-aware MPI) are allocated once, sized for the
/// largest message; a self-transfer (shift 0) is a local copy; chunks of at most ring.max_message_bytes().
/// start() posts the transfer, test() progresses it, finish() completes it and puts the received data in
/// place. Destroyed with a transfer in flight (an exception), it cancels or completes the requests first and
/// never frees a buffer MPI may still write.
template <class ExecSpace, class T>
class Exchanger {
 public:
  using Mem = typename ExecSpace::memory_space;
  using Flat = Kokkos::View<T*, Kokkos::LayoutRight, Mem>;
  using Staging = Kokkos::View<T*, Kokkos::LayoutRight, StagingSpace>;
  static constexpr bool host_accessible = Kokkos::SpaceAccessibility<Kokkos::HostSpace, Mem>::accessible;

  Exchanger(const ExecSpace& space, const Ring& ring, std::size_t max_count, const std::string& label)
      : m_space(space), m_ring(&ring), m_kind(ring.resolved_transport<Mem>()),
        m_stage(m_kind == RingTransport::host_staging) {
    if (m_stage && ring.size() > 1) {
      m_send_host = cached(label + "::send_host", max_count);
      m_recv_host = cached(label + "::recv_host", max_count);
    }
#if defined(KFA_RING_NCCL)
    if constexpr (nccl_available<Mem>()) {
      if (m_kind == RingTransport::nccl && ring.size() > 1) {
        m_nccl = nccl_channel(ring);
        if (!m_nccl) kfa::detail::fail("kfa::dist: internal error: NCCL transport used before prepare_transport");
        check_cuda(cudaEventCreateWithFlags(&m_ready, cudaEventDisableTiming), "cudaEventCreateWithFlags");
        check_cuda(cudaEventCreateWithFlags(&m_done, cudaEventDisableTiming), "cudaEventCreateWithFlags");
      }
    }
#endif
  }
  ~Exchanger() {
#if defined(KFA_RING_NCCL)
    if (m_nccl) {
      // Every rank posted its part of what was posted here, so this completes; finish() leaves the host
      // free, so a transfer may still run when an exception unwinds the buffers.
      if (m_used) cudaStreamSynchronize(m_nccl->stream);
      if (m_ready) cudaEventDestroy(m_ready);
      if (m_done) cudaEventDestroy(m_done);
    }
#endif
    if (!m_req.active()) return;
    if (!m_req.abandon()) {
      auto keep = std::make_shared<std::tuple<Flat, Flat, Staging, Staging>>(m_send, m_recv, m_send_host, m_recv_host);
      graveyard().push_back(keep);
    }
  }
  Exchanger(const Exchanger&) = delete;
  Exchanger& operator=(const Exchanger&) = delete;

  /// Sends send[0, send_count) to rank + shift and receives recv_count elements into recv from rank − shift
  /// (mod size). The data to send must be complete on `space` (this fences it first when it must).
  void start(const Flat& send, std::size_t send_count, const Flat& recv, std::size_t recv_count, int tag,
             int shift = 1) {
    const int sz = m_ring->size(), sh = ((shift % sz) + sz) % sz;
    m_send = send, m_recv = recv, m_recv_count = recv_count;
    m_bytes = 0;
    if (sh == 0) {  // to and from this rank: nothing goes through MPI
      m_local = true;
      Kokkos::deep_copy(m_space, Kokkos::subview(recv, std::make_pair(std::size_t(0), recv_count)),
                        Kokkos::subview(send, std::make_pair(std::size_t(0), send_count)));
      return;
    }
    m_local = false;
    const int next = (m_ring->rank() + sh) % sz, prev = (m_ring->rank() + sz - sh) % sz;
#if defined(KFA_RING_NCCL)
    if constexpr (nccl_available<Mem>()) {
      if (m_nccl) {  // after everything enqueued on the caller's instance so far, on the channel's stream
        check_cuda(cudaEventRecord(m_ready, m_space.cuda_stream()), "cudaEventRecord");
        check_cuda(cudaStreamWaitEvent(m_nccl->stream, m_ready, 0), "cudaStreamWaitEvent");
        check_nccl(ncclGroupStart(), "ncclGroupStart");
        if (send_count > 0)
          check_nccl(ncclSend(send.data(), send_count * sizeof(T), ncclUint8, next, m_nccl->comm, m_nccl->stream),
                     "ncclSend");
        if (recv_count > 0)
          check_nccl(ncclRecv(recv.data(), recv_count * sizeof(T), ncclUint8, prev, m_nccl->comm, m_nccl->stream),
                     "ncclRecv");
        check_nccl(ncclGroupEnd(), "ncclGroupEnd");
        m_posted = m_used = true;
        m_bytes = send_count * sizeof(T);
        return;
      }
    }
#endif
    const std::size_t mb = m_ring->max_message_bytes();
    const void* sptr = send.data();
    void* rptr = recv.data();
    if (m_stage) {
      Kokkos::deep_copy(m_space, Kokkos::subview(m_send_host, std::make_pair(std::size_t(0), send_count)),
                        Kokkos::subview(send, std::make_pair(std::size_t(0), send_count)));
      sptr = m_send_host.data();
      rptr = m_recv_host.data();
    }
    m_space.fence();  // the data to send (or its staged copy) is complete before MPI reads it
    m_req.post_recv(rptr, recv_count * sizeof(T), prev, tag, m_ring->comm(), mb);
    m_req.post_send(sptr, send_count * sizeof(T), next, tag, m_ring->comm(), mb);
    m_bytes = send_count * sizeof(T);
  }
  /// Lets MPI progress the transfer (call between block computations).
  void test() {
    if (!m_local) m_req.test();
  }
  /// Completes the MPI part only (device backends: call it after enqueuing the step's kernels, so the host
  /// drives MPI while the device computes).
  void wait_transfer() {
    if (!m_local) m_req.wait();
  }
  /// Completes the transfer; the received data is in `recv` (ordered on `space`). With NCCL the host
  /// returns at once (the caller's instance waits for the transfer) unless `host_wait` (timings) asks
  /// it to wait too.
  void finish(bool host_wait = false) {
    if (m_local) return;
#if defined(KFA_RING_NCCL)
    if constexpr (nccl_available<Mem>()) {
      if (m_nccl) {
        if (!m_posted) return;
        check_cuda(cudaEventRecord(m_done, m_nccl->stream), "cudaEventRecord");
        check_cuda(cudaStreamWaitEvent(m_space.cuda_stream(), m_done, 0), "cudaStreamWaitEvent");
        m_posted = false;
        if (host_wait) check_cuda(cudaEventSynchronize(m_done), "NCCL transfer (cudaEventSynchronize)");
        return;
      }
    }
#endif
    (void)host_wait;
    m_req.wait();
    if (m_stage)
      Kokkos::deep_copy(m_space, Kokkos::subview(m_recv, std::make_pair(std::size_t(0), m_recv_count)),
                        Kokkos::subview(m_recv_host, std::make_pair(std::size_t(0), m_recv_count)));
  }
  /// Bytes this rank sent in the last transfer (0 for a local copy).
  std::size_t bytes() const { return m_bytes; }

 private:
  Staging cached(const std::string& label, std::size_t count) {
    return kept_buffer<T, StagingSpace>(*m_ring, label, count);
  }

  ExecSpace m_space;
  const Ring* m_ring;
  RingTransport m_kind;
  bool m_stage, m_local = false;
#if defined(KFA_RING_NCCL)
  NcclChannel* m_nccl = nullptr;
  cudaEvent_t m_ready = nullptr, m_done = nullptr;
  bool m_posted = false, m_used = false;
#endif
  Staging m_send_host, m_recv_host;
  Flat m_send, m_recv;
  std::size_t m_recv_count = 0, m_bytes = 0;
  Requests m_req;
};

/// Collective: readies ring's transport for buffers in memory space Mem — on first use of NCCL, its
/// communicator (unique id from rank 0 over MPI) and stream — or throws the same kfa::Error on every rank.
template <class Mem>
void prepare_transport(const Ring& ring, const char* fn) {
  if (ring.size() == 1) return;
  const RingTransport t = ring.resolved_transport<Mem>();
  collective_check(ring, fn, [&] {
    if (t == RingTransport::nccl && !nccl_available<Mem>())
      kfa::detail::fail(fn, ": the NCCL transport was asked for (Ring::set_transport or KFA_RING_TRANSPORT) but this ",
                        "build has no NCCL for this memory space (it needs Kokkos CUDA, and CMake finding NCCL with ",
                        "KFA_ENABLE_NCCL=ON); use the automatic or the staging transport");
    if (t == RingTransport::nccl && ring.ranks_share_device())
      kfa::detail::fail(fn, ": the NCCL transport was asked for (Ring::set_transport or KFA_RING_TRANSPORT) but ",
                        "ranks of this ring share a GPU, which NCCL cannot put in one communicator; use the ",
                        "automatic or the staging transport, or one GPU per rank");
  });
#if defined(KFA_RING_NCCL)
  if constexpr (nccl_available<Mem>()) {
    if (t != RingTransport::nccl || nccl_channel(ring)) return;  // every rank: same Ring history, same answer
    struct {
      ncclUniqueId id;
      int ok;
    } boot{};
    collective_check(ring, fn, [&] {
      if (ring.rank() == 0) check_nccl(ncclGetUniqueId(&boot.id), "ncclGetUniqueId");
    });
    Ring::check_mpi(MPI_Bcast(&boot, sizeof boot, MPI_BYTE, 0, ring.comm()), "MPI_Bcast");
    auto ch = std::make_shared<NcclChannel>();
    collective_check(ring, fn, [&] {
      check_cuda(cudaStreamCreateWithFlags(&ch->stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
      check_nccl(ncclCommInitRank(&ch->comm, ring.size(), boot.id, ring.rank()), "ncclCommInitRank");
    });
    ring.staging_slot("kfa::dist::nccl") = ch;
  }
#endif
}

/// End of a ring step: agrees on whether any rank failed during it; if so, every rank throws the same
/// kfa::Error naming the first failing rank. The step's transfers must be complete (finish()) before.
inline void agree_on_step(const Ring& ring, const char* fn, int step, const std::string& local_error) {
  int mine = local_error.empty() ? 0 : 1, any = 0;
  Ring::check_mpi(MPI_Allreduce(&mine, &any, 1, MPI_INT, MPI_MAX, ring.comm()), "MPI_Allreduce");
  if (!any) return;
  constexpr int cap = 512;
  std::array<char, cap> msg{};
  std::snprintf(msg.data(), cap, "%s", local_error.c_str());
  std::vector<char> all(static_cast<std::size_t>(cap) * ring.size());
  Ring::check_mpi(MPI_Allgather(msg.data(), cap, MPI_CHAR, all.data(), cap, MPI_CHAR, ring.comm()), "MPI_Allgather");
  for (int r = 0; r < ring.size(); ++r) {
    const char* m = all.data() + static_cast<std::size_t>(r) * cap;
    if (m[0] != '\0')
      kfa::detail::fail(fn, ": ring step ", step, ": rank ", r, " of ", ring.size(), ": ", std::string(m, strnlen(m, cap)));
  }
}

/// Runs `body` and returns its exception's message ("" when none): a ring step's work, whose failure must
/// reach agree_on_step instead of leaving the other ranks waiting.
template <class F>
std::string capture(F&& body) {
  try {
    body();
  } catch (const std::exception& e) {
    return e.what()[0] ? e.what() : "unknown error";
  } catch (...) {
    return "unknown exception";
  }
  return "";
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

/// Buffers of one traveling K/V shard (and, in the backward pass, its dK/dV accumulators), sized for the
/// longest shard; a shard of n tokens uses the first 2·B·n·H_kv·d elements as [2][B][n][H_kv][d].
template <class T, class Mem>
struct KvBuffer {
  using Flat = Kokkos::View<T*, Kokkos::LayoutRight, Mem>;
  using Tile = Kokkos::View<T****, Kokkos::LayoutRight, Mem, Kokkos::MemoryUnmanaged>;
  Flat data;
  long batch = 0, heads = 0, dim = 0;
  KvBuffer(const Ring& ring, const std::string& key, long b, long n_max, long h, long d)
      : data(kept_buffer<T, Mem>(ring, key, static_cast<std::size_t>(2 * b * n_max * h * d))),
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

template <class Mem>
std::string Ring::transport() const {
  if (m_size == 1) return "none (one rank)";
  const RingTransport t = resolved_transport<Mem>();
  if (t == RingTransport::host_staging && !detail::staging_is_pinned) return "host staging (allocated once)";
  return to_string(t);
}

/// Seconds (the slowest rank's) of one ring exchange of `count` elements of T with nothing to hide it,
/// through the same transport as ring_attention_*: the denominator of "communication hidden". Collective.
template <class T, class ExecSpace>
double time_ring_exchange(const ExecSpace& space, const Ring& ring, std::size_t count) {
  if (ring.size() == 1) return 0.0;
  detail::prepare_transport<typename ExecSpace::memory_space>(ring, "kfa::dist::time_ring_exchange");
  using Flat = Kokkos::View<T*, Kokkos::LayoutRight, typename ExecSpace::memory_space>;
  Flat a("kfa::dist::time_ring_exchange::a", count), b("kfa::dist::time_ring_exchange::b", count);
  detail::Exchanger<ExecSpace, T> ex(space, ring, count, "kfa::dist::time_ring_exchange");
  space.fence();
  Ring::check_mpi(MPI_Barrier(ring.comm()), "MPI_Barrier");
  const double t0 = MPI_Wtime();
  ex.start(a, count, b, count, 97);
  ex.finish();
  space.fence();
  double t = MPI_Wtime() - t0;
  Ring::check_mpi(MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, ring.comm()), "MPI_Allreduce");
  return t;
}

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
  const bool timed = stats != nullptr;
  if (timed) stats->transport = ring.transport<Mem>();
  const double t_begin = detail::stamp(space, timed);

  if (p == 1) {  // the whole sequence is here: one kernel call, straight into o and lse, nothing sent
    detail::single_rank(space, ring, fn, stats, t_begin, [&] {
      kfa::detail::forward_impl(fn, space, q, k, v, o, lse, opts,
                                kfa::detail::Positions{0, 0, nq, static_cast<long>(k.extent(1))});
    });
    return;
  }

  detail::prepare_transport<Mem>(ring, fn);
  constexpr bool host_space = Kokkos::SpaceAccessibility<Kokkos::HostSpace, Mem>::accessible;
  // Timing single blocks' merges needs fences; on a device those would stall the host's MPI progress.
  const bool fence_blocks = timed && host_space;
  using Kv = detail::KvBuffer<T, Mem>;
  const int last = detail::last_needed_step(map, opts, p);
  long seg_max = 0;  // partial results are per (query segment, key segment) block
  for (const Segment& qs : map.q_segments(me)) seg_max = std::max(seg_max, qs.length);
  const detail::ReleaseWorkBuffers release(ring);  // declared first: runs after the buffers' users are gone
  std::unique_ptr<Kv> cur, nxt;
  std::unique_ptr<detail::Exchanger<ExecSpace, T>> ex;
  Kokkos::View<Acc****, Kokkos::LayoutRight, Mem, Kokkos::MemoryUnmanaged> o_acc, o_part;
  Kokkos::View<Acc***, Kokkos::LayoutRight, Mem, Kokkos::MemoryUnmanaged> lse_acc, lse_part;
  detail::agreed_allocation(ring, fn, [&] {  // kept by the Ring for its next call (the backward's too)
    cur.reset(new Kv(ring, "kfa::dist::buffer::kv_a", b, map.k_length_max(), hkv, d));
    nxt.reset(new Kv(ring, "kfa::dist::buffer::kv_b", b, map.k_length_max(), hkv, d));
    ex.reset(new detail::Exchanger<ExecSpace, T>(space, ring, cur->count(map.k_length_max()),
                                                 "kfa::dist::ring_forward::exchange"));
    o_acc = detail::kept_tensor<Acc, Mem>(ring, "kfa::dist::buffer::acc_q", b, nq, hq, d);
    o_part = detail::kept_tensor<Acc, Mem>(ring, "kfa::dist::buffer::part_q", b, seg_max, hq, d);
    lse_acc = detail::kept_tensor<Acc, Mem>(ring, "kfa::dist::buffer::lse_acc", b, hq, nq);
    lse_part = detail::kept_tensor<Acc, Mem>(ring, "kfa::dist::buffer::lse_part", b, hq, seg_max);
  });
  Kokkos::deep_copy(space, o_acc, Acc(0));  // the empty state (with lse_acc = −inf below)
  Kokkos::deep_copy(space, o_part, Acc(0));
  Kokkos::deep_copy(space, lse_part, Acc(0));
  detail::copy_into(space, cur->tile(map.k_length(me), 0), k, "kfa::dist::ring_forward::load_k");
  detail::copy_into(space, cur->tile(map.k_length(me), 1), v, "kfa::dist::ring_forward::load_v");
  Kokkos::deep_copy(space, lse_acc, -compat::infinity<Acc>());  // the empty state: merges as the identity
  if (timed) stats->steps.assign(p, RingStepStats{});

  for (int s = 0; s <= last; ++s) {
    const double t0 = detail::stamp(space, timed);
    int blocks = 0;
    double merge_s = 0;
    const int owner = (me - s + p) % p, incoming = (me - s - 1 + 2 * p) % p;
    // Every rank posts its transfer before any work that can fail, so the transfer always completes.
    if (s < last) ex->start(cur->data, cur->count(map.k_length(owner)), nxt->data, nxt->count(map.k_length(incoming)), s);
    const std::string err = detail::capture([&] {
      detail::injected_fault(ring, s);
      const long nk = map.k_length(owner);
      const auto kt = cur->tile(nk, 0), vt = cur->tile(nk, 1);
      for (const Segment& qs : map.q_segments(me))
        for (const Segment& ks : map.k_segments(owner)) {
          kfa::detail::Positions pos;
          if (!detail::block_visible(qs, ks, map, opts, pos)) continue;  // fully masked: skipped
          const Segment part{qs.global_begin, qs.length, 0};
          const auto op = detail::seq_slice(o_part, part);
          const auto lp = detail::lse_slice(lse_part, part);
          kfa::detail::forward_impl(fn, space, detail::seq_slice(q, qs), detail::seq_slice(kt, ks),
                                    detail::seq_slice(vt, ks), op, lp, opts, pos);
          const double tm0 = detail::stamp(space, fence_blocks);
          kfa::merge_attention(space, detail::seq_slice(o_acc, qs), detail::lse_slice(lse_acc, qs), op, lp);
          merge_s += detail::stamp(space, fence_blocks) - tm0;
          ++blocks;
          if (s < last) ex->test();
        }
      // On a device the kernels above run asynchronously: drive MPI now, while they compute.
      if (s < last && !host_space) ex->wait_transfer();
    });
    const double t1 = detail::stamp(space, timed);
    if (s < last) ex->finish(timed);
    const double t2 = detail::stamp(space, timed);
    detail::agree_on_step(ring, fn, s, err);
    if (s < last) std::swap(cur, nxt);
    if (timed)
      stats->steps[s] = {t1 - t0 - merge_s, merge_s, t2 - t1, s < last ? ex->bytes() : 0, blocks,
                         detail::stamp(space, true) - t2};
    if (timed && stats->on_step) stats->on_step(s + 1, last + 1);
  }
  detail::copy_into(space, o, o_acc, "kfa::dist::ring_forward::store_o");
  Kokkos::parallel_for("kfa::dist::ring_forward::store_lse", kfa::detail::range_like(space, lse),
                       KOKKOS_LAMBDA(const std::int64_t x, const std::int64_t h, const std::int64_t i) {
                         lse(x, h, i) = lse_acc(x, h, i);
                       });
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
  const bool timed = stats != nullptr;
  if (timed) stats->transport = ring.transport<Mem>();
  const double t_begin = detail::stamp(space, timed);

  if (p == 1) {  // the whole sequence is here: one kernel call, straight into dq, dk, dv, nothing sent
    detail::single_rank(space, ring, fn, stats, t_begin, [&] {
      kfa::detail::backward_impl(fn, space, q, k, v, o, d_o, lse, dq, dk, dv, opts,
                                 kfa::detail::Positions{0, 0, nq, static_cast<long>(k.extent(1))});
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
  const int last = detail::last_needed_step(map, opts, p);
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
  Kokkos::View<Acc***, Kokkos::LayoutRight, Mem> dd;
  detail::agreed_allocation(ring, fn, [&] {
    kv.reset(new Kv(ring, "kfa::dist::buffer::kv_a", b, nmax, hkv, d));  // kept by the Ring, as the forward's
    kv_next.reset(new Kv(ring, "kfa::dist::buffer::kv_b", b, nmax, hkv, d));
    acc_a.reset(new KvAcc(ring, "kfa::dist::buffer::dkv_a", b, nmax, hkv, d));
    acc_b.reset(new KvAcc(ring, "kfa::dist::buffer::dkv_b", b, nmax, hkv, d));
    ex_kv.reset(new detail::Exchanger<ExecSpace, T>(space, ring, kv->count(nmax), "kfa::dist::ring_backward::kv"));
    ex_acc.reset(new detail::Exchanger<ExecSpace, Acc>(space, ring, acc_a->count(nmax), "kfa::dist::ring_backward::dkv"));
    dq_acc = detail::kept_tensor<Acc, Mem>(ring, "kfa::dist::buffer::acc_q", b, nq, hq, d);
    dq_part = detail::kept_tensor<Acc, Mem>(ring, "kfa::dist::buffer::part_q", b, qseg_max, hq, d);
    dk_part = detail::kept_tensor<Acc, Mem>(ring, "kfa::dist::buffer::part_k", b, kseg_max, hkv, d);
    dv_part = detail::kept_tensor<Acc, Mem>(ring, "kfa::dist::buffer::part_v", b, kseg_max, hkv, d);
    dd = kfa::detail::backward_row_dot(space, o, d_o);  // D once for the shard, not once per block
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
    if (s < last)
      ex_kv->start(kv->data, kv->count(nk), kv_next->data, kv_next->count(map.k_length(incoming)), 2 * s);
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
      for (const Segment& qs : map.q_segments(me))
        for (const Segment& ks : map.k_segments(owner)) {
          kfa::detail::Positions pos;
          if (!detail::block_visible(qs, ks, map, opts, pos)) continue;
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
        Kokkos::deep_copy(space, Kokkos::subview(acc_b->data, std::make_pair(std::size_t(0), acc_b->count(nk))), Acc(0));
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
      stats->steps[s] = {t1 - t0 + dq_s, 0.0, (t2 - t1) + (detail::stamp(space, true) - t3) - dq_s - dq_sync, bytes,
                         blocks, t3 - t2 + dq_sync};
    if (timed && stats->on_step) stats->on_step(s + 1, last + 1);
  }
  detail::copy_into(space, dk, acc_a->tile(map.k_length(me), 0), "kfa::dist::ring_backward::store_dk");
  detail::copy_into(space, dv, acc_a->tile(map.k_length(me), 1), "kfa::dist::ring_backward::store_dv");
  space.fence();
  if (timed) stats->total_s = detail::stamp(space, true) - t_begin;
}

}  // namespace dist
}  // namespace kfa
