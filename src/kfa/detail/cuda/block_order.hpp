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
///
/// With documents (variable-length batches, a ring's sharded documents) the blocks of a pair follow the
/// documents instead of a fixed grid: each block holds rows (or keys) of one document only, so no block runs
/// a pass per document it straddles, and a document's last block is its only partial one. Document s's
/// blocks are the grid's indices [f(s), f(s + 1)) with f(s) = p(s) / size + s, p(s) its first row here
/// (clamped to [0, extent]): f(s + 1) − f(s), the grid cells its rows touch or one more, is at least the
/// blocks the document needs, so the kernels find their block from the document bounds alone (a search, eight
/// probes a step: last_where; no table to build or keep) and the few indices a document does not need are empty
/// blocks (rows ≤ 0) that return at once: at most one per document, extent / size + documents blocks per pair in
/// all.
struct BlockOrder {
  int blocks = 0;   // blocks per pair
  int pairs = 0;    // (batch, head) pairs
  int section = 1;  // pairs whose blocks interleave
  // With documents: their bounds (count + 1 prefix sums, packed positions), this launch's first position in
  // them (a ring shard's place), its rows (or keys) and the rows (keys) per block.
  const int* bounds = nullptr;
  int docs = 0, extent = 0, size = 0;
  long begin = 0;

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
  /// The same over `extent` rows (keys) in blocks of `size`, aligned to the documents of `bounds` (see above)
  /// when there are any (`docs` > 0), else on the fixed grid.
  BlockOrder(long extent_, int size_, long pairs_, const KeyMask& mask, const int* bounds_, int docs_, long begin_,
             int sms)
      : BlockOrder(docs_ > 0 ? extent_ / size_ + docs_ : (extent_ + size_ - 1) / size_, pairs_, mask, sms) {
    if (docs_ > 0) bounds = bounds_, docs = docs_, extent = static_cast<int>(extent_), size = size_, begin = begin_;
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

  /// The rows (keys) of grid index v of a pair: [first, first + count), count ≤ 0 for an empty block; with
  /// `block` rows (keys) per block over `extent` on the fixed grid, else the documents' (see above).
  KOKKOS_INLINE_FUNCTION void span(int v, int block, int extent_, int& first, int& count) const {
    if (docs == 0) {
      first = v * block;
      count = (extent_ - first) < block ? (extent_ - first) : block;
      return;
    }
    const int lo = last_where(0, docs - 1, [&](int s) { return start(s) / size + s <= v; });  // the last s, f(s) <= v
    const int p = start(lo), end = start(lo + 1);
    first = p + (v - (p / size + lo)) * size;
    count = (end - first) < size ? (end - first) : size;
  }

 private:
  /// p(s): document s's first row (key) in this launch, clamped to [0, extent].
  KOKKOS_INLINE_FUNCTION int start(int s) const {
    const long p = static_cast<long>(bounds[s]) - begin;
    return static_cast<int>(p < 0 ? 0 : (p > extent ? extent : p));
  }
};

/// The query block a block of the CUDA query-block kernels (forwards, dQ) owns, from its league rank. The
/// last query block of a pair has the most work under a causal mask: rank 0 is the last. With documents a
/// block may be empty (rows ≤ 0): the kernel returns at once, before any barrier.
struct QueryBlock {
  int b, h, hk, i0, rows;  // batch, query head, kv head, first row, rows in this block
  KOKKOS_INLINE_FUNCTION QueryBlock(int league_rank, const BlockOrder& order, int heads_q, int group, int block_q,
                                    int seq_q) {
    int pair, rank;
    order.at(league_rank, pair, rank);
    h = pair % heads_q;
    b = pair / heads_q;
    hk = h / group;
    order.span(order.blocks - 1 - rank, block_q, seq_q, i0, rows);
  }
};

/// The key block a block of the CUDA dK/dV kernels owns: under a causal mask the first key block is seen
/// by the most queries, so rank r is key block r. With documents a block may be empty (keys ≤ 0): the kernel
/// returns at once, before any barrier.
struct KeyBlock {
  int b, hk, k0, keys;  // batch, kv head, first key, keys in this block
  KOKKOS_INLINE_FUNCTION KeyBlock(int league_rank, const BlockOrder& order, int heads_kv, int block_k, int seq_k) {
    int pair, rank;
    order.at(league_rank, pair, rank);
    hk = pair % heads_kv;
    b = pair / heads_kv;
    order.span(rank, block_k, seq_k, k0, keys);
  }
};

/// The order of a query-block launch over q [batch][seq_q][heads_q][.] in blocks of `block_q` rows (aligned to
/// the mask's documents where it has any).
inline BlockOrder query_block_order(long batch, long seq_q, long heads_q, int block_q, const KeyMask& mask,
                                    int sms = cuda_sm_count()) {
  return BlockOrder(seq_q, block_q, batch * heads_q, mask, mask.docs.cu_q, mask.docs.count, mask.q_begin, sms);
}
/// The order of a key-block launch over k [batch][seq_k][heads_kv][.] in blocks of `block_k` keys (aligned to
/// the mask's documents where it has any).
inline BlockOrder key_block_order(long batch, long seq_k, long heads_kv, int block_k, const KeyMask& mask,
                                  int sms = cuda_sm_count()) {
  return BlockOrder(seq_k, block_k, batch * heads_kv, mask, mask.docs.cu_k, mask.docs.count, mask.k_begin, sms);
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
