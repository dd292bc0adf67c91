// Shards of global test tensors for the MPI tests: the rows a rank holds, the same seed on every rank.
#pragma once
#include <kfa/attention.hpp>
#include <kfa/mpi/shard.hpp>

#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
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

// A packed stream of documents (lengths lq of the queries, lk of the keys; hq and hkv heads of dimension d) with
// fresh random tensors from the shared seed, attention_forward_varlen / attention_backward_varlen of the whole
// stream on one rank, and this rank's shards of it in `layout` (document_shard), for checking a distributed call.
template <class T>
struct PackedStream {
  using Lse2 = Kokkos::View<kfa::accumulator_t<T>**, Kokkos::LayoutRight, Mem>;
  int tq = 0, tk = 0, mq = 0, mk = 0, hq, hkv, d;
  Kokkos::View<int*, Mem> cu_q, cu_k;
  Tensor<T> o1, dq1, dk1, dv1;  // one rank, the whole stream
  Lse2 lse1;
  std::vector<kfa::dist::Segment> qs, ks;  // this rank's shards, and their tensors
  Tensor<T> ql, kl, vl, dol;
  PackedStream(kfa::dist::Layout layout, const std::vector<int>& lq, const std::vector<int>& lk, int hq_, int hkv_,
               int d_, const kfa::AttentionOptions& opts, std::uint64_t seed)
      : hq(hq_), hkv(hkv_), d(d_) {
    for (size_t s = 0; s < lq.size(); ++s) tq += lq[s], tk += lk[s], mq = std::max(mq, lq[s]), mk = std::max(mk, lk[s]);
    std::mt19937_64 rng(seed);
    Tensor<T> q("q", 1, tq, hq, d), k("k", 1, tk, hkv, d), v("v", 1, tk, hkv, d), d_o("do", 1, tq, hq, d);
    fill_random(q, rng), fill_random(k, rng), fill_random(v, rng), fill_random(d_o, rng);
    cu_q = cu_of(lq), cu_k = cu_of(lk);
    o1 = Tensor<T>("o1", 1, tq, hq, d), dq1 = Tensor<T>("dq1", 1, tq, hq, d);
    dk1 = Tensor<T>("dk1", 1, tk, hkv, d), dv1 = Tensor<T>("dv1", 1, tk, hkv, d);
    lse1 = Lse2("lse1", hq, tq);
    kfa::attention_forward_varlen(Exec(), p3(q), p3(k), p3(v), p3(o1), lse1, cu_q, cu_k, mq, mk, opts);
    kfa::attention_backward_varlen(Exec(), p3(q), p3(k), p3(v), p3(o1), p3(d_o), lse1, p3(dq1), p3(dk1), p3(dv1), cu_q,
                                   cu_k, mq, mk, opts);
    Exec().fence();
    std::vector<int> cq{0}, ck{0};
    for (size_t s = 0; s < lq.size(); ++s) cq.push_back(cq.back() + lq[s]), ck.push_back(ck.back() + lk[s]);
    qs = kfa::dist::document_shard(layout, cq, world_size(), world_rank());
    ks = kfa::dist::document_shard(layout, ck, world_size(), world_rank());
    ql = shard(q, qs), dol = shard(d_o, qs), kl = shard(k, ks), vl = shard(v, ks);
  }
  std::string describe(const RefOptions& ro, std::uint64_t seed, std::size_t documents) const {
    return kfa_test::describe(Shape{1, tq, tk, hq, hkv, d}, ro, seed) + " varlen, " + std::to_string(documents) +
           " sequences";
  }
  // This rank's shards of a distributed call's results against the one-rank call's rows, within `tol`.
  void expect_shard(const Tensor<T>& o, const Lse2& lse, const Tensor<T>& dq, const Tensor<T>& dk, const Tensor<T>& dv,
                    double tol) const {
    const Shape sq{1, tq, tk, hq, hkv, d};
    EXPECT_TRUE(close_frobenius(to_doubles4(o), take_rows4(to_doubles4(o1), sq, hq, tq, qs), tol)) << "o";
    const auto l1 = doubles2(lse1);  // lse [heads, total]: the shard's rows of every head
    std::vector<double> lwant;
    for (int h = 0; h < hq; ++h)
      for (const auto& sg : qs)
        for (long i = sg.global_begin; i < sg.global_begin + sg.length; ++i) lwant.push_back(l1[size_t(h) * tq + i]);
    EXPECT_TRUE(close_lse(doubles2(lse), lwant, tol)) << "lse";
    EXPECT_TRUE(close_frobenius(to_doubles4(dq), take_rows4(to_doubles4(dq1), sq, hq, tq, qs), tol)) << "dq";
    EXPECT_TRUE(close_frobenius(to_doubles4(dk), take_rows4(to_doubles4(dk1), sq, hkv, tk, ks), tol)) << "dk";
    EXPECT_TRUE(close_frobenius(to_doubles4(dv), take_rows4(to_doubles4(dv1), sq, hkv, tk, ks), tol)) << "dv";
  }
};

}  // namespace kfa_test
