#pragma once
/// Tile products: C[m×n] = A[m×k]·B[k×n] (+ C) on tiles in team scratch, split over the team's threads
/// as register-blocked micro-tiles. A is addressed through (row, column) strides so the same routine
/// serves S = K·Qᵀ (A = the K tile, row-major) and O += P·V (A = Pᵀ as stored, i.e. column-major);
/// B and C are row-major.
///
/// This is the customization point for tile products. On host backends the micro-tile is written with
/// GCC/Clang vector extensions (one 64-byte vector per register, any x86/Arm SIMD width underneath); on
/// device backends each thread owns a small scalar micro-tile. A vendor path (tensor cores on CUDA)
/// plugs in beside these and is chosen by TileProductPath; the portable path always exists.
#include <kfa/compat.hpp>

#include <type_traits>

#if !KFA_ON_DEVICE && (defined(__GNUC__) || defined(__clang__))
#define KFA_HOST_VECTOR_EXT 1
#else
#define KFA_HOST_VECTOR_EXT 0
#endif

namespace kfa {
namespace detail {

/// Register-block shape per backend: host threads own whole tiles, so blocks of 8 rows × 2 SIMD vectors;
/// GPU threads are many and register-poor, so 2 × 4 scalars each. `lanes` is the width of the kernel's
/// element-wise loops over query rows (vectorized on host, one row per thread on device).
template <class ExecSpace>
struct MicroTileShape {
  static constexpr bool host =
      Kokkos::SpaceAccessibility<Kokkos::HostSpace, typename ExecSpace::memory_space>::accessible;
  static constexpr int rows = host ? 8 : 2;
  static constexpr int lanes = host ? 8 : 1;
};

/// One RI×RJ block of C = A·B (+C), scalar code (device threads, and any shape on host).
template <int RI, int RJ, class Acc>
KOKKOS_INLINE_FUNCTION void micro_tile_scalar(const Acc* a, long a_rs, long a_cs, const Acc* b, int ldb, Acc* c,
                                              int ldc, int kdim, bool accumulate) {
  Acc acc[RI][RJ];
  for (int r = 0; r < RI; ++r)
    for (int j = 0; j < RJ; ++j) acc[r][j] = accumulate ? c[r * ldc + j] : Acc(0);
  for (int kk = 0; kk < kdim; ++kk) {
    const Acc* brow = b + static_cast<long>(kk) * ldb;
    for (int r = 0; r < RI; ++r) {
      const Acc av = a[r * a_rs + kk * a_cs];
      for (int j = 0; j < RJ; ++j) acc[r][j] += av * brow[j];
    }
  }
  for (int r = 0; r < RI; ++r)
    for (int j = 0; j < RJ; ++j) c[r * ldc + j] = acc[r][j];
}

#if KFA_HOST_VECTOR_EXT
/// 64-byte SIMD vector of Acc; the unaligned, may-alias variant is how compilers' own intrinsics load.
template <class Acc>
struct Simd {
  typedef Acc type __attribute__((vector_size(64)));
  typedef Acc unaligned __attribute__((vector_size(64), aligned(alignof(Acc)), __may_alias__));
  static constexpr int width = 64 / sizeof(Acc);
};

/// One RI × (NV·width) block of C = A·B (+C) held in NV·RI vector registers.
template <int RI, int NV, class Acc>
inline void micro_tile_simd(const Acc* a, long a_rs, long a_cs, const Acc* b, int ldb, Acc* c, int ldc, int kdim,
                            bool accumulate) {
  using V = typename Simd<Acc>::type;
  using U = typename Simd<Acc>::unaligned;
  constexpr int W = Simd<Acc>::width;
  V acc[RI][NV];
  for (int r = 0; r < RI; ++r)
    for (int v = 0; v < NV; ++v)
      acc[r][v] = accumulate ? V(*reinterpret_cast<const U*>(c + r * ldc + v * W)) : V{};
  for (int kk = 0; kk < kdim; ++kk) {
    const Acc* brow = b + static_cast<long>(kk) * ldb;
    V bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = *reinterpret_cast<const U*>(brow + v * W);
    const Acc* acol = a + kk * a_cs;
    for (int r = 0; r < RI; ++r) {
      const Acc av = acol[r * a_rs];
      for (int v = 0; v < NV; ++v) acc[r][v] += av * bv[v];
    }
  }
  for (int r = 0; r < RI; ++r)
    for (int v = 0; v < NV; ++v) *reinterpret_cast<U*>(c + r * ldc + v * W) = acc[r][v];
}
#endif

template <int RI, int RJ, bool UseSimd, class Member, class Acc>
KOKKOS_INLINE_FUNCTION void team_gemm_fixed(const Member& team, int m, int n, int kdim, const Acc* a, long a_rs,
                                            long a_cs, const Acc* b, int ldb, Acc* c, int ldc, bool accumulate) {
  const int tiles_j = n / RJ;
  const int tiles = (m / RI) * tiles_j;
  Kokkos::parallel_for(Kokkos::TeamThreadRange(team, tiles), [&](const int t) {
    const int i0 = (t / tiles_j) * RI;
    const int j0 = (t % tiles_j) * RJ;
#if KFA_HOST_VECTOR_EXT
    if (UseSimd) {
      micro_tile_simd<RI, RJ / detail::Simd<Acc>::width>(a + i0 * a_rs, a_rs, a_cs, b + j0, ldb, c + i0 * ldc + j0,
                                                         ldc, kdim, accumulate);
      return;
    }
#endif
    micro_tile_scalar<RI, RJ>(a + i0 * a_rs, a_rs, a_cs, b + j0, ldb, c + i0 * ldc + j0, ldc, kdim, accumulate);
  });
}

/// C[m×n] = A[m×k]·B[k×n] (+ C when `accumulate`); A(r, kk) = a[r·a_rs + kk·a_cs]; B, C row-major with
/// leading dimensions ldb, ldc. Requires n % 4 == 0 (head_dim and the tiles are multiples of 4); m of any
/// size, fastest when a multiple of MicroTileShape::rows. No barrier inside.
template <class ExecSpace, class Member, class Acc>
KOKKOS_INLINE_FUNCTION void team_gemm(const Member& team, int m, int n, int kdim, const Acc* a, long a_rs, long a_cs,
                                      const Acc* b, int ldb, Acc* c, int ldc, bool accumulate) {
  using Shape = MicroTileShape<ExecSpace>;
  constexpr int RI = Shape::rows;
  if (m % RI != 0) return team_gemm_fixed<1, 4, false>(team, m, n, kdim, a, a_rs, a_cs, b, ldb, c, ldc, accumulate);
#if KFA_HOST_VECTOR_EXT
  if (Shape::host) {
    constexpr int W = Simd<Acc>::width;
    if (n % (2 * W) == 0)
      return team_gemm_fixed<RI, 2 * W, true>(team, m, n, kdim, a, a_rs, a_cs, b, ldb, c, ldc, accumulate);
    if (n % W == 0) return team_gemm_fixed<RI, W, true>(team, m, n, kdim, a, a_rs, a_cs, b, ldb, c, ldc, accumulate);
    if (n % 8 == 0) return team_gemm_fixed<RI, 8, false>(team, m, n, kdim, a, a_rs, a_cs, b, ldb, c, ldc, accumulate);
  }
#endif
  team_gemm_fixed<RI, 4, false>(team, m, n, kdim, a, a_rs, a_cs, b, ldb, c, ldc, accumulate);
}

}  // namespace detail
}  // namespace kfa
