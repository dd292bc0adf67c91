#pragma once
/// kfa::dist ring buffers — the work buffers of a ring call, kept by the Ring between calls (K/V shards in
/// flight and their dK/dV accumulators, partial results, host staging), and the element-wise copies and
/// sequence slices over them.
#include <Kokkos_Core.hpp>
#include <kfa/detail/common/ranges.hpp>
#include <kfa/distributed/ring/communicator.hpp>
#include <kfa/mpi/shard.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <typeinfo>
#include <utility>

namespace kfa {
namespace dist {
namespace detail {

/// dst(b, i, h, c) (+)= src(b, i, h, c) for rank-4 Views on `space`.
template <class ExecSpace, class Dst, class Src>
void add_into(const ExecSpace& space, const Dst& dst, const Src& src, const char* label) {
  using D = typename Dst::non_const_value_type;
  if (dst.size() == 0) return;
  kfa::detail::for_each_element4(
      label, space, dst,
      KOKKOS_LAMBDA(const std::int64_t a, const std::int64_t b, const std::int64_t c, const std::int64_t d) {
        dst(a, b, c, d) += static_cast<D>(src(a, b, c, d));
      });
}

/// dst = src (rank 4), converting element types.
template <class ExecSpace, class Dst, class Src>
void copy_into(const ExecSpace& space, const Dst& dst, const Src& src, const char* label) {
  using D = typename Dst::non_const_value_type;
  if (dst.size() == 0) return;
  kfa::detail::for_each_element4(
      label, space, dst,
      KOKKOS_LAMBDA(const std::int64_t a, const std::int64_t b, const std::int64_t c, const std::int64_t d) {
        dst(a, b, c, d) = static_cast<D>(src(a, b, c, d));
      });
}

/// A flat buffer of at least `count` elements of T in Mem under `key`, held by the Ring (grown when too
/// small, the smaller one freed first). Keys starting "kfa::dist::buffer::" are work buffers: a ring call
/// releases them at its end (ReleaseWorkBuffers) unless the Ring caches them. Contents are unspecified.
template <class T, class Mem>
Kokkos::View<T*, Kokkos::LayoutRight, Mem> kept_buffer(const Ring& ring, const std::string& key, std::size_t count) {
  using Flat = Kokkos::View<T*, Kokkos::LayoutRight, Mem>;
  // keyed by the exact View type (half and bfloat16 have the same size but are different types)
  std::shared_ptr<void>& slot = ring.staging_slot(key + "::" + typeid(Flat).name());
  auto* v = static_cast<Flat*>(slot.get());
  if (!v || v->extent(0) < count) {
    slot.reset();
    slot = std::make_shared<Flat>(Kokkos::view_alloc(key, Kokkos::WithoutInitializing), count);
    v = static_cast<Flat*>(slot.get());
  }
  return *v;
}

/// Releases the Ring's work buffers when the ring call ends, normally or by an exception, unless the Ring
/// caches them (Ring::cache_buffers).
class ReleaseWorkBuffers {
 public:
  explicit ReleaseWorkBuffers(const Ring& ring) : m_ring(ring) {}
  ~ReleaseWorkBuffers() {
    if (!m_ring.cache_buffers()) m_ring.release_buffers();
  }
  ReleaseWorkBuffers(const ReleaseWorkBuffers&) = delete;
  ReleaseWorkBuffers& operator=(const ReleaseWorkBuffers&) = delete;

 private:
  const Ring& m_ring;
};

/// A rank-4 LayoutRight [n0, n1, n2, n3] View over a kept buffer (see kept_buffer).
template <class T, class Mem>
Kokkos::View<T****, Kokkos::LayoutRight, Mem, Kokkos::MemoryUnmanaged> kept_tensor(const Ring& ring,
                                                                                   const std::string& key, long n0,
                                                                                   long n1, long n2, long n3) {
  const auto flat = kept_buffer<T, Mem>(ring, key, static_cast<std::size_t>(n0 * n1 * n2 * n3));
  return Kokkos::View<T****, Kokkos::LayoutRight, Mem, Kokkos::MemoryUnmanaged>(flat.data(), n0, n1, n2, n3);
}
/// A rank-3 LayoutRight View over a kept buffer.
template <class T, class Mem>
Kokkos::View<T***, Kokkos::LayoutRight, Mem, Kokkos::MemoryUnmanaged> kept_tensor(const Ring& ring,
                                                                                  const std::string& key, long n0,
                                                                                  long n1, long n2) {
  const auto flat = kept_buffer<T, Mem>(ring, key, static_cast<std::size_t>(n0 * n1 * n2));
  return Kokkos::View<T***, Kokkos::LayoutRight, Mem, Kokkos::MemoryUnmanaged>(flat.data(), n0, n1, n2);
}

/// Buffers of one traveling K/V shard (and, in the backward pass, its dK/dV accumulators), sized for the
/// longest shard; a shard of n tokens uses the first 2·B·n·H_kv·d elements as [2][B][n][H_kv][d].
template <class T, class Mem>
struct KvBuffer {
  using Flat = Kokkos::View<T*, Kokkos::LayoutRight, Mem>;
  using Tile = Kokkos::View<T****, Kokkos::LayoutRight, Mem, Kokkos::MemoryUnmanaged>;
  Flat data;
  long batch = 0, heads = 0, dim = 0;
  KvBuffer(const Ring& ring, const std::string& key, long b, long n_max, long h, long d)
      : data(kept_buffer<T, Mem>(ring, key, static_cast<std::size_t>(2 * b * n_max * h * d))),
        batch(b),
        heads(h),
        dim(d) {}
  std::size_t count(long n) const { return static_cast<std::size_t>(2 * batch * n * heads * dim); }
  /// which = 0: K (or dK), 1: V (or dV), for a shard of n tokens.
  Tile tile(long n, int which) const {
    return Tile(data.data() + which * batch * n * heads * dim, batch, n, heads, dim);
  }
};

template <class V>
auto seq_slice(const V& x, const Segment& s) {
  return Kokkos::subview(x, Kokkos::ALL, std::make_pair(s.local_begin, s.local_begin + s.length), Kokkos::ALL,
                         Kokkos::ALL);
}
template <class V>
auto lse_slice(const V& x, const Segment& s) {
  return Kokkos::subview(x, Kokkos::ALL, Kokkos::ALL, std::make_pair(s.local_begin, s.local_begin + s.length));
}

}  // namespace detail
}  // namespace dist
}  // namespace kfa
