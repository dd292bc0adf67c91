// The CUDA fp32 backwards, each called through its launcher: the SIMT one (detail/simt_backward.hpp) and the
// 3xTF32 tensor-core one (detail/tc_tf32_backward.hpp). dq, dk, dv against the float64 reference backward
// and against the portable backward on the same inputs, every element checked (unwritten elements are NaN
// from the poison; structural zeros must be exact zeros), and bitwise reproducibility. lse comes from
// kfa::attention_forward and D from kfa::detail::backward_row_dot, as the library's dispatch will call it.
// On builds without Kokkos::Cuda only the host-side tile checks run.
#include "../common/kfa_test.hpp"

#include <kfa/detail/simt/backward.hpp>
#include <kfa/detail/tc_tf32/backward.hpp>
#include <kfa/detail/tc_tf32/family.hpp>  // tf32_space_problem

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>

using namespace kfa_test;

// The tiles stay within Kokkos' level-0 team scratch (40,936 B up to Kokkos 5.1) and agree with the shape.
TEST(SimtBackward, TilesFitKokkosTeamScratch) {
  const std::size_t cap = 40936;
  for (const kfa::BackwardTileConfig& t :
       {kfa::detail::simt_backward_tiles<64>(cap), kfa::detail::simt_backward_tiles<128>(cap)}) {
    EXPECT_LE(t.dkdv.scratch_l0, cap) << kfa::to_string(t);
    EXPECT_LE(t.dq.scratch_l0, cap) << kfa::to_string(t);
    EXPECT_EQ(t.dkdv.scratch_l0_max, cap);
    EXPECT_EQ(t.dkdv.team_size, 128);
    EXPECT_EQ(t.dq.team_size, 128);
  }
  using S64 = kfa::detail::SimtBackwardShape<64>;
  using S128 = kfa::detail::SimtBackwardShape<128>;
  EXPECT_EQ(kfa::detail::simt_backward_tiles<64>(cap).dkdv.block_k, S64::dkdv_block_k);
  EXPECT_EQ(kfa::detail::simt_backward_tiles<128>(cap).dq.block_q, S128::dq_block_q);
  // every thread owns rows_per_thread rows of one slice; the slices of a row tile the head dim
  EXPECT_EQ(S64::lanes_per_row * S64::slice, 64);
  EXPECT_EQ(S128::lanes_per_row * S128::slice, 128);
  EXPECT_EQ(S128::threads / S128::lanes_per_row * S128::rows_per_thread, S128::block_owned);
}

#if defined(KOKKOS_ENABLE_CUDA)
namespace {

// "[b, s, h, c]" of flat index i of a [batch, seq, heads, d] tensor.
inline std::string where4(std::size_t i, const std::array<std::size_t, 4>& ext) {
  const std::size_t c = i % ext[3], h = i / ext[3] % ext[2], s = i / (ext[3] * ext[2]) % ext[1],
                    b = i / (ext[3] * ext[2] * ext[1]);
  std::ostringstream os;
  os << "[b " << b << ", s " << s << ", h " << h << ", c " << c << "]";
  return os.str();
}

// Every element: finite (an unwritten one is NaN from the poison), exactly 0 in the rows flagged in
// `zero_rows` ([b, s, h] order: a query row that sees no key, a key that no query sees), and
// ‖got − want‖ / ‖want‖ ≤ tol over the tensor. On failure: which elements, where, and their values.
::testing::AssertionResult close_every_element(const char* what, const std::vector<double>& got,
                                               const std::vector<double>& want, const std::array<std::size_t, 4>& ext,
                                               const std::vector<char>& zero_rows, double tol) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << what << ": " << got.size() << " elements, want " << want.size();
  std::ostringstream bad;
  std::size_t nonfinite = 0, nonzero = 0;
  double num = 0, den = 0;
  std::vector<std::pair<double, std::size_t>> worst;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) {
      if (nonfinite++ < 5) bad << "\n  " << what << where4(i, ext) << " = " << got[i] << " (want " << want[i] << ")";
      continue;
    }
    if (zero_rows[i / ext[3]] && got[i] != 0.0) {
      if (nonzero++ < 5)
        bad << "\n  " << what << where4(i, ext) << " = " << got[i]
            << " but its row has no contribution (want exactly 0)";
    }
    const double e = got[i] - want[i];
    num += e * e;
    den += want[i] * want[i];
    worst.emplace_back(std::abs(e), i);
  }
  const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  if (nonfinite == 0 && nonzero == 0 && rel <= tol) return ::testing::AssertionSuccess();
  std::partial_sort(worst.begin(), worst.begin() + std::min<std::size_t>(5, worst.size()), worst.end(),
                    [](const auto& a, const auto& b) { return a.first > b.first; });
  ::testing::AssertionResult r = ::testing::AssertionFailure();
  r << what << ": " << nonfinite << " non-finite elements, " << nonzero << " non-zero in rows with no contribution, "
    << "relative Frobenius error " << rel << " (tolerance " << tol << ")" << bad.str() << "\n  worst elements:";
  for (std::size_t n = 0; n < worst.size() && n < 5; ++n)
    r << "\n  " << what << where4(worst[n].second, ext) << " = " << got[worst[n].second] << ", want "
      << want[worst[n].second] << " (|error| " << worst[n].first << ")";
  return r;
}

struct Grads {
  std::vector<double> dq, dk, dv;
};

enum class Fp32Backward { simt, tf32x3 };
const char* name_of(Fp32Backward f) {
  return f == Fp32Backward::simt ? "simt_fp32" : "tensor_core_tf32x3";
}

template <int D>
Grads run_kernel(Fp32Backward family, const Shape& s, const RefOptions& ro, const Tensor<float>& q,
                 const Tensor<float>& k, const Tensor<float>& v, const Tensor<float>& d_o, const Lse<float>& lse,
                 const Kokkos::View<float***, Kokkos::LayoutRight, Mem>& dd) {
  Tensor<float> dq("dq", s.batch, s.seq_q, s.heads_q, D), dk("dk", s.batch, s.seq_k, s.heads_kv, D),
      dv("dv", s.batch, s.seq_k, s.heads_kv, D);
  poison(dq), poison(dk), poison(dv);
  const kfa::detail::KeyMask mask(s.seq_q, s.seq_k, ro.causal, ro.window_left, ro.window_right);
  const float scale = static_cast<float>(ref_scale(s, ro)), softcap = static_cast<float>(ro.softcap);
  const auto args = kfa::detail::backward_args(q, k, v, d_o, lse, dd, dq, dk, dv, scale, softcap, mask);
  if (family == Fp32Backward::simt) {
    if constexpr (D == 64 || D == 128)  // the SIMT kernels' head dims
      kfa::detail::simt_backward_launch_d<D>(Exec(), args);
  } else {
#if KFA_HAS_TENSOR_CORES
    kfa::detail::tf32_backward_launch(Exec(), args, kfa::detail::BackwardParts::all);
#endif
  }
  Exec().fence();
  return {to_doubles4(dq), to_doubles4(dk), to_doubles4(dv)};
}

template <int D>
void check_backward(Fp32Backward family, const char* label, const Shape& s, const RefOptions& ro) {
  const std::uint64_t seed = fresh_seed();
  SCOPED_TRACE(std::string(name_of(family)) + ", " + label + ": " + describe(s, ro, seed));
  std::mt19937_64 rng(seed);
  Tensor<float> q("q", s.batch, s.seq_q, s.heads_q, D), k("k", s.batch, s.seq_k, s.heads_kv, D),
      v("v", s.batch, s.seq_k, s.heads_kv, D), d_o("do", s.batch, s.seq_q, s.heads_q, D),
      o("o", s.batch, s.seq_q, s.heads_q, D);
  Lse<float> lse("lse", s.batch, s.heads_q, s.seq_q);
  const auto qh = fill_random(q, rng), kh = fill_random(k, rng), vh = fill_random(v, rng), doh = fill_random(d_o, rng);
  kfa::AttentionOptions opts = to_kfa(ro);
  poison(o), poison(lse);
  kfa::attention_forward(Exec(), q, k, v, o, lse, opts);
  const auto dd = kfa::detail::backward_row_dot(Exec(), o, d_o);
  Exec().fence();

  const Grads got = run_kernel<D>(family, s, ro, q, k, v, d_o, lse, dd);

  // the portable backward on the same inputs (its own forward outputs are the same o and lse)
  opts.path = kfa::TileProductPath::portable;
  Tensor<float> pdq("pdq", s.batch, s.seq_q, s.heads_q, D), pdk("pdk", s.batch, s.seq_k, s.heads_kv, D),
      pdv("pdv", s.batch, s.seq_k, s.heads_kv, D);
  poison(pdq), poison(pdk), poison(pdv);
  kfa::attention_backward(Exec(), q, k, v, o, d_o, lse, pdq, pdk, pdv, opts);
  Exec().fence();
  const Grads port{to_doubles4(pdq), to_doubles4(pdk), to_doubles4(pdv)};

  Grads ref;
  reference_backward64(s, ro, qh, kh, vh, doh, ref.dq, ref.dk, ref.dv);
  const double tol = tolerance<float>();
  // rows whose gradient is exactly zero: query rows that see no key, keys that no query of the group sees
  std::vector<char> zq(std::size_t(s.batch) * s.seq_q * s.heads_q, 1),
      zk(std::size_t(s.batch) * s.seq_k * s.heads_kv, 1);
  for (int b = 0; b < s.batch; ++b)
    for (int i = 0; i < s.seq_q; ++i)
      for (int j = 0; j < s.seq_k; ++j)
        if (ref_visible(s, ro, i, j))
          for (int h = 0; h < s.heads_q; ++h) {
            zq[(std::size_t(b) * s.seq_q + i) * s.heads_q + h] = 0;
            zk[(std::size_t(b) * s.seq_k + j) * s.heads_kv + h / (s.heads_q / s.heads_kv)] = 0;
          }
  const std::array<std::size_t, 4> qe{std::size_t(s.batch), std::size_t(s.seq_q), std::size_t(s.heads_q),
                                      std::size_t(D)};
  const std::array<std::size_t, 4> ke{std::size_t(s.batch), std::size_t(s.seq_k), std::size_t(s.heads_kv),
                                      std::size_t(D)};
  EXPECT_TRUE(close_every_element("dq", got.dq, ref.dq, qe, zq, tol)) << name_of(family) << " vs float64 reference";
  EXPECT_TRUE(close_every_element("dk", got.dk, ref.dk, ke, zk, tol)) << name_of(family) << " vs float64 reference";
  EXPECT_TRUE(close_every_element("dv", got.dv, ref.dv, ke, zk, tol)) << name_of(family) << " vs float64 reference";
  // the portable path against float64 too, so that a disagreement below says which side is off
  EXPECT_TRUE(close_frobenius(port.dq, ref.dq, tol)) << "portable dq vs float64 reference";
  EXPECT_TRUE(close_frobenius(port.dk, ref.dk, tol)) << "portable dk vs float64 reference";
  EXPECT_TRUE(close_frobenius(port.dv, ref.dv, tol)) << "portable dv vs float64 reference";
  EXPECT_TRUE(close_every_element("dq", got.dq, port.dq, qe, zq, tol)) << name_of(family) << " vs portable";
  EXPECT_TRUE(close_every_element("dk", got.dk, port.dk, ke, zk, tol)) << name_of(family) << " vs portable";
  EXPECT_TRUE(close_every_element("dv", got.dv, port.dv, ke, zk, tol)) << name_of(family) << " vs portable";

  // no atomics: a second run gives the same bits
  const Grads again = run_kernel<D>(family, s, ro, q, k, v, d_o, lse, dd);
  auto same_bits = [](const std::vector<double>& a, const std::vector<double>& b) {
    return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0);
  };
  EXPECT_TRUE(same_bits(got.dq, again.dq)) << "dq differs between two identical runs";
  EXPECT_TRUE(same_bits(got.dk, again.dk)) << "dk differs between two identical runs";
  EXPECT_TRUE(same_bits(got.dv, again.dv)) << "dv differs between two identical runs";
}

template <int D>
void all_cases(Fp32Backward family) {
  const RefOptions plain;
  RefOptions causal;
  causal.causal = true;
  RefOptions window_cap;
  window_cap.window_left = 37, window_cap.window_right = 5, window_cap.softcap = 20.0;
  RefOptions narrow;  // keys 0..239 of 300 are seen by none of 50 queries: dk, dv exactly zero there
  narrow.window_left = 10, narrow.window_right = 0;
  RefOptions causal_cap;
  causal_cap.causal = true, causal_cap.softcap = 15.0;
  RefOptions scaled;  // an explicit scale that is not 1/sqrt(d)
  scaled.scale = 0.3;
  if (std::getenv("KFA_TEST_SMALL") != nullptr) {  // under compute-sanitizer: two masked cases
    check_backward<D>(family, "sliding window + softcap", {1, 257, 190, 2, 2, D}, window_cap);
    check_backward<D>(family, "causal + softcap, GQA, seq_q > seq_k, batch 2", {2, 129, 77, 4, 2, D}, causal_cap);
    return;
  }
  check_backward<D>(family, "partial tiles on both sides, batch 2", {2, 200, 200, 2, 2, D}, plain);
  check_backward<D>(family, "GQA, seq_q < seq_k", {1, 65, 300, 4, 2, D}, plain);
  check_backward<D>(family, "causal, GQA", {1, 300, 300, 2, 1, D}, causal);
  check_backward<D>(family, "causal, rows that see no key", {1, 100, 30, 2, 2, D}, causal);
  check_backward<D>(family, "sliding window + softcap", {1, 257, 190, 2, 2, D}, window_cap);
  check_backward<D>(family, "keys no query sees (whole key blocks)", {1, 50, 300, 2, 1, D}, narrow);
  check_backward<D>(family, "causal + softcap, GQA, seq_q > seq_k, batch 2", {2, 129, 77, 4, 2, D}, causal_cap);
  check_backward<D>(family, "many tiles, causal (both scratch stages)", {1, 700, 1000, 2, 1, D}, causal);
  check_backward<D>(family, "explicit scale, three rows, five keys", {1, 3, 5, 1, 1, D}, scaled);
  check_backward<D>(family, "seq_k = 0 (dq zero)", {1, 37, 0, 2, 1, D}, plain);
  check_backward<D>(family, "seq_q = 0 (dk, dv zero)", {1, 0, 40, 2, 1, D}, causal);
}

}  // namespace
#endif

TEST(SimtBackward, AgreesWithReferenceAndPortableD64) {
#if defined(KOKKOS_ENABLE_CUDA)
  if constexpr (!std::is_same<Exec, Kokkos::Cuda>::value) {
    GTEST_SKIP() << "the fp32 backward runs on Kokkos::Cuda; the default execution space is " << Exec::name();
  } else {
    all_cases<64>(Fp32Backward::simt);
  }
#else
  GTEST_SKIP() << "the CUDA fp32 backward needs Kokkos::Cuda (not in this build)";
#endif
}

TEST(SimtBackward, AgreesWithReferenceAndPortableD128) {
#if defined(KOKKOS_ENABLE_CUDA)
  if constexpr (!std::is_same<Exec, Kokkos::Cuda>::value) {
    GTEST_SKIP() << "the fp32 backward runs on Kokkos::Cuda; the default execution space is " << Exec::name();
  } else {
    all_cases<128>(Fp32Backward::simt);
  }
#else
  GTEST_SKIP() << "the CUDA fp32 backward needs Kokkos::Cuda (not in this build)";
#endif
}

// The 3xTF32 backward at every head dim it has, where this build and device can run it.
TEST(Tf32Backward, AgreesWithReferenceAndPortable) {
#if KFA_HAS_TENSOR_CORES
  if constexpr (!std::is_same<Exec, Kokkos::Cuda>::value) {
    GTEST_SKIP() << "the fp32 tensor-core backward runs on Kokkos::Cuda; the default execution space is "
                 << Exec::name();
  } else {
    const std::string why = kfa::detail::tf32_space_problem<Exec, float>(Exec(), 128, 0);
    if (!why.empty()) GTEST_SKIP() << why;
    int ran = 0;
    auto head_dim = [&](auto dc) {  // where the device gives this head dim's kernels their shared memory
      constexpr int D = decltype(dc)::value;
      const std::string smem_why = kfa::detail::native_smem_problem(Exec(), kfa::detail::tf32_backward_min_smem<D>(),
                                                                    "the fp32 tensor-core backward");
      if (!smem_why.empty()) {
        std::printf("[ note ] d = %d: %s\n", D, smem_why.c_str());
        return;
      }
      std::printf("[ note ] d = %d: dQ kernel with %d warps\n", D,
                  kfa::detail::tf32_dq_warps<D>(kfa::detail::native_smem_max(Exec())));
      all_cases<D>(Fp32Backward::tf32x3);
      ++ran;
    };
    head_dim(std::integral_constant<int, 64>{});
    head_dim(std::integral_constant<int, 96>{});
    head_dim(std::integral_constant<int, 128>{});
    if (ran == 0) GTEST_SKIP() << "no head dim's kernels fit this device's shared memory";
  }
#else
  GTEST_SKIP() << "the fp32 tensor-core backward needs Kokkos::Cuda built for sm_80 or newer (not in this build)";
#endif
}
