// Ring attention on P ranks against the tests' float64 attention over the whole sequence, which every
// rank computes from the same global tensors (seed broadcast from rank 0, fresh every run).
#include <kfa/distributed/dist.hpp>

#include <cstdlib>

#include "../common/kfa_test.hpp"
#include "shards.hpp"

using namespace kfa_test;
using kfa::dist::Layout;

namespace {

struct Case {
  Layout layout;
  RefOptions ro;
  Shape s;                            // seq_q = seq_k = total length
  std::vector<long> explicit_len;     // contiguous only: per-rank lengths (empty: even cut)
  std::size_t max_message_bytes = 0;  // 0: the Ring's default
  bool deterministic = true;          // AttentionOptions::deterministic (false: atomic dQ where it exists)
};

std::vector<kfa::dist::Segment> segments_for(const Case& c, long n, int p, int r) {
  if (c.layout == Layout::contiguous && !c.explicit_len.empty()) {
    long b = 0;
    for (int x = 0; x < r; ++x) b += c.explicit_len[x];
    return {{b, c.explicit_len[r], 0}};
  }
  return kfa::dist::shard_of(c.layout, n, p, r);
}

template <class T>
void check_ring(const Case& c, bool backward, kfa::dist::Ring* shared_ring = nullptr) {
  const int p = world_size(), r = world_rank();
  const std::uint64_t seed = shared_seed();
  const Shape& s = c.s;
  SCOPED_TRACE(describe(s, c.ro, seed) + " layout " + kfa::dist::to_string(c.layout) + " P " + std::to_string(p));
  std::mt19937_64 rng(seed);
  Tensor<T> q("q", s.batch, s.seq_q, s.heads_q, s.head_dim), k("k", s.batch, s.seq_k, s.heads_kv, s.head_dim),
      v("v", s.batch, s.seq_k, s.heads_kv, s.head_dim), d_o("do", s.batch, s.seq_q, s.heads_q, s.head_dim);
  const auto qh = fill_random(q, rng), kh = fill_random(k, rng), vh = fill_random(v, rng), doh = fill_random(d_o, rng);
  const auto segs = segments_for(c, s.seq_q, p, r);
  auto ql = shard(q, segs), kl = shard(k, segs), vl = shard(v, segs), dol = shard(d_o, segs);
  const long n = ql.extent(1);
  Tensor<T> o("o", s.batch, n, s.heads_q, s.head_dim);
  Lse<T> lse("lse", s.batch, s.heads_q, n);
  poison(o), poison(lse);
  kfa::dist::Ring own(MPI_COMM_WORLD, c.layout);
  kfa::dist::Ring& ring = shared_ring ? *shared_ring : own;
  if (c.max_message_bytes) ring.set_max_message_bytes(c.max_message_bytes);
  kfa::AttentionOptions opts = to_kfa(c.ro);
  opts.deterministic = c.deterministic;
  kfa::dist::RingStats fst;
  kfa::dist::ring_attention_forward(Exec(), ring, ql, kl, vl, o, lse, opts, &fst);
  std::size_t sent = 0;
  for (const auto& st : fst.steps) sent += st.bytes;
  if (p == 1) EXPECT_EQ(sent, 0u) << "P = 1 must send nothing";
  if (p > 1 && c.max_message_bytes) {
    // every K/V message was split: at least 3 chunks each
    const std::size_t kv_bytes = 2 * std::size_t(s.batch) * ql.extent(1) * s.heads_kv * s.head_dim * sizeof(T);
    EXPECT_GE(kv_bytes, 3 * c.max_message_bytes) << "the case must force >= 3 chunks";
  }
  std::vector<double> oref, lref;
  reference_forward64(s, c.ro, qh, kh, vh, oref, lref);
  EXPECT_TRUE(close_frobenius(to_doubles4(o), take_rows4(oref, s, s.heads_q, s.seq_q, segs), tolerance<T>()));
  EXPECT_TRUE(close_lse(to_doubles3(lse), take_rows3(lref, s, s.seq_q, segs), tolerance<kfa::accumulator_t<T>>()));
  if (!backward) return;
  Tensor<T> dq("dq", s.batch, n, s.heads_q, s.head_dim), dk("dk", s.batch, n, s.heads_kv, s.head_dim),
      dv("dv", s.batch, n, s.heads_kv, s.head_dim);
  poison(dq), poison(dk), poison(dv);
  kfa::dist::RingStats bst;
  kfa::dist::ring_attention_backward(Exec(), ring, ql, kl, vl, o, dol, lse, dq, dk, dv, opts, &bst);
  std::size_t bsent = 0;
  for (const auto& st : bst.steps) bsent += st.bytes;
  if (p == 1) EXPECT_EQ(bsent, 0u) << "P = 1 must send nothing";
  std::vector<double> rdq, rdk, rdv;
  reference_backward64(s, c.ro, qh, kh, vh, doh, rdq, rdk, rdv);
  EXPECT_TRUE(close_frobenius(to_doubles4(dq), take_rows4(rdq, s, s.heads_q, s.seq_q, segs), tolerance<T>())) << "dq";
  EXPECT_TRUE(close_frobenius(to_doubles4(dk), take_rows4(rdk, s, s.heads_kv, s.seq_k, segs), tolerance<T>())) << "dk";
  EXPECT_TRUE(close_frobenius(to_doubles4(dv), take_rows4(rdv, s, s.heads_kv, s.seq_k, segs), tolerance<T>())) << "dv";
  if (!c.deterministic) return;
  // Deterministic for a fixed P and layout: a second backward is bitwise equal, here with its inputs (the forward's
  // o and lse included) passed as const Views.
  Tensor<T> dq2("dq2", s.batch, n, s.heads_q, s.head_dim), dk2("dk2", s.batch, n, s.heads_kv, s.head_dim),
      dv2("dv2", s.batch, n, s.heads_kv, s.head_dim);
  using C4 = Kokkos::View<const T****, Kokkos::LayoutRight, Mem>;
  const Kokkos::View<const kfa::accumulator_t<T>***, Kokkos::LayoutRight, Mem> lse_c = lse;
  kfa::dist::ring_attention_backward(Exec(), ring, C4(ql), C4(kl), C4(vl), C4(o), C4(dol), lse_c, dq2, dk2, dv2, opts);
  EXPECT_EQ(to_doubles4(dq), to_doubles4(dq2));
  EXPECT_EQ(to_doubles4(dk), to_doubles4(dk2));
}

}  // namespace

template <class T>
class Ring : public ::testing::Test {};
TYPED_TEST_SUITE(Ring, Dtypes, DtypeNames);

TYPED_TEST(Ring, ContiguousAndZigzag) {
  const int p = world_size();
  for (Layout layout : {Layout::contiguous, Layout::zigzag})
    for (bool causal : {false, true}) {
      RefOptions ro;
      ro.causal = causal;
      check_ring<TypeParam>({layout, ro, Shape{2, 23 * p + 5, 23 * p + 5, 2, 2, 32}, {}}, true);
    }
}

TYPED_TEST(Ring, GroupedQueryAttention) {
  const int p = world_size();
  RefOptions ro;
  ro.causal = true;
  check_ring<TypeParam>({Layout::zigzag, ro, Shape{1, 31 * p, 31 * p, 4, 1, 32}, {}}, true);
  check_ring<TypeParam>({Layout::contiguous, {}, Shape{1, 31 * p + 3, 31 * p + 3, 4, 2, 64}, {}}, false);
}

TYPED_TEST(Ring, SlidingWindowAndSoftcap) {
  const int p = world_size();
  RefOptions w;
  w.window_left = 17, w.window_right = 4;
  check_ring<TypeParam>({Layout::contiguous, w, Shape{1, 29 * p + 1, 29 * p + 1, 2, 2, 32}, {}}, true);
  w.causal = true, w.softcap = 3.0;
  check_ring<TypeParam>({Layout::zigzag, w, Shape{1, 29 * p + 1, 29 * p + 1, 2, 2, 32}, {}}, true);
}

// The head dims of the tensor-core kernels (64, 96, 128: on CUDA with half/bfloat16 the ring's blocks run them
// on strided shard slices with fp32 partial outputs), with and without atomic dQ, partial tiles.
TYPED_TEST(Ring, TensorCoreHeadDims) {
  const int p = world_size();
  RefOptions ro;
  ro.causal = true;
  for (int d : {64, 96, 128})
    for (bool det : {true, false}) {
      Case c{Layout::zigzag, ro, Shape{1, 37 * p + 3, 37 * p + 3, 4, 2, d}, {}};
      c.deterministic = det;
      check_ring<TypeParam>(c, true);
    }
  RefOptions cap;
  cap.softcap = 5.0, cap.window_left = 40;
  Case c{Layout::contiguous, cap, Shape{1, 45 * p + 7, 45 * p + 7, 2, 2, 128}, {}};
  c.deterministic = false;
  check_ring<TypeParam>(c, true);
}

// A window shorter than a shard: the ring stops after one step (nothing beyond is visible) and the dK/dV
// accumulators jump straight home; results must not change.
TYPED_TEST(Ring, WindowShorterThanShardStopsEarly) {
  const int p = world_size();
  RefOptions w;
  w.causal = true, w.window_left = 10;
  check_ring<TypeParam>({Layout::contiguous, w, Shape{1, 30 * p, 30 * p, 2, 1, 32}, {}}, true);
  RefOptions local;
  local.window_left = 0, local.window_right = 0;  // only the diagonal: every block but the own one is masked
  check_ring<TypeParam>({Layout::contiguous, local, Shape{1, 25 * p + 2, 25 * p + 2, 2, 2, 16}, {}}, true);
}

TYPED_TEST(Ring, UnevenExplicitShards) {
  const int p = world_size();
  std::vector<long> len(p);
  long total = 0;
  for (int r = 0; r < p; ++r) total += (len[r] = 9 + 13 * r);  // every rank a different length
  RefOptions ro;
  ro.causal = true;
  check_ring<TypeParam>({Layout::contiguous, ro, Shape{1, int(total), int(total), 2, 1, 32}, len}, true);
}

// Messages larger than Ring::max_message_bytes go in chunks (every K/V and dK/dV message here in >= 3).
TYPED_TEST(Ring, ChunkedMessages) {
  const int p = world_size();
  RefOptions ro;
  ro.causal = true;
  const Shape s{1, 24 * p, 24 * p, 2, 2, 32};
  const std::size_t kv_bytes = 2 * std::size_t(24) * 2 * 32 * sizeof(TypeParam);  // one shard's K and V
  for (Layout layout : {Layout::contiguous, Layout::zigzag})
    check_ring<TypeParam>({layout, ro, s, {}, kv_bytes / 3 - 1}, true);
  EXPECT_THROW(kfa::dist::Ring(MPI_COMM_WORLD).set_max_message_bytes(0), kfa::Error);
  EXPECT_THROW(kfa::dist::Ring(MPI_COMM_WORLD).set_max_message_bytes(std::size_t(1) << 31), kfa::Error);
}

// The transport is resolved and reported alike on every rank: host memory always goes to MPI directly,
// whatever was asked for device buffers; a misspelt KFA_RING_TRANSPORT is refused, not ignored.
TEST(RingTransport, ResolvedReportedAndConfigurable) {
  using kfa::dist::RingTransport;
  const int p = world_size();
  // the launcher's own KFA_RING_TRANSPORT (e.g. staging for two ranks on one GPU) is put back for later tests
  const char* outer = std::getenv("KFA_RING_TRANSPORT");
  const bool had_outer = outer != nullptr;
  const std::string launcher_transport = had_outer ? outer : "";
  auto restore = [&] {
    if (had_outer)
      setenv("KFA_RING_TRANSPORT", launcher_transport.c_str(), 1);
    else
      unsetenv("KFA_RING_TRANSPORT");
  };
  unsetenv("KFA_RING_TRANSPORT");
  kfa::dist::Ring ring(MPI_COMM_WORLD);
  EXPECT_EQ(ring.requested_transport(), RingTransport::automatic);
  EXPECT_EQ(ring.resolved_transport<Kokkos::HostSpace>(), RingTransport::host_memory);
  EXPECT_EQ(ring.transport<Kokkos::HostSpace>(), p == 1 ? "none (one rank)" : "host memory (MPI)");
  static_assert(!kfa::dist::nccl_available<Kokkos::HostSpace>(), "NCCL is for device memory only");
  // ranks sharing a GPU (e.g. two ranks on a one-GPU machine): automatic passes over NCCL, which cannot
  // put them in one communicator
  if (ring.ranks_share_device())
    EXPECT_NE(ring.resolved_transport<Mem>(), RingTransport::nccl);
  else if (kfa::dist::nccl_available<Mem>())
    EXPECT_EQ(ring.resolved_transport<Mem>(), RingTransport::nccl);
  for (const char* name : {"nccl", "staging", "gpu-aware-mpi"}) {
    setenv("KFA_RING_TRANSPORT", name, 1);
    kfa::dist::Ring asked(MPI_COMM_WORLD);
    restore();
    EXPECT_NE(asked.requested_transport(), RingTransport::automatic) << name;
    EXPECT_EQ(asked.resolved_transport<Kokkos::HostSpace>(), RingTransport::host_memory) << name;
    // the test's own buffers (device memory on GPU builds) travel the way that was asked for and reported
    constexpr bool host_mem = Kokkos::SpaceAccessibility<Kokkos::HostSpace, Mem>::accessible;
    if (!host_mem && std::string(name) == "gpu-aware-mpi" && !kfa::dist::mpi_reports_gpu_aware()) continue;
    Tensor<double> q("q", 1, 8, 1, 16), k("k", 1, 8, 1, 16), v("v", 1, 8, 1, 16), o("o", 1, 8, 1, 16);
    Lse<double> lse("lse", 1, 1, 8);
    std::mt19937_64 rng(shared_seed());
    fill_random(q, rng), fill_random(k, rng), fill_random(v, rng);
    kfa::dist::RingStats stats;
    if (!host_mem && p > 1 && std::string(name) == "nccl" &&
        (!kfa::dist::nccl_available<Mem>() || asked.ranks_share_device())) {
      EXPECT_THROW(kfa::dist::ring_attention_forward(Exec(), asked, q, k, v, o, lse, {}, &stats), kfa::Error);
      continue;
    }
    kfa::dist::ring_attention_forward(Exec(), asked, q, k, v, o, lse, {}, &stats);
    EXPECT_EQ(stats.transport, asked.transport<Mem>()) << name;
    if (host_mem) EXPECT_EQ(stats.transport, p == 1 ? "none (one rank)" : "host memory (MPI)") << name;
  }
  setenv("KFA_RING_TRANSPORT", "carrier-pigeon", 1);
  try {
    kfa::dist::Ring bad(MPI_COMM_WORLD);
    ADD_FAILURE() << "KFA_RING_TRANSPORT=carrier-pigeon accepted";
  } catch (const kfa::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'carrier-pigeon'; expected auto, nccl"), std::string::npos) << e.what();
  }
  restore();
}

// A Ring keeps its work buffers between calls (Ring::cache_buffers): one Ring through shapes that grow and
// shrink them, each forward then backward (which share the K/V and accumulator buffers), is exact; so is a
// Ring that keeps nothing, and one whose buffers were released in between.
TEST(RingBuffers, KeptBetweenCallsOfChangingShapes) {
  const int p = world_size();
  RefOptions causal;
  causal.causal = true;
  for (int mode = 0; mode < 3; ++mode) {
    SCOPED_TRACE(mode == 0 ? "buffers kept" : mode == 1 ? "buffers not kept" : "buffers released after each shape");
    kfa::dist::Ring ring(MPI_COMM_WORLD, Layout::zigzag);
    if (mode == 1) ring.set_cache_buffers(false);
    EXPECT_EQ(ring.cache_buffers(), mode != 1);
    for (const Shape s : {Shape{1, 16 * p, 16 * p, 2, 2, 32}, Shape{2, 40 * p + 3, 40 * p + 3, 4, 2, 32},
                          Shape{1, 12 * p + 1, 12 * p + 1, 2, 1, 16}}) {
      check_ring<float>({Layout::zigzag, causal, s, {}}, true, &ring);
      if (mode == 2) ring.release_buffers();
    }
  }
}

// A failure on one rank in the middle of a ring (the KFA_RING_FAULT test hook): every rank throws the same
// kfa::Error naming that rank and step, nobody hangs, and the ring works again afterwards.
TEST(RingErrors, FaultInTheMiddleOfARingFailsEverywhere) {
  const int p = world_size(), r = world_rank();
  const int bad_rank = p - 1, bad_step = p > 1 ? 1 : 0;
  const std::string hook = std::to_string(bad_rank) + ":" + std::to_string(bad_step);
  const std::string want = "ring step " + std::to_string(bad_step) + ": rank " + std::to_string(bad_rank) + " of " +
                           std::to_string(p) + ": kfa::dist: fault injected";
  Tensor<float> q("q", 1, 16, 2, 32), k("k", 1, 16, 2, 32), v("v", 1, 16, 2, 32), o("o", 1, 16, 2, 32),
      d_o("do", 1, 16, 2, 32), dq("dq", 1, 16, 2, 32), dk("dk", 1, 16, 2, 32), dv("dv", 1, 16, 2, 32);
  Lse<float> lse("lse", 1, 2, 16);
  std::mt19937_64 rng(shared_seed());
  fill_random(q, rng), fill_random(k, rng), fill_random(v, rng), fill_random(d_o, rng);
  for (Layout layout : {Layout::contiguous, Layout::zigzag}) {
    setenv("KFA_RING_FAULT", hook.c_str(), 1);
    kfa::dist::Ring faulty(MPI_COMM_WORLD, layout);
    unsetenv("KFA_RING_FAULT");
    kfa::dist::Ring fine(MPI_COMM_WORLD, layout);
    for (int pass = 0; pass < 2; ++pass) {
      try {
        if (pass == 0)
          kfa::dist::ring_attention_forward(Exec(), faulty, q, k, v, o, lse);
        else
          kfa::dist::ring_attention_backward(Exec(), faulty, q, k, v, o, d_o, lse, dq, dk, dv);
        ADD_FAILURE() << "no exception on rank " << r << " (pass " << pass << ")";
      } catch (const kfa::Error& e) {
        EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
      }
      // the same communicator is usable afterwards: nothing was left posted
      EXPECT_NO_THROW(kfa::dist::ring_attention_forward(Exec(), fine, q, k, v, o, lse));
    }
  }
}

TEST(RingErrors, MismatchOnOneRankFailsEverywhere) {
  const int p = world_size(), r = world_rank();
  kfa::dist::Ring ring(MPI_COMM_WORLD);
  EXPECT_EQ(ring.gpu_aware(), kfa::dist::mpi_reports_gpu_aware());
  const int d = (r == p - 1) ? 64 : 32;  // the last rank disagrees on head_dim
  Tensor<float> q("q", 1, 8, 2, d), k("k", 1, 8, 2, d), v("v", 1, 8, 2, d), o("o", 1, 8, 2, d);
  Lse<float> lse("lse", 1, 2, 8);
  if (p > 1) {
    try {
      kfa::dist::ring_attention_forward(Exec(), ring, q, k, v, o, lse);
      ADD_FAILURE() << "no exception on rank " << r;
    } catch (const kfa::Error& e) {
      EXPECT_NE(std::string(e.what()).find("head_dim (q.extent(3)) differs across ranks"), std::string::npos)
          << e.what();
    }
  }
  // A local shape error on one rank: every rank gets the same error naming that rank.
  Tensor<float> bad_o("bad_o", 1, (r == 0) ? 7 : 8, 2, 32), q2("q2", 1, 8, 2, 32), k2("k2", 1, 8, 2, 32),
      v2("v2", 1, 8, 2, 32);
  try {
    kfa::dist::ring_attention_forward(Exec(), ring, q2, k2, v2, bad_o, lse);
    ADD_FAILURE() << "no exception on rank " << r;
  } catch (const kfa::Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0 of " + std::to_string(p) +
                                         ": kfa::dist::ring_attention_forward: o.extent(1) = 7"),
              std::string::npos)
        << e.what();
  }
  // Zigzag needs each rank's two chunks: a wrong length is reported on every rank.
  kfa::dist::Ring zz(MPI_COMM_WORLD, Layout::zigzag);
  const long n = (r == 0) ? 5 : 8;
  Tensor<float> q3("q3", 1, n, 2, 32), k3("k3", 1, n, 2, 32), v3("v3", 1, n, 2, 32), o3("o3", 1, n, 2, 32);
  Lse<float> l3("l3", 1, 2, n);
  if (p > 1) EXPECT_THROW(kfa::dist::ring_attention_forward(Exec(), zz, q3, k3, v3, o3, l3), kfa::Error);
}

// Split-KV partials on every rank (all queries, this rank's keys) merged with MPI_Allreduce and the
// MergeOp equal attention over all keys.
TEST(RingMergeOp, AllreduceOfPartialsEqualsFullAttention) {
  const int p = world_size(), r = world_rank();
  const std::uint64_t seed = shared_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const Shape s{1, 19, 10 * p + 3, 2, 2, 16};
  Tensor<double> q("q", s.batch, s.seq_q, s.heads_q, s.head_dim), k("k", s.batch, s.seq_k, s.heads_kv, s.head_dim),
      v("v", s.batch, s.seq_k, s.heads_kv, s.head_dim);
  const auto qh = fill_random(q, rng), kh = fill_random(k, rng), vh = fill_random(v, rng);
  const auto segs = kfa::dist::shard_of(Layout::contiguous, s.seq_k, p, r);
  auto kl = shard(k, segs), vl = shard(v, segs);
  Tensor<double> o("o", s.batch, s.seq_q, s.heads_q, s.head_dim);
  Lse<double> lse("lse", s.batch, s.heads_q, s.seq_q);
  kfa::attention_forward(Exec(), q, kl, vl, o, lse);
  Exec().fence();
  auto oh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), o);
  auto lh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), lse);
  const int rows = s.batch * s.seq_q * s.heads_q, n = s.head_dim + 1;
  std::vector<double> rec(size_t(rows) * n), out(rec.size());
  for (int i = 0; i < s.seq_q; ++i)
    for (int h = 0; h < s.heads_q; ++h) {
      double* x = &rec[(size_t(i) * s.heads_q + h) * n];
      for (int c = 0; c < s.head_dim; ++c) x[c] = oh(0, i, h, c);
      x[s.head_dim] = lh(0, h, i);
    }
  kfa::dist::MergeOp<double> op(s.head_dim);
  MPI_Allreduce(rec.data(), out.data(), rows, op.datatype(), op.op(), MPI_COMM_WORLD);
  std::vector<double> oref, lref, got_o, got_l, want_l;
  reference_forward64(s, {}, qh, kh, vh, oref, lref);
  for (int i = 0; i < s.seq_q; ++i)
    for (int h = 0; h < s.heads_q; ++h) {
      const double* x = &out[(size_t(i) * s.heads_q + h) * n];
      got_o.insert(got_o.end(), x, x + s.head_dim);
      got_l.push_back(x[s.head_dim]);
      want_l.push_back(lref[size_t(h) * s.seq_q + i]);
    }
  EXPECT_TRUE(close_frobenius(got_o, oref, 1e-12));
  EXPECT_TRUE(close_lse(got_l, want_l, 1e-12));
}

// ---- Packed variable-length sequences over the ring ----
namespace {
// The ring over the packed stream against attention_forward_varlen / attention_backward_varlen on the whole
// stream on one rank (same element type), every rank checking its own shard.
template <class T>
void check_ring_varlen(Layout layout, const std::vector<int>& lq, const std::vector<int>& lk, int hq, int hkv,
                       const RefOptions& ro) {
  const int p = world_size();
  const std::uint64_t seed = shared_seed();
  const kfa::AttentionOptions opts = to_kfa(ro);
  const PackedStream<T> x(layout, lq, lk, hq, hkv, 64, opts, seed);
  SCOPED_TRACE(x.describe(ro, seed, lq.size()) + ", layout " + kfa::dist::to_string(layout) + " P " +
               std::to_string(p));
  const long nq = x.ql.extent(1), nk = x.kl.extent(1);
  Tensor<T> o("o", 1, nq, hq, 64), dq("dq", 1, nq, hq, 64), dk("dk", 1, nk, hkv, 64), dv("dv", 1, nk, hkv, 64);
  typename PackedStream<T>::Lse2 lse("lse", hq, nq);
  poison(o), poison(lse), poison(dq), poison(dk), poison(dv);
  kfa::dist::Ring ring(MPI_COMM_WORLD, layout);
  kfa::dist::ring_attention_forward_varlen(Exec(), ring, p3(x.ql), p3(x.kl), p3(x.vl), p3(o), lse, x.cu_q, x.cu_k, x.mq,
                                           x.mk, opts);
  kfa::dist::ring_attention_backward_varlen(Exec(), ring, p3(x.ql), p3(x.kl), p3(x.vl), p3(o), p3(x.dol), lse, p3(dq),
                                            p3(dk), p3(dv), x.cu_q, x.cu_k, x.mq, x.mk, opts);
  Exec().fence();
  x.expect_shard(o, lse, dq, dk, dv, tolerance<T>());
}
}  // namespace

TYPED_TEST(Ring, VariableLengthSequences) {
  const std::vector<int> lens = {37, 0, 150, 5, 91, 1, 60, 130};
  RefOptions causal;
  causal.causal = true;
  RefOptions sliding;
  sliding.causal = true, sliding.window_left = 20;
  for (Layout layout : {Layout::contiguous, Layout::zigzag}) {
    check_ring_varlen<TypeParam>(layout, lens, lens, 2, 2, RefOptions{});
    check_ring_varlen<TypeParam>(layout, lens, lens, 4, 2, causal);
    check_ring_varlen<TypeParam>(layout, lens, lens, 2, 1, sliding);
  }
  // Query and key lengths that differ per sequence (bottom-right causal in each), a window on both sides.
  const std::vector<int> lq = {20, 90, 0, 33, 64}, lk = {45, 30, 12, 33, 100};
  RefOptions both;
  both.window_left = 9, both.window_right = 4;
  for (Layout layout : {Layout::contiguous, Layout::zigzag}) {
    check_ring_varlen<TypeParam>(layout, lq, lk, 2, 2, causal);
    check_ring_varlen<TypeParam>(layout, lq, lk, 2, 2, both);
  }
  // Many documents shorter than 2P tokens (empty zigzag chunks) around a long one.
  std::vector<int> many(40, 3);
  many[7] = 0, many[11] = 1, many[20] = 200, many[33] = 7;
  check_ring_varlen<TypeParam>(Layout::zigzag, many, many, 2, 2, causal);
}

// document_shard: every rank's pieces cover each document's tokens once, in 2P chunks per document that
// differ in length by at most one token; the zigzag's halves are chunk r and chunk 2P - 1 - r.
TEST(RingLayout, DocumentShardsCoverEveryDocumentOnce) {
  const std::vector<int> cu = {0, 37, 37, 187, 192, 283, 284, 344};
  for (int p : {1, 2, 3, 4, 7})
    for (Layout layout : {Layout::contiguous, Layout::zigzag}) {
      std::vector<int> seen(cu.back(), 0);
      for (int r = 0; r < p; ++r) {
        const auto pieces = kfa::dist::document_shard(layout, cu, p, r);
        long local = 0;
        for (size_t i = 0; i < pieces.size(); ++i) {
          const auto& x = pieces[i];
          EXPECT_EQ(x.local_begin, local);
          local += x.length;
          for (long t = x.global_begin; t < x.global_begin + x.length; ++t) ++seen[t];
          if (layout == Layout::zigzag && p > 1) {
            ASSERT_EQ(pieces.size(), 2 * (cu.size() - 1));
            const size_t s = i % (cu.size() - 1);
            const long len = cu[s + 1] - cu[s], chunk = i < cu.size() - 1 ? r : 2 * p - 1 - r;
            const long base = len / (2 * p), extra = len % (2 * p);
            EXPECT_EQ(x.length, base + (chunk < extra ? 1 : 0)) << "document " << s << " chunk " << chunk;
            EXPECT_EQ(x.global_begin, cu[s] + chunk * base + std::min(chunk, extra));
          }
        }
      }
      for (int t = 0; t < cu.back(); ++t) ASSERT_EQ(seen[t], 1) << "token " << t << " P " << p;
    }
}

TEST(RingErrors, VariableLengthDocumentsMustAgree) {
  const int p = world_size(), r = world_rank();
  const std::vector<int> lens = {10, 30, 24};
  Tensor<float> q("q", 1, 64, 2, 64);
  std::mt19937_64 rng(shared_seed());
  fill_random(q, rng);
  const auto segs = kfa::dist::shard_of(Layout::contiguous, 64, p, r);
  const auto ql = shard(q, segs);
  Tensor<float> o("o", 1, ql.extent(1), 2, 64);
  Kokkos::View<float**, Kokkos::LayoutRight, Mem> lse("lse", 2, ql.extent(1));
  kfa::dist::Ring ring(MPI_COMM_WORLD);
  // the last rank's cu_seqlens differ: every rank refuses with the same message
  const auto cu = cu_of(r == p - 1 && p > 1 ? std::vector<int>{12, 28, 24} : lens);
  try {
    kfa::dist::ring_attention_forward_varlen(Exec(), ring, p3(ql), p3(ql), p3(ql), p3(o), lse, cu, cu, 30, 30);
    if (p > 1) ADD_FAILURE() << "no error for cu_seqlens that differ across ranks";
  } catch (const kfa::Error& e) {
    EXPECT_GT(p, 1) << e.what();
    EXPECT_NE(std::string(e.what()).find("cu_seqlens_q and cu_seqlens_k differs across ranks"), std::string::npos)
        << e.what();
  }
  // zigzag shards cut as one sequence, not per document: every rank refuses, naming what it must hold
  if (p > 1) {
    kfa::dist::Ring zz(MPI_COMM_WORLD, Layout::zigzag);
    const auto zsegs = kfa::dist::shard_of(Layout::zigzag, 64, p, r);
    const auto zq = shard(q, zsegs);
    Tensor<float> zo("zo", 1, zq.extent(1), 2, 64);
    Kokkos::View<float**, Kokkos::LayoutRight, Mem> zl("zl", 2, zq.extent(1));
    const auto zcu = cu_of({1, 1, 62});
    try {
      kfa::dist::ring_attention_forward_varlen(Exec(), zz, p3(zq), p3(zq), p3(zq), p3(zo), zl, zcu, zcu, 62, 62);
      ADD_FAILURE() << "no error for zigzag shards of the stream";
    } catch (const kfa::Error& e) {
      EXPECT_NE(std::string(e.what()).find("zigzag layout over documents: rank 0 must hold chunks 0 and " +
                                           std::to_string(2 * p - 1) + " of every document's queries"),
                std::string::npos)
          << e.what();
    }
  }
  // a total that disagrees with the shards, on every rank
  try {
    kfa::dist::ring_attention_forward_varlen(Exec(), ring, p3(ql), p3(ql), p3(ql), p3(o), lse, cu_of({10, 30}),
                                             cu_of({10, 30}), 30, 30);
    ADD_FAILURE() << "no error for 40 tokens in cu_seqlens against 64 in the shards";
  } catch (const kfa::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cu_seqlens_q(2) = 40 but 64 tokens are in the ranks' q shards"),
              std::string::npos)
        << e.what();
  }
}
