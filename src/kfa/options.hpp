#pragma once
#include <string>

namespace kfa {

/// Which kernel family computes the tile products. `automatic` and `tensor_core` choose; the others name
/// one family, and asking for one that cannot run these inputs is a kfa::Error saying why.
/// kfa::plan_forward / kfa::plan_backward (attention.hpp) say which family a call will run, its tiles and
/// its profiling region.
enum class TileProductPath {
  automatic,           ///< the fastest family that can run these inputs: tensor_core_wgmma, tensor_core_fa2,
                       ///< tensor_core_team, tensor_core_tf32x3, simt_fp32, portable (in that order; the backward:
                       ///< tensor_core, tensor_core_tf32x3, simt_fp32, portable)
  portable,            ///< team/vector loops that every backend runs (the reference path)
  tensor_core,         ///< the fastest tensor-core family (forward: tensor_core_wgmma, tensor_core_fa2, else
                       ///< tensor_core_team): CUDA
                       ///< sm_80+, half/bfloat16, head dim 64, 96, 128 or 256 (256: FA2-layout kernels only, the
                       ///< backward where the device has 216 KB of shared memory per block), unit head-dim stride and
                       ///< 16-byte-aligned rows
  tensor_core_team,    ///< forward: the Kokkos team kernel on tensor cores (16 rows per warp, 40 KB of team
                       ///< scratch); the backward runs the tensor-core backward without its wgmma kernels
  tensor_core_fa2,     ///< forward: FlashAttention-2's layout (128-row Q block in shared memory), launched
                       ///< natively with opt-in shared memory; the backward runs the tensor-core backward
                       ///< without its wgmma kernels (the FA2-layout ones)
  simt_fp32,           ///< the CUDA fp32 kernels, forward and backward (float, head dim 64/128, no block override)
  tensor_core_tf32x3,  ///< float on tensor cores in 3xTF32, forward and backward (each product split in three
                       ///< tf32 mma, about 2^-20 relative error per product; what torch's memory-efficient
                       ///< backend does for float): CUDA sm_80+, head dim 64, 96 or 128, no block override
  tensor_core_wgmma,   ///< forward: the FA2 layout on Hopper's warpgroup MMA (wgmma, 64 rows per warpgroup,
                       ///< operands from 128-byte-swizzled shared memory): half/bfloat16, head dim 64 or 128, a
                       ///< compute capability 9.0 device and a build with sm_90a code (KFA_ENABLE_SM90A); the
                       ///< backward runs the tensor-core backward, on wgmma where that can run (deterministic,
                       ///< head dim 64/128; BackwardPlan::wgmma)
};

/// Options shared by every attention entry point. Defaults give plain softmax(q kᵀ / sqrt(d)) v.
struct AttentionOptions {
  /// Multiplies q·k before masking and softcap; 0 means 1 / sqrt(head_dim). Must be finite and ≥ 0.
  double softmax_scale = 0.0;
  /// Causal mask aligned bottom-right: query i sees key j iff j ≤ i + seq_k − seq_q (FlashAttention).
  bool causal = false;
  /// Sliding window, bottom-right aligned like causal: key j is seen iff
  /// i + seq_k − seq_q − window_left ≤ j ≤ i + seq_k − seq_q + window_right; −1 means unbounded.
  int window_left = -1;
  int window_right = -1;
  /// Scores become softcap · tanh(score / softcap) after scaling; 0 means off. Must be finite and ≥ 0.
  double softcap = 0.0;
  /// Query rows per team (0: chosen from the scratch budget). A multiple of 8 when set. The CUDA kernels
  /// have fixed tiles per head dim; an override they cannot honour makes `automatic` pick portable.
  int block_q = 0;
  /// Keys per streamed K/V tile (0: chosen from the scratch budget). A multiple of 8 when set.
  int block_k = 0;
  /// Tile-product implementation.
  TileProductPath path = TileProductPath::automatic;
  /// Backward only. true (default): bitwise reproducible — no atomics, a separate dQ kernel recomputes
  /// S and dP. false lets the tensor-core backward accumulate dQ inside its dK/dV kernel in fp32 (5 tile
  /// products instead of 7, plus a zeroed fp32 dQ buffer of batch · seq_q · heads_q · head_dim floats
  /// allocated per call) where that is the faster of the two: the wgmma backward at head dim 64 (bulk
  /// asynchronous reductions), the FA2-layout backward at head dims above 64 where wgmma does not run
  /// (atomic adds); BackwardPlan::atomic_dq says which runs. The summation order then varies from run to
  /// run, so dq may differ in its last bits. The other families are deterministic either way.
  bool deterministic = true;
};

/// Name of a tile-product path as it appears in profiling regions and in opts.path's messages.
inline std::string to_string(TileProductPath p) {
  switch (p) {
    case TileProductPath::automatic:
      return "automatic";
    case TileProductPath::portable:
      return "portable";
    case TileProductPath::tensor_core:
      return "tensor_core";
    case TileProductPath::tensor_core_team:
      return "tensor_core_team";
    case TileProductPath::tensor_core_fa2:
      return "tensor_core_fa2";
    case TileProductPath::simt_fp32:
      return "simt_fp32";
    case TileProductPath::tensor_core_tf32x3:
      return "tensor_core_tf32x3";
    case TileProductPath::tensor_core_wgmma:
      return "tensor_core_wgmma";
  }
  return "unknown";
}

}  // namespace kfa
