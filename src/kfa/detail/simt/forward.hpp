#pragma once
/// simt/forward.hpp: the simt family's forward kernel.
/// The fp32 forward tuned for CUDA (what `automatic` runs for float on Kokkos::Cuda with head dim 64 or
/// 128; `portable` keeps the generic team kernel). Same FA2 algorithm, laid out for the SIMT units:
///
///   each thread owns ROWS query rows and a slice of HD = 64 / ROWS head dims of them (so D / HD lanes
///   share a row), with the pre-scaled Q slices and O accumulators in registers; K and V tiles stream
///   through level-0 scratch with 16-byte cp.async (V_j loads during the first scores, K_{j+1} during
///   the last P·V). The lanes of a warp that hold the same dim slice read the same K/V row at a time, so
///   scratch reads are 16-byte broadcasts, and the slices sit HD + 4 floats apart so a warp's distinct
///   addresses use distinct banks: one LDS.128 feeds 4 · ROWS FFMAs per lane. Scores are summed over the
///   lanes of a row with shuffles; the per-sub-block rescale is the shared combine rule (merge_factors).
#include <kfa/detail/cuda/mma.hpp>
#include <kfa/detail/mask.hpp>
#include <kfa/online_softmax.hpp>

#include <cstddef>
#include <cstdint>

namespace kfa {
namespace detail {

/// Tiles of the CUDA fp32 forward per head dim (64 or 128): threads per team, rows and head dims per thread,
/// block sizes and level-0 scratch. The kernel below walks keys in unrolled sub-blocks of 8 and is launched
/// with 2 teams per SM.
template <int D>
struct SimtForwardShape {
  static constexpr int threads = 128;
  static constexpr int rows_per_thread = 128 / D;     // two lanes per row at both head dims (measured best)
  static constexpr int slice = 64 / rows_per_thread;  // head dims per thread
  static constexpr int lanes_per_row = D / slice;
  static constexpr int block_q = threads / lanes_per_row * rows_per_thread;
  static constexpr int block_k = 4096 / D;                   // 32 KiB of K and V tiles (plus padding)
  static constexpr int pitch = lanes_per_row * (slice + 4);  // floats per scratch row, slices padded by 4
  static constexpr std::size_t scratch_l0 = 2u * block_k * pitch * 4;
};

#if defined(KOKKOS_ENABLE_CUDA)
template <int D, class Args>
struct SimtForwardKernel {
  using QV = typename Args::q_type;
  using KV = typename Args::k_type;
  using VV = typename Args::v_type;
  using OV = typename Args::o_type;
  using LV = typename Args::lse_type;
  using Shape = SimtForwardShape<D>;
  static constexpr int H = Shape::lanes_per_row, R = Shape::rows_per_thread, BQ = Shape::block_q, BK = Shape::block_k,
                       P = Shape::pitch;
  static constexpr int HD = Shape::slice;  // dims per thread
  static constexpr int SUB = 8;            // keys per unrolled sub-block
  using policy_type = Kokkos::TeamPolicy<Kokkos::Cuda, Kokkos::LaunchBounds<Shape::threads, 2>>;
  using member_type = typename policy_type::member_type;

  QV q;
  KV k;
  VV v;
  OV o;
  LV lse;
  int seq_q, heads_q, group;
  BlockOrder order;  // of the query blocks
  float scale, softcap;
  KeyMask mask;

  explicit SimtForwardKernel(const Args& a)
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

#if defined(__CUDA_ARCH__)
  /// BK × D floats (row r at src + r·stride) into scratch rows of pitch P, dim slices HD + 4 floats
  /// apart; rows ≥ valid zeroed.
  __device__ __forceinline__ static void load_tile(std::uint32_t dst, const float* src, long stride, int valid,
                                                   int tid) {
    constexpr int chunks = D / 4;
    for (int c = tid; c < BK * chunks; c += Shape::threads) {
      const int r = c / chunks, x = (c % chunks) * 4;
      const bool ok = r < valid;
      const int col = (x / HD) * (HD + 4) + x % HD;
      const std::uint32_t n = ok ? 16u : 0u;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst + (r * P + col) * 4u),
                   "l"(src + (ok ? r * stride : 0) + x), "r"(n));
    }
  }
#endif

  KOKKOS_FUNCTION void operator()(const member_type& team) const {
#if defined(__CUDA_ARCH__)
    const int tid = threadIdx.y * 32 + threadIdx.x;
    const int grp = tid / H, part = tid % H;
    const QueryBlock blk(team.league_rank(), order, heads_q, group, BQ, seq_q);
    const int b = blk.b, h = blk.h, hk = blk.hk, i0 = blk.i0, rows = blk.rows;
    if (rows <= 0) return;          // an empty block of a document-aligned launch (cuda/block_order.hpp)
    const int row_end = i0 + rows;  // rows past it are another block's (or past seq_q)
    int row[R];
#pragma unroll
    for (int r = 0; r < R; ++r) row[r] = i0 + grp + r * (BQ / R);
    const float ninf = -compat::infinity<float>();

    float* smem = static_cast<float*>(team.team_scratch(0).get_shmem(static_cast<std::size_t>(Shape::scratch_l0)));
    float* kt = smem;
    float* vt = smem + BK * P;
    const std::uint32_t ks = static_cast<std::uint32_t>(__cvta_generic_to_shared(kt));
    const std::uint32_t vs = static_cast<std::uint32_t>(__cvta_generic_to_shared(vt));
    const float* kbase = k.data() + b * k.stride(0) + hk * k.stride(2);
    const float* vbase = v.data() + b * v.stride(0) + hk * v.stride(2);
    const long kstride = static_cast<long>(k.stride(1)), vstride = static_cast<long>(v.stride(1));

    float qr[R][HD], acc[R][HD], m[R], l[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float4* src = row[r] < seq_q ? reinterpret_cast<const float4*>(&q(b, row[r], h, part * HD)) : nullptr;
#pragma unroll
      for (int c = 0; c < HD / 4; ++c) {
        const float4 x = src ? src[c] : make_float4(0.f, 0.f, 0.f, 0.f);
        qr[r][4 * c] = x.x * scale, qr[r][4 * c + 1] = x.y * scale, qr[r][4 * c + 2] = x.z * scale,
                  qr[r][4 * c + 3] = x.w * scale;
      }
#pragma unroll
      for (int c = 0; c < HD; ++c) acc[r][c] = 0.f;
      m[r] = ninf;
      l[r] = 0.f;
    }
    const int off = part * (HD + 4);  // this thread's dims within a scratch row

    // One pass per document the block's rows meet (one without documents), the row states carried across.
    const DocumentSpan span = this->mask.documents_of_rows(i0, i0 + rows);
    for (int doc = span.first; doc < span.last; ++doc) {
      const KeyRule mask = this->mask.rule(doc);
      const long j_begin = mask.key_begin(i0);
      const long j_end = mask.key_end(i0 + rows);
      if (j_begin < j_end)
        load_tile(ks, kbase + j_begin * kstride, kstride, static_cast<int>(j_end - j_begin < BK ? j_end - j_begin : BK),
                  tid);
      asm volatile("cp.async.commit_group;\n" ::);
      for (long j0 = j_begin; j0 < j_end; j0 += BK) {
        const int cols = (j_end - j0) < BK ? static_cast<int>(j_end - j0) : BK;
        asm volatile("cp.async.wait_group 0;\n" ::: "memory");
        __syncthreads();  // K_j is in; every thread is done with V_{j-1}
        load_tile(vs, vbase + j0 * vstride, vstride, cols, tid);
        asm volatile("cp.async.commit_group;\n" ::);

        const bool need_mask = cols < BK || !mask.all_visible(i0, i0 + rows, j0, j0 + BK);
        // The tile in sub-blocks of SUB keys (scores, softmax, P·V; each merged into the row's state with
        // the combine rule): a runtime loop with an unrolled body, because unrolling all BK keys overflowed
        // the instruction cache (ncu, 2026-11-29: "no instruction" stalls dominated).
        float sbuf[R][SUB];
        for (int jb = 0; jb < BK; jb += SUB) {
#pragma unroll
          for (int j = 0; j < SUB; ++j) {
            const float4* kr = reinterpret_cast<const float4*>(kt + (jb + j) * P + off);
            float a[R];
#pragma unroll
            for (int r = 0; r < R; ++r) a[r] = 0.f;
#pragma unroll
            for (int c = 0; c < HD / 4; ++c) {
              const float4 x = kr[c];
#pragma unroll
              for (int r = 0; r < R; ++r)
                a[r] += qr[r][4 * c] * x.x + qr[r][4 * c + 1] * x.y + qr[r][4 * c + 2] * x.z + qr[r][4 * c + 3] * x.w;
            }
#pragma unroll
            for (int r = 0; r < R; ++r) {
              float x = a[r];
#pragma unroll
              for (int w = 1; w < H; w *= 2) x += __shfl_xor_sync(0xffffffffu, x, w);
              if (softcap > 0.f) x = softcap * tanhf(x / softcap);
              if (need_mask && !(jb + j < cols && row[r] < i0 + rows && mask.visible(row[r], j0 + jb + j))) x = ninf;
              sbuf[r][j] = x;
            }
          }
          if (jb + SUB >= BK) {
            __syncthreads();  // every thread is done with K_j: K_{j+1} loads during this sub-block's P·V
            if (j0 + BK < j_end) {
              const long jn = j0 + BK;
              load_tile(ks, kbase + jn * kstride, kstride, static_cast<int>(j_end - jn < BK ? j_end - jn : BK), tid);
            }
            asm volatile("cp.async.commit_group;\n" ::);
          }
#pragma unroll
          for (int r = 0; r < R; ++r) {
            float tmax = ninf;
#pragma unroll
            for (int j = 0; j < SUB; ++j) tmax = fmaxf(tmax, sbuf[r][j]);
            const MergeFactors<float> f = merge_factors(m[r], tmax);
            m[r] = f.m;
            const float mexp = f.m == ninf ? 0.f : f.m;  // no visible key yet: exp(−inf) = 0, never NaN
            float sum = 0.f;
#pragma unroll
            for (int j = 0; j < SUB; ++j) {
              sbuf[r][j] = __expf(sbuf[r][j] - mexp);
              sum += sbuf[r][j];
            }
            l[r] = l[r] * f.scale_a + sum;
            if (f.scale_a != 1.f) {
#pragma unroll
              for (int c = 0; c < HD; ++c) acc[r][c] *= f.scale_a;
            }
          }
          if (jb == 0) {
            asm volatile("cp.async.wait_group 0;\n" ::: "memory");
            __syncthreads();  // V_j is in
          }
#pragma unroll
          for (int j = 0; j < SUB; ++j) {
            const float4* vr = reinterpret_cast<const float4*>(vt + (jb + j) * P + off);
#pragma unroll
            for (int c = 0; c < HD / 4; ++c) {
              const float4 x = vr[c];
#pragma unroll
              for (int r = 0; r < R; ++r) {
                const float p = sbuf[r][j];
                acc[r][4 * c] += p * x.x, acc[r][4 * c + 1] += p * x.y, acc[r][4 * c + 2] += p * x.z,
                    acc[r][4 * c + 3] += p * x.w;
              }
            }
          }
        }
      }
    }
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (row[r] >= row_end) continue;
      const float inv = l[r] == 0.f ? 0.f : 1.f / l[r];
      float4* dst = reinterpret_cast<float4*>(&o(b, row[r], h, part * HD));
#pragma unroll
      for (int c = 0; c < HD / 4; ++c)
        dst[c] =
            make_float4(acc[r][4 * c] * inv, acc[r][4 * c + 1] * inv, acc[r][4 * c + 2] * inv, acc[r][4 * c + 3] * inv);
      if (part == 0) lse(b, h, row[r]) = SoftmaxState<float>{m[r], l[r]}.lse();
    }
#else
    (void)team;
#endif
  }
};
#endif

}  // namespace detail
}  // namespace kfa
