#pragma once
/// Public attention API: exact softmax(scale·q·kᵀ + mask)·v without ever storing the seq_q × seq_k matrix.
#include <kfa/detail/backward_kernel.hpp>
#include <kfa/detail/checks.hpp>
#include <kfa/detail/forward_kernel.hpp>
#include <kfa/detail/ranges.hpp>
#include <kfa/detail/tc_dispatch.hpp>
#include <kfa/options.hpp>
#include <kfa/paths.hpp>
#include <kfa/tiling.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

namespace kfa {

namespace detail {
template <class T>
double resolved_scale(const AttentionOptions& opts, std::size_t head_dim) {
  return opts.softmax_scale > 0 ? opts.softmax_scale : 1.0 / std::sqrt(static_cast<double>(head_dim));
}

template <class ExecSpace, class QV, class KV, class VV, class OV, class LV>
void static_check_forward() {
  static_check_view<ExecSpace, QV, 4, false>();
  static_check_view<ExecSpace, KV, 4, false>();
  static_check_view<ExecSpace, VV, 4, false>();
  static_check_view<ExecSpace, OV, 4, true>();
  static_check_view<ExecSpace, LV, 3, true>();
  using T = typename QV::non_const_value_type;
  static_assert(is_supported_element<T>::value, "kfa: element type must be double, float, half or bfloat16");
  static_assert(std::is_same<T, typename KV::non_const_value_type>::value &&
                    std::is_same<T, typename VV::non_const_value_type>::value &&
                    std::is_same<T, typename OV::non_const_value_type>::value,
                "kfa: q, k, v and o must have the same element type");
  static_assert(std::is_same<accumulator_t<T>, typename LV::non_const_value_type>::value,
                "kfa: lse must hold the accumulation type (double for double inputs, float otherwise)");
}

/// All run-time checks of attention_forward and reference_attention.
template <class QV, class KV, class VV, class OV, class LV>
void check_forward(const char* fn, const QV& q, const KV& k, const VV& v, const OV& o, const LV& lse,
                   const AttentionOptions& opts) {
  check_qkv_and_options(fn, q, k, v, opts);
  check_extents(fn, "o", o, {q.extent(0), q.extent(1), q.extent(2), q.extent(3)});
  check_extents(fn, "lse", lse, {q.extent(0), q.extent(2), q.extent(1)});
  check_no_alias(fn, "o", o, "q", q);
  check_no_alias(fn, "o", o, "k", k);
  check_no_alias(fn, "o", o, "v", v);
  check_no_alias(fn, "lse", lse, "q", q);
  check_no_alias(fn, "lse", lse, "k", k);
  check_no_alias(fn, "lse", lse, "v", v);
  check_no_alias(fn, "lse", lse, "o", o);
}
template <class ExecSpace, class QV, class KV, class VV, class OV, class DOV, class LV, class DQV, class DKV,
          class DVV>
void static_check_backward() {
  static_check_forward<ExecSpace, QV, KV, VV, OV, LV>();
  static_check_view<ExecSpace, DOV, 4, false>();
  static_check_view<ExecSpace, DQV, 4, true>();
  static_check_view<ExecSpace, DKV, 4, true>();
  static_check_view<ExecSpace, DVV, 4, true>();
  using T = typename QV::non_const_value_type;
  static_assert(std::is_same<T, typename DOV::non_const_value_type>::value &&
                    std::is_same<T, typename DQV::non_const_value_type>::value &&
                    std::is_same<T, typename DKV::non_const_value_type>::value &&
                    std::is_same<T, typename DVV::non_const_value_type>::value,
                "kfa: d_o, dq, dk and dv must have the same element type as q");
}

/// All run-time checks of attention_backward and reference_attention_backward.
template <class QV, class KV, class VV, class OV, class DOV, class LV, class DQV, class DKV, class DVV>
void check_backward(const char* fn, const QV& q, const KV& k, const VV& v, const OV& o, const DOV& d_o, const LV& lse,
                    const DQV& dq, const DKV& dk, const DVV& dv, const AttentionOptions& opts) {
  check_qkv_and_options(fn, q, k, v, opts);
  check_extents(fn, "o", o, {q.extent(0), q.extent(1), q.extent(2), q.extent(3)});
  check_extents(fn, "d_o", d_o, {q.extent(0), q.extent(1), q.extent(2), q.extent(3)});
  check_extents(fn, "lse", lse, {q.extent(0), q.extent(2), q.extent(1)});
  check_extents(fn, "dq", dq, {q.extent(0), q.extent(1), q.extent(2), q.extent(3)});
  check_extents(fn, "dk", dk, {k.extent(0), k.extent(1), k.extent(2), k.extent(3)});
  check_extents(fn, "dv", dv, {k.extent(0), k.extent(1), k.extent(2), k.extent(3)});
  auto inputs_of = [&](const char* out_name, const auto& out) {
    check_no_alias(fn, out_name, out, "q", q);
    check_no_alias(fn, out_name, out, "k", k);
    check_no_alias(fn, out_name, out, "v", v);
    check_no_alias(fn, out_name, out, "o", o);
    check_no_alias(fn, out_name, out, "d_o", d_o);
    check_no_alias(fn, out_name, out, "lse", lse);
  };
  inputs_of("dq", dq);
  inputs_of("dk", dk);
  inputs_of("dv", dv);
  check_no_alias(fn, "dq", dq, "dk", dk);
  check_no_alias(fn, "dq", dq, "dv", dv);
  check_no_alias(fn, "dk", dk, "dv", dv);
}
}  // namespace detail

/// Tiles the portable forward kernel would use for these inputs on `space` (see TileConfig). The CUDA
/// kernels (tensor-core half/bfloat16, fp32 SIMT) have fixed tiles per head dim, named in the profiling
/// region of each call and in README.md.
template <class ExecSpace, class QV, class KV>
TileConfig forward_tile_config(const ExecSpace& space, const QV& q, const KV& k, const AttentionOptions& opts = {}) {
  using Acc = accumulator_t<typename QV::non_const_value_type>;
  return forward_tile_config<ExecSpace, Acc>(space, static_cast<int>(q.extent(3)), static_cast<long>(q.extent(1)),
                                             static_cast<long>(k.extent(1)),
                                             static_cast<long>(q.extent(0) * q.extent(2)), opts);
}

/// What a forward call runs: the kernel family (never automatic or tensor_core: what they resolved to),
/// its tiles and the name of the Kokkos profiling region it runs in.
struct ForwardPlan {
  TileProductPath family;
  TileConfig tiles;
  std::string region;
};

namespace detail {
/// The one place the forward's family is chosen: each family says why it cannot run these inputs ("" when
/// it can); opts.path picks among those that can, in the order wgmma, fa2, team, tf32x3, simt, portable.
template <class ExecSpace, class QV, class KV, class VV, class OV>
ForwardPlan forward_plan(const char* fn, const ExecSpace& space, const QV& q, const KV& k, const VV& v, const OV& o,
                         const AttentionOptions& opts) {
  using T = typename QV::non_const_value_type;
  using P = TileProductPath;
  const int d = static_cast<int>(q.extent(3));
  std::string views_why;
  tc_add_forward_view_problems(views_why, q, k, v, o);
  std::string tc_why = tc_space_problem<ExecSpace, T>(space, d);
  if (tc_why.empty()) tc_why = views_why;
  std::string fa2_why = tc_space_problem<ExecSpace, T>(space, d, true);  // the FA2-layout kernels also have d = 256
  if (fa2_why.empty()) fa2_why = views_why;
  if (fa2_why.empty()) fa2_why = fa2_forward_why_not(space, d, static_cast<long>(k.extent(1)), opts);
  std::string wgmma_why = tc_why;  // asked only where a tensor-core forward can run (it may probe the device)
  if (wgmma_why.empty()) wgmma_why = wgmma_forward_why_not(space, d, static_cast<long>(k.extent(1)), opts);
  const std::string team_why =
      tc_why.empty() ? tc_block_problem(opts, TcForwardShape<64>::block_q, TcForwardShape<64>::block_k, "forward") : tc_why;
  const std::string tf32_why = tf32_forward_why_not(space, q, k, v, o, opts);
  const std::string simt_why = simt_forward_why_not<ExecSpace>(q, k, v, o, opts);
  auto need = [&](P family, const std::string& why) {
    if (!why.empty()) fail(fn, ": opts.path = ", to_string(family), " but ", why);
    return family;
  };
  P family = P::portable;
  switch (opts.path) {
    case P::portable: family = P::portable; break;
    case P::tensor_core_fa2: family = need(P::tensor_core_fa2, fa2_why); break;
    case P::tensor_core_team: family = need(P::tensor_core_team, team_why); break;
    case P::simt_fp32: family = need(P::simt_fp32, simt_why); break;
    case P::tensor_core_tf32x3: family = need(P::tensor_core_tf32x3, tf32_why); break;
    case P::tensor_core_wgmma: family = need(P::tensor_core_wgmma, wgmma_why); break;
    case P::tensor_core:  // no family can run: each one's reason (at d = 256 the team one is only the head dim)
      family = wgmma_why.empty()  ? P::tensor_core_wgmma
               : fa2_why.empty()  ? P::tensor_core_fa2
               : team_why.empty() ? P::tensor_core_team
                                  : need(P::tensor_core, "the FA2-layout forward cannot run (" + fa2_why +
                                                             ") nor the team forward (" + team_why + ")");
      break;
    case P::automatic:
      family = wgmma_why.empty()  ? P::tensor_core_wgmma
               : fa2_why.empty()  ? P::tensor_core_fa2
               : team_why.empty() ? P::tensor_core_team
               : tf32_why.empty() ? P::tensor_core_tf32x3
               : simt_why.empty() ? P::simt_fp32
                                  : P::portable;
      break;
  }
  const std::size_t l0_max = static_cast<std::size_t>(compat::scratch_size_max_l0<ExecSpace>());
  TileConfig tiles;
  switch (family) {
    case P::tensor_core_fa2:
      tiles = fa2_forward_tiles(d, native_smem_max(space));
      break;
    case P::tensor_core_team: tiles = tc_forward_tiles(d, l0_max); break;
    case P::tensor_core_wgmma: tiles = wgmma_forward_tiles(d, opts.softcap > 0, native_smem_max(space)); break;
    case P::tensor_core_tf32x3: tiles = tf32_forward_tiles(d, native_smem_max(space)); break;
    case P::simt_fp32: tiles = d == 64 ? simt_forward_tiles<64>(l0_max) : simt_forward_tiles<128>(l0_max); break;
    default: {
      tiles = forward_tile_config(space, q, k, opts);
      const auto l1_max = static_cast<std::size_t>(Kokkos::TeamPolicy<ExecSpace>::scratch_size_max(1));
      if (opts.block_q > 0 && tiles.scratch_l1 > l1_max)
        fail(fn, ": opts.block_q = ", opts.block_q, " needs ", tiles.scratch_l1,
             " B of level-1 scratch, more than the backend's ", l1_max);
    }
  }
  return {family, tiles,
          std::string(fn) + "[" + to_string(family) + "," + dtype_name<T>() + ",d" + std::to_string(d) + "," +
              to_string(tiles) + "]"};
}

/// attention_forward after its checks, for a block at `pos` of a longer sequence (the ring layer's entry).
template <class ExecSpace, class QV, class KV, class VV, class OV, class LV>
void forward_impl(const char* fn, const ExecSpace& space, const QV& q, const KV& k, const VV& v, const OV& o,
                  const LV& lse, const AttentionOptions& opts, const Positions& pos) {
  using T = typename QV::non_const_value_type;
  using Acc = accumulator_t<T>;
  using P = TileProductPath;
  const ForwardPlan plan = forward_plan(fn, space, q, k, v, o, opts);
  compat::ScopedRegion region(plan.region);
  if (q.extent(0) == 0 || q.extent(1) == 0 || q.extent(2) == 0) return;
  const KeyMask mask(static_cast<long>(q.extent(1)), static_cast<long>(k.extent(1)), pos, opts.causal,
                     opts.window_left, opts.window_right);
  const double scale = resolved_scale<T>(opts, q.extent(3));
  const float scale32 = static_cast<float>(scale), softcap32 = static_cast<float>(opts.softcap);
  switch (plan.family) {
    case P::tensor_core_fa2:
#if KFA_HAS_TENSOR_CORES
      if constexpr (has_tensor_core_path<ExecSpace, T>::value) fa2_forward_launch(space, q, k, v, o, lse, scale32, softcap32, mask);
#endif
      return;
    case P::tensor_core_team:
      if constexpr (has_tensor_core_path<ExecSpace, T>::value) tc_forward_launch(space, q, k, v, o, lse, scale32, softcap32, mask);
      return;
    case P::tensor_core_wgmma:
#if KFA_HAS_TENSOR_CORES
      if constexpr (has_tensor_core_path<ExecSpace, T>::value)
        wgmma_forward_launch(space, q, k, v, o, lse, scale32, softcap32, mask);
#endif
      return;
    case P::tensor_core_tf32x3:
#if KFA_HAS_TENSOR_CORES
      if constexpr (std::is_same<ExecSpace, Kokkos::Cuda>::value && std::is_same<T, float>::value)
        tf32_forward_launch(space, q, k, v, o, lse, scale32, softcap32, mask);
#endif
      return;
    case P::simt_fp32:
      if (q.extent(3) == 64)
        simt_forward_launch_d<64>(space, q, k, v, o, lse, scale32, softcap32, mask);
      else
        simt_forward_launch_d<128>(space, q, k, v, o, lse, scale32, softcap32, mask);
      return;
    default: break;
  }
  using Kernel = ForwardKernel<ExecSpace, QV, KV, VV, OV, LV>;
  const Kernel kernel(q, k, v, o, lse, static_cast<Acc>(scale), static_cast<Acc>(opts.softcap), mask, plan.tiles);
  const long league = static_cast<long>(q.extent(0)) * static_cast<long>(q.extent(2)) * kernel.n_qblocks;
  if (league > 2147483647L) fail(fn, ": batch * heads_q * query blocks = ", league, " exceeds 2^31 - 1");
  Kokkos::TeamPolicy<ExecSpace> policy(space, static_cast<int>(league), plan.tiles.team_size);
  policy.set_scratch_size(0, Kokkos::PerTeam(plan.tiles.scratch_l0))
      .set_scratch_size(1, Kokkos::PerTeam(plan.tiles.scratch_l1));
  Kokkos::parallel_for("kfa::attention_forward", policy, kernel);
}
}  // namespace detail

/// Which kernel family attention_forward(space, q, k, v, o, lse, opts) runs, with its tiles and profiling
/// region; throws the kfa::Error the call would throw when opts.path names a family that cannot run.
template <class ExecSpace, class QV, class KV, class VV, class OV>
ForwardPlan plan_forward(const ExecSpace& space, const QV& q, const KV& k, const VV& v, const OV& o,
                         const AttentionOptions& opts = {}) {
  constexpr const char* fn = "kfa::attention_forward";
  detail::check_qkv_and_options(fn, q, k, v, opts);
  detail::check_extents(fn, "o", o, {q.extent(0), q.extent(1), q.extent(2), q.extent(3)});
  return detail::forward_plan(fn, space, q, k, v, o, opts);
}

/// Exact attention forward. q [batch, seq_q, heads_q, d]; k, v [batch, seq_k, heads_kv, d];
/// o [batch, seq_q, heads_q, d] (output); lse [batch, heads_q, seq_q] (output, natural-log log-sum-exp of
/// the scaled, softcapped, masked scores; −inf for a row that sees no key, whose o row is 0).
/// heads_q must be a multiple of heads_kv (GQA/MQA). Asynchronous on `space`, like any Kokkos kernel.
template <class ExecSpace, class QV, class KV, class VV, class OV, class LV>
void attention_forward(const ExecSpace& space, const QV& q, const KV& k, const VV& v, const OV& o, const LV& lse,
                       const AttentionOptions& opts = {}) {
  detail::static_check_forward<ExecSpace, QV, KV, VV, OV, LV>();
  constexpr const char* fn = "kfa::attention_forward";
  detail::check_forward(fn, q, k, v, o, lse, opts);
  detail::forward_impl(fn, space, q, k, v, o, lse, opts, detail::Positions{});
}

/// Tiles the portable backward kernels would use for these inputs on `space` (see BackwardTileConfig);
/// the tensor-core kernels' fixed tiles are named in their profiling region.
template <class ExecSpace, class QV, class KV>
BackwardTileConfig backward_tile_config(const ExecSpace& space, const QV& q, const KV& k,
                                        const AttentionOptions& opts = {}) {
  using Acc = accumulator_t<typename QV::non_const_value_type>;
  return backward_tile_config<ExecSpace, Acc>(space, static_cast<int>(q.extent(3)), static_cast<long>(q.extent(1)),
                                              static_cast<long>(k.extent(1)),
                                              static_cast<long>(q.extent(0) * q.extent(2)),
                                              static_cast<long>(k.extent(0) * k.extent(2)), opts);
}

/// What a backward call runs: tensor_core or portable, its tiles (dK/dV and dQ kernels) and the name of its
/// Kokkos profiling region.
struct BackwardPlan {
  TileProductPath family;
  BackwardTileConfig tiles;  ///< with atomic_dq only tiles.dkdv is used
  std::string region;
  /// dQ accumulated with atomic adds inside the dK/dV kernel (opts.deterministic = false and the
  /// tensor-core family); otherwise a separate dQ kernel, bitwise reproducible.
  bool atomic_dq = false;
  /// dK, dV and dQ from the wgmma kernels (tensor-core family, deterministic, head dim 64 or 128, sm_90a on a
  /// compute capability 9.0 device; opts.path automatic, tensor_core or tensor_core_wgmma); otherwise the
  /// FA2-layout or the 16-keys-per-warp dK/dV kernel and the FA2-layout or TcDqKernel dQ kernel.
  bool wgmma = false;
};

namespace detail {
/// D[b, h, i] = Σ_c dO ∘ O over the rows of o, in the accumulation type (the backward's row term).
template <class ExecSpace, class OV, class DOV>
Kokkos::View<accumulator_t<typename OV::non_const_value_type>***, Kokkos::LayoutRight, typename ExecSpace::memory_space>
backward_row_dot(const ExecSpace& space, const OV& o, const DOV& d_o) {
  using Acc = accumulator_t<typename OV::non_const_value_type>;
  const int batch = static_cast<int>(o.extent(0)), nq = static_cast<int>(o.extent(1)), hq = static_cast<int>(o.extent(2));
  Kokkos::View<Acc***, Kokkos::LayoutRight, typename ExecSpace::memory_space> dd(
      Kokkos::view_alloc(space, Kokkos::WithoutInitializing, "kfa::attention_backward::D"), batch, hq, nq);
  // One warp per row on a GPU (before: one thread per row over a rank-3 MDRange, each thread reading its own
  // row, d elements apart from its neighbours'; perf/RESULTS.md has what it cost).
  for_each_row_sum4<Acc>(
      "kfa::attention_backward::D", space, o,
      KOKKOS_LAMBDA(const std::int64_t b, const std::int64_t i, const std::int64_t h, const std::int64_t c) {
        return static_cast<Acc>(d_o(b, i, h, c)) * static_cast<Acc>(o(b, i, h, c));
      },
      KOKKOS_LAMBDA(const std::int64_t b, const std::int64_t i, const std::int64_t h, const Acc s) { dd(b, h, i) = s; });
  return dd;
}

/// The one place the backward's family is chosen: tensor_core where it can run (the tensor-core backward
/// serves every 16-bit tensor-core forward family), else tensor_core_tf32x3 (float on CUDA sm_80+), else
/// simt_fp32 (float on CUDA), else portable; opts.path names one of them (tensor_core_team,
/// tensor_core_fa2 and tensor_core_wgmma name the tensor-core backward; its kernels are the wgmma ones where
/// those can run, except when opts.path names tensor_core_fa2 or tensor_core_team).
template <class ExecSpace, class QV, class KV, class VV, class DOV, class DQV, class DKV, class DVV>
BackwardPlan backward_plan(const char* fn, const ExecSpace& space, const QV& q, const KV& k, const VV& v,
                           const DOV& d_o, const DQV& dq, const DKV& dk, const DVV& dv, const AttentionOptions& opts) {
  using T = typename QV::non_const_value_type;
  using P = TileProductPath;
  const int d = static_cast<int>(q.extent(3));
  const bool wgmma_allowed = opts.path != P::tensor_core_fa2 && opts.path != P::tensor_core_team;
  const bool fused = !opts.deterministic && tc_atomic_dq_pays(space, d, wgmma_allowed);  // atomic dQ where faster
  std::string why_not = tc_space_problem<ExecSpace, T>(space, d, true);  // d = 256: the FA2-layout kernels only
  if (why_not.empty()) why_not = tc_backward_problem(space, d, fused);
  const bool fa2 = why_not.empty() && tc_fa2_backward_runs(space, d, fused);
  const bool fa2_dq = why_not.empty() && !fused && fa2_dq_problem(space, d).empty();
  if (why_not.empty()) {
    const BackwardTileConfig t = tc_backward_tiles(d, 0, fused, fa2, fa2_dq);
    // one override serves both kernels only where they agree; the portable path honours any
    why_not = tc_block_problem(opts, t.dkdv.block_q, t.dkdv.block_k, "backward");
    if (why_not.empty() && !fused) why_not = tc_block_problem(opts, t.dq.block_q, t.dq.block_k, "backward");
  }
  // asked only where the tensor-core backward can run (it may probe the device)
  const std::string wgmma_why = why_not.empty() ? wgmma_backward_why_not(space, d, fused, opts) : why_not;
  tc_add_backward_view_problems(why_not, q, k, v, d_o, dq, dk, dv);
  const std::string tf32_why = tf32_backward_why_not(space, q, k, v, d_o, dq, dk, dv, opts);
  const std::string simt_why = simt_backward_why_not<ExecSpace>(q, k, v, d_o, dq, dk, dv, opts);
  auto need = [&](const std::string& why) {
    if (!why.empty()) fail(fn, ": opts.path = ", to_string(opts.path), " but ", why);
  };
  P family = P::portable;
  switch (opts.path) {
    case P::portable: family = P::portable; break;
    case P::simt_fp32: need(simt_why), family = P::simt_fp32; break;
    case P::tensor_core_tf32x3: need(tf32_why), family = P::tensor_core_tf32x3; break;
    case P::tensor_core:
    case P::tensor_core_team:
    case P::tensor_core_fa2:
    case P::tensor_core_wgmma: need(why_not), family = P::tensor_core; break;
    case P::automatic:
      family = why_not.empty()    ? P::tensor_core
               : tf32_why.empty() ? P::tensor_core_tf32x3
               : simt_why.empty() ? P::simt_fp32
                                  : P::portable;
      break;
  }
  const bool tc = family == P::tensor_core;
  const bool wgmma = tc && wgmma_why.empty() && wgmma_allowed;
  const std::size_t l0_max = static_cast<std::size_t>(compat::scratch_size_max_l0<ExecSpace>());
  BackwardTileConfig tiles = tc                                 ? tc_backward_tiles(d, l0_max, fused, fa2, fa2_dq)
                             : family == P::tensor_core_tf32x3 ? tf32_backward_tiles(d, native_smem_max(space))
                             : family == P::simt_fp32          ? (d == 64 ? simt_backward_tiles<64>(l0_max)
                                                                           : simt_backward_tiles<128>(l0_max))
                                                                : backward_tile_config(space, q, k, opts);
  if (tc && tiles.dkdv.scratch_l0 > l0_max) tiles.dkdv.scratch_l0_max = native_smem_max(space);  // launched natively
  if (tc && fa2_dq) tiles.dq.scratch_l0_max = native_smem_max(space);
  if (wgmma) tiles = wgmma_backward_tiles(d, native_smem_max(space));
  const std::size_t l1_max = static_cast<std::size_t>(Kokkos::TeamPolicy<ExecSpace>::scratch_size_max(1));
  if (family == P::portable && (tiles.dkdv.scratch_l1 > l1_max || tiles.dq.scratch_l1 > l1_max))
    fail(fn, ": tiles ", to_string(tiles), " need ", std::max(tiles.dkdv.scratch_l1, tiles.dq.scratch_l1),
         " B of level-1 scratch, more than the backend's ", l1_max, " B; lower opts.block_q / block_k");
  const bool atomic_dq = tc && fused;
  return {family, tiles,
          std::string(fn) + "[" + to_string(family) + (atomic_dq ? ",atomic_dq," : wgmma ? ",wgmma," : ",") +
              dtype_name<T>() + ",d" + std::to_string(d) + "," + to_string(tiles) + "]",
          atomic_dq, wgmma};
}

/// backward_impl with D = rowsum(dO ∘ O) given (`dd` [batch, heads_q, seq_q] of these query rows): the ring
/// computes D once for a rank's whole shard instead of once per block. `parts` picks the kernels (see
/// BackwardParts); returns whether this call wrote dq.
template <class ExecSpace, class QV, class KV, class VV, class DOV, class LV, class DD, class DQV, class DKV, class DVV>
bool backward_impl_d(const char* fn, const ExecSpace& space, const QV& q, const KV& k, const VV& v, const DOV& d_o,
                     const LV& lse, const DD& dd, const DQV& dq, const DKV& dk, const DVV& dv,
                     const AttentionOptions& opts, const Positions& pos, BackwardParts parts = BackwardParts::all) {
  using T = typename QV::non_const_value_type;
  using Acc = accumulator_t<T>;
  const BackwardPlan plan = backward_plan(fn, space, q, k, v, d_o, dq, dk, dv, opts);
  const BackwardTileConfig& tiles = plan.tiles;
  compat::ScopedRegion region(plan.region);
  const bool dq_with_dkdv = plan.family == TileProductPath::tensor_core && plan.atomic_dq;
  const bool wrote_dq = parts == BackwardParts::all || (parts == BackwardParts::dkdv) == dq_with_dkdv;
  const int batch = static_cast<int>(q.extent(0)), nq = static_cast<int>(q.extent(1));
  const int hq = static_cast<int>(q.extent(2)), nk = static_cast<int>(k.extent(1));
  if (batch == 0) return wrote_dq;
  if (hq == 0) {  // no query head uses k and v: their gradients are zero
    if (parts == BackwardParts::dq) return wrote_dq;
    zero4(space, dk, "kfa::attention_backward::zero_dk");
    zero4(space, dv, "kfa::attention_backward::zero_dv");
    return wrote_dq;
  }

  const Acc scale = static_cast<Acc>(resolved_scale<T>(opts, q.extent(3)));
  const KeyMask mask(nq, nk, pos, opts.causal, opts.window_left, opts.window_right);
  if (plan.family == TileProductPath::tensor_core) {
    if constexpr (has_tensor_core_path<ExecSpace, T>::value)
      tc_backward_launch(space, q, k, v, d_o, lse, dd, dq, dk, dv, static_cast<float>(scale),
                         static_cast<float>(opts.softcap), mask, !plan.atomic_dq, plan.wgmma, parts);
    return wrote_dq;
  }
  if (plan.family == TileProductPath::tensor_core_tf32x3) {
#if KFA_HAS_TENSOR_CORES
    if constexpr (std::is_same<ExecSpace, Kokkos::Cuda>::value && std::is_same<T, float>::value)
      tf32_backward_launch(space, q, k, v, d_o, lse, dd, dq, dk, dv, static_cast<float>(scale),
                           static_cast<float>(opts.softcap), mask, parts);
#endif
    return wrote_dq;
  }
  if (plan.family == TileProductPath::simt_fp32) {
    if (q.extent(3) == 64)
      simt_backward_launch_d<64>(space, q, k, v, d_o, lse, dd, dq, dk, dv, static_cast<float>(scale),
                                 static_cast<float>(opts.softcap), mask, parts);
    else
      simt_backward_launch_d<128>(space, q, k, v, d_o, lse, dd, dq, dk, dv, static_cast<float>(scale),
                                  static_cast<float>(opts.softcap), mask, parts);
    return wrote_dq;
  }
  if (nk > 0 && parts != BackwardParts::dq) {
    using K1 = DkDvKernel<ExecSpace, QV, KV, VV, DOV, LV, DD, DKV, DVV>;
    const K1 k1(q, k, v, d_o, lse, dd, dk, dv, scale, static_cast<Acc>(opts.softcap), mask, tiles.dkdv);
    const long league = static_cast<long>(batch) * static_cast<long>(k.extent(2)) * k1.n_kblocks;
    if (league > 2147483647L) fail(fn, ": batch * heads_kv * key blocks = ", league, " exceeds 2^31 - 1");
    Kokkos::TeamPolicy<ExecSpace> p1(space, static_cast<int>(league), tiles.dkdv.team_size);
    p1.set_scratch_size(0, Kokkos::PerTeam(tiles.dkdv.scratch_l0))
        .set_scratch_size(1, Kokkos::PerTeam(tiles.dkdv.scratch_l1));
    Kokkos::parallel_for("kfa::attention_backward::dkdv", p1, k1);
  }
  if (nq > 0 && parts != BackwardParts::dkdv) {
    using K2 = DqKernel<ExecSpace, QV, KV, VV, DOV, LV, DD, DQV>;
    const K2 k2(q, k, v, d_o, lse, dd, dq, scale, static_cast<Acc>(opts.softcap), mask, tiles.dq);
    const long league = static_cast<long>(batch) * hq * k2.n_qblocks;
    if (league > 2147483647L) fail(fn, ": batch * heads_q * query blocks = ", league, " exceeds 2^31 - 1");
    Kokkos::TeamPolicy<ExecSpace> p2(space, static_cast<int>(league), tiles.dq.team_size);
    p2.set_scratch_size(0, Kokkos::PerTeam(tiles.dq.scratch_l0)).set_scratch_size(1, Kokkos::PerTeam(tiles.dq.scratch_l1));
    Kokkos::parallel_for("kfa::attention_backward::dq", p2, k2);
  }
  return wrote_dq;
}

/// attention_backward after its checks, for a block at `pos` of a longer sequence (lse and o of the whole
/// rows, so P and D are exact): overwrites dq, dk, dv with this block's contributions.
template <class ExecSpace, class QV, class KV, class VV, class OV, class DOV, class LV, class DQV, class DKV,
          class DVV>
void backward_impl(const char* fn, const ExecSpace& space, const QV& q, const KV& k, const VV& v, const OV& o,
                   const DOV& d_o, const LV& lse, const DQV& dq, const DKV& dk, const DVV& dv,
                   const AttentionOptions& opts, const Positions& pos) {
  backward_impl_d(fn, space, q, k, v, d_o, lse, backward_row_dot(space, o, d_o), dq, dk, dv, opts, pos);
}

}  // namespace detail

/// Which kernel family attention_backward(space, q, k, v, o, d_o, lse, dq, dk, dv, opts) runs, with its
/// tiles and profiling region; throws the kfa::Error the call would throw when opts.path cannot be honoured.
template <class ExecSpace, class QV, class KV, class VV, class DOV, class DQV, class DKV, class DVV>
BackwardPlan plan_backward(const ExecSpace& space, const QV& q, const KV& k, const VV& v, const DOV& d_o,
                           const DQV& dq, const DKV& dk, const DVV& dv, const AttentionOptions& opts = {}) {
  constexpr const char* fn = "kfa::attention_backward";
  detail::check_qkv_and_options(fn, q, k, v, opts);
  detail::check_extents(fn, "d_o", d_o, {q.extent(0), q.extent(1), q.extent(2), q.extent(3)});
  detail::check_extents(fn, "dq", dq, {q.extent(0), q.extent(1), q.extent(2), q.extent(3)});
  detail::check_extents(fn, "dk", dk, {k.extent(0), k.extent(1), k.extent(2), k.extent(3)});
  detail::check_extents(fn, "dv", dv, {k.extent(0), k.extent(1), k.extent(2), k.extent(3)});
  return detail::backward_plan(fn, space, q, k, v, d_o, dq, dk, dv, opts);
}

/// Exact attention backward by recomputation: dq [batch, seq_q, heads_q, d], dk and dv
/// [batch, seq_k, heads_kv, d] (outputs, overwritten) from q, k, v, the forward's o and lse, and d_o
/// (like q). Same options as the forward call that produced o and lse. Deterministic by default: no
/// atomics; dK and dV of a shared KV head are summed over its query heads in a fixed order; allocates only
/// D = rowsum(dO ∘ O) [batch, heads_q, seq_q]. With opts.deterministic = false the tensor-core family
/// accumulates dq with atomics (faster; see AttentionOptions::deterministic). Asynchronous on `space`.
template <class ExecSpace, class QV, class KV, class VV, class OV, class DOV, class LV, class DQV, class DKV,
          class DVV>
void attention_backward(const ExecSpace& space, const QV& q, const KV& k, const VV& v, const OV& o, const DOV& d_o,
                        const LV& lse, const DQV& dq, const DKV& dk, const DVV& dv,
                        const AttentionOptions& opts = {}) {
  detail::static_check_backward<ExecSpace, QV, KV, VV, OV, DOV, LV, DQV, DKV, DVV>();
  constexpr const char* fn = "kfa::attention_backward";
  detail::check_backward(fn, q, k, v, o, d_o, lse, dq, dk, dv, opts);
  detail::backward_impl(fn, space, q, k, v, o, d_o, lse, dq, dk, dv, opts, detail::Positions{});
}

}  // namespace kfa
