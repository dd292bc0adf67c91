#pragma once
/// detail/instances.hpp: the kernels compiled once, into the kfa_core library (KFA_PRECOMPILED_KERNELS), as Kokkos
/// Kernels' ETI does. Every call reaches the kernels through detail/dispatch.hpp on canonical Views (one layout per
/// call: LayoutRight or LayoutStride), so a small set of dispatch.hpp's templates covers what callers pass:
///  - execution space: Kokkos::DefaultExecutionSpace, and with a GPU backend (KFA_PRECOMPILED_GPU) also
///    Kokkos::DefaultHostExecutionSpace (double and float there);
///  - element type: double, float, and with a GPU backend half and bfloat16 (where Kokkos has them);
///  - layout: LayoutRight and LayoutStride, Views in the space's default memory space;
///  - direction: the forward (forward_plan, forward_run) and the backward (backward_plan, backward_run,
///    row_dot_run); for half and bfloat16 also the ring's partials (strided, o and the gradients in float).
/// Each (space, element type, direction, layout or the ring's partials) is one translation unit, written by
/// src/CMakeLists.txt from src/instances/unit.cpp.in with the unit macros below; declared here `extern template`, so a
/// caller's translation unit links those kernels instead of compiling them. Anything outside the set (another memory
/// space, a View with static extents, another execution space) compiles from the headers as before, and so does
/// everything with KFA_PRECOMPILED_KERNELS=OFF.
#include <kfa/config.hpp>
#include <kfa/detail/dispatch.hpp>
#include <kfa/types.hpp>

namespace kfa {
namespace detail {
namespace instances {

template <class S, class T, class L>
using in4 = Kokkos::View<const T****, L, typename S::memory_space, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
template <class S, class T, class L>
using out4 = Kokkos::View<T****, L, typename S::memory_space, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
template <class S, class T, class L>
using in3 =
    Kokkos::View<const accumulator_t<T>***, L, typename S::memory_space, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
template <class S, class T, class L>
using out3 = Kokkos::View<accumulator_t<T>***, L, typename S::memory_space, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
/// The forward's call on element type T, its output o in OT (T, or float for the ring's partials).
template <class S, class T, class L, class OT>
using forward_call = ForwardCall<S, in4<S, T, L>, in4<S, T, L>, in4<S, T, L>, out4<S, OT, L>>;
/// The backward's call on element type T, its gradients in GT (T, or float for the ring's partials).
template <class S, class T, class L, class GT>
using backward_call = BackwardCall<S, in4<S, T, L>, in4<S, T, L>, in4<S, T, L>, in4<S, T, L>, out4<S, GT, L>,
                                   out4<S, GT, L>, out4<S, GT, L>>;

}  // namespace instances
}  // namespace detail
}  // namespace kfa

// EXTERN is `extern` for the declarations below and empty in src/instances/ (the definitions).
#define KFA_INSTANCE_FORWARD(EXTERN, S, T, L, OT)                                                         \
  EXTERN template kfa::ForwardPlan kfa::detail::forward_plan(                                             \
      const char*, const kfa::detail::instances::forward_call<S, T, L, OT>&);                             \
  EXTERN template void kfa::detail::forward_run(const kfa::detail::instances::forward_call<S, T, L, OT>&, \
                                                const kfa::detail::instances::out3<S, T, L>&,             \
                                                const kfa::detail::Positions&);
#define KFA_INSTANCE_BACKWARD(EXTERN, S, T, L, GT)                                                            \
  EXTERN template kfa::BackwardPlan kfa::detail::backward_plan(                                               \
      const char*, const kfa::detail::instances::backward_call<S, T, L, GT>&);                                \
  EXTERN template bool kfa::detail::backward_run(                                                             \
      const kfa::detail::instances::backward_call<S, T, L, GT>&, const kfa::detail::instances::in3<S, T, L>&, \
      const kfa::detail::instances::in3<S, T, L>&, const kfa::detail::Positions&, kfa::detail::BackwardParts);
#define KFA_INSTANCE_ROW_DOT(EXTERN, S, T, L)                                                           \
  EXTERN template Kokkos::View<kfa::accumulator_t<T>***, Kokkos::LayoutRight, typename S::memory_space> \
  kfa::detail::row_dot_run(const S&, const kfa::detail::instances::in4<S, T, L>&,                       \
                           const kfa::detail::instances::in4<S, T, L>&);

// The units, one translation unit each: KFA_UNIT_<direction>_<layout>(EXTERN, space, element type), where layout
// `partials` (half and bfloat16 only) is the ring's: strided, o or the gradients in float.
#define KFA_UNIT_forward_right(E, S, T) KFA_INSTANCE_FORWARD(E, S, T, Kokkos::LayoutRight, T)
#define KFA_UNIT_forward_stride(E, S, T) KFA_INSTANCE_FORWARD(E, S, T, Kokkos::LayoutStride, T)
#define KFA_UNIT_forward_partials(E, S, T) KFA_INSTANCE_FORWARD(E, S, T, Kokkos::LayoutStride, float)
#define KFA_UNIT_backward_right(E, S, T)                 \
  KFA_INSTANCE_BACKWARD(E, S, T, Kokkos::LayoutRight, T) \
  KFA_INSTANCE_ROW_DOT(E, S, T, Kokkos::LayoutRight)
#define KFA_UNIT_backward_stride(E, S, T)                 \
  KFA_INSTANCE_BACKWARD(E, S, T, Kokkos::LayoutStride, T) \
  KFA_INSTANCE_ROW_DOT(E, S, T, Kokkos::LayoutStride)
#define KFA_UNIT_backward_partials(E, S, T) KFA_INSTANCE_BACKWARD(E, S, T, Kokkos::LayoutStride, float)

#define KFA_UNITS_32(E, S, T)                                                                       \
  KFA_UNIT_forward_right(E, S, T) KFA_UNIT_forward_stride(E, S, T) KFA_UNIT_backward_right(E, S, T) \
      KFA_UNIT_backward_stride(E, S, T)
#define KFA_UNITS_16(E, S, T) \
  KFA_UNITS_32(E, S, T) KFA_UNIT_forward_partials(E, S, T) KFA_UNIT_backward_partials(E, S, T)

#if KFA_PRECOMPILED_KERNELS
KFA_UNITS_32(extern, Kokkos::DefaultExecutionSpace, double)
KFA_UNITS_32(extern, Kokkos::DefaultExecutionSpace, float)
#if KFA_PRECOMPILED_GPU
#if KFA_HAS_HALF
KFA_UNITS_16(extern, Kokkos::DefaultExecutionSpace, kfa::compat::half_t)
#endif
#if KFA_HAS_BHALF
KFA_UNITS_16(extern, Kokkos::DefaultExecutionSpace, kfa::compat::bhalf_t)
#endif
KFA_UNITS_32(extern, Kokkos::DefaultHostExecutionSpace, double)
KFA_UNITS_32(extern, Kokkos::DefaultHostExecutionSpace, float)
#endif
#endif
