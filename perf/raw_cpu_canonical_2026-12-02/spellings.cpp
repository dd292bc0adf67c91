// Scratch (not committed): attention_forward + attention_backward with eight View spellings of the same data.
#include <kfa/kfa.hpp>
#include <cstdio>
using Mem = Kokkos::DefaultExecutionSpace::memory_space;
using Dev = Kokkos::Device<Kokkos::DefaultExecutionSpace, Mem>;
template <class T> using R = Kokkos::View<T****, Kokkos::LayoutRight, Mem>;
template <class T> using RC = Kokkos::View<const T****, Kokkos::LayoutRight, Mem>;
template <class T> using RD = Kokkos::View<T****, Kokkos::LayoutRight, Dev>;
template <class T> using RU = Kokkos::View<T****, Kokkos::LayoutRight, Mem, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
template <class T> using S = Kokkos::View<T****, Kokkos::LayoutStride, Mem>;
template <class T> using L3 = Kokkos::View<T***, Kokkos::LayoutRight, Mem>;
template <class T> using L3D = Kokkos::View<T***, Kokkos::LayoutRight, Dev>;

template <class T, class QV, class KV, class VV, class OV, class LV>
void both(const QV& q, const KV& k, const VV& v, const OV& o, const LV& lse, const R<T>& dq, const R<T>& dk, const R<T>& dv) {
  Kokkos::DefaultExecutionSpace space;
  kfa::attention_forward(space, q, k, v, o, lse);
  kfa::attention_backward(space, q, k, v, o, o, lse, dq, dk, dv);
}
template <class T>
void run() {
  const int b = 1, n = 200, h = 2, d = 64;
  R<T> q("q", b, n, h, d), k("k", b, n, h, d), v("v", b, n, h, d), o("o", b, n, h, d), dq("dq", b, n, h, d), dk("dk", b, n, h, d), dv("dv", b, n, h, d);
  Kokkos::deep_copy(q, T(0.5)); Kokkos::deep_copy(k, T(0.25)); Kokkos::deep_copy(v, T(1));
  L3<kfa::accumulator_t<T>> lse("lse", b, h, n);
  L3D<kfa::accumulator_t<T>> lsed = lse;
  RC<T> qc = q, kc = k, vc = v;
  RD<T> qd = q, od = o;
  RU<T> ou(o.data(), b, n, h, d);
  S<T> qs = q, os = o;
  both<T>(q, k, v, o, lse, dq, dk, dv);
  both<T>(qc, kc, vc, o, lse, dq, dk, dv);
  both<T>(qd, k, v, od, lsed, dq, dk, dv);
  both<T>(q, kc, v, ou, lse, dq, dk, dv);
  both<T>(qs, k, v, o, lse, dq, dk, dv);
  both<T>(q, k, v, os, lse, dq, dk, dv);
  both<T>(qs, kc, vc, os, lsed, dq, dk, dv);
  both<T>(qd, kc, v, ou, lse, dq, dk, dv);
}
int main(int argc, char** argv) {
  Kokkos::ScopeGuard g(argc, argv);
  run<float>();
  run<double>();
  std::printf("ok\n");
}
