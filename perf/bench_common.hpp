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

// Host SIMD facts for benchmark headers: the compiled baseline and the ISA the kernels dispatch to.
inline std::string host_simd_line() {
  return std::string("compiled for ") + kfa::to_string(kfa::detail::compiled_host_isa) + ", running " +
         kfa::to_string(kfa::host_isa());
}

}  // namespace kfa_bench
