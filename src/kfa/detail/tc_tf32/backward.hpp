#pragma once
/// tc_tf32/backward.hpp: the tc_tf32 family's backward kernels (dK/dV and dQ).
/// The fp32 backward on tensor cores (TileProductPath::tensor_core_tf32x3, Kokkos::Cuda, sm_80+): every tile
/// product in 3×TF32 as in the fp32 forward (tc_tf32/forward.hpp, which has the split, the fragment layouts
/// and the index permutation used here), launched natively (cuda/native.hpp) on the caller's stream. Two
/// kernels, no atomics (the gradients are bitwise reproducible), the same recomputation as the 16-bit
/// tensor-core backward (P from the forward's lse, D = rowsum(dO ∘ O) given):
///
///   dK/dV: a block of 8 warps owns 64 keys (K and V in shared memory) and walks the visible query tiles of
///     BQ rows (Q and dO double-buffered with cp.async) of every query head of the group. Two warps share
///     16 keys (keys are the rows: no transposed operand is ever read): one computes Sᵀ = K·Qᵀ, Pᵀ and
///     dV += Pᵀ·dO, the other dPᵀ = V·dOᵀ, dSᵀ = Pᵀ ∘ (dPᵀ − D) (∘ softcap', from the first through
///     shared memory) and dK += dSᵀ·Q, so each holds one fp32 accumulator of 16 × D (one warp holding both
///     spilled 72-192 B at d = 128). Pᵀ and dSᵀ are A fragments straight from the C fragments; dO and Q are
///     read as the forward reads V (queries 2t and 2t + 1 of each 8, 16-byte reads of four head dims).
///   dQ: the forward's layout, 8 warps of 16 query rows (Q and dO in shared memory), K/V tiles of BK keys
///     double-buffered; S = Q·Kᵀ and dP = dO·Vᵀ, dS in registers, dQ += dS·K as the forward's O += P·V.
///
/// The tensor core truncates what it adds to C, so, as in the forward, no C carries a long sum: scores are
/// summed 32 head dims at a time and the gradients one step (tile) and 32 head dims at a time into a zeroed
/// C, then added to fp32 registers.
#include <kfa/detail/common/recompute.hpp>  // recompute_lse, BackwardParts
#include <kfa/detail/cuda/mma.hpp>
#include <kfa/detail/cuda/native.hpp>
#include <kfa/detail/cuda/native_args.hpp>  // Fa2DqArgs, set_dq_args
#include <kfa/detail/cuda/recompute_p.hpp>
#include <kfa/detail/mask.hpp>
#include <kfa/detail/tc_tf32/forward.hpp>  // tc::scores_3xtf32, tc::accumulate_c_rows_3xtf32, ...

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace kfa {
namespace detail {

/// Query rows per dK/dV step (64 at d = 64, else 32) and keys per dQ tile (16 at d = 96, else 32). dK/dV steps
/// of 64 rows at d = 64: +3.9 to +6.2% forward+backward over 32 (H200, kfa vs kfa). At d = 96 they gave +3.3
/// to +4.0% but take 170 KB, more than sm_80's 163 KB (where d = 96 would then have the portable backward
/// only); at d = 128 they spilled 36 B (ptxas, CUDA 13.0). The dQ kernel at d = 96 takes 16 keys: with 32 it
/// spilled 36 B (d = 64 and 128 do not; 64 keys spilled at d = 64 and 128).
/// DqWarps: the dQ kernel's warps, 8 (128-row blocks) where the device gives it their shared memory, else 4
/// (64 rows: d = 128 on sm_80 needs 135 KB instead of 198 KB); see tf32_dq_warps.
template <int D, int DqWarps = 8>
struct Tf32BackwardShape {
  static constexpr int warps = 8;  // dK/dV; both kernels: 16 rows per warp (keys in dK/dV, queries in dQ)
  static constexpr int dq_warps = DqWarps;
  static constexpr int pitch = D + 4;                     // floats per shared row
  static constexpr int dkdv_block_k = 16 * warps / 2;     // owned keys: two warps per 16 (dV, dK)
  static constexpr int dkdv_block_q = D <= 64 ? 64 : 32;  // query rows per step
  static constexpr int dq_block_q = 16 * dq_warps;        // owned query rows
  static constexpr int dq_block_k = D == 96 ? 16 : 32;    // streamed keys per tile
  static_assert(D % 32 == 0 && dkdv_block_q % 16 == 0 && dq_block_k % 16 == 0,
                "32 head dims per partial sum; n-tiles in pairs");
  /// dK/dV: K and V, two stages of Q and dO, and a buffer of BK × BQ (Pᵀ·softcap' from one warp of a pair to
  /// the other); dQ: Q and dO, then two stages of K and V; all fp32 (d = 64: 118 and 102 KB, 96: 108 and
  /// 125 KB, 128: 140 and 198 KB; dQ with 4 warps: 68, 75 and 132 KB).
  static constexpr std::size_t dkdv_scratch =
      static_cast<std::size_t>(2 * dkdv_block_k + 4 * dkdv_block_q) * pitch * 4 +
      static_cast<std::size_t>(dkdv_block_k) * dkdv_block_q * 4;
  static constexpr std::size_t dq_scratch = static_cast<std::size_t>(2 * dq_block_q + 4 * dq_block_k) * pitch * 4;
};

/// The dQ kernel's warps on a device that gives a block smem_max bytes (Tf32BackwardShape).
template <int D>
int tf32_dq_warps(std::size_t smem_max) {
  return Tf32BackwardShape<D, 8>::dq_scratch <= smem_max ? 8 : 4;
}
/// The shared memory per block the 3xTF32 backward of head dim D needs at least.
template <int D>
constexpr std::size_t tf32_backward_min_smem() {
  return Tf32BackwardShape<D>::dkdv_scratch > Tf32BackwardShape<D, 4>::dq_scratch ? Tf32BackwardShape<D>::dkdv_scratch
                                                                                  : Tf32BackwardShape<D, 4>::dq_scratch;
}

/// Both kernels' arguments: the dQ kernel's (Fa2DqArgs<float>; its 16-bit pointers carry the float data) and
/// the dK/dV outputs.
struct Tf32BackwardArgs : Fa2DqArgs<float> {
  float* dk;
  float* dv;
  long dk_s[3], dv_s[3];
  int seq_k, heads_kv;
  BlockOrder korder;  // of the key blocks (order: the dQ kernel's query blocks)
};

#if KFA_HAS_TENSOR_CORES

template <int D, bool Softcap>
__global__ void __launch_bounds__(32 * Tf32BackwardShape<D>::warps, 1)
    tc_tf32_dkdv_kernel(const __grid_constant__ Tf32BackwardArgs a) {
#if KFA_TC_DEVICE
  using Shape = Tf32BackwardShape<D>;
  constexpr int BK = Shape::dkdv_block_k, BQ = Shape::dkdv_block_q, P = Shape::pitch, NT = 32 * Shape::warps;
  constexpr int NQ = BQ / 8;  // n-tiles of query columns
  extern __shared__ __align__(16) unsigned char tf32_dkdv_smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, tid = threadIdx.x;
  const int g = lane >> 2, t4 = lane & 3, mi = lane >> 3, mr = lane & 7;
  // Warps w and w + warps/2 share keys 16w … 16w + 15: the first (role 0) computes Sᵀ, Pᵀ and dV, the
  // second (role 1) dPᵀ, dSᵀ and dK.
  const int kw = warp % (Shape::warps / 2), role = warp / (Shape::warps / 2);
  const int lr = static_cast<int>(blockIdx.x);
  const KeyBlock blk(lr, a.korder, a.heads_kv, BK, a.seq_k);
  const int hk = blk.hk, b = blk.b, k0 = blk.k0, keys = blk.keys;
  if (keys <= 0) return;  // an empty block of a document-aligned launch (cuda/block_order.hpp)

  // K, V, two stages of (Q, dO), then Pᵀ·softcap' per pair in C-fragment order.
  const std::uint32_t ks = tc::smem_addr(tf32_dkdv_smem), vs = ks + BK * P * 4, stage0 = vs + BK * P * 4;
  constexpr std::uint32_t stage_bytes = 2 * BQ * P * 4;
  const float* stage0_f = reinterpret_cast<const float*>(tf32_dkdv_smem) + 2 * BK * P;
  float4* w_frag = reinterpret_cast<float4*>(tf32_dkdv_smem + 2 * BK * P * 4 + 2 * stage_bytes) + kw * NQ * 32 + lane;
  // Rows of D floats are rows of 2·D 16-bit elements with pitch 2·D + 8, i.e. D + 4 floats.
  auto load_rows = [&](auto rows_c, std::uint32_t dst, const float* src, long stride, int valid) {
    tc::load_tile_async<2 * D, decltype(rows_c)::value, NT, false>(dst, reinterpret_cast<const std::uint16_t*>(src),
                                                                   2 * stride, valid, tid);
  };

  KeyRule mask;  // the pass's: one per document the block's keys meet (one without documents)
  long qb0 = 0, qb1 = 0;
  int n_qt = 0;
  // Steps run over the visible query tiles (fastest) of each query head of the group. The tile's addresses
  // come from the arguments each time (kept in registers across the loop, they spilled).
  auto issue = [&](int qt, int gh, int st) {
    const long i = qb0 + static_cast<long>(qt) * BQ;
    const int rows = static_cast<int>(qb1 - i < BQ ? qb1 - i : BQ);
    const long hq = static_cast<long>(hk) * a.group + gh;
    const std::uint32_t qd = stage0 + st * stage_bytes;
    load_rows(std::integral_constant<int, BQ>{}, qd,
              reinterpret_cast<const float*>(a.q) + b * a.q_s[0] + i * a.q_s[1] + hq * a.q_s[2], a.q_s[1], rows);
    load_rows(std::integral_constant<int, BQ>{}, qd + BQ * P * 4,
              reinterpret_cast<const float*>(a.d_o) + b * a.do_s[0] + i * a.do_s[1] + hq * a.do_s[2], a.do_s[1], rows);
  };

  float acc[D / 8][4];  // dV (role 0) or dK (role 1), unscaled
#pragma unroll
  for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;

  // K (role 0) or V (role 1) as A of Sᵀ = K·Qᵀ or dPᵀ = V·dOᵀ: the pair's 16 keys; matrices (keys +0, d +0),
  // (+8, +0), (+0, +4), (+8, +4)
  const std::uint32_t a_lane =
      (role == 0 ? ks : vs) + static_cast<std::uint32_t>(((kw * 16 + (mi & 1) * 8 + mr) * P + (mi >> 1) * 4) * 4);
  // Q (role 0) or dO (role 1) as B of those: matrices (queries +0, d +0), (+0, +4), (+8, +0), (+8, +4)
  const std::uint32_t b_off = (role == 0 ? 0u : static_cast<std::uint32_t>(BQ * P * 4)) +
                              static_cast<std::uint32_t>((((mi >> 1) * 8 + mr) * P + (mi & 1) * 4) * 4);
  // dO (role 0) or Q (role 1) as B of dV += Pᵀ·dO or dK += dSᵀ·Q: queries 2t and 2t + 1 of each 8, head dims
  // 4g … 4g + 3
  const int r_off = (role == 0 ? BQ * P : 0) + 2 * t4 * P + 4 * g;
  const long kj = k0 + kw * 16 + g;  // this lane's keys kj and kj + 8

  // K and V, with the first pass's first step. One pass per document the block's keys meet (one without
  // documents), dK and dV carried across; each pass starts its own pipeline (every stage is free between them).
  load_rows(std::integral_constant<int, BK>{}, ks,
            reinterpret_cast<const float*>(a.k) + b * a.k_s[0] + static_cast<long>(k0) * a.k_s[1] + hk * a.k_s[2],
            a.k_s[1], keys);
  load_rows(std::integral_constant<int, BK>{}, vs,
            reinterpret_cast<const float*>(a.v) + b * a.v_s[0] + static_cast<long>(k0) * a.v_s[1] + hk * a.v_s[2],
            a.v_s[1], keys);
  const DocumentSpan span = a.mask.documents_of_keys(k0, k0 + keys);
  for (int doc = span.first; doc < span.last; ++doc) {
    mask = a.mask.rule(doc);
    qb0 = mask.query_begin(k0);
    qb1 = mask.query_end(k0 + keys, a.seq_q);
    n_qt = qb1 > qb0 ? static_cast<int>((qb1 - qb0 + BQ - 1) / BQ) : 0;
    const int steps = n_qt * a.group;
    if (steps == 0) continue;
    issue(0, 0, 0);
    tc::cp_async_commit();
    int qt = 0, gh = 0;
    for (int step = 0; step < steps; ++step) {
      const long i0 = qb0 + static_cast<long>(qt) * BQ;
      const int rows = static_cast<int>(qb1 - i0 < BQ ? qb1 - i0 : BQ);
      const int hq = hk * a.group + gh;
      const int st = step & 1;
      if (step + 1 < steps) {
        if (qt + 1 < n_qt)
          issue(qt + 1, gh, st ^ 1);
        else
          issue(0, gh + 1, st ^ 1);
      }
      tc::cp_async_commit();
      tc::cp_async_wait_1();  // all but the group just issued
      __syncthreads();        // this step's Q and dO (and K, V) are in
      const std::uint32_t qs = stage0 + st * stage_bytes;

      // 1. Sᵀ = K·Qᵀ (role 0) or dPᵀ = V·dOᵀ (role 1), the pair's 16 keys × BQ queries.
      float c[NQ][4];
#pragma unroll
      for (int n = 0; n < NQ; ++n) c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0.f;
      tc::scores_3xtf32<D, NQ, P>(c, a_lane, qs + b_off);

      // 2. Role 0: Pᵀ into c, Pᵀ·softcap' to the pair's buffer. Element (key kj + 8r, query i0 + n·8 + 2t + e).
      //    Masked steps take a second copy of the pass (the common step tests nothing per element).
      if (role == 0) {
        auto pass = [&](auto masked) {
          constexpr bool Masked = decltype(masked)::value;
#pragma unroll
          for (int n = 0; n < NQ; ++n) {
            float w[4];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int qi = n * 8 + 2 * t4 + e;
              const long row = i0 + qi;
              const float l2 = qi < rows
                                   ? recompute_lse(a.lse[b * a.l_s[0] + hq * a.l_s[1] + row * a.l_s[2]]) * tc::log2e
                                   : compat::infinity<float>();
              long first = 0, last = a.seq_k - 1;
              if (Masked) mask.visible_range(row, first, last);
#pragma unroll
              for (int r = 0; r < 2; ++r) {
                const bool vis = !Masked || (kj + 8 * r >= first && kj + 8 * r <= last);
                float dcap;
                c[n][2 * r + e] = tc_recompute_p<Softcap>(c[n][2 * r + e], a.pc, l2, vis, dcap);
                w[2 * r + e] = c[n][2 * r + e] * dcap;
              }
            }
            w_frag[n * 32] = make_float4(w[0], w[1], w[2], w[3]);
          }
        };
        if (rows < BQ || keys < BK || !mask.all_visible(i0, i0 + BQ, k0, k0 + BK))
          pass(std::true_type{});
        else
          pass(std::false_type{});
      }
      __syncthreads();  // every pair's Pᵀ·softcap' is in
      // Role 1: dSᵀ = Pᵀ·softcap' ∘ (dPᵀ − D) into c (rows past the tile have D = 0 and Pᵀ = 0).
      if (role == 1) {
#pragma unroll
        for (int n = 0; n < NQ; ++n) {
          const float4 w = w_frag[n * 32];
          float dd[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int qi = n * 8 + 2 * t4 + e;
            dd[e] = qi < rows ? a.dd[b * a.d_s[0] + hq * a.d_s[1] + (i0 + qi) * a.d_s[2]] : 0.f;
          }
          c[n][0] = w.x * (c[n][0] - dd[0]);
          c[n][1] = w.y * (c[n][1] - dd[1]);
          c[n][2] = w.z * (c[n][2] - dd[0]);
          c[n][3] = w.w * (c[n][3] - dd[1]);
        }
      }

      // 3. dV += Pᵀ·dO (role 0) or dK += dSᵀ·Q (role 1), one step and 32 head dims at a time into a zeroed C.
      tc::accumulate_c_rows_3xtf32<D, NQ, P>(acc, c, stage0_f + st * (stage_bytes / 4) + r_off);
      __syncthreads();  // every warp is done with this stage and the buffers before they are refilled
      if (++qt == n_qt) qt = 0, ++gh;
    }
  }
  tc::cp_async_wait_all();

  float* out = role == 0 ? a.dv + b * a.dv_s[0] + hk * a.dv_s[2] : a.dk + b * a.dk_s[0] + hk * a.dk_s[2];
  const long out_s = role == 0 ? a.dv_s[1] : a.dk_s[1];
  const float f = role == 0 ? 1.f : a.scale;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const long key = kj + 8 * r;
    if (key < k0 + keys) tc::store_rows_permuted<D>(out + key * out_s + 8 * t4, acc, r, f);
  }
#else
  (void)a;
#if defined(__CUDA_ARCH__)
  __trap();  // not reachable: the launcher checks the device's compute capability first
#endif
#endif
}

template <int D, bool Softcap, int DqWarps>
__global__ void __launch_bounds__(32 * DqWarps, 1) tc_tf32_dq_kernel(const __grid_constant__ Tf32BackwardArgs a) {
#if KFA_TC_DEVICE
  using Shape = Tf32BackwardShape<D, DqWarps>;
  constexpr int BQ = Shape::dq_block_q, BC = Shape::dq_block_k, P = Shape::pitch, NT = 32 * DqWarps;
  extern __shared__ __align__(16) unsigned char tf32_dq_smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, tid = threadIdx.x;
  const int g = lane >> 2, t4 = lane & 3, mi = lane >> 3, mr = lane & 7;
  const QueryBlock blk(static_cast<int>(blockIdx.x), a.order, a.heads_q, a.group, BQ, a.seq_q);
  const int b = blk.b, h = blk.h, hk = blk.hk, i0 = blk.i0, rows = blk.rows;
  if (rows <= 0) return;           // an empty block of a document-aligned launch (cuda/block_order.hpp)
  const int row_end = i0 + rows;   // rows past it are another block's (or past seq_q)
  const int wr0 = i0 + warp * 16;  // this warp's first query row

  // Q, dO, then two stages of (K, V).
  const std::uint32_t qs = tc::smem_addr(tf32_dq_smem), dos = qs + BQ * P * 4, ks0 = dos + BQ * P * 4;
  constexpr std::uint32_t kv_bytes = BC * P * 4, stage_bytes = 2 * kv_bytes;
  const float* ks0_f = reinterpret_cast<const float*>(tf32_dq_smem) + 2 * BQ * P;
  auto load_rows = [&](auto rows_c, std::uint32_t dst, const float* src, long stride, int valid) {
    tc::load_tile_async<2 * D, decltype(rows_c)::value, NT, false>(dst, reinterpret_cast<const std::uint16_t*>(src),
                                                                   2 * stride, valid, tid);
  };
  // The tile's addresses from the arguments each time (kept in registers across the loop, they spilled).
  auto load_kv = [&](long j0, long j_end, int stage) {
    const int cols = static_cast<int>(j_end - j0 < BC ? j_end - j0 : BC);
    const std::uint32_t kd = ks0 + stage * stage_bytes;
    load_rows(std::integral_constant<int, BC>{}, kd,
              reinterpret_cast<const float*>(a.k) + b * a.k_s[0] + j0 * a.k_s[1] + hk * a.k_s[2], a.k_s[1], cols);
    load_rows(std::integral_constant<int, BC>{}, kd + kv_bytes,
              reinterpret_cast<const float*>(a.v) + b * a.v_s[0] + j0 * a.v_s[1] + hk * a.v_s[2], a.v_s[1], cols);
  };
  // The Q and dO blocks (rows past seq_q are zeros), in the group of the first pass's first K/V tile.
  load_rows(std::integral_constant<int, BQ>{}, qs,
            reinterpret_cast<const float*>(a.q) + b * a.q_s[0] + static_cast<long>(i0) * a.q_s[1] + h * a.q_s[2],
            a.q_s[1], rows);
  load_rows(std::integral_constant<int, BQ>{}, dos,
            reinterpret_cast<const float*>(a.d_o) + b * a.do_s[0] + static_cast<long>(i0) * a.do_s[1] + h * a.do_s[2],
            a.do_s[1], rows);

  // Rows g and g + 8: lse·log2(e) and D (+inf and 0 past seq_q: P = 0 there).
  float lse2[2], ddr[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = wr0 + g + r * 8;
    const bool in = row < row_end;
    lse2[r] =
        in ? recompute_lse(a.lse[b * a.l_s[0] + h * a.l_s[1] + row * a.l_s[2]]) * tc::log2e : compat::infinity<float>();
    ddr[r] = in ? a.dd[b * a.d_s[0] + h * a.d_s[1] + row * a.d_s[2]] : 0.f;
  }
  float acc[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;

  // Q, dO as A: this warp's 16 rows; K, V as B of S = Q·Kᵀ, dP = dO·Vᵀ (as tc_tf32_forward_kernel)
  const std::uint32_t a_off = static_cast<std::uint32_t>(((warp * 16 + (mi & 1) * 8 + mr) * P + (mi >> 1) * 4) * 4);
  const std::uint32_t b_off = static_cast<std::uint32_t>((((mi >> 1) * 8 + mr) * P + (mi & 1) * 4) * 4);
  // K as B of dQ += dS·K: keys 2t and 2t + 1 of each 8, head dims 4g … 4g + 3
  const int r_off = 2 * t4 * P + 4 * g;

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
    for (long j0 = j_begin; j0 < j_end; j0 += BC, stage ^= 1) {
      const int cols = (j_end - j0) < BC ? static_cast<int>(j_end - j0) : BC;
      if (j0 + BC < j_end) load_kv(j0 + BC, j_end, stage ^ 1);
      tc::cp_async_commit();
      tc::cp_async_wait_1();  // everything but the group just issued: tile j (and Q, dO) are in
      __syncthreads();
      const std::uint32_t ks = ks0 + stage * stage_bytes, vs = ks + kv_bytes;
      const float* k_f = ks0_f + stage * (stage_bytes / 4);

      float dp[BC / 8][4], s[BC / 8][4];
#pragma unroll
      for (int n = 0; n < BC / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) dp[n][e] = s[n][e] = 0.f;
      tc::scores_3xtf32<D, BC / 8, P>(dp, dos + a_off, vs + b_off);
      tc::scores_3xtf32<D, BC / 8, P>(s, qs + a_off, ks + b_off);

      // dS = P ∘ (dP − D) (∘ softcap') into s; masked tiles take a second copy of the pass.
      auto ds_pass = [&](auto masked) {
        constexpr bool Masked = decltype(masked)::value;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          int lo = 0, hi = BC - 1;  // visible keys of the row, tile-local
          if (Masked) {
            long first, last;
            mask.visible_range(wr0 + g + r * 8, first, last);
            lo = static_cast<int>(first - j0 < 0 ? 0 : (first - j0 > BC ? BC : first - j0));
            hi = static_cast<int>(last - j0 < -1 ? -1 : (last - j0 > cols - 1 ? cols - 1 : last - j0));
          }
#pragma unroll
          for (int n = 0; n < BC / 8; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int jj = n * 8 + 2 * t4 + e;
              const bool vis = !Masked || (jj >= lo && jj <= hi);
              float dcap;
              const float p = tc_recompute_p<Softcap>(s[n][2 * r + e], a.pc, lse2[r], vis, dcap);
              s[n][2 * r + e] = p * (dp[n][2 * r + e] - ddr[r]) * dcap;
            }
        }
      };
      if (cols < BC || !mask.all_visible(i0, i0 + rows, j0, j0 + BC))
        ds_pass(std::true_type{});
      else
        ds_pass(std::false_type{});

      // dQ += dS·K, one tile and 32 head dims at a time into a zeroed C.
      tc::accumulate_c_rows_3xtf32<D, BC / 8, P>(acc, s, k_f + r_off);
      __syncthreads();  // every warp is done with this stage before the next iteration refills it
    }
  }
  tc::cp_async_wait_all();

  float* dqbase = a.dq + b * a.dq_s[0] + h * a.dq_s[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = wr0 + g + 8 * r;
    if (row < row_end) tc::store_rows_permuted<D>(dqbase + row * a.dq_s[1] + 8 * t4, acc, r, a.scale);
  }
#else
  (void)a;
#if defined(__CUDA_ARCH__)
  __trap();  // not reachable: the launcher checks the device's compute capability first
#endif
#endif
}

/// The fp32 tensor-core backward of head dim D: dK/dV (parts != dq), then dQ (parts != dkdv). Arguments as
/// tc_backward_launch_d; the plan checked tf32_backward_why_not. Every output row is written (zero where no
/// query sees a key, or no key a query).
template <int D, bool Softcap, class Args>
void tf32_backward_launch_d(const Kokkos::Cuda& space, const Args& args, BackwardParts parts) {
  static_assert(std::is_same<typename Args::T, float>::value &&
                    std::is_same<typename Args::dq_type::non_const_value_type, float>::value &&
                    std::is_same<typename Args::lse_type::non_const_value_type, float>::value &&
                    std::is_same<typename Args::d_type::non_const_value_type, float>::value,
                "the 3xTF32 backward takes float");
  using S = Tf32BackwardShape<D>;
  const int dq_warps = tf32_dq_warps<D>(native_smem_max(space));
  Tf32BackwardArgs a;
  const long q_league = set_dq_args(a, args, 16 * dq_warps);
  a.dk = args.dk.data();
  a.dv = args.dv.data();
  strides3(args.dk, a.dk_s), strides3(args.dv, a.dv_s);
  a.seq_k = static_cast<int>(args.k.extent(1));
  a.heads_kv = static_cast<int>(args.k.extent(2));
  a.korder = key_block_order(args, S::dkdv_block_k);
  const long k_league = a.korder.league();
  if (k_league > 0 && parts != BackwardParts::dq)
    native_launch(space, "kfa::attention_backward::dkdv[tensor_core_tf32x3]", &tc_tf32_dkdv_kernel<D, Softcap>,
                  k_league, dim3(32 * S::warps), S::dkdv_scratch, 1, a);
  if (q_league > 0 && parts != BackwardParts::dkdv) {
    if (dq_warps == 8)
      native_launch(space, "kfa::attention_backward::dq[tensor_core_tf32x3]", &tc_tf32_dq_kernel<D, Softcap, 8>,
                    q_league, dim3(32 * 8), Tf32BackwardShape<D, 8>::dq_scratch, 1, a);
    else
      native_launch(space, "kfa::attention_backward::dq[tensor_core_tf32x3]", &tc_tf32_dq_kernel<D, Softcap, 4>,
                    q_league, dim3(32 * 4), Tf32BackwardShape<D, 4>::dq_scratch, 1, a);
  }
}

template <class Args>
void tf32_backward_launch(const Kokkos::Cuda& space, const Args& args, BackwardParts parts) {
  tc_head_dim_switch(static_cast<int>(args.q.extent(3)), [&](auto dc) {
    constexpr int D = decltype(dc)::value;
    if (args.softcap > 0.f)
      tf32_backward_launch_d<D, true>(space, args, parts);
    else
      tf32_backward_launch_d<D, false>(space, args, parts);
  });
}
#endif  // KFA_HAS_TENSOR_CORES

}  // namespace detail
}  // namespace kfa
