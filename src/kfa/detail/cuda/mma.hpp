#pragma once
/// cuda/mma.hpp: the Ampere primitives the CUDA families stand on (sm_80 and newer): the head-dim and view
/// eligibility tests and the warp-level PTX wrappers (mma.sync m16n8k16 with fp32 accumulation, ldmatrix,
/// cp.async, exp2) the tensor-core kernels use; the block order (cuda/block_order.hpp) comes with it. The
/// compile-time trait kfa::has_tensor_core_path is in kfa/paths.hpp.
///
/// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16"), with g = lane / 4 and t = lane % 4:
///   A 16×16 row-major, 4 registers of 2 elements: (g, 2t..2t+1), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..)
///   B 16×8  ("col"),   2 registers of 2 elements: (k = 2t..2t+1, n = g), (k = 2t+8.., n = g)
///   C 16×8  fp32,      4 values: (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)
/// Two neighbouring C tiles (16×16 in all) converted to 16-bit are exactly one A fragment, which is how
/// P = softmax(S) feeds P·V without leaving registers.
#include <kfa/compat.hpp>
#include <kfa/detail/cuda/block_order.hpp>  // QueryBlock, KeyBlock
#include <kfa/paths.hpp>                    // kfa::has_tensor_core_path, KFA_HAS_TENSOR_CORES
#include <kfa/types.hpp>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#if defined(KOKKOS_ENABLE_CUDA)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace kfa {

namespace detail {

/// Head dims the tensor-core kernels are instantiated for (each kernel's shape struct says its tiles per
/// head dim). 256 only in the FA2-layout kernels (below): the team forward's and the 16-keys-per-warp
/// backward's fp32 accumulators would not fit a thread's registers there.
inline bool tc_head_dim_supported(int d) {
  return d == 64 || d == 96 || d == 128;
}
/// The message part that lists them, for errors ("the tensor-core kernels exist for ...").
inline const char* tc_head_dims_text() {
  return "64, 96 and 128";
}

/// Head dims of the FA2-layout kernels (the forward in tc_fa2/forward.hpp, dK/dV in tc_fa2/backward.hpp, dQ
/// in tc_fa2/dq.hpp): the family's and 256. At 256 a forward or dQ warp takes one m16 tile of query rows
/// instead of two (O's or dQ's fp32 accumulator alone is 128 registers per thread) and a dK/dV block owns 64
/// keys instead of 128. The team forward and the 16-keys-per-warp backward stop at 128.
inline bool fa2_head_dim_supported(int d) {
  return tc_head_dim_supported(d) || d == 256;
}

/// f(std::integral_constant<int, D>{}) for the supported head dim D == d: the one switch from a run-time
/// head dim to the kernels' instances, which every tensor-core launcher and tile query goes through
/// (the caller has checked tc_head_dim_supported(d); anything else is taken as 128).
template <class F>
decltype(auto) tc_head_dim_switch(int d, F&& f) {
  if (d == 64) return f(std::integral_constant<int, 64>{});
  if (d == 96) return f(std::integral_constant<int, 96>{});
  return f(std::integral_constant<int, 128>{});
}
/// The same over fa2_head_dim_supported (the FA2-layout kernels' launchers and tile queries, and the wgmma
/// forward's, which has the same head dims).
template <class F>
decltype(auto) fa2_head_dim_switch(int d, F&& f) {
  if (d == 256) return f(std::integral_constant<int, 256>{});
  return tc_head_dim_switch(d, f);
}

/// Why a view cannot feed the tensor-core kernels (16-byte cp.async rows need a unit stride over the
/// head dim, 16-byte-aligned data and row strides that are multiples of 8 elements), or nullptr.
template <class V>
const char* tc_view_problem(const V& v) {
  using T = typename V::non_const_value_type;
  static_assert(V::rank == 4, "rank-4 views only");
  if (v.span() == 0) return nullptr;
  if (v.stride(3) != 1) return "its head_dim stride is not 1";
  if (reinterpret_cast<std::uintptr_t>(v.data()) % 16 != 0) return "its data is not 16-byte aligned";
  const std::size_t per16 = 16 / sizeof(T);
  if (v.stride(0) % per16 != 0 || v.stride(1) % per16 != 0 || v.stride(2) % per16 != 0)
    return "its strides are not multiples of 16 bytes";
  return nullptr;
}

#if KFA_HAS_TENSOR_CORES
/// Bits of a 16-bit element type as CUDA's own type.
template <class T>
struct cuda16;
#if KFA_HAS_HALF
template <>
struct cuda16<compat::half_t> {
  using type = __half;
  using type2 = __half2;
  static __device__ __forceinline__ std::uint32_t pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<std::uint32_t*>(&h);
  }
};
#endif
#if KFA_HAS_BHALF
template <>
struct cuda16<compat::bhalf_t> {
  using type = __nv_bfloat16;
  using type2 = __nv_bfloat162;
  static __device__ __forceinline__ std::uint32_t pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<std::uint32_t*>(&h);
  }
};
#endif
#endif

namespace tc {
constexpr float log2e = 1.4426950408889634f;  // log2(e): exp(x) = 2^(x·log2e), see exp2_approx
}  // namespace tc

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define KFA_TC_DEVICE 1
namespace tc {
/// 2^x in one MUFU.EX2 (subnormal results flush to 0). The softmax kernels fold log2(e) into the score
/// scale and the row offset (max or lse), so exp(scale·s − m) costs one FFMA and this; __expf adds a
/// multiply by log2(e) and the non-ftz range fix-ups around the same instruction.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

/// d += a·b for one m16n8k16 tile, fp32 accumulation.
template <class T>
__device__ __forceinline__ void mma(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) {
#if KFA_HAS_BHALF
  if (std::is_same<T, compat::bhalf_t>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    return;
  }
#endif
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ std::uint32_t smem_addr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

/// Four 8×8 16-bit matrices from shared memory; lane l gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&r)[4], std::uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
/// The same, each matrix transposed.
__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t (&r)[4], std::uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
/// Two transposed 8×8 matrices: the addresses of lanes 0-15 are used (as for matrices 0 and 1 of x4).
__device__ __forceinline__ void ldmatrix_x2_trans(std::uint32_t (&r)[2], std::uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}

/// 16 bytes global → shared without staging in registers; `valid` false writes zeros (src not read).
__device__ __forceinline__ void cp_async16(std::uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}
/// Waits for all but the most recently committed group (two-stage pipelines).
__device__ __forceinline__ void cp_async_wait_1() {
  asm volatile("cp.async.wait_group 1;\n" ::: "memory");
}
/// Waits for all but the N most recently committed groups (N + 1-stage pipelines).
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

/// Copies ROWS × D 16-bit elements (row r at src + r·stride) into a shared tile with row pitch D + 8
/// (the 16-byte pad keeps ldmatrix's eight row addresses in distinct banks); rows ≥ valid are zeroed.
/// NT threads (tid < NT) share the copy, `dr` whole rows per pass: each of the first dr·(D/8) threads keeps
/// one 16-byte column and walks its rows by pointer increments (no division or 64-bit multiply per chunk).
/// Where the D/8 chunks of a row do not divide NT (d = 96), dr is the largest power of two that fits, so
/// that the passes cover the tile's power-of-two rows exactly, and the other threads idle (instead of
/// every thread paying a division and a 64-bit multiply per chunk).
/// Shapes are template parameters so that the loop unrolls; `Unroll` = false rolls it where threads idle
/// (which form leaves a kernel without register spills differs per kernel: ptxas, CUDA 13.0, d = 96 — the
/// FA2 forward needs it rolled, the FA2 dK/dV kernel with softcap and dQ fused unrolled).
template <int D, int ROWS, int NT, bool Unroll = true>
__device__ __forceinline__ void load_tile_async(std::uint32_t dst, const std::uint16_t* src, long stride, int valid,
                                                int tid) {
  constexpr int chunks = D / 8;  // 16-byte chunks per row
  constexpr int fit = NT / chunks;
  constexpr int pow2 = fit >= 16 ? 16 : fit >= 8 ? 8 : fit >= 4 ? 4 : fit >= 2 ? 2 : 1;
  constexpr int dr = fit * chunks == NT ? fit : pow2;  // rows per pass
  static_assert(fit >= 1, "at least one row per pass");
  constexpr int iters = (ROWS + dr - 1) / dr;
  if (dr * chunks != NT && tid >= dr * chunks) return;
  const int r0 = tid / chunks, x = tid % chunks;
  const std::uint16_t* p = src + static_cast<long>(r0) * stride + x * 8;
  std::uint32_t d = dst + static_cast<std::uint32_t>((r0 * (D + 8) + x * 8) * 2);
#pragma unroll(Unroll || dr * chunks == NT ? iters : 1)
  for (int it = 0; it < iters; ++it) {
    const int r = r0 + it * dr;
    if (ROWS % dr == 0 || r < ROWS) {
      const bool ok = r < valid;
      cp_async16(d, ok ? p : src, ok);
    }
    p += dr * stride;
    d += static_cast<std::uint32_t>(dr * (D + 8) * 2);
  }
}

/// A fragments of a 16 × D row block straight from global memory: r0 = row g, r1 = row g + 8 of the
/// block (nullptr: a row past the end, read as zeros). Used once per kernel for the operand a warp keeps.
template <int D, class T>
__device__ __forceinline__ void load_a_rows(std::uint32_t (&a)[D / 16][4], const T* r0, const T* r1, int t4) {
  const std::uint32_t* p0 = reinterpret_cast<const std::uint32_t*>(r0);
  const std::uint32_t* p1 = reinterpret_cast<const std::uint32_t*>(r1);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    a[kk][0] = p0 ? p0[kk * 8 + t4] : 0u;
    a[kk][1] = p1 ? p1[kk * 8 + t4] : 0u;
    a[kk][2] = p0 ? p0[kk * 8 + 4 + t4] : 0u;
    a[kk][3] = p1 ? p1[kk * 8 + 4 + t4] : 0u;
  }
}

/// Keys (or columns) 16·kk … 16·kk + 15 of a warp's 16-row C accumulator, i.e. C tiles 2·kk and 2·kk + 1,
/// as one 16-bit A fragment (see the layouts at the top of this file): P and dS feed the next product.
template <class T, int N>
__device__ __forceinline__ void c_to_a(std::uint32_t (&a)[4], const float (&c)[N][4], int kk) {
  a[0] = cuda16<T>::pack(c[2 * kk][0], c[2 * kk][1]);
  a[1] = cuda16<T>::pack(c[2 * kk][2], c[2 * kk][3]);
  a[2] = cuda16<T>::pack(c[2 * kk + 1][0], c[2 * kk + 1][1]);
  a[3] = cuda16<T>::pack(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

/// Writes a warp's 16 × D fp32 accumulator (C layout, times `mul`) as rows of 16-bit T; r0/r1 as above.
template <int D, class T, class Out>
__device__ __forceinline__ void store_c_rows(const float (&c)[D / 8][4], float mul0, float mul1, Out* r0, Out* r1,
                                             int t4) {
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    if (std::is_same<Out, float>::value) {
      if (r0) *reinterpret_cast<float2*>(r0 + n * 8 + 2 * t4) = make_float2(c[n][0] * mul0, c[n][1] * mul0);
      if (r1) *reinterpret_cast<float2*>(r1 + n * 8 + 2 * t4) = make_float2(c[n][2] * mul1, c[n][3] * mul1);
    } else {
      if (r0) *reinterpret_cast<std::uint32_t*>(r0 + n * 8 + 2 * t4) = cuda16<T>::pack(c[n][0] * mul0, c[n][1] * mul0);
      if (r1) *reinterpret_cast<std::uint32_t*>(r1 + n * 8 + 2 * t4) = cuda16<T>::pack(c[n][2] * mul1, c[n][3] * mul1);
    }
  }
}

}  // namespace tc
#else
#define KFA_TC_DEVICE 0
#endif

}  // namespace detail
}  // namespace kfa
