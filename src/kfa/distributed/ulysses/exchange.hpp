#pragma once
/// kfa::dist Ulysses exchange — the all-to-all inside a group that turns the members' sequence shards of a
/// tensor into head shards of the group's tokens (to_heads) and back (to_sequence). Each member packs one
/// block per destination, the blocks travel pairwise (shift 1 … U − 1, through the group Ring's transport:
/// MPI in chunks below 2^31 bytes, NCCL on a stream of its own, or host staging), and the receiver unpacks
/// them in place; a member's own block never leaves it. On the way back, a head held by several members
/// (key/value heads shared or expanded for GQA) has its gradients summed in a fixed order, in the
/// accumulation type, so results are reproducible.
#include <Kokkos_Core.hpp>
#include <kfa/distributed/ring/buffers.hpp>
#include <kfa/distributed/ring/communicator.hpp>
#include <kfa/distributed/ring/transport.hpp>
#include <kfa/distributed/ulysses/group.hpp>
#include <kfa/mpi/shard.hpp>
#include <kfa/types.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kfa {
namespace dist {
namespace detail {

/// A run of a member's shard inside its group's sequence: where it starts in the member's arrays, where in
/// the group's, and its length.
struct Piece {
  long member_begin = 0, group_begin = 0, length = 0;
};

/// The tokens of a group: each member's pieces, each member's shard length, the group's length.
struct GroupTokens {
  std::vector<std::vector<Piece>> pieces;
  std::vector<long> lengths;
  long total = 0;
};

/// The runs of the stream that rank r holds (queries or keys), local_begin in its arrays: its segments, or, in a
/// map over documents (zigzag), its documents' pieces, whose segments are not runs of the stream.
inline std::vector<Segment> member_runs(const ShardMap& map, bool keys, int r) {
  if (map.documents() == 0) return keys ? map.k_segments(r) : map.q_segments(r);
  std::vector<Segment> runs = keys ? map.k_pieces(r, 0) : map.q_pieces(r, 0);
  for (const Segment& s : keys ? map.k_pieces(r, 1) : map.q_pieces(r, 1)) runs.push_back(s);
  return runs;
}

/// The runs of the stream held by group g (ranks g·U … g·U + U − 1) of `map` (queries or keys), in global
/// order with adjacent runs joined (local_begin: where the run starts in the group's arrays), and, when
/// `tokens` is given, where each member's runs sit in them. Over documents cut in zigzag chunks a group of
/// U < P ranks holds two runs per document (its chunks gU … gU + U − 1 and their mirror), a group of all P
/// ranks the whole stream in one.
inline std::vector<Segment> group_runs(const ShardMap& map, bool keys, int u, int g, GroupTokens* tokens = nullptr) {
  struct Item {
    Segment s;
    int member;
  };
  std::vector<Item> items;
  if (tokens) tokens->pieces.assign(u, {}), tokens->lengths.assign(u, 0);
  for (int m = 0; m < u; ++m)
    for (const Segment& s : member_runs(map, keys, g * u + m)) {
      if (tokens) tokens->lengths[m] += s.length;
      if (s.length > 0) items.push_back({s, m});
    }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.s.global_begin < b.s.global_begin; });
  std::vector<Segment> runs;
  long at = 0;
  for (const Item& it : items) {
    if (!runs.empty() && runs.back().global_begin + runs.back().length == it.s.global_begin)
      runs.back().length += it.s.length;
    else
      runs.push_back({it.s.global_begin, it.s.length, at});
    if (tokens) tokens->pieces[it.member].push_back({it.s.local_begin, at, it.s.length});
    at += it.s.length;
  }
  if (tokens) tokens->total = at;
  return runs;
}

/// The map of the ring between the groups: ring rank g holds the runs of group g.
inline ShardMap ring_map_of(const ShardMap& map, int u, int groups) {
  std::vector<std::vector<Segment>> q(groups), k(groups);
  for (int g = 0; g < groups; ++g) q[g] = group_runs(map, false, u, g), k[g] = group_runs(map, true, u, g);
  return ShardMap::of_segments(q, k);
}

/// Element (b, i, h, c) of a rank-4 [b, n, h, c] View, or (b, h, i) of a rank-3 [b, h, n] one (lse, D).
template <class V>
KOKKOS_INLINE_FUNCTION decltype(auto) at4(const V& x, std::int64_t b, std::int64_t i, std::int64_t h, std::int64_t c) {
  if constexpr (static_cast<int>(V::rank) == 4)
    return x(b, i, h, c);
  else {
    (void)c;
    return x(b, h, i);
  }
}
template <class V>
long heads_of(const V& x) {
  return static_cast<long>(static_cast<int>(V::rank) == 4 ? x.extent(2) : x.extent(1));
}
template <class V>
long tokens_of(const V& x) {
  return static_cast<long>(static_cast<int>(V::rank) == 4 ? x.extent(1) : x.extent(2));
}
template <class V>
long columns_of(const V& x) {
  return static_cast<int>(V::rank) == 4 ? static_cast<long>(x.extent(3)) : 1L;
}

/// Calls f(row, c0, c1) (columns [c0, c1) of a row) over rows × cols: on the host once per row with all its
/// columns (the row's index arithmetic once, the copy vectorized), on a device once per element, a team's threads
/// over rows and vector lanes over a row's columns (coalesced along the row).
template <class ExecSpace, class F>
void for_rows(const char* label, const ExecSpace& space, std::int64_t rows, std::int64_t cols, const F& f) {
  if (rows == 0 || cols == 0) return;
  constexpr bool device = !Kokkos::SpaceAccessibility<Kokkos::HostSpace, typename ExecSpace::memory_space>::accessible;
  if constexpr (!device) {
    Kokkos::parallel_for(
        label, Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>(space, 0, rows),
        KOKKOS_LAMBDA(const std::int64_t r) { f(r, std::int64_t(0), cols); });
  } else {
    constexpr int team = 8, vec = 32;
    using Policy = Kokkos::TeamPolicy<ExecSpace>;
    const std::int64_t league = (rows + team - 1) / team;
    if (league > 2147483647LL) kfa::detail::fail(label, ": ", rows, " rows exceed one launch");
    Kokkos::parallel_for(
        label, Policy(space, static_cast<int>(league), team, vec),
        KOKKOS_LAMBDA(const typename Policy::member_type& m) {
          const std::int64_t r0 = static_cast<std::int64_t>(m.league_rank()) * team;
          Kokkos::parallel_for(Kokkos::TeamThreadRange(m, team), [&](const int t) {
            const std::int64_t r = r0 + t;
            if (r >= rows) return;
            Kokkos::parallel_for(Kokkos::ThreadVectorRange(m, cols), [&](const std::int64_t c) { f(r, c, c + 1); });
          });
        });
  }
}

/// One tensor's all-to-all in a group, elements of type E: blocks packed per member, sent pairwise, unpacked.
/// to_heads: a member's shard [b, n_me, H, c] becomes the group's tokens of its heads [b, n_group, H/U, c];
/// to_sequence the reverse. Rank-3 tensors ([b, H, n]: lse, D) travel as c = 1.
template <class ExecSpace, class E>
class HeadExchange {
 public:
  using Mem = typename ExecSpace::memory_space;
  using Flat = Kokkos::View<E*, Kokkos::LayoutRight, Mem>;
  using Table = Kokkos::View<int*, Mem>;

  /// `heads(m, h)`: the global head of member m's local head h (local_heads of them). `to_heads`: the
  /// direction. Buffers are the group Ring's work buffers under `label`; `tag` tells concurrent exchanges apart.
  template <class HeadOf>
  HeadExchange(const ExecSpace& space, const Ring& group, const GroupTokens& tokens, long batch, long columns,
               int local_heads, HeadOf heads, int global_heads, bool to_heads, const std::string& label, int tag)
      : m_space(space),
        m_group(&group),
        m_tokens(tokens),
        m_batch(batch),
        m_cols(columns),
        m_hl(local_heads),
        m_tag(tag) {
    const int u = group.size(), me = group.rank();
    const long row = batch * local_heads * columns;  // elements per token per block
    m_send_off.assign(u + 1, 0), m_recv_off.assign(u + 1, 0);
    for (int m = 0; m < u; ++m) {
      // to_heads: every block I send holds my tokens; I receive each member's. Back: the reverse.
      const long send_tokens = to_heads ? tokens.lengths[me] : tokens.lengths[m];
      const long recv_tokens = to_heads ? tokens.lengths[m] : tokens.lengths[me];
      m_send_off[m + 1] = m_send_off[m] + (m == me ? 0 : send_tokens * row);
      m_recv_off[m + 1] = m_recv_off[m] + recv_tokens * row;
    }
    std::size_t largest = 1;
    for (int m = 0; m < u; ++m)
      largest = std::max<std::size_t>(largest, static_cast<std::size_t>(m_recv_off[m + 1] - m_recv_off[m]));
    for (int m = 0; m < u; ++m)
      largest = std::max<std::size_t>(largest, static_cast<std::size_t>(m_send_off[m + 1] - m_send_off[m]));
    const std::string key = "kfa::dist::buffer::ulysses::" + label;
    m_send = kept_buffer<E, Mem>(group, key + "::send", static_cast<std::size_t>(std::max(1L, m_send_off[u])));
    m_recv = kept_buffer<E, Mem>(group, key + "::recv", static_cast<std::size_t>(std::max(1L, m_recv_off[u])));
    // heads(m, h) for every member, and its inverse: for each global head the (member, local head) holding it
    std::vector<int> table(static_cast<std::size_t>(u) * local_heads), begin(global_heads + 1, 0), pairs;
    for (int m = 0; m < u; ++m)
      for (int h = 0; h < local_heads; ++h) table[m * local_heads + h] = heads(m, h), ++begin[heads(m, h) + 1];
    for (int x = 0; x < global_heads; ++x) begin[x + 1] += begin[x];
    pairs.resize(2 * static_cast<std::size_t>(begin[global_heads]));
    std::vector<int> fill(begin.begin(), begin.end() - 1);
    for (int m = 0; m < u; ++m)  // in member order, then local head order: the order of the sums
      for (int h = 0; h < local_heads; ++h) {
        const int x = fill[heads(m, h)]++;
        pairs[2 * x] = m, pairs[2 * x + 1] = h;
      }
    m_table = to_device(table, label + "::heads");
    m_inv_begin = to_device(begin, label + "::inverse_begin");
    m_inv_pairs = to_device(pairs, label + "::inverse_pairs");
    for (int sh = 1; sh < u; ++sh)
      m_ex.emplace_back(new Exchanger<ExecSpace, E>(space, group, largest,
                                                    "kfa::dist::ulysses::" + label + "::" + std::to_string(sh)));
  }
  HeadExchange(const HeadExchange&) = delete;
  HeadExchange& operator=(const HeadExchange&) = delete;

  /// to_heads: packs this member's shard x (rank 4 [b, n_me, H, c] or rank 3 [b, H, n_me]) into one block
  /// per member (its own straight into the receive buffer).
  template <class X>
  void pack_shard(const X& x) {
    const int u = m_group->size(), me = m_group->rank();
    const std::int64_t n = m_tokens.lengths[me], hl = m_hl, cols = m_cols, bt = m_batch;
    const std::int64_t blk = bt * n * hl * cols, total = blk * u;
    if (total == 0) return;
    E* send = m_send.data();
    E* own = m_recv.data() + m_recv_off[me];
    const auto table = m_table;
    std::vector<std::int64_t> off(u);
    for (int m = 0; m < u; ++m) off[m] = m_send_off[m];
    const auto offs = to_device64(off, "kfa::dist::ulysses::pack_offsets");
    for_rows(
        "kfa::dist::ulysses::pack_to_heads", m_space, total / cols, cols,
        KOKKOS_LAMBDA(const std::int64_t row, const std::int64_t c0, const std::int64_t c1) {
          const std::int64_t h = row % hl, t2 = row / hl, i = t2 % n, t3 = t2 / n, b = t3 % bt, m = t3 / bt;
          E* dst = (m == me ? own : send + offs(m)) + ((b * n + i) * hl + h) * cols;
          const std::int64_t hh = table(m * hl + h);
          for (std::int64_t c = c0; c < c1; ++c) dst[c] = static_cast<E>(at4(x, b, i, hh, c));
        });
  }

  /// to_heads, after finish(): the group's tokens of this member's heads into y (rank 4 [b, n_group, H/U, c] or
  /// rank 3 [b, H/U, n_group]).
  template <class Y>
  void unpack_heads(const Y& y) const {
    const int u = m_group->size();
    const std::int64_t hl = m_hl, cols = m_cols, bt = m_batch;
    for (int s = 0; s < u; ++s)
      for (const Piece& p : m_tokens.pieces[s]) {
        const std::int64_t ns = m_tokens.lengths[s], len = p.length, mb = p.member_begin, gb = p.group_begin;
        const E* src = m_recv.data() + m_recv_off[s];
        const std::int64_t total = bt * len * hl * cols;
        if (total == 0) continue;
        for_rows(
            "kfa::dist::ulysses::unpack_heads", m_space, total / cols, cols,
            KOKKOS_LAMBDA(const std::int64_t row, const std::int64_t c0, const std::int64_t c1) {
              const std::int64_t h = row % hl, t2 = row / hl, i = t2 % len, b = t2 / len;
              const E* from = src + ((b * ns + mb + i) * hl + h) * cols;
              for (std::int64_t c = c0; c < c1; ++c) at4(y, b, gb + i, h, c) = from[c];
            });
      }
  }

  /// to_sequence: packs y (this member's heads of the group's tokens) into one block per member: the rows
  /// of that member's shard.
  template <class Y>
  void pack_heads(const Y& y) {
    const int u = m_group->size(), me = m_group->rank();
    const std::int64_t hl = m_hl, cols = m_cols, bt = m_batch;
    for (int s = 0; s < u; ++s)
      for (const Piece& p : m_tokens.pieces[s]) {
        const std::int64_t ns = m_tokens.lengths[s], len = p.length, mb = p.member_begin, gb = p.group_begin;
        E* dst = s == me ? m_recv.data() + m_recv_off[me] : m_send.data() + m_send_off[s];
        const std::int64_t total = bt * len * hl * cols;
        if (total == 0) continue;
        for_rows(
            "kfa::dist::ulysses::pack_to_sequence", m_space, total / cols, cols,
            KOKKOS_LAMBDA(const std::int64_t row, const std::int64_t c0, const std::int64_t c1) {
              const std::int64_t h = row % hl, t2 = row / hl, i = t2 % len, b = t2 / len;
              E* to = dst + ((b * ns + mb + i) * hl + h) * cols;
              for (std::int64_t c = c0; c < c1; ++c) to[c] = static_cast<E>(at4(y, b, gb + i, h, c));
            });
      }
  }

  /// to_sequence, after finish(): this member's shard out (rank 4 [b, n_me, H, c] or rank 3 [b, H, n_me]) from
  /// every member's heads; a head held by several members (or several times by one) gets the sum of its
  /// copies, in member order, in the accumulation type Acc.
  template <class Acc, class Out>
  void unpack_sequence(const Out& out) const {
    using O = typename Out::non_const_value_type;
    const int me = m_group->rank();
    const std::int64_t n = m_tokens.lengths[me], hl = m_hl, cols = m_cols, bt = m_batch, hout = heads_of(out);
    const std::int64_t blk = bt * n * hl * cols, total = bt * n * hout * cols;
    if (total == 0) return;
    const E* recv = m_recv.data();
    const auto begin = m_inv_begin;
    const auto pairs = m_inv_pairs;
    for_rows(
        "kfa::dist::ulysses::unpack_sequence", m_space, total / cols, cols,
        KOKKOS_LAMBDA(const std::int64_t row, const std::int64_t c0, const std::int64_t c1) {
          const std::int64_t hh = row % hout, t2 = row / hout, i = t2 % n, b = t2 / n;
          const int x0 = begin(hh), x1 = begin(hh + 1);
          if (x1 == x0 + 1) {  // one copy: moved as it is
            const E* from = recv + pairs(2 * x0) * blk + ((b * n + i) * hl + pairs(2 * x0 + 1)) * cols;
            for (std::int64_t c = c0; c < c1; ++c) at4(out, b, i, hh, c) = static_cast<O>(static_cast<Acc>(from[c]));
            return;
          }
          for (std::int64_t c = c0; c < c1; ++c) {
            Acc s = 0;
            for (int x = x0; x < x1; ++x)
              s += static_cast<Acc>(recv[pairs(2 * x) * blk + ((b * n + i) * hl + pairs(2 * x + 1)) * cols + c]);
            at4(out, b, i, hh, c) = static_cast<O>(s);
          }
        });
  }

  /// Posts the transfers (the packed blocks must be complete on the execution space: this fences first).
  void start() {
    const int u = m_group->size(), me = m_group->rank();
    for (int sh = 1; sh < u; ++sh) {
      const int to = (me + sh) % u, from = (me - sh + u) % u;
      const std::size_t sc = static_cast<std::size_t>(m_send_off[to + 1] - m_send_off[to]);
      const std::size_t rc = static_cast<std::size_t>(m_recv_off[from + 1] - m_recv_off[from]);
      m_ex[sh - 1]->start(Flat(m_send.data() + m_send_off[to], std::max<std::size_t>(sc, 1)), sc,
                          Flat(m_recv.data() + m_recv_off[from], std::max<std::size_t>(rc, 1)), rc, m_tag * u + sh, sh);
    }
  }
  /// Completes the transfers (ordered on the execution space).
  void finish(bool host_wait = false) {
    for (auto& e : m_ex) e->finish(host_wait);
  }
  /// Bytes this member sent.
  std::size_t bytes() const {
    std::size_t b = 0;
    for (const auto& e : m_ex) b += e->bytes();
    return b;
  }

 private:
  Table to_device(const std::vector<int>& h, const std::string& label) const {
    Table t(label, std::max<std::size_t>(h.size(), 1));
    if (!h.empty())  // synchronous: h is gone when the caller returns
      Kokkos::deep_copy(Kokkos::subview(t, std::make_pair(std::size_t(0), h.size())),
                        Kokkos::View<const int*, Kokkos::HostSpace, Kokkos::MemoryUnmanaged>(h.data(), h.size()));
    return t;
  }
  Kokkos::View<std::int64_t*, Mem> to_device64(const std::vector<std::int64_t>& h, const std::string& label) const {
    Kokkos::View<std::int64_t*, Mem> t(label, std::max<std::size_t>(h.size(), 1));
    if (!h.empty())  // synchronous, as to_device
      Kokkos::deep_copy(
          Kokkos::subview(t, std::make_pair(std::size_t(0), h.size())),
          Kokkos::View<const std::int64_t*, Kokkos::HostSpace, Kokkos::MemoryUnmanaged>(h.data(), h.size()));
    return t;
  }

  ExecSpace m_space;
  const Ring* m_group;
  GroupTokens m_tokens;
  long m_batch, m_cols;
  int m_hl;
  int m_tag;
  std::vector<long> m_send_off, m_recv_off;
  Flat m_send, m_recv;
  Table m_table, m_inv_begin, m_inv_pairs;
  std::vector<std::unique_ptr<Exchanger<ExecSpace, E>>> m_ex;
};

}  // namespace detail
}  // namespace dist
}  // namespace kfa
