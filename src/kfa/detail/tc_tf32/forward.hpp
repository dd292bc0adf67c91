#pragma once
/// tc_tf32/forward.hpp: the tc_tf32 family's forward kernel and its 3×TF32 primitives.
/// The fp32 forward on tensor cores (TileProductPath::tensor_core_tf32x3): FlashAttention-2's layout as in
/// tc_fa2/forward.hpp, with both products (S = Q·Kᵀ and O += P·V) in 3×TF32. Each fp32 operand x is split
/// into big = x rounded to tf32 (10 mantissa bits) and small = x − big (exact in fp32), and a·b is taken as
/// a_small·b_big + a_big·b_small + a_big·b_big with mma.sync m16n8k8 (fp32 accumulation): the dropped
/// a_small·b_small term and the tf32 truncation of the small parts leave a relative error of about 2^-20 per
/// product, where fp32 FMA leaves 2^-24, and below the fp32 rounding of a head-dim-long dot product. This is
/// what torch's memory-efficient backend runs for float (CUTLASS' OpMultiplyAddFastF32). Inputs, outputs,
/// the softmax and every accumulation stay fp32.
///
/// The tensor core truncates what it adds to C (it does not round to nearest), so each mma loses up to one
/// ulp of C, always toward zero. With O's running sum kept in C over all keys, the output error grew with
/// seq_k to 24-51x that of torch's math backend (H200, N = 4096-16384). Here no C lives longer than 32 head
/// dims of one tile: S is summed 32 head dims at a time and O one tile and 32 head dims at a time into a
/// zeroed C, which is then added to the fp32 sum in registers with FADD. Measured after that: 0.29-1.12x the
/// math backend's output error (H200).
///
/// Per block: `warps` warps of 16 query rows each, Q in shared memory (re-read with ldmatrix each tile and
/// split again: keeping both halves in registers would take 4·D/8·2 of them), K and V tiles of BC keys
/// double-buffered with cp.async. Shared rows are D + 4 floats: ldmatrix's eight 16-byte rows and the V
/// reads below fall in distinct banks.
///
/// Fragments of m16n8k8 tf32 (PTX ISA), g = lane / 4, t = lane % 4: A (g, t), (g+8, t), (g, t+4),
/// (g+8, t+4); B (k = t, n = g), (k = t+4, n = g); C as for m16n8k16. An 8×8 16-bit ldmatrix matrix is
/// 8 rows × 4 floats and gives lane l row l / 4, float l % 4: Q's and K's fragments as they are. P·V permutes
/// indices so that no shuffle is needed: the k-slot t of 8 keys is key 2t and t+4 is key 2t+1, so the
/// fragment of P is S's C fragment (c0, c2, c1, c3); the n-index g of n-tile 4p + q is head dim
/// 32p + 4g + q, so one 16-byte read of V's row gives the B fragments of four n-tiles, and a thread ends with
/// head dims 32p + 8t … 32p + 8t + 7 of its rows (two 16-byte stores).
#include <kfa/detail/cuda/mma.hpp>
#include <kfa/detail/cuda/native.hpp>
#include <kfa/detail/cuda/native_args.hpp>  // Fa2ForwardArgs, native_forward_launch
#include <kfa/detail/cuda/row_keys.hpp>     // tc::RowKeys, tc::softcap_and_mask_rows
#include <kfa/detail/mask.hpp>
#include <kfa/online_softmax.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

namespace kfa {
namespace detail {

/// Tiles, measured on the H200 (fp32 forward, N = 4096/16384, kfa vs kfa in one run): 8 warps of 16 rows
/// (128-row Q block), one block per SM with up to 255 registers. K/V tiles of 32 keys at d = 96/128: with 64
/// the per-tile partial sums (see the top) made d = 128 spill 28-32 B; 64 at d = 64 (55.1-59.0 TF/s against
/// 47.7-51.1 with 32). 4 warps with two blocks per SM: -1.0 to +2.7% at d = 128, so the simpler one block
/// stays.
template <int D>
struct Tf32ForwardShape {
  static constexpr int warps = 8;
  static constexpr int block_q = 16 * warps;
  static constexpr int block_k = D <= 64 ? 64 : 32;
  static constexpr int pitch = D + 4;  // floats per shared row
  static_assert(D % 32 == 0 && block_k % 16 == 0, "V is read 32 head dims at a time; K in pairs of n-tiles");
  /// Q, then two stages of K and V, fp32.
  static constexpr std::size_t smem = static_cast<std::size_t>(block_q + 4 * block_k) * pitch * 4;
  /// Resident blocks per SM the registers are bounded for.
  static constexpr int min_blocks = 1;
};

#if KFA_HAS_TENSOR_CORES
#if KFA_TC_DEVICE
namespace tc {
/// x as 3×TF32's two halves: big = x rounded to tf32 (to nearest, ties away from zero), small = x − big,
/// exact in fp32; the tensor core reads the top 19 bits of each.
__device__ __forceinline__ void split_tf32(float x, std::uint32_t& big, std::uint32_t& small) {
  const std::uint32_t b = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
  big = b;
  small = __float_as_uint(x - __uint_as_float(b));
}
template <int N>
__device__ __forceinline__ void split_tf32(const std::uint32_t (&x)[N], std::uint32_t (&big)[N],
                                           std::uint32_t (&small)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) split_tf32(__uint_as_float(x[i]), big[i], small[i]);
}
/// d += a·b for one m16n8k8 tile in tf32, fp32 accumulation.
__device__ __forceinline__ void mma_tf32(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                         std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
/// d += a·b in 3×TF32 from the split halves of a and b (small terms first).
__device__ __forceinline__ void mma_3xtf32(float (&d)[4], const std::uint32_t (&a_big)[4],
                                           const std::uint32_t (&a_small)[4], std::uint32_t b0_big,
                                           std::uint32_t b1_big, std::uint32_t b0_small, std::uint32_t b1_small) {
  mma_tf32(d, a_small, b0_big, b1_big);
  mma_tf32(d, a_big, b0_small, b1_small);
  mma_tf32(d, a_big, b0_big, b1_big);
}
/// part[q] += A·B over 8 keys (or queries) for the n-tiles 4p + q (q < 4) of 32 head dims, in 3×TF32: A is
/// the C fragment `c` of an m16n8 tile (its k-slot t is column 2t, t + 4 is 2t + 1), B the rows 2t and
/// 2t + 1 at `rows` (float pointer, `pitch` floats apart), head dims 4g … 4g + 3 (see the top of this file).
template <int Pitch>
__device__ __forceinline__ void mma_c_rows_3xtf32(float (&part)[4][4], const float (&c)[4], const float* rows) {
  const std::uint32_t af[4] = {__float_as_uint(c[0]), __float_as_uint(c[2]), __float_as_uint(c[1]),
                               __float_as_uint(c[3])};
  std::uint32_t ab[4], as[4];
  split_tf32(af, ab, as);
  const float4 x0 = *reinterpret_cast<const float4*>(rows);
  const float4 x1 = *reinterpret_cast<const float4*>(rows + Pitch);
  const std::uint32_t bf[8] = {__float_as_uint(x0.x), __float_as_uint(x0.y), __float_as_uint(x0.z),
                               __float_as_uint(x0.w), __float_as_uint(x1.x), __float_as_uint(x1.y),
                               __float_as_uint(x1.z), __float_as_uint(x1.w)};
  std::uint32_t bb[8], bs[8];
  split_tf32(bf, bb, bs);
#pragma unroll
  for (int q = 0; q < 4; ++q) mma_3xtf32(part[q], ab, as, bb[q], bb[4 + q], bs[q], bs[4 + q]);
}

/// acc += A·B for D head dims, A the C fragments c[kk] of NK tiles of 8 keys (or queries) and B their rows
/// at `rows` (this lane's offset applied): per 32 head dims, the tile's part is summed in a zeroed C and added
/// to acc in registers.
template <int D, int NK, int P>
__device__ __forceinline__ void accumulate_c_rows_3xtf32(float (&acc)[D / 8][4], const float (&c)[NK][4],
                                                         const float* rows) {
#pragma unroll
  for (int p = 0; p < D / 32; ++p) {
    float part[4][4];
#pragma unroll
    for (int q = 0; q < 4; ++q) part[q][0] = part[q][1] = part[q][2] = part[q][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < NK; ++kk) mma_c_rows_3xtf32<P>(part, c[kk], rows + kk * 8 * P + 32 * p);
#pragma unroll
    for (int q = 0; q < 4; ++q)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[4 * p + q][e] += part[q][e];
  }
}

/// c[n] += A·Bᵀ over D head dims in 3×TF32 for NT n-tiles: A the 16 rows at `a_lane` (ldmatrix lane address,
/// row-major, pitch P floats), B the rows at `b_lane` (n-major); 32 head dims at a time into a zeroed C.
template <int D, int NT, int P>
__device__ __forceinline__ void scores_3xtf32(float (&c)[NT][4], std::uint32_t a_lane, std::uint32_t b_lane) {
#pragma unroll
  for (int k0 = 0; k0 < D / 8; k0 += 4) {
    float part[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) part[n][0] = part[n][1] = part[n][2] = part[n][3] = 0.f;
#pragma unroll
    for (int kk = k0; kk < k0 + 4; ++kk) {
      std::uint32_t af[4], ab[4], as[4];
      ldmatrix_x4(af, a_lane + static_cast<std::uint32_t>(kk * 8 * 4));
      split_tf32(af, ab, as);
#pragma unroll
      for (int n = 0; n < NT; n += 2) {
        std::uint32_t bf[4], bb[4], bs[4];
        ldmatrix_x4(bf, b_lane + static_cast<std::uint32_t>((n * 8 * P + kk * 8) * 4));
        split_tf32(bf, bb, bs);
        mma_3xtf32(part[n], ab, as, bb[0], bb[1], bs[0], bs[1]);
        mma_3xtf32(part[n + 1], ab, as, bb[2], bb[3], bs[2], bs[3]);
      }
    }
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) c[n][e] += part[n][e];
  }
}

/// row[32p + 8t + 4·half + q] = acc[4p + q][2r + half] · f for the head dims this lane holds of row r
/// (the permuted layout of mma_c_rows_3xtf32's n-tiles); `row` already points at head dim 8t.
template <int D>
__device__ __forceinline__ void store_rows_permuted(float* row, const float (&acc)[D / 8][4], int r, float f) {
#pragma unroll
  for (int p = 0; p < D / 32; ++p)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int e = 2 * r + half;
      *reinterpret_cast<float4*>(row + 32 * p + 4 * half) =
          make_float4(acc[4 * p][e] * f, acc[4 * p + 1][e] * f, acc[4 * p + 2][e] * f, acc[4 * p + 3][e] * f);
    }
}
}  // namespace tc
#endif

/// Softcap is a template parameter for the reason given at tc_fa2_forward_kernel (tc_fa2/forward.hpp).
template <int D, bool Softcap>
__global__ void __launch_bounds__(32 * Tf32ForwardShape<D>::warps, Tf32ForwardShape<D>::min_blocks)
    tc_tf32_forward_kernel(const __grid_constant__ Fa2ForwardArgs<float> a) {
#if KFA_TC_DEVICE
  using Shape = Tf32ForwardShape<D>;
  constexpr int BQ = Shape::block_q, BC = Shape::block_k, P = Shape::pitch, NT = 32 * Shape::warps;
  extern __shared__ __align__(16) unsigned char tf32_smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, tid = threadIdx.x;
  const int g = lane >> 2, t4 = lane & 3;
  const QueryBlock blk(static_cast<int>(blockIdx.x), a.order, a.heads_q, a.group, BQ, a.seq_q);
  const int b = blk.b, h = blk.h, hk = blk.hk, i0 = blk.i0, rows = blk.rows;
  if (rows <= 0) return;           // an empty block of a document-aligned launch (cuda/block_order.hpp)
  const int row_end = i0 + rows;   // rows past it are another block's (or past seq_q)
  const int wr0 = i0 + warp * 16;  // this warp's first query row
  const float ninf = -compat::infinity<float>();

  // The arguments carry the views' data as 16-bit pointers (Fa2QkvArgs) and strides in floats.
  const float* qg = reinterpret_cast<const float*>(a.q);
  const float* kg = reinterpret_cast<const float*>(a.k);
  const float* vg = reinterpret_cast<const float*>(a.v);
  const std::uint32_t qs = tc::smem_addr(tf32_smem);
  const std::uint32_t ks0 = qs + BQ * P * 4;  // stage s: K at ks0 + s·2·BC·P·4, V right after it
  constexpr std::uint32_t kv_bytes = BC * P * 4, stage_bytes = 2 * kv_bytes;
  const float* kv_smem = reinterpret_cast<const float*>(tf32_smem) + BQ * P;  // the same, for plain reads of V

  // Rows of D floats are rows of 2·D 16-bit elements with pitch 2·D + 8, i.e. D + 4 floats.
  auto load_rows = [&](auto rows_c, std::uint32_t dst, const float* src, long stride, int valid) {
    tc::load_tile_async<2 * D, decltype(rows_c)::value, NT, false>(dst, reinterpret_cast<const std::uint16_t*>(src),
                                                                   2 * stride, valid, tid);
  };
  const float* kbase = kg + b * a.k_s[0] + hk * a.k_s[2];
  const float* vbase = vg + b * a.v_s[0] + hk * a.v_s[2];
  const long kstride = a.k_s[1], vstride = a.v_s[1];

  // Key positions: long in the softcap instances below d = 128, else int (tf32_space_problem checks seq_k <
  // 2^31 - 256). Long at d = 128 spilled 4 B on sm_80/86/89 (ptxas, CUDA 13.0); int there is also 1% faster
  // on the H200, while at d = 64 long is 1-2% faster (fp32, softcap 30, N 4096/16384).
  using Pos = typename std::conditional < Softcap&& D<128, long, int>::type;
  auto load_kv = [&](Pos j0, Pos j_end, int stage) {
    const int cols = static_cast<int>(j_end - j0 < BC ? j_end - j0 : BC);
    const std::uint32_t kd = ks0 + stage * stage_bytes;
    load_rows(std::integral_constant<int, BC>{}, kd, kbase + static_cast<long>(j0) * kstride, kstride, cols);
    load_rows(std::integral_constant<int, BC>{}, kd + kv_bytes, vbase + static_cast<long>(j0) * vstride, vstride, cols);
  };
  // The Q block (rows past seq_q are zeros), in the group of the first pass's first K/V tile.
  load_rows(std::integral_constant<int, BQ>{}, qs, qg + b * a.q_s[0] + static_cast<long>(i0) * a.q_s[1] + h * a.q_s[2],
            a.q_s[1], rows);

  float acc[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  float m[2] = {ninf, ninf}, l[2] = {0.f, 0.f};  // rows g and g + 8; m in natural units, l this lane's part
  const float c = a.scale * tc::log2e;
  const float cap_in = Softcap ? a.scale / a.softcap : 0.f, cap_out = Softcap ? a.softcap / a.scale : 0.f;

  const int mi = lane >> 3, mr = lane & 7;  // ldmatrix: lane l gives row l % 8 of matrix l / 8
  // Q as A: matrices (rows +0, d +0), (rows +8, d +0), (rows +0, d +4), (rows +8, d +4)
  const std::uint32_t q_lane =
      qs + static_cast<std::uint32_t>(((warp * 16 + (mi & 1) * 8 + mr) * P + (mi >> 1) * 4) * 4);
  // K as B of S = Q·Kᵀ: matrices (keys +0, d +0), (keys +0, d +4), (keys +8, d +0), (keys +8, d +4)
  const std::uint32_t k_off = static_cast<std::uint32_t>((((mi >> 1) * 8 + mr) * P + (mi & 1) * 4) * 4);
  // V as B of O += P·V: this lane reads keys 2t and 2t + 1 of each 8, head dims 32p + 4g … 32p + 4g + 3
  const int v_off = 2 * t4 * P + 4 * g;

  // One pass per document the block's rows meet (one without documents), the rows' state carried across; each
  // pass starts its own pipeline (its first tile in the next stage).
  int stage = 0;
  const DocumentSpan span = a.mask.documents_of_rows(i0, i0 + rows);
  for (int doc = span.first; doc < span.last; ++doc) {
    const KeyRule mask = a.mask.rule(doc);
    const Pos j_begin = static_cast<Pos>(mask.key_begin(i0));
    const Pos j_end = static_cast<Pos>(mask.key_end(i0 + rows));
    const tc::RowKeys rk(mask, i0, rows, wr0 + g);
    if (j_begin < j_end) load_kv(j_begin, j_end, stage);
    tc::cp_async_commit();
    for (Pos j0 = j_begin; j0 < j_end; j0 += BC, stage ^= 1) {
      const int cols = (j_end - j0) < BC ? static_cast<int>(j_end - j0) : BC;
      if (j0 + BC < j_end) load_kv(j0 + BC, j_end, stage ^ 1);
      tc::cp_async_commit();
      tc::cp_async_wait_1();  // everything but the group just issued: tile j (and Q) are in
      __syncthreads();
      const std::uint32_t k_lane = ks0 + stage * stage_bytes + k_off;
      const float* v_lane = kv_smem + stage * (stage_bytes / 4) + BC * P + v_off;

      float s[BC / 8][4];
#pragma unroll
      for (int n = 0; n < BC / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
      // S = Q·Kᵀ, 32 head dims at a time into a zeroed C, added to S in registers (as O below).
      tc::scores_3xtf32<D, BC / 8, P>(s, q_lane, k_lane);

      tc::softcap_and_mask_rows<BC, Softcap>(s, rk, j0, cols, t4, cap_in, cap_out);
      // The online softmax, rescaling on every tile (tile maxima in natural units, as the combine rule takes them).
      float tmax[2] = {ninf, ninf};
#pragma unroll
      for (int n = 0; n < BC / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) tmax[e >> 1] = fmaxf(tmax[e >> 1], s[n][e]);
      float mc[2];  // the running maximum times log2(e), 0 for a row with no visible key yet (its p are 0)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float t = tc::quad_max(tmax[r]);
        const MergeFactors<float> f = merge_factors(m[r], t == ninf ? ninf : t * a.scale);
        m[r] = f.m;
        l[r] *= f.scale_a;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
          acc[n][2 * r] *= f.scale_a;
          acc[n][2 * r + 1] *= f.scale_a;
        }
        mc[r] = m[r] == ninf ? 0.f : m[r] * tc::log2e;
      }
#pragma unroll
      for (int n = 0; n < BC / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] = tc::exp2_approx(fmaf(s[n][e], c, -mc[e >> 1]));
        l[0] += s[n][0] + s[n][1];
        l[1] += s[n][2] + s[n][3];
      }

      // O += P·V, 32 head dims at a time: this tile's part is summed in a zeroed C and added to O in registers,
      // because the tensor core truncates what it adds to C (see the top of this file).
      tc::accumulate_c_rows_3xtf32<D, BC / 8, P>(acc, s, v_lane);
      __syncthreads();  // every warp is done with this stage before the next iteration refills it
    }
  }
  tc::cp_async_wait_all();

  float* obase = a.o + b * a.o_s[0] + h * a.o_s[2];
  float* lbase = a.lse + b * a.l_s[0] + h * a.l_s[1];
  float lsum[2], inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    lsum[r] = tc::quad_sum(l[r]);
    inv[r] = lsum[r] == 0.f ? 0.f : 1.f / lsum[r];
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = wr0 + g + 8 * r;
    if (row >= row_end) continue;
    tc::store_rows_permuted<D>(obase + row * a.o_s[1] + 8 * t4, acc, r, inv[r]);
    if (t4 == 0) lbase[row * a.l_s[2]] = SoftmaxState<float>{m[r], lsum[r]}.lse();
  }
#else
  (void)a;
#if defined(__CUDA_ARCH__)
  __trap();  // not reachable: the launcher checks the device's compute capability first
#endif
#endif
}
#endif  // KFA_HAS_TENSOR_CORES

#if KFA_HAS_TENSOR_CORES
template <int D, bool Softcap, class Args>
void tf32_forward_launch_d(const Kokkos::Cuda& space, const Args& args) {
  static_assert(std::is_same<typename Args::T, float>::value &&
                    std::is_same<typename Args::o_type::non_const_value_type, float>::value &&
                    std::is_same<typename Args::lse_type::non_const_value_type, float>::value,
                "the 3xTF32 forward takes float");
  native_forward_launch<Tf32ForwardShape<D>, float>(space, "kfa::attention_forward[tensor_core_tf32x3]",
                                                    &tc_tf32_forward_kernel<D, Softcap>, args);
}

template <class Args>
void tf32_forward_launch(const Kokkos::Cuda& space, const Args& args) {
  tc_head_dim_switch(static_cast<int>(args.q.extent(3)), [&](auto dc) {
    constexpr int D = decltype(dc)::value;
    if (args.softcap > 0.f)
      tf32_forward_launch_d<D, true>(space, args);
    else
      tf32_forward_launch_d<D, false>(space, args);
  });
}
#endif

}  // namespace detail
}  // namespace kfa
