#pragma once
/// simt/backward.hpp: the simt family's backward kernels (dK/dV and dQ).
/// The fp32 backward tuned for CUDA (SIMT, no tensor cores): the same two launches as portable/backward.hpp
/// (D = rowsum(dO ∘ O) is the caller's; no atomics, so results are bitwise reproducible), laid out for the
/// SIMT units the way simt/forward.hpp lays out the forward:
///
///   dK/dV (one team per batch, kv head, block of BK keys): each thread owns R = 2 key rows and a slice of
///     HD = 16 head dims of them (D / 16 lanes share a row), with K, V, dK and dV of its slice in
///     registers (4 · R · HD = 128 floats). Q and dO tiles with their lse and D stream through two stages
///     of level-0 scratch with cp.async (tile t + 1 lands while tile t is used). For each query row all
///     lanes read the same scratch row: s = q·k and dp = dO·v as partial dots summed over the row's lanes
///     with shuffles, then P = exp(softcap(scale·s) − lse), dS = P ∘ (dP − D) ∘ softcap', and
///     dV += P·dO, dK += dS·q on the slice. Every query head of the GQA group and only the query rows the
///     mask lets see the block; dK is written times scale (Q is not pre-scaled here).
///   dQ (one team per batch, query head, block of BQ queries): the mirror image, Q, dO, dQ in registers
///     with each row's lse and D, K and V tiles streamed; dQ += dS·k, written times scale.
///
/// Why this shape: per streamed row a thread loads 2 · HD floats (8 LDS.128, each a broadcast that the
/// H lanes of a warp take from one 128-byte line: a thread's slice is interleaved, dims 4·(part + H·m)
/// for m < HD / 4, so no padding is needed) and does 4 · R · HD = 128 FFMAs in dK/dV (96 in dQ), i.e.
/// 16 (12) FFMAs per scratch load, twice the forward's 8; the 4 · log2 H shuffles per row that sum the
/// four dots (7 where reduce-scattered, see reduce_p_ds) are the other MIO traffic. Owning more rows per
/// thread would cut loads further but needs more than 255 registers (dK/dV already takes 240).
#include <kfa/detail/common/recompute.hpp>  // recompute_lse
#include <kfa/detail/cuda/mma.hpp>          // QueryBlock
#include <kfa/detail/mask.hpp>
#include <kfa/error.hpp>
#include <kfa/tiling.hpp>

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace kfa {
namespace detail {

// The launch bounds and loop forms of the two kernels below, measured on an H200 (batch 2, 16 heads,
// N = 8192, each variant timed twice, repeatable to <1%): dK/dV runs 2 teams per SM, one streamed row per
// unrolled body (U) and plain shuffle sums; dQ runs 3 teams per SM, two streamed rows per unrolled body (ILP
// across a row's shuffle chain) and the four dots of a row reduce-scattered over its lanes (fewer shuffles;
// see reduce_p_ds). At d = 128 dK/dV took 96.8 ms with the plain shuffle sums and no unrolling vs 98.9
// unrolled by 2 and 105.2 reduce-scattered; dQ 61.6 ms with 3 teams per SM (168 registers, no spills),
// unrolled by 2 and reduce-scattered vs 77.0 with 2 teams per SM. dK/dV at 3 teams per SM spills (124 B at
// 168 registers).

/// Tiles of the CUDA fp32 backward per head dim (64 or 128): owned rows (keys for dK/dV, queries for dQ)
/// per team and streamed rows per scratch stage, threads, and level-0 scratch per team.
template <int D>
struct SimtBackwardShape {
  static_assert(D == 64 || D == 128, "the fp32 backward exists for head dims 64 and 128");
  static constexpr int threads = 128;
  static constexpr int rows_per_thread = 2;                                      // owned rows per thread
  static constexpr int slice = 16;                                               // head dims per thread
  static constexpr int lanes_per_row = D / slice;                                // 8 at d = 128, 4 at d = 64
  static constexpr int block_owned = threads / lanes_per_row * rows_per_thread;  // 32 / 64
  static constexpr int block_streamed = 2048 / D;                                // 16 / 32: 8 KiB per streamed tile
  static constexpr int stages = 2;
  static constexpr int dkdv_block_k = block_owned, dkdv_block_q = block_streamed;
  static constexpr int dq_block_q = block_owned, dq_block_k = block_streamed;
  // dK/dV stage: Q[bq][D], dO[bq][D], lse[bq], D[bq]; dQ stage: K[bk][D], V[bk][D] (floats, dense rows)
  static constexpr std::size_t dkdv_stage_floats = 2u * block_streamed * D + 2u * block_streamed;
  static constexpr std::size_t dq_stage_floats = 2u * block_streamed * D;
  static constexpr std::size_t dkdv_scratch = stages * dkdv_stage_floats * 4;  // 33,024 B
  static constexpr std::size_t dq_scratch = stages * dq_stage_floats * 4;      // 32,768 B
};

#if defined(__CUDA_ARCH__)
namespace simt_bwd {

__device__ __forceinline__ std::uint32_t smem_addr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}
/// 16 (4) bytes global → shared; `ok` false writes zeros and reads nothing.
__device__ __forceinline__ void cp16(std::uint32_t dst, const void* src, bool ok) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0));
}
__device__ __forceinline__ void cp4(std::uint32_t dst, const void* src, bool ok) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 4 : 0));
}
__device__ __forceinline__ void commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
__device__ __forceinline__ void wait_all() {
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

/// N rows of D floats (row r at src + r·stride) into a dense [N][D] tile at dst; rows ≥ valid zeroed.
template <int D, int N, int THREADS>
__device__ __forceinline__ void load_rows(std::uint32_t dst, const float* src, long stride, int valid, int tid) {
  constexpr int chunks = D / 4;
  static_assert(N * chunks % THREADS == 0, "whole copies per thread");
#pragma unroll
  for (int n = 0; n < N * chunks / THREADS; ++n) {
    const int c = tid + n * THREADS;
    const int r = c / chunks, x = (c % chunks) * 4;
    const bool ok = r < valid;
    cp16(dst + static_cast<std::uint32_t>((r * D + x) * 4), src + (ok ? r * stride : 0) + x, ok);
  }
}

/// Sum over the H consecutive lanes that share a row; every lane gets the same bits (xor butterfly).
template <int H>
__device__ __forceinline__ float row_sum(float x) {
#pragma unroll
  for (int w = 1; w < H; w *= 2) x += __shfl_xor_sync(0xffffffffu, x, w);
  return x;
}

/// A thread's slice of a row: chunk m holds dims 4·(part + H·m) … + 3, so the H lanes of a row read
/// one contiguous 16·H-byte span per chunk (no bank conflicts without padding).
template <int H, int C>
__device__ __forceinline__ void load_slice(float4 (&x)[C], const float* row, int part) {
#pragma unroll
  for (int m = 0; m < C; ++m) x[m] = *reinterpret_cast<const float4*>(row + 4 * (part + H * m));
}
template <int H, int C>
__device__ __forceinline__ void load_slice_global(float (&x)[4 * C], const float* row, int part) {
#pragma unroll
  for (int m = 0; m < C; ++m) {
    const float4 v = row ? *reinterpret_cast<const float4*>(row + 4 * (part + H * m)) : make_float4(0.f, 0.f, 0.f, 0.f);
    x[4 * m] = v.x, x[4 * m + 1] = v.y, x[4 * m + 2] = v.z, x[4 * m + 3] = v.w;
  }
}
template <int H, int C>
__device__ __forceinline__ void store_slice_global(float* row, const float (&x)[4 * C], float mul, int part) {
#pragma unroll
  for (int m = 0; m < C; ++m)
    *reinterpret_cast<float4*>(row + 4 * (part + H * m)) =
        make_float4(x[4 * m] * mul, x[4 * m + 1] * mul, x[4 * m + 2] * mul, x[4 * m + 3] * mul);
}

/// Partial dot of a register slice with a scratch slice (two chains for latency).
template <int C>
__device__ __forceinline__ float dot(const float (&a)[4 * C], const float4 (&x)[C]) {
  float s0 = 0.f, s1 = 0.f;
#pragma unroll
  for (int m = 0; m < C; ++m) {
    s0 += a[4 * m] * x[m].x;
    s1 += a[4 * m + 1] * x[m].y;
    s0 += a[4 * m + 2] * x[m].z;
    s1 += a[4 * m + 3] * x[m].w;
  }
  return s0 + s1;
}
template <int C>
__device__ __forceinline__ void axpy(float (&acc)[4 * C], float a, const float4 (&x)[C]) {
#pragma unroll
  for (int m = 0; m < C; ++m) {
    acc[4 * m] += a * x[m].x;
    acc[4 * m + 1] += a * x[m].y;
    acc[4 * m + 2] += a * x[m].z;
    acc[4 * m + 3] += a * x[m].w;
  }
}

/// P and dS of one (query, key) pair from the summed dots: x = softcap(scale·s), P = exp(x − lse) (0 where
/// the key is not visible), dS = P·(dp − D)·(1 − tanh²) (factor 1 without softcap).
__device__ __forceinline__ void p_and_ds(float s, float dp, float scale, float softcap, float inv_cap, float l,
                                         float dval, bool visible, float& p, float& ds) {
  float x = s * scale, dcap = 1.f;
  if (softcap > 0.f) {
    const float th = tanhf(x * inv_cap);
    x = softcap * th;
    dcap = 1.f - th * th;
  }
  p = visible ? __expf(x - l) : 0.f;
  ds = p * (dp - dval) * dcap;
}

/// The two owned rows' dots s[r] = q·k_r and dp[r] = dO·v_r, summed over the H lanes of the rows, turned
/// into P and dS by f(r, s, dp, p, ds); p[r], ds[r] end the same in every lane of the row.
/// With Split the four sums are reduce-scattered (the lane bit H/2 picks the row,
/// bit H/4 the dot), so each lane computes one row's P and dS and swaps with its partner: 2 + log2(H) + 2
/// shuffles (7 at H = 8) instead of 4·log2(H) (12), and half the exps.
template <int H, bool Split, class F>
__device__ __forceinline__ void reduce_p_ds(const float (&s)[2], const float (&dp)[2], int part, const F& f,
                                            float (&p)[2], float (&ds)[2]) {
  if constexpr (Split) {
    static_assert(H >= 4, "two rows, two dots: at least four lanes per row");
    const int hr = (part & (H / 2)) ? 1 : 0;
    const bool hk = (part & (H / 4)) != 0;
    float k0 = hr ? s[1] : s[0], k1 = hr ? dp[1] : dp[0];
    const float g0 = hr ? s[0] : s[1], g1 = hr ? dp[0] : dp[1];
    k0 += __shfl_xor_sync(0xffffffffu, g0, H / 2);
    k1 += __shfl_xor_sync(0xffffffffu, g1, H / 2);
    float kk = hk ? k1 : k0;
    kk += __shfl_xor_sync(0xffffffffu, hk ? k0 : k1, H / 4);
#pragma unroll
    for (int w = H / 8; w > 0; w /= 2) kk += __shfl_xor_sync(0xffffffffu, kk, w);
    const float other = __shfl_xor_sync(0xffffffffu, kk, H / 4);
    float pp, gg;
    f(hr, hk ? other : kk, hk ? kk : other, pp, gg);
    const float po = __shfl_xor_sync(0xffffffffu, pp, H / 2), go = __shfl_xor_sync(0xffffffffu, gg, H / 2);
    p[0] = hr ? po : pp, p[1] = hr ? pp : po;
    ds[0] = hr ? go : gg, ds[1] = hr ? gg : go;
  } else {
    (void)part;
#pragma unroll
    for (int r = 0; r < 2; ++r) f(r, row_sum<H>(s[r]), row_sum<H>(dp[r]), p[r], ds[r]);
  }
}

}  // namespace simt_bwd
#endif

#if defined(KOKKOS_ENABLE_CUDA)
/// dK and dV of one key block per team (see the top of this file).
template <int D, class Args>
struct SimtDkDvKernel {
  using QV = typename Args::q_type;
  using KV = typename Args::k_type;
  using VV = typename Args::v_type;
  using DOV = typename Args::do_type;
  using LV = typename Args::lse_type;
  using DV = typename Args::d_type;
  using DKV = typename Args::dk_type;
  using DVV = typename Args::dv_type;
  using Shape = SimtBackwardShape<D>;
  static constexpr int H = Shape::lanes_per_row, R = Shape::rows_per_thread, HD = Shape::slice, C = HD / 4,
                       BK = Shape::dkdv_block_k, BQ = Shape::dkdv_block_q, T = Shape::threads;
  static constexpr int STAGE = static_cast<int>(Shape::dkdv_stage_floats);
  static constexpr int U = 1;
  static_assert(R == 2, "reduce_p_ds pairs two owned rows");
  using policy_type = Kokkos::TeamPolicy<Kokkos::Cuda, Kokkos::LaunchBounds<Shape::threads, 2>>;
  using member_type = typename policy_type::member_type;

  QV q;
  KV k;
  VV v;
  DOV d_o;
  LV lse;
  DV dd;
  DKV dk;
  DVV dv;
  int seq_q, seq_k, heads_kv, group;
  BlockOrder order;  // of the key blocks
  float scale, softcap;
  KeyMask mask;

  explicit SimtDkDvKernel(const Args& a)
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
        group(a.k.extent(2) > 0 ? static_cast<int>(a.q.extent(2) / a.k.extent(2)) : 0),
        order(key_block_order(a, BK)),
        scale(a.scale),
        softcap(a.softcap),
        mask(a.mask) {}

  KOKKOS_FUNCTION void operator()(const member_type& team) const {
#if defined(__CUDA_ARCH__)
    using namespace simt_bwd;
    const int tid = threadIdx.y * 32 + threadIdx.x;
    const int grp = tid / H, part = tid % H;
    const int lr = team.league_rank();
    // Key block 0 first: under a causal mask the first keys are seen by the most queries.
    const KeyBlock blk(lr, order, heads_kv, BK, seq_k);
    const int hk = blk.hk, b = blk.b, k0 = blk.k0, keys = blk.keys;
    if (keys <= 0) return;  // an empty block of a document-aligned launch (cuda/block_order.hpp)

    float* smem = static_cast<float*>(team.team_scratch(0).get_shmem(static_cast<std::size_t>(Shape::dkdv_scratch)));
    const std::uint32_t sbase = smem_addr(smem);

    KeyRule mask;  // the pass's: one per document the block's keys meet (one without documents)
    long qb0 = 0, qb1 = 0;
    int n_qt = 0;
    const long qs1 = static_cast<long>(q.stride(1)), os1 = static_cast<long>(d_o.stride(1));
    // Step `step` of the pass (query head step / n_qt, query tile step % n_qt) into stage st.
    auto issue = [&](int step, int st) {
      const int hq = hk * group + step / n_qt;
      const long i = qb0 + static_cast<long>(step % n_qt) * BQ;
      const int rows = qb1 - i < BQ ? static_cast<int>(qb1 - i) : BQ;
      const std::uint32_t dst = sbase + static_cast<std::uint32_t>(st * STAGE * 4);
      load_rows<D, BQ, T>(dst, q.data() + b * q.stride(0) + i * qs1 + hq * q.stride(2), qs1, rows, tid);
      load_rows<D, BQ, T>(dst + BQ * D * 4, d_o.data() + b * d_o.stride(0) + i * os1 + hq * d_o.stride(2), os1, rows,
                          tid);
      if (tid < BQ) {
        const bool ok = tid < rows;
        const long ii = i + (ok ? tid : 0);
        cp4(dst + static_cast<std::uint32_t>((2 * BQ * D + tid) * 4), &lse(b, hq, ii), ok);
        cp4(dst + static_cast<std::uint32_t>((2 * BQ * D + BQ + tid) * 4), &dd(b, hq, ii), ok);
      }
    };

    int krow[R];  // this thread's key rows within the block
    float kr[R][HD], vr[R][HD], dka[R][HD], dva[R][HD];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      krow[r] = grp + r * (BK / R);
      const bool in = krow[r] < keys;
      load_slice_global<H, C>(kr[r], in ? &k(b, k0 + krow[r], hk, 0) : nullptr, part);
      load_slice_global<H, C>(vr[r], in ? &v(b, k0 + krow[r], hk, 0) : nullptr, part);
#pragma unroll
      for (int c = 0; c < HD; ++c) dka[r][c] = dva[r][c] = 0.f;
    }
    const float inv_cap = softcap > 0.f ? 1.f / softcap : 0.f;

    // One pass per document the block's keys meet (one without documents), dK and dV carried across; step t of
    // all passes is in stage t & 1 (a step ends with no barrier: the next pass starts in the other stage).
    int t = 0;
    const DocumentSpan span = this->mask.documents_of_keys(k0, k0 + keys);
    for (int doc = span.first; doc < span.last; ++doc) {
      mask = this->mask.rule(doc);
      qb0 = mask.query_begin(k0);
      qb1 = mask.query_end(k0 + keys, seq_q);
      n_qt = qb1 > qb0 ? static_cast<int>((qb1 - qb0 + BQ - 1) / BQ) : 0;
      const int steps = n_qt * group;
      if (steps == 0) continue;
      issue(0, t & 1);
      commit();
      for (int step = 0; step < steps; ++step, ++t) {
        wait_all();
        __syncthreads();  // this step's stage is in; every thread is done with the other stage
        if (step + 1 < steps) issue(step + 1, (t + 1) & 1);
        commit();
        const long i0 = qb0 + static_cast<long>(step % n_qt) * BQ;
        const int rows = qb1 - i0 < BQ ? static_cast<int>(qb1 - i0) : BQ;
        const float* qs = smem + (t & 1) * STAGE;
        const float* os = qs + BQ * D;
        const float* ls = qs + 2 * BQ * D;
        const float* ds_ = ls + BQ;
        const bool need_mask = !mask.all_visible(i0, i0 + rows, k0, k0 + keys);
#pragma unroll U
        for (int ii = 0; ii < rows; ++ii) {
          float4 qx[C], ox[C];
          load_slice<H, C>(qx, qs + ii * D, part);
          load_slice<H, C>(ox, os + ii * D, part);
          float s[R], dp[R], p[R], g[R];
#pragma unroll
          for (int r = 0; r < R; ++r) s[r] = dot<C>(kr[r], qx), dp[r] = dot<C>(vr[r], ox);
          const float l = recompute_lse(ls[ii]), dval = ds_[ii];
          long first = 0, last = -1;
          if (need_mask) mask.visible_range(i0 + ii, first, last);
          reduce_p_ds<H, false>(
              s, dp, part,
              [&](int r, float sr, float dpr, float& pr, float& gr) {
                const long j = k0 + (r ? krow[1] : krow[0]);
                p_and_ds(sr, dpr, scale, softcap, inv_cap, l, dval, !need_mask || (j >= first && j <= last), pr, gr);
              },
              p, g);
#pragma unroll
          for (int r = 0; r < R; ++r) {
            axpy<C>(dva[r], p[r], ox);
            axpy<C>(dka[r], g[r], qx);
          }
        }
      }
    }
    wait_all();
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (krow[r] >= keys) continue;
      store_slice_global<H, C>(&dk(b, k0 + krow[r], hk, 0), dka[r], scale, part);
      store_slice_global<H, C>(&dv(b, k0 + krow[r], hk, 0), dva[r], 1.f, part);
    }
#else
    (void)team;
#endif
  }
};

/// dQ of one query block per team (see the top of this file).
template <int D, class Args>
struct SimtDqKernel {
  using QV = typename Args::q_type;
  using KV = typename Args::k_type;
  using VV = typename Args::v_type;
  using DOV = typename Args::do_type;
  using LV = typename Args::lse_type;
  using DV = typename Args::d_type;
  using DQV = typename Args::dq_type;
  using Shape = SimtBackwardShape<D>;
  static constexpr int H = Shape::lanes_per_row, R = Shape::rows_per_thread, HD = Shape::slice, C = HD / 4,
                       BQ = Shape::dq_block_q, BK = Shape::dq_block_k, T = Shape::threads;
  static constexpr int STAGE = static_cast<int>(Shape::dq_stage_floats);
  static constexpr int U = 2;
  static_assert(R == 2, "reduce_p_ds pairs two owned rows");
  using policy_type = Kokkos::TeamPolicy<Kokkos::Cuda, Kokkos::LaunchBounds<Shape::threads, 3>>;
  using member_type = typename policy_type::member_type;

  QV q;
  KV k;
  VV v;
  DOV d_o;
  LV lse;
  DV dd;
  DQV dq;
  int seq_q, heads_q, group;
  BlockOrder order;  // of the query blocks
  float scale, softcap;
  KeyMask mask;

  explicit SimtDqKernel(const Args& a)
      : q(a.q),
        k(a.k),
        v(a.v),
        d_o(a.d_o),
        lse(a.lse),
        dd(a.dd),
        dq(a.dq),
        seq_q(static_cast<int>(a.q.extent(1))),
        heads_q(static_cast<int>(a.q.extent(2))),
        group(a.k.extent(2) > 0 ? static_cast<int>(a.q.extent(2) / a.k.extent(2)) : 1),
        order(query_block_order(a, BQ)),
        scale(a.scale),
        softcap(a.softcap),
        mask(a.mask) {}

  KOKKOS_FUNCTION void operator()(const member_type& team) const {
#if defined(__CUDA_ARCH__)
    using namespace simt_bwd;
    const int tid = threadIdx.y * 32 + threadIdx.x;
    const int grp = tid / H, part = tid % H;
    const QueryBlock blk(team.league_rank(), order, heads_q, group, BQ, seq_q);
    const int b = blk.b, h = blk.h, hk = blk.hk, i0 = blk.i0, rows = blk.rows;
    if (rows <= 0) return;          // an empty block of a document-aligned launch (cuda/block_order.hpp)
    const int row_end = i0 + rows;  // rows past it are another block's (or past seq_q)

    float* smem = static_cast<float*>(team.team_scratch(0).get_shmem(static_cast<std::size_t>(Shape::dq_scratch)));
    const std::uint32_t sbase = smem_addr(smem);
    const float* kbase = k.data() + b * k.stride(0) + hk * k.stride(2);
    const float* vbase = v.data() + b * v.stride(0) + hk * v.stride(2);
    const long ks1 = static_cast<long>(k.stride(1)), vs1 = static_cast<long>(v.stride(1));

    KeyRule mask;  // the pass's: one per document the block's rows meet (one without documents)
    long j_begin = 0, j_end = 0;
    int n_kt = 0;
    auto issue = [&](int t, int st) {  // the pass's tile t into stage st
      const long j = j_begin + static_cast<long>(t) * BK;
      const int cols = j_end - j < BK ? static_cast<int>(j_end - j) : BK;
      const std::uint32_t dst = sbase + static_cast<std::uint32_t>(st * STAGE * 4);
      load_rows<D, BK, T>(dst, kbase + j * ks1, ks1, cols, tid);
      load_rows<D, BK, T>(dst + BK * D * 4, vbase + j * vs1, vs1, cols, tid);
    };

    int row[R];
    float qr[R][HD], orr[R][HD], dqa[R][HD], l[R], dval[R];
    long first[R], last[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      row[r] = i0 + grp + r * (BQ / R);
      const bool in = row[r] < row_end;
      load_slice_global<H, C>(qr[r], in ? &q(b, row[r], h, 0) : nullptr, part);
      load_slice_global<H, C>(orr[r], in ? &d_o(b, row[r], h, 0) : nullptr, part);
      l[r] = in ? recompute_lse(static_cast<float>(lse(b, h, row[r]))) : compat::infinity<float>();
      dval[r] = in ? static_cast<float>(dd(b, h, row[r])) : 0.f;
#pragma unroll
      for (int c = 0; c < HD; ++c) dqa[r][c] = 0.f;
    }
    const float inv_cap = softcap > 0.f ? 1.f / softcap : 0.f;

    // One pass per document the block's rows meet (one without documents), dQ carried across; tile u of all
    // passes is in stage u & 1 (a tile ends with no barrier: the next pass starts in the other stage).
    int u = 0;
    const DocumentSpan span = this->mask.documents_of_rows(i0, i0 + rows);
    for (int doc = span.first; doc < span.last; ++doc) {
      mask = this->mask.rule(doc);
      j_begin = mask.key_begin(i0);
      j_end = mask.key_end(i0 + rows);
      n_kt = j_end > j_begin ? static_cast<int>((j_end - j_begin + BK - 1) / BK) : 0;
      if (n_kt == 0) continue;
#pragma unroll
      for (int r = 0; r < R; ++r) mask.visible_range(row[r], first[r], last[r]);
      issue(0, u & 1);
      commit();
      for (int t = 0; t < n_kt; ++t, ++u) {
        wait_all();
        __syncthreads();  // tile t is in; every thread is done with tile t − 1's stage
        if (t + 1 < n_kt) issue(t + 1, (u + 1) & 1);
        commit();
        const long j0 = j_begin + static_cast<long>(t) * BK;
        const int cols = j_end - j0 < BK ? static_cast<int>(j_end - j0) : BK;
        const float* ks = smem + (u & 1) * STAGE;
        const float* vs = ks + BK * D;
        const bool need_mask = !mask.all_visible(i0, i0 + rows, j0, j0 + cols);
#pragma unroll U
        for (int jj = 0; jj < cols; ++jj) {
          float4 kx[C], vx[C];
          load_slice<H, C>(kx, ks + jj * D, part);
          load_slice<H, C>(vx, vs + jj * D, part);
          float s[R], dp[R], p[R], g[R];
#pragma unroll
          for (int r = 0; r < R; ++r) s[r] = dot<C>(qr[r], kx), dp[r] = dot<C>(orr[r], vx);
          const long j = j0 + jj;
          reduce_p_ds<H, true>(
              s, dp, part,
              [&](int r, float sr, float dpr, float& pr, float& gr) {
                const bool vis = !need_mask || (r ? (j >= first[1] && j <= last[1]) : (j >= first[0] && j <= last[0]));
                p_and_ds(sr, dpr, scale, softcap, inv_cap, r ? l[1] : l[0], r ? dval[1] : dval[0], vis, pr, gr);
              },
              p, g);
#pragma unroll
          for (int r = 0; r < R; ++r) axpy<C>(dqa[r], g[r], kx);
        }
      }
    }
    wait_all();
#pragma unroll
    for (int r = 0; r < R; ++r)
      if (row[r] < row_end) store_slice_global<H, C>(&dq(b, row[r], h, 0), dqa[r], scale, part);
#else
    (void)team;
#endif
  }
};
#endif

/// The fp32 backward's tiles (dK/dV: block_k keys owned, block_q queries streamed; dQ: the converse).
template <int D>
BackwardTileConfig simt_backward_tiles(std::size_t l0_max) {
  using S = SimtBackwardShape<D>;
  return backward_tiles_of<S>(l0_max, S::threads, S::threads);
}

/// The CUDA fp32 backward: dq [batch, seq_q, heads_q, D], dk and dv [batch, seq_k, heads_kv, D] from q, k, v,
/// d_o, lse [batch, heads_q, seq_q] (the forward's) and dd = rowsum(dO ∘ O) [batch, heads_q, seq_q].
/// Arguments as tc_backward_launch_d; needs what simt_forward_why_not checks (float on Kokkos::Cuda, unit
/// head-dim stride, 16-byte-aligned rows). Every dk/dv row is written (zero where no query sees the key).
template <int D, class ExecSpace, class Args>
void simt_backward_launch_d(const ExecSpace& space, const Args& args, BackwardParts parts = BackwardParts::all) {
#if defined(KOKKOS_ENABLE_CUDA)
  if constexpr (std::is_same<ExecSpace, Kokkos::Cuda>::value && std::is_same<typename Args::T, float>::value &&
                std::is_same<typename Args::d_type::non_const_value_type, float>::value &&
                std::is_same<typename Args::dq_type::non_const_value_type, float>::value) {
    using S = SimtBackwardShape<D>;
    const auto& q = args.q;
    const auto& k = args.k;
    if (k.extent(1) > 0 && parts != BackwardParts::dq) {
      using K1 = SimtDkDvKernel<D, Args>;
      const K1 k1(args);
      const long league = k1.order.league();
      checked_league("kfa::attention_backward", "batch * heads_kv * key blocks", league);
      if (league > 0) {
        typename K1::policy_type p1(space, static_cast<int>(league), S::threads / 32, 32);
        p1.set_scratch_size(0, Kokkos::PerTeam(S::dkdv_scratch));
        Kokkos::parallel_for("kfa::attention_backward::dkdv[simt_fp32]", p1, k1);
      }
    }
    if (q.extent(1) > 0 && parts != BackwardParts::dkdv) {
      using K2 = SimtDqKernel<D, Args>;
      const K2 k2(args);
      const long league = k2.order.league();
      checked_league("kfa::attention_backward", "batch * heads_q * query blocks", league);
      if (league > 0) {
        typename K2::policy_type p2(space, static_cast<int>(league), S::threads / 32, 32);
        p2.set_scratch_size(0, Kokkos::PerTeam(S::dq_scratch));
        Kokkos::parallel_for("kfa::attention_backward::dq[simt_fp32]", p2, k2);
      }
    }
    return;
  }
#endif
  (void)space, (void)args, (void)parts;
  fail("kfa: the CUDA fp32 backward does not exist for these types in this build");
}

}  // namespace detail
}  // namespace kfa
