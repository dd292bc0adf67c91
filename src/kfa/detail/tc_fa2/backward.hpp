#pragma once
/// tc_fa2/backward.hpp: the tc_fa2 family's dK/dV kernel (with dQ fused in by atomics, or not).
/// The tensor-core dK/dV kernel in FlashAttention-2's backward layout (Kokkos::Cuda, half/bfloat16, sm_80+),
/// launched natively (cuda/native.hpp) with opt-in shared memory on the caller's stream. Same algorithm,
/// fragments and recomputation as TcDkDvKernel (tc_team/backward.hpp); what differs is who multiplies what:
///
///   One block of 8 warps owns BK = 128 keys (64 at d = 256; K and V in shared memory) and walks the visible
///   query tiles of BQ = 64 rows (Q and dO double-buffered with cp.async) of every query head of the group.
///   A step:
///     1. dP = dO·Vᵀ and S = Q·Kᵀ (BQ × BK each), the warps as 2 × 4 tiles of BQ/2 queries × BK/4 keys, S one
///        m16 tile of rows at a time; P = exp(S·scale − lse) and dS = P ∘ (dP − D) (∘ softcap') go to
///        shared memory as 16-bit.
///     2. dV += Pᵀ·dO and dK += dSᵀ·Q, the warps as 4 × 2 tiles of BK/4 keys × D/2 columns (fp32
///        registers: 2·(BK/4)·(D/2)/32 values per thread for the two: D at BK = 128, as in the 16-key layout,
///        and 128 at d = 256).
///     3. FuseDq: dQ += dS·K (BQ × D), the warps as 2 × 4 tiles of BQ/2 queries × D/4 columns, atomically
///        added into the fp32 accumulator.
///   Against the 16-keys-per-warp kernel, a step is 4× the work per barrier, S and dP tiles are two m16
///   tiles per warp (each K, V, Q or dO fragment read from shared memory feeds two mma), and no softcap
///   factor lives across a product (dP is computed first; P and dS come out of one pass).
#include <kfa/detail/common/recompute.hpp>  // recompute_lse
#include <kfa/detail/cuda/mma.hpp>
#include <kfa/detail/cuda/recompute_p.hpp>
#include <kfa/detail/mask.hpp>

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace kfa {
namespace detail {

/// Whether the tensor-core backward uses the FA2-layout dK/dV kernel at head dim D, with dQ fused in
/// (atomics) or not: everywhere but the deterministic d = 64 backward, where the 16-keys-per-warp kernel
/// was measured 8-10% faster (H200, bf16).
template <int D, bool Fused>
constexpr bool tc_fa2_backward_used() {
  return D > 128 || Fused || D > 64;
}
/// Tiles of the FA2-layout dK/dV kernel (the deterministic backward's dQ kernel has its own).
/// Keys a block owns: 128, and 64 at d = 256 (dK and dV take 128 fp32 registers per thread; 128 keys would
/// take 256). Query rows per step: 64 at every head dim (d = 64: 128 measured within 2% of 64 and spilled
/// 8 B fused; d = 256: 32 measured 8.7-10.2% slower forward+backward, H200, bf16; d = 128: below).
/// Shared memory: K and V [BK][D + 8], two stages of Q and dO [BQ][D + 8], P and dS [BQ][BK + 8], all
/// 16-bit (d = 64: 107 KB, 96: 139 KB, 128: 170 KB, 256: 216 KB).
template <int D, bool Fused = false>
struct Fa2BackwardShape {
  static constexpr int dkdv_warps = 8;
  static constexpr int dkdv_block_k = D > 128 ? 64 : 128;  // owned keys
  // 64 rows at d = 128 too: 32 rows were measured 17-22% slower in the backward (H200); its registers are
  // kept below 255 by computing S one m16 tile of rows at a time (MSS).
  static constexpr int dkdv_block_q =  // streamed query rows per step
      64;
  static constexpr int pitch = D + 8;
  static constexpr int ps_pitch = dkdv_block_k + 8;  // P and dS rows [query][key]
  static constexpr int dkdv_stages = 2;
  static constexpr std::size_t dkdv_stage = 2u * dkdv_block_q * pitch * 2;  // Q, dO
  static constexpr std::size_t dkdv_ps = 2u * dkdv_block_q * ps_pitch * 2;  // P, dS
  static constexpr std::size_t dkdv_scratch = 2u * dkdv_block_k * pitch * 2 + dkdv_stages * dkdv_stage + dkdv_ps;
  static_assert((D / 16) % 2 == 0, "D/2 columns per dK/dV warp in pairs of n-tiles");
  static_assert(dkdv_block_q % 32 == 0, "query rows in m16 tiles, half of them per warp row");
  static_assert(dkdv_block_k % 64 == 0, "keys in m16 tiles per dK/dV warp row and n8 pairs per S warp column");
};

#if KFA_HAS_TENSOR_CORES
template <int D, bool Softcap, bool FuseDq, class Args>
struct TcFa2DkDvKernel {
  using QV = typename Args::q_type;
  using KV = typename Args::k_type;
  using VV = typename Args::v_type;
  using DOV = typename Args::do_type;
  using LV = typename Args::lse_type;
  using DV = typename Args::d_type;
  using DKV = typename Args::dk_type;
  using DVV = typename Args::dv_type;
  using T = typename QV::non_const_value_type;
  using Shape = Fa2BackwardShape<D, FuseDq>;
  static constexpr int WARPS = Shape::dkdv_warps, BK = Shape::dkdv_block_k, BQ = Shape::dkdv_block_q;
  static constexpr int P = Shape::pitch, PP = Shape::ps_pitch, NTH = 32 * WARPS;
  static constexpr int MIN_BLOCKS = 1;  // 8 warps, up to 255 registers each
  static constexpr int MS = BQ / 32;    // m16 tiles of query rows per warp (S, dP and dQ)
  static constexpr int KM = BK / 64;    // m16 tiles of keys per warp (dK, dV)
  static constexpr int SN = BK / 32;    // n8 tiles of keys per warp (S, dP)
  // m16 tiles of query rows per warp whose S = Q·Kᵀ is computed (and turned into P and dS) at a time: 1, not
  // MS = 2 for the whole step at once. With 2, S and dP take 64 registers next to dK and dV's 128 and the
  // d = 128 deterministic instance spilled 8 B at 255 registers (ptxas, CUDA 13.0, sm_90); with 1, 48, and no
  // instance spills on sm_80 to sm_90a, at the price of reading K's fragments twice per step.
  static constexpr int MSS = 1;  // m16 tiles of S per part (see step 1)
  static_assert(MSS >= 1 && MS % MSS == 0, "S parts divide the warp's m16 tiles");

  QV q;
  KV k;
  VV v;
  DOV d_o;
  LV lse;
  DV dd;
  DKV dk;
  DVV dv;
  float* dq_acc;
  int seq_q, seq_k, heads_kv, group;
  BlockOrder order;  // of the key blocks
  float scale;
  TcRecomputeConsts pc;
  KeyMask mask;

  TcFa2DkDvKernel(const Args& a, float* dq_acc_ = nullptr)
      : q(a.q),
        k(a.k),
        v(a.v),
        d_o(a.d_o),
        lse(a.lse),
        dd(a.dd),
        dk(a.dk),
        dv(a.dv),
        dq_acc(dq_acc_),
        seq_q(static_cast<int>(a.q.extent(1))),
        seq_k(static_cast<int>(a.k.extent(1))),
        heads_kv(static_cast<int>(a.k.extent(2))),
        group(static_cast<int>(a.q.extent(2) / a.k.extent(2))),
        order(key_block_order(a, BK)),
        scale(a.scale),
        pc(a.scale, a.softcap),
        mask(a.mask) {}

  /// The body of block `lr` (native_team_kernel), with Shape::dkdv_scratch bytes of shared memory at smem.
  __device__ void run(int lr, char* smem) const {
#if KFA_TC_DEVICE
    const int lane = threadIdx.x, warp = threadIdx.y, tid = warp * 32 + lane;
    const int g = lane >> 2, t4 = lane & 3, mi = lane >> 3, mr = lane & 7;
    const KeyBlock blk(lr, order, heads_kv, BK, seq_k);
    const int hk = blk.hk, b = blk.b, k0 = blk.k0, keys = blk.keys;
    if (keys <= 0) return;  // an empty block of a document-aligned launch (cuda/block_order.hpp)

    // V, K, two stages of (Q, dO), then P and dS.
    const std::uint32_t vs = tc::smem_addr(smem), ks = vs + BK * P * 2;
    const std::uint32_t stage0 = ks + BK * P * 2;
    const std::uint32_t ps = stage0 + 2 * static_cast<std::uint32_t>(Shape::dkdv_stage), dss = ps + BQ * PP * 2;
    char* ps_ptr = smem + (ps - vs);
    char* dss_ptr = smem + (dss - vs);

    KeyRule mask;  // the pass's: one per document the block's keys meet (one without documents)
    long qb0 = 0, qb1 = 0;
    int n_qt = 0;
    const long qstride = static_cast<long>(q.stride(1)), dostride = static_cast<long>(d_o.stride(1));
    const auto* qbase = q.data() + b * q.stride(0) + static_cast<long>(hk) * group * q.stride(2);
    const auto* dobase = d_o.data() + b * d_o.stride(0) + static_cast<long>(hk) * group * d_o.stride(2);
    // Steps run over the visible query tiles (fastest) of each query head of the group.
    auto issue = [&](int qt, int gh, int st) {
      const long i = qb0 + static_cast<long>(qt) * BQ;
      const int rows = static_cast<int>(qb1 - i < BQ ? qb1 - i : BQ);
      const std::uint32_t qs = stage0 + st * static_cast<std::uint32_t>(Shape::dkdv_stage), dos = qs + BQ * P * 2;
      tc::load_tile_async<D, BQ, NTH>(
          qs, reinterpret_cast<const std::uint16_t*>(qbase + i * qstride + gh * q.stride(2)), qstride, rows, tid);
      tc::load_tile_async<D, BQ, NTH>(
          dos, reinterpret_cast<const std::uint16_t*>(dobase + i * dostride + gh * d_o.stride(2)), dostride, rows, tid);
    };

    // dK/dV: warp owns keys kw0 … kw0 + BK/4 − 1 (KM m16 tiles) and columns cw0 … cw0 + D/2 − 1.
    constexpr int NB = D / 16;  // n8 tiles of D/2 columns
    const int kw0 = (warp >> 1) * (BK / 4), cw0 = (warp & 1) * (D / 2);
    float dka[KM][NB][4], dva[KM][NB][4];
#pragma unroll
    for (int mt = 0; mt < KM; ++mt)
#pragma unroll
      for (int n = 0; n < NB; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) dka[mt][n][e] = dva[mt][n][e] = 0.f;

    // S/dP: warp's query rows qw0 … qw0 + BQ/2 − 1 (MS m16 tiles), keys sw0 … sw0 + BK/4 − 1 (SN n8 tiles).
    const int qw0 = (warp >> 2) * (BQ / 2), sw0 = (warp & 3) * (BK / 4);
    // ldmatrix lane offsets. Row-major A (Q, dO, dS): matrices (rows +0, k +0), (+8, +0), (+0, +8), (+8, +8).
    const std::uint32_t a_lane = static_cast<std::uint32_t>((((mi & 1) * 8 + mr) * P + (mi >> 1) * 8) * 2);
    const std::uint32_t aps_lane = static_cast<std::uint32_t>((((mi & 1) * 8 + mr) * PP + (mi >> 1) * 8) * 2);
    // Row-major [n][k] as B (K, V in S = Q·Kᵀ): matrices (n +0, k +0), (n +0, k +8), (n +8, k +0), (n +8, k +8).
    const std::uint32_t b_lane = static_cast<std::uint32_t>((((mi >> 1) * 8 + mr) * P + (mi & 1) * 8) * 2);
    // Row-major [k][n] as B (dO, Q, K in the k-major products), transposed: (k +0, n +0), (k +8, n +0), ...
    const std::uint32_t bt_lane = static_cast<std::uint32_t>((((mi & 1) * 8 + mr) * P + (mi >> 1) * 8) * 2);
    // Pᵀ, dSᵀ as A from P, dS [query][key], transposed: matrix mi holds keys +8·(mi odd), queries +8·(mi ≥ 2).
    const std::uint32_t at_lane = static_cast<std::uint32_t>((((mi >> 1) * 8 + mr) * PP + (mi & 1) * 8) * 2);

    // K and V, with the first pass's first step. One pass per document the block's keys meet (one without
    // documents), dK and dV carried across; each pass starts its own pipeline (every stage is free between them).
    tc::load_tile_async<D, BK, NTH>(
        vs, reinterpret_cast<const std::uint16_t*>(v.data() + b * v.stride(0) + k0 * v.stride(1) + hk * v.stride(2)),
        static_cast<long>(v.stride(1)), keys, tid);
    tc::load_tile_async<D, BK, NTH>(
        ks, reinterpret_cast<const std::uint16_t*>(k.data() + b * k.stride(0) + k0 * k.stride(1) + hk * k.stride(2)),
        static_cast<long>(k.stride(1)), keys, tid);
    const DocumentSpan span = this->mask.documents_of_keys(k0, k0 + keys);
    for (int doc = span.first; doc < span.last; ++doc) {
      mask = this->mask.rule(doc);
      qb0 = mask.query_begin(k0);
      qb1 = mask.query_end(k0 + keys, seq_q);
      n_qt = qb1 > qb0 ? static_cast<int>((qb1 - qb0 + BQ - 1) / BQ) : 0;
      const int steps = n_qt * group;
      if (steps == 0) continue;
      issue(0, 0, 0);
      tc::cp_async_commit();
      int qt = 0, gh = 0;
      for (int step = 0; step < steps; ++step) {
        const long i0 = qb0 + static_cast<long>(qt) * BQ;
        const int rows = static_cast<int>(qb1 - i0 < BQ ? qb1 - i0 : BQ);
        const int hq = hk * group + gh;
        const int st = step & 1;
        // This warp's four rows' lse·log2(e) and D (rows past the tile: +inf and 0, so P = 0 there).
        float lse2[MS][2], ddr[MS][2];
#pragma unroll
        for (int mt = 0; mt < MS; ++mt)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int rr = qw0 + mt * 16 + g + r * 8;
            const bool in = rr < rows;
            lse2[mt][r] =
                in ? recompute_lse(static_cast<float>(lse(b, hq, i0 + rr))) * tc::log2e : compat::infinity<float>();
            ddr[mt][r] = in ? static_cast<float>(dd(b, hq, i0 + rr)) : 0.f;
          }
        if (step + 1 < steps) {
          if (qt + 1 < n_qt)
            issue(qt + 1, gh, st ^ 1);
          else
            issue(0, gh + 1, st ^ 1);
        }
        tc::cp_async_commit();
        tc::cp_async_wait_1();  // all but the group just issued
        __syncthreads();        // this step's Q and dO (and K, V) are in
        const std::uint32_t qs = stage0 + st * static_cast<std::uint32_t>(Shape::dkdv_stage), dos = qs + BQ * P * 2;

        // 1. dP = dO·Vᵀ, then S = Q·Kᵀ (dP first: P and dS then come out of one pass, with no softcap
        //    factor held across a product). S is computed MSS m-tiles at a time, each part followed by its
        //    P/dS pass (MSS < MS: fewer registers at the peak, K's fragments read once per part).
        float dp[MS][SN][4];
#pragma unroll
        for (int mt = 0; mt < MS; ++mt)
#pragma unroll
          for (int n = 0; n < SN; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) dp[mt][n][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          std::uint32_t af[MS][4];
#pragma unroll
          for (int mt = 0; mt < MS; ++mt)
            tc::ldmatrix_x4(af[mt], dos + a_lane + static_cast<std::uint32_t>(((qw0 + mt * 16) * P + kk * 16) * 2));
#pragma unroll
          for (int n = 0; n < SN; n += 2) {
            std::uint32_t bf[4];
            tc::ldmatrix_x4(bf, vs + b_lane + static_cast<std::uint32_t>(((sw0 + n * 8) * P + kk * 16) * 2));
#pragma unroll
            for (int mt = 0; mt < MS; ++mt) {
              tc::mma<T>(dp[mt][n], af[mt], bf[0], bf[1]);
              tc::mma<T>(dp[mt][n + 1], af[mt], bf[2], bf[3]);
            }
          }
        }
        const bool masked_tile = rows < BQ || keys < BK || !mask.all_visible(i0, i0 + BQ, k0, k0 + BK);
#pragma unroll
        for (int m0 = 0; m0 < MS; m0 += MSS) {
          float s[MSS][SN][4];
#pragma unroll
          for (int mt = 0; mt < MSS; ++mt)
#pragma unroll
            for (int n = 0; n < SN; ++n)
#pragma unroll
              for (int e = 0; e < 4; ++e) s[mt][n][e] = 0.f;
#pragma unroll
          for (int kk = 0; kk < D / 16; ++kk) {
            std::uint32_t af[MSS][4];
#pragma unroll
            for (int mt = 0; mt < MSS; ++mt)
              tc::ldmatrix_x4(af[mt],
                              qs + a_lane + static_cast<std::uint32_t>(((qw0 + (m0 + mt) * 16) * P + kk * 16) * 2));
#pragma unroll
            for (int n = 0; n < SN; n += 2) {
              std::uint32_t bf[4];
              tc::ldmatrix_x4(bf, ks + b_lane + static_cast<std::uint32_t>(((sw0 + n * 8) * P + kk * 16) * 2));
#pragma unroll
              for (int mt = 0; mt < MSS; ++mt) {
                tc::mma<T>(s[mt][n], af[mt], bf[0], bf[1]);
                tc::mma<T>(s[mt][n + 1], af[mt], bf[2], bf[3]);
              }
            }
          }
          // P and dS of these m-tiles into shared memory, [query][key], 16-bit. Masked tiles take a second copy
          // of the pass, in which each row's visible keys are one range of the tile (the common tile tests
          // nothing per element).
          auto p_ds_pass = [&](auto masked) {
            constexpr bool Masked = decltype(masked)::value;
#pragma unroll
            for (int mt = 0; mt < MSS; ++mt)
#pragma unroll
              for (int r = 0; r < 2; ++r) {
                const int rr = qw0 + (m0 + mt) * 16 + g + r * 8;
                int lo = 0, hi = BK - 1;  // visible keys of the row, tile-local
                if (Masked) {
                  long first, last;
                  mask.visible_range(i0 + rr, first, last);
                  lo = static_cast<int>(first - k0 < 0 ? 0 : (first - k0 > BK ? BK : first - k0));
                  hi = static_cast<int>(last - k0 < -1 ? -1 : (last - k0 > BK - 1 ? BK - 1 : last - k0));
                  if (rr >= rows) hi = -1;
                }
#pragma unroll
                for (int n = 0; n < SN; ++n) {
                  const int kk0 = sw0 + n * 8 + 2 * t4;
                  float p[2], d2[2];
#pragma unroll
                  for (int e = 0; e < 2; ++e) {
                    const bool vis = !Masked || (kk0 + e >= lo && kk0 + e <= hi);
                    float dcap;
                    p[e] = tc_recompute_p<Softcap>(s[mt][n][2 * r + e], pc, lse2[m0 + mt][r], vis, dcap);
                    d2[e] = p[e] * (dp[m0 + mt][n][2 * r + e] - ddr[m0 + mt][r]) * dcap;
                  }
                  const int off = (rr * PP + kk0) * 2;
                  *reinterpret_cast<std::uint32_t*>(ps_ptr + off) = cuda16<T>::pack(p[0], p[1]);
                  *reinterpret_cast<std::uint32_t*>(dss_ptr + off) = cuda16<T>::pack(d2[0], d2[1]);
                }
              }
          };
          if (masked_tile)
            p_ds_pass(std::true_type{});
          else
            p_ds_pass(std::false_type{});
        }
        __syncthreads();  // every warp's P and dS are in

        // 2. dV += Pᵀ·dO, dK += dSᵀ·Q over this step's BQ queries.
#pragma unroll
        for (int kk = 0; kk < BQ / 16; ++kk) {
          std::uint32_t pa[KM][4], da[KM][4];
#pragma unroll
          for (int mt = 0; mt < KM; ++mt) {
            const std::uint32_t o = static_cast<std::uint32_t>((kk * 16 * PP + kw0 + mt * 16) * 2);
            tc::ldmatrix_x4_trans(pa[mt], ps + at_lane + o);
            tc::ldmatrix_x4_trans(da[mt], dss + at_lane + o);
          }
#pragma unroll
          for (int n = 0; n < NB; n += 2) {
            const std::uint32_t o = static_cast<std::uint32_t>((kk * 16 * P + cw0 + n * 8) * 2);
            std::uint32_t bo[4], bq[4];
            tc::ldmatrix_x4_trans(bo, dos + bt_lane + o);
            tc::ldmatrix_x4_trans(bq, qs + bt_lane + o);
#pragma unroll
            for (int mt = 0; mt < KM; ++mt) {
              tc::mma<T>(dva[mt][n], pa[mt], bo[0], bo[1]);
              tc::mma<T>(dva[mt][n + 1], pa[mt], bo[2], bo[3]);
              tc::mma<T>(dka[mt][n], da[mt], bq[0], bq[1]);
              tc::mma<T>(dka[mt][n + 1], da[mt], bq[2], bq[3]);
            }
          }
        }
        // 3. dQ += dS·K (unscaled), atomically.
        if constexpr (FuseDq) accumulate_dq(dss, aps_lane, ks, bt_lane, b, hq, i0, rows, warp, lane);
        __syncthreads();  // every warp is done with this stage and with P, dS before they are refilled
        if (++qt == n_qt) qt = 0, ++gh;
      }
    }
    tc::cp_async_wait_all();

#pragma unroll
    for (int mt = 0; mt < KM; ++mt) {
      const int r0 = k0 + kw0 + mt * 16 + g, r1 = r0 + 8;
      tc::store_c_rows<D / 2, T>(dka[mt], scale, scale, r0 < k0 + keys ? &dk(b, r0, hk, cw0) : nullptr,
                                 r1 < k0 + keys ? &dk(b, r1, hk, cw0) : nullptr, t4);
      tc::store_c_rows<D / 2, T>(dva[mt], 1.f, 1.f, r0 < k0 + keys ? &dv(b, r0, hk, cw0) : nullptr,
                                 r1 < k0 + keys ? &dv(b, r1, hk, cw0) : nullptr, t4);
    }
#else
    (void)lr, (void)smem;
#if defined(__CUDA_ARCH__)
    __trap();  // not reachable: the launcher checks the device's compute capability first
#endif
#endif
  }

#if KFA_TC_DEVICE
  /// dq_acc[b][i0 + r][hq][c] += Σ_key dS[r][key] · K[key][c]: warp w takes query rows (BQ/2)·(w / 4) … (MS
  /// m16 tiles) and columns (w % 4)·D/4 … (D/32 n-tiles; an odd last one takes a two-matrix ldmatrix).
  __device__ __forceinline__ void accumulate_dq(std::uint32_t dss, std::uint32_t aps_lane, std::uint32_t ks,
                                                std::uint32_t bt_lane, int b, int hq, long i0, int rows, int warp,
                                                int lane) const {
    constexpr int DN = D / 4, NC = DN / 8;
    const int g = lane >> 2, t4 = lane & 3;
    const int qw0 = (warp >> 2) * (BQ / 2), cw0 = (warp & 3) * DN;
    float acc[MS][NC][4];
#pragma unroll
    for (int mt = 0; mt < MS; ++mt)
#pragma unroll
      for (int n = 0; n < NC; ++n) acc[mt][n][0] = acc[mt][n][1] = acc[mt][n][2] = acc[mt][n][3] = 0.f;
        // Not unrolled at d = 256: unrolled, the fused d = 256 instances spilled 4 B (ptxas, CUDA 13.0, sm_80/86).
#pragma unroll(D > 128 ? 1 : BK / 16)
    for (int kk = 0; kk < BK / 16; ++kk) {
      std::uint32_t a[MS][4];
#pragma unroll
      for (int mt = 0; mt < MS; ++mt)
        tc::ldmatrix_x4(a[mt], dss + aps_lane + static_cast<std::uint32_t>(((qw0 + mt * 16) * PP + kk * 16) * 2));
#pragma unroll
      for (int n = 0; n + 1 < NC; n += 2) {
        std::uint32_t bf[4];
        tc::ldmatrix_x4_trans(bf, ks + bt_lane + static_cast<std::uint32_t>((kk * 16 * P + cw0 + n * 8) * 2));
#pragma unroll
        for (int mt = 0; mt < MS; ++mt) {
          tc::mma<T>(acc[mt][n], a[mt], bf[0], bf[1]);
          tc::mma<T>(acc[mt][n + 1], a[mt], bf[2], bf[3]);
        }
      }
      if constexpr (NC % 2 == 1) {  // matrices 0 and 1 of the x4 layout: keys +0 and +8 of one n-tile
        std::uint32_t bf[2];
        tc::ldmatrix_x2_trans(bf, ks + bt_lane + static_cast<std::uint32_t>((kk * 16 * P + cw0 + (NC - 1) * 8) * 2));
#pragma unroll
        for (int mt = 0; mt < MS; ++mt) tc::mma<T>(acc[mt][NC - 1], a[mt], bf[0], bf[1]);
      }
    }
    const long heads_q = static_cast<long>(heads_kv) * group;
#pragma unroll
    for (int mt = 0; mt < MS; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = qw0 + mt * 16 + g + h * 8;
        if (r >= rows) continue;
        float* dst = dq_acc + ((static_cast<long>(b) * seq_q + i0 + r) * heads_q + hq) * D + cw0 + 2 * t4;
#pragma unroll
        for (int n = 0; n < NC; ++n) {
#if __CUDA_ARCH__ >= 900
          atomicAdd(reinterpret_cast<float2*>(dst + n * 8), make_float2(acc[mt][n][2 * h], acc[mt][n][2 * h + 1]));
#else
          atomicAdd(dst + n * 8, acc[mt][n][2 * h]);
          atomicAdd(dst + n * 8 + 1, acc[mt][n][2 * h + 1]);
#endif
        }
      }
  }
#endif
};
#endif

}  // namespace detail
}  // namespace kfa
