#pragma once
// Helpers shared by the benchmarks: Kokkos Tools memory high-water, median timing with fences, the
// KokkosBlas::gemm ceiling of the same backend, argument parsing (CLI11: numbers validated, unknown options
// refused, Kokkos' own --kokkos-* options left to Kokkos).
#include <Kokkos_Random.hpp>
#include <kfa/kfa.hpp>

#include "../examples/cli.hpp"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

namespace kfa_bench {

using Exec = Kokkos::DefaultExecutionSpace;
using Mem = Exec::memory_space;

// High-water of Kokkos allocations made after reset_peak() (labels and sizes from Kokkos Tools).
inline std::mutex g_mu;
inline std::int64_t g_live = 0, g_peak = 0;
inline void on_alloc(Kokkos::Profiling::SpaceHandle, const char*, const void*, std::uint64_t n) {
  std::lock_guard<std::mutex> l(g_mu);
  g_live += static_cast<std::int64_t>(n);
  g_peak = std::max(g_peak, g_live);
}
inline void on_free(Kokkos::Profiling::SpaceHandle, const char*, const void*, std::uint64_t n) {
  std::lock_guard<std::mutex> l(g_mu);
  g_live -= static_cast<std::int64_t>(n);
}
inline void track_memory(bool on) {
  Kokkos::Tools::Experimental::set_allocate_data_callback(on ? on_alloc : nullptr);
  Kokkos::Tools::Experimental::set_deallocate_data_callback(on ? on_free : nullptr);
}
inline void reset_peak() {
  std::lock_guard<std::mutex> l(g_mu);
  g_live = 0;
  g_peak = 0;
}
inline double peak_mib() {
  return g_peak / 1048576.0;
}

// The command-line helpers shared with the examples (integer, positive_int, nonnegative_int, positive_real,
// parse_command_line).
using namespace kfa_cli;

// The benchmarks' rank-4 tensors [batch, seq, heads, d] in memory order `bnhd` (a LayoutRight View: the heads of a
// position side by side, as a model's projections give them) or `bhnd` (each head's rows contiguous, as PyTorch's
// SDPA takes them: a LayoutStride View with the same indices). perf/cpu_peer.py gives PyTorch the same memory.
inline Kokkos::View<float****, Kokkos::LayoutStride, Mem> per_head_tensor(const std::string& label, int n, int heads,
                                                                          int d) {
  const std::size_t N = static_cast<std::size_t>(n), H = static_cast<std::size_t>(heads),
                    D = static_cast<std::size_t>(d);
  return Kokkos::View<float****, Kokkos::LayoutStride, Mem>(label,
                                                            Kokkos::LayoutStride(1, H * N * D, N, D, H, N * D, D, 1));
}
inline void add_layout_option(CLI::App& app, std::string& layout) {
  app.add_option("--layout", layout, "memory order of the [batch, seq, heads, d] tensors: bnhd or bhnd")
      ->check(CLI::IsMember({"bnhd", "bhnd"}))
      ->capture_default_str();
}

// Runs `body` (after Kokkos is up), turning what it throws into a message and an exit status instead of an
// abort: 2 for a kfa::Error (arguments kfa refuses: an unsupported head dim, ...), 1 for anything else
// (an allocation that failed: sizes beyond the device's memory).
template <class F>
int report_errors(const char* program, F&& body) {
  try {
    return body();
  } catch (const kfa::Error& e) {
    std::fprintf(stderr, "%s: %s\n", program, e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", program, e.what());
    return 1;
  }
}

// Median wall time of `reps` calls, with a fence before starting and before stopping each timer.
template <class F>
double median_seconds(int reps, F&& f) {
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    Exec().fence();
    const auto t0 = std::chrono::steady_clock::now();
    f();
    Exec().fence();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

#if KFA_HAVE_KOKKOS_KERNELS
// KokkosBlas::gemm rate (GFLOP/s) on square float matrices of size n, same backend and threads.
inline double gemm_ceiling(int n, int reps) {
  Kokkos::View<float**, Kokkos::LayoutRight, Mem> a("bench::a", n, n), b("bench::b", n, n), c("bench::c", n, n);
  Kokkos::Random_XorShift64_Pool<Exec> pool(7);
  Kokkos::fill_random(a, pool, -1.0f, 1.0f);
  Kokkos::fill_random(b, pool, -1.0f, 1.0f);
  kfa::compat::gemm(Exec(), "N", "N", 1.0f, a, b, 0.0f, c);  // warm-up
  const double s = median_seconds(reps, [&] { kfa::compat::gemm(Exec(), "N", "N", 1.0f, a, b, 0.0f, c); });
  return 2.0 * n * double(n) * n / s * 1e-9;
}
#else
inline double gemm_ceiling(int, int) {  // no Kokkos Kernels in this build: no ceiling (0)
  return 0;
}
#endif

// The BLAS library this process has mapped (Debian's libblas.so.3 is an alternative: the reference BLAS
// or OpenBLAS), so a "GEMM ceiling" says which BLAS it measured.
inline std::string loaded_blas() {
  std::ifstream maps("/proc/self/maps");
  std::string line, found;
  while (std::getline(maps, line)) {
    const auto slash = line.find('/');
    if (slash == std::string::npos) continue;
    const std::string path = line.substr(slash);
    if ((path.find("blas") != std::string::npos || path.find("mkl") != std::string::npos) &&
        found.find(path) == std::string::npos)
      found += (found.empty() ? "" : ", ") + path;
  }
  return found.empty() ? "none mapped (statically linked or not used)" : found;
}

// One core's FP32 FMA peak, measured: twelve independent register-resident FMA chains of the running host ISA's
// vector width (kfa::host_isa(): the width the kernels use), timed on the calling thread. GFLOP/s, counting an
// FMA as 2 flops. The honest yardstick of a CPU figure: a fraction of it says how much of the core a kernel
// uses, where a BLAS ceiling only says how it compares with that BLAS on this build.
#define KFA_BENCH_FMA_CHAINS(V)                                                                                     \
  V a0 = V{} + 1, a1 = V{} + 2, a2 = V{} + 3, a3 = V{} + 4, a4 = V{} + 5, a5 = V{} + 6, a6 = V{} + 7, a7 = V{} + 8, \
    a8 = V{} + 9, a9 = V{} + 10, a10 = V{} + 11, a11 = V{} + 12;                                                    \
  const V b = V{} + 1.0000001f, c = V{} + x;                                                                        \
  for (long it = 0; it < iters; ++it) {                                                                             \
    a0 = a0 * b + c, a1 = a1 * b + c, a2 = a2 * b + c, a3 = a3 * b + c, a4 = a4 * b + c, a5 = a5 * b + c;           \
    a6 = a6 * b + c, a7 = a7 * b + c, a8 = a8 * b + c, a9 = a9 * b + c, a10 = a10 * b + c, a11 = a11 * b + c;       \
  }                                                                                                                 \
  const V s = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11;                                          \
  return s[0];
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
__attribute__((target("avx512f,fma"), noinline)) inline float fma_chains_avx512(long iters, float x) {
  typedef float V __attribute__((vector_size(64)));
  KFA_BENCH_FMA_CHAINS(V)
}
__attribute__((target("avx2,fma"), noinline)) inline float fma_chains_avx2(long iters, float x) {
  typedef float V __attribute__((vector_size(32)));
  KFA_BENCH_FMA_CHAINS(V)
}
__attribute__((noinline)) inline float fma_chains_sse2(long iters, float x) {  // mul + add: no FMA in SSE2
  typedef float V __attribute__((vector_size(16)));
  KFA_BENCH_FMA_CHAINS(V)
}
#pragma GCC pop_options
#endif
#undef KFA_BENCH_FMA_CHAINS

// GFLOP/s of one core at the running host ISA (0 where not measured: not x86-64, the scalar level, or a CUDA
// build, whose compiler driver crashed on these target-attributed vector functions: nvcc 13.0 with g++ 13).
inline double fma_peak_gflops() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__)
  const kfa::HostIsa isa = kfa::host_isa();
  if (isa == kfa::HostIsa::scalar) return 0;
  const int lanes = isa == kfa::HostIsa::avx512 ? 16 : isa == kfa::HostIsa::avx2 ? 8 : 4;
  auto run = [&](long iters) {
    volatile float x = 0.5f;
    return isa == kfa::HostIsa::avx512 ? fma_chains_avx512(iters, x)
           : isa == kfa::HostIsa::avx2 ? fma_chains_avx2(iters, x)
                                       : fma_chains_sse2(iters, x);
  };
  const long iters = 20000000;
  run(iters / 10);  // warm-up: clocks up, AVX-512 licence taken
  volatile float sink = 0;
  const double s = median_seconds(3, [&] { sink = sink + run(iters); });
  return 12.0 * iters * lanes * 2 / s * 1e-9;
#else
  return 0;
#endif
}

// Host SIMD facts for benchmark headers: the compiled baseline and the ISA the kernels dispatch to.
inline std::string host_simd_line() {
  return std::string("compiled for ") + kfa::to_string(kfa::detail::compiled_host_isa) + ", running " +
         kfa::to_string(kfa::host_isa());
}

}  // namespace kfa_bench
