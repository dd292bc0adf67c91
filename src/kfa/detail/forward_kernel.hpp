#pragma once
/// The FlashAttention-2 forward team kernel: one team per (batch, query head, query block). The team loads
/// its Q tile once (pre-scaled), streams the visible K/V tiles through level-0 scratch, and for each tile
/// computes S = Q·Kᵀ, applies softcap and mask, merges the tile into the per-row (m, ℓ) with the shared
/// combine rule, and accumulates O += P·V. O is normalized once at the end and written with its LSE.
#include <kfa/detail/fast_exp.hpp>
#include <kfa/detail/mask.hpp>
#include <kfa/detail/tile_products.hpp>
#include <kfa/online_softmax.hpp>
#include <kfa/tiling.hpp>
#include <kfa/types.hpp>

namespace kfa {
namespace detail {

template <class ExecSpace, class QV, class KV, class VV, class OV, class LV>
struct ForwardKernel {
  using T = typename QV::non_const_value_type;
  using Acc = accumulator_t<T>;
  using policy_type = Kokkos::TeamPolicy<ExecSpace>;
  using member_type = typename policy_type::member_type;
  using ScratchBuf = Kokkos::View<Acc*, typename ExecSpace::scratch_memory_space, Kokkos::MemoryUnmanaged>;

  QV q;
  KV k;
  VV v;
  OV o;
  LV lse;
  int seq_q, heads_q, head_dim, group;
  int bq, bk, n_qblocks;
  Acc scale, softcap;
  KeyMask mask;
  ForwardScratchLayout lay;

  ForwardKernel(const QV& q_, const KV& k_, const VV& v_, const OV& o_, const LV& lse_, Acc scale_, Acc softcap_,
                const KeyMask& mask_, const TileConfig& t)
      : q(q_), k(k_), v(v_), o(o_), lse(lse_),
        seq_q(static_cast<int>(q_.extent(1))), heads_q(static_cast<int>(q_.extent(2))),
        head_dim(static_cast<int>(q_.extent(3))), group(static_cast<int>(q_.extent(2) / k_.extent(2))),
        bq(t.block_q), bk(t.block_k), n_qblocks((seq_q + t.block_q - 1) / t.block_q), scale(scale_),
        softcap(softcap_), mask(mask_), lay(t.block_q, t.block_k, head_dim, sizeof(Acc)) {}

  KOKKOS_FUNCTION void operator()(const member_type& team) const {
    const int lr = team.league_rank();
    const int qb = lr % n_qblocks;
    const int h = (lr / n_qblocks) % heads_q;
    const int b = lr / (n_qblocks * heads_q);
    const int hk = h / group;
    const int d = head_dim;
    const int i0 = qb * bq;
    const int rows = (seq_q - i0) < bq ? (seq_q - i0) : bq;

    ScratchBuf buf0(team.team_scratch(0), lay.l0_total);
    ScratchBuf buf1(team.team_scratch(1), lay.l1_total);
    Acc* const kt = buf0.data() + lay.kt;  // [d][bk]: K tile transposed
    Acc* const vt = buf0.data() + lay.v;   // [bk][d]
    Acc* const qt = buf1.data() + lay.q;   // [bq][d], pre-scaled
    Acc* const ot = buf1.data() + lay.o;   // [bq][d], unnormalized O
    Acc* const st = buf1.data() + lay.s;   // [bq][bk], scores then probabilities
    Acc* const mrow = buf1.data() + lay.m;
    Acc* const lrow = buf1.data() + lay.l;

    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, bq * d), [&](const int e) {
      const int r = e / d, c = e % d;
      qt[e] = r < rows ? static_cast<Acc>(q(b, i0 + r, h, c)) * scale : Acc(0);
      ot[e] = Acc(0);
    });
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, bq), [&](const int r) {
      const SoftmaxState<Acc> s0 = SoftmaxState<Acc>::empty();
      mrow[r] = s0.m;
      lrow[r] = s0.l;
    });

    const long j_begin = mask.key_begin(i0);
    const long j_end = mask.key_end(i0 + rows);
    for (long j0 = j_begin; j0 < j_end; j0 += bk) {
      const int cols = (j_end - j0) < bk ? static_cast<int>(j_end - j0) : bk;
      team.team_barrier();  // the previous tile's P·V is done with kt/vt
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, bk * d), [&](const int e) {
        const int j = e / d, c = e % d;
        const bool in = j < cols;
        kt[c * bk + j] = in ? static_cast<Acc>(k(b, j0 + j, hk, c)) : Acc(0);
        vt[e] = in ? static_cast<Acc>(v(b, j0 + j, hk, c)) : Acc(0);
      });
      team.team_barrier();
      team_gemm_nn<ExecSpace>(team, bq, bk, d, qt, d, kt, bk, st, bk, false);
      team.team_barrier();

      const bool need_mask = cols < bk || !mask.all_visible(i0, i0 + rows, j0, j0 + bk);
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, bq), [&](const int r) {
        Acc* srow = st + r * bk;
        if (softcap > Acc(0)) {
          const Acc inv = Acc(1) / softcap;
          for (int j = 0; j < bk; ++j) srow[j] = softcap * compat::tanh(srow[j] * inv);
        }
        if (need_mask) {
          const long i = i0 + r;
          for (int j = 0; j < bk; ++j)
            if (j >= cols || !mask.visible(i, j0 + j)) srow[j] = -compat::infinity<Acc>();
        }
        Acc tile_max = -compat::infinity<Acc>();
        for (int j = 0; j < bk; ++j) tile_max = srow[j] > tile_max ? srow[j] : tile_max;
        // Merge the tile into the row state (m, ℓ, O) with the combine rule; the tile's own terms are
        // computed directly at the merged maximum, so they need no further scaling.
        SoftmaxState<Acc> state{mrow[r], lrow[r]};
        const MergeFactors<Acc> f = merge_factors(state.m, tile_max);
        Acc sum = 0;
        if (f.m == -compat::infinity<Acc>()) {
          for (int j = 0; j < bk; ++j) srow[j] = Acc(0);
        } else {
          for (int j = 0; j < bk; ++j) {
            const Acc p = fast_exp(srow[j] - f.m);
            srow[j] = p;
            sum += p;
          }
        }
        mrow[r] = f.m;
        lrow[r] = f.scale_a * state.l + sum;
        if (f.scale_a != Acc(1)) {
          Acc* orow = ot + r * d;
          for (int c = 0; c < d; ++c) orow[c] *= f.scale_a;
        }
      });
      team.team_barrier();
      team_gemm_nn<ExecSpace>(team, bq, d, bk, st, bk, vt, d, ot, d, true);
    }
    team.team_barrier();

    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, rows * d), [&](const int e) {
      const int r = e / d, c = e % d;
      const Acc l = lrow[r];
      o(b, i0 + r, h, c) = static_cast<T>(l > Acc(0) ? ot[e] / l : Acc(0));
    });
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, rows), [&](const int r) {
      lse(b, h, i0 + r) = SoftmaxState<Acc>{mrow[r], lrow[r]}.lse();
    });
  }
};

}  // namespace detail
}  // namespace kfa
