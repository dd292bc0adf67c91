// The combine rule alone: exactness against a one-shot softmax, associativity, commutativity, the empty
// state (−inf) as identity, fp32 partials, and the vectorizable exp used in the kernel's inner loop.
#include <kfa/detail/common/fast_exp.hpp>

#include <vector>

#include "../common/kfa_test.hpp"

namespace {

// State (m, ℓ, O) of scores xs with values vs, computed in one shot in double; `a` = Σ p·|v| per column,
// the scale of O's rounding errors (O itself can be much smaller when its terms cancel).
struct Full {
  double m, l;
  std::vector<double> o, a;
};
Full one_shot(const std::vector<double>& xs, const std::vector<std::vector<double>>& vs, size_t d) {
  Full f{-std::numeric_limits<double>::infinity(), 0, std::vector<double>(d, 0), std::vector<double>(d, 0)};
  for (double x : xs) f.m = std::max(f.m, x);
  if (f.m == -std::numeric_limits<double>::infinity()) return f;
  for (size_t j = 0; j < xs.size(); ++j) {
    const double p = std::exp(xs[j] - f.m);
    f.l += p;
    for (size_t c = 0; c < d; ++c) f.o[c] += p * vs[j][c], f.a[c] += p * std::abs(vs[j][c]);
  }
  return f;
}

template <class T>
struct Partial {
  kfa::SoftmaxState<T> s;
  std::vector<T> o;
};
template <class T>
Partial<T> partial(const Full& f) {
  Partial<T> p{{T(f.m), T(f.l)}, {}};
  for (double x : f.o) p.o.push_back(T(x));
  return p;
}
template <class T>
Partial<T> merged(Partial<T> a, const Partial<T>& b) {
  const kfa::MergeFactors<T> fac = kfa::merge(a.s, b.s);
  for (size_t c = 0; c < a.o.size(); ++c) a.o[c] = fac.scale_a * a.o[c] + fac.scale_b * b.o[c];
  return a;
}

}  // namespace

template <class T>
void check_merge_exact(double tol) {
  std::mt19937_64 rng(kfa_test::fresh_seed());
  std::normal_distribution<double> g(0, 4);
  const size_t d = 5;
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<double> xs(3 * 17);
    std::vector<std::vector<double>> vs(xs.size(), std::vector<double>(d));
    for (auto& x : xs) x = g(rng);
    for (auto& v : vs)
      for (auto& y : v) y = g(rng);
    if (trial % 5 == 0)
      for (size_t j = 17; j < 34; ++j) xs[j] = -std::numeric_limits<double>::infinity();  // middle part empty
    auto part = [&](size_t lo, size_t hi) {
      return one_shot(std::vector<double>(xs.begin() + lo, xs.begin() + hi),
                      std::vector<std::vector<double>>(vs.begin() + lo, vs.begin() + hi), d);
    };
    const Full all = one_shot(xs, vs, d);
    const auto a = partial<T>(part(0, 17)), b = partial<T>(part(17, 34)), c = partial<T>(part(34, 51));
    const auto left = merged(merged(a, b), c), right = merged(a, merged(b, c)), swapped = merged(c, merged(b, a));
    for (const auto* r : {&left, &right, &swapped}) {
      EXPECT_NEAR(double(r->s.l) * std::exp(double(r->s.m) - all.m), all.l, tol * all.l);
      // Rounding the partials to T and merging them errs by a few ulps of the terms' magnitudes, a / l.
      for (size_t k = 0; k < d; ++k)
        EXPECT_NEAR(double(r->o[k]) / double(r->s.l), all.o[k] / all.l, tol * (1 + all.a[k] / all.l));
      EXPECT_NEAR(double(r->s.lse()), all.m + std::log(all.l), tol * std::max(1.0, std::abs(all.m)));
    }
  }
}

TEST(OnlineSoftmax, MergeIsExactAndAssociativeDouble) {
  check_merge_exact<double>(1e-13);
}
TEST(OnlineSoftmax, MergeIsExactAndAssociativeFloat) {
  check_merge_exact<float>(2e-6);
}

TEST(OnlineSoftmax, EmptyStateIsIdentity) {
  using S = kfa::SoftmaxState<float>;
  const float ninf = -std::numeric_limits<float>::infinity();
  S a = S::empty();
  const S b{2.5f, 3.0f};
  auto f = kfa::merge(a, b);
  EXPECT_EQ(a.m, 2.5f);
  EXPECT_EQ(a.l, 3.0f);
  EXPECT_EQ(f.scale_a, 0.0f);
  EXPECT_EQ(f.scale_b, 1.0f);
  S c = b;
  f = kfa::merge(c, S::empty());
  EXPECT_EQ(c.m, 2.5f);
  EXPECT_EQ(c.l, 3.0f);
  EXPECT_EQ(f.scale_a, 1.0f);
  EXPECT_EQ(f.scale_b, 0.0f);
  S e = S::empty();
  f = kfa::merge(e, S::empty());  // both empty: no NaN anywhere
  EXPECT_EQ(e.m, ninf);
  EXPECT_EQ(e.l, 0.0f);
  EXPECT_EQ(f.scale_a, 0.0f);
  EXPECT_EQ(f.scale_b, 0.0f);
  EXPECT_EQ(e.lse(), ninf);
}

TEST(OnlineSoftmax, LseFormMatchesStateForm) {
  std::mt19937_64 rng(kfa_test::fresh_seed());
  std::normal_distribution<double> g(0, 10);
  for (int t = 0; t < 1000; ++t) {
    const double la = g(rng), lb = t % 7 == 0 ? -std::numeric_limits<double>::infinity() : g(rng);
    const auto r = kfa::merge_lse(la, lb);
    const double want = std::max(la, lb) + std::log(std::exp(la - std::max(la, lb)) + std::exp(lb - std::max(la, lb)));
    EXPECT_NEAR(r.lse, want, 1e-13 * std::max(1.0, std::abs(want)));
    EXPECT_NEAR(r.weight_a + r.weight_b, 1.0, 1e-15);
  }
  const auto both = kfa::merge_lse(-std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity());
  EXPECT_TRUE(std::isinf(both.lse) && both.lse < 0);
  EXPECT_EQ(both.weight_a, 0.0);
  EXPECT_EQ(both.weight_b, 0.0);
  // Huge LSEs stay finite.
  const auto huge = kfa::merge_lse(1e4f, 1e4f + 1.0f);
  EXPECT_TRUE(std::isfinite(huge.lse));
  EXPECT_NEAR(huge.weight_b, 1.0 / (1.0 + std::exp(-1.0)), 1e-6);
}

template <class T>
void check_fast_exp(double max_rel) {
  double worst = 0;
  for (double x = -700.0; x <= 80.0; x += 0.001713) {
    const T xt = T(x);
    if (double(xt) < (std::is_same<T, float>::value ? -87.0 : -708.0)) continue;
    const double want = std::exp(double(xt));
    if (want < std::numeric_limits<T>::min()) continue;
    worst = std::max(worst, std::abs(double(kfa::detail::fast_exp(xt)) - want) / want);
  }
  EXPECT_LE(worst, max_rel);
  EXPECT_EQ(kfa::detail::fast_exp(-std::numeric_limits<T>::infinity()), T(0));
  EXPECT_EQ(kfa::detail::fast_exp(T(-1e30)), T(0));
  EXPECT_EQ(kfa::detail::fast_exp(T(0)), T(1));
  EXPECT_TRUE(std::isnan(kfa::detail::fast_exp(std::numeric_limits<T>::quiet_NaN())));
}

// The vector form the host kernels use (every lane, special values included) against the scalar form.
template <class T>
void check_fast_exp_vec() {
#if KFA_HOST_LANES
  using L = kfa::detail::LaneVec<32, T>;
  constexpr int W = L::width;
  std::vector<T> xs;
  for (double x = -720.0; x <= 90.0; x += 0.0371) xs.push_back(T(x));
  for (T special : {-std::numeric_limits<T>::infinity(), T(-1e30), T(0), T(-0.0), T(-87.0), T(-708.0), T(1e-30),
                    std::numeric_limits<T>::quiet_NaN(), T(88.5), T(-88.0)})
    xs.push_back(special);
  while (xs.size() % W) xs.push_back(T(-1));
  for (std::size_t i = 0; i < xs.size(); i += W) {
    T out[W];
    typename L::type x;
    L::load(x, xs.data() + i);
    kfa::detail::fast_exp_vec(x);
    L::store(out, x);
    for (int l = 0; l < W; ++l) {
      const T want = kfa::detail::fast_exp(xs[i + l]);
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(out[l])) << "x = " << xs[i + l];
      } else {
        const double tol = 4 * std::numeric_limits<T>::epsilon() * std::abs(double(want));
        EXPECT_LE(std::abs(double(out[l]) - double(want)), tol) << "x = " << xs[i + l];
        if (want == T(0)) EXPECT_EQ(out[l], T(0)) << "x = " << xs[i + l];
      }
    }
  }
#else
  GTEST_SKIP() << "no host vector extensions in this build";
#endif
}

TEST(FastExp, VectorFormMatchesScalarFloat) {
  check_fast_exp_vec<float>();
}
TEST(FastExp, VectorFormMatchesScalarDouble) {
  check_fast_exp_vec<double>();
}

TEST(FastExp, FloatWithinTwoUlp) {
  check_fast_exp<float>(2.5e-7);
}
TEST(FastExp, DoubleWithinFourUlp) {
  check_fast_exp<double>(9e-16);
}
