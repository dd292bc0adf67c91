#pragma once
/// cuda/row_keys.hpp: the scores' softcap and mask of one 16-row C tile for the tensor-core kernels with one m16
/// tile per warp (the wgmma forward, the 3xTF32 forward): a lane's two rows' visible keys resolved once per pass
/// (RowKeys), and softcap_and_mask_rows applying them to a tile of raw scores.
#include <kfa/compat.hpp>
#include <kfa/detail/cuda/mma.hpp>  // KFA_TC_DEVICE
#include <kfa/detail/mask.hpp>      // KeyRule

namespace kfa {
namespace detail {

#if KFA_TC_DEVICE
namespace tc {
/// What a lane of the kernels with one m16 tile per warp masks in one pass (one document's rule, KeyRule): the
/// keys its rows row0 and row0 + 8 see, and the keys whose tiles need no mask for the block's rows [i0, i0 + rows),
/// resolved once per pass so that the key loop holds six integers instead of the rule (key positions < 2^31, as
/// these kernels' plans check).
struct RowKeys {
  int first[2], last[2];  // rows row0 and row0 + 8 see the keys [first, last]
  int lo, hi;             // a tile [j0, j0 + BC) needs no mask iff lo <= j0 and j0 + BC - 1 <= hi
  RowKeys() = default;
  __device__ RowKeys(const KeyRule& mask, int i0, int rows, int row0) {
    long f, l;
    for (int r = 0; r < 2; ++r) {
      mask.visible_range(row0 + r * 8, f, l);
      first[r] = static_cast<int>(f), last[r] = static_cast<int>(l);
    }
    mask.unmasked_keys(i0, i0 + rows, f, l);
    lo = static_cast<int>(f), hi = static_cast<int>(l);
  }
};

/// Softcap and mask of one 16-row C tile of raw scores s (keys j0 … j0 + BC − 1, `cols` of them real) for the
/// kernels with one m16 tile per warp, this lane's rows as `rk` says. Each step is one block of code that the
/// common tile skips with one branch; masked scores become −inf. Keys past the last real one are seen by no row,
/// so a row's visible range covers the tile's padding too.
template <int BC, bool Softcap, class Pos>
__device__ __forceinline__ void softcap_and_mask_rows(float (&s)[BC / 8][4], const RowKeys& rk, Pos j0, int cols,
                                                      int t4, float cap_in, float cap_out) {
  if (Softcap) {
#pragma unroll
    for (int n = 0; n < BC / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = cap_out * tanhf(s[n][e] * cap_in);
  }
  if (cols < BC || j0 < rk.lo || static_cast<long>(j0) + BC - 1 > rk.hi) {
    const float ninf = -compat::infinity<float>();
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const long first = rk.first[r], last = rk.last[r];
      const int lo = static_cast<int>(first - j0 < 0 ? 0 : (first - j0 > BC ? BC : first - j0));
      const int hi = static_cast<int>(last - j0 < -1 ? -1 : (last - j0 > BC ? BC : last - j0));
#pragma unroll
      for (int n = 0; n < BC / 8; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int jj = n * 8 + 2 * t4 + e;
          if (jj < lo || jj > hi) s[n][2 * r + e] = ninf;
        }
    }
  }
}
}  // namespace tc
#endif

}  // namespace detail
}  // namespace kfa
