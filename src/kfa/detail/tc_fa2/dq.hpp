#pragma once
/// tc_fa2/dq.hpp: the tc_fa2 family's dQ kernel (deterministic backward).
/// The deterministic backward's dQ kernel in FlashAttention-2's forward layout (Kokkos::Cuda, half/bfloat16,
/// sm_80+), launched natively (cuda/native.hpp) with opt-in shared memory on the caller's stream. Same
/// recomputation as TcDqKernel (tc_team/backward.hpp); what differs is the layout, as the FA2-layout
/// forward's:
///
///   4 warps, BQ = 128 query rows, 32 rows (two m16 tiles) per warp, so every K or V fragment a warp reads
///   from shared memory feeds four mma instead of two. At d = 256, 8 warps of 16 rows (one m16 tile: dQ's
///   fp32 accumulator alone is then 128 registers per thread), as in the FA2-layout forward there. Q and dO
///   are copied to shared memory once and re-read with ldmatrix (TcDqKernel keeps them in registers, which
///   left room for 16 rows per warp only, in 40,936 B of Kokkos team scratch); K and V tiles of BK keys are
///   double-buffered with cp.async.
///   A tile: S = Q·Kᵀ and dP = dO·Vᵀ, dS = P ∘ (dP − D) (∘ softcap') in registers, dQ += dS·K.
///   No atomics: each block owns its rows of dQ, so the result is bitwise reproducible.
#include <kfa/detail/common/recompute.hpp>  // recompute_lse
#include <kfa/detail/cuda/mma.hpp>
#include <kfa/detail/cuda/native.hpp>
#include <kfa/detail/cuda/native_args.hpp>  // Fa2DqArgs, set_dq_args
#include <kfa/detail/mask.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

namespace kfa {
namespace detail {

/// Tiles of this dQ kernel, which the deterministic tensor-core backward runs where the device gives it its
/// shared memory (else TcDqKernel). Keys per K/V tile (64 at d = 64, else 32): S and dP take 2·2·BK/8·4
/// registers next to dQ's 2·D/8·4.
template <int D>
struct Fa2DqShape {
  static constexpr int m_tiles = D > 128 ? 1 : 2;  // m16 tiles of query rows per warp
  static constexpr int warps = D > 128 ? 8 : 4;
  static constexpr int min_blocks = D > 128 ? 1 : 2;  // resident blocks per SM the registers are bounded for
  static constexpr int block_q = 16 * m_tiles * warps;
  static constexpr int block_k = D <= 64 ? 64 : 32;
  static constexpr int pitch = D + 8;  // elements per shared row (16-byte pad: conflict-free ldmatrix)
  static_assert(D % 16 == 0 && (D / 8) % 2 == 0 && block_k % 16 == 0, "n-tiles are taken in pairs");
  /// Q and dO, then two stages of K and V, all 16-bit (d = 64: 72 KB, 96: 78 KB, 128: 102 KB, 256: 198 KB).
  static constexpr std::size_t smem = static_cast<std::size_t>(2 * block_q + 4 * block_k) * pitch * 2;
};

/// Why this dQ kernel cannot run head dim d on the device of `space` ("" when it can).
template <class ExecSpace>
std::string fa2_dq_problem(const ExecSpace& space, int d) {
#if KFA_HAS_TENSOR_CORES
  if constexpr (std::is_same<ExecSpace, Kokkos::Cuda>::value) {
    const std::size_t smem = fa2_head_dim_switch(d, [](auto dc) { return Fa2DqShape<decltype(dc)::value>::smem; });
    return native_smem_problem(space, smem, "the FA2-layout dQ kernel");
  }
#endif
  (void)space, (void)d;
  return "it is a Kokkos::Cuda kernel";
}

#if KFA_HAS_TENSOR_CORES
template <int D, bool Softcap, class T, class OutT>
__global__ void __launch_bounds__(32 * Fa2DqShape<D>::warps, Fa2DqShape<D>::min_blocks)
    tc_fa2_dq_kernel(const __grid_constant__ Fa2DqArgs<OutT> a) {
#if KFA_TC_DEVICE
  using Shape = Fa2DqShape<D>;
  constexpr int BQ = Shape::block_q, BK = Shape::block_k, P = Shape::pitch, NT = 32 * Shape::warps;
  constexpr int MT = Shape::m_tiles;
  extern __shared__ __align__(16) unsigned char fa2_dq_smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, tid = threadIdx.x;
  const int g = lane >> 2, t4 = lane & 3, mi = lane >> 3, mr = lane & 7;
  const QueryBlock blk(static_cast<int>(blockIdx.x), a.order, a.heads_q, a.group, BQ, a.seq_q);
  const int b = blk.b, h = blk.h, hk = blk.hk, i0 = blk.i0, rows = blk.rows;
  if (rows <= 0) return;                // an empty block of a document-aligned launch (cuda/block_order.hpp)
  const int row_end = i0 + rows;        // rows past it are another block's (or past seq_q)
  const int wr0 = i0 + warp * 16 * MT;  // this warp's first query row

  const std::uint32_t qs = tc::smem_addr(fa2_dq_smem), dos = qs + BQ * P * 2;
  const std::uint32_t ks0 = dos + BQ * P * 2;  // stage s: K at ks0 + s·2·BK·P·2, V right after it
  constexpr std::uint32_t kv_bytes = BK * P * 2, stage_bytes = 2 * kv_bytes;
  const std::uint16_t* kbase = a.k + b * a.k_s[0] + hk * a.k_s[2];
  const std::uint16_t* vbase = a.v + b * a.v_s[0] + hk * a.v_s[2];
  const long kstride = a.k_s[1], vstride = a.v_s[1];
  // Loads rolled where threads idle (d = 96: unrolled, that instance spilled 4 B; the same code elsewhere).
  auto load_kv = [&](long j0, long j_end, int stage) {
    const int cols = static_cast<int>(j_end - j0 < BK ? j_end - j0 : BK);
    const std::uint32_t kd = ks0 + stage * stage_bytes;
    tc::load_tile_async<D, BK, NT, false>(kd, kbase + j0 * kstride, kstride, cols, tid);
    tc::load_tile_async<D, BK, NT, false>(kd + kv_bytes, vbase + j0 * vstride, vstride, cols, tid);
  };
  // The Q and dO blocks (rows past seq_q are zeros), in the group of the first pass's first K/V tile.
  tc::load_tile_async<D, BQ, NT, false>(qs, a.q + b * a.q_s[0] + static_cast<long>(i0) * a.q_s[1] + h * a.q_s[2],
                                        a.q_s[1], rows, tid);
  tc::load_tile_async<D, BQ, NT, false>(dos, a.d_o + b * a.do_s[0] + static_cast<long>(i0) * a.do_s[1] + h * a.do_s[2],
                                        a.do_s[1], rows, tid);

  // Row r of m-tile mt: r = 0 is row g, r = 1 is row g + 8. lse·log2(e) and D (+inf and 0 past seq_q: P = 0).
  float lse2[MT][2], ddr[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = wr0 + mt * 16 + g + r * 8;
      const bool in = row < row_end;
      lse2[mt][r] = in ? recompute_lse(a.lse[b * a.l_s[0] + h * a.l_s[1] + row * a.l_s[2]]) * tc::log2e
                       : compat::infinity<float>();
      ddr[mt][r] = in ? a.dd[b * a.d_s[0] + h * a.d_s[1] + row * a.d_s[2]] : 0.f;
    }
  float acc[MT][D / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int n = 0; n < D / 8; ++n) acc[mt][n][0] = acc[mt][n][1] = acc[mt][n][2] = acc[mt][n][3] = 0.f;

  // ldmatrix row addresses: lane l serves row l % 8 of matrix l / 8.
  // Q, dO as A (row-major): matrices (rows +0, d +0), (rows +8, d +0), (rows +0, d +8), (rows +8, d +8)
  const std::uint32_t a_off =
      static_cast<std::uint32_t>(((warp * 16 * MT + (mi & 1) * 8 + mr) * P + (mi >> 1) * 8) * 2);
  // K, V as B of S = Q·Kᵀ, dP = dO·Vᵀ: matrices (keys +0, d +0), (keys +0, d +8), (keys +8, d +0),
  // (keys +8, d +8)
  const std::uint32_t b_off = static_cast<std::uint32_t>((((mi >> 1) * 8 + mr) * P + (mi & 1) * 8) * 2);
  // K as B of dQ += dS·K (transposed): matrices (keys +0, d +0), (keys +8, d +0), (keys +0, d +8), (keys +8, d +8)
  const std::uint32_t bt_off = static_cast<std::uint32_t>((((mi & 1) * 8 + mr) * P + (mi >> 1) * 8) * 2);

  // One pass per document the block's rows meet (one without documents), the rows' state carried across; each
  // pass starts its own pipeline (its first tile in the next stage).
  int stage = 0;
  const DocumentSpan span = a.mask.documents_of_rows(i0, i0 + rows);
  for (int doc = span.first; doc < span.last; ++doc) {
    const KeyRule mask = a.mask.rule(doc);
    const long j_begin = mask.key_begin(i0);
    const long j_end = mask.key_end(i0 + rows);
    if (j_begin < j_end) load_kv(j_begin, j_end, stage);
    tc::cp_async_commit();
    for (long j0 = j_begin; j0 < j_end; j0 += BK, stage ^= 1) {
      const int cols = (j_end - j0) < BK ? static_cast<int>(j_end - j0) : BK;
      if (j0 + BK < j_end) load_kv(j0 + BK, j_end, stage ^ 1);
      tc::cp_async_commit();
      tc::cp_async_wait_1();  // everything but the group just issued: tile j (and Q, dO) are in
      __syncthreads();
      const std::uint32_t ks = ks0 + stage * stage_bytes, vs = ks + kv_bytes;

      float s[MT][BK / 8][4], dp[MT][BK / 8][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < BK / 8; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][n][e] = dp[mt][n][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        std::uint32_t qa[MT][4], oa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const std::uint32_t o = a_off + static_cast<std::uint32_t>((mt * 16 * P + kk * 16) * 2);
          tc::ldmatrix_x4(qa[mt], qs + o);
          tc::ldmatrix_x4(oa[mt], dos + o);
        }
#pragma unroll
        for (int n = 0; n < BK / 8; n += 2) {
          const std::uint32_t o = b_off + static_cast<std::uint32_t>((n * 8 * P + kk * 16) * 2);
          std::uint32_t bk[4], bv[4];
          tc::ldmatrix_x4(bk, ks + o);
          tc::ldmatrix_x4(bv, vs + o);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            tc::mma<T>(s[mt][n], qa[mt], bk[0], bk[1]);
            tc::mma<T>(s[mt][n + 1], qa[mt], bk[2], bk[3]);
            tc::mma<T>(dp[mt][n], oa[mt], bv[0], bv[1]);
            tc::mma<T>(dp[mt][n + 1], oa[mt], bv[2], bv[3]);
          }
        }
      }
      // dS = P ∘ (dP − D) into s. Masked tiles take a second copy of the pass, in which each row's visible
      // keys are one range of the tile (the common tile tests nothing per element).
      auto ds_pass = [&](auto masked) {
        constexpr bool Masked = decltype(masked)::value;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            int lo = 0, hi = BK - 1;  // visible keys of the row, tile-local
            if (Masked) {
              long first, last;
              mask.visible_range(wr0 + mt * 16 + g + r * 8, first, last);
              lo = static_cast<int>(first - j0 < 0 ? 0 : (first - j0 > BK ? BK : first - j0));
              hi = static_cast<int>(last - j0 < -1 ? -1 : (last - j0 > cols - 1 ? cols - 1 : last - j0));
            }
#pragma unroll
            for (int n = 0; n < BK / 8; ++n)
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                const int jj = n * 8 + 2 * t4 + e;
                const bool vis = !Masked || (jj >= lo && jj <= hi);
                float dcap;
                const float p = tc_recompute_p<Softcap>(s[mt][n][2 * r + e], a.pc, lse2[mt][r], vis, dcap);
                s[mt][n][2 * r + e] = p * (dp[mt][n][2 * r + e] - ddr[mt][r]) * dcap;
              }
          }
      };
      if (cols < BK || !mask.all_visible(i0, i0 + rows, j0, j0 + BK))
        ds_pass(std::true_type{});
      else
        ds_pass(std::false_type{});
        // dQ += dS·K
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) {
        std::uint32_t da[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) tc::c_to_a<T>(da[mt], s[mt], kk);
#pragma unroll
        for (int n = 0; n < D / 8; n += 2) {
          std::uint32_t bf[4];
          tc::ldmatrix_x4_trans(bf, ks + bt_off + static_cast<std::uint32_t>((kk * 16 * P + n * 8) * 2));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            tc::mma<T>(acc[mt][n], da[mt], bf[0], bf[1]);
            tc::mma<T>(acc[mt][n + 1], da[mt], bf[2], bf[3]);
          }
        }
      }
      __syncthreads();  // every warp is done with this stage before the next iteration refills it
    }
  }
  tc::cp_async_wait_all();

  OutT* qbase = a.dq + b * a.dq_s[0] + h * a.dq_s[2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int r0 = wr0 + mt * 16 + g, r1 = r0 + 8;
    tc::store_c_rows<D, T>(acc[mt], a.scale, a.scale, r0 < row_end ? qbase + r0 * a.dq_s[1] : nullptr,
                           r1 < row_end ? qbase + r1 * a.dq_s[1] : nullptr, t4);
  }
#else
  (void)a;
#if defined(__CUDA_ARCH__)
  __trap();  // not reachable: the launcher checks the device's compute capability first
#endif
#endif
}

/// dq = scale · Σ_key dS·K for every query row, with this kernel (fa2_dq_problem(space, D) is "").
template <int D, bool Softcap, class Args>
void fa2_dq_launch_d(const Kokkos::Cuda& space, const Args& args) {
  using T = typename Args::T;
  using OutT = typename Args::dq_type::non_const_value_type;
  using Shape = Fa2DqShape<D>;
  Fa2DqArgs<OutT> a;
  const long league = set_dq_args(a, args, Shape::block_q);
  native_launch(space, "kfa::attention_backward::dq[tensor_core_fa2]", &tc_fa2_dq_kernel<D, Softcap, T, OutT>, league,
                dim3(32 * Shape::warps), Shape::smem, Shape::min_blocks, a);
}
#endif  // KFA_HAS_TENSOR_CORES

}  // namespace detail
}  // namespace kfa
