#pragma once
/// kfa::count_nonfinite: how many elements of a tensor are NaN or ±Inf.
///
/// What non-finite values do to attention (kfa computes exactly what IEEE arithmetic gives; it does not
/// check its inputs for NaN/Inf, and does not clamp or repair anything):
///  - NaN or ±Inf in a row of q makes that query row's o (and lse) NaN; other rows are unaffected.
///  - NaN or ±Inf in a row of k or v poisons every query row that sees that key (all of them without a
///    mask; with causal/window masks the rows whose visible range contains the key): their o, and with k
///    also their lse, become NaN (an Inf in v can also give ±Inf in o). With k, rows that do not see the
///    key are unaffected. With v, such rows near the mask edge can be poisoned too: the kernels' tile
///    products multiply the masked probabilities (0) by the whole tile of v, and 0·NaN = NaN. That reaches
///    only rows fewer than block_q + block_k − 1 rows from one that sees the key (the tiles of the call's
///    kfa::plan_forward); a poisoned o row is NaN in all its elements, every other row is exact
///    (tests/core/test_nonfinite.cpp checks both). In the ring (kfa::dist) the poison spreads to every rank
///    whose queries see the bad key.
///  - Packed documents (the varlen calls; kfa::dist's documents run the same kernels, not tested there): a NaN
///    or ±Inf in one document's q, k, v or do stays out of the other documents' o, lse and gradients in
///    every family (a masked probability is 0, but 0·NaN = NaN: no product that accumulates runs over another
///    document's rows, and the wgmma family zeroes the next document's rows its TMA loads bring into a
///    document's last tile). tests/core/test_varlen.cpp checks every family.
///  - Finite inputs whose scores q·k·scale overflow the compute dtype (e.g. values of 1e20 in float32, or
///    a huge softmax scale) give Inf - Inf = NaN in the online softmax: o and lse NaN where the exact
///    result is finite. Compute in float64 or use a smaller scale.
///  - The backward pass inherits all of this: NaN/Inf in o, lse, do or the inputs give NaN gradients.
/// Callers that must not pass bad data on should scan inputs and outputs with count_nonfinite (an
/// O(elements) pass on the tensor's own execution space) — kfa-longseq does, see --allow-nonfinite.
#include <kfa/compat.hpp>
#include <kfa/detail/common/ranges.hpp>
#include <kfa/types.hpp>

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace kfa {
namespace detail {
template <class T>
KOKKOS_INLINE_FUNCTION std::size_t nonfinite_one(const T& x) {
  const double d = static_cast<double>(static_cast<accumulator_t<T>>(x));
  return compat::isfinite(d) ? 0 : 1;
}
}  // namespace detail

/// The number of NaN or ±Inf elements of a rank-3 or rank-4 View of double, float, half or bfloat16 (any
/// layout, strided subviews included), computed on `space` (which must be able to access the View's
/// memory). Blocks until the count is known.
template <class ExecSpace, class View>
std::size_t count_nonfinite(const ExecSpace& space, const View& v) {
  static_assert(Kokkos::is_view<View>::value, "kfa::count_nonfinite: the argument must be a Kokkos::View");
  static_assert(View::rank == 3 || View::rank == 4, "kfa::count_nonfinite: the View must be rank 3 or rank 4");
  static_assert(Kokkos::SpaceAccessibility<ExecSpace, typename View::memory_space>::accessible,
                "kfa::count_nonfinite: the View's memory is not accessible from the execution space");
  using T = typename View::non_const_value_type;
  if (v.size() == 0) return 0;
  std::size_t n = 0;
  if constexpr (View::rank == 4) {
    Kokkos::parallel_reduce(
        "kfa::count_nonfinite", detail::range_like(space, v),
        KOKKOS_LAMBDA(std::int64_t a, std::int64_t b, std::int64_t c, std::int64_t e, std::size_t & acc) {
          acc += detail::nonfinite_one<T>(v(a, b, c, e));
        },
        n);
  } else {
    Kokkos::parallel_reduce(
        "kfa::count_nonfinite", detail::range_like(space, v),
        KOKKOS_LAMBDA(std::int64_t a, std::int64_t b, std::int64_t c, std::size_t & acc) {
          acc += detail::nonfinite_one<T>(v(a, b, c));
        },
        n);
  }
  space.fence();
  return n;
}

}  // namespace kfa
