#pragma once
/// The portable family (Kokkos team kernels, every backend and element type): its tiles from the scratch
/// budget (tiling.hpp) and its launches. It can run every argument set the checks admit.
#include <kfa/detail/common/ranges.hpp>
#include <kfa/detail/portable/backward.hpp>
#include <kfa/detail/portable/forward.hpp>
#include <kfa/error.hpp>
#include <kfa/plan.hpp>
#include <kfa/tiling.hpp>
#include <kfa/types.hpp>

#include <algorithm>
#include <cstddef>
#include <string>

namespace kfa {
namespace detail {

struct PortableForwardFamily {  // every backend and element type: Kokkos team kernel (forward.hpp)
  static constexpr TileProductPath path = TileProductPath::portable;
  static constexpr bool tensor_core = false;
  template <class C>
  static std::string why_not(const C&) {
    return "";
  }
  template <class C>
  static TileConfig tiles(const C& c) {
    using ExecSpace = typename C::exec_space;
    const TileConfig t = kfa::forward_tile_config<ExecSpace, accumulator_t<typename C::T>>(
        c.space, static_cast<int>(c.q.extent(3)), static_cast<long>(c.q.extent(1)), static_cast<long>(c.k.extent(1)),
        static_cast<long>(c.q.extent(0) * c.q.extent(2)), c.opts);
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
    const int league =
        checked_league(c.fn, "batch * heads_q * query blocks",
                       static_cast<long>(c.q.extent(0)) * static_cast<long>(c.q.extent(2)) * kernel.n_qblocks);
    team_policy<ExecSpace> policy(c.space, league, tiles.team_size);
    policy.set_scratch_size(0, Kokkos::PerTeam(tiles.scratch_l0))
        .set_scratch_size(1, Kokkos::PerTeam(tiles.scratch_l1));
    Kokkos::parallel_for("kfa::attention_forward", policy, kernel);
  }
};

struct PortableBackwardFamily {  // every backend and element type: Kokkos team kernels (backward.hpp)
  static constexpr TileProductPath path = TileProductPath::portable;
  static constexpr bool tensor_core = false;
  template <class C>
  static std::string why_not(const C&) {
    return "";
  }
  template <class C>
  static void plan(const C& c, BackwardPlan& plan) {
    using ExecSpace = typename C::exec_space;
    plan.tiles = kfa::backward_tile_config<ExecSpace, accumulator_t<typename C::T>>(
        c.space, static_cast<int>(c.q.extent(3)), static_cast<long>(c.q.extent(1)), static_cast<long>(c.k.extent(1)),
        static_cast<long>(c.q.extent(0) * c.q.extent(2)), static_cast<long>(c.k.extent(0) * c.k.extent(2)), c.opts);
    const auto l1_max = static_cast<std::size_t>(Kokkos::TeamPolicy<ExecSpace>::scratch_size_max(1));
    if (plan.tiles.dkdv.scratch_l1 > l1_max || plan.tiles.dq.scratch_l1 > l1_max)
      fail(c.fn, ": tiles ", to_string(plan.tiles), " need ",
           std::max(plan.tiles.dkdv.scratch_l1, plan.tiles.dq.scratch_l1),
           " B of level-1 scratch, more than the backend's ", l1_max, " B; lower opts.block_q / block_k");
    if (is_host_space<ExecSpace>()) {  // host: five products, dQ from the dK/dV pass (backward.hpp)
      plan.dq_in_dkdv = true;
      const long n_kblocks = (static_cast<long>(c.k.extent(1)) + plan.tiles.dkdv.block_k - 1) / plan.tiles.dkdv.block_k;
      plan.dq_chunks =
          host_backward_chunks(c.space.concurrency(), static_cast<long>(c.k.extent(0) * c.k.extent(2)), n_kblocks);
    }
  }
  template <class C, class A>
  static void launch(const C& c, const A& args, const BackwardPlan& plan, BackwardParts parts) {
    using ExecSpace = typename C::exec_space;
    const BackwardTileConfig& tiles = plan.tiles;
    if constexpr (is_host_space<ExecSpace>()) {  // plan() set dq_in_dkdv
      return launch_fused(c, args, tiles.dkdv, plan.dq_chunks, parts);
    } else {
      launch_two_pass(c, args, tiles, parts);
    }
  }
  /// Devices: the dK/dV kernel, then the dQ kernel (backward.hpp).
  template <class C, class A>
  static void launch_two_pass(const C& c, const A& args, const BackwardTileConfig& tiles, BackwardParts parts) {
    using ExecSpace = typename C::exec_space;
    const long batch = static_cast<long>(c.q.extent(0));
    if (c.k.extent(1) > 0 && parts != BackwardParts::dq) {
      using K1 = DkDvKernel<ExecSpace, A>;
      const K1 k1(args, tiles.dkdv);
      const int league = checked_league(c.fn, "batch * heads_kv * key blocks",
                                        batch * static_cast<long>(c.k.extent(2)) * k1.n_kblocks);
      team_policy<ExecSpace> p1(c.space, league, tiles.dkdv.team_size);
      p1.set_scratch_size(0, Kokkos::PerTeam(tiles.dkdv.scratch_l0))
          .set_scratch_size(1, Kokkos::PerTeam(tiles.dkdv.scratch_l1));
      Kokkos::parallel_for("kfa::attention_backward::dkdv", p1, k1);
    }
    if (c.q.extent(1) > 0 && parts != BackwardParts::dkdv) {
      using K2 = DqKernel<ExecSpace, A>;
      const K2 k2(args, tiles.dq);
      const int league = checked_league(c.fn, "batch * heads_q * query blocks",
                                        batch * static_cast<long>(c.q.extent(2)) * k2.n_qblocks);
      team_policy<ExecSpace> p2(c.space, league, tiles.dq.team_size);
      p2.set_scratch_size(0, Kokkos::PerTeam(tiles.dq.scratch_l0))
          .set_scratch_size(1, Kokkos::PerTeam(tiles.dq.scratch_l1));
      Kokkos::parallel_for("kfa::attention_backward::dq", p2, k2);
    }
  }
  /// Host backends: dK, dV and each chunk's dQ in one pass, then the chunks' dQ summed (backward.hpp). dq is
  /// written whatever `parts` asks (the plan's dq_in_dkdv tells the caller); dk and dv unless parts = dq. No
  /// key or no query needs no case of its own: the pass then writes zeros where there is anything to write.
  template <class C, class A>
  static void launch_fused(const C& c, const A& args, const TileConfig& tiles, int chunks, BackwardParts parts) {
    using ExecSpace = typename C::exec_space;
    using Acc = typename A::Acc;
    const long batch = static_cast<long>(c.q.extent(0)), seq_q = static_cast<long>(c.q.extent(1));
    const long heads_q = static_cast<long>(c.q.extent(2)), d = static_cast<long>(c.q.extent(3));
    using K1 = DkDvKernel<ExecSpace, A, true>;
    K1 k1(args, tiles, chunks);
    Kokkos::View<Acc*, typename ExecSpace::memory_space> ws("kfa::attention_backward::dq_chunks", k1.dq_ws_size());
    k1.dq_ws = ws.data();
    k1.write_dkdv = parts != BackwardParts::dq;
    const int league = checked_league(c.fn, "batch * heads_kv * dQ chunks", k1.league());
    team_policy<ExecSpace> p1(c.space, league, tiles.team_size);
    p1.set_scratch_size(0, Kokkos::PerTeam(tiles.scratch_l0)).set_scratch_size(1, Kokkos::PerTeam(tiles.scratch_l1));
    Kokkos::parallel_for("kfa::attention_backward::dkdv_dq", p1, k1);
    using Sum = DqChunkSum<ExecSpace, typename A::dq_type, Acc>;
    const Sum sum{args.dq,
                  ws.data(),
                  k1.chunks,
                  static_cast<int>(batch),
                  static_cast<int>(seq_q),
                  static_cast<int>(seq_q + tiles.block_q),
                  static_cast<int>(heads_q),
                  static_cast<int>(d),
                  args.scale};
    Kokkos::parallel_for("kfa::attention_backward::dq_sum", Kokkos::RangePolicy<ExecSpace>(c.space, 0, batch * seq_q),
                         sum);
  }
};

}  // namespace detail
}  // namespace kfa
