#pragma once
/// The FA2-layout tensor-core family (natively launched, opt-in shared memory): why it cannot run an
/// argument set, its tiles.
#include <kfa/detail/cuda/problems.hpp>
#include <kfa/detail/tc_fa2/backward.hpp>
#include <kfa/detail/tc_fa2/dq.hpp>
#include <kfa/detail/tc_fa2/forward.hpp>
#include <kfa/plan.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

namespace kfa {
namespace detail {

/// Whether the FA2-layout dK/dV kernel runs head dim d (`fused`: with dQ fused in) on `space`: where
/// tc_fa2_backward_used says so and the device gives a block its shared memory (107-216 KB: not sm_86/89's
/// 99 KB, nor sm_80's 163 KB at d = 128 and 256); the 16-keys-per-warp kernel runs otherwise (not at 256).
template <class ExecSpace>
bool tc_fa2_backward_runs(const ExecSpace& space, int d, bool fused) {
  return fa2_head_dim_switch(d, [&](auto dc) {
    constexpr int D = decltype(dc)::value;
    if (fused)
      return tc_fa2_backward_used<D, true>() && Fa2BackwardShape<D, true>::dkdv_scratch <= native_smem_max(space);
    return tc_fa2_backward_used<D, false>() && Fa2BackwardShape<D, false>::dkdv_scratch <= native_smem_max(space);
  });
}

/// Why the FA2-layout forward cannot run these options with head dim d on `space` ("" when it can), given
/// that the tensor-core kernels can (tc_space_problem and the views' problems are "").
template <class ExecSpace>
std::string fa2_forward_why_not(const ExecSpace& space, int d, long seq_k, const AttentionOptions& opts) {
  const std::string why = fa2_forward_problem(space, d);
  if (!why.empty()) return why;
  if (seq_k > 2147483647L - 256)  // key positions are ints in its tile loop (fewer registers: no spills)
    return "seq_k = " + std::to_string(seq_k) + " (the FA2-layout forward indexes keys with 32-bit ints)";
  return fa2_head_dim_switch(d, [&](auto dc) {
    using S = Fa2ForwardShape<decltype(dc)::value>;
    return tc_block_problem(opts, S::block_q, S::block_k, "forward");
  });
}
inline TileConfig fa2_forward_tiles(int head_dim, std::size_t smem_max) {
  return fa2_head_dim_switch(
      head_dim, [&](auto dc) { return native_forward_tiles<Fa2ForwardShape<decltype(dc)::value>>(smem_max); });
}

struct Fa2ForwardFamily {  // sm_80+: mma.sync in FlashAttention-2's layout, native launch (forward.hpp)
  static constexpr TileProductPath path = TileProductPath::tensor_core_fa2;
  static constexpr bool tensor_core = true;
  template <class C>
  static std::string why_not(const C& c) {
    const std::string why = c.tc_problem(true);  // the FA2-layout kernels also have d = 256
    return why.empty() ? fa2_forward_why_not(c.space, c.d, c.seq_k, c.opts) : why;
  }
  template <class C>
  static TileConfig tiles(const C& c) {
    return fa2_forward_tiles(c.d, native_smem_max(c.space));
  }
  template <class C, class A>
  static void launch(const C& c, const A& args, const TileConfig&) {
#if KFA_HAS_TENSOR_CORES
    if constexpr (has_tensor_core_path<typename C::exec_space, typename C::T>::value) fa2_forward_launch(c.space, args);
#endif
    (void)c, (void)args;
  }
};
}  // namespace detail
}  // namespace kfa
