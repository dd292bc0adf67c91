#pragma once
/// common/ranges.hpp: element-wise passes over kfa's tensors in the order their memory is laid out.
#include <kfa/compat.hpp>
#include <kfa/error.hpp>

#include <cstdint>
#include <type_traits>

namespace kfa {
namespace detail {

/// An MDRangePolicy over all of View x whose fastest-moving index is the one contiguous in memory: the
/// last for LayoutRight and LayoutStride (kfa's strided views are slices of LayoutRight tensors), the
/// first for LayoutLeft. Kokkos' default order follows the backend's default layout, which on CUDA is
/// LayoutLeft: for kfa's LayoutRight tensors every warp then touched 32 rows instead of one (measured on an
/// H200: the ring's fp32 partial adds took ~18% of a backward step).
template <class ExecSpace, class View>
auto range_like(const ExecSpace& space, const View& x) {
  constexpr unsigned rank = static_cast<unsigned>(View::rank);
  constexpr Kokkos::Iterate order = std::is_same<typename View::array_layout, Kokkos::LayoutLeft>::value
                                        ? Kokkos::Iterate::Left
                                        : Kokkos::Iterate::Right;
  using Policy = Kokkos::MDRangePolicy<ExecSpace, Kokkos::Rank<rank, order, order>, Kokkos::IndexType<std::int64_t>>;
  typename Policy::point_type lo{}, hi{};
  for (unsigned r = 0; r < rank; ++r) {
    lo[r] = 0;
    hi[r] = static_cast<std::int64_t>(x.extent(r));
  }
  return Policy(space, lo, hi);
}

/// Calls f(b, i, h, c) for every index of the rank-4 View x (its extents only): the rows (b, i, h) spread
/// over teams and their threads, the last index over vector lanes, so that on a GPU one warp walks a row of
/// LayoutRight (or a strided slice of it) in memory order, coalesced. Kokkos' rank-4 MDRange, even in memory
/// order (range_like), moved only ~0.2–0.3 TB/s on an H200 with d = 128 (ncu: 3.1 ms to copy 268 MB of
/// bfloat16 K into the ring's buffer, 2.6 ms per merge of 268 MB fp32 partials). LayoutLeft views keep
/// range_like's order (their first index is the contiguous one).
template <class ExecSpace, class View, class F>
void for_each_element4(const char* label, const ExecSpace& space, const View& x, const F& f) {
  static_assert(static_cast<int>(View::rank) == 4, "for_each_element4: a rank-4 View");
  const std::int64_t n1 = static_cast<std::int64_t>(x.extent(1)), n2 = static_cast<std::int64_t>(x.extent(2)),
                     n3 = static_cast<std::int64_t>(x.extent(3));
  const std::int64_t rows = static_cast<std::int64_t>(x.extent(0)) * n1 * n2;
  if (rows == 0 || n3 == 0) return;
  constexpr bool device = !Kokkos::SpaceAccessibility<Kokkos::HostSpace, typename ExecSpace::memory_space>::accessible;
  constexpr int team = device ? 8 : 1, vec = device ? 32 : 1;
  if constexpr (std::is_same<typename View::array_layout, Kokkos::LayoutLeft>::value) {
    Kokkos::parallel_for(label, range_like(space, x), f);
  } else {
    const std::int64_t league = (rows + team - 1) / team;
    if (league > 2147483647LL) fail(label, ": ", rows, " rows exceed the ", team, " × (2^31 − 1) of one launch");
    using Policy = Kokkos::TeamPolicy<ExecSpace>;
    Kokkos::parallel_for(
        label, Policy(space, static_cast<int>(league), team, vec),
        KOKKOS_LAMBDA(const typename Policy::member_type& m) {
          const std::int64_t r0 = static_cast<std::int64_t>(m.league_rank()) * team;
          Kokkos::parallel_for(Kokkos::TeamThreadRange(m, team), [&](const int t) {
            const std::int64_t r = r0 + t;
            if (r >= rows) return;
            const std::int64_t h = r % n2, i = (r / n2) % n1, b = r / (n1 * n2);
            Kokkos::parallel_for(Kokkos::ThreadVectorRange(m, n3), [&](const std::int64_t c) { f(b, i, h, c); });
          });
        });
  }
}

/// For every row (b, i, h) of the rank-4 View x (its extents only): g(b, i, h, s) with s = Σ_c f(b, i, h, c)
/// summed in Acc, the rows spread over teams and threads as in for_each_element4 and each sum over vector
/// lanes (a tree over the lanes' partial sums on a GPU, a loop on hosts: deterministic either way).
/// LayoutLeft views are summed row by row over an MDRange of (b, i, h) in memory order.
template <class Acc, class ExecSpace, class View, class F, class G>
void for_each_row_sum4(const char* label, const ExecSpace& space, const View& x, const F& f, const G& g) {
  static_assert(static_cast<int>(View::rank) == 4, "for_each_row_sum4: a rank-4 View");
  const std::int64_t n0 = static_cast<std::int64_t>(x.extent(0)), n1 = static_cast<std::int64_t>(x.extent(1)),
                     n2 = static_cast<std::int64_t>(x.extent(2)), n3 = static_cast<std::int64_t>(x.extent(3));
  const std::int64_t rows = n0 * n1 * n2;
  if (rows == 0) return;
  constexpr bool device = !Kokkos::SpaceAccessibility<Kokkos::HostSpace, typename ExecSpace::memory_space>::accessible;
  constexpr int team = device ? 8 : 1, vec = device ? 32 : 1;
  if constexpr (std::is_same<typename View::array_layout, Kokkos::LayoutLeft>::value) {
    using Policy = Kokkos::MDRangePolicy<ExecSpace, Kokkos::Rank<3, Kokkos::Iterate::Left, Kokkos::Iterate::Left>,
                                         Kokkos::IndexType<std::int64_t>>;
    Kokkos::parallel_for(
        label, Policy(space, {0, 0, 0}, {n0, n1, n2}),
        KOKKOS_LAMBDA(const std::int64_t b, const std::int64_t i, const std::int64_t h) {
          Acc s = 0;
          for (std::int64_t c = 0; c < n3; ++c) s += f(b, i, h, c);
          g(b, i, h, s);
        });
  } else {
    const std::int64_t league = (rows + team - 1) / team;
    if (league > 2147483647LL) fail(label, ": ", rows, " rows exceed the ", team, " × (2^31 − 1) of one launch");
    using Policy = Kokkos::TeamPolicy<ExecSpace>;
    Kokkos::parallel_for(
        label, Policy(space, static_cast<int>(league), team, vec),
        KOKKOS_LAMBDA(const typename Policy::member_type& m) {
          const std::int64_t r0 = static_cast<std::int64_t>(m.league_rank()) * team;
          Kokkos::parallel_for(Kokkos::TeamThreadRange(m, team), [&](const int t) {
            const std::int64_t r = r0 + t;
            if (r >= rows) return;
            const std::int64_t h = r % n2, i = (r / n2) % n1, b = r / (n1 * n2);
            Acc s = 0;
            Kokkos::parallel_reduce(
                Kokkos::ThreadVectorRange(m, n3), [&](const std::int64_t c, Acc& part) { part += f(b, i, h, c); }, s);
            Kokkos::single(Kokkos::PerThread(m), [&]() { g(b, i, h, s); });
          });
        });
  }
}

}  // namespace detail
}  // namespace kfa
