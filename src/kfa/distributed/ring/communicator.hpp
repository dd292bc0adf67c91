#pragma once
/// kfa::dist ring communicator — the Ring (a duplicate of the user's communicator, the transport chosen for
/// device buffers, the buffers kept between ring calls), the names of the transports and the host memory
/// that staging uses.
#include <mpi.h>
#if defined(OPEN_MPI) && defined(__has_include)
#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>  // MPIX_Query_cuda_support
#endif
#endif

#include <Kokkos_Core.hpp>
#include <kfa/error.hpp>
#include <kfa/mpi/agreement.hpp>
#include <kfa/mpi/shard.hpp>

#if defined(KFA_HAVE_NCCL) && defined(KOKKOS_ENABLE_CUDA)
#include <nccl.h>
#define KFA_RING_NCCL 1
#endif

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
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
    case RingTransport::automatic:
      return "automatic";
    case RingTransport::host_memory:
      return "host memory (MPI)";
    case RingTransport::nccl:
      return "NCCL (device memory, own stream)";
    case RingTransport::gpu_aware_mpi:
      return "device memory (GPU-aware MPI)";
    case RingTransport::host_staging:
      return "host staging (pinned, allocated once)";
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
      if (v == "nccl")
        m_transport = RingTransport::nccl;
      else if (v == "gpu-aware-mpi")
        m_transport = RingTransport::gpu_aware_mpi;
      else if (v == "staging")
        m_transport = RingTransport::host_staging;
      else if (v != "auto" && !v.empty())
        kfa::detail::fail("kfa::dist::Ring: KFA_RING_TRANSPORT = '", v,
                          "'; expected auto, nccl, gpu-aware-mpi or staging");
    }
  }
  MPI_Comm comm() const {
    return *m_comm;
  }
  int rank() const {
    return m_rank;
  }
  int size() const {
    return m_size;
  }
  Layout layout() const {
    return m_layout;
  }
  bool gpu_aware() const {
    return m_gpu_aware;
  }

  /// Largest single MPI message; larger transfers are split into chunks of at most this many bytes
  /// (1 ≤ bytes ≤ 2^31 − 1; default 1 GiB). Small values force many chunks (tests do).
  void set_max_message_bytes(std::size_t bytes) {
    if (bytes < 1 || bytes > static_cast<std::size_t>(INT_MAX))
      kfa::detail::fail("kfa::dist::Ring::set_max_message_bytes: ", bytes, " is outside [1, ", INT_MAX, "]");
    m_max_message_bytes = bytes;
  }
  std::size_t max_message_bytes() const {
    return m_max_message_bytes;
  }

  /// The transport for device buffers (default automatic; the environment variable KFA_RING_TRANSPORT =
  /// auto | nccl | gpu-aware-mpi | staging sets it too). Host-accessible buffers always go to MPI directly.
  /// Asking for NCCL in a build without it fails at the next ring call, on every rank.
  void set_transport(RingTransport t) {
    m_transport = t;
  }
  RingTransport requested_transport() const {
    return m_transport;
  }
  /// Whether two ranks of this ring run on the same GPU (the CUDA device current when the Ring was made; a
  /// build with NCCL asks, others say false). NCCL cannot put them in one communicator: `automatic` then
  /// passes over it, and asking for it is an error on every rank.
  bool ranks_share_device() const {
    return m_ranks_share_device;
  }
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
  bool cache_buffers() const {
    return m_cache_buffers;
  }
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
  bool fault_at(int step) const {
    return m_fault_rank == m_rank && m_fault_step == step;
  }

  /// kfa::dist::check_mpi (agreement.hpp), kept here for code that calls it as Ring::check_mpi.
  static void check_mpi(int rc, const char* call) {
    kfa::dist::check_mpi(rc, call);
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

namespace detail {

/// Host memory for staging device buffers: pinned where the backend has it (asynchronous copies, DMA).
#if defined(KOKKOS_ENABLE_CUDA)
using StagingSpace = Kokkos::CudaHostPinnedSpace;
constexpr bool staging_is_pinned = true;
#else
using StagingSpace = Kokkos::HostSpace;
constexpr bool staging_is_pinned = false;
#endif

}  // namespace detail

template <class Mem>
std::string Ring::transport() const {
  if (m_size == 1) return "none (one rank)";
  const RingTransport t = resolved_transport<Mem>();
  if (t == RingTransport::host_staging && !detail::staging_is_pinned) return "host staging (allocated once)";
  return to_string(t);
}

}  // namespace dist
}  // namespace kfa
