// GoogleTest main for kfa's test executables: Kokkos lives for the whole run.
#include <gtest/gtest.h>

#include <Kokkos_Core.hpp>
#include <kfa/detail/common/host_simd.hpp>

#include <cstdio>

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  Kokkos::ScopeGuard guard(argc, argv);
  // Which host SIMD branch the kernels take in this run (KFA_HOST_ISA caps it; see tests/CMakeLists.txt).
  std::printf("kfa host SIMD: compiled for %s, running %s\n", kfa::to_string(kfa::detail::compiled_host_isa),
              kfa::to_string(kfa::host_isa()));
  return RUN_ALL_TESTS();
}
