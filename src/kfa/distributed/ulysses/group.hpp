#pragma once
/// kfa::dist Ulysses groups — the 2-D decomposition of a communicator for all-to-all (DeepSpeed-Ulysses)
/// sequence parallelism and its hybrid with the ring (USP): P ranks as P/U groups of U consecutive ranks.
/// Inside a group an all-to-all turns U sequence shards into U head shards of the group's tokens; across
/// the groups, the ranks that hold the same heads form a ring. U = P is pure Ulysses, U = 1 the ring alone.
/// Which heads a rank holds between the all-to-alls (HeadPlan), with key/value heads split, shared or
/// expanded for grouped-query attention.
#include <mpi.h>

#include <kfa/distributed/ring/communicator.hpp>
#include <kfa/error.hpp>
#include <kfa/mpi/agreement.hpp>
#include <kfa/mpi/shard.hpp>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace kfa {
namespace dist {

/// How the key/value heads reach the ranks of a group. With g = heads_q / heads_kv query heads per key/value
/// head and q_local = heads_q / U query heads per rank:
enum class KvHeads {
  split,    ///< U divides heads_kv: each rank gets heads_kv / U of them (its query heads' own)
  shared,   ///< q_local divides g: each rank's query heads use one key/value head, sent to every rank using it
  expanded  ///< otherwise: one copy of the key/value head of each local query head (the local kernel is MHA)
};
inline const char* to_string(KvHeads k) {
  return k == KvHeads::split ? "split" : k == KvHeads::shared ? "shared" : "expanded";
}

/// The heads a group member holds between the all-to-alls.
struct HeadPlan {
  int degree = 1, heads_q = 0, heads_kv = 0;
  int q_local = 0, kv_local = 0;  ///< query and key/value heads per member
  KvHeads kv = KvHeads::split;
  /// Global query head of member m's local head h.
  int q_head(int m, int h) const { return m * q_local + h; }
  /// Global key/value head of member m's local key/value head j.
  int kv_head(int m, int j) const {
    const int g = heads_q / heads_kv;
    if (kv == KvHeads::split) return m * kv_local + j;
    if (kv == KvHeads::shared) return m * q_local / g;
    return (m * q_local + j) / g;
  }
  /// E.g. "32 query heads, 8 key/value heads over a degree of 4: 8 query and 2 key/value heads per rank (split)".
  std::string describe() const {
    return std::to_string(heads_q) + " query heads, " + std::to_string(heads_kv) +
           " key/value heads over a Ulysses degree of " + std::to_string(degree) + ": " + std::to_string(q_local) +
           " query and " + std::to_string(kv_local) + " key/value heads per rank (" + to_string(kv) +
           (kv == KvHeads::split ? ")" : ", key/value heads sent to several ranks)");
  }
};

/// The HeadPlan of heads_q query and heads_kv key/value heads (heads_kv divides heads_q) over `degree`
/// ranks; throws kfa::Error naming the function, the heads and the degree when degree does not divide heads_q.
inline HeadPlan plan_heads(const char* fn, int heads_q, int heads_kv, int degree) {
  if (degree < 1 || heads_q % degree != 0)
    kfa::detail::fail(fn, ": heads_q (q.extent(2)) = ", heads_q, " is not divisible by the Ulysses degree ", degree,
                      "; use a degree that divides the query heads (a smaller one with the ring: the hybrid)");
  HeadPlan p;
  p.degree = degree, p.heads_q = heads_q, p.heads_kv = heads_kv, p.q_local = heads_q / degree;
  const int g = heads_kv > 0 ? heads_q / heads_kv : 1;
  if (heads_kv % degree == 0)
    p.kv = KvHeads::split, p.kv_local = heads_kv / degree;
  else if (g % p.q_local == 0)
    p.kv = KvHeads::shared, p.kv_local = 1;
  else
    p.kv = KvHeads::expanded, p.kv_local = p.q_local;
  return p;
}

/// The communicators of Ulysses (U = degree) and hybrid sequence parallelism over `comm`. Rank r is member
/// r mod U of group r / U, and rank r / U of the ring of the ranks whose member index is r mod U. The shards
/// of the sequence are in `layout` over all P ranks, as for a Ring of P ranks; a group's ranks hold
/// consecutive shards, whose union is its ring shard (contiguous: one run; zigzag: two). Collective over comm.
class Ulysses {
 public:
  /// Throws the same kfa::Error on every rank when `degree` is below 1, does not divide the size of comm or
  /// differs across ranks.
  ///
  /// Test hook: `KFA_ULYSSES_FAULT=r:s` in the environment makes rank r (of comm) throw in stage s of every
  /// call: 0 the all-to-all to heads, 1 the attention between them, 2 the all-to-all back.
  Ulysses(MPI_Comm comm, int degree, Layout layout = Layout::contiguous, GpuAwareMpi gpu_aware = GpuAwareMpi::automatic)
      : m_all(comm, layout, gpu_aware),
        m_degree(agreed_degree(m_all, degree)),
        m_group(Split(m_all.comm(), m_all.rank() / m_degree).comm, Layout::contiguous, gpu_aware),
        m_ring(Split(m_all.comm(), m_all.rank() % m_degree).comm, layout, gpu_aware),
        m_within_nodes(groups_share_nodes(m_all, m_group)) {
    if (const char* f = std::getenv("KFA_ULYSSES_FAULT"))
      if (std::sscanf(f, "%d:%d", &m_fault_rank, &m_fault_stage) != 2) m_fault_rank = m_fault_stage = -1;
  }

  /// U: ranks per all-to-all group.
  int degree() const { return m_degree; }
  /// P / U: ranks of the ring between the groups (1: pure Ulysses).
  int ring_degree() const { return m_all.size() / m_degree; }
  int rank() const { return m_all.rank(); }
  int size() const { return m_all.size(); }
  Layout layout() const { return m_all.layout(); }
  /// This rank's index in its group and its group's index (its rank in the ring).
  int member() const { return m_all.rank() % m_degree; }
  int group_index() const { return m_all.rank() / m_degree; }
  /// Whether every group's ranks share a node (MPI_COMM_TYPE_SHARED): the all-to-all stays inside nodes.
  /// Groups are consecutive ranks: place consecutive ranks on one node (mpirun --map-by core, the default).
  bool groups_within_nodes() const { return m_within_nodes; }

  /// Over all P ranks (arguments and failures are agreed here).
  const Ring& all() const { return m_all; }
  /// The U ranks of this rank's group (the all-to-all).
  const Ring& group() const { return m_group; }
  /// The P / U ranks holding this rank's heads (the ring).
  const Ring& ring() const { return m_ring; }

  /// As Ring::set_max_message_bytes, for the all-to-all and the ring.
  void set_max_message_bytes(std::size_t bytes) {
    m_all.set_max_message_bytes(bytes), m_group.set_max_message_bytes(bytes), m_ring.set_max_message_bytes(bytes);
  }
  /// As Ring::set_transport, for the all-to-all and the ring.
  void set_transport(RingTransport t) { m_all.set_transport(t), m_group.set_transport(t), m_ring.set_transport(t); }
  /// As Ring::set_cache_buffers, for the all-to-all's buffers and the ring's.
  void set_cache_buffers(bool on) {
    m_all.set_cache_buffers(on), m_group.set_cache_buffers(on), m_ring.set_cache_buffers(on);
  }

  /// The KFA_ULYSSES_FAULT test hook: throws on the chosen rank in the chosen stage.
  void injected_fault(int stage) const {
    if (m_fault_rank == m_all.rank() && m_fault_stage == stage)
      kfa::detail::fail("kfa::dist: fault injected in Ulysses stage ", stage, " on rank ", m_all.rank(),
                        " (KFA_ULYSSES_FAULT)");
  }

 private:
  /// MPI_Comm_split(comm, color, rank), freed at the end of the full-expression (the Ring has its duplicate).
  struct Split {
    MPI_Comm comm = MPI_COMM_NULL;
    Split(MPI_Comm parent, int color) {
      int r = 0;
      MPI_Comm_rank(parent, &r);
      check_mpi(MPI_Comm_split(parent, color, r, &comm), "MPI_Comm_split");
    }
    ~Split() {
      if (comm != MPI_COMM_NULL) MPI_Comm_free(&comm);
    }
    Split(const Split&) = delete;
    Split& operator=(const Split&) = delete;
  };
  /// `degree`, once every rank has agreed that it is the same everywhere and divides the ranks (else throws).
  static int agreed_degree(const Ring& all, int degree) {
    int lo = degree, hi = degree;
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, &lo, 1, MPI_INT, MPI_MIN, all.comm()), "MPI_Allreduce");
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, &hi, 1, MPI_INT, MPI_MAX, all.comm()), "MPI_Allreduce");
    std::string err;
    if (lo != hi)
      err = "the degree differs across ranks (from " + std::to_string(lo) + " to " + std::to_string(hi) + ")";
    else if (degree < 1 || all.size() % degree != 0)
      err = "degree " + std::to_string(degree) + " does not divide the " + std::to_string(all.size()) +
            " ranks of the communicator (U ranks per all-to-all group, P / U groups in the ring)";
    agree(all.comm(), err, "kfa::dist::Ulysses: ");
    return degree;
  }
  /// Whether every group's ranks share a node (the lowest rank of each rank's node, compared within groups).
  static bool groups_share_nodes(const Ring& all, const Ring& group) {
    MPI_Comm node = MPI_COMM_NULL;
    check_mpi(MPI_Comm_split_type(all.comm(), MPI_COMM_TYPE_SHARED, all.rank(), MPI_INFO_NULL, &node),
              "MPI_Comm_split_type");
    int node_id = all.rank();
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, &node_id, 1, MPI_INT, MPI_MIN, node), "MPI_Allreduce");
    MPI_Comm_free(&node);
    int lo = node_id, hi = node_id;
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, &lo, 1, MPI_INT, MPI_MIN, group.comm()), "MPI_Allreduce");
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, &hi, 1, MPI_INT, MPI_MAX, group.comm()), "MPI_Allreduce");
    int within = lo == hi ? 1 : 0;
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, &within, 1, MPI_INT, MPI_MIN, all.comm()), "MPI_Allreduce");
    return within != 0;
  }
  Ring m_all;
  int m_degree;
  Ring m_group, m_ring;
  bool m_within_nodes;
  int m_fault_rank = -1, m_fault_stage = -1;
};

}  // namespace dist
}  // namespace kfa
