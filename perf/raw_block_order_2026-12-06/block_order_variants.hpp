#pragma once
/// cuda/block_order.hpp: which (batch, head) pair and which query or key block each block of a CUDA launch
/// takes, for every CUDA family's query-block kernels (forwards, dQ) and key-block kernels (dK/dV).
///
/// The hardware hands out blocks in index order, to whichever SM frees up. Without a row-dependent mask
/// every block of a launch does the same work, and the blocks of one (batch, head) pair go one after the
/// other, so the K/V (or Q/dO) they all read stays in L2. Under a causal mask or a window the work differs
/// by block (a causal query block sees as many keys as rows precede it): then the pairs go in sections of
/// as many as half the L2 holds the operands of, and inside a section the blocks with the most work come
/// first, over all of its pairs (longest-processing-time order), so the launch ends on its shortest blocks.
#include <kfa/compat.hpp>
#include <kfa/detail/mask.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <mutex>

#if defined(KOKKOS_ENABLE_CUDA)
#include <cuda_runtime.h>
#endif

namespace kfa {
namespace detail {

/// The L2 cache of the current CUDA device in bytes (0 without CUDA, or where the runtime does not say).
inline long cuda_l2_bytes() {
#if defined(KOKKOS_ENABLE_CUDA)
  static std::mutex mu;
  static long known[256] = {};  // per device: 0 not asked yet, else the size + 1
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 256) return 0;
  std::lock_guard<std::mutex> lock(mu);
  if (known[dev] == 0) {
    int bytes = 0;
    if (cudaDeviceGetAttribute(&bytes, cudaDevAttrL2CacheSize, dev) != cudaSuccess) bytes = 0;
    known[dev] = static_cast<long>(bytes) + 1;
  }
  return known[dev] - 1;
#else
  return 0;
#endif
}

/// The order of a launch of pairs × blocks blocks (league rank r): `section` pairs at a time, and in a
/// section rank 0 (the block with the most work) of each pair first, then rank 1, ... With section = 1 the
/// pairs go one after the other, each from rank 0.
struct BlockOrder {
  int blocks = 0;   // blocks per pair
  int pairs = 0;    // (batch, head) pairs
  int section = 1;  // pairs whose blocks interleave

  BlockOrder() = default;
  /// pairs · blocks blocks; `pair_bytes`: what the blocks of one pair read in common (K and V for query
  /// blocks, Q, dO and the row statistics for key blocks); the mask says whether their work differs.
  BlockOrder(long blocks_, long pairs_, const KeyMask& mask, double pair_bytes)
      : blocks(static_cast<int>(blocks_)), pairs(static_cast<int>(pairs_)) {
    const bool uniform = mask.base.left < 0 && mask.base.right < 0;
    double half_l2 = 0.5 * static_cast<double>(cuda_l2_bytes());
    const char* e = std::getenv("KFA_EXP_SECTION");  // EXPERIMENT ONLY
    if (e && e[0] == 'b') half_l2 = std::atof(e + 1) * static_cast<double>(cuda_l2_bytes());
    if (!uniform && pairs > 1 && pair_bytes > 0.0)
      section = static_cast<int>(std::max(1.0, std::min(static_cast<double>(pairs), half_l2 / pair_bytes)));
    if (e && e[0] == 'w' && blocks > 0) {
      int sms = 132;
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
      const double w = std::atof(e + 1) * sms / blocks;
      section = uniform ? 1 : static_cast<int>(std::max(1.0, std::min(static_cast<double>(pairs), w + 0.5)));
    }
    if (e && e[0] == '0') section = 1;
    if (e && std::getenv("KFA_EXP_VERBOSE")) std::fprintf(stderr, "order blocks %d pairs %d section %d\n", blocks, pairs, section);
  }
  /// The blocks of the launch (native_launch checks it fits an int).
  long league() const { return static_cast<long>(pairs) * blocks; }

  /// League rank r's pair and rank (0: the most work).
  KOKKOS_INLINE_FUNCTION void at(int r, int& pair, int& rank) const {
    const int per = section * blocks;
    const int first = r / per * section;  // the section's first pair
    const int here = pairs - first < section ? pairs - first : section;
    const int in = r - first * blocks;
    rank = in / here;
    pair = first + in % here;
  }
};

/// The query block a block of the CUDA query-block kernels (forwards, dQ) owns, from its league rank. The
/// last query block of a pair has the most work under a causal mask: rank 0 is the last.
struct QueryBlock {
  int b, h, hk, i0, rows;  // batch, query head, kv head, first row, rows in this block
  KOKKOS_INLINE_FUNCTION QueryBlock(int league_rank, const BlockOrder& order, int heads_q, int group, int block_q,
                                    int seq_q) {
    int pair, rank;
    order.at(league_rank, pair, rank);
    h = pair % heads_q;
    b = pair / heads_q;
    hk = h / group;
    i0 = (order.blocks - 1 - rank) * block_q;
    rows = (seq_q - i0) < block_q ? (seq_q - i0) : block_q;
  }
};

/// The key block a block of the CUDA dK/dV kernels owns: under a causal mask the first key block is seen
/// by the most queries, so rank r is key block r.
struct KeyBlock {
  int b, hk, kb;  // batch, kv head, key block
  KOKKOS_INLINE_FUNCTION KeyBlock(int league_rank, const BlockOrder& order, int heads_kv) {
    int pair;
    order.at(league_rank, pair, kb);
    hk = pair % heads_kv;
    b = pair / heads_kv;
  }
};

/// Query heads per kv head (1 where there are none).
inline long group_of(long heads_q, long heads_kv) {
  return heads_kv > 0 && heads_q >= heads_kv ? heads_q / heads_kv : 1;
}

/// The order of a query-block launch over q [batch][seq_q][heads_q][d], k/v [.][seq_k][heads_kv][d] of
/// `elem` bytes: query heads of one kv head read its K and V.
inline BlockOrder query_block_order(long batch, long seq_q, long heads_q, long seq_k, long heads_kv, long d, long elem,
                                    int block_q, const KeyMask& mask) {
  const double kv = 2.0 * static_cast<double>(seq_k) * d * elem / static_cast<double>(group_of(heads_q, heads_kv));
  return BlockOrder((seq_q + block_q - 1) / block_q, batch * heads_q, mask, kv);
}
/// The order of a key-block launch: a kv head's blocks read Q, dO (and 8 bytes of row statistics a row) of
/// its query heads.
inline BlockOrder key_block_order(long batch, long seq_q, long heads_q, long seq_k, long heads_kv, long d, long elem,
                                  int block_k, const KeyMask& mask) {
  const double qdo =
      (2.0 * d * elem + 8.0) * static_cast<double>(seq_q) * static_cast<double>(group_of(heads_q, heads_kv));
  return BlockOrder((seq_k + block_k - 1) / block_k, batch * heads_kv, mask, qdo);
}

/// The same from a call's ForwardArgs or BackwardArgs (common/kernel_args.hpp).
template <class Args>
BlockOrder query_block_order(const Args& a, int block_q) {
  return query_block_order(a.q.extent(0), a.q.extent(1), a.q.extent(2), a.k.extent(1), a.k.extent(2), a.q.extent(3),
                           sizeof(typename Args::q_type::non_const_value_type), block_q, a.mask);
}
template <class Args>
BlockOrder key_block_order(const Args& a, int block_k) {
  return key_block_order(a.q.extent(0), a.q.extent(1), a.q.extent(2), a.k.extent(1), a.k.extent(2), a.q.extent(3),
                         sizeof(typename Args::q_type::non_const_value_type), block_k, a.mask);
}

}  // namespace detail
}  // namespace kfa
