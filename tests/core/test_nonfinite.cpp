// kfa::count_nonfinite: zero on fresh random data; exactly the planted NaN, +Inf and -Inf counted, at the
// first, last and a middle element, for rank-4 tensors, rank-3 lse-like Views and strided subviews.
#include "../common/kfa_test.hpp"

using namespace kfa_test;

namespace {

template <class T>
class NonFinite : public ::testing::Test {};
TYPED_TEST_SUITE(NonFinite, Dtypes, DtypeNames);

// Sets elements of x (rank 3 or 4, any Mem View) at the given flat row-major positions to `val`.
template <class View>
void plant(const View& x, const std::vector<size_t>& flat, double val) {
  using T = typename View::non_const_value_type;
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), x);
  for (size_t f : flat) {
    size_t r = f;
    if constexpr (View::rank == 4) {
      const size_t e = r % x.extent(3);
      r /= x.extent(3);
      const size_t c = r % x.extent(2);
      r /= x.extent(2);
      const size_t b = r % x.extent(1);
      h(r / x.extent(1), b, c, e) = static_cast<T>(val);
    } else {
      const size_t c = r % x.extent(2);
      r /= x.extent(2);
      h(r / x.extent(1), r % x.extent(1), c) = static_cast<T>(val);
    }
  }
  Kokkos::deep_copy(x, h);
}

template <class View>
void fill_random3(const View& x, std::mt19937_64& rng) {
  using T = typename View::non_const_value_type;
  auto h = Kokkos::create_mirror_view(Kokkos::HostSpace(), x);
  std::normal_distribution<double> dist(0.0, 1.0);
  for (size_t a = 0; a < x.extent(0); ++a)
    for (size_t b = 0; b < x.extent(1); ++b)
      for (size_t c = 0; c < x.extent(2); ++c) h(a, b, c) = static_cast<T>(dist(rng));
  Kokkos::deep_copy(x, h);
}

const double kNaN = std::numeric_limits<double>::quiet_NaN(), kInf = std::numeric_limits<double>::infinity();

}  // namespace

TYPED_TEST(NonFinite, Rank4CountsEveryPlantedValue) {
  using T = TypeParam;
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  Tensor<T> x("x", 2, 37, 3, 16);
  fill_random(x, rng);
  EXPECT_EQ(kfa::count_nonfinite(Exec(), x), 0u) << "clean data";
  const size_t last = x.size() - 1, mid = x.size() / 2 + 5;
  for (double val : {kNaN, kInf, -kInf}) {
    for (std::vector<size_t> at : {std::vector<size_t>{0}, {last}, {mid}, {0, mid, last}}) {
      Tensor<T> y("y", 2, 37, 3, 16);
      Kokkos::deep_copy(y, x);
      plant(y, at, val);
      EXPECT_EQ(kfa::count_nonfinite(Exec(), y), at.size())
          << "value " << val << " at " << at.size() << " position(s), first " << at[0];
    }
  }
  // All three kinds at once, and every element.
  Tensor<T> y("y", 2, 37, 3, 16);
  Kokkos::deep_copy(y, x);
  plant(y, {0}, kNaN), plant(y, {mid}, kInf), plant(y, {last}, -kInf);
  EXPECT_EQ(kfa::count_nonfinite(Exec(), y), 3u);
  Kokkos::deep_copy(y, static_cast<T>(kNaN));
  EXPECT_EQ(kfa::count_nonfinite(Exec(), y), y.size());
  // A large finite value of the type (not an overflow) is finite.
  Kokkos::deep_copy(y, x);
  plant(y, {mid}, std::is_same<T, double>::value ? 1e300 : 60000.0);
  EXPECT_EQ(kfa::count_nonfinite(Exec(), y), 0u);
  // Also from a const View and on an empty one.
  Kokkos::View<const T****, Kokkos::LayoutRight, Mem> cy = x;
  EXPECT_EQ(kfa::count_nonfinite(Exec(), cy), 0u);
  EXPECT_EQ(kfa::count_nonfinite(Exec(), Tensor<T>("e", 0, 4, 2, 8)), 0u);
}

TYPED_TEST(NonFinite, Rank3AndStridedSubview) {
  using T = TypeParam;
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  Kokkos::View<T***, Kokkos::LayoutRight, Mem> l("l", 3, 4, 41);
  fill_random3(l, rng);
  EXPECT_EQ(kfa::count_nonfinite(Exec(), l), 0u);
  plant(l, {0, l.size() / 2, l.size() - 1}, kNaN);
  plant(l, {7}, kInf);
  plant(l, {l.size() - 2}, -kInf);
  EXPECT_EQ(kfa::count_nonfinite(Exec(), l), 5u);

  // A strided head slice of a rank-4 tensor: only the elements inside the slice count.
  Tensor<T> x("x", 2, 19, 4, 8);
  fill_random(x, rng);
  auto h1 = Kokkos::subview(x, Kokkos::ALL, Kokkos::ALL, std::make_pair(1, 2), Kokkos::ALL);  // rank 4, strided
  plant(x, {0}, kNaN);                                                                        // head 0: outside
  plant(x, {1 * 8 + 0}, kInf);              // token 0, head 1, e 0: inside
  plant(x, {x.size() - 1 - 2 * 8}, -kInf);  // last token, head 1, e 7: inside
  EXPECT_EQ(kfa::count_nonfinite(Exec(), x), 3u);
  EXPECT_EQ(kfa::count_nonfinite(Exec(), h1), 2u);
  auto h0 = Kokkos::subview(x, Kokkos::ALL, Kokkos::ALL, 0, Kokkos::ALL);  // rank 3, strided
  EXPECT_EQ(kfa::count_nonfinite(Exec(), h0), 1u);
}

// What src/kfa/nonfinite.hpp promises about a bad key j: NaN in row j of k makes the o row and the lse of every
// query row that sees key j NaN and leaves every other row exact. NaN in row j of v makes the o row of every query
// that sees it NaN; a row that does not see it may come out NaN too (the tile products multiply the masked
// probabilities, 0, by the whole tile of v, and 0·NaN = NaN), but only if it lies fewer than block_q + block_k − 1
// rows from a row that sees it (the tiles of the plan); otherwise it is exact, and any row is either all NaN or
// exact. Causal and sliding-window masks put key j in tiles of rows that do not see it; without a mask every row
// sees it. The path is `automatic`: on a GPU build, the tensor-core (half/bfloat16) and fp32 CUDA families.
namespace {
template <class T>
void check_bad_key(bool in_k, const RefOptions& ro, int bad_key) {
  const Shape s{1, 700, 700, 2, 1, 64};  // both query heads share the poisoned kv head
  const std::uint64_t seed = fresh_seed();
  SCOPED_TRACE(std::string(in_k ? "NaN row in k" : "NaN row in v") + " at key " + std::to_string(bad_key) + ", " +
               describe(s, ro, seed));
  std::mt19937_64 rng(seed);
  Tensor<T> q("q", s.batch, s.seq_q, s.heads_q, s.head_dim), k("k", s.batch, s.seq_k, s.heads_kv, s.head_dim),
      v("v", s.batch, s.seq_k, s.heads_kv, s.head_dim), o("o", s.batch, s.seq_q, s.heads_q, s.head_dim);
  Lse<T> lse("lse", s.batch, s.heads_q, s.seq_q);
  const auto qh = fill_random(q, rng), kh = fill_random(k, rng), vh = fill_random(v, rng);
  std::vector<size_t> row;
  for (int c = 0; c < s.head_dim; ++c) row.push_back(size_t(bad_key) * s.head_dim + c);
  plant(in_k ? k : v, row, kNaN);
  poison(o);
  poison(lse);
  const kfa::ForwardPlan plan = kfa::plan_forward(Exec(), q, k, v, o, to_kfa(ro));
  SCOPED_TRACE("plan " + plan.region);
  const long reach = in_k ? 0 : plan.tiles.block_q + plan.tiles.block_k - 1;
  kfa::attention_forward(Exec(), q, k, v, o, lse, to_kfa(ro));
  Exec().fence();
  std::vector<double> oref, lref;
  reference_forward64(s, ro, qh, kh, vh, oref, lref);  // the clean inputs
  const std::vector<double> og = to_doubles4(o), lg = to_doubles3(lse);
  std::vector<long> seeing;
  for (int i = 0; i < s.seq_q; ++i)
    if (ref_visible(s, ro, i, bad_key)) seeing.push_back(i);
  ASSERT_FALSE(seeing.empty());
  std::vector<double> got, want, lgot, lwant;
  int wrong_seeing = 0, first_wrong = -1, near_nan = 0, far_nan = 0, first_far_nan = -1;
  for (int h = 0; h < s.heads_q; ++h)
    for (int i = 0; i < s.seq_q; ++i) {
      const size_t at = (size_t(i) * s.heads_q + h) * s.head_dim, li = size_t(h) * s.seq_q + i;
      bool all_nan = true, any_nan = false;
      for (int c = 0; c < s.head_dim; ++c)
        all_nan = all_nan && std::isnan(og[at + c]), any_nan = any_nan || std::isnan(og[at + c]);
      long dist = s.seq_q;
      for (long r : seeing) dist = std::min(dist, std::labs(r - i));
      if (dist == 0) {
        if (!(all_nan && (!in_k || std::isnan(lg[li]))) && wrong_seeing++ == 0) first_wrong = i;
        continue;
      }
      if (all_nan && dist < reach) {
        ++near_nan;  // allowed: a row in a tile of the bad key
        continue;
      }
      if (any_nan && far_nan++ == 0) first_far_nan = i;
      got.insert(got.end(), og.begin() + at, og.begin() + at + s.head_dim);
      want.insert(want.end(), oref.begin() + at, oref.begin() + at + s.head_dim);
      lgot.push_back(lg[li]);
      lwant.push_back(lref[li]);
    }
  EXPECT_EQ(wrong_seeing, 0) << "query rows that see the bad key but whose o" << (in_k ? " and lse are" : " is")
                             << " not all NaN (of " << 2 * seeing.size() << "); the first is row " << first_wrong;
  EXPECT_EQ(far_nan, 0) << "rows that do not see the bad key, " << reach
                        << " or more rows from one that does, with NaN in o; the first is row " << first_far_nan;
  if (!got.empty()) {
    EXPECT_TRUE(close_frobenius(got, want, tolerance<T>())) << "the rows that do not see the bad key";
    EXPECT_TRUE(close_lse(lgot, lwant, tolerance<kfa::accumulator_t<T>>())) << "the rows that do not see the bad key";
  }
  if (!in_k)
    std::printf("  [v NaN at %d, %s] %d near rows NaN (reach %ld)\n", bad_key, plan.region.c_str(), near_nan, reach);
}
}  // namespace

TYPED_TEST(NonFinite, BadKeyPoisonsTheRowsThatSeeIt) {
  for (bool in_k : {false, true}) {
    RefOptions causal, window, none;
    causal.causal = true;
    window.window_left = 40, window.window_right = 0;
    for (int j : {0, 170, 600, 699}) check_bad_key<TypeParam>(in_k, causal, j);
    for (int j : {170, 600}) check_bad_key<TypeParam>(in_k, window, j);
    check_bad_key<TypeParam>(in_k, none, 170);
  }
}
