#pragma once
/// Umbrella header of kfa: exact FlashAttention on Kokkos.
#include <kfa/attention.hpp>
#include <kfa/compat.hpp>
#include <kfa/config.hpp>
#include <kfa/detail/host_simd.hpp>  // kfa::host_isa(): the host vector ISA in use
#include <kfa/error.hpp>
#include <kfa/merge.hpp>
#include <kfa/nonfinite.hpp>  // kfa::count_nonfinite; what NaN/Inf inputs produce
#include <kfa/online_softmax.hpp>
#include <kfa/options.hpp>
#include <kfa/paths.hpp>  // kfa::has_tensor_core_path: where the tensor-core path exists
#include <kfa/reference.hpp>
#include <kfa/tiling.hpp>
#include <kfa/types.hpp>
