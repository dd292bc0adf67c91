#pragma once
/// Every difference between the Kokkos (and Kokkos Kernels) versions kfa supports (3.4.01 as in Debian 12,
/// 4.x, 5.x) lives here. No Kokkos Kernels header is included: kernels_call takes the call as a generic
/// lambda, so only reference.hpp, the one kfa header that calls Kokkos Kernels (compat::gemm), includes one.
#include <Kokkos_Core.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

// Device-side code path marker. Kokkos 3.4 has no KOKKOS_IF_ON_DEVICE, so we test the compilers' macros.
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__) || defined(__SYCL_DEVICE_ONLY__)
#define KFA_ON_DEVICE 1
#else
#define KFA_ON_DEVICE 0
#endif

// Kokkos without a GPU backend (3.4 and 4.x alike) defines half_t and bhalf_t as plain float; then kfa
// has no separate half or bfloat16 type and those spellings simply mean float.
#if defined(KOKKOS_HALF_T_IS_FLOAT) && KOKKOS_HALF_T_IS_FLOAT
#define KFA_HAS_HALF 0
#else
#define KFA_HAS_HALF 1
#endif

// bfloat16 exists from Kokkos 3.7 on (Kokkos::Experimental::bhalf_t).
#if KOKKOS_VERSION >= 30700 && !(defined(KOKKOS_BHALF_T_IS_FLOAT) && KOKKOS_BHALF_T_IS_FLOAT)
#define KFA_HAS_BHALF 1
#else
#define KFA_HAS_BHALF 0
#endif

namespace kfa {
namespace compat {

#if KFA_HAS_HALF
using half_t = Kokkos::Experimental::half_t;
#endif
#if KFA_HAS_BHALF
using bhalf_t = Kokkos::Experimental::bhalf_t;
#endif

// Math: Kokkos 3.4 keeps these in Kokkos::Experimental, 4.x in Kokkos.
#if KOKKOS_VERSION >= 40000
using Kokkos::exp;
using Kokkos::isfinite;
using Kokkos::isinf;
using Kokkos::isnan;
using Kokkos::log;
using Kokkos::tanh;
#else
using Kokkos::Experimental::exp;
using Kokkos::Experimental::isfinite;
using Kokkos::Experimental::isinf;
using Kokkos::Experimental::isnan;
using Kokkos::Experimental::log;
using Kokkos::Experimental::tanh;
#endif

/// +inf of a floating-point type, usable on device (Kokkos moved infinity<T> between versions).
template <class T>
KOKKOS_INLINE_FUNCTION constexpr T infinity() {
  return static_cast<T>(HUGE_VAL);
}

/// RAII profiling region; Kokkos::Profiling::ScopedRegion only exists from 4.1.
class ScopedRegion {
 public:
  explicit ScopedRegion(const std::string& name) { Kokkos::Profiling::pushRegion(name); }
  ~ScopedRegion() { Kokkos::Profiling::popRegion(); }
  ScopedRegion(const ScopedRegion&) = delete;
  ScopedRegion& operator=(const ScopedRegion&) = delete;
};

/// Level-0 scratch a team may request on this backend, in bytes.
template <class ExecSpace>
int scratch_size_max_l0() {
  return Kokkos::TeamPolicy<ExecSpace>::scratch_size_max(0);
}

/// Human name of a Kokkos version number, e.g. "3.4.1".
inline std::string kokkos_version_string() {
  return std::to_string(KOKKOS_VERSION / 10000) + "." + std::to_string(KOKKOS_VERSION / 100 % 100) + "." +
         std::to_string(KOKKOS_VERSION % 100);
}

/// Runs a Kokkos Kernels call on `space`. From 4.0 Kokkos Kernels takes the execution space as the first
/// argument: call(space). Kokkos Kernels 3.4 has no execution-space overloads: call() runs on the default
/// instance, so `space` is fenced before it and the default instance after. `call` is generic over a pack
/// that is `space` or empty, e.g. [&](const auto&... on) { KokkosBlas::gemm(on..., "N", "N", ...); }
/// (compat::gemm in reference.hpp), so this header needs no Kokkos Kernels header.
template <class ExecSpace, class Call>
void kernels_call(const ExecSpace& space, Call&& call) {
#if KOKKOS_VERSION >= 40000
  call(space);
#else
  space.fence();
  call();
  ExecSpace().fence();
#endif
}

}  // namespace compat
}  // namespace kfa
