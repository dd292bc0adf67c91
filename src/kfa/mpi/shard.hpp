#pragma once
/// kfa/mpi/shard.hpp (namespace kfa::dist): how one sequence is cut into per-rank shards, for the ring and
/// kfa::io. Contiguous: rank r holds one run of tokens, of any length (lengths may differ per rank). Zigzag
/// (causal load balance): the sequence is cut into 2P nearly equal chunks and rank r holds chunks r and 2P−1−r,
/// in that order.
#include <kfa/error.hpp>

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

namespace kfa {
namespace dist {

enum class Layout { contiguous, zigzag };

inline std::string to_string(Layout l) {
  return l == Layout::contiguous ? "contiguous" : "zigzag";
}

/// A run of tokens of a shard: global position of its first token, its length, and where it starts in
/// the rank's local arrays.
struct Segment {
  long global_begin = 0;
  long length = 0;
  long local_begin = 0;
};

/// The segments rank `rank` of `nranks` holds of an n-token sequence cut with `layout` (for contiguous,
/// the most even cut: the first n % P ranks hold one token more).
inline std::vector<Segment> shard_of(Layout layout, long n, int nranks, int rank) {
  if (layout == Layout::contiguous) {
    const long base = n / nranks, extra = n % nranks;
    const long begin = rank * base + (rank < extra ? rank : extra);
    return {{begin, base + (rank < extra ? 1 : 0), 0}};
  }
  const long chunks = 2L * nranks, base = n / chunks, extra = n % chunks;
  auto chunk = [&](long c) { return Segment{c * base + (c < extra ? c : extra), base + (c < extra ? 1 : 0), 0}; };
  Segment a = chunk(rank), b = chunk(chunks - 1 - rank);
  b.local_begin = a.length;
  return {a, b};
}

/// Global layout of the query and key shards of every rank.
class ShardMap {
 public:
  ShardMap() = default;
  /// From every rank's local lengths; throws kfa::Error when they do not fit the layout.
  ShardMap(Layout layout, const std::vector<long>& q_len, const std::vector<long>& k_len) {
    const int p = static_cast<int>(q_len.size());
    for (long x : q_len) m_q_total += x;
    for (long x : k_len) m_k_total += x;
    m_q.resize(p), m_k.resize(p);
    long qb = 0, kb = 0;
    for (int r = 0; r < p; ++r) {
      if (layout == Layout::contiguous) {
        m_q[r] = {{qb, q_len[r], 0}};
        m_k[r] = {{kb, k_len[r], 0}};
        qb += q_len[r], kb += k_len[r];
        continue;
      }
      m_q[r] = shard_of(layout, m_q_total, p, r);
      m_k[r] = shard_of(layout, m_k_total, p, r);
      const long wq = m_q[r][0].length + m_q[r][1].length, wk = m_k[r][0].length + m_k[r][1].length;
      if (wq != q_len[r] || wk != k_len[r])
        kfa::detail::fail("zigzag layout: rank ", r, " must hold chunks ", r, " and ", 2 * p - 1 - r, " of the ",
                          m_q_total, "-token query / ", m_k_total, "-token key sequence (", wq, " / ", wk,
                          " tokens) but holds ", q_len[r], " / ", k_len[r]);
    }
  }
  const std::vector<Segment>& q_segments(int rank) const { return m_q[rank]; }
  const std::vector<Segment>& k_segments(int rank) const { return m_k[rank]; }
  long q_length(int rank) const { return length(m_q[rank]); }
  long k_length(int rank) const { return length(m_k[rank]); }
  long q_total() const { return m_q_total; }
  long k_total() const { return m_k_total; }
  long k_length_max() const {
    long m = 0;
    for (std::size_t r = 0; r < m_k.size(); ++r) m = std::max(m, length(m_k[r]));
    return m;
  }

 private:
  static long length(const std::vector<Segment>& s) {
    long n = 0;
    for (const auto& x : s) n += x.length;
    return n;
  }
  std::vector<std::vector<Segment>> m_q, m_k;
  long m_q_total = 0, m_k_total = 0;
};

}  // namespace dist
}  // namespace kfa
