// Every bad input throws kfa::Error (a std::invalid_argument) naming the function, the argument and the
// values, before anything is launched: the poisoned outputs stay poisoned.
#include "../common/kfa_test.hpp"

using namespace kfa_test;
using T = float;

namespace {

struct Args {
  Tensor<T> q, k, v, o;
  Lse<T> lse;
  Args(Shape s, Shape out)
      : q("q", s.batch, s.seq_q, s.heads_q, s.head_dim),
        k("k", s.batch, s.seq_k, s.heads_kv, s.head_dim),
        v("v", s.batch, s.seq_k, s.heads_kv, s.head_dim),
        o("o", out.batch, out.seq_q, out.heads_q, out.head_dim),
        lse("lse", out.batch, out.heads_q, out.seq_q) {
    std::mt19937_64 rng(fresh_seed());
    fill_random(q, rng), fill_random(k, rng), fill_random(v, rng);
    poison(o), poison(lse);
  }
  explicit Args(Shape s) : Args(s, s) {}
};

// Runs f, expects kfa::Error whose message contains every fragment, and the outputs untouched.
template <class F>
void expect_error(F&& f, const Args& a, const std::vector<const char*>& fragments) {
  try {
    f();
    ADD_FAILURE() << "no exception";
  } catch (const kfa::Error& e) {
    const std::string msg = e.what();
    const std::invalid_argument& base = e;  // the documented base class
    (void)base;
    for (const char* frag : fragments)
      EXPECT_NE(msg.find(frag), std::string::npos) << "'" << frag << "' not in: " << msg;
  }
  for (double x : to_doubles4(a.o)) ASSERT_TRUE(std::isnan(x)) << "an output was written before the error";
  for (double x : to_doubles3(a.lse)) ASSERT_TRUE(std::isnan(x)) << "lse was written before the error";
}

void expect_forward_error(const Args& a, const kfa::AttentionOptions& opts, std::initializer_list<const char*> frags) {
  // Both entry points name themselves first, then the argument and values (the materialized reference
  // exists only in a build with Kokkos Kernels).
  std::vector<const char*> f1{"kfa::attention_forward: "};
  f1.insert(f1.end(), frags);
  expect_error([&] { kfa::attention_forward(Exec(), a.q, a.k, a.v, a.o, a.lse, opts); }, a, f1);
#if KFA_HAVE_KOKKOS_KERNELS
  std::vector<const char*> f2{"kfa::reference_attention: "};
  f2.insert(f2.end(), frags);
  expect_error([&] { kfa::reference_attention(Exec(), a.q, a.k, a.v, a.o, a.lse, opts); }, a, f2);
#endif
}

}  // namespace

TEST(Errors, MismatchedBatch) {
  Args a({2, 8, 8, 2, 2, 64});
  a.k = Tensor<T>("k", 3, 8, 2, 64);
  a.v = Tensor<T>("v", 3, 8, 2, 64);
  expect_forward_error(a, {}, {"k.extent(0) = 3 but q.extent(0) = 2 (batch)"});
}

TEST(Errors, MismatchedHeadDim) {
  Args a({1, 8, 8, 2, 2, 128});
  a.k = Tensor<T>("k", 1, 8, 2, 96);
  a.v = Tensor<T>("v", 1, 8, 2, 96);
  expect_error([&] { kfa::attention_forward(Exec(), a.q, a.k, a.v, a.o, a.lse); }, a,
               {"kfa::attention_forward: k.extent(3) = 96 but q.extent(3) = 128"});
}

TEST(Errors, ValueShapeDiffersFromKey) {
  Args a({1, 8, 8, 2, 2, 64});
  a.v = Tensor<T>("v", 1, 9, 2, 64);
  expect_forward_error(a, {}, {"v.extent(1) = 9", "must be 8"});
}

TEST(Errors, OutputShape) {
  Args a({1, 8, 8, 2, 2, 64}, {1, 7, 8, 2, 2, 64});
  expect_forward_error(a, {}, {"o.extent(1) = 7", "must be 8"});
}

TEST(Errors, LseShape) {
  Args a({1, 8, 8, 2, 2, 64});
  a.lse = Lse<T>("lse", 1, 8, 2);  // [batch, seq, heads]: wrong order
  poison(a.lse);
  expect_forward_error(a, {}, {"lse.extent(1) = 8", "must be 2"});
}

TEST(Errors, HeadsNotDivisible) {
  Args a({1, 8, 8, 6, 4, 64});
  expect_forward_error(a, {}, {"q.extent(2) = 6", "k.extent(2) = 4"});
}

TEST(Errors, UnsupportedHeadDim) {
  for (int d : {4, 12, 264}) {
    Args a({1, 8, 8, 1, 1, d});
    expect_forward_error(a, {}, {"head_dim q.extent(3) = ", std::to_string(d).c_str(), "multiple of 8 in [8, 256]"});
  }
}

TEST(Errors, WindowBelowMinusOne) {
  Args a({1, 8, 8, 1, 1, 8});
  kfa::AttentionOptions o;
  o.window_left = -2;
  expect_forward_error(a, o, {"opts.window_left = -2"});
  o.window_left = -1;
  o.window_right = -5;
  expect_forward_error(a, o, {"opts.window_right = -5"});
}

TEST(Errors, BadScale) {
  Args a({1, 8, 8, 1, 1, 8});
  for (double s : {-1.0, std::nan(""), std::numeric_limits<double>::infinity()}) {
    kfa::AttentionOptions o;
    o.softmax_scale = s;
    expect_forward_error(a, o, {"opts.softmax_scale = "});
  }
}

TEST(Errors, BadSoftcap) {
  Args a({1, 8, 8, 1, 1, 8});
  for (double s : {-0.5, std::nan(""), std::numeric_limits<double>::infinity()}) {
    kfa::AttentionOptions o;
    o.softcap = s;
    expect_forward_error(a, o, {"opts.softcap = "});
  }
}

TEST(Errors, BadTileOverrides) {
  Args a({1, 8, 8, 1, 1, 64});
  kfa::AttentionOptions o;
  o.block_q = 12;
  expect_error([&] { kfa::attention_forward(Exec(), a.q, a.k, a.v, a.o, a.lse, o); }, a, {"opts.block_q = 12"});
  o.block_q = 0;
  o.block_k = 20;
  expect_error([&] { kfa::attention_forward(Exec(), a.q, a.k, a.v, a.o, a.lse, o); }, a, {"opts.block_k = 20"});
  o.block_k = 4096;  // far beyond the streamed-tile budget on every backend
  expect_error([&] { kfa::attention_forward(Exec(), a.q, a.k, a.v, a.o, a.lse, o); }, a,
               {"opts.block_k = 4096", "but the budget is"});
}

TEST(Errors, OutputAliasesInput) {
  Args b({1, 8, 8, 2, 2, 64});
  // o is q itself.
  expect_error([&] { kfa::attention_forward(Exec(), b.q, b.k, b.v, b.q, b.lse); }, b, {"output o overlaps input q"});
  // o shifted by one token against v inside the same buffer: they share elements.
  Kokkos::View<T****, Kokkos::LayoutRight, Mem> buf("buf", 1, 9, 2, 64);
  auto v_in = Kokkos::subview(buf, Kokkos::ALL, std::make_pair(0, 8), Kokkos::ALL, Kokkos::ALL);
  auto o_out = Kokkos::subview(buf, Kokkos::ALL, std::make_pair(1, 9), Kokkos::ALL, Kokkos::ALL);
  Args c({1, 8, 8, 2, 2, 64});
  expect_error([&] { kfa::attention_forward(Exec(), c.q, c.k, v_in, o_out, c.lse); }, c, {"output o overlaps input v"});
  // Interleaved slots of one packed tensor share no element: allowed.
  Kokkos::View<T*****, Kokkos::LayoutRight, Mem> packed("packed", 1, 8, 2, 2, 64);
  auto v_slot = Kokkos::subview(packed, Kokkos::ALL, Kokkos::ALL, 0, Kokkos::ALL, Kokkos::ALL);
  auto o_slot = Kokkos::subview(packed, Kokkos::ALL, Kokkos::ALL, 1, Kokkos::ALL, Kokkos::ALL);
  EXPECT_NO_THROW(kfa::attention_forward(Exec(), c.q, c.k, v_slot, o_slot, c.lse));
  // lse inside k's memory.
  Kokkos::View<float***, Kokkos::LayoutRight, Mem, Kokkos::MemoryUnmanaged> lse_in_k(b.k.data(), 1, 2, 8);
  expect_error([&] { kfa::attention_forward(Exec(), b.q, b.k, b.v, b.o, lse_in_k); }, b,
               {"output lse overlaps input k"});
}

TEST(Errors, IsInvalidArgument) {
  Args a({1, 8, 8, 3, 2, 64});
  EXPECT_THROW(kfa::attention_forward(Exec(), a.q, a.k, a.v, a.o, a.lse), std::invalid_argument);
}

// KFA_NATIVE_SMEM_CAP (environment, read once per process): the number of bytes, or an error naming the variable
// and the value. The cap itself only acts on CUDA devices (the GPU suite runs with it set).
TEST(Errors, NativeSmemCapEnvironment) {
  using kfa::detail::parse_native_smem_cap;
  EXPECT_EQ(parse_native_smem_cap(nullptr), 0u);
  EXPECT_EQ(parse_native_smem_cap(""), 0u);  // set but empty, as unset
  EXPECT_EQ(parse_native_smem_cap("0"), 0u);
  EXPECT_EQ(parse_native_smem_cap("101376"), 101376u);
  EXPECT_EQ(parse_native_smem_cap("166912"), 166912u);
  for (const char* bad : {"-1", "+5", " 99", "99 ", "99KB", "1e5", "0x100", "99999999999999999999999"}) {
    try {
      parse_native_smem_cap(bad);
      ADD_FAILURE() << "no error for KFA_NATIVE_SMEM_CAP = \"" << bad << "\"";
    } catch (const kfa::Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(std::string("KFA_NATIVE_SMEM_CAP = \"") + bad + "\""), std::string::npos) << what;
      EXPECT_NE(what.find("whole number of bytes"), std::string::npos) << what;
    }
  }
}
