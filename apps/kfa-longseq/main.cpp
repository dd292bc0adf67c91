// kfa-longseq: exact attention over one long sequence spread over MPI ranks, with HDF5 input/output, a
// float64 self-check and a performance report.
//
//   mpirun -np P kfa-longseq --generate --seqlen 65536 --heads 4 --head-dim 64 --causal --layout zigzag --check 4
//   mpirun -np P kfa-longseq --input in.h5 --output out.h5 --backward --dtype float32
//
// Run with --help for every option.
#include <CLI/CLI.hpp>
#include <kfa/dist/dist.hpp>
#include <kfa/io/hdf5.hpp>
#include <kfa/nonfinite.hpp>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <iomanip>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace {

struct Config {
  std::string input, output, json, dtype = "float32", layout = "contiguous";
  bool generate = false, causal = false, backward = false, progress = false, quiet = false, allow_nonfinite = false;
  double progress_interval = 10;  // seconds between progress lines (not on a terminal)
  long batch = 1, seqlen = 65536;
  int heads = 4, kv_heads = 0, head_dim = 64, check = 0;
  std::uint64_t seed = 1;
  std::vector<int> window;
  double scale = 0, softcap = 0;
  double check_tol = -1;  // < 0: the dtype's default
  long max_message_bytes = 0;  // 0: the Ring's default (1 GiB)
};

// Deterministic value of element `flat` of tensor `id`: the same for every rank count and layout.
double generated(std::uint64_t seed, int id, std::uint64_t flat) {
  std::uint64_t z = seed * 0x9E3779B97F4A7C15ULL + (static_cast<std::uint64_t>(id) << 56) + flat;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * (2.0 / 9007199254740992.0) - 1.0;  // uniform in [-1, 1)
}

struct Shards {
  long batch, seq, heads, kv_heads, d;
  std::vector<kfa::dist::Segment> segs;
  long n = 0;  // local tokens
  std::vector<double> q, k, v, d_o;  // [batch, n, heads, d] host copies (rounded to the compute dtype)
};

template <class T>
double round_to(double x) {
  return static_cast<double>(static_cast<kfa::accumulator_t<T>>(static_cast<T>(x)));
}

template <class T>
std::vector<double> generate(const Config& c, const Shards& s, int id, long heads) {
  std::vector<double> out;
  out.reserve(static_cast<size_t>(s.batch * s.n * heads * s.d));
  for (long b = 0; b < s.batch; ++b)
    for (const auto& sg : s.segs)
      for (long i = sg.global_begin; i < sg.global_begin + sg.length; ++i)
        for (long x = 0; x < heads * s.d; ++x)
          out.push_back(round_to<T>(generated(c.seed, id, static_cast<std::uint64_t>((b * s.seq + i) * heads * s.d + x))));
  return out;
}

template <class T, class V>
V to_device(const std::vector<double>& h, long b, long n, long heads, long d, const char* label) {
  V x(std::string(label), b, n, heads, d);
  auto m = Kokkos::create_mirror_view(x);
  size_t f = 0;
  for (long i0 = 0; i0 < b; ++i0)
    for (long i1 = 0; i1 < n; ++i1)
      for (long i2 = 0; i2 < heads; ++i2)
        for (long i3 = 0; i3 < d; ++i3) m(i0, i1, i2, i3) = static_cast<T>(h[f++]);
  Kokkos::deep_copy(x, m);
  return x;
}

template <class R, class V>
std::vector<R> to_host(const V& x) {  // rank-4 View, row-major
  auto m = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), x);
  std::vector<R> out;
  out.reserve(x.size());
  for (size_t a = 0; a < x.extent(0); ++a)
    for (size_t b = 0; b < x.extent(1); ++b)
      for (size_t c = 0; c < x.extent(2); ++c)
        for (size_t e = 0; e < x.extent(3); ++e) out.push_back(static_cast<R>(static_cast<double>(m(a, b, c, e))));
  return out;
}

template <class R, class V>
std::vector<R> to_host3(const V& x) {  // rank-3 View, row-major
  auto m = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), x);
  std::vector<R> out;
  out.reserve(x.size());
  for (size_t a = 0; a < x.extent(0); ++a)
    for (size_t b = 0; b < x.extent(1); ++b)
      for (size_t c = 0; c < x.extent(2); ++c) out.push_back(static_cast<R>(m(a, b, c)));
  return out;
}

double max_over(double x, MPI_Comm comm) {
  MPI_Allreduce(MPI_IN_PLACE, &x, 1, MPI_DOUBLE, MPI_MAX, comm);
  return x;
}

// Visible from the definition (bottom-right aligned causal and window over global positions).
bool visible(const Config& c, long seq_q, long seq_k, long i, long j) {
  const long diag = i + seq_k - seq_q;
  const long left = c.window.empty() ? -1 : c.window[0], right = c.window.empty() ? -1 : c.window[1];
  if (c.causal && j > diag) return false;
  if (right >= 0 && j > diag + right) return false;
  if (left >= 0 && j < diag - left) return false;
  return true;
}

struct CheckResult {
  double max_abs = 0, max_rel = 0, max_lse = 0;
  int rows = 0;
  // --backward: relative L2 errors of the checked rows of dq (the query rows above) and of dk, dv (key rows).
  bool gradients = false;
  double dq_rel = 0, dk_rel = 0, dv_rel = 0;
  int key_rows = 0;
};

// The computed gradients (host copies, float64) the check compares; empty without --backward.
struct Gradients {
  std::vector<double> dq, dk, dv;  // [batch, n, heads, d], [batch, n, kv_heads, d] x 2
};

// Adds |got - want|^2 and |want|^2 of one row of length d to num/den (a non-finite value counts as +inf).
void accumulate_error(const double* got, const std::vector<double>& want, double& num, double& den) {
  for (size_t e = 0; e < want.size(); ++e) {
    const double err = std::isfinite(got[e]) ? got[e] - want[e] : INFINITY;
    num += err * err, den += want[e] * want[e];
  }
}

// Relative L2 error over all checked rows of all ranks (collective): sqrt(sum num / sum den). One number per
// tensor, not the worst row: a gradient row that is nearly zero by cancellation would make a per-row
// relative error meaningless.
double relative_l2(double num, double den, MPI_Comm comm) {
  double v[2] = {num, den};
  MPI_Allreduce(MPI_IN_PLACE, v, 2, MPI_DOUBLE, MPI_SUM, comm);
  if (std::isnan(v[0]) || std::isinf(v[0])) return INFINITY;
  return v[1] > 0 ? std::sqrt(v[0] / v[1]) : std::sqrt(v[0]);
}

// The global position of local token `li` of shard `s`.
long global_of(const Shards& s, long li) {
  for (const auto& sg : s.segs)
    if (li >= sg.local_begin && li < sg.local_begin + sg.length) return sg.global_begin + li - sg.local_begin;
  return 0;
}

// A travelling shard's segments: {tokens, begin0, length0, begin1, length1}.
struct TravellingSegments {
  long v[5] = {0, 0, 0, 0, 0};
  explicit TravellingSegments(const Shards& s) {
    v[0] = s.n;
    for (size_t i = 0; i < s.segs.size() && i < 2; ++i) v[1 + 2 * i] = s.segs[i].global_begin, v[2 + 2 * i] = s.segs[i].length;
  }
  // Calls f(local index in the owner's shard, global position) for every token of the owner.
  template <class F>
  void for_each(F&& f) const {
    long lb = 0;
    for (int g = 0; g < 2; ++g) {
      for (long j = 0; j < v[2 + 2 * g]; ++j) f(lb + j, v[1 + 2 * g] + j);
      lb += v[2 + 2 * g];
    }
  }
};

// Passes `buf` and the segments on to the next rank and receives the previous rank's (P > 1).
void pass_on(std::vector<double>& buf, TravellingSegments& seg, MPI_Comm comm) {
  int rank, p;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &p);
  if (p == 1) return;
  const int next = (rank + 1) % p, prev = (rank + p - 1) % p;
  // Chunks of at most 2^30 doubles: no count beyond MPI's int.
  const size_t chunk = size_t(1) << 30;
  for (size_t off = 0; off < buf.size(); off += chunk)
    MPI_Sendrecv_replace(buf.data() + off, static_cast<int>(std::min(chunk, buf.size() - off)), MPI_DOUBLE, next, 5, prev, 5,
                         comm, MPI_STATUS_IGNORE);
  MPI_Sendrecv_replace(seg.v, 5, MPI_LONG, next, 6, prev, 6, comm, MPI_STATUS_IGNORE);
}

// The score of q·k in float64 as the kernels define it (scale, then softcap) and its derivative factor
// d score / d (scale q·k) (1 - tanh^2 with a softcap, else 1).
struct Score {
  double s, g;
};
Score score(const Config& c, double scale, const double* q, const double* k, long d) {
  double x = 0;
  for (long e = 0; e < d; ++e) x += q[e] * k[e];
  x *= scale;
  if (c.softcap > 0) {
    const double t = std::tanh(x / c.softcap);
    return {c.softcap * t, 1 - t * t};
  }
  return {x, 1.0};
}

// `--check K`: K random query rows of this rank, in float64 straight from the definition, with the K/V shards
// streamed around the ring; compared with the computed o and lse rows. With --backward also dq of those
// rows (accumulated in the same pass: dq_i = scale/l · (Σ_j w_ij dP_ij g_ij k_j − D_i Σ_j w_ij g_ij k_j),
// with D_i = dO_i·O_i from the exact O_i), and dk, dv of K random key rows of this rank, with the query-side
// shards (q, dO and each query row's lse and D) streamed around the ring: dv_j = Σ_i P_ij dO_i and
// dk_j = scale Σ_i P_ij (dO_i·v_j − D_i) g_ij q_i over every query of the sequence (and every query head
// of the key's group). Those query rows' lse and D come from the run's own lse and o (float64 from there
// on): exact ones for every row would be the whole forward pass again; the o and lse rows above check them.
// O(K·N·d) work per rank, O(N/P·(heads·d)) memory. Collective.
CheckResult self_check(const Config& c, const Shards& s, const std::vector<double>& o, const std::vector<double>& lse,
                       const Gradients& grad, MPI_Comm comm) {
  int rank, p;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &p);
  const bool bwd = !grad.dq.empty();
  std::mt19937_64 rng(c.seed * 7919 + rank);
  struct Row { long b, li, gi, h; double m, l; std::vector<double> acc, a, bsum; };
  std::vector<Row> rows;
  for (int t = 0; t < c.check && s.n > 0; ++t) {
    Row r;
    r.b = static_cast<long>(rng() % s.batch);
    r.li = static_cast<long>(rng() % s.n);
    r.h = static_cast<long>(rng() % s.heads);
    r.gi = global_of(s, r.li), r.m = -INFINITY, r.l = 0, r.acc.assign(s.d, 0.0);
    if (bwd) r.a.assign(s.d, 0.0), r.bsum.assign(s.d, 0.0);
    rows.push_back(r);
  }
  const double scale = c.scale > 0 ? c.scale : 1.0 / std::sqrt(double(s.d));
  const long group = s.heads / s.kv_heads;
  long nmax = s.n;
  MPI_Allreduce(MPI_IN_PLACE, &nmax, 1, MPI_LONG, MPI_MAX, comm);

  // ---- pass 1: the K/V shards travel; o, lse (and dq) of the query rows --------------------------------
  const size_t row = static_cast<size_t>(s.kv_heads * s.d);
  {
    std::vector<double> kv(2 * static_cast<size_t>(s.batch * nmax) * row, 0.0);
    const size_t voff = static_cast<size_t>(s.batch * nmax) * row;
    for (long b = 0; b < s.batch; ++b) {  // [batch, nmax, kv_heads, d]: this rank's n rows first
      std::copy(s.k.begin() + b * s.n * row, s.k.begin() + (b + 1) * s.n * row, kv.begin() + b * nmax * row);
      std::copy(s.v.begin() + b * s.n * row, s.v.begin() + (b + 1) * s.n * row, kv.begin() + voff + b * nmax * row);
    }
    TravellingSegments seg(s);
    for (int step = 0; step < p; ++step) {
      for (auto& r : rows) {
        const long hk = r.h / group;
        const double* qr = &s.q[((r.b * s.n + r.li) * s.heads + r.h) * s.d];
        const double* dor = bwd ? &s.d_o[((r.b * s.n + r.li) * s.heads + r.h) * s.d] : nullptr;
        seg.for_each([&](long lj, long gj) {
          if (!visible(c, s.seq, s.seq, r.gi, gj)) return;
          const double* kr = &kv[(r.b * nmax + lj) * row + hk * s.d];
          const double* vr = &kv[voff + (r.b * nmax + lj) * row + hk * s.d];
          const Score x = score(c, scale, qr, kr, s.d);
          const double m = std::max(r.m, x.s), a = std::exp(r.m - m), w = std::exp(x.s - m);
          r.l = r.l * a + w;
          for (long e = 0; e < s.d; ++e) r.acc[e] = r.acc[e] * a + w * vr[e];
          if (bwd) {
            double dp = 0;
            for (long e = 0; e < s.d; ++e) dp += dor[e] * vr[e];
            for (long e = 0; e < s.d; ++e) {
              r.a[e] = r.a[e] * a + w * dp * x.g * kr[e];
              r.bsum[e] = r.bsum[e] * a + w * x.g * kr[e];
            }
          }
          r.m = m;
        });
      }
      pass_on(kv, seg, comm);
    }
  }
  CheckResult res;
  double dq_num = 0, dq_den = 0;
  for (const auto& r : rows) {
    double num = 0, den = 0;
    std::vector<double> want(s.d);
    for (long e = 0; e < s.d; ++e) want[e] = r.l > 0 ? r.acc[e] / r.l : 0.0;
    const double* got = &o[((r.b * s.n + r.li) * s.heads + r.h) * s.d];
    for (long e = 0; e < s.d; ++e) res.max_abs = std::max(res.max_abs, std::isfinite(got[e]) ? std::abs(got[e] - want[e]) : INFINITY);
    accumulate_error(got, want, num, den);
    res.max_rel = std::max(res.max_rel, std::isnan(num) ? INFINITY : den > 0 ? std::sqrt(num / den) : std::sqrt(num));
    const double want_lse = r.l > 0 ? r.m + std::log(r.l) : -INFINITY;
    const double got_lse = lse[(r.b * s.heads + r.h) * s.n + r.li];
    const double lerr = (std::isinf(want_lse) && got_lse == want_lse) ? 0.0 : std::abs(got_lse - want_lse) / std::max(1.0, std::abs(want_lse));
    res.max_lse = std::max(res.max_lse, std::isnan(lerr) ? INFINITY : lerr);
    if (bwd) {
      const double* dor = &s.d_o[((r.b * s.n + r.li) * s.heads + r.h) * s.d];
      double dd = 0;  // D_i = dO_i · O_i, exact O
      for (long e = 0; e < s.d; ++e) dd += dor[e] * want[e];
      std::vector<double> dq(s.d, 0.0);
      if (r.l > 0)
        for (long e = 0; e < s.d; ++e) dq[e] = scale / r.l * (r.a[e] - dd * r.bsum[e]);
      accumulate_error(&grad.dq[((r.b * s.n + r.li) * s.heads + r.h) * s.d], dq, dq_num, dq_den);
    }
  }
  res.rows = static_cast<int>(rows.size());
  res.max_abs = max_over(res.max_abs, comm), res.max_rel = max_over(res.max_rel, comm), res.max_lse = max_over(res.max_lse, comm);
  MPI_Allreduce(MPI_IN_PLACE, &res.rows, 1, MPI_INT, MPI_SUM, comm);
  if (!bwd) return res;
  res.gradients = true;
  res.dq_rel = relative_l2(dq_num, dq_den, comm);

  // ---- pass 2: the query-side shards travel; dk, dv of the key rows -------------------------------------
  struct KeyRow { long b, lj, gj, hk; std::vector<double> dk, dv; };
  std::vector<KeyRow> keys;
  for (int t = 0; t < c.check && s.n > 0; ++t) {
    KeyRow r;
    r.b = static_cast<long>(rng() % s.batch);
    r.lj = static_cast<long>(rng() % s.n);
    r.hk = static_cast<long>(rng() % s.kv_heads);
    r.gj = global_of(s, r.lj), r.dk.assign(s.d, 0.0), r.dv.assign(s.d, 0.0);
    keys.push_back(r);
  }
  // Per (batch, token, head): q [d], dO [d], lse, D = dO·o (the run's own o and lse).
  const size_t qrow = static_cast<size_t>(2 * s.d + 2);
  std::vector<double> qs(static_cast<size_t>(s.batch * nmax * s.heads) * qrow, 0.0);
  for (long b = 0; b < s.batch; ++b)
    for (long li = 0; li < s.n; ++li)
      for (long h = 0; h < s.heads; ++h) {
        double* dst = &qs[((b * nmax + li) * s.heads + h) * qrow];
        const size_t src = static_cast<size_t>(((b * s.n + li) * s.heads + h) * s.d);
        double dd = 0;
        for (long e = 0; e < s.d; ++e) dst[e] = s.q[src + e], dst[s.d + e] = s.d_o[src + e], dd += s.d_o[src + e] * o[src + e];
        dst[2 * s.d] = lse[(b * s.heads + h) * s.n + li];
        dst[2 * s.d + 1] = dd;
      }
  TravellingSegments seg(s);
  for (int step = 0; step < p; ++step) {
    for (auto& r : keys) {
      const double* kr = &s.k[((r.b * s.n + r.lj) * s.kv_heads + r.hk) * s.d];
      const double* vr = &s.v[((r.b * s.n + r.lj) * s.kv_heads + r.hk) * s.d];
      seg.for_each([&](long li, long gi) {
        if (!visible(c, s.seq, s.seq, gi, r.gj)) return;
        for (long h = r.hk * group; h < (r.hk + 1) * group; ++h) {
          const double* qr = &qs[((r.b * nmax + li) * s.heads + h) * qrow];
          const double* dor = qr + s.d;
          const double l = qr[2 * s.d], dd = qr[2 * s.d + 1];
          const Score sc = score(c, scale, qr, kr, s.d);
          const double pr = std::exp(sc.s - l);
          double dp = 0;
          for (long e = 0; e < s.d; ++e) dp += dor[e] * vr[e];
          const double ds = pr * (dp - dd) * sc.g * scale;
          for (long e = 0; e < s.d; ++e) r.dv[e] += pr * dor[e], r.dk[e] += ds * qr[e];
        }
      });
    }
    pass_on(qs, seg, comm);
  }
  double dk_num = 0, dk_den = 0, dv_num = 0, dv_den = 0;
  for (const auto& r : keys) {
    const size_t at = static_cast<size_t>(((r.b * s.n + r.lj) * s.kv_heads + r.hk) * s.d);
    accumulate_error(&grad.dk[at], r.dk, dk_num, dk_den);
    accumulate_error(&grad.dv[at], r.dv, dv_num, dv_den);
  }
  res.dk_rel = relative_l2(dk_num, dk_den, comm), res.dv_rel = relative_l2(dv_num, dv_den, comm);
  res.key_rows = static_cast<int>(keys.size());
  MPI_Allreduce(MPI_IN_PLACE, &res.key_rows, 1, MPI_INT, MPI_SUM, comm);
  return res;
}

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

std::string shape_text(const Shards& s) {
  return "[batch " + std::to_string(s.batch) + ", seq " + std::to_string(s.seq) + ", heads " + std::to_string(s.heads) +
         "/" + std::to_string(s.kv_heads) + ", head_dim " + std::to_string(s.d) + "]";
}

// Why this run cannot fit, or "": the bytes each rank will hold at once (inputs in float64 on the host, the
// compute-dtype tensors, ring buffers, the results copied back, the check's rows), summed over the ranks
// that share a node and compared with the node's MemAvailable; element counts that overflow 64-bit
// arithmetic are refused outright. A lower bound: Kokkos, MPI and HDF5 add their own. Device memory (a GPU
// backend) is not measured here: there the device tensors are left out of the host sum. Collective.
template <class T>
std::string memory_problem(const Config& c, const Shards& s, int p, MPI_Comm comm) {
  using Acc = kfa::accumulator_t<T>;
  using Mem = Kokkos::DefaultExecutionSpace::memory_space;
  constexpr bool device_on_host = Kokkos::SpaceAccessibility<Kokkos::HostSpace, Mem>::accessible;
  using U = unsigned long long;
  Bytes global;  // the whole tensor q: a count that must exist in 64 bits (and as HDF5 sizes)
  global.add({U(s.batch), U(s.seq), U(s.heads), U(s.d), 8});
  global.add({U(s.batch), U(s.seq), U(s.kv_heads), U(s.d), 8});
  if (global.overflow)
    return "kfa-longseq: " + shape_text(s) + ": the element count overflows 64-bit arithmetic; nothing was allocated";
  long nmax = s.n;
  MPI_Allreduce(MPI_IN_PLACE, &nmax, 1, MPI_LONG, MPI_MAX, comm);
  const U tok = U(s.batch) * U(s.n), tokmax = U(s.batch) * U(nmax), hq = U(s.heads) * U(s.d), hkv = U(s.kv_heads) * U(s.d);
  Bytes b;
  b.add({tok, hq + 2 * hkv + (c.backward ? hq : 0), 8});  // q, k, v (and do) read or generated, as float64
  if (device_on_host) {
    b.add({tok, 2 * hq + 2 * hkv, sizeof(T)});  // q, k, v, o
    b.add({U(s.batch), U(s.heads), U(s.n), sizeof(Acc)});  // lse
    b.add({tokmax, hkv, 4 * sizeof(T)});  // the ring's K/V buffers in flight (and the exchange timing's)
    if (c.backward) b.add({tok, 2 * hq + 2 * hkv, sizeof(T)}).add({tokmax, hkv, 4 * sizeof(Acc)});  // do, dq, dk, dv
  }
  b.add({tok, hq, 8}).add({U(s.batch), U(s.heads), U(s.n), 8});  // o and lse copied back as float64
  b.add({tok, hq, sizeof(double)});  // one output dataset in its stored type while it is written
  Bytes chk;
  if (c.check > 0) chk.add({tokmax, 2 * hkv, 8}).add({U(c.check), 8 * U(s.d) + 96});  // travelling K/V rows, rows
  if (c.check > 0 && c.backward)  // the computed gradients as float64, travelling q/dO/lse/D rows, dq/key rows
    chk.add({tok, hq + 2 * hkv, 8}).add({tokmax, U(s.heads), 2 * U(s.d) + 2, 8}).add({U(c.check), 32 * U(s.d) + 96});
  b.add({chk.v, 1});
  b.overflow |= chk.overflow;
  // Ranks sharing this node share its memory.
  MPI_Comm node;
  MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
  int on_node = 1;
  MPI_Comm_size(node, &on_node);
  double need_node = b.overflow ? 1e300 : static_cast<double>(b.v);
  MPI_Allreduce(MPI_IN_PLACE, &need_node, 1, MPI_DOUBLE, MPI_SUM, node);
  MPI_Comm_free(&node);
  const U avail = mem_available();
  if (!b.overflow && (avail == 0 || need_node <= static_cast<double>(avail))) return "";
  std::ostringstream m;
  m << "kfa-longseq: " << shape_text(s) << " " << c.dtype << (c.backward ? " forward+backward" : " forward") << " on " << p
    << " ranks needs ";
  if (b.overflow) m << "more bytes per rank than 64-bit arithmetic counts";
  else
    m << "at least " << b.v << " bytes per rank (" << std::fixed << std::setprecision(1) << b.v / 1073741824.0 << " GiB"
      << (c.check > 0 ? ", of which --check " + std::to_string(c.check) + " rows take " + std::to_string(chk.v) : std::string())
      << "), " << std::setprecision(0) << need_node << " bytes for the " << on_node << " rank(s) on this node";
  m << ", but MemAvailable is " << avail << " bytes (" << std::setprecision(1) << avail / 1073741824.0
    << " GiB); nothing was allocated: use more ranks or nodes, a shorter sequence or a smaller batch"
    << (c.check > 0 ? " (or fewer --check rows)" : "");
  return m.str();
}

template <class T>
double tolerance() {
  if (std::is_same<T, double>::value) return 1e-12;
  if (std::is_same<T, float>::value) return 1e-5;
  return 1e-2;
}

std::string json_escape(const std::string& s) {
  std::string o;
  for (char ch : s) {
    if (ch == '"' || ch == '\\') o += std::string("\\") + ch;
    else if (static_cast<unsigned char>(ch) < 0x20) {
      char u[8];
      std::snprintf(u, sizeof u, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(ch)));
      o += u;
    } else o += ch;
  }
  return o;
}

// A JSON object built key by key: strings escaped, non-finite numbers as null, nested objects.
class Json {
 public:
  struct Value { std::string text; };
  static Value null() { return {"null"}; }
  static Value str(const std::string& x) { return {"\"" + json_escape(x) + "\""}; }
  static Value num(double x) {
    if (!std::isfinite(x)) return null();
    char b[32];
    std::snprintf(b, sizeof b, "%.9g", x);
    return {b};
  }
  static Value raw(const std::string& x) { return {x}; }
  Json& add(const std::string& key, const Value& v) {
    m_text += (m_text.empty() ? "" : ", ") + str(key).text + ": " + v.text;
    return *this;
  }
  Json& add(const std::string& key, const std::string& v) { return add(key, str(v)); }
  Json& add(const std::string& key, const char* v) { return add(key, str(v)); }
  Json& add(const std::string& key, bool v) { return add(key, Value{v ? "true" : "false"}); }
  Json& add(const std::string& key, double v) { return add(key, num(v)); }
  template <class I, typename std::enable_if<std::is_integral<I>::value && !std::is_same<I, bool>::value, int>::type = 0>
  Json& add(const std::string& key, I v) { return add(key, Value{std::to_string(v)}); }
  Json& add(const std::string& key, const Json& v) { return add(key, Value{v.text()}); }
  std::string text() const { return "{" + m_text + "}"; }

 private:
  std::string m_text;
};

// Seconds for the report: 3 decimals, or 3 significant digits below 0.1 s.
std::string secs(double x) {
  char b[32];
  std::snprintf(b, sizeof b, x >= 0.1 || x == 0 ? "%.3f s" : "%.3g s", x);
  return b;
}

// "Open MPI v4.1.4" (the first part of MPI_Get_library_version), and the MPI standard version.
std::string mpi_runtime_version() {
  char lib[MPI_MAX_LIBRARY_VERSION_STRING] = {0};
  int len = 0, major = 0, minor = 0;
  MPI_Get_library_version(lib, &len);
  MPI_Get_version(&major, &minor);
  std::string l(lib, static_cast<size_t>(std::max(0, len)));
  l = l.substr(0, l.find_first_of(",\n"));
  while (!l.empty() && (l.back() == ' ' || l.back() == '\0')) l.pop_back();
  return l + " (MPI " + std::to_string(major) + "." + std::to_string(minor) + ")";
}

// Gradients allow ten times o's tolerance: dk and dv sum over every query, dq over every key, each term
// carrying the rounding of the recomputed P and of dO·v - D in the compute dtype (measured in float32: about
// 1e-6 at seq 16384, against o's 2e-6 and a tolerance of 1e-4).
template <class T>
double gradient_tolerance() {
  return 10 * tolerance<T>();
}

// Test hook: KFA_LONGSEQ_CORRUPT=o|dq|dk|dv multiplies that computed tensor by 1.001 on every rank after the
// computation, so the tests can show that --check fails on a wrong result.
template <class V>
void corrupt_for_tests(const V& o, const V& dq, const V& dk, const V& dv) {
  const char* e = std::getenv("KFA_LONGSEQ_CORRUPT");
  if (!e) return;
  const std::string w(e);
  const V x = w == "o" ? o : w == "dq" ? dq : w == "dk" ? dk : w == "dv" ? dv : V();
  if (x.size() == 0) return;
  using T = typename V::non_const_value_type;
  auto* ptr = x.data();
  Kokkos::parallel_for("kfa-longseq::corrupt_for_tests", Kokkos::RangePolicy<typename V::execution_space>(0, x.size()),
                       KOKKOS_LAMBDA(const size_t i) { ptr[i] = static_cast<T>(ptr[i] * static_cast<T>(1.001)); });
  Kokkos::fence();
}

// A person watching the run sees this (rank 0, stderr): on a terminal (or with --progress) a bar redrawn
// after every ring step; otherwise a line after a ring step when at least --progress-interval seconds
// (10) passed since the last one, so a long run says it is alive without flooding a log. (Open MPI's mpirun
// gives ranks a pipe for stderr even on a terminal: there the lines, unless --progress.) Elapsed time and an
// ETA of the whole computation: the backward pass counts 2.5 forward passes (its FLOP ratio). --quiet: none.
class Progress {
 public:
  Progress(const Config& c, int rank, int ranks)
      : m_on(rank == 0 && !c.quiet), m_bar(c.progress || isatty(2)), m_interval(c.progress_interval), m_ranks(ranks),
        m_backward(c.backward) {}
  void start(double t0) {
    m_t0 = m_last = t0;
    if (!m_on || m_bar) return;
    std::fprintf(stderr,
                 "kfa-longseq: computing %s on %d rank(s); a progress line after a ring step, at most one per %g s "
                 "(--progress-interval; --quiet: none)\n",
                 m_backward ? "forward+backward" : "forward", m_ranks, m_interval);
    std::fflush(stderr);
  }
  // The RingStats::on_step of one pass that does `weight` of the `total` work after `before` was done.
  std::function<void(int, int)> hook(const char* pass, double before, double weight, double total) {
    return [this, pass, before, weight, total](int done, int all) {
      if (m_on) step(pass, (before + weight * done / std::max(all, 1)) / total, done, all);
    };
  }

 private:
  static std::string duration(double sec) {
    char b[32];
    if (sec < 120) std::snprintf(b, sizeof b, "%.1f s", sec);
    else if (sec < 7200) std::snprintf(b, sizeof b, "%dm%02ds", int(sec) / 60, int(sec) % 60);
    else std::snprintf(b, sizeof b, "%dh%02dm", int(sec) / 3600, int(sec) / 60 % 60);
    return b;
  }
  void step(const char* pass, double fraction, int done, int all) {
    const double now = MPI_Wtime(), elapsed = now - m_t0;
    const std::string eta = fraction > 0 ? duration(elapsed * (1 - fraction) / fraction) : std::string("?");
    if (m_bar) {
      const int w = 30, f = static_cast<int>(w * fraction + 0.5);
      std::fprintf(stderr, "\r%-8s [%s%s] ring step %d/%d, %s elapsed, ETA %s   ", pass, std::string(f, '#').c_str(),
                   std::string(w - f, '.').c_str(), done, all, duration(elapsed).c_str(), eta.c_str());
      if (done == all) std::fprintf(stderr, "\n");
    } else if (now - m_last >= m_interval) {
      std::fprintf(stderr, "kfa-longseq: %s ring step %d/%d done, %s elapsed, ETA %s\n", pass, done, all,
                   duration(elapsed).c_str(), eta.c_str());
      m_last = now;
    }
    std::fflush(stderr);
  }
  bool m_on, m_bar;
  double m_interval;
  int m_ranks;
  bool m_backward;
  double m_t0 = 0, m_last = 0;
};

// The ring steps' time split, from every rank's measured per-step times (RingStats): per step, a rank is
// busy c (its attention kernels and merges) and then waits w (for its transfers, and at the end-of-step
// agreement for every other rank). Averaged over the ranks, the step's time c + w splits into
//   compute              mean c
//   load imbalance       max c - mean c   (waiting for the slowest rank's compute)
//   not hidden           mean (c + w) - max c   (what is left: communication the compute did not cover)
// and "hidden" compares the last with the transfer time measured alone (the bytes each step sent at the rate
// of one bare exchange, time_ring_exchange). Collective.
// A step's end-of-step agreement time where RingStepStats reports it apart from wait_s (sync_s), else 0 (then
// wait_s includes it).
template <class S>
auto step_sync(const S& x, int) -> decltype(double(x.sync_s)) {
  return x.sync_s;
}
template <class S>
double step_sync(const S&, long) {
  return 0.0;
}

struct StepSplit {
  double steps_s = 0, compute_s = 0, imbalance_s = 0, exposed_s = 0, transfer_s = 0, transfer_bytes = 0;
};
StepSplit split_steps(std::initializer_list<const kfa::dist::RingStats*> stats, double t_exchange, double exchange_bytes,
                      MPI_Comm comm) {
  int p;
  MPI_Comm_size(comm, &p);
  std::vector<double> mine;  // per step: busy, wait, bytes sent
  for (const auto* st : stats)
    for (const auto& x : st->steps)
      mine.insert(mine.end(), {x.compute_s + x.merge_s, x.wait_s + step_sync(x, 0), double(x.bytes)});
  int n = static_cast<int>(mine.size()), nmin = n;
  MPI_Allreduce(MPI_IN_PLACE, &nmin, 1, MPI_INT, MPI_MIN, comm);
  mine.resize(static_cast<size_t>(nmin));  // the same step count on every rank (it is: one ring)
  n = nmin;
  std::vector<double> all(static_cast<size_t>(n) * p);
  MPI_Allgather(mine.data(), n, MPI_DOUBLE, all.data(), n, MPI_DOUBLE, comm);
  StepSplit r;
  for (int i = 0; i + 3 <= n; i += 3) {
    double cmax = 0, csum = 0, tsum = 0, bmax = 0;
    for (int q = 0; q < p; ++q) {
      const double* x = &all[static_cast<size_t>(q) * n + i];
      cmax = std::max(cmax, x[0]), csum += x[0], tsum += x[0] + x[1], bmax = std::max(bmax, x[2]);
    }
    r.steps_s += tsum / p, r.compute_s += csum / p, r.imbalance_s += cmax - csum / p;
    r.exposed_s += std::max(0.0, tsum / p - cmax);
    r.transfer_bytes += bmax;
  }
  if (exchange_bytes > 0) r.transfer_s = r.transfer_bytes / exchange_bytes * t_exchange;
  return r;
}

// Non-finite counts of named tensors, summed over the ranks (collective).
struct NonFiniteCounts {
  std::vector<std::pair<std::string, unsigned long long>> n;
  unsigned long long total() const {
    unsigned long long t = 0;
    for (const auto& x : n) t += x.second;
    return t;
  }
  std::string text() const {  // "o 3, lse 1"
    std::string t;
    for (const auto& x : n) t += (t.empty() ? "" : ", ") + x.first + " " + std::to_string(x.second);
    return t;
  }
  std::string json() const {  // {"o": 3, "lse": 1}
    std::string t;
    for (const auto& x : n) t += (t.empty() ? "{" : ", ") + ("\"" + x.first + "\": ") + std::to_string(x.second);
    return t.empty() ? "{}" : t + "}";
  }
};

template <class V>
void count_into(NonFiniteCounts& out, const char* name, const V& x) {
  out.n.emplace_back(name, static_cast<unsigned long long>(kfa::count_nonfinite(Kokkos::DefaultExecutionSpace(), x)));
}

void allreduce(NonFiniteCounts& c, MPI_Comm comm) {
  std::vector<unsigned long long> v;
  for (const auto& x : c.n) v.push_back(x.second);
  MPI_Allreduce(MPI_IN_PLACE, v.data(), static_cast<int>(v.size()), MPI_UNSIGNED_LONG_LONG, MPI_SUM, comm);
  for (size_t i = 0; i < v.size(); ++i) c.n[i].second = v[i];
}

// The global [batch, seq, head, e] index of the first non-finite element of a host shard ([batch, n, heads, d],
// as rounded to the compute dtype), the smallest over the ranks; "" when none (collective).
std::string first_nonfinite(const Shards& s, const std::vector<double>& x, long heads, MPI_Comm comm) {
  long long best = -1;
  for (size_t f = 0; f < x.size() && best < 0; ++f) {
    if (std::isfinite(x[f])) continue;
    const long e = static_cast<long>(f % s.d), h = static_cast<long>(f / s.d % heads), li = static_cast<long>(f / s.d / heads % s.n),
               b = static_cast<long>(f / s.d / heads / s.n);
    long gi = 0;
    for (const auto& sg : s.segs)
      if (li >= sg.local_begin && li < sg.local_begin + sg.length) gi = sg.global_begin + li - sg.local_begin;
    best = ((static_cast<long long>(b) * s.seq + gi) * heads + h) * s.d + e;
  }
  long long mine = best < 0 ? LLONG_MAX : best;
  MPI_Allreduce(MPI_IN_PLACE, &mine, 1, MPI_LONG_LONG, MPI_MIN, comm);
  if (mine == LLONG_MAX) return "";
  const long long e = mine % s.d, h = mine / s.d % heads, i = mine / s.d / heads % s.seq, b = mine / s.d / heads / s.seq;
  return "[" + std::to_string(b) + ", " + std::to_string(i) + ", " + std::to_string(h) + ", " + std::to_string(e) + "]";
}

template <class T>
int run(const Config& c, MPI_Comm comm) {
  using Exec = Kokkos::DefaultExecutionSpace;
  using Mem = Exec::memory_space;
  using V4 = Kokkos::View<T****, Kokkos::LayoutRight, Mem>;
  using Acc = kfa::accumulator_t<T>;
  int rank, p;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &p);
  const kfa::dist::Layout layout = c.layout == "zigzag" ? kfa::dist::Layout::zigzag : kfa::dist::Layout::contiguous;
  const double t_start = MPI_Wtime();

  // ---- read or generate ----------------------------------------------------------------------------
  Shards s;
  std::unique_ptr<kfa::io::Reader> reader;
  kfa::io::DatasetInfo qi, ki, vi, doi;
  if (c.generate) {
    s.batch = c.batch, s.seq = c.seqlen, s.heads = c.heads, s.kv_heads = c.kv_heads, s.d = c.head_dim;
  } else {
    reader.reset(new kfa::io::Reader(c.input, comm));
    qi = reader->info("q"), ki = reader->info("k"), vi = reader->info("v");
    for (auto pr : {std::make_pair("q", &qi), std::make_pair("k", &ki), std::make_pair("v", &vi)}) {
      if (!pr.second->exists) kfa::detail::fail("kfa-longseq: --input ", c.input, " has no dataset '", pr.first, "'");
      if (pr.second->dims.size() != 4)
        kfa::detail::fail("kfa-longseq: dataset '", pr.first, "' of ", c.input, " has rank ", pr.second->dims.size(),
                          "; expected 4: [batch, seq, heads, head_dim]");
      if (pr.second->type == kfa::io::FileType::other)
        kfa::detail::fail("kfa-longseq: dataset '", pr.first, "' of ", c.input, " is ", pr.second->type_text,
                          ", not float64, float32 or float16");
    }
    if (ki.dims != vi.dims)
      kfa::detail::fail("kfa-longseq: datasets 'k' ", kfa::detail::extents_string({size_t(ki.dims[0]), size_t(ki.dims[1]), size_t(ki.dims[2]), size_t(ki.dims[3])}),
                        " and 'v' ", kfa::detail::extents_string({size_t(vi.dims[0]), size_t(vi.dims[1]), size_t(vi.dims[2]), size_t(vi.dims[3])}), " differ");
    if (qi.dims[0] != ki.dims[0] || qi.dims[1] != ki.dims[1] || qi.dims[3] != ki.dims[3])
      kfa::detail::fail("kfa-longseq: 'q' is [", qi.dims[0], ", ", qi.dims[1], ", ", qi.dims[2], ", ", qi.dims[3],
                        "] but 'k' is [", ki.dims[0], ", ", ki.dims[1], ", ", ki.dims[2], ", ", ki.dims[3],
                        "]: batch, seq and head_dim must match");
    s.batch = qi.dims[0], s.seq = qi.dims[1], s.heads = qi.dims[2], s.kv_heads = ki.dims[2], s.d = qi.dims[3];
    if (c.backward) {
      doi = reader->info("do");
      if (doi.exists && doi.type == kfa::io::FileType::other)
        kfa::detail::fail("kfa-longseq: dataset 'do' of ", c.input, " is ", doi.type_text,
                          ", not float64, float32 or float16");
      if (doi.exists && doi.dims != qi.dims) kfa::detail::fail("kfa-longseq: dataset 'do' must have the shape of 'q'");
    }
  }
  if (s.kv_heads <= 0 || s.heads % s.kv_heads != 0)
    kfa::detail::fail("kfa-longseq: heads = ", s.heads, " is not a multiple of kv-heads = ", s.kv_heads);
  if (s.d % 8 != 0 || s.d < 8 || s.d > 256)
    kfa::detail::fail("kfa-longseq: head_dim = ", s.d, " is unsupported (a multiple of 8 in [8, 256])");
  if (s.seq < p) kfa::detail::fail("kfa-longseq: seq = ", s.seq, " is shorter than the ", p, " ranks");
  if (layout == kfa::dist::Layout::zigzag && s.seq < 2 * p)
    kfa::detail::fail("kfa-longseq: --layout zigzag needs seq >= 2 * ranks = ", 2 * p, " but seq = ", s.seq);
  s.segs = kfa::dist::shard_of(layout, s.seq, p, rank);
  for (const auto& sg : s.segs) s.n += sg.length;
  kfa::io::detail::agree(comm, memory_problem<T>(c, s, p, comm));  // every rank refuses alike, before allocating
  auto load = [&](const char* name, int id, long heads, const kfa::io::DatasetInfo& info) {
    if (c.generate || !info.exists) return generate<T>(c, s, id, heads);
    std::vector<double> x;
    reader->read_rows(name, info, s.segs, x);
    for (double& e : x) e = round_to<T>(e);
    return x;
  };
  s.q = load("q", 0, s.heads, qi), s.k = load("k", 1, s.kv_heads, ki), s.v = load("v", 2, s.kv_heads, vi);
  if (c.backward) s.d_o = load("do", 3, s.heads, doi);
  reader.reset();
  const double t_read = max_over(MPI_Wtime() - t_start, comm);

  // ---- compute --------------------------------------------------------------------------------------
  kfa::AttentionOptions opts;
  opts.causal = c.causal, opts.softmax_scale = c.scale, opts.softcap = c.softcap;
  if (!c.window.empty()) opts.window_left = c.window[0], opts.window_right = c.window[1];
  kfa::dist::Ring ring(comm, layout);
  if (c.max_message_bytes > 0) ring.set_max_message_bytes(static_cast<std::size_t>(c.max_message_bytes));
  V4 q = to_device<T, V4>(s.q, s.batch, s.n, s.heads, s.d, "q"), k = to_device<T, V4>(s.k, s.batch, s.n, s.kv_heads, s.d, "k"),
     v = to_device<T, V4>(s.v, s.batch, s.n, s.kv_heads, s.d, "v"), o("o", s.batch, s.n, s.heads, s.d);
  V4 d_o;
  if (c.backward) d_o = to_device<T, V4>(s.d_o, s.batch, s.n, s.heads, s.d, "do");
  // Inputs with NaN/Inf (as stored, or after rounding to the compute dtype) give NaN outputs: refused on every
  // rank alike, naming each dataset, its count over all ranks and its first element, unless --allow-nonfinite.
  NonFiniteCounts in_bad;
  count_into(in_bad, "q", q), count_into(in_bad, "k", k), count_into(in_bad, "v", v);
  if (c.backward) count_into(in_bad, "do", d_o);
  allreduce(in_bad, comm);
  if (in_bad.total() > 0 && !c.allow_nonfinite) {
    std::ostringstream m;
    m << "kfa-longseq: non-finite input values (NaN or +-Inf";
    if (c.dtype != "float64") m << " in " << c.dtype;
    m << "):";
    const std::vector<const std::vector<double>*> host{&s.q, &s.k, &s.v, &s.d_o};
    for (size_t i = 0; i < in_bad.n.size(); ++i) {
      if (in_bad.n[i].second == 0) continue;
      const long heads = (i == 1 || i == 2) ? s.kv_heads : s.heads;
      m << " dataset '" << in_bad.n[i].first << "'" << (c.generate ? " (generated)" : " of " + c.input) << " has "
        << in_bad.n[i].second << ", the first at " << first_nonfinite(s, *host[i], heads, comm) << ";";
    }
    m << " they would make the outputs NaN; nothing was computed (--allow-nonfinite accepts them)";
    kfa::detail::fail(m.str());
  }
  Kokkos::View<Acc***, Kokkos::LayoutRight, Mem> lse("lse", s.batch, s.heads, s.n);
  // The bare ring exchange of one K/V shard, timed with nothing to hide it: the measured transfer time
  // that "hidden" compares with. The faster of two (the first also pays for setting up connections).
  const size_t exchange_count = static_cast<size_t>(2 * s.batch * max_over(double(s.n), comm) * s.kv_heads * s.d);
  double t_exchange = 0;
  if (p > 1)
    t_exchange = std::min(kfa::dist::time_ring_exchange<T>(Exec(), ring, exchange_count),
                          kfa::dist::time_ring_exchange<T>(Exec(), ring, exchange_count));
  kfa::dist::RingStats fst, bst;
  Progress progress(c, rank, p);
  fst.on_step = progress.hook("forward", 0.0, 1.0, c.backward ? 3.5 : 1.0);
  bst.on_step = progress.hook("backward", 1.0, 2.5, 3.5);
  MPI_Barrier(comm);
  const double tc0 = MPI_Wtime();
  progress.start(tc0);
  kfa::dist::ring_attention_forward(Exec(), ring, q, k, v, o, lse, opts, &fst);
  V4 dq, dk, dv;
  if (c.backward) {
    dq = V4("dq", s.batch, s.n, s.heads, s.d), dk = V4("dk", s.batch, s.n, s.kv_heads, s.d), dv = V4("dv", s.batch, s.n, s.kv_heads, s.d);
    kfa::dist::ring_attention_backward(Exec(), ring, q, k, v, o, d_o, lse, dq, dk, dv, opts, &bst);
  }
  const double t_compute_total = max_over(MPI_Wtime() - tc0, comm);
  const StepSplit split = split_steps({&fst, &bst}, t_exchange, exchange_count * sizeof(T), comm);
  double attention = 0, merge = 0;
  for (const auto* st : {&fst, &bst})
    for (const auto& x : st->steps) attention += x.compute_s, merge += x.merge_s;
  attention = max_over(attention, comm), merge = max_over(merge, comm);
  corrupt_for_tests(o, dq, dk, dv);

  // ---- check ----------------------------------------------------------------------------------------
  CheckResult chk;
  bool check_ok = true;
  const double o_tol = c.check_tol >= 0 ? c.check_tol : tolerance<T>();
  const double lse_tol = c.check_tol >= 0 ? c.check_tol : tolerance<Acc>() * 10;
  const double grad_tol = c.check_tol >= 0 ? c.check_tol : gradient_tolerance<T>();
  if (c.check > 0) {
    Gradients g;
    if (c.backward) g.dq = to_host<double>(dq), g.dk = to_host<double>(dk), g.dv = to_host<double>(dv);
    chk = self_check(c, s, to_host<double>(o), to_host3<double>(lse), g, comm);
    check_ok = chk.max_rel <= o_tol && chk.max_lse <= lse_tol &&
               (!chk.gradients || (chk.dq_rel <= grad_tol && chk.dk_rel <= grad_tol && chk.dv_rel <= grad_tol));
  }
  // Non-finite results (NaN/Inf inputs let through, or scores that overflow the compute dtype): exit 4 and
  // nothing written, unless --allow-nonfinite.
  NonFiniteCounts out_bad;
  count_into(out_bad, "o", o), count_into(out_bad, "lse", lse);
  if (c.backward) count_into(out_bad, "dq", dq), count_into(out_bad, "dk", dk), count_into(out_bad, "dv", dv);
  allreduce(out_bad, comm);
  const bool finite_ok = out_bad.total() == 0 || c.allow_nonfinite;

  // Where dO came from (--backward): the input's dataset 'do', or generated.
  const std::string do_source = !c.backward ? "" : (!c.generate && doi.exists) ? "file" : "generated";
  const double scale_applied = c.scale > 0 ? c.scale : 1.0 / std::sqrt(double(s.d));

  // ---- write ----------------------------------------------------------------------------------------
  const double tw0 = MPI_Wtime();
  // Nothing is written unless the run and its check succeeded: a failed check leaves --output and --json
  // as they were. The HDF5 output is written to a temporary, flushed and closed with every rank agreeing
  // that all of it succeeded; the JSON summary is written to its own temporary; only then are both renamed.
  std::unique_ptr<kfa::io::Writer> writer;
  if (!c.output.empty() && check_ok && finite_ok) {
    const std::vector<long> od{s.batch, s.seq, s.heads, s.d}, ld{s.batch, s.heads, s.seq}, kd{s.batch, s.seq, s.kv_heads, s.d};
    using Store = typename std::conditional<std::is_same<T, double>::value, double, float>::type;
    const unsigned long long row = static_cast<unsigned long long>(s.batch) * s.seq * sizeof(Store),
                             bytes = row * (s.heads * s.d + s.heads) + (c.backward ? row * (s.heads + 2 * s.kv_heads) * s.d : 0);
    writer.reset(new kfa::io::Writer(c.output, comm, bytes));
    kfa::io::Writer& w = *writer;
    w.write_rows("o", od, 1, s.segs, to_host<Store>(o));
    w.write_rows("lse", ld, 2, s.segs, to_host3<Store>(lse));
    if (c.backward) {
      w.write_rows("dq", od, 1, s.segs, to_host<Store>(dq));
      w.write_rows("dk", kd, 1, s.segs, to_host<Store>(dk));
      w.write_rows("dv", kd, 1, s.segs, to_host<Store>(dv));
    }
    // The schema is documented in apps/README.md ("Output attributes"); keep the two in step.
    w.attribute("kfa_version", KFA_VERSION_STRING);
    w.attribute("kokkos_version", kfa::compat::kokkos_version_string());
    w.attribute("mpi_version", mpi_runtime_version());
    w.attribute("hdf5_version", kfa::io::hdf5_library_version());
    w.attribute("backend", Exec::name());
    w.attribute("io", kfa::io::io_mode());
    w.attribute("ranks", p);
    w.attribute("layout", c.layout);
    w.attribute("dtype", c.dtype);
    w.attribute("batch", s.batch);
    w.attribute("seq", s.seq);
    w.attribute("heads", s.heads);
    w.attribute("kv_heads", s.kv_heads);
    w.attribute("head_dim", s.d);
    w.attribute("causal", c.causal);
    w.attribute("window_left", c.window.empty() ? -1 : c.window[0]);
    w.attribute("window_right", c.window.empty() ? -1 : c.window[1]);
    w.attribute("scale", scale_applied);
    w.attribute("scale_is_default", !(c.scale > 0));
    w.attribute("softcap", c.softcap);
    w.attribute("backward", c.backward);
    w.attribute("source", c.generate ? std::string("generated") : c.input);
    if (c.generate || do_source == "generated") w.attribute("seed", static_cast<long long>(c.seed));
    if (c.backward) w.attribute("do_source", do_source);
    w.attribute("check_rows", chk.rows);
    w.close();
  }
  const double t_write = max_over(MPI_Wtime() - tw0, comm);

  // ---- report ---------------------------------------------------------------------------------------
  rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  const double mem_mib = max_over(ru.ru_maxrss / 1024.0, comm);
  const double flops = 4.0 * s.batch * s.heads * double(s.seq) * s.seq * s.d * (c.causal ? 0.5 : 1.0) * (c.backward ? 3.5 : 1.0);
  const bool hidden_known = split.transfer_s > 0;
  const double hidden = hidden_known ? std::max(0.0, std::min(1.0, 1.0 - split.exposed_s / split.transfer_s)) : 0.0;
  if (rank == 0) {
    std::ostringstream rep;
    rep << "kfa-longseq " << KFA_VERSION_STRING << " (Kokkos " << kfa::compat::kokkos_version_string() << ", "
        << Exec::name() << ", " << kfa::io::io_mode() << ")\n"
        << "  " << p << " ranks, " << c.layout << ", " << c.dtype << ", batch " << s.batch << ", seq " << s.seq
        << ", heads " << s.heads << "/" << s.kv_heads << ", head_dim " << s.d << (c.causal ? ", causal" : "")
        << (c.backward ? ", forward+backward" : ", forward") << "\n"
        << "  ring transport: " << ring.transport<Mem>() << ", messages of at most " << ring.max_message_bytes()
        << " bytes\n";
    if (c.backward)
      rep << "  dO: " << (do_source == "file" ? "dataset 'do' of " + c.input
                                              : c.generate ? "generated (seed " + std::to_string(c.seed) + ")"
                                                           : "generated (seed " + std::to_string(c.seed) + "): " + c.input +
                                                                 " has no dataset 'do'")
          << "\n";
    char line[768];
    std::snprintf(line, sizeof line, "  read %s | compute %s | write %s\n", secs(t_read).c_str(), secs(t_compute_total).c_str(),
                  secs(t_write).c_str());
    rep << line;
    std::snprintf(line, sizeof line,
                  "  ring steps %s (mean over ranks) = compute %s + load imbalance %s + communication not hidden %s; "
                  "outside the steps %s\n  busiest rank: attention %s, merge %s\n",
                  secs(split.steps_s).c_str(), secs(split.compute_s).c_str(), secs(split.imbalance_s).c_str(),
                  secs(split.exposed_s).c_str(), secs(std::max(0.0, t_compute_total - split.steps_s)).c_str(),
                  secs(attention).c_str(), secs(merge).c_str());
    rep << line;
    if (hidden_known)
      std::snprintf(line, sizeof line,
                    "  transfers %s measured alone (%.0f bytes per rank; one bare exchange of %.0f bytes: %s), "
                    "communication hidden %.0f%%\n",
                    secs(split.transfer_s).c_str(), split.transfer_bytes, double(exchange_count * sizeof(T)),
                    secs(t_exchange).c_str(), hidden * 100);
    else
      std::snprintf(line, sizeof line, "  transfers none (%s), communication hidden n/a\n", p == 1 ? "one rank" : "no ring step sent");
    rep << line;
    std::snprintf(line, sizeof line, "  %.3f TFLOP/s, %.0f tokens/s, memory high-water %.1f MiB per rank (max)\n",
                  flops / t_compute_total * 1e-12, s.batch * s.seq / t_compute_total, mem_mib);
    rep << line;
    if (c.check > 0) {
      std::snprintf(line, sizeof line, "  check: %d rows vs float64: max abs error %.3e, max relative error %.3e (tolerance %.0e), lse %.3e: %s\n",
                    chk.rows, chk.max_abs, chk.max_rel, o_tol, chk.max_lse, check_ok ? "PASS" : "FAIL");
      rep << line;
      if (chk.gradients) {
        std::snprintf(line, sizeof line,
                      "  check gradients: dq %d query rows %.3e, dk %.3e and dv %.3e over %d key rows (relative L2 vs "
                      "float64, tolerance %.0e)%s\n",
                      chk.rows, chk.dq_rel, chk.dk_rel, chk.dv_rel, chk.key_rows, grad_tol,
                      chk.dq_rel <= grad_tol && chk.dk_rel <= grad_tol && chk.dv_rel <= grad_tol ? "" : ": FAIL");
        rep << line;
      }
    }
    if (in_bad.total() > 0 || out_bad.total() > 0)
      rep << "  non-finite values: inputs " << in_bad.text() << "; outputs " << out_bad.text()
          << (c.allow_nonfinite ? " (--allow-nonfinite)" : "") << "\n";
    std::fputs(rep.str().c_str(), stdout);
    std::fflush(stdout);
  }
  if (!finite_ok) {
    if (rank == 0) {
      std::fprintf(stderr,
                   "kfa-longseq: %s non-finite result element(s) (NaN or +-Inf) from finite inputs: %s: exit 4 "
                   "(score overflow in %s? use --dtype float64 or a smaller --scale; --allow-nonfinite "
                   "writes them anyway)",
                   std::to_string(out_bad.total()).c_str(), out_bad.text().c_str(), c.dtype.c_str());
      if (!c.output.empty()) std::fprintf(stderr, "; --output %s not written", c.output.c_str());
      if (!c.json.empty()) std::fprintf(stderr, "; --json %s not written", c.json.c_str());
      if (!c.output.empty() || !c.json.empty()) std::fprintf(stderr, " (existing files are left as they were)");
      std::fprintf(stderr, "\n");
    }
    return 4;
  }
  if (!check_ok) {
    if (rank == 0) {
      std::fprintf(stderr, "kfa-longseq: check FAILED (error over the tolerance): exit 3");
      if (!c.output.empty()) std::fprintf(stderr, "; --output %s not written", c.output.c_str());
      if (!c.json.empty()) std::fprintf(stderr, "; --json %s not written", c.json.c_str());
      if (!c.output.empty() || !c.json.empty()) std::fprintf(stderr, " (existing files are left as they were)");
      std::fprintf(stderr, "\n");
    }
    return 3;
  }
  // The JSON summary goes to a temporary first (rank 0); every rank learns whether that worked before
  // the HDF5 output is renamed, so a full disk or a failed write leaves both files as they were.
  std::string json_tmp, err;
  if (!c.json.empty()) {
    long id = static_cast<long>(MPI_Wtime() * 1e6) % 100000000;
    MPI_Bcast(&id, 1, MPI_LONG, 0, comm);
    json_tmp = kfa::io::temporary_path(c.json, id);
    if (rank == 0) {
      Json js;
      js.add("kfa_version", KFA_VERSION_STRING).add("kokkos_version", kfa::compat::kokkos_version_string());
      js.add("mpi_version", mpi_runtime_version()).add("hdf5_version", kfa::io::hdf5_library_version());
      js.add("backend", Exec::name()).add("io", kfa::io::io_mode()).add("ranks", p).add("layout", c.layout);
      js.add("dtype", c.dtype).add("batch", s.batch).add("seq", s.seq).add("heads", s.heads).add("kv_heads", s.kv_heads);
      js.add("head_dim", s.d).add("causal", c.causal).add("backward", c.backward).add("scale", scale_applied);
      js.add("do_source", do_source.empty() ? Json::null() : Json::str(do_source));
      js.add("read_s", t_read).add("compute_s", t_compute_total).add("write_s", t_write);
      js.add("attention_s", attention).add("merge_s", merge);
      js.add("steps_s", split.steps_s).add("step_compute_s", split.compute_s).add("load_imbalance_s", split.imbalance_s);
      js.add("communication_not_hidden_s", split.exposed_s).add("transfer_s", split.transfer_s);
      js.add("transfer_bytes", split.transfer_bytes).add("exchange_alone_s", t_exchange);
      js.add("communication_hidden", hidden_known ? Json::num(hidden) : Json::null());
      js.add("tflops", flops / t_compute_total * 1e-12).add("tokens_per_s", s.batch * s.seq / t_compute_total);
      js.add("memory_high_water_mib", mem_mib);
      if (c.check > 0) {
        Json ck;
        ck.add("rows", chk.rows).add("o_max_abs_error", chk.max_abs).add("o_max_rel_error", chk.max_rel);
        ck.add("lse_max_error", chk.max_lse).add("o_tolerance", o_tol).add("lse_tolerance", lse_tol);
        if (chk.gradients) {
          Json gr;
          gr.add("query_rows", chk.rows).add("key_rows", chk.key_rows).add("dq_rel_error", chk.dq_rel);
          gr.add("dk_rel_error", chk.dk_rel).add("dv_rel_error", chk.dv_rel).add("tolerance", grad_tol);
          ck.add("gradients", gr);
        } else {
          ck.add("gradients", Json::null());
        }
        ck.add("pass", check_ok);
        js.add("check", ck);
      } else {
        js.add("check", Json::null());
      }
      js.add("nonfinite_inputs", Json::raw(in_bad.json())).add("nonfinite_outputs", Json::raw(out_bad.json()));
      js.add("output", c.output.empty() ? Json::null() : Json::str(c.output));
      err = kfa::io::write_text_temporary(json_tmp, js.text() + "\n");
      if (!err.empty()) err = "kfa-longseq: --json " + c.json + ": " + err + kfa::io::full_filesystem_hint(c.json);
    }
    kfa::io::detail::agree(comm, err);  // throws on every rank; the Writer then removes its temporary
  }
  if (writer) writer->commit();
  if (!c.json.empty()) {
    if (rank == 0) {
      err = kfa::io::commit_temporary(json_tmp, c.json);
      if (!err.empty()) err = "kfa-longseq: --json " + c.json + ": " + err;
    }
    kfa::io::detail::agree(comm, err);
  }
  if (rank == 0 && writer) std::printf("  wrote %s\n", c.output.c_str());
  return 0;
}

// Why the outputs cannot be written safely, or "": each must name a file in an existing writable directory,
// and none may be the same file as --input or as another output (device + inode after links; directory +
// name for a file not created yet), or the run would destroy the input or its own result.
std::string output_problems(const Config& c, int ranks) {
  struct Named { const char* option; const std::string* path; };
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

int main(int argc, char** argv) {
  // No shared file pointers here: without Open MPI 4's lockedfile component, paths of any legal length open.
  kfa::io::avoid_shared_file_pointer_components();
  MPI_Init(&argc, &argv);
  int rank = 0, status = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  Config c;
  CLI::App app{"kfa-longseq: exact attention over one long sequence on many MPI ranks (ring attention over MPI, "
               "HDF5 in and out, a float64 self-check and a performance report). Needs seq >= ranks (contiguous) or "
               "seq >= 2 x ranks (zigzag). [default] after each option; sizes in tokens, elements or bytes as said."};
  app.option_defaults()->always_capture_default();
  auto* in = app.add_option("--input", c.input, "HDF5 file with datasets q, k, v [batch, seq, heads, head_dim] (k, v may have fewer heads; 'do' for --backward)")->check(CLI::ExistingFile);
  auto* gen = app.add_flag("--generate", c.generate, "generate deterministic inputs instead (same tensors for any rank count)");
  in->excludes(gen);
  app.add_option("--batch", c.batch, "with --generate: sequences in the batch")->check(CLI::PositiveNumber);
  app.add_option("--seqlen", c.seqlen, "with --generate: sequence length in tokens")->check(CLI::PositiveNumber);
  app.add_option("--heads", c.heads, "with --generate: query heads")->check(CLI::PositiveNumber);
  app.add_option("--kv-heads", c.kv_heads, "with --generate: key/value heads, a divisor of --heads")
      ->check(CLI::NonNegativeNumber)
      ->default_str("--heads");
  app.add_option("--head-dim", c.head_dim, "with --generate: elements per head, a multiple of 8 in [8, 256]")->check(CLI::PositiveNumber);
  app.add_option("--seed", c.seed, "with --generate: a non-negative integer (a generated dO and --check's rows use it too; with --input it is 1)")
      ->check(CLI::Validator(
          [](std::string& v) -> std::string {
            return v.find_first_not_of("0123456789") == std::string::npos && !v.empty()
                       ? std::string()
                       : "must be a non-negative integer, got '" + v + "'";
          },
          "NONNEGATIVE"));
  app.add_option("--dtype", c.dtype, "compute type (inputs are rounded to it)")->check(CLI::IsMember({"float64", "float32", "float16", "bfloat16"}));
  app.add_flag("--causal", c.causal, "causal mask (bottom-right aligned)");
  app.add_option("--window", c.window, "sliding window: L R keys left and right of the diagonal (-1 = unbounded)")
      ->expected(2)
      ->default_str("-1 -1");
  app.add_option("--scale", c.scale, "softmax scale multiplying q.k")->check(CLI::NonNegativeNumber)->default_str("1/sqrt(head_dim)");
  app.add_option("--softcap", c.softcap, "score softcap: softcap*tanh(score/softcap) (0 = off)")->check(CLI::NonNegativeNumber);
  app.add_option("--layout", c.layout, "how the sequence is sharded over the ranks (zigzag balances causal work)")->check(CLI::IsMember({"contiguous", "zigzag"}));
  app.add_option("--max-message-bytes", c.max_message_bytes, "split ring messages into chunks of at most this many bytes")
      ->check(CLI::Range(1L, 2147483647L))
      ->default_str("1073741824 (1 GiB)");
  app.add_flag("--backward", c.backward, "also compute dq, dk, dv (dO from the input's dataset 'do', else generated with --seed: reported)");
  app.add_option("--output", c.output, "write o, lse (and dq, dk, dv) and typed attributes to this HDF5 file")->default_str("none");
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
  app.footer("Exit status: 0 success; 2 a refused option or input (non-finite values in q/k/v/do included, unless "
             "--allow-nonfinite) or a failed read/write; 3 --check failed; 4 non-finite results (NaN/Inf in o, lse or "
             "the gradients: overflow? use --dtype float64 or a smaller --scale) unless --allow-nonfinite. A non-zero "
             "exit writes neither --output nor --json.");
  try {
    app.parse(argc, argv);
    if (!c.generate && c.input.empty()) throw CLI::ValidationError("one of --input FILE or --generate is required");
    if (!c.generate)  // the shape comes from the file: a generate-only option would be silently ignored
      for (const char* o : {"--batch", "--seqlen", "--heads", "--kv-heads", "--head-dim", "--seed"})
        if (app.count(o) > 0)
          throw CLI::ValidationError(std::string(o) + " applies only with --generate; with --input the shape and the "
                                     "values come from " + c.input);
    if (!c.window.empty() && (c.window[0] < -1 || c.window[1] < -1))
      throw CLI::ValidationError("--window values must be >= -1, got " + std::to_string(c.window[0]) + " " + std::to_string(c.window[1]));
    if (c.generate && c.kv_heads == 0) c.kv_heads = c.heads;
    if (app.count("--output") > 0 && c.output.empty()) throw CLI::ValidationError("--output needs a file name (got an empty string)");
    if (app.count("--json") > 0 && c.json.empty()) throw CLI::ValidationError("--json needs a file name (got an empty string)");
    if (app.count("--check-tol") > 0 && c.check == 0) throw CLI::ValidationError("--check-tol needs --check K");
    // Decided on rank 0 and broadcast, so every rank ends the same way before any work.
    int ranks = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &ranks);
    std::string problem = rank == 0 ? output_problems(c, ranks) : std::string();
    long len = static_cast<long>(problem.size());
    MPI_Bcast(&len, 1, MPI_LONG, 0, MPI_COMM_WORLD);
    problem.resize(static_cast<size_t>(len));
    MPI_Bcast(&problem[0], static_cast<int>(len), MPI_CHAR, 0, MPI_COMM_WORLD);
    if (!problem.empty()) throw CLI::ValidationError(problem);
    if (rank == 0) warn_stale_temporaries(c);
  } catch (const CLI::ParseError& e) {
    if (rank == 0) status = app.exit(e);
    else status = e.get_exit_code();
    MPI_Finalize();
    return status == 0 ? 0 : 2;
  }
  {
    Kokkos::ScopeGuard guard(argc, argv);
    try {
      if (c.dtype == "float64") status = run<double>(c, MPI_COMM_WORLD);
      else if (c.dtype == "float32") status = run<float>(c, MPI_COMM_WORLD);
#if KFA_HAS_HALF
      else if (c.dtype == "float16") status = run<kfa::compat::half_t>(c, MPI_COMM_WORLD);
#endif
#if KFA_HAS_BHALF
      else if (c.dtype == "bfloat16") status = run<kfa::compat::bhalf_t>(c, MPI_COMM_WORLD);
#endif
      else kfa::detail::fail("kfa-longseq: --dtype ", c.dtype, " is not supported by this Kokkos build (", Kokkos::DefaultExecutionSpace::name(),
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
