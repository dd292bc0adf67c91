// kfa-longseq: exact attention over one long sequence spread over MPI ranks, with HDF5 input/output, a
// float64 self-check and a performance report.
//
//   mpirun -np P kfa-longseq --generate --seqlen 65536 --heads 4 --head-dim 64 --causal --layout zigzag --check 4
//   mpirun -np P kfa-longseq --input in.h5 --output out.h5 --backward --dtype float32
//
// Run with --help for every option. The data path keeps the tensors on the device in the compute dtype:
// generated inputs are computed there (a counter hash), HDF5 reads and writes go through one block at a
// time, and --check regenerates or streams what it needs (apps/README.md, "memory").
#include "check.hpp"
#include "common.hpp"
#include "device.hpp"
#include "files.hpp"
#include "json.hpp"
#include "report.hpp"
#include "strategy.hpp"

#include <sys/stat.h>
#include <unistd.h>
#include <CLI/CLI.hpp>
#include <kfa/distributed/dist.hpp>
#include <kfa/io/hdf5.hpp>
#include <kfa/kfa.hpp>
#include <kfa/nonfinite.hpp>
#ifdef KOKKOS_ENABLE_CUDA
#include <cuda_runtime.h>
#endif

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <initializer_list>
#include <iomanip>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace longseq {
namespace {

// ---- memory: what a rank will allocate, before it allocates --------------------------------------------
// A byte count with overflow kept: a product or sum beyond 64 bits saturates and is remembered.
struct Bytes {
  unsigned long long v = 0;
  bool overflow = false;
  Bytes& add(std::initializer_list<unsigned long long> factors) {
    unsigned long long x = 1;
    for (unsigned long long f : factors) overflow |= __builtin_mul_overflow(x, f, &x);
    overflow |= __builtin_add_overflow(v, x, &v);
    return *this;
  }
  Bytes& add(const Bytes& o) {
    overflow |= o.overflow || __builtin_add_overflow(v, o.v, &v);
    return *this;
  }
};

// MemAvailable of /proc/meminfo in bytes; 0 when unknown (not Linux).
unsigned long long mem_available() {
  std::ifstream f("/proc/meminfo");
  std::string key, rest;
  unsigned long long kib = 0;
  while (f >> key >> kib) {
    std::getline(f, rest);
    if (key == "MemAvailable:") return kib * 1024ULL;
  }
  return 0;
}

std::string shape_text(const Shard& s) {
  return "[batch " + std::to_string(s.batch) + ", seq " + std::to_string(s.seq) + ", heads " + std::to_string(s.heads) +
         "/" + std::to_string(s.kv_heads) + ", head_dim " + std::to_string(s.d) + "]";
}

// What a rank will hold at once, in bytes: on the device the tensors in the compute dtype (q, k, v, o, lse;
// do, dq, dk, dv with --backward), the ring's buffers (K/V in flight; dK/dV accumulators travelling) and the
// check's row dots; on the host one I/O block and the check's travelling shards and rows. A lower bound:
// Kokkos, MPI, HDF5 and the CUDA context add their own.
struct MemoryNeed {
  Bytes device, host, check;
};
template <class T>
MemoryNeed memory_need(const Config& c, const Shard& s, long nmax) {
  using Acc = kfa::accumulator_t<T>;
  using U = unsigned long long;
  const U tok = U(s.batch) * U(s.n), tokmax = U(s.batch) * U(nmax), hq = U(s.heads) * U(s.d),
          hkv = U(s.kv_heads) * U(s.d);
  MemoryNeed m;
  m.device.add({tok, 2 * hq + 2 * hkv, sizeof(T)});             // q, k, v, o
  m.device.add({U(s.batch), U(s.heads), U(s.n), sizeof(Acc)});  // lse
  m.device.add({tokmax, hkv, 4 * sizeof(T)});  // the ring's K/V buffers in flight (and the exchange timing's)
  if (c.backward)
    m.device.add({tok, 2 * hq + 2 * hkv, sizeof(T)}).add({tokmax, hkv, 4 * sizeof(Acc)});  // do, dq, dk, dv
  if (c.check > 0 && c.backward) m.device.add({tok, U(s.heads), 8});  // D = dO·o of every query row
  if (!c.input.empty() || !c.output.empty())  // one I/O block: in T and in the file's type (8 bytes at most)
    m.host.add({std::min<U>(io_chunk_elements(), tok * std::max(hq, U(1))), sizeof(T) + 8});
  if (c.check > 0) {
    Bytes pass1, pass2;
    m.check.add({U(c.check), 8 * U(s.d) + 96});                     // the query rows
    if (!c.input.empty()) pass1.add({tokmax, 2 * hkv, sizeof(T)});  // K/V travelling in T
    if (c.backward) {
      m.check.add({U(c.check), 32 * U(s.d) + 96});                                  // dq and the key rows
      pass2.add({tokmax, U(s.heads), 16}).add({tok, U(s.heads), 8 + sizeof(Acc)});  // lse and D travelling, host copies
      if (!c.input.empty()) pass2.add({tokmax, 2 * hq, sizeof(T)});                 // q and dO travelling in T
    }
    m.check.add(pass1.v > pass2.v ? pass1 : pass2);  // one pass at a time
  }
  return m;
}

// Why this run cannot fit, or "" (collective): element counts beyond 64-bit arithmetic are refused outright;
// each rank's host bytes (with the device's on host backends), summed over the ranks that share a node,
// are compared with the node's MemAvailable; on CUDA each rank's device bytes, summed over the ranks that
// share a GPU, with that GPU's free memory.
template <class T>
std::string memory_problem(const Config& c, const Shard& s, int p, MPI_Comm comm) {
  using U = unsigned long long;
  Bytes global;  // the whole tensor q: a count that must exist in 64 bits (and as HDF5 sizes)
  global.add({U(s.batch), U(s.seq), U(s.heads), U(s.d), 8});
  global.add({U(s.batch), U(s.seq), U(s.kv_heads), U(s.d), 8});
  if (global.overflow)
    return "kfa-longseq: " + shape_text(s) + ": the element count overflows 64-bit arithmetic; nothing was allocated";
  const MemoryNeed need = memory_need<T>(c, s, max_over(s.n, comm));
  Bytes host = need.host;
  host.add(need.check);
  if (device_is_host) host.add(need.device);
  const std::string what = "kfa-longseq: " + shape_text(s) + " " + c.dtype +
                           (c.backward ? " forward+backward" : " forward") + " on " + std::to_string(p) +
                           " ranks needs ";
  const std::string advice = "; nothing was allocated: use more ranks or nodes, a shorter sequence or a smaller batch";
  MPI_Comm node;
  MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
  std::string problem;
#ifdef KOKKOS_ENABLE_CUDA
  if (std::is_same<Exec, Kokkos::Cuda>::value) {  // ranks sharing a GPU share its memory
    int dev = 0;
    size_t free_b = 0, total_b = 0;
    cudaGetDevice(&dev);
    cudaMemGetInfo(&free_b, &total_b);
    MPI_Comm gpu;
    MPI_Comm_split(node, dev, 0, &gpu);
    int on_gpu = 1;
    MPI_Comm_size(gpu, &on_gpu);
    double need_gpu = need.device.overflow ? 1e300 : static_cast<double>(need.device.v),
           free_min = static_cast<double>(free_b);
    MPI_Allreduce(MPI_IN_PLACE, &need_gpu, 1, MPI_DOUBLE, MPI_SUM, gpu);
    MPI_Allreduce(MPI_IN_PLACE, &free_min, 1, MPI_DOUBLE, MPI_MIN, gpu);
    MPI_Comm_free(&gpu);
    if (need.device.overflow || need_gpu > free_min) {
      std::ostringstream m;
      m << what;
      if (need.device.overflow)
        m << "more bytes of device memory per rank than 64-bit arithmetic counts";
      else
        m << "at least " << need.device.v << " bytes of device memory per rank (" << std::fixed << std::setprecision(1)
          << need.device.v / 1073741824.0 << " GiB: the tensors in " << c.dtype << " and the ring's buffers), "
          << std::setprecision(0) << need_gpu << " bytes for the " << on_gpu << " rank(s) on GPU " << dev
          << " of this node";
      m << ", but that GPU has " << std::setprecision(0) << free_min << " bytes free of " << total_b << " ("
        << std::setprecision(1) << free_min / 1073741824.0 << " of " << total_b / 1073741824.0
        << " GiB, cudaMemGetInfo)" << advice;
      problem = m.str();
    }
  }
#endif
  int on_node = 1;
  MPI_Comm_size(node, &on_node);
  double need_node = host.overflow ? 1e300 : static_cast<double>(host.v);
  MPI_Allreduce(MPI_IN_PLACE, &need_node, 1, MPI_DOUBLE, MPI_SUM, node);
  MPI_Comm_free(&node);
  const U avail = mem_available();
  if (!problem.empty() || (!host.overflow && (avail == 0 || need_node <= static_cast<double>(avail)))) return problem;
  std::ostringstream m;
  m << what;
  if (host.overflow)
    m << "more bytes per rank than 64-bit arithmetic counts";
  else
    m << "at least " << host.v << " bytes per rank (" << std::fixed << std::setprecision(1) << host.v / 1073741824.0
      << " GiB"
      << (device_is_host ? ": the tensors in " + c.dtype + ", the ring's buffers" : std::string(": host buffers"))
      << (c.check > 0 ? ", of which --check " + std::to_string(c.check) + " rows take " + std::to_string(need.check.v)
                      : std::string())
      << "), " << std::setprecision(0) << need_node << " bytes for the " << on_node << " rank(s) on this node";
  m << ", but MemAvailable is " << avail << " bytes (" << std::setprecision(1) << avail / 1073741824.0 << " GiB)"
    << advice << (c.check > 0 ? " (or fewer --check rows)" : "");
  return m.str();
}

// ---- read: the input's shape, this rank's shard -----------------------------------------------------------
struct Input {
  std::unique_ptr<kfa::io::Reader> reader;  // --input only
  kfa::io::DatasetInfo q, k, v, d_o;
};

std::string dims_text(const std::vector<long>& d) {
  std::string t;
  for (long x : d) t += (t.empty() ? "[" : ", ") + std::to_string(x);
  return t + "]";
}

// The documents packed into the sequence: --doc-lengths, --doc-lognormal (drawn from its seed until they fill
// --seqlen, the last one cut), or the input's dataset 'cu_seqlens' (int32 or int64); checked. Empty: none. Every
// rank computes or reads the same. Collective (a read).
std::vector<long> documents(const Config& c, Input& in, const Shard& s) {
  std::vector<long> cu;
  std::string from;
  if (!c.doc_lengths.empty()) {
    cu.push_back(0);
    for (int l : c.doc_lengths) cu.push_back(cu.back() + l);
    from = "--doc-lengths";
    if (cu.back() != s.seq) fail("kfa-longseq: --doc-lengths add up to ", cu.back(), " tokens but --seqlen is ", s.seq);
  } else if (!c.doc_lognormal.empty()) {
    const double median = c.doc_lognormal[0], sigma = c.doc_lognormal[1];
    const long lo = static_cast<long>(c.doc_lognormal[2]), hi = static_cast<long>(c.doc_lognormal[3]);
    std::mt19937_64 rng(static_cast<std::uint64_t>(c.doc_lognormal[4]));
    std::normal_distribution<double> z(0.0, sigma);
    cu.push_back(0);
    while (cu.back() < s.seq) {
      const long l = std::min(std::max(lo, std::lround(median * std::exp(z(rng)))), hi);
      cu.push_back(std::min(cu.back() + l, s.seq));
    }
    from = "--doc-lognormal";
  } else if (in.reader) {
    const kfa::io::DatasetInfo info = in.reader->info("cu_seqlens");
    if (!info.exists) return cu;
    cu = in.reader->read_integers("cu_seqlens", info);
    from = "dataset 'cu_seqlens' of " + c.input;
    if (cu.empty()) fail("kfa-longseq: ", from, " is empty (it has documents + 1 entries, the first 0)");
    if (cu.front() != 0) fail("kfa-longseq: ", from, " starts at ", cu.front(), "; it must start at 0");
    for (size_t x = 1; x < cu.size(); ++x)
      if (cu[x] < cu[x - 1])
        fail("kfa-longseq: ", from, " decreases: entry ", x, " = ", cu[x], " < entry ", x - 1, " = ", cu[x - 1]);
    if (cu.back() != s.seq)
      fail("kfa-longseq: ", from, " ends at ", cu.back(), " but the sequence has ", s.seq, " tokens");
  } else {
    return cu;
  }
  if (s.batch != 1) fail("kfa-longseq: documents (", from, ") pack one sequence: batch must be 1, not ", s.batch);
  if (s.seq > INT_MAX) fail("kfa-longseq: documents (", from, ") need seq < 2^31 (int32 cu_seqlens), not ", s.seq);
  return cu;
}

// Opens --input (its datasets' shapes and types, checked) or takes the generated shape; the rank's shard.
// Every rank refuses alike. Collective.
Shard describe_input(const Config& c, Input& in, MPI_Comm comm) {
  int rank, p;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &p);
  Shard s;
  if (c.generate) {
    s.batch = c.batch, s.seq = c.seqlen, s.heads = c.heads, s.kv_heads = c.kv_heads, s.d = c.head_dim;
  } else {
    in.reader.reset(new kfa::io::Reader(c.input, comm));
    in.q = in.reader->info("q"), in.k = in.reader->info("k"), in.v = in.reader->info("v");
    for (auto pr : {std::make_pair("q", &in.q), std::make_pair("k", &in.k), std::make_pair("v", &in.v)}) {
      if (!pr.second->exists) fail("kfa-longseq: --input ", c.input, " has no dataset '", pr.first, "'");
      if (pr.second->dims.size() != 4)
        fail("kfa-longseq: dataset '", pr.first, "' of ", c.input, " has rank ", pr.second->dims.size(),
             "; expected 4: [batch, seq, heads, head_dim]");
      if (pr.second->type == kfa::io::FileType::other)
        fail("kfa-longseq: dataset '", pr.first, "' of ", c.input, " is ", pr.second->type_text,
             ", not float64, float32 or float16");
    }
    const auto &qd = in.q.dims, &kd = in.k.dims;
    if (kd != in.v.dims)
      fail("kfa-longseq: datasets 'k' ", dims_text(kd), " and 'v' ", dims_text(in.v.dims), " differ");
    if (qd[0] != kd[0] || qd[1] != kd[1] || qd[3] != kd[3])
      fail("kfa-longseq: 'q' is ", dims_text(qd), " but 'k' is ", dims_text(kd),
           ": batch, seq and head_dim must match");
    s.batch = qd[0], s.seq = qd[1], s.heads = qd[2], s.kv_heads = kd[2], s.d = qd[3];
    if (c.backward) {
      in.d_o = in.reader->info("do");
      if (in.d_o.exists && in.d_o.type == kfa::io::FileType::other)
        fail("kfa-longseq: dataset 'do' of ", c.input, " is ", in.d_o.type_text, ", not float64, float32 or float16");
      if (in.d_o.exists && in.d_o.dims != qd) fail("kfa-longseq: dataset 'do' must have the shape of 'q'");
    }
  }
  s.documents = documents(c, in, s);
  if (s.kv_heads <= 0 || s.heads % s.kv_heads != 0)
    fail("kfa-longseq: heads = ", s.heads, " is not a multiple of kv-heads = ", s.kv_heads);
  if (s.d % 8 != 0 || s.d < 8 || s.d > 256)
    fail("kfa-longseq: head_dim = ", s.d, " is unsupported (a multiple of 8 in [8, 256])");
  if (s.seq < p) fail("kfa-longseq: seq = ", s.seq, " is shorter than the ", p, " ranks");
  const bool zigzag = c.layout == "zigzag";
  if (zigzag && s.seq < 2 * p)
    fail("kfa-longseq: --layout zigzag needs seq >= 2 * ranks = ", 2 * p, " but seq = ", s.seq);
  const kfa::dist::Layout layout = zigzag ? kfa::dist::Layout::zigzag : kfa::dist::Layout::contiguous;
  if (s.documents.empty()) {
    s.segs = kfa::dist::shard_of(layout, s.seq, p, rank);
  } else {  // zigzag: every document in 2P chunks, as the ring's variable-length calls take them
    s.segs = kfa::dist::document_shard(layout, std::vector<int>(s.documents.begin(), s.documents.end()), p, rank);
  }
  for (const auto& sg : s.segs) s.n += sg.length;
  return s;
}

template <class T>
Tensor<T> input_tensor(const char* label, const Shard& s, long heads) {
  return Tensor<T>(Kokkos::view_alloc(std::string("kfa-longseq::") + label, Kokkos::WithoutInitializing), s.batch, s.n,
                   heads, s.d);
}

struct InputTimes {
  double read_s = 0, generate_s = 0;  // the whole input phase; the part of it spent generating
};

// q, k, v (and do) on the device in T: read block by block from --input, or generated on the device.
// Collective.
template <class T>
InputTimes load_inputs(const Config& c, const Shard& s, Input& in, Tensors<T>& t, MPI_Comm comm, double t_start) {
  InputTimes times;
  t.q = input_tensor<T>("q", s, s.heads), t.k = input_tensor<T>("k", s, s.kv_heads),
  t.v = input_tensor<T>("v", s, s.kv_heads);
  if (c.backward) t.d_o = input_tensor<T>("do", s, s.heads);
  struct Named {
    const char* name;
    int id;
    Tensor<T>* x;
    const kfa::io::DatasetInfo* info;
  };
  std::vector<Named> all{{"q", 0, &t.q, &in.q}, {"k", 1, &t.k, &in.k}, {"v", 2, &t.v, &in.v}};
  if (c.backward) all.push_back({"do", 3, &t.d_o, &in.d_o});
  for (const Named& x : all) {
    if (in.reader && x.info->exists) {
      read_shard(*in.reader, x.name, *x.info, s, *x.x, comm);
    } else {
      Kokkos::fence();
      const double t0 = MPI_Wtime();
      generate_shard(*x.x, s, c.seed, x.id);
      Kokkos::fence();
      times.generate_s += MPI_Wtime() - t0;
    }
  }
  in.reader.reset();
  times.read_s = max_over(MPI_Wtime() - t_start, comm);
  times.generate_s = max_over(times.generate_s, comm);
  return times;
}

// The global [batch, seq, head, e] index of the first non-finite element of a device shard [batch, n, heads,
// d], the smallest over the ranks; "" when none. Collective.
template <class T>
std::string first_nonfinite(const Shard& s, const Tensor<T>& x, MPI_Comm comm) {
  const long long heads = static_cast<long long>(x.extent(2)), f = first_nonfinite_in_shard(x, s);
  long long best = f >= 0 ? f : LLONG_MAX;
  MPI_Allreduce(MPI_IN_PLACE, &best, 1, MPI_LONG_LONG, MPI_MIN, comm);
  if (best == LLONG_MAX) return "";
  const long long e = best % s.d, h = best / s.d % heads, i = best / s.d / heads % s.seq,
                  b = best / s.d / heads / s.seq;
  return "[" + std::to_string(b) + ", " + std::to_string(i) + ", " + std::to_string(h) + ", " + std::to_string(e) + "]";
}

// Inputs with NaN/Inf (as stored, or after rounding to the compute dtype) give NaN outputs: refused on every
// rank alike, naming each dataset, its count over all ranks and its first element, unless --allow-nonfinite.
// Scanned on the device. Collective.
template <class T>
NonFiniteCounts scan_inputs(const Config& c, const Shard& s, const Tensors<T>& t, MPI_Comm comm) {
  NonFiniteCounts bad;
  std::vector<const Tensor<T>*> xs{&t.q, &t.k, &t.v};
  count_into(bad, "q", t.q), count_into(bad, "k", t.k), count_into(bad, "v", t.v);
  if (c.backward) count_into(bad, "do", t.d_o), xs.push_back(&t.d_o);
  allreduce(bad, comm);
  if (bad.total() == 0 || c.allow_nonfinite) return bad;
  std::ostringstream m;
  m << "kfa-longseq: non-finite input values (NaN or +-Inf";
  if (c.dtype != "float64") m << " in " << c.dtype;
  m << "):";
  for (size_t i = 0; i < bad.n.size(); ++i) {
    if (bad.n[i].second == 0) continue;
    m << " dataset '" << bad.n[i].first << "'" << (c.generate ? " (generated)" : " of " + c.input) << " has "
      << bad.n[i].second << ", the first at " << first_nonfinite(s, *xs[i], comm) << ";";
  }
  m << " they would make the outputs NaN; nothing was computed (--allow-nonfinite accepts them)";
  fail(m.str());
}

// ---- compute ----------------------------------------------------------------------------------------------
struct Computed {
  double total_s = 0, attention_s = 0, merge_s = 0, exchange_alone_s = 0, exchange_bytes = 0;
  StepSplit split;
  std::string transport;
  std::size_t max_message_bytes = 0;
  Strategy sp;  // the Ulysses degree that ran (1: the ring alone) and why
  // Ulysses / hybrid (sp.u > 1): the all-to-alls (slowest rank), bytes this rank sent (max over ranks), and what
  // travelled how
  double a2a_to_heads_s = 0, a2a_to_sequence_s = 0, a2a_bytes = 0;
  std::string a2a_transport, heads_plan;
  bool groups_within_nodes = true;
};

// Test hook: KFA_LONGSEQ_CORRUPT=o|dq|dk|dv multiplies that computed tensor by 1.001 on every rank after the
// computation, so the tests can show that --check fails on a wrong result.
template <class T>
void corrupt_for_tests(const Tensors<T>& t) {
  const char* e = std::getenv("KFA_LONGSEQ_CORRUPT");
  if (!e) return;
  const std::string w(e);
  const Tensor<T> x = w == "o" ? t.o : w == "dq" ? t.dq : w == "dk" ? t.dk : w == "dv" ? t.dv : Tensor<T>();
  if (x.size() == 0) return;
  T* const ptr = x.data();
  Kokkos::parallel_for(
      "kfa-longseq::corrupt_for_tests", Kokkos::RangePolicy<Exec>(0, x.size()),
      KOKKOS_LAMBDA(const size_t i) { ptr[i] = static_cast<T>(ptr[i] * static_cast<T>(1.001)); });
  Kokkos::fence();
}

// --sp auto's calibration, measured now on every rank (the slowest rank's figures): the forward kernel's rate on
// min(seq / P, 4096) tokens of this run's heads and mask, and the bandwidth and latency of one pairwise exchange
// between neighbouring ranks (consecutive ranks: inside a node) and, when the job spans nodes, between ranks on
// different nodes. Collective.
template <class T>
SpModelInputs calibrate(const Config& c, const Shard& s, const kfa::AttentionOptions& opts, MPI_Comm comm) {
  int rank, p;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &p);
  SpModelInputs m;
  m.ranks = p, m.batch = s.batch, m.seq = s.seq, m.heads = s.heads, m.kv_heads = s.kv_heads, m.d = s.d;
  m.elem_bytes = sizeof(T), m.acc_bytes = sizeof(kfa::accumulator_t<T>), m.causal = c.causal, m.backward = c.backward;
  MPI_Comm node;
  MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
  int node_ranks = 1, node_rank = 0;
  MPI_Comm_size(node, &node_ranks);
  MPI_Comm_rank(node, &node_rank);
  MPI_Comm_free(&node);
  MPI_Allreduce(MPI_IN_PLACE, &node_ranks, 1, MPI_INT, MPI_MIN, comm);
  m.node_ranks = node_ranks;
  const long n = std::max(1L, std::min(s.seq / p, 4096L));
  Tensor<T> q("kfa-longseq::calibrate::q", 1, n, s.heads, s.d), k("kfa-longseq::calibrate::k", 1, n, s.kv_heads, s.d),
      v("kfa-longseq::calibrate::v", 1, n, s.kv_heads, s.d), o("kfa-longseq::calibrate::o", 1, n, s.heads, s.d);
  Lse<T> lse("kfa-longseq::calibrate::lse", 1, s.heads, n);
  for (const Tensor<T>* x : {&q, &k, &v}) {  // not zeros: scores of every size
    T* const ptr = x->data();
    Kokkos::parallel_for(
        "kfa-longseq::calibrate::fill", Kokkos::RangePolicy<Exec>(0, x->size()),
        KOKKOS_LAMBDA(const size_t i) { ptr[i] = static_cast<T>(double((i * 2654435761u) % 1021) / 1021.0 - 0.5); });
  }
  double best = 1e300;
  for (int rep = 0; rep < 2; ++rep) {
    Kokkos::fence();
    const double t0 = MPI_Wtime();
    kfa::attention_forward(Exec(), q, k, v, o, lse, opts);
    Kokkos::fence();
    best = std::min(best, MPI_Wtime() - t0);
  }
  best = max_over(best, comm);
  m.rate = 4.0 * double(n) * double(n) * s.heads * s.d * (c.causal ? 0.5 : 1.0) / best;
  // pairwise exchanges as the ring makes them: of one K/V shard (at most 64 MiB), and of one byte (latency)
  const long longest = max_over(std::max(1L, s.n), comm);  // the same count on every rank
  const size_t count =
      std::min<size_t>(static_cast<size_t>(2 * s.batch * longest * s.kv_heads * s.d), (size_t(64) << 20) / sizeof(T));
  auto measure = [&](MPI_Comm cm, double& bw) {
    kfa::dist::Ring ring(cm);
    const double t = std::min(kfa::dist::time_ring_exchange<T>(Exec(), ring, count),
                              kfa::dist::time_ring_exchange<T>(Exec(), ring, count));
    bw = double(count) * sizeof(T) / std::max(t, 1e-9);
    double lat = 1e300;
    for (int rep = 0; rep < 3; ++rep) lat = std::min(lat, kfa::dist::time_ring_exchange<char>(Exec(), ring, 1));
    return lat;
  };
  m.latency_s = measure(comm, m.bw_intra);
  m.bw_inter = m.bw_intra;
  if (node_ranks < p) {  // neighbours on different nodes: the ranks ordered by their place in their node
    MPI_Comm across;
    MPI_Comm_split(comm, 0, node_rank * p + rank, &across);
    measure(across, m.bw_inter);
    MPI_Comm_free(&across);
  }
  return m;
}

// The forward (and backward) pass of the strategy, timed per ring step and per Ulysses stage. Collective.
template <class T>
Computed compute(const Config& c, const Shard& s, Strategy sp, Tensors<T>& t, MPI_Comm comm) {
  int rank, p;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &p);
  kfa::AttentionOptions opts;
  opts.causal = c.causal, opts.softmax_scale = c.scale, opts.softcap = c.softcap;
  opts.deterministic = !c.nondeterministic;
  if (!c.window.empty()) opts.window_left = c.window[0], opts.window_right = c.window[1];
  const kfa::dist::Layout layout = c.layout == "zigzag" ? kfa::dist::Layout::zigzag : kfa::dist::Layout::contiguous;
  if (sp.u == 0) {  // --sp auto
    if (p == 1)
      sp.u = 1, sp.why = "auto: one rank";
    else if (s.documents.empty())
      choose(sp, calibrate<T>(c, s, opts, comm));
    else
      choose_for_documents(sp, calibrate<T>(c, s, opts, comm));
  }
  // The ring of all ranks, or the Ulysses groups and the ring between them.
  std::unique_ptr<kfa::dist::Ring> own_ring;
  std::unique_ptr<kfa::dist::Ulysses> ulysses;
  if (sp.u == 1)
    own_ring.reset(new kfa::dist::Ring(comm, layout));
  else
    ulysses.reset(new kfa::dist::Ulysses(comm, sp.u, layout));
  if (c.max_message_bytes > 0) {
    if (own_ring) own_ring->set_max_message_bytes(static_cast<std::size_t>(c.max_message_bytes));
    if (ulysses) ulysses->set_max_message_bytes(static_cast<std::size_t>(c.max_message_bytes));
  }
  const kfa::dist::Ring& ring = own_ring ? *own_ring : ulysses->ring();
  t.o = Tensor<T>("kfa-longseq::o", s.batch, s.n, s.heads, s.d);
  t.lse = Lse<T>("kfa-longseq::lse", s.batch, s.heads, s.n);
  Computed r;
  r.sp = sp;
  // The bare ring exchange of one K/V shard (of the ring's ranks: with Ulysses groups, the group's tokens of the
  // key/value heads a rank holds), timed with nothing to hide it: the measured transfer time that "hidden"
  // compares with. The faster of two (the first also pays for setting up connections).
  const long ring_tokens = max_over(s.n, comm) * sp.u;
  const long ring_kv_heads = sp.u == 1 ? s.kv_heads : kv_local_heads(s.heads, s.kv_heads, sp.u);
  const size_t exchange_count = static_cast<size_t>(2 * s.batch * ring_tokens * ring_kv_heads * s.d);
  r.exchange_bytes = double(exchange_count) * sizeof(T);
  if (ring.size() > 1)
    r.exchange_alone_s = std::min(kfa::dist::time_ring_exchange<T>(Exec(), ring, exchange_count),
                                  kfa::dist::time_ring_exchange<T>(Exec(), ring, exchange_count));
  kfa::dist::UlyssesStats fus, bus;
  kfa::dist::RingStats own_fst, own_bst;
  kfa::dist::RingStats& fst = ulysses ? fus.ring : own_fst;
  kfa::dist::RingStats& bst = ulysses ? bus.ring : own_bst;
  Progress progress(c, rank, p);
  fst.on_step = progress.hook("forward", 0.0, 1.0, c.backward ? 3.5 : 1.0);
  bst.on_step = progress.hook("backward", 1.0, 2.5, 3.5);
  MPI_Barrier(comm);
  const double tc0 = MPI_Wtime();
  progress.start(tc0);
  if (c.backward) {
    t.dq = Tensor<T>("kfa-longseq::dq", s.batch, s.n, s.heads, s.d);
    t.dk = Tensor<T>("kfa-longseq::dk", s.batch, s.n, s.kv_heads, s.d);
    t.dv = Tensor<T>("kfa-longseq::dv", s.batch, s.n, s.kv_heads, s.d);
  }
  if (s.documents.empty()) {
    if (ulysses) {
      kfa::dist::ulysses_attention_forward(Exec(), *ulysses, t.q, t.k, t.v, t.o, t.lse, opts, &fus);
      if (c.backward)
        kfa::dist::ulysses_attention_backward(Exec(), *ulysses, t.q, t.k, t.v, t.o, t.d_o, t.lse, t.dq, t.dk, t.dv,
                                              opts, &bus);
    } else {
      kfa::dist::ring_attention_forward(Exec(), ring, t.q, t.k, t.v, t.o, t.lse, opts, &fst);
      if (c.backward)
        kfa::dist::ring_attention_backward(Exec(), ring, t.q, t.k, t.v, t.o, t.d_o, t.lse, t.dq, t.dk, t.dv, opts,
                                           &bst);
    }
  } else {  // packed documents: the batch of one as [tokens, heads, head_dim], cu_seqlens on the device
    Kokkos::View<int*, Mem> cu("kfa-longseq::cu_seqlens", s.documents.size());
    const auto cu_h = Kokkos::create_mirror_view(cu);
    for (size_t x = 0; x < s.documents.size(); ++x) cu_h(x) = static_cast<int>(s.documents[x]);
    Kokkos::deep_copy(cu, cu_h);
    const long longest = s.longest_document();
    auto tok = [](const Tensor<T>& x) { return Kokkos::subview(x, 0, Kokkos::ALL, Kokkos::ALL, Kokkos::ALL); };
    const auto lse = Kokkos::subview(t.lse, 0, Kokkos::ALL, Kokkos::ALL);
    if (ulysses) {
      kfa::dist::ulysses_attention_forward_varlen(Exec(), *ulysses, tok(t.q), tok(t.k), tok(t.v), tok(t.o), lse, cu, cu,
                                                  longest, longest, opts, &fus);
      if (c.backward)
        kfa::dist::ulysses_attention_backward_varlen(Exec(), *ulysses, tok(t.q), tok(t.k), tok(t.v), tok(t.o),
                                                     tok(t.d_o), lse, tok(t.dq), tok(t.dk), tok(t.dv), cu, cu, longest,
                                                     longest, opts, &bus);
    } else {
      kfa::dist::ring_attention_forward_varlen(Exec(), ring, tok(t.q), tok(t.k), tok(t.v), tok(t.o), lse, cu, cu,
                                               longest, longest, opts, &fst);
      if (c.backward)
        kfa::dist::ring_attention_backward_varlen(Exec(), ring, tok(t.q), tok(t.k), tok(t.v), tok(t.o), tok(t.d_o), lse,
                                                  tok(t.dq), tok(t.dk), tok(t.dv), cu, cu, longest, longest, opts,
                                                  &bst);
    }
  }
  r.total_s = max_over(MPI_Wtime() - tc0, comm);
  r.split = split_steps({&fst, &bst}, r.exchange_alone_s, r.exchange_bytes, comm);
  for (const auto* st : {&fst, &bst})
    for (const auto& x : st->steps) r.attention_s += x.compute_s, r.merge_s += x.merge_s;
  r.attention_s = max_over(r.attention_s, comm), r.merge_s = max_over(r.merge_s, comm);
  r.transport = ring.transport<Mem>();
  r.max_message_bytes = ring.max_message_bytes();
  if (ulysses) {
    r.a2a_to_heads_s = max_over(fus.to_heads_s + bus.to_heads_s, comm);
    r.a2a_to_sequence_s = max_over(fus.to_sequence_s + bus.to_sequence_s, comm);
    r.a2a_bytes = max_over(double(fus.a2a_bytes + bus.a2a_bytes), comm);
    r.a2a_transport = ulysses->group().transport<Mem>();
    r.heads_plan = fus.heads.describe();
    r.groups_within_nodes = ulysses->groups_within_nodes();
  }
  corrupt_for_tests(t);
  return r;
}

// ---- check ------------------------------------------------------------------------------------------------
struct Checked {
  CheckResult r;
  bool ok = true;
  double o_tol = 0, lse_tol = 0, grad_tol = 0, seconds = 0;
};

template <class T>
Checked check(const Config& c, const Shard& s, const Tensors<T>& t, MPI_Comm comm) {
  Checked k;
  k.o_tol = c.check_tol >= 0 ? c.check_tol : tolerance<T>();
  k.lse_tol = c.check_tol >= 0 ? c.check_tol : tolerance<kfa::accumulator_t<T>>() * 10;
  k.grad_tol = c.check_tol >= 0 ? c.check_tol : gradient_tolerance<T>();
  if (c.check == 0) return k;
  const double t0 = MPI_Wtime();
  k.r = self_check(c, s, t, comm);
  k.ok = k.r.max_rel <= k.o_tol && k.r.max_lse <= k.lse_tol &&
         (!k.r.gradients || (k.r.dq_rel <= k.grad_tol && k.r.dk_rel <= k.grad_tol && k.r.dv_rel <= k.grad_tol));
  k.seconds = max_over(MPI_Wtime() - t0, comm);
  return k;
}

// ---- write ------------------------------------------------------------------------------------------------
// The --output dtype: as asked, else the compute dtype (float32 for bfloat16, which HDF5 has no type for).
std::string output_dtype(const Config& c) {
  if (!c.output_dtype.empty()) return c.output_dtype;
  return c.dtype == "bfloat16" ? "float32" : c.dtype;
}

// The datasets of --output, stored as Out (lse as float64 when Out is, else float32), and the attributes.
template <class Out, class T>
void write_datasets(kfa::io::Writer& w, const Config& c, const Shard& s, const Tensors<T>& t, MPI_Comm comm) {
  const std::vector<long> od{s.batch, s.seq, s.heads, s.d}, kd{s.batch, s.seq, s.kv_heads, s.d};
  write_tensor<Out>(w, "o", od, s, t.o, comm);
  write_lse<typename std::conditional<std::is_same<Out, double>::value, double, float>::type>(w, s, t.lse);
  if (!s.documents.empty()) {  // the documents, as the input's: rank 0 writes them
    int rank;
    MPI_Comm_rank(comm, &rank);
    const long n = static_cast<long>(s.documents.size());
    w.write_rows(
        "cu_seqlens", {n}, 0,
        rank == 0 ? std::vector<kfa::dist::Segment>{{0, n, 0}} : std::vector<kfa::dist::Segment>{},
        rank == 0 ? std::vector<std::int64_t>(s.documents.begin(), s.documents.end()) : std::vector<std::int64_t>{});
  }
  if (c.backward) {
    write_tensor<Out>(w, "dq", od, s, t.dq, comm);
    write_tensor<Out>(w, "dk", kd, s, t.dk, comm);
    write_tensor<Out>(w, "dv", kd, s, t.dv, comm);
  }
}

// The typed attributes of --output: the schema is documented in apps/README.md ("Output attributes"); keep
// the two in step.
void write_attributes(kfa::io::Writer& w, const Config& c, const Shard& s, int p, const std::string& do_source,
                      int check_rows) {
  w.attribute("kfa_version", KFA_VERSION_STRING);
  w.attribute("kokkos_version", kfa::compat::kokkos_version_string());
  w.attribute("mpi_version", mpi_runtime_version());
  w.attribute("hdf5_version", kfa::io::hdf5_library_version());
  w.attribute("backend", Exec::name());
  w.attribute("io", kfa::io::io_mode());
  w.attribute("ranks", p);
  w.attribute("layout", c.layout);
  w.attribute("dtype", c.dtype);
  w.attribute("output_dtype", output_dtype(c));
  w.attribute("batch", s.batch);
  w.attribute("seq", s.seq);
  w.attribute("heads", s.heads);
  w.attribute("kv_heads", s.kv_heads);
  w.attribute("head_dim", s.d);
  w.attribute("causal", c.causal);
  w.attribute("window_left", c.window.empty() ? -1 : c.window[0]);
  w.attribute("window_right", c.window.empty() ? -1 : c.window[1]);
  w.attribute("scale", c.scale > 0 ? c.scale : 1.0 / std::sqrt(double(s.d)));
  w.attribute("scale_is_default", !(c.scale > 0));
  w.attribute("softcap", c.softcap);
  w.attribute("backward", c.backward);
  w.attribute("deterministic", !c.nondeterministic);
  w.attribute("source", c.generate ? std::string("generated") : c.input);
  if (c.generate || do_source == "generated") w.attribute("seed", static_cast<long long>(c.seed));
  if (c.backward) w.attribute("do_source", do_source);
  w.attribute("check_rows", check_rows);
}

// Test hook: KFA_LONGSEQ_FILL_AFTER_RESERVE=FILE makes rank 0 write FILE until the file system holding it is
// full, right after the output's Writer has reserved its space and before any dataset is written: a disk
// that another process fills after the reservation. Every rank waits for it. The tests remove FILE.
void fill_disk_for_tests(MPI_Comm comm) {
  int rank;
  MPI_Comm_rank(comm, &rank);
  const char* f = std::getenv("KFA_LONGSEQ_FILL_AFTER_RESERVE");
  if (!f || !*f) return;
  if (rank == 0) {
    if (std::FILE* fp = std::fopen(f, "ab")) {
      static const char zeros[4096] = {0};
      while (std::fwrite(zeros, 1, sizeof zeros, fp) == sizeof zeros && std::fflush(fp) == 0) {
      }
      std::fclose(fp);
    }
  }
  MPI_Barrier(comm);
}

// Writes --output to its temporary (closed, not yet renamed: commit() does that once the JSON is written
// too). Nothing is written unless the run and its check succeeded. Collective.
template <class T>
std::unique_ptr<kfa::io::Writer> write_output(const Config& c, const Shard& s, const Tensors<T>& t,
                                              const std::string& do_source, int check_rows, MPI_Comm comm) {
  int p;
  MPI_Comm_size(comm, &p);
  const std::string od = output_dtype(c);
  const unsigned long long out_size = od == "float64" ? 8 : od == "float32" ? 4 : 2, lse_size = od == "float64" ? 8 : 4;
  const unsigned long long row = static_cast<unsigned long long>(s.batch) * s.seq,
                           bytes = row * s.heads * (s.d * out_size + lse_size) +
                                   (c.backward ? row * (s.heads + 2 * s.kv_heads) * s.d * out_size : 0);
  std::unique_ptr<kfa::io::Writer> w(new kfa::io::Writer(c.output, comm, bytes));
  fill_disk_for_tests(comm);
  if (od == "float64")
    write_datasets<double>(*w, c, s, t, comm);
  else if (od == "float32")
    write_datasets<float>(*w, c, s, t, comm);
  else
    write_datasets<kfa::io::Float16>(*w, c, s, t, comm);
  write_attributes(*w, c, s, p, do_source, check_rows);
  w->close();
  return w;
}

// ---- report -----------------------------------------------------------------------------------------------
struct Memory {
  double peak_mib = 0, tensor_mib = 0, ratio = 0;  // max over ranks
};
// Peak host memory (VmHWM) against the rank's tensors in the compute dtype, the largest of each over the
// ranks. Collective.
template <class T>
Memory memory_report(const Tensors<T>& t, MPI_Comm comm) {
  Memory m;
  const double peak = host_memory_peak(), tensors = t.bytes();
  m.peak_mib = max_over(peak / 1048576.0, comm), m.tensor_mib = max_over(tensors / 1048576.0, comm);
  m.ratio = max_over(tensors > 0 ? peak / tensors : 0.0, comm);
  return m;
}

struct Outcome {
  InputTimes in;
  Computed comp;
  Checked chk;
  NonFiniteCounts in_bad, out_bad;
  double write_s = 0, memory_high_water_mib = 0;
  Memory mem;
  std::string do_source;
};

// The report on stdout (rank 0).
void print_report(const Config& c, const Shard& s, int p, const Outcome& x) {
  const double flops = 4.0 * s.heads * s.pairs() * s.d * (c.causal ? 0.5 : 1.0) * (c.backward ? 3.5 : 1.0);
  const StepSplit& split = x.comp.split;
  const bool hidden_known = split.transfer_s > 0;
  const double hidden = hidden_known ? std::max(0.0, std::min(1.0, 1.0 - split.exposed_s / split.transfer_s)) : 0.0;
  std::ostringstream rep;
  rep << "kfa-longseq " << KFA_VERSION_STRING << " (Kokkos " << kfa::compat::kokkos_version_string() << ", "
      << Exec::name() << ", " << kfa::io::io_mode() << ")\n"
      << "  " << p << " ranks, " << c.layout << ", " << c.dtype << ", batch " << s.batch << ", seq " << s.seq
      << ", heads " << s.heads << "/" << s.kv_heads << ", head_dim " << s.d << (c.causal ? ", causal" : "")
      << (c.backward ? (c.nondeterministic ? ", forward+backward (nondeterministic dq)" : ", forward+backward")
                     : ", forward")
      << "\n"
      << (s.documents.empty() ? std::string()
                              : "  documents: " + std::to_string(s.documents.size() - 1) + " packed in " +
                                    std::to_string(s.seq) + " tokens, longest " + std::to_string(s.longest_document()) +
                                    " (no token sees another document's)\n")
      << "  sequence parallelism: " << x.comp.sp.kind(p) << " (Ulysses degree " << x.comp.sp.u << ", ring of "
      << p / x.comp.sp.u << " rank" << (p / x.comp.sp.u == 1 ? "" : "s") << "): " << x.comp.sp.why << "\n";
  if (x.comp.sp.u > 1) {
    char a2a[512];
    std::snprintf(
        a2a, sizeof a2a,
        "  all-to-all: to heads %s + back %s (slowest rank), %.0f bytes sent per rank (max), %s; groups of %d "
        "consecutive ranks %s\n  heads: %s\n",
        secs(x.comp.a2a_to_heads_s).c_str(), secs(x.comp.a2a_to_sequence_s).c_str(), x.comp.a2a_bytes,
        x.comp.a2a_transport.c_str(), x.comp.sp.u,
        x.comp.groups_within_nodes ? "each within a node" : "spanning nodes (the all-to-all crosses them)",
        x.comp.heads_plan.c_str());
    rep << a2a;
  }
  rep << "  ring transport: " << x.comp.transport << ", messages of at most " << x.comp.max_message_bytes << " bytes\n";
  if (c.backward)
    rep << "  dO: "
        << (x.do_source == "file" ? "dataset 'do' of " + c.input
            : c.generate          ? "generated (seed " + std::to_string(c.seed) + ")"
                         : "generated (seed " + std::to_string(c.seed) + "): " + c.input + " has no dataset 'do'")
        << "\n";
  char line[768];
  std::snprintf(line, sizeof line, "  read %s | compute %s | check %s | write %s\n", secs(x.in.read_s).c_str(),
                secs(x.comp.total_s).c_str(), secs(x.chk.seconds).c_str(), secs(x.write_s).c_str());
  rep << line;
  if (x.in.generate_s > 0) {
    std::snprintf(line, sizeof line, "  generated on the device in %s (%.2f%% of compute)\n",
                  secs(x.in.generate_s).c_str(), x.comp.total_s > 0 ? 100.0 * x.in.generate_s / x.comp.total_s : 0.0);
    rep << line;
  }
  std::snprintf(line, sizeof line,
                "  ring steps %s = compute %s + load imbalance %s + communication not hidden %s; "
                "outside the steps %s\n  busiest rank: attention %s, merge %s\n",
                secs(split.steps_s).c_str(), secs(split.compute_s).c_str(), secs(split.imbalance_s).c_str(),
                secs(split.exposed_s).c_str(), secs(std::max(0.0, x.comp.total_s - split.steps_s)).c_str(),
                secs(x.comp.attention_s).c_str(), secs(x.comp.merge_s).c_str());
  rep << line;
  if (c.causal && c.layout == "contiguous" && p > 1 && split.imbalance_s > 0.1 * split.steps_s) {
    std::snprintf(line, sizeof line,
                  "  hint: with --causal the contiguous layout gives the last ranks most of the work (%.0f%% of the "
                  "ring steps here was load imbalance); --layout zigzag balances it\n",
                  100.0 * split.imbalance_s / split.steps_s);
    rep << line;
  }
  if (hidden_known)
    std::snprintf(line, sizeof line,
                  "  transfers %s measured alone (%.0f bytes per rank; one bare exchange of %.0f bytes: %s), "
                  "communication hidden %.0f%%\n",
                  secs(split.transfer_s).c_str(), split.transfer_bytes, x.comp.exchange_bytes,
                  secs(x.comp.exchange_alone_s).c_str(), hidden * 100);
  else
    std::snprintf(line, sizeof line, "  transfers none (%s), communication hidden n/a\n",
                  p == 1 ? "one rank" : "no ring step sent");
  rep << line;
  std::snprintf(line, sizeof line, "  %.3f TFLOP/s, %.0f tokens/s, memory high-water %.1f MiB per rank (max)\n",
                flops / x.comp.total_s * 1e-12, s.batch * s.seq / x.comp.total_s, x.memory_high_water_mib);
  rep << line;
  std::snprintf(line, sizeof line,
                "  host memory peak %.1f MiB per rank (max), %.2fx the rank's tensors (%.1f MiB in %s%s)\n",
                x.mem.peak_mib, x.mem.ratio, x.mem.tensor_mib, c.dtype.c_str(),
                device_is_host ? "; on this host backend the tensors are host memory" : ", on the device");
  rep << line;
  const CheckResult& chk = x.chk.r;
  if (c.check > 0) {
    std::snprintf(
        line, sizeof line,
        "  check: %d rows vs float64: max abs error %.3e, max relative error %.3e (tolerance %.0e), lse %.3e: %s\n",
        chk.rows, chk.max_abs, chk.max_rel, x.chk.o_tol, chk.max_lse, x.chk.ok ? "PASS" : "FAIL");
    rep << line;
    if (chk.gradients) {
      const double g = x.chk.grad_tol;
      std::snprintf(line, sizeof line,
                    "  check gradients: dq %d query rows %.3e, dk %.3e and dv %.3e over %d key rows (relative L2 vs "
                    "float64, tolerance %.0e)%s\n",
                    chk.rows, chk.dq_rel, chk.dk_rel, chk.dv_rel, chk.key_rows, g,
                    chk.dq_rel <= g && chk.dk_rel <= g && chk.dv_rel <= g ? "" : ": FAIL");
      rep << line;
    }
  }
  if (x.in_bad.total() > 0 || x.out_bad.total() > 0)
    rep << "  non-finite values: inputs " << x.in_bad.text() << "; outputs " << x.out_bad.text()
        << (c.allow_nonfinite ? " (--allow-nonfinite)" : "") << "\n";
  std::fputs(rep.str().c_str(), stdout);
  std::fflush(stdout);
}

// The --json summary (documented in apps/README.md, "JSON summary").
Json summary(const Config& c, const Shard& s, int p, const Outcome& x) {
  const double flops = 4.0 * s.heads * s.pairs() * s.d * (c.causal ? 0.5 : 1.0) * (c.backward ? 3.5 : 1.0);
  const StepSplit& split = x.comp.split;
  const bool hidden_known = split.transfer_s > 0;
  const double hidden = hidden_known ? std::max(0.0, std::min(1.0, 1.0 - split.exposed_s / split.transfer_s)) : 0.0;
  Json js;
  js.add("kfa_version", KFA_VERSION_STRING).add("kokkos_version", kfa::compat::kokkos_version_string());
  js.add("mpi_version", mpi_runtime_version()).add("hdf5_version", kfa::io::hdf5_library_version());
  js.add("backend", Exec::name()).add("io", kfa::io::io_mode()).add("ranks", p).add("layout", c.layout);
  js.add("dtype", c.dtype).add("output_dtype", c.output.empty() ? Json::null() : Json::str(output_dtype(c)));
  js.add("batch", s.batch).add("seq", s.seq).add("heads", s.heads).add("kv_heads", s.kv_heads);
  js.add("documents", s.documents.empty() ? Json::null() : Json::num(double(s.documents.size() - 1)));
  js.add("longest_document", s.documents.empty() ? Json::null() : Json::num(double(s.longest_document())));
  js.add("head_dim", s.d).add("causal", c.causal).add("backward", c.backward).add("deterministic", !c.nondeterministic);
  js.add("scale", c.scale > 0 ? c.scale : 1.0 / std::sqrt(double(s.d)));
  js.add("do_source", x.do_source.empty() ? Json::null() : Json::str(x.do_source));
  js.add("read_s", x.in.read_s).add("generate_s", x.in.generate_s).add("compute_s", x.comp.total_s);
  js.add("check_s", x.chk.seconds).add("write_s", x.write_s);
  js.add("attention_s", x.comp.attention_s).add("merge_s", x.comp.merge_s);
  js.add("steps_s", split.steps_s).add("step_compute_s", split.compute_s).add("load_imbalance_s", split.imbalance_s);
  js.add("communication_not_hidden_s", split.exposed_s).add("transfer_s", split.transfer_s);
  js.add("transfer_bytes", split.transfer_bytes).add("exchange_alone_s", x.comp.exchange_alone_s);
  js.add("communication_hidden", hidden_known ? Json::num(hidden) : Json::null());
  js.add("tflops", flops / x.comp.total_s * 1e-12).add("tokens_per_s", s.batch * s.seq / x.comp.total_s);
  js.add("sp", x.comp.sp.kind(p)).add("sp_asked", c.sp).add("sp_reason", x.comp.sp.why);
  js.add("ulysses_degree", x.comp.sp.u).add("ring_degree", p / x.comp.sp.u);
  js.add("a2a_to_heads_s", x.comp.a2a_to_heads_s).add("a2a_to_sequence_s", x.comp.a2a_to_sequence_s);
  js.add("a2a_bytes", x.comp.a2a_bytes);
  js.add("a2a_transport", x.comp.sp.u > 1 ? Json::str(x.comp.a2a_transport) : Json::null());
  js.add("heads_plan", x.comp.sp.u > 1 ? Json::str(x.comp.heads_plan) : Json::null());
  if (!x.comp.sp.predictions.empty()) {
    Json pred, model;
    for (const auto& q : x.comp.sp.predictions) pred.add(q.name(p), q.total());
    const SpModelInputs& m = x.comp.sp.model;
    model.add("rate_flops", m.rate).add("bw_intra_bytes_per_s", m.bw_intra).add("bw_inter_bytes_per_s", m.bw_inter);
    model.add("latency_s", m.latency_s).add("node_ranks", m.node_ranks);
    js.add("sp_predicted_s", pred).add("sp_model", model);
  } else {
    js.add("sp_predicted_s", Json::null()).add("sp_model", Json::null());
  }
  js.add("memory_high_water_mib", x.memory_high_water_mib);
  js.add("host_memory_peak_mib", x.mem.peak_mib).add("tensor_mib", x.mem.tensor_mib);
  js.add("host_memory_ratio", x.mem.ratio).add("tensors_on_host", device_is_host);
  if (c.check > 0) {
    const CheckResult& r = x.chk.r;
    Json ck;
    ck.add("rows", r.rows).add("o_max_abs_error", r.max_abs).add("o_max_rel_error", r.max_rel);
    ck.add("lse_max_error", r.max_lse).add("o_tolerance", x.chk.o_tol).add("lse_tolerance", x.chk.lse_tol);
    if (r.gradients) {
      Json gr;
      gr.add("query_rows", r.rows).add("key_rows", r.key_rows).add("dq_rel_error", r.dq_rel);
      gr.add("dk_rel_error", r.dk_rel).add("dv_rel_error", r.dv_rel).add("tolerance", x.chk.grad_tol);
      ck.add("gradients", gr);
    } else {
      ck.add("gradients", Json::null());
    }
    ck.add("pass", x.chk.ok);
    js.add("check", ck);
  } else {
    js.add("check", Json::null());
  }
  js.add("nonfinite_inputs", x.in_bad.json()).add("nonfinite_outputs", x.out_bad.json());
  js.add("output", c.output.empty() ? Json::null() : Json::str(c.output));
  return js;
}

// Says on stderr (rank 0) why nothing was written: exit 3 or 4.
void nothing_written(const Config& c, const std::string& why) {
  std::fprintf(stderr, "%s", why.c_str());
  if (!c.output.empty()) std::fprintf(stderr, "; --output %s not written", c.output.c_str());
  if (!c.json.empty()) std::fprintf(stderr, "; --json %s not written", c.json.c_str());
  if (!c.output.empty() || !c.json.empty()) std::fprintf(stderr, " (existing files are left as they were)");
  std::fprintf(stderr, "\n");
}

// The JSON summary goes to a temporary first (rank 0); every rank learns whether that worked before the
// HDF5 output is renamed, so a full disk or a failed write leaves both files as they were; then both are
// renamed. Collective.
void commit_outputs(const Config& c, const std::string& json_text, kfa::io::Writer* writer, MPI_Comm comm) {
  int rank;
  MPI_Comm_rank(comm, &rank);
  std::string json_tmp, err;
  if (!c.json.empty()) {
    long id = static_cast<long>(MPI_Wtime() * 1e6) % 100000000;
    MPI_Bcast(&id, 1, MPI_LONG, 0, comm);
    json_tmp = kfa::io::temporary_path(c.json, id);
    if (rank == 0) {
      err = kfa::io::write_text_temporary(json_tmp, json_text + "\n");
      if (!err.empty()) err = "kfa-longseq: --json " + c.json + ": " + err + kfa::io::full_filesystem_hint(c.json);
    }
    kfa::io::agree(comm, err);  // throws on every rank; the Writer then removes its temporary
  }
  if (writer) writer->commit();
  if (!c.json.empty()) {
    if (rank == 0) {
      err = kfa::io::commit_temporary(json_tmp, c.json);
      if (!err.empty()) err = "kfa-longseq: --json " + c.json + ": " + err;
    }
    kfa::io::agree(comm, err);
  }
}

// ---- the run: read / generate, compute, check, write, report ------------------------------------------------
template <class T>
int run(const Config& c, MPI_Comm comm) {
  int rank, p;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &p);
  const double t_start = MPI_Wtime();
  Input in;
  const Shard s = describe_input(c, in, comm);
  const Strategy sp = asked_strategy(c, p, s.heads);
  kfa::io::agree(comm, memory_problem<T>(c, s, p, comm));  // every rank refuses alike, before allocating
  Tensors<T> t;
  Outcome x;
  x.in = load_inputs(c, s, in, t, comm, t_start);
  x.in_bad = scan_inputs(c, s, t, comm);
  x.comp = compute(c, s, sp, t, comm);
  x.chk = check(c, s, t, comm);
  // Non-finite results (NaN/Inf inputs let through, or scores that overflow the compute dtype): exit 4 and
  // nothing written, unless --allow-nonfinite.
  count_into(x.out_bad, "o", t.o), count_into(x.out_bad, "lse", t.lse);
  if (c.backward)
    count_into(x.out_bad, "dq", t.dq), count_into(x.out_bad, "dk", t.dk), count_into(x.out_bad, "dv", t.dv);
  allreduce(x.out_bad, comm);
  const bool finite_ok = x.out_bad.total() == 0 || c.allow_nonfinite;
  x.do_source = !c.backward ? "" : in.d_o.exists ? "file" : "generated";

  // Nothing is written unless the run and its check succeeded: a failed check leaves --output and --json as
  // they were.
  const double tw0 = MPI_Wtime();
  std::unique_ptr<kfa::io::Writer> writer;
  if (!c.output.empty() && x.chk.ok && finite_ok) writer = write_output(c, s, t, x.do_source, x.chk.r.rows, comm);
  x.write_s = max_over(MPI_Wtime() - tw0, comm);

  rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  x.memory_high_water_mib = max_over(ru.ru_maxrss / 1024.0, comm);
  x.mem = memory_report(t, comm);
  if (rank == 0) print_report(c, s, p, x);
  if (!finite_ok) {
    if (rank == 0)
      nothing_written(c, "kfa-longseq: " + std::to_string(x.out_bad.total()) +
                             " non-finite result element(s) (NaN or +-Inf) from finite inputs: " + x.out_bad.text() +
                             ": exit 4 (score overflow in " + c.dtype +
                             "? use --dtype float64 or a smaller --scale; --allow-nonfinite writes them anyway)");
    return 4;
  }
  if (!x.chk.ok) {
    if (rank == 0) nothing_written(c, "kfa-longseq: check FAILED (error over the tolerance): exit 3");
    return 3;
  }
  commit_outputs(c, rank == 0 && !c.json.empty() ? summary(c, s, p, x).text() : std::string(), writer.get(), comm);
  if (rank == 0 && writer) std::printf("  wrote %s\n", c.output.c_str());
  return 0;
}

// Why the outputs cannot be written safely, or "": each must name a file in an existing writable directory,
// and none may be the same file as --input or as another output (device + inode after links; directory +
// name for a file not created yet), or the run would destroy the input or its own result.
std::string output_problems(const Config& c, int ranks) {
  struct Named {
    const char* option;
    const std::string* path;
  };
  std::vector<Named> outs;
  if (!c.output.empty()) outs.push_back({"--output", &c.output});
  if (!c.json.empty()) outs.push_back({"--json", &c.json});
  for (const auto& o : outs) {
    const std::string p = kfa::io::output_path_problem(o.option, *o.path);
    if (!p.empty()) return p;
  }
  // The HDF5 output's temporary is what MPI-IO opens (its longest id: 8 digits).
  if (!c.output.empty()) {
    const std::string p = kfa::io::mpi_io_path_problem("--output " + c.output + ": its temporary",
                                                       kfa::io::temporary_path(c.output, 99999999), ranks);
    if (!p.empty()) return p;
  }
  if (!c.input.empty()) {
    const auto in = kfa::io::identify(c.input);
    for (const auto& o : outs)
      if (kfa::io::same_file(kfa::io::identify(*o.path), in))
        return std::string(o.option) + " " + *o.path + " and --input " + c.input +
               " are the same file: writing it would destroy the input; choose another " + o.option + " name";
  }
  if (outs.size() == 2 && kfa::io::same_file(kfa::io::identify(c.output), kfa::io::identify(c.json)))
    return "--json " + c.json + " and --output " + c.output +
           " are the same file: the summary would overwrite the result; choose another --json name";
  return "";
}

// Temporaries `<output>.tmp-*` of an earlier run that was killed (or of one writing the same file now),
// named on stderr. They are not removed: nothing proves that no other run is still writing them.
void warn_stale_temporaries(const Config& c) {
  for (const std::string* path : {&c.output, &c.json}) {
    if (path->empty()) continue;
    const auto stale = kfa::io::stale_temporaries(*path);
    if (stale.empty()) continue;
    std::string list;
    for (size_t i = 0; i < stale.size() && i < 10; ++i) {
      struct stat st;
      const long bytes = ::stat(stale[i].c_str(), &st) == 0 ? static_cast<long>(st.st_size) : -1;
      list += "\n  " + stale[i] + " (" + std::to_string(bytes) + " bytes)";
    }
    if (stale.size() > 10) list += "\n  ... and " + std::to_string(stale.size() - 10) + " more";
    std::fprintf(stderr,
                 "kfa-longseq: warning: %zu temporary file(s) of an earlier run that did not finish (killed?) lie "
                 "beside %s:%s\n  they are not removed automatically (another run may be writing them); delete them "
                 "when no run writes %s\n",
                 stale.size(), path->c_str(), list.c_str(), path->c_str());
  }
}

}  // namespace
}  // namespace longseq

int main(int argc, char** argv) {
  // No shared file pointers here: without Open MPI 4's lockedfile component, paths of any legal length open.
  kfa::io::avoid_shared_file_pointer_components();
  MPI_Init(&argc, &argv);
  int rank = 0, status = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  longseq::Config c;
  CLI::App app{
      "kfa-longseq: exact attention over one long sequence on many MPI ranks (ring attention over MPI, "
      "HDF5 in and out, a float64 self-check and a performance report). Needs seq >= ranks (contiguous) or "
      "seq >= 2 x ranks (zigzag). [default] after each option; sizes in tokens, elements or bytes as said."};
  app.option_defaults()->always_capture_default();
  auto* in = app.add_option("--input", c.input,
                            "HDF5 file with datasets q, k, v [batch, seq, heads, head_dim] (k, v may have fewer heads; "
                            "'do' for --backward)")
                 ->check(CLI::ExistingFile);
  auto* gen =
      app.add_flag("--generate", c.generate, "generate deterministic inputs instead (same tensors for any rank count)");
  in->excludes(gen);
  app.add_option("--batch", c.batch, "with --generate: sequences in the batch")->check(CLI::PositiveNumber);
  app.add_option("--seqlen", c.seqlen, "with --generate: sequence length in tokens")->check(CLI::PositiveNumber);
  app.add_option("--doc-lengths", c.doc_lengths,
                 "with --generate: documents packed into the sequence (batch 1), comma separated; --seqlen "
                 "defaults to their sum. No token attends to another document's")
      ->delimiter(',')
      ->check(CLI::NonNegativeNumber);
  app.add_option("--doc-lognormal", c.doc_lognormal,
                 "with --generate: documents of log-normal lengths (MEDIAN, SIGMA of log length, clamped to "
                 "[MIN, MAX]) drawn with SEED until they fill --seqlen (the last cut)")
      ->expected(5);
  app.add_option("--heads", c.heads, "with --generate: query heads")->check(CLI::PositiveNumber);
  app.add_option("--kv-heads", c.kv_heads, "with --generate: key/value heads, a divisor of --heads")
      ->check(CLI::NonNegativeNumber)
      ->default_str("--heads");
  app.add_option("--head-dim", c.head_dim, "with --generate: elements per head, a multiple of 8 in [8, 256]")
      ->check(CLI::PositiveNumber);
  app.add_option(
         "--seed", c.seed,
         "with --generate: a non-negative integer (a generated dO and --check's rows use it too; with --input it is 1)")
      ->check(CLI::Validator(
          [](std::string& v) -> std::string {
            return v.find_first_not_of("0123456789") == std::string::npos && !v.empty()
                       ? std::string()
                       : "must be a non-negative integer, got '" + v + "'";
          },
          "NONNEGATIVE"));
  app.add_option("--dtype", c.dtype, "compute type (inputs are rounded to it)")
      ->check(CLI::IsMember({"float64", "float32", "float16", "bfloat16"}));
  app.add_option("--output-dtype", c.output_dtype,
                 "element type of o, dq, dk, dv in --output, rounded to nearest (lse: float64 with float64, else "
                 "float32); bfloat16 results are stored as float32 (HDF5 has no bfloat16 type)")
      ->check(CLI::IsMember({"float64", "float32", "float16"}))
      ->default_str("--dtype (float32 for bfloat16)");
  app.add_flag("--causal", c.causal, "causal mask (bottom-right aligned)");
  app.add_option("--window", c.window, "sliding window: L R keys left and right of the diagonal (-1 = unbounded)")
      ->expected(2)
      ->default_str("-1 -1");
  app.add_option("--scale", c.scale, "softmax scale multiplying q.k")
      ->check(CLI::NonNegativeNumber)
      ->default_str("1/sqrt(head_dim)");
  app.add_option("--softcap", c.softcap, "score softcap: softcap*tanh(score/softcap) (0 = off)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--layout", c.layout, "how the sequence is sharded over the ranks (zigzag balances causal work)")
      ->check(CLI::IsMember({"contiguous", "zigzag"}));
  app.add_option(
         "--sp", c.sp,
         "sequence parallelism: ring (K/V around the ranks), ulysses (all-to-all to heads: --heads divisible "
         "by the ranks), hybrid (all-to-all inside groups of --ulysses-degree consecutive ranks, the ring across "
         "them) or auto (the cost model's choice, calibrated at the start of the run; the report says why)")
      ->check(CLI::IsMember({"ring", "ulysses", "hybrid", "auto"}))
      ->default_str("ring");
  app.add_option("--ulysses-degree", c.ulysses_degree,
                 "with --sp hybrid: ranks per all-to-all group (divides the ranks and --heads)")
      ->check(CLI::PositiveNumber);
  app.add_option("--max-message-bytes", c.max_message_bytes,
                 "split ring messages into chunks of at most this many bytes")
      ->check(CLI::Range(1L, 2147483647L))
      ->default_str("1073741824 (1 GiB)");
  app.add_flag("--backward", c.backward,
               "also compute dq, dk, dv (dO from the input's dataset 'do', else generated with --seed: reported)");
  app.add_flag(
      "--nondeterministic", c.nondeterministic,
      "let the backward accumulate dq with atomic adds where its kernel family can (CUDA tensor cores: faster, "
      "dq not bitwise reproducible); default: bitwise reproducible");
  app.add_option("--output", c.output, "write o, lse (and dq, dk, dv) and typed attributes to this HDF5 file")
      ->default_str("none");
  app.add_option("--check", c.check,
                 "check K random query rows per rank (o, lse; with --backward also dq of those rows and dk, dv of K "
                 "random key rows) against float64 from the definition (0 = no check)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--check-tol", c.check_tol,
                 "relative error --check allows (o: 1e-12 float64, 1e-5 float32, 1e-2 float16/bfloat16; lse 10x the "
                 "accumulator's; dq, dk, dv 10x o's)")
      ->check(CLI::NonNegativeNumber)
      ->default_str("per dtype");
  app.add_option("--json", c.json, "write the summary as JSON to this file")->default_str("none");
  app.add_flag("--allow-nonfinite", c.allow_nonfinite,
               "accept NaN/Inf in q, k, v, do (refused with exit 2 otherwise) and write non-finite results (exit 4 "
               "otherwise); the counts are reported");
  auto* prog = app.add_flag("--progress", c.progress, "progress as a bar on stderr even when it is not a terminal");
  auto* quiet = app.add_flag("--quiet", c.quiet, "no progress output (the report on stdout stays)");
  prog->excludes(quiet);
  app.add_option("--progress-interval", c.progress_interval,
                 "seconds: when stderr is not a terminal, a progress line after a ring step at most this often")
      ->check(CLI::NonNegativeNumber);
  app.footer(
      "Exit status: 0 success; 2 a refused option or input (non-finite values in q/k/v/do included, unless "
      "--allow-nonfinite) or a failed read/write; 3 --check failed; 4 non-finite results (NaN/Inf in o, lse or "
      "the gradients: overflow? use --dtype float64 or a smaller --scale) unless --allow-nonfinite. A non-zero "
      "exit writes neither --output nor --json.");
  try {
    app.parse(argc, argv);
    if (!c.generate && c.input.empty()) throw CLI::ValidationError("one of --input FILE or --generate is required");
    if (!c.generate)  // the shape comes from the file: a generate-only option would be silently ignored
      for (const char* o :
           {"--batch", "--seqlen", "--heads", "--kv-heads", "--head-dim", "--seed", "--doc-lengths", "--doc-lognormal"})
        if (app.count(o) > 0)
          throw CLI::ValidationError(std::string(o) +
                                     " applies only with --generate; with --input the shape and the "
                                     "values come from " +
                                     c.input);
    if (!c.window.empty() && (c.window[0] < -1 || c.window[1] < -1))
      throw CLI::ValidationError("--window values must be >= -1, got " + std::to_string(c.window[0]) + " " +
                                 std::to_string(c.window[1]));
    if (c.generate && c.kv_heads == 0) c.kv_heads = c.heads;
    if (!c.doc_lengths.empty() && !c.doc_lognormal.empty())
      throw CLI::ValidationError("--doc-lengths and --doc-lognormal exclude each other");
    if (!c.doc_lengths.empty() && app.count("--seqlen") == 0) {  // the documents make the sequence
      long total = 0;
      for (int l : c.doc_lengths) total += l;
      c.seqlen = total;
    }
    if (!c.doc_lognormal.empty() && (c.doc_lognormal[0] <= 0 || c.doc_lognormal[1] < 0 || c.doc_lognormal[2] < 1 ||
                                     c.doc_lognormal[3] < c.doc_lognormal[2] || c.doc_lognormal[4] < 0 ||
                                     c.doc_lognormal[4] != std::floor(c.doc_lognormal[4])))
      throw CLI::ValidationError(
          "--doc-lognormal MEDIAN SIGMA MIN MAX SEED needs MEDIAN > 0, SIGMA >= 0, "
          "1 <= MIN <= MAX and a whole SEED >= 0");
    if (app.count("--output") > 0 && c.output.empty())
      throw CLI::ValidationError("--output needs a file name (got an empty string)");
    if (app.count("--json") > 0 && c.json.empty())
      throw CLI::ValidationError("--json needs a file name (got an empty string)");
    if (app.count("--check-tol") > 0 && c.check == 0) throw CLI::ValidationError("--check-tol needs --check K");
    if (app.count("--output-dtype") > 0 && c.output.empty())
      throw CLI::ValidationError("--output-dtype needs --output FILE");
    // Decided on rank 0 and broadcast, so every rank ends the same way before any work.
    int ranks = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &ranks);
    std::string problem = rank == 0 ? longseq::output_problems(c, ranks) : std::string();
    long len = static_cast<long>(problem.size());
    MPI_Bcast(&len, 1, MPI_LONG, 0, MPI_COMM_WORLD);
    problem.resize(static_cast<size_t>(len));
    MPI_Bcast(&problem[0], static_cast<int>(len), MPI_CHAR, 0, MPI_COMM_WORLD);
    if (!problem.empty()) throw CLI::ValidationError(problem);
    if (rank == 0) longseq::warn_stale_temporaries(c);
  } catch (const CLI::ParseError& e) {
    if (rank == 0)
      status = app.exit(e);
    else
      status = e.get_exit_code();
    MPI_Finalize();
    return status == 0 ? 0 : 2;
  }
  {
    Kokkos::ScopeGuard guard(argc, argv);
    try {
      if (c.dtype == "float64")
        status = longseq::run<double>(c, MPI_COMM_WORLD);
      else if (c.dtype == "float32")
        status = longseq::run<float>(c, MPI_COMM_WORLD);
#if KFA_HAS_HALF
      else if (c.dtype == "float16")
        status = longseq::run<kfa::compat::half_t>(c, MPI_COMM_WORLD);
#endif
#if KFA_HAS_BHALF
      else if (c.dtype == "bfloat16")
        status = longseq::run<kfa::compat::bhalf_t>(c, MPI_COMM_WORLD);
#endif
      else
        longseq::fail("kfa-longseq: --dtype ", c.dtype, " is not supported by this Kokkos build (",
                      Kokkos::DefaultExecutionSpace::name(),
                      ": its half/bfloat16 are plain float on host backends); use float32 or float64");
    } catch (const kfa::Error& e) {
      if (rank == 0) std::fprintf(stderr, "%s\n", e.what());
      status = 2;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "kfa-longseq: rank %d: %s\n", rank, e.what());
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
  }
  kfa::io::finalize();  // HDF5 closes what a failed write left open while MPI is still up
  MPI_Finalize();
  return status;
}
