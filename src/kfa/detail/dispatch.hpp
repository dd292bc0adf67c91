#pragma once
/// The one place a kernel family is chosen and launched: the forward's and the backward's families in the order
/// `automatic` tries them (each family's family.hpp says why it cannot run a call, its tiles and its launch), the
/// 16-bit tensor-core backward, which composes its dK/dV and dQ stages from the wgmma, FA2-layout and team
/// families' kernels, and what the public calls of attention.hpp (and the ring) run after their argument checks:
/// the arguments as canonical Views (common/canonical.hpp; one layout per call), the plan (the family that runs,
/// its tiles, its profiling region) and the family's launch. forward_plan, forward_run, backward_plan,
/// backward_run and row_dot_run on canonical Views are the templates detail/instances.hpp precompiles. CUDA-specific
/// code compiles only where has_tensor_core_path holds.
#include <kfa/detail/common/canonical.hpp>
#include <kfa/detail/common/checks.hpp>
#include <kfa/detail/common/kernel_args.hpp>
#include <kfa/detail/common/ranges.hpp>
#include <kfa/detail/common/recompute.hpp>
#include <kfa/detail/mask.hpp>
#include <kfa/detail/portable/family.hpp>
#include <kfa/detail/simt/family.hpp>
#include <kfa/detail/tc_fa2/family.hpp>
#include <kfa/detail/tc_team/family.hpp>
#include <kfa/detail/tc_tf32/family.hpp>
#include <kfa/detail/tc_wgmma/family.hpp>
#include <kfa/error.hpp>
#include <kfa/options.hpp>
#include <kfa/plan.hpp>
#include <kfa/tiling.hpp>
#include <kfa/types.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

namespace kfa {
namespace detail {

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

/// Whether deterministic = false fuses dQ into the dK/dV kernel at head dim d on `space`. Where the wgmma
/// backward runs: at d = 64 (its dK/dV kernel with dQ reduced in fp32, three warpgroups as the deterministic
/// one's: forward+backward 1.02-1.09x the two deterministic kernels, H100, bf16, N 8192/16384, causal or not, kfa
/// vs kfa in one run), not at d = 96, 128 and 256 (at 128 0.98-1.05x: the fp32 reductions' traffic, not the
/// product, is the cost; at 256 the FA2-layout kernel with atomic dQ ran its backward at 0.52-0.58x the wgmma
/// pair's speed, H100, bf16/fp16, N 4096/16384). Elsewhere: not at d = 64 where the FA2-layout dQ kernel runs,
/// because there the two-kernel backward was measured faster (H200, bf16, forward+backward 0.82-0.86x torch's
/// flash against 0.75-0.81x with atomic dQ). `wgmma_allowed`: opts.path lets the backward take the wgmma kernels.
template <class ExecSpace>
bool tc_atomic_dq_pays(const ExecSpace& space, int d, bool wgmma_allowed) {
  if (wgmma_allowed && wgmma_backward_problem(space, d, false).empty())
    return wgmma_backward_problem(space, d, true).empty();  // d = 64
  return d > 64 || !fa2_dq_problem(space, d).empty();
}

/// Tiles of the tensor-core backward; `fused`: dK/dV with dQ fused in (its dq tiles are then unused);
/// `fa2`: the FA2-layout dK/dV kernel (tc_fa2_backward_runs), else the 16-keys-per-warp one; `fa2_dq`: the
/// FA2-layout dQ kernel (fa2_dq_problem is ""), else TcDqKernel.
template <int D, bool Fused>
BackwardTileConfig tc_backward_tiles(std::size_t l0_max, bool fa2, bool fa2_dq) {
  using S = TcBackwardShape<D, Fused>;
  using F = Fa2BackwardShape<D, Fused>;
  BackwardTileConfig t = backward_tiles_of<S>(l0_max, 32 * S::dkdv_warps, 32 * S::warps);
  if (fa2) {  // the FA2-layout dK/dV kernel with the 16-keys-per-warp family's dQ tiles
    t.dkdv.block_q = F::dkdv_block_q;
    t.dkdv.block_k = F::dkdv_block_k;
    t.dkdv.scratch_l0 = F::dkdv_scratch;
    t.dkdv.team_size = 32 * F::dkdv_warps;
  }
  if (fa2_dq) {
    using Q = Fa2DqShape<D>;
    t.dq.block_q = Q::block_q;
    t.dq.block_k = Q::block_k;
    t.dq.team_size = 32 * Q::warps;
    t.dq.scratch_l0 = Q::smem;
  }
  return t;
}
inline BackwardTileConfig tc_backward_tiles(int head_dim, std::size_t l0_max, bool fused, bool fa2, bool fa2_dq) {
  return fa2_head_dim_switch(head_dim, [&](auto dc) {
    constexpr int D = decltype(dc)::value;
    return fused ? tc_backward_tiles<D, true>(l0_max, fa2, false) : tc_backward_tiles<D, false>(l0_max, fa2, fa2_dq);
  });
}

/// The kernels of the 16-bit tensor-core backward, as its plan chose them (TensorCoreBackwardFamily::kernels).
struct TcBackwardKernels {
  bool fused = false;   ///< dQ accumulated with atomics inside the dK/dV kernel (no dQ kernel)
  bool wgmma = false;   ///< the wgmma dK/dV and dQ kernels (in place of the two below)
  bool fa2 = false;     ///< the FA2-layout dK/dV kernel, else the 16-keys-per-warp (team) one
  bool fa2_dq = false;  ///< the FA2-layout dQ kernel, else TcDqKernel
};

/// The dK/dV kernel the plan chose (FuseDq: with dQ accumulated into dq_acc): the wgmma kernel, the
/// FA2-layout kernel (natively) or the 16-keys-per-warp kernel, under Kokkos where its tiles fit the team
/// scratch, natively otherwise.
template <int D, bool Softcap, bool FuseDq, class ExecSpace, class Args>
void tc_dkdv_launch(const ExecSpace& space, const Args& args, float* dq_acc, const TcBackwardKernels& kn) {
#if KFA_HAS_TENSOR_CORES
  const auto& k = args.k;
  if constexpr (wgmma_backward_head_dim(D) && (!FuseDq || D == 64) && std::is_same<ExecSpace, Kokkos::Cuda>::value) {
    if (kn.wgmma) {
      using S = WgmmaBackwardShape<D, FuseDq>;
      auto run = [&](auto tma) {  // the kernel loading by TMA where its descriptors are made, else by cp.async
        using K1 = TcWgmmaDkDvKernel<D, Softcap, decltype(tma)::value, FuseDq, Args>;
        K1 k1(args, dq_acc);
        if (decltype(tma)::value && !k1.set_tma()) return false;
        const long league = k1.order.league();
        checked_league("kfa::attention_backward", "batch * heads_kv * key blocks", league);
        native_launch(space,
                      FuseDq ? "kfa::attention_backward::dkdv_dq[tensor_core_wgmma]"
                             : "kfa::attention_backward::dkdv[tensor_core_wgmma]",
                      &native_team_kernel<K1>, league, dim3(32, S::warps), S::smem, K1::MIN_BLOCKS, k1);
        return true;
      };
      if (!run(std::true_type{})) run(std::false_type{});
      return;
    }
  }
  const char* name =
      FuseDq ? "kfa::attention_backward::dkdv_dq[tensor_core]" : "kfa::attention_backward::dkdv[tensor_core]";
  if constexpr (tc_fa2_backward_used<D, FuseDq>()) {
    using S = Fa2BackwardShape<D, FuseDq>;
    if (kn.fa2) {
      using K1 = TcFa2DkDvKernel<D, Softcap, FuseDq, Args>;
      const K1 k1(args, dq_acc);
      const long league = k1.order.league();
      checked_league("kfa::attention_backward", "batch * heads_kv * key blocks", league);
      native_launch(space, name, &native_team_kernel<K1>, league, dim3(32, S::dkdv_warps), S::dkdv_scratch,
                    K1::MIN_BLOCKS, k1);
      return;
    }
  }
  if constexpr (D > 128) {  // the plan chose the FA2-layout kernel, the only one (tc_backward_problem)
    fail("kfa::attention_backward: the FA2-layout dK/dV kernel, the only one at head_dim = ", D,
         ", does not fit this device's shared memory");
  } else {
    using S = TcBackwardShape<D, FuseDq>;
    using K1 = TcDkDvKernel<D, Softcap, FuseDq, Args>;
    const K1 k1(args, dq_acc);
    const long league = k1.order.league();
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
  (void)space, (void)args, (void)dq_acc, (void)kn;
  fail("kfa: tensor-core kernels are not compiled in this build");
#endif
}

/// The tensor-core backward with the kernels its plan chose (`kn`). Deterministic: the dK/dV kernel, then the
/// dQ kernel (7 tile products, no atomics). kn.fused: dQ is fused into the dK/dV kernel (5 products) through a
/// zeroed fp32 accumulator allocated here, then converted into dq (the plan fuses only where
/// tc_atomic_dq_pays).
template <int D, bool Softcap, class ExecSpace, class Args>
void tc_backward_launch_d(const ExecSpace& space, const Args& args, const TcBackwardKernels& kn, BackwardParts parts) {
#if KFA_HAS_TENSOR_CORES
  using S = TcBackwardShape<D>;
  using DQV = typename Args::dq_type;
  const auto& q = args.q;
  const auto& k = args.k;
  const auto& dq = args.dq;
  const float scale = args.scale;
  if (kn.fused) {  // dQ comes with dK/dV
    if (parts == BackwardParts::dq) return;
    const long n = static_cast<long>(q.extent(0)) * static_cast<long>(q.extent(1)) * static_cast<long>(q.extent(2)) * D;
    Kokkos::View<float*, typename ExecSpace::memory_space> acc(
        Kokkos::view_alloc(space, "kfa::attention_backward::dq_accumulator"), n);  // zeroed on `space`
    if (k.extent(1) > 0) tc_dkdv_launch<D, Softcap, true>(space, args, acc.data(), kn);
    const float* a = acc.data();
    const std::int64_t seq_q = static_cast<std::int64_t>(q.extent(1)), heads_q = static_cast<std::int64_t>(q.extent(2));
    if constexpr (D == 64) {
      if (kn.wgmma) {  // dq = scale · acc in the wgmma kernel's layout (wgmma_dq_index)
        for_each_element4(
            "kfa::attention_backward::dq_from_accumulator", space, dq,
            KOKKOS_LAMBDA(const std::int64_t b, const std::int64_t i, const std::int64_t h, const std::int64_t c) {
              const int half = static_cast<int>(c) / (D / 2), col = static_cast<int>(c) % (D / 2);
              dq(b, i, h, c) = static_cast<typename DQV::non_const_value_type>(
                  a[wgmma_dq_index<D>(b, h, half, i, heads_q, seq_q) + wgmma_dq_column<D>(i, col)] * scale);
            });
        return;
      }
    }
    // dq = scale · acc (acc: fp32 [batch][seq_q][heads_q][D], contiguous), one warp per row.
    for_each_element4(
        "kfa::attention_backward::dq_from_accumulator", space, dq,
        KOKKOS_LAMBDA(const std::int64_t b, const std::int64_t i, const std::int64_t h, const std::int64_t c) {
          dq(b, i, h, c) =
              static_cast<typename DQV::non_const_value_type>(a[((b * seq_q + i) * heads_q + h) * D + c] * scale);
        });
    return;  // acc's deallocation waits for the device (Kokkos synchronizes before freeing device memory)
  }
  if (k.extent(1) > 0 && parts != BackwardParts::dq) tc_dkdv_launch<D, Softcap, false>(space, args, nullptr, kn);
  if (q.extent(1) > 0 && parts != BackwardParts::dkdv) {
    if constexpr (wgmma_backward_head_dim(D) && std::is_same<ExecSpace, Kokkos::Cuda>::value) {
      if (kn.wgmma) {
        wgmma_dq_launch_d<D, Softcap>(space, args);
        return;
      }
    }
    if (kn.fa2_dq) {
      fa2_dq_launch_d<D, Softcap>(space, args);
      return;
    }
    if constexpr (D > 128) {  // the plan chose the FA2-layout dQ kernel, the only one (tc_backward_problem)
      fail("kfa::attention_backward: the FA2-layout dQ kernel, the only one at head_dim = ", D,
           ", does not fit this device's shared memory");
    } else {
      using K2 = TcDqKernel<D, Softcap, Args>;
      const K2 k2(args);
      const long league = k2.order.league();
      checked_league("kfa::attention_backward", "batch * heads_q * query blocks", league);
      typename K2::policy_type p2(space, static_cast<int>(league), S::warps, 32);
      p2.set_scratch_size(0, Kokkos::PerTeam(S::dq_scratch));
      Kokkos::parallel_for("kfa::attention_backward::dq[tensor_core]", p2, k2);
    }
  }
#else
  (void)space, (void)args, (void)kn, (void)parts;
  fail("kfa: tensor-core kernels are not compiled in this build");
#endif
}

template <class ExecSpace, class Args>
void tc_backward_launch(const ExecSpace& space, const Args& args, const TcBackwardKernels& kn,
                        BackwardParts parts = BackwardParts::all) {
  fa2_head_dim_switch(static_cast<int>(args.q.extent(3)), [&](auto dc) {
    constexpr int D = decltype(dc)::value;
    if (args.softcap > 0.f)
      tc_backward_launch_d<D, true>(space, args, kn, parts);
    else
      tc_backward_launch_d<D, false>(space, args, kn, parts);
  });
}

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
    plan.atomic_dq = plan.dq_in_dkdv = kn.fused;
    plan.wgmma = kn.wgmma;
    plan.fa2_dkdv = kn.fa2 && !kn.wgmma;
    plan.fa2_dq = kn.fa2_dq && !kn.wgmma;
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
      tc_backward_launch(c.space, args, TcBackwardKernels{plan.atomic_dq, plan.wgmma, plan.fa2_dkdv, plan.fa2_dq},
                         parts);
    (void)c, (void)args, (void)plan, (void)parts;
  }
};

/// The forward's kernel families, in the order `automatic` tries them. Each one says why it cannot run a
/// call ("" when it can), its tiles, and launches it; `tensor_core` marks the ones opts.path = tensor_core may
/// pick (the 16-bit tensor-core families).
using ForwardFamilies = std::tuple<WgmmaForwardFamily, Fa2ForwardFamily, TeamForwardFamily, Tf32ForwardFamily,
                                   SimtForwardFamily, PortableForwardFamily>;

/// The backward's kernel families, in the order `automatic` tries them (see the forward's). Each one says why
/// it cannot run a call, fills a plan's tiles (the tensor-core family also its kernels) and launches it.
using BackwardFamilies =
    std::tuple<TensorCoreBackwardFamily, Tf32BackwardFamily, SimtBackwardFamily, PortableBackwardFamily>;

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
// ---- From the API to a family's launch: canonical Views, the plan, the launch ----

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
      : fn(f),
        space(s),
        q(q_),
        k(k_),
        v(v_),
        o(o_),
        opts(op),
        d(static_cast<int>(q_.extent(3))),
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
/// One layout for the whole call, lse included (canonical.hpp), so a call reaches the instances of
/// detail/instances.hpp whatever mix of Views it passes.
template <class ExecSpace, class QV, class KV, class VV, class OV, class LV>
void forward_impl(const char* fn, const ExecSpace& space, const QV& q, const KV& k, const VV& v, const OV& o,
                  const LV& lse, const AttentionOptions& opts, const Positions& pos) {
  using L = canonical_layout_t<QV, KV, VV, OV, LV>;
  forward_run(forward_call<ExecSpace, QV, KV, VV, OV, L>(fn, space, q, k, v, o, opts), canonical_out_t<L, LV>(lse),
              pos);
}

/// backward_row_dot on canonical Views.
template <class ExecSpace, class OV, class DOV>
Kokkos::View<accumulator_t<typename OV::non_const_value_type>***, Kokkos::LayoutRight, typename ExecSpace::memory_space>
row_dot_run(const ExecSpace& space, const OV& o, const DOV& d_o) {
  using Acc = accumulator_t<typename OV::non_const_value_type>;
  const int batch = static_cast<int>(o.extent(0)), nq = static_cast<int>(o.extent(1)),
            hq = static_cast<int>(o.extent(2));
  Kokkos::View<Acc***, Kokkos::LayoutRight, typename ExecSpace::memory_space> dd(
      Kokkos::view_alloc(space, Kokkos::WithoutInitializing, "kfa::attention_backward::D"), batch, hq, nq);
  // One warp per row on a GPU: coalesced reads of each row (one thread per row would read d elements apart
  // from its neighbours').
  for_each_row_sum4<Acc>(
      "kfa::attention_backward::D", space, o,
      KOKKOS_LAMBDA(const std::int64_t b, const std::int64_t i, const std::int64_t h, const std::int64_t c) {
        return static_cast<Acc>(d_o(b, i, h, c)) * static_cast<Acc>(o(b, i, h, c));
      },
      KOKKOS_LAMBDA(const std::int64_t b, const std::int64_t i, const std::int64_t h, const Acc s) {
        dd(b, h, i) = s;
      });
  return dd;
}

/// D[b, h, i] = Σ_c dO ∘ O over the rows of o, in the accumulation type (the backward's row term).
template <class ExecSpace, class OV, class DOV, class L = canonical_layout_t<OV, DOV>>
Kokkos::View<accumulator_t<typename OV::non_const_value_type>***, Kokkos::LayoutRight, typename ExecSpace::memory_space>
backward_row_dot(const ExecSpace& space, const OV& o, const DOV& d_o) {
  return row_dot_run(space, canonical_in_t<L, OV>(o), canonical_in_t<L, DOV>(d_o));
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
      : fn(f),
        space(s),
        q(q_),
        k(k_),
        v(v_),
        d_o(do_),
        dq(dq_),
        dk(dk_),
        dv(dv_),
        opts(op),
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
                (plan.atomic_dq    ? ",atomic_dq,"
                 : plan.dq_in_dkdv ? ",dq_in_dkdv,"
                 : plan.wgmma      ? ",wgmma,"
                                   : ",") +
                dtype_name<typename Call::T>() + ",d" + std::to_string(c.d) + "," + to_string(plan.tiles) + "]";
  return plan;
}

/// backward_impl_d on canonical Views (c from backward_call; lse and dd canonical too).
template <class Call, class LV, class DD>
bool backward_run(const Call& c, const LV& lse, const DD& dd, const Positions& pos, BackwardParts parts) {
  using T = typename Call::T;
  const BackwardPlan plan = backward_plan(c.fn, c);
  compat::ScopedRegion region(plan.region);
  const bool dq_with_dkdv = plan.dq_in_dkdv;
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
  with_family<BackwardFamilies>(plan.family, [&](auto family) { decltype(family)::launch(c, args, plan, parts); });
  return wrote_dq;
}

/// backward_impl with D = rowsum(dO ∘ O) given (`dd` [batch, heads_q, seq_q] of these query rows): the ring
/// computes D once for a rank's whole shard instead of once per block. `parts` picks the kernels (see
/// BackwardParts); returns whether this call wrote dq.
template <class ExecSpace, class QV, class KV, class VV, class DOV, class LV, class DD, class DQV, class DKV, class DVV>
bool backward_impl_d(const char* fn, const ExecSpace& space, const QV& q, const KV& k, const VV& v, const DOV& d_o,
                     const LV& lse, const DD& dd, const DQV& dq, const DKV& dk, const DVV& dv,
                     const AttentionOptions& opts, const Positions& pos, BackwardParts parts = BackwardParts::all) {
  using L = canonical_layout_t<QV, KV, VV, DOV, LV, DD, DQV, DKV, DVV>;  // one layout per call, as forward_impl
  return backward_run(
      backward_call<ExecSpace, QV, KV, VV, DOV, DQV, DKV, DVV, L>(fn, space, q, k, v, d_o, dq, dk, dv, opts),
      canonical_in_t<L, LV>(lse), canonical_in_t<L, DD>(dd), pos, parts);
}

/// attention_backward after its checks, for a block at `pos` of a longer sequence (lse and o of the whole
/// rows, so P and D are exact): overwrites dq, dk, dv with this block's contributions.
template <class ExecSpace, class QV, class KV, class VV, class OV, class DOV, class LV, class DQV, class DKV, class DVV>
void backward_impl(const char* fn, const ExecSpace& space, const QV& q, const KV& k, const VV& v, const OV& o,
                   const DOV& d_o, const LV& lse, const DQV& dq, const DKV& dk, const DVV& dv,
                   const AttentionOptions& opts, const Positions& pos) {
  using L = canonical_layout_t<QV, KV, VV, OV, DOV, LV, DQV, DKV, DVV>;
  const auto dd = backward_row_dot(space, canonical_in_t<L, OV>(o), canonical_in_t<L, DOV>(d_o));
  backward_impl_d(fn, space, q, k, v, d_o, lse, dd, dq, dk, dv, opts, pos);
}

}  // namespace detail
}  // namespace kfa
