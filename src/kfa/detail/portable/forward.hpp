#pragma once
/// portable/forward.hpp: the portable family's forward, a Kokkos team kernel for every backend (the host
/// backends' only forward).
/// The FlashAttention-2 forward team kernel: one team per (batch, query head, query block). The team loads
/// its Q tile once (pre-scaled), streams the visible K/V tiles through scratch (on host a tile already in the
/// accumulation type is read in place), and for each tile computes Sᵀ = K·Qᵀ (transposed so every row-wise
/// softmax step is element-wise over query rows, which vectorizes on host and is one row per thread on device),
/// applies softcap and mask, merges the tile into the per-row (m, ℓ) with the shared combine rule, and
/// accumulates O += P·V. O is normalized once at the end and written with its LSE.
#include <kfa/detail/common/fast_exp.hpp>
#include <kfa/detail/mask.hpp>
#include <kfa/detail/portable/tile_products.hpp>
#include <kfa/online_softmax.hpp>
#include <kfa/tiling.hpp>
#include <kfa/types.hpp>

namespace kfa {
namespace detail {

template <class ExecSpace, class Args>
struct ForwardKernel {
  using QV = typename Args::q_type;
  using KV = typename Args::k_type;
  using VV = typename Args::v_type;
  using OV = typename Args::o_type;
  using LV = typename Args::lse_type;
  using T = typename QV::non_const_value_type;
  using Acc = accumulator_t<T>;
  using OutT = typename OV::non_const_value_type;  // T, or Acc for the ring layer's partials
  using policy_type = team_policy<ExecSpace>;
  using member_type = typename policy_type::member_type;
  using ScratchBuf = Kokkos::View<Acc*, typename ExecSpace::scratch_memory_space, Kokkos::MemoryUnmanaged>;
  static constexpr int stream_level = stream_scratch_level<ExecSpace>();  // where the streamed tiles live
  static constexpr bool direct_types = MicroTileShape<ExecSpace>::host &&
                                       std::is_same<typename KV::non_const_value_type, Acc>::value &&
                                       std::is_same<typename VV::non_const_value_type, Acc>::value;

  QV q;
  KV k;
  VV v;
  OV o;
  LV lse;
  int seq_q, heads_q, head_dim, group;
  bool direct_rows;  // host, K and V hold Acc with a contiguous head dim: products read tiles in place
  int bq, bk, n_qblocks;
  Acc scale, softcap;
  KeyMask mask;
  ForwardScratchLayout lay;

  ForwardKernel(const Args& a, const TileConfig& t)
      : q(a.q),
        k(a.k),
        v(a.v),
        o(a.o),
        lse(a.lse),
        seq_q(static_cast<int>(a.q.extent(1))),
        heads_q(static_cast<int>(a.q.extent(2))),
        head_dim(static_cast<int>(a.q.extent(3))),
        group(static_cast<int>(a.q.extent(2) / a.k.extent(2))),
        direct_rows(direct_types && a.k.stride(3) == 1 && a.v.stride(3) == 1),
        bq(t.block_q),
        bk(t.block_k),
        n_qblocks((seq_q + t.block_q - 1) / t.block_q),
        scale(a.scale),
        softcap(a.softcap),
        mask(a.mask),
        lay(t.block_q, t.block_k, head_dim, sizeof(Acc), MicroTileShape<ExecSpace>::host) {}

  KOKKOS_FUNCTION void operator()(const member_type& team) const {
    const Acc ninf = -compat::infinity<Acc>();
    const int lr = team.league_rank();
    const int qb = lr % n_qblocks;
    const int h = (lr / n_qblocks) % heads_q;
    const int b = lr / (n_qblocks * heads_q);
    const int hk = h / group;
    const int d = head_dim;
    const int i0 = qb * bq;
    const int rows = (seq_q - i0) < bq ? (seq_q - i0) : bq;
    const int ld = lay.ld;  // row length of the Qᵀ and Sᵀ tiles
    constexpr bool host = MicroTileShape<ExecSpace>::host;

    ScratchBuf buf0(team.team_scratch(int(stream_level)), lay.l0_total);
    ScratchBuf buf1(team.team_scratch(1), lay.l1_total);
    Acc* const kt = buf0.data() + lay.k;   // [bk][d]
    Acc* const vt = buf0.data() + lay.v;   // [bk][d]
    Acc* const qt = buf1.data() + lay.qt;  // [d][ld]: Q tile transposed and pre-scaled
    Acc* const ot = buf1.data() + lay.o;   // [bq][d]: unnormalized O
    Acc* const st = buf1.data() + lay.s;   // [bk][ld]: scores, then probabilities, transposed
    Acc* const mrow = buf1.data() + lay.m;
    Acc* const lrow = buf1.data() + lay.l;

    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, bq), [&](const int r) {
      for (int c = 0; c < d; ++c) qt[c * ld + r] = r < rows ? static_cast<Acc>(q(b, i0 + r, h, c)) * scale : Acc(0);
      for (int c = 0; c < d; ++c) ot[r * d + c] = Acc(0);
      const SoftmaxState<Acc> s0 = SoftmaxState<Acc>::empty();
      mrow[r] = s0.m;
      lrow[r] = s0.l;
    });

    // One pass per document the block's rows meet (one without documents), the row states carried across.
    const DocumentSpan span = this->mask.documents_of_rows(i0, i0 + rows);
    for (int doc = span.first; doc < span.last; ++doc) {
      const KeyRule mask = this->mask.rule(doc);
      const long j_begin = mask.key_begin(i0);
      const long j_end = mask.key_end(i0 + rows);
      // On host the pass computes only the tile rows [r0, r1) that hold this document's rows (or the block's rows
      // that exist), widened to steps of 16 so that the products' columns stay whole vectors; the other rows' state
      // is left alone. Devices compute the whole tile as before (not measured there).
      const long in_lo = mask.q_lo > i0 ? mask.q_lo - i0 : 0;
      const long in_hi = mask.q_hi >= 0 && mask.q_hi < i0 + rows ? mask.q_hi - i0 : rows;
      const int r0 = host ? static_cast<int>(in_lo) / 16 * 16 : 0;
      const int r1 = host && (in_hi + 15) / 16 * 16 < bq ? static_cast<int>((in_hi + 15) / 16 * 16) : bq;
      // P·V goes over this document's rows only, on every backend: another document's rows in the tile have P = 0,
      // but 0·inf or 0·NaN in this document's V would reach their O. Up to the tile's end as above where no
      // document ends inside the block.
      const int p0 = static_cast<int>(in_lo);
      const int p1 = in_hi < rows ? static_cast<int>(in_hi) : r1;
      for (long j0 = j_begin; j0 < j_end; j0 += bk) {
        const int cols = (j_end - j0) < bk ? static_cast<int>(j_end - j0) : bk;
        const int cols8 = host && (cols + 7) / 8 * 8 < bk ? (cols + 7) / 8 * 8 : bk;  // score rows computed (≥ cols)
        // On host a tile of Acc rows with a contiguous head dim whose bk rows all exist is read where it lies (rows
        // past `cols` are another document's or a window's keys: their scores are masked to −inf, and P·V stops at
        // `cols`); other tiles are copied into kt/vt, converted and padded with zero rows.
        const bool direct = direct_rows && j0 + bk <= static_cast<long>(k.extent(1));
        const Acc* kp = kt;
        const Acc* vp = vt;
        int ldk = d, ldv = d;
        if constexpr (direct_types) {
          if (direct) {
            kp = &k(b, j0, hk, 0);
            vp = &v(b, j0, hk, 0);
            ldk = static_cast<int>(k.stride(1));
            ldv = static_cast<int>(v.stride(1));
          }
        }
        team.team_barrier();  // the previous tile's P·V is done with kt/vt
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, bk), [&](const int j) {
          Acc* krow = kt + j * d;
          Acc* vrow = vt + j * d;
          if (j0 + bk + j < j_end) {  // the next tile's row, while this tile computes
            prefetch_row<ExecSpace>(k, b, j0 + bk + j, hk, d);
            prefetch_row<ExecSpace>(v, b, j0 + bk + j, hk, d);
          }
          if (direct) return;
          if (j < cols) {
            load_row<ExecSpace>(krow, k, b, j0 + j, hk, d, Acc(1));
            load_row<ExecSpace>(vrow, v, b, j0 + j, hk, d, Acc(1));
          } else {
            for (int c = 0; c < d; ++c) krow[c] = vrow[c] = Acc(0);
          }
        });
        team.team_barrier();
        // Sᵀ[bk][bq] = K[bk][d] · Qᵀ[d][bq]: rows [0, cols8), columns [r0, r1); rows from cols8 masked below. On
        // host a tile the mask cuts (a causal diagonal, a window's edge) goes in strips of host_mask_strip keys, each
        // over the query columns that see one of its keys (widened to steps of 16); what is left out is masked below.
        const bool need_mask = cols < bk || !mask.all_visible(i0, i0 + rows, j0, j0 + bk);
        if (host && need_mask) {
          for (int ja = 0; ja < cols; ja += host_mask_strip) {
            const int jb = ja + host_mask_strip < cols8 ? ja + host_mask_strip : cols8;
            const long lo = mask.query_begin(j0 + ja) - i0;
            const long hi = mask.query_end(j0 + (jb < cols ? jb : cols), seq_q) - i0;
            if ((hi < r1 ? hi : r1) <= (lo > r0 ? lo : r0)) continue;  // no row of [r0, r1) sees these keys
            const int qa = lo > r0 ? static_cast<int>(lo) / 16 * 16 : r0;
            const int qb = (hi + 15) / 16 * 16 < r1 ? static_cast<int>((hi + 15) / 16 * 16) : r1;
            team_gemm<ExecSpace>(team, jb - ja, qb - qa, d, kp + static_cast<long>(ja) * ldk, ldk, 1, qt + qa, ld,
                                 st + static_cast<long>(ja) * ld + qa, ld, false);
          }
        } else {
          team_gemm<ExecSpace>(team, cols8, r1 - r0, d, kp, ldk, 1, qt + r0, ld, st + r0, ld, false);
        }
        team.team_barrier();

        const int step0 = r0 / MicroTileShape<ExecSpace>::lanes;
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, step0, lane_steps<ExecSpace>(r1)), [&](const int step) {
          with_host_isa([&](auto isa) KFA_SIMD_BODY {  // vectorized for the CPU's ISA (common/host_simd.hpp)
            lane_step<ExecSpace>(step, r1, [&](auto width, const int ib) KFA_SIMD_BODY {
              constexpr int W = decltype(width)::value;  // query rows ib .. ib + W
              if (softcap > Acc(0)) {
                const Acc inv = Acc(1) / softcap;
                for (int j = 0; j < bk; ++j)
                  for (int x = 0; x < W; ++x) st[j * ld + ib + x] = softcap * compat::tanh(st[j * ld + ib + x] * inv);
              }
              if (need_mask) {
                long first[W], last[W];  // each row's visible keys, as tile columns
                for (int x = 0; x < W; ++x) {
                  mask.visible_range(i0 + ib + x, first[x], last[x]);
                  first[x] -= j0;
                  last[x] = last[x] - j0 < cols - 1 ? last[x] - j0 : cols - 1;
                }
                for (int j = 0; j < bk; ++j)
                  for (int x = 0; x < W; ++x) {
                    const bool vis = j >= first[x] && j <= last[x];
                    st[j * ld + ib + x] = vis ? st[j * ld + ib + x] : ninf;
                  }
              }
              Acc tmax[W], mnew[W], mexp[W], scale_old[W], sum[W];
              for (int x = 0; x < W; ++x) tmax[x] = ninf;
              lanes_max<W>(isa, st + ib, ld, bk, tmax);
              // Merge the tile into each row's (m, ℓ, O) with the combine rule; the tile's own terms are computed
              // directly at the merged maximum, so their factor is 1.
              for (int x = 0; x < W; ++x) {
                const MergeFactors<Acc> f = merge_factors(mrow[ib + x], tmax[x]);
                mnew[x] = f.m;
                mexp[x] = f.m == ninf ? Acc(0) : f.m;  // an empty row has only −inf scores: exp → 0, never NaN
                scale_old[x] = f.scale_a;
                sum[x] = Acc(0);
              }
              lanes_exp_sum<W>(isa, st + ib, ld, bk, mexp, sum);
              for (int x = 0; x < W; ++x) {
                mrow[ib + x] = mnew[x];
                lrow[ib + x] = scale_old[x] * lrow[ib + x] + sum[x];
                if (scale_old[x] != Acc(1))
                  for (int c = 0; c < d; ++c) ot[(ib + x) * d + c] *= scale_old[x];
              }
            });
          });
        });
        team.team_barrier();
        // O[bq][d] += P[bq][bk] · V[bk][d] for rows [p0, p1), P read through the transposed Sᵀ; on host a tile the
        // mask cuts in strips of host_mask_strip rows, each over the keys its rows see (P is 0 elsewhere)
        if (host && need_mask) {
          for (int ra = p0; ra < p1; ra += host_mask_strip) {
            const int rb = ra + host_mask_strip < p1 ? ra + host_mask_strip : p1;
            const long seen_lo = mask.key_begin(i0 + ra) - j0, seen_hi = mask.key_end(i0 + rb) - j0;
            const long ka = seen_lo > 0 ? seen_lo : 0, kb = seen_hi < cols ? seen_hi : cols;
            if (kb > ka)
              team_gemm<ExecSpace>(team, rb - ra, d, static_cast<int>(kb - ka), st + ka * ld + ra, 1, ld, vp + ka * ldv,
                                   ldv, ot + ra * d, d, true);
          }
        } else {
          team_gemm<ExecSpace>(team, p1 - p0, d, cols, st + p0, 1, ld, vp, ldv, ot + p0 * d, d, true);
        }
      }
    }
    team.team_barrier();

    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, rows), [&](const int r) {
      const Acc l = lrow[r];
      const Acc inv = l == Acc(0) ? Acc(0) : Acc(1) / l;  // NaN ℓ stays NaN in o
      for (int c = 0; c < d; ++c) o(b, i0 + r, h, c) = static_cast<OutT>(ot[r * d + c] * inv);
      lse(b, h, i0 + r) = SoftmaxState<Acc>{mrow[r], lrow[r]}.lse();
    });
  }
};

}  // namespace detail
}  // namespace kfa
