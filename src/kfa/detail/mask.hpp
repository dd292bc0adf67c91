#pragma once
/// detail/mask.hpp: which keys a query row sees: bottom-right-aligned causal mask and sliding window, on global
/// positions, inside each document of a variable-length batch. Below common/ and cuda/ (it includes only
/// compat.hpp), since both carry a KeyMask: the common argument structs and the native kernels' pointer structs.
#include <kfa/compat.hpp>

namespace kfa {
namespace detail {

/// Packed variable-length sequences (FlashAttention's cu_seqlens): document s holds the queries
/// [cu_q[s], cu_q[s+1]) and the keys [cu_k[s], cu_k[s+1]) of one packed sequence, and no query sees a key of
/// another document. Pointers into memory the kernels' execution space reads (count + 1 entries each,
/// validated on the host before any launch); count = 0 is a fixed-length call.
/// A shard of the documents (kfa::dist's zigzag: each document cut into chunks spread over the ranks) says
/// where its part of each document lies in it (sharded = 1): then cu_q holds, after its count + 1 bounds,
/// len_q[s] − at_q[s] for each document s (count): its whole length less the position in it of its first
/// query here; cu_k likewise. Otherwise (the default) the documents are whole (at 0, lengths from the bounds).
struct Documents {
  const int* cu_q = nullptr;
  const int* cu_k = nullptr;
  int count = 0;
  int sharded = 0;
};

/// The last i in [lo, hi] where `pred` holds, for a pred that holds up to some index and not after it (lo when it
/// holds nowhere). Eight probes a step whose loads go out together, so a search over n entries waits for about
/// log9(n) dependent loads instead of a binary search's log2(n): the document searches at a CUDA block's start
/// lie on the path to its first tile.
template <class Pred>
KOKKOS_INLINE_FUNCTION int last_where(int lo, int hi, const Pred& pred) {
  while (lo < hi) {
    const int w = (hi - lo + 9) / 9;  // the interval's ninth, rounded up: ≥ 1
    int c = 0;                        // the probes lo + i·w (i = 1 .. 8) where pred holds: a prefix of them
#pragma unroll
    for (int i = 1; i <= 8; ++i) {
      const int p = lo + i * w;
      c += p <= hi && pred(p) ? 1 : 0;
    }
    const int top = lo + (c + 1) * w - 1;
    hi = top < hi ? top : hi;
    lo += c * w;
  }
  return lo;
}

/// Where a block of queries and keys sits in the whole sequence: the global position of its first query
/// and first key, and the global lengths that fix the bottom-right alignment. The default (negative
/// totals) means the block is the whole sequence. The MPI ring layer passes its shards' positions here;
/// the variable-length API its documents (then the block is the whole packed sequence).
struct Positions {
  long q_begin = 0;
  long k_begin = 0;
  long q_total = -1;
  long k_total = -1;
  Documents docs;
};

/// Query i sees key j iff j < seq_k and i + offset − left ≤ j ≤ i + offset + right, where offset =
/// seq_k − seq_q (bottom-right alignment) and left/right < 0 mean unbounded. Causal is right = 0.
/// For a block of a longer sequence, i and j stay local and the block's global positions fold into
/// offset = (k_total − q_total) + q_begin − k_begin.
/// The rule of one sequence, with no documents: what the kernels' key loops apply. Keys outside
/// [key_lo, seq_k) and query rows outside [q_lo, q_hi) (q_hi < 0: no upper bound) see, and are seen by, nothing:
/// a pass over one document of a block that holds rows or keys of several (KeyMask::rule).
struct KeyRule {
  long seq_k = 0;
  long offset = 0;
  long left = -1;
  long right = -1;
  long key_lo = 0, q_lo = 0, q_hi = -1;

  KOKKOS_INLINE_FUNCTION bool row_inside(long i) const { return i >= q_lo && (q_hi < 0 || i < q_hi); }
  /// The keys row i sees as one range [first, last] (empty when first > last): visible(i, j) is
  /// first <= j <= last. Kernels test a whole row of a tile against it.
  KOKKOS_INLINE_FUNCTION void visible_range(long i, long& first, long& last) const {
    first = left < 0 ? key_lo : i + offset - left;
    if (first < key_lo) first = key_lo;
    last = right < 0 ? seq_k - 1 : i + offset + right;
    if (last > seq_k - 1) last = seq_k - 1;
    if (!row_inside(i)) last = first - 1;
  }
  /// The query rows that see key j as one range [first, last] (empty when first > last).
  KOKKOS_INLINE_FUNCTION void seen_by(long j, long seq_q, long& first, long& last) const {
    const long hi = q_hi >= 0 && q_hi < seq_q ? q_hi : seq_q;
    first = right < 0 ? q_lo : j - offset - right;
    if (first < q_lo) first = q_lo;
    last = left < 0 ? hi - 1 : j + left - offset;
    if (last > hi - 1) last = hi - 1;
    if (j < key_lo || j >= seq_k) last = first - 1;
  }
  KOKKOS_INLINE_FUNCTION bool visible(long i, long j) const {
    return row_inside(i) && j >= key_lo && j < seq_k && (left < 0 || j >= i + offset - left) &&
           (right < 0 || j <= i + offset + right);
  }
  /// First key any of rows [i_begin, i_end) can see (may be ≥ key_end: nothing visible).
  KOKKOS_INLINE_FUNCTION long key_begin(long i_begin) const {
    if (i_begin < q_lo) i_begin = q_lo;
    const long b = left < 0 ? key_lo : i_begin + offset - left;
    return b < key_lo ? key_lo : b;
  }
  /// One past the last key any of rows [i_begin, i_end) can see (key_lo where none of the rows is inside).
  KOKKOS_INLINE_FUNCTION long key_end(long i_end) const {
    if (q_hi >= 0 && i_end > q_hi) i_end = q_hi;
    if (i_end <= q_lo) return key_lo;
    const long e = right < 0 ? seq_k : (i_end - 1) + offset + right + 1;
    return e > seq_k ? seq_k : e;
  }
  /// First query row that sees any key of [j_begin, j_end) (clamped to q_lo).
  KOKKOS_INLINE_FUNCTION long query_begin(long j_begin) const {
    if (j_begin < key_lo) j_begin = key_lo;
    const long b = right < 0 ? q_lo : j_begin - offset - right;
    return b < q_lo ? q_lo : b;
  }
  /// One past the last query row that sees any key of [j_begin, j_end), clamped to seq_q (q_lo where none of the
  /// keys is inside).
  KOKKOS_INLINE_FUNCTION long query_end(long j_end, long seq_q) const {
    if (j_end > seq_k) j_end = seq_k;
    if (j_end <= key_lo) return q_lo;
    const long hi = q_hi >= 0 && q_hi < seq_q ? q_hi : seq_q;
    const long e = left < 0 ? hi : (j_end - 1) + left - offset + 1;
    return e > hi ? hi : e;
  }
  /// True when every row of [i_begin, i_end) sees every key of [j_begin, j_end) (no masking needed).
  KOKKOS_INLINE_FUNCTION bool all_visible(long i_begin, long i_end, long j_begin, long j_end) const {
    return j_end <= seq_k && j_begin >= key_lo && i_begin >= q_lo && (q_hi < 0 || i_end <= q_hi) &&
           (left < 0 || j_begin >= (i_end - 1) + offset - left) && (right < 0 || j_end - 1 <= i_begin + offset + right);
  }
  /// all_visible for the rows [i_begin, i_end) as one key range, for kernels that hold it instead of the rule:
  /// every row sees every key of [j_begin, j_end) iff lo <= j_begin and j_end - 1 <= hi (lo > hi: no keys).
  KOKKOS_INLINE_FUNCTION void unmasked_keys(long i_begin, long i_end, long& lo, long& hi) const {
    lo = 0, hi = -1;
    if (i_begin < q_lo || (q_hi >= 0 && i_end > q_hi)) return;
    lo = left < 0 || (i_end - 1) + offset - left < key_lo ? key_lo : (i_end - 1) + offset - left;
    hi = right < 0 || i_begin + offset + right > seq_k - 1 ? seq_k - 1 : i_begin + offset + right;
  }
};

/// The documents [first, last) that a block's rows (or keys) meet; one (first = 0) without documents.
struct DocumentSpan {
  int first = 0, last = 1;
};

/// The rule with documents (varlen): the same rule holds inside each document, on the document's own positions
/// and lengths (bottom-right alignment per document); i and j index the block, whose first query and key sit at
/// q_begin and k_begin of the packed sequence the documents' bounds refer to (0 for a whole packed batch; a
/// ring shard's segment otherwise). Sharded documents hold one contiguous piece of each document, placed in it
/// as Documents says; the document's own lengths still fix the alignment.
/// This is the one place variable-length batches reach the kernels, and their key loops never see documents: a
/// kernel asks which documents its block meets (documents_of_rows / documents_of_keys) and runs its key loop once
/// per document with that document's KeyRule (rule(s)), keeping its accumulators across the passes. A block inside
/// one document makes one pass that costs what a fixed-length block does; a block that straddles documents makes
/// one pass per document, each over that document's keys (the rows of the others see nothing in it). The member
/// functions below answer for the whole packed sequence (the reference, the ring's planning on the host).
struct KeyMask {
  KeyRule base;  // the rule without documents (the offset folds in the block's place)
  Documents docs;
  long q_begin = 0, k_begin = 0;  // with documents: the block's place in the packed sequence

  KeyMask() = default;
  KeyMask(long seq_q_, long seq_k_, bool causal, long window_left, long window_right) {
    base.seq_k = seq_k_;
    base.offset = seq_k_ - seq_q_;
    base.left = window_left;
    base.right = causal ? 0 : window_right;  // causal and a window combine as FlashAttention does: window (left, 0)
  }
  KeyMask(long seq_q_, long seq_k_, const Positions& p, bool causal, long window_left, long window_right)
      : KeyMask(seq_q_, seq_k_, causal, window_left, window_right) {
    const long q_total = p.q_total < 0 ? seq_q_ : p.q_total;
    const long k_total = p.k_total < 0 ? seq_k_ : p.k_total;
    base.offset = (k_total - q_total) + p.q_begin - p.k_begin;
    docs = p.docs;
    q_begin = p.q_begin, k_begin = p.k_begin;
  }

  /// The document holding packed position x of prefix sums cu (the last s < docs.count with cu[s] <= x:
  /// empty documents never hold a position).
  KOKKOS_INLINE_FUNCTION int document_of(const int* cu, long x) const {
    return last_where(0, docs.count - 1, [&](int s) { return cu[s] <= x; });
  }
  KOKKOS_INLINE_FUNCTION static long clamp(long x, long lo, long hi) { return x < lo ? lo : (x > hi ? hi : x); }
  /// Where document s's keys sit against its queries here: key position (counted from its first key here) =
  /// query position (from its first query here) + shift sees the key on the diagonal: len_k − len_q (bottom-
  /// right alignment in the document) + at_q − at_k (where the pieces sit in it). Written so that whole and
  /// sharded documents take the same loads and no branch.
  KOKKOS_INLINE_FUNCTION long doc_shift(int s) const {
    const int *q = docs.cu_q, *k = docs.cu_k, whole = 1 - docs.sharded, at = s + 1 + docs.sharded * docs.count;
    return (k[at] - whole * k[s]) - (q[at] - whole * q[s]);
  }

  /// The documents the rows [i_begin, i_end) of a block meet (query-block kernels ask once per block).
  /// A block inside one document (every CUDA block: cuda/block_order.hpp) costs one search and one more load.
  KOKKOS_INLINE_FUNCTION DocumentSpan documents_of_rows(long i_begin, long i_end) const {
    if (docs.count == 0 || i_end <= i_begin) return {};
    return span_of(docs.cu_q, q_begin + i_begin, q_begin + i_end - 1);
  }
  /// The documents the keys [j_begin, j_end) of a key-block kernel's block meet.
  KOKKOS_INLINE_FUNCTION DocumentSpan documents_of_keys(long j_begin, long j_end) const {
    if (docs.count == 0 || j_end <= j_begin) return {};
    return span_of(docs.cu_k, k_begin + j_begin, k_begin + j_end - 1);
  }
  /// The documents of positions [x0, x1] (x0 ≤ x1) of prefix sums cu.
  KOKKOS_INLINE_FUNCTION DocumentSpan span_of(const int* cu, long x0, long x1) const {
    const int first = document_of(cu, x0);
    return {first, (cu[first + 1] > x1 ? first : document_of(cu, x1)) + 1};
  }
  /// The rule of a pass over document s of the span (without documents, this rule).
  KOKKOS_INLINE_FUNCTION KeyRule rule(int s) const {
    if (docs.count == 0) return base;
    const long q0 = docs.cu_q[s] - q_begin, q1 = docs.cu_q[s + 1] - q_begin;
    const long k0 = docs.cu_k[s] - k_begin, k1 = docs.cu_k[s + 1] - k_begin;
    KeyRule r;
    r.left = base.left, r.right = base.right;
    r.offset = k0 - q0 + doc_shift(s);  // bottom-right alignment in the document
    r.seq_k = k1 < base.seq_k ? k1 : base.seq_k;
    r.key_lo = k0 > 0 ? k0 : 0;
    r.q_lo = q0 > 0 ? q0 : 0;
    r.q_hi = q1 > 0 ? q1 : 0;
    return r;
  }

  /// As KeyRule's, over the documents (each row's visible keys stay one range, and the ranges' ends grow with
  /// the row across documents too).
  KOKKOS_INLINE_FUNCTION void visible_range(long i, long& first, long& last) const {
    if (docs.count == 0) return base.visible_range(i, first, last);
    // pi: the key on row i's diagonal, counted from the document's first key here (nk of them).
    const int s = document_of(docs.cu_q, q_begin + i);
    const long q0 = docs.cu_q[s], k0 = docs.cu_k[s];
    const long nk = docs.cu_k[s + 1] - k0, pi = q_begin + i - q0 + doc_shift(s);
    const long left = base.left, right = base.right;
    first = k0 - k_begin + (left < 0 ? 0 : clamp(pi - left, 0, nk));
    last = k0 - k_begin + (right < 0 ? nk - 1 : clamp(pi + right, -1, nk - 1));
    if (first < 0) first = 0;  // keys before or after this block's
    if (last > base.seq_k - 1) last = base.seq_k - 1;
  }
  KOKKOS_INLINE_FUNCTION bool visible(long i, long j) const {
    if (docs.count == 0) return base.visible(i, j);
    long first, last;
    visible_range(i, first, last);
    return j >= first && j <= last;
  }
  /// First key any of rows [i_begin, …) can see.
  KOKKOS_INLINE_FUNCTION long key_begin(long i_begin) const {
    if (docs.count == 0) return base.key_begin(i_begin);
    long first, last;
    visible_range(i_begin, first, last);
    return first;
  }
  /// One past the last key any of rows […, i_end) can see.
  KOKKOS_INLINE_FUNCTION long key_end(long i_end) const {
    if (docs.count == 0) return base.key_end(i_end);
    long first, last;
    visible_range(i_end - 1, first, last);
    return last + 1;
  }
};

}  // namespace detail
}  // namespace kfa
