// attention_backward against the tests' float64 gradients (materialized formulas), those formulas against
// central finite differences, and the library's own properties: determinism, masks, GQA, layouts, errors.
#include <kfa/detail/dispatch.hpp>

#include <algorithm>

#include "../common/kfa_test.hpp"

using namespace kfa_test;

template <class T>
class Backward : public ::testing::Test {};
TYPED_TEST_SUITE(Backward, Dtypes, DtypeNames);

namespace {
template <class T>
struct Problem {
  Shape s;
  Tensor<T> q, k, v, o, d_o, dq, dk, dv;
  Lse<T> lse;
  std::vector<double> qh, kh, vh, doh;
  Problem(const Shape& s_, std::mt19937_64& rng, double sigma = 1.0)
      : s(s_),
        q("q", s.batch, s.seq_q, s.heads_q, s.head_dim),
        k("k", s.batch, s.seq_k, s.heads_kv, s.head_dim),
        v("v", s.batch, s.seq_k, s.heads_kv, s.head_dim),
        o("o", s.batch, s.seq_q, s.heads_q, s.head_dim),
        d_o("do", s.batch, s.seq_q, s.heads_q, s.head_dim),
        dq("dq", s.batch, s.seq_q, s.heads_q, s.head_dim),
        dk("dk", s.batch, s.seq_k, s.heads_kv, s.head_dim),
        dv("dv", s.batch, s.seq_k, s.heads_kv, s.head_dim),
        lse("lse", s.batch, s.heads_q, s.seq_q) {
    qh = fill_random(q, rng, sigma), kh = fill_random(k, rng, sigma), vh = fill_random(v, rng);
    doh = fill_random(d_o, rng);
  }
  void run(const kfa::AttentionOptions& opts) {
    kfa::attention_forward(Exec(), q, k, v, o, lse, opts);
    poison(dq), poison(dk), poison(dv);
    kfa::attention_backward(Exec(), q, k, v, o, d_o, lse, dq, dk, dv, opts);
    Exec().fence();
  }
};

template <class T>
void check_backward(const Shape& s, const RefOptions& ro, kfa::AttentionOptions opts = {}, double sigma = 1.0) {
  const std::uint64_t seed = fresh_seed();
  SCOPED_TRACE(describe(s, ro, seed));
  std::mt19937_64 rng(seed);
  Problem<T> p(s, rng, sigma);
  const kfa::AttentionOptions base = to_kfa(ro);
  opts.softmax_scale = base.softmax_scale, opts.causal = base.causal, opts.softcap = base.softcap;
  opts.window_left = base.window_left, opts.window_right = base.window_right;
  p.run(opts);
  std::vector<double> dq, dk, dv;
  reference_backward64(s, ro, p.qh, p.kh, p.vh, p.doh, dq, dk, dv);
  EXPECT_TRUE(close_frobenius(to_doubles4(p.dq), dq, tolerance<T>())) << "dq";
  EXPECT_TRUE(close_frobenius(to_doubles4(p.dk), dk, tolerance<T>())) << "dk";
  EXPECT_TRUE(close_frobenius(to_doubles4(p.dv), dv, tolerance<T>())) << "dv";
}

// L(q, k, v) = Σ O ∘ G in float64 through the tests' reference forward.
double loss64(const Shape& s, const RefOptions& ro, const std::vector<double>& q, const std::vector<double>& k,
              const std::vector<double>& v, const std::vector<double>& g) {
  std::vector<double> o, lse;
  reference_forward64(s, ro, q, k, v, o, lse);
  double l = 0;
  for (size_t i = 0; i < o.size(); ++i) l += o[i] * g[i];
  return l;
}
}  // namespace

TYPED_TEST(Backward, SequenceLengths) {
  for (int n : {1, 7, 63, 64, 65, 127, 400}) check_backward<TypeParam>({1, n, n, 2, 2, 64}, {});
}

TYPED_TEST(Backward, UnequalSequenceLengths) {
  for (auto nn : {std::make_pair(1, 300), std::make_pair(65, 127), std::make_pair(127, 65), std::make_pair(300, 7)})
    for (bool causal : {false, true}) {
      RefOptions ro;
      ro.causal = causal;
      check_backward<TypeParam>({2, nn.first, nn.second, 2, 1, 32}, ro);
    }
}

TYPED_TEST(Backward, ShrunkBlocks) {
  for (int n : {19, 23, 40, 41}) check_backward<TypeParam>({1, n, n + 3, 2, 1, 16}, {});
}

TYPED_TEST(Backward, HeadDims) {
  for (int d : {8, 24, 40, 64, 96, 128, 160, 256}) check_backward<TypeParam>({1, 65, 100, 2, 2, d}, {});
}

TYPED_TEST(Backward, CausalWindowSoftcap) {
  RefOptions c;
  c.causal = true;
  check_backward<TypeParam>({2, 127, 127, 2, 2, 64}, c);
  RefOptions w;
  w.window_left = 20, w.window_right = 5;
  check_backward<TypeParam>({1, 127, 150, 2, 2, 64}, w);
  w.causal = true;
  check_backward<TypeParam>({1, 150, 127, 2, 2, 64}, w);
  RefOptions sc;
  sc.softcap = 4.0;
  check_backward<TypeParam>({1, 65, 127, 2, 2, 64}, sc, {}, 2.0);
  sc.causal = true;
  check_backward<TypeParam>({1, 127, 127, 2, 1, 32}, sc, {}, 2.0);
  RefOptions scale;
  scale.scale = 0.3;
  check_backward<TypeParam>({1, 63, 65, 2, 2, 64}, scale);
}

TYPED_TEST(Backward, GroupedAndMultiQuery) {
  check_backward<TypeParam>({2, 65, 127, 4, 2, 64}, {});
  RefOptions c;
  c.causal = true;
  check_backward<TypeParam>({1, 127, 127, 6, 1, 32}, c);
}

TYPED_TEST(Backward, FullyMaskedRowsHaveZeroGradients) {
  RefOptions c;
  c.causal = true;  // the first 70 query rows see no key
  check_backward<TypeParam>({1, 100, 30, 2, 2, 32}, c);
  RefOptions w;
  w.window_left = 0, w.window_right = 0;
  check_backward<TypeParam>({1, 80, 20, 1, 1, 32}, w);
}

TYPED_TEST(Backward, TileOverrides) {
  // Streamed blocks (block_q in the dK/dV kernel, block_k in the dQ kernel) must fit level 0 for double too.
  for (auto t : {std::make_pair(8, 8), std::make_pair(16, 24), std::make_pair(24, 16)}) {
    kfa::AttentionOptions opts;
    opts.block_q = t.first, opts.block_k = t.second;
    RefOptions ro;
    ro.causal = true;
    check_backward<TypeParam>({1, 100, 100, 2, 2, 64}, ro, opts);
  }
}

TYPED_TEST(Backward, StridedInputsAndOutputs) {
  using T = TypeParam;
  const std::uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const Shape s{2, 65, 65, 2, 2, 32};
  using V5 = Kokkos::View<T*****, Kokkos::LayoutRight, Mem>;
  V5 qkv("qkv", s.batch, s.seq_q, 3, s.heads_q, s.head_dim), dqkv("dqkv", s.batch, s.seq_q, 3, s.heads_q, s.head_dim);
  auto sl = [](const V5& x, int i) {
    return Kokkos::subview(x, Kokkos::ALL, Kokkos::ALL, i, Kokkos::ALL, Kokkos::ALL);
  };
  auto q = sl(qkv, 0), k = sl(qkv, 1), v = sl(qkv, 2), dq = sl(dqkv, 0), dk = sl(dqkv, 1), dv = sl(dqkv, 2);
  const auto qh = fill_random(q, rng), kh = fill_random(k, rng), vh = fill_random(v, rng);
  Tensor<T> o("o", s.batch, s.seq_q, s.heads_q, s.head_dim), d_o("do", s.batch, s.seq_q, s.heads_q, s.head_dim);
  Lse<T> lse("lse", s.batch, s.heads_q, s.seq_q);
  const auto doh = fill_random(d_o, rng);
  RefOptions ro;
  ro.causal = true;
  kfa::attention_forward(Exec(), q, k, v, o, lse, to_kfa(ro));
  poison(dqkv);
  kfa::attention_backward(Exec(), q, k, v, o, d_o, lse, dq, dk, dv, to_kfa(ro));
  Exec().fence();
  std::vector<double> rdq, rdk, rdv;
  reference_backward64(s, ro, qh, kh, vh, doh, rdq, rdk, rdv);
  EXPECT_TRUE(close_frobenius(to_doubles4(dq), rdq, tolerance<T>()));
  EXPECT_TRUE(close_frobenius(to_doubles4(dk), rdk, tolerance<T>()));
  EXPECT_TRUE(close_frobenius(to_doubles4(dv), rdv, tolerance<T>()));
}

TYPED_TEST(Backward, BitwiseDeterministic) {
  using T = TypeParam;
  std::mt19937_64 rng(fresh_seed());
  Problem<T> p({2, 200, 230, 4, 2, 64}, rng);
  kfa::AttentionOptions opts;
  opts.causal = true;
  p.run(opts);
  Tensor<T> dq2("dq2", 2, 200, 4, 64), dk2("dk2", 2, 230, 2, 64), dv2("dv2", 2, 230, 2, 64);
  poison(dq2), poison(dk2), poison(dv2);
  kfa::attention_backward(Exec(), p.q, p.k, p.v, p.o, p.d_o, p.lse, dq2, dk2, dv2, opts);
  Exec().fence();
  auto same = [](const Tensor<T>& a, const Tensor<T>& b) {
    auto ha = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), a);
    auto hb = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), b);
    return std::memcmp(ha.data(), hb.data(), ha.size() * sizeof(T)) == 0;
  };
  EXPECT_TRUE(same(p.dq, dq2));
  EXPECT_TRUE(same(p.dk, dk2));
  EXPECT_TRUE(same(p.dv, dv2));
}

// Host backends compute dQ in the dK/dV pass, each team (a chunk of key blocks) into a workspace slice of its
// own, the slices summed in chunk order; the chunk count follows the thread count (one on one thread). Every
// count must give the float64 gradients and the same bits on a second run, the plan's count the public call's.
TYPED_TEST(Backward, HostDqChunks) {
  using T = TypeParam;
  if constexpr (!kfa::detail::is_host_space<Exec>() || sizeof(T) == 0) {
    GTEST_SKIP() << "host backends only";
  } else {
    struct Case {
      Shape s;
      RefOptions ro;
    };
    for (const Case& cs : {Case{{2, 200, 230, 4, 2, 64}, RefOptions{0, true, -1, -1, 0}},
                           Case{{1, 301, 170, 3, 1, 32}, RefOptions{0, false, 40, 7, 0}},
                           Case{{1, 97, 130, 2, 2, 16}, RefOptions{0, false, -1, -1, 3.0}}}) {
      const std::uint64_t seed = fresh_seed();
      SCOPED_TRACE(describe(cs.s, cs.ro, seed));
      std::mt19937_64 rng(seed);
      Problem<T> p(cs.s, rng);
      const kfa::AttentionOptions opts = to_kfa(cs.ro);
      p.run(opts);
      std::vector<double> rdq, rdk, rdv;
      reference_backward64(cs.s, cs.ro, p.qh, p.kh, p.vh, p.doh, rdq, rdk, rdv);
      const Shape& s = cs.s;
      Tensor<T> dq("dq", s.batch, s.seq_q, s.heads_q, s.head_dim), dk("dk", s.batch, s.seq_k, s.heads_kv, s.head_dim),
          dv("dv", s.batch, s.seq_k, s.heads_kv, s.head_dim);
      const Exec space;  // the call holds a reference to it
      const auto c = kfa::detail::backward_call("HostDqChunks", space, p.q, p.k, p.v, p.d_o, dq, dk, dv, opts);
      kfa::BackwardPlan plan = kfa::detail::backward_plan("HostDqChunks", c);
      ASSERT_TRUE(plan.dq_in_dkdv) << plan.region;
      ASSERT_GE(plan.dq_chunks, 1) << plan.region;
      const int planned = plan.dq_chunks;
      const auto dd = kfa::detail::backward_row_dot(Exec(), p.o, p.d_o);
      using Acc = kfa::accumulator_t<T>;
      const kfa::detail::KeyMask mask(s.seq_q, s.seq_k, kfa::detail::Positions{}, opts.causal, opts.window_left,
                                      opts.window_right);
      const Acc scale = static_cast<Acc>(1.0 / std::sqrt(double(s.head_dim)));
      const auto args = kfa::detail::backward_args(c.q, c.k, c.v, c.d_o,
                                                   kfa::detail::canonical_in_t<Kokkos::LayoutRight, Lse<T>>(p.lse), dd,
                                                   c.dq, c.dk, c.dv, scale, static_cast<Acc>(opts.softcap), mask);
      auto bits = [](const Tensor<T>& x) {
        const auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), x);
        return std::vector<T>(h.data(), h.data() + h.size());
      };
      for (int chunks : {1, 2, 3, 7, planned}) {
        SCOPED_TRACE("chunks " + std::to_string(chunks));
        plan.dq_chunks = chunks;
        std::vector<T> first;
        for (int run = 0; run < 2; ++run) {
          poison(dq), poison(dk), poison(dv);
          kfa::detail::PortableBackwardFamily::launch(c, args, plan, kfa::detail::BackwardParts::all);
          Exec().fence();
          EXPECT_TRUE(close_frobenius(to_doubles4(dq), rdq, tolerance<T>())) << "dq";
          EXPECT_TRUE(close_frobenius(to_doubles4(dk), rdk, tolerance<T>())) << "dk";
          EXPECT_TRUE(close_frobenius(to_doubles4(dv), rdv, tolerance<T>())) << "dv";
          if (run == 0)
            first = bits(dq);
          else
            EXPECT_TRUE(first == bits(dq)) << "dq differs between two runs";
        }
        if (chunks == planned) {
          EXPECT_TRUE(bits(dq) == bits(p.dq)) << "the plan's chunks: not the public call's dq";
          EXPECT_TRUE(bits(dk) == bits(p.dk)) << "dk";
          EXPECT_TRUE(bits(dv) == bits(p.dv)) << "dv";
        }
      }
    }
  }
}

// The host backward's chunk count (tiling.hpp): one on one thread; every thread a team; teams that fill the
// threads' last round where up to twice the chunks allow it; never more chunks than key blocks, nor 16.
TEST(BackwardChunks, FillTheThreads) {
  using kfa::detail::host_backward_chunks;
  for (long pairs : {1L, 2L, 3L, 7L, 64L})
    for (long blocks : {1L, 5L, 32L}) EXPECT_EQ(host_backward_chunks(1, pairs, blocks), 1) << pairs << " " << blocks;
  EXPECT_EQ(host_backward_chunks(2, 2, 32), 1);    // 2 teams on 2 threads
  EXPECT_EQ(host_backward_chunks(2, 1, 32), 2);    // every thread a team
  EXPECT_EQ(host_backward_chunks(2, 3, 32), 2);    // 3 teams would leave a thread idle for a round: 6
  EXPECT_EQ(host_backward_chunks(2, 3, 1), 1);     // one key block: one chunk
  EXPECT_EQ(host_backward_chunks(16, 3, 64), 10);  // 30 teams of 32 slots (6 chunks: 18 of 32)
  EXPECT_EQ(host_backward_chunks(64, 4, 64), 16);  // the workspace bound
  for (long threads = 1; threads <= 64; ++threads)
    for (long pairs = 1; pairs <= 40; ++pairs)
      for (long blocks : {1L, 3L, 16L, 100L}) {
        const long c = host_backward_chunks(threads, pairs, blocks);
        const long want = std::min<long>({(threads + pairs - 1) / pairs, blocks, 16L});
        ASSERT_GE(c, want) << threads << " " << pairs << " " << blocks;
        ASSERT_LE(c, std::min<long>({2 * want, blocks, 16L})) << threads << " " << pairs << " " << blocks;
      }
}

#if KFA_HAVE_KOKKOS_KERNELS  // kfa::reference_attention_backward needs Kokkos Kernels
TYPED_TEST(Backward, MaterializedReferenceAgrees) {
  using T = TypeParam;
  for (auto ro : {RefOptions{}, RefOptions{0, true, -1, -1, 0}, RefOptions{0, false, 20, 3, 4.0}}) {
    const Shape s{2, 65, 100, 4, 2, 32};
    const std::uint64_t seed = fresh_seed();
    SCOPED_TRACE(describe(s, ro, seed));
    std::mt19937_64 rng(seed);
    Problem<T> p(s, rng);
    kfa::attention_forward(Exec(), p.q, p.k, p.v, p.o, p.lse, to_kfa(ro));
    poison(p.dq), poison(p.dk), poison(p.dv);
    kfa::reference_attention_backward(Exec(), p.q, p.k, p.v, p.o, p.d_o, p.lse, p.dq, p.dk, p.dv, to_kfa(ro));
    Exec().fence();
    std::vector<double> dq, dk, dv;
    reference_backward64(s, ro, p.qh, p.kh, p.vh, p.doh, dq, dk, dv);
    EXPECT_TRUE(close_frobenius(to_doubles4(p.dq), dq, tolerance<T>()));
    EXPECT_TRUE(close_frobenius(to_doubles4(p.dk), dk, tolerance<T>()));
    EXPECT_TRUE(close_frobenius(to_doubles4(p.dv), dv, tolerance<T>()));
  }
}
#endif

// Central finite differences of L = Σ O ∘ dO in double, for each option, on tiny shapes: both the tests'
// materialized gradient formulas and kfa's backward must match them.
TEST(BackwardFiniteDifferences, EveryOption) {
  const std::vector<RefOptions> cases = {RefOptions{}, RefOptions{0, true, -1, -1, 0}, RefOptions{0, false, 2, 1, 0},
                                         RefOptions{0, false, -1, -1, 1.5}, RefOptions{0.7, true, 3, -1, 2.0}};
  for (const RefOptions& ro : cases)
    for (const Shape& s : {Shape{1, 5, 7, 2, 1, 8}, Shape{2, 6, 4, 2, 2, 8}}) {
      const std::uint64_t seed = fresh_seed();
      SCOPED_TRACE(describe(s, ro, seed));
      std::mt19937_64 rng(seed);
      Problem<double> p(s, rng, 1.5);
      p.run(to_kfa(ro));
      std::vector<double> rdq, rdk, rdv;
      reference_backward64(s, ro, p.qh, p.kh, p.vh, p.doh, rdq, rdk, rdv);
      const double h = 1e-6;
      auto fd = [&](std::vector<double>& x) {
        std::vector<double> g(x.size());
        for (size_t i = 0; i < x.size(); ++i) {
          const double x0 = x[i];
          x[i] = x0 + h;
          const double lp = loss64(s, ro, p.qh, p.kh, p.vh, p.doh);
          x[i] = x0 - h;
          const double lm = loss64(s, ro, p.qh, p.kh, p.vh, p.doh);
          x[i] = x0;
          g[i] = (lp - lm) / (2 * h);
        }
        return g;
      };
      const auto gq = fd(p.qh), gk = fd(p.kh), gv = fd(p.vh);
      EXPECT_TRUE(close_frobenius(rdq, gq, 1e-7)) << "reference dq vs finite differences";
      EXPECT_TRUE(close_frobenius(rdk, gk, 1e-7)) << "reference dk vs finite differences";
      EXPECT_TRUE(close_frobenius(rdv, gv, 1e-7)) << "reference dv vs finite differences";
      EXPECT_TRUE(close_frobenius(to_doubles4(p.dq), gq, 1e-7)) << "kfa dq vs finite differences";
      EXPECT_TRUE(close_frobenius(to_doubles4(p.dk), gk, 1e-7)) << "kfa dk vs finite differences";
      EXPECT_TRUE(close_frobenius(to_doubles4(p.dv), gv, 1e-7)) << "kfa dv vs finite differences";
    }
}

TEST(BackwardErrors, ShapesAndAliasing) {
  using T = float;
  std::mt19937_64 rng(fresh_seed());
  Problem<T> p({1, 8, 8, 2, 2, 64}, rng);
  p.run({});
  poison(p.dq), poison(p.dk), poison(p.dv);
  auto expect = [&](auto&& f, const std::vector<std::string>& frags) {
    try {
      f();
      ADD_FAILURE() << "no exception";
    } catch (const kfa::Error& e) {
      for (const auto& fr : frags) EXPECT_NE(std::string(e.what()).find(fr), std::string::npos) << e.what();
    }
    for (double x : to_doubles4(p.dq)) ASSERT_TRUE(std::isnan(x)) << "dq written before the error";
    for (double x : to_doubles4(p.dk)) ASSERT_TRUE(std::isnan(x)) << "dk written before the error";
  };
  Tensor<T> bad_do("bad_do", 1, 9, 2, 64), bad_dk("bad_dk", 1, 8, 1, 64);
  expect([&] { kfa::attention_backward(Exec(), p.q, p.k, p.v, p.o, bad_do, p.lse, p.dq, p.dk, p.dv); },
         {"kfa::attention_backward: d_o.extent(1) = 9", "must be 8"});
  expect([&] { kfa::attention_backward(Exec(), p.q, p.k, p.v, p.o, p.d_o, p.lse, p.dq, bad_dk, p.dv); },
         {"kfa::attention_backward: dk.extent(2) = 1", "must be 2"});
  expect([&] { kfa::attention_backward(Exec(), p.q, p.k, p.v, p.o, p.d_o, p.lse, p.dq, p.dk, p.dk); },
         {"output dk overlaps", "dv"});
}

TEST(BackwardErrors, OptionsCheckedLikeForward) {
  using T = float;
  std::mt19937_64 rng(fresh_seed());
  Problem<T> p({1, 8, 8, 2, 2, 64}, rng);
  kfa::AttentionOptions o;
  o.softcap = -1;
  EXPECT_THROW(kfa::attention_backward(Exec(), p.q, p.k, p.v, p.o, p.d_o, p.lse, p.dq, p.dk, p.dv, o), kfa::Error);
  o = {};
  o.window_left = -3;
#if KFA_HAVE_KOKKOS_KERNELS
  EXPECT_THROW(kfa::reference_attention_backward(Exec(), p.q, p.k, p.v, p.o, p.d_o, p.lse, p.dq, p.dk, p.dv, o),
               kfa::Error);
#else
  EXPECT_THROW(kfa::attention_backward(Exec(), p.q, p.k, p.v, p.o, p.d_o, p.lse, p.dq, p.dk, p.dv, o), kfa::Error);
#endif
  o = {};
  o.block_k = 4096;
  EXPECT_THROW(kfa::attention_backward(Exec(), p.q, p.k, p.v, p.o, p.d_o, p.lse, p.dq, p.dk, p.dv, o), kfa::Error);
}
