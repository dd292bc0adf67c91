#pragma once
// The tests' own float64 attention, written from the definition and sharing no code with the library:
// O = softmax(scale·q·kᵀ (softcapped, masked)) v and LSE = log Σ_j exp(score_ij), on host arrays in the
// [batch, seq, heads, head_dim] / [batch, heads, seq] layouts.
#include <cmath>
#include <limits>
#include <vector>

namespace kfa_test {

struct Shape {
  int batch = 1, seq_q = 1, seq_k = 1, heads_q = 1, heads_kv = 1, head_dim = 8;
};

struct RefOptions {
  double scale = 0;  // 0: 1/sqrt(d)
  bool causal = false;
  int window_left = -1, window_right = -1;
  double softcap = 0;
};

// Key j is visible from query i (bottom-right aligned, as FlashAttention).
inline bool ref_visible(const Shape& s, const RefOptions& o, long i, long j) {
  const long diag = i + (s.seq_k - s.seq_q);  // the key on query i's diagonal
  if (o.causal && j > diag) return false;
  if (o.window_right >= 0 && j > diag + o.window_right) return false;
  if (o.window_left >= 0 && j < diag - o.window_left) return false;
  return true;
}

inline double ref_scale(const Shape& s, const RefOptions& o) {
  return o.scale > 0 ? o.scale : 1.0 / std::sqrt(double(s.head_dim));
}

// Scores of one (b, h, i) row over all keys; −inf where masked.
inline void ref_scores(const Shape& s, const RefOptions& o, const std::vector<double>& q, const std::vector<double>& k,
                       int b, int h, int i, std::vector<double>& row) {
  const int d = s.head_dim, hk = h / (s.heads_q / s.heads_kv);
  row.assign(s.seq_k, -std::numeric_limits<double>::infinity());
  const double scale = ref_scale(s, o);
  for (int j = 0; j < s.seq_k; ++j) {
    if (!ref_visible(s, o, i, j)) continue;
    double acc = 0;
    for (int c = 0; c < d; ++c)
      acc += q[((size_t(b) * s.seq_q + i) * s.heads_q + h) * d + c] *
             k[((size_t(b) * s.seq_k + j) * s.heads_kv + hk) * d + c];
    acc *= scale;
    if (o.softcap > 0) acc = o.softcap * std::tanh(acc / o.softcap);
    row[j] = acc;
  }
}

inline void reference_forward64(const Shape& s, const RefOptions& o, const std::vector<double>& q,
                                const std::vector<double>& k, const std::vector<double>& v, std::vector<double>& out,
                                std::vector<double>& lse) {
  const int d = s.head_dim, group = s.heads_q / s.heads_kv;
  out.assign(size_t(s.batch) * s.seq_q * s.heads_q * d, 0.0);
  lse.assign(size_t(s.batch) * s.heads_q * s.seq_q, 0.0);
  std::vector<double> row;
  for (int b = 0; b < s.batch; ++b)
    for (int h = 0; h < s.heads_q; ++h)
      for (int i = 0; i < s.seq_q; ++i) {
        ref_scores(s, o, q, k, b, h, i, row);
        double mx = -std::numeric_limits<double>::infinity();
        for (double x : row) mx = std::max(mx, x);
        double* orow = &out[((size_t(b) * s.seq_q + i) * s.heads_q + h) * d];
        double& l = lse[(size_t(b) * s.heads_q + h) * s.seq_q + i];
        if (mx == -std::numeric_limits<double>::infinity()) {
          l = mx;  // no visible key: O = 0, LSE = −inf
          continue;
        }
        double sum = 0;
        for (int j = 0; j < s.seq_k; ++j) {
          const double p = std::exp(row[j] - mx);
          sum += p;
          const double* vrow = &v[((size_t(b) * s.seq_k + j) * s.heads_kv + h / group) * d];
          for (int c = 0; c < d; ++c) orow[c] += p * vrow[c];
        }
        for (int c = 0; c < d; ++c) orow[c] /= sum;
        l = mx + std::log(sum);
      }
}

// Gradients of L = Σ O ∘ dO from the materialized formulas: P = softmax(S), dV = Pᵀ dO, dP = dO Vᵀ,
// dS = P ∘ (dP − rowsum(P ∘ dP)) (times 1 − tanh² under softcap), dQ = scale·dS K, dK = scale·dSᵀ Q.
inline void reference_backward64(const Shape& s, const RefOptions& o, const std::vector<double>& q,
                                 const std::vector<double>& k, const std::vector<double>& v,
                                 const std::vector<double>& dout, std::vector<double>& dq, std::vector<double>& dk,
                                 std::vector<double>& dv) {
  const int d = s.head_dim, group = s.heads_q / s.heads_kv;
  const double scale = ref_scale(s, o);
  dq.assign(size_t(s.batch) * s.seq_q * s.heads_q * d, 0.0);
  dk.assign(size_t(s.batch) * s.seq_k * s.heads_kv * d, 0.0);
  dv.assign(dk.size(), 0.0);
  std::vector<double> row, p(s.seq_k), dp(s.seq_k);
  auto qi = [&](int b, int i, int h) { return ((size_t(b) * s.seq_q + i) * s.heads_q + h) * d; };
  auto kj = [&](int b, int j, int hk) { return ((size_t(b) * s.seq_k + j) * s.heads_kv + hk) * d; };
  for (int b = 0; b < s.batch; ++b)
    for (int h = 0; h < s.heads_q; ++h)
      for (int i = 0; i < s.seq_q; ++i) {
        const int hk = h / group;
        ref_scores(s, o, q, k, b, h, i, row);
        double mx = -std::numeric_limits<double>::infinity();
        for (double x : row) mx = std::max(mx, x);
        if (mx == -std::numeric_limits<double>::infinity()) continue;  // no visible key: no gradient
        double sum = 0;
        for (int j = 0; j < s.seq_k; ++j) sum += (p[j] = std::exp(row[j] - mx));
        double dsum = 0;
        for (int j = 0; j < s.seq_k; ++j) {
          p[j] /= sum;
          double acc = 0;
          for (int c = 0; c < d; ++c) acc += dout[qi(b, i, h) + c] * v[kj(b, j, hk) + c];
          dp[j] = acc;
          dsum += p[j] * acc;
        }
        for (int j = 0; j < s.seq_k; ++j) {
          if (p[j] == 0) continue;
          double ds = p[j] * (dp[j] - dsum);
          if (o.softcap > 0) ds *= 1.0 - (row[j] / o.softcap) * (row[j] / o.softcap);
          for (int c = 0; c < d; ++c) {
            dq[qi(b, i, h) + c] += scale * ds * k[kj(b, j, hk) + c];
            dk[kj(b, j, hk) + c] += scale * ds * q[qi(b, i, h) + c];
            dv[kj(b, j, hk) + c] += p[j] * dout[qi(b, i, h) + c];
          }
        }
      }
}

}  // namespace kfa_test
