#pragma once
/// tc_wgmma/forward.hpp: the tc_wgmma family's forward kernel (warp-specialized) and the Hopper wgmma
/// primitives (descriptors, wgmma and mbarrier wrappers, named barriers) its backward shares.
/// The tensor-core forward on Hopper's warpgroup MMA (wgmma, sm_90a): FlashAttention-3's structure, the
/// products issued by a warpgroup of four warps as asynchronous 64 × N × 16 instructions reading their operands
/// straight from shared memory (instead of each warp's m16n8k16 mma.sync fed by ldmatrix, tc_fa2/forward.hpp).
///
/// Per block: two consumer warpgroups (three at d = 64), 64 query rows each and 16 per warp, and a producer
/// warpgroup that does all the loads (TMA, cuda/tma.hpp).
/// - S = Q·Kᵀ: wgmma m64nBCk16, A = the warpgroup's 64 Q rows and B = the K tile, both from shared memory.
/// - O += P·V: wgmma m64nNk16 (N = D up to 128, two of N = 128 at D = 256), A = P from registers (the
///   accumulator of S converted to 16 bits in place: the fragment layouts agree, as with mma.sync), B = the V
///   tile from shared memory, read transposed (V's rows are keys, the instruction's K dimension, with the head
///   dim contiguous: "MN-major").
/// - Shared tiles have no padding: rows of 64-element (128-byte) panels under the 128-byte swizzle that the
///   instruction's descriptors name (16-byte chunk c of row r stored at chunk c ^ (r mod 8)), so a
///   d = 128 row is two panels (d = 96 too, the second half-used: wgmma_row_elems).
/// - The scores' softcap, mask and online softmax (lazy rescaling, base 2) are those of the FA2-layout
///   kernel, per warp on its 16 rows; the accumulators have the m16n8 C layout per warp.
///
/// Needs the translation unit compiled for sm_90a too (`-gencode=arch=compute_90a,code=sm_90a`, which kfa's
/// own build adds with KFA_ENABLE_SM90A); every other image has a trapping body. A binary may carry both an
/// sm_90 and an sm_90a image and the CUDA runtime picks one per device, so the plan asks the device once
/// which one it loaded (wgmma_loaded) and runs the FA2-layout kernel where it is not the sm_90a one.
#include <kfa/detail/cuda/native_args.hpp>  // Fa2ForwardArgs, set_forward_args, native_launch
#include <kfa/detail/cuda/row_keys.hpp>     // tc::RowKeys, tc::softcap_and_mask_rows
#include <kfa/detail/cuda/tma.hpp>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <type_traits>

namespace kfa {
namespace detail {

/// Head dims of the wgmma forward: O += P·V as wgmma products of n = D (64, 96, 128) or two of n = 128 (256).
KOKKOS_INLINE_FUNCTION constexpr bool wgmma_forward_head_dim(int d) {
  return d == 64 || d == 96 || d == 128 || d == 256;
}
/// Head dims of the wgmma backward (backward.hpp): 64, 96, 128 and 256.
KOKKOS_INLINE_FUNCTION constexpr bool wgmma_backward_head_dim(int d) {
  return d == 64 || d == 96 || d == 128 || d == 256;
}
/// A row's elements in the wgmma kernels' shared tiles: head dim d in whole 64-element (128-byte) panels. At
/// d = 96 a row's second panel is half used: the products read only the head dim's 96 (the instruction's K
/// steps of S = Q·Kᵀ stop there, and O += P·V is one product of n = 96), so the rest is never read (TMA fills
/// it with zeros, the cp.async path leaves it).
KOKKOS_INLINE_FUNCTION constexpr int wgmma_row_elems(int d) {
  return (d + 63) / 64 * 64;
}

/// Tiles of the warp-specialized forward (tc_wgmma_ws_forward_kernel): `consumers` warpgroups compute 64 query
/// rows each, the last one only loads, into K/V stages signalled by mbarriers; the consumer warpgroups take
/// turns issuing their products (named barriers), so one's softmax overlaps the others' tensor-core work.
/// d = 64: three consumers (192 rows; 160 registers each, the most that three and a 24-register producer
/// leave) ran 1.07-1.29x two (H100, bf16, N 4096/16384, causal or not, kfa vs kfa in one run).
/// d = 128: 3 stages of 128 keys (64 KB each, 225 KB in all, which every compute capability 9.0 device has)
/// ran 1.41-1.52x a two-warpgroup kernel with per-tile __syncthreads and 1.35-1.50x 2 stages (H200, bf16,
/// N 4096-16384, causal or not, kfa vs kfa in one run); with 2 the producer can refill a stage only once
/// O += P·V of its tile is done, one tile ahead. d = 64: 4 stages of 128 keys (145 KB, one block per SM) ran
/// 1.03-1.12x the two-warpgroup kernel at two blocks per SM with 64-key tiles (same conditions). d = 256: Q is
/// 64 KB, O 128 registers a thread; 4 stages of 32 keys (32 KB each, 193 KB in all) ran 1.11-1.28x 2 stages of
/// 64 keys (H100, bf16, N 4096/16384, causal or not, kfa vs kfa in one run; 5 stages of 32: no faster).
/// d = 96: d = 128's tiles (its rows take two panels all the same, wgmma_row_elems). d = 64 with softcap: 5
/// stages of 96 keys (S = Q·Kᵀ as products of n = 96), which take 24 fewer registers than 128-key tiles: no
/// spill instead of 136 B, 1.10-1.11x (H200, bf16, N 16384, softcap 30); without softcap those tiles also stop
/// the spill (52 B) but ran 0.94-1.03x, so it keeps 128 keys there.
template <int D, bool Softcap = false>
struct WgmmaWsForwardShape {
  static constexpr int consumers = D == 64 ? 3 : 2;  // warpgroups of 64 query rows
  static constexpr int warps = 4 * (consumers + 1);
  static constexpr int min_blocks = 1;
  static constexpr int block_q = 64 * consumers;
  static constexpr int block_k = D == 256 ? 32 : D == 64 && Softcap ? 96 : 128;
  static constexpr int stages = D == 64 && Softcap ? 5 : D == 64 || D == 256 ? 4 : 3;
  static_assert(wgmma_forward_head_dim(D) && stages >= 2, "d = 64, 96, 128 or 256; at least double-buffered");
  static constexpr std::size_t tile_bytes =
      static_cast<std::size_t>(block_q + 2 * stages * block_k) * wgmma_row_elems(D) * 2;
  /// the tiles, 1 KB of alignment slack and the mbarriers (Q, then full and empty per stage)
  static constexpr std::size_t smem = tile_bytes + 1024 + 8 * (1 + 2 * stages);
};

#if KFA_HAS_TENSOR_CORES
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KFA_WGMMA_DEVICE 1
namespace tc {
// Operand lists of the wgmma wrappers: the accumulator d[n/8][4] (the m16n8 C layout per warp) as
// n/2 "+f" registers.
#define KFA_WG_REGS_32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define KFA_WG_REGS_64                                                             \
  "{"                                                                              \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "         \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
  "}"
#define KFA_WG_REGS_96                                                               \
  "{"                                                                                \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "           \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"   \
  "}"
#define KFA_WG_REGS_128                                                              \
  "{"                                                                                \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "           \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"   \
  "}"
#define KFA_WG_OPS_32                                                                                          \
  "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),     \
      "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), \
      "+f"(d[3][2]), "+f"(d[3][3])
#define KFA_WG_OPS_64_HI                                                                                       \
  "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]),     \
      "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), \
      "+f"(d[7][2]), "+f"(d[7][3])
#define KFA_WG_OPS_64 KFA_WG_OPS_32, KFA_WG_OPS_64_HI
#define KFA_WG_OPS_96_HI                                                                                             \
  "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]),           \
      "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), \
      "+f"(d[11][2]), "+f"(d[11][3])
#define KFA_WG_OPS_128_HI                                                                                             \
  KFA_WG_OPS_96_HI, "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]),   \
      "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), \
      "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
// D = A·B (+ D where the scale_d operand is non-zero); A and B from shared memory (descriptors); A K-major,
// B K-major (operand TB 0) or read transposed (1: MN-major).
#define KFA_WG_SS(N, TY, REGS, A, B, S, TB)                                                                        \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %" S ", 0;\nwgmma.mma_async.sync.aligned.m64n" N "k16.f32." TY "." TY " " REGS \
  ", %" A ", %" B ", p, 1, 1, 0, %" TB ";\n}\n"
// D += A·B with A from registers (a0..a3) and B from shared memory read transposed (MN-major).
#define KFA_WG_RS(N, TY, REGS, A0, A1, A2, A3, B, S)                                                               \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %" S ", 0;\nwgmma.mma_async.sync.aligned.m64n" N "k16.f32." TY "." TY " " REGS \
  ", {%" A0 ", %" A1 ", %" A2 ", %" A3 "}, %" B ", p, 1, 1, 1;\n}\n"

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_wait_all() {
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
/// Orders this thread's generic-proxy writes to shared memory (cp.async, st.shared) before the async
/// proxy's reads (wgmma's operands); then a barrier makes every thread's writes visible.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
/// Pins an accumulator's registers after wgmma_wait_all: without it the compiler, which sees the wgmma
/// asm produce them at issue, could move their readers above the wait.
template <int N>
__device__ __forceinline__ void wgmma_hold(float (&d)[N][4]) {
#pragma unroll
  for (int j = 0; j < N; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
}

/// Stores four 8 × 8 16-bit matrices transposed (stmatrix, sm_90): r[m] is this thread's pair of matrix m in the
/// mma.sync C/A layout (row lane / 4, columns 2·(lane mod 4) + {0, 1}); lane 8m + c names where row c of the
/// transpose (column c of matrix m) goes, 16 contiguous bytes.
__device__ __forceinline__ void stmatrix_x4_trans(std::uint32_t addr, const std::uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

/// Shared-memory matrix descriptor, 128-byte swizzle: start address, leading and stride byte offsets.
/// K-major operands (rows of a panel along the instruction's K): the stride offset is the 1024 B between
/// groups of 8 rows and the leading one is unused. MN-major (V): leading = between 64-element panels of
/// the N dimension, stride = between groups of 8 rows (keys).
__device__ __forceinline__ std::uint64_t wgmma_desc(std::uint32_t addr, std::uint32_t lbo, std::uint32_t sbo) {
  return static_cast<std::uint64_t>((addr & 0x3FFFFu) >> 4) | (static_cast<std::uint64_t>(lbo >> 4) << 16) |
         (static_cast<std::uint64_t>(sbo >> 4) << 32) | (1ull << 62);
}

/// d (64 × N per warpgroup) = A·B, or += where scale_d ≠ 0; TransB: B read transposed (MN-major, as V).
template <int N, class T, bool TransB = false>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 8][4], std::uint64_t a, std::uint64_t b, int scale_d) {
  constexpr bool bf = std::is_same<T, compat::bhalf_t>::value;
  constexpr int tb = TransB ? 1 : 0;
  if constexpr (N == 32) {
    if constexpr (bf)
      asm volatile(KFA_WG_SS("32", "bf16", KFA_WG_REGS_32, "16", "17", "18", "19")
                   : KFA_WG_OPS_32
                   : "l"(a), "l"(b), "r"(scale_d), "n"(tb));
    else
      asm volatile(KFA_WG_SS("32", "f16", KFA_WG_REGS_32, "16", "17", "18", "19")
                   : KFA_WG_OPS_32
                   : "l"(a), "l"(b), "r"(scale_d), "n"(tb));
  } else if constexpr (N == 64) {
    if constexpr (bf)
      asm volatile(KFA_WG_SS("64", "bf16", KFA_WG_REGS_64, "32", "33", "34", "35")
                   : KFA_WG_OPS_64
                   : "l"(a), "l"(b), "r"(scale_d), "n"(tb));
    else
      asm volatile(KFA_WG_SS("64", "f16", KFA_WG_REGS_64, "32", "33", "34", "35")
                   : KFA_WG_OPS_64
                   : "l"(a), "l"(b), "r"(scale_d), "n"(tb));
  } else if constexpr (N == 96) {
    if constexpr (bf)
      asm volatile(KFA_WG_SS("96", "bf16", KFA_WG_REGS_96, "48", "49", "50", "51")
                   : KFA_WG_OPS_64, KFA_WG_OPS_96_HI
                   : "l"(a), "l"(b), "r"(scale_d), "n"(tb));
    else
      asm volatile(KFA_WG_SS("96", "f16", KFA_WG_REGS_96, "48", "49", "50", "51")
                   : KFA_WG_OPS_64, KFA_WG_OPS_96_HI
                   : "l"(a), "l"(b), "r"(scale_d), "n"(tb));
  } else {
    static_assert(N == 128, "n = 32, 64, 96 or 128");
    if constexpr (bf)
      asm volatile(KFA_WG_SS("128", "bf16", KFA_WG_REGS_128, "64", "65", "66", "67")
                   : KFA_WG_OPS_64, KFA_WG_OPS_128_HI
                   : "l"(a), "l"(b), "r"(scale_d), "n"(tb));
    else
      asm volatile(KFA_WG_SS("128", "f16", KFA_WG_REGS_128, "64", "65", "66", "67")
                   : KFA_WG_OPS_64, KFA_WG_OPS_128_HI
                   : "l"(a), "l"(b), "r"(scale_d), "n"(tb));
  }
}

/// d (64 × N per warpgroup) += A·B, A = this warp's 16 × 16 fragment (the mma.sync A layout), B transposed.
template <int N, class T>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 8][4], const std::uint32_t (&a)[4], std::uint64_t b) {
  constexpr bool bf = std::is_same<T, compat::bhalf_t>::value;
  const int one = 1;
  if constexpr (N == 64) {
    if constexpr (bf)
      asm volatile(KFA_WG_RS("64", "bf16", KFA_WG_REGS_64, "32", "33", "34", "35", "36", "37")
                   : KFA_WG_OPS_64
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(one));
    else
      asm volatile(KFA_WG_RS("64", "f16", KFA_WG_REGS_64, "32", "33", "34", "35", "36", "37")
                   : KFA_WG_OPS_64
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(one));
  } else if constexpr (N == 96) {
    if constexpr (bf)
      asm volatile(KFA_WG_RS("96", "bf16", KFA_WG_REGS_96, "48", "49", "50", "51", "52", "53")
                   : KFA_WG_OPS_64, KFA_WG_OPS_96_HI
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(one));
    else
      asm volatile(KFA_WG_RS("96", "f16", KFA_WG_REGS_96, "48", "49", "50", "51", "52", "53")
                   : KFA_WG_OPS_64, KFA_WG_OPS_96_HI
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(one));
  } else {
    static_assert(N == 128, "n = 64, 96 or 128");
    if constexpr (bf)
      asm volatile(KFA_WG_RS("128", "bf16", KFA_WG_REGS_128, "64", "65", "66", "67", "68", "69")
                   : KFA_WG_OPS_64, KFA_WG_OPS_128_HI
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(one));
    else
      asm volatile(KFA_WG_RS("128", "f16", KFA_WG_REGS_128, "64", "65", "66", "67", "68", "69")
                   : KFA_WG_OPS_64, KFA_WG_OPS_128_HI
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(one));
  }
}
#undef KFA_WG_REGS_32
#undef KFA_WG_REGS_64
#undef KFA_WG_REGS_96
#undef KFA_WG_REGS_128
#undef KFA_WG_OPS_32
#undef KFA_WG_OPS_64
#undef KFA_WG_OPS_64_HI
#undef KFA_WG_OPS_96_HI
#undef KFA_WG_OPS_128_HI
#undef KFA_WG_SS
#undef KFA_WG_RS

/// k step kk of acc (64 × D per warpgroup) += A·B with A = this warp's fragment a and B = a tile of ROWS rows ×
/// D in 64-element panels of ROWS × 128 B at b, read transposed (its rows are the K dimension, 16 a step):
/// O += P·V in the forward, dQ += dS·K in the dQ kernel. One product of n = D (at 96 it reads the first panel and
/// half the second), or at D = 256 two of n = 128 (two panels each).
template <int D, int ROWS, class T>
__device__ __forceinline__ void wgmma_rs_tile(float (&acc)[D / 8][4], const std::uint32_t (&a)[4], std::uint32_t b,
                                              int kk) {
  if constexpr (D <= 128) {
    wgmma_rs<D, T>(acc, a, wgmma_desc(b + kk * 16 * 128, ROWS * 128, 1024));
  } else {
#pragma unroll
    for (int cn = 0; cn < D / 128; ++cn)
      wgmma_rs<128, T>(*reinterpret_cast<float(*)[16][4]>(&acc[cn * 16][0]), a,
                       wgmma_desc(b + cn * 2 * ROWS * 128 + kk * 16 * 128, ROWS * 128, 1024));
  }
}

/// Copies ROWS × D 16-bit elements (row r at src + r·stride) into 64-element panels of ROWS × 128 B under
/// the 128-byte swizzle: chunk x of row r goes to panel x / 8, chunk (x mod 8) ^ (r mod 8); rows ≥ valid
/// are zeroed. NT threads, each keeping one chunk column of the panels (wgmma_row_elems(D) / 8 of them; the
/// threads of the columns past D, half of d = 96's second panel, copy nothing), dr = NT / columns rows apart
/// pass by pass: a thread's swizzled chunk repeats every `period` passes (1 where dr is a multiple of 8, up to
/// d = 128; 2 at d = 256 with 128 threads), so it keeps that many addresses (few registers: the producers run
/// on 24).
template <int D, int ROWS, int NT>
__device__ __forceinline__ void load_tile_sw128(std::uint32_t dst, const std::uint16_t* src, long stride, int valid,
                                                int tid) {
  constexpr int chunks = wgmma_row_elems(D) / 8;
  constexpr int dr = NT / chunks;
  constexpr int period = dr % 8 == 0 ? 1 : 8 / dr;
  static_assert(NT % chunks == 0 && (dr % 8 == 0 || 8 % dr == 0) && ROWS % (dr * period) == 0, "whole periods");
  const int r0 = tid / chunks, x = tid % chunks;
  if (D % 64 != 0 && x >= D / 8) return;
  const std::uint16_t* p = src + static_cast<long>(r0) * stride + x * 8;
  std::uint32_t d[period];
#pragma unroll
  for (int q = 0; q < period; ++q) {
    const int r = r0 + q * dr;
    d[q] = dst + static_cast<std::uint32_t>((x >> 3) * ROWS * 128 + r * 128 + (((x & 7) ^ (r & 7)) << 4));
  }
#pragma unroll
  for (int it = 0; it < ROWS / dr; ++it) {
    const int r = r0 + it * dr;
    const bool ok = r < valid;
    cp_async16(d[it % period] + static_cast<std::uint32_t>((it / period) * period * dr * 128), ok ? p : src, ok);
    p += dr * stride;
  }
}

/// Zeroes rows valid .. ROWS − 1 of a tile in load_tile_sw128's layout at dst (64-element panels of ROWS × 128 B,
/// so a row is 128 whole bytes of each panel whatever the swizzle), as its cp.async path leaves them. TMA brings
/// the rows past a pass's last key (query) in with their values, another document's where one ends there; a
/// masked product multiplies them by 0, and 0·inf is NaN. NT threads (tid 0 .. NT − 1) write 16-byte chunks; the
/// caller fences (fence_proxy_async) and synchronizes them before the async proxy reads the tile.
template <int D, int ROWS, int NT>
__device__ __forceinline__ void zero_rows_sw128(std::uint32_t dst, int valid, int tid) {
  constexpr int panels = wgmma_row_elems(D) / 64;
  const int per_panel = (ROWS - valid) * 8;  // 16-byte chunks
  for (int c = tid; c < panels * per_panel; c += NT) {
    const int p = c / per_panel, x = c - p * per_panel;
    const std::uint32_t at = dst + static_cast<std::uint32_t>(p * ROWS * 128 + valid * 128 + x * 16);
    asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(at), "r"(0u) : "memory");
  }
}

/// mbarriers (shared memory, 8 bytes each) and named barriers for the warp-specialized kernel.
__device__ __forceinline__ void mbar_init(std::uint32_t bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
/// Waits until the phase of parity `phase` of the barrier has completed.
__device__ __forceinline__ void mbar_wait(std::uint32_t bar, unsigned phase) {
  asm volatile(
      "{\n.reg .pred p;\nKFA_MBAR_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra KFA_MBAR_WAIT;\n}\n" ::"r"(bar),
      "r"(phase)
      : "memory");
}
__device__ __forceinline__ void mbar_arrive(std::uint32_t bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
/// The barrier's arrival of this thread once all its earlier cp.async have landed (counted in its init).
__device__ __forceinline__ void cp_async_mbar_arrive(std::uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

/// The mbarriers of the warp-specialized kernels, 8 bytes each from `bars`: the block's resident tiles
/// ("head"), then "full" and "empty" per stage.
template <int ST>
struct WsBarriers {
  std::uint32_t bars;
  __device__ std::uint32_t head() const { return bars; }
  __device__ std::uint32_t full(int st) const { return bars + 8u * static_cast<std::uint32_t>(1 + st); }
  __device__ std::uint32_t empty(int st) const { return bars + 8u * static_cast<std::uint32_t>(1 + ST + st); }
  /// One thread: head and full complete after `loads` arrivals (1 with TMA: the issuing thread's, which also
  /// announces the bytes; the producer's 128 threads with cp.async), empty after the `consumers` threads'.
  __device__ void init(unsigned loads, unsigned consumers) const {
    mbar_init(head(), loads);
    for (int st = 0; st < ST; ++st) mbar_init(full(st), loads), mbar_init(empty(st), consumers);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
};

/// The producer of the warp-specialized kernels: `head(bar)` loads the block's resident tiles onto the head
/// barrier, then key tile t (the tiles of the rows [i_begin, i_end), one pass per document they meet) goes to
/// stage t mod ST once the consumers have released the stage's previous tile: `tile(stage, j0, the pass's j_end,
/// the stage's full barrier)`. Run by the one thread that issues TMA copies, or by every producer thread with
/// cp.async.
template <int ST, class J, class Head, class Tile>
__device__ __forceinline__ void ws_produce(const WsBarriers<ST>& w, const KeyMask& mask, long i_begin, long i_end,
                                           int bc, Head&& head, Tile&& tile) {
  head(w.head());
  int st = 0;
  unsigned use = 0;  // how many times stage st was filled before
  const DocumentSpan span = mask.documents_of_rows(i_begin, i_end);
  for (int doc = span.first; doc < span.last; ++doc) {  // the consumers' passes, tile after tile
    const KeyRule rule = mask.rule(doc);
    const J j_begin = static_cast<J>(rule.key_begin(i_begin)), j_end = static_cast<J>(rule.key_end(i_end));
    for (J j0 = j_begin; j0 < j_end; j0 += bc) {
      if (use > 0) mbar_wait(w.empty(st), (use - 1) & 1);
      tile(st, j0, j_end, w.full(st));
      if (++st == ST) st = 0, ++use;
    }
  }
}
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
/// Waits for the most recent wgmma group but `n` of this warpgroup.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
}  // namespace tc
#else
#define KFA_WGMMA_DEVICE 0
#endif

/// Writes 1 where the image of this translation unit's kernels that the device loaded is the sm_90a one
/// (the wgmma kernels are real there), else 0.
template <int Unused = 0>
__global__ void wgmma_probe_kernel(int* out) {
  *out = KFA_WGMMA_DEVICE;
}

/// The warp-specialized forward's arguments: the forward's, and TMA descriptors of q, k and v (TmaMaps).
template <class OutT>
struct WgmmaWsForwardArgs : Fa2ForwardArgs<OutT> {
  TmaMaps tma;
};

/// The warp-specialized wgmma forward (FlashAttention-3's structure; d = 64, 96, 128 and 256, softcap or not).
/// - The last warpgroup is the producer: it gives back registers (setmaxnreg) and loads Q and then every K/V tile
///   into stage t mod STAGES, which completes the stage's "full" mbarrier; before refilling a stage it waits
///   on its "empty" mbarrier (tc::ws_produce). With TMA descriptors (a.tma.on) one thread issues the whole
///   tiles; else its 128 threads issue 16-byte cp.async, each arriving on the barrier when its copies land.
/// - The others compute 64 rows each, with no block-wide barrier: each waits on the stage's full barrier,
///   issues S_t = Q·K_tᵀ and then O += P_{t-1}·V_{t-1} in its turn (warpgroup w waits on named barrier 1 + w
///   and hands the turn to the next, round robin, so one warpgroup's softmax runs while the others' products
///   do), waits for S_t, computes the softmax of tile t in place, waits for O += P_{t-1}·V_{t-1}, arrives on
///   stage t - 1's empty barrier, rescales O and packs P_t.
template <int D, bool Softcap, class T, class OutT>
__global__ void __launch_bounds__(32 * WgmmaWsForwardShape<D, Softcap>::warps, 1)
    tc_wgmma_ws_forward_kernel(const __grid_constant__ WgmmaWsForwardArgs<OutT> a) {
#if KFA_WGMMA_DEVICE
  using Shape = WgmmaWsForwardShape<D, Softcap>;
  constexpr int BQ = Shape::block_q, BC = Shape::block_k, ST = Shape::stages, NP = 128, NC = Shape::consumers;
  constexpr int DP = wgmma_row_elems(D);  // a row's elements in shared memory
  extern __shared__ __align__(1024) unsigned char wgmma_smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t4 = lane & 3, wg = warp >> 2;
  const QueryBlock blk(static_cast<int>(blockIdx.x), a.order, a.heads_q, a.group, BQ, a.seq_q);
  const int b = blk.b, h = blk.h, hk = blk.hk, i0 = blk.i0, rows = blk.rows;
  if (rows <= 0) return;          // an empty block of a document-aligned launch (cuda/block_order.hpp)
  const int row_end = i0 + rows;  // rows past it are another block's (or past seq_q)
  const float ninf = -compat::infinity<float>();

  const std::uint32_t qs = (tc::smem_addr(wgmma_smem) + 1023u) & ~1023u;
  const std::uint32_t ks0 = qs + BQ * DP * 2;  // stage s: K at ks0 + s·2·BC·DP·2, V right after it
  constexpr std::uint32_t kv_bytes = BC * DP * 2, stage_bytes = 2 * kv_bytes;
  const tc::WsBarriers<ST> bar{qs + static_cast<std::uint32_t>(Shape::tile_bytes)};
  const bool tma = a.tma.on != 0;
  if (threadIdx.x == 0) bar.init(tma ? 1 : NP, 128 * NC);
  __syncthreads();  // the last block-wide barrier: the producer leaves early

  if (wg == NC) {  // the producer
    tc::setmaxnreg_dec<24>();
    const int tid = threadIdx.x - 128 * NC;
    if (tma) {
      if (tid == 0) {
        for (int i = 0; i < 3; ++i) tc::tma_prefetch(a.tma, i);
        tc::ws_produce<ST, int>(  // int key positions: seq_k < 2^31 - 256 (wgmma_forward_why_not)
            bar, a.mask, i0, i0 + rows, BC,
            [&](std::uint32_t full) {
              tc::mbar_arrive_expect_tx(full, BQ * DP * 2);
              tc::tma_rows<D, BQ>(qs, a.tma, 0, i0, h, b, full);
            },
            [&](int st, int j0, int, std::uint32_t full) {
              const std::uint32_t kd = ks0 + st * stage_bytes;
              tc::mbar_arrive_expect_tx(full, stage_bytes);
              tc::tma_rows<D, BC>(kd, a.tma, 1, j0, hk, b, full);
              tc::tma_rows<D, BC>(kd + kv_bytes, a.tma, 2, j0, hk, b, full);
            });
      }
      return;
    }
    const std::uint16_t* kbase = a.k + b * a.k_s[0] + hk * a.k_s[2];
    const std::uint16_t* vbase = a.v + b * a.v_s[0] + hk * a.v_s[2];
    const long kstride = a.k_s[1], vstride = a.v_s[1];
    tc::ws_produce<ST, int>(
        bar, a.mask, i0, i0 + rows, BC,
        [&](std::uint32_t full) {
          tc::load_tile_sw128<D, BQ, NP>(qs, a.q + b * a.q_s[0] + static_cast<long>(i0) * a.q_s[1] + h * a.q_s[2],
                                         a.q_s[1], rows, tid);
          tc::cp_async_mbar_arrive(full);
        },
        [&](int st, int j0, int j_end, std::uint32_t full) {
          const int cols = j_end - j0 < BC ? j_end - j0 : BC;
          const std::uint32_t kd = ks0 + st * stage_bytes;
          tc::load_tile_sw128<D, BC, NP>(kd, kbase + static_cast<long>(j0) * kstride, kstride, cols, tid);
          tc::load_tile_sw128<D, BC, NP>(kd + kv_bytes, vbase + static_cast<long>(j0) * vstride, vstride, cols, tid);
          tc::cp_async_mbar_arrive(full);
        });
    tc::cp_async_wait_all();
    return;
  }

  tc::setmaxnreg_inc<NC == 3 ? 160 : 240>();  // (NC · R + 24) · 128 registers fit the SM's 65,536
  const int wr0 = i0 + warp * 16;             // this warp's first query row
  const int tid = threadIdx.x & 127;          // in the warpgroup
  float acc[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  float m[2] = {ninf, ninf}, l[2] = {0.f, 0.f};
  const float c = a.scale * tc::log2e;
  constexpr float kStale = 8.f * 0.6931471805599453f;
  const float cap_in = Softcap ? a.scale / a.softcap : 0.f, cap_out = Softcap ? a.softcap / a.scale : 0.f;
  const std::uint32_t q_wg = qs + static_cast<std::uint32_t>(wg * 64 * 128);
  float s[BC / 8][4];
  std::uint32_t pa[BC / 16][4];
  tc::RowKeys rk;  // the pass's: one per document the block's rows meet (one without documents)
  int j_begin = 0, j_end = 0;
  // The softmax of tile t in place in s (softcap, masks, running max, exponentials, row sums); returns whether
  // O is to be rescaled, by f.
  auto softmax = [&](int j0, float(&f)[2]) {
    const int cols = j_end - j0 < BC ? j_end - j0 : BC;
    tc::softcap_and_mask_rows<BC, Softcap>(s, rk, j0, cols, t4, cap_in, cap_out);
    float tmax[2] = {ninf, ninf};
#pragma unroll
    for (int n = 0; n < BC / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) tmax[e >> 1] = fmaxf(tmax[e >> 1], s[n][e]);
    float tm[2];
    bool grow = false;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float t = tc::quad_max(tmax[r]);
      tm[r] = t == ninf ? ninf : t * a.scale;
      grow |= tm[r] > m[r] + kStale;
    }
    const bool rescale = __any_sync(0xffffffffu, grow);
    if (rescale) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const MergeFactors<float> mf = merge_factors(m[r], tm[r]);
        m[r] = mf.m;
        l[r] *= mf.scale_a;
        f[r] = mf.scale_a;
      }
    }
    float mc[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) mc[r] = m[r] == ninf ? 0.f : m[r] * tc::log2e;
#pragma unroll
    for (int n = 0; n < BC / 8; ++n) {
      s[n][0] = tc::exp2_approx(fmaf(s[n][0], c, -mc[0]));
      s[n][1] = tc::exp2_approx(fmaf(s[n][1], c, -mc[0]));
      s[n][2] = tc::exp2_approx(fmaf(s[n][2], c, -mc[1]));
      s[n][3] = tc::exp2_approx(fmaf(s[n][3], c, -mc[1]));
      l[0] += s[n][0] + s[n][1];
      l[1] += s[n][2] + s[n][3];
    }
    return rescale;
  };
  // O *= f where the softmax asked, then P packed to the A fragments of O += P·V.
  auto rescale_and_pack = [&](bool rescale, const float(&f)[2]) {
    if (rescale) {
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        acc[n][0] *= f[0];
        acc[n][1] *= f[0];
        acc[n][2] *= f[1];
        acc[n][3] *= f[1];
      }
    }
#pragma unroll
    for (int n = 0; n < BC / 8; ++n) {
      pa[n / 2][(n & 1) * 2 + 0] = cuda16<T>::pack(s[n][0], s[n][1]);
      pa[n / 2][(n & 1) * 2 + 1] = cuda16<T>::pack(s[n][2], s[n][3]);
    }
  };
  // Waits for stage st's tiles (key tile j0) and for this warpgroup's turn; issues S = Q·Kᵀ from it.
  auto issue_s = [&](int st, unsigned use, int j0) {
    tc::mbar_wait(bar.full(st), use & 1);
    // V's rows past the pass's keys as 0 (K's are masked in S): every consumer warpgroup writes them before its
    // own P·V reads them (the same zeros; the turn barrier below orders this warpgroup's threads)
    if (tma && j_end - j0 < BC) tc::zero_rows_sw128<D, BC, 128>(ks0 + st * stage_bytes + kv_bytes, j_end - j0, tid);
    tc::fence_proxy_async();  // cp.async writes (the generic proxy), seen through the barrier, before wgmma reads
    const std::uint32_t kst = ks0 + st * stage_bytes;
    tc::named_sync(1 + wg, 256);
    tc::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const std::uint32_t in_row = static_cast<std::uint32_t>((kk & 3) * 32);
      tc::wgmma_ss<BC, T>(s, tc::wgmma_desc(q_wg + (kk >> 2) * BQ * 128 + in_row, 16, 1024),
                          tc::wgmma_desc(kst + (kk >> 2) * BC * 128 + in_row, 16, 1024), kk);
    }
    tc::wgmma_commit();
  };
  // O += P·V, V read transposed.
  auto issue_pv = [&](int st) {
    const std::uint32_t vst = ks0 + st * stage_bytes + kv_bytes;
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk) tc::wgmma_rs_tile<D, BC, T>(acc, pa[kk], vst, kk);
    tc::wgmma_commit();
  };
  auto hand_over = [&] {  // the next warpgroup's turn
    tc::named_arrive(wg + 1 == NC ? 1 : 2 + wg, 256);
  };

  tc::mbar_wait(bar.head(), 0);
  if (wg == NC - 1) tc::named_arrive(1, 256);  // warpgroup 0 takes the first turn
  // Tile t of the block (over all passes, as tc::ws_produce loads them) is in stage t mod ST, its (t / ST)-th
  // use. Each pass ends its pipeline and releases its last stage.
  int st = 0;
  unsigned use = 0;
  const DocumentSpan span = a.mask.documents_of_rows(i0, i0 + rows);
  for (int doc = span.first; doc < span.last; ++doc) {
    const KeyRule mask = a.mask.rule(doc);
    j_begin = static_cast<int>(mask.key_begin(i0));
    j_end = static_cast<int>(mask.key_end(i0 + rows));
    if (j_begin >= j_end) continue;
    rk = tc::RowKeys(mask, i0, rows, wr0 + g);
    issue_s(st, use, j_begin);
    hand_over();
    tc::wgmma_wait<0>();
    tc::wgmma_hold(s);
    float f0[2] = {1.f, 1.f};
    rescale_and_pack(softmax(j_begin, f0), f0);
    int prev = st;
    if (++st == ST) st = 0, ++use;
    for (int j0 = j_begin + BC; j0 < j_end; j0 += BC) {
      issue_s(st, use, j0);
      issue_pv(prev);
      hand_over();
      tc::wgmma_wait<1>();  // S_t; O += P_{t-1}·V_{t-1} may still run
      tc::wgmma_hold(s);
      float f[2] = {1.f, 1.f};
      const bool rescale = softmax(j0, f);
      tc::wgmma_wait<0>();  // O += P_{t-1}·V_{t-1}: its stage is free, acc and pa may be written
      tc::wgmma_hold(acc);
      tc::mbar_arrive(bar.empty(prev));
      rescale_and_pack(rescale, f);
      prev = st;
      if (++st == ST) st = 0, ++use;
    }
    tc::wgmma_fence();
    issue_pv(prev);
    tc::wgmma_wait<0>();
    tc::wgmma_hold(acc);
    tc::mbar_arrive(bar.empty(prev));  // the next pass's tiles may refill it
  }
  if (wg == 0) tc::named_sync(1, 256);  // the last warpgroup's last turn handed over: barrier 1 ends balanced

  OutT* obase = a.o + b * a.o_s[0] + h * a.o_s[2];
  float* lbase = a.lse + b * a.l_s[0] + h * a.l_s[1];
  float lsum[2], inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    lsum[r] = tc::quad_sum(l[r]);
    inv[r] = lsum[r] == 0.f ? 0.f : 1.f / lsum[r];
  }
  const int r0 = wr0 + g, r1 = r0 + 8;
  tc::store_c_rows<D, T>(acc, inv[0], inv[1], r0 < row_end ? obase + r0 * a.o_s[1] : nullptr,
                         r1 < row_end ? obase + r1 * a.o_s[1] : nullptr, t4);
  if (t4 == 0) {
    if (r0 < row_end) lbase[r0 * a.l_s[2]] = SoftmaxState<float>{m[0], lsum[0]}.lse();
    if (r1 < row_end) lbase[r1 * a.l_s[2]] = SoftmaxState<float>{m[1], lsum[1]}.lse();
  }
#else
  (void)a;
#if defined(__CUDA_ARCH__)
  __trap();  // not reachable: the plan runs this kernel only where wgmma_loaded says the sm_90a image is in
#endif
#endif
}

/// Whether the device of `space` runs this build's sm_90a image of kfa's kernels: a build for sm_90 and
/// sm_90a carries both images and the CUDA runtime picks one per device, so this launches a probe once
/// per device (synchronizing `space` that once) and remembers the answer.
inline bool wgmma_loaded(const Kokkos::Cuda& space) {
  static std::mutex mu;
  static signed char known[256] = {};  // per device: 0 not asked yet, 1 sm_90a, -1 not
  const int dev = space.cuda_device();
  std::lock_guard<std::mutex> lock(mu);
  if (dev < 0 || dev >= 256) return false;
  if (known[dev] == 0) {
    Kokkos::View<int, Kokkos::CudaSpace> flag(Kokkos::view_alloc(space, "kfa::wgmma_probe"));
    wgmma_probe_kernel<><<<1, 1, 0, space.cuda_stream()>>>(flag.data());
    int got = 0;
    if (cudaGetLastError() == cudaSuccess) {
      const auto host = Kokkos::create_mirror_view(flag);
      Kokkos::deep_copy(space, host, flag);
      space.fence("kfa::wgmma_probe");
      got = host();
    }
    known[dev] = got == 1 ? 1 : -1;
  }
  return known[dev] == 1;
}
#endif  // KFA_HAS_TENSOR_CORES

/// Whether ExecSpace is one the wgmma kernels are compiled for (Kokkos::Cuda in a tensor-core build).
template <class ExecSpace>
constexpr bool wgmma_space() {
#if KFA_HAS_TENSOR_CORES
  return std::is_same<ExecSpace, Kokkos::Cuda>::value;
#else
  return false;
#endif
}

/// Why a wgmma kernel needing `smem` bytes of shared memory per block cannot run on this space's device
/// ("" when it can): Kokkos::Cuda on a compute capability 9.0 device, the shared memory, and the device
/// running sm_90a code (the probe last); `kernel` names it in the message.
template <class ExecSpace>
std::string wgmma_device_problem(const ExecSpace& space, std::size_t smem, const char* kernel) {
#if KFA_HAS_TENSOR_CORES
  if constexpr (std::is_same<ExecSpace, Kokkos::Cuda>::value) {
    const cudaDeviceProp& prop = space.cuda_device_prop();
    if (prop.major != 9 || prop.minor != 0)
      return "wgmma needs a compute capability 9.0 device (sm_90a code), this one is " + std::to_string(prop.major) +
             "." + std::to_string(prop.minor);
    std::string why = native_smem_problem(space, smem, kernel);
    if (why.empty() && !wgmma_loaded(space))
      why =
          "the device runs no sm_90a image of kfa's kernels (compile with -gencode=arch=compute_90a,code=sm_90a "
          "too; kfa's own build: KFA_ENABLE_SM90A)";
    return why;
  }
#endif
  (void)space, (void)smem, (void)kernel;
  return "it is a Kokkos::Cuda kernel for sm_90a";
}

/// Why the wgmma forward cannot run head dim d (with softcap or not) on this space's device ("" when it can): head
/// dim 64, 96, 128, 256, then wgmma_device_problem.
template <class ExecSpace>
std::string wgmma_forward_problem(const ExecSpace& space, int d, bool softcap) {
  if (!wgmma_space<ExecSpace>()) return wgmma_device_problem(space, 0, "the wgmma forward");
  if (!wgmma_forward_head_dim(d))
    return "head_dim = " + std::to_string(d) + " (the wgmma forward exists for 64, 96, 128 and 256)";
  const std::size_t smem = fa2_head_dim_switch(d, [&](auto dc) {
    constexpr int D = decltype(dc)::value;
    return softcap ? WgmmaWsForwardShape<D, true>::smem : WgmmaWsForwardShape<D>::smem;
  });
  return wgmma_device_problem(space, smem, "the wgmma forward");
}

#if KFA_HAS_TENSOR_CORES
template <int D, bool Softcap, class Args>
void wgmma_forward_launch_d(const Kokkos::Cuda& space, const Args& args) {
  using T = typename Args::T;
  using OutT = typename Args::o_type::non_const_value_type;
  using Shape = WgmmaWsForwardShape<D, Softcap>;
  WgmmaWsForwardArgs<OutT> a;
  const long league = set_forward_args(a, Shape::block_q, args);
  tma_maps_done(a.tma, tma_map_rows(a.tma, 0, args.q, Shape::block_q) &&
                           tma_map_rows(a.tma, 1, args.k, Shape::block_k) &&
                           tma_map_rows(a.tma, 2, args.v, Shape::block_k));
  native_launch(space, "kfa::attention_forward[tensor_core_wgmma]", &tc_wgmma_ws_forward_kernel<D, Softcap, T, OutT>,
                league, dim3(32 * Shape::warps), Shape::smem, Shape::min_blocks, a);
}

template <class Args>
void wgmma_forward_launch(const Kokkos::Cuda& space, const Args& args) {
  auto launch = [&](auto dc) {
    constexpr int D = decltype(dc)::value;
    if (args.softcap > 0.f)
      wgmma_forward_launch_d<D, true>(space, args);
    else
      wgmma_forward_launch_d<D, false>(space, args);
  };
  fa2_head_dim_switch(static_cast<int>(args.q.extent(3)), launch);
}
#endif

}  // namespace detail
}  // namespace kfa
