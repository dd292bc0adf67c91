#pragma once
/// common/packed.hpp: what the variable-length API (attention.hpp, *_varlen) does before the fixed-length path
/// takes over: its argument checks on the packed shapes and on cu_seqlens (named as the caller wrote them), and
/// the packed tensors seen as one sequence of a batch of one (q [total_q, heads, d] as [1, total_q, heads, d],
/// lse [heads, total_q] as [1, heads, total_q]; same memory, no copy). The documents themselves reach the
/// kernels through Positions::docs and the KeyMask (mask.hpp).
#include <kfa/detail/mask.hpp>
#include <kfa/error.hpp>
#include <kfa/options.hpp>

#include <climits>
#include <cstddef>
#include <string>
#include <type_traits>

namespace kfa {
namespace detail {

/// A packed View of rank R (3: a tensor, 2: lse) as rank R + 1 with a leading extent of 1, on the same memory:
/// LayoutRight stays LayoutRight, any other layout becomes LayoutStride.
template <class V>
auto with_batch_of_one(const V& x) {
  constexpr int R = static_cast<int>(V::rank);
  static_assert(R == 2 || R == 3, "with_batch_of_one: a packed tensor (rank 3) or lse (rank 2)");
  using E = typename V::value_type;
  using L = std::conditional_t<std::is_same<typename V::array_layout, Kokkos::LayoutRight>::value, Kokkos::LayoutRight,
                               Kokkos::LayoutStride>;
  using D = std::conditional_t<R == 3, E****, E***>;
  using Out = Kokkos::View<D, L, typename V::memory_space, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
  if constexpr (std::is_same<L, Kokkos::LayoutRight>::value) {
    if constexpr (R == 3)
      return Out(x.data(), 1, x.extent(0), x.extent(1), x.extent(2));
    else
      return Out(x.data(), 1, x.extent(0), x.extent(1));
  } else {
    const std::size_t outer = x.span() > 0 ? x.span() : 1;  // any stride serves an extent of 1
    if constexpr (R == 3)
      return Out(x.data(), Kokkos::LayoutStride(1, outer, x.extent(0), x.stride(0), x.extent(1), x.stride(1),
                                                x.extent(2), x.stride(2)));
    else
      return Out(x.data(), Kokkos::LayoutStride(1, outer, x.extent(0), x.stride(0), x.extent(1), x.stride(1)));
  }
}

/// Compile-time checks of the variable-length calls' cu_seqlens (the tensors are checked as the fixed-length
/// calls' after with_batch_of_one).
template <class ExecSpace, class CU>
constexpr void static_check_cu_seqlens() {
  static_assert(Kokkos::is_view<CU>::value && static_cast<int>(CU::rank) == 1 &&
                    std::is_same<typename CU::non_const_value_type, int>::value,
                "kfa: cu_seqlens_q and cu_seqlens_k must be rank-1 Kokkos::View of int (int32 prefix sums)");
  static_assert(Kokkos::SpaceAccessibility<ExecSpace, typename CU::memory_space>::accessible,
                "kfa: a View's memory space is not accessible from the execution space");
}

/// x (argument `name`) must have the extents of `like` (argument `like_name`): o, d_o and dq those of q, dk and
/// dv those of k.
template <class X, class Like>
void check_packed_like(const char* fn, const char* name, const X& x, const char* like_name, const Like& like) {
  static_assert(static_cast<int>(X::rank) == 3,
                "kfa: the variable-length calls take q, k, v, o and gradients of "
                "rank 3 [total, heads, head_dim]");
  for (unsigned r = 0; r < 3; ++r)
    if (x.extent(r) != like.extent(r))
      fail(fn, ": ", name, ".extent(", r, ") = ", x.extent(r), " but ", like_name, ".extent(", r,
           ") = ", like.extent(r), " (", name, " has ", like_name, "'s shape)");
}

/// The packed shapes: q [total_q, heads_q, d], k and v [total_k, heads_kv, d] (and the extents every backend
/// can index with int32 positions).
template <class QV, class KV, class VV>
void check_packed_qkv(const char* fn, const QV& q, const KV& k, const VV& v) {
  static_assert(static_cast<int>(QV::rank) == 3 && static_cast<int>(KV::rank) == 3,
                "kfa: the variable-length calls take q, k, v, o and gradients of rank 3 [total, heads, head_dim]");
  if (k.extent(2) != q.extent(2))
    fail(fn, ": k.extent(2) = ", k.extent(2), " but q.extent(2) = ", q.extent(2), " (head_dim)");
  check_packed_like(fn, "v", v, "k", k);
  const std::size_t hq = q.extent(1), hkv = k.extent(1), d = q.extent(2);
  if (hq > 0 && (hkv == 0 || hq % hkv != 0))
    fail(fn, ": q.extent(1) = ", hq, " query heads is not a multiple of k.extent(1) = ", hkv, " key/value heads");
  if (d % 8 != 0 || d < 8 || d > 256)
    fail(fn, ": head_dim q.extent(2) = ", d, " is unsupported (must be a multiple of 8 in [8, 256])");
  if (q.extent(0) > static_cast<std::size_t>(INT_MAX))
    fail(fn, ": q.extent(0) = ", q.extent(0), " tokens exceed the int32 range of cu_seqlens_q");
  if (k.extent(0) > static_cast<std::size_t>(INT_MAX))
    fail(fn, ": k.extent(0) = ", k.extent(0), " tokens exceed the int32 range of cu_seqlens_k");
}

/// lse [heads_q, total_q].
template <class LV, class QV>
void check_packed_lse(const char* fn, const LV& lse, const QV& q) {
  static_assert(static_cast<int>(LV::rank) == 2, "kfa: the variable-length calls take lse of rank 2 [heads, total_q]");
  if (lse.extent(0) != q.extent(1) || lse.extent(1) != q.extent(0))
    fail(fn, ": lse is [", lse.extent(0), ", ", lse.extent(1), "] but must be [heads_q, total_q] = [", q.extent(1),
         ", ", q.extent(0), "]");
}

/// Checks cu_seqlens_q and cu_seqlens_k against each other, the packed totals and the longest lengths the
/// caller gave (one small copy to the host, so it waits for the copy), and returns the documents for the
/// kernels: pointers into the caller's Views, which must live until the call's kernels finish.
template <class CQ, class CK>
Documents check_cu_seqlens(const char* fn, const CQ& cu_q, const CK& cu_k, std::size_t total_q, std::size_t total_k,
                           long max_seqlen_q, long max_seqlen_k, const char* q_what = "q", const char* k_what = "k") {
  if (cu_q.extent(0) == 0) fail(fn, ": cu_seqlens_q is empty (it has batch + 1 entries, the first 0)");
  if (cu_k.extent(0) != cu_q.extent(0))
    fail(fn, ": cu_seqlens_k.extent(0) = ", cu_k.extent(0), " but cu_seqlens_q.extent(0) = ", cu_q.extent(0),
         " (both are batch + 1)");
  if (cu_q.extent(0) - 1 > static_cast<std::size_t>(INT_MAX))
    fail(fn, ": cu_seqlens_q.extent(0) = ", cu_q.extent(0), " sequences exceed the int32 range");
  if (cu_q.stride(0) != 1 || cu_k.stride(0) != 1)
    fail(fn, ": cu_seqlens_q and cu_seqlens_k must be contiguous (strides ", cu_q.stride(0), " and ", cu_k.stride(0),
         ")");
  if (max_seqlen_q < 0) fail(fn, ": max_seqlen_q = ", max_seqlen_q, " (must be >= 0)");
  if (max_seqlen_k < 0) fail(fn, ": max_seqlen_k = ", max_seqlen_k, " (must be >= 0)");
  const auto hq = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), cu_q);
  const auto hk = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), cu_k);
  const std::size_t batch = cu_q.extent(0) - 1;
  auto check = [&](const char* name, const auto& cu, std::size_t total, const char* tensor, long max_len,
                   const char* max_name) {
    if (cu(0) != 0) fail(fn, ": ", name, "(0) = ", cu(0), " but must be 0");
    long longest = 0;
    std::size_t at = 0;
    for (std::size_t s = 0; s < batch; ++s) {
      const long len = static_cast<long>(cu(s + 1)) - static_cast<long>(cu(s));
      if (len < 0)
        fail(fn, ": ", name, " decreases: ", name, "(", s + 1, ") = ", cu(s + 1), " < ", name, "(", s, ") = ", cu(s));
      if (len > longest) longest = len, at = s;
    }
    if (static_cast<std::size_t>(cu(batch)) != total)
      fail(fn, ": ", name, "(", batch, ") = ", cu(batch), " but ", total, " tokens are in ", tensor);
    if (longest > max_len)
      fail(fn, ": ", max_name, " = ", max_len, " but sequence ", at, " has ", longest, " tokens (", name, ")");
  };
  check("cu_seqlens_q", hq, total_q, q_what, max_seqlen_q, "max_seqlen_q");
  check("cu_seqlens_k", hk, total_k, k_what, max_seqlen_k, "max_seqlen_k");
  return Documents{cu_q.data(), cu_k.data(), static_cast<int>(batch)};
}

}  // namespace detail
}  // namespace kfa
