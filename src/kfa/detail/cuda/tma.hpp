#pragma once
/// cuda/tma.hpp: Hopper's Tensor Memory Accelerator (TMA, cp.async.bulk.tensor) for the wgmma kernels: one thread hands
/// the copy unit a whole tile (rows × 64 elements of one head per instruction, written under the 128-byte
/// swizzle the wgmma descriptors name) and the bytes arrive on an mbarrier, instead of every thread of a
/// warpgroup computing addresses and issuing 16-byte cp.async.
///
/// Host: a TMA descriptor (CUtensorMap) per input tensor, made per launch by the driver's
/// cuTensorMapEncodeTiled, reached through the runtime's driver entry point (no link against libcuda). The
/// kernels' argument structs carry the descriptors in parameter space (__grid_constant__), where TMA reads
/// them. A descriptor describes a rank-4 16-bit tensor [batch][row][head][d] with a unit d stride as
/// (d, head, row, batch) or (d, row, head, batch), whichever orders the strides; the requirements (16-byte
/// aligned data, strides multiples of 16 bytes) are tc_view_problem's. Where the driver cannot make one
/// `TmaMaps::on` stays 0 and the kernels load with cp.async.
///
/// Rows past the tensor's end arrive as zeros (as cp.async's zero fill gave); rows inside the tensor but past
/// a tile's last visible key or query arrive with their data, which the kernels mask (P = 0, dS = 0).
#include <kfa/detail/cuda/mma.hpp>

#include <cstdint>
#include <type_traits>

#if KFA_HAS_TENSOR_CORES
#include <cuda.h>          // CUtensorMap and its enums (types only)
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled
#endif

namespace kfa {
namespace detail {

#if KFA_HAS_TENSOR_CORES
/// The TMA descriptors of a kernel's (up to four) 16-bit inputs, in the kernel's own order.
struct TmaMaps {
  static constexpr int max = 4;
  CUtensorMap map[max];
  unsigned char heads_inner[max];  // 1: the descriptor's dimensions are (d, head, row, batch)
  int on = 0;                      // 1: every descriptor the kernel uses was made; it loads with TMA
};

/// cuTensorMapEncodeTiled from the driver (nullptr where the driver does not give it).
inline PFN_cuTensorMapEncodeTiled_v12000 tma_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult got = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &got) != cudaSuccess ||
        got != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      p = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

/// Makes descriptor i of `t` for the rank-4 16-bit view x ([batch][row][head][d], unit d stride), for boxes of
/// `box_rows` rows × 64 elements of one head under the 128-byte swizzle. False where the driver cannot.
template <class V>
bool tma_map_rows(TmaMaps& t, int i, const V& x, int box_rows) {
  static_assert(V::rank == 4 && sizeof(typename V::value_type) == 2, "rank-4 views of 16-bit elements");
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tma_encoder();
  if (encode == nullptr || x.span() == 0 || x.stride(3) != 1) return false;
  const bool hin = x.stride(2) <= x.stride(1);
  const cuuint64_t rows = x.extent(1), heads = x.extent(2);
  const cuuint64_t dim[4] = {x.extent(3), hin ? heads : rows, hin ? rows : heads, x.extent(0)};
  const cuuint64_t str[3] = {2u * static_cast<cuuint64_t>(hin ? x.stride(2) : x.stride(1)),
                             2u * static_cast<cuuint64_t>(hin ? x.stride(1) : x.stride(2)),
                             2u * static_cast<cuuint64_t>(x.stride(0))};
  const cuuint32_t box[4] = {64u, hin ? 1u : static_cast<cuuint32_t>(box_rows),
                             hin ? static_cast<cuuint32_t>(box_rows) : 1u, 1u};
  const cuuint32_t one[4] = {1u, 1u, 1u, 1u};
  const CUresult r =
      encode(&t.map[i], CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, const_cast<void*>(static_cast<const void*>(x.data())), dim,
             str, box, one, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  t.heads_inner[i] = hin ? 1 : 0;
  return r == CUDA_SUCCESS;
}

/// Sets t.on where every descriptor of `made` was made.
inline void tma_maps_done(TmaMaps& t, bool made) {
  t.on = made ? 1 : 0;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
namespace tc {
/// This thread's arrival on the mbarrier at `bar`, announcing `bytes` more bytes of asynchronous copies.
__device__ __forceinline__ void mbar_arrive_expect_tx(std::uint32_t bar, std::uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
/// Fetches descriptor i into the TMA unit's cache ahead of its first use.
__device__ __forceinline__ void tma_prefetch(const TmaMaps& t, int i) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<std::uint64_t>(&t.map[i])) : "memory");
}
/// ROWS rows (from `row`) × D elements of head h of batch b of descriptor i's tensor into ⌈D/64⌉ panels of
/// ROWS × 128 B at dst (a multiple of 1024), completing ROWS·64·⌈D/64⌉·2 bytes on the mbarrier at bar (columns
/// past the head dim, as the second panel of d = 96, come as zeros). One thread.
template <int D, int ROWS>
__device__ __forceinline__ void tma_rows(std::uint32_t dst, const TmaMaps& t, int i, int row, int h, int b,
                                         std::uint32_t bar) {
  const std::uint64_t map = reinterpret_cast<std::uint64_t>(&t.map[i]);
  const int c1 = t.heads_inner[i] ? h : row, c2 = t.heads_inner[i] ? row : h;
#pragma unroll
  for (int p = 0; p < (D + 63) / 64; ++p)
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
        "%5}], [%6];\n" ::"r"(dst + static_cast<std::uint32_t>(p * ROWS * 128)),
        "l"(map), "r"(p * 64), "r"(c1), "r"(c2), "r"(b), "r"(bar)
        : "memory");
}
/// Adds `bytes` (a multiple of 16) of fp32 at src (shared, 16-byte aligned) into dst (global, 16-byte aligned)
/// element by element, as one bulk asynchronous reduction of this thread's current bulk group.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, std::uint32_t src, std::uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst), "r"(src),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
/// Waits until this thread's bulk groups have read their shared-memory sources (Read) or completed.
template <bool Read>
__device__ __forceinline__ void bulk_wait() {
  if constexpr (Read)
    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
  else
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}
}  // namespace tc
#endif
#endif  // KFA_HAS_TENSOR_CORES

}  // namespace detail
}  // namespace kfa
