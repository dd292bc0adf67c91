#pragma once
/// Merging attention partials computed over disjoint key sets (split-KV decoding, ring attention, a
/// user's own sharding) with the combine rule of online_softmax.hpp.
#include <kfa/detail/common/ranges.hpp>
#include <kfa/error.hpp>
#include <kfa/online_softmax.hpp>

#include <cstdint>

namespace kfa {

/// (o_a, lse_a) ← merge((o_a, lse_a), (o_b, lse_b)) for partials of the same query rows over disjoint key
/// sets: o [batch, seq, heads, d] normalized outputs, lse [batch, heads, seq] their log-sum-exps (−inf for
/// an empty partial, which merges as the identity). o_a/lse_a in the accumulation type; o_b may be any
/// element type. Asynchronous on `space`.
template <class ExecSpace, class OA, class LA, class OB, class LB>
void merge_attention(const ExecSpace& space, const OA& o_a, const LA& lse_a, const OB& o_b, const LB& lse_b) {
  using Acc = typename LA::non_const_value_type;
  static_assert(static_cast<int>(OA::rank) == 4 && static_cast<int>(OB::rank) == 4 && static_cast<int>(LA::rank) == 3 &&
                    static_cast<int>(LB::rank) == 3,
                "kfa::merge_attention: o views are rank 4, lse views rank 3");
  for (int r = 0; r < 4; ++r)
    if (o_a.extent(r) != o_b.extent(r))
      detail::fail("kfa::merge_attention: o_a.extent(", r, ") = ", o_a.extent(r), " but o_b.extent(", r,
                   ") = ", o_b.extent(r));
  for (int r = 0; r < 3; ++r)
    if (lse_a.extent(r) != lse_b.extent(r) || lse_a.extent(r) != (r == 0   ? o_a.extent(0)
                                                                  : r == 1 ? o_a.extent(2)
                                                                           : o_a.extent(1)))
      detail::fail("kfa::merge_attention: lse_a / lse_b must be [batch, heads, seq] = [", o_a.extent(0), ", ",
                   o_a.extent(2), ", ", o_a.extent(1), "]");
  if (o_a.size() == 0) return;
  // Two passes in memory order: the outputs element by element (each recomputes its row's weights from
  // the unchanged LSEs), then the LSEs.
  detail::for_each_element4(
      "kfa::merge_attention::o", space, o_a,
      KOKKOS_LAMBDA(const std::int64_t b, const std::int64_t i, const std::int64_t h, const std::int64_t c) {
        const LseMerge<Acc> m = merge_lse<Acc>(lse_a(b, h, i), static_cast<Acc>(lse_b(b, h, i)));
        o_a(b, i, h, c) = m.weight_a * o_a(b, i, h, c) + m.weight_b * static_cast<Acc>(o_b(b, i, h, c));
      });
  Kokkos::parallel_for(
      "kfa::merge_attention::lse", detail::range_like(space, lse_a),
      KOKKOS_LAMBDA(const std::int64_t b, const std::int64_t h, const std::int64_t i) {
        lse_a(b, h, i) = merge_lse<Acc>(lse_a(b, h, i), static_cast<Acc>(lse_b(b, h, i))).lse;
      });
}

}  // namespace kfa
