// Forward+backward benchmark: kfa::attention_forward + attention_backward vs the materialized
// reference_attention + reference_attention_backward, with the KokkosBlas::gemm ceiling of the same run.
//
//   kfa_bench_backward [--n 512,1024,...] [--d 64,128] [--heads H] [--reps R] [--reference-max-n N]
//                      [--markdown]
//
// FLOPs: forward 4·B·H·N²·d (halved for causal), backward 2.5× that (the FlashAttention convention),
// so the backward's two extra recomputed products (S and dP in the dQ pass) are not counted as work.
// Memory: high-water of Kokkos allocations during forward+backward, beyond inputs, outputs and gradients.
#include <cstdio>

#include "bench_common.hpp"

using namespace kfa_bench;

int main(int argc, char** argv) {
  std::vector<int> ns{512, 1024, 2048, 4096, 8192, 16384}, ds{64, 128};
  int heads = 4, reps = 3, ref_max_n = 8192, gemm_n = 2048;
  bool markdown = false;
  std::string layout = "bnhd";
  CLI::App app{
      "kfa forward+backward benchmark: kfa vs the materialized reference, with the KokkosBlas::gemm "
      "ceiling of the same run (Kokkos options: --kokkos-*)",
      "kfa_bench_backward"};
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
  app.add_flag("--markdown", markdown, "print a Markdown table");
  add_layout_option(app, layout);
  const int parsed = parse_command_line(app, argc, argv);
  if (parsed >= 0) return parsed;
  Kokkos::ScopeGuard guard(argc, argv);
  return report_errors("kfa_bench_backward", [&] {
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
    if (markdown)
      std::printf(
          "| N | d | causal | bwd tiles | kfa fwd s | kfa bwd s | bwd GFLOP/s | bwd /GEMM | bwd /peak | fwd+bwd "
          "GFLOP/s | ref bwd s | bwd kfa/ref | fwd+bwd kfa/ref | kfa extra MiB | ref extra MiB |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    else
      std::printf("%6s %4s %6s %28s %9s %9s %8s %6s %6s %9s %9s %7s %7s %8s %8s\n", "N", "d", "causal", "bwd_tiles",
                  "fwd_s", "bwd_s", "bwd_GF/s", "/GEMM", "/peak", "f+b_GF/s", "ref_bwd_s", "bwd_x", "f+b_x", "kfa_MiB",
                  "ref_MiB");
    for (int d : ds)
      for (int n : ns)
        for (bool causal : {false, true}) {
          auto run = [&](auto make) {
            using V4 = decltype(make(""));
            V4 q = make("bench::q"), k = make("bench::k"), v = make("bench::v"), o = make("bench::o"),
               d_o = make("bench::do"), dq = make("bench::dq"), dk = make("bench::dk"), dv = make("bench::dv");
            Kokkos::View<float***, Mem> lse("bench::lse", 1, heads, n);
            Kokkos::Random_XorShift64_Pool<Exec> pool(n * 131 + d);
            for (const V4* x : {&q, &k, &v, &d_o}) Kokkos::fill_random(*x, pool, -1.0f, 1.0f);
            kfa::AttentionOptions opts;
            opts.causal = causal;
            const double fwd_flops = 4.0 * heads * double(n) * n * d * (causal ? 0.5 : 1.0),
                         bwd_flops = 2.5 * fwd_flops;
            const int r = bwd_flops > 4e11 ? 1 : reps;
            kfa::attention_forward(Exec(), q, k, v, o, lse, opts);  // warm-up (and o, lse for the backward)
            kfa::attention_backward(Exec(), q, k, v, o, d_o, lse, dq, dk, dv, opts);
            reset_peak();
            const double tf = median_seconds(r, [&] { kfa::attention_forward(Exec(), q, k, v, o, lse, opts); });
            const double tb =
                median_seconds(r, [&] { kfa::attention_backward(Exec(), q, k, v, o, d_o, lse, dq, dk, dv, opts); });
            const double mem_k = peak_mib();
            double trf = 0, trb = 0, mem_r = 0;
#if KFA_HAVE_KOKKOS_KERNELS  // the materialized reference needs Kokkos Kernels
            if (n <= ref_max_n) {
              reset_peak();
              trf = median_seconds(1, [&] { kfa::reference_attention(Exec(), q, k, v, o, lse, opts); });
              trb = median_seconds(
                  1, [&] { kfa::reference_attention_backward(Exec(), q, k, v, o, d_o, lse, dq, dk, dv, opts); });
              mem_r = peak_mib();
            }
#endif
            const std::string tiles = kfa::to_string(kfa::backward_tile_config(Exec(), q, k, opts));
            const double gb = bwd_flops / tb * 1e-9, gfb = (fwd_flops + bwd_flops) / (tf + tb) * 1e-9;
            const double xb = trb > 0 ? trb / tb : 0, xfb = trb > 0 ? (trf + trb) / (tf + tb) : 0;
            const double pb = peak > 0 ? gb / peak : 0;
            if (markdown)
              std::printf(
                  "| %d | %d | %s | %s | %.4f | %.4f | %.1f | %.2f | %.2f | %.1f | %.4f | %.2f | %.2f | %.1f | %.1f "
                  "|\n",
                  n, d, causal ? "yes" : "no", tiles.c_str(), tf, tb, gb, (ceiling > 0 ? gb / ceiling : 0.0), pb, gfb,
                  trb, xb, xfb, mem_k, mem_r);
            else
              std::printf("%6d %4d %6s %28s %9.4f %9.4f %8.1f %6.2f %6.2f %9.1f %9.4f %7.2f %7.2f %8.1f %8.1f\n", n, d,
                          causal ? "yes" : "no", tiles.c_str(), tf, tb, gb, (ceiling > 0 ? gb / ceiling : 0.0), pb, gfb,
                          trb, xb, xfb, mem_k, mem_r);
            std::fflush(stdout);
          };
          if (layout == "bhnd")
            run([&](const char* label) { return per_head_tensor(label, n, heads, d); });
          else
            run([&](const char* label) { return Kokkos::View<float****, Mem>(std::string(label), 1, n, heads, d); });
        }
    track_memory(false);
    return 0;
  });
}
