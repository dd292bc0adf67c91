// Scratch (not committed): forward and backward time with all-LayoutRight Views vs the same data with q (and dq)
// passed as LayoutStride (a mixed call), interleaved in one process; median of 5 per spelling.
#include <kfa/kfa.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>
using Mem = Kokkos::DefaultExecutionSpace::memory_space;
template <class T> using R = Kokkos::View<T****, Kokkos::LayoutRight, Mem>;
template <class T> using S = Kokkos::View<T****, Kokkos::LayoutStride, Mem>;
template <class T>
void run(int n, int h, int d) {
  const int b = 1;
  R<T> q("q", b, n, h, d), k("k", b, n, h, d), v("v", b, n, h, d), o("o", b, n, h, d), dq("dq", b, n, h, d), dk("dk", b, n, h, d), dv("dv", b, n, h, d);
  auto fill = [](const R<T>& x, int seed) { auto hh = Kokkos::create_mirror_view(x); std::mt19937 g(seed); std::normal_distribution<double> nd;
    for (size_t i = 0; i < x.size(); ++i) hh.data()[i] = T(nd(g)); Kokkos::deep_copy(x, hh); };
  fill(q, 1), fill(k, 2), fill(v, 3);
  Kokkos::View<kfa::accumulator_t<T>***, Kokkos::LayoutRight, Mem> lse("lse", b, h, n);
  S<T> qs = q, dqs = dq;
  Kokkos::DefaultExecutionSpace sp;
  auto t = [&](auto&& f) { auto a = std::chrono::steady_clock::now(); f(); sp.fence(); return std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count(); };
  std::vector<double> fr, fs, br, bs;
  for (int rep = 0; rep < 5; ++rep) {
    fr.push_back(t([&] { kfa::attention_forward(sp, q, k, v, o, lse); }));
    fs.push_back(t([&] { kfa::attention_forward(sp, qs, k, v, o, lse); }));
    br.push_back(t([&] { kfa::attention_backward(sp, q, k, v, o, o, lse, dq, dk, dv); }));
    bs.push_back(t([&] { kfa::attention_backward(sp, qs, k, v, o, o, lse, dqs, dk, dv); }));
  }
  auto med = [](std::vector<double> x) { std::sort(x.begin(), x.end()); return x[x.size() / 2]; };
  std::printf("%s n=%d h=%d d=%d  fwd right %.4f s, q strided %.4f s (x%.3f)  bwd right %.4f s, q,dq strided %.4f s (x%.3f)\n",
              kfa::dtype_name<T>().c_str(), n, h, d, med(fr), med(fs), med(fs) / med(fr), med(br), med(bs), med(bs) / med(br));
}
int main(int argc, char** argv) {
  Kokkos::ScopeGuard g(argc, argv);
  run<float>(2048, 4, 64);
  run<float>(2048, 2, 128);
  run<double>(1024, 4, 64);
}
