#pragma once
/// detail/mask.hpp: which keys a query row sees: bottom-right-aligned causal mask and sliding window, on global
/// positions. Below common/ and cuda/ (it includes only compat.hpp), since both carry a KeyMask: the common
/// argument structs and the native kernels' pointer structs.
#include <kfa/compat.hpp>

namespace kfa {
namespace detail {

/// Where a block of queries and keys sits in the whole sequence: the global position of its first query
/// and first key, and the global lengths that fix the bottom-right alignment. The default (negative
/// totals) means the block is the whole sequence. The MPI ring layer passes its shards' positions here.
struct Positions {
  long q_begin = 0;
  long k_begin = 0;
  long q_total = -1;
  long k_total = -1;
};

/// Query i sees key j iff j < seq_k and i + offset − left ≤ j ≤ i + offset + right, where offset =
/// seq_k − seq_q (bottom-right alignment) and left/right < 0 mean unbounded. Causal is right = 0.
/// For a block of a longer sequence, i and j stay local and the block's global positions fold into
/// offset = (k_total − q_total) + q_begin − k_begin.
struct KeyMask {
  long seq_k = 0;
  long offset = 0;
  long left = -1;
  long right = -1;

  KeyMask() = default;
  KeyMask(long seq_q_, long seq_k_, bool causal, long window_left, long window_right)
      : seq_k(seq_k_), offset(seq_k_ - seq_q_), left(window_left), right(window_right) {
    if (causal) right = 0;  // causal and a window combine as FlashAttention does: window (left, 0)
  }
  KeyMask(long seq_q_, long seq_k_, const Positions& p, bool causal, long window_left, long window_right)
      : KeyMask(seq_q_, seq_k_, causal, window_left, window_right) {
    const long q_total = p.q_total < 0 ? seq_q_ : p.q_total;
    const long k_total = p.k_total < 0 ? seq_k_ : p.k_total;
    offset = (k_total - q_total) + p.q_begin - p.k_begin;
  }
  KOKKOS_INLINE_FUNCTION bool visible(long i, long j) const {
    return j >= 0 && j < seq_k && (left < 0 || j >= i + offset - left) && (right < 0 || j <= i + offset + right);
  }
  /// The keys row i sees as one range [first, last] (empty when first > last): visible(i, j) is
  /// first <= j <= last. Kernels test a whole row of a tile against it.
  KOKKOS_INLINE_FUNCTION void visible_range(long i, long& first, long& last) const {
    first = left < 0 ? 0 : i + offset - left;
    if (first < 0) first = 0;
    last = right < 0 ? seq_k - 1 : i + offset + right;
    if (last > seq_k - 1) last = seq_k - 1;
  }
  /// First key any of rows [i_begin, i_end) can see (may be ≥ the returned end: nothing visible).
  KOKKOS_INLINE_FUNCTION long key_begin(long i_begin) const {
    const long b = left < 0 ? 0 : i_begin + offset - left;
    return b < 0 ? 0 : b;
  }
  /// One past the last key any of rows [i_begin, i_end) can see.
  KOKKOS_INLINE_FUNCTION long key_end(long i_end) const {
    const long e = right < 0 ? seq_k : (i_end - 1) + offset + right + 1;
    return e > seq_k ? seq_k : e;
  }
  /// First query row that sees any key of [j_begin, j_end) (clamped to 0).
  KOKKOS_INLINE_FUNCTION long query_begin(long j_begin) const {
    const long b = right < 0 ? 0 : j_begin - offset - right;
    return b < 0 ? 0 : b;
  }
  /// One past the last query row that sees any key of [j_begin, j_end), clamped to seq_q.
  KOKKOS_INLINE_FUNCTION long query_end(long j_end, long seq_q) const {
    const long e = left < 0 ? seq_q : (j_end - 1) + left - offset + 1;
    return e > seq_q ? seq_q : e;
  }
  /// True when every row of [i_begin, i_end) sees every key of [j_begin, j_end) (no masking needed).
  KOKKOS_INLINE_FUNCTION bool all_visible(long i_begin, long i_end, long j_begin, long j_end) const {
    return j_end <= seq_k && (left < 0 || j_begin >= (i_end - 1) + offset - left) &&
           (right < 0 || j_end - 1 <= i_begin + offset + right);
  }
};

}  // namespace detail
}  // namespace kfa
