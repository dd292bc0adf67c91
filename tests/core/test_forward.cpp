// attention_forward against the tests' float64 reference: every element, fresh random inputs, poisoned
// outputs, per-dtype tolerances, over sequence lengths, head dims, masks, softcap, GQA and layouts.
#include "../common/kfa_test.hpp"

using namespace kfa_test;

template <class T>
class Forward : public ::testing::Test {};
TYPED_TEST_SUITE(Forward, Dtypes, DtypeNames);

// Runs one forward on fresh inputs and checks o and lse against the float64 reference.
template <class T>
void check_forward(const Shape& s, const RefOptions& ro, kfa::AttentionOptions opts = {}, double sigma = 1.0,
                   double tol_scale = 1.0) {
  const std::uint64_t seed = fresh_seed();
  SCOPED_TRACE(describe(s, ro, seed));
  std::mt19937_64 rng(seed);
  Tensor<T> q("q", s.batch, s.seq_q, s.heads_q, s.head_dim), k("k", s.batch, s.seq_k, s.heads_kv, s.head_dim),
      v("v", s.batch, s.seq_k, s.heads_kv, s.head_dim), o("o", s.batch, s.seq_q, s.heads_q, s.head_dim);
  Lse<T> lse("lse", s.batch, s.heads_q, s.seq_q);
  const auto qh = fill_random(q, rng, sigma), kh = fill_random(k, rng, sigma), vh = fill_random(v, rng);
  poison(o);
  poison(lse);
  const kfa::AttentionOptions base = to_kfa(ro);
  opts.softmax_scale = base.softmax_scale;
  opts.causal = base.causal;
  opts.window_left = base.window_left;
  opts.window_right = base.window_right;
  opts.softcap = base.softcap;
  kfa::attention_forward(Exec(), q, k, v, o, lse, opts);
  Exec().fence();
  std::vector<double> oref, lref;
  reference_forward64(s, ro, qh, kh, vh, oref, lref);
  EXPECT_TRUE(close_frobenius(to_doubles4(o), oref, tolerance<T>() * tol_scale));
  EXPECT_TRUE(close_lse(to_doubles3(lse), lref, tolerance<kfa::accumulator_t<T>>() * tol_scale));
}

TYPED_TEST(Forward, SequenceLengths) {
  for (int n : {1, 7, 63, 64, 65, 127, 1000}) check_forward<TypeParam>({1, n, n, 2, 2, 64}, {});
}

TYPED_TEST(Forward, UnequalSequenceLengths) {
  for (auto nn : {std::make_pair(1, 1000), std::make_pair(65, 127), std::make_pair(127, 65), std::make_pair(1000, 7),
                  std::make_pair(7, 64)})
    for (bool causal : {false, true}) {
      RefOptions ro;
      ro.causal = causal;
      check_forward<TypeParam>({2, nn.first, nn.second, 2, 1, 32}, ro);
    }
}

// Few teams make the tiling shrink the query block (24 -> 16 rows here): every row must still be computed.
TYPED_TEST(Forward, ShrunkQueryBlocks) {
  for (int n : {19, 23, 40, 41}) check_forward<TypeParam>({1, n, 13, 2, 2, 16}, {});
}

TYPED_TEST(Forward, HeadDims) {
  for (int d : {8, 16, 24, 40, 64, 96, 128, 160, 256}) check_forward<TypeParam>({2, 65, 127, 2, 2, d}, {});
}

TYPED_TEST(Forward, Causal) {
  RefOptions ro;
  ro.causal = true;
  for (int n : {1, 63, 64, 65, 127}) check_forward<TypeParam>({2, n, n, 3, 3, 64}, ro);
}

TYPED_TEST(Forward, SlidingWindow) {
  for (auto w : {std::make_pair(0, 0), std::make_pair(16, -1), std::make_pair(-1, 5), std::make_pair(31, 7),
                 std::make_pair(100, 0)}) {
    RefOptions ro;
    ro.window_left = w.first;
    ro.window_right = w.second;
    check_forward<TypeParam>({1, 127, 127, 2, 2, 64}, ro);
    check_forward<TypeParam>({1, 65, 200, 2, 2, 32}, ro);
    ro.causal = true;
    check_forward<TypeParam>({1, 127, 127, 2, 1, 64}, ro);
  }
}

TYPED_TEST(Forward, Softcap) {
  RefOptions ro;
  ro.softcap = 5.0;
  check_forward<TypeParam>({2, 65, 127, 2, 2, 64}, ro, {}, 3.0);
  ro.causal = true;
  ro.softcap = 30.0;
  check_forward<TypeParam>({1, 127, 127, 2, 2, 128}, ro, {}, 3.0);
}

TYPED_TEST(Forward, ExplicitScale) {
  RefOptions ro;
  ro.scale = 0.37;
  check_forward<TypeParam>({1, 63, 65, 2, 2, 64}, ro);
}

TYPED_TEST(Forward, GroupedAndMultiQuery) {
  check_forward<TypeParam>({2, 65, 127, 4, 2, 64}, {});  // GQA
  check_forward<TypeParam>({2, 65, 127, 4, 1, 64}, {});  // MQA
  RefOptions ro;
  ro.causal = true;
  check_forward<TypeParam>({1, 127, 127, 6, 2, 32}, ro);
}

TYPED_TEST(Forward, FullyMaskedRowsAreZeroWithMinusInfLse) {
  RefOptions ro;
  ro.causal = true;  // seq_q > seq_k: the first seq_q − seq_k rows see no key
  check_forward<TypeParam>({1, 100, 30, 2, 2, 64}, ro);
  RefOptions w;
  w.window_left = 0;
  w.window_right = 0;  // only the diagonal key; rows above the first key see nothing
  check_forward<TypeParam>({1, 80, 20, 1, 1, 32}, w);
}

TYPED_TEST(Forward, TileOverrides) {
  // On host the softmax steps over 16 query rows: 8 rows is one short step, 24 a full one and a short one.
  for (auto t : {std::make_pair(8, 8), std::make_pair(16, 24), std::make_pair(24, 16), std::make_pair(32, 16)}) {
    kfa::AttentionOptions opts;
    opts.block_q = t.first;
    opts.block_k = t.second;
    RefOptions ro;
    ro.causal = true;
    check_forward<TypeParam>({1, 100, 100, 2, 2, 64}, ro, opts);
  }
}

// Logits around 1e4: outputs stay finite. The float64 check is exact; for the other dtypes the problem's
// condition number is |logit|·eps (a relative rounding of the inputs moves each logit by that much), so
// the tolerance scales with the largest logit — what any correct implementation in that dtype can reach.
TYPED_TEST(Forward, HugeLogitsStayFinite) {
  const double sigma = 35.0;  // q·k·scale ≈ sigma² · sqrt(d)/sqrt(d) · a few ≈ 1e4 at the extremes
  const double cond = std::is_same<TypeParam, double>::value ? 1.0 : 1e4 * 0.1;
  RefOptions ro;
  check_forward<TypeParam>({1, 64, 64, 1, 1, 64}, ro, {}, sigma, cond);
  ro.causal = true;
  check_forward<TypeParam>({1, 65, 65, 1, 1, 64}, ro, {}, sigma, cond);
}

TYPED_TEST(Forward, StridedInputsAndOutputs) {
  using T = TypeParam;
  const std::uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const Shape s{2, 65, 65, 3, 3, 64};
  // Packed QKV [batch, seq, 3, heads, d]: q, k, v are LayoutStride subviews.
  Kokkos::View<T*****, Kokkos::LayoutRight, Mem> qkv("qkv", s.batch, s.seq_q, 3, s.heads_q, s.head_dim);
  auto q = Kokkos::subview(qkv, Kokkos::ALL, Kokkos::ALL, 0, Kokkos::ALL, Kokkos::ALL);
  auto k = Kokkos::subview(qkv, Kokkos::ALL, Kokkos::ALL, 1, Kokkos::ALL, Kokkos::ALL);
  auto v = Kokkos::subview(qkv, Kokkos::ALL, Kokkos::ALL, 2, Kokkos::ALL, Kokkos::ALL);
  static_assert(std::is_same<typename decltype(q)::array_layout, Kokkos::LayoutStride>::value, "packed q is strided");
  const auto qh = fill_random(q, rng), kh = fill_random(k, rng), vh = fill_random(v, rng);
  // Output o into every other head slot of a wider buffer, lse transposed through a strided view.
  Kokkos::View<T*****, Kokkos::LayoutRight, Mem> obuf("obuf", s.batch, s.seq_q, s.heads_q, 2, s.head_dim);
  auto o = Kokkos::subview(obuf, Kokkos::ALL, Kokkos::ALL, Kokkos::ALL, 1, Kokkos::ALL);
  Kokkos::View<kfa::accumulator_t<T>****, Kokkos::LayoutRight, Mem> lbuf("lbuf", s.batch, s.heads_q, s.seq_q, 2);
  auto lse = Kokkos::subview(lbuf, Kokkos::ALL, Kokkos::ALL, Kokkos::ALL, 0);
  poison(obuf);
  poison(lbuf);
  RefOptions ro;
  ro.causal = true;
  kfa::attention_forward(Exec(), q, k, v, o, lse, to_kfa(ro));
  Exec().fence();
  std::vector<double> oref, lref;
  reference_forward64(s, ro, qh, kh, vh, oref, lref);
  EXPECT_TRUE(close_frobenius(to_doubles4(o), oref, tolerance<T>()));
  EXPECT_TRUE(close_lse(to_doubles3(lse), lref, tolerance<kfa::accumulator_t<T>>()));
  // The slots between the outputs are untouched (still NaN).
  auto oh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), obuf);
  for (size_t i = 0; i < oh.extent(1); ++i)
    ASSERT_TRUE(std::isnan(static_cast<double>(static_cast<kfa::accumulator_t<T>>(oh(1, i, 2, 0, 5)))));
}

TYPED_TEST(Forward, BitwiseDeterministic) {
  using T = TypeParam;
  std::mt19937_64 rng(fresh_seed());
  const Shape s{2, 300, 300, 4, 2, 64};
  Tensor<T> q("q", s.batch, s.seq_q, s.heads_q, s.head_dim), k("k", s.batch, s.seq_k, s.heads_kv, s.head_dim),
      v("v", s.batch, s.seq_k, s.heads_kv, s.head_dim), o1("o1", s.batch, s.seq_q, s.heads_q, s.head_dim),
      o2("o2", s.batch, s.seq_q, s.heads_q, s.head_dim);
  Lse<T> l1("l1", s.batch, s.heads_q, s.seq_q), l2("l2", s.batch, s.heads_q, s.seq_q);
  fill_random(q, rng), fill_random(k, rng), fill_random(v, rng);
  poison(o1), poison(o2), poison(l1), poison(l2);
  kfa::AttentionOptions opts;
  opts.causal = true;
  kfa::attention_forward(Exec(), q, k, v, o1, l1, opts);
  kfa::attention_forward(Exec(), q, k, v, o2, l2, opts);
  Exec().fence();
  auto h1 = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), o1);
  auto h2 = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), o2);
  EXPECT_EQ(0, std::memcmp(h1.data(), h2.data(), h1.size() * sizeof(T)));
  auto g1 = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), l1);
  auto g2 = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), l2);
  EXPECT_EQ(0, std::memcmp(g1.data(), g2.data(), g1.size() * sizeof(g1(0, 0, 0))));
}

TYPED_TEST(Forward, EmptyExtentsAreNoOps) {
  using T = TypeParam;
  for (auto s : {Shape{0, 5, 5, 2, 2, 8}, Shape{1, 0, 5, 2, 2, 8}, Shape{1, 5, 0, 2, 2, 8}, Shape{1, 5, 5, 0, 0, 8}}) {
    Tensor<T> q("q", s.batch, s.seq_q, s.heads_q, s.head_dim), k("k", s.batch, s.seq_k, s.heads_kv, s.head_dim),
        v("v", s.batch, s.seq_k, s.heads_kv, s.head_dim), o("o", s.batch, s.seq_q, s.heads_q, s.head_dim);
    Lse<T> lse("lse", s.batch, s.heads_q, s.seq_q);
    std::mt19937_64 rng(fresh_seed());
    fill_random(q, rng);
    poison(o);
    poison(lse);
    EXPECT_NO_THROW(kfa::attention_forward(Exec(), q, k, v, o, lse));
    Exec().fence();
    if (s.seq_k == 0 && s.seq_q > 0) {
      // No keys at all: every row is fully masked.
      const auto od = to_doubles4(o);
      for (double x : od) ASSERT_EQ(x, 0.0);
      for (double x : to_doubles3(lse)) ASSERT_TRUE(std::isinf(x) && x < 0);
    }
  }
}

#if KFA_HAVE_KOKKOS_KERNELS  // kfa::reference_attention needs Kokkos Kernels
TYPED_TEST(Forward, MaterializedReferenceAgrees) {
  using T = TypeParam;
  for (auto ro : {RefOptions{}, RefOptions{0, true, -1, -1, 0}, RefOptions{0, false, 20, 3, 4.0}}) {
    const Shape s{2, 65, 100, 4, 2, 64};
    const std::uint64_t seed = fresh_seed();
    SCOPED_TRACE(describe(s, ro, seed));
    std::mt19937_64 rng(seed);
    Tensor<T> q("q", s.batch, s.seq_q, s.heads_q, s.head_dim), k("k", s.batch, s.seq_k, s.heads_kv, s.head_dim),
        v("v", s.batch, s.seq_k, s.heads_kv, s.head_dim), o("o", s.batch, s.seq_q, s.heads_q, s.head_dim);
    Lse<T> lse("lse", s.batch, s.heads_q, s.seq_q);
    const auto qh = fill_random(q, rng), kh = fill_random(k, rng), vh = fill_random(v, rng);
    poison(o);
    poison(lse);
    kfa::reference_attention(Exec(), q, k, v, o, lse, to_kfa(ro));
    Exec().fence();
    std::vector<double> oref, lref;
    reference_forward64(s, ro, qh, kh, vh, oref, lref);
    EXPECT_TRUE(close_frobenius(to_doubles4(o), oref, tolerance<T>()));
    EXPECT_TRUE(close_lse(to_doubles3(lse), lref, tolerance<kfa::accumulator_t<T>>()));
  }
}
#endif
