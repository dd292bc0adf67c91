#pragma once
/// Public attention API: exact softmax(scale·q·kᵀ + mask)·v without ever storing the seq_q × seq_k matrix.
#include <kfa/detail/backward_kernel.hpp>
#include <kfa/detail/canonical.hpp>
#include <kfa/detail/checks.hpp>
#include <kfa/detail/forward_kernel.hpp>
#include <kfa/detail/kernel_args.hpp>
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
#include <tuple>
#include <type_traits>

namespace kfa {

namespace detail {
template <class T>
double resolved_scale(const AttentionOptions& opts, std::size_t head_dim) {
  return opts.softmax_scale > 0 ? opts.softmax_scale : 1.0 / std::sqrt(static_cast<double>(head_dim));
}

/// The element types of q, k, v, o and lse (forward and backward).
template <class QV, class KV, class VV, class OV, class LV>
void static_check_elements() {
  using T = typename QV::non_const_value_type;
  static_assert(is_supported_element<T>::value, "kfa: element type must be double, float, half or bfloat16");
  static_assert(std::is_same<T, typename KV::non_const_value_type>::value &&
                    std::is_same<T, typename VV::non_const_value_type>::value &&
                    std::is_same<T, typename OV::non_const_value_type>::value,
                "kfa: q, k, v and o must have the same element type");
  static_assert(std::is_same<accumulator_t<T>, typename LV::non_const_value_type>::value,
                "kfa: lse must hold the accumulation type (double for double inputs, float otherwise)");
}

template <class ExecSpace, class QV, class KV, class VV, class OV, class LV>
void static_check_forward() {
  static_check_view<ExecSpace, QV, 4, false>();
  static_check_view<ExecSpace, KV, 4, false>();
  static_check_view<ExecSpace, VV, 4, false>();
  static_check_view<ExecSpace, OV, 4, true>();
  static_check_view<ExecSpace, LV, 3, true>();
  static_check_elements<QV, KV, VV, OV, LV>();
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
  static_check_view<ExecSpace, QV, 4, false>();
  static_check_view<ExecSpace, KV, 4, false>();
  static_check_view<ExecSpace, VV, 4, false>();
  static_check_view<ExecSpace, OV, 4, false>();  // the forward's outputs are the backward's inputs: may be const
  static_check_view<ExecSpace, LV, 3, false>();
  static_check_elements<QV, KV, VV, OV, LV>();
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
/// What a forward family looks at to decide whether it can run a call, size its tiles and launch it.
template <class ExecSpace, class QV, class KV, class VV, class OV>
struct ForwardCall {
  using exec_space = ExecSpace;
  using q_type = QV;
  using k_type = KV;
  using v_type = VV;
  using o_type = OV;
  using T = typename QV::non_const_value_type;
  const char* fn;  ///< the API function the call came through (its errors name it)
  const ExecSpace& space;
  QV q;  // canonical (unmanaged) Views, held by value: see forward_call
  KV k;
  VV v;
  OV o;
  const AttentionOptions& opts;
  int d;
  long seq_k;
  std::string views_why;  ///< why the tensor-core kernels cannot read or write these views ("" when they can)
  ForwardCall(const char* f, const ExecSpace& s, const QV& q_, const KV& k_, const VV& v_, const OV& o_,
              const AttentionOptions& op)
      : fn(f), space(s), q(q_), k(k_), v(v_), o(o_), opts(op), d(static_cast<int>(q_.extent(3))),
        seq_k(static_cast<long>(k_.extent(1))) {
    tc_add_forward_view_problems(views_why, q, k, v, o);
  }
  /// The tensor-core families' common problem: the space and element type, the head dim, the views.
  std::string tc_problem(bool fa2_head_dims) const {
    std::string why = tc_space_problem<ExecSpace, T>(space, d, fa2_head_dims);
    return why.empty() ? views_why : why;
  }
};

/// The ForwardCall of these arguments on their canonical Views (canonical.hpp): every kernel family, its
/// checks and its launch are instantiated for those types only.
template <class ExecSpace, class QV, class KV, class VV, class OV, class L = canonical_layout_t<QV, KV, VV, OV>>
ForwardCall<ExecSpace, canonical_in_t<L, QV>, canonical_in_t<L, KV>, canonical_in_t<L, VV>, canonical_out_t<L, OV>>
forward_call(const char* fn, const ExecSpace& space, const QV& q, const KV& k, const VV& v, const OV& o,
             const AttentionOptions& opts) {
  return {fn, space, q, k, v, o, opts};
}

/// The forward's kernel families, in the order `automatic` tries them. Each one says why it cannot run a
/// call ("" when it can), its tiles, and launches it; `tensor_core` marks the ones opts.path = tensor_core may
/// pick (the 16-bit tensor-core families).
struct WgmmaForwardFamily {  // Hopper (sm_90a): wgmma, warp-specialized (tc_wgmma_forward.hpp)
  static constexpr TileProductPath path = TileProductPath::tensor_core_wgmma;
  static constexpr bool tensor_core = true;
  template <class C>
  static std::string why_not(const C& c) {
    const std::string why = c.tc_problem(false);  // wgmma_forward_why_not may probe the device: asked last
    return why.empty() ? wgmma_forward_why_not(c.space, c.d, c.seq_k, c.opts) : why;
  }
  template <class C>
  static TileConfig tiles(const C& c) {
    return wgmma_forward_tiles(c.d, c.opts.softcap > 0, native_smem_max(c.space));
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
struct Fa2ForwardFamily {  // sm_80+: mma.sync in FlashAttention-2's layout, native launch (tc_fa2_forward.hpp)
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
    if constexpr (has_tensor_core_path<typename C::exec_space, typename C::T>::value)
      fa2_forward_launch(c.space, args);
#endif
    (void)c, (void)args;
  }
};
struct TeamForwardFamily {  // sm_80+: mma.sync, a Kokkos team per 64 query rows (tc_forward.hpp)
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
    if constexpr (has_tensor_core_path<typename C::exec_space, typename C::T>::value)
      tc_forward_launch(c.space, args);
    (void)c, (void)args;
  }
};
struct Tf32ForwardFamily {  // float on CUDA sm_80+: 3×TF32 mma.sync (tc_tf32_forward.hpp)
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
struct SimtForwardFamily {  // float on CUDA: FMA tiles in registers (simt_forward.hpp)
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
struct PortableForwardFamily {  // every backend and element type: Kokkos team kernel (forward_kernel.hpp)
  static constexpr TileProductPath path = TileProductPath::portable;
  static constexpr bool tensor_core = false;
  template <class C>
  static std::string why_not(const C&) {
    return "";
  }
  template <class C>
  static TileConfig tiles(const C& c) {
    using ExecSpace = typename C::exec_space;
    const TileConfig t = forward_tile_config(c.space, c.q, c.k, c.opts);
    const auto l1_max = static_cast<std::size_t>(Kokkos::TeamPolicy<ExecSpace>::scratch_size_max(1));
    if (c.opts.block_q > 0 && t.scratch_l1 > l1_max)
      fail(c.fn, ": opts.block_q = ", c.opts.block_q, " needs ", t.scratch_l1,
           " B of level-1 scratch, more than the backend's ", l1_max);
    return t;
  }
  template <class C, class A>
  static void launch(const C& c, const A& args, const TileConfig& tiles) {
    using ExecSpace = typename C::exec_space;
    using Kernel = ForwardKernel<ExecSpace, A>;
    const Kernel kernel(args, tiles);
    const int league = checked_league(c.fn, "batch * heads_q * query blocks",
                                      static_cast<long>(c.q.extent(0)) * static_cast<long>(c.q.extent(2)) *
                                          kernel.n_qblocks);
    Kokkos::TeamPolicy<ExecSpace> policy(c.space, league, tiles.team_size);
    policy.set_scratch_size(0, Kokkos::PerTeam(tiles.scratch_l0))
        .set_scratch_size(1, Kokkos::PerTeam(tiles.scratch_l1));
    Kokkos::parallel_for("kfa::attention_forward", policy, kernel);
  }
};
using ForwardFamilies = std::tuple<WgmmaForwardFamily, Fa2ForwardFamily, TeamForwardFamily, Tf32ForwardFamily,
                                   SimtForwardFamily, PortableForwardFamily>;

/// f(family) for each family type of the tuple Families, in order.
template <class Families, class F>
void for_each_family(F&& f) {
  std::apply([&](auto... family) { (f(family), ...); }, Families{});
}

/// The one place a family is chosen: Families in order, each saying why it cannot run the call ("" when it
/// can). `asked` = automatic takes the first that can, tensor_core the first tensor-core one, a named family
/// that one; where none of those asked for can run, the error names opts.path (`shown`) and each one's reason.
template <class Families, class Call>
TileProductPath choose_family(const char* fn, const Call& c, TileProductPath asked, TileProductPath shown) {
  using P = TileProductPath;
  P chosen = P::automatic;
  int candidates = 0;
  std::string reasons, last_why;
  for_each_family<Families>([&](auto family) {
    using F = decltype(family);
    if (chosen != P::automatic) return;
    if (!(asked == F::path || asked == P::automatic || (asked == P::tensor_core && F::tensor_core))) return;
    ++candidates;
    std::string why = F::why_not(c);
    if (why.empty()) {
      chosen = F::path;
    } else {
      reasons += (reasons.empty() ? "" : "; ") + to_string(F::path) + ": " + why;
      last_why = std::move(why);
    }
  });
  if (chosen == P::automatic) {
    if (candidates == 1) fail(fn, ": opts.path = ", to_string(shown), " but ", last_why);
    fail(fn, ": opts.path = ", to_string(shown), " but no family it names can run these inputs (", reasons, ")");
  }
  return chosen;
}

/// f(family) for the family whose path is `path`.
template <class Families, class F>
void with_family(TileProductPath path, F&& f) {
  for_each_family<Families>([&](auto family) {
    if (decltype(family)::path == path) f(family);
  });
}

template <class Call>
ForwardPlan forward_plan(const char* fn, const Call& c) {
  using T = typename Call::T;
  ForwardPlan plan;
  plan.family = choose_family<ForwardFamilies>(fn, c, c.opts.path, c.opts.path);
  with_family<ForwardFamilies>(plan.family, [&](auto family) { plan.tiles = decltype(family)::tiles(c); });
  plan.region = std::string(fn) + "[" + to_string(plan.family) + "," + dtype_name<T>() + ",d" + std::to_string(c.d) +
                "," + to_string(plan.tiles) + "]";
  return plan;
}

/// forward_impl on canonical Views (c from forward_call; lse canonical too).
template <class Call, class LV>
void forward_run(const Call& c, const LV& lse, const Positions& pos) {
  using T = typename Call::T;
  const ForwardPlan plan = forward_plan(c.fn, c);
  compat::ScopedRegion region(plan.region);
  const auto& q = c.q;
  if (q.extent(0) == 0 || q.extent(1) == 0 || q.extent(2) == 0) return;
  using Acc = accumulator_t<T>;
  const Acc scale = static_cast<Acc>(resolved_scale<T>(c.opts, q.extent(3)));
  const KeyMask mask(static_cast<long>(q.extent(1)), static_cast<long>(c.k.extent(1)), pos, c.opts.causal,
                     c.opts.window_left, c.opts.window_right);
  const auto args = forward_args(c.q, c.k, c.v, c.o, lse, scale, static_cast<Acc>(c.opts.softcap), mask);
  with_family<ForwardFamilies>(plan.family, [&](auto family) { decltype(family)::launch(c, args, plan.tiles); });
}

/// attention_forward after its checks, for a block at `pos` of a longer sequence (the ring layer's entry).
template <class ExecSpace, class QV, class KV, class VV, class OV, class LV>
void forward_impl(const char* fn, const ExecSpace& space, const QV& q, const KV& k, const VV& v, const OV& o,
                  const LV& lse, const AttentionOptions& opts, const Positions& pos) {
  forward_run(forward_call(fn, space, q, k, v, o, opts), canonical_out_t<canonical_layout_t<LV>, LV>(lse), pos);
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
  return detail::forward_plan(fn, detail::forward_call(fn, space, q, k, v, o, opts));
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

/// What a backward family looks at to decide whether it can run a call, size its tiles and launch it.
template <class ExecSpace, class QV, class KV, class VV, class DOV, class DQV, class DKV, class DVV>
struct BackwardCall {
  using exec_space = ExecSpace;
  using q_type = QV;
  using k_type = KV;
  using v_type = VV;
  using do_type = DOV;
  using dq_type = DQV;
  using dk_type = DKV;
  using dv_type = DVV;
  using T = typename QV::non_const_value_type;
  const char* fn;  ///< the API function the call came through (its errors name it)
  const ExecSpace& space;
  QV q;  // canonical (unmanaged) Views, held by value: see backward_call
  KV k;
  VV v;
  DOV d_o;
  DQV dq;
  DKV dk;
  DVV dv;
  const AttentionOptions& opts;
  int d;
  BackwardCall(const char* f, const ExecSpace& s, const QV& q_, const KV& k_, const VV& v_, const DOV& do_,
               const DQV& dq_, const DKV& dk_, const DVV& dv_, const AttentionOptions& op)
      : fn(f), space(s), q(q_), k(k_), v(v_), d_o(do_), dq(dq_), dk(dk_), dv(dv_), opts(op),
        d(static_cast<int>(q_.extent(3))) {}
};

/// The BackwardCall of these arguments on their canonical Views (canonical.hpp), as forward_call.
template <class ExecSpace, class QV, class KV, class VV, class DOV, class DQV, class DKV, class DVV,
          class L = canonical_layout_t<QV, KV, VV, DOV, DQV, DKV, DVV>>
BackwardCall<ExecSpace, canonical_in_t<L, QV>, canonical_in_t<L, KV>, canonical_in_t<L, VV>, canonical_in_t<L, DOV>,
             canonical_out_t<L, DQV>, canonical_out_t<L, DKV>, canonical_out_t<L, DVV>>
backward_call(const char* fn, const ExecSpace& space, const QV& q, const KV& k, const VV& v, const DOV& d_o,
              const DQV& dq, const DKV& dk, const DVV& dv, const AttentionOptions& opts) {
  return {fn, space, q, k, v, d_o, dq, dk, dv, opts};
}

/// The backward's kernel families, in the order `automatic` tries them (see the forward's). Each one says why
/// it cannot run a call, fills a plan's tiles (the tensor-core family also its kernels) and launches it.
struct TensorCoreBackwardFamily {  // 16-bit, sm_80+: wgmma (sm_90a), FA2-layout or team dK/dV and dQ kernels
  static constexpr TileProductPath path = TileProductPath::tensor_core;
  static constexpr bool tensor_core = true;
  /// Which kernels it would run and why it cannot ("" when it can).
  struct Kernels {
    std::string why;
    bool fused = false;   ///< atomic dQ inside the dK/dV kernel (opts.deterministic = false, where it pays)
    bool fa2 = false;     ///< the FA2-layout dK/dV kernel (else the team one)
    bool fa2_dq = false;  ///< the FA2-layout dQ kernel
    bool wgmma = false;   ///< the wgmma dK/dV and dQ kernels (in place of the three above)
  };
  template <class C>
  static Kernels kernels(const C& c) {
    using P = TileProductPath;
    using ExecSpace = typename C::exec_space;
    Kernels kn;
    const int d = c.d;
    // opts.path = tensor_core_fa2 or tensor_core_team keeps the FA2-layout or team kernels
    const bool wgmma_allowed = c.opts.path != P::tensor_core_fa2 && c.opts.path != P::tensor_core_team;
    kn.fused = !c.opts.deterministic && tc_atomic_dq_pays(c.space, d, wgmma_allowed);  // atomic dQ where faster
    kn.why = tc_space_problem<ExecSpace, typename C::T>(c.space, d, true);  // d = 256: the FA2-layout kernels only
    if (kn.why.empty()) kn.why = tc_backward_problem(c.space, d, kn.fused);
    if (kn.why.empty()) {
      kn.fa2 = tc_fa2_backward_runs(c.space, d, kn.fused);
      kn.fa2_dq = !kn.fused && fa2_dq_problem(c.space, d).empty();
      const BackwardTileConfig t = tc_backward_tiles(d, 0, kn.fused, kn.fa2, kn.fa2_dq);
      // one override serves both kernels only where they agree; the portable path honours any
      kn.why = tc_block_problem(c.opts, t.dkdv.block_q, t.dkdv.block_k, "backward");
      if (kn.why.empty() && !kn.fused) kn.why = tc_block_problem(c.opts, t.dq.block_q, t.dq.block_k, "backward");
    }
    tc_add_backward_view_problems(kn.why, c.q, c.k, c.v, c.d_o, c.dq, c.dk, c.dv);
    // asked only where the tensor-core backward can run (it may probe the device)
    kn.wgmma = kn.why.empty() && wgmma_allowed && wgmma_backward_why_not(c.space, d, kn.fused, c.opts).empty();
    return kn;
  }
  template <class C>
  static std::string why_not(const C& c) {
    return kernels(c).why;
  }
  template <class C>
  static void plan(const C& c, BackwardPlan& plan) {
    const Kernels kn = kernels(c);
    const auto l0_max = static_cast<std::size_t>(compat::scratch_size_max_l0<typename C::exec_space>());
    plan.atomic_dq = kn.fused;
    plan.wgmma = kn.wgmma;
    if (kn.wgmma) {
      plan.tiles = wgmma_backward_tiles(c.d, native_smem_max(c.space));
      return;
    }
    plan.tiles = tc_backward_tiles(c.d, l0_max, kn.fused, kn.fa2, kn.fa2_dq);
    if (plan.tiles.dkdv.scratch_l0 > l0_max) plan.tiles.dkdv.scratch_l0_max = native_smem_max(c.space);  // native
    if (kn.fa2_dq) plan.tiles.dq.scratch_l0_max = native_smem_max(c.space);
  }
  template <class C, class A>
  static void launch(const C& c, const A& args, const BackwardPlan& plan, BackwardParts parts) {
    if constexpr (has_tensor_core_path<typename C::exec_space, typename C::T>::value)
      tc_backward_launch(c.space, args, !plan.atomic_dq, plan.wgmma, parts);
    (void)c, (void)args, (void)plan, (void)parts;
  }
};
struct Tf32BackwardFamily {  // float on CUDA sm_80+: 3×TF32 mma.sync (tc_tf32_backward.hpp)
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
struct SimtBackwardFamily {  // float on CUDA: FMA tiles in registers (simt_backward.hpp)
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
struct PortableBackwardFamily {  // every backend and element type: Kokkos team kernels (backward_kernel.hpp)
  static constexpr TileProductPath path = TileProductPath::portable;
  static constexpr bool tensor_core = false;
  template <class C>
  static std::string why_not(const C&) {
    return "";
  }
  template <class C>
  static void plan(const C& c, BackwardPlan& plan) {
    using ExecSpace = typename C::exec_space;
    plan.tiles = backward_tile_config(c.space, c.q, c.k, c.opts);
    const auto l1_max = static_cast<std::size_t>(Kokkos::TeamPolicy<ExecSpace>::scratch_size_max(1));
    if (plan.tiles.dkdv.scratch_l1 > l1_max || plan.tiles.dq.scratch_l1 > l1_max)
      fail(c.fn, ": tiles ", to_string(plan.tiles), " need ",
           std::max(plan.tiles.dkdv.scratch_l1, plan.tiles.dq.scratch_l1),
           " B of level-1 scratch, more than the backend's ", l1_max, " B; lower opts.block_q / block_k");
  }
  template <class C, class A>
  static void launch(const C& c, const A& args, const BackwardPlan& plan, BackwardParts parts) {
    using ExecSpace = typename C::exec_space;
    const BackwardTileConfig& tiles = plan.tiles;
    const long batch = static_cast<long>(c.q.extent(0));
    if (c.k.extent(1) > 0 && parts != BackwardParts::dq) {
      using K1 = DkDvKernel<ExecSpace, A>;
      const K1 k1(args, tiles.dkdv);
      const int league = checked_league(c.fn, "batch * heads_kv * key blocks",
                                        batch * static_cast<long>(c.k.extent(2)) * k1.n_kblocks);
      Kokkos::TeamPolicy<ExecSpace> p1(c.space, league, tiles.dkdv.team_size);
      p1.set_scratch_size(0, Kokkos::PerTeam(tiles.dkdv.scratch_l0))
          .set_scratch_size(1, Kokkos::PerTeam(tiles.dkdv.scratch_l1));
      Kokkos::parallel_for("kfa::attention_backward::dkdv", p1, k1);
    }
    if (c.q.extent(1) > 0 && parts != BackwardParts::dkdv) {
      using K2 = DqKernel<ExecSpace, A>;
      const K2 k2(args, tiles.dq);
      const int league = checked_league(c.fn, "batch * heads_q * query blocks",
                                        batch * static_cast<long>(c.q.extent(2)) * k2.n_qblocks);
      Kokkos::TeamPolicy<ExecSpace> p2(c.space, league, tiles.dq.team_size);
      p2.set_scratch_size(0, Kokkos::PerTeam(tiles.dq.scratch_l0))
          .set_scratch_size(1, Kokkos::PerTeam(tiles.dq.scratch_l1));
      Kokkos::parallel_for("kfa::attention_backward::dq", p2, k2);
    }
  }
};
using BackwardFamilies =
    std::tuple<TensorCoreBackwardFamily, Tf32BackwardFamily, SimtBackwardFamily, PortableBackwardFamily>;

/// The backward's plan: one tensor-core family serves every 16-bit forward family (opts.path tensor_core_team,
/// tensor_core_fa2 and tensor_core_wgmma name it; its kernels are the wgmma ones where those can run, except
/// when opts.path names tensor_core_fa2 or tensor_core_team), then tensor_core_tf32x3, simt_fp32, portable.
template <class Call>
BackwardPlan backward_plan(const char* fn, const Call& c) {
  using P = TileProductPath;
  const P shown = c.opts.path;
  const bool names_tc_backward =
      shown == P::tensor_core_team || shown == P::tensor_core_fa2 || shown == P::tensor_core_wgmma;
  const P asked = names_tc_backward ? P::tensor_core : shown;
  BackwardPlan plan;
  plan.family = choose_family<BackwardFamilies>(fn, c, asked, shown);
  with_family<BackwardFamilies>(plan.family, [&](auto family) { decltype(family)::plan(c, plan); });
  plan.region = std::string(fn) + "[" + to_string(plan.family) +
                (plan.atomic_dq ? ",atomic_dq," : plan.wgmma ? ",wgmma," : ",") +
                dtype_name<typename Call::T>() + ",d" + std::to_string(c.d) + "," +
                to_string(plan.tiles) + "]";
  return plan;
}

/// backward_impl_d on canonical Views (c from backward_call; lse and dd canonical too).
template <class Call, class LV, class DD>
bool backward_run(const Call& c, const LV& lse, const DD& dd, const Positions& pos, BackwardParts parts) {
  using T = typename Call::T;
  const BackwardPlan plan = backward_plan(c.fn, c);
  compat::ScopedRegion region(plan.region);
  const bool dq_with_dkdv = plan.family == TileProductPath::tensor_core && plan.atomic_dq;
  const bool wrote_dq = parts == BackwardParts::all || (parts == BackwardParts::dkdv) == dq_with_dkdv;
  const auto& opts = c.opts;
  const int batch = static_cast<int>(c.q.extent(0)), nq = static_cast<int>(c.q.extent(1));
  const int hq = static_cast<int>(c.q.extent(2)), nk = static_cast<int>(c.k.extent(1));
  if (batch == 0) return wrote_dq;
  if (hq == 0) {  // no query head uses k and v: their gradients are zero
    if (parts == BackwardParts::dq) return wrote_dq;
    zero4(c.space, c.dk, "kfa::attention_backward::zero_dk");
    zero4(c.space, c.dv, "kfa::attention_backward::zero_dv");
    return wrote_dq;
  }
  using Acc = accumulator_t<T>;
  const Acc scale = static_cast<Acc>(resolved_scale<T>(opts, c.q.extent(3)));
  const KeyMask mask(nq, nk, pos, opts.causal, opts.window_left, opts.window_right);
  const auto args =
      backward_args(c.q, c.k, c.v, c.d_o, lse, dd, c.dq, c.dk, c.dv, scale, static_cast<Acc>(opts.softcap), mask);
  with_family<BackwardFamilies>(plan.family,
                                [&](auto family) { decltype(family)::launch(c, args, plan, parts); });
  return wrote_dq;
}

/// backward_impl with D = rowsum(dO ∘ O) given (`dd` [batch, heads_q, seq_q] of these query rows): the ring
/// computes D once for a rank's whole shard instead of once per block. `parts` picks the kernels (see
/// BackwardParts); returns whether this call wrote dq.
template <class ExecSpace, class QV, class KV, class VV, class DOV, class LV, class DD, class DQV, class DKV, class DVV>
bool backward_impl_d(const char* fn, const ExecSpace& space, const QV& q, const KV& k, const VV& v, const DOV& d_o,
                     const LV& lse, const DD& dd, const DQV& dq, const DKV& dk, const DVV& dv,
                     const AttentionOptions& opts, const Positions& pos, BackwardParts parts = BackwardParts::all) {
  return backward_run(backward_call(fn, space, q, k, v, d_o, dq, dk, dv, opts),
                      canonical_in_t<canonical_layout_t<LV>, LV>(lse), canonical_in_t<canonical_layout_t<DD>, DD>(dd),
                      pos, parts);
}

/// attention_backward after its checks, for a block at `pos` of a longer sequence (lse and o of the whole
/// rows, so P and D are exact): overwrites dq, dk, dv with this block's contributions.
template <class ExecSpace, class QV, class KV, class VV, class OV, class DOV, class LV, class DQV, class DKV,
          class DVV>
void backward_impl(const char* fn, const ExecSpace& space, const QV& q, const KV& k, const VV& v, const OV& o,
                   const DOV& d_o, const LV& lse, const DQV& dq, const DKV& dk, const DVV& dv,
                   const AttentionOptions& opts, const Positions& pos) {
  using L = canonical_layout_t<OV, DOV>;
  const auto dd = backward_row_dot(space, canonical_in_t<L, OV>(o), canonical_in_t<L, DOV>(d_o));
  backward_impl_d(fn, space, q, k, v, d_o, lse, dd, dq, dk, dv, opts, pos);
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
  return detail::backward_plan(fn, detail::backward_call(fn, space, q, k, v, d_o, dq, dk, dv, opts));
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
