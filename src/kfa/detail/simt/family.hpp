#pragma once
/// The CUDA fp32 SIMT family: why it cannot run an argument set, its tiles, its forward launch.
#include <kfa/detail/cuda/problems.hpp>
#include <kfa/detail/simt/backward.hpp>
#include <kfa/detail/simt/forward.hpp>
#include <kfa/plan.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

namespace kfa {
namespace detail {

/// Why the CUDA fp32 forward (forward.hpp) cannot run these inputs ("" when it can): it needs float
/// on Kokkos::Cuda, head dim 64 or 128, rows as the tensor-core kernels need them, no block-size override.
template <class ExecSpace, class QV, class KV, class VV, class OV>
std::string simt_forward_why_not(const QV& q, const KV& k, const VV& v, const OV& o, const AttentionOptions& opts) {
#if defined(KOKKOS_ENABLE_CUDA)
  if constexpr (std::is_same<ExecSpace, Kokkos::Cuda>::value &&
                std::is_same<typename QV::non_const_value_type, float>::value &&
                std::is_same<typename OV::non_const_value_type, float>::value) {
    const int d = static_cast<int>(q.extent(3));
    if (opts.block_q > 0 || opts.block_k > 0)
      return "a block-size override (opts.block_q = " + std::to_string(opts.block_q) +
             ", opts.block_k = " + std::to_string(opts.block_k) + "; the fp32 kernel has fixed tiles)";
    if (d != 64 && d != 128) return "head_dim = " + std::to_string(d) + " (the fp32 kernel exists for 64 and 128)";
    std::string why;
    tc_add_forward_view_problems(why, q, k, v, o);
    return why;
  }
#endif
  (void)q, (void)k, (void)v, (void)o, (void)opts;
  return std::string("there is no CUDA fp32 kernel for ") + dtype_name<typename QV::non_const_value_type>() + " on " +
         ExecSpace::name() + " (it needs Kokkos::Cuda and float elements)";
}

/// Why the CUDA fp32 backward (backward.hpp) cannot run these inputs ("" when it can): what the fp32
/// forward needs, of q, k, v, d_o and of the gradients.
template <class ExecSpace, class QV, class KV, class VV, class DOV, class DQV, class DKV, class DVV>
std::string simt_backward_why_not(const QV& q, const KV& k, const VV& v, const DOV& d_o, const DQV& dq, const DKV& dk,
                                  const DVV& dv, const AttentionOptions& opts) {
  std::string why = simt_forward_why_not<ExecSpace>(q, k, v, q, opts);  // q in o's place: its checks are q's
  tc_add_backward_view_problems(why, q, k, v, d_o, dq, dk, dv);         // (q, k, v already checked: no-ops)
  return why;
}

template <int D>
TileConfig simt_forward_tiles(std::size_t l0_max) {
  TileConfig t;
  t.block_q = SimtForwardShape<D>::block_q;
  t.block_k = SimtForwardShape<D>::block_k;
  t.team_size = SimtForwardShape<D>::threads;
  t.scratch_l0 = SimtForwardShape<D>::scratch_l0;
  t.scratch_l0_max = l0_max;
  return t;
}

template <int D, class ExecSpace, class Args>
void simt_forward_launch_d(const ExecSpace& space, const Args& args) {
#if defined(KOKKOS_ENABLE_CUDA)
  if constexpr (std::is_same<ExecSpace, Kokkos::Cuda>::value && std::is_same<typename Args::T, float>::value &&
                std::is_same<typename Args::o_type::non_const_value_type, float>::value) {
    using Kernel = SimtForwardKernel<D, Args>;
    const Kernel kernel(args);
    const long league = kernel.order.league();
    checked_league("kfa::attention_forward", "batch * heads_q * query blocks", league);
    typename Kernel::policy_type policy(space, static_cast<int>(league), SimtForwardShape<D>::threads / 32, 32);
    policy.set_scratch_size(0, Kokkos::PerTeam(SimtForwardShape<D>::scratch_l0));
    Kokkos::parallel_for("kfa::attention_forward[simt_fp32]", policy, kernel);
    return;
  }
#endif
  (void)space, (void)args;
  fail("kfa: the CUDA fp32 kernel does not exist for these types in this build");
}

struct SimtForwardFamily {  // float on CUDA: FMA tiles in registers (forward.hpp)
  static constexpr TileProductPath path = TileProductPath::simt_fp32;
  static constexpr bool tensor_core = false;
  template <class C>
  static std::string why_not(const C& c) {
    using ExecSpace = typename C::exec_space;
    return simt_forward_why_not<ExecSpace>(c.q, c.k, c.v, c.o, c.opts);
  }
  template <class C>
  static TileConfig tiles(const C& c) {
    using ExecSpace = typename C::exec_space;
    const auto l0_max = static_cast<std::size_t>(compat::scratch_size_max_l0<ExecSpace>());
    return c.d == 64 ? simt_forward_tiles<64>(l0_max) : simt_forward_tiles<128>(l0_max);
  }
  template <class C, class A>
  static void launch(const C& c, const A& args, const TileConfig&) {
    if (c.d == 64)
      simt_forward_launch_d<64>(c.space, args);
    else
      simt_forward_launch_d<128>(c.space, args);
  }
};

struct SimtBackwardFamily {  // float on CUDA: FMA tiles in registers (backward.hpp)
  static constexpr TileProductPath path = TileProductPath::simt_fp32;
  static constexpr bool tensor_core = false;
  template <class C>
  static std::string why_not(const C& c) {
    return simt_backward_why_not<typename C::exec_space>(c.q, c.k, c.v, c.d_o, c.dq, c.dk, c.dv, c.opts);
  }
  template <class C>
  static void plan(const C& c, BackwardPlan& plan) {
    const auto l0_max = static_cast<std::size_t>(compat::scratch_size_max_l0<typename C::exec_space>());
    plan.tiles = c.d == 64 ? simt_backward_tiles<64>(l0_max) : simt_backward_tiles<128>(l0_max);
  }
  template <class C, class A>
  static void launch(const C& c, const A& args, const BackwardPlan&, BackwardParts parts) {
    if (c.d == 64)
      simt_backward_launch_d<64>(c.space, args, parts);
    else
      simt_backward_launch_d<128>(c.space, args, parts);
  }
};
}  // namespace detail
}  // namespace kfa
