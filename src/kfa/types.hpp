#pragma once
/// Element types kfa accepts and the accumulation type used for each.
#include <kfa/compat.hpp>

#include <string>
#include <type_traits>

namespace kfa {

/// True for the element types attention accepts: double, float, half and bfloat16 (where Kokkos has them).
template <class T>
struct is_supported_element
    : std::integral_constant<bool, std::is_same<T, double>::value || std::is_same<T, float>::value> {};
#if KFA_HAS_HALF
template <>
struct is_supported_element<compat::half_t> : std::true_type {};
#endif
#if KFA_HAS_BHALF
template <>
struct is_supported_element<compat::bhalf_t> : std::true_type {};
#endif

/// Accumulation type: double for double inputs, float for everything else.
template <class T>
using accumulator_t = std::conditional_t<std::is_same<T, double>::value, double, float>;

/// Short dtype name used in profiling regions and messages.
template <class T>
inline std::string dtype_name() {
  if (std::is_same<T, double>::value) return "double";
  if (std::is_same<T, float>::value) return "float";
#if KFA_HAS_HALF
  if (std::is_same<T, compat::half_t>::value) return "half";
#endif
#if KFA_HAS_BHALF
  if (std::is_same<T, compat::bhalf_t>::value) return "bfloat16";
#endif
  return "unsupported";
}

}  // namespace kfa
