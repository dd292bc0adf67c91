// Sources that must not compile; tests/CMakeLists.txt builds each case and expects the static_assert text.
#include <kfa/kfa.hpp>

int main() {
  using Mem = Kokkos::DefaultExecutionSpace::memory_space;
  Kokkos::View<float****, Mem> q("q", 1, 8, 1, 8), k("k", 1, 8, 1, 8), v("v", 1, 8, 1, 8), o("o", 1, 8, 1, 8);
  Kokkos::View<float***, Mem> lse("lse", 1, 1, 8);
#if defined(KFA_CASE_RANK)
  Kokkos::View<float***, Mem> q3("q3", 8, 1, 8);
  kfa::attention_forward(Kokkos::DefaultExecutionSpace(), q3, k, v, o, lse);
#elif defined(KFA_CASE_CONST_OUTPUT)
  Kokkos::View<const float****, Mem> oc = o;
  kfa::attention_forward(Kokkos::DefaultExecutionSpace(), q, k, v, oc, lse);
#elif defined(KFA_CASE_ELEMENT_MISMATCH)
  Kokkos::View<double****, Mem> kd("kd", 1, 8, 1, 8);
  kfa::attention_forward(Kokkos::DefaultExecutionSpace(), q, kd, v, o, lse);
#elif defined(KFA_CASE_MEMORY_SPACE)
  Kokkos::View<float****, Kokkos::HostSpace> qh("qh", 1, 8, 1, 8);
  kfa::attention_forward(Kokkos::DefaultExecutionSpace(), qh, k, v, o, lse);
#endif
  return 0;
}
