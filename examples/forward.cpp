// kfa forward example: exact attention over one sequence, checked against float64 rows computed here.
//
//   kfa_example_forward [--seq N] [--batch B] [--heads H] [--kv-heads G] [--head-dim D] [--causal]
//                       [--check K] [--repeat R]
//
// Prints the tiles kfa chose, the time per call, GFLOP/s and the largest error of K checked rows.
#include <Kokkos_Random.hpp>
#include <kfa/kfa.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

namespace {
[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "kfa_example_forward: %s\nusage: kfa_example_forward [--seq N] [--batch B] [--heads H] [--kv-heads G] "
               "[--head-dim D] [--causal] [--check K] [--repeat R]\n",
               why.c_str());
  std::exit(2);
}
int parse_int(int& i, int argc, char** argv) {
  if (i + 1 >= argc) usage(std::string(argv[i]) + " needs a value");
  char* end = nullptr;
  const long x = std::strtol(argv[++i], &end, 10);
  if (*end != '\0' || x < 0 || x > (1L << 30)) usage(std::string(argv[i - 1]) + " got '" + argv[i] + "'");
  return static_cast<int>(x);
}
}  // namespace

int main(int argc, char** argv) {
  int seq = 4096, batch = 1, heads = 8, kv_heads = 0, d = 128, check = 16, repeat = 3;
  bool causal = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--seq") seq = parse_int(i, argc, argv);
    else if (a == "--batch") batch = parse_int(i, argc, argv);
    else if (a == "--heads") heads = parse_int(i, argc, argv);
    else if (a == "--kv-heads") kv_heads = parse_int(i, argc, argv);
    else if (a == "--head-dim") d = parse_int(i, argc, argv);
    else if (a == "--check") check = parse_int(i, argc, argv);
    else if (a == "--repeat") repeat = std::max(1, parse_int(i, argc, argv));
    else if (a == "--causal") causal = true;
    else if (a == "--help" || a == "-h") usage("help");
    else usage("unknown argument '" + a + "'");
  }
  if (kv_heads == 0) kv_heads = heads;
  Kokkos::ScopeGuard guard(argc, argv);
  using Exec = Kokkos::DefaultExecutionSpace;
  using View4 = Kokkos::View<float****, Exec::memory_space>;
  int status = 0;
  try {
    // q [batch, seq, heads, d]; k, v [batch, seq, kv_heads, d]; o like q; lse [batch, heads, seq].
    View4 q("q", batch, seq, heads, d), k("k", batch, seq, kv_heads, d), v("v", batch, seq, kv_heads, d),
        o("o", batch, seq, heads, d);
    Kokkos::View<float***, Exec::memory_space> lse("lse", batch, heads, seq);
    Kokkos::Random_XorShift64_Pool<Exec> pool(std::random_device{}());
    Kokkos::fill_random(q, pool, -1.0f, 1.0f);
    Kokkos::fill_random(k, pool, -1.0f, 1.0f);
    Kokkos::fill_random(v, pool, -1.0f, 1.0f);

    kfa::AttentionOptions opts;
    opts.causal = causal;
    const kfa::TileConfig t = kfa::forward_tile_config(Exec(), q, k, opts);
    double best = 1e300;
    for (int r = 0; r < repeat; ++r) {
      Kokkos::deep_copy(o, std::nanf(""));  // poison: every element must be written
      Exec().fence();
      const auto t0 = std::chrono::steady_clock::now();
      kfa::attention_forward(Exec(), q, k, v, o, lse, opts);
      Exec().fence();
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    const double flops = 4.0 * batch * heads * double(seq) * seq * d * (causal ? 0.5 : 1.0);

    // Check `check` random rows in float64 straight from the definition.
    auto qh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), q);
    auto kh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), k);
    auto vh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
    auto oh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), o);
    std::mt19937 rng(12345);
    double max_rel = 0;
    const double scale = 1.0 / std::sqrt(double(d));
    for (int c = 0; c < check; ++c) {
      const int b = rng() % batch, h = rng() % heads, i = rng() % seq, hk = h / (heads / kv_heads);
      const int jmax = causal ? i + 1 : seq;
      std::vector<double> s(jmax);
      double mx = -1e300, sum = 0;
      for (int j = 0; j < jmax; ++j) {
        double acc = 0;
        for (int x = 0; x < d; ++x) acc += double(qh(b, i, h, x)) * kh(b, j, hk, x);
        s[j] = acc * scale;
        mx = std::max(mx, s[j]);
      }
      std::vector<double> ref(d, 0.0);
      for (int j = 0; j < jmax; ++j) {
        const double p = std::exp(s[j] - mx);
        sum += p;
        for (int x = 0; x < d; ++x) ref[x] += p * vh(b, j, hk, x);
      }
      double num = 0, den = 0;
      for (int x = 0; x < d; ++x) {
        const double e = oh(b, i, h, x) - ref[x] / sum;
        num += e * e;
        den += (ref[x] / sum) * (ref[x] / sum);
        if (!std::isfinite(oh(b, i, h, x))) num = INFINITY;
      }
      max_rel = std::max(max_rel, std::sqrt(num / den));
    }
    const bool ok = max_rel <= 1e-5;
    std::printf("kfa %s, Kokkos %s (%s), float, batch %d seq %d heads %d/%d d %d%s, tiles %s\n", KFA_VERSION_STRING,
                kfa::compat::kokkos_version_string().c_str(), Exec::name(), batch, seq, heads, kv_heads, d,
                causal ? " causal" : "", kfa::to_string(t).c_str());
    std::printf("time %.4f s (best of %d), %.2f GFLOP/s\n", best, repeat, flops / best * 1e-9);
    std::printf("check: %d rows vs float64, max relative error %.3e (tolerance 1e-5): %s\n", check, max_rel,
                ok ? "PASS" : "FAIL");
    status = ok ? 0 : 1;
  } catch (const kfa::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    status = 2;
  }
  return status;
}
