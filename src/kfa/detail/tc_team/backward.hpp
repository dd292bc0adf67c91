#pragma once
/// tc_team/backward.hpp: the tc_team family's backward kernels (dK/dV, optionally with atomic dQ, and dQ).
/// The backward team kernels on tensor cores (Kokkos::Cuda, half/bfloat16, sm_80+). Same algorithm and
/// launches as portable/backward.hpp (D = rowsum(dO ∘ O) first, then a dK/dV kernel and a dQ kernel, no
/// atomics, bitwise reproducible), with every tile product on mma.sync and each warp owning 16 rows:
///
///   dK/dV (one block per batch, kv head, 64 keys): K and V in shared memory (A of Sᵀ = K·Qᵀ and of
///     dPᵀ = V·dOᵀ), Q and dO tiles (with their lse and D) streamed through two stages of shared
///     memory with cp.async; Pᵀ and dSᵀ go from the C layout straight into A fragments of dV += Pᵀ·dO and
///     dK += dSᵀ·Q; dK and dV stay in fp32 registers over every query head of the group and every visible
///     query tile. At d = 96 and 128 its two stages do not fit Kokkos' 40 KB team scratch: launched
///     natively (cuda/native.hpp) on the caller's stream; at d = 64 (one stage) a Kokkos team kernel.
///   dQ (one team per batch, query head, 64 queries): Q and dO in registers, K and V tiles streamed through
///     two stages of level-0 scratch; S = Q·Kᵀ, dP = dO·Vᵀ, dS = P ∘ (dP − D), dQ += dS·K.
/// Double-buffered (dK/dV at d > 64, dQ): the loads of tile t+1 are in flight while tile t is multiplied.
#include <kfa/detail/common/recompute.hpp>  // recompute_lse
#include <kfa/detail/cuda/mma.hpp>
#include <kfa/detail/cuda/recompute_p.hpp>
#include <kfa/detail/mask.hpp>

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace kfa {
namespace detail {

/// Tile shapes of the tensor-core backward per head dim: the owned block is 16 rows per warp, the
/// streamed block keeps registers below 255 per thread (and, for dQ, two stages within Kokkos' 40 KB of
/// level-0 scratch). d = 96 takes d = 128's tiles: dK/dV with 32-row Q/dO tiles in two stages (54 KB,
/// 59 KB fused; 64-row tiles would put Sᵀ, dPᵀ and the softcap factors in 96 registers next to dK and
/// dV's 96), dQ with 32-key tiles (64 would need 53 KB of team scratch). d = 64: dK/dV with 64-row Q/dO
/// tiles (32 fused) in one stage, dQ with 64-key tiles. Four warps per dK/dV block.
/// `Fused`: the dK/dV kernel also accumulates dQ with atomics (AttentionOptions::deterministic = false);
/// it then keeps dSᵀ of each step in shared memory as well, and at d = 64 streams 32-row query tiles so
/// that it stays within Kokkos' team scratch.
template <int D, bool Fused = false>
struct TcBackwardShape {
  static constexpr int warps = 4;  // dQ
  static constexpr int dkdv_warps = 4;
  static constexpr int pitch = D + 8;
  static constexpr int dkdv_block_k = 16 * dkdv_warps;  // owned keys
  static constexpr int dkdv_block_q = D > 64 ? 32 : Fused ? 32 : 64;
  static constexpr int dq_block_q = 16 * warps;        // owned query rows
  static constexpr int dq_block_k = D > 64 ? 32 : 64;  // streamed keys
  // dK/dV: V[bk] and K[bk], then stages of Q[bq] + dO[bq] tiles (16-bit, padded rows) and lse[bq] + D[bq]
  // (fp32). Two stages at d = 128 (70 KB, launched natively: 6% faster than a single-stage Kokkos kernel
  // on the H200) and at d = 96 (54 KB, natively); one at d = 64, so that it fits Kokkos' team scratch
  // (37 KB): launched natively, this body ran 50% slower on the H200 than under Kokkos, with one stage or
  // two.
  static constexpr int dkdv_stages = D > 64 ? 2 : 1;
  static constexpr std::size_t dkdv_stage = 2u * dkdv_block_q * pitch * 2 + 2u * dkdv_block_q * 4;
  static constexpr int ds_pitch = dkdv_block_q + 8;  // dSᵀ [key][query] of a step (Fused only)
  static constexpr std::size_t dkdv_ds = Fused ? std::size_t(dkdv_block_k) * ds_pitch * 2 : 0u;
  static constexpr std::size_t dkdv_scratch = 2u * dkdv_block_k * pitch * 2 + dkdv_stages * dkdv_stage + dkdv_ds;
  // dQ: two stages of K[bk] + V[bk]
  static constexpr std::size_t dq_stage = 2u * dq_block_k * pitch * 2;
  static constexpr std::size_t dq_scratch = 2u * dq_stage;
};

#if KFA_HAS_TENSOR_CORES
/// Softcap is a template parameter so that without it the 1 − tanh² factors take no registers. FuseDq:
/// also dQ += dS·K per step into `dq_acc` (fp32 [batch][seq_q][heads_q][D], zeroed; unscaled) with atomic
/// adds — dSᵀ goes through shared memory, each warp multiplies all query rows of the step by a quarter
/// of K's columns (tc_backward_launch_d converts dq_acc into dq).
template <int D, bool Softcap, bool FuseDq, class Args>
struct TcDkDvKernel {
  using QV = typename Args::q_type;
  using KV = typename Args::k_type;
  using VV = typename Args::v_type;
  using DOV = typename Args::do_type;
  using LV = typename Args::lse_type;
  using DV = typename Args::d_type;
  using DKV = typename Args::dk_type;
  using DVV = typename Args::dv_type;
  using T = typename QV::non_const_value_type;
  using Shape = TcBackwardShape<D, FuseDq>;
  static constexpr int WARPS = Shape::dkdv_warps, BK = Shape::dkdv_block_k, BQ = Shape::dkdv_block_q, P = Shape::pitch;
  static constexpr int MIN_BLOCKS = 8 / WARPS;  // launch bounds (either launch): 8 warps per SM

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

  TcDkDvKernel(const Args& a, float* dq_acc_ = nullptr)
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

  using policy_type = Kokkos::TeamPolicy<Kokkos::Cuda, Kokkos::LaunchBounds<32 * WARPS, MIN_BLOCKS>>;
  using member_type = typename policy_type::member_type;
  /// The Kokkos launch, where dkdv_scratch fits the team scratch (see tc_backward_launch_d).
  KOKKOS_FUNCTION void operator()(const member_type& team) const {
    run(team.league_rank(),
        static_cast<char*>(team.team_scratch(0).get_shmem(static_cast<std::size_t>(Shape::dkdv_scratch))));
  }
  /// The body of block `lr` (native_team_kernel or operator()), with Shape::dkdv_scratch bytes of shared
  /// memory at smem.
  KOKKOS_FUNCTION void run(int lr, char* smem) const {
#if KFA_TC_DEVICE
    const int lane = threadIdx.x, warp = threadIdx.y, tid = warp * 32 + lane;
    const int g = lane >> 2, t4 = lane & 3, mi = lane >> 3, mr = lane & 7;
    const KeyBlock blk(lr, order, heads_kv, BK, seq_k);
    const int hk = blk.hk, b = blk.b, k0 = blk.k0, keys = blk.keys;
    if (keys <= 0) return;           // an empty block of a document-aligned launch (cuda/block_order.hpp)
    const int wk0 = k0 + warp * 16;  // this warp's first key

    // V, K, then stage st at smem + 2·BK·P·2 + st·dkdv_stage: Q tile, dO tile, lse[BQ], D[BQ]; then
    // (FuseDq) dSᵀ [BK][DSP].
    const std::uint32_t vs = tc::smem_addr(smem), ks = vs + BK * P * 2;
    auto stage_at = [&](int st) { return smem + 2 * BK * P * 2 + st * Shape::dkdv_stage; };
    constexpr int DSP = Shape::ds_pitch;
    char* ds_smem = smem + 2 * BK * P * 2 + Shape::dkdv_stages * Shape::dkdv_stage;

    KeyRule mask;  // the pass's: one per document the block's keys meet (one without documents)
    long qb0 = 0, qb1 = 0;
    int n_qt = 0;
    const long qstride = static_cast<long>(q.stride(1)), dostride = static_cast<long>(d_o.stride(1));
    // The steps run over the visible query tiles (fastest) of each query head of the group. A step's
    // place is kept as counters advanced once per step (no divisions in the loop).
    struct Step {
      int qt, gh;  // query tile, query head within the group
      int hq, rows;
      long i;  // first query row
    };
    auto step_at = [&](int qt, int gh) {
      const long i = qb0 + static_cast<long>(qt) * BQ;
      return Step{qt, gh, hk * group + gh, static_cast<int>(qb1 - i < BQ ? qb1 - i : BQ), i};
    };
    auto after = [&](int qt, int gh) { return qt + 1 < n_qt ? step_at(qt + 1, gh) : step_at(0, gh + 1); };
    // Step c into stage st: Q and dO with cp.async; lse and D of its rows through registers, loaded
    // when the step is issued and stored into the stage only after the current step's products (so their
    // latency hides behind them; seen after the barrier that starts the step).
    static_assert(BQ <= 32 * WARPS, "one lse/D row per thread");
    struct RowPair {
      float lse, dd;
    };
    auto load_rows = [&](const Step& c) {
      const bool in = tid < c.rows;
      return RowPair{
          // lse × log2(e), as tc_recompute_p takes it
          in ? recompute_lse(static_cast<float>(lse(b, c.hq, c.i + tid))) * tc::log2e : compat::infinity<float>(),
          in ? static_cast<float>(dd(b, c.hq, c.i + tid)) : 0.f};
    };
    auto store_rows = [&](const RowPair& p, int st) {
      float* lse_s = reinterpret_cast<float*>(stage_at(st) + 2 * BQ * P * 2);
      if (tid < BQ) lse_s[tid] = p.lse, lse_s[BQ + tid] = p.dd;
    };
    const auto* qbase = q.data() + b * q.stride(0) + static_cast<long>(hk) * group * q.stride(2);
    const auto* dobase = d_o.data() + b * d_o.stride(0) + static_cast<long>(hk) * group * d_o.stride(2);
    auto issue = [&](const Step& c, int st) {
      char* sp = stage_at(st);
      const std::uint32_t qs = tc::smem_addr(sp), dos = qs + BQ * P * 2;
      tc::load_tile_async<D, BQ, 32 * WARPS>(
          qs, reinterpret_cast<const std::uint16_t*>(qbase + c.i * qstride + c.gh * q.stride(2)), qstride, c.rows, tid);
      tc::load_tile_async<D, BQ, 32 * WARPS>(
          dos, reinterpret_cast<const std::uint16_t*>(dobase + c.i * dostride + c.gh * d_o.stride(2)), dostride, c.rows,
          tid);
    };

    float dka[D / 8][4], dva[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) dka[n][e] = dva[n][e] = 0.f;

    // Row-major operands as B (non-transposed, like K in the forward) and as B of a k-major product
    // (transposed, like V in the forward); V as A (rows +0/+8 by lane bit 3, columns +0/+8 by bit 4).
    const std::uint32_t b_lane = static_cast<std::uint32_t>((((mi >> 1) * 8 + mr) * P + (mi & 1) * 8) * 2);
    const std::uint32_t bt_lane = static_cast<std::uint32_t>((((mi & 1) * 8 + mr) * P + (mi >> 1) * 8) * 2);
    const std::uint32_t a_lane = static_cast<std::uint32_t>(((warp * 16 + (mi & 1) * 8 + mr) * P + (mi >> 1) * 8) * 2);

    // K and V, with the first pass's first step. One pass per document the block's keys meet (one without
    // documents), dK and dV carried across; each pass starts its own pipeline (every stage is free between them).
    tc::load_tile_async<D, BK, 32 * WARPS>(
        vs, reinterpret_cast<const std::uint16_t*>(v.data() + b * v.stride(0) + k0 * v.stride(1) + hk * v.stride(2)),
        static_cast<long>(v.stride(1)), keys, tid);
    tc::load_tile_async<D, BK, 32 * WARPS>(
        ks, reinterpret_cast<const std::uint16_t*>(k.data() + b * k.stride(0) + k0 * k.stride(1) + hk * k.stride(2)),
        static_cast<long>(k.stride(1)), keys, tid);
    constexpr bool two = Shape::dkdv_stages == 2;
    const DocumentSpan span = this->mask.documents_of_keys(k0, k0 + keys);
    for (int doc = span.first; doc < span.last; ++doc) {
      mask = this->mask.rule(doc);
      qb0 = mask.query_begin(k0);
      qb1 = mask.query_end(k0 + keys, seq_q);
      n_qt = qb1 > qb0 ? static_cast<int>((qb1 - qb0 + BQ - 1) / BQ) : 0;
      const int steps = n_qt * group;
      if (steps == 0) continue;
      issue(step_at(0, 0), 0);
      store_rows(load_rows(step_at(0, 0)), 0);
      tc::cp_async_commit();
      int qt = 0, gh = 0;  // the current step's place (the only loop state besides `step`)
      for (int step = 0; step < steps; ++step) {
        const Step cur = step_at(qt, gh);
        const long i0 = cur.i;
        const int rows = cur.rows;
        const int st = two ? step & 1 : 0;
        const bool next = step + 1 < steps;
        RowPair next_rows{0.f, 0.f};
        if (two) {
          if (next) {
            const Step nxt = after(qt, gh);
            issue(nxt, st ^ 1);
            next_rows = load_rows(nxt);
          }
          tc::cp_async_commit();
          tc::cp_async_wait_1();  // all but the group just issued
        } else {
          tc::cp_async_wait_all();
        }
        __syncthreads();  // this step's Q, dO (and V) tiles, lse and D are in
        char* sp = stage_at(st);
        const std::uint32_t qs = tc::smem_addr(sp), dos = qs + BQ * P * 2;
        const float* lse_s = reinterpret_cast<const float*>(sp + 2 * BQ * P * 2);
        const float* dd_s = lse_s + BQ;

        // Sᵀ[key][query] = K·Qᵀ
        float s[BQ / 8][4];
#pragma unroll
        for (int n = 0; n < BQ / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          std::uint32_t ka[4];  // K rows of this warp as A, from shared memory (rows past seq_k are zeros)
          tc::ldmatrix_x4(ka, ks + a_lane + static_cast<std::uint32_t>(kk * 16 * 2));
#pragma unroll
          for (int n = 0; n < BQ / 8; n += 2) {
            std::uint32_t bf[4];
            tc::ldmatrix_x4(bf, qs + b_lane + static_cast<std::uint32_t>((n * 8 * P + kk * 16) * 2));
            tc::mma<T>(s[n], ka, bf[0], bf[1]);
            tc::mma<T>(s[n + 1], ka, bf[2], bf[3]);
          }
        }
        float dcap[BQ / 8][4];
        // Masked tiles take a second copy of the pass, in which each key's visible queries are one range of
        // the tile (the common tile tests nothing per element).
        auto p_pass = [&](auto masked) {
          constexpr bool Masked = decltype(masked)::value;
          int lo[2] = {0, 0}, hi[2] = {BQ - 1, BQ - 1};  // visible queries of keys g and g + 8, tile-local
          if (Masked) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const long j = wk0 + g + h * 8;
              long first, last;  // the queries that see key j, tile-local
              mask.seen_by(j, seq_q, first, last);
              first -= i0, last -= i0;
              lo[h] = static_cast<int>(first < 0 ? 0 : (first > BQ ? BQ : first));
              hi[h] = static_cast<int>(j >= seq_k || last < 0 ? -1 : (last > rows - 1 ? rows - 1 : last));
            }
          }
#pragma unroll
          for (int n = 0; n < BQ / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int qq = n * 8 + 2 * t4 + (e & 1);
              const bool vis = !Masked || (qq >= lo[e >> 1] && qq <= hi[e >> 1]);
              s[n][e] = tc_recompute_p<Softcap, D == 64>(s[n][e], pc, lse_s[qq], vis, dcap[n][e]);  // now Pᵀ
            }
        };
        if (rows < BQ || keys < BK || !mask.all_visible(i0, i0 + BQ, k0, k0 + BK))
          p_pass(std::true_type{});
        else
          p_pass(std::false_type{});
          // dV += Pᵀ·dO
#pragma unroll
        for (int kk = 0; kk < BQ / 16; ++kk) {
          std::uint32_t pa[4];
          tc::c_to_a<T>(pa, s, kk);
#pragma unroll
          for (int n = 0; n < D / 8; n += 2) {
            std::uint32_t bf[4];
            tc::ldmatrix_x4_trans(bf, dos + bt_lane + static_cast<std::uint32_t>((kk * 16 * P + n * 8) * 2));
            tc::mma<T>(dva[n], pa, bf[0], bf[1]);
            tc::mma<T>(dva[n + 1], pa, bf[2], bf[3]);
          }
        }
        // dPᵀ[key][query] = V·dOᵀ, then dSᵀ = Pᵀ ∘ (dPᵀ − D) ∘ softcap' and dK += dSᵀ·Q, in DPH
        // parts of the step's query rows (d = 128: two, so that dPᵀ takes 8 registers next to dK and dV's 128,
        // Pᵀ and the softcap factors; V's fragments are then read once per part. In one part the softcap
        // instances spilled 4 B: ptxas, CUDA 13.0, sm_90).
        constexpr int DPH = D == 128 ? BQ / 16 : 1, DPN = BQ / 8 / DPH;  // parts, n-tiles per part
#pragma unroll
        for (int h = 0; h < DPH; ++h) {
          float dp[DPN][4];
#pragma unroll
          for (int n = 0; n < DPN; ++n) dp[n][0] = dp[n][1] = dp[n][2] = dp[n][3] = 0.f;
#pragma unroll
          for (int kk = 0; kk < D / 16; ++kk) {
            std::uint32_t va[4];
            tc::ldmatrix_x4(va, vs + a_lane + static_cast<std::uint32_t>(kk * 16 * 2));
#pragma unroll
            for (int n = 0; n < DPN; n += 2) {
              std::uint32_t bf[4];
              tc::ldmatrix_x4(bf, dos + b_lane + static_cast<std::uint32_t>(((h * DPN + n) * 8 * P + kk * 16) * 2));
              tc::mma<T>(dp[n], va, bf[0], bf[1]);
              tc::mma<T>(dp[n + 1], va, bf[2], bf[3]);
            }
          }
#pragma unroll
          for (int n = 0; n < DPN; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int m = h * DPN + n;
              s[m][e] = s[m][e] * (dp[n][e] - dd_s[m * 8 + 2 * t4 + (e & 1)]) * dcap[m][e];
            }
#pragma unroll
          for (int kk = h * DPN / 2; kk < (h + 1) * DPN / 2; ++kk) {
            std::uint32_t da[4];
            tc::c_to_a<T>(da, s, kk);
            if (FuseDq) {  // dSᵀ rows of this warp's keys, for dQ below (columns kk·16 … kk·16 + 15)
              std::uint32_t* r0 =
                  reinterpret_cast<std::uint32_t*>(ds_smem + ((warp * 16 + g) * DSP + kk * 16 + 2 * t4) * 2);
              std::uint32_t* r1 = r0 + 8 * DSP / 2;
              r0[0] = da[0], r1[0] = da[1], r0[4] = da[2], r1[4] = da[3];
            }
#pragma unroll
            for (int n = 0; n < D / 8; n += 2) {
              std::uint32_t bf[4];
              tc::ldmatrix_x4_trans(bf, qs + bt_lane + static_cast<std::uint32_t>((kk * 16 * P + n * 8) * 2));
              tc::mma<T>(dka[n], da, bf[0], bf[1]);
              tc::mma<T>(dka[n + 1], da, bf[2], bf[3]);
            }
          }
        }
        // With FuseDq, before its dQ products: the two registers are free for them (d = 128 spilled otherwise).
        if (FuseDq && two && next) store_rows(next_rows, st ^ 1);
        if constexpr (FuseDq) {
          __syncthreads();  // every warp's dSᵀ rows are in
          accumulate_dq(ds_smem, ks, b, hk * group + gh, i0, rows, warp, lane);
        }
        if (!FuseDq && two && next) store_rows(next_rows, st ^ 1);
        __syncthreads();  // every warp is done with this stage before it is refilled; step + 1's lse, D are in
        if (!two && next) {
          const Step nxt = after(qt, gh);
          issue(nxt, 0);
          tc::cp_async_commit();
          store_rows(load_rows(nxt), 0);  // seen after the barrier that starts step + 1
        }
        if (++qt == n_qt) qt = 0, ++gh;
      }
    }
    tc::cp_async_wait_all();

    const int r0 = wk0 + g, r1 = wk0 + g + 8;
    tc::store_c_rows<D, T>(dka, scale, scale, r0 < k0 + keys ? &dk(b, r0, hk, 0) : nullptr,
                           r1 < k0 + keys ? &dk(b, r1, hk, 0) : nullptr, t4);
    tc::store_c_rows<D, T>(dva, 1.f, 1.f, r0 < k0 + keys ? &dv(b, r0, hk, 0) : nullptr,
                           r1 < k0 + keys ? &dv(b, r1, hk, 0) : nullptr, t4);
#else
    (void)lr, (void)smem;
    Kokkos::abort("kfa: the tensor-core backward kernel ran on a device without sm_80 tensor cores");
#endif
  }

#if KFA_TC_DEVICE
  /// dq_acc[b][i0 + r][hq][c] += Σ_key dS[r][key] · K[key][c] for this step's `rows` query rows: warp w
  /// takes columns w·D/WARPS … of every row (D/WARPS/8 n-tiles: 2 at d = 64, 3 at d = 96, 4 at d = 128; an
  /// odd last one takes a two-matrix ldmatrix); dS from its transpose in shared memory (ldmatrix.trans), K
  /// as the row-major B operand (as dO in dV += Pᵀ·dO). Atomic adds of float pairs (vector adds on sm_90).
  __device__ __forceinline__ void accumulate_dq(const char* ds_smem, std::uint32_t ks, int b, int hq, long i0, int rows,
                                                int warp, int lane) const {
    constexpr int DSP = Shape::ds_pitch, MT = BQ / 16, DN = D / WARPS, NT = DN / 8;
    static_assert(D % (8 * WARPS) == 0, "whole 8-column n-tiles per warp");
    const int g = lane >> 2, t4 = lane & 3, mi = lane >> 3, mr = lane & 7;
    float acc[MT][NT][4];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int n = 0; n < NT; ++n) acc[m][n][0] = acc[m][n][1] = acc[m][n][2] = acc[m][n][3] = 0.f;
    const std::uint32_t ds = tc::smem_addr(ds_smem);
    // A = dS (query × key) is dSᵀ (key × query) transposed: matrix mi holds keys +8·(mi ≥ 2), queries
    // +8·(mi odd). B = K (key × column) as in the dK/dV products above.
    const std::uint32_t a_lane = static_cast<std::uint32_t>((((mi >> 1) * 8 + mr) * DSP + (mi & 1) * 8) * 2);
    const std::uint32_t bt_lane = static_cast<std::uint32_t>((((mi & 1) * 8 + mr) * P + (mi >> 1) * 8) * 2);
    // Not unrolled: unrolled, the d = 128 instance spilled 4-16 B (ptxas, CUDA 13.0, sm_80 to sm_90).
#pragma unroll 1
    for (int kk = 0; kk < BK / 16; ++kk) {
      std::uint32_t a[MT][4];
#pragma unroll
      for (int m = 0; m < MT; ++m)
        tc::ldmatrix_x4_trans(a[m], ds + a_lane + static_cast<std::uint32_t>((kk * 16 * DSP + m * 16) * 2));
#pragma unroll
      for (int n = 0; n + 1 < NT; n += 2) {
        std::uint32_t bf[4];
        tc::ldmatrix_x4_trans(bf, ks + bt_lane + static_cast<std::uint32_t>((kk * 16 * P + warp * DN + n * 8) * 2));
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          tc::mma<T>(acc[m][n], a[m], bf[0], bf[1]);
          tc::mma<T>(acc[m][n + 1], a[m], bf[2], bf[3]);
        }
      }
      if constexpr (NT % 2 == 1) {  // matrices 0 and 1 of the x4 layout: keys +0 and +8 of one n-tile
        std::uint32_t bf[2];
        tc::ldmatrix_x2_trans(bf,
                              ks + bt_lane + static_cast<std::uint32_t>((kk * 16 * P + warp * DN + (NT - 1) * 8) * 2));
#pragma unroll
        for (int m = 0; m < MT; ++m) tc::mma<T>(acc[m][NT - 1], a[m], bf[0], bf[1]);
      }
    }
    const long heads_q = static_cast<long>(heads_kv) * group;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = m * 16 + g + h * 8;
        if (r >= rows) continue;
        float* dst = dq_acc + ((static_cast<long>(b) * seq_q + i0 + r) * heads_q + hq) * D + warp * DN + 2 * t4;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#if __CUDA_ARCH__ >= 900
          atomicAdd(reinterpret_cast<float2*>(dst + n * 8), make_float2(acc[m][n][2 * h], acc[m][n][2 * h + 1]));
#else
          atomicAdd(dst + n * 8, acc[m][n][2 * h]);
          atomicAdd(dst + n * 8 + 1, acc[m][n][2 * h + 1]);
#endif
        }
      }
  }
#endif
};

template <int D, bool Softcap, class Args>
struct TcDqKernel {
  using QV = typename Args::q_type;
  using KV = typename Args::k_type;
  using VV = typename Args::v_type;
  using DOV = typename Args::do_type;
  using LV = typename Args::lse_type;
  using DV = typename Args::d_type;
  using DQV = typename Args::dq_type;
  using T = typename QV::non_const_value_type;
  using Shape = TcBackwardShape<D>;
  static constexpr int WARPS = Shape::warps, BQ = Shape::dq_block_q, BK = Shape::dq_block_k, P = Shape::pitch;
  using policy_type = Kokkos::TeamPolicy<Kokkos::Cuda, Kokkos::LaunchBounds<32 * WARPS, 2>>;
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
  float scale;
  TcRecomputeConsts pc;
  KeyMask mask;

  explicit TcDqKernel(const Args& a)
      : q(a.q),
        k(a.k),
        v(a.v),
        d_o(a.d_o),
        lse(a.lse),
        dd(a.dd),
        dq(a.dq),
        seq_q(static_cast<int>(a.q.extent(1))),
        heads_q(static_cast<int>(a.q.extent(2))),
        group(static_cast<int>(a.q.extent(2) / a.k.extent(2))),
        order(query_block_order(a, BQ)),
        scale(a.scale),
        pc(a.scale, a.softcap),
        mask(a.mask) {}

  KOKKOS_FUNCTION void operator()(const member_type& team) const {
#if KFA_TC_DEVICE
    const int lane = threadIdx.x, warp = threadIdx.y, tid = warp * 32 + lane;
    const int g = lane >> 2, t4 = lane & 3, mi = lane >> 3, mr = lane & 7;
    const QueryBlock blk(team.league_rank(), order, heads_q, group, BQ, seq_q);
    const int b = blk.b, h = blk.h, hk = blk.hk, i0 = blk.i0, rows = blk.rows;
    if (rows <= 0) return;          // an empty block of a document-aligned launch (cuda/block_order.hpp)
    const int row_end = i0 + rows;  // rows past it are another block's (or past seq_q)
    const int wr0 = i0 + warp * 16;

    char* smem = static_cast<char*>(team.team_scratch(0).get_shmem(static_cast<std::size_t>(Shape::dq_scratch)));
    // Stage st: K tile at ks0 + st·dq_stage, V tile right after it.
    const std::uint32_t ks0 = tc::smem_addr(smem);
    const std::uint16_t* kbase = reinterpret_cast<const std::uint16_t*>(k.data() + b * k.stride(0) + hk * k.stride(2));
    const std::uint16_t* vbase = reinterpret_cast<const std::uint16_t*>(v.data() + b * v.stride(0) + hk * v.stride(2));
    const long kstride = static_cast<long>(k.stride(1)), vstride = static_cast<long>(v.stride(1));

    auto issue = [&](long j0, long j_end, int st) {
      const int cols = static_cast<int>(j_end - j0 < BK ? j_end - j0 : BK);
      const std::uint32_t ks = ks0 + st * static_cast<std::uint32_t>(Shape::dq_stage);
      tc::load_tile_async<D, BK, 32 * WARPS>(ks, kbase + j0 * kstride, kstride, cols, tid);
      tc::load_tile_async<D, BK, 32 * WARPS>(ks + BK * P * 2, vbase + j0 * vstride, vstride, cols, tid);
    };

    const int r0 = wr0 + g, r1 = wr0 + g + 8;
    std::uint32_t qa[D / 16][4], oa[D / 16][4];
    tc::load_a_rows<D>(qa, r0 < seq_q ? &q(b, r0, h, 0) : nullptr, r1 < seq_q ? &q(b, r1, h, 0) : nullptr, t4);
    tc::load_a_rows<D>(oa, r0 < seq_q ? &d_o(b, r0, h, 0) : nullptr, r1 < seq_q ? &d_o(b, r1, h, 0) : nullptr, t4);
    const float lse_r[2] = {
        // × log2(e), as tc_recompute_p takes it
        r0 < row_end ? recompute_lse(static_cast<float>(lse(b, h, r0))) * tc::log2e : compat::infinity<float>(),
        r1 < row_end ? recompute_lse(static_cast<float>(lse(b, h, r1))) * tc::log2e : compat::infinity<float>()};
    const float dd_r[2] = {r0 < row_end ? static_cast<float>(dd(b, h, r0)) : 0.f,
                           r1 < row_end ? static_cast<float>(dd(b, h, r1)) : 0.f};
    float dqa[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) dqa[n][0] = dqa[n][1] = dqa[n][2] = dqa[n][3] = 0.f;

    const std::uint32_t b_lane = static_cast<std::uint32_t>((((mi >> 1) * 8 + mr) * P + (mi & 1) * 8) * 2);
    const std::uint32_t bt_lane = static_cast<std::uint32_t>((((mi & 1) * 8 + mr) * P + (mi >> 1) * 8) * 2);

    // One pass per document the block's rows meet (one without documents), dQ carried across; each pass starts
    // its own pipeline (its first tile in the next stage).
    int st = 0;
    const DocumentSpan span = this->mask.documents_of_rows(i0, i0 + rows);
    for (int doc = span.first; doc < span.last; ++doc) {
      const KeyRule mask = this->mask.rule(doc);
      const long j_begin = mask.key_begin(i0);
      const long j_end = mask.key_end(i0 + rows);
      if (j_begin < j_end) issue(j_begin, j_end, st);
      tc::cp_async_commit();
      for (long j0 = j_begin; j0 < j_end; j0 += BK, st ^= 1) {
        const int cols = (j_end - j0) < BK ? static_cast<int>(j_end - j0) : BK;
        if (j0 + BK < j_end) issue(j0 + BK, j_end, st ^ 1);
        tc::cp_async_commit();
        tc::cp_async_wait_1();  // all but the group just issued
        __syncthreads();        // K_j, V_j are in
        const std::uint32_t ks = ks0 + st * static_cast<std::uint32_t>(Shape::dq_stage), vs = ks + BK * P * 2;
        float s[BK / 8][4], dp[BK / 8][4];
#pragma unroll
        for (int n = 0; n < BK / 8; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
          for (int n = 0; n < BK / 8; n += 2) {
            std::uint32_t bk[4], bv[4];
            tc::ldmatrix_x4(bk, ks + b_lane + static_cast<std::uint32_t>((n * 8 * P + kk * 16) * 2));
            tc::ldmatrix_x4(bv, vs + b_lane + static_cast<std::uint32_t>((n * 8 * P + kk * 16) * 2));
            tc::mma<T>(s[n], qa[kk], bk[0], bk[1]);
            tc::mma<T>(s[n + 1], qa[kk], bk[2], bk[3]);
            tc::mma<T>(dp[n], oa[kk], bv[0], bv[1]);
            tc::mma<T>(dp[n + 1], oa[kk], bv[2], bv[3]);
          }
        // Masked tiles take a second copy of the pass, in which each row's visible keys are one range of
        // the tile (the common tile tests nothing per element).
        auto ds_pass = [&](auto masked) {
          constexpr bool Masked = decltype(masked)::value;
          int lo[2] = {0, 0}, hi[2] = {BK - 1, BK - 1};  // visible keys of rows g and g + 8, tile-local
          if (Masked) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              long first, last;
              mask.visible_range(wr0 + g + h * 8, first, last);
              lo[h] = static_cast<int>(first - j0 < 0 ? 0 : (first - j0 > BK ? BK : first - j0));
              hi[h] = static_cast<int>(last - j0 < -1 ? -1 : (last - j0 > cols - 1 ? cols - 1 : last - j0));
            }
          }
#pragma unroll
          for (int n = 0; n < BK / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int jj = n * 8 + 2 * t4 + (e & 1);
              const bool vis = !Masked || (jj >= lo[e >> 1] && jj <= hi[e >> 1]);
              float dcap;
              const float p = tc_recompute_p<Softcap>(s[n][e], pc, lse_r[e >> 1], vis, dcap);
              s[n][e] = p * (dp[n][e] - dd_r[e >> 1]) * dcap;  // dS
            }
        };
        if (cols < BK || !mask.all_visible(i0, i0 + rows, j0, j0 + BK))
          ds_pass(std::true_type{});
        else
          ds_pass(std::false_type{});
          // dQ += dS·K
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
          std::uint32_t da[4];
          tc::c_to_a<T>(da, s, kk);
#pragma unroll
          for (int n = 0; n < D / 8; n += 2) {
            std::uint32_t bf[4];
            tc::ldmatrix_x4_trans(bf, ks + bt_lane + static_cast<std::uint32_t>((kk * 16 * P + n * 8) * 2));
            tc::mma<T>(dqa[n], da, bf[0], bf[1]);
            tc::mma<T>(dqa[n + 1], da, bf[2], bf[3]);
          }
        }
        __syncthreads();  // every warp is done with this stage before tile j + 2 refills it
      }
    }
    tc::cp_async_wait_all();
    tc::store_c_rows<D, T>(dqa, scale, scale, r0 < row_end ? &dq(b, r0, h, 0) : nullptr,
                           r1 < row_end ? &dq(b, r1, h, 0) : nullptr, t4);
#else
    (void)team;
    Kokkos::abort("kfa: the tensor-core backward kernel ran on a device without sm_80 tensor cores");
#endif
  }
};
#endif

}  // namespace detail
}  // namespace kfa
