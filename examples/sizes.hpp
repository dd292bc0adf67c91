#pragma once
// Sizes an example cannot fill, refused before anything is allocated (as kfa-longseq refuses a run that does
// not fit). Two limits:
// - Elements per View: below 2^31. Kokkos 3.4 as Debian ships it keeps a View's span in 32 bits: a float
//   View of [1, 2^25, 1, 128] gets a span (and an allocation) of 0, and Kokkos::fill_random then writes past
//   the end (SIGSEGV). The examples fill every tensor with fill_random, and 2^31 leaves room for any int index.
// - Bytes: the tensors must fit in the memory there is: host bytes (all of them on host backends; the host
//   copies the example checks against on a device) against MemAvailable of /proc/meminfo, summed over the
//   ranks that share a node; on CUDA the device bytes against the GPU's free memory.
#include <Kokkos_Core.hpp>

#include <cstdio>
#include <fstream>
#include <string>
#include <type_traits>
#include <vector>

namespace kfa_sizes {

// One tensor an example allocates: its name, its extents, its element size, and whether the example also
// holds a host copy of it when the tensors live on a device.
struct Tensor {
  std::string name;
  std::vector<long long> extents;
  unsigned long long element_bytes;
  bool host_copy = false;
};

constexpr unsigned long long max_view_elements = (1ULL << 31) - 1;

// MemAvailable of /proc/meminfo in bytes; 0 when unknown (not Linux).
inline unsigned long long mem_available() {
  std::ifstream f("/proc/meminfo");
  std::string key, rest;
  unsigned long long kib = 0;
  while (f >> key >> kib) {
    std::getline(f, rest);
    if (key == "MemAvailable:") return kib * 1024ULL;
  }
  return 0;
}

// The product of the extents; false when it does not fit in 64 bits.
inline bool element_count(const Tensor& t, unsigned long long& n) {
  n = 1;
  for (long long e : t.extents)
    if (__builtin_mul_overflow(n, static_cast<unsigned long long>(e), &n)) return false;
  return true;
}

inline std::string shape_text(const Tensor& t) {
  std::string s = t.name + " [";
  for (std::size_t i = 0; i < t.extents.size(); ++i) s += (i ? ", " : "") + std::to_string(t.extents[i]);
  return s + "]";
}

inline std::string gib(double bytes) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f GiB", bytes / 1073741824.0);
  return b;
}

// "" when the example can allocate and fill `tensors`; else why not, as "<program>: <args>: ...; nothing was
// allocated: <advice>". `args` names the options and their values; `ranks_on_node` ranks of this node each
// hold the same tensors.
inline std::string problem(const std::string& program, const std::string& args, const std::vector<Tensor>& tensors,
                           const std::string& advice, int ranks_on_node = 1) {
  const std::string head = program + ": " + args + ": ";
  const std::string tail = "; nothing was allocated: " + advice;
  using Mem = Kokkos::DefaultExecutionSpace::memory_space;
  constexpr bool on_host = Kokkos::SpaceAccessibility<Kokkos::HostSpace, Mem>::accessible;
  double host = 0, device = 0;
  std::string names;
  for (const Tensor& t : tensors) {
    unsigned long long n = 0;
    const bool fits = element_count(t, n);
    if (!fits || n > max_view_elements)
      return head + shape_text(t) + " has " + (fits ? std::to_string(n) : std::string("more than 2^64")) +
             " elements, but this example holds at most 2^31 - 1 (2147483647) per View (Kokkos 3.4 miscounts " +
             "larger Views, and Kokkos::fill_random then writes past their end)" + tail;
    const double bytes = static_cast<double>(n) * static_cast<double>(t.element_bytes);
    if (on_host)
      host += bytes;
    else
      device += bytes, host += t.host_copy ? bytes : 0.0;
    names += (names.empty() ? "" : ", ") + t.name;
  }
  host *= ranks_on_node;
  const unsigned long long avail = mem_available();
  if (avail > 0 && host > static_cast<double>(avail))
    return head + "the tensors (" + names + ") need at least " + std::to_string(static_cast<unsigned long long>(host)) +
           " bytes (" + gib(host) + ") of host memory" +
           (ranks_on_node > 1 ? " for the " + std::to_string(ranks_on_node) + " ranks on this node" : std::string()) +
           ", but MemAvailable is " + std::to_string(avail) + " bytes (" + gib(static_cast<double>(avail)) + ")" + tail;
#ifdef KOKKOS_ENABLE_CUDA
  if (std::is_same<Mem, Kokkos::CudaSpace>::value) {
    size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess && device > static_cast<double>(free_b))
      return head + "the tensors (" + names + ") need at least " +
             std::to_string(static_cast<unsigned long long>(device)) + " bytes (" + gib(device) +
             ") of device memory, but the GPU has " + std::to_string(free_b) + " bytes free (" +
             gib(static_cast<double>(free_b)) + ", cudaMemGetInfo)" + tail;
  }
#endif
  (void)device;
  return "";
}

}  // namespace kfa_sizes
