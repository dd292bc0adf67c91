#pragma once
/// cuda/native_args.hpp: the argument structs of the natively launched query-block kernels (the FA2-layout
/// forward and dQ, the 3xTF32 and wgmma kernels): raw pointers and element strides filled from a call's
/// ForwardArgs or BackwardArgs, and the launch of a native forward.
#include <kfa/detail/cuda/mma.hpp>
#include <kfa/detail/cuda/native.hpp>
#include <kfa/detail/cuda/recompute_p.hpp>
#include <kfa/detail/mask.hpp>

#include <cstdint>
#include <type_traits>

namespace kfa {
namespace detail {

/// Element strides of a view's first three dimensions: (batch, row, head) of q, k, v, o, or (batch, head, row)
/// of lse.
template <class V>
void strides3(const V& x, long (&s)[3]) {
  for (int r = 0; r < 3; ++r) s[r] = static_cast<long>(x.stride(r));
}

/// What the natively launched query-block kernels (the native forwards, the dQ kernels) read of q, k and
/// v, as raw 16-bit pointers and element strides, with the extents, scale and mask; each kernel's argument
/// struct adds its own operands.
struct Fa2QkvArgs {
  const std::uint16_t* q;
  const std::uint16_t* k;
  const std::uint16_t* v;
  long q_s[3], k_s[3], v_s[3];
  int seq_q, heads_q, group;
  BlockOrder order;  // of the query blocks
  float scale;
  KeyMask mask;
  /// From a call's ForwardArgs or BackwardArgs (common/kernel_args.hpp); `block_q`: the kernel's query rows per
  /// block. Returns the number of blocks.
  template <class Args>
  long set_qkv(const Args& x, int block_q) {
    q = reinterpret_cast<const std::uint16_t*>(x.q.data());
    k = reinterpret_cast<const std::uint16_t*>(x.k.data());
    v = reinterpret_cast<const std::uint16_t*>(x.v.data());
    strides3(x.q, q_s), strides3(x.k, k_s), strides3(x.v, v_s);
    seq_q = static_cast<int>(x.q.extent(1));
    heads_q = static_cast<int>(x.q.extent(2));
    group = static_cast<int>(x.q.extent(2) / x.k.extent(2));
    scale = x.scale;
    mask = x.mask;
    order = query_block_order(x, block_q);
    return order.league();
  }
};

/// A native forward's arguments: Fa2QkvArgs, the outputs and the softcap.
template <class OutT>
struct Fa2ForwardArgs : Fa2QkvArgs {
  OutT* o;
  float* lse;
  long o_s[3], l_s[3];  // l_s: (batch, head, row)
  float softcap;
};

/// A native dQ kernel's arguments: Fa2QkvArgs (above), dO, lse and D ([batch][head][row]), dq, the
/// recomputation's constants.
template <class OutT>
struct Fa2DqArgs : Fa2QkvArgs {
  const std::uint16_t* d_o;
  const float* lse;
  const float* dd;
  OutT* dq;
  long do_s[3], dq_s[3], l_s[3], d_s[3];
#if KFA_HAS_TENSOR_CORES
  TcRecomputeConsts pc{1.f, 0.f};
#endif
};

#if KFA_HAS_TENSOR_CORES
/// Fills a native forward's arguments from a call's ForwardArgs for a kernel of `block_q` query rows per block;
/// returns the number of blocks (native_launch checks it fits an int).
template <class OutT, class Args>
long set_forward_args(Fa2ForwardArgs<OutT>& a, int block_q, const Args& args) {
  static_assert(std::is_same<typename Args::o_type::non_const_value_type, OutT>::value, "the kernel writes o's type");
  static_assert(std::is_same<typename Args::lse_type::non_const_value_type, float>::value, "float log-sum-exp only");
  const long league = a.set_qkv(args, block_q);
  a.o = args.o.data();
  a.lse = args.lse.data();
  strides3(args.o, a.o_s), strides3(args.lse, a.l_s);
  a.softcap = args.softcap;
  return league;
}

/// Fills a native forward's arguments from a call's ForwardArgs and launches `kernel` (a natively launched
/// forward with shape Shape: the FA2-layout one, the 3xTF32 one, the wgmma one) on the caller's stream;
/// `name` is its profiling region.
template <class Shape, class OutT, class Args>
void native_forward_launch(const Kokkos::Cuda& space, const char* name, void (*kernel)(Fa2ForwardArgs<OutT>),
                           const Args& args) {
  Fa2ForwardArgs<OutT> a;
  const long league = set_forward_args(a, Shape::block_q, args);
  native_launch(space, name, kernel, league, dim3(32 * Shape::warps), Shape::smem, Shape::min_blocks, a);
}

/// The arguments of a natively launched dQ kernel with `block_q` query rows per block; returns the number of
/// blocks (native_launch checks that it fits an int).
template <class Args>
long set_dq_args(Fa2DqArgs<typename Args::dq_type::non_const_value_type>& a, const Args& args, int block_q) {
  static_assert(std::is_same<typename Args::lse_type::non_const_value_type, float>::value, "float log-sum-exp only");
  static_assert(std::is_same<typename Args::d_type::non_const_value_type, float>::value, "float D only");
  const long league = a.set_qkv(args, block_q);
  a.d_o = reinterpret_cast<const std::uint16_t*>(args.d_o.data());
  a.lse = args.lse.data();
  a.dd = args.dd.data();
  a.dq = args.dq.data();
  strides3(args.d_o, a.do_s), strides3(args.dq, a.dq_s), strides3(args.lse, a.l_s), strides3(args.dd, a.d_s);
  a.pc = TcRecomputeConsts(args.scale, args.softcap);
  return league;
}
#endif  // KFA_HAS_TENSOR_CORES

}  // namespace detail
}  // namespace kfa
