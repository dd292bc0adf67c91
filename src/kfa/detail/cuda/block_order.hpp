#pragma once
/// cuda/block_order.hpp: which (batch, head) pair and which query or key block each block of a CUDA launch
/// takes, for every CUDA family's query-block kernels (forwards, dQ) and key-block kernels (dK/dV).
///
/// The hardware hands out blocks in index order, to whichever SM frees up. Without a row-dependent mask
/// every block of a launch does the same work, and the blocks of one (batch, head) pair go one after the
/// other, so the K/V (or Q/dO) they all read stays in L2. Under a causal mask or a window the work differs
/// by block (a causal query block sees as many keys as rows precede it): then the pairs go in sections of
/// as many as fill the device's SMs once with their blocks (the pairs in flight together anyway), and inside
/// a section the blocks with the most work come first over all of its pairs (longest-processing-time order),
/// so a section ends on its shortest blocks, not on the long blocks of its last pair.
#include <kfa/compat.hpp>
#include <kfa/detail/mask.hpp>

#include <algorithm>
#include <mutex>

#if defined(KOKKOS_ENABLE_CUDA)
#include <cuda_runtime.h>
#endif

namespace kfa {
namespace detail {

/// The SMs of the current CUDA device (0 without CUDA, or where the runtime does not say).
inline int cuda_sm_count() {
#if defined(KOKKOS_ENABLE_CUDA)
  static std::mutex mu;
  static int known[256] = {};  // per device: 0 not asked yet, else the count + 1
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 256) return 0;
  std::lock_guard<std::mutex> lock(mu);
  if (known[dev] == 0) {
    int sms = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) sms = 0;
    known[dev] = sms + 1;
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
  /// pairs · blocks blocks on a device of `sms` SMs; the mask says whether their work differs by block.
  /// Measured on an H100 (132 SMs; bf16, causal; medians against the pair-after-pair order): one wave 1.02–1.04×
  /// the forward at d 128, N 2048–8192, 0.99–1.02× at d 64 and N 16384; two waves 0.98–1.03×; as many pairs as
  /// half the L2 holds the shared operands of 0.93–1.02× (d 128, N 16384: three heads' K/V in flight, not one).
  BlockOrder(long blocks_, long pairs_, const KeyMask& mask, int sms)
      : blocks(static_cast<int>(blocks_)), pairs(static_cast<int>(pairs_)) {
    const bool uniform = mask.base.left < 0 && mask.base.right < 0;
    if (!uniform && blocks > 0 && sms > 0)
      section = static_cast<int>(std::max(1L, std::min<long>(pairs, (sms + blocks / 2) / blocks)));
  }
  /// The blocks of the launch (native_launch checks it fits an int).
  long league() const { return static_cast<long>(pairs) * blocks; }

  /// League rank r's pair and rank (0: the most work). Unsigned arithmetic: with signed divisions ptxas gave the
  /// d = 128 wgmma dK/dV kernel 255 registers and 16 B of spills (sm_90a, bf16); unsigned, 248 and none.
  KOKKOS_INLINE_FUNCTION void at(int r, int& pair, int& rank) const {
    const unsigned u = static_cast<unsigned>(r), sec = static_cast<unsigned>(section);
    const unsigned first = u / (sec * static_cast<unsigned>(blocks)) * sec;  // the section's first pair
    const unsigned left = static_cast<unsigned>(pairs) - first;
    const unsigned here = left < sec ? left : sec;
    const unsigned in = u - first * static_cast<unsigned>(blocks);
    const unsigned rk = in / here;
    rank = static_cast<int>(rk);
    pair = static_cast<int>(first + in - rk * here);
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

/// The order of a query-block launch over q [batch][seq_q][heads_q][.] in blocks of `block_q` rows.
inline BlockOrder query_block_order(long batch, long seq_q, long heads_q, int block_q, const KeyMask& mask,
                                    int sms = cuda_sm_count()) {
  return BlockOrder((seq_q + block_q - 1) / block_q, batch * heads_q, mask, sms);
}
/// The order of a key-block launch over k [batch][seq_k][heads_kv][.] in blocks of `block_k` keys.
inline BlockOrder key_block_order(long batch, long seq_k, long heads_kv, int block_k, const KeyMask& mask,
                                  int sms = cuda_sm_count()) {
  return BlockOrder((seq_k + block_k - 1) / block_k, batch * heads_kv, mask, sms);
}

/// The same from a call's ForwardArgs or BackwardArgs (common/kernel_args.hpp).
template <class Args>
BlockOrder query_block_order(const Args& a, int block_q) {
  return query_block_order(a.q.extent(0), a.q.extent(1), a.q.extent(2), block_q, a.mask);
}
template <class Args>
BlockOrder key_block_order(const Args& a, int block_k) {
  return key_block_order(a.k.extent(0), a.k.extent(1), a.k.extent(2), block_k, a.mask);
}

}  // namespace detail
}  // namespace kfa
