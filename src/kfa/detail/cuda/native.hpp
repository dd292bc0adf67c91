#pragma once
/// cuda/native.hpp: native CUDA launches for the tensor-core kernels that need more shared memory per block
/// than Kokkos' team scratch gives (40,936 B of level 0 on Kokkos::Cuda up to 5.1): opt in to the device's
/// larger limit (cudaFuncAttributeMaxDynamicSharedMemorySize) and enqueue on the stream of the caller's
/// Kokkos::Cuda instance, so the kernel is ordered with that instance's other work exactly as a
/// parallel_for would be. Everything outside these launches stays Kokkos.
#include <kfa/compat.hpp>
#include <kfa/error.hpp>
#include <kfa/paths.hpp>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <string>

namespace kfa {
namespace detail {

/// The value of the environment variable KFA_NATIVE_SMEM_CAP (`value`; null when unset): bytes of shared memory
/// per block that native_smem_max reports at most, so that a device with more runs and tests what a device with
/// less would choose (101376: sm_86/89; 166912: sm_80). 0, empty or unset: no cap. Anything but a whole number of bytes
/// is a kfa::Error naming the variable.
inline std::size_t parse_native_smem_cap(const char* value) {
  if (value == nullptr || *value == '\0') return 0;
  char* end = nullptr;
  errno = 0;
  const unsigned long long bytes = std::strtoull(value, &end, 10);
  if (!std::isdigit(static_cast<unsigned char>(value[0])) || *end != '\0' || errno == ERANGE)
    fail("KFA_NATIVE_SMEM_CAP = \"", value, "\": must be a whole number of bytes (0: no cap)");
  return static_cast<std::size_t>(bytes);
}

/// KFA_NATIVE_SMEM_CAP of this process's environment, read once (see parse_native_smem_cap).
inline std::size_t native_smem_cap() {
  static const std::size_t cap = parse_native_smem_cap(std::getenv("KFA_NATIVE_SMEM_CAP"));
  return cap;
}

/// Shared memory per block the device of `space` allows with opt-in (0 off CUDA), at most KFA_NATIVE_SMEM_CAP
/// where the environment sets it. Every choice between kernels that depends on shared memory asks this.
template <class ExecSpace>
std::size_t native_smem_max(const ExecSpace& space) {
#if KFA_HAS_TENSOR_CORES
  if constexpr (std::is_same<ExecSpace, Kokkos::Cuda>::value) {
    const std::size_t have = space.cuda_device_prop().sharedMemPerBlockOptin;
    const std::size_t cap = native_smem_cap();
    return cap > 0 && cap < have ? cap : have;
  }
#endif
  (void)space;
  return 0;
}

/// Why a kernel that needs `need` bytes of shared memory per block cannot be launched natively on the
/// device of `space` ("" when it can); `kernel` names it in the message.
template <class ExecSpace>
std::string native_smem_problem(const ExecSpace& space, std::size_t need, const char* kernel) {
  const std::size_t have = native_smem_max(space);
  if (have >= need) return "";
  return "the device allows " + std::to_string(have) + " B of shared memory per block, " + kernel + " needs " +
         std::to_string(need);
}

#if KFA_HAS_TENSOR_CORES
/// A Kokkos-style team functor body run by a native launch: blockIdx.x is the league rank, threadIdx.x
/// the lane and threadIdx.y the warp (as in a TeamPolicy of F::warps × 32), the dynamic shared memory
/// its level-0 scratch. The functor stays in the parameter space (__grid_constant__): without it, calling
/// a member function on the parameter made a copy of it and the dK/dV kernel ran 49% slower than the
/// same body under Kokkos' launch (measured with ncu on the H200).
template <class F>
__global__ void __launch_bounds__(32 * F::WARPS, F::MIN_BLOCKS) native_team_kernel(const __grid_constant__ F f) {
  extern __shared__ __align__(16) unsigned char native_team_smem[];
  f.run(static_cast<int>(blockIdx.x), reinterpret_cast<char*>(native_team_smem));
}

/// kernel<<<league, block, smem, space.cuda_stream()>>>(arg) with `smem` bytes of dynamic shared memory
/// opted in and the shared-memory carveout `blocks_per_sm` such blocks need (the rest stays L1 cache);
/// `name` is the profiling region and what a failure names.
template <class A>
void native_launch(const Kokkos::Cuda& space, const std::string& name, void (*kernel)(A), long league, dim3 block,
                   std::size_t smem, int blocks_per_sm, const A& arg) {
  checked_league(name.c_str(), "blocks", league);
  compat::ScopedRegion region(name);
  cudaError_t err = cudaSetDevice(space.cuda_device());
  if (err == cudaSuccess)
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  // Left to the driver, the carveout may fit one block per SM (measured: half the speed on the H200); all
  // of it for shared memory starves kernels that read through L1. Ask for what the blocks need.
  const cudaDeviceProp& prop = space.cuda_device_prop();
  const std::size_t need = static_cast<std::size_t>(blocks_per_sm) * (smem + prop.reservedSharedMemPerBlock);
  const int carveout = static_cast<int>(
      std::min<std::size_t>(100, (100 * need + prop.sharedMemPerMultiprocessor - 1) / prop.sharedMemPerMultiprocessor));
  if (err == cudaSuccess) err = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, carveout);
  if (err != cudaSuccess) fail(name, ": opting in to ", smem, " B of shared memory failed: ", cudaGetErrorString(err));
  kernel<<<static_cast<unsigned>(league), block, smem, space.cuda_stream()>>>(arg);
  err = cudaGetLastError();
  if (err != cudaSuccess) fail(name, ": the launch failed: ", cudaGetErrorString(err));
}
#endif

}  // namespace detail
}  // namespace kfa
