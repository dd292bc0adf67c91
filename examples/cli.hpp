#pragma once
// Command lines of kfa's examples and benchmarks (CLI11), in one place: numbers must be whole and in range,
// unknown options are refused (exit 2, with a message naming the option and the value), --help prints and
// exits 0, and Kokkos' own --kokkos-* options are left for Kokkos::ScopeGuard (--kokkos-help: see asks_kokkos_help).
#include <CLI/CLI.hpp>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace kfa_cli {

// Validators that name the value they refuse (CLI11 prefixes the option): "--heads: must be a positive
// integer (at most 1073741824), got 'abc'". The whole string must be the number.
inline CLI::Validator integer(long long lo, long long hi, const std::string& what) {
  return CLI::Validator(
      [=](std::string& s) -> std::string {
        errno = 0;
        char* end = nullptr;
        const long long x = std::strtoll(s.c_str(), &end, 10);
        if (s.empty() || *end != '\0' || errno == ERANGE || x < lo || x > hi)
          return "must be " + what + ", got '" + s + "'";
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
        if (s.empty() || *end != '\0' || !std::isfinite(x) || x <= 0)
          return "must be a positive finite number, got '" + s + "'";
        return std::string();
      },
      "a positive number");
}

// Parses the command line with `app`, Kokkos' own --kokkos-* options (--kokkos-threads=4, ...) left for
// Kokkos::ScopeGuard. Returns -1 to go on, 0 after --help (printed on stdout), 2 after a bad or unknown
// argument (the message, naming the option and the value, on stderr). `quiet`: the same verdict, nothing
// printed (MPI ranks other than 0). A repeated single-value option: the last one wins.
inline int parse_command_line(CLI::App& app, int argc, char** argv, bool quiet = false) {
  for (CLI::Option* o : app.get_options())
    if (o->get_items_expected_max() == 1) o->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  std::vector<char*> mine;
  for (int i = 0; i < argc; ++i)
    if (i == 0 || std::strncmp(argv[i], "--kokkos-", 9) != 0) mine.push_back(argv[i]);
  try {
    app.parse(static_cast<int>(mine.size()), mine.data());
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) {  // --help
      if (!quiet) app.exit(e);
      return 0;
    }
    if (!quiet) std::fprintf(stderr, "%s: %s\nRun with --help for the options.\n", app.get_name().c_str(), e.what());
    return 2;
  }
  return -1;
}

// Kokkos::ScopeGuard prints Kokkos' options for --kokkos-help and then lets the program run on. A program asked
// for help should not run: test this before the ScopeGuard (Kokkos removes the option from argv) and return 0
// right after constructing it.
inline bool asks_kokkos_help(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (std::strcmp(argv[i], "--kokkos-help") == 0) return true;
  return false;
}

}  // namespace kfa_cli
