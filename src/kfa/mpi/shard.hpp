#pragma once
/// kfa/mpi/shard.hpp (namespace kfa::dist): how one sequence is cut into per-rank shards, for the ring and
/// kfa::io. Contiguous: rank r holds one run of tokens, of any length (lengths may differ per rank). Zigzag
/// (causal load balance): the sequence is cut into 2P nearly equal chunks and rank r holds chunks r and 2P−1−r,
/// in that order; a packed stream of documents is cut so per document (document_shard).
#include <kfa/error.hpp>

#include <algorithm>
#include <cstddef>
#include <string>
#include <utility>
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

/// The pieces rank `rank` of `nranks` holds of a packed stream of documents (prefix sums `cu`, as
/// cu_seqlens: document s is the tokens [cu[s], cu[s+1])) cut with `layout`, in the rank's local order.
/// Contiguous: one run of the stream, the most even cut (shard_of). Zigzag: every document cut into 2P
/// chunks as shard_of cuts one sequence, so that causal work balances per document (TransformerEngine's THD
/// layout); the rank holds chunk r of every document, in document order, then chunk 2P−1−r of every
/// document: one piece per document and half, empty ones included (a document shorter than 2P tokens). One
/// rank holds the stream itself, in either layout.
inline std::vector<Segment> document_shard(Layout layout, const std::vector<int>& cu, int nranks, int rank) {
  const long total = cu.empty() ? 0 : cu.back();
  if (layout == Layout::contiguous || nranks == 1) return shard_of(Layout::contiguous, total, nranks, rank);
  std::vector<Segment> pieces;
  long local = 0;
  for (const int half : {0, 1})
    for (std::size_t s = 0; s + 1 < cu.size(); ++s) {
      Segment c = shard_of(Layout::zigzag, cu[s + 1] - cu[s], nranks, rank)[half];
      c.global_begin += cu[s], c.local_begin = local;
      local += c.length;
      pieces.push_back(c);
    }
  return pieces;
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
  /// Of a packed stream of documents (prefix sums cu_q, cu_k, the same on every rank) cut with document_shard;
  /// throws kfa::Error when the ranks' lengths do not fit. Zigzag (two ranks or more): each rank's shard is
  /// two segments (its chunks r, then its chunks 2P−1−r) that are not runs of the stream (global_begin −1),
  /// and pieces() says where their documents' tokens are.
  ShardMap(Layout layout, const std::vector<int>& cu_q, const std::vector<int>& cu_k, const std::vector<long>& q_len,
           const std::vector<long>& k_len)
      : ShardMap(Layout::contiguous, q_len, k_len) {
    const int p = static_cast<int>(q_len.size());
    if (layout == Layout::contiguous || p == 1) return;
    m_docs = static_cast<int>(cu_q.size()) - 1;
    for (const bool keys : {false, true}) {
      const std::vector<int>& cu = keys ? cu_k : cu_q;
      auto& segs = keys ? m_k : m_q;
      auto& pieces = keys ? m_k_pieces : m_q_pieces;
      pieces.assign(p, {});
      for (int r = 0; r < p; ++r) {
        pieces[r] = document_shard(layout, cu, p, r);
        long half = 0, all = 0;
        for (int i = 0; i < 2 * m_docs; ++i) (i < m_docs ? half : all) += pieces[r][i].length;
        all += half;
        const long held = keys ? k_len[r] : q_len[r];
        if (held != all)
          kfa::detail::fail("zigzag layout over documents: rank ", r, " must hold chunks ", r, " and ", 2 * p - 1 - r,
                            " of every document's ", keys ? "keys" : "queries", " (", all, " tokens) but holds ", held);
        segs[r] = {{-1, half, 0}, {-1, all - half, half}};
      }
    }
  }
  /// Of explicit runs per rank (global_begin, length, and local_begin in the rank's arrays; runs of one
  /// rank in local order, every token of each sequence held once): the map of a ring each of whose ranks
  /// holds the union of several ranks' shards (kfa::dist::Ulysses between its all-to-alls).
  static ShardMap of_segments(std::vector<std::vector<Segment>> q, std::vector<std::vector<Segment>> k) {
    ShardMap m;
    for (const auto& r : q) m.m_q_total += length(r);
    for (const auto& r : k) m.m_k_total += length(r);
    m.m_q = std::move(q), m.m_k = std::move(k);
    return m;
  }
  /// Of a map over documents (zigzag, two ranks or more): the pieces of segment `seg` of rank `rank`'s queries
  /// (keys), one per document in document order, as document_shard gives them; empty otherwise.
  std::vector<Segment> q_pieces(int rank, int seg) const { return pieces_of(m_q_pieces, rank, seg); }
  std::vector<Segment> k_pieces(int rank, int seg) const { return pieces_of(m_k_pieces, rank, seg); }
  /// The number of documents of a map over documents (0 otherwise).
  int documents() const { return m_docs; }
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
  std::vector<Segment> pieces_of(const std::vector<std::vector<Segment>>& all, int rank, int seg) const {
    if (all.empty()) return {};
    const auto first = all[rank].begin() + static_cast<long>(seg) * m_docs;
    return std::vector<Segment>(first, first + m_docs);
  }
  std::vector<std::vector<Segment>> m_q, m_k;
  std::vector<std::vector<Segment>> m_q_pieces, m_k_pieces;
  long m_q_total = 0, m_k_total = 0;
  int m_docs = 0;
};

}  // namespace dist
}  // namespace kfa
