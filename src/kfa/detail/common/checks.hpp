#pragma once
/// common/checks.hpp: host-side argument checks shared by the attention entry points. Everything here runs
/// before any kernel launch, so a failed check leaves every output untouched.
#include <kfa/error.hpp>
#include <kfa/options.hpp>
#include <kfa/types.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

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

/// Byte range [first element, one past the last element] of a non-empty View. (View::span() may
/// over-state it for strided subviews: a dimension of extent 1 still contributes its stride.)
template <class View>
std::pair<std::uintptr_t, std::uintptr_t> byte_range(const View& x) {
  std::size_t last = 0;
  for (unsigned r = 0; r < View::rank; ++r) last += (x.extent(r) - 1) * x.stride(r);
  const auto p = reinterpret_cast<std::uintptr_t>(x.data());
  return {p, p + (last + 1) * sizeof(typename View::value_type)};
}

/// Element offsets of a View as (stride, extent) pairs, largest stride first, extent-1 dims dropped.
template <class View>
std::vector<std::pair<long, long>> stride_extents(const View& x) {
  std::vector<std::pair<long, long>> se;
  for (unsigned r = 0; r < View::rank; ++r)
    if (x.extent(r) > 1) se.emplace_back(static_cast<long>(x.stride(r)), static_cast<long>(x.extent(r)));
  std::sort(se.begin(), se.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return se;
}

/// Is delta = Σ e_k·s_k for integers |e_k| < n_k? Exact for nested strides (each stride larger than the
/// reach of all smaller ones), where at most two digits are possible per level.
inline bool representable(const std::vector<std::pair<long, long>>& se, std::size_t k, long delta) {
  if (k == se.size()) return delta == 0;
  long reach = 0;  // largest |Σ_{m>k} e_m s_m|
  for (std::size_t m = k + 1; m < se.size(); ++m) reach += (se[m].second - 1) * se[m].first;
  const long s = se[k].first;
  const long lo = delta >= 0 ? delta / s : -((-delta + s - 1) / s);  // floor(delta / s)
  for (long e : {lo, lo + 1}) {
    if (e <= -se[k].second || e >= se[k].second) continue;
    const long rem = delta - e * s;
    if (rem >= -reach && rem <= reach && representable(se, k + 1, rem)) return true;
  }
  return false;
}

/// overlaps() for two Views of one element size and rank whose byte ranges intersect; b starts
/// `diff_bytes` after a.
template <class A, class B>
bool same_shape_overlap(const A& a, const B& b, std::uintptr_t diff_bytes_unsigned) {
  constexpr std::size_t ea = sizeof(typename A::value_type);
  for (unsigned r = 0; r < A::rank; ++r)
    if (a.stride(r) != b.stride(r) || a.extent(r) != b.extent(r)) return true;
  const auto se = stride_extents(a);
  for (std::size_t k = 0; k + 1 < se.size(); ++k) {
    long reach = 0;
    for (std::size_t m = k + 1; m < se.size(); ++m) reach += (se[m].second - 1) * se[m].first;
    if (se[k].first <= reach) return true;  // not nested: stay conservative
  }
  const long diff = static_cast<long>(diff_bytes_unsigned);
  if (diff % static_cast<long>(ea) != 0) return true;
  return representable(se, 0, diff / static_cast<long>(ea));
}

/// True when two Views may share an element. Exact for Views with the same element size and strides in a
/// nested layout (e.g. the q, k, v slices of one packed QKV tensor, which interleave without sharing);
/// otherwise conservative: any overlap of their byte ranges counts.
template <class A, class B>
bool overlaps(const A& a, const B& b) {
  if (a.size() == 0 || b.size() == 0 || a.data() == nullptr || b.data() == nullptr) return false;
  const auto ra = byte_range(a);
  const auto rb = byte_range(b);
  if (!(ra.first < rb.second && rb.first < ra.second)) return false;
  constexpr std::size_t ea = sizeof(typename A::value_type), eb = sizeof(typename B::value_type);
  if constexpr (ea != eb || static_cast<int>(A::rank) != static_cast<int>(B::rank)) {
    return true;
  } else {
    return same_shape_overlap(a, b, rb.first - ra.first);
  }
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
      fail(fn, ": ", name, ".extent(", r, ") = ", x.extent(r), " but must be ", w, " (", name, " is ", extents_of(x),
           ", expected ", extents_string(want), ")");
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
  if (opts.window_right < -1) fail(fn, ": opts.window_right = ", opts.window_right, " (must be >= -1; -1 = unbounded)");
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

template <class T>
double resolved_scale(const AttentionOptions& opts, std::size_t head_dim) {
  return opts.softmax_scale > 0 ? opts.softmax_scale : 1.0 / std::sqrt(static_cast<double>(head_dim));
}

/// The element types of q, k, v, o and lse (forward and backward).
template <class QV, class KV, class VV, class OV, class LV>
void static_check_elements() {
  using T = typename QV::non_const_value_type;
  static_assert(is_supported_element<T>::value, "kfa: element type must be double, float, half or bfloat16");
  static_assert(std::is_same<T, typename KV::non_const_value_type>::value &&
                    std::is_same<T, typename VV::non_const_value_type>::value &&
                    std::is_same<T, typename OV::non_const_value_type>::value,
                "kfa: q, k, v and o must have the same element type");
  static_assert(std::is_same<accumulator_t<T>, typename LV::non_const_value_type>::value,
                "kfa: lse must hold the accumulation type (double for double inputs, float otherwise)");
}

template <class ExecSpace, class QV, class KV, class VV, class OV, class LV>
void static_check_forward() {
  static_check_view<ExecSpace, QV, 4, false>();
  static_check_view<ExecSpace, KV, 4, false>();
  static_check_view<ExecSpace, VV, 4, false>();
  static_check_view<ExecSpace, OV, 4, true>();
  static_check_view<ExecSpace, LV, 3, true>();
  static_check_elements<QV, KV, VV, OV, LV>();
}

/// All run-time checks of attention_forward and reference_attention.
template <class QV, class KV, class VV, class OV, class LV>
void check_forward(const char* fn, const QV& q, const KV& k, const VV& v, const OV& o, const LV& lse,
                   const AttentionOptions& opts) {
  check_qkv_and_options(fn, q, k, v, opts);
  check_extents(fn, "o", o, {q.extent(0), q.extent(1), q.extent(2), q.extent(3)});
  check_extents(fn, "lse", lse, {q.extent(0), q.extent(2), q.extent(1)});
  check_no_alias(fn, "o", o, "q", q);
  check_no_alias(fn, "o", o, "k", k);
  check_no_alias(fn, "o", o, "v", v);
  check_no_alias(fn, "lse", lse, "q", q);
  check_no_alias(fn, "lse", lse, "k", k);
  check_no_alias(fn, "lse", lse, "v", v);
  check_no_alias(fn, "lse", lse, "o", o);
}
template <class ExecSpace, class QV, class KV, class VV, class OV, class DOV, class LV, class DQV, class DKV, class DVV>
void static_check_backward() {
  static_check_view<ExecSpace, QV, 4, false>();
  static_check_view<ExecSpace, KV, 4, false>();
  static_check_view<ExecSpace, VV, 4, false>();
  static_check_view<ExecSpace, OV, 4, false>();  // the forward's outputs are the backward's inputs: may be const
  static_check_view<ExecSpace, LV, 3, false>();
  static_check_elements<QV, KV, VV, OV, LV>();
  static_check_view<ExecSpace, DOV, 4, false>();
  static_check_view<ExecSpace, DQV, 4, true>();
  static_check_view<ExecSpace, DKV, 4, true>();
  static_check_view<ExecSpace, DVV, 4, true>();
  using T = typename QV::non_const_value_type;
  static_assert(std::is_same<T, typename DOV::non_const_value_type>::value &&
                    std::is_same<T, typename DQV::non_const_value_type>::value &&
                    std::is_same<T, typename DKV::non_const_value_type>::value &&
                    std::is_same<T, typename DVV::non_const_value_type>::value,
                "kfa: d_o, dq, dk and dv must have the same element type as q");
}

/// All run-time checks of attention_backward and reference_attention_backward.
template <class QV, class KV, class VV, class OV, class DOV, class LV, class DQV, class DKV, class DVV>
void check_backward(const char* fn, const QV& q, const KV& k, const VV& v, const OV& o, const DOV& d_o, const LV& lse,
                    const DQV& dq, const DKV& dk, const DVV& dv, const AttentionOptions& opts) {
  check_qkv_and_options(fn, q, k, v, opts);
  check_extents(fn, "o", o, {q.extent(0), q.extent(1), q.extent(2), q.extent(3)});
  check_extents(fn, "d_o", d_o, {q.extent(0), q.extent(1), q.extent(2), q.extent(3)});
  check_extents(fn, "lse", lse, {q.extent(0), q.extent(2), q.extent(1)});
  check_extents(fn, "dq", dq, {q.extent(0), q.extent(1), q.extent(2), q.extent(3)});
  check_extents(fn, "dk", dk, {k.extent(0), k.extent(1), k.extent(2), k.extent(3)});
  check_extents(fn, "dv", dv, {k.extent(0), k.extent(1), k.extent(2), k.extent(3)});
  auto inputs_of = [&](const char* out_name, const auto& out) {
    check_no_alias(fn, out_name, out, "q", q);
    check_no_alias(fn, out_name, out, "k", k);
    check_no_alias(fn, out_name, out, "v", v);
    check_no_alias(fn, out_name, out, "o", o);
    check_no_alias(fn, out_name, out, "d_o", d_o);
    check_no_alias(fn, out_name, out, "lse", lse);
  };
  inputs_of("dq", dq);
  inputs_of("dk", dk);
  inputs_of("dv", dv);
  check_no_alias(fn, "dq", dq, "dk", dk);
  check_no_alias(fn, "dq", dq, "dv", dv);
  check_no_alias(fn, "dk", dk, "dv", dv);
}
}  // namespace detail
}  // namespace kfa
