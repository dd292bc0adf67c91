// A consumer TU: attention_forward + attention_backward for bfloat16 through an installed kfa, no flags of its own.
#include <kfa/kfa.hpp>
#include <cstdio>
int main(int argc, char** argv) {
  Kokkos::ScopeGuard guard(argc, argv);
  using T = Kokkos::Experimental::bhalf_t;
  const int b = 2, n = 2048, h = 8, d = 128;
  Kokkos::View<T****, Kokkos::LayoutRight> q("q", b, n, h, d), k("k", b, n, h, d), v("v", b, n, h, d), o("o", b, n, h, d);
  Kokkos::View<T****, Kokkos::LayoutRight> dq("dq", b, n, h, d), dk("dk", b, n, h, d), dv("dv", b, n, h, d), d_o("do", b, n, h, d);
  Kokkos::View<float***, Kokkos::LayoutRight> lse("lse", b, h, n);
  Kokkos::deep_copy(q, T(0.5f)), Kokkos::deep_copy(k, T(0.25f)), Kokkos::deep_copy(v, T(1.0f));
  Kokkos::deep_copy(d_o, T(1.0f));
  kfa::AttentionOptions opts;
  const auto space = Kokkos::DefaultExecutionSpace();
  std::printf("forward plan: %s\n", kfa::plan_forward(space, q, k, v, o, opts).region.c_str());
  std::printf("backward plan: %s\n", kfa::plan_backward(space, q, k, v, d_o, dq, dk, dv, opts).region.c_str());
  kfa::attention_forward(space, q, k, v, o, lse, opts);
  kfa::attention_backward(space, q, k, v, o, d_o, lse, dq, dk, dv, opts);
  space.fence();
  auto oh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), o);
  std::printf("o(0,0,0,0) = %f (want 1)\n", static_cast<float>(oh(0, 0, 0, 0)));
  return 0;
}
