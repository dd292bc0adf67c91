#pragma once
/// The Hopper family (sm_90a wgmma, TMA, warp specialization): why it cannot run an argument set, its tiles.
#include <kfa/detail/cuda/problems.hpp>
#include <kfa/detail/tc_wgmma/backward.hpp>
#include <kfa/detail/tc_wgmma/forward.hpp>
#include <kfa/plan.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

namespace kfa {
namespace detail {

/// The wgmma forward's tiles at head dim d, with softcap or not.
inline TileConfig wgmma_forward_tiles(int d, std::size_t smem_max, bool softcap) {
  return fa2_head_dim_switch(d, [&](auto dc) {
    constexpr int D = decltype(dc)::value;
    return softcap ? native_forward_tiles<WgmmaWsForwardShape<D, true>>(smem_max)
                   : native_forward_tiles<WgmmaWsForwardShape<D>>(smem_max);
  });
}

/// Why the wgmma forward cannot run these inputs ("" when it can); the device probe (wgmma_loaded) last.
template <class ExecSpace>
std::string wgmma_forward_why_not(const ExecSpace& space, int d, long seq_k, const AttentionOptions& opts) {
  if (seq_k > 2147483647L - 256)
    return "seq_k = " + std::to_string(seq_k) + " (the wgmma forward indexes keys with 32-bit ints)";
  if (wgmma_forward_head_dim(d)) {
    const TileConfig t = wgmma_forward_tiles(d, 0, opts.softcap > 0.f);
    const std::string why = tc_block_problem(opts, t.block_q, t.block_k, "forward");
    if (!why.empty()) return why;
  }
  return wgmma_forward_problem(space, d, opts.softcap > 0.f);
}

/// Why the deterministic backward cannot take the wgmma kernels for these inputs ("" when it can), given that
/// the tensor-core backward can run them; the device probe (wgmma_loaded) last.
template <class ExecSpace>
std::string wgmma_backward_why_not(const ExecSpace& space, int d, bool fused, const AttentionOptions& opts) {
  if (wgmma_backward_head_dim(d)) {
    auto blocks = [&](auto dc) {
      constexpr int D = decltype(dc)::value;
      std::string why =
          tc_block_problem(opts, WgmmaBackwardShape<D>::block_q, WgmmaBackwardShape<D>::block_k, "wgmma dK/dV kernel");
      if (why.empty())
        why = tc_block_problem(opts, WgmmaWsDqShape<D>::block_q, WgmmaWsDqShape<D>::block_k, "wgmma dQ kernel");
      return why;
    };
    const std::string why = fa2_head_dim_switch(d, blocks);
    if (!why.empty()) return why;
  }
  return wgmma_backward_problem(space, d, fused);
}

/// The tiles of the wgmma backward kernels at head dim D (64, 96, 128 or 256).
template <int D>
BackwardTileConfig wgmma_backward_tiles(std::size_t smem_max) {
  using S = WgmmaBackwardShape<D>;
  using Q = WgmmaWsDqShape<D>;
  BackwardTileConfig t;
  t.dkdv.block_q = S::block_q;
  t.dkdv.block_k = S::block_k;
  t.dkdv.team_size = 32 * S::warps;
  t.dkdv.scratch_l0 = S::smem;
  t.dq.block_q = Q::block_q;
  t.dq.block_k = Q::block_k;
  t.dq.team_size = 32 * Q::warps;
  t.dq.scratch_l0 = Q::smem;
  t.dkdv.scratch_l0_max = t.dq.scratch_l0_max = smem_max;
  return t;
}
inline BackwardTileConfig wgmma_backward_tiles(int d, std::size_t smem_max) {
  return fa2_head_dim_switch(d, [&](auto dc) { return wgmma_backward_tiles<decltype(dc)::value>(smem_max); });
}

struct WgmmaForwardFamily {  // Hopper (sm_90a): wgmma, warp-specialized (forward.hpp)
  static constexpr TileProductPath path = TileProductPath::tensor_core_wgmma;
  static constexpr bool tensor_core = true;
  template <class C>
  static std::string why_not(const C& c) {
    // head dims 64 to 256 (wgmma_forward_why_not narrows them); it may probe the device: asked last
    const std::string why = c.tc_problem(true);
    return why.empty() ? wgmma_forward_why_not(c.space, c.d, c.seq_k, c.opts) : why;
  }
  template <class C>
  static TileConfig tiles(const C& c) {
    return wgmma_forward_tiles(c.d, native_smem_max(c.space), c.opts.softcap > 0.f);
  }
  template <class C, class A>
  static void launch(const C& c, const A& args, const TileConfig&) {
#if KFA_HAS_TENSOR_CORES
    if constexpr (has_tensor_core_path<typename C::exec_space, typename C::T>::value)
      wgmma_forward_launch(c.space, args);
#endif
    (void)c, (void)args;
  }
};
}  // namespace detail
}  // namespace kfa
