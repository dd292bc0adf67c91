// Smallest program against an installed kfa: one forward, one value checked by hand.
#include <kfa/kfa.hpp>

#include <cstdio>
#include <cstdlib>
#include <cstring>

int main(int argc, char** argv) {
  bool kokkos_help = false;
  for (int i = 1; i < argc; ++i) {  // no options of its own but --help; Kokkos' --kokkos-* pass through
    if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) {
      std::printf(
          "kfa_consumer: one forward through an installed kfa, one value checked by hand\n"
          "Usage: kfa_consumer [--kokkos-*] (Kokkos' options: --kokkos-help)\n");
      return 0;
    }
    if (std::strncmp(argv[i], "--kokkos-", 9) != 0) {
      std::fprintf(stderr, "kfa_consumer: unknown argument '%s'\nRun with --help for the options.\n", argv[i]);
      return 2;
    }
    kokkos_help = kokkos_help || std::strcmp(argv[i], "--kokkos-help") == 0;
  }
  Kokkos::ScopeGuard guard(argc, argv);
  if (kokkos_help) return 0;  // Kokkos printed its options; nothing runs
  // One query, two keys with scores 0 and log 3 (scale 1): weights 1/4 and 3/4.
  Kokkos::View<double****> q("q", 1, 1, 1, 8), k("k", 1, 2, 1, 8), v("v", 1, 2, 1, 8), o("o", 1, 1, 1, 8);
  Kokkos::View<double***> lse("lse", 1, 1, 1);
  auto qh = Kokkos::create_mirror_view(q);
  auto kh = Kokkos::create_mirror_view(k);
  auto vh = Kokkos::create_mirror_view(v);
  Kokkos::deep_copy(qh, 0.0), Kokkos::deep_copy(kh, 0.0);
  qh(0, 0, 0, 0) = 1.0;
  kh(0, 1, 0, 0) = std::log(3.0);
  for (int c = 0; c < 8; ++c) vh(0, 0, 0, c) = 4.0, vh(0, 1, 0, c) = 8.0;
  Kokkos::deep_copy(q, qh), Kokkos::deep_copy(k, kh), Kokkos::deep_copy(v, vh);
  kfa::AttentionOptions opts;
  opts.softmax_scale = 1.0;
  kfa::attention_forward(Kokkos::DefaultExecutionSpace(), q, k, v, o, lse, opts);
  auto oh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), o);
  auto lh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), lse);
  bool ok = std::abs(oh(0, 0, 0, 3) - 7.0) < 1e-12 && std::abs(lh(0, 0, 0) - std::log(4.0)) < 1e-12;
  // Built with the consumer's flags (no -march here): the host kernels must still dispatch to the widest
  // ISA this x86-64 CPU has, unless KFA_HOST_ISA caps it.
  std::printf("host SIMD: compiled for %s, running %s\n", kfa::to_string(kfa::detail::compiled_host_isa),
              kfa::to_string(kfa::host_isa()));
#if defined(__x86_64__) && defined(__GNUC__)
  if (!std::getenv("KFA_HOST_ISA") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      static_cast<int>(kfa::host_isa()) < static_cast<int>(kfa::HostIsa::avx2)) {
    std::printf("FAIL: this CPU has AVX2+FMA but the kernels run %s\n", kfa::to_string(kfa::host_isa()));
    ok = false;
  }
#endif
  std::printf("kfa %s installed package: o = %.15f (want 7), lse = %.15f (want log 4): %s\n", KFA_VERSION_STRING,
              oh(0, 0, 0, 3), lh(0, 0, 0), ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}
