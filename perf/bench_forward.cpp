// Forward benchmark: kfa::attention_forward vs the materialized kfa::reference_attention, with the
// KokkosBlas::gemm rate of the same backend and thread count measured in the same run as the ceiling.
//
//   kfa_bench_forward [--n 512,1024,...] [--d 64,128] [--heads H] [--reps R] [--no-reference]
//                     [--reference-max-n N] [--markdown]
//
// GFLOP/s count 4·B·H·N²·d (halved for causal). Memory is the high-water of Kokkos allocations made
// during the call (Kokkos Tools callbacks), on top of the inputs and outputs. Fences before every timer.
#include <cstdio>

#include "bench_common.hpp"

using namespace kfa_bench;

int main(int argc, char** argv) {
  std::vector<int> ns{512, 1024, 2048, 4096, 8192, 16384}, ds{64, 128};
  int heads = 4, reps = 3, ref_max_n = 16384, gemm_n = 2048;
  bool reference = true, markdown = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "kfa_bench_forward: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--n") ns = parse_list(next());
    else if (a == "--d") ds = parse_list(next());
    else if (a == "--heads") heads = std::stoi(next());
    else if (a == "--reps") reps = std::stoi(next());
    else if (a == "--gemm-n") gemm_n = std::stoi(next());
    else if (a == "--reference-max-n") ref_max_n = std::stoi(next());
    else if (a == "--no-reference") reference = false;
    else if (a == "--markdown") markdown = true;
    else if (a.rfind("--kokkos", 0) == 0) continue;
    else {
      std::fprintf(stderr, "kfa_bench_forward: unknown argument '%s'\n", a.c_str());
      return 2;
    }
  }
  Kokkos::ScopeGuard guard(argc, argv);
  track_memory(true);

  const double ceiling = gemm_ceiling(gemm_n, reps);
  std::printf("# kfa %s, Kokkos %s, backend %s, concurrency %d, float, batch 1, heads %d\n", KFA_VERSION_STRING,
              kfa::compat::kokkos_version_string().c_str(), Exec::name(), Exec().concurrency(), heads);
  std::printf("# GEMM ceiling: KokkosBlas::gemm float %d^3: %.1f GFLOP/s\n", gemm_n, ceiling);
  const char* head = markdown ? "| N | d | causal | tiles | kfa s | kfa GFLOP/s | /GEMM | ref s | ref GFLOP/s | kfa/ref | kfa extra MiB | ref extra MiB |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n"
                              : "%6s %4s %6s %10s %9s %10s %6s %9s %10s %7s %10s %10s\n";
  if (markdown) std::printf("%s", head);
  else std::printf(head, "N", "d", "causal", "tiles", "kfa_s", "kfa_GF/s", "/GEMM", "ref_s", "ref_GF/s", "kfa/ref", "kfa_MiB", "ref_MiB");

  for (int d : ds)
    for (int n : ns)
      for (bool causal : {false, true}) {
        Kokkos::View<float****, Mem> q("bench::q", 1, n, heads, d), k("bench::k", 1, n, heads, d),
            v("bench::v", 1, n, heads, d), o("bench::o", 1, n, heads, d);
        Kokkos::View<float***, Mem> lse("bench::lse", 1, heads, n);
        Kokkos::Random_XorShift64_Pool<Exec> pool(n * 131 + d);
        Kokkos::fill_random(q, pool, -1.0f, 1.0f);
        Kokkos::fill_random(k, pool, -1.0f, 1.0f);
        Kokkos::fill_random(v, pool, -1.0f, 1.0f);
        kfa::AttentionOptions opts;
        opts.causal = causal;
        const double flops = 4.0 * heads * double(n) * n * d * (causal ? 0.5 : 1.0);
        const int r = flops > 2e11 ? 1 : reps;
        kfa::attention_forward(Exec(), q, k, v, o, lse, opts);  // warm-up
        reset_peak();
        const double tk = median_seconds(r, [&] { kfa::attention_forward(Exec(), q, k, v, o, lse, opts); });
        const double mem_k = peak_mib();
        double tr = 0, mem_r = 0;
        if (reference && n <= ref_max_n) {
          reset_peak();
          tr = median_seconds(1, [&] { kfa::reference_attention(Exec(), q, k, v, o, lse, opts); });
          mem_r = peak_mib();
        }
        const std::string tiles = kfa::to_string(kfa::forward_tile_config(Exec(), q, k, opts));
        const double gk = flops / tk * 1e-9, gr = tr > 0 ? flops / tr * 1e-9 : 0;
        if (markdown)
          std::printf("| %d | %d | %s | %s | %.4f | %.1f | %.2f | %.4f | %.1f | %.2f | %.1f | %.1f |\n", n, d,
                      causal ? "yes" : "no", tiles.c_str(), tk, gk, gk / ceiling, tr, gr, tr > 0 ? tr / tk : 0.0, mem_k,
                      mem_r);
        else
          std::printf("%6d %4d %6s %10s %9.4f %10.1f %6.2f %9.4f %10.1f %7.2f %10.1f %10.1f\n", n, d, causal ? "yes" : "no",
                      tiles.c_str(), tk, gk, gk / ceiling, tr, gr, tr > 0 ? tr / tk : 0.0, mem_k, mem_r);
        std::fflush(stdout);
      }
  track_memory(false);
  return 0;
}
