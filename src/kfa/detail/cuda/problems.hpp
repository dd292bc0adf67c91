#pragma once
/// cuda/problems.hpp: what every CUDA family checks before it runs an argument set: the element type and device
/// (tensor cores), the views' alignment and strides, block-size overrides; and the tiles of a natively launched
/// forward.
#include <kfa/detail/cuda/mma.hpp>
#include <kfa/error.hpp>
#include <kfa/options.hpp>
#include <kfa/tiling.hpp>
#include <kfa/types.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

namespace kfa {
namespace detail {

/// Why the tensor-core kernels cannot run T elements with this head dim on `space` ("" when they can);
/// `fa2`: asked for the kernels that also have head dim 256 (the FA2-layout and wgmma forwards, the tensor-core
/// backward).
template <class ExecSpace, class T>
std::string tc_space_problem(const ExecSpace& space, int head_dim, bool fa2 = false) {
  if (!has_tensor_core_path<ExecSpace, T>::value)
    return std::string("there is no tensor-core path for ") + dtype_name<T>() + " on " + ExecSpace::name() +
           " (it needs Kokkos::Cuda built for sm_80 or newer and half or bfloat16 elements" +
           (std::is_same<T, float>::value ? "; float's forward has its own: tensor_core_tf32x3)" : ")");
#if KFA_HAS_TENSOR_CORES
  if constexpr (std::is_same<ExecSpace, Kokkos::Cuda>::value) {
    const auto& prop = space.cuda_device_prop();
    if (prop.major < 8)
      return "the device has compute capability " + std::to_string(prop.major) + "." + std::to_string(prop.minor) +
             " (tensor-core kernels need 8.0 or newer)";
  }
#else
  (void)space;
#endif
  if (fa2 ? !fa2_head_dim_supported(head_dim) : !tc_head_dim_supported(head_dim))
    return "head_dim = " + std::to_string(head_dim) + " (the tensor-core kernels exist for " + tc_head_dims_text() +
           (fa2               ? "; the FA2-layout and wgmma forwards and the FA2-layout backward also for 256)"
            : head_dim == 256 ? "; only the FA2-layout and wgmma forwards and the FA2-layout backward for 256)"
                              : ")");
  return "";
}

/// Appends the first problem of a view to `why` ("" when none so far).
template <class V>
void tc_add_view_problem(std::string& why, const char* name, const V& v) {
  if (!why.empty()) return;
  if (const char* p = tc_view_problem(v)) why = std::string(name) + ": " + p;
}
/// The same for the forward's views (q, k, v, o), and for the backward's (q, k, v, d_o, dq, dk, dv).
template <class QV, class KV, class VV, class OV>
void tc_add_forward_view_problems(std::string& why, const QV& q, const KV& k, const VV& v, const OV& o) {
  tc_add_view_problem(why, "q", q);
  tc_add_view_problem(why, "k", k);
  tc_add_view_problem(why, "v", v);
  tc_add_view_problem(why, "o", o);
}
template <class QV, class KV, class VV, class DOV, class DQV, class DKV, class DVV>
void tc_add_backward_view_problems(std::string& why, const QV& q, const KV& k, const VV& v, const DOV& d_o,
                                   const DQV& dq, const DKV& dk, const DVV& dv) {
  tc_add_view_problem(why, "q", q);
  tc_add_view_problem(why, "k", k);
  tc_add_view_problem(why, "v", v);
  tc_add_view_problem(why, "d_o", d_o);
  tc_add_view_problem(why, "dq", dq);
  tc_add_view_problem(why, "dk", dk);
  tc_add_view_problem(why, "dv", dv);
}

/// A block-size override the tensor-core kernels cannot honour, or "".
inline std::string tc_block_problem(const AttentionOptions& opts, int block_q, int block_k, const char* kernel) {
  if (opts.block_q > 0 && opts.block_q != block_q)
    return "opts.block_q = " + std::to_string(opts.block_q) + " (the tensor-core " + kernel + " uses " +
           std::to_string(block_q) + ")";
  if (opts.block_k > 0 && opts.block_k != block_k)
    return "opts.block_k = " + std::to_string(opts.block_k) + " (the tensor-core " + kernel + " uses " +
           std::to_string(block_k) + ")";
  return "";
}

/// Tiles of a natively launched forward kernel from its shape (block_q, block_k, warps, smem).
template <class Shape>
TileConfig native_forward_tiles(std::size_t smem_max) {
  TileConfig t;
  t.block_q = Shape::block_q;
  t.block_k = Shape::block_k;
  t.team_size = 32 * Shape::warps;
  t.scratch_l0 = Shape::smem;
  t.scratch_l0_max = smem_max;
  return t;
}

}  // namespace detail
}  // namespace kfa
