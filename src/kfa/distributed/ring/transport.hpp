#pragma once
/// kfa::dist ring transport — how one buffer per ring step moves to the next rank: MPI requests in chunks
/// below MPI's 2^31 count limit, NCCL on a stream of its own, or host staging buffers; readied collectively
/// before the first transfer, and never leaving a request posted into freed memory.
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <kfa/distributed/ring/buffers.hpp>
#include <kfa/distributed/ring/communicator.hpp>
#include <kfa/distributed/ring/steps.hpp>
#include <kfa/error.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace kfa {
namespace dist {
namespace detail {

#if defined(KFA_RING_NCCL)
inline void check_cuda(cudaError_t rc, const char* call) {
  if (rc != cudaSuccess)
    throw std::runtime_error(std::string("kfa::dist: ") + call + " failed: " + cudaGetErrorString(rc));
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
      if (done)
        m_req.clear();
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
      : m_space(space),
        m_ring(&ring),
        m_kind(ring.resolved_transport<Mem>()),
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
  std::size_t bytes() const {
    return m_bytes;
  }

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

}  // namespace detail

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

}  // namespace dist
}  // namespace kfa
