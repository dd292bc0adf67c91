#pragma once
/// common/canonical.hpp: the View types kfa's kernels are instantiated for. The API takes any rank-4 (and
/// rank-3 lse) Kokkos::View of the right element type in a memory space the execution space can reach; before a
/// kernel family is chosen, each call converts its arguments to unmanaged Views of one layout per call (as
/// KokkosBlas canonicalizes its arguments before its Impl):
///  - the rank-4 tensors of a call are all LayoutRight when every one of them is LayoutRight, else all
///    LayoutStride (LayoutLeft, strided subviews, packed QKV slices);
///  - a rank-3 row term (lse, D) is LayoutRight when it is, else LayoutStride;
///  - inputs become const, outputs keep their non-const element type, every View becomes Unmanaged (no
///    reference counting in the kernels' copies), and its Device<> spelling collapses to its memory space.
/// So const-ness, memory traits, Device<> spellings and layout mixes no longer multiply the kernels'
/// instantiations: per execution space, element type and memory space the tensors come in two layouts (and
/// lse / D in two), whatever the callers pass. The kernels take these Views in one argument struct per call
/// (common/kernel_args.hpp).
#include <kfa/compat.hpp>
#include <type_traits>

namespace kfa {
namespace detail {

/// LayoutRight when every View type given is LayoutRight, else LayoutStride.
template <class... V>
using canonical_layout_t =
    std::conditional_t<(std::is_same<typename V::array_layout, Kokkos::LayoutRight>::value && ...), Kokkos::LayoutRight,
                       Kokkos::LayoutStride>;

/// The canonical type of an input View V (read only) in layout Layout.
template <class Layout, class V>
using canonical_in_t = Kokkos::View<typename V::const_data_type, Layout, typename V::memory_space,
                                    Kokkos::MemoryTraits<Kokkos::Unmanaged>>;

/// The canonical type of an output View V in layout Layout.
template <class Layout, class V>
using canonical_out_t = Kokkos::View<typename V::non_const_data_type, Layout, typename V::memory_space,
                                     Kokkos::MemoryTraits<Kokkos::Unmanaged>>;

}  // namespace detail
}  // namespace kfa
