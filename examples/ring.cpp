// Ring attention example: one causal sequence sharded over the MPI ranks in the zigzag layout, forward
// and backward, each rank checking a few of its rows against float64 computed from the whole sequence.
// --ulysses U runs the same shards with Ulysses (U = P) or the hybrid (all-to-all inside groups of U ranks).
//
//   mpirun -n P kfa_example_ring [--seq N] [--heads H] [--head-dim D] [--ulysses U]
#include <Kokkos_Random.hpp>
#include <kfa/distributed/dist.hpp>

#include "cli.hpp"
#include "sizes.hpp"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);  // MPI first, Kokkos inside, and the reverse at the end
  int rank, nranks, status = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &nranks);
  long seq = 4096;
  int heads = 4, d = 64, ulysses = 0;
  {  // Every rank parses the same command line and so ends the same way; rank 0 speaks.
    const long long big = 1LL << 30;
    using kfa_cli::integer;
    const std::string positive = "a positive integer (at most " + std::to_string(big) + ")";
    CLI::App app{
        "kfa ring attention example: one causal sequence sharded over the MPI ranks (zigzag), forward and "
        "backward, checked against float64 (Kokkos' options --kokkos-*: --kokkos-help)",
        "kfa_example_ring"};
    app.add_option("--seq", seq, "sequence length, at least 2 x ranks")
        ->check(integer(1, big, positive))
        ->capture_default_str();
    app.add_option("--heads", heads, "heads")->check(integer(1, big, positive))->capture_default_str();
    app.add_option("--head-dim", d, "head dim")
        ->check(integer(1, 1024, "a positive integer (at most 1024)"))
        ->capture_default_str();
    app.add_option("--ulysses", ulysses,
                   "0: the ring; U: all-to-all inside groups of U ranks, the ring across them (U divides the ranks "
                   "and --heads; U = ranks: Ulysses alone)")
        ->check(integer(0, big, "a non-negative integer"))
        ->capture_default_str();
    int exit_now = kfa_cli::parse_command_line(app, argc, argv, rank != 0);
    if (exit_now < 0 && seq < 2L * nranks) {
      if (rank == 0)
        std::fprintf(stderr,
                     "kfa_example_ring: --seq %ld is shorter than 2 x %d ranks (the zigzag layout gives every "
                     "rank two chunks)\n",
                     seq, nranks);
      exit_now = 2;
    }
    if (exit_now >= 0) {
      MPI_Finalize();
      return exit_now;
    }
  }
  const bool kokkos_help = kfa_cli::asks_kokkos_help(argc, argv);
  if (kokkos_help) {  // Kokkos prints its options (on rank 0 only); nothing runs
    std::vector<char*> args(argv, argv + argc);
    if (rank != 0)
      args.erase(std::remove_if(args.begin(), args.end(), [](char* a) { return std::strcmp(a, "--kokkos-help") == 0; }),
                 args.end());
    int nargs = static_cast<int>(args.size());
    Kokkos::ScopeGuard guard(nargs, args.data());
  } else {
    Kokkos::ScopeGuard guard(argc, argv);
    using Exec = Kokkos::DefaultExecutionSpace;
    using V4 = Kokkos::View<float****, Exec::memory_space>;
    try {
      // Sizes this rank cannot fill (Views of 2^31 elements or more, more memory than the node has) are
      // refused alike on every rank (kfa::dist::agree), before anything is allocated.
      {
        long n = 0;
        for (const auto& s : kfa::dist::shard_of(kfa::dist::Layout::zigzag, seq, nranks, rank)) n += s.length;
        MPI_Comm node;
        int on_node = 1;
        MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
        MPI_Comm_size(node, &on_node);
        MPI_Comm_free(&node);
        std::vector<kfa_sizes::Tensor> tensors;
        for (const char* x : {"q", "k", "v", "do"})
          tensors.push_back({x, {1, seq, heads, d}, sizeof(float), *x != 'd'});
        for (const char* x : {"q_shard", "k_shard", "v_shard", "do_shard", "o", "dq", "dk", "dv"})
          tensors.push_back({x, {1, n, heads, d}, sizeof(float), std::string(x) == "o"});
        tensors.push_back({"lse", {1, heads, n}, sizeof(float), false});
        kfa::dist::agree(
            MPI_COMM_WORLD,
            kfa_sizes::problem("kfa_example_ring",
                               "--seq " + std::to_string(seq) + " --heads " + std::to_string(heads) + " --head-dim " +
                                   std::to_string(d) + " on " + std::to_string(nranks) + " ranks",
                               tensors, "use a shorter --seq, fewer --heads or a smaller --head-dim", on_node));
      }
      // Every rank builds the same global tensors (same seed), then keeps its zigzag shard: with 2P chunks,
      // rank r holds chunks r and 2P-1-r, which balances the causal work.
      V4 q("q", 1, seq, heads, d), k("k", 1, seq, heads, d), v("v", 1, seq, heads, d), g("do", 1, seq, heads, d);
      Kokkos::Random_XorShift64_Pool<Exec> pool(2024);
      for (auto* x : {&q, &k, &v, &g}) Kokkos::fill_random(*x, pool, -1.0f, 1.0f);
      const auto segs = kfa::dist::shard_of(kfa::dist::Layout::zigzag, seq, nranks, rank);
      long n = 0;
      for (const auto& s : segs) n += s.length;
      V4 ql("q_shard", 1, n, heads, d), kl("k_shard", 1, n, heads, d), vl("v_shard", 1, n, heads, d),
          gl("do_shard", 1, n, heads, d), o("o", 1, n, heads, d), dq("dq", 1, n, heads, d), dk("dk", 1, n, heads, d),
          dv("dv", 1, n, heads, d);
      for (const auto& s : segs)
        for (auto pr :
             {std::make_pair(&ql, &q), std::make_pair(&kl, &k), std::make_pair(&vl, &v), std::make_pair(&gl, &g)})
          Kokkos::deep_copy(
              Kokkos::subview(*pr.first, Kokkos::ALL, std::make_pair(s.local_begin, s.local_begin + s.length),
                              Kokkos::ALL, Kokkos::ALL),
              Kokkos::subview(*pr.second, Kokkos::ALL, std::make_pair(s.global_begin, s.global_begin + s.length),
                              Kokkos::ALL, Kokkos::ALL));
      Kokkos::View<float***, Exec::memory_space> lse("lse", 1, heads, n);

      kfa::AttentionOptions opts;
      opts.causal = true;
      double t0 = 0, t1 = 0, t2 = 0;
      if (ulysses == 0) {
        kfa::dist::Ring ring(MPI_COMM_WORLD, kfa::dist::Layout::zigzag);  // duplicates the communicator
        t0 = MPI_Wtime();
        kfa::dist::ring_attention_forward(Exec(), ring, ql, kl, vl, o, lse, opts);
        t1 = MPI_Wtime();
        kfa::dist::ring_attention_backward(Exec(), ring, ql, kl, vl, o, gl, lse, dq, dk, dv, opts);
        t2 = MPI_Wtime();
      } else {  // the same shards in and out; the heads travel instead of the keys
        kfa::dist::Ulysses u(MPI_COMM_WORLD, ulysses, kfa::dist::Layout::zigzag);
        t0 = MPI_Wtime();
        kfa::dist::ulysses_attention_forward(Exec(), u, ql, kl, vl, o, lse, opts);
        t1 = MPI_Wtime();
        kfa::dist::ulysses_attention_backward(Exec(), u, ql, kl, vl, o, gl, lse, dq, dk, dv, opts);
        t2 = MPI_Wtime();
      }

      // Check 4 local rows of o against float64 over the whole sequence (causal: keys 0..i).
      auto qh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), q);
      auto kh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), k);
      auto vh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
      auto oh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), o);
      double worst = 0;
      for (int t = 0; t < 4; ++t) {
        const auto& s = segs[t % segs.size()];
        if (s.length == 0) continue;
        const long li = s.local_begin + (t * 7919L) % s.length, gi = s.global_begin + (li - s.local_begin);
        const int h = t % heads;
        std::vector<double> sc(gi + 1), ref(d, 0.0);
        double mx = -1e300, sum = 0, num = 0, den = 0;
        for (long j = 0; j <= gi; ++j) {
          double acc = 0;
          for (int c = 0; c < d; ++c) acc += double(qh(0, gi, h, c)) * kh(0, j, h, c);
          mx = std::max(mx, sc[j] = acc / std::sqrt(double(d)));
        }
        for (long j = 0; j <= gi; ++j) {
          const double p = std::exp(sc[j] - mx);
          sum += p;
          for (int c = 0; c < d; ++c) ref[c] += p * vh(0, j, h, c);
        }
        for (int c = 0; c < d; ++c) {
          const double e = oh(0, li, h, c) - ref[c] / sum;
          num += e * e, den += ref[c] * ref[c] / (sum * sum);
        }
        worst = std::max(worst, std::sqrt(num / den));
      }
      MPI_Allreduce(MPI_IN_PLACE, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      const bool ok = worst <= 1e-5;
      if (rank == 0)
        std::printf(
            "kfa %s attention: %d ranks, zigzag, causal, seq %ld, heads %d, d %d: forward %.3f s, backward "
            "%.3f s; max relative row error vs float64 %.2e: %s\n",
            ulysses == 0        ? "ring"
            : ulysses == nranks ? "Ulysses"
                                : "hybrid",
            nranks, seq, heads, d, t1 - t0, t2 - t1, worst, ok ? "PASS" : "FAIL");
      status = ok ? 0 : 1;
    } catch (const kfa::Error& e) {
      if (rank == 0) std::fprintf(stderr, "%s\n", e.what());
      status = 2;
    } catch (const std::exception& e) {  // an allocation beyond the memory there is, say: perhaps on this rank only
      std::fprintf(stderr, "kfa_example_ring: rank %d: %s\n", rank, e.what());
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
  }
  MPI_Finalize();
  return status;
}
