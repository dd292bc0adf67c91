#pragma once
#include <string>

namespace kfa {

/// Which implementation of the tile products to use.
enum class TileProductPath {
  automatic,    ///< tensor cores where they can run these inputs (see has_tensor_core_path), the CUDA fp32
                ///< forward for float on CUDA (head dim 64/128), else portable
  portable,     ///< team/vector loops that every backend runs (the reference path)
  tensor_core,  ///< mma.sync tile products on CUDA sm_80+ for half/bfloat16, head dim 64 or 128, unit
                ///< head-dim stride and 16-byte-aligned rows; asking for it elsewhere is a kfa::Error
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
};

/// Name of a tile-product path as it appears in profiling regions.
inline std::string to_string(TileProductPath p) {
  switch (p) {
    case TileProductPath::automatic: return "automatic";
    case TileProductPath::portable: return "portable";
    case TileProductPath::tensor_core: return "tensor_core";
  }
  return "unknown";
}

}  // namespace kfa
