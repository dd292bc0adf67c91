// kfa variable-length example: sequences of different lengths packed without padding into q [total, heads, d]
// (as FlashAttention's varlen functions take them), described by cu_seqlens, run forward and backward in one call
// each; every sequence's output is then checked against the fixed-length call on that sequence alone.
//
//   kfa_example_varlen [--lengths 300,17,0,1000,64] [--heads 4] [--kv-heads 2] [--head-dim 64] [--causal]
#include <Kokkos_Random.hpp>
#include <kfa/kfa.hpp>

#include "cli.hpp"

#include <cmath>
#include <cstdio>
#include <vector>

int main(int argc, char** argv) {
  std::vector<int> lengths{300, 17, 0, 1000, 64};
  int heads = 4, kv_heads = 2, d = 64;
  bool causal = false;
  {
    using namespace kfa_cli;
    CLI::App app{"kfa variable-length example: packed sequences against per-sequence calls", "kfa_example_varlen"};
    app.add_option("--lengths", lengths, "sequence lengths, comma separated (0 allowed)")
        ->delimiter(',')
        ->check(nonnegative_int(1 << 20))
        ->capture_default_str();
    app.add_option("--heads", heads, "query heads")->check(positive_int(256))->capture_default_str();
    app.add_option("--kv-heads", kv_heads, "key/value heads, a divisor of --heads")
        ->check(positive_int(256))
        ->capture_default_str();
    app.add_option("--head-dim", d, "head dim (a multiple of 8, at most 256)")
        ->check(positive_int(256))
        ->capture_default_str();
    app.add_flag("--causal", causal, "causal mask in every sequence");
    const int parsed = parse_command_line(app, argc, argv);
    if (parsed >= 0) return parsed;
    if (heads % kv_heads != 0) {
      std::fprintf(stderr, "kfa_example_varlen: --heads %d is not a multiple of --kv-heads %d\n", heads, kv_heads);
      return 2;
    }
  }
  const bool kokkos_help = kfa_cli::asks_kokkos_help(argc, argv);
  Kokkos::ScopeGuard guard(argc, argv);
  if (kokkos_help) return 0;
  using Exec = Kokkos::DefaultExecutionSpace;
  using Mem = Exec::memory_space;
  using P3 = Kokkos::View<float***, Kokkos::LayoutRight, Mem>;
  try {
    // cu_seqlens: the prefix sums of the lengths (int32, batch + 1 entries), in memory the kernels read.
    std::vector<int> cu(lengths.size() + 1, 0);
    long longest = 0;
    for (std::size_t s = 0; s < lengths.size(); ++s)
      cu[s + 1] = cu[s] + lengths[s], longest = std::max<long>(longest, lengths[s]);
    const int total = cu.back();
    Kokkos::View<int*, Mem> cu_seqlens("cu_seqlens", cu.size());
    auto cu_h = Kokkos::create_mirror_view(cu_seqlens);
    for (std::size_t s = 0; s < cu.size(); ++s) cu_h(s) = cu[s];
    Kokkos::deep_copy(cu_seqlens, cu_h);

    P3 q("q", total, heads, d), k("k", total, kv_heads, d), v("v", total, kv_heads, d), o("o", total, heads, d);
    P3 d_o("do", total, heads, d), dq("dq", total, heads, d), dk("dk", total, kv_heads, d),
        dv("dv", total, kv_heads, d);
    Kokkos::View<float**, Kokkos::LayoutRight, Mem> lse("lse", heads, total);
    Kokkos::Random_XorShift64_Pool<Exec> pool(11);
    for (P3* x : {&q, &k, &v, &d_o}) Kokkos::fill_random(*x, pool, -1.0f, 1.0f);
    kfa::AttentionOptions opts;
    opts.causal = causal;

    // One call for the whole batch, each way (queries and keys share cu_seqlens here: self-attention).
    kfa::attention_forward_varlen(Exec(), q, k, v, o, lse, cu_seqlens, cu_seqlens, longest, longest, opts);
    kfa::attention_backward_varlen(Exec(), q, k, v, o, d_o, lse, dq, dk, dv, cu_seqlens, cu_seqlens, longest, longest,
                                   opts);
    std::printf("%zu sequences, %d tokens, %s: %s\n", lengths.size(), total, Exec::name(),
                kfa::plan_forward_varlen(Exec(), q, k, v, o, opts).region.c_str());

    // Each sequence alone through the fixed-length API: [1, length, heads, d] copies of its rows.
    double worst = 0;
    for (std::size_t s = 0; s < lengths.size(); ++s) {
      const int n = lengths[s];
      if (n == 0) continue;
      const auto rows = std::make_pair(cu[s], cu[s + 1]);
      Kokkos::View<float****, Kokkos::LayoutRight, Mem> qs("qs", 1, n, heads, d), ks("ks", 1, n, kv_heads, d),
          vs("vs", 1, n, kv_heads, d), os("os", 1, n, heads, d);
      Kokkos::View<float***, Kokkos::LayoutRight, Mem> ls("ls", 1, heads, n);
      Kokkos::deep_copy(Kokkos::subview(qs, 0, Kokkos::ALL, Kokkos::ALL, Kokkos::ALL),
                        Kokkos::subview(q, rows, Kokkos::ALL, Kokkos::ALL));
      Kokkos::deep_copy(Kokkos::subview(ks, 0, Kokkos::ALL, Kokkos::ALL, Kokkos::ALL),
                        Kokkos::subview(k, rows, Kokkos::ALL, Kokkos::ALL));
      Kokkos::deep_copy(Kokkos::subview(vs, 0, Kokkos::ALL, Kokkos::ALL, Kokkos::ALL),
                        Kokkos::subview(v, rows, Kokkos::ALL, Kokkos::ALL));
      kfa::attention_forward(Exec(), qs, ks, vs, os, ls, opts);
      double num = 0, den = 0;
      Kokkos::parallel_reduce(
          "compare", Kokkos::MDRangePolicy<Exec, Kokkos::Rank<3>>({0, 0, 0}, {n, heads, d}),
          KOKKOS_LAMBDA(int i, int h, int c, double& e2) {
            const double x = o(rows.first + i, h, c) - os(0, i, h, c);
            e2 += x * x;
          },
          num);
      Kokkos::parallel_reduce(
          "norm", Kokkos::MDRangePolicy<Exec, Kokkos::Rank<3>>({0, 0, 0}, {n, heads, d}),
          KOKKOS_LAMBDA(int i, int h, int c, double& x2) { x2 += double(os(0, i, h, c)) * os(0, i, h, c); }, den);
      const double rel = std::sqrt(num / den);
      worst = std::max(worst, rel);
      std::printf("  sequence %zu: %d tokens, o vs its own call: relative error %.2e\n", s, n, rel);
    }
    if (!(worst <= 1e-5)) {
      std::printf("FAILED: %.2e > 1e-5\n", worst);
      return 1;
    }
    std::printf("ok: every sequence equals its own call (worst %.2e); gradients in dq, dk, dv\n", worst);
  } catch (const kfa::Error& e) {
    std::fprintf(stderr, "kfa_example_varlen: %s\n", e.what());
    return 2;
  }
  return 0;
}
