#pragma once
// kfa-longseq --check: random rows of the results against float64 from the definition.
#include "common.hpp"
#include "device.hpp"

#include <algorithm>
#include <cmath>
#include <random>
#include <type_traits>
#include <vector>

namespace longseq {

struct CheckResult {
  double max_abs = 0, max_rel = 0, max_lse = 0;
  int rows = 0;
  // --backward: relative L2 errors of the checked rows of dq (the query rows above) and of dk, dv (key rows).
  bool gradients = false;
  double dq_rel = 0, dk_rel = 0, dv_rel = 0;
  int key_rows = 0;
};

/// o's tolerance per compute dtype (relative L2 of a row).
template <class T>
double tolerance() {
  if (std::is_same<T, double>::value) return 1e-12;
  if (std::is_same<T, float>::value) return 1e-5;
  return 1e-2;
}
/// Gradients allow ten times o's tolerance: dk and dv sum over every query, dq over every key, each term
/// carrying the rounding of the recomputed P and of dO·v - D in the compute dtype (measured in float32:
/// about 1e-6 at seq 16384, against o's 2e-6 and a tolerance of 1e-4).
template <class T>
double gradient_tolerance() {
  return 10 * tolerance<T>();
}

// Visible from the definition (bottom-right aligned causal and window over global positions; seq_q = seq_k; no
// key of another document).
inline bool visible(const Config& c, const Shard& s, long i, long j) {
  const auto doc = s.document_of(i);
  if (j < doc.first || j >= doc.second) return false;
  const long left = c.window.empty() ? -1 : c.window[0], right = c.window.empty() ? -1 : c.window[1];
  if (c.causal && j > i) return false;
  if (right >= 0 && j > i + right) return false;
  if (left >= 0 && j < i - left) return false;
  return true;
}
/// The keys query i sees, [lo, hi) of [0, seq) (of its document).
inline std::pair<long, long> keys_of(const Config& c, const Shard& s, long i) {
  const long left = c.window.empty() ? -1 : c.window[0], right = c.window.empty() ? -1 : c.window[1];
  const auto doc = s.document_of(i);
  long lo = left >= 0 ? i - left : 0, hi = c.causal ? i + 1 : s.seq;
  if (right >= 0) hi = std::min(hi, i + right + 1);
  return {std::max(lo, doc.first), std::min(hi, doc.second)};
}

// Adds |got - want|^2 and |want|^2 of one row to num/den (a non-finite value counts as +inf).
inline void accumulate_error(const std::vector<double>& got, const std::vector<double>& want, double& num,
                             double& den) {
  for (size_t e = 0; e < want.size(); ++e) {
    const double err = std::isfinite(got[e]) ? got[e] - want[e] : INFINITY;
    num += err * err, den += want[e] * want[e];
  }
}

// Relative L2 error over all checked rows of all ranks (collective): sqrt(sum num / sum den). One number per
// tensor, not the worst row: a gradient row that is nearly zero by cancellation would make a per-row
// relative error meaningless.
inline double relative_l2(double num, double den, MPI_Comm comm) {
  double v[2] = {num, den};
  MPI_Allreduce(MPI_IN_PLACE, v, 2, MPI_DOUBLE, MPI_SUM, comm);
  if (std::isnan(v[0]) || std::isinf(v[0])) return INFINITY;
  return v[1] > 0 ? std::sqrt(v[0] / v[1]) : std::sqrt(v[0]);
}

// The score of q·k in float64 as the kernels define it (scale, then softcap) and its derivative factor
// d score / d (scale q·k) (1 - tanh^2 with a softcap, else 1).
struct Score {
  double s, g;
};
inline Score score(const Config& c, double scale, const double* q, const double* k, long d) {
  double x = 0;
  for (long e = 0; e < d; ++e) x += q[e] * k[e];
  x *= scale;
  if (c.softcap > 0) {
    const double t = std::tanh(x / c.softcap);
    return {c.softcap * t, 1 - t * t};
  }
  return {x, 1.0};
}

/// Row (b, i, h) of a device tensor, as float64 on the host.
template <class T>
std::vector<double> device_row(const Tensor<T>& x, long b, long i, long h) {
  auto m = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), Kokkos::subview(x, b, i, h, Kokkos::ALL()));
  std::vector<double> r(m.extent(0));
  for (size_t e = 0; e < r.size(); ++e) r[e] = to_double(m(e));
  return r;
}
/// Element (a, b, c) of a device rank-3 View, as float64 on the host.
template <class A>
double device_value(const Kokkos::View<A***, Kokkos::LayoutRight, Mem>& x, long a, long b, long c) {
  auto m = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), Kokkos::subview(x, a, b, std::make_pair(c, c + 1)));
  return static_cast<double>(m(0));
}

/// Row (b, global token gi, head h) of generated tensor `id` with `heads` heads, rounded to T, into out[d]:
/// the values the device generated (the same hash), without communication.
template <class T>
void generated_row(const Config& c, const Shard& s, int id, long heads, long b, long gi, long h, double* out) {
  const std::uint64_t at = static_cast<std::uint64_t>(((b * s.seq + gi) * heads + h) * s.d);
  for (long e = 0; e < s.d; ++e) out[e] = round_to<T>(generated(c.seed, id, at + static_cast<std::uint64_t>(e)));
}

// A travelling shard's segments: {global begin, length} of each in local order, as many on every rank.
struct TravellingSegments {
  std::vector<long> v;
  explicit TravellingSegments(const Shard& s) : v(2 * std::max<size_t>(2, s.segs.size()), 0) {
    for (size_t i = 0; i < s.segs.size(); ++i) v[2 * i] = s.segs[i].global_begin, v[2 * i + 1] = s.segs[i].length;
  }
  // Calls f(local index in the owner's shard, global position) for every token of the owner.
  template <class F>
  void for_each(F&& f) const {
    long lb = 0;
    for (size_t g = 0; g < v.size(); g += 2) {
      for (long j = 0; j < v[g + 1]; ++j) f(lb + j, v[g] + j);
      lb += v[g + 1];
    }
  }
};

// Passes a buffer on to the next rank and receives the previous rank's in its place (P > 1); messages of
// at most 1 GiB (MPI counts are int).
template <class U>
void pass_on(std::vector<U>& buf, MPI_Comm comm) {
  int rank, p;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &p);
  if (p == 1) return;
  const int next = (rank + 1) % p, prev = (rank + p - 1) % p;
  char* bytes = reinterpret_cast<char*>(buf.data());
  const size_t total = buf.size() * sizeof(U), chunk = size_t(1) << 30;
  for (size_t off = 0; off < total; off += chunk)
    MPI_Sendrecv_replace(bytes + off, static_cast<int>(std::min(chunk, total - off)), MPI_BYTE, next, 5, prev, 5, comm,
                         MPI_STATUS_IGNORE);
}
inline void pass_on(TravellingSegments& seg, MPI_Comm comm) {
  pass_on(seg.v, comm);
}

/// A random row (batch, local token, head) of this rank's shard.
struct RandomRow {
  long b, local, h;
};
/// `count` random rows of this rank (none when it holds no token), each drawn from `rng` as batch, local
/// token, then head (of `heads`).
inline std::vector<RandomRow> random_rows(int count, const Shard& s, long heads, std::mt19937_64& rng) {
  std::vector<RandomRow> out;
  for (int i = 0; i < count && s.n > 0; ++i) {
    RandomRow r;
    r.b = static_cast<long>(rng() % s.batch);
    r.local = static_cast<long>(rng() % s.n);
    r.h = static_cast<long>(rng() % heads);
    out.push_back(r);
  }
  return out;
}

/// A host copy of a device tensor in its own dtype, [batch, nmax, heads, d] (rows beyond the rank's n
/// left zero): the shards that travel around the ring for --input (the same size on every rank).
template <class T>
std::vector<T> padded_copy(const Tensor<T>& x, long nmax) {
  using Host = Kokkos::View<T***, Kokkos::LayoutRight, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
  const size_t row = x.extent(2) * x.extent(3);
  std::vector<T> out(x.extent(0) * static_cast<size_t>(nmax) * row, T(0));
  if (x.extent(1) > 0)
    for (size_t b = 0; b < x.extent(0); ++b)
      Kokkos::deep_copy(Host(out.data() + b * nmax * row, x.extent(1), x.extent(2), x.extent(3)),
                        Kokkos::subview(x, b, Kokkos::ALL(), Kokkos::ALL(), Kokkos::ALL()));
  return out;
}
/// d elements of a host buffer in T, as float64.
template <class T>
void row_to_double(const T* src, long d, double* out) {
  for (long e = 0; e < d; ++e) out[e] = to_double(src[e]);
}

/// `--check K`: K random query rows of this rank, in float64 straight from the definition, compared with
/// the computed o and lse rows; with --backward also dq of those rows (accumulated in the same pass:
/// dq_i = scale/l · (Σ_j w_ij dP_ij g_ij k_j − D_i Σ_j w_ij g_ij k_j), with D_i = dO_i·O_i from the exact O_i),
/// and dk, dv of K random key rows of this rank: dv_j = Σ_i P_ij dO_i and dk_j = scale Σ_i P_ij (dO_i·v_j −
/// D_i) g_ij q_i over every query of the sequence (and every query head of the key's group). Those query
/// rows' lse and D come from the run's own lse and o (float64 from there on): exact ones for every row
/// would be the whole forward pass again; the o and lse rows above check them.
///
/// Where the other ranks' keys (and queries) come from: generated inputs are regenerated from the hash (no
/// communication; the query rows' lse and D travel around the ring, 16 bytes a row); inputs read from a file
/// travel around the ring in the compute dtype (K/V, then q and dO with lse and D) and are converted per
/// row. O(K·N·d) work per rank; host memory O(N/P·heads·d) in the compute dtype with --input, O(N/P·heads)
/// for generated inputs. Collective.
template <class T>
CheckResult self_check(const Config& c, const Shard& s, const Tensors<T>& t, MPI_Comm comm) {
  int rank, p;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &p);
  const bool bwd = c.backward;
  const long d = s.d;
  std::mt19937_64 rng(c.seed * 7919 + rank);
  struct Row {
    long b, li, gi, h;
    double m, l;
    std::vector<double> q, dout, acc, a, bsum;
  };
  std::vector<Row> rows;
  for (const RandomRow& x : random_rows(c.check, s, s.heads, rng)) {
    Row r;
    r.b = x.b, r.li = x.local, r.h = x.h;
    r.gi = s.global_of(r.li), r.m = -INFINITY, r.l = 0, r.acc.assign(d, 0.0);
    r.q = device_row(t.q, r.b, r.li, r.h);
    if (bwd) r.a.assign(d, 0.0), r.bsum.assign(d, 0.0), r.dout = device_row(t.d_o, r.b, r.li, r.h);
    rows.push_back(r);
  }
  const double scale = c.scale > 0 ? c.scale : 1.0 / std::sqrt(double(d));
  const long group = s.heads / s.kv_heads;
  const long nmax = max_over(s.n, comm);

  // ---- pass 1: every key and value of the sequence; o, lse (and dq) of the query rows -------------------
  auto visit_key = [&](Row& r, const double* kr, const double* vr) {
    const Score x = score(c, scale, r.q.data(), kr, d);
    const double m = std::max(r.m, x.s), a = std::exp(r.m - m), w = std::exp(x.s - m);
    r.l = r.l * a + w;
    for (long e = 0; e < d; ++e) r.acc[e] = r.acc[e] * a + w * vr[e];
    if (bwd) {
      double dp = 0;
      for (long e = 0; e < d; ++e) dp += r.dout[e] * vr[e];
      for (long e = 0; e < d; ++e) {
        r.a[e] = r.a[e] * a + w * dp * x.g * kr[e];
        r.bsum[e] = r.bsum[e] * a + w * x.g * kr[e];
      }
    }
    r.m = m;
  };
  std::vector<double> kr(d), vr(d);
  if (c.generate) {
    for (auto& r : rows) {
      const auto range = keys_of(c, s, r.gi);
      for (long gj = range.first; gj < range.second; ++gj) {
        generated_row<T>(c, s, 1, s.kv_heads, r.b, gj, r.h / group, kr.data());
        generated_row<T>(c, s, 2, s.kv_heads, r.b, gj, r.h / group, vr.data());
        visit_key(r, kr.data(), vr.data());
      }
    }
  } else {
    std::vector<T> kb = padded_copy(t.k, nmax), vb = padded_copy(t.v, nmax);
    const size_t row = static_cast<size_t>(s.kv_heads * d);
    TravellingSegments seg(s);
    for (int step = 0; step < p; ++step) {
      for (auto& r : rows)
        seg.for_each([&](long lj, long gj) {
          if (!visible(c, s, r.gi, gj)) return;
          const size_t at = (r.b * nmax + lj) * row + (r.h / group) * d;
          row_to_double(&kb[at], d, kr.data()), row_to_double(&vb[at], d, vr.data());
          visit_key(r, kr.data(), vr.data());
        });
      pass_on(kb, comm), pass_on(vb, comm), pass_on(seg, comm);
    }
  }
  CheckResult res;
  double dq_num = 0, dq_den = 0;
  for (const auto& r : rows) {
    double num = 0, den = 0;
    std::vector<double> want(d);
    for (long e = 0; e < d; ++e) want[e] = r.l > 0 ? r.acc[e] / r.l : 0.0;
    const std::vector<double> got = device_row(t.o, r.b, r.li, r.h);
    for (long e = 0; e < d; ++e)
      res.max_abs = std::max(res.max_abs, std::isfinite(got[e]) ? std::abs(got[e] - want[e]) : INFINITY);
    accumulate_error(got, want, num, den);
    res.max_rel = std::max(res.max_rel, std::isnan(num) ? INFINITY : den > 0 ? std::sqrt(num / den) : std::sqrt(num));
    const double want_lse = r.l > 0 ? r.m + std::log(r.l) : -INFINITY;
    const double got_lse = device_value(t.lse, r.b, r.h, r.li);
    const double lerr = (std::isinf(want_lse) && got_lse == want_lse)
                            ? 0.0
                            : std::abs(got_lse - want_lse) / std::max(1.0, std::abs(want_lse));
    res.max_lse = std::max(res.max_lse, std::isnan(lerr) ? INFINITY : lerr);
    if (bwd) {
      double dd = 0;  // D_i = dO_i · O_i, exact O
      for (long e = 0; e < d; ++e) dd += r.dout[e] * want[e];
      std::vector<double> dq(d, 0.0);
      if (r.l > 0)
        for (long e = 0; e < d; ++e) dq[e] = scale / r.l * (r.a[e] - dd * r.bsum[e]);
      accumulate_error(device_row(t.dq, r.b, r.li, r.h), dq, dq_num, dq_den);
    }
  }
  res.rows = static_cast<int>(rows.size());
  res.max_abs = max_over(res.max_abs, comm), res.max_rel = max_over(res.max_rel, comm),
  res.max_lse = max_over(res.max_lse, comm);
  MPI_Allreduce(MPI_IN_PLACE, &res.rows, 1, MPI_INT, MPI_SUM, comm);
  if (!bwd) return res;
  res.gradients = true;
  res.dq_rel = relative_l2(dq_num, dq_den, comm);

  // ---- pass 2: every query of the sequence; dk, dv of the key rows --------------------------------------
  struct KeyRow {
    long b, lj, gj, hk;
    std::vector<double> k, v, dk, dv;
  };
  std::vector<KeyRow> keys;
  for (const RandomRow& x : random_rows(c.check, s, s.kv_heads, rng)) {
    KeyRow r;
    r.b = x.b, r.lj = x.local, r.hk = x.h;
    r.gj = s.global_of(r.lj), r.dk.assign(d, 0.0), r.dv.assign(d, 0.0);
    r.k = device_row(t.k, r.b, r.lj, r.hk), r.v = device_row(t.v, r.b, r.lj, r.hk);
    keys.push_back(r);
  }
  // Per (batch, token, head) of the travelling shard: lse and D = dO·o (the run's own o and lse).
  std::vector<double> ld(static_cast<size_t>(s.batch * nmax * s.heads) * 2, 0.0);
  {
    auto lse = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), t.lse);
    auto dd = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), row_dots(t.d_o, t.o));
    for (long b = 0; b < s.batch; ++b)
      for (long li = 0; li < s.n; ++li)
        for (long h = 0; h < s.heads; ++h) {
          double* dst = &ld[((b * nmax + li) * s.heads + h) * 2];
          dst[0] = static_cast<double>(lse(b, h, li)), dst[1] = dd(b, li, h);
        }
  }
  auto visit_query = [&](KeyRow& r, const double* qr, const double* dor, double l, double dd) {
    const Score sc = score(c, scale, qr, r.k.data(), d);
    const double pr = std::exp(sc.s - l);
    double dp = 0;
    for (long e = 0; e < d; ++e) dp += dor[e] * r.v[e];
    const double ds = pr * (dp - dd) * sc.g * scale;
    for (long e = 0; e < d; ++e) r.dv[e] += pr * dor[e], r.dk[e] += ds * qr[e];
  };
  std::vector<double> qr(d), dor(d);
  std::vector<T> qb, db;  // --input: q and dO travel too
  if (!c.generate) qb = padded_copy(t.q, nmax), db = padded_copy(t.d_o, nmax);
  const size_t qrow = static_cast<size_t>(s.heads * d);
  TravellingSegments seg(s);
  for (int step = 0; step < p; ++step) {
    for (auto& r : keys)
      seg.for_each([&](long li, long gi) {
        if (!visible(c, s, gi, r.gj)) return;
        for (long h = r.hk * group; h < (r.hk + 1) * group; ++h) {
          if (c.generate) {
            generated_row<T>(c, s, 0, s.heads, r.b, gi, h, qr.data());
            generated_row<T>(c, s, 3, s.heads, r.b, gi, h, dor.data());
          } else {
            const size_t at = (r.b * nmax + li) * qrow + h * d;
            row_to_double(&qb[at], d, qr.data()), row_to_double(&db[at], d, dor.data());
          }
          const double* x = &ld[((r.b * nmax + li) * s.heads + h) * 2];
          visit_query(r, qr.data(), dor.data(), x[0], x[1]);
        }
      });
    pass_on(ld, comm), pass_on(seg, comm);
    if (!c.generate) pass_on(qb, comm), pass_on(db, comm);
  }
  double dk_num = 0, dk_den = 0, dv_num = 0, dv_den = 0;
  for (const auto& r : keys) {
    accumulate_error(device_row(t.dk, r.b, r.lj, r.hk), r.dk, dk_num, dk_den);
    accumulate_error(device_row(t.dv, r.b, r.lj, r.hk), r.dv, dv_num, dv_den);
  }
  res.dk_rel = relative_l2(dk_num, dk_den, comm), res.dv_rel = relative_l2(dv_num, dv_den, comm);
  res.key_rows = static_cast<int>(keys.size());
  MPI_Allreduce(MPI_IN_PLACE, &res.key_rows, 1, MPI_INT, MPI_SUM, comm);
  return res;
}

}  // namespace longseq
