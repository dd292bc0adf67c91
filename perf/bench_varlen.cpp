// Variable-length batches: kfa's packed call (attention_forward_varlen / attention_backward_varlen) on a mix of
// lengths, against kfa's fixed-length call in the same run: at the same lengths when every sequence has the same
// length, and at equal FLOPs otherwise (batch x N with N = sum(L^2) / sum(L), the same tokens). perf/
// varlen_compare.py times PyTorch's variable-length path on the printed lengths.
//
//   kfa_bench_varlen [--dtype bf16|fp16|fp32|fp64] [--d 128] [--hidden 2048] [--causal 0,1] [--reps 20]
//                    [--lengths L1,L2,...] [--tokens 65536 --min 128 --max 16384 --median 1024 --sigma 1 --seed 7]
//                    [--no-backward] [--path automatic|portable|...]
//
// Without --lengths the lengths are log-normal (median and sigma of log L), clamped to [min, max], drawn until
// they hold --tokens (the last one cut to fit, at least 1). Prints "lengths: ..." and one line per case:
//   case dtype d causal sequences tokens heads fwd_ms fwd_TFLOPs fwdbwd_ms fwdbwd_TFLOPs
// FLOPs: forward 4·H·d·Σ seq_q·seq_k (halved for causal), backward 2.5x forward (FlashAttention's convention).
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>

#include "bench_common.hpp"

using namespace kfa_bench;

namespace {
const kfa::TileProductPath all_paths[] = {
    kfa::TileProductPath::automatic,          kfa::TileProductPath::portable,         kfa::TileProductPath::tensor_core,
    kfa::TileProductPath::tensor_core_team,   kfa::TileProductPath::tensor_core_fa2,  kfa::TileProductPath::simt_fp32,
    kfa::TileProductPath::tensor_core_tf32x3, kfa::TileProductPath::tensor_core_wgmma};

struct Args {
  std::string dtype = "bf16", path = "automatic";
  int d = 128, hidden = 2048, reps = 20;
  std::vector<int> causals{0, 1}, lengths;
  long tokens = 65536;
  int min_len = 128, max_len = 16384, median = 1024;
  double sigma = 1.0;
  std::uint64_t seed = 7;
  bool backward = true;
};

std::vector<int> lognormal_lengths(const Args& a) {
  std::mt19937_64 rng(a.seed);
  std::normal_distribution<double> z(0.0, a.sigma);
  std::vector<int> len;
  long total = 0;
  while (total < a.tokens) {
    int l = static_cast<int>(std::lround(a.median * std::exp(z(rng))));
    l = std::min(a.max_len, std::max(a.min_len, l));
    l = static_cast<int>(std::min<long>(l, a.tokens - total));
    len.push_back(l);
    total += l;
  }
  return len;
}

template <class V>
void fill_random(const V& x, std::uint64_t seed) {
  using T = typename V::non_const_value_type;
  auto* p = x.data();
  Kokkos::parallel_for(
      "bench::fill", Kokkos::RangePolicy<Exec>(0, x.size()), KOKKOS_LAMBDA(const std::size_t i) {
        std::uint64_t h = (i * 2654435761ull + seed * 97531ull) & 0xffffffffull;
        h ^= h >> 16;
        h = (h * 0x45d9f3bull) & 0xffffffffull;
        h ^= h >> 16;
        p[i] = static_cast<T>((static_cast<float>(h >> 8) * (1.0f / 8388608.0f) - 1.0f) * 1.7320508f);
      });
}

struct Timing {
  double fwd = 0, fb = 0;
};

template <class T>
Timing time_varlen(const Args& a, const std::vector<int>& len, const kfa::AttentionOptions& opts, int heads) {
  using V3 = Kokkos::View<T***, Kokkos::LayoutRight, Mem>;
  std::vector<int> cu(len.size() + 1, 0);
  for (std::size_t s = 0; s < len.size(); ++s) cu[s + 1] = cu[s] + len[s];
  const int total = cu.back();
  long longest = 0;
  for (int l : len) longest = std::max<long>(longest, l);
  Kokkos::View<int*, Mem> cu_d("cu_seqlens", cu.size());
  auto cu_h = Kokkos::create_mirror_view(cu_d);
  for (std::size_t s = 0; s < cu.size(); ++s) cu_h(s) = cu[s];
  Kokkos::deep_copy(cu_d, cu_h);
  V3 q("q", total, heads, a.d), k("k", total, heads, a.d), v("v", total, heads, a.d), o("o", total, heads, a.d),
      d_o("do", total, heads, a.d), dq("dq", total, heads, a.d), dk("dk", total, heads, a.d),
      dv("dv", total, heads, a.d);
  Kokkos::View<kfa::accumulator_t<T>**, Kokkos::LayoutRight, Mem> lse("lse", heads, total);
  fill_random(q, a.seed + 1), fill_random(k, a.seed + 2), fill_random(v, a.seed + 3), fill_random(d_o, a.seed + 4);
  auto fwd = [&] { kfa::attention_forward_varlen(Exec(), q, k, v, o, lse, cu_d, cu_d, longest, longest, opts); };
  auto bwd = [&] {
    kfa::attention_backward_varlen(Exec(), q, k, v, o, d_o, lse, dq, dk, dv, cu_d, cu_d, longest, longest, opts);
  };
  Timing t;
  const double first = median_seconds(1, fwd);
  const int reps = std::max(3, std::min(a.reps, static_cast<int>(2.0 / (first * (a.backward ? 3.5 : 1.0)))));
  t.fwd = median_seconds(reps, fwd);
  if (a.backward) {
    bwd();
    t.fb = median_seconds(reps, [&] { fwd(), bwd(); });
  }
  return t;
}

template <class T>
Timing time_fixed(const Args& a, int batch, int n, const kfa::AttentionOptions& opts, int heads) {
  using V4 = Kokkos::View<T****, Kokkos::LayoutRight, Mem>;
  V4 q("q", batch, n, heads, a.d), k("k", batch, n, heads, a.d), v("v", batch, n, heads, a.d),
      o("o", batch, n, heads, a.d), d_o("do", batch, n, heads, a.d), dq("dq", batch, n, heads, a.d),
      dk("dk", batch, n, heads, a.d), dv("dv", batch, n, heads, a.d);
  Kokkos::View<kfa::accumulator_t<T>***, Kokkos::LayoutRight, Mem> lse("lse", batch, heads, n);
  fill_random(q, a.seed + 1), fill_random(k, a.seed + 2), fill_random(v, a.seed + 3), fill_random(d_o, a.seed + 4);
  auto fwd = [&] { kfa::attention_forward(Exec(), q, k, v, o, lse, opts); };
  auto bwd = [&] { kfa::attention_backward(Exec(), q, k, v, o, d_o, lse, dq, dk, dv, opts); };
  Timing t;
  const double first = median_seconds(1, fwd);
  const int reps = std::max(3, std::min(a.reps, static_cast<int>(2.0 / (first * (a.backward ? 3.5 : 1.0)))));
  t.fwd = median_seconds(reps, fwd);
  if (a.backward) {
    bwd();
    t.fb = median_seconds(reps, [&] { fwd(), bwd(); });
  }
  return t;
}

void print(const char* what, const Args& a, int causal, long seqs, long tokens, int heads, double flops,
           const Timing& t) {
  std::printf("%s %s %d %d %ld %ld %d %.4f %.4f %.4f %.4f\n", what, a.dtype.c_str(), a.d, causal, seqs, tokens, heads,
              t.fwd * 1e3, flops / t.fwd * 1e-12, t.fb * 1e3, t.fb > 0 ? 3.5 * flops / t.fb * 1e-12 : 0.0);
  std::fflush(stdout);
}

template <class T>
int run(const Args& a) {
  const std::vector<int> len = a.lengths.empty() ? lognormal_lengths(a) : a.lengths;
  const int heads = std::max(1, a.hidden / a.d);
  long tokens = 0;
  double sum_sq = 0;
  for (int l : len) tokens += l, sum_sq += double(l) * l;
  std::printf("lengths:");
  for (int l : len) std::printf(" %d", l);
  std::printf("\n# %zu sequences, %ld tokens, longest %d, heads %d, d %d, %s, %s\n", len.size(), tokens,
              *std::max_element(len.begin(), len.end()), heads, a.d, a.dtype.c_str(), Exec::name());
  std::printf("# case dtype d causal sequences tokens heads fwd_ms fwd_TFLOPs fwdbwd_ms fwdbwd_TFLOPs\n");
  const bool equal = std::all_of(len.begin(), len.end(), [&](int l) { return l == len[0]; });
  for (int causal : a.causals) {
    kfa::AttentionOptions opts;
    opts.causal = causal != 0;
    for (kfa::TileProductPath p : all_paths)
      if (kfa::to_string(p) == a.path) opts.path = p;
    const double c = causal ? 0.5 : 1.0;
    print("varlen", a, causal, static_cast<long>(len.size()), tokens, heads, 4.0 * heads * a.d * sum_sq * c,
          time_varlen<T>(a, len, opts, heads));
    // The fixed-length call at the same lengths, or at equal FLOPs with the same tokens.
    const int n = equal ? len[0] : std::max(64, static_cast<int>(std::lround(sum_sq / tokens / 64.0)) * 64);
    const int batch =
        equal ? static_cast<int>(len.size()) : std::max(1, static_cast<int>(std::lround(double(tokens) / n)));
    print(equal ? "fixed_same_lengths" : "fixed_equal_flops", a, causal, batch, long(batch) * n, heads,
          4.0 * heads * a.d * double(batch) * n * n * c, time_fixed<T>(a, batch, n, opts, heads));
  }
  return 0;
}
}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"kfa variable-length batches against the fixed-length call"};
  bool no_backward = false;
  app.add_option("--dtype", a.dtype, "bf16, fp16, fp32 or fp64")->capture_default_str();
  app.add_option("--d", a.d, "head dim")->check(positive_int())->capture_default_str();
  app.add_option("--hidden", a.hidden, "heads x d")->check(positive_int())->capture_default_str();
  app.add_option("--causal", a.causals, "0 and/or 1, comma separated")->delimiter(',')->capture_default_str();
  app.add_option("--reps", a.reps, "timed repetitions (median)")->check(positive_int())->capture_default_str();
  app.add_option("--lengths", a.lengths, "sequence lengths, comma separated (else log-normal)")->delimiter(',');
  app.add_option("--tokens", a.tokens, "log-normal: tokens in all")->check(positive_int())->capture_default_str();
  app.add_option("--min", a.min_len, "log-normal: shortest")->check(positive_int())->capture_default_str();
  app.add_option("--max", a.max_len, "log-normal: longest")->check(positive_int())->capture_default_str();
  app.add_option("--median", a.median, "log-normal: median length")->check(positive_int())->capture_default_str();
  app.add_option("--sigma", a.sigma, "log-normal: sigma of log length")->capture_default_str();
  app.add_option("--seed", a.seed, "lengths and inputs")->capture_default_str();
  app.add_option("--path", a.path, "kernel family (kfa::TileProductPath)")->capture_default_str();
  app.add_flag("--no-backward", no_backward, "forward only");
  const int parsed = parse_command_line(app, argc, argv);
  if (parsed >= 0) return parsed;
  a.backward = !no_backward;
  for (int l : a.lengths)
    if (l < 1) return std::fprintf(stderr, "kfa_bench_varlen: --lengths must be positive\n"), 2;
  Kokkos::ScopeGuard guard(argc, argv);
  return report_errors("kfa_bench_varlen", [&] {
    if (a.dtype == "fp32") return run<float>(a);
    if (a.dtype == "fp64") return run<double>(a);
#if KFA_HAS_BHALF
    if (a.dtype == "bf16") return run<kfa::compat::bhalf_t>(a);
#endif
#if KFA_HAS_HALF
    if (a.dtype == "fp16") return run<kfa::compat::half_t>(a);
#endif
    throw kfa::Error("--dtype " + a.dtype + " is not available in this build (bf16, fp16, fp32, fp64)");
  });
}
