// Forward benchmark: kfa::attention_forward vs the materialized kfa::reference_attention, with the
// KokkosBlas::gemm rate of the same backend and thread count measured in the same run as the ceiling.
//
//   kfa_bench_forward [--n 512,1024,...] [--d 64,128] [--heads H] [--reps R] [--no-reference]
//                     [--reference-max-n N] [--markdown]
//   kfa_bench_forward --guard [--guard-ratio 5]
//
// --guard: a ratio in one run, not a timed test. kfa's forward at N=2048, d=128 (1 head, float) against a
// plain scalar triple-loop attention of the same shapes (compiled without vectorization) timed in the same
// process; exits 1 when kfa is not at least --guard-ratio times faster, or when the two disagree.
//
// GFLOP/s count 4·B·H·N²·d (halved for causal). Memory is the high-water of Kokkos allocations made
// during the call (Kokkos Tools callbacks), on top of the inputs and outputs. Fences before every timer.
#include <cmath>
#include <cstdio>

#include "bench_common.hpp"

using namespace kfa_bench;

// Plain scalar attention, one query row at a time (scores, softmax, weighted sum): the yardstick of --guard.
// No vectorization, so its speed depends only on the CPU's scalar throughput, not on the build's -march.
__attribute__((optimize("no-tree-vectorize"), noinline)) void scalar_attention(const float* q, const float* k,
                                                                               const float* v, float* o, int n, int d) {
  std::vector<float> s(n);
  const float scale = 1.0f / std::sqrt(float(d));
  for (int i = 0; i < n; ++i) {
    float m = -INFINITY;
    for (int j = 0; j < n; ++j) {
      float acc = 0;
      for (int c = 0; c < d; ++c) acc += q[i * d + c] * k[j * d + c];
      s[j] = acc * scale;
      m = s[j] > m ? s[j] : m;
    }
    float l = 0;
    for (int j = 0; j < n; ++j) l += (s[j] = std::exp(s[j] - m));
    for (int c = 0; c < d; ++c) o[i * d + c] = 0;
    for (int j = 0; j < n; ++j)
      for (int c = 0; c < d; ++c) o[i * d + c] += s[j] * v[j * d + c];
    for (int c = 0; c < d; ++c) o[i * d + c] /= l;
  }
}

int guard(double min_ratio) {
  const int n = 2048, d = 128;
  Kokkos::View<float****, Kokkos::HostSpace> q("guard::q", 1, n, 1, d), k("guard::k", 1, n, 1, d),
      v("guard::v", 1, n, 1, d), o("guard::o", 1, n, 1, d), o_ref("guard::o_ref", 1, n, 1, d);
  Kokkos::View<float***, Kokkos::HostSpace> lse("guard::lse", 1, 1, n);
  Kokkos::Random_XorShift64_Pool<Kokkos::DefaultHostExecutionSpace> pool(2048);
  Kokkos::fill_random(q, pool, -1.0f, 1.0f);
  Kokkos::fill_random(k, pool, -1.0f, 1.0f);
  Kokkos::fill_random(v, pool, -1.0f, 1.0f);
  auto qd = Kokkos::create_mirror_view_and_copy(Mem(), q);
  auto kd = Kokkos::create_mirror_view_and_copy(Mem(), k);
  auto vd = Kokkos::create_mirror_view_and_copy(Mem(), v);
  Kokkos::View<float****, Mem> od("guard::od", 1, n, 1, d);
  Kokkos::View<float***, Mem> lsed("guard::lsed", 1, 1, n);
  Kokkos::deep_copy(od, std::nanf(""));                  // poisoned: every element must be written
  kfa::attention_forward(Exec(), qd, kd, vd, od, lsed);  // warm-up
  const double t_kfa = median_seconds(5, [&] { kfa::attention_forward(Exec(), qd, kd, vd, od, lsed); });
  const auto t0 = std::chrono::steady_clock::now();
  scalar_attention(q.data(), k.data(), v.data(), o_ref.data(), n, d);
  const double t_scalar = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  Kokkos::deep_copy(o, od);
  double worst = 0;
  for (std::size_t i = 0; i < o.size(); ++i) {
    const double e = std::abs(double(o.data()[i]) - double(o_ref.data()[i]));
    worst = std::isfinite(e) ? std::max(worst, e) : INFINITY;
  }
  const double ratio = t_scalar / t_kfa;
  const double flops = 4.0 * n * double(n) * d;
  std::printf("# guard: N=%d d=%d float, 1 head; %s; backend %s\n", n, d, host_simd_line().c_str(), Exec::name());
  std::printf(
      "# guard: kfa %.4f s (%.1f GFLOP/s), scalar triple loop %.4f s (%.2f GFLOP/s): kfa %.1fx faster "
      "(required %.1fx); max |o - o_scalar| = %.2e\n",
      t_kfa, flops / t_kfa * 1e-9, t_scalar, flops / t_scalar * 1e-9, ratio, min_ratio, worst);
  if (!(worst < 1e-4)) {
    std::printf("GUARD FAIL: kfa and the scalar loop disagree (%.2e)\n", worst);
    return 1;
  }
  if (ratio < min_ratio) {
    std::printf("GUARD FAIL: kfa's forward is only %.1fx the scalar triple loop (need %.1fx)\n", ratio, min_ratio);
    return 1;
  }
  std::printf("GUARD PASS\n");
  return 0;
}

int main(int argc, char** argv) {
  std::vector<int> ns{512, 1024, 2048, 4096, 8192, 16384}, ds{64, 128};
  int heads = 4, reps = 3, ref_max_n = 16384, gemm_n = 2048;
  bool no_reference = false, markdown = false, run_guard = false;
  std::string layout = "bnhd";
  double guard_ratio = 5.0;
  CLI::App app{
      "kfa forward benchmark: kfa::attention_forward vs the materialized reference, with the "
      "KokkosBlas::gemm ceiling of the same run (Kokkos options: --kokkos-*)",
      "kfa_bench_forward"};
  app.add_option("--n", ns, "sequence lengths, comma separated")
      ->delimiter(',')
      ->check(positive_int())
      ->capture_default_str();
  app.add_option("--d", ds, "head dims, comma separated")
      ->delimiter(',')
      ->check(positive_int(1024))
      ->capture_default_str();
  app.add_option("--heads", heads, "heads")->check(positive_int())->capture_default_str();
  app.add_option("--reps", reps, "timed repetitions (median)")->check(positive_int())->capture_default_str();
  app.add_option("--gemm-n", gemm_n, "size of the GEMM ceiling's square matrices")
      ->check(positive_int(65536))
      ->capture_default_str();
  app.add_option("--reference-max-n", ref_max_n, "largest N timed with the reference (0: none)")
      ->check(nonnegative_int())
      ->capture_default_str();
  app.add_flag("--no-reference", no_reference, "do not time the reference");
  app.add_flag("--markdown", markdown, "print a Markdown table");
  add_layout_option(app, layout);
  app.add_flag("--guard", run_guard,
               "the speed guard: kfa vs a scalar triple loop at N=2048, d=128; exit 1 when too slow");
  app.add_option("--guard-ratio", guard_ratio, "speed-up --guard requires")
      ->check(positive_real())
      ->capture_default_str();
  const int parsed = parse_command_line(app, argc, argv);
  if (parsed >= 0) return parsed;
  const bool reference = !no_reference;
  Kokkos::ScopeGuard kokkos(argc, argv);
  if (run_guard) return report_errors("kfa_bench_forward", [&] { return guard(guard_ratio); });
  return report_errors("kfa_bench_forward", [&] {
    track_memory(true);

    const double ceiling = gemm_ceiling(gemm_n, reps);
    std::printf("# kfa %s, Kokkos %s, backend %s, concurrency %d, float, batch 1, heads %d, layout %s\n",
                KFA_VERSION_STRING, kfa::compat::kokkos_version_string().c_str(), Exec::name(), Exec().concurrency(),
                heads, layout.c_str());
    if (ceiling > 0)
      std::printf("# GEMM ceiling: KokkosBlas::gemm float %d^3: %.1f GFLOP/s (BLAS: %s)\n", gemm_n, ceiling,
                  loaded_blas().c_str());
    else
      std::printf("# GEMM ceiling: none (built without Kokkos Kernels; no reference either)\n");
    std::printf("# host SIMD: %s\n", host_simd_line().c_str());
    const double peak = fma_peak_gflops() * Exec().concurrency();
    std::printf("# FP32 FMA peak: %.1f GFLOP/s (one core at the running ISA, measured, times concurrency %d)\n", peak,
                Exec().concurrency());
    const char* head =
        markdown ? "| N | d | causal | tiles | kfa s | kfa GFLOP/s | /GEMM | /peak | ref s | ref GFLOP/s | kfa/ref | "
                   "kfa extra MiB | ref extra MiB |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
                 : "%6s %4s %6s %10s %9s %10s %6s %6s %9s %10s %7s %10s %10s\n";
    if (markdown)
      std::printf("%s", head);
    else
      std::printf(head, "N", "d", "causal", "tiles", "kfa_s", "kfa_GF/s", "/GEMM", "/peak", "ref_s", "ref_GF/s",
                  "kfa/ref", "kfa_MiB", "ref_MiB");

    for (int d : ds)
      for (int n : ns)
        for (bool causal : {false, true}) {
          auto run = [&](auto q, auto k, auto v, auto o) {
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
#if KFA_HAVE_KOKKOS_KERNELS  // the materialized reference needs Kokkos Kernels
            if (reference && n <= ref_max_n) {
              reset_peak();
              tr = median_seconds(1, [&] { kfa::reference_attention(Exec(), q, k, v, o, lse, opts); });
              mem_r = peak_mib();
            }
#endif
            const std::string tiles = kfa::to_string(kfa::forward_tile_config(Exec(), q, k, opts));
            const double gk = flops / tk * 1e-9, gr = tr > 0 ? flops / tr * 1e-9 : 0;
            if (markdown)
              std::printf("| %d | %d | %s | %s | %.4f | %.1f | %.2f | %.2f | %.4f | %.1f | %.2f | %.1f | %.1f |\n", n,
                          d, causal ? "yes" : "no", tiles.c_str(), tk, gk, (ceiling > 0 ? gk / ceiling : 0.0),
                          peak > 0 ? gk / peak : 0.0, tr, gr, tr > 0 ? tr / tk : 0.0, mem_k, mem_r);
            else
              std::printf("%6d %4d %6s %10s %9.4f %10.1f %6.2f %6.2f %9.4f %10.1f %7.2f %10.1f %10.1f\n", n, d,
                          causal ? "yes" : "no", tiles.c_str(), tk, gk, (ceiling > 0 ? gk / ceiling : 0.0),
                          peak > 0 ? gk / peak : 0.0, tr, gr, tr > 0 ? tr / tk : 0.0, mem_k, mem_r);
            std::fflush(stdout);
          };
          if (layout == "bhnd")
            run(per_head_tensor("bench::q", n, heads, d), per_head_tensor("bench::k", n, heads, d),
                per_head_tensor("bench::v", n, heads, d), per_head_tensor("bench::o", n, heads, d));
          else
            run(Kokkos::View<float****, Mem>("bench::q", 1, n, heads, d),
                Kokkos::View<float****, Mem>("bench::k", 1, n, heads, d),
                Kokkos::View<float****, Mem>("bench::v", 1, n, heads, d),
                Kokkos::View<float****, Mem>("bench::o", 1, n, heads, d));
        }
    track_memory(false);
    return 0;
  });
}
