#pragma once
/// Umbrella header of kfa: exact FlashAttention on Kokkos.
#include <kfa/attention.hpp>
#include <kfa/compat.hpp>
#include <kfa/config.hpp>
#include <kfa/detail/common/host_simd.hpp>  // kfa::host_isa(): the host vector ISA in use
#include <kfa/error.hpp>
#include <kfa/merge.hpp>
#include <kfa/nonfinite.hpp>  // kfa::count_nonfinite; what NaN/Inf inputs produce
#include <kfa/online_softmax.hpp>
#include <kfa/options.hpp>
#include <kfa/paths.hpp>      // kfa::has_tensor_core_path: where the tensor-core path exists
#if KFA_HAVE_KOKKOS_KERNELS   // from kfa/config.hpp: built with KFA_ENABLE_KOKKOS_KERNELS=ON
#include <kfa/reference.hpp>  // kfa::reference_attention*: the materialized baseline (Kokkos Kernels gemm)
#endif
#include <kfa/tiling.hpp>
#include <kfa/types.hpp>
