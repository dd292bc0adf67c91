#pragma once
/// Portable tile products: C = A·B (+ C) on row-major tiles in team scratch, split over the team's threads
/// as register-blocked micro-tiles. Both forward products have this "NN" shape because the kernel stores
/// the K tile transposed: S = Q·Kᵀ is Q[bq×d]·Kt[d×bk] and O += P·V is P[bq×bk]·V[bk×d].
///
/// This is the customization point for tile products: a vendor implementation (tensor cores on CUDA)
/// sits beside it and is chosen by `TileProductPath`; this one runs on every backend and is the path the
/// tests compare against.
#include <kfa/compat.hpp>

#include <type_traits>

namespace kfa {
namespace detail {

/// Register-block shape per backend: host threads own whole tiles, so big blocks that map to SIMD
/// registers (8 rows × up to 32 floats on AVX-512); GPU threads are many and register-poor.
template <class ExecSpace>
struct MicroTileShape {
  static constexpr bool host =
      Kokkos::SpaceAccessibility<Kokkos::HostSpace, typename ExecSpace::memory_space>::accessible;
  static constexpr int rows = host ? 8 : 2;
  template <class Acc>
  static constexpr int max_cols() {
    return host ? (std::is_same<Acc, double>::value ? 16 : 32) : 4;
  }
};

/// One RI×RJ block of C = A·B (+C). K is the shared dimension.
template <int RI, int RJ, class Acc>
KOKKOS_INLINE_FUNCTION void micro_tile(const Acc* __restrict__ a, int lda, const Acc* __restrict__ b, int ldb,
                                       Acc* __restrict__ c, int ldc, int kdim, bool accumulate) {
  Acc acc[RI][RJ];
  for (int r = 0; r < RI; ++r)
    for (int j = 0; j < RJ; ++j) acc[r][j] = accumulate ? c[r * ldc + j] : Acc(0);
  for (int kk = 0; kk < kdim; ++kk) {
    const Acc* brow = b + static_cast<long>(kk) * ldb;
    for (int r = 0; r < RI; ++r) {
      const Acc av = a[r * lda + kk];
      for (int j = 0; j < RJ; ++j) acc[r][j] += av * brow[j];
    }
  }
  for (int r = 0; r < RI; ++r)
    for (int j = 0; j < RJ; ++j) c[r * ldc + j] = acc[r][j];
}

template <int RI, int RJ, class Member, class Acc>
KOKKOS_INLINE_FUNCTION void team_gemm_nn_fixed(const Member& team, int m, int n, int kdim, const Acc* a, int lda,
                                               const Acc* b, int ldb, Acc* c, int ldc, bool accumulate) {
  const int tiles_j = n / RJ;
  const int tiles = (m / RI) * tiles_j;
  Kokkos::parallel_for(Kokkos::TeamThreadRange(team, tiles), [&](const int t) {
    const int i0 = (t / tiles_j) * RI;
    const int j0 = (t % tiles_j) * RJ;
    micro_tile<RI, RJ>(a + i0 * lda, lda, b + j0, ldb, c + i0 * ldc + j0, ldc, kdim, accumulate);
  });
}

/// C[m×n] = A[m×k]·B[k×n] (+ C when `accumulate`), all row-major with leading dimensions lda, ldb, ldc.
/// Requires m % MicroTileShape::rows == 0 and n % 4 == 0 (the tiling guarantees both). No barrier inside.
template <class ExecSpace, class Member, class Acc>
KOKKOS_INLINE_FUNCTION void team_gemm_nn(const Member& team, int m, int n, int kdim, const Acc* a, int lda,
                                         const Acc* b, int ldb, Acc* c, int ldc, bool accumulate) {
  using Shape = MicroTileShape<ExecSpace>;
  constexpr int RI = Shape::rows;
  constexpr int RJ = Shape::template max_cols<Acc>();
  if (RJ >= 32 && n % 32 == 0)
    team_gemm_nn_fixed<RI, (RJ >= 32 ? 32 : 4)>(team, m, n, kdim, a, lda, b, ldb, c, ldc, accumulate);
  else if (RJ >= 16 && n % 16 == 0)
    team_gemm_nn_fixed<RI, (RJ >= 16 ? 16 : 4)>(team, m, n, kdim, a, lda, b, ldb, c, ldc, accumulate);
  else if (RJ >= 8 && n % 8 == 0)
    team_gemm_nn_fixed<RI, (RJ >= 8 ? 8 : 4)>(team, m, n, kdim, a, lda, b, ldb, c, ldc, accumulate);
  else
    team_gemm_nn_fixed<RI, 4>(team, m, n, kdim, a, lda, b, ldb, c, ldc, accumulate);
}

}  // namespace detail
}  // namespace kfa
