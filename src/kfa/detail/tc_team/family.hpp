#pragma once
/// The 16-keys-per-warp tensor-core family (mma.sync under Kokkos team scratch): its tiles and its forward
/// launch. Its backward kernels are composed with the other tensor-core families' in dispatch.hpp.
#include <kfa/detail/cuda/problems.hpp>
#include <kfa/detail/tc_team/backward.hpp>
#include <kfa/detail/tc_team/forward.hpp>
#include <kfa/plan.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

namespace kfa {
namespace detail {

template <int D>
TileConfig tc_forward_tiles(std::size_t l0_max) {
  TileConfig t;
  t.block_q = TcForwardShape<D>::block_q;
  t.block_k = TcForwardShape<D>::block_k;
  t.team_size = 32 * TcForwardShape<D>::warps;
  t.scratch_l0 = TcForwardShape<D>::scratch_l0;
  t.scratch_l0_max = l0_max;
  return t;
}

/// Tiles of the tensor-core kernels for a head dim they support.
inline TileConfig tc_forward_tiles(int head_dim, std::size_t l0_max) {
  return tc_head_dim_switch(head_dim, [&](auto dc) { return tc_forward_tiles<decltype(dc)::value>(l0_max); });
}

template <int D, class ExecSpace, class Args>
void tc_forward_launch_d(const ExecSpace& space, const Args& args) {
#if KFA_HAS_TENSOR_CORES
  using Kernel = TcForwardKernel<D, Args>;
  const Kernel kernel(args);
  const long league = kernel.order.league();
  checked_league("kfa::attention_forward", "batch * heads_q * query blocks", league);
  typename Kernel::policy_type policy(space, static_cast<int>(league), Kernel::WARPS, 32);
  policy.set_scratch_size(0, Kokkos::PerTeam(TcForwardShape<D>::scratch_l0));
  Kokkos::parallel_for("kfa::attention_forward[tensor_core]", policy, kernel);
#else
  (void)space, (void)args;
  fail("kfa: tensor-core kernels are not compiled in this build");
#endif
}

template <class ExecSpace, class Args>
void tc_forward_launch(const ExecSpace& space, const Args& args) {
  tc_head_dim_switch(static_cast<int>(args.q.extent(3)),
                     [&](auto dc) { tc_forward_launch_d<decltype(dc)::value>(space, args); });
}

struct TeamForwardFamily {  // sm_80+: mma.sync, a Kokkos team per 64 query rows (forward.hpp)
  static constexpr TileProductPath path = TileProductPath::tensor_core_team;
  static constexpr bool tensor_core = true;
  template <class C>
  static std::string why_not(const C& c) {
    const std::string why = c.tc_problem(false);
    return why.empty() ? tc_block_problem(c.opts, TcForwardShape<64>::block_q, TcForwardShape<64>::block_k, "forward")
                       : why;
  }
  template <class C>
  static TileConfig tiles(const C& c) {
    using ExecSpace = typename C::exec_space;
    return tc_forward_tiles(c.d, static_cast<std::size_t>(compat::scratch_size_max_l0<ExecSpace>()));
  }
  template <class C, class A>
  static void launch(const C& c, const A& args, const TileConfig&) {
    if constexpr (has_tensor_core_path<typename C::exec_space, typename C::T>::value) tc_forward_launch(c.space, args);
    (void)c, (void)args;
  }
};
}  // namespace detail
}  // namespace kfa
