#pragma once
// kfa-longseq: what a person sees while the run goes on and after it: progress on stderr, the split of the
// ring steps' time, non-finite counts, and the formatting the report uses.
#include "common.hpp"
#include "json.hpp"

#include <unistd.h>
#include <kfa/nonfinite.hpp>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

namespace longseq {

// Seconds for the report: 3 decimals, or 3 significant digits below 0.1 s.
inline std::string secs(double x) {
  char b[32];
  std::snprintf(b, sizeof b, x >= 0.1 || x == 0 ? "%.3f s" : "%.3g s", x);
  return b;
}

// "Open MPI v4.1.4" (the first part of MPI_Get_library_version), and the MPI standard version.
inline std::string mpi_runtime_version() {
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

// A person watching the run sees this (rank 0, stderr): on a terminal (or with --progress) a bar redrawn
// after every ring step; otherwise a line after a ring step when at least --progress-interval seconds
// (10) passed since the last one, so a long run says it is alive without flooding a log. (Open MPI's mpirun
// gives ranks a pipe for stderr even on a terminal: there the lines, unless --progress.) Elapsed time and an
// ETA of the whole computation: the backward pass counts 2.5 forward passes (its FLOP ratio). --quiet: none.
class Progress {
 public:
  Progress(const Config& c, int rank, int ranks)
      : m_on(rank == 0 && !c.quiet),
        m_bar(c.progress || isatty(2)),
        m_interval(c.progress_interval),
        m_ranks(ranks),
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
    if (sec < 120)
      std::snprintf(b, sizeof b, "%.1f s", sec);
    else if (sec < 7200)
      std::snprintf(b, sizeof b, "%dm%02ds", int(sec) / 60, int(sec) % 60);
    else
      std::snprintf(b, sizeof b, "%dh%02dm", int(sec) / 3600, int(sec) / 60 % 60);
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
// agreement for every other rank). Every step ends together (that agreement), so its wall time T is the
// longest c + w (the rank that started it first), and splits into
//   compute              mean c           (the work, as the average rank did it)
//   load imbalance       max c - mean c   (the average rank waiting for the slowest rank's compute)
//   not hidden           T - max c        (after the slowest compute: communication it did not cover)
// which add up to T exactly (a mean of c + w would not: ranks enter the first step at different times);
// "hidden" compares the last with the transfer time measured alone (the bytes each step sent at the rate of
// one bare exchange, time_ring_exchange). Collective.
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
inline StepSplit split_steps(std::initializer_list<const kfa::dist::RingStats*> stats, double t_exchange,
                             double exchange_bytes, MPI_Comm comm) {
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
    double cmax = 0, csum = 0, tmax = 0, bmax = 0;
    for (int q = 0; q < p; ++q) {
      const double* x = &all[static_cast<size_t>(q) * n + i];
      cmax = std::max(cmax, x[0]), csum += x[0], tmax = std::max(tmax, x[0] + x[1]), bmax = std::max(bmax, x[2]);
    }
    r.steps_s += tmax, r.compute_s += csum / p, r.imbalance_s += cmax - csum / p, r.exposed_s += tmax - cmax;
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
  Json json() const {  // {"o": 3, "lse": 1}
    Json j;
    for (const auto& x : n) j.add(x.first, x.second);
    return j;
  }
};

template <class V>
void count_into(NonFiniteCounts& out, const char* name, const V& x) {
  out.n.emplace_back(name, static_cast<unsigned long long>(kfa::count_nonfinite(Kokkos::DefaultExecutionSpace(), x)));
}

inline void allreduce(NonFiniteCounts& c, MPI_Comm comm) {
  std::vector<unsigned long long> v;
  for (const auto& x : c.n) v.push_back(x.second);
  MPI_Allreduce(MPI_IN_PLACE, v.data(), static_cast<int>(v.size()), MPI_UNSIGNED_LONG_LONG, MPI_SUM, comm);
  for (size_t i = 0; i < v.size(); ++i) c.n[i].second = v[i];
}

}  // namespace longseq
