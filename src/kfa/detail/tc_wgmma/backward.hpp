#pragma once
/// tc_wgmma/backward.hpp: the tc_wgmma family's backward kernels (dK/dV and warp-specialized dQ).
/// The kernels of the deterministic tensor-core backward on Hopper's warpgroup MMA (wgmma, sm_90a). The dK/dV
/// kernel is the 16-keys-per-warp kernel's algorithm (tc_team/backward.hpp: transposed scores, Pᵀ and dSᵀ
/// straight from the accumulators into the A operands of dV and dK) with every product issued by a warpgroup
/// as one asynchronous 64 × N × 16 instruction reading shared memory through descriptors
/// (tc_wgmma/forward.hpp).
///
/// dK/dV, per block: two warpgroups (8 warps; d = 64: three, 12 warps), BK = 128 owned keys (d = 64: 192), 64
/// per warpgroup and 16 per warp (d = 256: 64 keys, both warpgroups on the same keys, each with half of dK's and
/// dV's columns); K and V stay in shared memory; query tiles of BQ = 64 rows of every query head of the group
/// stream through 3 stages (d = 256: 2; Q and dO by TMA, cuda/tma.hpp, or cp.async; the rows' lse and D). A step,
/// per warpgroup:
///   Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ   m64n64k16, both operands from shared memory (K-major, as S = Q·Kᵀ in the
///                               forward), issued together and waited for once;
///   Pᵀ = exp2(Sᵀ·scale·log2e − lse·log2e), dSᵀ = Pᵀ ∘ (dPᵀ − D) (∘ softcap'), in registers, then
///                               packed to 16 bits in place as A fragments (the m16n8 C and A layouts agree
///                               per warp);
///   dV += Pᵀ·dO, dK += dSᵀ·Q     m64nDk16, A from registers, B = the dO or Q tile read transposed
///                               (MN-major, as V in the forward's O += P·V).
/// dK and dV stay in fp32 registers (2·D/2 per thread) over the whole key block; no atomics (bitwise
/// reproducible). Tiles are unpadded 64-element panels under the 128-byte swizzle the descriptors name (d = 96:
/// two per row, the second half-used, wgmma_row_elems).
/// dQ comes from a second kernel here, the wgmma forward's layout with the dQ kernel's recomputation, warp-
/// specialized (tc_wgmma_ws_dq_kernel: a producer warpgroup and 4 stages of 64-key K/V tiles loaded by TMA,
/// as the warp-specialized forward). With deterministic = false at d = 64 the dK/dV kernel computes dQ too
/// and adds it into an fp32 workspace by bulk asynchronous reductions (TcWgmmaDkDvKernel, Fused).
///
/// Both need the sm_90a image as the wgmma forward does (wgmma_loaded); every other image has a trapping body.
#include <kfa/detail/common/recompute.hpp>  // recompute_lse
#include <kfa/detail/cuda/native_args.hpp>  // Fa2DqArgs, set_dq_args
#include <kfa/detail/cuda/recompute_p.hpp>
#include <kfa/detail/mask.hpp>
#include <kfa/detail/tc_wgmma/forward.hpp>  // tc::wgmma_*, tc::load_tile_sw128, wgmma_device_problem

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

namespace kfa {
namespace detail {

#if KFA_HAS_TENSOR_CORES && KFA_WGMMA_DEVICE
namespace tc {
/// The ping-pong's turns: the NC warpgroups of the wgmma dK/dV kernel issue their products in turn
/// (FlashAttention-3's ping-pong): each one's first products in warpgroup order, then each one's second, so
/// that one's softmax-like pass runs while the others' products are on the tensor cores. Warpgroup w waits
/// for its turn on named barrier 1 + w, which the warpgroup before it arrives on once it has issued:
/// before_first: every warpgroup but 0 waits (0 goes first); after_first: each hands the turn on (the last
/// to 0, for its second products); before_second: each waits; after_second: each but the last hands on.
/// Barrier 1 takes one arrival and one wait per step, the others two of each, balanced. The kernel ends each
/// step with a block-wide barrier and needs it: without one, the warpgroup before w can arrive on w's barrier
/// for step t + 1's first products before w waited for step t's second ones, which completes the barrier
/// without w (a two-warpgroup kernel without it hung so on the H200).
template <int NC>
__device__ __forceinline__ void pingpong_before_first(int wg) {
  if (wg > 0) named_sync(1 + wg, 128 * 2);
}
template <int NC>
__device__ __forceinline__ void pingpong_after_first(int wg) {
  named_arrive(1 + (wg + 1) % NC, 128 * 2);
}
template <int NC>
__device__ __forceinline__ void pingpong_before_second(int wg) {
  named_sync(1 + wg, 128 * 2);
}
template <int NC>
__device__ __forceinline__ void pingpong_after_second(int wg) {
  if (wg + 1 < NC) named_arrive(2 + wg, 128 * 2);
}
}  // namespace tc
#endif

/// Tiles of the wgmma dK/dV kernel: `consumers` warpgroups of 64 owned keys each, three at d = 64 (room for
/// their accumulators at 168 registers, no spill; forward+backward 1.04–1.09× two warpgroups, H100, bf16, N
/// 4096–16384; the fused kernel's dQ columns go to two of the three), two otherwise. At d = 256 dK and dV of
/// 64 keys would take 256 registers a thread, so the two warpgroups own the same 64 keys and each keeps dK and
/// dV for one half of the head dim (`col_parts`; the dn = 128 columns from dn·part): both compute the keys' Sᵀ
/// and dPᵀ (6 tile products of work per step where 4 are needed). Shared memory: K and V [BK][D], `stages`
/// stages of Q and dO [BQ][D] (16-bit, unpadded) and of the rows' lse and D (fp32), a "full" mbarrier per
/// stage (TMA), and 1 KB to align the tiles to the swizzle's period (d = 64 98.5 KB, d = 128 162.5 KB, d = 256
/// 194 KB; each stage 16.5, 32.5 or 64.5 KB of that; d = 96 takes d = 128's, its rows in two panels:
/// wgmma_row_elems). Three stages (2 to 4 work; two at d = 256, where three do not fit): the loads of step
/// t + stages − 1 are issued at step t. Fused (dQ accumulated in the kernel, d = 64 only): dS [BQ][BK] of two
/// steps as the A operand of dQ += dS·K and a step's dQ [BQ][D] in fp32 (162.5 KB in all).
template <int D, bool Fused = false>
struct WgmmaBackwardShape {
  static constexpr int consumers = D == 64 ? 3 : 2;   // warpgroups
  static constexpr int col_parts = D == 256 ? 2 : 1;  // warpgroups sharing 64 keys, each dn columns of dK and dV
  static constexpr int dn = D / col_parts;
  static constexpr int warps = 4 * consumers;
  static constexpr int block_k = 64 * consumers / col_parts;  // owned keys
  static constexpr int block_q = 64;                          // streamed query rows per step: wgmma's n of Sᵀ, dPᵀ
  static constexpr int stages = D == 256 ? 2 : 3;
  static constexpr int row_elems = wgmma_row_elems(D);
  static constexpr std::size_t tile_q = static_cast<std::size_t>(block_q) * row_elems * 2;  // one Q or dO tile
  static constexpr std::size_t tile_ds = static_cast<std::size_t>(block_q) * block_k * 2;   // one dS (Fused)
  static constexpr std::size_t ds_bytes = Fused ? 2 * tile_ds : 0u;
  static constexpr std::size_t dq_bytes = Fused ? static_cast<std::size_t>(block_q) * D * 4 : 0u;
  static constexpr std::size_t smem = 2u * block_k * row_elems * 2 + stages * 2u * tile_q + ds_bytes + dq_bytes +
                                      stages * 2u * block_q * 4 + 8u * stages + 1024;
  static_assert(wgmma_backward_head_dim(D) && (!Fused || D == 64), "wgmma's n of dV and dK is dn; fused: d = 64");
  static_assert(stages >= 2 && stages <= 4, "2 to 4 stages");
  static_assert(consumers % col_parts == 0 && dn <= 128, "whole key groups; dV and dK products of n <= 128");
};

/// Where the fused wgmma dK/dV kernel accumulates dQ[b][i][h][c] (fp32, unscaled): [batch][heads_q][2][seq_q][D/2]
/// (a warpgroup's half of the columns of consecutive rows is one contiguous block, reduced at once), the
/// float pairs of a row XOR-swizzled by the row (so the shared-memory tile it is written from has 2-way bank
/// conflicts at most, not 8). wgmma_dq_index(b, h, half, i, ...) + the swizzled column = the element.
template <int D>
KOKKOS_INLINE_FUNCTION long wgmma_dq_index(long b, long h, int half, long i, long heads_q, long seq_q) {
  return (((b * heads_q + h) * 2 + half) * seq_q + i) * (D / 2);
}
template <int D>
KOKKOS_INLINE_FUNCTION long wgmma_dq_column(long i, int c) {  // c in [0, D/2)
  return 2 * ((c >> 1) ^ (static_cast<int>(i & (D / 16 - 1)) << 2)) + (c & 1);
}

#if KFA_HAS_TENSOR_CORES
/// Tma: the tiles come by TMA (tma holds the descriptors), else by cp.async. A template parameter, not a
/// flag: both paths in one body cost the d = 128 softcap instance 4 bytes of spill at 255 registers.
/// Fused (AttentionOptions::deterministic = false): dQ too, FlashAttention-3's way. At step t each warpgroup
/// stores its dSᵀ fragments transposed (stmatrix) as its 64-key panel of the dS [BQ][BK] tile t mod 2; after
/// its dV and dK products of step t, warpgroup 0 and 1 each compute dS_{t−1}·K over all BK keys for one half
/// of dQ's columns (wgmma, A = dS K-major, B = K read transposed; step t − 1's closing barrier made every
/// panel visible), write it to shared memory, and one thread adds the rows into `dq_acc` with one bulk
/// asynchronous reduction (wgmma_dq_index gives the layout); the block's last step is added after its loop.
/// dQ waits for dV's and dK's products so that their A fragments are dead by then (168 registers a thread
/// with three warpgroups); the third warpgroup's products fill the tensor cores meanwhile. 5 tile products
/// per step instead of the 7 of the two kernels, one kernel.
template <int D, bool Softcap, bool Tma, bool Fused, class Args>
struct TcWgmmaDkDvKernel {
  using QV = typename Args::q_type;
  using KV = typename Args::k_type;
  using VV = typename Args::v_type;
  using DOV = typename Args::do_type;
  using LV = typename Args::lse_type;
  using DV = typename Args::d_type;
  using DKV = typename Args::dk_type;
  using DVV = typename Args::dv_type;
  using T = typename QV::non_const_value_type;
  using Shape = WgmmaBackwardShape<D, Fused>;
  static constexpr int WARPS = Shape::warps, BK = Shape::block_k, BQ = Shape::block_q, NTH = 32 * WARPS;
  static constexpr int ST = Shape::stages, DN = Shape::dn;
  static constexpr int MIN_BLOCKS = 1;

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
  float scale;
  TcRecomputeConsts pc;
  KeyMask mask;
  TmaMaps tma;    // Tma: q, dO (boxes of BQ rows), k, v (BK rows), made by set_tma
  float* dq_acc;  // Fused

  explicit TcWgmmaDkDvKernel(const Args& a, float* dq_acc_ = nullptr)
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
        group(static_cast<int>(a.q.extent(2) / a.k.extent(2))),
        order(key_block_order(a, BK)),
        scale(a.scale),
        pc(a.scale, a.softcap),
        mask(a.mask),
        dq_acc(dq_acc_) {}

  /// Makes the TMA descriptors (the host, before the launch); false where the driver cannot (then the
  /// kernel with Tma = false runs).
  bool set_tma() {
    tma_maps_done(tma, tma_map_rows(tma, 0, q, BQ) && tma_map_rows(tma, 1, d_o, BQ) && tma_map_rows(tma, 2, k, BK) &&
                           tma_map_rows(tma, 3, v, BK));
    return tma.on != 0;
  }

#if KFA_WGMMA_DEVICE
  /// Fused: this warp's dSᵀ fragments (keys wk + 0..15 of the tile, wk = 64·wg + 16·(warp mod 4); queries
  /// 16·kk + 0..15 in da[kk]) into the dS tile [BQ][BK] at ds (two 64-key panels, the 128-byte swizzle, as a
  /// K-major A operand): matrix m of da[kk] holds keys wk + 8·(m mod 2) and queries 16·kk + 8·(m / 2), so
  /// its transpose's row c is query 16·kk + 8·(m / 2) + c, 16 bytes at the key panel's chunk
  /// 2·(warp mod 4) + m mod 2. The async proxy (wgmma) reads it after the next block-wide barrier.
  __device__ static void store_ds(std::uint32_t ds, const std::uint32_t (&da)[BQ / 16][4], int wg, int warp, int lane) {
    const int m = lane >> 3, c = lane & 7;
    const int x = (warp & 3) * 2 + (m & 1);
    const std::uint32_t panel = ds + static_cast<std::uint32_t>(wg * BQ * 128);
#pragma unroll
    for (int kk = 0; kk < BQ / 16; ++kk) {
      const int row = kk * 16 + (m >> 1) * 8 + c;
      tc::stmatrix_x4_trans(panel + static_cast<std::uint32_t>(row * 128 + ((x ^ (row & 7)) << 4)), da[kk]);
    }
    tc::fence_proxy_async();
  }
  /// Fused: acc = dS·K over the BK keys for dQ's columns D/2·wg .. D/2·wg + D/2 − 1 (issued, not committed):
  /// A = the dS tile at ds (K-major, 64-key panels), B = K read transposed (keys are the K dimension; the
  /// columns start inside a 64-element panel at d = 64).
  __device__ static void issue_dq(float (&acc)[D / 16][4], std::uint32_t ds, std::uint32_t ks, int wg) {
    constexpr int half = D / 2;
    std::uint32_t b0 = ks + static_cast<std::uint32_t>((wg * half / 64) * BK * 128 + (wg * half % 64) * 2);
    asm volatile("" : "+r"(b0));  // opaque: else ptxas keeps B's BK / 16 descriptors across the steps (spills)
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk)
      tc::wgmma_ss<half, T, true>(acc, tc::wgmma_desc(ds + (kk >> 2) * BQ * 128 + (kk & 3) * 32, 16, 1024),
                                  tc::wgmma_desc(b0 + kk * 16 * 128, BK * 128, 1024), kk);
  }
  /// Fused: dq_acc += acc for this warpgroup's half of the columns of rows i0 .. i0 + rows − 1 of head hq:
  /// the warpgroup writes acc into its [BQ][D/2] fp32 tile at dq_s (columns swizzled per row as in dq_acc),
  /// then its first thread reduces the rows' contiguous block into dq_acc; that thread first waits until
  /// its previous reduction has read the tile (named barrier NC + 1 + wg orders the warpgroup around both).
  __device__ void reduce_dq(const float (&acc)[D / 16][4], std::uint32_t dq_s, int b, int hq, long i0, int rows, int wg,
                            int warp, int lane) const {
    const bool first = (warp & 3) == 0 && lane == 0;
    const std::uint32_t dq = dq_s + static_cast<std::uint32_t>(wg * BQ * (D / 2) * 4);
    if (first) tc::bulk_wait<true>();
    wg_sync(wg);
    const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = (warp & 3) * 16 + g + h * 8;
      const int sw = static_cast<int>((i0 + r) & (D / 16 - 1)) << 2;
#pragma unroll
      for (int n = 0; n < D / 16; ++n) {
        const std::uint32_t at = dq + static_cast<std::uint32_t>((r * (D / 2) + 2 * ((4 * n + t4) ^ sw)) * 4);
        asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(at), "f"(acc[n][2 * h]), "f"(acc[n][2 * h + 1])
                     : "memory");
      }
    }
    tc::fence_proxy_async();
    wg_sync(wg);
    if (first) {
      const long heads_q = static_cast<long>(heads_kv) * group;
      tc::bulk_reduce_add_f32(dq_acc + wgmma_dq_index<D>(b, hq, wg, i0, heads_q, seq_q), dq,
                              static_cast<std::uint32_t>(rows * (D / 2) * 4));
      tc::bulk_commit();
    }
  }
  __device__ static void wg_sync(int wg) {  // barriers 1 .. NC are the ping-pong's
    if (wg == 0)
      tc::named_sync(Shape::consumers + 1, 128);
    else
      tc::named_sync(Shape::consumers + 2, 128);
  }
#endif

  /// The body of block `lr` (native_team_kernel), with Shape::smem bytes of shared memory at smem.
  __device__ void run(int lr, char* smem) const {
#if KFA_WGMMA_DEVICE
    const int lane = threadIdx.x, warp = threadIdx.y, tid = warp * 32 + lane;
    const int g = lane >> 2, t4 = lane & 3, wg = warp >> 2;
    // The warpgroup's 64 keys (key group kg) and its columns of dK and dV (part: columns DN·part ..)
    const int kg = wg / Shape::col_parts, part = wg % Shape::col_parts;
    const KeyBlock blk(lr, order, heads_kv, BK, seq_k);
    const int hk = blk.hk, b = blk.b, k0 = blk.k0, keys = blk.keys;
    if (keys <= 0) return;  // an empty block of a document-aligned launch (cuda/block_order.hpp)

    // K, V, then stage s's Q and dO at stage0 + s·2·tile_q, (Fused) dS, then [stage][lse | D] rows. Tiles
    // start at a multiple of 1024 B: the swizzle is a function of the address bits.
    const std::uint32_t base = tc::smem_addr(smem);
    constexpr std::uint32_t kv_tile = BK * Shape::row_elems * 2;  // one K or V tile
    const std::uint32_t ks = (base + 1023u) & ~1023u, vs = ks + kv_tile, stage0 = vs + kv_tile;
    constexpr std::uint32_t tile_q = static_cast<std::uint32_t>(Shape::tile_q);
    const std::uint32_t ds_s = stage0 + ST * 2 * tile_q, dq_s = ds_s + static_cast<std::uint32_t>(Shape::ds_bytes);
    const std::uint32_t rows0 = dq_s + static_cast<std::uint32_t>(Shape::dq_bytes);
    float* rows_s = reinterpret_cast<float*>(smem + (rows0 - base));
    // With TMA thread 0 issues each stage's Q and dO tiles (and K, V with stage 0's) as whole tiles that
    // complete the stage's full mbarrier, which every thread waits on instead of its cp.async groups and the
    // step's first __syncthreads; else every thread issues cp.async.
    constexpr bool use_tma = Tma;
    const std::uint32_t full0 = rows0 + ST * 2 * BQ * 4;
    auto full = [&](int st) { return full0 + 8u * static_cast<std::uint32_t>(st); };

    KeyRule mask;  // the pass's: one per document the block's keys meet (one without documents)
    long qb0 = 0, qb1 = 0;
    int n_qt = 0;
    const long qstride = static_cast<long>(q.stride(1)), dostride = static_cast<long>(d_o.stride(1));
    const auto* qbase = q.data() + b * q.stride(0) + static_cast<long>(hk) * group * q.stride(2);
    const auto* dobase = d_o.data() + b * d_o.stride(0) + static_cast<long>(hk) * group * d_o.stride(2);
    // Steps run over the visible query tiles (fastest) of each query head of the group: step = gh·n_qt + qt.
    // `extra`: more bytes the stage's full barrier waits for (K and V with step 0's, by TMA).
    auto issue = [&](int step, int st, std::uint32_t extra) {
      const int qt = step % n_qt, gh = step / n_qt;
      const long i = qb0 + static_cast<long>(qt) * BQ;
      const int rows = static_cast<int>(qb1 - i < BQ ? qb1 - i : BQ);
      const std::uint32_t qd = stage0 + st * 2 * tile_q;
      if constexpr (use_tma) {
        if (tid == 0) {
          tc::mbar_arrive_expect_tx(full(st), 2 * tile_q + extra);
          tc::tma_rows<D, BQ>(qd, tma, 0, static_cast<int>(i), hk * group + gh, b, full(st));
          tc::tma_rows<D, BQ>(qd + tile_q, tma, 1, static_cast<int>(i), hk * group + gh, b, full(st));
        }
        return;
      }
      constexpr int NTQ = NTH > 256 ? 256 : NTH;  // threads loading a Q or dO tile (BQ rows: whole passes)
      if (tid >= NTQ) return;
      tc::load_tile_sw128<D, BQ, NTQ>(
          qd, reinterpret_cast<const std::uint16_t*>(qbase + i * qstride + gh * q.stride(2)), qstride, rows, tid);
      tc::load_tile_sw128<D, BQ, NTQ>(
          qd + tile_q, reinterpret_cast<const std::uint16_t*>(dobase + i * dostride + gh * d_o.stride(2)), dostride,
          rows, tid);
    };
    // Row r's lse·log2(e) and D of a step (rows past the visible ones: +inf and 0, so Pᵀ = 0 there).
    auto row_values = [&](int step, float& l2, float& d) {  // row tid of the step's query tile
      const int qt = step % n_qt, gh = step / n_qt;
      const long i = qb0 + static_cast<long>(qt) * BQ + tid;
      const int hq = hk * group + gh;
      const bool in = tid < BQ && i < qb1;
      l2 = in ? recompute_lse(static_cast<float>(lse(b, hq, i))) * tc::log2e : compat::infinity<float>();
      d = in ? static_cast<float>(dd(b, hq, i)) : 0.f;
    };
    constexpr std::uint32_t kv_bytes = 2u * kv_tile;
    float dka[DN / 8][4], dva[DN / 8][4];
#pragma unroll
    for (int n = 0; n < DN / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) dka[n][e] = dva[n][e] = 0.f;
    float s[BQ / 8][4], dp[BQ / 8][4];
#pragma unroll
    for (int n = 0; n < BQ / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.f;

    // This warp's key rows kr0 and kr0 + 8 (tile-local); the warpgroup's K and V rows in each panel; its
    // columns of the dO and Q tiles (B of dV and dK: whole 64-element panels).
    const int kr0 = kg * 64 + (warp & 3) * 16 + g;
    const std::uint32_t k_wg = ks + static_cast<std::uint32_t>(kg * 64 * 128), v_wg = k_wg + kv_tile;
    const std::uint32_t cols_b = static_cast<std::uint32_t>(part * (DN / 64) * BQ * 128);

    // One pass per document the block's keys meet (one without documents), dK and dV carried across. Step s of a
    // pass is step done + s of the block (done: the earlier passes' steps), in stage (done + s) mod ST, its
    // ((done + s) / ST)-th use; K and V ride with the first pass's first step.
    int done = 0;
    bool kv_in = false;
    // Fused: the previous step's rows (rows 0: none). The dS tiles start zeroed: the first step's dQ product
    // reads one before any step wrote it (its result is dropped).
    [[maybe_unused]] struct {
      int i0, rows, hq;  // i0 < seq_q, an int
    } prev = {0, 0, 0};
    // Fused: warpgroups 0 and 1 own dQ's column halves. Taken from lane 0, the flag is uniform over the warp
    // for ptxas (threadIdx.y alone is not, for all it knows): a branch on it does not serialize wgmma.
    [[maybe_unused]] const bool dq_here = Fused && __shfl_sync(0xffffffffu, wg, 0) < 2;
    if constexpr (Fused) {
      uint4* ds_p = reinterpret_cast<uint4*>(smem + (ds_s - base));
      for (int i = tid; i < static_cast<int>(Shape::ds_bytes / 16); i += NTH) ds_p[i] = make_uint4(0u, 0u, 0u, 0u);
      tc::fence_proxy_async();  // before the wgmma reads, after the first block-wide barrier
    }
    const DocumentSpan span = this->mask.documents_of_keys(k0, k0 + keys);
    for (int doc = span.first; doc < span.last; ++doc) {
      mask = this->mask.rule(doc);
      qb0 = mask.query_begin(k0);
      qb1 = mask.query_end(k0 + keys, seq_q);
      n_qt = qb1 > qb0 ? static_cast<int>((qb1 - qb0 + BQ - 1) / BQ) : 0;
      const int steps = n_qt * group;
      if (steps == 0) continue;
      const int st0 = done % ST;
      if (!kv_in) {
        if constexpr (use_tma) {
          if (tid == 0) {
            for (int i = 0; i < 4; ++i) tc::tma_prefetch(tma, i);
            for (int st = 0; st < ST; ++st) tc::mbar_init(full(st), 1);
            asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
            tc::tma_rows<D, BK>(ks, tma, 2, k0, hk, b, full(st0));
            tc::tma_rows<D, BK>(vs, tma, 3, k0, hk, b, full(st0));
          }
        } else {
          tc::load_tile_sw128<D, BK, NTH>(
              ks,
              reinterpret_cast<const std::uint16_t*>(k.data() + b * k.stride(0) + k0 * k.stride(1) + hk * k.stride(2)),
              static_cast<long>(k.stride(1)), keys, tid);
          tc::load_tile_sw128<D, BK, NTH>(
              vs,
              reinterpret_cast<const std::uint16_t*>(v.data() + b * v.stride(0) + k0 * v.stride(1) + hk * v.stride(2)),
              static_cast<long>(v.stride(1)), keys, tid);
        }
      }
      // Steps 0 .. ST − 2 in flight, one commit group each (K and V ride with the first pass's step 0).
#pragma unroll
      for (int s0 = 0; s0 < ST - 1; ++s0) {
        if (s0 < steps) {
          const int sst = (st0 + s0) % ST;
          issue(s0, sst, s0 == 0 && !kv_in ? kv_bytes : 0u);
          if (tid < BQ) row_values(s0, rows_s[sst * 2 * BQ + tid], rows_s[sst * 2 * BQ + BQ + tid]);
        }
        tc::cp_async_commit();
      }
      kv_in = true;
      if constexpr (use_tma) __syncthreads();  // the barriers' init and the first steps' rows (cp.async: at step 0)

      int qt = 0, st = st0;
      for (int step = 0; step < steps; ++step) {
        const long i0 = qb0 + static_cast<long>(qt) * BQ;
        const int rows = static_cast<int>(qb1 - i0 < BQ ? qb1 - i0 : BQ);
        // Step + ST − 1 goes into the stage step − 1 used (every warp left it at the previous step's end).
        const bool next = step + ST - 1 < steps;
        const int nst = st == 0 ? ST - 1 : st - 1;
        float next_l2 = 0.f, next_d = 0.f;
        if (next) {
          issue(step + ST - 1, nst, 0u);
          row_values(step + ST - 1, next_l2, next_d);
        }
        if constexpr (use_tma) {
          tc::mbar_wait(full(st), static_cast<unsigned>((done + step) / ST) & 1u);  // this step's Q and dO (and K, V)
          // Rows past the pass's last query (and, with the block's first step, past its last key) as 0, as the
          // cp.async path loads them: 0·inf in a masked product is NaN (tc::zero_rows_sw128)
          const bool kv_tail = done + step == 0 && keys < BK;
          if (rows < BQ || kv_tail) {
            if (rows < BQ) {
              tc::zero_rows_sw128<D, BQ, NTH>(stage0 + st * 2 * tile_q, rows, tid);
              tc::zero_rows_sw128<D, BQ, NTH>(stage0 + st * 2 * tile_q + tile_q, rows, tid);
            }
            if (kv_tail) {
              tc::zero_rows_sw128<D, BK, NTH>(ks, keys, tid);
              tc::zero_rows_sw128<D, BK, NTH>(vs, keys, tid);
            }
            tc::fence_proxy_async();
            __syncthreads();
          }
        } else {
          tc::cp_async_commit();
          tc::cp_async_wait<ST - 1>();  // all but the ST − 1 groups after this step's
          tc::fence_proxy_async();
          __syncthreads();  // this step's Q and dO (and K, V), lse and D are in
        }
        const std::uint32_t qs = stage0 + st * 2 * tile_q, dos = qs + tile_q;
        const float* lse_s = rows_s + st * 2 * BQ;
        const float* dd_s = lse_s + BQ;

        // Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ: K-major steps of 16 elements advance 32 B inside a 128-byte panel row,
        // every 4 steps a panel.
        tc::pingpong_before_first<Shape::consumers>(wg);
        tc::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          const std::uint32_t in_row = static_cast<std::uint32_t>((kk & 3) * 32), panel = (kk >> 2);
          tc::wgmma_ss<BQ, T>(s, tc::wgmma_desc(k_wg + panel * BK * 128 + in_row, 16, 1024),
                              tc::wgmma_desc(qs + panel * BQ * 128 + in_row, 16, 1024), kk);
        }
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          const std::uint32_t in_row = static_cast<std::uint32_t>((kk & 3) * 32), panel = (kk >> 2);
          tc::wgmma_ss<BQ, T>(dp, tc::wgmma_desc(v_wg + panel * BK * 128 + in_row, 16, 1024),
                              tc::wgmma_desc(dos + panel * BQ * 128 + in_row, 16, 1024), kk);
        }
        tc::wgmma_commit();
        tc::pingpong_after_first<Shape::consumers>(wg);
        tc::wgmma_wait_all();
        tc::wgmma_hold(s);
        tc::wgmma_hold(dp);

        // Pᵀ and dSᵀ, packed into A fragments (16 queries per k step: n-tiles 2kk and 2kk + 1). Masked tiles
        // take a second copy of the pass, in which each key's visible queries are one range of the tile (the
        // common tile tests nothing per element).
        std::uint32_t pa[BQ / 16][4], da[BQ / 16][4];
        auto p_ds_pass = [&](auto masked) {
          constexpr bool Masked = decltype(masked)::value;
          int lo[2] = {0, 0}, hi[2] = {BQ - 1, BQ - 1};  // visible queries of keys kr0 and kr0 + 8, tile-local
          if (Masked) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const long j = k0 + kr0 + h * 8;
              long first, last;  // the queries that see key j, tile-local
              mask.seen_by(j, seq_q, first, last);
              first -= i0, last -= i0;
              lo[h] = static_cast<int>(first < 0 ? 0 : (first > BQ ? BQ : first));
              hi[h] = static_cast<int>(j >= seq_k || last < 0 ? -1 : (last > rows - 1 ? rows - 1 : last));
            }
          }
#pragma unroll
          for (int n = 0; n < BQ / 8; ++n) {
            float p[4], ds[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int qq = n * 8 + 2 * t4 + (e & 1);
              const bool vis = !Masked || (qq >= lo[e >> 1] && qq <= hi[e >> 1]);
              float dcap;
              p[e] = tc_recompute_p<Softcap>(s[n][e], pc, lse_s[qq], vis, dcap);
              ds[e] = p[e] * (dp[n][e] - dd_s[qq]) * dcap;
            }
            pa[n / 2][(n & 1) * 2 + 0] = cuda16<T>::pack(p[0], p[1]);
            pa[n / 2][(n & 1) * 2 + 1] = cuda16<T>::pack(p[2], p[3]);
            da[n / 2][(n & 1) * 2 + 0] = cuda16<T>::pack(ds[0], ds[1]);
            da[n / 2][(n & 1) * 2 + 1] = cuda16<T>::pack(ds[2], ds[3]);
          }
        };
        if (rows < BQ || keys < BK || !mask.all_visible(i0, i0 + BQ, k0, k0 + BK))
          p_ds_pass(std::true_type{});
        else
          p_ds_pass(std::false_type{});
        if constexpr (Fused)
          store_ds(ds_s + static_cast<std::uint32_t>(((done + step) & 1) * Shape::tile_ds), da, wg, warp, lane);

        // dV += Pᵀ·dO and dK += dSᵀ·Q (this warpgroup's DN columns): B = dO or Q read transposed (queries are
        // the instruction's K dimension): 16 query rows per step, 64-element panels BQ rows apart.
        tc::pingpong_before_second<Shape::consumers>(wg);
        tc::wgmma_fence();  // pa and da were written by ordinary instructions
#pragma unroll
        for (int kk = 0; kk < BQ / 16; ++kk)
          tc::wgmma_rs<DN, T>(dva, pa[kk], tc::wgmma_desc(dos + cols_b + kk * 16 * 128, BQ * 128, 1024));
#pragma unroll
        for (int kk = 0; kk < BQ / 16; ++kk)
          tc::wgmma_rs<DN, T>(dka, da[kk], tc::wgmma_desc(qs + cols_b + kk * 16 * 128, BQ * 128, 1024));
        tc::wgmma_commit();
        tc::pingpong_after_second<Shape::consumers>(wg);
        tc::wgmma_wait_all();
        tc::wgmma_hold(dva);
        tc::wgmma_hold(dka);
        if constexpr (Fused) {  // the previous step's dQ, after dV's and dK's products (their A fragments are free)
          if (dq_here) {
            float dqa[D / 16][4];
            tc::wgmma_fence();
            issue_dq(dqa, ds_s + static_cast<std::uint32_t>(((done + step + 1) & 1) * Shape::tile_ds), ks, wg);
            tc::wgmma_commit();
            tc::wgmma_wait_all();
            tc::wgmma_hold(dqa);
            if (prev.rows > 0) reduce_dq(dqa, dq_s, b, prev.hq, prev.i0, prev.rows, wg, warp, lane);
          }
          prev = {static_cast<int>(i0), rows, hk * group + step / n_qt};
        }
        if (next && tid < BQ) {  // stage nst's rows were last read in the previous step
          float* nr = rows_s + nst * 2 * BQ;
          nr[tid] = next_l2, nr[BQ + tid] = next_d;
        }
        __syncthreads();  // every warp is done with this stage before it is refilled; step + ST − 1's rows are in
        if (++qt == n_qt) qt = 0;
        if (++st == ST) st = 0;
      }
      done += steps;
    }
    tc::cp_async_wait_all();
    if constexpr (Fused) {  // the last step's dQ (its closing barrier made dS visible)
      if (prev.rows > 0 && dq_here) {
        float dqa[D / 16][4];
        tc::wgmma_fence();
        issue_dq(dqa, ds_s + static_cast<std::uint32_t>(((done - 1) & 1) * Shape::tile_ds), ks, wg);
        tc::wgmma_commit();
        tc::wgmma_wait_all();
        tc::wgmma_hold(dqa);
        reduce_dq(dqa, dq_s, b, prev.hq, prev.i0, prev.rows, wg, warp, lane);
      }
      if ((warp & 3) == 0 && lane == 0) tc::bulk_wait<false>();  // the reductions are done before the block ends
    }

    const int r0 = k0 + kr0, r1 = r0 + 8, c0 = DN * part;
    tc::store_c_rows<DN, T>(dka, scale, scale, r0 < k0 + keys ? &dk(b, r0, hk, c0) : nullptr,
                            r1 < k0 + keys ? &dk(b, r1, hk, c0) : nullptr, t4);
    tc::store_c_rows<DN, T>(dva, 1.f, 1.f, r0 < k0 + keys ? &dv(b, r0, hk, c0) : nullptr,
                            r1 < k0 + keys ? &dv(b, r1, hk, c0) : nullptr, t4);
#else
    (void)lr, (void)smem;
#if defined(__CUDA_ARCH__)
    __trap();  // not reachable: the plan runs this kernel only where wgmma_loaded says the sm_90a image is in
#endif
#endif
  }
};
#endif  // KFA_HAS_TENSOR_CORES

/// Tiles of the warp-specialized wgmma dQ kernel: three warpgroups (two compute 64 query rows each, one loads),
/// Q and dO of the block, `stages` stages of 64-key K and V tiles (16-bit, unpadded), 1 KB of alignment slack,
/// the mbarriers (Q/dO, then full and empty per stage). 4 stages: d = 64 97 KB, d = 96 and 128 193 KB (rows of
/// wgmma_row_elems); d = 256 (dQ in 128 registers a thread, as the forward's O) 3 stages of 32-key tiles, 225 KB.
/// The backward with this kernel ran 1.03–1.10× the one with a two-warpgroup dQ kernel of 128-key tiles (H200,
/// bf16, d 64/128, N 4096–16384, kfa vs kfa in one run).
template <int D>
struct WgmmaWsDqShape {
  static constexpr int warps = 12;
  static constexpr int block_q = 128;
  static constexpr int block_k = D == 256 ? 32 : 64;
  static constexpr int stages = D == 256 ? 3 : 4;
  static constexpr std::size_t tile_bytes =
      static_cast<std::size_t>(2 * block_q + 2 * stages * block_k) * wgmma_row_elems(D) * 2;
  static constexpr std::size_t smem = tile_bytes + 1024 + 8 * (1 + 2 * stages);
  static_assert(wgmma_backward_head_dim(D) && stages >= 2, "d = 64, 96, 128 or 256; at least double-buffered");
};

#if KFA_HAS_TENSOR_CORES
/// The warp-specialized dQ kernel's arguments: the dQ kernels', and TMA descriptors of q, dO, k and v.
template <class OutT>
struct WgmmaWsDqArgs : Fa2DqArgs<OutT> {
  TmaMaps tma;
};

/// The warp-specialized wgmma dQ kernel: the wgmma forward's layout with the FA2-layout dQ kernel's
/// recomputation, in the warp-specialized forward's structure (tc_wgmma_ws_forward_kernel). Warpgroup 2 loads
/// Q and dO, then each 64-key K/V tile into stage t mod STAGES (tc::ws_produce: by TMA from one thread where
/// a.tma.on, else by cp.async from all 128; the stage's "full" mbarrier completes when they land; it waits on
/// the stage's "empty" one before a refill).
/// Warpgroups 0 and 1 (64 rows each), in turns (named barriers 1 and 2): issue S_t = Q·K_tᵀ and
/// dP_t = dO·V_tᵀ, then dQ += dS_{t-1}·K_{t-1}; wait for S_t and dP_t only, compute dS_t in place, wait for
/// the dQ product, release stage t − 1, pack dS_t. No atomics: each block owns its rows of dQ.
template <int D, bool Softcap, class T, class OutT>
__global__ void __launch_bounds__(32 * WgmmaWsDqShape<D>::warps, 1)
    tc_wgmma_ws_dq_kernel(const __grid_constant__ WgmmaWsDqArgs<OutT> a) {
#if KFA_WGMMA_DEVICE
  using Shape = WgmmaWsDqShape<D>;
  constexpr int BQ = Shape::block_q, BC = Shape::block_k, ST = Shape::stages, NP = 128;
  constexpr int DP = wgmma_row_elems(D);  // a row's elements in shared memory
  extern __shared__ __align__(1024) unsigned char wgmma_ws_dq_smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t4 = lane & 3, wg = warp >> 2;
  const QueryBlock blk(static_cast<int>(blockIdx.x), a.order, a.heads_q, a.group, BQ, a.seq_q);
  const int b = blk.b, h = blk.h, hk = blk.hk, i0 = blk.i0, rows = blk.rows;
  if (rows <= 0) return;          // an empty block of a document-aligned launch (cuda/block_order.hpp)
  const int row_end = i0 + rows;  // rows past it are another block's (or past seq_q)

  // Q, dO, then stage s's K at ks0 + s·2·BC·DP·2 and V right after it, each at a multiple of 1024 B; barriers.
  const std::uint32_t qs = (tc::smem_addr(wgmma_ws_dq_smem) + 1023u) & ~1023u, dos = qs + BQ * DP * 2;
  const std::uint32_t ks0 = dos + BQ * DP * 2;
  constexpr std::uint32_t kv_bytes = BC * DP * 2, stage_bytes = 2 * kv_bytes;
  const tc::WsBarriers<ST> bar{qs + static_cast<std::uint32_t>(Shape::tile_bytes)};
  const bool tma = a.tma.on != 0;
  if (threadIdx.x == 0) bar.init(tma ? 1 : NP, 256);
  __syncthreads();  // the last block-wide barrier: the producer leaves early

  if (wg == 2) {  // the producer: 56 registers (its four tiles' address arithmetic spilled at 24 and 40)
    tc::setmaxnreg_dec<56>();
    const int tid = threadIdx.x - 256;
    if (tma) {
      if (tid == 0) {
        for (int i = 0; i < 4; ++i) tc::tma_prefetch(a.tma, i);
        tc::ws_produce<ST, long>(
            bar, a.mask, i0, i0 + rows, BC,
            [&](std::uint32_t full) {
              tc::mbar_arrive_expect_tx(full, 2 * BQ * DP * 2);
              tc::tma_rows<D, BQ>(qs, a.tma, 0, i0, h, b, full);
              tc::tma_rows<D, BQ>(dos, a.tma, 1, i0, h, b, full);
            },
            [&](int st, long j0, long, std::uint32_t full) {
              const std::uint32_t kd = ks0 + st * stage_bytes;
              tc::mbar_arrive_expect_tx(full, stage_bytes);
              tc::tma_rows<D, BC>(kd, a.tma, 2, static_cast<int>(j0), hk, b, full);
              tc::tma_rows<D, BC>(kd + kv_bytes, a.tma, 3, static_cast<int>(j0), hk, b, full);
            });
      }
      return;
    }
    const std::uint16_t* kbase = a.k + b * a.k_s[0] + hk * a.k_s[2];
    const std::uint16_t* vbase = a.v + b * a.v_s[0] + hk * a.v_s[2];
    const long kstride = a.k_s[1], vstride = a.v_s[1];
    tc::ws_produce<ST, long>(
        bar, a.mask, i0, i0 + rows, BC,
        [&](std::uint32_t full) {
          tc::load_tile_sw128<D, BQ, NP>(qs, a.q + b * a.q_s[0] + static_cast<long>(i0) * a.q_s[1] + h * a.q_s[2],
                                         a.q_s[1], rows, tid);
          tc::load_tile_sw128<D, BQ, NP>(dos, a.d_o + b * a.do_s[0] + static_cast<long>(i0) * a.do_s[1] + h * a.do_s[2],
                                         a.do_s[1], rows, tid);
          tc::cp_async_mbar_arrive(full);
        },
        [&](int st, long j0, long j_end, std::uint32_t full) {
          const int cols = static_cast<int>(j_end - j0 < BC ? j_end - j0 : BC);
          const std::uint32_t kd = ks0 + st * stage_bytes;
          tc::load_tile_sw128<D, BC, NP>(kd, kbase + j0 * kstride, kstride, cols, tid);
          tc::load_tile_sw128<D, BC, NP>(kd + kv_bytes, vbase + j0 * vstride, vstride, cols, tid);
          tc::cp_async_mbar_arrive(full);
        });
    tc::cp_async_wait_all();
    return;
  }

  tc::setmaxnreg_inc<224>();
  const int wr0 = i0 + warp * 16;  // this warp's first query row
  // Rows g and g + 8 of this warp: lse·log2(e) and D (+inf and 0 past seq_q: P = 0 there).
  float lse2[2], ddr[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = wr0 + g + r * 8;
    const bool in = row < row_end;
    lse2[r] =
        in ? recompute_lse(a.lse[b * a.l_s[0] + h * a.l_s[1] + row * a.l_s[2]]) * tc::log2e : compat::infinity<float>();
    ddr[r] = in ? a.dd[b * a.d_s[0] + h * a.d_s[1] + row * a.d_s[2]] : 0.f;
  }
  float acc[D / 8][4], s[BC / 8][4], dp[BC / 8][4];
  std::uint32_t da[BC / 16][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  const std::uint32_t q_wg = qs + static_cast<std::uint32_t>(wg * 64 * 128), do_wg = q_wg + BQ * DP * 2;
  KeyRule mask;  // the pass's: one per document the block's rows meet (one without documents)
  long j_begin = 0, j_end = 0;

  // dS of tile j0 in place in s (from s and dp). Masked tiles take a second copy of the pass, in which each
  // row's visible keys are one range of the tile.
  auto ds_in_place = [&](long j0) {
    const int cols = static_cast<int>(j_end - j0 < BC ? j_end - j0 : BC);
    auto pass = [&](auto masked) {
      constexpr bool Masked = decltype(masked)::value;
      int lo[2] = {0, 0}, hi[2] = {BC - 1, BC - 1};  // visible keys of rows g and g + 8, tile-local
      if (Masked) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          long first, last;
          mask.visible_range(wr0 + g + r * 8, first, last);
          lo[r] = static_cast<int>(first - j0 < 0 ? 0 : (first - j0 > BC ? BC : first - j0));
          hi[r] = static_cast<int>(last - j0 < -1 ? -1 : (last - j0 > cols - 1 ? cols - 1 : last - j0));
        }
      }
#pragma unroll
      for (int n = 0; n < BC / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int jj = n * 8 + 2 * t4 + (e & 1);
          const bool vis = !Masked || (jj >= lo[e >> 1] && jj <= hi[e >> 1]);
          float dcap;
          const float p = tc_recompute_p<Softcap>(s[n][e], a.pc, lse2[e >> 1], vis, dcap);
          s[n][e] = p * (dp[n][e] - ddr[e >> 1]) * dcap;
        }
    };
    if (cols < BC || !mask.all_visible(i0, i0 + rows, j0, j0 + BC))
      pass(std::true_type{});
    else
      pass(std::false_type{});
  };
  auto pack = [&] {
#pragma unroll
    for (int n = 0; n < BC / 8; ++n) {
      da[n / 2][(n & 1) * 2 + 0] = cuda16<T>::pack(s[n][0], s[n][1]);
      da[n / 2][(n & 1) * 2 + 1] = cuda16<T>::pack(s[n][2], s[n][3]);
    }
  };
  // Waits for stage st's tiles and for this warpgroup's turn; issues S = Q·Kᵀ and dP = dO·Vᵀ from it.
  auto issue_s_dp = [&](int st, unsigned use, long j0) {
    tc::mbar_wait(bar.full(st), use & 1);
    const std::uint32_t kst = ks0 + st * stage_bytes, vst = kst + kv_bytes;
    // K's and V's rows past the pass's keys as 0 (tc::zero_rows_sw128): both warpgroups write them before their
    // own products read them (the same zeros; the turn barrier below orders this warpgroup's threads)
    if (tma && j_end - j0 < BC) {
      const int valid = static_cast<int>(j_end - j0);
      tc::zero_rows_sw128<D, BC, 128>(kst, valid, threadIdx.x & 127);
      tc::zero_rows_sw128<D, BC, 128>(vst, valid, threadIdx.x & 127);
    }
    tc::fence_proxy_async();  // cp.async writes (the generic proxy), seen through the barrier, before wgmma reads
    std::uint32_t qa = q_wg, doa = do_wg;
    // opaque at d = 256: else ptxas keeps the Q and dO tiles' 32 descriptors live across the tiles (spills)
    if constexpr (D > 128) asm volatile("" : "+r"(qa), "+r"(doa));
    if (wg == 0)
      tc::named_sync(1, 256);
    else
      tc::named_sync(2, 256);
    tc::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const std::uint32_t in_row = static_cast<std::uint32_t>((kk & 3) * 32), panel = kk >> 2;
      tc::wgmma_ss<BC, T>(s, tc::wgmma_desc(qa + panel * BQ * 128 + in_row, 16, 1024),
                          tc::wgmma_desc(kst + panel * BC * 128 + in_row, 16, 1024), kk);
    }
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const std::uint32_t in_row = static_cast<std::uint32_t>((kk & 3) * 32), panel = kk >> 2;
      tc::wgmma_ss<BC, T>(dp, tc::wgmma_desc(doa + panel * BQ * 128 + in_row, 16, 1024),
                          tc::wgmma_desc(vst + panel * BC * 128 + in_row, 16, 1024), kk);
    }
    tc::wgmma_commit();
  };
  // dQ += dS·K: B = the K tile of stage st read transposed (keys are the instruction's K dimension).
  auto issue_dq = [&](int st) {
    const std::uint32_t kst = ks0 + st * stage_bytes;
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk) tc::wgmma_rs_tile<D, BC, T>(acc, da[kk], kst, kk);
    tc::wgmma_commit();
  };
  auto hand_over = [&] {  // the other warpgroup's turn
    if (wg == 0)
      tc::named_arrive(2, 256);
    else
      tc::named_arrive(1, 256);
  };

  tc::mbar_wait(bar.head(), 0);
  if (wg == 1) tc::named_arrive(1, 256);  // warpgroup 0 takes the first turn
  // Tile t of the block (over all passes, as tc::ws_produce loads them) is in stage t mod ST, its (t / ST)-th
  // use. Each pass ends its pipeline and releases its last stage.
  int st = 0;
  unsigned use = 0;
  const DocumentSpan span = a.mask.documents_of_rows(i0, i0 + rows);
  for (int doc = span.first; doc < span.last; ++doc) {
    mask = a.mask.rule(doc);
    j_begin = mask.key_begin(i0);
    j_end = mask.key_end(i0 + rows);
    if (j_begin >= j_end) continue;
    issue_s_dp(st, use, j_begin);
    hand_over();
    tc::wgmma_wait<0>();
    tc::wgmma_hold(s);
    tc::wgmma_hold(dp);
    ds_in_place(j_begin);
    pack();
    int prev = st;
    if (++st == ST) st = 0, ++use;
    for (long j0 = j_begin + BC; j0 < j_end; j0 += BC) {
      issue_s_dp(st, use, j0);
      issue_dq(prev);
      hand_over();
      tc::wgmma_wait<1>();  // S_t and dP_t; dQ += dS_{t-1}·K_{t-1} may still run
      tc::wgmma_hold(s);
      tc::wgmma_hold(dp);
      ds_in_place(j0);
      tc::wgmma_wait<0>();  // dQ += dS_{t-1}·K_{t-1}: its stage is free, da may be written
      tc::wgmma_hold(acc);
      tc::mbar_arrive(bar.empty(prev));
      pack();
      prev = st;
      if (++st == ST) st = 0, ++use;
    }
    tc::wgmma_fence();
    issue_dq(prev);
    tc::wgmma_wait<0>();
    tc::wgmma_hold(acc);
    tc::mbar_arrive(bar.empty(prev));  // the next pass's tiles may refill it
  }
  if (wg == 0) tc::named_sync(1, 256);  // warpgroup 1's last turn handed over: barrier 1 ends balanced

  OutT* qbase = a.dq + b * a.dq_s[0] + h * a.dq_s[2];
  const int r0 = wr0 + g, r1 = r0 + 8;
  tc::store_c_rows<D, T>(acc, a.scale, a.scale, r0 < row_end ? qbase + r0 * a.dq_s[1] : nullptr,
                         r1 < row_end ? qbase + r1 * a.dq_s[1] : nullptr, t4);
#else
  (void)a;
#if defined(__CUDA_ARCH__)
  __trap();  // not reachable: the plan runs this kernel only where wgmma_loaded says the sm_90a image is in
#endif
#endif
}

/// dq = scale · Σ_key dS·K for every query row, with the wgmma dQ kernel (the plan checked
/// wgmma_backward_problem).
template <int D, bool Softcap, class Args>
void wgmma_dq_launch_d(const Kokkos::Cuda& space, const Args& args) {
  using T = typename Args::T;
  using OutT = typename Args::dq_type::non_const_value_type;
  using WS = WgmmaWsDqShape<D>;
  WgmmaWsDqArgs<OutT> a;
  const long league = set_dq_args(a, args, WS::block_q);
  tma_maps_done(a.tma, tma_map_rows(a.tma, 0, args.q, WS::block_q) && tma_map_rows(a.tma, 1, args.d_o, WS::block_q) &&
                           tma_map_rows(a.tma, 2, args.k, WS::block_k) && tma_map_rows(a.tma, 3, args.v, WS::block_k));
  native_launch(space, "kfa::attention_backward::dq[tensor_core_wgmma,ws]", &tc_wgmma_ws_dq_kernel<D, Softcap, T, OutT>,
                league, dim3(32 * WS::warps), WS::smem, 1, a);
}
#endif  // KFA_HAS_TENSOR_CORES

/// Why the wgmma backward kernels (dK/dV and dQ) cannot run head dim d on this space's device ("" when they
/// can): head dim 64, 96, 128 or 256 (fused: 64), a compute capability 9.0 device running kfa's sm_90a image,
/// the shared memory.
template <class ExecSpace>
std::string wgmma_backward_problem(const ExecSpace& space, int d, bool fused) {
  if (!wgmma_space<ExecSpace>()) return wgmma_device_problem(space, 0, "the wgmma backward");
  if (!wgmma_backward_head_dim(d))
    return "head_dim = " + std::to_string(d) + " (the wgmma backward exists for 64, 96, 128 and 256)";
  if (fused && d != 64)
    return "opts.deterministic = false at head_dim = " + std::to_string(d) +
           " (the wgmma dK/dV kernel fuses dQ at 64 only; at 128 that was no faster than its two deterministic "
           "kernels)";
  const std::size_t smem = fused ? WgmmaBackwardShape<64, true>::smem : fa2_head_dim_switch(d, [](auto dc) {
    constexpr int D = decltype(dc)::value;
    return std::max(WgmmaBackwardShape<D>::smem, WgmmaWsDqShape<D>::smem);
  });
  return wgmma_device_problem(space, smem, "the wgmma backward");
}

}  // namespace detail
}  // namespace kfa
