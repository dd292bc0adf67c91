// Ulysses and hybrid sequence parallelism on P ranks, every degree U that divides P, against the tests' float64
// attention over the whole sequence and against the ring's result on the same shards (seed broadcast from rank 0,
// fresh every run).
#include <kfa/distributed/dist.hpp>

#include <cstdlib>
#include <string>
#include <vector>

#include "../common/kfa_test.hpp"
#include "shards.hpp"

using namespace kfa_test;
using kfa::dist::Layout;

namespace {

std::vector<int> degrees_of(int p) {
  std::vector<int> u;
  for (int x = 1; x <= p; ++x)
    if (p % x == 0) u.push_back(x);
  return u;
}

struct Case {
  Layout layout;
  RefOptions ro;
  Shape s;
  std::size_t max_message_bytes = 0;  // 0: the default
};

// The shards of every rank (seq_q and seq_k cut alike by the layout).
std::vector<kfa::dist::Segment> segs_of(Layout layout, long n, int p, int r) {
  return kfa::dist::shard_of(layout, n, p, r);
}

template <class T>
void check_ulysses(const Case& c, int degree) {
  const int p = world_size(), r = world_rank();
  const std::uint64_t seed = shared_seed();
  const Shape& s = c.s;
  SCOPED_TRACE(describe(s, c.ro, seed) + " layout " + kfa::dist::to_string(c.layout) + " P " + std::to_string(p) +
               " U " + std::to_string(degree));
  std::mt19937_64 rng(seed);
  Tensor<T> q("q", s.batch, s.seq_q, s.heads_q, s.head_dim), k("k", s.batch, s.seq_k, s.heads_kv, s.head_dim),
      v("v", s.batch, s.seq_k, s.heads_kv, s.head_dim), d_o("do", s.batch, s.seq_q, s.heads_q, s.head_dim);
  const auto qh = fill_random(q, rng), kh = fill_random(k, rng), vh = fill_random(v, rng), doh = fill_random(d_o, rng);
  const auto qs = segs_of(c.layout, s.seq_q, p, r), ks = segs_of(c.layout, s.seq_k, p, r);
  auto ql = shard(q, qs), kl = shard(k, ks), vl = shard(v, ks), dol = shard(d_o, qs);
  const long nq = ql.extent(1), nk = kl.extent(1);
  kfa::dist::Ulysses u(MPI_COMM_WORLD, degree, c.layout);
  EXPECT_EQ(u.degree(), degree);
  EXPECT_EQ(u.ring_degree(), p / degree);
  if (c.max_message_bytes) u.set_max_message_bytes(c.max_message_bytes);
  const kfa::AttentionOptions opts = to_kfa(c.ro);
  Tensor<T> o("o", s.batch, nq, s.heads_q, s.head_dim);
  Lse<T> lse("lse", s.batch, s.heads_q, nq);
  poison(o), poison(lse);
  kfa::dist::UlyssesStats fst;
  kfa::dist::ulysses_attention_forward(Exec(), u, ql, kl, vl, o, lse, opts, &fst);
  if (degree == 1) EXPECT_EQ(fst.a2a_bytes, 0u) << "U = 1 has no all-to-all";
  if (degree == 1) EXPECT_EQ(fst.ring.steps.size(), std::size_t(p)) << "U = 1 is the ring of all ranks";
  if (degree > 1) EXPECT_GT(fst.a2a_bytes, 0u);
  EXPECT_EQ(fst.heads.q_local, s.heads_q / degree);
  EXPECT_EQ(fst.ring.steps.empty(), false);
  std::vector<double> oref, lref;
  reference_forward64(s, c.ro, qh, kh, vh, oref, lref);
  EXPECT_TRUE(close_frobenius(to_doubles4(o), take_rows4(oref, s, s.heads_q, s.seq_q, qs), tolerance<T>()));
  EXPECT_TRUE(close_lse(to_doubles3(lse), take_rows3(lref, s, s.seq_q, qs), tolerance<kfa::accumulator_t<T>>()));
  // the ring of all P ranks on the same shards: equal within the dtype's tolerance
  kfa::dist::Ring ring(MPI_COMM_WORLD, c.layout);
  Tensor<T> o_ring("o_ring", s.batch, nq, s.heads_q, s.head_dim);
  Lse<T> lse_ring("lse_ring", s.batch, s.heads_q, nq);
  kfa::dist::ring_attention_forward(Exec(), ring, ql, kl, vl, o_ring, lse_ring, opts);
  EXPECT_TRUE(close_frobenius(to_doubles4(o), to_doubles4(o_ring), tolerance<T>())) << "o vs the ring's";

  Tensor<T> dq("dq", s.batch, nq, s.heads_q, s.head_dim), dk("dk", s.batch, nk, s.heads_kv, s.head_dim),
      dv("dv", s.batch, nk, s.heads_kv, s.head_dim);
  poison(dq), poison(dk), poison(dv);
  kfa::dist::UlyssesStats bst;
  kfa::dist::ulysses_attention_backward(Exec(), u, ql, kl, vl, o, dol, lse, dq, dk, dv, opts, &bst);
  std::vector<double> rdq, rdk, rdv;
  reference_backward64(s, c.ro, qh, kh, vh, doh, rdq, rdk, rdv);
  EXPECT_TRUE(close_frobenius(to_doubles4(dq), take_rows4(rdq, s, s.heads_q, s.seq_q, qs), tolerance<T>())) << "dq";
  EXPECT_TRUE(close_frobenius(to_doubles4(dk), take_rows4(rdk, s, s.heads_kv, s.seq_k, ks), tolerance<T>())) << "dk";
  EXPECT_TRUE(close_frobenius(to_doubles4(dv), take_rows4(rdv, s, s.heads_kv, s.seq_k, ks), tolerance<T>())) << "dv";
  Tensor<T> dq_r("dq_r", s.batch, nq, s.heads_q, s.head_dim), dk_r("dk_r", s.batch, nk, s.heads_kv, s.head_dim),
      dv_r("dv_r", s.batch, nk, s.heads_kv, s.head_dim);
  kfa::dist::ring_attention_backward(Exec(), ring, ql, kl, vl, o_ring, dol, lse_ring, dq_r, dk_r, dv_r, opts);
  EXPECT_TRUE(close_frobenius(to_doubles4(dq), to_doubles4(dq_r), tolerance<T>())) << "dq vs the ring's";
  EXPECT_TRUE(close_frobenius(to_doubles4(dk), to_doubles4(dk_r), tolerance<T>())) << "dk vs the ring's";
  EXPECT_TRUE(close_frobenius(to_doubles4(dv), to_doubles4(dv_r), tolerance<T>())) << "dv vs the ring's";
  // deterministic: a second backward (const inputs) is bitwise equal
  Tensor<T> dq2("dq2", s.batch, nq, s.heads_q, s.head_dim), dk2("dk2", s.batch, nk, s.heads_kv, s.head_dim),
      dv2("dv2", s.batch, nk, s.heads_kv, s.head_dim);
  poison(dq2), poison(dk2), poison(dv2);
  using C4 = Kokkos::View<const T****, Kokkos::LayoutRight, Mem>;
  const Kokkos::View<const kfa::accumulator_t<T>***, Kokkos::LayoutRight, Mem> lse_c = lse;
  kfa::dist::ulysses_attention_backward(Exec(), u, C4(ql), C4(kl), C4(vl), C4(o), C4(dol), lse_c, dq2, dk2, dv2, opts);
  EXPECT_EQ(to_doubles4(dq), to_doubles4(dq2));
  EXPECT_EQ(to_doubles4(dk), to_doubles4(dk2));
  EXPECT_EQ(to_doubles4(dv), to_doubles4(dv2));
}

// Ulysses of degree U over a packed stream of documents against attention_forward_varlen /
// attention_backward_varlen on the whole stream on one rank (same element type), every rank checking its shard,
// and a second backward bitwise equal.
template <class T>
void check_ulysses_varlen(Layout layout, int degree, const std::vector<int>& lq, const std::vector<int>& lk, int hq,
                          int hkv, const RefOptions& ro) {
  const int p = world_size(), d = 32;
  const std::uint64_t seed = shared_seed();
  const kfa::AttentionOptions opts = to_kfa(ro);
  const PackedStream<T> x(layout, lq, lk, hq, hkv, d, opts, seed);
  SCOPED_TRACE(x.describe(ro, seed, lq.size()) + ", layout " + kfa::dist::to_string(layout) + " P " +
               std::to_string(p) + " U " + std::to_string(degree));
  const long nq = x.ql.extent(1), nk = x.kl.extent(1);
  Tensor<T> o("o", 1, nq, hq, d), dq("dq", 1, nq, hq, d), dk("dk", 1, nk, hkv, d), dv("dv", 1, nk, hkv, d);
  typename PackedStream<T>::Lse2 lse("lse", hq, nq);
  poison(o), poison(lse), poison(dq), poison(dk), poison(dv);
  kfa::dist::Ulysses u(MPI_COMM_WORLD, degree, layout);
  kfa::dist::UlyssesStats fst;
  auto backward = [&](const Tensor<T>& gq, const Tensor<T>& gk, const Tensor<T>& gv) {
    kfa::dist::ulysses_attention_backward_varlen(Exec(), u, p3(x.ql), p3(x.kl), p3(x.vl), p3(o), p3(x.dol), lse, p3(gq),
                                                 p3(gk), p3(gv), x.cu_q, x.cu_k, x.mq, x.mk, opts);
    Exec().fence();
  };
  kfa::dist::ulysses_attention_forward_varlen(Exec(), u, p3(x.ql), p3(x.kl), p3(x.vl), p3(o), lse, x.cu_q, x.cu_k, x.mq,
                                              x.mk, opts, &fst);
  backward(dq, dk, dv);
  if (degree > 1) EXPECT_GT(fst.a2a_bytes, 0u);
  x.expect_shard(o, lse, dq, dk, dv, tolerance<T>());
  // deterministic: a second backward is bitwise equal
  Tensor<T> dq2("dq2", 1, nq, hq, d), dk2("dk2", 1, nk, hkv, d), dv2("dv2", 1, nk, hkv, d);
  poison(dq2), poison(dk2), poison(dv2);
  backward(dq2, dk2, dv2);
  EXPECT_EQ(to_doubles4(dq), to_doubles4(dq2));
  EXPECT_EQ(to_doubles4(dk), to_doubles4(dk2));
  EXPECT_EQ(to_doubles4(dv), to_doubles4(dv2));
}

}  // namespace

template <class T>
class Ulysses : public ::testing::Test {};
TYPED_TEST_SUITE(Ulysses, Dtypes, DtypeNames);

// Every degree that divides P (1: the ring alone; P: Ulysses alone; between: the hybrid), both layouts, causal or
// not, lengths that are not multiples of 2P (uneven shards).
TYPED_TEST(Ulysses, EveryDegreeBothLayouts) {
  const int p = world_size();
  for (int u : degrees_of(p))
    for (Layout layout : {Layout::contiguous, Layout::zigzag})
      for (bool causal : {false, true}) {
        RefOptions ro;
        ro.causal = causal;
        check_ulysses<TypeParam>({layout, ro, Shape{2, 19 * p + 5, 19 * p + 5, 12, 12, 32}}, u);
      }
}

// Key/value heads split (U divides heads_kv), shared (one per rank, MQA) and expanded (a rank's query heads span
// two key/value heads), each with its gradients summed over the ranks that held it.
TYPED_TEST(Ulysses, GroupedQueryAttention) {
  const int p = world_size();
  RefOptions ro;
  ro.causal = true;
  for (int u : degrees_of(p))
    for (int hkv : {4, 1, 6}) check_ulysses<TypeParam>({Layout::zigzag, ro, Shape{1, 21 * p, 21 * p, 12, hkv, 32}}, u);
}

TYPED_TEST(Ulysses, WindowsSoftcapAndUnequalLengths) {
  const int p = world_size();
  RefOptions w;
  w.window_left = 17, w.window_right = 4;
  RefOptions cw;
  cw.causal = true, cw.window_left = 9, cw.softcap = 3.0;
  for (int u : degrees_of(p)) {
    check_ulysses<TypeParam>({Layout::contiguous, w, Shape{1, 17 * p + 3, 17 * p + 3, 12, 4, 32}}, u);
    check_ulysses<TypeParam>({Layout::zigzag, cw, Shape{1, 17 * p + 3, 17 * p + 3, 12, 4, 32}}, u);
    // seq_q != seq_k (bottom-right alignment), as the ring takes them
    RefOptions causal;
    causal.causal = true;
    check_ulysses<TypeParam>({Layout::contiguous, causal, Shape{1, 11 * p + 1, 23 * p + 2, 12, 6, 32}}, u);
  }
}

// Every message of the all-to-all and of the ring in chunks of at most max_message_bytes.
TYPED_TEST(Ulysses, ChunkedMessages) {
  const int p = world_size();
  RefOptions ro;
  ro.causal = true;
  for (int u : degrees_of(p))
    check_ulysses<TypeParam>({Layout::zigzag, ro, Shape{1, 24 * p, 24 * p, 12, 4, 32}, 700}, u);
}

TEST(UlyssesHeads, PlanOfEveryKind) {
  using kfa::dist::KvHeads;
  const auto a = kfa::dist::plan_heads("f", 32, 8, 4);
  EXPECT_EQ(a.kv, KvHeads::split);
  EXPECT_EQ(a.q_local, 8);
  EXPECT_EQ(a.kv_local, 2);
  EXPECT_EQ(a.kv_head(3, 1), 7);
  const auto b = kfa::dist::plan_heads("f", 32, 2, 8);
  EXPECT_EQ(b.kv, KvHeads::shared);
  EXPECT_EQ(b.kv_local, 1);
  EXPECT_EQ(b.kv_head(3, 0), 0);
  EXPECT_EQ(b.kv_head(4, 0), 1);
  const auto c = kfa::dist::plan_heads("f", 12, 4, 3);  // 4 query heads per rank over groups of 3
  EXPECT_EQ(c.kv, KvHeads::expanded);
  EXPECT_EQ(c.kv_local, 4);
  EXPECT_EQ(c.kv_head(1, 0), 1);  // query head 4
  EXPECT_EQ(c.kv_head(1, 3), 2);  // query head 7
  try {
    kfa::dist::plan_heads("kfa::dist::ulysses_attention_forward", 12, 4, 8);
    ADD_FAILURE() << "12 heads over a degree of 8 accepted";
  } catch (const kfa::Error& e) {
    EXPECT_NE(std::string(e.what()).find("heads_q (q.extent(2)) = 12 is not divisible by the Ulysses degree 8"),
              std::string::npos)
        << e.what();
  }
}

// Packed documents through every degree and both layouts (zigzag: every document in 2P chunks), causal with GQA;
// then, at U = P (Ulysses alone) and at the smallest hybrid degree, every other mask per document, MHA, MQA and
// expanded key/value heads, query and key lengths that differ per document, many documents shorter than 2P tokens
// around a long one. Empty and one-token documents in every case.
TYPED_TEST(Ulysses, VariableLengthSequences) {
  const int p = world_size();
  const std::vector<int> lens = {37, 0, 150, 5, 91, 1, 60, 130};
  RefOptions causal;
  causal.causal = true;
  RefOptions sliding;
  sliding.causal = true, sliding.window_left = 20;
  RefOptions both;
  both.window_left = 9, both.window_right = 4, both.softcap = 5.0;
  const std::vector<int> lq = {20, 90, 0, 33, 64}, lk = {45, 30, 12, 33, 100};
  std::vector<int> many(40, 3);
  many[7] = 0, many[11] = 1, many[20] = 200, many[33] = 7;
  int hybrid = p;
  for (int u : degrees_of(p))
    if (u > 1 && u < hybrid) hybrid = u;
  for (int u : degrees_of(p))
    for (Layout layout : {Layout::contiguous, Layout::zigzag}) {
      check_ulysses_varlen<TypeParam>(layout, u, lens, lens, 12, 4, causal);
      if (u != p && u != hybrid) continue;
      check_ulysses_varlen<TypeParam>(layout, u, lens, lens, 12, 12, RefOptions{});
      check_ulysses_varlen<TypeParam>(layout, u, lens, lens, 12, 1, sliding);
      check_ulysses_varlen<TypeParam>(layout, u, lq, lk, 12, 6, causal);
      check_ulysses_varlen<TypeParam>(layout, u, lq, lk, 12, 12, both);
      if (layout == Layout::zigzag) check_ulysses_varlen<TypeParam>(layout, u, many, many, 12, 4, causal);
    }
}

// Refusals reach every rank with the same message: a degree that does not divide P, one that differs across ranks,
// query heads that the degree does not divide.
TEST(UlyssesErrors, RefusedOnEveryRank) {
  const int p = world_size(), r = world_rank();
  auto expect_error = [&](auto&& body, const std::string& want) {
    try {
      body();
      ADD_FAILURE() << "accepted; expected: " << want;
    } catch (const kfa::Error& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  };
  expect_error([&] { kfa::dist::Ulysses(MPI_COMM_WORLD, p + 1); },
               "degree " + std::to_string(p + 1) + " does not divide the " + std::to_string(p) + " ranks");
  expect_error([&] { kfa::dist::Ulysses(MPI_COMM_WORLD, 0); }, "degree 0 does not divide");
  if (p > 1)
    expect_error([&] { kfa::dist::Ulysses(MPI_COMM_WORLD, r == 0 ? 1 : p); }, "the degree differs across ranks");
  if (p > 1) {
    kfa::dist::Ulysses u(MPI_COMM_WORLD, p);
    const int heads = p + 1;  // not divisible by p
    Tensor<float> q("q", 1, 8, heads, 16), k("k", 1, 8, 1, 16), v("v", 1, 8, 1, 16), o("o", 1, 8, heads, 16);
    Lse<float> lse("lse", 1, heads, 8);
    expect_error([&] { kfa::dist::ulysses_attention_forward(Exec(), u, q, k, v, o, lse); },
                 "heads_q (q.extent(2)) = " + std::to_string(heads) + " is not divisible by the Ulysses degree " +
                     std::to_string(p));
    // one rank with a different head dim: every rank throws the same error
    const int d = r == p - 1 ? 32 : 16;
    Tensor<float> q2("q", 1, 8, p, d), k2("k", 1, 8, 1, d), v2("v", 1, 8, 1, d), o2("o", 1, 8, p, d);
    Lse<float> lse2("lse", 1, p, 8);
    expect_error([&] { kfa::dist::ulysses_attention_forward(Exec(), u, q2, k2, v2, o2, lse2); },
                 "head_dim (q.extent(3)) differs across ranks");
    // packed documents: the last rank's cu_seqlens differ, or the documents' total is not the shards' tokens
    Tensor<float> qp("qp", 1, 16, p, 16), op("op", 1, 16, p, 16);
    Kokkos::View<float**, Kokkos::LayoutRight, Mem> lp("lp", p, 16);
    const long total = 16L * p;
    const auto cu = cu_of(r == p - 1 ? std::vector<int>{int(total) - 5, 5} : std::vector<int>{5, int(total) - 5});
    expect_error(
        [&] {
          kfa::dist::ulysses_attention_forward_varlen(Exec(), u, p3(qp), p3(qp), p3(qp), p3(op), lp, cu, cu, total,
                                                      total);
        },
        "cu_seqlens_q and cu_seqlens_k differs across ranks");
    const auto short_cu = cu_of({5, 7});
    expect_error(
        [&] {
          kfa::dist::ulysses_attention_forward_varlen(Exec(), u, p3(qp), p3(qp), p3(qp), p3(op), lp, short_cu, short_cu,
                                                      7, 7);
        },
        "cu_seqlens_q(2) = 12 but " + std::to_string(total) + " tokens are in the ranks' q shards");
  }
}

// A failure on one rank in any stage (KFA_ULYSSES_FAULT), or in one ring of the hybrid (KFA_RING_FAULT): every
// rank throws the same kfa::Error naming the stage and the rank, nobody hangs, and the next call works.
TEST(UlyssesErrors, FaultInAnyStageFailsEverywhere) {
  const int p = world_size();
  const int bad = p - 1;
  const int n = 10 * p;
  Tensor<float> q("q", 1, n / p, 12, 16), k("k", 1, n / p, 4, 16), v("v", 1, n / p, 4, 16), o("o", 1, n / p, 12, 16),
      d_o("do", 1, n / p, 12, 16), dq("dq", 1, n / p, 12, 16), dk("dk", 1, n / p, 4, 16), dv("dv", 1, n / p, 4, 16);
  Lse<float> lse("lse", 1, 12, n / p);
  std::mt19937_64 rng(shared_seed());
  fill_random(q, rng), fill_random(k, rng), fill_random(v, rng), fill_random(d_o, rng);
  const char* stages[] = {"all-to-all to heads: ", "attention: ", "all-to-all to the sequence: "};
  for (int u : degrees_of(p))
    for (int stage = u == 1 ? 1 : 0; stage < (u == 1 ? 2 : 3); ++stage)  // U = 1: no all-to-all stages
      for (bool backward : {false, true}) {
        SCOPED_TRACE("U " + std::to_string(u) + " stage " + std::to_string(stage) + (backward ? " backward" : ""));
        setenv("KFA_ULYSSES_FAULT", (std::to_string(bad) + ":" + std::to_string(stage)).c_str(), 1);
        kfa::dist::Ulysses faulty(MPI_COMM_WORLD, u, Layout::zigzag);
        unsetenv("KFA_ULYSSES_FAULT");
        try {
          if (backward)
            kfa::dist::ulysses_attention_backward(Exec(), faulty, q, k, v, o, d_o, lse, dq, dk, dv);
          else
            kfa::dist::ulysses_attention_forward(Exec(), faulty, q, k, v, o, lse);
          ADD_FAILURE() << "no error";
        } catch (const kfa::Error& e) {
          const std::string want = std::string(stages[stage]) + "rank " + std::to_string(bad) + " of " +
                                   std::to_string(p) + ": kfa::dist: fault injected in Ulysses stage " +
                                   std::to_string(stage);
          EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
        }
        kfa::dist::Ulysses fine(MPI_COMM_WORLD, u, Layout::zigzag);
        kfa::dist::ulysses_attention_forward(Exec(), fine, q, k, v, o, lse);
        kfa::dist::ulysses_attention_backward(Exec(), fine, q, k, v, o, d_o, lse, dq, dk, dv);
      }
  // a fault in one ring of the hybrid (ring rank 0 of the rings, at its step 0): every rank of every ring throws
  for (int u : degrees_of(p)) {
    if (u == p) continue;
    setenv("KFA_RING_FAULT", "0:0", 1);
    kfa::dist::Ulysses faulty(MPI_COMM_WORLD, u, Layout::zigzag);
    unsetenv("KFA_RING_FAULT");
    EXPECT_THROW(kfa::dist::ulysses_attention_forward(Exec(), faulty, q, k, v, o, lse), kfa::Error);
    EXPECT_THROW(kfa::dist::ulysses_attention_backward(Exec(), faulty, q, k, v, o, d_o, lse, dq, dk, dv), kfa::Error);
  }
}

// The hybrid's ring holds each group's consecutive shards: contiguous gives one run per group, zigzag two (one for
// the last group).
TEST(UlyssesLayout, GroupRunsJoinConsecutiveShards) {
  for (int p : {2, 4, 6, 8})
    for (int u : degrees_of(p))
      for (Layout layout : {Layout::contiguous, Layout::zigzag}) {
        const long n = 37 * p + 3;
        std::vector<long> len(p);
        for (int r = 0; r < p; ++r) {
          long x = 0;
          for (const auto& sg : kfa::dist::shard_of(layout, n, p, r)) x += sg.length;
          len[r] = x;
        }
        const kfa::dist::ShardMap map(layout, len, len);
        const auto ring = kfa::dist::detail::ring_map_of(map, u, p / u);
        long covered = 0;
        for (int g = 0; g < p / u; ++g) {
          const auto& runs = ring.q_segments(g);
          // the last group's two zigzag runs (chunks P − U … P − 1 and P … P + U − 1) meet in the middle
          const std::size_t want = layout == Layout::contiguous || g == p / u - 1 ? 1 : 2;
          EXPECT_EQ(runs.size(), want) << "P " << p << " U " << u << " group " << g;
          for (const auto& x : runs) covered += x.length;
        }
        EXPECT_EQ(covered, n);
        EXPECT_EQ(ring.q_total(), n);
      }
}
