#pragma once
/// Tile sizes from the head dimension, the element size and the team scratch budget.
///
/// On device backends the forward kernel streams K and V tiles through level-0 team scratch (the fast, small
/// level: about 40 KiB per team on Kokkos CUDA); the Q tile, the O accumulator and the score tile of the team's
/// query block live in level-1 scratch, the larger per-team level. The key block is the largest that keeps the
/// K and V tiles within 90 % of level 0. On host backends both levels are ordinary memory behind the core's
/// caches, so every tile lives in level 1 and the streamed tiles get a budget of their own (detail::
/// host_forward_stream_bytes, host_backward_stream_bytes) instead of Kokkos' 32 KiB level-0 limit. The query
/// block trades reuse of each K/V tile (larger is better) against having enough teams to fill the machine.
#include <kfa/compat.hpp>
#include <kfa/error.hpp>
#include <kfa/options.hpp>

#include <algorithm>
#include <cstddef>
#include <string>

namespace kfa {

/// The tile configuration chosen for one call; queryable with forward_tile_config().
struct TileConfig {
  int block_q = 0;                 ///< query rows per team
  int block_k = 0;                 ///< keys per streamed K/V tile
  int team_size = 0;               ///< threads per team
  std::size_t scratch_l0 = 0;      ///< level-0 bytes per team (K and V tiles)
  std::size_t scratch_l1 = 0;      ///< level-1 bytes per team (Q, O, S tiles and row state)
  std::size_t scratch_l0_max = 0;  ///< what the backend allows at level 0
};

namespace detail {

/// Elements are carved from one scratch buffer per level at 64-byte-aligned offsets.
KOKKOS_INLINE_FUNCTION constexpr std::size_t pad_elems(std::size_t n, std::size_t elem_bytes) {
  const std::size_t per_line = 64 / elem_bytes;
  return (n + per_line - 1) / per_line * per_line;
}

/// Host tiles whose rows are a power-of-two number of bytes apart (query-block rows: 128 floats = 512 B) put
/// every row of a column strip in the same few sets of the L1 cache and evict each other while a tile product
/// or a softmax pass walks down the strip; one more cache line per row spreads them over all sets. Measured on
/// one Intel Xeon core (Emerald Rapids, float, d 64, bq = bk = 128): the micro-tiles of S = K·Qᵀ from 0.52 to
/// 0.93 of the FMA peak. Not on devices, whose scratch is banked, not set-associative.
KOKKOS_INLINE_FUNCTION constexpr int host_row_pad(std::size_t elem_bytes) {
  return static_cast<int>(64 / elem_bytes);
}

/// Element offsets of the forward kernel's scratch tiles. `ld` is the row length of the Qᵀ and Sᵀ tiles: bq,
/// plus host_row_pad on host.
struct ForwardScratchLayout {
  int ld;
  std::size_t k, v, l0_total;            // level 0: K[bk][d], V[bk][d]
  std::size_t qt, o, s, m, l, l1_total;  // level 1: Qᵀ[d][ld], O[bq][d], Sᵀ[bk][ld], m[bq], ℓ[bq]
  KOKKOS_INLINE_FUNCTION ForwardScratchLayout(int bq, int bk, int d, std::size_t eb, bool host) {
    ld = bq + (host ? host_row_pad(eb) : 0);
    k = 0;
    v = k + pad_elems(std::size_t(bk) * d, eb);
    l0_total = v + pad_elems(std::size_t(bk) * d, eb);
    qt = 0;
    o = qt + pad_elems(std::size_t(d) * ld, eb);
    s = o + pad_elems(std::size_t(bq) * d, eb);
    m = s + pad_elems(std::size_t(bk) * ld, eb);
    l = m + pad_elems(bq, eb);
    l1_total = l + pad_elems(bq, eb);
  }
};

/// Bytes Kokkos needs for a scratch View of n elements (its own alignment included).
template <class ExecSpace, class Acc>
std::size_t scratch_view_bytes(std::size_t n) {
  using V = Kokkos::View<Acc*, typename ExecSpace::scratch_memory_space, Kokkos::MemoryUnmanaged>;
  return V::shmem_size(n);
}

template <class ExecSpace>
constexpr bool is_host_space() {
  return Kokkos::SpaceAccessibility<Kokkos::HostSpace, typename ExecSpace::memory_space>::accessible;
}

/// Host backends: bytes for the two streamed tiles of a step, the forward's K and V and the backward's Q and dO
/// (its dK/dV pass), and the forward's query block. The team's working set (streamed tiles, owned tiles,
/// scores) stays in a core's L2 (1-2 MiB on the x86 cores we measure) while a tile product's panels stay in L1.
/// Measured on one Zen 4 core (float, N 2048-8192, 2026-12-04): the forward gains 3-5% from 128 keys over 64 at
/// d = 128 and 3-5% from 128 query rows over 64; the backward loses 3-5% (causal) with 128 streamed rows at
/// d = 128 against 64. So: forward 128 keys at d <= 128 (the cap), 64 at d = 256; backward 64 rows at d = 128,
/// 128 at d <= 64, 32 at d = 256.
constexpr std::size_t host_forward_stream_bytes = 136 * 1024;
constexpr std::size_t host_backward_stream_bytes = 72 * 1024;
constexpr int host_forward_block_q = 128;
/// Host kernels: a tile the mask cuts (a causal diagonal, a window's edge) computes its products in strips of this
/// many keys or query rows, each over the part its mask leaves visible (forward and the backward's dK/dV pass).
constexpr int host_mask_strip = 32;
/// Host backward: keys a dK/dV team owns at 64 < d <= 128 (64 elsewhere, and on devices). Every owned key block
/// streams the whole query range past it (Q, dO and the dQ workspace rows), so 128 keys halve that traffic.
/// Measured on one Zen 4 core (float, N 2048-8192, 2026-12-06) against 64: d = 128 1.00-1.09x the backward with
/// the AVX-512 kernels (N 8192: 1.07-1.09x), 0.99-1.11x held to AVX2 (noisy); d = 64 0.99-1.03x AVX-512 but
/// 0.87-1.10x AVX2, so d = 64 keeps 64.
constexpr int host_backward_block_k = 128;

/// The scratch level the portable kernels put their streamed tiles in: level 0 on devices, level 1 with the
/// other tiles on host (see host_forward_stream_bytes).
template <class ExecSpace>
constexpr int stream_scratch_level() {
  return is_host_space<ExecSpace>() ? 1 : 0;
}

/// The budget for the streamed tiles (see the file comment) and the words for it in errors.
inline std::size_t stream_budget(bool host, bool forward, std::size_t l0_max) {
  return host ? (forward ? host_forward_stream_bytes : host_backward_stream_bytes) : l0_max * 9 / 10;
}
inline std::string stream_budget_words(bool host, bool forward, std::size_t l0_max) {
  return host ? "the host budget for streamed tiles, " + std::to_string(stream_budget(host, forward, l0_max)) + " B"
              : "90% of the backend's " + std::to_string(l0_max) + " B level-0 scratch, " +
                    std::to_string(l0_max * 9 / 10) + " B";
}

/// On host both scratch requests are ordinary memory: the streamed tiles move into level 1 (the kernels take
/// them from stream_scratch_level()).
inline void host_scratch_in_level1(bool host, TileConfig& t) {
  if (!host) return;
  t.scratch_l1 += t.scratch_l0;
  t.scratch_l0 = 0;
}

/// Host backward: how many chunks of key blocks the teams of one (batch, kv head) split into. Each chunk is
/// one team and accumulates its dQ rows in its own workspace slice (chunks x dQ in the accumulation type),
/// summed in chunk order afterwards. At least enough chunks that every thread of the backend gets a team, at
/// most one per key block and at most 16 (the workspace bound); from there, up to twice as many, the fewest whose
/// teams fill the threads' last round to 90%, else the fullest (teams do about equal work: chunk c takes key
/// blocks c, c + chunks, ...). Three (batch, kv head) pairs on two threads took two rounds of one team each, a
/// third of the threads idle: now 2 chunks, 6 teams. One thread (Serial) always gets one chunk.
inline int host_backward_chunks(long concurrency, long batch_heads_kv, long n_kblocks) {
  const long threads = std::max<long>(1, concurrency), pairs = std::max<long>(1, batch_heads_kv);
  const long most = std::max<long>(1, std::min<long>(n_kblocks, 16));
  const long first = std::min<long>(most, (threads + pairs - 1) / pairs);
  long best = first;
  double best_fill = 0;
  for (long c = first; c <= std::min<long>(most, 2 * first); ++c) {
    const long teams = pairs * c, rounds = (teams + threads - 1) / threads;
    const double fill = static_cast<double>(teams) / static_cast<double>(rounds * threads);
    if (fill > best_fill) best = c, best_fill = fill;
    if (fill >= 0.9) break;
  }
  return static_cast<int>(best);
}

}  // namespace detail

/// The forward kernel's tiles for this execution space, element type and problem. Throws kfa::Error when
/// a user override (opts.block_q / block_k) is not a multiple of 8 or does not fit the scratch budget.
template <class ExecSpace, class Acc>
TileConfig forward_tile_config(const ExecSpace& space, int head_dim, long seq_q, long seq_k, long batch_heads,
                               const AttentionOptions& opts) {
  const char* fn = "kfa::forward_tile_config";
  constexpr std::size_t eb = sizeof(Acc);
  TileConfig t;
  t.scratch_l0_max = static_cast<std::size_t>(compat::scratch_size_max_l0<ExecSpace>());
  const bool host = detail::is_host_space<ExecSpace>();
  const std::size_t budget = detail::stream_budget(host, true, t.scratch_l0_max);
  t.team_size = host ? 1 : 128;

  auto l0_bytes = [&](int bq, int bk) {
    return detail::scratch_view_bytes<ExecSpace, Acc>(
        detail::ForwardScratchLayout(bq, bk, head_dim, eb, host).l0_total);
  };
  if (opts.block_k > 0) {
    if (opts.block_k % 8 != 0) detail::fail(fn, ": opts.block_k = ", opts.block_k, " is not a multiple of 8");
    if (l0_bytes(8, opts.block_k) > budget)
      detail::fail(fn, ": opts.block_k = ", opts.block_k, " with head_dim = ", head_dim, " needs ",
                   l0_bytes(8, opts.block_k), " B for its K and V tiles but the budget is ",
                   detail::stream_budget_words(host, true, t.scratch_l0_max));
    t.block_k = opts.block_k;
  } else {
    // Largest multiple of 8 (4 when not even 8 fit) that fits, capped at 128 keys and at the padded seq_k.
    const long cap = std::min<long>(128, std::max<long>(4, (seq_k + 3) / 4 * 4));
    int best = 0;
    for (int bk = 4; bk <= cap; bk += 4) {
      if (l0_bytes(8, bk) > budget) break;
      if (bk % 8 == 0 || bk < 8) best = bk;
    }
    if (best == 0)
      detail::fail(fn, ": head_dim = ", head_dim, " with ", eb, "-byte accumulators does not fit 4 keys in ",
                   detail::stream_budget_words(host, true, t.scratch_l0_max));
    t.block_k = best;
  }

  if (opts.block_q > 0) {
    if (opts.block_q % 8 != 0) detail::fail(fn, ": opts.block_q = ", opts.block_q, " is not a multiple of 8");
    t.block_q = opts.block_q;
  } else {
    // 64 rows (host: host_forward_block_q) reuse each K/V tile 64 times; shrink (to 16) while the league
    // would not give every thread of the machine a few teams.
    const long want_teams = 4L * static_cast<long>(space.concurrency()) / t.team_size;
    const long cap = host ? detail::host_forward_block_q : 64;
    int bq = static_cast<int>(std::min<long>(cap, std::max<long>(8, (seq_q + 7) / 8 * 8)));
    // Halve, staying a multiple of 8: the kernel's row loops and micro-tiles step by 8 rows.
    while (bq > 16 && batch_heads * ((seq_q + bq - 1) / bq) < want_teams) bq = std::max(16, (bq / 2 + 7) / 8 * 8);
    t.block_q = bq;
  }
  const detail::ForwardScratchLayout lay(t.block_q, t.block_k, head_dim, eb, host);
  t.scratch_l0 = detail::scratch_view_bytes<ExecSpace, Acc>(lay.l0_total);
  t.scratch_l1 = detail::scratch_view_bytes<ExecSpace, Acc>(lay.l1_total);
  detail::host_scratch_in_level1(host, t);
  return t;
}

namespace detail {
/// Scratch tiles of the backward's two kernels. dK/dV kernel (one team per key block, streaming query
/// blocks): level 0 Q[bq][d], dO[bq][d]; level 1 Kᵀ[d][bk], Vᵀ[d][bk], dK[bk][d], dV[bk][d], S[bq][bk],
/// dP[bq][bk], lse[bq], D[bq]. dQ kernel (one team per query block, streaming key blocks): level 0
/// K[bk][d], V[bk][d]; level 1 Qᵀ[d][bq], dOᵀ[d][bq], dQ[bq][d], Sᵀ[bk][bq], dPᵀ[bk][bq], lse[bq], D[bq].
/// The host dK/dV pass with dQ fused in (`rows_a`) also keeps K[bk][d] row-major in level 1.
struct BackwardScratchLayout {
  std::size_t a, b, l0_total;  // the two streamed tiles
  std::size_t ta, tb, acc_a, acc_b, s, dp, lse, dd, ra, l1_total;
  KOKKOS_INLINE_FUNCTION BackwardScratchLayout(int streamed, int owned, int d, std::size_t eb, bool rows_a = false) {
    a = 0;
    b = a + pad_elems(std::size_t(streamed) * d, eb);
    l0_total = b + pad_elems(std::size_t(streamed) * d, eb);
    ta = 0;
    tb = ta + pad_elems(std::size_t(d) * owned, eb);
    acc_a = tb + pad_elems(std::size_t(d) * owned, eb);
    acc_b = acc_a + pad_elems(std::size_t(owned) * d, eb);
    s = acc_b + pad_elems(std::size_t(owned) * d, eb);
    dp = s + pad_elems(std::size_t(streamed) * owned, eb);
    const std::size_t rows = static_cast<std::size_t>(streamed > owned ? streamed : owned);
    lse = dp + pad_elems(std::size_t(streamed) * owned, eb);
    dd = lse + pad_elems(rows, eb);
    ra = dd + pad_elems(rows, eb);
    l1_total = ra + (rows_a ? pad_elems(std::size_t(owned) * d, eb) : 0);
  }
};
}  // namespace detail

/// Tiles of the backward pass: `dkdv` (block_k keys owned per team, block_q query rows streamed) and
/// `dq` (block_q rows owned per team, block_k keys streamed).
struct BackwardTileConfig {
  TileConfig dkdv;
  TileConfig dq;
};

namespace detail {
/// The tiles of a CUDA backward family from its shape struct S (dkdv_/dq_ block_q, block_k, scratch) and
/// its two kernels' team sizes.
template <class S>
BackwardTileConfig backward_tiles_of(std::size_t l0_max, int dkdv_team, int dq_team) {
  BackwardTileConfig t;
  t.dkdv.block_q = S::dkdv_block_q;
  t.dkdv.block_k = S::dkdv_block_k;
  t.dkdv.scratch_l0 = S::dkdv_scratch;
  t.dkdv.team_size = dkdv_team;
  t.dq.block_q = S::dq_block_q;
  t.dq.block_k = S::dq_block_k;
  t.dq.scratch_l0 = S::dq_scratch;
  t.dq.team_size = dq_team;
  t.dkdv.scratch_l0_max = t.dq.scratch_l0_max = l0_max;
  return t;
}
}  // namespace detail

/// The backward kernels' tiles: the streamed tiles (two per step) take at most 90% of level-0 scratch,
/// the owned tiles and accumulators live in level 1. Overrides as in forward_tile_config.
template <class ExecSpace, class Acc>
BackwardTileConfig backward_tile_config(const ExecSpace& space, int head_dim, long seq_q, long seq_k,
                                        long batch_heads_q, long batch_heads_kv, const AttentionOptions& opts) {
  const char* fn = "kfa::backward_tile_config";
  constexpr std::size_t eb = sizeof(Acc);
  const std::size_t l0_max = static_cast<std::size_t>(compat::scratch_size_max_l0<ExecSpace>());
  const bool host = detail::is_host_space<ExecSpace>();
  const std::size_t budget = detail::stream_budget(host, false, l0_max);
  const int team_size = host ? 1 : 128;
  auto l0_bytes = [&](int streamed) {
    return detail::scratch_view_bytes<ExecSpace, Acc>(
        detail::BackwardScratchLayout(streamed, 8, head_dim, eb).l0_total);
  };
  // Streamed block: the override, else the largest multiple of 8 (4 if not even 8 fit) within budget.
  auto streamed = [&](int override_value, const char* name, long extent) {
    if (override_value > 0) {
      if (override_value % 8 != 0) detail::fail(fn, ": opts.", name, " = ", override_value, " is not a multiple of 8");
      if (l0_bytes(override_value) > budget)
        detail::fail(fn, ": opts.", name, " = ", override_value, " with head_dim = ", head_dim, " needs ",
                     l0_bytes(override_value), " B for its two streamed tiles but the budget is ",
                     detail::stream_budget_words(host, false, l0_max));
      return override_value;
    }
    const long cap = std::min<long>(128, std::max<long>(4, (extent + 3) / 4 * 4));
    int best = 0;
    for (int n = 4; n <= cap; n += 4) {
      if (l0_bytes(n) > budget) break;
      if (n % 8 == 0 || n < 8) best = n;
    }
    if (best == 0)
      detail::fail(fn, ": head_dim = ", head_dim, " with ", eb, "-byte accumulators does not fit 4 rows in ",
                   detail::stream_budget_words(host, false, l0_max));
    return best;
  };
  // Owned block: the override, else `most` (64; the host dK/dV pass's keys: host_backward_block_k), on devices
  // shrunk (to 16) while the league would leave threads idle (the host dK/dV pass fills threads with chunks of key
  // blocks instead: host_backward_chunks).
  auto owned = [&](int override_value, const char* name, long extent, long batch_heads, int most) {
    if (override_value > 0) {
      if (override_value % 8 != 0) detail::fail(fn, ": opts.", name, " = ", override_value, " is not a multiple of 8");
      return override_value;
    }
    const long want = 4L * static_cast<long>(space.concurrency()) / team_size;
    int n = static_cast<int>(std::min<long>(most, std::max<long>(8, (extent + 7) / 8 * 8)));
    while (!host && n > 16 && batch_heads * ((extent + n - 1) / n) < want) n = std::max(16, (n / 2 + 7) / 8 * 8);
    return n;
  };
  BackwardTileConfig t;
  for (TileConfig* c : {&t.dkdv, &t.dq}) {
    c->team_size = team_size;
    c->scratch_l0_max = l0_max;
  }
  t.dkdv.block_q = streamed(opts.block_q, "block_q", seq_q);
  t.dkdv.block_k = owned(opts.block_k, "block_k", seq_k, batch_heads_kv,
                         host && head_dim > 64 && head_dim <= 128 ? detail::host_backward_block_k : 64);
  t.dq.block_k = streamed(opts.block_k, "block_k", seq_k);
  t.dq.block_q = owned(opts.block_q, "block_q", seq_q, batch_heads_q, 64);
  const detail::BackwardScratchLayout a(t.dkdv.block_q, t.dkdv.block_k, head_dim, eb, host);
  const detail::BackwardScratchLayout b(t.dq.block_k, t.dq.block_q, head_dim, eb);
  t.dkdv.scratch_l0 = detail::scratch_view_bytes<ExecSpace, Acc>(a.l0_total);
  t.dkdv.scratch_l1 = detail::scratch_view_bytes<ExecSpace, Acc>(a.l1_total);
  t.dq.scratch_l0 = detail::scratch_view_bytes<ExecSpace, Acc>(b.l0_total);
  t.dq.scratch_l1 = detail::scratch_view_bytes<ExecSpace, Acc>(b.l1_total);
  detail::host_scratch_in_level1(host, t.dkdv);
  detail::host_scratch_in_level1(host, t.dq);
  return t;
}

/// "bq64,bk16": the tile part of profiling-region names.
inline std::string to_string(const TileConfig& t) {
  return "bq" + std::to_string(t.block_q) + ",bk" + std::to_string(t.block_k);
}

/// "dkdv:bq24,bk64;dq:bq64,bk24"
inline std::string to_string(const BackwardTileConfig& t) {
  return "dkdv:" + to_string(t.dkdv) + ";dq:" + to_string(t.dq);
}

}  // namespace kfa
