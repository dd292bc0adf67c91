// kfa's side of the side-by-side benchmark against PyTorch SDPA (perf/sdpa_compare.py runs both and
// prints the table). For every (dtype, head dim, N, causal): batch = tokens / N, heads = hidden / d,
// inputs from a counter hash that sdpa_compare.py reproduces bit for bit (so both libraries see the same
// q, k, v, dO), forward and forward+backward timed (median of --reps, fences around each call), and the
// outputs of 64 fixed query/key rows per (batch, head) written as float32 for the error check against
// float64 done in Python.
//
//   kfa_bench_sdpa --out DIR [--dtypes bf16,fp16,fp32] [--d 64,128] [--n 512,...,16384] [--causal 0,1]
//                  [--tokens 16384] [--hidden 2048] [--reps 20] [--path
//                  automatic|portable|tensor_core|tensor_core_team|tensor_core_fa2|simt_fp32|tensor_core_tf32x3|tensor_core_wgmma]
//                  [--no-backward] [--nondeterministic] [--softcap C] [--seed S]
//
// --softcap C (AttentionOptions::softcap, kfa only: SDPA has none, so perf/sdpa_compare.py never passes it)
// times kfa's softcap instances; their outputs are not comparable with sdpa_compare.py's reference.
//
// Prints one line per case: dtype d N causal batch heads path fwd_ms fwd_TFLOPs fwdbwd_ms fwdbwd_TFLOPs.
// FLOPs: forward 4·B·H·N²·d (halved for causal), backward 2.5× forward (FlashAttention's convention).
#include <cstdio>
#include <fstream>

#include "bench_common.hpp"

using namespace kfa_bench;

namespace {
const kfa::TileProductPath all_paths[] = {
    kfa::TileProductPath::automatic,          kfa::TileProductPath::portable,         kfa::TileProductPath::tensor_core,
    kfa::TileProductPath::tensor_core_team,   kfa::TileProductPath::tensor_core_fa2,  kfa::TileProductPath::simt_fp32,
    kfa::TileProductPath::tensor_core_tf32x3, kfa::TileProductPath::tensor_core_wgmma};

// The counter hash shared with sdpa_compare.py: element i of tensor `seed` → uniform on [−√3, √3).
KOKKOS_INLINE_FUNCTION float hash_value(std::uint64_t i, std::uint64_t seed) {
  std::uint64_t h = (i * 2654435761ull + seed * 97531ull) & 0xffffffffull;
  h ^= h >> 16;
  h = (h * 0x45d9f3bull) & 0xffffffffull;
  h ^= h >> 16;
  const float u = static_cast<float>(h >> 8) * (1.0f / 8388608.0f) - 1.0f;  // exact in float
  return u * 1.7320508f;
}

template <class V>
void fill_hash(const V& x, std::uint64_t seed) {
  using T = typename V::non_const_value_type;
  auto* p = x.data();
  Kokkos::parallel_for(
      "bench::hash", Kokkos::RangePolicy<Exec>(0, x.size()),
      KOKKOS_LAMBDA(const std::size_t i) { p[i] = static_cast<T>(hash_value(i, seed)); });
}

// Rows (query or key positions) whose outputs are written for the error check.
std::vector<int> sample_rows(int n) {
  std::vector<int> r;
  for (int s = 0; s < 64; ++s) r.push_back(static_cast<int>((2L * s + 1) * n / 128));
  return r;
}

// x[b, rows[s], h, :] as float32 in (b, h, s, c) order.
template <class V>
void write_rows(const std::string& path, const V& x, const std::vector<int>& rows) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), x);
  std::vector<float> out;
  for (std::size_t b = 0; b < x.extent(0); ++b)
    for (std::size_t hh = 0; hh < x.extent(2); ++hh)
      for (int r : rows)
        for (std::size_t c = 0; c < x.extent(3); ++c) out.push_back(static_cast<float>(h(b, r, hh, c)));
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(out.data()), static_cast<std::streamsize>(out.size() * sizeof(float)));
  if (!f) throw std::runtime_error("cannot write " + path);
}

struct Args {
  std::vector<std::string> dtypes{"bf16", "fp16", "fp32"};
  std::vector<int> ds{64, 128}, ns{512, 1024, 2048, 4096, 8192, 16384}, causals{0, 1};
  int tokens = 16384, hidden = 2048, reps = 20;
  bool backward = true, deterministic = true;
  std::uint64_t seed = 1000;
  double softcap = 0;
  std::string out, path = "automatic";
};

template <class T>
void run_dtype(const Args& a, const std::string& dname, int& case_id) {
  using V4 = Kokkos::View<T****, Kokkos::LayoutRight, Mem>;
  using L3 = Kokkos::View<float***, Kokkos::LayoutRight, Mem>;
  for (int d : a.ds)
    for (int n : a.ns)
      for (int causal : a.causals) {
        ++case_id;
        const int batch = a.tokens / n, heads = a.hidden / d;
        if (batch < 1 || heads < 1) continue;
        V4 q("q", batch, n, heads, d), k("k", batch, n, heads, d), v("v", batch, n, heads, d),
            o("o", batch, n, heads, d), d_o("do", batch, n, heads, d), dq("dq", batch, n, heads, d),
            dk("dk", batch, n, heads, d), dv("dv", batch, n, heads, d);
        L3 lse("lse", batch, heads, n);
        const std::uint64_t s0 = a.seed + 10ull * case_id;
        fill_hash(q, s0 + 1), fill_hash(k, s0 + 2), fill_hash(v, s0 + 3), fill_hash(d_o, s0 + 4);
        kfa::AttentionOptions opts;
        opts.causal = causal != 0;
        opts.deterministic = a.deterministic;
        opts.softcap = a.softcap;
        for (kfa::TileProductPath p : all_paths)
          if (kfa::to_string(p) == a.path) opts.path = p;
        const double fwd_flops = 4.0 * batch * heads * double(n) * n * d * (causal ? 0.5 : 1.0);
        // poison, run once (warm-up and the outputs checked), then time
        Kokkos::deep_copy(o, static_cast<T>(std::numeric_limits<float>::quiet_NaN()));
        const double t_first = median_seconds(1, [&] { kfa::attention_forward(Exec(), q, k, v, o, lse, opts); });
        // slow cases (the fp32 portable path at large N) get fewer repetitions: about 2 s per measurement
        const int reps = std::max(3, std::min(a.reps, static_cast<int>(2.0 / (t_first * (a.backward ? 3.5 : 1.0)))));
        const double tf = median_seconds(reps, [&] { kfa::attention_forward(Exec(), q, k, v, o, lse, opts); });
        const std::vector<int> rows = sample_rows(n);
        const std::string stem = a.out + "/kfa_" + dname + "_d" + std::to_string(d) + "_n" + std::to_string(n) + "_c" +
                                 std::to_string(causal);
        write_rows(stem + "_o.f32", o, rows);
        double tfb = 0;
        if (a.backward) {
          for (const V4* x : {&dq, &dk, &dv})
            Kokkos::deep_copy(*x, static_cast<T>(std::numeric_limits<float>::quiet_NaN()));
          kfa::attention_backward(Exec(), q, k, v, o, d_o, lse, dq, dk, dv, opts);
          Exec().fence();
          write_rows(stem + "_dq.f32", dq, rows);
          write_rows(stem + "_dk.f32", dk, rows);
          write_rows(stem + "_dv.f32", dv, rows);
          tfb = median_seconds(reps, [&] {
            kfa::attention_forward(Exec(), q, k, v, o, lse, opts);
            kfa::attention_backward(Exec(), q, k, v, o, d_o, lse, dq, dk, dv, opts);
          });
        }
        std::printf("%s %d %d %d %d %d %s seed=%llu %.4f %.2f %.4f %.2f\n", dname.c_str(), d, n, causal, batch, heads,
                    (a.path + (a.deterministic ? "" : "+nondet") + (a.softcap > 0 ? "+softcap" : "")).c_str(),
                    static_cast<unsigned long long>(s0), tf * 1e3, fwd_flops / tf * 1e-12, tfb * 1e3,
                    tfb > 0 ? 3.5 * fwd_flops / tfb * 1e-12 : 0.0);
        std::fflush(stdout);
      }
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{
      "kfa's side of the benchmark against PyTorch SDPA (perf/sdpa_compare.py runs both; Kokkos options: "
      "--kokkos-*)",
      "kfa_bench_sdpa"};
  app.add_option("--out", a.out, "directory for the sampled output rows")->required();
  app.add_option("--dtypes", a.dtypes, "comma separated")
      ->delimiter(',')
      ->check(CLI::IsMember({"bf16", "fp16", "fp32"}))
      ->capture_default_str();
  app.add_option("--d", a.ds, "head dims, comma separated")
      ->delimiter(',')
      ->check(positive_int(1024))
      ->capture_default_str();
  app.add_option("--n", a.ns, "sequence lengths, comma separated")
      ->delimiter(',')
      ->check(positive_int())
      ->capture_default_str();
  app.add_option("--causal", a.causals, "0 and/or 1, comma separated")
      ->delimiter(',')
      ->check(integer(0, 1, "0 or 1"))
      ->capture_default_str();
  app.add_option("--tokens", a.tokens, "batch x N of every case")->check(positive_int())->capture_default_str();
  app.add_option("--hidden", a.hidden, "heads x d of every case")->check(positive_int())->capture_default_str();
  app.add_option("--reps", a.reps, "timed repetitions (median; fewer for slow cases, at least 3)")
      ->check(positive_int())
      ->capture_default_str();
  std::vector<std::string> path_names;
  for (kfa::TileProductPath p : all_paths) path_names.push_back(kfa::to_string(p));
  app.add_option("--path", a.path, "kernel family (kfa::TileProductPath)")
      ->check(CLI::IsMember(path_names))
      ->capture_default_str();
  bool no_backward = false;
  app.add_flag("--no-backward", no_backward, "forward only");
  bool nondet = false;
  app.add_flag("--nondeterministic", nondet, "AttentionOptions::deterministic = false (atomic dQ where it exists)");
  app.add_option("--softcap", a.softcap, "AttentionOptions::softcap (kfa only; 0 = none)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--seed", a.seed, "base seed of the counter hash")
      ->check(integer(0, LLONG_MAX, "a non-negative integer"))
      ->capture_default_str();
  const int parsed = parse_command_line(app, argc, argv);
  if (parsed >= 0) return parsed;
  a.backward = !no_backward;
  a.deterministic = !nondet;
  Kokkos::ScopeGuard guard(argc, argv);
  std::printf("# kfa %s, Kokkos %s, backend %s\n", KFA_VERSION_STRING, kfa::compat::kokkos_version_string().c_str(),
              Exec::name());
  return report_errors("kfa_bench_sdpa", [&] {
    int case_id = 0;
    for (const std::string& t : a.dtypes) {
      if (t == "fp32")
        run_dtype<float>(a, t, case_id);
#if KFA_HAS_BHALF
      else if (t == "bf16")
        run_dtype<kfa::compat::bhalf_t>(a, t, case_id);
#endif
#if KFA_HAS_HALF
      else if (t == "fp16")
        run_dtype<kfa::compat::half_t>(a, t, case_id);
#endif
      else
        std::fprintf(stderr, "kfa_bench_sdpa: dtype %s not available in this build, skipped\n", t.c_str());
    }
    return 0;
  });
}
