#pragma once
// kfa-longseq: which sequence-parallel strategy runs (--sp ring | ulysses | hybrid | auto, --ulysses-degree) and
// the cost model --sp auto chooses by. The same model, with the same formulas, is perf/ring_model.py's
// "strategies" mode (keep the two in step): per rank, for a Ulysses degree U (R = P / U ranks in the ring),
//   compute   C = 4·B·N²·H·d (halved when causal) / P / rate, ×3.5 with the backward (the same for every U)
//   all-to-all (U > 1, not hidden): bytes sent / bw_a2a + one latency per message; forward: q, k, v to heads,
//             o and lse back; backward: q, k, v, dO, lse, D to heads, dq, dk, dv back
//   ring      (R > 1): per step the K/V of a ring shard (N/R tokens, the key/value heads a rank holds), in the
//             backward also the dK/dV accumulators (fp32); what a step's compute (C / R) does not hide is
//             exposed, R − 1 times; plus the accumulators' trip home after the last step
//   overhead  per ring step and per Ulysses stage: an agreement (2·⌈log2 P⌉ latencies)
// bw_a2a is the intra-node bandwidth when every group lies within a node, else the inter-node one; the ring's
// hops are inter-node when the job spans nodes (the slowest hop sets every step), else intra-node.
// Assumptions, said in the report: balanced work per rank (zigzag or non-causal), rates independent of the
// shard size, transfers at the bandwidth of one pairwise exchange measured at the start of the run.
#include "common.hpp"
#include "report.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

namespace longseq {

/// What the model is calibrated with and asked about.
struct SpModelInputs {
  int ranks = 1, node_ranks = 1;  // P; ranks per node (the smallest node's)
  long batch = 1, seq = 0, heads = 1, kv_heads = 1, d = 64;
  int elem_bytes = 4, acc_bytes = 4;
  bool causal = false, backward = false;
  double rate = 1e11;       // attention FLOP/s of one rank (forward kernel, measured)
  double bw_intra = 1e10;   // bytes/s of one pairwise exchange between ranks of a node, per rank and direction
  double bw_inter = 1e10;   // the same between nodes
  double latency_s = 5e-6;  // per message
};

/// The model's prediction for one Ulysses degree.
struct SpPrediction {
  int u = 1;
  double compute_s = 0, a2a_s = 0, ring_s = 0, overhead_s = 0;
  double total() const { return compute_s + a2a_s + ring_s + overhead_s; }
  std::string name(int ranks) const {
    return u == 1 ? "ring" : u == ranks ? "ulysses" : "hybrid U=" + std::to_string(u);
  }
};

/// Key/value heads a rank holds between the all-to-alls (kfa::dist::plan_heads).
inline long kv_local_heads(long heads, long kv_heads, int u) {
  const long ql = heads / u, g = heads / kv_heads;
  if (kv_heads % u == 0) return kv_heads / u;
  if (g % ql == 0) return 1;
  return ql;
}

inline SpPrediction predict(const SpModelInputs& m, int u) {
  SpPrediction p;
  p.u = u;
  const int r = m.ranks / u;
  const double n = double(m.seq) / m.ranks, b = double(m.batch), e = m.elem_bytes, a = m.acc_bytes, d = double(m.d);
  const double hl = double(m.heads) / u, kvl = double(kv_local_heads(m.heads, m.kv_heads, u));
  const double flops = 4.0 * b * double(m.seq) * double(m.seq) * m.heads * d * (m.causal ? 0.5 : 1.0);
  const double cf = flops / m.ranks / m.rate, cb = 2.5 * cf;
  p.compute_s = cf + (m.backward ? cb : 0.0);
  const bool multi_node = m.node_ranks < m.ranks;
  const bool groups_in_node = u <= m.node_ranks && m.node_ranks % u == 0;
  const double lat_agree = 2.0 * std::ceil(std::log2(std::max(2, m.ranks))) * m.latency_s;
  if (u > 1) {
    const double bw = groups_in_node ? m.bw_intra : m.bw_inter, peers = u - 1;
    double bytes = peers * b * n * ((hl + 2 * kvl) * d * e + hl * (d * e + a));  // q, k, v in; o, lse out
    int messages = 5;
    if (m.backward)
      bytes += peers * b * n * ((2 * hl + 2 * kvl) * d * e + 2 * hl * a + (hl + 2 * kvl) * d * e), messages += 9;
    p.a2a_s = bytes / bw + messages * peers * m.latency_s;
    p.overhead_s += (m.backward ? 10 : 5) * lat_agree;
  }
  if (r > 1) {
    const double bw = multi_node ? m.bw_inter : m.bw_intra, shard = b * (double(m.seq) / r) * kvl * d;
    const double kv = 2 * shard * e / bw + m.latency_s, acc = 2 * shard * a / bw + m.latency_s;
    p.ring_s = (r - 1) * std::max(0.0, kv - cf / r);
    if (m.backward) p.ring_s += (r - 1) * std::max(0.0, kv + acc - cb / r) + std::max(0.0, acc - cb / r * 3.0 / 7.0);
    p.overhead_s += (m.backward ? 2 : 1) * r * lat_agree;
  }
  return p;
}

/// Every Ulysses degree the heads allow (U divides P and the query heads), ring first.
inline std::vector<SpPrediction> predict_all(const SpModelInputs& m) {
  std::vector<SpPrediction> out;
  for (int u = 1; u <= m.ranks; ++u)
    if (m.ranks % u == 0 && m.heads % u == 0) out.push_back(predict(m, u));
  return out;
}

/// The strategy of a run: the Ulysses degree (1: the ring alone) and why.
struct Strategy {
  std::string asked;  // --sp
  int u = 1;
  std::string why;
  std::vector<SpPrediction> predictions;  // --sp auto
  SpModelInputs model;
  std::string kind(int ranks) const { return u == 1 ? "ring" : u == ranks ? "ulysses" : "hybrid"; }
};

/// The strategy --sp and --ulysses-degree ask for, or an error naming them (--sp auto: resolved later, from the
/// model).
inline Strategy asked_strategy(const Config& c, int ranks, long heads) {
  Strategy s;
  s.asked = c.sp;
  const int deg = c.ulysses_degree;
  if (c.sp == "ring") {
    if (deg > 1)
      fail("kfa-longseq: --ulysses-degree ", deg, " with --sp ring (which has no all-to-all); use --sp hybrid");
    s.u = 1, s.why = "asked (--sp ring)";
  } else if (c.sp == "ulysses") {
    if (deg > 0 && deg != ranks)
      fail("kfa-longseq: --sp ulysses spreads the heads over all ", ranks, " ranks, but --ulysses-degree is ", deg,
           "; use --sp hybrid --ulysses-degree ", deg);
    s.u = ranks, s.why = "asked (--sp ulysses)";
  } else if (c.sp == "hybrid") {
    if (deg <= 0) fail("kfa-longseq: --sp hybrid needs --ulysses-degree U (a divisor of the ", ranks, " ranks)");
    if (ranks % deg != 0)
      fail("kfa-longseq: --ulysses-degree ", deg, " does not divide the ", ranks, " ranks (groups of U ranks)");
    s.u = deg, s.why = "asked (--sp hybrid --ulysses-degree " + std::to_string(deg) + ")";
  } else {
    s.u = 0;  // resolved by choose() (choose_for_documents() with documents)
  }
  if (s.u > 1 && heads % s.u != 0)
    fail("kfa-longseq: --sp ", c.sp, ": the ", heads, " query heads (--heads) are not divisible by the Ulysses degree ",
         s.u, "; use a degree that divides them");
  return s;
}

/// --sp auto: the degree of the smallest predicted time.
inline void choose(Strategy& s, const SpModelInputs& m) {
  s.model = m;
  s.predictions = predict_all(m);
  const SpPrediction* best = &s.predictions.front();
  for (const auto& p : s.predictions)
    if (p.total() < best->total()) best = &p;
  s.u = best->u;
  char b[160];
  std::string why = "auto: predicted ";
  for (const auto& p : s.predictions) {
    std::snprintf(b, sizeof b, "%s%s %s", &p == &s.predictions.front() ? "" : ", ", p.name(m.ranks).c_str(),
                  secs(p.total()).c_str());
    why += b;
  }
  std::snprintf(b, sizeof b,
                " (kernel %.3g TFLOP/s, intra-node %.3g GB/s, inter-node %.3g GB/s, latency %.3g us, %d ranks per "
                "node)",
                m.rate * 1e-12, m.bw_intra * 1e-9, m.bw_inter * 1e-9, m.latency_s * 1e6, m.node_ranks);
  s.why = why + b;
}

/// --sp auto over packed documents: the largest Ulysses degree the heads allow whose groups lie within a node.
/// The model is of one sequence and does not see what documents cost the ring: it cuts them into pieces (zigzag:
/// 2P per document) whose tiles straddle, and with the contiguous layout it is unbalanced; Ulysses keeps every
/// document whole on each rank. Measured on CPU (Intel Xeon, 2 ranks, 16,384 tokens in 12 log-normal documents,
/// causal, forward+backward): Ulysses 1.32-1.53x the ring (docs/sequence_parallel.md). The model's predictions are
/// still reported.
inline void choose_for_documents(Strategy& s, const SpModelInputs& m) {
  s.model = m;
  s.predictions = predict_all(m);
  s.u = 1;
  for (const auto& p : s.predictions)
    if (p.u <= m.node_ranks && m.node_ranks % p.u == 0) s.u = std::max(s.u, p.u);
  s.why = "auto: packed documents: " +
          (s.u == 1 ? std::string("no Ulysses degree divides the heads within a node, the ring")
                    : "Ulysses degree " + std::to_string(s.u) +
                          ", the largest the heads allow within a node (every document whole on each rank)");
}

}  // namespace longseq
