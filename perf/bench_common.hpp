#pragma once
// Helpers shared by the benchmarks: Kokkos Tools memory high-water, median timing with fences, the
// KokkosBlas::gemm ceiling of the same backend, argument parsing (CLI11: numbers validated, unknown options
// refused, Kokkos' own --kokkos-* options left to Kokkos).
#include <CLI/CLI.hpp>
#include <Kokkos_Random.hpp>
#include <kfa/kfa.hpp>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <chrono>
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
inline double peak_mib() { return g_peak / 1048576.0; }

// Validators that name the value they refuse (CLI11 prefixes the option): "--heads: must be a positive
// integer (at most 1073741824), got 'abc'". The whole string must be the number.
inline CLI::Validator integer(long long lo, long long hi, const std::string& what) {
  return CLI::Validator(
      [=](std::string& s) -> std::string {
        errno = 0;
        char* end = nullptr;
        const long long x = std::strtoll(s.c_str(), &end, 10);
        if (s.empty() || *end != '\0' || errno == ERANGE || x < lo || x > hi) return "must be " + what + ", got '" + s + "'";
        return std::string();
      },
      what);
}
inline CLI::Validator positive_int(long long hi = 1LL << 30) {
  return integer(1, hi, "a positive integer (at most " + std::to_string(hi) + ")");
}
inline CLI::Validator nonnegative_int(long long hi = 1LL << 30) {
  return integer(0, hi, "an integer in [0, " + std::to_string(hi) + "]");
}
inline CLI::Validator positive_real() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        char* end = nullptr;
        const double x = std::strtod(s.c_str(), &end);
        if (s.empty() || *end != '\0' || !std::isfinite(x) || x <= 0) return "must be a positive finite number, got '" + s + "'";
        return std::string();
      },
      "a positive number");
}

// Parses the command line with `app`, Kokkos' own --kokkos-* options (--kokkos-threads=4, ...) left for
// Kokkos::ScopeGuard. Returns -1 to go on, 0 after --help (printed on stdout), 2 after a bad or unknown
// argument (the message, naming the option and the value, on stderr).
inline int parse_command_line(CLI::App& app, int argc, char** argv) {
  for (CLI::Option* o : app.get_options())  // a repeated single-value option: the last one wins, as before
    if (o->get_items_expected_max() == 1) o->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  std::vector<char*> mine;
  for (int i = 0; i < argc; ++i)
    if (i == 0 || std::strncmp(argv[i], "--kokkos-", 9) != 0) mine.push_back(argv[i]);
  try {
    app.parse(static_cast<int>(mine.size()), mine.data());
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) {  // --help
      app.exit(e);
      return 0;
    }
    std::fprintf(stderr, "%s: %s\nRun with --help for the options.\n", app.get_name().c_str(), e.what());
    return 2;
  }
  return -1;
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
