#pragma once
/// common/recompute.hpp: what every backward family shares: which parts of a backward call run, zeroing a
/// gradient, and the log-sum-exp as used for recomputing P.
#include <kfa/compat.hpp>
#include <kfa/detail/common/ranges.hpp>

#include <cstdint>

namespace kfa {
namespace detail {

/// Which kernels of a backward call run: both, or one of them (the ring's last step runs the dK/dV kernels
/// first, so that their accumulator travels home while the dQ kernels compute). A family that accumulates dQ
/// inside its dK/dV kernel (atomic dQ) writes dq with `dkdv` and does nothing for `dq`.
enum class BackwardParts { all, dkdv, dq };

/// Sets a rank-4 View to zero on `space` (Kokkos 3.4 cannot deep_copy a scalar into a LayoutStride View).
template <class ExecSpace, class View>
void zero4(const ExecSpace& space, const View& x, const char* label) {
  using T = typename View::non_const_value_type;
  if (x.size() == 0) return;
  for_each_element4(
      label, space, x,
      KOKKOS_LAMBDA(const std::int64_t a, const std::int64_t b, const std::int64_t c, const std::int64_t d) {
        x(a, b, c, d) = T(0);
      });
}

/// LSE as used for recomputing P: +inf for a row that saw no key, so exp(s − lse) = 0 there.
template <class Acc>
KOKKOS_INLINE_FUNCTION Acc recompute_lse(Acc lse) {
  return lse == -compat::infinity<Acc>() ? compat::infinity<Acc>() : lse;
}

}  // namespace detail
}  // namespace kfa
