#pragma once
// Shared test helpers: random tensors (fresh seed per check, printed on failure), poisoned outputs,
// per-dtype tolerances and whole-tensor comparisons against the float64 reference.
#include <gtest/gtest.h>
#include <kfa/kfa.hpp>

#include <cmath>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "reference64.hpp"

namespace kfa_test {

using Exec = Kokkos::DefaultExecutionSpace;
using Mem = Exec::memory_space;
template <class T>
using Tensor = Kokkos::View<T****, Kokkos::LayoutRight, Mem>;
template <class T>
using Lse = Kokkos::View<kfa::accumulator_t<T>***, Kokkos::LayoutRight, Mem>;

// Every element type this Kokkos build has as a distinct type, for typed tests.
using Dtypes = ::testing::Types<double, float
#if KFA_HAS_HALF
                                ,
                                kfa::compat::half_t
#endif
#if KFA_HAS_BHALF
                                ,
                                kfa::compat::bhalf_t
#endif
                                >;
struct DtypeNames {
  template <class T>
  static std::string GetName(int) {
    return kfa::dtype_name<T>();
  }
};

// Relative Frobenius error allowed for outputs, per element type (from the contract).
template <class T>
double tolerance() {
  if (std::is_same<T, double>::value) return 1e-12;
  if (std::is_same<T, float>::value) return 1e-5;
  return 1e-2;  // half, bfloat16
}

// A new seed for every check; tests print it so a failure can be replayed (KFA_TEST_SEED overrides).
inline std::uint64_t fresh_seed() {
  if (const char* s = std::getenv("KFA_TEST_SEED")) return std::stoull(s);
  static std::random_device rd;
  return (std::uint64_t(rd()) << 32) ^ rd();
}

// Contiguous copy of any rank-4 View in its own memory space (Kokkos cannot deep_copy non-contiguous
// Views across memory spaces, e.g. a strided device subview to the host).
template <class View>
Kokkos::View<typename View::non_const_value_type****, Kokkos::LayoutRight, typename View::memory_space> packed4(
    const View& x) {
  Kokkos::View<typename View::non_const_value_type****, Kokkos::LayoutRight, typename View::memory_space> p(
      "kfa_test::packed", x.extent(0), x.extent(1), x.extent(2), x.extent(3));
  Kokkos::deep_copy(p, x);
  return p;
}

// Fills x with N(0, sigma²) values rounded to T and returns them as doubles ([b, s, h, d] order).
template <class View>
std::vector<double> fill_random(const View& x, std::mt19937_64& rng, double sigma = 1.0) {
  using T = typename View::non_const_value_type;
  auto p = packed4(x);
  auto h = Kokkos::create_mirror_view(Kokkos::HostSpace(), p);
  std::normal_distribution<double> dist(0.0, sigma);
  std::vector<double> out;
  out.reserve(x.size());
  for (size_t b = 0; b < x.extent(0); ++b)
    for (size_t i = 0; i < x.extent(1); ++i)
      for (size_t hh = 0; hh < x.extent(2); ++hh)
        for (size_t c = 0; c < x.extent(3); ++c) {
          const T val = static_cast<T>(dist(rng));
          h(b, i, hh, c) = val;
          out.push_back(static_cast<double>(static_cast<kfa::accumulator_t<T>>(val)));
        }
  Kokkos::deep_copy(p, h);
  Kokkos::deep_copy(x, p);
  return out;
}

// Sets every element of an output to NaN so that an unwritten element cannot pass.
template <class View>
void poison(const View& x) {
  using T = typename View::non_const_value_type;
  Kokkos::deep_copy(x, static_cast<T>(std::numeric_limits<float>::quiet_NaN()));
}

// Output tensor [b, s, h, d] as doubles in the reference's order.
template <class View>
std::vector<double> to_doubles4(const View& x) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), packed4(x));
  std::vector<double> out;
  out.reserve(x.size());
  for (size_t b = 0; b < x.extent(0); ++b)
    for (size_t i = 0; i < x.extent(1); ++i)
      for (size_t hh = 0; hh < x.extent(2); ++hh)
        for (size_t c = 0; c < x.extent(3); ++c)
          out.push_back(static_cast<double>(
              static_cast<kfa::accumulator_t<typename View::non_const_value_type>>(h(b, i, hh, c))));
  return out;
}

template <class View>
std::vector<double> to_doubles3(const View& x) {
  Kokkos::View<typename View::non_const_value_type***, Kokkos::LayoutRight, typename View::memory_space> p(
      "kfa_test::packed", x.extent(0), x.extent(1), x.extent(2));
  Kokkos::deep_copy(p, x);
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), p);
  std::vector<double> out;
  for (size_t a = 0; a < x.extent(0); ++a)
    for (size_t b = 0; b < x.extent(1); ++b)
      for (size_t c = 0; c < x.extent(2); ++c) out.push_back(static_cast<double>(h(a, b, c)));
  return out;
}

// Every element finite and ‖got − want‖ / ‖want‖ ≤ tol; reports the worst elements on failure.
inline ::testing::AssertionResult close_frobenius(const std::vector<double>& got, const std::vector<double>& want,
                                                  double tol) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << "size " << got.size() << " vs " << want.size();
  double num = 0, den = 0, worst = -1;
  size_t worst_i = 0, nonfinite = 0, first_nonfinite = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) {
      if (nonfinite++ == 0) first_nonfinite = i;
      continue;
    }
    const double e = got[i] - want[i];
    num += e * e;
    den += want[i] * want[i];
    if (std::abs(e) > worst) worst = std::abs(e), worst_i = i;
  }
  if (nonfinite)
    return ::testing::AssertionFailure() << nonfinite << " non-finite elements (unwritten or NaN), first at flat index "
                                         << first_nonfinite;
  const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  if (rel <= tol) return ::testing::AssertionSuccess() << "relative error " << rel;
  return ::testing::AssertionFailure() << "relative Frobenius error " << rel << " > " << tol
                                       << "; worst element at flat " << worst_i << ": got " << got[worst_i] << ", want "
                                       << want[worst_i];
}

// LSE: −inf exactly where the reference has −inf, else |got − want| ≤ tol·max(1, |want|).
inline ::testing::AssertionResult close_lse(const std::vector<double>& got, const std::vector<double>& want,
                                            double tol) {
  for (size_t i = 0; i < got.size(); ++i) {
    const bool want_inf = std::isinf(want[i]);
    if (want_inf) {
      if (!(std::isinf(got[i]) && got[i] < 0))
        return ::testing::AssertionFailure()
               << "lse[" << i << "] = " << got[i] << " but the row sees no key (want -inf)";
      continue;
    }
    if (!std::isfinite(got[i]) || std::abs(got[i] - want[i]) > tol * std::max(1.0, std::abs(want[i])))
      return ::testing::AssertionFailure()
             << "lse[" << i << "] = " << got[i] << ", want " << want[i] << " (tol " << tol << ")";
  }
  return ::testing::AssertionSuccess();
}

inline kfa::AttentionOptions to_kfa(const RefOptions& r) {
  kfa::AttentionOptions o;
  o.softmax_scale = r.scale;
  o.causal = r.causal;
  o.window_left = r.window_left;
  o.window_right = r.window_right;
  o.softcap = r.softcap;
  return o;
}

inline std::string describe(const Shape& s, const RefOptions& o, std::uint64_t seed) {
  std::ostringstream os;
  os << "batch " << s.batch << " seq_q " << s.seq_q << " seq_k " << s.seq_k << " heads " << s.heads_q << "/"
     << s.heads_kv << " d " << s.head_dim << " causal " << o.causal << " window (" << o.window_left << ","
     << o.window_right << ") softcap " << o.softcap << " seed " << seed << " (KFA_TEST_SEED to replay)";
  return os.str();
}

}  // namespace kfa_test
