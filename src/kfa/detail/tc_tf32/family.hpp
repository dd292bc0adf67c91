#pragma once
/// The fp32 tensor-core family (3xTF32): why it cannot run an argument set, its tiles.
#include <kfa/detail/cuda/problems.hpp>
#include <kfa/detail/tc_tf32/backward.hpp>
#include <kfa/detail/tc_tf32/forward.hpp>
#include <kfa/plan.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

namespace kfa {
namespace detail {

/// Why the fp32 tensor-core kernels (3xTF32) cannot run head dim d on `space` ("" when they can): they need
/// float on Kokkos::Cuda built for sm_80 or newer, a device of compute capability 8.0+, head dim 64, 96 or 128
/// and seq_k below 2^31 − 256 (their key positions are ints).
template <class ExecSpace, class T>
std::string tf32_space_problem(const ExecSpace& space, int d, long seq_k) {
#if KFA_HAS_TENSOR_CORES
  if constexpr (std::is_same<ExecSpace, Kokkos::Cuda>::value && std::is_same<T, float>::value) {
    const auto& prop = space.cuda_device_prop();
    if (prop.major < 8)
      return "the device has compute capability " + std::to_string(prop.major) + "." + std::to_string(prop.minor) +
             " (tensor-core kernels need 8.0 or newer)";
    if (!tc_head_dim_supported(d))
      return "head_dim = " + std::to_string(d) + " (the tensor-core kernels exist for " + tc_head_dims_text() + ")";
    if (seq_k > 2147483647L - 256)
      return "seq_k = " + std::to_string(seq_k) + " (the fp32 tensor-core kernels index keys with 32-bit ints)";
    return "";
  }
#endif
  (void)space, (void)d, (void)seq_k;
  return std::string("there is no fp32 tensor-core kernel for ") + dtype_name<T>() + " on " + ExecSpace::name() +
         " (it needs Kokkos::Cuda built for sm_80 or newer and float elements)";
}

/// Why the fp32 tensor-core forward (3xTF32, tc_tf32_forward.hpp) cannot run these inputs on `space` ("" when
/// it can): tf32_space_problem, rows as the tensor-core kernels need them, its shared memory and no block-size
/// override it cannot honour.
template <class ExecSpace, class QV, class KV, class VV, class OV>
std::string tf32_forward_why_not(const ExecSpace& space, const QV& q, const KV& k, const VV& v, const OV& o,
                                 const AttentionOptions& opts) {
  using T = typename QV::non_const_value_type;
  const int d = static_cast<int>(q.extent(3));
  std::string why = tf32_space_problem<ExecSpace, T>(space, d, static_cast<long>(k.extent(1)));
  tc_add_forward_view_problems(why, q, k, v, o);
  if (!why.empty()) return why;
  return tc_head_dim_switch(d, [&](auto dc) -> std::string {
    using S = Tf32ForwardShape<decltype(dc)::value>;
    const std::string w = native_smem_problem(space, S::smem, "the fp32 tensor-core forward");
    return w.empty() ? tc_block_problem(opts, S::block_q, S::block_k, "fp32 forward") : w;
  });
}

/// Why the fp32 tensor-core backward (3xTF32, tc_tf32_backward.hpp) cannot run these inputs on `space` (""
/// when it can): tf32_space_problem, rows of every view as the tensor-core kernels need them, the shared
/// memory of both kernels and no block-size override (its two kernels' tiles differ).
template <class ExecSpace, class QV, class KV, class VV, class DOV, class DQV, class DKV, class DVV>
std::string tf32_backward_why_not(const ExecSpace& space, const QV& q, const KV& k, const VV& v, const DOV& d_o,
                                  const DQV& dq, const DKV& dk, const DVV& dv, const AttentionOptions& opts) {
  using T = typename QV::non_const_value_type;
  const int d = static_cast<int>(q.extent(3));
  std::string why = tf32_space_problem<ExecSpace, T>(space, d, static_cast<long>(k.extent(1)));
  tc_add_backward_view_problems(why, q, k, v, d_o, dq, dk, dv);
  if (!why.empty()) return why;
  return tc_head_dim_switch(d, [&](auto dc) -> std::string {
    constexpr int D = decltype(dc)::value;
    using S = Tf32BackwardShape<D>;
    std::string w = native_smem_problem(space, tf32_backward_min_smem<D>(), "the fp32 tensor-core backward");
    if (w.empty()) w = tc_block_problem(opts, S::dkdv_block_q, S::dkdv_block_k, "fp32 backward");
    const int dq_block_q = 16 * tf32_dq_warps<D>(native_smem_max(space));
    if (w.empty()) w = tc_block_problem(opts, dq_block_q, S::dq_block_k, "fp32 backward");
    return w;
  });
}

/// Tiles of the 3xTF32 backward on a device that gives a block smem_max bytes (the dQ kernel's warps depend on
/// it).
inline BackwardTileConfig tf32_backward_tiles(int head_dim, std::size_t smem_max) {
  return tc_head_dim_switch(head_dim, [&](auto dc) {
    constexpr int D = decltype(dc)::value;
    if (tf32_dq_warps<D>(smem_max) == 8) {
      using S = Tf32BackwardShape<D, 8>;
      return backward_tiles_of<S>(smem_max, 32 * S::warps, 32 * S::dq_warps);
    }
    using S = Tf32BackwardShape<D, 4>;
    return backward_tiles_of<S>(smem_max, 32 * S::warps, 32 * S::dq_warps);
  });
}

inline TileConfig tf32_forward_tiles(int head_dim, std::size_t smem_max) {
  return tc_head_dim_switch(
      head_dim, [&](auto dc) { return native_forward_tiles<Tf32ForwardShape<decltype(dc)::value>>(smem_max); });
}

struct Tf32ForwardFamily {  // float on CUDA sm_80+: 3×TF32 mma.sync (forward.hpp)
  static constexpr TileProductPath path = TileProductPath::tensor_core_tf32x3;
  static constexpr bool tensor_core = false;
  template <class C>
  static std::string why_not(const C& c) {
    return tf32_forward_why_not(c.space, c.q, c.k, c.v, c.o, c.opts);
  }
  template <class C>
  static TileConfig tiles(const C& c) {
    return tf32_forward_tiles(c.d, native_smem_max(c.space));
  }
  template <class C, class A>
  static void launch(const C& c, const A& args, const TileConfig&) {
#if KFA_HAS_TENSOR_CORES
    if constexpr (std::is_same<typename C::exec_space, Kokkos::Cuda>::value &&
                  std::is_same<typename C::T, float>::value)
      tf32_forward_launch(c.space, args);
#endif
    (void)c, (void)args;
  }
};

struct Tf32BackwardFamily {  // float on CUDA sm_80+: 3×TF32 mma.sync (backward.hpp)
  static constexpr TileProductPath path = TileProductPath::tensor_core_tf32x3;
  static constexpr bool tensor_core = false;
  template <class C>
  static std::string why_not(const C& c) {
    return tf32_backward_why_not(c.space, c.q, c.k, c.v, c.d_o, c.dq, c.dk, c.dv, c.opts);
  }
  template <class C>
  static void plan(const C& c, BackwardPlan& plan) {
    plan.tiles = tf32_backward_tiles(c.d, native_smem_max(c.space));
  }
  template <class C, class A>
  static void launch(const C& c, const A& args, const BackwardPlan&, BackwardParts parts) {
#if KFA_HAS_TENSOR_CORES
    if constexpr (std::is_same<typename C::exec_space, Kokkos::Cuda>::value &&
                  std::is_same<typename C::T, float>::value)
      tf32_backward_launch(c.space, args, parts);
#endif
    (void)c, (void)args, (void)parts;
  }
};
}  // namespace detail
}  // namespace kfa
