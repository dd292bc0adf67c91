// kfa backward example: gradients of L = sum(O * dO) for a small causal GQA problem, checked against
// central finite differences of the forward in double precision.
//
//   kfa_example_backward          (no options but --help and Kokkos' own --kokkos-*, listed by --kokkos-help)
#include <Kokkos_Random.hpp>
#include <kfa/kfa.hpp>

#include "cli.hpp"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

int main(int argc, char** argv) {
  {  // --help prints and exits; anything but Kokkos' own --kokkos-* options is refused (exit 2)
    CLI::App app{
        "kfa backward example: gradients of a small causal GQA problem checked against central finite "
        "differences (no options; Kokkos' options --kokkos-*: --kokkos-help)",
        "kfa_example_backward"};
    const int parsed = kfa_cli::parse_command_line(app, argc, argv);
    if (parsed >= 0) return parsed;
  }
  const bool kokkos_help = kfa_cli::asks_kokkos_help(argc, argv);
  Kokkos::ScopeGuard guard(argc, argv);
  if (kokkos_help) return 0;  // Kokkos printed its options; nothing runs
  using Exec = Kokkos::DefaultExecutionSpace;
  using V4 = Kokkos::View<double****, Exec::memory_space>;
  // q [1, 12, 4, 16]; k, v [1, 12, 2, 16]: two query heads share each key/value head (GQA).
  V4 q("q", 1, 12, 4, 16), k("k", 1, 12, 2, 16), v("v", 1, 12, 2, 16), o("o", 1, 12, 4, 16), d_o("do", 1, 12, 4, 16);
  V4 dq("dq", 1, 12, 4, 16), dk("dk", 1, 12, 2, 16), dv("dv", 1, 12, 2, 16);
  Kokkos::View<double***, Exec::memory_space> lse("lse", 1, 4, 12);
  Kokkos::Random_XorShift64_Pool<Exec> pool(7);
  for (V4* x : {&q, &k, &v, &d_o}) Kokkos::fill_random(*x, pool, -1.0, 1.0);
  kfa::AttentionOptions opts;
  opts.causal = true;

  // Forward saves o and lse; the backward recomputes the scores from them (no N x N matrix is kept).
  kfa::attention_forward(Exec(), q, k, v, o, lse, opts);
  kfa::attention_backward(Exec(), q, k, v, o, d_o, lse, dq, dk, dv, opts);

  // Finite differences of L(k) = sum(O * dO) for every element of k.
  auto loss = [&]() {
    kfa::attention_forward(Exec(), q, k, v, o, lse, opts);
    double l = 0;
    Kokkos::parallel_reduce(
        "loss", Kokkos::MDRangePolicy<Exec, Kokkos::Rank<4>>({0, 0, 0, 0}, {1, 12, 4, 16}),
        KOKKOS_LAMBDA(int a, int b, int c, int d, double& s) { s += o(a, b, c, d) * d_o(a, b, c, d); }, l);
    return l;
  };
  auto kh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), k);
  auto dkh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), dk);
  double num = 0, den = 0;
  const double h = 1e-6;
  for (int j = 0; j < 12; ++j)
    for (int g = 0; g < 2; ++g)
      for (int c = 0; c < 16; ++c) {
        const double x0 = kh(0, j, g, c);
        kh(0, j, g, c) = x0 + h, Kokkos::deep_copy(k, kh);
        const double lp = loss();
        kh(0, j, g, c) = x0 - h, Kokkos::deep_copy(k, kh);
        const double lm = loss();
        kh(0, j, g, c) = x0, Kokkos::deep_copy(k, kh);
        const double fd = (lp - lm) / (2 * h);
        num += (dkh(0, j, g, c) - fd) * (dkh(0, j, g, c) - fd), den += fd * fd;
      }
  const double rel = std::sqrt(num / den);
  std::printf("kfa backward: dk vs central finite differences, relative error %.2e (tolerance 1e-7): %s\n", rel,
              rel <= 1e-7 ? "PASS" : "FAIL");
  return rel <= 1e-7 ? 0 : 1;
}
