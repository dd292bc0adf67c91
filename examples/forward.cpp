// kfa forward example: exact attention over one sequence, checked against float64 rows computed here.
//
//   kfa_example_forward [--seq N] [--batch B] [--heads H] [--kv-heads G] [--head-dim D] [--causal]
//                       [--check K] [--repeat R]
//
// Prints the tiles kfa chose, the time per call, GFLOP/s and the largest error of K checked rows.
#include <Kokkos_Random.hpp>
#include <kfa/kfa.hpp>

#include "cli.hpp"
#include "sizes.hpp"

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {
using kfa_cli::integer;
using kfa_cli::parse_command_line;
}  // namespace

int main(int argc, char** argv) {
  int seq = 4096, batch = 1, heads = 8, kv_heads = 0, d = 128, check = 16, repeat = 3;
  bool causal = false;
  const long long big = 1LL << 30;
  const std::string positive = "a positive integer (at most " + std::to_string(big) + ")";
  CLI::App app{
      "kfa forward example: exact attention over one sequence, checked against float64 rows "
      "(Kokkos' options --kokkos-*: --kokkos-help)",
      "kfa_example_forward"};
  app.add_option("--seq", seq, "sequence length")->check(integer(1, big, positive))->capture_default_str();
  app.add_option("--batch", batch, "batch")->check(integer(1, big, positive))->capture_default_str();
  app.add_option("--heads", heads, "query heads")->check(integer(1, big, positive))->capture_default_str();
  app.add_option("--kv-heads", kv_heads, "key/value heads, a divisor of --heads (0: --heads)")
      ->check(integer(0, big, "an integer in [0, " + std::to_string(big) + "]"))
      ->capture_default_str();
  app.add_option("--head-dim", d, "head dim")
      ->check(integer(1, 1024, "a positive integer (at most 1024)"))
      ->capture_default_str();
  app.add_flag("--causal", causal, "causal mask");
  app.add_option("--check", check, "rows checked against float64 (0: none)")
      ->check(integer(0, big, "an integer in [0, " + std::to_string(big) + "]"))
      ->capture_default_str();
  app.add_option("--repeat", repeat, "timed calls (the best is reported)")
      ->check(integer(1, big, positive))
      ->capture_default_str();
  const int parsed = parse_command_line(app, argc, argv);
  if (parsed >= 0) return parsed;
  if (kv_heads == 0) kv_heads = heads;
  if (heads % kv_heads != 0) {
    std::fprintf(stderr, "kfa_example_forward: --heads %d is not a multiple of --kv-heads %d\n", heads, kv_heads);
    return 2;
  }
  const bool kokkos_help = kfa_cli::asks_kokkos_help(argc, argv);
  Kokkos::ScopeGuard guard(argc, argv);
  if (kokkos_help) return 0;  // Kokkos printed its options; nothing runs
  const std::string sizes = kfa_sizes::problem(
      "kfa_example_forward",
      "--seq " + std::to_string(seq) + " --batch " + std::to_string(batch) + " --heads " + std::to_string(heads) +
          " --kv-heads " + std::to_string(kv_heads) + " --head-dim " + std::to_string(d),
      {{"q", {batch, seq, heads, d}, sizeof(float), true},
       {"k", {batch, seq, kv_heads, d}, sizeof(float), true},
       {"v", {batch, seq, kv_heads, d}, sizeof(float), true},
       {"o", {batch, seq, heads, d}, sizeof(float), true},
       {"lse", {batch, heads, seq}, sizeof(float), false}},
      "use a shorter --seq, fewer --heads, or a smaller --batch or --head-dim");
  if (!sizes.empty()) {
    std::fprintf(stderr, "%s\n", sizes.c_str());
    return 2;
  }
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
  } catch (const std::exception& e) {  // an allocation beyond the memory there is, say
    std::fprintf(stderr, "kfa_example_forward: %s\n", e.what());
    status = 1;
  }
  return status;
}
