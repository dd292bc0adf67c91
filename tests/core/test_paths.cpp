// Tile-product paths (AttentionOptions::path): the tensor-core kernels against the float64 reference and
// against the portable path on the same inputs, forward and backward; asking for tensor cores where they
// cannot run is a clear error. On a build without a tensor-core path (every host build) the agreement
// tests report a skip and the error tests carry the weight.
#include "../common/kfa_test.hpp"

#include <kfa/detail/cuda/block_order.hpp>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

using namespace kfa_test;

template <class T>
class Paths : public ::testing::Test {};
TYPED_TEST_SUITE(Paths, Dtypes, DtypeNames);

namespace {
template <class T>
struct Run {
  Tensor<T> o, dq, dk, dv;
  Lse<T> lse;
};

template <class T>
Run<T> run_path(const Shape& s, const Tensor<T>& q, const Tensor<T>& k, const Tensor<T>& v, const Tensor<T>& d_o,
                kfa::AttentionOptions opts, kfa::TileProductPath path) {
  opts.path = path;
  Run<T> r{Tensor<T>("o", s.batch, s.seq_q, s.heads_q, s.head_dim),
           Tensor<T>("dq", s.batch, s.seq_q, s.heads_q, s.head_dim),
           Tensor<T>("dk", s.batch, s.seq_k, s.heads_kv, s.head_dim),
           Tensor<T>("dv", s.batch, s.seq_k, s.heads_kv, s.head_dim), Lse<T>("lse", s.batch, s.heads_q, s.seq_q)};
  poison(r.o), poison(r.lse), poison(r.dq), poison(r.dk), poison(r.dv);
  kfa::attention_forward(Exec(), q, k, v, r.o, r.lse, opts);
  kfa::attention_backward(Exec(), q, k, v, r.o, d_o, r.lse, r.dq, r.dk, r.dv, opts);
  Exec().fence();
  return r;
}

template <class T>
bool same_bits(const Tensor<T>& a, const Tensor<T>& b) {
  auto ha = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), a);
  auto hb = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), b);
  return ha.size() == hb.size() && std::memcmp(ha.data(), hb.data(), ha.size() * sizeof(T)) == 0;
}

template <class T>
void check_paths_agree(const Shape& s, const RefOptions& ro) {
  const std::uint64_t seed = fresh_seed();
  SCOPED_TRACE(describe(s, ro, seed));
  std::mt19937_64 rng(seed);
  Tensor<T> q("q", s.batch, s.seq_q, s.heads_q, s.head_dim), k("k", s.batch, s.seq_k, s.heads_kv, s.head_dim),
      v("v", s.batch, s.seq_k, s.heads_kv, s.head_dim), d_o("do", s.batch, s.seq_q, s.heads_q, s.head_dim);
  const auto qh = fill_random(q, rng), kh = fill_random(k, rng), vh = fill_random(v, rng), doh = fill_random(d_o, rng);
  const kfa::AttentionOptions opts = to_kfa(ro);
  const Run<T> tc = run_path(s, q, k, v, d_o, opts, kfa::TileProductPath::tensor_core);
  const Run<T> pt = run_path(s, q, k, v, d_o, opts, kfa::TileProductPath::portable);
  // Every tensor-core forward family that can run here by name (tensor_core runs only the first of them):
  // wgmma (sm_90a), FA2's layout, the Kokkos team kernel (head dims up to 128).
  std::vector<std::pair<kfa::TileProductPath, Run<T>>> forwards;
  for (kfa::TileProductPath p : {kfa::TileProductPath::tensor_core_wgmma, kfa::TileProductPath::tensor_core_fa2,
                                 kfa::TileProductPath::tensor_core_team}) {
    kfa::AttentionOptions named = opts;
    named.path = p;
    try {
      (void)kfa::plan_forward(Exec(), q, k, v, q, named);
    } catch (const kfa::Error&) {
      continue;
    }
    Run<T> r{Tensor<T>("o", s.batch, s.seq_q, s.heads_q, s.head_dim),
             {},
             {},
             {},
             Lse<T>("lse", s.batch, s.heads_q, s.seq_q)};
    poison(r.o), poison(r.lse);
    kfa::attention_forward(Exec(), q, k, v, r.o, r.lse, named);
    Exec().fence();
    forwards.emplace_back(p, r);
  }
  EXPECT_FALSE(forwards.empty()) << "no tensor-core forward family ran";
  // dQ accumulated with atomics inside the dK/dV kernel (opts.deterministic = false): the wgmma dK/dV kernel
  // where it runs, and the FA2-layout (or team) one by name.
  kfa::AttentionOptions nondet = opts;
  nondet.deterministic = false;
  nondet.path = kfa::TileProductPath::tensor_core;
  const kfa::BackwardPlan nondet_plan = kfa::plan_backward(Exec(), q, k, v, d_o, d_o, k, v, nondet);
  std::vector<std::pair<std::string, Run<T>>> atomics;
  if (nondet_plan.wgmma && nondet_plan.atomic_dq)  // head dim 64
    atomics.emplace_back("atomic wgmma", run_path(s, q, k, v, d_o, nondet, kfa::TileProductPath::tensor_core));
  atomics.emplace_back("atomic", run_path(s, q, k, v, d_o, nondet,
                                          nondet_plan.wgmma ? kfa::TileProductPath::tensor_core_fa2
                                                            : kfa::TileProductPath::tensor_core));
  kfa::AttentionOptions det = opts;
  det.path = kfa::TileProductPath::tensor_core;
  const bool wgmma_bwd = kfa::plan_backward(Exec(), q, k, v, d_o, d_o, k, v, det).wgmma;
  // The deterministic tensor-core backward again on the same inputs: bitwise the same gradients.
  const Run<T> again = run_path(s, q, k, v, d_o, opts, kfa::TileProductPath::tensor_core);
  // Where that backward's kernels are the wgmma ones, the FA2-layout (or older) ones by name too.
  std::vector<Run<T>> other_dkdv;
  if (wgmma_bwd) other_dkdv.push_back(run_path(s, q, k, v, d_o, opts, kfa::TileProductPath::tensor_core_fa2));
  std::vector<double> oref, lref, dqr, dkr, dvr;
  reference_forward64(s, ro, qh, kh, vh, oref, lref);
  reference_backward64(s, ro, qh, kh, vh, doh, dqr, dkr, dvr);
  const double tol = tolerance<T>();
  // Each path against float64, then the two paths against each other.
  for (const Run<T>* r : {&tc, &pt}) {
    const char* name = r == &tc ? "tensor_core" : "portable";
    EXPECT_TRUE(close_frobenius(to_doubles4(r->o), oref, tol)) << name << " o";
    EXPECT_TRUE(close_lse(to_doubles3(r->lse), lref, tolerance<float>() * 10)) << name << " lse";
    EXPECT_TRUE(close_frobenius(to_doubles4(r->dq), dqr, tol)) << name << " dq";
    EXPECT_TRUE(close_frobenius(to_doubles4(r->dk), dkr, tol)) << name << " dk";
    EXPECT_TRUE(close_frobenius(to_doubles4(r->dv), dvr, tol)) << name << " dv";
  }
  for (const auto& [p, r] : forwards) {
    const std::string name = kfa::to_string(p);
    EXPECT_TRUE(close_frobenius(to_doubles4(r.o), oref, tol)) << name << " o";
    EXPECT_TRUE(close_lse(to_doubles3(r.lse), lref, tolerance<float>() * 10)) << name << " lse";
    EXPECT_TRUE(close_frobenius(to_doubles4(r.o), to_doubles4(pt.o), tol)) << "o: " << name << " vs portable";
  }
  EXPECT_TRUE(close_frobenius(to_doubles4(tc.o), to_doubles4(pt.o), tol)) << "o: tensor_core vs portable";
  EXPECT_TRUE(close_frobenius(to_doubles4(tc.dq), to_doubles4(pt.dq), tol)) << "dq: tensor_core vs portable";
  EXPECT_TRUE(close_frobenius(to_doubles4(tc.dk), to_doubles4(pt.dk), tol)) << "dk: tensor_core vs portable";
  EXPECT_TRUE(close_frobenius(to_doubles4(tc.dv), to_doubles4(pt.dv), tol)) << "dv: tensor_core vs portable";
  for (const Run<T>& r : other_dkdv) {
    EXPECT_TRUE(close_frobenius(to_doubles4(r.dq), dqr, tol)) << "tensor_core_fa2 dq";
    EXPECT_TRUE(close_frobenius(to_doubles4(r.dk), dkr, tol)) << "tensor_core_fa2 dk";
    EXPECT_TRUE(close_frobenius(to_doubles4(r.dv), dvr, tol)) << "tensor_core_fa2 dv";
    EXPECT_TRUE(close_frobenius(to_doubles4(r.dk), to_doubles4(pt.dk), tol)) << "dk: tensor_core_fa2 vs portable";
    EXPECT_TRUE(close_frobenius(to_doubles4(r.dv), to_doubles4(pt.dv), tol)) << "dv: tensor_core_fa2 vs portable";
  }
  for (const auto& [name, atomic] : atomics) {
    EXPECT_TRUE(close_frobenius(to_doubles4(atomic.dq), dqr, tol)) << name << " dq";
    EXPECT_TRUE(close_frobenius(to_doubles4(atomic.dk), dkr, tol)) << name << " dk";
    EXPECT_TRUE(close_frobenius(to_doubles4(atomic.dv), dvr, tol)) << name << " dv";
    EXPECT_TRUE(close_frobenius(to_doubles4(atomic.dq), to_doubles4(pt.dq), tol)) << "dq: " << name << " vs portable";
    EXPECT_TRUE(close_frobenius(to_doubles4(atomic.dk), to_doubles4(pt.dk), tol)) << "dk: " << name << " vs portable";
    EXPECT_TRUE(close_frobenius(to_doubles4(atomic.dv), to_doubles4(pt.dv), tol)) << "dv: " << name << " vs portable";
  }
  EXPECT_TRUE(same_bits(tc.dq, again.dq)) << "deterministic dq run twice";
  EXPECT_TRUE(same_bits(tc.dk, again.dk)) << "deterministic dk run twice";
  EXPECT_TRUE(same_bits(tc.dv, again.dv)) << "deterministic dv run twice";
}

template <class T>
std::string error_of(const Shape& s, kfa::AttentionOptions opts, bool backward) {
  Tensor<T> q("q", s.batch, s.seq_q, s.heads_q, s.head_dim), k("k", s.batch, s.seq_k, s.heads_kv, s.head_dim),
      v("v", s.batch, s.seq_k, s.heads_kv, s.head_dim), o("o", s.batch, s.seq_q, s.heads_q, s.head_dim),
      dq("dq", s.batch, s.seq_q, s.heads_q, s.head_dim), dk("dk", s.batch, s.seq_k, s.heads_kv, s.head_dim),
      dv("dv", s.batch, s.seq_k, s.heads_kv, s.head_dim);
  Lse<T> lse("lse", s.batch, s.heads_q, s.seq_q);
  try {
    if (backward)
      kfa::attention_backward(Exec(), q, k, v, o, o, lse, dq, dk, dv, opts);
    else
      kfa::attention_forward(Exec(), q, k, v, o, lse, opts);
  } catch (const kfa::Error& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TYPED_TEST(Paths, TensorCoreAgreesWithPortableAndReference) {
  using T = TypeParam;
  if constexpr (!kfa::has_tensor_core_path<Exec, T>::value) {
    GTEST_SKIP() << "no tensor-core path for " << kfa::dtype_name<T>() << " on " << Exec::name();
  } else {
    // KFA_TEST_SMALL=1 (used under compute-sanitizer): two masked cases per head dim, with softcap and without.
    // 600 keys take the warp-specialized wgmma forward's K/V ring around more than once: five 128-key tiles
    // through its three stages (d = 64: four), with softcap at d = 64 seven 96-key tiles through five.
    const bool small = std::getenv("KFA_TEST_SMALL") != nullptr;
    for (int d : {64, 96, 128}) {
      RefOptions ro;
      if (small) {
        RefOptions c;
        c.causal = true;
        check_paths_agree<T>({1, 130, 600, 2, 1, d}, c);
        c.softcap = 20.0;
        check_paths_agree<T>({1, 130, 600, 2, 1, d}, c);
        continue;
      }
      check_paths_agree<T>({2, 200, 200, 2, 2, d}, ro);  // partial last tiles on both sides
      check_paths_agree<T>({1, 65, 300, 4, 2, d}, ro);   // GQA, seq_q != seq_k
      ro.causal = true;
      check_paths_agree<T>({1, 300, 300, 2, 1, d}, ro);
      check_paths_agree<T>({1, 100, 30, 2, 2, d}, ro);    // rows that see no key
      check_paths_agree<T>({1, 700, 1000, 2, 1, d}, ro);  // many key tiles: both stages of the K/V double buffer
      RefOptions w;
      w.window_left = 37;
      w.window_right = 5;
      w.softcap = 20.0;
      check_paths_agree<T>({1, 257, 190, 2, 2, d}, w);
      RefOptions sc;  // softcap over many key tiles (the ring of stages more than once), partial last tile
      sc.softcap = 30.0;
      check_paths_agree<T>({1, 190, 1000, 2, 1, d}, sc);
    }
  }
}

// The tensor-core kernels on strided views, head dims 64, 96 and 128 (the wgmma kernels on Hopper, which load
// them with TMA there: its descriptors order the head and row dimensions by stride, and at d = 96 a row's second
// 64-element box ends past the head dim, inside the packed row's next tensor): every tensor in
// [batch][head][row][d] memory (heads outside rows), and q, k, v packed as [batch][row][3][head][d] with the
// gradients packed the same way; forward and backward against the float64 reference.
TYPED_TEST(Paths, TensorCoreStridedLayouts) {
  using T = TypeParam;
  if constexpr (!kfa::has_tensor_core_path<Exec, T>::value) {
    GTEST_SKIP() << "no tensor-core path for " << kfa::dtype_name<T>() << " on " << Exec::name();
  } else {
    using S4 = Kokkos::View<T****, Kokkos::LayoutStride, Mem>;
    using Buf = Kokkos::View<T*, Mem>;
    // A [batch][row][head][d] view of [batch][head][row][d] memory (buf outlives it).
    auto heads_outer = [](const Buf& buf, int b, int n, int h, int d) {
      return S4(buf.data(), Kokkos::LayoutStride(b, std::size_t(h) * n * d, n, d, h, std::size_t(n) * d, d, 1));
    };
    const bool small = std::getenv("KFA_TEST_SMALL") != nullptr;
    for (int d : {64, 96, 128}) {
      for (int packed = 0; packed < 2; ++packed) {
        // Many tiles on both sides (refills of every stage); GQA and seq_q != seq_k where not packed.
        const Shape s = packed ? Shape{1, 520, 520, 2, 2, d} : Shape{1, small ? 200 : 600, 520, 4, 2, d};
        RefOptions ro;
        ro.causal = true;
        const std::uint64_t seed = fresh_seed();
        SCOPED_TRACE(describe(s, ro, seed) + (packed ? " packed qkv" : " heads outside rows"));
        std::mt19937_64 rng(seed);
        const std::size_t nq = std::size_t(s.batch) * s.seq_q * s.heads_q * d;
        const std::size_t nk = std::size_t(s.batch) * s.seq_k * s.heads_kv * d;
        Buf bq("q", nq), bk("k", nk), bv("v", nk), bo("o", nq), bdo("do", nq), bdq("dq", nq), bdk("dk", nk),
            bdv("dv", nk);
        Kokkos::View<T*****, Kokkos::LayoutRight, Mem> qkv("qkv", s.batch, s.seq_q, 3, s.heads_q, d),
            dqkv("dqkv", s.batch, s.seq_q, 3, s.heads_q, d);
        auto slot = [&](const decltype(qkv)& x, int i) {
          return S4(Kokkos::subview(x, Kokkos::ALL, Kokkos::ALL, i, Kokkos::ALL, Kokkos::ALL));
        };
        const S4 q = packed ? slot(qkv, 0) : heads_outer(bq, s.batch, s.seq_q, s.heads_q, d);
        const S4 k = packed ? slot(qkv, 1) : heads_outer(bk, s.batch, s.seq_k, s.heads_kv, d);
        const S4 v = packed ? slot(qkv, 2) : heads_outer(bv, s.batch, s.seq_k, s.heads_kv, d);
        const S4 dq = packed ? slot(dqkv, 0) : heads_outer(bdq, s.batch, s.seq_q, s.heads_q, d);
        const S4 dk = packed ? slot(dqkv, 1) : heads_outer(bdk, s.batch, s.seq_k, s.heads_kv, d);
        const S4 dv = packed ? slot(dqkv, 2) : heads_outer(bdv, s.batch, s.seq_k, s.heads_kv, d);
        const S4 o = heads_outer(bo, s.batch, s.seq_q, s.heads_q, d),
                 d_o = heads_outer(bdo, s.batch, s.seq_q, s.heads_q, d);
        Lse<T> lse("lse", s.batch, s.heads_q, s.seq_q);
        const auto qh = fill_random(q, rng), kh = fill_random(k, rng), vh = fill_random(v, rng),
                   doh = fill_random(d_o, rng);
        kfa::AttentionOptions opts = to_kfa(ro);
        opts.path = kfa::TileProductPath::tensor_core;
        poison(o), poison(lse), poison(dq), poison(dk), poison(dv);
        kfa::attention_forward(Exec(), q, k, v, o, lse, opts);
        kfa::attention_backward(Exec(), q, k, v, o, d_o, lse, dq, dk, dv, opts);
        Exec().fence();
        std::vector<double> oref, lref, dqr, dkr, dvr;
        reference_forward64(s, ro, qh, kh, vh, oref, lref);
        reference_backward64(s, ro, qh, kh, vh, doh, dqr, dkr, dvr);
        const double tol = tolerance<T>();
        EXPECT_TRUE(close_frobenius(to_doubles4(o), oref, tol)) << "o";
        EXPECT_TRUE(close_lse(to_doubles3(lse), lref, tolerance<float>() * 10)) << "lse";
        EXPECT_TRUE(close_frobenius(to_doubles4(dq), dqr, tol)) << "dq";
        EXPECT_TRUE(close_frobenius(to_doubles4(dk), dkr, tol)) << "dk";
        EXPECT_TRUE(close_frobenius(to_doubles4(dv), dvr, tol)) << "dv";
      }
    }
  }
}

// Head dim 256: the wgmma forward and backward run it on Hopper (sm_90a), the FA2-layout kernels elsewhere (dK/dV
// with 64 keys per block, dQ with one m16 tile per warp) and by name. Where the device does not give them
// their shared memory (the backward: not sm_80's 163 KB; neither: not sm_86/89's 99 KB), automatic runs the
// portable kernels and naming tensor_core there is an error saying why.
TYPED_TEST(Paths, TensorCoreHeadDim256) {
  using T = TypeParam;
  using P = kfa::TileProductPath;
  if constexpr (!kfa::has_tensor_core_path<Exec, T>::value) {
    GTEST_SKIP() << "no tensor-core path for " << kfa::dtype_name<T>() << " on " << Exec::name();
  } else {
    const bool small = std::getenv("KFA_TEST_SMALL") != nullptr;
    const std::string fwd_why = kfa::detail::fa2_forward_problem(Exec(), 256);
    const std::string bwd_why = kfa::detail::tc_backward_problem(Exec(), 256, false);
    const std::string atomic_why = kfa::detail::tc_backward_problem(Exec(), 256, true);
    RefOptions plain, causal, window;
    causal.causal = true;
    window.window_left = 37;
    window.window_right = 5;
    window.softcap = 20.0;
    const std::pair<Shape, RefOptions> cases[] = {
        {{2, 200, 200, 2, 2, 256}, plain},   // partial last tiles on both sides
        {{1, 65, 300, 4, 2, 256}, plain},    // GQA, seq_q != seq_k
        {{1, 300, 520, 2, 1, 256}, causal},  // many key and query tiles: both stages of every double buffer
        {{1, 100, 30, 2, 2, 256}, causal},   // rows that see no key
        {{1, 257, 190, 2, 2, 256}, window}};
    for (const auto& [s, ro] : cases) {
      if (small && s.seq_q != 100) continue;
      if (!fwd_why.empty()) break;  // no tensor-core kernel of d = 256 runs here: the plans below say so
      if (bwd_why.empty() && atomic_why.empty()) {  // forward and backward, every tensor-core kernel of d = 256
        check_paths_agree<T>(s, ro);
        continue;
      }
      const std::uint64_t seed = fresh_seed();
      SCOPED_TRACE(describe(s, ro, seed));
      std::mt19937_64 rng(seed);
      Tensor<T> q("q", s.batch, s.seq_q, s.heads_q, s.head_dim), k("k", s.batch, s.seq_k, s.heads_kv, s.head_dim),
          v("v", s.batch, s.seq_k, s.heads_kv, s.head_dim);
      const auto qh = fill_random(q, rng), kh = fill_random(k, rng), vh = fill_random(v, rng);
      std::vector<double> oref, lref;
      reference_forward64(s, ro, qh, kh, vh, oref, lref);
      std::vector<double> outs[2];
      for (int i = 0; i < 2; ++i) {
        kfa::AttentionOptions opts = to_kfa(ro);
        opts.path = i == 0 ? P::tensor_core : P::portable;
        Tensor<T> o("o", s.batch, s.seq_q, s.heads_q, s.head_dim);
        Lse<T> lse("lse", s.batch, s.heads_q, s.seq_q);
        poison(o), poison(lse);
        kfa::attention_forward(Exec(), q, k, v, o, lse, opts);
        Exec().fence();
        outs[i] = to_doubles4(o);
        EXPECT_TRUE(close_frobenius(outs[i], oref, tolerance<T>())) << kfa::to_string(opts.path) << " o";
        EXPECT_TRUE(close_lse(to_doubles3(lse), lref, tolerance<float>() * 10)) << kfa::to_string(opts.path) << " lse";
      }
      EXPECT_TRUE(close_frobenius(outs[0], outs[1], tolerance<T>())) << "o: tensor_core vs portable";
    }
    // The plans: the wgmma forward where it runs, else the FA2-layout one; the tensor-core backward with its
    // d = 256 tiles where it runs.
    const Shape s{1, 64, 64, 2, 2, 256};
    Tensor<T> q("q", 1, 64, 2, 256), o("o", 1, 64, 2, 256), dq("dq", 1, 64, 2, 256), dk("dk", 1, 64, 2, 256),
        dv("dv", 1, 64, 2, 256);
    kfa::AttentionOptions opts, nondet;
    nondet.deterministic = false;
    const bool wgmma = kfa::detail::wgmma_forward_why_not(Exec(), 256, 64, opts).empty();
    EXPECT_EQ(kfa::plan_forward(Exec(), q, q, q, o, opts).family, wgmma             ? P::tensor_core_wgmma
                                                                  : fwd_why.empty() ? P::tensor_core_fa2
                                                                                    : P::portable);
    if (!fwd_why.empty()) {
      kfa::AttentionOptions tc;
      tc.path = P::tensor_core;
      const std::string e = error_of<T>(s, tc, false);
      EXPECT_NE(e.find("opts.path = tensor_core but no family it names can run these inputs ("), std::string::npos)
          << e;
      EXPECT_NE(e.find("tensor_core_fa2: the device allows"), std::string::npos) << e;
      EXPECT_NE(e.find("head_dim = 256"), std::string::npos) << e;
    }
    const kfa::BackwardPlan b = kfa::plan_backward(Exec(), q, q, q, q, dq, dk, dv, opts);
    const kfa::BackwardPlan nb = kfa::plan_backward(Exec(), q, q, q, q, dq, dk, dv, nondet);
    EXPECT_EQ(b.family, bwd_why.empty() ? P::tensor_core : P::portable) << b.region;
    EXPECT_EQ(nb.family, atomic_why.empty() ? P::tensor_core : P::portable) << nb.region;
    if (b.family == P::tensor_core) {
      // the wgmma kernels exactly where they say they can run (dK/dV: two warpgroups on 64 keys; dQ: the
      // warp-specialized kernel, 32-key tiles), else the FA2-layout ones
      EXPECT_EQ(b.wgmma, kfa::detail::wgmma_backward_why_not(Exec(), 256, false, opts).empty()) << b.region;
      EXPECT_FALSE(b.atomic_dq) << b.region;
      EXPECT_EQ(b.tiles.dkdv.block_k, 64) << b.region;
      EXPECT_EQ(b.tiles.dkdv.team_size, 256) << b.region;
      EXPECT_EQ(b.tiles.dq.block_q, 128) << b.region;
      EXPECT_EQ(b.tiles.dq.team_size, b.wgmma ? 384 : 256) << b.region;
      if (b.wgmma) EXPECT_EQ(b.tiles.dq.block_k, 32) << b.region;
    } else {
      opts.path = P::tensor_core;
      const std::string e = error_of<T>(s, opts, true);
      EXPECT_NE(e.find("opts.path = tensor_core but the device allows"), std::string::npos) << e;
    }
    // deterministic = false: the wgmma pair where it runs (it has no atomic dQ at d = 256), else the FA2-layout
    // dK/dV kernel with atomic dQ
    if (nb.family == P::tensor_core) EXPECT_EQ(nb.atomic_dq, !nb.wgmma) << nb.region;
  }
}

TYPED_TEST(Paths, TensorCoreWhereItCannotRunIsAnError) {
  using T = TypeParam;
  kfa::AttentionOptions opts;
  opts.path = kfa::TileProductPath::tensor_core;
  for (bool backward : {false, true}) {
    if (!kfa::has_tensor_core_path<Exec, T>::value) {
      const std::string e = error_of<T>({1, 16, 16, 1, 1, 64}, opts, backward);
      EXPECT_NE(e.find("opts.path = tensor_core"), std::string::npos) << e;
      EXPECT_NE(e.find("no tensor-core path for " + kfa::dtype_name<T>()), std::string::npos) << e;
    } else {
      const std::string e = error_of<T>({1, 16, 16, 1, 1, 80}, opts, backward);
      EXPECT_NE(e.find("head_dim = 80"), std::string::npos) << e;
      kfa::AttentionOptions tiles = opts;
      tiles.block_q = 8;
      const std::string e2 = error_of<T>({1, 16, 16, 1, 1, 64}, tiles, backward);
      EXPECT_NE(e2.find("opts.block_q = 8"), std::string::npos) << e2;
    }
  }
}

// float: every family that can run it here (automatic, portable; on CUDA also simt_fp32 and the 3xTF32
// tensor-core kernels, each where its plan says it runs) against float64 and against portable, forward and
// backward (test_simt_backward checks both CUDA fp32 backwards element by element).
TEST(Paths, FloatFamiliesAgreeWithPortableAndReference) {
  using P = kfa::TileProductPath;
  int tf32_runs = 0;
  const bool small = std::getenv("KFA_TEST_SMALL") != nullptr;
  for (int d : {64, 96, 128})
    for (const RefOptions& ro : {RefOptions{},
                                 [] {
                                   RefOptions c;
                                   c.causal = true;
                                   return c;
                                 }(),
                                 [] {
                                   RefOptions w;
                                   w.window_left = 40;
                                   w.window_right = 3;
                                   w.softcap = 15.0;
                                   return w;
                                 }()}) {
      for (const Shape& s : {Shape{2, 211, 190, 4, 2, d}, Shape{1, 300, 520, 2, 1, d}, Shape{1, 100, 30, 2, 2, d}}) {
        if (s.seq_q == 100 && !ro.causal) continue;  // rows that see no key: the causal case only
        if (small && s.seq_q != 211) continue;       // KFA_TEST_SMALL=1 (under compute-sanitizer): one shape
        const std::uint64_t seed = fresh_seed();
        SCOPED_TRACE(describe(s, ro, seed));
        std::mt19937_64 rng(seed);
        Tensor<float> q("q", s.batch, s.seq_q, s.heads_q, d), k("k", s.batch, s.seq_k, s.heads_kv, d),
            v("v", s.batch, s.seq_k, s.heads_kv, d), d_o("do", s.batch, s.seq_q, s.heads_q, d);
        const auto qh = fill_random(q, rng), kh = fill_random(k, rng), vh = fill_random(v, rng),
                   doh = fill_random(d_o, rng);
        std::vector<double> oref, lref, dqr, dkr, dvr;
        reference_forward64(s, ro, qh, kh, vh, oref, lref);
        reference_backward64(s, ro, qh, kh, vh, doh, dqr, dkr, dvr);
        ::Run<float> portable{};
        for (P path : {P::portable, P::automatic, P::simt_fp32, P::tensor_core_tf32x3}) {
          kfa::AttentionOptions opts = to_kfa(ro);
          opts.path = path;
          if (path == P::simt_fp32 || path == P::tensor_core_tf32x3) {
            Tensor<float> o("o", s.batch, s.seq_q, s.heads_q, d), dq("dq", s.batch, s.seq_q, s.heads_q, d),
                dk("dk", s.batch, s.seq_k, s.heads_kv, d), dv("dv", s.batch, s.seq_k, s.heads_kv, d);
            try {
              (void)kfa::plan_forward(Exec(), q, k, v, o, opts);
              (void)kfa::plan_backward(Exec(), q, k, v, d_o, dq, dk, dv, opts);
            } catch (const kfa::Error&) {
              continue;  // cannot run here (host builds; d = 96 for simt_fp32): the plan test covers the error
            }
            tf32_runs += path == P::tensor_core_tf32x3;
          }
          const ::Run<float> r = run_path(s, q, k, v, d_o, opts, path);
          const std::string name = kfa::to_string(path);
          EXPECT_TRUE(close_frobenius(to_doubles4(r.o), oref, tolerance<float>())) << name << " o";
          EXPECT_TRUE(close_lse(to_doubles3(r.lse), lref, tolerance<float>())) << name << " lse";
          EXPECT_TRUE(close_frobenius(to_doubles4(r.dq), dqr, tolerance<float>())) << name << " dq";
          EXPECT_TRUE(close_frobenius(to_doubles4(r.dk), dkr, tolerance<float>())) << name << " dk";
          EXPECT_TRUE(close_frobenius(to_doubles4(r.dv), dvr, tolerance<float>())) << name << " dv";
          if (path == P::portable) {
            portable = r;
            continue;
          }
          const double tol = tolerance<float>();
          EXPECT_TRUE(close_frobenius(to_doubles4(r.o), to_doubles4(portable.o), tol)) << name << " o vs portable";
          EXPECT_TRUE(close_frobenius(to_doubles4(r.dq), to_doubles4(portable.dq), tol)) << name << " dq vs portable";
          EXPECT_TRUE(close_frobenius(to_doubles4(r.dk), to_doubles4(portable.dk), tol)) << name << " dk vs portable";
          EXPECT_TRUE(close_frobenius(to_doubles4(r.dv), to_doubles4(portable.dv), tol)) << name << " dv vs portable";
        }
      }
    }
  if (tf32_runs == 0)
    std::printf("[ note ] tensor_core_tf32x3 cannot run on %s here: checked portable/automatic only\n", Exec::name());
}

// The order the CUDA kernels take their blocks in (cuda/block_order.hpp): every (pair, block) exactly once, for
// any section; inside a section the most work first over all its pairs; sections only under a mask whose work
// depends on the block, no wider than the pairs.
TEST(Paths, BlockOrderTakesEveryBlockOnce) {
  for (int pairs : {1, 2, 5, 12})
    for (int blocks : {1, 3, 8})
      for (int section = 1; section <= pairs; ++section) {
        kfa::detail::BlockOrder o;
        o.blocks = blocks, o.pairs = pairs, o.section = section;
        ASSERT_EQ(o.league(), static_cast<long>(pairs) * blocks);
        std::vector<int> seen(static_cast<std::size_t>(pairs) * blocks, 0);
        int last_first = -1, last_rank = 0;
        for (int r = 0; r < pairs * blocks; ++r) {
          int pair = -1, rank = -1;
          o.at(r, pair, rank);
          ASSERT_TRUE(pair >= 0 && pair < pairs && rank >= 0 && rank < blocks)
              << "pairs " << pairs << " blocks " << blocks << " section " << section << " r " << r;
          ++seen[static_cast<std::size_t>(pair) * blocks + rank];
          const int first = pair / section * section;
          if (first == last_first) EXPECT_GE(rank, last_rank) << "section " << section << " r " << r;
          EXPECT_GE(first, last_first) << "section " << section << " r " << r;
          last_first = first, last_rank = rank;
        }
        for (int c : seen) EXPECT_EQ(c, 1) << "pairs " << pairs << " blocks " << blocks << " section " << section;
      }
  // QueryBlock: rank 0 is the last query block; KeyBlock: rank 0 the first key block.
  kfa::detail::BlockOrder o;
  o.blocks = 4, o.pairs = 6, o.section = 3;  // batch 2 · heads 3
  const kfa::detail::QueryBlock first_q(0, o, 3, 1, 64, 200);
  EXPECT_EQ(first_q.i0, 192);
  EXPECT_EQ(first_q.rows, 8);
  const kfa::detail::QueryBlock next_q(1, o, 3, 1, 64, 200);
  EXPECT_EQ(next_q.h, 1);
  EXPECT_EQ(next_q.i0, 192);
  const kfa::detail::KeyBlock first_k(o.league() - 1, o, 3, 64, 200);
  EXPECT_EQ(first_k.b, 1);
  EXPECT_EQ(first_k.hk, 2);
  EXPECT_EQ(first_k.k0, 192);
  EXPECT_EQ(first_k.keys, 8);
  // Without a row-dependent mask one pair after the other; under one, the pairs whose blocks fill the SMs once
  // (rounded), never more than there are, never fewer than one.
  const kfa::detail::KeyMask none(4096, 4096, false, -1, -1), causal(4096, 4096, true, -1, -1);
  EXPECT_EQ(kfa::detail::query_block_order(4, 4096, 16, 128, none, 132).section, 1);
  EXPECT_EQ(kfa::detail::query_block_order(4, 4096, 16, 128, causal, 132).section, 4);  // 32 blocks a pair
  EXPECT_EQ(kfa::detail::key_block_order(4, 4096, 16, 128, causal, 132).section, 4);
  EXPECT_EQ(kfa::detail::query_block_order(4, 16384, 16, 128, causal, 132).section, 1);  // 128 blocks a pair
  EXPECT_EQ(kfa::detail::query_block_order(4, 4096, 16, 128, causal, 0).section, 1);     // no CUDA device
  const kfa::detail::BlockOrder c = kfa::detail::query_block_order(1, 256, 2, 128, causal, 132);
  EXPECT_EQ(c.blocks, 2);
  EXPECT_EQ(c.pairs, 2);
  EXPECT_EQ(c.section, 2);
}

// With documents the blocks follow them (cuda/block_order.hpp): over every league rank of a launch, each row of
// the launch is in exactly one block of each pair, every block lies inside one document and holds at most a
// block's rows, and at most one block per document and pair is empty; for a whole packed batch and for windows of it (a
// ring shard's rows, documents cut at both ends), for empty documents, lengths off the tile grid and one long one.
TEST(Paths, DocumentAlignedBlocks) {
  const std::vector<std::vector<int>> length_sets = {{2451, 387, 1770, 0, 205, 64, 1, 128, 129, 6985, 0, 88},
                                                     {5},
                                                     {0, 300, 0},
                                                     {128, 128, 128},
                                                     {1, 1, 1, 1, 1, 1, 1}};
  for (const auto& lengths : length_sets) {
    std::vector<int> cu(1, 0);
    for (int len : lengths) cu.push_back(cu.back() + len);
    const int total = cu.back(), docs = static_cast<int>(lengths.size());
    kfa::detail::Positions pos;
    pos.docs = kfa::detail::Documents{cu.data(), cu.data(), docs, 0};
    for (int size : {64, 128, 192})
      for (const auto& window : std::vector<std::pair<int, int>>{{0, total}, {total / 3, total / 2}, {1, total - 1}}) {
        const int begin = window.first, extent = window.second - window.first;
        if (extent <= 0) continue;
        pos.q_begin = pos.k_begin = begin;
        pos.q_total = pos.k_total = total;
        const kfa::detail::KeyMask mask(extent, extent, pos, true, -1, -1);
        const kfa::detail::BlockOrder qo = kfa::detail::query_block_order(1, extent, 2, size, mask, 132);
        const kfa::detail::BlockOrder ko = kfa::detail::key_block_order(1, extent, 2, size, mask, 132);
        EXPECT_EQ(qo.blocks, extent / size + docs);
        for (const kfa::detail::BlockOrder* o : {&qo, &ko}) {
          std::vector<int> seen(2 * static_cast<std::size_t>(extent), 0);
          int empty = 0;
          for (int r = 0; r < o->league(); ++r) {
            int pair, first, count;
            if (o == &qo) {
              const kfa::detail::QueryBlock q(r, *o, 2, 1, size, extent);
              pair = q.h, first = q.i0, count = q.rows;
            } else {
              const kfa::detail::KeyBlock k(r, *o, 2, size, extent);
              pair = k.hk, first = k.k0, count = k.keys;
            }
            const std::string what = "lengths " + std::to_string(docs) + " size " + std::to_string(size) + " begin " +
                                     std::to_string(begin) + " r " + std::to_string(r);
            if (count <= 0) {
              ++empty;
              continue;
            }
            ASSERT_LE(count, size) << what;
            ASSERT_TRUE(first >= 0 && first + count <= extent) << what << " first " << first << " count " << count;
            const int s = mask.document_of(cu.data(), begin + first);
            EXPECT_LE(begin + first + count, cu[static_cast<std::size_t>(s) + 1]) << what << " straddles";
            for (int i = first; i < first + count; ++i) ++seen[static_cast<std::size_t>(pair) * extent + i];
          }
          EXPECT_LE(empty, 2 * docs) << "size " << size;  // two pairs, at most one empty block a document each
          for (std::size_t i = 0; i < seen.size(); ++i)
            ASSERT_EQ(seen[i], 1) << "row " << i % extent << " size " << size;
        }
      }
  }
}

// The document search the blocks take their document from (last_where: eight probes a step) against a linear scan:
// random bounds with empty documents, every position from before the first to past the last, and the documents a
// range of positions meets (span_of, which skips the second search when the range ends in its first document).
TEST(Paths, DocumentSearchMatchesALinearScan) {
  const std::uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  for (int count : {1, 2, 8, 9, 10, 80, 81, 82, 700, 5000}) {
    std::vector<int> cu(1, static_cast<int>(rng() % 3));
    for (int s = 0; s < count; ++s) cu.push_back(cu.back() + (rng() % 4 == 0 ? 0 : static_cast<int>(rng() % 40)));
    kfa::detail::KeyMask mask;
    mask.docs = kfa::detail::Documents{cu.data(), cu.data(), count, 0};
    auto scan = [&](long x) {  // the last s < count with cu[s] <= x (0 if none)
      int found = 0;
      for (int s = 0; s < count; ++s)
        if (cu[static_cast<std::size_t>(s)] <= x) found = s;
      return found;
    };
    const std::string what = "seed " + std::to_string(seed) + " documents " + std::to_string(count);
    for (long x = -1; x <= cu.back() + 1; ++x) {
      ASSERT_EQ(mask.document_of(cu.data(), x), scan(x)) << what << " x " << x;
      if (x < cu.front() || x >= cu.back()) continue;
      const long x1 = std::min<long>(cu.back() - 1, x + static_cast<long>(rng() % 60));
      const kfa::detail::DocumentSpan span = mask.span_of(cu.data(), x, x1);
      ASSERT_EQ(span.first, scan(x)) << what << " x " << x;
      ASSERT_EQ(span.last, scan(x1) + 1) << what << " x " << x << " x1 " << x1;
    }
  }
}

TEST(Paths, NamesOfPaths) {
  EXPECT_EQ(kfa::to_string(kfa::TileProductPath::automatic), "automatic");
  EXPECT_EQ(kfa::to_string(kfa::TileProductPath::portable), "portable");
  EXPECT_EQ(kfa::to_string(kfa::TileProductPath::tensor_core), "tensor_core");
  EXPECT_EQ(kfa::to_string(kfa::TileProductPath::tensor_core_team), "tensor_core_team");
  EXPECT_EQ(kfa::to_string(kfa::TileProductPath::tensor_core_fa2), "tensor_core_fa2");
  EXPECT_EQ(kfa::to_string(kfa::TileProductPath::simt_fp32), "simt_fp32");
  EXPECT_EQ(kfa::to_string(kfa::TileProductPath::tensor_core_tf32x3), "tensor_core_tf32x3");
  EXPECT_EQ(kfa::to_string(kfa::TileProductPath::tensor_core_wgmma), "tensor_core_wgmma");
}

// plan_forward / plan_backward: the family a call runs, named in its region; a named family that cannot run
// is the same error the call throws.
TYPED_TEST(Paths, PlansNameTheFamilyThatRuns) {
  using T = TypeParam;
  using P = kfa::TileProductPath;
  const int d = 128;
  Tensor<T> q("q", 1, 300, 2, d), k("k", 1, 300, 2, d), v("v", 1, 300, 2, d), o("o", 1, 300, 2, d);
  Tensor<T> d_o("do", 1, 300, 2, d), dq("dq", 1, 300, 2, d), dk("dk", 1, 300, 2, d), dv("dv", 1, 300, 2, d);
  kfa::AttentionOptions opts;
  const kfa::ForwardPlan f = kfa::plan_forward(Exec(), q, k, v, o, opts);
  const kfa::BackwardPlan b = kfa::plan_backward(Exec(), q, k, v, d_o, dq, dk, dv, opts);
  EXPECT_EQ(
      f.region.rfind("kfa::attention_forward[" + kfa::to_string(f.family) + "," + kfa::dtype_name<T>() + ",d128,", 0),
      0u)
      << f.region;
  EXPECT_EQ(b.region.rfind("kfa::attention_backward[" + kfa::to_string(b.family) + ",", 0), 0u) << b.region;
  EXPECT_NE(f.family, P::automatic);
  EXPECT_NE(f.family, P::tensor_core);
  const bool f32cuda = f.family == P::simt_fp32 || f.family == P::tensor_core_tf32x3;  // float on CUDA
  if (kfa::has_tensor_core_path<Exec, T>::value) {
    // wgmma where it runs (sm_90a code on a compute capability 9.0 device), else FA2's layout where the device
    // gives it its shared memory (every sm_80+ GPU but sm_86/89), else the team kernel
    const std::string wgmma_why = kfa::detail::wgmma_forward_why_not(Exec(), d, 300, opts);
    if (wgmma_why.empty()) {
      EXPECT_EQ(f.family, P::tensor_core_wgmma) << f.region;
      EXPECT_EQ(f.tiles.block_q, 128) << f.region;
      // the warp-specialized kernel: a producer warpgroup on top of the two that compute
      EXPECT_EQ(f.tiles.team_size, 384) << f.region;
      kfa::AttentionOptions fa2_tiles;  // FA2's 64-key tiles, which the wgmma forward cannot honour
      fa2_tiles.block_k = 64;
      EXPECT_EQ(kfa::plan_forward(Exec(), q, k, v, o, fa2_tiles).family, P::tensor_core_fa2);
    } else {
      std::printf("[ note ] tensor_core_wgmma cannot run here: %s\n", wgmma_why.c_str());
      EXPECT_TRUE(f.family == P::tensor_core_fa2 || f.family == P::tensor_core_team) << f.region;
      opts.path = P::tensor_core_wgmma;
      try {
        (void)kfa::plan_forward(Exec(), q, k, v, o, opts);
        ADD_FAILURE() << "tensor_core_wgmma planned where it cannot run: " << wgmma_why;
      } catch (const kfa::Error& e) {
        EXPECT_NE(std::string(e.what()).find("opts.path = tensor_core_wgmma but " + wgmma_why), std::string::npos)
            << e.what();
      }
      opts.path = P::automatic;
    }
    EXPECT_EQ(b.family, P::tensor_core);
    // the deterministic backward's kernels: the wgmma ones exactly where they say they can run, and not when
    // opts.path names the FA2-layout family
    const std::string wgmma_bwd_why = kfa::detail::wgmma_backward_why_not(Exec(), d, false, opts);
    EXPECT_EQ(b.wgmma, wgmma_bwd_why.empty()) << b.region << " " << wgmma_bwd_why;
    EXPECT_EQ(b.region.find(",wgmma,") != std::string::npos, b.wgmma) << b.region;
    if (b.wgmma) {
      EXPECT_EQ(b.tiles.dkdv.block_k, 128) << b.region;
      EXPECT_EQ(b.tiles.dkdv.team_size, 256) << b.region;
      EXPECT_EQ(b.tiles.dq.block_q, 128) << b.region;
      EXPECT_EQ(b.tiles.dq.team_size, 32 * kfa::detail::WgmmaWsDqShape<d>::warps) << b.region;
    } else {
      std::printf("[ note ] the wgmma backward cannot run here: %s\n", wgmma_bwd_why.c_str());
    }
    {  // d = 96: the wgmma kernels too, in d = 128's tiles, exactly where they say they can run
      Tensor<T> x("x", 1, 300, 2, 96), y("y", 1, 300, 2, 96), gq("gq", 1, 300, 2, 96), gk("gk", 1, 300, 2, 96),
          gv("gv", 1, 300, 2, 96);
      kfa::AttentionOptions a;
      const kfa::ForwardPlan f96 = kfa::plan_forward(Exec(), x, x, x, y, a);
      const kfa::BackwardPlan b96 = kfa::plan_backward(Exec(), x, x, x, y, gq, gk, gv, a);
      const bool fwd96 = kfa::detail::wgmma_forward_why_not(Exec(), 96, 300, a).empty();
      EXPECT_EQ(f96.family == P::tensor_core_wgmma, fwd96) << f96.region;
      if (fwd96) EXPECT_EQ(f96.tiles.block_q, 128) << f96.region;
      EXPECT_EQ(b96.wgmma, kfa::detail::wgmma_backward_why_not(Exec(), 96, false, a).empty()) << b96.region;
      if (b96.wgmma) EXPECT_EQ(b96.tiles.dkdv.block_k, 128) << b96.region;
    }
    opts.path = P::tensor_core_fa2;
    EXPECT_FALSE(kfa::plan_backward(Exec(), q, k, v, d_o, dq, dk, dv, opts).wgmma);
    opts.path = P::tensor_core_team;
    EXPECT_EQ(kfa::plan_forward(Exec(), q, k, v, o, opts).family, P::tensor_core_team);
    kfa::AttentionOptions blocks;  // the team kernel's tiles, which FA2's layout cannot honour
    blocks.block_q = 64;
    blocks.block_k = 64;
    EXPECT_EQ(kfa::plan_forward(Exec(), q, k, v, o, blocks).family, P::tensor_core_team);
  } else {
    EXPECT_TRUE(f.family == P::portable || f32cuda) << f.region;
    // float on CUDA: the 3xTF32 backward exactly where it says it can run, else the SIMT one
    const bool tf32_bwd = kfa::detail::tf32_backward_why_not(Exec(), q, k, v, d_o, dq, dk, dv, opts).empty();
    EXPECT_EQ(b.family, !f32cuda ? P::portable : tf32_bwd ? P::tensor_core_tf32x3 : P::simt_fp32) << b.region;
    // float on CUDA: 3xTF32 tensor cores exactly where that kernel says it can run, else the SIMT kernel
    if (f32cuda)
      EXPECT_EQ(f.family, kfa::detail::tf32_forward_why_not(Exec(), q, k, v, o, opts).empty() ? P::tensor_core_tf32x3
                                                                                              : P::simt_fp32)
          << kfa::detail::tf32_forward_why_not(Exec(), q, k, v, o, opts);
    for (P p : {P::tensor_core, P::tensor_core_team, P::tensor_core_fa2, P::tensor_core_wgmma}) {
      opts.path = p;
      try {
        (void)kfa::plan_forward(Exec(), q, k, v, o, opts);
        ADD_FAILURE() << kfa::to_string(p) << " planned where it cannot run";
      } catch (const kfa::Error& e) {
        EXPECT_NE(std::string(e.what()).find("opts.path = " + kfa::to_string(p) + " but "), std::string::npos)
            << e.what();
      }
    }
  }
  // The fp32 families by name: each forward exactly where it runs (the SIMT one for float on CUDA, the 3xTF32
  // one where automatic picked it), each backward likewise (the 3xTF32 one where its why_not is ""); elsewhere
  // the error names the family.
  for (P p : {P::simt_fp32, P::tensor_core_tf32x3}) {
    opts.path = p;
    const std::string expect = "opts.path = " + kfa::to_string(p) + " but ";
    if (p == P::simt_fp32 ? f32cuda : f.family == p) {
      EXPECT_EQ(kfa::plan_forward(Exec(), q, k, v, o, opts).family, p);
    } else {
      try {
        (void)kfa::plan_forward(Exec(), q, k, v, o, opts);
        ADD_FAILURE() << kfa::to_string(p) << " planned for " << kfa::dtype_name<T>() << " on " << Exec::name();
      } catch (const kfa::Error& e) {
        EXPECT_NE(std::string(e.what()).find(expect), std::string::npos) << e.what();
      }
    }
    const bool bwd_runs = p == P::simt_fp32
                              ? f32cuda
                              : kfa::detail::tf32_backward_why_not(Exec(), q, k, v, d_o, dq, dk, dv, opts).empty();
    if (bwd_runs) {
      EXPECT_EQ(kfa::plan_backward(Exec(), q, k, v, d_o, dq, dk, dv, opts).family, p);
    } else {
      try {
        (void)kfa::plan_backward(Exec(), q, k, v, d_o, dq, dk, dv, opts);
        ADD_FAILURE() << kfa::to_string(p) << " backward planned for " << kfa::dtype_name<T>() << " on "
                      << Exec::name();
      } catch (const kfa::Error& e) {
        EXPECT_NE(std::string(e.what()).find(expect), std::string::npos) << e.what();
      }
    }
  }
  opts.path = P::portable;
  EXPECT_EQ(kfa::plan_forward(Exec(), q, k, v, o, opts).family, P::portable);
  // deterministic = false: atomic dQ only in the tensor-core backward, named in its region
  kfa::AttentionOptions nondet;
  nondet.deterministic = false;
  const kfa::BackwardPlan nb = kfa::plan_backward(Exec(), q, k, v, d_o, dq, dk, dv, nondet);
  EXPECT_FALSE(b.atomic_dq) << b.region;
  EXPECT_EQ(nb.family, b.family);
  // (d = 128: not where the wgmma backward runs, whose two deterministic kernels are as fast)
  EXPECT_EQ(nb.atomic_dq, b.family == P::tensor_core && !b.wgmma) << nb.region;
  if (b.wgmma) EXPECT_TRUE(nb.wgmma) << nb.region;
  EXPECT_EQ(nb.region.find(",atomic_dq,") != std::string::npos, nb.atomic_dq) << nb.region;
  if (nb.family == P::tensor_core) {
    kfa::AttentionOptions fa2_path;  // the kernels below by name where automatic takes the wgmma ones
    fa2_path.path = P::tensor_core_fa2;
    const kfa::BackwardPlan bf = b.wgmma ? kfa::plan_backward(Exec(), q, k, v, d_o, dq, dk, dv, fa2_path) : b;
    EXPECT_FALSE(bf.wgmma) << bf.region;
    fa2_path.deterministic = false;
    const kfa::BackwardPlan nbf = b.wgmma ? kfa::plan_backward(Exec(), q, k, v, d_o, dq, dk, dv, fa2_path) : nb;
    EXPECT_TRUE(nbf.atomic_dq) << nbf.region;  // d = 128: atomic dQ pays against the FA2-layout kernels
    // the FA2-layout dK/dV kernel (8 warps, 128 keys) exactly where tc_fa2_backward_used says so and
    // the device gives it its shared memory, else the 16-keys-per-warp kernel; the plan names the tiles of
    // the one that runs
    for (const kfa::BackwardPlan* pl : {&bf, &nbf}) {
      const bool fused = pl == &nbf;
      const bool fa2 = kfa::detail::tc_fa2_backward_runs(Exec(), d, fused);
      const bool used =
          fused ? kfa::detail::tc_fa2_backward_used<d, true>() : kfa::detail::tc_fa2_backward_used<d, false>();
      EXPECT_EQ(fa2, used && kfa::detail::native_smem_max(Exec()) >=
                                 (fused ? kfa::detail::Fa2BackwardShape<d, true>::dkdv_scratch
                                        : kfa::detail::Fa2BackwardShape<d, false>::dkdv_scratch));
      EXPECT_EQ(pl->fa2_dkdv, fa2) << pl->region;  // the launch runs what the plan names
      EXPECT_EQ(pl->tiles.dkdv.block_k, fa2 ? 128 : 64) << pl->region;
      EXPECT_EQ(pl->tiles.dkdv.team_size, fa2 ? 256 : 128) << pl->region;
    }
    // the deterministic dQ kernel, where the wgmma one does not run (checked above): FA2's layout (128 rows,
    // 4 warps) exactly where the device gives it its shared memory, else TcDqKernel (64 rows)
    const bool fa2_dq = kfa::detail::fa2_dq_problem(Exec(), d).empty();
    EXPECT_EQ(fa2_dq, kfa::detail::native_smem_max(Exec()) >= kfa::detail::Fa2DqShape<d>::smem);
    EXPECT_EQ(bf.fa2_dq, fa2_dq) << bf.region;
    EXPECT_EQ(bf.tiles.dq.block_q, fa2_dq ? 128 : 64) << bf.region;
    EXPECT_EQ(bf.tiles.dq.block_k, fa2_dq ? kfa::detail::Fa2DqShape<d>::block_k : 32) << bf.region;
    EXPECT_EQ(bf.tiles.dq.team_size, 128) << bf.region;
  }
  // d = 64: dQ fused into the wgmma dK/dV kernel where that runs; else only where the FA2-layout dQ kernel
  // cannot run (the two-kernel backward is the faster)
  {
    Tensor<T> q6("q", 1, 300, 2, 64), k6("k", 1, 300, 2, 64), v6("v", 1, 300, 2, 64), do6("do", 1, 300, 2, 64),
        dq6("dq", 1, 300, 2, 64), dk6("dk", 1, 300, 2, 64), dv6("dv", 1, 300, 2, 64);
    const kfa::BackwardPlan b6 = kfa::plan_backward(Exec(), q6, k6, v6, do6, dq6, dk6, dv6, nondet);
    EXPECT_EQ(b6.atomic_dq,
              b6.family == P::tensor_core && (b6.wgmma || !kfa::detail::fa2_dq_problem(Exec(), 64).empty()))
        << b6.region;
    EXPECT_EQ(b6.wgmma,
              b6.family == P::tensor_core && kfa::detail::wgmma_backward_why_not(Exec(), 64, true, nondet).empty())
        << b6.region;
  }
  nondet.path = P::portable;
  EXPECT_FALSE(kfa::plan_backward(Exec(), q, k, v, d_o, dq, dk, dv, nondet).atomic_dq);
}

// deterministic = false changes nothing in the families without an atomic path: the portable backward
// gives bitwise the same gradients either way.
TYPED_TEST(Paths, NondeterministicOptionLeavesPortableBitwiseEqual) {
  using T = TypeParam;
  const Shape s{1, 70, 90, 4, 2, 64};
  const std::uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  Tensor<T> q("q", s.batch, s.seq_q, s.heads_q, s.head_dim), k("k", s.batch, s.seq_k, s.heads_kv, s.head_dim),
      v("v", s.batch, s.seq_k, s.heads_kv, s.head_dim), d_o("do", s.batch, s.seq_q, s.heads_q, s.head_dim);
  fill_random(q, rng), fill_random(k, rng), fill_random(v, rng), fill_random(d_o, rng);
  kfa::AttentionOptions opts;
  opts.causal = true;
  const ::Run<T> a = run_path(s, q, k, v, d_o, opts, kfa::TileProductPath::portable);
  opts.deterministic = false;
  const ::Run<T> b = run_path(s, q, k, v, d_o, opts, kfa::TileProductPath::portable);
  EXPECT_EQ(to_doubles4(a.dq), to_doubles4(b.dq));
  EXPECT_EQ(to_doubles4(a.dk), to_doubles4(b.dk));
  EXPECT_EQ(to_doubles4(a.dv), to_doubles4(b.dv));
}

// Canonical views (src/kfa/detail/common/canonical.hpp): a call's Views are converted to one of two View sets before a
// family is chosen, so const-ness, Device<> spellings, memory traits and layout mixes share the kernels'
// instantiations (checked at compile time here), and each spelling computes bitwise what the LayoutRight
// call does, forward and backward (automatic path).
namespace {
template <class T>
using Const4 = Kokkos::View<const T****, Kokkos::LayoutRight, Mem>;
template <class T>
using Dev4 = Kokkos::View<T****, Kokkos::LayoutRight, Kokkos::Device<Exec, Mem>>;
template <class T>
using Unm4 = Kokkos::View<T****, Kokkos::LayoutRight, Mem, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
template <class T>
using Str4 = Kokkos::View<T****, Kokkos::LayoutStride, Mem>;
template <class T>
using Left4 = Kokkos::View<T****, Kokkos::LayoutLeft, Mem>;
template <class QV, class KV, class VV, class OV>
using FwdCall = decltype(kfa::detail::forward_call(
    "", std::declval<const Exec&>(), std::declval<const QV&>(), std::declval<const KV&>(), std::declval<const VV&>(),
    std::declval<const OV&>(), std::declval<const kfa::AttentionOptions&>()));
template <class QV, class DQV>
using BwdCall = decltype(kfa::detail::backward_call(
    "", std::declval<const Exec&>(), std::declval<const QV&>(), std::declval<const QV&>(), std::declval<const QV&>(),
    std::declval<const QV&>(), std::declval<const DQV&>(), std::declval<const DQV&>(), std::declval<const DQV&>(),
    std::declval<const kfa::AttentionOptions&>()));
template <class T>
constexpr bool canonical_types_shared() {
  using R = Tensor<T>;
  using FR = FwdCall<R, R, R, R>;
  using FS = FwdCall<Str4<T>, Str4<T>, Str4<T>, Str4<T>>;
  return std::is_same<FR, FwdCall<Const4<T>, Const4<T>, Const4<T>, R>>::value &&
         std::is_same<FR, FwdCall<Dev4<T>, Const4<T>, R, Unm4<T>>>::value &&
         std::is_same<FR, FwdCall<Unm4<T>, Dev4<T>, Const4<T>, Dev4<T>>>::value &&
         std::is_same<FS, FwdCall<Str4<T>, R, R, R>>::value &&
         std::is_same<FS, FwdCall<R, Const4<T>, R, Str4<T>>>::value &&
         std::is_same<FS, FwdCall<Left4<T>, Dev4<T>, R, Unm4<T>>>::value && !std::is_same<FR, FS>::value &&
         std::is_same<BwdCall<R, R>, BwdCall<Const4<T>, Unm4<T>>>::value &&
         std::is_same<BwdCall<R, R>, BwdCall<Dev4<T>, Dev4<T>>>::value &&
         std::is_same<BwdCall<Str4<T>, R>, BwdCall<R, Str4<T>>>::value &&
         std::is_same<BwdCall<Str4<T>, R>, BwdCall<Left4<T>, Unm4<T>>>::value;
}
}  // namespace

TYPED_TEST(Paths, CanonicalViewsShareInstantiationsAndResults) {
  using T = TypeParam;
  static_assert(canonical_types_shared<T>(), "kfa: View spellings must map to the two canonical View sets");
  const Shape s{2, 150, 130, 4, 2, 64};
  const std::uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  Tensor<T> q("q", s.batch, s.seq_q, s.heads_q, s.head_dim), k("k", s.batch, s.seq_k, s.heads_kv, s.head_dim),
      v("v", s.batch, s.seq_k, s.heads_kv, s.head_dim), d_o("do", s.batch, s.seq_q, s.heads_q, s.head_dim);
  fill_random(q, rng), fill_random(k, rng), fill_random(v, rng), fill_random(d_o, rng);
  kfa::AttentionOptions opts;
  opts.causal = true;
  const ::Run<T> a = run_path(s, q, k, v, d_o, opts, kfa::TileProductPath::automatic);
  for (int spelling = 0; spelling < 2; ++spelling) {
    SCOPED_TRACE(spelling == 0 ? "const / Device<> / Unmanaged LayoutRight Views" : "q, o and dq as LayoutStride");
    ::Run<T> b{Tensor<T>("o", s.batch, s.seq_q, s.heads_q, s.head_dim),
               Tensor<T>("dq", s.batch, s.seq_q, s.heads_q, s.head_dim),
               Tensor<T>("dk", s.batch, s.seq_k, s.heads_kv, s.head_dim),
               Tensor<T>("dv", s.batch, s.seq_k, s.heads_kv, s.head_dim), Lse<T>("lse", s.batch, s.heads_q, s.seq_q)};
    poison(b.o), poison(b.lse), poison(b.dq), poison(b.dk), poison(b.dv);
    if (spelling == 0) {
      const Const4<T> qc = q, kc = k;
      const Dev4<T> vd = v, od = b.o;
      const Unm4<T> dqu(b.dq.data(), s.batch, s.seq_q, s.heads_q, s.head_dim);
      kfa::attention_forward(Exec(), qc, kc, vd, od, b.lse, opts);
      const Kokkos::View<const kfa::accumulator_t<T>***, Kokkos::LayoutRight, Mem> lse_c = b.lse;  // inputs here
      kfa::attention_backward(Exec(), qc, kc, vd, Const4<T>(b.o), Const4<T>(d_o), lse_c, dqu, b.dk, Dev4<T>(b.dv),
                              opts);
    } else {
      const Str4<T> qs = q, os = b.o, dqs = b.dq;
      kfa::attention_forward(Exec(), qs, k, v, os, b.lse, opts);
      kfa::attention_backward(Exec(), qs, k, v, os, d_o, b.lse, dqs, b.dk, b.dv, opts);
    }
    Exec().fence();
    EXPECT_TRUE(same_bits(a.o, b.o));
    EXPECT_EQ(to_doubles3(a.lse), to_doubles3(b.lse));
    EXPECT_TRUE(same_bits(a.dq, b.dq));
    EXPECT_TRUE(same_bits(a.dk, b.dk));
    EXPECT_TRUE(same_bits(a.dv, b.dv));
  }
}
