#pragma once
/// tc_fa2/forward.hpp: the tc_fa2 family's forward kernel.
/// The tensor-core forward in FlashAttention-2's layout, launched natively on the caller's Kokkos::Cuda
/// stream with opt-in dynamic shared memory (Kokkos gives a team at most 40,936 B of level-0 scratch,
/// which is what keeps the Q block out of shared memory in tc_team/forward.hpp). Same algorithm, same
/// fragments (cuda/mma.hpp), same combine rule.
///
/// Per block: 4 warps, BQ = 128 query rows, 32 rows (two m16 tiles) per warp, so every K or V fragment a
/// warp reads from shared memory feeds four mma instead of two (d = 256: 8 warps of 16 rows). Q is copied
/// to shared memory once and re-read with ldmatrix; K and V tiles of BC keys are double-buffered (two real
/// stages): the loads of tile j+1 are in flight while tile j is multiplied. S, P and O live in registers;
/// the softmax runs in base 2 with the scale folded into one FFMA per element.
///
/// Ordering with the user's work: the kernel is enqueued on space.cuda_stream(), the stream every Kokkos
/// kernel of that instance runs on, so fences and later Kokkos work see it exactly as a parallel_for.
#include <kfa/detail/cuda/mma.hpp>
#include <kfa/detail/cuda/native.hpp>
#include <kfa/detail/cuda/native_args.hpp>
#include <kfa/detail/mask.hpp>
#include <kfa/online_softmax.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

namespace kfa {
namespace detail {

/// Tile shape of the FA2-layout forward for head dim D, as FA2 picks it on sm_80/90: 64 keys per tile at
/// d = 128 (S in 64 registers next to O's 128; 32 keys measured 12-19% slower on the H200), 128 at d = 64
/// (measured 20% faster than 64). d = 96 takes 64 as FA2 does: 128 keys would put S in 128 registers
/// next to O's 96 and P's 64 (H200, bf16, N = 4096/16384, with the unrolled tile loads: 223-249 TF/s,
/// 0.74-0.78x torch's flash forward in the same run, where d = 64 reaches 1.01-1.02x and d = 128
/// 0.91-0.95x).
/// d = 256: 8 warps of one m16 tile each (O alone is 128 registers), one block per SM, 64 keys per tile
/// (203 KB of shared memory; 254-255 registers, no spills): 15-17% faster than 32 keys (H200, bf16/fp16,
/// N = 4096/16384, kfa vs kfa in one run).
template <int D>
struct Fa2ForwardShape {
  static constexpr int mt = D > 128 ? 1 : 2;  // m16 tiles (16 query rows each) per warp
  static constexpr int warps = D > 128 ? 8 : 4;
  static constexpr int min_blocks = D > 128 ? 1 : 2;  // resident blocks per SM the registers are bounded for
  static constexpr int block_q = 16 * mt * warps;
  static constexpr int block_k = D <= 64 ? 128 : 64;
  static constexpr int pitch = D + 8;  // elements per shared row (16-byte pad: conflict-free ldmatrix)
  static_assert(D % 16 == 0 && (D / 8) % 2 == 0 && block_k % 16 == 0, "n-tiles are taken in pairs");
  /// Q, then two stages of K and V, all 16-bit (d = 64: 92 KB, 96: 80 KB, 128: 104 KB, 256: 203 KB).
  static constexpr std::size_t smem = static_cast<std::size_t>(block_q + 4 * block_k) * pitch * 2;
};

#if KFA_HAS_TENSOR_CORES
/// Softcap is a template parameter so that the common instance carries no tanh code: the loop body is
/// large, and cold code interleaved with it was measured (ncu) to stall warps on instruction fetch.
template <int D, bool Softcap, class T, class OutT>
__global__ void __launch_bounds__(32 * Fa2ForwardShape<D>::warps, Fa2ForwardShape<D>::min_blocks)
    tc_fa2_forward_kernel(const __grid_constant__ Fa2ForwardArgs<OutT> a) {
#if KFA_TC_DEVICE
  using Shape = Fa2ForwardShape<D>;
  constexpr int BQ = Shape::block_q, BC = Shape::block_k, P = Shape::pitch, NT = 32 * Shape::warps;
  constexpr int MT = Shape::mt;  // m16 tiles per warp
  extern __shared__ __align__(16) unsigned char fa2_smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, tid = threadIdx.x;
  const int g = lane >> 2, t4 = lane & 3;
  const QueryBlock blk(static_cast<int>(blockIdx.x), a.order, a.heads_q, a.group, BQ, a.seq_q);
  const int b = blk.b, h = blk.h, hk = blk.hk, i0 = blk.i0, rows = blk.rows;
  if (rows <= 0) return;                // an empty block of a document-aligned launch (cuda/block_order.hpp)
  const int row_end = i0 + rows;        // rows past it are another block's (or past seq_q)
  const int wr0 = i0 + warp * 16 * MT;  // this warp's first query row
  const float ninf = -compat::infinity<float>();

  const std::uint32_t qs = tc::smem_addr(fa2_smem);
  const std::uint32_t ks0 = qs + BQ * P * 2;  // stage s: K at ks0 + s·2·BC·P·2, V right after it
  constexpr std::uint32_t kv_bytes = BC * P * 2, stage_bytes = 2 * kv_bytes;

  const std::uint16_t* kbase = a.k + b * a.k_s[0] + hk * a.k_s[2];
  const std::uint16_t* vbase = a.v + b * a.v_s[0] + hk * a.v_s[2];
  const long kstride = a.k_s[1], vstride = a.v_s[1];

  // Key positions: int or long, whichever leaves the instance without register spills (ptxas, CUDA 13.0,
  // sm_90); int needs seq_k < 2^31 - 256, which the plan checks.
  using Pos = typename std::conditional<Softcap, long, int>::type;
  auto load_kv = [&](Pos j0, Pos j_end, int stage) {
    const int cols = static_cast<int>(j_end - j0 < BC ? j_end - j0 : BC);
    const std::uint32_t kd = ks0 + stage * stage_bytes;
    tc::load_tile_async<D, BC, NT, false>(kd, kbase + static_cast<long>(j0) * kstride, kstride, cols, tid);
    tc::load_tile_async<D, BC, NT, false>(kd + kv_bytes, vbase + static_cast<long>(j0) * vstride, vstride, cols, tid);
  };
  // The Q block (rows past seq_q are zeros), in the group of the first pass's first K/V tile.
  tc::load_tile_async<D, BQ, NT, false>(qs, a.q + b * a.q_s[0] + static_cast<long>(i0) * a.q_s[1] + h * a.q_s[2],
                                        a.q_s[1], rows, tid);

  float acc[MT][D / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int n = 0; n < D / 8; ++n) acc[mt][n][0] = acc[mt][n][1] = acc[mt][n][2] = acc[mt][n][3] = 0.f;
  // Row r of m-tile mt: r = 0 is row g, r = 1 is row g + 8. m in natural units (scale applied), as the
  // combine rule takes it; l is this lane's partial sum, reduced over the quad at the end.
  float m[MT][2], l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) m[mt][0] = m[mt][1] = ninf, l[mt][0] = l[mt][1] = 0.f;
  const float c = a.scale * tc::log2e;  // exp(scale·s − m) = 2^(s·c − m·log2e)
  // Lazy rescaling of the running maxima (below), but not with softcap: there it made the d = 64 instance
  // spill 8-12 B (ptxas, CUDA 13.0).
  constexpr bool kLazyRescale = !Softcap;
  constexpr float kStale = 8.f * 0.6931471805599453f;  // 8·ln 2: p ≤ 2^8 while the running maximum is stale
  const float cap_in = Softcap ? a.scale / a.softcap : 0.f, cap_out = Softcap ? a.softcap / a.scale : 0.f;

  // ldmatrix row addresses: lane l serves row l % 8 of matrix l / 8.
  const int mi = lane >> 3, mr = lane & 7;
  // Q as A (row-major): matrices (rows +0, d +0), (rows +8, d +0), (rows +0, d +8), (rows +8, d +8)
  const std::uint32_t q_lane =
      qs + static_cast<std::uint32_t>(((warp * 16 * MT + (mi & 1) * 8 + mr) * P + (mi >> 1) * 8) * 2);
  // K as B of S = Q·Kᵀ: matrices (keys +0, d +0), (keys +0, d +8), (keys +8, d +0), (keys +8, d +8)
  const std::uint32_t k_off = static_cast<std::uint32_t>((((mi >> 1) * 8 + mr) * P + (mi & 1) * 8) * 2);
  // V as B of O += P·V (transposed): matrices (keys +0, d +0), (keys +8, d +0), (keys +0, d +8), (keys +8, d +8)
  const std::uint32_t v_off = static_cast<std::uint32_t>((((mi & 1) * 8 + mr) * P + (mi >> 1) * 8) * 2);

  // One pass per document the block's rows meet (one without documents), the row states carried across; each
  // pass starts its own pipeline (its first tile in the next stage).
  int stage = 0;
  const DocumentSpan span = a.mask.documents_of_rows(i0, i0 + rows);
  for (int doc = span.first; doc < span.last; ++doc) {
    const KeyRule mask = a.mask.rule(doc);
    const Pos j_begin = static_cast<Pos>(mask.key_begin(i0));
    const Pos j_end = static_cast<Pos>(mask.key_end(i0 + rows));
    if (j_begin < j_end) load_kv(j_begin, j_end, stage);
    tc::cp_async_commit();
    for (Pos j0 = j_begin; j0 < j_end; j0 += BC, stage ^= 1) {
      const int cols = (j_end - j0) < BC ? static_cast<int>(j_end - j0) : BC;
      if (j0 + BC < j_end) load_kv(j0 + BC, j_end, stage ^ 1);
      tc::cp_async_commit();
      tc::cp_async_wait_1();  // everything but the group just issued: tile j (and Q) are in
      __syncthreads();
      const std::uint32_t k_lane = ks0 + stage * stage_bytes + k_off;
      const std::uint32_t v_lane = ks0 + stage * stage_bytes + kv_bytes + v_off;

      float s[MT][BC / 8][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < BC / 8; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        std::uint32_t qa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
          tc::ldmatrix_x4(qa[mt], q_lane + static_cast<std::uint32_t>((mt * 16 * P + kk * 16) * 2));
#pragma unroll
        for (int n = 0; n < BC / 8; n += 2) {
          std::uint32_t bf[4];
          tc::ldmatrix_x4(bf, k_lane + static_cast<std::uint32_t>((n * 8 * P + kk * 16) * 2));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            tc::mma<T>(s[mt][n], qa[mt], bf[0], bf[1]);
            tc::mma<T>(s[mt][n + 1], qa[mt], bf[2], bf[3]);
          }
        }
      }

      // Softcap and mask in raw units (x·scale is applied in the exponent), each one block of code that
      // the common tile skips with one branch; then the online softmax.
      if (Softcap) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int n = 0; n < BC / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[mt][n][e] = cap_out * tanhf(s[mt][n][e] * cap_in);
      }
      if (cols < BC || !mask.all_visible(i0, i0 + rows, j0, static_cast<long>(j0) + BC)) {
        // Keys past j_end are seen by no row, so the row's visible range covers the tile's padding too.
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            long first, last;
            mask.visible_range(wr0 + mt * 16 + g + r * 8, first, last);
            const int lo = static_cast<int>(first - j0 < 0 ? 0 : (first - j0 > BC ? BC : first - j0));
            const int hi = static_cast<int>(last - j0 < -1 ? -1 : (last - j0 > BC ? BC : last - j0));
#pragma unroll
            for (int n = 0; n < BC / 8; ++n)
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                const int jj = n * 8 + 2 * t4 + e;
                if (jj < lo || jj > hi) s[mt][n][2 * r + e] = ninf;
              }
          }
      }
      // Per m-tile: the tile's row maxima (natural units). The running maxima move (and l and O are rescaled)
      // only when a row of the warp's m-tile has a tile maximum more than kStale above its running one;
      // otherwise p = exp(x − m) with the running m, at most e^kStale = 2^8: the same sums in another rounding,
      // without the D/8·4 multiplies of the rescale (FlashAttention-4's lazy rescaling).
      std::uint32_t pa[MT][BC / 16][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        float tmax[2] = {ninf, ninf};
#pragma unroll
        for (int n = 0; n < BC / 8; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) tmax[e >> 1] = fmaxf(tmax[e >> 1], s[mt][n][e]);
        float tm[2];
        bool grow = false;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float t = tc::quad_max(tmax[r]);
          tm[r] = t == ninf ? ninf : t * a.scale;
          grow |= tm[r] > m[mt][r] + kStale;  // m = −inf: any visible key
        }
        if (!kLazyRescale || __any_sync(0xffffffffu, grow)) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const MergeFactors<float> f = merge_factors(m[mt][r], tm[r]);
            m[mt][r] = f.m;
            l[mt][r] *= f.scale_a;
#pragma unroll
            for (int n = 0; n < D / 8; ++n) {
              acc[mt][n][2 * r] *= f.scale_a;
              acc[mt][n][2 * r + 1] *= f.scale_a;
            }
          }
        }
        float mc[2];  // the running maximum times log2(e), 0 for a row with no visible key yet (its p are 0)
#pragma unroll
        for (int r = 0; r < 2; ++r) mc[r] = m[mt][r] == ninf ? 0.f : m[mt][r] * tc::log2e;
#pragma unroll
        for (int n = 0; n < BC / 8; ++n) {
          const float p0 = tc::exp2_approx(fmaf(s[mt][n][0], c, -mc[0]));
          const float p1 = tc::exp2_approx(fmaf(s[mt][n][1], c, -mc[0]));
          const float p2 = tc::exp2_approx(fmaf(s[mt][n][2], c, -mc[1]));
          const float p3 = tc::exp2_approx(fmaf(s[mt][n][3], c, -mc[1]));
          l[mt][0] += p0 + p1;
          l[mt][1] += p2 + p3;
          pa[mt][n / 2][(n & 1) * 2 + 0] = cuda16<T>::pack(p0, p1);
          pa[mt][n / 2][(n & 1) * 2 + 1] = cuda16<T>::pack(p2, p3);
        }
      }

#pragma unroll
      for (int kk = 0; kk < BC / 16; ++kk) {
#pragma unroll
        for (int n = 0; n < D / 8; n += 2) {
          std::uint32_t bf[4];
          tc::ldmatrix_x4_trans(bf, v_lane + static_cast<std::uint32_t>((kk * 16 * P + n * 8) * 2));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            tc::mma<T>(acc[mt][n], pa[mt][kk], bf[0], bf[1]);
            tc::mma<T>(acc[mt][n + 1], pa[mt][kk], bf[2], bf[3]);
          }
        }
      }
      __syncthreads();  // every warp is done with this stage before the next iteration refills it
    }
  }
  tc::cp_async_wait_all();

  OutT* obase = a.o + b * a.o_s[0] + h * a.o_s[2];
  float* lbase = a.lse + b * a.l_s[0] + h * a.l_s[1];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    float lsum[2], inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      lsum[r] = tc::quad_sum(l[mt][r]);
      inv[r] = lsum[r] == 0.f ? 0.f : 1.f / lsum[r];
    }
    const int r0 = wr0 + mt * 16 + g, r1 = r0 + 8;
    tc::store_c_rows<D, T>(acc[mt], inv[0], inv[1], r0 < row_end ? obase + r0 * a.o_s[1] : nullptr,
                           r1 < row_end ? obase + r1 * a.o_s[1] : nullptr, t4);
    if (t4 == 0) {
      if (r0 < row_end) lbase[r0 * a.l_s[2]] = SoftmaxState<float>{m[mt][0], lsum[0]}.lse();
      if (r1 < row_end) lbase[r1 * a.l_s[2]] = SoftmaxState<float>{m[mt][1], lsum[1]}.lse();
    }
  }
#else
  (void)a;
#if defined(__CUDA_ARCH__)
  __trap();  // not reachable: the launcher checks the device's compute capability first
#endif
#endif
}
#endif  // KFA_HAS_TENSOR_CORES

/// Why the FA2-layout forward cannot run head dim d on this space's device ("" when it can): it needs
/// Kokkos::Cuda and more shared memory per block than Kokkos' team scratch allows.
template <class ExecSpace>
std::string fa2_forward_problem(const ExecSpace& space, int d) {
#if KFA_HAS_TENSOR_CORES
  if constexpr (std::is_same<ExecSpace, Kokkos::Cuda>::value) {
    const std::size_t smem = fa2_head_dim_switch(d, [](auto dc) { return Fa2ForwardShape<decltype(dc)::value>::smem; });
    return native_smem_problem(space, smem, "the FA2-layout forward");
  }
#endif
  (void)space, (void)d;
  return "it is a Kokkos::Cuda kernel";
}

#if KFA_HAS_TENSOR_CORES

template <int D, bool Softcap, class Args>
void fa2_forward_launch_d(const Kokkos::Cuda& space, const Args& args) {
  using T = typename Args::T;
  using OutT = typename Args::o_type::non_const_value_type;
  native_forward_launch<Fa2ForwardShape<D>, OutT>(space, "kfa::attention_forward[tensor_core_fa2]",
                                                  &tc_fa2_forward_kernel<D, Softcap, T, OutT>, args);
}

template <class Args>
void fa2_forward_launch(const Kokkos::Cuda& space, const Args& args) {
  fa2_head_dim_switch(static_cast<int>(args.q.extent(3)), [&](auto dc) {
    constexpr int D = decltype(dc)::value;
    if (args.softcap > 0.f)
      fa2_forward_launch_d<D, true>(space, args);
    else
      fa2_forward_launch_d<D, false>(space, args);
  });
}
#endif

}  // namespace detail
}  // namespace kfa
