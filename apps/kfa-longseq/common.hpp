#pragma once
// kfa-longseq: what every part of the app shares: the options, this rank's shard of the problem, the
// tensors on the device, and small helpers.
#include <mpi.h>
#include <sys/resource.h>
#include <kfa/distributed/dist.hpp>
#include <kfa/types.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace longseq {

struct Config {
  std::string input, output, json, dtype = "float32", output_dtype, layout = "contiguous";
  bool generate = false, causal = false, backward = false, progress = false, quiet = false, allow_nonfinite = false;
  bool nondeterministic = false;  // AttentionOptions::deterministic = false (atomic dQ where a family has it)
  double progress_interval = 10;  // seconds between progress lines (not on a terminal)
  long batch = 1, seqlen = 65536;
  int heads = 4, kv_heads = 0, head_dim = 64, check = 0;
  std::uint64_t seed = 1;
  std::vector<int> window;
  double scale = 0, softcap = 0;
  double check_tol = -1;              // < 0: the dtype's default
  long max_message_bytes = 0;         // 0: the Ring's default (1 GiB)
  std::vector<int> doc_lengths;       // --doc-lengths: documents packed into the sequence
  std::vector<double> doc_lognormal;  // --doc-lognormal MEDIAN SIGMA MIN MAX SEED
  std::string sp = "ring";            // --sp: ring, ulysses, hybrid or auto (strategy.hpp)
  int ulysses_degree = 0;             // --ulysses-degree (0: what --sp implies)
};

/// Throws kfa::Error with a message built from streamable pieces.
template <class... Args>
[[noreturn]] void fail(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  throw kfa::Error(os.str());
}

inline double max_over(double x, MPI_Comm comm) {
  MPI_Allreduce(MPI_IN_PLACE, &x, 1, MPI_DOUBLE, MPI_MAX, comm);
  return x;
}
inline long max_over(long x, MPI_Comm comm) {
  MPI_Allreduce(MPI_IN_PLACE, &x, 1, MPI_LONG, MPI_MAX, comm);
  return x;
}

/// This rank's part of the problem: the global shape and the segments of the sequence it holds.
struct Shard {
  long batch = 0, seq = 0, heads = 0, kv_heads = 0, d = 0;
  std::vector<kfa::dist::Segment> segs;
  long n = 0;  // local tokens
  /// The documents packed into the sequence (batch 1): their bounds as cu_seqlens, documents.size() − 1 of them;
  /// empty: one sequence per batch entry. No token attends to another document's.
  std::vector<long> documents;
  /// [first, end) of the document holding position i (the whole sequence without documents).
  std::pair<long, long> document_of(long i) const {
    if (documents.empty()) return {0, seq};
    const auto it = std::upper_bound(documents.begin(), documents.end() - 1, i);  // the first bound past i
    return {*(it - 1), *it};
  }
  long longest_document() const {
    long m = documents.empty() ? seq : 0;
    for (size_t x = 1; x < documents.size(); ++x) m = std::max(m, documents[x] - documents[x - 1]);
    return m;
  }
  /// Σ over the (batch entries or) documents of length²: the query-key pairs a full mask would score.
  double pairs() const {
    if (documents.empty()) return double(batch) * double(seq) * double(seq);
    double p = 0;
    for (size_t x = 1; x < documents.size(); ++x)
      p += double(documents[x] - documents[x - 1]) * (documents[x] - documents[x - 1]);
    return p;
  }
  /// The global position of local token `li`.
  long global_of(long li) const {
    for (const auto& sg : segs)
      if (li >= sg.local_begin && li < sg.local_begin + sg.length) return sg.global_begin + li - sg.local_begin;
    return 0;
  }
};

using Exec = Kokkos::DefaultExecutionSpace;
using Mem = Exec::memory_space;
constexpr bool device_is_host = Kokkos::SpaceAccessibility<Kokkos::HostSpace, Mem>::accessible;
template <class T>
using Tensor = Kokkos::View<T****, Kokkos::LayoutRight, Mem>;  // [batch, n, heads, head_dim]
template <class T>
using Lse = Kokkos::View<kfa::accumulator_t<T>***, Kokkos::LayoutRight, Mem>;  // [batch, heads, n]

/// The rank's tensors on the device (do, dq, dk, dv only with --backward).
template <class T>
struct Tensors {
  Tensor<T> q, k, v, o, d_o, dq, dk, dv;
  Lse<T> lse;
  /// Their bytes in the compute dtype (the lse in its accumulator type).
  double bytes() const {
    double b = 0;
    for (const Tensor<T>* x : {&q, &k, &v, &o, &d_o, &dq, &dk, &dv}) b += double(x->size()) * sizeof(T);
    return b + double(lse.size()) * sizeof(typename Lse<T>::value_type);
  }
};

/// A compute-dtype value as float64 (exact: through the accumulator type, which holds every T).
template <class T>
KOKKOS_INLINE_FUNCTION double to_double(const T& x) {
  return static_cast<double>(static_cast<kfa::accumulator_t<T>>(x));
}
/// x rounded to the compute dtype, as float64.
template <class T>
double round_to(double x) {
  return to_double(static_cast<T>(x));
}

/// The process's peak resident memory in bytes (VmHWM of /proc/self/status; getrusage's ru_maxrss where
/// that is missing).
inline double host_memory_peak() {
  std::ifstream f("/proc/self/status");
  std::string key;
  double kib = 0;
  while (f >> key) {
    if (key == "VmHWM:" && f >> kib) return kib * 1024.0;
    std::getline(f, key);
  }
  rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_maxrss * 1024.0;
}

}  // namespace longseq
