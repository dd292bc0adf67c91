// One translation unit that instantiates every CUDA kernel of kfa's forward and backward for the 16-bit
// types and float (LayoutRight), for perf/ptxas_matrix.sh: compiled per GPU architecture with
// `-Xptxas -v`, its log says each kernel's registers and spills. Not part of the build.
#include <kfa/kfa.hpp>

template <class T>
void instantiate(const kfa::AttentionOptions& opts) {
  using V4 = Kokkos::View<T****, Kokkos::LayoutRight, Kokkos::CudaSpace>;
  using L3 = Kokkos::View<float***, Kokkos::LayoutRight, Kokkos::CudaSpace>;
  V4 q, k, v, o, d_o, dq, dk, dv;
  L3 lse;
  kfa::attention_forward(Kokkos::Cuda(), q, k, v, o, lse, opts);
  kfa::attention_backward(Kokkos::Cuda(), q, k, v, o, d_o, lse, dq, dk, dv, opts);
}

template void instantiate<Kokkos::Experimental::bhalf_t>(const kfa::AttentionOptions&);
template void instantiate<Kokkos::Experimental::half_t>(const kfa::AttentionOptions&);
template void instantiate<float>(const kfa::AttentionOptions&);
