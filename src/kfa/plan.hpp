#pragma once
/// What a call runs: the kernel family a plan chose, its tiles and its profiling region (plan_forward,
/// plan_backward in attention.hpp return these; the launch runs what the plan says).
#include <kfa/options.hpp>
#include <kfa/tiling.hpp>

#include <string>

namespace kfa {

/// What a forward call runs: the kernel family (never automatic or tensor_core: what they resolved to),
/// its tiles and the name of the Kokkos profiling region it runs in.
struct ForwardPlan {
  TileProductPath family;
  TileConfig tiles;
  std::string region;
};

/// What a backward call runs: tensor_core or portable, its tiles (dK/dV and dQ kernels) and the name of its
/// Kokkos profiling region.
struct BackwardPlan {
  TileProductPath family;
  BackwardTileConfig tiles;  ///< with atomic_dq only tiles.dkdv is used
  std::string region;
  /// dQ accumulated in fp32 inside the dK/dV kernel by atomic adds or bulk reductions, in any order
  /// (opts.deterministic = false and the tensor-core family, where faster); otherwise no atomics (a separate
  /// dQ kernel, or dq_in_dkdv on host), bitwise reproducible.
  bool atomic_dq = false;
  /// dQ computed in the dK/dV pass, no dQ kernel of its own: with atomic_dq, and in the portable family on
  /// host backends (each team's dQ into a workspace slice of its own, the slices summed in a fixed order, so
  /// still bitwise reproducible; portable/backward.hpp).
  bool dq_in_dkdv = false;
  /// With dq_in_dkdv on host: the teams (chunks of key blocks) per (batch, kv head), each with a dQ workspace
  /// slice (tiling.hpp, host_backward_chunks); 0 otherwise.
  int dq_chunks = 0;
  /// dK, dV and dQ from the wgmma kernels (tensor-core family, head dim 64 or 128, sm_90a on a compute
  /// capability 9.0 device; opts.path automatic, tensor_core or tensor_core_wgmma; with atomic_dq one
  /// kernel, at head dim 64); otherwise the
  /// FA2-layout or the 16-keys-per-warp dK/dV kernel and the FA2-layout or TcDqKernel dQ kernel.
  bool wgmma = false;
  /// Where neither wgmma: the FA2-layout dK/dV kernel (else the 16-keys-per-warp one) and the FA2-layout dQ
  /// kernel (else TcDqKernel; unused with atomic_dq). The launch runs these and decides nothing.
  bool fa2_dkdv = false;
  bool fa2_dq = false;
};

}  // namespace kfa
