#pragma once
/// common/host_simd.hpp: which vector ISA the host kernels run with, decided from the compilation target and,
/// on x86-64, from the CPU at run time.
///
/// The width is never a constant. At compile time the target's macros give the baseline (AVX-512 → 64-byte
/// vectors, AVX2+FMA → 32, SSE2 or NEON → 16, otherwise scalar). On x86-64 with GCC or Clang (host
/// compilation, not nvcc) the hot routines are additionally compiled for AVX2+FMA and AVX-512 through
/// `__attribute__((target))` and chosen at run time from the CPU (cpuid, once per process), so a consumer who
/// compiles without -march still gets the widest kernels the machine has. Wider-than-baseline code is only
/// ever called through `host_isa()`, never inlined into baseline code.
///
/// `KFA_HOST_ISA=scalar|sse2|avx2|avx512` in the environment caps the run-time choice (never above what the
/// CPU has, never below the compiled baseline): tests use it to run every dispatch branch on one machine,
/// users to compare. `std::experimental::native_simd` was considered: its width is fixed by the translation
/// unit's flags, so it cannot serve run-time dispatch; GCC/Clang vector extensions of explicit width inside
/// target-attributed functions can, and they lower to single registers there.
#include <kfa/compat.hpp>

#include <cstdlib>
#include <cstring>

#if !KFA_ON_DEVICE && (defined(__GNUC__) || defined(__clang__))
#define KFA_HOST_VECTOR_EXT 1
#else
#define KFA_HOST_VECTOR_EXT 0
#endif

// Run-time dispatch: x86-64, GCC/Clang, not inside nvcc (whose host pass we do not trust with target
// attributes); KFA_NO_HOST_DISPATCH turns it off (then the compile-time width is all there is).
#if KFA_HOST_VECTOR_EXT && defined(__x86_64__) && !defined(__CUDACC__) && !defined(__NVCOMPILER) && \
    !defined(__INTEL_COMPILER) && !defined(KFA_NO_HOST_DISPATCH)
#define KFA_HOST_DISPATCH 1
#else
#define KFA_HOST_DISPATCH 0
#endif

#if KFA_HOST_DISPATCH
// Function-level targets for the wider ISAs (x86-64-v3 and the AVX-512 subset of x86-64-v4).
#define KFA_TARGET_AVX2 __attribute__((target("avx2,fma")))
#define KFA_TARGET_AVX512 __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")))
// Marks a lambda passed to with_host_isa(): it is inlined into each ISA's instance, so its loops are
// vectorized for that ISA (a lambda does not inherit its enclosing function's target otherwise).
#define KFA_SIMD_BODY __attribute__((always_inline))
#else
#define KFA_SIMD_BODY
#endif

namespace kfa {

/// Host vector ISA levels, in increasing width.
enum class HostIsa : int { scalar = 0, sse2 = 1, avx2 = 2, avx512 = 3 };

inline const char* to_string(HostIsa isa) {
  switch (isa) {
    case HostIsa::scalar:
      return "scalar";
    case HostIsa::sse2:
#if defined(__ARM_NEON)
      return "neon";
#else
      return "sse2";
#endif
    case HostIsa::avx2:
      return "avx2";
    case HostIsa::avx512:
      return "avx512";
  }
  return "?";
}

namespace detail {

/// The baseline of this translation unit's target.
#if !KFA_HOST_VECTOR_EXT
constexpr HostIsa compiled_host_isa = HostIsa::scalar;
#elif defined(__AVX512F__) && defined(__AVX512VL__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
constexpr HostIsa compiled_host_isa = HostIsa::avx512;
#elif defined(__AVX2__) && defined(__FMA__)
constexpr HostIsa compiled_host_isa = HostIsa::avx2;
#elif defined(__SSE2__) || defined(__ARM_NEON)
constexpr HostIsa compiled_host_isa = HostIsa::sse2;
#else
constexpr HostIsa compiled_host_isa = HostIsa::scalar;
#endif

/// Bytes per vector register at each level (0: scalar code).
KOKKOS_INLINE_FUNCTION constexpr int isa_vector_bytes(HostIsa isa) {
  return isa == HostIsa::avx512 ? 64 : isa == HostIsa::avx2 ? 32 : isa == HostIsa::sse2 ? 16 : 0;
}

/// What the CPU can run (cpuid, x86-64 only; elsewhere the compiled baseline), capped by KFA_HOST_ISA.
/// Cached once per process. The cap may go below the compiled baseline: then the narrower vectors and
/// their blocking are used, encoded with the baseline's instructions (tests use this to cover every
/// branch in any build).
inline HostIsa runtime_host_isa() {
  static const HostIsa isa = [] {
    HostIsa best = compiled_host_isa;
#if KFA_HOST_DISPATCH
    __builtin_cpu_init();
    HostIsa cpu = HostIsa::sse2;  // every x86-64 CPU
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) cpu = HostIsa::avx2;
    if (cpu == HostIsa::avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq"))
      cpu = HostIsa::avx512;
    if (static_cast<int>(cpu) > static_cast<int>(best)) best = cpu;
#endif
    if (const char* env = std::getenv("KFA_HOST_ISA")) {
      HostIsa cap = best;
      if (!std::strcmp(env, "scalar"))
        cap = HostIsa::scalar;
      else if (!std::strcmp(env, "sse2") || !std::strcmp(env, "neon"))
        cap = HostIsa::sse2;
      else if (!std::strcmp(env, "avx2"))
        cap = HostIsa::avx2;
      else if (!std::strcmp(env, "avx512"))
        cap = HostIsa::avx512;
      if (static_cast<int>(cap) < static_cast<int>(best)) best = cap;
    }
    return best;
  }();
  return isa;
}

}  // namespace detail

/// The vector ISA the host kernels of this process use: the widest the CPU runs (run-time dispatch on
/// x86-64) or, without dispatch, the compiled baseline; `KFA_HOST_ISA` caps it.
inline HostIsa host_isa() {
  return detail::runtime_host_isa();
}

namespace detail {

/// The ISA a with_host_isa() body is being compiled for, as a type.
template <HostIsa I>
struct IsaTag {
  static constexpr HostIsa value = I;
};

#if KFA_HOST_DISPATCH
template <class F>
KFA_TARGET_AVX512 __attribute__((noinline)) void run_for_avx512(const F& f) {
  f(IsaTag<HostIsa::avx512>{});
}
template <class F>
KFA_TARGET_AVX2 __attribute__((noinline)) void run_for_avx2(const F& f) {
  f(IsaTag<HostIsa::avx2>{});
}
#endif

/// Runs `f(tag)` (a generic lambda marked KFA_SIMD_BODY) compiled for host_isa(), with an IsaTag naming
/// that ISA so the body can pick its vector width (the lanes_* helpers): the customization point for the
/// element-wise loops of the host kernels (softmax, dS). On device it calls f(IsaTag<scalar>).
template <class F>
KOKKOS_FORCEINLINE_FUNCTION void with_host_isa(const F& f) {
#if KFA_ON_DEVICE || !KFA_HOST_VECTOR_EXT
  f(IsaTag<HostIsa::scalar>{});
#else
  const HostIsa isa = host_isa();
#if KFA_HOST_DISPATCH
  if (isa == HostIsa::avx512 && compiled_host_isa != HostIsa::avx512) return run_for_avx512(f);
  if (isa == HostIsa::avx2 && static_cast<int>(compiled_host_isa) < static_cast<int>(HostIsa::avx2))
    return run_for_avx2(f);
#endif
  // At or below the compiled baseline: the baseline's instructions, the chosen level's width.
  switch (isa) {
    case HostIsa::avx512:
      return f(IsaTag < compiled_host_isa == HostIsa::avx512 ? HostIsa::avx512 : compiled_host_isa > {});
    case HostIsa::avx2:
      return f(IsaTag < static_cast<int>(compiled_host_isa) >= static_cast<int>(HostIsa::avx2)
                   ? HostIsa::avx2
                   : compiled_host_isa > {});
    case HostIsa::sse2:
      return f(IsaTag < compiled_host_isa == HostIsa::scalar ? HostIsa::scalar : HostIsa::sse2 > {});
    case HostIsa::scalar:
      return f(IsaTag<HostIsa::scalar>{});
  }
#endif
}

}  // namespace detail

}  // namespace kfa
