# Finds Kokkos and Kokkos Kernels and gives them one spelling: Kokkos::kokkos and kfa::kokkoskernels.
# Used by our own build and by the installed kfaConfig.cmake, so consumers get the same fixes.
# Kokkos Kernels is looked for only when KFA_ENABLE_KOKKOS_KERNELS is ON (the default; the installed
# kfaConfig.cmake sets it to what kfa was built with): only kfa/reference.hpp and the benchmarks use it.
#
# Debian 12 ships Kokkos 3.4.01 inside Trilinos 13.2. Its KokkosConfig.cmake creates Kokkos::kokkos with
# INTERFACE_INCLUDE_DIRECTORIES = <prefix>/../include computed one directory too high (/usr/lib/include,
# which does not exist, so CMake refuses the target). We repair the imported target here and never touch
# the system file. Its Kokkos Kernels target is called trilinos_kokkoskernels instead of
# Kokkos::kokkoskernels.
include_guard(GLOBAL)

find_package(Kokkos 3.4.01 REQUIRED CONFIG)
if(NOT TARGET Kokkos::kokkos)
  message(FATAL_ERROR "kfa: find_package(Kokkos) succeeded but defined no Kokkos::kokkos target")
endif()

get_target_property(_kfa_kokkos_inc Kokkos::kokkos INTERFACE_INCLUDE_DIRECTORIES)
set(_kfa_kokkos_fixed_inc "")
set(_kfa_kokkos_needs_fix FALSE)
foreach(_dir IN LISTS _kfa_kokkos_inc)
  if(_dir MATCHES "^\\$<" OR EXISTS "${_dir}")
    list(APPEND _kfa_kokkos_fixed_inc "${_dir}")
  else()
    set(_kfa_kokkos_needs_fix TRUE)
  endif()
endforeach()
if(_kfa_kokkos_needs_fix)
  # Kokkos_INCLUDE_DIRS is set correctly by the same (Trilinos-generated) config file.
  foreach(_dir IN LISTS Kokkos_INCLUDE_DIRS)
    get_filename_component(_dir "${_dir}" ABSOLUTE)
    if(EXISTS "${_dir}")
      list(APPEND _kfa_kokkos_fixed_inc "${_dir}")
    endif()
  endforeach()
  if(NOT _kfa_kokkos_fixed_inc)
    message(FATAL_ERROR "kfa: Kokkos::kokkos points at missing include directories (${_kfa_kokkos_inc}) "
                        "and Kokkos_INCLUDE_DIRS (${Kokkos_INCLUDE_DIRS}) gives no existing one")
  endif()
  list(REMOVE_DUPLICATES _kfa_kokkos_fixed_inc)
  set_property(TARGET Kokkos::kokkos PROPERTY INTERFACE_INCLUDE_DIRECTORIES "${_kfa_kokkos_fixed_inc}")
  message(STATUS "kfa: repaired Kokkos::kokkos include directories -> ${_kfa_kokkos_fixed_inc}")
endif()

if(NOT DEFINED KFA_ENABLE_KOKKOS_KERNELS)
  set(KFA_ENABLE_KOKKOS_KERNELS ON)
endif()
if(NOT KFA_ENABLE_KOKKOS_KERNELS)
  set(KFA_KOKKOS_VERSION "${Kokkos_VERSION}")
  message(STATUS "kfa: Kokkos ${Kokkos_VERSION} (${Kokkos_DIR}); Kokkos Kernels not used (KFA_ENABLE_KOKKOS_KERNELS=OFF)")
  return()
endif()

find_package(KokkosKernels REQUIRED CONFIG)
if(NOT TARGET kfa::kokkoskernels)
  add_library(kfa::kokkoskernels INTERFACE IMPORTED)
  if(TARGET Kokkos::kokkoskernels)
    set_property(TARGET kfa::kokkoskernels PROPERTY INTERFACE_LINK_LIBRARIES Kokkos::kokkoskernels)
  elseif(TARGET trilinos_kokkoskernels)
    # Trilinos' target carries no include directories of its own.
    set_property(TARGET kfa::kokkoskernels PROPERTY INTERFACE_LINK_LIBRARIES trilinos_kokkoskernels Kokkos::kokkos)
    set_property(TARGET kfa::kokkoskernels PROPERTY INTERFACE_INCLUDE_DIRECTORIES "${_kfa_kokkos_fixed_inc}")
  else()
    message(FATAL_ERROR "kfa: found KokkosKernels but neither Kokkos::kokkoskernels nor trilinos_kokkoskernels")
  endif()
endif()

# C++17 at least; Kokkos 5 needs C++20 and says so through its compile features.
set(KFA_KOKKOS_VERSION "${Kokkos_VERSION}")
message(STATUS "kfa: Kokkos ${Kokkos_VERSION} (${Kokkos_DIR}), KokkosKernels ${KokkosKernels_VERSION}")
