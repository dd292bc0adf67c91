// Variable-length batches (attention_forward_varlen / attention_backward_varlen): packed sequences against the
// float64 reference applied sequence by sequence, through every kernel family this build can run; equal to the
// fixed-length API called per sequence; argument errors.
#include "../common/kfa_test.hpp"

#include <cstring>

using namespace kfa_test;

template <class T>
class Varlen : public ::testing::Test {};
TYPED_TEST_SUITE(Varlen, Dtypes, DtypeNames);

namespace {
template <class T>
using Packed = Kokkos::View<T***, Kokkos::LayoutRight, Mem, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
template <class T>
using PackedLse = Kokkos::View<kfa::accumulator_t<T>**, Kokkos::LayoutRight, Mem>;
using Cu = Kokkos::View<int*, Mem>;

std::vector<int> prefix_sums(const std::vector<int>& len) {
  std::vector<int> cu(len.size() + 1, 0);
  for (size_t s = 0; s < len.size(); ++s) cu[s + 1] = cu[s] + len[s];
  return cu;
}

Cu to_device(const std::vector<int>& cu) {
  Cu d("cu_seqlens", cu.size());
  auto h = Kokkos::create_mirror_view(Kokkos::HostSpace(), d);
  for (size_t s = 0; s < cu.size(); ++s) h(s) = cu[s];
  Kokkos::deep_copy(d, h);
  return d;
}

// The packed tensors of one check ([1, total, heads, d] storage, passed to the API as [total, heads, d]) and
// their float64 copies.
template <class T>
struct VarProblem {
  int hq, hkv, d;
  std::vector<int> cq, ck;
  long max_q = 0, max_k = 0;
  Tensor<T> q, k, v, o, d_o, dq, dk, dv;
  PackedLse<T> lse;
  Cu cu_q, cu_k;
  std::vector<double> qh, kh, vh, doh;
  VarProblem(const std::vector<int>& lq, const std::vector<int>& lk, int hq_, int hkv_, int d_, std::mt19937_64& rng,
             double sigma = 1.0)
      : hq(hq_), hkv(hkv_), d(d_), cq(prefix_sums(lq)), ck(prefix_sums(lk)) {
    for (int x : lq) max_q = std::max<long>(max_q, x);
    for (int x : lk) max_k = std::max<long>(max_k, x);
    const int tq = cq.back(), tk = ck.back();
    q = Tensor<T>("q", 1, tq, hq, d), o = Tensor<T>("o", 1, tq, hq, d), d_o = Tensor<T>("do", 1, tq, hq, d);
    dq = Tensor<T>("dq", 1, tq, hq, d);
    k = Tensor<T>("k", 1, tk, hkv, d), v = Tensor<T>("v", 1, tk, hkv, d);
    dk = Tensor<T>("dk", 1, tk, hkv, d), dv = Tensor<T>("dv", 1, tk, hkv, d);
    lse = PackedLse<T>("lse", hq, tq);
    cu_q = to_device(cq), cu_k = to_device(ck);
    qh = fill_random(q, rng, sigma), kh = fill_random(k, rng, sigma), vh = fill_random(v, rng);
    doh = fill_random(d_o, rng);
  }
  static Packed<T> p3(const Tensor<T>& x) { return Packed<T>(x.data(), x.extent(1), x.extent(2), x.extent(3)); }
  void forward(const kfa::AttentionOptions& opts) {
    poison(o), poison(lse);
    kfa::attention_forward_varlen(Exec(), p3(q), p3(k), p3(v), p3(o), lse, cu_q, cu_k, max_q, max_k, opts);
  }
  void backward(const kfa::AttentionOptions& opts) {
    poison(dq), poison(dk), poison(dv);
    kfa::attention_backward_varlen(Exec(), p3(q), p3(k), p3(v), p3(o), p3(d_o), lse, p3(dq), p3(dk), p3(dv), cu_q, cu_k,
                                   max_q, max_k, opts);
    Exec().fence();
  }
};

// The float64 reference of a packed batch: the tests' reference attention on each sequence alone.
struct Reference {
  std::vector<double> o, lse, dq, dk, dv;  // o, dq [total_q, hq, d]; dk, dv [total_k, hkv, d]; lse [hq, total_q]
};
template <class T>
Reference reference_varlen(const VarProblem<T>& p, const RefOptions& ro) {
  const int hq = p.hq, hkv = p.hkv, d = p.d, tq = p.cq.back();
  Reference r;
  r.o.assign(size_t(tq) * hq * d, 0.0), r.dq.assign(r.o.size(), 0.0);
  r.dk.assign(size_t(p.ck.back()) * hkv * d, 0.0), r.dv.assign(r.dk.size(), 0.0);
  r.lse.assign(size_t(hq) * tq, 0.0);
  for (size_t s = 0; s + 1 < p.cq.size(); ++s) {
    const int q0 = p.cq[s], k0 = p.ck[s];
    const Shape sh{1, p.cq[s + 1] - q0, p.ck[s + 1] - k0, hq, hkv, d};
    auto slice = [](const std::vector<double>& x, size_t row0, int rows, int width) {
      return std::vector<double>(x.begin() + row0 * width, x.begin() + (row0 + rows) * width);
    };
    const auto qs = slice(p.qh, q0, sh.seq_q, hq * d), dos = slice(p.doh, q0, sh.seq_q, hq * d);
    const auto ks = slice(p.kh, k0, sh.seq_k, hkv * d), vs = slice(p.vh, k0, sh.seq_k, hkv * d);
    std::vector<double> o, lse, dq, dk, dv;
    reference_forward64(sh, ro, qs, ks, vs, o, lse);
    reference_backward64(sh, ro, qs, ks, vs, dos, dq, dk, dv);
    std::copy(o.begin(), o.end(), r.o.begin() + size_t(q0) * hq * d);
    std::copy(dq.begin(), dq.end(), r.dq.begin() + size_t(q0) * hq * d);
    std::copy(dk.begin(), dk.end(), r.dk.begin() + size_t(k0) * hkv * d);
    std::copy(dv.begin(), dv.end(), r.dv.begin() + size_t(k0) * hkv * d);
    for (int h = 0; h < hq; ++h)
      for (int i = 0; i < sh.seq_q; ++i) r.lse[size_t(h) * tq + q0 + i] = lse[size_t(h) * sh.seq_q + i];
  }
  return r;
}

template <class V>
std::vector<double> to_doubles2(const V& x) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), x);
  std::vector<double> out;
  for (size_t a = 0; a < x.extent(0); ++a)
    for (size_t b = 0; b < x.extent(1); ++b) out.push_back(static_cast<double>(h(a, b)));
  return out;
}

std::string describe_lengths(const std::vector<int>& lq, const std::vector<int>& lk) {
  std::ostringstream os;
  os << lq.size() << " sequences, (seq_q, seq_k):";
  for (size_t s = 0; s < lq.size() && s < 24; ++s) os << " (" << lq[s] << "," << lk[s] << ")";
  if (lq.size() > 24) os << " ...";
  return os.str();
}

const kfa::TileProductPath every_path[] = {
    kfa::TileProductPath::automatic,         kfa::TileProductPath::portable,
    kfa::TileProductPath::tensor_core_team,  kfa::TileProductPath::tensor_core_fa2,
    kfa::TileProductPath::tensor_core_wgmma, kfa::TileProductPath::simt_fp32,
    kfa::TileProductPath::tensor_core_tf32x3};

// Forward and backward of a packed batch against the float64 reference, through every kernel family this build
// can run on these inputs (the plan functions say which; automatic and portable always can).
template <class T>
void check_varlen(const std::vector<int>& lq, const std::vector<int>& lk, int hq, int hkv, int d, const RefOptions& ro,
                  double sigma = 1.0) {
  const std::uint64_t seed = fresh_seed();
  SCOPED_TRACE(describe(Shape{1, 0, 0, hq, hkv, d}, ro, seed) + "; " + describe_lengths(lq, lk));
  std::mt19937_64 rng(seed);
  VarProblem<T> p(lq, lk, hq, hkv, d, rng, sigma);
  const Reference ref = reference_varlen(p, ro);
  int ran = 0;
  for (const kfa::TileProductPath path : every_path) {
    kfa::AttentionOptions opts = to_kfa(ro);
    opts.path = path;
    std::string family;
    try {
      family =
          kfa::to_string(kfa::plan_forward_varlen(Exec(), p.p3(p.q), p.p3(p.k), p.p3(p.v), p.p3(p.o), opts).family);
      (void)kfa::plan_backward_varlen(Exec(), p.p3(p.q), p.p3(p.k), p.p3(p.v), p.p3(p.d_o), p.p3(p.dq), p.p3(p.dk),
                                      p.p3(p.dv), opts);
    } catch (const kfa::Error&) {
      continue;  // this family cannot run these inputs here (its plan says why)
    }
    SCOPED_TRACE("opts.path = " + kfa::to_string(path) + " (forward family " + family + ")");
    ++ran;
    p.forward(opts);
    p.backward(opts);
    const double tol = tolerance<T>();
    EXPECT_TRUE(close_frobenius(to_doubles4(p.o), ref.o, tol)) << "o";
    EXPECT_TRUE(close_lse(to_doubles2(p.lse), ref.lse, tol)) << "lse";
    EXPECT_TRUE(close_frobenius(to_doubles4(p.dq), ref.dq, tol)) << "dq";
    EXPECT_TRUE(close_frobenius(to_doubles4(p.dk), ref.dk, tol)) << "dk";
    EXPECT_TRUE(close_frobenius(to_doubles4(p.dv), ref.dv, tol)) << "dv";
    // deterministic = false where it changes the kernels (dQ accumulated with atomics in the dK/dV kernel)
    opts.deterministic = false;
    if (kfa::plan_backward_varlen(Exec(), p.p3(p.q), p.p3(p.k), p.p3(p.v), p.p3(p.d_o), p.p3(p.dq), p.p3(p.dk),
                                  p.p3(p.dv), opts)
            .atomic_dq) {
      p.backward(opts);
      EXPECT_TRUE(close_frobenius(to_doubles4(p.dq), ref.dq, tol)) << "atomic dq";
      EXPECT_TRUE(close_frobenius(to_doubles4(p.dk), ref.dk, tol)) << "atomic dk";
      EXPECT_TRUE(close_frobenius(to_doubles4(p.dv), ref.dv, tol)) << "atomic dv";
    }
  }
  EXPECT_GE(ran, 2) << "automatic and portable always run";
}

RefOptions causal() {
  RefOptions r;
  r.causal = true;
  return r;
}
RefOptions window(int left, int right) {
  RefOptions r;
  r.window_left = left, r.window_right = right;
  return r;
}
}  // namespace

TYPED_TEST(Varlen, EveryMask) {
  const std::vector<int> lens = {1, 7, 0, 64, 130, 33, 65};
  check_varlen<TypeParam>(lens, lens, 2, 2, 64, {});
  check_varlen<TypeParam>(lens, lens, 2, 2, 64, causal());
  check_varlen<TypeParam>(lens, lens, 2, 2, 64, window(20, 3));
  RefOptions sliding = window(16, 0);
  sliding.causal = true;
  check_varlen<TypeParam>(lens, lens, 2, 1, 64, sliding);
  RefOptions sc;
  sc.softcap = 5.0, sc.causal = true;
  check_varlen<TypeParam>(lens, lens, 2, 2, 64, sc, 2.0);
}

TYPED_TEST(Varlen, AnotherSequencesNonFiniteRowsStayOutOfTheForward) {
  // Host forwards read a key tile in place when its rows exist, so a block of sequence 0 reads sequence 1's first
  // key rows too: their scores must be masked and P·V must stop at sequence 0's keys. With every query block
  // inside one sequence (lengths multiples of block_q; a block spanning two sequences may carry a value row's NaN
  // to the other's rows, as NonFinite states for V within a tile), NaN and inf in every key and value row of
  // sequence 1 leave the o and lse of sequences 0 and 2 bit for bit as with finite rows, under every mask.
  using T = TypeParam;
  const std::uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const std::vector<int> lens = {96, 144, 48};
  for (const RefOptions& ro : {RefOptions{}, causal(), window(20, 3)}) {
    SCOPED_TRACE(describe(Shape{1, 0, 0, 2, 1, 64}, ro, seed));
    VarProblem<T> p(lens, lens, 2, 1, 64, rng);
    kfa::AttentionOptions opts = to_kfa(ro);
    opts.block_q = 16;
    p.forward(opts);
    Exec().fence();
    const auto o_clean = to_doubles4(p.o), lse_clean = to_doubles2(p.lse);
    for (auto* x : {&p.k, &p.v}) {
      auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), *x);
      for (int j = p.ck[1]; j < p.ck[2]; ++j)
        for (int c = 0; c < p.d; ++c)
          h(0, j, 0, c) = static_cast<T>(c % 3 == 0   ? std::numeric_limits<double>::quiet_NaN()
                                         : c % 3 == 1 ? std::numeric_limits<double>::infinity()
                                                      : -std::numeric_limits<double>::infinity());
      Kokkos::deep_copy(*x, h);
    }
    p.forward(opts);
    Exec().fence();
    const auto o = to_doubles4(p.o), lse = to_doubles2(p.lse);
    const size_t width = size_t(p.hq) * p.d, tq = size_t(p.cq.back());
    for (int s : {0, 2})
      for (int i = p.cq[s]; i < p.cq[s + 1]; ++i) {
        for (size_t c = 0; c < width; ++c)
          ASSERT_EQ(o[i * width + c], o_clean[i * width + c]) << "o, sequence " << s << ", row " << i;
        for (int h = 0; h < p.hq; ++h)
          ASSERT_EQ(lse[h * tq + i], lse_clean[h * tq + i]) << "lse, sequence " << s << ", row " << i;
      }
  }
}

TYPED_TEST(Varlen, AnotherSequencesNonFiniteRowsStayOutOfEveryFamily) {
  // Every family that can run (the plan's own tiles, the tensor-core ones on GPUs), forward and backward: NaN and
  // inf in every row of sequence 1's q, k, v and dO leave o, lse, dq, dk and dv of sequences 0 and 2 bit for bit as
  // with finite rows (dq of deterministic = false: finite and close). The lengths are no multiple of any kernel's
  // tiles or vector steps, so blocks span two or three sequences (portable family) or a block's last key or query
  // tile reads the next sequence's first rows (the CUDA families), masked: 0·inf must not reach the other rows.
  // The wgmma family's TMA loads bring those rows in with their values; it zeroes them in shared memory
  // (docs/kernels.md, "Variable-length batches").
  using T = TypeParam;
  const std::uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  for (const int d : {64, 128})
    for (const std::vector<int>& lens : {std::vector<int>{200, 144, 88}, std::vector<int>{77, 3, 51}})
      for (const RefOptions& ro : {RefOptions{}, causal(), window(40, 24)}) {
        for (const kfa::TileProductPath path : every_path) {
          SCOPED_TRACE(describe(Shape{1, 0, 0, 2, 1, d}, ro, seed) + "; " + describe_lengths(lens, lens) +
                       "; opts.path = " + kfa::to_string(path));
          VarProblem<T> p(lens, lens, 2, 1, d, rng);  // for the plans
          kfa::AttentionOptions opts = to_kfa(ro);
          opts.path = path;
          std::string family;
          try {
            family = kfa::to_string(
                kfa::plan_forward_varlen(Exec(), p.p3(p.q), p.p3(p.k), p.p3(p.v), p.p3(p.o), opts).family);
            (void)kfa::plan_backward_varlen(Exec(), p.p3(p.q), p.p3(p.k), p.p3(p.v), p.p3(p.d_o), p.p3(p.dq),
                                            p.p3(p.dk), p.p3(p.dv), opts);
          } catch (const kfa::Error&) {
            continue;  // this family cannot run these inputs here
          }
          SCOPED_TRACE("forward family " + family);
          for (const bool deterministic : {true, false}) {
            opts.deterministic = deterministic;
            SCOPED_TRACE(deterministic ? "deterministic" : "deterministic = false");
            VarProblem<T> run(lens, lens, 2, 1, d, rng);
            run.forward(opts);
            run.backward(opts);
            const auto o0 = to_doubles4(run.o), lse0 = to_doubles2(run.lse);
            const auto dq0 = to_doubles4(run.dq), dk0 = to_doubles4(run.dk), dv0 = to_doubles4(run.dv);
            for (auto* x : {&run.q, &run.k, &run.v, &run.d_o}) {
              auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), *x);
              for (int j = run.ck[1]; j < run.ck[2]; ++j)
                for (int hh = 0; hh < static_cast<int>(h.extent(2)); ++hh)
                  for (int c = 0; c < run.d; ++c)
                    h(0, j, hh, c) = static_cast<T>(c % 3 == 0   ? std::numeric_limits<double>::quiet_NaN()
                                                    : c % 3 == 1 ? std::numeric_limits<double>::infinity()
                                                                 : -std::numeric_limits<double>::infinity());
              Kokkos::deep_copy(*x, h);
            }
            run.forward(opts);
            run.backward(opts);
            const auto o = to_doubles4(run.o), lse = to_doubles2(run.lse);
            const auto dq = to_doubles4(run.dq), dk = to_doubles4(run.dk), dv = to_doubles4(run.dv);
            const size_t wq = size_t(run.hq) * run.d, wk = size_t(run.hkv) * run.d, tq = size_t(run.cq.back());
            // Elements of sequences 0 and 2 that differ from the clean run's (dQ by atomics, deterministic = false,
            // sums in an order that differs from run to run: finite there, and close below), and the first row.
            auto check = [&](const char* what, const std::vector<double>& got, const std::vector<double>& want,
                             const std::vector<int>& cu, size_t width, bool exact) {
              long bad = 0, first = -1;
              for (int s : {0, 2})
                for (int i = cu[s]; i < cu[s + 1]; ++i)
                  for (size_t c = 0; c < width; ++c) {
                    const double g = got[i * width + c], w = want[i * width + c];
                    if (exact ? !(g == w) : !std::isfinite(g)) first = first < 0 ? i : first, ++bad;
                  }
              EXPECT_EQ(bad, 0) << what << ": " << bad << " elements differ, the first in row " << first;
            };
            check("o", o, o0, run.cq, wq, true);
            check("dq", dq, dq0, run.cq, wq, deterministic);
            check("dk", dk, dk0, run.ck, wk, true);
            check("dv", dv, dv0, run.ck, wk, true);
            std::vector<double> lse_t(lse.size()), lse0_t(lse.size()), dq_rows, dq0_rows;  // lse as [row][head]
            for (size_t i = 0; i < tq; ++i)
              for (int h = 0; h < run.hq; ++h)
                lse_t[i * run.hq + h] = lse[h * tq + i], lse0_t[i * run.hq + h] = lse0[h * tq + i];
            check("lse", lse_t, lse0_t, run.cq, run.hq, true);
            for (int s : {0, 2})
              for (size_t c = size_t(run.cq[s]) * wq; c < size_t(run.cq[s + 1]) * wq; ++c)
                dq_rows.push_back(dq[c]), dq0_rows.push_back(dq0[c]);
            EXPECT_TRUE(close_frobenius(dq_rows, dq0_rows, tolerance<T>())) << "dq of sequences 0 and 2";
          }
        }
      }
}

TYPED_TEST(Varlen, QueryAndKeyLengthsDifferPerSequence) {
  // Bottom-right causal per sequence: where a sequence has more queries than keys its first rows see no key
  // (lse −inf, o and the gradients 0); sequences with queries and no keys, and keys and no queries.
  const std::vector<int> lq = {5, 70, 0, 33, 100, 9, 1}, lk = {9, 40, 12, 0, 128, 9, 200};
  check_varlen<TypeParam>(lq, lk, 2, 2, 64, {});
  check_varlen<TypeParam>(lq, lk, 2, 2, 64, causal());
  check_varlen<TypeParam>(lq, lk, 2, 1, 64, window(8, 8));
}

TYPED_TEST(Varlen, GroupedAndMultiQueryHeads) {
  const std::vector<int> lq = {40, 1, 150, 17}, lk = {40, 3, 150, 90};
  check_varlen<TypeParam>(lq, lk, 4, 2, 64, causal());
  check_varlen<TypeParam>(lq, lk, 3, 1, 128, {});
}

TYPED_TEST(Varlen, HeadDims96And256) {
  // The tensor-core families' other head dims: on Hopper the wgmma kernels (d = 96 in two 64-element panels a row;
  // d = 256's dK/dV warpgroups on the same keys, half of the columns each), the FA2-layout ones by name.
  const std::vector<int> lq = {1, 70, 0, 130, 33}, lk = {9, 70, 12, 130, 64};
  for (int d : {96, 256}) {
    check_varlen<TypeParam>(lq, lk, 2, 1, d, causal());
    check_varlen<TypeParam>(lq, lk, 2, 2, d, {});
  }
}

TYPED_TEST(Varlen, ThousandsOfShortSequencesAndOneLong) {
  std::mt19937_64 rng(fresh_seed());
  std::uniform_int_distribution<int> len(0, 9);
  std::vector<int> lens(1200);
  for (int& x : lens) x = len(rng);
  lens[700] = 300;
  check_varlen<TypeParam>(lens, lens, 2, 1, 64, causal());
}

TYPED_TEST(Varlen, OneSequenceIsTheFixedLengthCall) {
  // One sequence runs exactly the fixed-length kernels (bitwise, on every backend).
  using T = TypeParam;
  for (const bool is_causal : {false, true}) {
    const std::uint64_t seed = fresh_seed();
    SCOPED_TRACE("seed " + std::to_string(seed) + " causal " + std::to_string(is_causal));
    std::mt19937_64 rng(seed);
    VarProblem<T> p({203}, {171}, 2, 1, 64, rng);
    kfa::AttentionOptions opts;
    opts.causal = is_causal;
    p.forward(opts);
    p.backward(opts);
    Tensor<T> o("o", 1, 203, 2, 64), dq("dq", 1, 203, 2, 64), dk("dk", 1, 171, 1, 64), dv("dv", 1, 171, 1, 64);
    Lse<T> lse("lse", 1, 2, 203);
    kfa::attention_forward(Exec(), p.q, p.k, p.v, o, lse, opts);
    kfa::attention_backward(Exec(), p.q, p.k, p.v, o, p.d_o, lse, dq, dk, dv, opts);
    Exec().fence();
    EXPECT_EQ(to_doubles4(o), to_doubles4(p.o));
    EXPECT_EQ(to_doubles3(lse), to_doubles2(p.lse));
    EXPECT_EQ(to_doubles4(dq), to_doubles4(p.dq));
    EXPECT_EQ(to_doubles4(dk), to_doubles4(p.dk));
    EXPECT_EQ(to_doubles4(dv), to_doubles4(p.dv));
  }
}

TYPED_TEST(Varlen, EqualsFixedLengthCallsPerSequence) {
  // Where every sequence starts at a multiple of the kernels' tiles, each block of the packed call covers the
  // rows and keys the fixed-length call on that sequence alone covers, in the same order: bitwise equal on host
  // backends, every mask (elsewhere a block spanning two sequences tiles the second one's keys from another
  // start, which changes the rounding, not the result's accuracy: EveryMask and the tests above).
  using T = TypeParam;
  if constexpr (!Kokkos::SpaceAccessibility<Kokkos::HostSpace, Mem>::accessible) {
    GTEST_SKIP() << "bitwise agreement is checked on host backends";
  } else {
    const std::uint64_t seed = fresh_seed();
    std::mt19937_64 rng(seed);
    // Tiles depend on the lengths: both calls get the same ones through the overrides (and every sequence
    // starts at a multiple of them).
    constexpr int unit = 48;
    const std::vector<int> lq = {unit, 2 * unit, unit}, lk = {2 * unit, unit, unit};
    for (const RefOptions& ro : {RefOptions{}, causal(), window(37, 5)}) {
      SCOPED_TRACE(describe(Shape{1, 0, 0, 2, 1, 64}, ro, seed) + " tile unit " + std::to_string(unit));
      VarProblem<T> p(lq, lk, 2, 1, 64, rng);
      kfa::AttentionOptions opts = to_kfa(ro);
      opts.block_q = 16, opts.block_k = 16;
      p.forward(opts);
      p.backward(opts);
      const auto o = to_doubles4(p.o), dq = to_doubles4(p.dq), dk = to_doubles4(p.dk), dv = to_doubles4(p.dv);
      const auto lse = to_doubles2(p.lse);
      for (size_t s = 0; s < lq.size(); ++s) {
        const int nq = lq[s], nk = lk[s], q0 = p.cq[s], k0 = p.ck[s];
        auto copy_rows = [](const Tensor<T>& x, int r0, int n) {
          Tensor<T> y("seq", 1, n, x.extent(2), x.extent(3));
          Kokkos::deep_copy(y, Kokkos::subview(x, Kokkos::ALL, std::make_pair(r0, r0 + n), Kokkos::ALL, Kokkos::ALL));
          return y;
        };
        const Tensor<T> qs = copy_rows(p.q, q0, nq), ks = copy_rows(p.k, k0, nk), vs = copy_rows(p.v, k0, nk);
        const Tensor<T> dos = copy_rows(p.d_o, q0, nq);
        Tensor<T> os("o", 1, nq, 2, 64), dqs("dq", 1, nq, 2, 64), dks("dk", 1, nk, 1, 64), dvs("dv", 1, nk, 1, 64);
        Lse<T> ls("lse", 1, 2, nq);
        kfa::attention_forward(Exec(), qs, ks, vs, os, ls, opts);
        kfa::attention_backward(Exec(), qs, ks, vs, os, dos, ls, dqs, dks, dvs, opts);
        Exec().fence();
        auto rows_of = [](const std::vector<double>& x, int r0, int n, int width) {
          return std::vector<double>(x.begin() + size_t(r0) * width, x.begin() + size_t(r0 + n) * width);
        };
        EXPECT_EQ(to_doubles4(os), rows_of(o, q0, nq, 2 * 64)) << "o of sequence " << s;
        EXPECT_EQ(to_doubles4(dqs), rows_of(dq, q0, nq, 2 * 64)) << "dq of sequence " << s;
        EXPECT_EQ(to_doubles4(dks), rows_of(dk, k0, nk, 64)) << "dk of sequence " << s;
        EXPECT_EQ(to_doubles4(dvs), rows_of(dv, k0, nk, 64)) << "dv of sequence " << s;
        const auto lsv = to_doubles3(ls);
        for (int h = 0; h < 2; ++h)
          for (int i = 0; i < nq; ++i)
            ASSERT_EQ(lsv[size_t(h) * nq + i], lse[size_t(h) * p.cq.back() + q0 + i]) << "lse of sequence " << s;
      }
    }
  }
}

TYPED_TEST(Varlen, StridedAndLayoutLeftViews) {
  // q, k, v as slices of one packed QKV buffer [total, 3, heads, d] (LayoutStride), o and lse LayoutLeft.
  using T = TypeParam;
  using Acc = kfa::accumulator_t<T>;
  const std::uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const std::vector<int> lens = {30, 0, 77, 1};
  VarProblem<T> p(lens, lens, 2, 2, 64, rng);
  const int total = p.cq.back();
  Kokkos::View<T****, Kokkos::LayoutRight, Mem> qkv("qkv", total, 3, 2, 64);
  Kokkos::deep_copy(Kokkos::subview(qkv, Kokkos::ALL, 0, Kokkos::ALL, Kokkos::ALL), p.p3(p.q));
  Kokkos::deep_copy(Kokkos::subview(qkv, Kokkos::ALL, 1, Kokkos::ALL, Kokkos::ALL), p.p3(p.k));
  Kokkos::deep_copy(Kokkos::subview(qkv, Kokkos::ALL, 2, Kokkos::ALL, Kokkos::ALL), p.p3(p.v));
  const auto qs = Kokkos::subview(qkv, Kokkos::ALL, 0, Kokkos::ALL, Kokkos::ALL);
  const auto ks = Kokkos::subview(qkv, Kokkos::ALL, 1, Kokkos::ALL, Kokkos::ALL);
  const auto vs = Kokkos::subview(qkv, Kokkos::ALL, 2, Kokkos::ALL, Kokkos::ALL);
  Kokkos::View<T***, Kokkos::LayoutLeft, Mem> o("o", total, 2, 64);
  Kokkos::View<Acc**, Kokkos::LayoutLeft, Mem> lse("lse", 2, total);
  poison(o), poison(lse);
  kfa::attention_forward_varlen(Exec(), qs, ks, vs, o, lse, p.cu_q, p.cu_k, p.max_q, p.max_k);
  Exec().fence();
  const Reference ref = reference_varlen(p, RefOptions{});
  Kokkos::View<T***, Kokkos::LayoutRight, Mem> o_right("o_right", total, 2, 64);
  Kokkos::deep_copy(o_right, o);
  const Tensor<T> o4("o4", 1, total, 2, 64);
  Kokkos::deep_copy(p.p3(o4), o_right);
  EXPECT_TRUE(close_frobenius(to_doubles4(o4), ref.o, tolerance<T>()));
  PackedLse<T> lse_right("lse_right", 2, total);
  Kokkos::deep_copy(lse_right, lse);
  EXPECT_TRUE(close_lse(to_doubles2(lse_right), ref.lse, tolerance<T>()));
}

TEST(VarlenErrors, NameTheArgumentAndLeaveOutputsUntouched) {
  std::mt19937_64 rng(fresh_seed());
  VarProblem<float> p({10, 0, 22}, {12, 5, 22}, 2, 1, 64, rng);
  kfa::attention_forward_varlen(Exec(), p.p3(p.q), p.p3(p.k), p.p3(p.v), p.p3(p.o), p.lse, p.cu_q, p.cu_k, p.max_q,
                                p.max_k);
  Exec().fence();
  const auto o_before = to_doubles4(p.o);
  auto expect_error = [&](const std::string& what, const Cu& cu_q, const Cu& cu_k, long max_q, long max_k) {
    try {
      kfa::attention_forward_varlen(Exec(), p.p3(p.q), p.p3(p.k), p.p3(p.v), p.p3(p.o), p.lse, cu_q, cu_k, max_q,
                                    max_k);
      ADD_FAILURE() << "no error; expected one naming " << what;
    } catch (const kfa::Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("kfa::attention_forward_varlen"), std::string::npos) << e.what();
    }
    EXPECT_EQ(to_doubles4(p.o), o_before) << "o changed by a refused call";
  };
  expect_error("cu_seqlens_q decreases: cu_seqlens_q(2) = 5 < cu_seqlens_q(1) = 10", to_device({0, 10, 5, 32}), p.cu_k,
               32, 22);
  expect_error("cu_seqlens_k(0) = 1 but must be 0", p.cu_q, to_device({1, 12, 17, 39}), 22, 22);
  expect_error("cu_seqlens_q(3) = 31 but 32 tokens are in q", to_device({0, 10, 10, 31}), p.cu_k, 22, 22);
  expect_error("cu_seqlens_k(3) = 40 but 39 tokens are in k", p.cu_q, to_device({0, 12, 17, 40}), 22, 23);
  expect_error("cu_seqlens_k.extent(0) = 3 but cu_seqlens_q.extent(0) = 4", p.cu_q, to_device({0, 17, 39}), 22, 22);
  expect_error("max_seqlen_q = 21 but sequence 2 has 22 tokens", p.cu_q, p.cu_k, 21, 22);
  expect_error("max_seqlen_k = -1", p.cu_q, p.cu_k, 22, -1);
  expect_error("cu_seqlens_q is empty", Cu("empty", 0), Cu("empty", 0), 22, 22);

  // Shapes, named as the caller passed them.
  PackedLse<float> bad_lse("lse", 2, 31);
  try {
    kfa::attention_forward_varlen(Exec(), p.p3(p.q), p.p3(p.k), p.p3(p.v), p.p3(p.o), bad_lse, p.cu_q, p.cu_k, 22, 22);
    ADD_FAILURE() << "no error for lse [2, 31]";
  } catch (const kfa::Error& e) {
    EXPECT_NE(std::string(e.what()).find("lse is [2, 31] but must be [heads_q, total_q] = [2, 32]"), std::string::npos)
        << e.what();
  }
  Tensor<float> k3("k3", 1, 39, 3, 64);
  try {
    kfa::attention_forward_varlen(Exec(), p.p3(p.q), p.p3(k3), p.p3(p.v), p.p3(p.o), p.lse, p.cu_q, p.cu_k, 22, 22);
    ADD_FAILURE() << "no error for 3 key heads";
  } catch (const kfa::Error& e) {
    EXPECT_NE(std::string(e.what()).find("v.extent(1) = 1 but k.extent(1) = 3"), std::string::npos) << e.what();
  }
  try {
    kfa::attention_backward_varlen(Exec(), p.p3(p.q), p.p3(p.k), p.p3(p.v), p.p3(p.o), p.p3(p.d_o), p.lse, p.p3(p.dq),
                                   p.p3(p.dq), p.p3(p.dv), p.cu_q, p.cu_k, 22, 22);
    ADD_FAILURE() << "no error for dk shaped like q";
  } catch (const kfa::Error& e) {
    EXPECT_NE(std::string(e.what()).find("dk.extent(0) = 32 but k.extent(0) = 39"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("kfa::attention_backward_varlen"), std::string::npos) << e.what();
  }
  EXPECT_EQ(to_doubles4(p.o), o_before);
}
