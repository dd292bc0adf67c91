#pragma once
/// The online-softmax state of one query row and the one rule that merges two such states.
///
/// A row's state over a key set K is (m, ℓ, O): m = max_{j∈K} s_j, ℓ = Σ_{j∈K} e^(s_j − m),
/// O = Σ_{j∈K} e^(s_j − m) v_j. Two states over disjoint key sets merge exactly:
///
///     m = max(m_a, m_b);  ℓ = e^(m_a−m)·ℓ_a + e^(m_b−m)·ℓ_b;  O = e^(m_a−m)·O_a + e^(m_b−m)·O_b
///
/// The forward kernel applies it when it adds a K/V tile to a Q tile; the MPI ring layer applies it when
/// it adds another rank's K/V shard. An empty key set (every key masked) is m = −inf, ℓ = 0, O = 0 and
/// merges as the identity — that case is the reason for the explicit −inf branches below.
#include <kfa/compat.hpp>

namespace kfa {

/// Factors that bring two states to a common maximum: the merged state is
/// (m, scale_a·ℓ_a + scale_b·ℓ_b, scale_a·O_a + scale_b·O_b).
template <class T>
struct MergeFactors {
  T m;
  T scale_a;
  T scale_b;
};

/// The combine rule's factors for running maxima m_a and m_b (either may be −inf).
template <class T>
KOKKOS_INLINE_FUNCTION MergeFactors<T> merge_factors(T m_a, T m_b) {
  const T ninf = -compat::infinity<T>();
  const T m = m_a > m_b ? m_a : m_b;
  if (m == ninf) return {m, T(0), T(0)};  // both empty: avoid (−inf) − (−inf) = NaN
  return {m, m_a == ninf ? T(0) : compat::exp(m_a - m), m_b == ninf ? T(0) : compat::exp(m_b - m)};
}

/// Running (m, ℓ) of one row; O is kept by the caller and scaled with the same factors.
template <class T>
struct SoftmaxState {
  T m;  ///< running maximum (−inf when no key seen)
  T l;  ///< running denominator at m
  KOKKOS_INLINE_FUNCTION static SoftmaxState empty() { return {-compat::infinity<T>(), T(0)}; }
  /// Natural-log log-sum-exp of the row: m + log ℓ, or −inf for an empty row (ℓ = 0). A NaN ℓ (a NaN score:
  /// NaN in q or k) gives NaN, not −inf, so the bad input shows in lse as in o.
  KOKKOS_INLINE_FUNCTION T lse() const { return l == T(0) ? -compat::infinity<T>() : m + compat::log(l); }
};

/// Merges (m_b, ℓ_b) into `a` and returns the factors to apply to O_a and O_b.
template <class T>
KOKKOS_INLINE_FUNCTION MergeFactors<T> merge(SoftmaxState<T>& a, const SoftmaxState<T>& b) {
  const MergeFactors<T> f = merge_factors(a.m, b.m);
  a.m = f.m;
  a.l = f.scale_a * a.l + f.scale_b * b.l;
  return f;
}

/// The same rule for normalized partials (O/ℓ, LSE), as kernels and ranks hand them over:
/// lse = log(e^lse_a + e^lse_b), O = w_a·O_a + w_b·O_b with w = e^(lse_x − lse).
template <class T>
struct LseMerge {
  T lse;
  T weight_a;
  T weight_b;
};

template <class T>
KOKKOS_INLINE_FUNCTION LseMerge<T> merge_lse(T lse_a, T lse_b) {
  // (lse, O/ℓ) is the state (m = lse, ℓ = 1, O/ℓ): the rule above with ℓ_a = ℓ_b = 1, then normalized.
  const MergeFactors<T> f = merge_factors(lse_a, lse_b);
  const T l = f.scale_a + f.scale_b;
  if (l == T(0)) return {f.m, T(0), T(0)};
  return {f.m + compat::log(l), f.scale_a / l, f.scale_b / l};
}

}  // namespace kfa
