#pragma once
/// tc_team/forward.hpp: the tc_team family's forward, a Kokkos team kernel on tensor cores.
/// The forward team kernel on tensor cores (Kokkos::Cuda, half/bfloat16, sm_80+): the same FA2 algorithm
/// as portable/forward.hpp, with each warp of the team owning 16 query rows.
///
/// Per team: WARPS·16 query rows; Q stays in registers as mma A fragments for the whole kernel (read
/// once from global memory); K and V tiles of BC keys stream through level-0 scratch (pitch D + 8,
/// conflict-free ldmatrix) with cp.async, software-pipelined FA2-style: V_j loads while S = Q·K_jᵀ and
/// the softmax run, K_{j+1} loads while O += P·V_j runs. S and O live in fp32 registers; P is converted to
/// 16-bit in registers and used directly as the A operand of P·V. Row maxima and sums are reduced over
/// the four lanes that share a row; the per-tile rescale is the shared combine rule (merge_factors).
#include <kfa/detail/cuda/mma.hpp>
#include <kfa/detail/mask.hpp>
#include <kfa/online_softmax.hpp>

#include <cstddef>
#include <cstdint>

namespace kfa {
namespace detail {

/// Tile shape of the tensor-core forward for head dim D (keys per streamed tile and warps per team); the
/// kernel is launched with 2 teams per SM.
template <int D>
struct TcForwardShape {
  static constexpr int warps = 4;
  static constexpr int block_q = 16 * warps;
  static constexpr int block_k = 64;
  static constexpr int pitch = D + 8;                                  // elements per scratch row
  static constexpr std::size_t scratch_l0 = 2u * block_k * pitch * 2;  // K and V tiles, 16-bit
};

#if KFA_HAS_TENSOR_CORES
template <int D, class Args>
struct TcForwardKernel {
  using QV = typename Args::q_type;
  using KV = typename Args::k_type;
  using VV = typename Args::v_type;
  using OV = typename Args::o_type;
  using LV = typename Args::lse_type;
  using T = typename QV::non_const_value_type;
  using OutT = typename OV::non_const_value_type;  // T, or float for the ring layer's partials
  using Shape = TcForwardShape<D>;
  static constexpr int WARPS = Shape::warps, BQ = Shape::block_q, BC = Shape::block_k, P = Shape::pitch;
  using policy_type = Kokkos::TeamPolicy<Kokkos::Cuda, Kokkos::LaunchBounds<32 * WARPS, 2>>;
  using member_type = typename policy_type::member_type;
  static_assert(sizeof(T) == 2, "16-bit elements only");
  static_assert(D % 16 == 0, "head dim must be a multiple of 16");

  QV q;
  KV k;
  VV v;
  OV o;
  LV lse;
  int seq_q, heads_q, group;
  BlockOrder order;  // of the query blocks
  float scale, softcap;
  KeyMask mask;

  explicit TcForwardKernel(const Args& a)
      : q(a.q),
        k(a.k),
        v(a.v),
        o(a.o),
        lse(a.lse),
        seq_q(static_cast<int>(a.q.extent(1))),
        heads_q(static_cast<int>(a.q.extent(2))),
        group(static_cast<int>(a.q.extent(2) / a.k.extent(2))),
        order(query_block_order(a, BQ)),
        scale(a.scale),
        softcap(a.softcap),
        mask(a.mask) {}

  KOKKOS_FUNCTION void operator()(const member_type& team) const {
#if KFA_TC_DEVICE
    const int lane = threadIdx.x, warp = threadIdx.y, tid = warp * 32 + lane;
    const int g = lane >> 2, t4 = lane & 3;
    const QueryBlock blk(team.league_rank(), order, heads_q, group, BQ, seq_q);
    const int b = blk.b, h = blk.h, hk = blk.hk, i0 = blk.i0, rows = blk.rows;
    if (rows <= 0) return;           // an empty block of a document-aligned launch (cuda/block_order.hpp)
    const int row_end = i0 + rows;   // rows past it are another block's (or past seq_q)
    const int wr0 = i0 + warp * 16;  // this warp's first query row
    const float ninf = -compat::infinity<float>();

    char* smem = static_cast<char*>(team.team_scratch(0).get_shmem(static_cast<std::size_t>(Shape::scratch_l0)));
    const std::uint32_t ks = tc::smem_addr(smem);
    const std::uint32_t vs = ks + BC * P * 2;

    const std::uint16_t* kbase = reinterpret_cast<const std::uint16_t*>(k.data() + b * k.stride(0) + hk * k.stride(2));
    const std::uint16_t* vbase = reinterpret_cast<const std::uint16_t*>(v.data() + b * v.stride(0) + hk * v.stride(2));
    const long kstride = static_cast<long>(k.stride(1)), vstride = static_cast<long>(v.stride(1));

    // Q A fragments (rows g and g + 8 of the warp); rows past seq_q are zero.
    std::uint32_t qa[D / 16][4];
    tc::load_a_rows<D>(qa, wr0 + g < seq_q ? &q(b, wr0 + g, h, 0) : nullptr,
                       wr0 + g + 8 < seq_q ? &q(b, wr0 + g + 8, h, 0) : nullptr, t4);

    float acc[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    float m[2] = {ninf, ninf}, l[2] = {0.f, 0.f};  // l: this lane's partial sums, reduced at the end

    // ldmatrix row addresses: lane l serves row l % 8 of matrix l / 8.
    const int mi = lane >> 3, mr = lane & 7;
    // K as B of S = Q·Kᵀ (non-transposed): matrices (keys +0, d +0), (keys +0, d +8), (keys +8, d +0),
    // (keys +8, d +8)
    const std::uint32_t k_lane = ks + static_cast<std::uint32_t>((((mi >> 1) * 8 + mr) * P + (mi & 1) * 8) * 2);
    // V as B of O += P·V (transposed): matrices (keys +0, d +0), (keys +8, d +0), (keys +0, d +8), (keys +8, d +8)
    const std::uint32_t v_lane = vs + static_cast<std::uint32_t>((((mi & 1) * 8 + mr) * P + (mi >> 1) * 8) * 2);

    // One pass per document the block's rows meet (one without documents), the row states carried across.
    const DocumentSpan span = this->mask.documents_of_rows(i0, i0 + rows);
    for (int doc = span.first; doc < span.last; ++doc) {
      const KeyRule mask = this->mask.rule(doc);
      const long j_begin = mask.key_begin(i0);
      const long j_end = mask.key_end(i0 + rows);
      if (j_begin < j_end)
        tc::load_tile_async<D, BC, 32 * WARPS>(ks, kbase + j_begin * kstride, kstride,
                                               static_cast<int>(j_end - j_begin < BC ? j_end - j_begin : BC), tid);
      tc::cp_async_commit();
      for (long j0 = j_begin; j0 < j_end; j0 += BC) {
        const int cols = (j_end - j0) < BC ? static_cast<int>(j_end - j0) : BC;
        tc::cp_async_wait_all();
        __syncthreads();  // K_j is in; every warp is done with V_{j-1}
        tc::load_tile_async<D, BC, 32 * WARPS>(vs, vbase + j0 * vstride, vstride, cols, tid);
        tc::cp_async_commit();

        float s[BC / 8][4];
#pragma unroll
        for (int n = 0; n < BC / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
          for (int n = 0; n < BC / 8; n += 2) {
            std::uint32_t bf[4];
            tc::ldmatrix_x4(bf, k_lane + static_cast<std::uint32_t>((n * 8 * P + kk * 16) * 2));
            tc::mma<T>(s[n], qa[kk], bf[0], bf[1]);
            tc::mma<T>(s[n + 1], qa[kk], bf[2], bf[3]);
          }
        }

        // Scale, softcap, mask, then the online softmax of this lane's two rows.
        const bool need_mask = cols < BC || !mask.all_visible(i0, i0 + rows, j0, j0 + BC);
        float tmax[2] = {ninf, ninf};
#pragma unroll
        for (int n = 0; n < BC / 8; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float x = s[n][e] * scale;
            if (softcap > 0.f) x = softcap * tanhf(x / softcap);
            if (need_mask) {
              const int jj = n * 8 + 2 * t4 + (e & 1);
              if (!(jj < cols && mask.visible(wr0 + g + (e >> 1) * 8, j0 + jj))) x = ninf;
            }
            s[n][e] = x;
            tmax[e >> 1] = fmaxf(tmax[e >> 1], x);
          }
        float mexp[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const MergeFactors<float> f = merge_factors(m[r], tc::quad_max(tmax[r]));
          m[r] = f.m;
          mexp[r] = f.m == ninf ? 0.f : f.m;  // a row with no visible key yet: exp(−inf) = 0, never NaN
          l[r] *= f.scale_a;
#pragma unroll
          for (int n = 0; n < D / 8; ++n) {
            acc[n][2 * r] *= f.scale_a;
            acc[n][2 * r + 1] *= f.scale_a;
          }
        }
        std::uint32_t pa[BC / 16][4];
#pragma unroll
        for (int n = 0; n < BC / 8; ++n) {
          const float p0 = __expf(s[n][0] - mexp[0]), p1 = __expf(s[n][1] - mexp[0]);
          const float p2 = __expf(s[n][2] - mexp[1]), p3 = __expf(s[n][3] - mexp[1]);
          l[0] += p0 + p1;
          l[1] += p2 + p3;
          pa[n / 2][(n & 1) * 2 + 0] = cuda16<T>::pack(p0, p1);
          pa[n / 2][(n & 1) * 2 + 1] = cuda16<T>::pack(p2, p3);
        }

        tc::cp_async_wait_all();
        __syncthreads();  // V_j is in; every warp is done with K_j
        if (j0 + BC < j_end) {
          const long jn = j0 + BC;
          tc::load_tile_async<D, BC, 32 * WARPS>(ks, kbase + jn * kstride, kstride,
                                                 static_cast<int>(j_end - jn < BC ? j_end - jn : BC), tid);
        }
        tc::cp_async_commit();

#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) {
#pragma unroll
          for (int n = 0; n < D / 8; n += 2) {
            std::uint32_t bf[4];
            tc::ldmatrix_x4_trans(bf, v_lane + static_cast<std::uint32_t>((kk * 16 * P + n * 8) * 2));
            tc::mma<T>(acc[n], pa[kk], bf[0], bf[1]);
            tc::mma<T>(acc[n + 1], pa[kk], bf[2], bf[3]);
          }
        }
      }
    }
    tc::cp_async_wait_all();

    float lsum[2], inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      lsum[r] = tc::quad_sum(l[r]);
      inv[r] = lsum[r] == 0.f ? 0.f : 1.f / lsum[r];
    }
    const int r0 = wr0 + g, r1 = wr0 + g + 8;
    tc::store_c_rows<D, T>(acc, inv[0], inv[1], r0 < row_end ? &o(b, r0, h, 0) : nullptr,
                           r1 < row_end ? &o(b, r1, h, 0) : nullptr, t4);
    if (t4 == 0) {
      if (r0 < row_end) lse(b, h, r0) = SoftmaxState<float>{m[0], lsum[0]}.lse();
      if (r1 < row_end) lse(b, h, r1) = SoftmaxState<float>{m[1], lsum[1]}.lse();
    }
#else
    (void)team;
    Kokkos::abort("kfa: the tensor-core forward kernel ran on a device without sm_80 tensor cores");
#endif
  }
};
#endif

}  // namespace detail
}  // namespace kfa
