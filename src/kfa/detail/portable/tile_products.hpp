#pragma once
/// portable/tile_products.hpp: the portable family's tile products.
/// C[m×n] = A[m×k]·B[k×n] (+ C) on tiles in team scratch, split over the team's threads
/// as register-blocked micro-tiles. A is addressed through (row, column) strides so the same routine
/// serves S = K·Qᵀ (A = the K tile, row-major) and O += P·V (A = Pᵀ as stored, i.e. column-major);
/// B and C are row-major.
///
/// This is the customization point for tile products. On host backends the micro-tile is written with
/// GCC/Clang vector extensions whose width is the ISA's register (common/host_simd.hpp: 64 bytes on AVX-512,
/// 32 on AVX2, 16 on SSE2/NEON), with a register blocking per ISA, and the ISA is chosen at run time on x86-64;
/// on device backends each thread owns a small scalar micro-tile. A vendor path (tensor cores on CUDA)
/// plugs in beside these and is chosen by TileProductPath; the portable path always exists.
#include <kfa/compat.hpp>
#include <kfa/detail/common/host_simd.hpp>

#include <type_traits>

namespace kfa {
namespace detail {

/// Register-block shape per backend for the scalar micro-tiles: GPU threads are many and register-poor,
/// so 2 × 4 scalars each (host SIMD blocking: HostBlocking below). `lanes` is the width of a step of the
/// kernels' element-wise loops over query rows: one row per thread on device; on host 16 rows, vectorized (16
/// floats fill an AVX-512 register; with 8-row steps the forward's softmax passes took 1.6-2.1x as long on an
/// Intel Xeon core). Tiles are multiples of 8 rows, so a tile's last step may be `tail_lanes` rows wide.
template <class ExecSpace>
struct MicroTileShape {
  static constexpr bool host =
      Kokkos::SpaceAccessibility<Kokkos::HostSpace, typename ExecSpace::memory_space>::accessible;
  static constexpr int rows = host ? 8 : 2;
  static constexpr int lanes = host ? 16 : 1;
  static constexpr int tail_lanes = host ? 8 : 1;
};

/// The portable family's team launches. Host backends hand teams out dynamically (Kokkos' work stealing): under
/// a causal mask a query block's work grows with its index, and the static split gave each thread a contiguous
/// run of the league, so with one head on two OpenMP threads one thread had three quarters of the causal forward
/// (Zen 4, N 4096/8192: 100-116 GFLOP/s against 173-178 now). Devices keep the default schedule.
template <class ExecSpace>
using team_policy =
    std::conditional_t<MicroTileShape<ExecSpace>::host,
                       Kokkos::TeamPolicy<ExecSpace, Kokkos::Schedule<Kokkos::Dynamic>>, Kokkos::TeamPolicy<ExecSpace>>;

/// The element-wise steps over a tile of n rows (n a multiple of tail_lanes): lane_steps of them; step s calls
/// f(w, first row) with w a std::integral_constant of its width, `lanes` or, for a shorter last step,
/// `tail_lanes`. Host bodies call it inside with_host_isa() with f marked KFA_SIMD_BODY.
template <class ExecSpace>
KOKKOS_INLINE_FUNCTION constexpr int lane_steps(int n) {
  return (n + MicroTileShape<ExecSpace>::lanes - 1) / MicroTileShape<ExecSpace>::lanes;
}
template <class ExecSpace, class F>
KOKKOS_FORCEINLINE_FUNCTION void lane_step(int s, int n, const F& f) {
  using Shape = MicroTileShape<ExecSpace>;
  const int i = s * Shape::lanes;
  if constexpr (Shape::lanes == Shape::tail_lanes) {
    f(std::integral_constant<int, Shape::lanes>{}, i);
  } else {
    if (i + Shape::lanes <= n)
      f(std::integral_constant<int, Shape::lanes>{}, i);
    else
      f(std::integral_constant<int, Shape::tail_lanes>{}, i);
  }
}

/// dst[c] = scale · x(b, i, h, c) for c < d (a row of a rank-4 [batch, seq, heads, d] View into a tile): on
/// host through a pointer where the head dim is contiguous, a loop the compiler vectorizes; element by element
/// elsewhere.
template <class ExecSpace, class V, class Acc>
KOKKOS_FORCEINLINE_FUNCTION void load_row(Acc* dst, const V& x, int b, long i, int h, int d, Acc scale) {
  if constexpr (MicroTileShape<ExecSpace>::host) {
    if (x.stride(3) == 1) {
      const auto* src = &x(b, i, h, 0);
      for (int c = 0; c < d; ++c) dst[c] = static_cast<Acc>(src[c]) * scale;
      return;
    }
  }
  for (int c = 0; c < d; ++c) dst[c] = static_cast<Acc>(x(b, i, h, c)) * scale;
}

/// Asks the host's caches for n elements at p, to be used a tile later (into L2); nothing on devices.
template <class ExecSpace, class E>
KOKKOS_FORCEINLINE_FUNCTION void prefetch_span(const E* p, int n) {
#if KFA_HOST_VECTOR_EXT
  if constexpr (MicroTileShape<ExecSpace>::host) {
    const char* const bytes = reinterpret_cast<const char*>(p);
    const long len = static_cast<long>(n) * static_cast<long>(sizeof(E));
    for (long at = 0; at < len; at += 64) __builtin_prefetch(bytes + at, 0, 2);
  }
#else
  (void)p, (void)n;
#endif
}

/// Asks the host's caches for row (b, i, h, ·) of x, d elements, to be read a tile later (into L2: the row is
/// used after a tile's products, by which time an L1 prefetch would be gone). Host backends with a contiguous
/// head dim only; nothing elsewhere. The K/V rows of the next tile come from L3 or memory with a stride of
/// heads·d between rows, which the hardware prefetchers do not run ahead of.
template <class ExecSpace, class V>
KOKKOS_FORCEINLINE_FUNCTION void prefetch_row(const V& x, int b, long i, int h, int d) {
  if constexpr (MicroTileShape<ExecSpace>::host)
    if (x.stride(3) == 1) prefetch_span<ExecSpace>(&x(b, i, h, 0), d);
}

/// One RI×RJ block of C = A·B (+C), scalar code (device threads, and any shape on host).
template <int RI, int RJ, class Acc>
KOKKOS_INLINE_FUNCTION void micro_tile_scalar(const Acc* a, long a_rs, long a_cs, const Acc* b, int ldb, Acc* c,
                                              int ldc, int kdim, bool accumulate) {
  Acc acc[RI][RJ];
  for (int r = 0; r < RI; ++r)
    for (int j = 0; j < RJ; ++j) acc[r][j] = accumulate ? c[r * ldc + j] : Acc(0);
  for (int kk = 0; kk < kdim; ++kk) {
    const Acc* brow = b + static_cast<long>(kk) * ldb;
    const Acc* acol = a + kk * a_cs;
#if KFA_HOST_VECTOR_EXT
    // Hide the column's address from the loop vectorizer: GCC 12.2 at -O3 (AVX2 or AVX-512 targets) vectorizes
    // this kk loop with loads of columns kk .. kk + 3 for column kk alone, reading up to three columns of A past
    // kdim: a segmentation fault where the tile ends the heap (perf/raw_gcc_overread_2026-12-07 reproduces it).
    __asm__("" : "+r"(acol));
#endif
    for (int r = 0; r < RI; ++r) {
      const Acc av = acol[r * a_rs];
      for (int j = 0; j < RJ; ++j) acc[r][j] += av * brow[j];
    }
  }
  for (int r = 0; r < RI; ++r)
    for (int j = 0; j < RJ; ++j) c[r * ldc + j] = acc[r][j];
}

/// Walks the (m/RI)·(n/RJ) micro-tiles of C over the team's threads, calling f(i0, j0) for each.
template <int RI, int RJ, class Member, class F>
KOKKOS_INLINE_FUNCTION void team_gemm_tiles(const Member& team, int m, int n, const F& f) {
  const int tiles_j = n / RJ;
  const int tiles = (m / RI) * tiles_j;
  Kokkos::parallel_for(Kokkos::TeamThreadRange(team, tiles),
                       [&](const int t) { f((t / tiles_j) * RI, (t % tiles_j) * RJ); });
}

/// C = A·B (+C) in scalar RI×RJ micro-tiles (device threads; host shapes the SIMD blocking cannot take).
template <int RI, int RJ, class Member, class Acc>
KOKKOS_INLINE_FUNCTION void team_gemm_fixed(const Member& team, int m, int n, int kdim, const Acc* a, long a_rs,
                                            long a_cs, const Acc* b, int ldb, Acc* c, int ldc, bool accumulate) {
  team_gemm_tiles<RI, RJ>(team, m, n, [&](int i0, int j0) {
    micro_tile_scalar<RI, RJ>(a + i0 * a_rs, a_rs, a_cs, b + j0, ldb, c + i0 * ldc + j0, ldc, kdim, accumulate);
  });
}

#if KFA_HOST_VECTOR_EXT
/// A VB-byte vector of Acc (VB = 16, 32 or 64); the unaligned, may-alias variant is how compilers' own
/// intrinsics load. Used only inside functions compiled for an ISA whose registers are VB bytes wide.
template <int VB, class Acc>
struct Simd {
  typedef Acc type __attribute__((vector_size(VB)));
  typedef Acc unaligned __attribute__((vector_size(VB), aligned(alignof(Acc)), __may_alias__));
  static constexpr int width = VB / static_cast<int>(sizeof(Acc));
};

/// One RI × (NV·width) block of C = A·B (+C) held in NV·RI vector registers. Always inlined into the
/// ISA-specific wrappers below, which decide the instructions. `Accumulate` is a template argument so that each
/// form starts its accumulators straight in registers (a run-time choice made GCC 12 stage them on the stack).
template <int RI, int NV, int VB, bool Accumulate, class Acc>
__attribute__((always_inline)) inline void micro_tile_simd(const Acc* a, long a_rs, long a_cs, const Acc* b, int ldb,
                                                           Acc* c, int ldc, int kdim) {
  using V = typename Simd<VB, Acc>::type;
  using U = typename Simd<VB, Acc>::unaligned;
  constexpr int W = Simd<VB, Acc>::width;
  V acc[RI][NV];
  for (int r = 0; r < RI; ++r)
    for (int v = 0; v < NV; ++v) {
      if constexpr (Accumulate)
        acc[r][v] = *reinterpret_cast<const U*>(c + r * ldc + v * W);
      else
        acc[r][v] = V{};
    }
  int kk = 0;
  do {  // kdim ≥ 1 (a tile's extent): no path where the accumulators skip the loop and go through memory
    const Acc* brow = b + static_cast<long>(kk) * ldb;
    V bv[NV];
    for (int v = 0; v < NV; ++v) {
      bv[v] = *reinterpret_cast<const U*>(brow + v * W);
#if defined(__x86_64__)
      // Keep B in a register: with Zen tuning (-march=znver*) GCC otherwise folds this load into every
      // row's FMA, RI loads instead of one, and the AVX2 micro-tile runs 1.5x slower (measured, GCC 12).
      __asm__("" : "+v"(bv[v]));
#endif
    }
    const Acc* acol = a + kk * a_cs;
    for (int r = 0; r < RI; ++r) {
      const Acc av = acol[r * a_rs];
      for (int v = 0; v < NV; ++v) acc[r][v] += av * bv[v];
    }
  } while (++kk < kdim);
  for (int r = 0; r < RI; ++r)
    for (int v = 0; v < NV; ++v) *reinterpret_cast<U*>(c + r * ldc + v * W) = acc[r][v];
}

/// Register blocking per ISA: rows × vectors of the micro-tile, chosen so that the RI·NV accumulators, the
/// NV B vectors and one broadcast fit the register file (32 zmm on AVX-512; 16 ymm/xmm on AVX2, SSE2, NEON)
/// and that there are more independent accumulators than FMA latency × FMA ports: AVX2 takes 6 rows (12
/// accumulators; with 4 rows, 8 accumulators, Zen 4's two 4-cycle FMA pipes wait: float, L1-resident tiles,
/// 0.65-0.84 of the core's peak against 0.88-0.95 with 6 rows). The rows of a tile past the last multiple of
/// `rows` go in 4-, 2- and 1-row micro-tiles.
template <HostIsa Isa>
struct HostBlocking {
  static constexpr int rows = Isa == HostIsa::avx512 ? 8 : Isa == HostIsa::avx2 ? 6 : 4;
  static constexpr int vectors = 2;
  static constexpr int bytes = isa_vector_bytes(Isa);
};

/// The micro-tile compiled for each ISA: baseline-width code is plain; wider ISAs get a function-level
/// target and are reached only through host_isa() (run-time dispatch), never inlined into baseline code.
template <HostIsa Isa, int RI, int NV, class Acc>
struct MicroTile {
  __attribute__((noinline)) static void run(const Acc* a, long a_rs, long a_cs, const Acc* b, int ldb, Acc* c, int ldc,
                                            int kdim, bool accumulate) {
    constexpr int VB = isa_vector_bytes(Isa);
    if (accumulate) return micro_tile_simd<RI, NV, VB, true>(a, a_rs, a_cs, b, ldb, c, ldc, kdim);
    micro_tile_simd<RI, NV, VB, false>(a, a_rs, a_cs, b, ldb, c, ldc, kdim);
  }
};
#if KFA_HOST_DISPATCH
template <int RI, int NV, class Acc>
struct MicroTile<HostIsa::avx2, RI, NV, Acc> {
  KFA_TARGET_AVX2 __attribute__((noinline)) static void run(const Acc* a, long a_rs, long a_cs, const Acc* b, int ldb,
                                                            Acc* c, int ldc, int kdim, bool accumulate) {
    if (accumulate) return micro_tile_simd<RI, NV, 32, true>(a, a_rs, a_cs, b, ldb, c, ldc, kdim);
    micro_tile_simd<RI, NV, 32, false>(a, a_rs, a_cs, b, ldb, c, ldc, kdim);
  }
};
template <int RI, int NV, class Acc>
struct MicroTile<HostIsa::avx512, RI, NV, Acc> {
  KFA_TARGET_AVX512 __attribute__((noinline)) static void run(const Acc* a, long a_rs, long a_cs, const Acc* b, int ldb,
                                                              Acc* c, int ldc, int kdim, bool accumulate) {
    if (accumulate) return micro_tile_simd<RI, NV, 64, true>(a, a_rs, a_cs, b, ldb, c, ldc, kdim);
    micro_tile_simd<RI, NV, 64, false>(a, a_rs, a_cs, b, ldb, c, ldc, kdim);
  }
};
#endif

/// Whether this translation unit has `Isa`'s micro-tiles: at or below the compiled baseline, or a dispatch
/// target.
constexpr bool host_isa_available(HostIsa isa) {
  return isa != HostIsa::scalar && (static_cast<int>(isa) <= static_cast<int>(compiled_host_isa) || KFA_HOST_DISPATCH);
}

/// C = A·B (+C) split over the team's threads with `Isa`'s vectors and blocking, m of any size (the rows past
/// the last multiple of the block rows in 4-, 2- and 1-row micro-tiles); false when n is not a multiple of one
/// vector: the caller falls back.
template <HostIsa Isa, class Member, class Acc>
inline bool team_gemm_host(const Member& team, int m, int n, int kdim, const Acc* a, long a_rs, long a_cs, const Acc* b,
                           int ldb, Acc* c, int ldc, bool accumulate) {
  using Blk = HostBlocking<Isa>;
  constexpr int RI = Blk::rows;
  constexpr int W = Blk::bytes / static_cast<int>(sizeof(Acc));
  if (n % W != 0) return false;
  // Rows [r0, r0 + rows) in RB-row micro-tiles of NV vectors.
  auto strip = [&](auto rb, auto nv, int r0, int rows) {
    constexpr int RB = decltype(rb)::value, NV = decltype(nv)::value;
    team_gemm_tiles<RB, NV * W>(team, rows, n, [&](int i0, int j0) {
      const long i = r0 + i0;
      MicroTile<Isa, RB, NV, Acc>::run(a + i * a_rs, a_rs, a_cs, b + j0, ldb, c + i * ldc + j0, ldc, kdim, accumulate);
    });
  };
  auto strips = [&](auto nv) {
    using I = std::integral_constant<int, RI>;
    const int main = m / RI * RI;
    if (main > 0) strip(I{}, nv, 0, main);
    int r0 = main;
    if constexpr (RI > 4)
      if (m - r0 >= 4) {
        strip(std::integral_constant<int, 4>{}, nv, r0, 4);
        r0 += 4;
      }
    if constexpr (RI > 2)
      if (m - r0 >= 2) {
        const int pairs = (m - r0) / 2 * 2;
        strip(std::integral_constant<int, 2>{}, nv, r0, pairs);
        r0 += pairs;
      }
    if (m > r0) strip(std::integral_constant<int, 1>{}, nv, r0, 1);
  };
  if (n % (Blk::vectors * W) == 0)
    strips(std::integral_constant<int, Blk::vectors>{});
  else
    strips(std::integral_constant<int, 1>{});
  return true;
}
#endif

/// C[m×n] = A[m×k]·B[k×n] (+ C when `accumulate`); A(r, kk) = a[r·a_rs + kk·a_cs]; B, C row-major with
/// leading dimensions ldb, ldc. Requires n % 4 == 0 (head_dim and the tiles are multiples of 4); m of any
/// size, fastest when a multiple of the ISA's block rows. No barrier inside. On host the vector ISA is
/// host_isa(), read once per call.
template <class ExecSpace, class Member, class Acc>
KOKKOS_INLINE_FUNCTION void team_gemm(const Member& team, int m, int n, int kdim, const Acc* a, long a_rs, long a_cs,
                                      const Acc* b, int ldb, Acc* c, int ldc, bool accumulate) {
  using Shape = MicroTileShape<ExecSpace>;
#if KFA_HOST_VECTOR_EXT
  if constexpr (Shape::host) {
    bool done = false;
    switch (host_isa()) {
      case HostIsa::avx512:
        if constexpr (host_isa_available(HostIsa::avx512))
          done = team_gemm_host<HostIsa::avx512>(team, m, n, kdim, a, a_rs, a_cs, b, ldb, c, ldc, accumulate);
        break;
      case HostIsa::avx2:
        if constexpr (host_isa_available(HostIsa::avx2))
          done = team_gemm_host<HostIsa::avx2>(team, m, n, kdim, a, a_rs, a_cs, b, ldb, c, ldc, accumulate);
        break;
      case HostIsa::sse2:
        if constexpr (host_isa_available(HostIsa::sse2))
          done = team_gemm_host<HostIsa::sse2>(team, m, n, kdim, a, a_rs, a_cs, b, ldb, c, ldc, accumulate);
        break;
      case HostIsa::scalar:
        break;
    }
    if (done) return;
    if (m % 4 == 0 && n % 8 == 0)
      return team_gemm_fixed<4, 8>(team, m, n, kdim, a, a_rs, a_cs, b, ldb, c, ldc, accumulate);
  }
#endif
  constexpr int RI = Shape::rows;
  if (m % RI != 0) return team_gemm_fixed<1, 4>(team, m, n, kdim, a, a_rs, a_cs, b, ldb, c, ldc, accumulate);
  team_gemm_fixed<RI, 4>(team, m, n, kdim, a, a_rs, a_cs, b, ldb, c, ldc, accumulate);
}

}  // namespace detail
}  // namespace kfa
