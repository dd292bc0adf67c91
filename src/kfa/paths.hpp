#pragma once
/// Which tile-product paths a build has, at compile time.
///
/// `kfa::has_tensor_core_path<ExecSpace, T>::value` is true where attention can run its tile products on
/// tensor cores (TileProductPath::tensor_core, and what TileProductPath::automatic picks first):
/// ExecSpace = Kokkos::Cuda, T = half or bfloat16 (compat::half_t / compat::bhalf_t, i.e.
/// Kokkos::Experimental::half_t / bhalf_t), in a build whose Kokkos targets sm_80 or newer (Ampere, Ada,
/// Hopper, Blackwell). It is false everywhere else: host execution spaces, float and double, CUDA builds for
/// older GPUs, and builds where Kokkos has no separate half/bfloat16 type. It is only the compile-time side:
/// at run time the device's compute capability (8.0 or newer), the head dim (64, 96, 128 or 256; the
/// backward at 256 where the device has the shared memory), a unit head-dim stride and 16-byte-aligned rows
/// are checked too; `automatic` then falls back
/// to another path and an explicit TileProductPath::tensor_core is a kfa::Error. (float has tensor-core
/// kernels of its own, forward and backward: TileProductPath::tensor_core_tf32x3, which this trait does not
/// cover.)
/// kfa::plan_forward / plan_backward say which family a call runs; its profiling region's name says it too, e.g.
/// `kfa::attention_forward[tensor_core_fa2,bfloat16,d128,bq128,bk64]`.
///
/// KFA_HAS_TENSOR_CORES is 1 when this build compiles the tensor-core kernels at all (some
/// has_tensor_core_path<Kokkos::Cuda, T> holds), else 0.
#include <kfa/compat.hpp>

#include <type_traits>

namespace kfa {

/// True where attention can run its tile products on tensor cores (see the comment at the top).
template <class ExecSpace, class T>
struct has_tensor_core_path : std::false_type {};

#if defined(KOKKOS_ENABLE_CUDA) && (defined(KOKKOS_ARCH_AMPERE) || defined(KOKKOS_ARCH_ADA89) || \
                                    defined(KOKKOS_ARCH_HOPPER) || defined(KOKKOS_ARCH_BLACKWELL))
#define KFA_HAS_TENSOR_CORES 1
#if KFA_HAS_HALF
template <>
struct has_tensor_core_path<Kokkos::Cuda, compat::half_t> : std::true_type {};
#endif
#if KFA_HAS_BHALF
template <>
struct has_tensor_core_path<Kokkos::Cuda, compat::bhalf_t> : std::true_type {};
#endif
#else
#define KFA_HAS_TENSOR_CORES 0
#endif

}  // namespace kfa
