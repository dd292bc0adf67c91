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
      EXPECT_EQ(kfa::count_nonfinite(Exec(), y), at.size()) << "value " << val << " at " << at.size() << " position(s), first " << at[0];
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
  plant(x, {0}, kNaN);                              // head 0: outside
  plant(x, {1 * 8 + 0}, kInf);                      // token 0, head 1, e 0: inside
  plant(x, {x.size() - 1 - 2 * 8}, -kInf);          // last token, head 1, e 7: inside
  EXPECT_EQ(kfa::count_nonfinite(Exec(), x), 3u);
  EXPECT_EQ(kfa::count_nonfinite(Exec(), h1), 2u);
  auto h0 = Kokkos::subview(x, Kokkos::ALL, Kokkos::ALL, 0, Kokkos::ALL);  // rank 3, strided
  EXPECT_EQ(kfa::count_nonfinite(Exec(), h0), 1u);
}
