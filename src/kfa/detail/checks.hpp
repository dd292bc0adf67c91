#pragma once
/// Host-side argument checks shared by the attention entry points. Everything here runs before any
/// kernel launch, so a failed check leaves every output untouched.
#include <kfa/error.hpp>
#include <kfa/options.hpp>
#include <kfa/types.hpp>

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

namespace kfa {
namespace detail {

/// Compile-time checks on one View argument.
template <class ExecSpace, class View, int Rank, bool Output>
constexpr void static_check_view() {
  static_assert(Kokkos::is_view<View>::value, "kfa: attention arguments must be Kokkos::View");
  static_assert(static_cast<int>(View::rank) == Rank,
                "kfa: q, k, v, o (and gradients) must be rank 4 [batch, seq, heads, head_dim]; lse rank 3 "
                "[batch, heads, seq]");
  static_assert(!Output || !std::is_const<typename View::value_type>::value,
                "kfa: output Views (o, lse, gradients) must not have a const value type");
  static_assert(Kokkos::SpaceAccessibility<ExecSpace, typename View::memory_space>::accessible,
                "kfa: a View's memory space is not accessible from the execution space");
}

/// Byte range [begin, end) that a View may touch (its span, including stride gaps).
template <class View>
std::pair<std::uintptr_t, std::uintptr_t> byte_range(const View& x) {
  const auto p = reinterpret_cast<std::uintptr_t>(x.data());
  return {p, p + x.span() * sizeof(typename View::value_type)};
}

template <class A, class B>
bool overlaps(const A& a, const B& b) {
  if (a.span() == 0 || b.span() == 0 || a.data() == nullptr || b.data() == nullptr) return false;
  const auto ra = byte_range(a);
  const auto rb = byte_range(b);
  return ra.first < rb.second && rb.first < ra.second;
}

inline std::string extents_string(std::initializer_list<std::size_t> e) {
  std::string s = "[";
  bool first = true;
  for (auto x : e) {
    s += (first ? "" : ", ") + std::to_string(x);
    first = false;
  }
  return s + "]";
}

template <class V>
std::string extents_of(const V& x) {
  if (V::rank == 3) return extents_string({x.extent(0), x.extent(1), x.extent(2)});
  return extents_string({x.extent(0), x.extent(1), x.extent(2), x.extent(3)});
}

/// Checks a tensor against the extents it must have.
template <class V>
void check_extents(const char* fn, const char* name, const V& x, std::initializer_list<std::size_t> want) {
  std::size_t r = 0;
  for (auto w : want) {
    if (x.extent(r) != w)
      fail(fn, ": ", name, ".extent(", r, ") = ", x.extent(r), " but must be ", w, " (", name, " is ",
           extents_of(x), ", expected ", extents_string(want), ")");
    ++r;
  }
}

/// Shapes and options common to forward and backward: q [B, Nq, Hq, d], k/v [B, Nk, Hkv, d].
template <class QV, class KV, class VV>
void check_qkv_and_options(const char* fn, const QV& q, const KV& k, const VV& v, const AttentionOptions& opts) {
  if (k.extent(0) != q.extent(0))
    fail(fn, ": k.extent(0) = ", k.extent(0), " but q.extent(0) = ", q.extent(0), " (batch)");
  if (k.extent(3) != q.extent(3))
    fail(fn, ": k.extent(3) = ", k.extent(3), " but q.extent(3) = ", q.extent(3), " (head_dim)");
  check_extents(fn, "v", v, {k.extent(0), k.extent(1), k.extent(2), k.extent(3)});
  const std::size_t hq = q.extent(2), hkv = k.extent(2), d = q.extent(3);
  if (hq > 0 && (hkv == 0 || hq % hkv != 0))
    fail(fn, ": q.extent(2) = ", hq, " query heads is not a multiple of k.extent(2) = ", hkv, " key/value heads");
  if (d % 8 != 0 || d < 8 || d > 256)
    fail(fn, ": head_dim q.extent(3) = ", d, " is unsupported (must be a multiple of 8 in [8, 256])");
  if (opts.window_left < -1) fail(fn, ": opts.window_left = ", opts.window_left, " (must be >= -1; -1 = unbounded)");
  if (opts.window_right < -1)
    fail(fn, ": opts.window_right = ", opts.window_right, " (must be >= -1; -1 = unbounded)");
  if (!std::isfinite(opts.softmax_scale) || opts.softmax_scale < 0)
    fail(fn, ": opts.softmax_scale = ", opts.softmax_scale, " (must be finite and >= 0; 0 = 1/sqrt(head_dim))");
  if (!std::isfinite(opts.softcap) || opts.softcap < 0)
    fail(fn, ": opts.softcap = ", opts.softcap, " (must be finite and >= 0; 0 = off)");
  if (opts.block_q < 0) fail(fn, ": opts.block_q = ", opts.block_q, " (must be >= 0; 0 = automatic)");
  if (opts.block_k < 0) fail(fn, ": opts.block_k = ", opts.block_k, " (must be >= 0; 0 = automatic)");
}

/// Throws if output `out` shares memory with input `in`.
template <class Out, class In>
void check_no_alias(const char* fn, const char* out_name, const Out& out, const char* in_name, const In& in) {
  if (overlaps(out, in)) fail(fn, ": output ", out_name, " overlaps input ", in_name, " in memory");
}

}  // namespace detail
}  // namespace kfa
