#pragma once
/// Choosing between the portable and the tensor-core tile products (AttentionOptions::path), and the
/// launches of the tensor-core kernels. Everything CUDA-specific compiles only where
/// has_tensor_core_path holds; elsewhere the launchers are never instantiated.
#include <kfa/detail/mask.hpp>
#include <kfa/detail/ranges.hpp>
#include <kfa/detail/simt_backward.hpp>
#include <kfa/detail/simt_forward.hpp>
#include <kfa/detail/tc_backward.hpp>
#include <kfa/detail/tc_fa2_backward.hpp>
#include <kfa/detail/tc_fa2_dq.hpp>
#include <kfa/detail/tc_fa2_forward.hpp>
#include <kfa/detail/tc_forward.hpp>
#include <kfa/detail/tc_tf32_backward.hpp>
#include <kfa/detail/tc_tf32_forward.hpp>
#include <kfa/detail/tc_wgmma_backward.hpp>
#include <kfa/detail/tc_wgmma_forward.hpp>
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
/// `fa2`: asked for the FA2-layout kernels (the FA2-layout forward, the tensor-core backward), which also
/// have head dim 256.
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
           (fa2                ? "; the FA2-layout ones also for 256)"
            : head_dim == 256 ? "; only the FA2-layout ones for 256)"
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

/// Shared memory of the smallest dK/dV kernel at head dim d (with dQ fused in when `fused`): what the
/// tensor-core backward needs at least. The 16-keys-per-warp kernel's, or at d = 256 the FA2-layout one's.
inline std::size_t tc_dkdv_scratch(int d, bool fused) {
  return fa2_head_dim_switch(d, [&](auto dc) {
    constexpr int D = decltype(dc)::value;
    if constexpr (D > 128)
      return fused ? Fa2BackwardShape<D, true>::dkdv_scratch : Fa2BackwardShape<D>::dkdv_scratch;
    else
      return fused ? TcBackwardShape<D, true>::dkdv_scratch : TcBackwardShape<D>::dkdv_scratch;
  });
}

/// Why the tensor-core backward cannot run head dim d on this device ("" when it can): at d > 64 even its
/// smaller dK/dV kernel takes more shared memory per block than Kokkos' team scratch, opted in natively;
/// at d = 256 the deterministic backward has one dQ kernel only, the FA2-layout one.
template <class ExecSpace>
std::string tc_backward_problem(const ExecSpace& space, int d, bool fused) {
  std::string why = native_smem_problem(space, tc_dkdv_scratch(d, fused), "the tensor-core dK/dV kernel");
  if (why.empty() && d > 128 && !fused) why = fa2_dq_problem(space, d);
  return why;
}

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

/// Whether deterministic = false fuses dQ into the dK/dV kernel with atomics at head dim d on `space`: not
/// at d = 64 where the FA2-layout dQ kernel runs, because there the two-kernel backward (no atomics) was
/// measured faster (H200, bf16, forward+backward 0.82-0.86x torch's flash against 0.75-0.81x with atomic
/// dQ; perf/RESULTS.md, seventh session), and not where the wgmma backward runs (two kernels, no atomics):
/// at d = 128 on the H200 forward+backward ran 236-296 TF/s with atomic dQ against 298-370 deterministic
/// (perf/RESULTS.md, eleventh session). `wgmma_allowed`: opts.path lets the backward take the wgmma kernels.
template <class ExecSpace>
bool tc_atomic_dq_pays(const ExecSpace& space, int d, bool wgmma_allowed) {
  return (d > 64 || !fa2_dq_problem(space, d).empty()) &&
         !(wgmma_allowed && wgmma_backward_problem(space, d, false).empty());
}

/// Tiles of the tensor-core backward; `fused`: dK/dV with dQ fused in (its dq tiles are then unused);
/// `fa2`: the FA2-layout dK/dV kernel (tc_fa2_backward_runs), else the 16-keys-per-warp one; `fa2_dq`: the
/// FA2-layout dQ kernel (fa2_dq_problem is ""), else TcDqKernel.
template <int D, bool Fused>
BackwardTileConfig tc_backward_tiles(std::size_t l0_max, bool fa2, bool fa2_dq) {
  using S = TcBackwardShape<D, Fused>;
  using F = Fa2BackwardShape<D, Fused>;
  BackwardTileConfig t = fa2 ? backward_tiles_of<F>(l0_max, 32 * F::dkdv_warps, 32 * F::warps)
                             : backward_tiles_of<S>(l0_max, 32 * S::dkdv_warps, 32 * S::warps);
  if (fa2_dq) {
    using Q = Fa2DqShape<D>;
    t.dq.block_q = Q::block_q;
    t.dq.block_k = Q::block_k;
    t.dq.team_size = 32 * Q::warps;
    t.dq.scratch_l0 = Q::smem;
  }
  return t;
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

/// Why the wgmma forward cannot run these inputs ("" when it can); the device probe (wgmma_loaded) last.
template <class ExecSpace>
std::string wgmma_forward_why_not(const ExecSpace& space, int d, long seq_k, const AttentionOptions& opts) {
  if (seq_k > 2147483647L - 256)
    return "seq_k = " + std::to_string(seq_k) + " (the wgmma forward indexes keys with 32-bit ints)";
  if (wgmma_head_dim_supported(d)) {
    static_assert(WgmmaForwardShape<64>::block_q == 128 && WgmmaForwardShape<128>::block_q == 128 &&
                      WgmmaWsForwardShape<64>::block_q == 128 && WgmmaWsForwardShape<128>::block_q == 128,
                  "128 query rows per block in every wgmma forward");
    const int block_k = wgmma_ws_forward(d, opts.softcap > 0) ? WgmmaWsForwardShape<128>::block_k
                        : d == 64                             ? WgmmaForwardShape<64>::block_k
                                                              : WgmmaForwardShape<128>::block_k;
    const std::string why = tc_block_problem(opts, 128, block_k, "forward");
    if (!why.empty()) return why;
  }
  return wgmma_forward_problem(space, d, opts.softcap > 0);
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
inline TileConfig wgmma_forward_tiles(int d, bool softcap, std::size_t smem_max) {
  const bool ws = wgmma_ws_forward(d, softcap);
  return d == 64 ? (ws ? native_forward_tiles<WgmmaWsForwardShape<64>>(smem_max)
                       : native_forward_tiles<WgmmaForwardShape<64>>(smem_max))
                 : (ws ? native_forward_tiles<WgmmaWsForwardShape<128>>(smem_max)
                       : native_forward_tiles<WgmmaForwardShape<128>>(smem_max));
}

/// Why the deterministic backward cannot take the wgmma kernels for these inputs ("" when it can), given that
/// the tensor-core backward can run them; the device probe (wgmma_loaded) last.
template <class ExecSpace>
std::string wgmma_backward_why_not(const ExecSpace& space, int d, bool fused, const AttentionOptions& opts) {
  if (wgmma_head_dim_supported(d)) {
    auto blocks = [&](auto dc) {
      constexpr int D = decltype(dc)::value;
      std::string why = tc_block_problem(opts, WgmmaBackwardShape<D>::block_q, WgmmaBackwardShape<D>::block_k,
                                         "wgmma dK/dV kernel");
      if (why.empty())
        why = tc_block_problem(opts, WgmmaDqRunShape<D>::block_q, WgmmaDqRunShape<D>::block_k, "wgmma dQ kernel");
      return why;
    };
    const std::string why = d == 64 ? blocks(std::integral_constant<int, 64>{}) : blocks(std::integral_constant<int, 128>{});
    if (!why.empty()) return why;
  }
  return wgmma_backward_problem(space, d, fused);
}

/// The tiles of the wgmma backward kernels at head dim D (64 or 128).
template <int D>
BackwardTileConfig wgmma_backward_tiles(std::size_t smem_max) {
  using S = WgmmaBackwardShape<D>;
  using Q = WgmmaDqRunShape<D>;
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
  return d == 64 ? wgmma_backward_tiles<64>(smem_max) : wgmma_backward_tiles<128>(smem_max);
}

/// Tiles of the tensor-core kernels for a head dim they support.
inline TileConfig tc_forward_tiles(int head_dim, std::size_t l0_max) {
  return tc_head_dim_switch(head_dim, [&](auto dc) { return tc_forward_tiles<decltype(dc)::value>(l0_max); });
}
inline TileConfig fa2_forward_tiles(int head_dim, std::size_t smem_max) {
  return fa2_head_dim_switch(head_dim, [&](auto dc) {
    return native_forward_tiles<Fa2ForwardShape<decltype(dc)::value>>(smem_max);
  });
}
inline BackwardTileConfig tc_backward_tiles(int head_dim, std::size_t l0_max, bool fused, bool fa2, bool fa2_dq) {
  return fa2_head_dim_switch(head_dim, [&](auto dc) {
    constexpr int D = decltype(dc)::value;
    return fused ? tc_backward_tiles<D, true>(l0_max, fa2, false) : tc_backward_tiles<D, false>(l0_max, fa2, fa2_dq);
  });
}

/// Why the CUDA fp32 forward (simt_forward.hpp) cannot run these inputs ("" when it can): it needs float
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
  return tc_head_dim_switch(head_dim, [&](auto dc) {
    return native_forward_tiles<Tf32ForwardShape<decltype(dc)::value>>(smem_max);
  });
}

/// Why the CUDA fp32 backward (simt_backward.hpp) cannot run these inputs ("" when it can): what the fp32
/// forward needs, of q, k, v, d_o and of the gradients.
template <class ExecSpace, class QV, class KV, class VV, class DOV, class DQV, class DKV, class DVV>
std::string simt_backward_why_not(const QV& q, const KV& k, const VV& v, const DOV& d_o, const DQV& dq, const DKV& dk,
                                  const DVV& dv, const AttentionOptions& opts) {
  std::string why = simt_forward_why_not<ExecSpace>(q, k, v, q, opts);  // q in o's place: its checks are q's
  tc_add_backward_view_problems(why, q, k, v, d_o, dq, dk, dv);           // (q, k, v already checked: no-ops)
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
    const long league = static_cast<long>(args.q.extent(0)) * static_cast<long>(args.q.extent(2)) * kernel.n_qblocks;
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

template <int D, class ExecSpace, class Args>
void tc_forward_launch_d(const ExecSpace& space, const Args& args) {
#if KFA_HAS_TENSOR_CORES
  using Kernel = TcForwardKernel<D, Args>;
  const Kernel kernel(args);
  const long league = static_cast<long>(args.q.extent(0)) * static_cast<long>(args.q.extent(2)) * kernel.n_qblocks;
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

/// The dK/dV kernel (FuseDq: with dQ accumulated into dq_acc): the wgmma kernel where the plan says so
/// (`wgmma`: wgmma_backward_why_not is ""), else the FA2-layout kernel (natively) where
/// tc_fa2_backward_runs, else the 16-keys-per-warp kernel, under Kokkos where its tiles fit the team
/// scratch, natively otherwise.
template <int D, bool Softcap, bool FuseDq, class ExecSpace, class Args>
void tc_dkdv_launch(const ExecSpace& space, const Args& args, float* dq_acc, bool wgmma) {
#if KFA_HAS_TENSOR_CORES
  const auto& k = args.k;
  if constexpr (!FuseDq && D % 64 == 0 && D <= 128 && std::is_same<ExecSpace, Kokkos::Cuda>::value) {
    if (wgmma) {
      using S = WgmmaBackwardShape<D>;
      auto run = [&](auto tma) {  // the kernel loading by TMA where its descriptors are made, else by cp.async
        using K1 = TcWgmmaDkDvKernel<D, Softcap, decltype(tma)::value, Args>;
        K1 k1(args);
        if (decltype(tma)::value && !k1.set_tma()) return false;
        const long league = static_cast<long>(k.extent(0)) * static_cast<long>(k.extent(2)) * k1.n_kblocks;
        checked_league("kfa::attention_backward", "batch * heads_kv * key blocks", league);
        native_launch(space, "kfa::attention_backward::dkdv[tensor_core_wgmma]", &native_team_kernel<K1>, league,
                      dim3(32, S::warps), S::smem, K1::MIN_BLOCKS, k1);
        return true;
      };
      if (KFA_WGMMA_TMA == 0 || !run(std::true_type{})) run(std::false_type{});
      return;
    }
  }
  const char* name = FuseDq ? "kfa::attention_backward::dkdv_dq[tensor_core]" : "kfa::attention_backward::dkdv[tensor_core]";
  if constexpr (tc_fa2_backward_used<D, FuseDq>()) {
    using S = Fa2BackwardShape<D, FuseDq>;
    if (tc_fa2_backward_runs(space, D, FuseDq)) {
      using K1 = TcFa2DkDvKernel<D, Softcap, FuseDq, Args>;
      const K1 k1(args, dq_acc);
      const long league = static_cast<long>(k.extent(0)) * static_cast<long>(k.extent(2)) * k1.n_kblocks;
      checked_league("kfa::attention_backward", "batch * heads_kv * key blocks", league);
      native_launch(space, name, &native_team_kernel<K1>, league, dim3(32, S::dkdv_warps), S::dkdv_scratch,
                    K1::MIN_BLOCKS, k1);
      return;
    }
  }
  if constexpr (D > 128) {  // the plan checked tc_fa2_backward_runs (tc_backward_problem)
    fail("kfa::attention_backward: the FA2-layout dK/dV kernel, the only one at head_dim = ", D,
         ", does not fit this device's shared memory");
  } else {
  using S = TcBackwardShape<D, FuseDq>;
  using K1 = TcDkDvKernel<D, Softcap, FuseDq, Args>;
  const K1 k1(args, dq_acc);
  const long league = static_cast<long>(k.extent(0)) * static_cast<long>(k.extent(2)) * k1.n_kblocks;
  checked_league("kfa::attention_backward", "batch * heads_kv * key blocks", league);
  // Natively only where the tiles exceed Kokkos' team scratch: the d = 64 body launched natively ran
  // 50% slower than the same body under Kokkos (ncu on the H200: warps stalled on instruction fetch;
  // the cause is not found), the d = 128 one 6% faster than the previous single-stage Kokkos kernel.
  // Tiles above Kokkos CUDA's team-scratch cap (40,936 B up to Kokkos 5.1) are never launched through
  // Kokkos, so that instance is not even compiled (it only cost registers and build time).
  constexpr std::size_t kokkos_cuda_l0_cap = 40936;
  if constexpr (S::dkdv_scratch <= kokkos_cuda_l0_cap) {
    if (S::dkdv_scratch <= static_cast<std::size_t>(compat::scratch_size_max_l0<ExecSpace>())) {
      typename K1::policy_type p1(space, static_cast<int>(league), S::dkdv_warps, 32);
      p1.set_scratch_size(0, Kokkos::PerTeam(S::dkdv_scratch));
      Kokkos::parallel_for(name, p1, k1);
      return;
    }
  }
  native_launch(space, name, &native_team_kernel<K1>, league, dim3(32, S::dkdv_warps), S::dkdv_scratch,
                K1::MIN_BLOCKS, k1);
  }
#else
  (void)space, (void)args, (void)dq_acc, (void)wgmma;
  fail("kfa: tensor-core kernels are not compiled in this build");
#endif
}

/// The tensor-core backward. deterministic: the dK/dV kernel, then the dQ kernel (7 tile products, no atomics;
/// the wgmma kernels where `wgmma`, else the FA2-layout dQ kernel where fa2_dq_problem is "", else
/// TcDqKernel). Otherwise dQ is fused into the dK/dV kernel (5 products) through a zeroed fp32 accumulator
/// allocated here, then converted into dq (the plan passes deterministic = false only where
/// tc_atomic_dq_pays).
template <int D, bool Softcap, class ExecSpace, class Args>
void tc_backward_launch_d(const ExecSpace& space, const Args& args, bool deterministic, bool wgmma,
                          BackwardParts parts) {
#if KFA_HAS_TENSOR_CORES
  using S = TcBackwardShape<D>;
  using DQV = typename Args::dq_type;
  const auto& q = args.q;
  const auto& k = args.k;
  const auto& dq = args.dq;
  const float scale = args.scale;
  if (!deterministic) {  // dQ comes with dK/dV
    if (parts == BackwardParts::dq) return;
    const long n = static_cast<long>(q.extent(0)) * static_cast<long>(q.extent(1)) * static_cast<long>(q.extent(2)) * D;
    Kokkos::View<float*, typename ExecSpace::memory_space> acc(
        Kokkos::view_alloc(space, "kfa::attention_backward::dq_accumulator"), n);  // zeroed on `space`
    if (k.extent(1) > 0)
      tc_dkdv_launch<D, Softcap, true>(space, args, acc.data(), false);
    // dq = scale · acc (acc: fp32 [batch][seq_q][heads_q][D], contiguous), one warp per row.
    const float* a = acc.data();
    const std::int64_t seq_q = static_cast<std::int64_t>(q.extent(1)), heads_q = static_cast<std::int64_t>(q.extent(2));
    for_each_element4(
        "kfa::attention_backward::dq_from_accumulator", space, dq,
        KOKKOS_LAMBDA(const std::int64_t b, const std::int64_t i, const std::int64_t h, const std::int64_t c) {
          dq(b, i, h, c) = static_cast<typename DQV::non_const_value_type>(a[((b * seq_q + i) * heads_q + h) * D + c] * scale);
        });
    return;  // acc's deallocation waits for the device (Kokkos synchronizes before freeing device memory)
  }
  if (k.extent(1) > 0 && parts != BackwardParts::dq)
    tc_dkdv_launch<D, Softcap, false>(space, args, nullptr, wgmma);
  if (q.extent(1) > 0 && parts != BackwardParts::dkdv) {
    if constexpr (D % 64 == 0 && D <= 128 && std::is_same<ExecSpace, Kokkos::Cuda>::value) {
      if (wgmma) {
        wgmma_dq_launch_d<D, Softcap>(space, args);
        return;
      }
    }
    if (fa2_dq_problem(space, D).empty()) {
      fa2_dq_launch_d<D, Softcap>(space, args);
      return;
    }
    if constexpr (D > 128) {  // the plan checked fa2_dq_problem (tc_backward_problem)
      fail("kfa::attention_backward: the FA2-layout dQ kernel, the only one at head_dim = ", D,
           ", does not fit this device's shared memory");
    } else {
    using K2 = TcDqKernel<D, Softcap, Args>;
    const K2 k2(args);
    const long league = static_cast<long>(q.extent(0)) * static_cast<long>(q.extent(2)) * k2.n_qblocks;
    checked_league("kfa::attention_backward", "batch * heads_q * query blocks", league);
    typename K2::policy_type p2(space, static_cast<int>(league), S::warps, 32);
    p2.set_scratch_size(0, Kokkos::PerTeam(S::dq_scratch));
    Kokkos::parallel_for("kfa::attention_backward::dq[tensor_core]", p2, k2);
    }
  }
#else
  (void)space, (void)args, (void)deterministic, (void)wgmma, (void)parts;
  fail("kfa: tensor-core kernels are not compiled in this build");
#endif
}

template <class ExecSpace, class Args>
void tc_backward_launch(const ExecSpace& space, const Args& args, bool deterministic, bool wgmma,
                        BackwardParts parts = BackwardParts::all) {
  fa2_head_dim_switch(static_cast<int>(args.q.extent(3)), [&](auto dc) {
    constexpr int D = decltype(dc)::value;
    if (args.softcap > 0.f)
      tc_backward_launch_d<D, true>(space, args, deterministic, wgmma, parts);
    else
      tc_backward_launch_d<D, false>(space, args, deterministic, wgmma, parts);
  });
}

}  // namespace detail
}  // namespace kfa
