#pragma once
/// portable/backward.hpp: the portable family's backward, Kokkos team kernels for every backend.
/// FlashAttention-2 backward by recomputation, no atomics, so results are bitwise reproducible:
///   1. D = rowsum(dO ∘ O) per query row;
///   2. one team per (batch, kv head, key block): for every query head of the group (in order) and every
///      visible query block, recompute S = Q·Kᵀ and P = exp(S − LSE), then dV += Pᵀ·dO, dP = dO·Vᵀ,
///      dS = P ∘ (dP − D), dK += dSᵀ·Q — dK and dV stay in the team until written once;
///   3. devices: one team per (batch, query head, query block): the same recomputation over the visible key
///      blocks, dQ += dS·K (FA2 folds this into launch 2 with atomics; we pay two extra tile products for
///      determinism). Host backends: launch 2 also does dQ += dS·K (five products, FA2's count), each team
///      owning a chunk of key blocks (every chunks-th) and its own dQ workspace slice; launch 3 sums the
///      slices in chunk order (DqChunkSum). With one chunk per (batch, kv head), as on one thread, that is
///      the key blocks' order, as in the device dQ kernel.
/// Launch 2 scales its Kᵀ tile (S = Q·(scale·K)ᵀ), so dK = scale·dSᵀ·Q (scaled once, when written) and
/// dQ = scale·dS·K; on host, whole tiles of Q, dO and K already in the accumulation type are read in place.
/// Launch 3 (devices) pre-scales its Q tile instead. With softcap, dS picks up 1 − tanh².
/// A row whose LSE is −inf saw no key: its P row is 0, so it contributes nothing.
#include <kfa/detail/common/fast_exp.hpp>
#include <kfa/detail/common/ranges.hpp>
#include <kfa/detail/common/recompute.hpp>
#include <kfa/detail/mask.hpp>
#include <kfa/detail/portable/tile_products.hpp>
#include <kfa/online_softmax.hpp>
#include <kfa/tiling.hpp>
#include <kfa/types.hpp>

#include <cstdint>

namespace kfa {
namespace detail {

/// FuseDq (host backends): dQ += dS·K too, into `dq_ws` [chunks][batch][seq_q + block_q][heads_q][d] (the
/// rows past seq_q take the zero dS of a partial query block), one team per (batch, kv head, chunk).
template <class ExecSpace, class Args, bool FuseDq = false>
struct DkDvKernel {
  using QV = typename Args::q_type;
  using KV = typename Args::k_type;
  using VV = typename Args::v_type;
  using DOV = typename Args::do_type;
  using LV = typename Args::lse_type;
  using DV = typename Args::d_type;
  using DKV = typename Args::dk_type;
  using DVV = typename Args::dv_type;
  using T = typename QV::non_const_value_type;
  using Acc = accumulator_t<T>;
  using member_type = typename team_policy<ExecSpace>::member_type;
  using ScratchBuf = Kokkos::View<Acc*, typename ExecSpace::scratch_memory_space, Kokkos::MemoryUnmanaged>;
  static constexpr int stream_level = stream_scratch_level<ExecSpace>();  // where the streamed tiles live
  static constexpr bool direct_types = MicroTileShape<ExecSpace>::host &&
                                       std::is_same<typename QV::non_const_value_type, Acc>::value &&
                                       std::is_same<typename DOV::non_const_value_type, Acc>::value &&
                                       std::is_same<typename KV::non_const_value_type, Acc>::value;

  QV q;
  KV k;
  VV v;
  DOV d_o;
  LV lse;
  DV dd;
  DKV dk;
  DVV dv;
  int seq_q, seq_k, heads_kv, head_dim, group, bq, bk, n_kblocks;
  Acc scale, softcap;
  KeyMask mask;
  BackwardScratchLayout lay;
  int chunks = 1;        // FuseDq: teams per (batch, kv head); team c takes key blocks c, c + chunks, ...
  Acc* dq_ws = nullptr;  // FuseDq: the chunks' dQ slices (see above)
  long batch = 0;
  bool write_dkdv = true;  // FuseDq: false when only dQ is asked for
  bool direct_rows;        // host, Q, dO and K hold Acc with a contiguous head dim: whole tiles read in place

  /// The league: batch · heads_kv · (chunks with FuseDq, else key blocks).
  long league() const { return batch * heads_kv * (FuseDq ? chunks : n_kblocks); }
  /// FuseDq: row i of query head h in chunk c's dQ slice.
  KOKKOS_FORCEINLINE_FUNCTION Acc* dq_row(int c, int b, long i, int h) const {
    const long hd = static_cast<long>(heads_kv) * group * head_dim;
    return dq_ws + ((static_cast<long>(c) * batch + b) * (seq_q + bq) + i) * hd + static_cast<long>(h) * head_dim;
  }
  /// FuseDq: the workspace's extent.
  std::size_t dq_ws_size() const {
    return std::size_t(chunks) * std::size_t(batch) * std::size_t(seq_q + bq) * std::size_t(heads_kv * group) *
           std::size_t(head_dim);
  }

  DkDvKernel(const Args& a, const TileConfig& t, int chunks_ = 1)
      : q(a.q),
        k(a.k),
        v(a.v),
        d_o(a.d_o),
        lse(a.lse),
        dd(a.dd),
        dk(a.dk),
        dv(a.dv),
        seq_q(static_cast<int>(a.q.extent(1))),
        seq_k(static_cast<int>(a.k.extent(1))),
        heads_kv(static_cast<int>(a.k.extent(2))),
        head_dim(static_cast<int>(a.q.extent(3))),
        group(static_cast<int>(a.q.extent(2) / a.k.extent(2))),
        bq(t.block_q),
        bk(t.block_k),
        n_kblocks((seq_k + t.block_k - 1) / t.block_k),
        scale(a.scale),
        softcap(a.softcap),
        mask(a.mask),
        lay(t.block_q, t.block_k, head_dim, sizeof(Acc), FuseDq),
        direct_rows(direct_types && a.q.stride(3) == 1 && a.d_o.stride(3) == 1 && a.k.stride(3) == 1),
        chunks(chunks_),
        batch(static_cast<long>(a.q.extent(0))) {}

  KOKKOS_FUNCTION void operator()(const member_type& team) const {
    const int lr = team.league_rank();
    const int units = FuseDq ? chunks : n_kblocks;  // a team's key blocks: unit, unit + units, ...
    const int unit = lr % units;
    const int hk = (lr / units) % heads_kv;
    const int b = lr / (units * heads_kv);
    ScratchBuf buf0(team.team_scratch(int(stream_level)), lay.l0_total);
    ScratchBuf buf1(team.team_scratch(1), lay.l1_total);
    for (int kb = unit; kb < n_kblocks; kb += units) key_block(team, buf0, buf1, b, hk, unit, kb);
  }

  KOKKOS_FUNCTION void key_block(const member_type& team, const ScratchBuf& buf0, const ScratchBuf& buf1, int b, int hk,
                                 int chunk, int kb) const {
    const int d = head_dim;
    const int j0 = kb * bk;
    const int cols = (seq_k - j0) < bk ? (seq_k - j0) : bk;
    Acc* const qs = buf0.data() + lay.a;       // [bq][d] Q
    Acc* const dos = buf0.data() + lay.b;      // [bq][d] dO
    Acc* const kt = buf1.data() + lay.ta;      // [d][bk] scale·Kᵀ
    Acc* const vt = buf1.data() + lay.tb;      // [d][bk] Vᵀ
    Acc* const dka = buf1.data() + lay.acc_a;  // [bk][d]
    Acc* const dva = buf1.data() + lay.acc_b;  // [bk][d]
    Acc* const s = buf1.data() + lay.s;        // [bq][bk] S, then P
    Acc* const dp = buf1.data() + lay.dp;      // [bq][bk] dP, then dS
    Acc* const lrow = buf1.data() + lay.lse;
    Acc* const drow = buf1.data() + lay.dd;
    Acc* const kr = buf1.data() + lay.ra;  // FuseDq: [bk][d] K
    constexpr bool host = MicroTileShape<ExecSpace>::host;
    const Acc* krp = kr;  // FuseDq: K rows for dQ += dS·K, in place when the tile is whole
    int ldkr = d;
    if constexpr (direct_types)
      if (direct_rows && cols == bk) {
        krp = &k(b, j0, hk, 0);
        ldkr = static_cast<int>(k.stride(1));
      }

    team.team_barrier();  // the previous key block's dK, dV are written
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, bk), [&](const int j) {
      const bool in = j < cols;
      for (int c = 0; c < d; ++c) kt[c * bk + j] = in ? static_cast<Acc>(k(b, j0 + j, hk, c)) * scale : Acc(0);
      for (int c = 0; c < d; ++c) vt[c * bk + j] = in ? static_cast<Acc>(v(b, j0 + j, hk, c)) : Acc(0);
      for (int c = 0; c < d; ++c) dka[j * d + c] = dva[j * d + c] = Acc(0);
      if constexpr (FuseDq)
        if (krp == kr)
          for (int c = 0; c < d; ++c) kr[j * d + c] = in ? static_cast<Acc>(k(b, j0 + j, hk, c)) : Acc(0);
    });

    // One pass per document the block's keys meet (one without documents), dK and dV carried across.
    const DocumentSpan span = this->mask.documents_of_keys(j0, j0 + cols);
    for (int doc = span.first; doc < span.last; ++doc) {
      const KeyRule mask = this->mask.rule(doc);
      const long i_begin = mask.query_begin(j0);
      const long i_end = mask.query_end(j0 + cols, seq_q);
      // On host the pass computes only the key columns [c0, c1) that hold this document's keys, widened to steps of
      // 16 so that the products' vectors stay whole (the other keys' dK, dV are left alone; their dS would be zero),
      // and of a tile's query rows those that exist, to a multiple of 8. Devices compute whole tiles as before.
      const int c0 = host ? (mask.key_lo > j0 ? static_cast<int>(mask.key_lo - j0) : 0) / 16 * 16 : 0;
      const int in_hi = mask.seq_k < j0 + cols ? static_cast<int>(mask.seq_k - j0) : cols;
      const int c1 = host && (in_hi + 15) / 16 * 16 < bk ? (in_hi + 15) / 16 * 16 : bk;
      const int nc = c1 - c0;
      // dV, dK and dQ's products go over this document's key columns only, on every backend: another document's
      // keys in the tile have P = dS = 0, but 0·inf or 0·NaN in this document's dO, Q (dV, dK) or in the other
      // keys' K (dQ) would not stay 0. Up to the tile's end as above where no document ends inside the block.
      const int k0 = mask.key_lo > j0 ? static_cast<int>(mask.key_lo - j0) : 0;
      const int k1 = in_hi < cols ? in_hi : c1;
      for (int g = 0; g < group; ++g) {
        const int h = hk * group + g;
        for (long i0 = i_begin; i0 < i_end; i0 += bq) {
          const int rows = (i_end - i0) < bq ? static_cast<int>(i_end - i0) : bq;
          const int rows8 = host && (rows + 7) / 8 * 8 < bq ? (rows + 7) / 8 * 8 : bq;  // rows computed (≥ rows)
          const Acc* qp = qs;  // Q and dO rows, in place when the tile is whole
          const Acc* dop = dos;
          int ldq = d, lddo = d;
          if constexpr (direct_types)
            if (direct_rows && rows == bq) {
              qp = &q(b, i0, h, 0);
              dop = &d_o(b, i0, h, 0);
              ldq = static_cast<int>(q.stride(1));
              lddo = static_cast<int>(d_o.stride(1));
            }
          team.team_barrier();  // previous step's products are done with qs, dos, s, dp
          Kokkos::parallel_for(Kokkos::TeamThreadRange(team, bq), [&](const int r) {
            const bool in = r < rows;
            if (i0 + bq + r < i_end) {  // the next step's rows, while this step computes
              prefetch_row<ExecSpace>(q, b, i0 + bq + r, h, d);
              prefetch_row<ExecSpace>(d_o, b, i0 + bq + r, h, d);
              if constexpr (FuseDq) prefetch_span<ExecSpace>(dq_row(chunk, b, i0 + bq + r, h), d);
            }
            if (qp == qs) {  // copied: converted, and zero rows past the block's end
              if (in) {
                load_row<ExecSpace>(qs + r * d, q, b, i0 + r, h, d, Acc(1));
                load_row<ExecSpace>(dos + r * d, d_o, b, i0 + r, h, d, Acc(1));
              } else {
                for (int c = 0; c < d; ++c) qs[r * d + c] = dos[r * d + c] = Acc(0);
              }
            }
            lrow[r] = in ? recompute_lse(lse(b, h, i0 + r)) : compat::infinity<Acc>();
            drow[r] = in ? dd(b, h, i0 + r) : Acc(0);
          });
          team.team_barrier();
          // rows [0, rows8) and key columns [c0, c1) of S = Q·(scale·K)ᵀ and dP = dO·Vᵀ. On host a step the mask
          // cuts (a causal diagonal, a window's edge) goes in strips of host_mask_strip rows, each over the key columns
          // its rows see (widened to steps of 16); what is left out is masked to P = dS = 0 below.
          const bool need_mask = cols < bk || !mask.all_visible(i0, i0 + rows, j0, j0 + bk);
          if (host && need_mask) {
            for (int ra = 0; ra < rows; ra += host_mask_strip) {
              const int rb = ra + host_mask_strip < rows8 ? ra + host_mask_strip : rows8;
              const long lo = mask.key_begin(i0 + ra) - j0, hi = mask.key_end(i0 + rb) - j0;  // rb: padding rows too
              if ((hi < c1 ? hi : c1) <= (lo > c0 ? lo : c0)) continue;  // these rows see none of the columns
              const int ka = lo > c0 ? static_cast<int>(lo) / 16 * 16 : c0;
              const int kb = (hi + 15) / 16 * 16 < c1 ? static_cast<int>((hi + 15) / 16 * 16) : c1;
              const long at = static_cast<long>(ra) * bk + ka;
              team_gemm<ExecSpace>(team, rb - ra, kb - ka, d, qp + static_cast<long>(ra) * ldq, ldq, 1, kt + ka, bk,
                                   s + at, bk, false);
              team_gemm<ExecSpace>(team, rb - ra, kb - ka, d, dop + static_cast<long>(ra) * lddo, lddo, 1, vt + ka, bk,
                                   dp + at, bk, false);
            }
          } else {
            team_gemm<ExecSpace>(team, rows8, nc, d, qp, ldq, 1, kt + c0, bk, s + c0, bk, false);
            team_gemm<ExecSpace>(team, rows8, nc, d, dop, lddo, 1, vt + c0, bk, dp + c0, bk, false);
          }
          team.team_barrier();
          Kokkos::parallel_for(Kokkos::TeamThreadRange(team, rows8), [&](const int r) {
            with_host_isa([&](auto isa) KFA_SIMD_BODY {
              score_to_ds(isa, mask, s + r * bk + c0, dp + r * bk + c0, lrow[r], drow[r], i0 + r, j0 + c0, cols - c0,
                          nc, need_mask);
            });
          });
          team.team_barrier();
          if (host && need_mask) {
            // The products over what the mask leaves visible (P and dS are 0 elsewhere): dV and dK in strips of
            // host_mask_strip key columns over the rows that see them, dQ in strips of rows over the keys they see.
            for (int ka = k0; ka < k1; ka += host_mask_strip) {
              const int kb = ka + host_mask_strip < k1 ? ka + host_mask_strip : k1;
              const long seen_lo = mask.query_begin(j0 + ka) - i0, seen_hi = mask.query_end(j0 + kb, seq_q) - i0;
              const long lo = seen_lo > 0 ? seen_lo : 0, hi = seen_hi < rows ? seen_hi : rows;
              if (hi <= lo) continue;
              const int n = static_cast<int>(hi - lo);
              team_gemm<ExecSpace>(team, kb - ka, d, n, s + lo * bk + ka, 1, bk, dop + lo * lddo, lddo, dva + ka * d, d,
                                   true);
              team_gemm<ExecSpace>(team, kb - ka, d, n, dp + lo * bk + ka, 1, bk, qp + lo * ldq, ldq, dka + ka * d, d,
                                   true);
            }
            if constexpr (FuseDq)
              for (int ra = 0; ra < rows; ra += host_mask_strip) {  // rows past `rows` are the next document's
                const int rb = ra + host_mask_strip < rows ? ra + host_mask_strip : rows;
                const long first = mask.key_begin(i0 + ra) - j0;
                const long lo = first > k0 ? first : k0;
                const long hi = mask.key_end(i0 + rb) - j0;
                const long ke = hi < k1 ? hi : k1;
                if (ke <= lo) continue;
                team_gemm<ExecSpace>(team, rb - ra, d, static_cast<int>(ke - lo), dp + ra * bk + lo, bk, 1,
                                     krp + lo * ldkr, ldkr, dq_row(chunk, b, i0 + ra, h), heads_kv * group * d, true);
              }
          } else {
            // dV += Pᵀ·dO, dK += dSᵀ·Q
            team_gemm<ExecSpace>(team, k1 - k0, d, rows8, s + k0, 1, bk, dop, lddo, dva + k0 * d, d, true);
            team_gemm<ExecSpace>(team, k1 - k0, d, rows8, dp + k0, 1, bk, qp, ldq, dka + k0 * d, d, true);
            if constexpr (FuseDq)  // dQ += dS·K into this chunk's rows (scale applied by DqChunkSum)
              team_gemm<ExecSpace>(team, rows, d, k1 - k0, dp + k0, bk, 1, krp + k0 * ldkr, ldkr,
                                   dq_row(chunk, b, i0, h), heads_kv * group * d, true);
          }
        }
      }
    }
    team.team_barrier();
    if (!write_dkdv) return;
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, cols), [&](const int j) {
      for (int c = 0; c < d; ++c)
        dk(b, j0 + j, hk, c) = static_cast<typename DKV::non_const_value_type>(dka[j * d + c] * scale);
      for (int c = 0; c < d; ++c)
        dv(b, j0 + j, hk, c) = static_cast<typename DVV::non_const_value_type>(dva[j * d + c]);
    });
  }

  /// One query row of a tile, its n columns from key j0 (n a multiple of 8; columns from `cols` are past the keys):
  /// S → P = exp(softcap(S) − LSE) (0 where masked) and dP → dS.
  template <class Tag>
  KOKKOS_FORCEINLINE_FUNCTION void score_to_ds(Tag isa, const KeyRule& mask, Acc* srow, Acc* dprow, Acc l, Acc dval,
                                               long i, long j0, int cols, int n, bool need_mask) const {
    long first = 0, last = cols - 1;  // the row's visible keys, as tile columns
    if (need_mask) {
      mask.visible_range(i, first, last);
      first -= j0;
      last = last - j0 < cols - 1 ? last - j0 : cols - 1;
    }
    if (softcap > Acc(0)) {
      const Acc inv = Acc(1) / softcap;
      for (int j = 0; j < n; ++j) {
        const Acc t = compat::tanh(srow[j] * inv);
        const bool vis = j >= first && j <= last;
        const Acc p = vis ? fast_exp(softcap * t - l) : Acc(0);
        srow[j] = p;
        dprow[j] = vis ? p * (dprow[j] - dval) * (Acc(1) - t * t) : Acc(0);  // masked: 0 whatever dP held
      }
      return;
    }
    if (need_mask) {
      for (int j = 0; j < n; ++j) {
        const bool vis = j >= first && j <= last;
        srow[j] = vis ? srow[j] : -compat::infinity<Acc>();
        dprow[j] = vis ? dprow[j] : Acc(0);  // entries a masked strip left out hold stale values: P = dS = 0 there
      }
    }
    // The row as groups of `lanes`, then one of `tail_lanes` (tiles are multiples of 8), so the lane loops
    // vectorize.
    constexpr int L = MicroTileShape<ExecSpace>::lanes, Lt = MicroTileShape<ExecSpace>::tail_lanes;
    Acc lv[L], dv[L];
    for (int x = 0; x < L; ++x) lv[x] = l, dv[x] = dval;
    const int groups = n / L;
    lanes_p_ds<L>(isa, srow, dprow, L, groups, lv, dv);
    int j = groups * L;
    if (n - j >= Lt) {
      lanes_p_ds<Lt>(isa, srow + j, dprow + j, Lt, 1, lv, dv);
      j += Lt;
    }
    for (; j < n; ++j) {
      const Acc p = fast_exp(srow[j] - l);
      srow[j] = p;
      dprow[j] = p * (dprow[j] - dval);
    }
  }
};

template <class ExecSpace, class Args>
struct DqKernel {
  using QV = typename Args::q_type;
  using KV = typename Args::k_type;
  using VV = typename Args::v_type;
  using DOV = typename Args::do_type;
  using LV = typename Args::lse_type;
  using DV = typename Args::d_type;
  using DQV = typename Args::dq_type;
  using T = typename QV::non_const_value_type;
  using Acc = accumulator_t<T>;
  using member_type = typename team_policy<ExecSpace>::member_type;
  using ScratchBuf = Kokkos::View<Acc*, typename ExecSpace::scratch_memory_space, Kokkos::MemoryUnmanaged>;
  static constexpr int stream_level = stream_scratch_level<ExecSpace>();  // where the streamed tiles live

  QV q;
  KV k;
  VV v;
  DOV d_o;
  LV lse;
  DV dd;
  DQV dq;
  int seq_q, heads_q, head_dim, group, bq, bk, n_qblocks;
  Acc scale, softcap;
  KeyMask mask;
  BackwardScratchLayout lay;

  DqKernel(const Args& a, const TileConfig& t)
      : q(a.q),
        k(a.k),
        v(a.v),
        d_o(a.d_o),
        lse(a.lse),
        dd(a.dd),
        dq(a.dq),
        seq_q(static_cast<int>(a.q.extent(1))),
        heads_q(static_cast<int>(a.q.extent(2))),
        head_dim(static_cast<int>(a.q.extent(3))),
        group(static_cast<int>(a.q.extent(2) / a.k.extent(2))),
        bq(t.block_q),
        bk(t.block_k),
        n_qblocks((seq_q + t.block_q - 1) / t.block_q),
        scale(a.scale),
        softcap(a.softcap),
        mask(a.mask),
        lay(t.block_k, t.block_q, head_dim, sizeof(Acc)) {}

  KOKKOS_FUNCTION void operator()(const member_type& team) const {
    const int lr = team.league_rank();
    const int qb = lr % n_qblocks;
    const int h = (lr / n_qblocks) % heads_q;
    const int b = lr / (n_qblocks * heads_q);
    const int hk = h / group;
    const int d = head_dim;
    const int i0 = qb * bq;
    const int rows = (seq_q - i0) < bq ? (seq_q - i0) : bq;

    ScratchBuf buf0(team.team_scratch(int(stream_level)), lay.l0_total);
    ScratchBuf buf1(team.team_scratch(1), lay.l1_total);
    Acc* const ks = buf0.data() + lay.a;       // [bk][d]
    Acc* const vs = buf0.data() + lay.b;       // [bk][d]
    Acc* const qst = buf1.data() + lay.ta;     // [d][bq] (scale·Q)ᵀ
    Acc* const dot = buf1.data() + lay.tb;     // [d][bq] dOᵀ
    Acc* const dqa = buf1.data() + lay.acc_a;  // [bq][d]
    Acc* const st = buf1.data() + lay.s;       // [bk][bq] Sᵀ, then Pᵀ
    Acc* const dpt = buf1.data() + lay.dp;     // [bk][bq] dPᵀ, then dSᵀ
    Acc* const lrow = buf1.data() + lay.lse;
    Acc* const drow = buf1.data() + lay.dd;

    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, bq), [&](const int r) {
      const bool in = r < rows;
      for (int c = 0; c < d; ++c) qst[c * bq + r] = in ? static_cast<Acc>(q(b, i0 + r, h, c)) * scale : Acc(0);
      for (int c = 0; c < d; ++c) dot[c * bq + r] = in ? static_cast<Acc>(d_o(b, i0 + r, h, c)) : Acc(0);
      for (int c = 0; c < d; ++c) dqa[r * d + c] = Acc(0);
      lrow[r] = in ? recompute_lse(lse(b, h, i0 + r)) : compat::infinity<Acc>();
      drow[r] = in ? dd(b, h, i0 + r) : Acc(0);
    });

    // One pass per document the block's rows meet (one without documents), dQ carried across.
    const DocumentSpan span = this->mask.documents_of_rows(i0, i0 + rows);
    for (int doc = span.first; doc < span.last; ++doc) {
      const KeyRule mask = this->mask.rule(doc);
      const long j_begin = mask.key_begin(i0);
      const long j_end = mask.key_end(i0 + rows);
      // dQ += dS·K over this document's rows only: another document's rows in the tile have dS = 0 (or NaN, from
      // their own dO), and 0·inf in this document's K would reach them. The whole tile where none ends inside.
      const int q0 = mask.q_lo > i0 ? static_cast<int>(mask.q_lo - i0) : 0;
      const int q1 = mask.q_hi >= 0 && mask.q_hi < i0 + rows ? static_cast<int>(mask.q_hi - i0) : bq;
      for (long j0 = j_begin; j0 < j_end; j0 += bk) {
        const int cols = (j_end - j0) < bk ? static_cast<int>(j_end - j0) : bk;
        team.team_barrier();
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, bk), [&](const int j) {
          const bool in = j < cols;
          if (in) {
            load_row<ExecSpace>(ks + j * d, k, b, j0 + j, hk, d, Acc(1));
            load_row<ExecSpace>(vs + j * d, v, b, j0 + j, hk, d, Acc(1));
          } else {
            for (int c = 0; c < d; ++c) ks[j * d + c] = vs[j * d + c] = Acc(0);
          }
        });
        team.team_barrier();
        team_gemm<ExecSpace>(team, bk, bq, d, ks, d, 1, qst, bq, st, bq, false);   // Sᵀ = K·Qᵀ
        team_gemm<ExecSpace>(team, bk, bq, d, vs, d, 1, dot, bq, dpt, bq, false);  // dPᵀ = V·dOᵀ
        team.team_barrier();
        const bool need_mask = cols < bk || !mask.all_visible(i0, i0 + rows, j0, j0 + bk);
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, lane_steps<ExecSpace>(bq)), [&](const int step) {
          with_host_isa([&](auto isa) KFA_SIMD_BODY {
            lane_step<ExecSpace>(step, bq, [&](auto width, const int ib) KFA_SIMD_BODY {
              // dSᵀ for W query rows at a time; the common case (no softcap) is kept free of calls and
              // branches so that it vectorizes across the W rows on host.
              constexpr int W = decltype(width)::value;
              long first[W], last[W];  // each row's visible keys, as tile columns
              for (int x = 0; x < W; ++x) {
                first[x] = 0, last[x] = cols - 1;
                if (!need_mask) continue;
                mask.visible_range(i0 + ib + x, first[x], last[x]);
                first[x] -= j0;
                last[x] = last[x] - j0 < cols - 1 ? last[x] - j0 : cols - 1;
              }
              if (softcap > Acc(0)) {
                const Acc inv = Acc(1) / softcap;
                for (int j = 0; j < bk; ++j)
                  for (int x = 0; x < W; ++x) {
                    const Acc t = compat::tanh(st[j * bq + ib + x] * inv);
                    const bool vis = j >= first[x] && j <= last[x];
                    const Acc p = vis ? fast_exp(softcap * t - lrow[ib + x]) : Acc(0);
                    dpt[j * bq + ib + x] = p * (dpt[j * bq + ib + x] - drow[ib + x]) * (Acc(1) - t * t);
                  }
                return;
              }
              if (need_mask)
                for (int j = 0; j < bk; ++j)
                  for (int x = 0; x < W; ++x) {
                    const bool vis = j >= first[x] && j <= last[x];
                    st[j * bq + ib + x] = vis ? st[j * bq + ib + x] : -compat::infinity<Acc>();
                  }
              lanes_p_ds<W>(isa, st + ib, dpt + ib, bq, bk, lrow + ib, drow + ib);
            });
          });
        });
        team.team_barrier();
        team_gemm<ExecSpace>(team, q1 - q0, d, bk, dpt + q0, 1, bq, ks, d, dqa + q0 * d, d,
                             true);  // dQ += dS·K (scale applied at the end)
      }
    }
    team.team_barrier();
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, rows), [&](const int r) {
      for (int c = 0; c < d; ++c)
        dq(b, i0 + r, h, c) = static_cast<typename DQV::non_const_value_type>(dqa[r * d + c] * scale);
    });
  }
};

/// Host backward, launch 3: dq = scale · Σ_c dq_ws[c] (DkDvKernel<FuseDq>'s slices, in chunk order), one
/// (batch, query row) per index.
template <class ExecSpace, class DQV, class Acc>
struct DqChunkSum {
  DQV dq;
  const Acc* ws;
  int chunks, batch, seq_q, ws_rows, heads_q, head_dim;
  Acc scale;
  KOKKOS_FUNCTION void operator()(const long row) const {
    const int b = static_cast<int>(row / seq_q), i = static_cast<int>(row % seq_q);
    const long hd = static_cast<long>(heads_q) * head_dim;
    const long slice = static_cast<long>(batch) * ws_rows * hd;
    const Acc* const first = ws + (static_cast<long>(b) * ws_rows + i) * hd;
    for (int h = 0; h < heads_q; ++h)
      for (int c = 0; c < head_dim; ++c) {
        const long at = static_cast<long>(h) * head_dim + c;
        Acc sum = first[at];
        for (int ch = 1; ch < chunks; ++ch) sum += first[ch * slice + at];
        dq(b, i, h, c) = static_cast<typename DQV::non_const_value_type>(sum * scale);
      }
  }
};

}  // namespace detail
}  // namespace kfa
