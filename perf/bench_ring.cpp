// Ring attention benchmark (run under mpirun): per-step compute and wait times, the communication hidden
// fraction, and end-to-end GFLOP/s, for weak scaling (--tokens-per-rank) or strong scaling (--seq).
//
//   mpirun -n P kfa_bench_ring [--tokens-per-rank n | --seq N] [--heads H] [--kv-heads G] [--head-dim d]
//                              [--layout contiguous|zigzag] [--causal] [--backward] [--reps R] [--steps]
//                              [--dtype float32|float16|bfloat16|float64] [--max-message-bytes B]
//                              [--transport auto|nccl|gpu-aware-mpi|staging] [--no-buffer-cache] [--strategies]
//
// Also times attention_forward (+ attention_backward) of one rank's shard as one local call in the same
// run ("single"): at P = 1 the ring should match it.
// Hidden fraction = 1 − Σ wait / Σ exchange alone, over the steps that send something, where "exchange
// alone" is the time of an exchange of that step's bytes with no compute (measured here; with --backward the
// K/V and the dK/dV accumulators, and at the last step the accumulators going home), wait is the time blocked
// on transfers outside the step's compute and "imbalance" the end-of-step agreement
// (waiting for the slowest rank). With host staging on a device the host drives MPI inside the step (the
// kernels run meanwhile), so a transfer longer than the compute shows up as compute, not wait: there
// "hidden" overstates; compare the step times with the single call instead. Times
// are the maximum over ranks. GFLOP/s counts the whole sequence's attention (4·H·N²·d, halved for
// causal; ×3.5 with --backward for forward+backward) over the slowest rank's time.
#include <Kokkos_Random.hpp>
#include <kfa/distributed/dist.hpp>

#include "bench_common.hpp"

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

using Exec = Kokkos::DefaultExecutionSpace;
using Mem = Exec::memory_space;

namespace {
double max_over_ranks(double x, MPI_Comm c) {
  MPI_Allreduce(MPI_IN_PLACE, &x, 1, MPI_DOUBLE, MPI_MAX, c);
  return x;
}
}  // namespace

struct Args {
  long per_rank, seq;
  int heads, kv_heads, d, reps;
  bool causal, backward, steps;
  kfa::dist::Layout layout;
  std::size_t max_msg;
  kfa::dist::RingTransport transport;
  bool no_cache;
  bool strategies;
};

// --strategies: the ring and every Ulysses degree U that divides P and the heads (U = P: Ulysses alone; between:
// the hybrid) on the same shards, interleaved round by round (reps rounds after a warm-up one), the best round of
// each: seconds, GFLOP/s per rank, ratio to the ring, and the all-to-alls' share.
template <class T, class V4, class L3>
void compare_strategies(const Args& args, int rank, int p, const V4& q, const V4& k, const V4& v, const V4& o,
                        const V4& d_o, const L3& lse, const V4& dq, const V4& dk, const V4& dv,
                        const kfa::AttentionOptions& opts, double flops) {
  std::vector<int> degrees;
  for (int u = 1; u <= p; ++u)
    if (p % u == 0 && args.heads % u == 0) degrees.push_back(u);
  std::vector<std::unique_ptr<kfa::dist::Ulysses>> groups;
  for (int u : degrees) {
    groups.emplace_back(new kfa::dist::Ulysses(MPI_COMM_WORLD, u, args.layout));
    if (args.max_msg) groups.back()->set_max_message_bytes(args.max_msg);
    if (args.transport != kfa::dist::RingTransport::automatic) groups.back()->set_transport(args.transport);
  }
  kfa::dist::Ring ring(MPI_COMM_WORLD, args.layout);
  if (args.max_msg) ring.set_max_message_bytes(args.max_msg);
  if (args.transport != kfa::dist::RingTransport::automatic) ring.set_transport(args.transport);
  std::vector<double> best(degrees.size() + 1, 1e300), a2a(degrees.size() + 1, 0);
  for (int r = 0; r < args.reps + 1; ++r)
    for (std::size_t x = 0; x <= degrees.size(); ++x) {  // x = 0: the ring; then each degree
      kfa::dist::UlyssesStats fs, bs;
      MPI_Barrier(MPI_COMM_WORLD);
      const double t0 = MPI_Wtime();
      if (x == 0) {
        kfa::dist::ring_attention_forward(Exec(), ring, q, k, v, o, lse, opts);
        if (args.backward) kfa::dist::ring_attention_backward(Exec(), ring, q, k, v, o, d_o, lse, dq, dk, dv, opts);
      } else {
        kfa::dist::ulysses_attention_forward(Exec(), *groups[x - 1], q, k, v, o, lse, opts, &fs);
        if (args.backward)
          kfa::dist::ulysses_attention_backward(Exec(), *groups[x - 1], q, k, v, o, d_o, lse, dq, dk, dv, opts, &bs);
      }
      const double t = max_over_ranks(MPI_Wtime() - t0, MPI_COMM_WORLD);
      const double comm =
          max_over_ranks(fs.to_heads_s + fs.to_sequence_s + bs.to_heads_s + bs.to_sequence_s, MPI_COMM_WORLD);
      if (r > 0 && t < best[x]) best[x] = t, a2a[x] = comm;
    }
  if (rank != 0) return;
  for (std::size_t x = 0; x <= degrees.size(); ++x) {
    const int u = x == 0 ? 1 : degrees[x - 1];
    const std::string name = x == 0 ? "ring" : u == 1 ? "ulysses U=1 (its ring)" : u == p ? "ulysses" : "hybrid";
    std::printf(
        "kfa_bench_ring strategy %-22s U=%d R=%d: time %.4f s, %.1f GFLOP/s per rank, %.3fx the ring, "
        "all-to-all %.4f s (%.1f%%)\n",
        name.c_str(), u, p / u, best[x], flops / best[x] * 1e-9 / p, best[0] / best[x], a2a[x],
        100.0 * a2a[x] / best[x]);
  }
}

template <class T>
void run(const Args& args, int rank, int p) {
  const long per_rank = args.per_rank, seq = args.seq;
  const int heads = args.heads, kv_heads = args.kv_heads, d = args.d, reps = args.reps;
  const bool causal = args.causal, backward = args.backward, steps = args.steps;
  const kfa::dist::Layout layout = args.layout;
  const std::size_t max_msg = args.max_msg;
  const long n_total = seq > 0 ? seq : per_rank * p;
  {
    kfa::dist::Ring ring(MPI_COMM_WORLD, layout);
    if (max_msg) ring.set_max_message_bytes(max_msg);
    if (args.transport != kfa::dist::RingTransport::automatic) ring.set_transport(args.transport);
    if (args.no_cache) ring.set_cache_buffers(false);
    long n = 0;
    for (const auto& s : kfa::dist::shard_of(layout, n_total, p, rank)) n += s.length;
    using V4 = Kokkos::View<T****, Kokkos::LayoutRight, Mem>;  // the tensor-core kernels need unit head-dim stride
    V4 q("bench::q", 1, n, heads, d), k("bench::k", 1, n, kv_heads, d), v("bench::v", 1, n, kv_heads, d),
        o("bench::o", 1, n, heads, d), d_o("bench::do", 1, n, heads, d), dq("bench::dq", 1, n, heads, d),
        dk("bench::dk", 1, n, kv_heads, d), dv("bench::dv", 1, n, kv_heads, d);
    Kokkos::View<kfa::accumulator_t<T>***, Kokkos::LayoutRight, Mem> lse("bench::lse", 1, heads, n);
    Kokkos::Random_XorShift64_Pool<Exec> pool(1234 + rank);
    for (const V4* x : {&q, &k, &v, &d_o}) {
      Kokkos::View<float****, Kokkos::LayoutRight, Mem> tmp("bench::tmp", x->extent(0), x->extent(1), x->extent(2),
                                                            x->extent(3));
      Kokkos::fill_random(tmp, pool, -1.0f, 1.0f);
      const V4 dst = *x;
      Kokkos::parallel_for(
          "bench::convert", Kokkos::RangePolicy<Exec>(0, tmp.size()),
          KOKKOS_LAMBDA(const long i) { dst.data()[i] = static_cast<T>(tmp.data()[i]); });
    }
    kfa::AttentionOptions opts;
    opts.causal = causal;
    if (args.strategies) {
      const double all = 4.0 * heads * double(n_total) * n_total * d * (causal ? 0.5 : 1.0) * (backward ? 3.5 : 1.0);
      compare_strategies<T>(args, rank, p, q, k, v, o, d_o, lse, dq, dk, dv, opts, all);
      return;
    }

    kfa::dist::RingStats best;
    double best_t = 1e300;
    for (int r = 0; r < reps + 1; ++r) {  // the first call warms up
      kfa::dist::RingStats st;
      MPI_Barrier(MPI_COMM_WORLD);
      const double t0 = MPI_Wtime();
      kfa::dist::ring_attention_forward(Exec(), ring, q, k, v, o, lse, opts, backward ? nullptr : &st);
      if (backward) kfa::dist::ring_attention_backward(Exec(), ring, q, k, v, o, d_o, lse, dq, dk, dv, opts, &st);
      const double t = max_over_ranks(MPI_Wtime() - t0, MPI_COMM_WORLD);
      if (r > 0 && t < best_t) best_t = t, best = st;
    }
    const double flops = 4.0 * heads * double(n_total) * n_total * d * (causal ? 0.5 : 1.0) * (backward ? 3.5 : 1.0);
    double compute = 0, wait = 0, sync = 0, t_comm = 0, wait_sending = 0;
    std::vector<double> sc(p), sw(p), ss(p), sx(p);
    for (int s = 0; s < p; ++s) {
      sc[s] = max_over_ranks(best.steps[s].compute_s + best.steps[s].merge_s, MPI_COMM_WORLD);
      sw[s] = max_over_ranks(best.steps[s].wait_s, MPI_COMM_WORLD);
      ss[s] = max_over_ranks(best.steps[s].sync_s, MPI_COMM_WORLD);
      compute += sc[s], wait += sw[s], sync += ss[s];
      // The same bytes exchanged with nothing to hide them (median of reps): the hidden fraction's denominator.
      unsigned long bytes = best.steps[s].bytes;
      MPI_Allreduce(MPI_IN_PLACE, &bytes, 1, MPI_UNSIGNED_LONG, MPI_MAX, MPI_COMM_WORLD);
      if (p > 1 && bytes > 0) {
        std::vector<double> ts;
        for (int r = 0; r < reps + 1; ++r)
          ts.push_back(kfa::dist::time_ring_exchange<T>(Exec(), ring, bytes / sizeof(T)));
        std::sort(ts.begin() + 1, ts.end());
        sx[s] = ts[1 + reps / 2];
        t_comm += sx[s], wait_sending += sw[s];
      }
    }
    const double hidden = t_comm > 0 ? std::min(1.0, std::max(0.0, 1.0 - wait_sending / t_comm)) : 1.0;
    // The same rank's shard as one local call (no ring): the kernel's own speed on this much work.
    double best_single = 1e300;
    for (int r = 0; r < reps + 1; ++r) {
      Exec().fence();
      MPI_Barrier(MPI_COMM_WORLD);
      const double t0 = MPI_Wtime();
      kfa::attention_forward(Exec(), q, k, v, o, lse, opts);
      if (backward) kfa::attention_backward(Exec(), q, k, v, o, d_o, lse, dq, dk, dv, opts);
      Exec().fence();
      const double t = max_over_ranks(MPI_Wtime() - t0, MPI_COMM_WORLD);
      if (r > 0) best_single = std::min(best_single, t);
    }
    const double single_flops = 4.0 * heads * double(n) * n * d * (causal ? 0.5 : 1.0) * (backward ? 3.5 : 1.0);
    if (rank == 0) {
      std::printf(
          "kfa_bench_ring %s transport: %s; buffers %s; single (one local call on one shard, %ld tokens): %.4f s, %.1f "
          "GFLOP/s\n",
          kfa::dtype_name<T>().c_str(), best.transport.c_str(),
          ring.cache_buffers() ? "kept between calls" : "allocated per call", n, best_single,
          single_flops / best_single * 1e-9);
      std::printf(
          "kfa_bench_ring P=%d N=%ld tokens/rank=%ld heads=%d/%d d=%d layout=%s causal=%d %s: time %.4f s, "
          "%.1f GFLOP/s, %.1f GFLOP/s per rank, compute %.4f s, wait %.4f s, imbalance %.4f s, exchange alone "
          "%.4f s, hidden %.2f\n",
          p, n_total, n_total / p, heads, kv_heads, d, kfa::dist::to_string(layout).c_str(), causal ? 1 : 0,
          backward ? "fwd+bwd" : "fwd", best_t, flops / best_t * 1e-9, flops / best_t * 1e-9 / p, compute, wait, sync,
          t_comm, hidden);
      if (steps)
        for (int s = 0; s < p; ++s)
          std::printf(
              "  step %d: compute %.4f s, wait %.4f s, imbalance %.4f s, %zu bytes sent by rank 0 (alone "
              "%.4f s), %d blocks\n",
              s, sc[s], sw[s], ss[s], best.steps[s].bytes, sx[s], best.steps[s].blocks);
    }
  }
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank, p;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &p);
  long per_rank = 2048, seq = 0;
  int heads = 4, kv_heads = 0, d = 64, reps = 3;
  bool causal = false, backward = false, steps = false, no_cache = false, strategies = false;
  std::string dtype = "float32", layout_name = "contiguous";
  std::size_t max_msg = 0;
  std::string transport = "auto";
  CLI::App app("Ring attention benchmark (run under mpirun)", "kfa_bench_ring");
  app.add_option("--tokens-per-rank", per_rank, "weak scaling: tokens per rank")
      ->check(kfa_bench::positive_int(1LL << 40));
  app.add_option("--seq", seq, "strong scaling: the whole sequence (overrides --tokens-per-rank)")
      ->check(kfa_bench::positive_int(1LL << 40));
  app.add_option("--heads", heads, "query heads")->check(kfa_bench::positive_int());
  app.add_option("--kv-heads", kv_heads, "key/value heads (default: --heads)")->check(kfa_bench::positive_int());
  app.add_option("--head-dim", d, "head dimension")->check(kfa_bench::positive_int());
  app.add_option("--reps", reps, "timed repetitions (after one warm-up)")->check(kfa_bench::positive_int());
  app.add_option("--layout", layout_name, "contiguous or zigzag")->check(CLI::IsMember({"contiguous", "zigzag"}));
  app.add_option("--dtype", dtype, "float32, float64, float16 or bfloat16")
      ->check(CLI::IsMember({"float32", "float64", "float16", "bfloat16"}));
  app.add_option("--max-message-bytes", max_msg, "split ring messages into chunks of at most this many bytes")
      ->check(kfa_bench::positive_int(2147483647LL));
  app.add_option("--transport", transport,
                 "how device buffers travel (auto: NCCL if built, else GPU-aware MPI if "
                 "reported, else pinned host staging)")
      ->check(CLI::IsMember({"auto", "nccl", "gpu-aware-mpi", "staging"}));
  app.add_flag("--causal", causal, "causal mask");
  app.add_flag("--backward", backward, "forward + backward");
  app.add_flag("--steps", steps, "per-step table");
  app.add_flag("--strategies", strategies,
               "compare the ring with Ulysses and the hybrids (every degree dividing P and --heads), interleaved");
  app.add_flag("--no-buffer-cache", no_cache,
               "allocate the ring's work buffers in every call (Ring::set_cache_buffers(false))");
  // Every rank parses the same command line and reaches the same verdict; rank 0 alone prints it.
  const int st = kfa_bench::parse_command_line(app, argc, argv, rank != 0);
  if (st >= 0) {
    MPI_Finalize();
    return st;
  }
  if (kv_heads == 0) kv_heads = heads;
  if (kv_heads > heads || heads % kv_heads != 0) {
    if (rank == 0) std::fprintf(stderr, "kfa_bench_ring: --kv-heads %d must divide --heads %d\n", kv_heads, heads);
    MPI_Finalize();
    return 2;
  }
  const kfa::dist::Layout layout = layout_name == "zigzag" ? kfa::dist::Layout::zigzag : kfa::dist::Layout::contiguous;
  {
    Kokkos::ScopeGuard guard(argc, argv);
    using RT = kfa::dist::RingTransport;
    const RT tr = transport == "nccl"            ? RT::nccl
                  : transport == "gpu-aware-mpi" ? RT::gpu_aware_mpi
                  : transport == "staging"       ? RT::host_staging
                                                 : RT::automatic;
    Args a{per_rank, seq, heads, kv_heads, d, reps, causal, backward, steps, layout, max_msg, tr, no_cache, strategies};
    if (dtype == "float32")
      run<float>(a, rank, p);
    else if (dtype == "float64")
      run<double>(a, rank, p);
#if KFA_HAS_HALF
    else if (dtype == "float16")
      run<kfa::compat::half_t>(a, rank, p);
#endif
#if KFA_HAS_BHALF
    else if (dtype == "bfloat16")
      run<kfa::compat::bhalf_t>(a, rank, p);
#endif
    else if (rank == 0)
      std::fprintf(stderr, "kfa_bench_ring: --dtype %s is not available in this build\n", dtype.c_str());
  }
  MPI_Finalize();
  return 0;
}
