// Shards of global test tensors for the MPI tests: the rows a rank holds, the same seed on every rank.
#pragma once
#include <kfa/mpi/shard.hpp>

#include <mpi.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "../common/kfa_test.hpp"

namespace kfa_test {

inline int world_rank() {
  int r;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
inline int world_size() {
  int p;
  MPI_Comm_size(MPI_COMM_WORLD, &p);
  return p;
}
inline std::uint64_t shared_seed() {
  std::uint64_t s = world_rank() == 0 ? fresh_seed() : 0;
  MPI_Bcast(&s, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  return s;
}

// Rows of a [b, n, h, d] flat array (or [b, h, n] for lse) picked by the segments, in local order.
inline std::vector<double> take_rows4(const std::vector<double>& g, const Shape& s, int heads, long n_total,
                                      const std::vector<kfa::dist::Segment>& segs) {
  std::vector<double> out;
  for (int b = 0; b < s.batch; ++b)
    for (const auto& sg : segs)
      for (long i = sg.global_begin; i < sg.global_begin + sg.length; ++i)
        for (int x = 0; x < heads * s.head_dim; ++x)
          out.push_back(g[(size_t(b) * n_total + i) * heads * s.head_dim + x]);
  return out;
}
inline std::vector<double> take_rows3(const std::vector<double>& g, const Shape& s, long n_total,
                                      const std::vector<kfa::dist::Segment>& segs) {
  std::vector<double> out;
  for (int b = 0; b < s.batch; ++b)
    for (int h = 0; h < s.heads_q; ++h)
      for (const auto& sg : segs)
        for (long i = sg.global_begin; i < sg.global_begin + sg.length; ++i)
          out.push_back(g[(size_t(b) * s.heads_q + h) * n_total + i]);
  return out;
}
// Local shard View holding the given global rows.
template <class T>
Tensor<T> shard(const Tensor<T>& g, const std::vector<kfa::dist::Segment>& segs) {
  long n = 0;
  for (const auto& sg : segs) n += sg.length;
  Tensor<T> out("shard", g.extent(0), n, g.extent(2), g.extent(3));
  for (const auto& sg : segs)
    Kokkos::deep_copy(Kokkos::subview(out, Kokkos::ALL, std::make_pair(sg.local_begin, sg.local_begin + sg.length),
                                      Kokkos::ALL, Kokkos::ALL),
                      Kokkos::subview(g, Kokkos::ALL, std::make_pair(sg.global_begin, sg.global_begin + sg.length),
                                      Kokkos::ALL, Kokkos::ALL));
  return out;
}

// Packed [tokens, heads, d] views of a batch-of-one tensor, cu_seqlens of lengths, a rank-2 View as doubles.
template <class T>
using Packed3 = Kokkos::View<T***, Kokkos::LayoutRight, Mem, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
template <class T>
Packed3<T> p3(const Tensor<T>& x) {
  return Packed3<T>(x.data(), x.extent(1), x.extent(2), x.extent(3));
}
inline Kokkos::View<int*, Mem> cu_of(const std::vector<int>& len) {
  Kokkos::View<int*, Mem> d("cu_seqlens", len.size() + 1);
  auto h = Kokkos::create_mirror_view(d);
  h(0) = 0;
  for (size_t s = 0; s < len.size(); ++s) h(s + 1) = h(s) + len[s];
  Kokkos::deep_copy(d, h);
  return d;
}
template <class V>
std::vector<double> doubles2(const V& x) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), x);
  std::vector<double> out;
  for (size_t a = 0; a < x.extent(0); ++a)
    for (size_t b = 0; b < x.extent(1); ++b) out.push_back(static_cast<double>(h(a, b)));
  return out;
}

}  // namespace kfa_test
