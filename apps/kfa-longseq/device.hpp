#pragma once
// kfa-longseq: the element-wise work on the device: generated inputs (a counter hash, the same values for
// any rank count and layout), the first non-finite element of a tensor, and the row dot products D = dO·O
// the gradient check needs.
#include "common.hpp"

#include <kfa/compat.hpp>

#include <cstdint>

namespace longseq {

/// Element `flat` (its index in the global row-major [batch, seq, heads, head_dim] tensor) of generated
/// tensor `id` (0 q, 1 k, 2 v, 3 dO), uniform in [-1, 1): splitmix64 of the seed, the tensor and the index.
/// The same on host and device, so the check regenerates any element the device generated.
KOKKOS_INLINE_FUNCTION double generated(std::uint64_t seed, int id, std::uint64_t flat) {
  std::uint64_t z = seed * 0x9E3779B97F4A7C15ULL + (static_cast<std::uint64_t>(id) << 56) + flat;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * (2.0 / 9007199254740992.0) - 1.0;
}

/// Two-dimensional range over (token, element of the token's row) of a [batch, n, heads, d] tensor, the
/// element index fastest: the order of LayoutRight memory on every backend (Kokkos' default on CUDA would
/// make every warp touch 32 rows).
using TokenRange = Kokkos::MDRangePolicy<Exec, Kokkos::Rank<2, Kokkos::Iterate::Right, Kokkos::Iterate::Right>,
                                         Kokkos::IndexType<std::int64_t>>;
inline TokenRange token_range(std::int64_t tokens, std::int64_t row) {
  TokenRange::point_type lo{}, hi{};
  lo[0] = 0, lo[1] = 0, hi[0] = tokens, hi[1] = row;
  return TokenRange(lo, hi);
}

/// The global position of each of this rank's n local tokens, on the device.
inline Kokkos::View<std::int64_t*, Mem> global_positions(const Shard& s) {
  Kokkos::View<std::int64_t*, Mem> g(Kokkos::view_alloc("kfa-longseq::global_positions", Kokkos::WithoutInitializing),
                                     s.n);
  const auto h = Kokkos::create_mirror_view(g);
  for (const auto& sg : s.segs)
    for (long t = 0; t < sg.length; ++t) h(sg.local_begin + t) = sg.global_begin + t;
  Kokkos::deep_copy(g, h);
  return g;
}

/// Fills x [batch, n, heads, d], this rank's shard of generated tensor `id`, on the device in T: element
/// (b, i, h, e) is generated(seed, id, global index) rounded to T, at the global position of local token i.
template <class T>
void generate_shard(const Tensor<T>& x, const Shard& s, std::uint64_t seed, int id) {
  if (x.size() == 0) return;
  const std::int64_t n = s.n, seq = s.seq, row = static_cast<std::int64_t>(x.extent(2) * x.extent(3));
  const auto global = global_positions(s);
  T* const p = x.data();
  Kokkos::parallel_for(
      "kfa-longseq::generate", token_range(static_cast<std::int64_t>(x.extent(0)) * n, row),
      KOKKOS_LAMBDA(const std::int64_t t, const std::int64_t e) {
        const std::int64_t b = t / n, gi = global(t - b * n);
        p[t * row + e] = static_cast<T>(generated(seed, id, static_cast<std::uint64_t>((b * seq + gi) * row + e)));
      });
}

/// The global row-major index ([batch, seq, heads, d]) of the first NaN or ±Inf element (as float64) of x
/// [batch, n, heads, d], this rank's shard, or -1. Blocks.
template <class T>
long long first_nonfinite_in_shard(const Tensor<T>& x, const Shard& s) {
  if (x.size() == 0) return -1;
  const T* const p = x.data();
  const auto global = global_positions(s);
  const std::int64_t n = s.n, seq = s.seq, row = static_cast<std::int64_t>(x.extent(2) * x.extent(3));
  long long first = 0;
  Kokkos::parallel_reduce(
      "kfa-longseq::first_nonfinite", Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::int64_t>>(0, x.size()),
      KOKKOS_LAMBDA(const std::int64_t i, long long& m) {
        if (kfa::compat::isfinite(to_double(p[i]))) return;
        const std::int64_t t = i / row, b = t / n;
        const long long at = (b * seq + global(t - b * n)) * row + i % row;
        if (at < m) m = at;
      },
      Kokkos::Min<long long>(first));
  Kokkos::fence();
  return first == Kokkos::reduction_identity<long long>::min() ? -1 : first;
}

/// D(b, i, h) = sum_e a(b, i, h, e) b(b, i, h, e) in float64 [batch, n, heads] (the backward pass's
/// D = dO·O of every query row), on the device.
template <class T>
Kokkos::View<double***, Kokkos::LayoutRight, Mem> row_dots(const Tensor<T>& a, const Tensor<T>& b) {
  Kokkos::View<double***, Kokkos::LayoutRight, Mem> out(
      Kokkos::view_alloc("kfa-longseq::row_dots", Kokkos::WithoutInitializing), a.extent(0), a.extent(1), a.extent(2));
  if (out.size() == 0) return out;
  const std::int64_t d = static_cast<std::int64_t>(a.extent(3)), heads = static_cast<std::int64_t>(a.extent(2));
  const T* const pa = a.data();
  const T* const pb = b.data();
  double* const po = out.data();
  Kokkos::parallel_for(
      "kfa-longseq::row_dots", token_range(static_cast<std::int64_t>(a.extent(0) * a.extent(1)), heads),
      KOKKOS_LAMBDA(const std::int64_t t, const std::int64_t h) {
        const std::int64_t at = (t * heads + h) * d;
        double x = 0;
        for (std::int64_t e = 0; e < d; ++e) x += to_double(pa[at + e]) * to_double(pb[at + e]);
        po[t * heads + h] = x;
      });
  Kokkos::fence();
  return out;
}

}  // namespace longseq
