#!/usr/bin/env python3
"""Ring-attention performance model, calibrated from kfa_bench_ring logs (python3 standard library only).

Two modes.

LEGACY (any command with --rate; unchanged, reproduces raw_ring_model_*_2026-11-29.txt): from one per-block
compute rate and link bandwidths, the step time, hidden fraction and efficiency of a forward ring step:
  compute = 4 * H * n^2 * d / rate                      (n = N / P tokens per rank; halve for causal)
  comm    = latency + 2 * H_kv * n * d * bytes / bandwidth
  step    = max(compute, comm);  hidden = min(1, compute / comm);  efficiency = compute / step
  python3 perf/ring_model.py --rate 94 --bandwidth 450 50 --heads 4 --head-dim 64 --dtype-bytes 4

CALIBRATED (no --rate; the default):
  python3 perf/ring_model.py [--calibrate LOG] [--validate LOG ...] [--staging-log LOG] [--csv FILE]
Every parameter is read from the calibration log (default perf/raw_h200_ring_2026-11-30/
s5call7_bench_ring.log: 2 x H200 NVLink, bf16, H = H_kv = 8, d = 128, causal zigzag, 131,072 tokens per
rank, NCCL 2.28, 2026-11-30, the fifth session's code: the backward's last step sends the accumulators home
while its dQ kernels compute) unless given on the command line; the script prints each one and says where
it came from. The P = 2 prediction is checked against a run the parameters were NOT taken from (--validate,
default s5call6: the same ring code in another device call); the host-staging runs are predicted with the
staging bandwidth of run4's staging log (older ring code: in-sample for the bandwidth only).

MEASURED (from the calibration log; n0 = its tokens per rank):
  r1f, r1b   single-call rate: P = 1 forward (one kernel call), P = 1 backward alone (the fwd+bwd record's
             only step); FLOPs 4*H*n^2*d/2 forward, 2.5x that backward (the bench counts fwd+bwd as 3.5x)
  rf, rb     the ring's per-step rate: P = 2 forward / backward step FLOPs (under zigzag every step has
             the FLOPs of the P = 1 call) over the mean step compute (kernels + fp32 merges / adds)
  bw         link bandwidth = one K/V shard (2 * n * H_kv * d * bytes) / "exchange alone" (the forward
             record's; logs since the fifth session time each step's own bytes alone): a simultaneous
             send of that many bytes to the next rank and receive from the previous one, on every rank
             (at P = 2 both directions of one GPU pair), barrier to fence, slowest rank: bytes per second
             per direction per GPU
  Of, Ob     per-call overhead at P > 1 (allocations, zero fills, loads/stores): forward total - sum of steps
             (compute + wait + imbalance); backward: fwd+bwd total - forward total (from the forward record
             of the same log) - sum of the backward's steps
  imb_f/b    load imbalance (end-of-step agreement) as a fraction of step compute
  acc_pass   backward, every step but the last: exposed time after the compute (before the fifth session
             the dK/dV accumulator copy/add before it moved on; now ~0), scaled with n / n0
  home_x     backward, last step: exposed time beyond what the model expects of the accumulators' trip
             home (its part not covered by the last step's dQ kernels), scaled with n / n0
  staging bw the same exchange through pinned host buffers (--staging-log, default run4's staging log)
ASSUMED (not measurable from these logs; printed as assumptions):
  latency    per message (--latency, 5 us): a single message size was timed, so it cannot be separated
  dQ share   of a backward step's compute (--dq-fraction, 3/7: 3 of the deterministic backward's 7 tile
             products): the last step's dQ kernels, behind which the accumulators travel home
  step cost  per step, not hidden: --step-overhead-us (10 us: kernel launches, event waits) plus the
             end-of-step MPI_Allreduce, 2 * ceil(log2 P) * latency (subtracted from the measured imbalance);
             added, not overlapped: timed runs fence every step, and untimed the host's per-step allreduce
             paces the device once a step's compute is shorter. It dominates strong scaling at P >= 256
             (the breakdown lines say by how much)
  links      NVLink at the measured bandwidth for every hop (P > 8 needs an NVLink-switch domain; otherwise
             the slowest hop, inter-node, sets every step); an inter-node link of --ib-gbs (50 GB/s,
             InfiniBand-class); host staging at its measured bandwidth, SERIALIZED with compute (as measured:
             run4's P = 2 forward step 0 took compute + exchange) unless --staging-overlap
  scaling    rates, overheads and imbalance fraction independent of P; Of, Ob fixed per call (part of them is
             proportional to n, so small shards are predicted pessimistically); per-step FLOPs equal (zigzag
             causal or non-causal); rates independent of n (kernels on small shards run slower: optimistic)
Model (P > 1; c = step compute; m = latency + bytes / bw; exposed(m) = max(0, m - c), or m when serialized):
  forward  = Of + P * (cf * (1 + imb_f) + step cost) + (P - 1) * exposed(m_kv)
  backward = Ob + P * (cb * (1 + imb_b) + step cost) + (P - 1) * acc_pass * n/n0
             + exposed(m_kv) [step 0] + (P - 2) * exposed(m_kv+acc) [K/V out, accumulator in, same link]
             + exposed(m_acc) [last step] + exposed(m_acc, q * cb) + home_x * n/n0 [the accumulators' trip
             home, behind the last step's dQ kernels, q = dQ share]
  P = 1: F / r1f (+ 2.5 F / r1b).  Weak-scaling efficiency = P * T(P=1, n) / T(P); strong = T(P=1, N) / (P T(P)).
STRATEGIES (--strategies): ring, Ulysses and the hybrid side by side, the model kfa-longseq --sp auto chooses by
(apps/kfa-longseq/strategy.hpp; the same formulas, keep the two in step). Per rank, Ulysses degree U, R = P / U:
  compute   C = 4*B*N^2*H*d (halved when causal) / P / rate, x3.5 with --backward (the same for every U)
  all-to-all (U > 1, not hidden): bytes sent / bw_a2a + a latency per message (forward q, k, v to heads and o,
            lse back; backward q, k, v, dO, lse, D to heads and dq, dk, dv back); bw_a2a = intra-node when U
            ranks fit a node (U divides the ranks per node), else inter-node
  ring      (R > 1): per step the K/V of a ring shard (N/R tokens, the key/value heads a rank holds; backward:
            plus fp32 dK/dV), exposed where a step's compute C/R does not hide it, R - 1 times; the backward's
            accumulators home after the last step (behind its dQ share, 3/7); inter-node links when P > node
  overhead  an agreement (2*ceil(log2 P) latencies) per ring step and per Ulysses stage
  python3 perf/ring_model.py --strategies --ranks 8 16 32 --node-ranks 8 --seq 1048576 --heads 32 --kv-heads 8 \
      --head-dim 128 --dtype-bytes 2 --causal --backward --kernel-tflops 500 --intra-gbs 150 --inter-gbs 25
  python3 perf/ring_model.py --strategies --from-json run.json   (shape and calibration of a kfa-longseq --sp auto
      run: its predictions again, for any other --ranks / --seq)
Communication hides completely above n* tokens per rank: forward cf(n*) = m_kv(n*); backward (middle steps)
cb(n*) = m_kv+acc(n*). No P > 2 run exists: the P = 8...1024 rows are extrapolations of this model.
"""
import argparse
import csv
import json
import math
import os
import re
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RAW = os.path.join(HERE, "raw_h200_ring_2026-11-30")
DEFAULT_CALIBRATE = os.path.join(RAW, "s5call7_bench_ring.log")
DEFAULT_VALIDATE = [os.path.join(RAW, "s5call6_bench_ring.log")]
DEFAULT_STAGING = os.path.join(RAW, "bench_ring_run4_staging.log")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}
DEFAULT_RANKS = [8, 16, 32, 64, 128, 256, 512, 1024]


# ---------------------------------------------------------------- legacy mode (unchanged)
def model(rate_gflops, bw_gbs, latency_us, heads, kv_heads, d, nbytes, p, n_total, causal):
    n = n_total / p
    compute = 4.0 * heads * n * n * d / (rate_gflops * 1e9) * (0.5 if causal else 1.0)
    comm = latency_us * 1e-6 + 2.0 * kv_heads * n * d * nbytes / (bw_gbs * 1e9)
    step = max(compute, comm)
    return n, compute, comm, step, min(1.0, compute / comm), compute / step


def threshold(rate_gflops, bw_gbs, latency_us, heads, kv_heads, d, nbytes, causal):
    """Smallest n with compute(n) >= comm(n), by bisection (latency makes it non-linear)."""
    lo, hi = 1.0, 1e9
    for _ in range(200):
        mid = (lo + hi) / 2
        c = 4.0 * heads * mid * mid * d / (rate_gflops * 1e9) * (0.5 if causal else 1.0)
        m = latency_us * 1e-6 + 2.0 * kv_heads * mid * d * nbytes / (bw_gbs * 1e9)
        lo, hi = (mid, hi) if c < m else (lo, mid)
    return hi


def legacy(a):
    heads = a.heads or 16
    kv = a.kv_heads or heads
    d = a.head_dim or 128
    nbytes = a.dtype_bytes or 2
    bws = a.bandwidth or [450.0, 50.0]
    seqs = a.seq or [1 << 20, 1 << 22, 1 << 24]
    latency = 5.0 if a.latency is None else a.latency
    rows = []
    print(f"# rate {a.rate} GFLOP/s per rank, heads {heads}/{kv}, d {d}, {nbytes}-byte K/V, "
          f"latency {latency} us, {'causal (zigzag)' if a.causal else 'non-causal'}")
    for bw in bws:
        nstar = threshold(a.rate, bw, latency, heads, kv, d, nbytes, a.causal)
        print(f"\n## link {bw} GB/s: communication hides completely above {nstar:,.0f} tokens per rank")
        print(f"{'N':>10} {'P':>6} {'tokens/rank':>12} {'compute ms':>11} {'comm ms':>9} {'step ms':>9} "
              f"{'hidden':>7} {'efficiency':>10}")
        for n_total in seqs:
            for p in a.ranks:
                n, c, m, s, h, e = model(a.rate, bw, latency, heads, kv, d, nbytes, p, n_total, a.causal)
                print(f"{n_total:>10} {p:>6} {n:>12,.0f} {c * 1e3:>11.3f} {m * 1e3:>9.3f} {s * 1e3:>9.3f} "
                      f"{h:>7.2f} {e:>10.2f}")
                rows.append(dict(bandwidth_gbs=bw, seq=n_total, ranks=p, tokens_per_rank=n, compute_s=c, comm_s=m,
                                 step_s=s, hidden=h, efficiency=e, hide_threshold_tokens=nstar))
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return 0


# ---------------------------------------------------------------- bench_ring log parsing
SINGLE_RE = re.compile(r"kfa_bench_ring (\w+) transport: (.*?); single \(one local call on one shard, (\d+) tokens\): "
                       r"([\d.]+) s")
MAIN_RE = re.compile(r"kfa_bench_ring P=(\d+) N=(\d+) tokens/rank=(\d+) heads=(\d+)/(\d+) d=(\d+) layout=(\w+) "
                     r"causal=(\d) (fwd\+bwd|fwd): time ([\d.]+) s, .*?compute ([\d.]+) s, wait ([\d.]+) s"
                     r"(?:, imbalance ([\d.]+) s)?, exchange alone ([\d.]+) s, hidden ([\d.]+)")
STEP_RE = re.compile(r"\s+step (\d+): compute ([\d.]+) s, wait ([\d.]+) s(?:, imbalance ([\d.]+) s)?, (\d+) bytes "
                     r"sent by rank 0(?: \(alone ([\d.]+) s\))?, (\d+) blocks")


def parse_log(path):
    """Records of one kfa_bench_ring output (with --steps): one dict per 'P=...' line."""
    recs, single = [], None
    with open(path) as f:
        for line in f:
            m = SINGLE_RE.search(line)
            if m:
                single = dict(dtype=m.group(1), transport=m.group(2), single_s=float(m.group(4)))
                continue
            m = MAIN_RE.search(line)
            if m:
                g = m.groups()
                recs.append(dict(file=os.path.basename(path), p=int(g[0]), n_total=int(g[1]), n=int(g[2]),
                                 heads=int(g[3]), kv=int(g[4]), d=int(g[5]), layout=g[6], causal=g[7] == "1",
                                 bwd=g[8] == "fwd+bwd", total=float(g[9]), compute=float(g[10]), wait=float(g[11]),
                                 imb=float(g[12] or 0.0), exch=float(g[13]), hidden=float(g[14]), steps=[],
                                 **(single or {})))
                single = None
                continue
            m = STEP_RE.match(line)
            if m and recs:
                recs[-1]["steps"].append(dict(compute=float(m.group(2)), wait=float(m.group(3)),
                                              imb=float(m.group(4) or 0.0), bytes=int(m.group(5)),
                                              alone=None if m.group(6) is None else float(m.group(6)),
                                              blocks=int(m.group(7))))
    return recs


def find(recs, p, bwd):
    for r in recs:
        if r["p"] == p and r["bwd"] == bwd:
            return r
    return None


# ---------------------------------------------------------------- calibrated model
class Model:
    def __init__(self, heads, kv, d, nbytes, causal, latency_s, step_s):
        self.heads, self.kv, self.d, self.nbytes, self.causal = heads, kv, d, nbytes, causal
        self.acc = 8 if nbytes == 8 else 4  # accumulator_t: double for double, float otherwise
        self.lat, self.step_s = latency_s, step_s
        # filled by calibrate() or the command line
        self.r1f = self.r1b = self.rf = self.rb = None
        self.of = self.ob = 0.0
        self.imb_f = self.imb_b = 0.0
        self.acc_pass = self.home_x = 0.0
        self.dq_frac = 3.0 / 7.0  # ASSUMED share of a backward step's compute in its dQ kernels
        self.n0 = 1

    def flops(self, n):  # one step = one P = 1 call on n tokens (zigzag causal or non-causal)
        return 4.0 * self.heads * n * n * self.d * (0.5 if self.causal else 1.0)

    def kv_bytes(self, n):
        return 2.0 * n * self.kv * self.d * self.nbytes

    def acc_bytes(self, n):
        return 2.0 * n * self.kv * self.d * self.acc

    def xfer(self, nbytes, bw):
        return self.lat + nbytes / bw

    def fixed(self, p):  # assumed per-step cost: launches + end-of-step MPI_Allreduce
        return self.step_s + 2 * math.ceil(math.log2(p)) * self.lat if p > 1 else 0.0

    def predict(self, p, n, bw, serial=False):
        """Forward and forward+backward time of one call for P ranks with n tokens each."""
        f = self.flops(n)
        cf, cb = f / self.rf, 2.5 * f / self.rb
        if p == 1:
            tf = f / self.r1f
            return dict(cf=f / self.r1f, cb=2.5 * f / self.r1b, mf=0.0, mb=0.0, hf=1.0, hb=1.0, home=0.0,
                        tf=tf, tfb=tf + 2.5 * f / self.r1b,
                        parts=dict(overhead=0.0, compute=tf, imbalance=0.0, step_cost=0.0, exposed_comm=0.0))
        exposed = (lambda m, c: m) if serial else (lambda m, c: max(0.0, m - c))
        m_kv, m_acc = self.xfer(self.kv_bytes(n), bw), self.xfer(self.acc_bytes(n), bw)
        m_mid = self.xfer(self.kv_bytes(n) + self.acc_bytes(n), bw)
        fx, scale = self.fixed(p), n / self.n0
        tf = self.of + p * (cf * (1 + self.imb_f) + fx) + (p - 1) * exposed(m_kv, cf)
        home = exposed(m_acc, self.dq_frac * cb) + self.home_x * scale
        tb = (self.ob + p * (cb * (1 + self.imb_b) + fx) + (p - 1) * self.acc_pass * scale + exposed(m_kv, cb)
              + max(0, p - 2) * exposed(m_mid, cb) + exposed(m_acc, cb) + home)
        mb = m_mid if p > 2 else max(m_kv, m_acc)
        hide = (lambda c, m: 0.0) if serial else (lambda c, m: min(1.0, c / m))
        # where the forward's time goes (for the breakdown lines and the CSV)
        parts = dict(overhead=self.of, compute=p * cf, imbalance=p * cf * self.imb_f, step_cost=p * fx,
                     exposed_comm=(p - 1) * exposed(m_kv, cf))
        return dict(cf=cf, cb=cb, mf=m_kv, mb=mb, hf=hide(cf, m_kv), hb=hide(cb, mb), home=home, tf=tf, tfb=tf + tb,
                    parts=parts)

    def threshold(self, bw, backward):
        """Smallest n per rank whose step compute covers the step's transfer (bisection)."""
        lo, hi = 1.0, 1e9
        for _ in range(200):
            n = (lo + hi) / 2
            if backward:
                c, m = 2.5 * self.flops(n) / self.rb, self.xfer(self.kv_bytes(n) + self.acc_bytes(n), bw)
            else:
                c, m = self.flops(n) / self.rf, self.xfer(self.kv_bytes(n), bw)
            lo, hi = (n, hi) if c < m else (lo, n)
        return hi


def calibrate(mdl, recs, out):
    """Rates, overheads, bandwidth from one bench_ring log (P = 1 and P = 2 records, fwd and fwd+bwd)."""
    f1 = find(recs, 1, False)
    fb1 = find(recs, 1, True)
    f2 = next((r for r in recs if r["p"] > 1 and not r["bwd"]), None)
    fb2 = next((r for r in recs if r["p"] > 1 and r["bwd"]), None)
    if not f2 or not fb2 or not f2["steps"] or not fb2["steps"]:
        sys.exit("ring_model.py: the calibration log needs P > 1 forward and fwd+bwd records with --steps")
    n = f2["n"]
    mdl.n0 = n
    F = mdl.flops(n)
    out(f"  shapes: {n:,} tokens per rank, heads {mdl.heads}/{mdl.kv}, d {mdl.d}, {mdl.nbytes}-byte K/V, "
        f"{mdl.acc}-byte dK/dV accumulators, {'causal ' if mdl.causal else ''}{f2['layout']}; "
        f"one step = one P = 1 call = {F:.4e} FLOP forward, {2.5 * F:.4e} backward")
    # single-call rates
    if f1:
        t1f, src = f1["total"], f"P = 1 ring call (one kernel call), time {f1['total']:.4f} s"
    else:
        t1f, src = f2["single_s"], f"'single' line of the P = {f2['p']} run (both GPUs busy), {f2['single_s']:.4f} s"
    mdl.r1f = F / t1f
    if fb1:
        t1b, srcb = fb1["steps"][0]["compute"], (f"P = 1 fwd+bwd record's step (backward alone) "
                                                  f"{fb1['steps'][0]['compute']:.4f} s (fwd+bwd {fb1['total']:.4f} s)")
    else:
        t1b = fb2["single_s"] - f2["single_s"]
        srcb = f"'single' fwd+bwd {fb2['single_s']:.4f} s - 'single' fwd {f2['single_s']:.4f} s"
    mdl.r1b = 2.5 * F / t1b
    # ring per-step rates
    sf = [s["compute"] for s in f2["steps"]]
    sb = [s["compute"] for s in fb2["steps"]]
    mdl.rf = F / statistics.mean(sf)
    mdl.rb = 2.5 * F / statistics.mean(sb)
    out(f"  single-call forward rate  r1f = {mdl.r1f / 1e12:7.1f} TFLOP/s   ({src})")
    out(f"  ring step forward rate    rf  = {mdl.rf / 1e12:7.1f} TFLOP/s   (P = {f2['p']} steps "
        f"{', '.join(f'{x:.4f}' for x in sf)} s, mean {statistics.mean(sf):.4f} s) = {mdl.rf / mdl.r1f:.3f} x r1f "
        f"({(1 - mdl.rf / mdl.r1f) * 100:.1f}% slower)")
    out(f"  single-call backward rate r1b = {mdl.r1b / 1e12:7.1f} TFLOP/s   ({srcb})")
    out(f"  ring step backward rate   rb  = {mdl.rb / 1e12:7.1f} TFLOP/s   (P = {fb2['p']} steps "
        f"{', '.join(f'{x:.4f}' for x in sb)} s, mean {statistics.mean(sb):.4f} s) = {mdl.rb / mdl.r1b:.3f} x r1b "
        f"({(1 - mdl.rb / mdl.r1b) * 100:.1f}% slower)")
    # link bandwidth: K/V shard over the exchange-alone time
    msg = mdl.kv_bytes(n)
    sent = f2["steps"][0]["bytes"]
    if sent != msg:
        out(f"  NOTE: step 0 sent {sent} bytes, model's K/V shard is {msg:.0f} bytes")
    per_step = f2["steps"][0].get("alone") is not None  # the bench times each step's own bytes alone
    exch = f2["exch"] if per_step else statistics.mean([f2["exch"], fb2["exch"]])
    bw = msg / exch
    how = (f"the forward record's" if per_step else f"mean of {f2['exch']:.4f} and {fb2['exch']:.4f}")
    out(f"  link bandwidth            bw  = {bw / 1e9:7.1f} GB/s per direction per GPU: {msg:.0f} B (one K/V shard) "
        f"sent to the next rank while as many arrive from the previous one, in {exch:.4f} s (exchange alone, "
        f"{how}; printed to 0.1 ms: +-{0.00005 / exch * 100:.0f}%); {2 * bw / 1e9:.0f} GB/s both directions")
    # overheads and imbalance
    p2 = f2["p"]
    sum_f = sum(s["compute"] + s["wait"] + s["imb"] for s in f2["steps"])
    mdl.of = f2["total"] - sum_f
    mdl.imb_f = max(0.0, sum(s["imb"] for s in f2["steps"]) - p2 * mdl.fixed(p2)) / sum(sf)
    sum_b = sum(s["compute"] + s["wait"] + s["imb"] for s in fb2["steps"])
    mdl.ob = fb2["total"] - f2["total"] - sum_b
    mdl.imb_b = max(0.0, sum(s["imb"] for s in fb2["steps"]) - fb2["p"] * mdl.fixed(fb2["p"])) / sum(sb)
    out(f"  forward per-call overhead  Of = {mdl.of * 1e3:6.1f} ms  (total {f2['total']:.4f} s - steps "
        f"{sum_f:.4f} s (compute + wait + imbalance))")
    out(f"  backward per-call overhead Ob = {mdl.ob * 1e3:6.1f} ms  (fwd+bwd total {fb2['total']:.4f} s - forward "
        f"total {f2['total']:.4f} s - backward steps {sum_b:.4f} s)")
    out(f"  imbalance: forward {mdl.imb_f * 100:.2f}%, backward {mdl.imb_b * 100:.2f}% of step compute "
        f"(measured {sum(s['imb'] for s in f2['steps']) * 1e3:.1f} / {sum(s['imb'] for s in fb2['steps']) * 1e3:.1f} "
        f"ms minus the assumed per-step cost)")
    # backward exposed accumulator passes
    last = len(fb2["steps"]) - 1
    m_kv, m_acc = mdl.xfer(msg, bw), mdl.xfer(mdl.acc_bytes(n), bw)
    mid = [s["wait"] - max(0.0, m_kv - s["compute"]) for s in fb2["steps"][:last]]
    mdl.acc_pass = max(0.0, statistics.mean(mid)) if mid else 0.0
    w_last, c_last = fb2["steps"][last]["wait"], fb2["steps"][last]["compute"]
    home_expected = max(0.0, m_acc - mdl.dq_frac * c_last)  # the trip home not covered by the dQ kernels
    mdl.home_x = max(0.0, w_last - home_expected - max(0.0, m_acc - c_last))
    out(f"  backward accumulator pass per step (not last) acc_pass = {mdl.acc_pass * 1e3:.1f} ms (step waits "
        f"{', '.join('%.4f' % s['wait'] for s in fb2['steps'][:last])} s; the K/V transfer itself is hidden)")
    out(f"  backward last step: wait {w_last * 1e3:.1f} ms; accumulators home {mdl.acc_bytes(n):.0f} B at bw "
        f"{m_acc * 1e3:.1f} ms behind dQ kernels of ~{mdl.dq_frac * c_last * 1e3:.0f} ms (ASSUMED dQ share "
        f"{mdl.dq_frac:.3f}): expected exposed {home_expected * 1e3:.1f} ms, home_x {mdl.home_x * 1e3:.1f} ms")
    return bw


def fmt_err(pred, meas):
    return f"{(pred - meas) / meas * 100:+6.1f}%"


def validate(mdl, paths, bw, staging_bw, out, calib_name, staging_log=None):
    out(f"\n## P = 2 (and P = 1) predicted with {calib_name}'s parameters vs runs they were not taken from")
    out(f"{'log':<34} {'P':>2} {'pass':<8} {'transport':<15} {'measured s':>10} {'predicted s':>11} {'error':>7}")
    for path in paths:
        for r in parse_log(path):
            staging = "staging" in r.get("transport", "")
            link = staging_bw if staging else bw
            variants = [("serial", True), ("overlap", False)] if staging and r["p"] > 1 else [("", False)]
            for label, serial in variants:
                pr = mdl.predict(r["p"], r["n"], link, serial)
                pred = pr["tfb"] if r["bwd"] else pr["tf"]
                tr = ("staging" if staging else "NCCL" if r["p"] > 1 else "none") + (f" {label}" if label else "")
                out(f"{r['file']:<34} {r['p']:>2} {'fwd+bwd' if r['bwd'] else 'fwd':<8} {tr:<15} {r['total']:>10.4f} "
                    f"{pred:>11.4f} {fmt_err(pred, r['total']):>7}")
    if staging_log and staging_bw:
        out(f"  host staging ({os.path.basename(staging_log)}): rates and overheads from {calib_name}, the staging "
            f"bandwidth from this same log (in-sample); 'serial' = transfer after compute, 'overlap' = hidden")
        for r in parse_log(staging_log):
            for label, serial in ([("serial", True), ("overlap", False)] if r["p"] > 1 else [("", False)]):
                pr = mdl.predict(r["p"], r["n"], staging_bw, serial)
                pred = pr["tfb"] if r["bwd"] else pr["tf"]
                out(f"{r['file']:<34} {r['p']:>2} {'fwd+bwd' if r['bwd'] else 'fwd':<8} {'staging ' + label:<15} "
                    f"{r['total']:>10.4f} {pred:>11.4f} {fmt_err(pred, r['total']):>7}")
    f2 = mdl.flops(mdl.n0)
    t_single = mdl.of + 2 * f2 / mdl.r1f
    out(f"  (with the single-call rate r1f instead of rf, P = 2 forward would be predicted {t_single:.4f} s: the "
        f"ring's own step rate matters)")


def scaling_tables(mdl, links, ranks, per_rank, seqs, out, rows):
    for label, bw, serial in links:
        out(f"\n## link: {label}, {bw / 1e9:.2f} GB/s{' (transfer serialized with compute)' if serial else ''}")
        nf, nb = mdl.threshold(bw, False), mdl.threshold(bw, True)
        if serial:
            out(f"  communication never hides (serialized); with overlap it would hide above {nf:,.0f} tokens per "
                f"rank forward, {nb:,.0f} backward")
        else:
            out(f"  communication hides completely above {nf:,.0f} tokens per rank forward, {nb:,.0f} backward "
                f"(K/V + accumulators per step)")
        cases = [("weak", n * p, n, p) for n in per_rank for p in ranks] + \
                [("strong", N, N / p, p) for N in seqs for p in ranks]
        hdr = (f"{'scaling':<7} {'P':>5} {'N':>11} {'tok/rank':>9} | {'fwd step':>9} {'K/V msg':>9} {'hidden':>6} "
               f"{'fwd s':>10} {'TF/GPU':>7} {'eff':>5} | {'bwd step':>9} {'bwd msg':>9} {'hidden':>6} "
               f"{'home ms':>8} {'fwd+bwd s':>10} {'TF/GPU':>7} {'eff':>5}")
        out(f"  times per step in ms; TF/GPU = whole-sequence TFLOP/s per GPU (fwd+bwd 3.5x); eff: weak = P T1(n)/T, "
            f"strong = T1(N)/(P T)")
        out(hdr)
        prev = None
        for kind, N, n, p in cases:
            if prev and prev != kind:
                out("")
            prev = kind
            pr = mdl.predict(p, n, bw, serial)
            one = mdl.predict(1, n if kind == "weak" else N, bw)
            fl = mdl.flops(N)  # whole sequence, causal halved
            eff_f = (p * one["tf"] if kind == "weak" else one["tf"] / p) / pr["tf"]
            eff_b = (p * one["tfb"] if kind == "weak" else one["tfb"] / p) / pr["tfb"]
            tff, tfb = fl / pr["tf"] / p / 1e12, 3.5 * fl / pr["tfb"] / p / 1e12
            out(f"{kind:<7} {p:>5} {N:>11,} {n:>9,.0f} | {pr['cf'] * 1e3:>9.3f} {pr['mf'] * 1e3:>9.3f} {pr['hf']:>6.2f} "
                f"{pr['tf']:>10.4f} {tff:>7.1f} {eff_f:>5.2f} | {pr['cb'] * 1e3:>9.3f} {pr['mb'] * 1e3:>9.3f} "
                f"{pr['hb']:>6.2f} {pr['home'] * 1e3:>8.2f} {pr['tfb']:>10.4f} {tfb:>7.1f} {eff_b:>5.2f}")
            rows.append(dict(link=label, bandwidth_gbs=bw / 1e9, serialized=int(serial), scaling=kind, ranks=p, seq=N,
                             tokens_per_rank=n, fwd_step_compute_s=pr["cf"], fwd_msg_s=pr["mf"], fwd_hidden=pr["hf"],
                             fwd_s=pr["tf"], fwd_tflops_per_gpu=tff, fwd_efficiency=eff_f, bwd_step_compute_s=pr["cb"],
                             bwd_msg_s=pr["mb"], bwd_hidden=pr["hb"], home_s=pr["home"], fwd_bwd_s=pr["tfb"],
                             fwd_bwd_tflops_per_gpu=tfb, fwd_bwd_efficiency=eff_b, hide_threshold_fwd_tokens=nf,
                             hide_threshold_bwd_tokens=nb, **{f"fwd_{k}_s": v for k, v in pr["parts"].items()}))
        for kind, N, n, p in cases[-1:]:
            pr = mdl.predict(p, n, bw, serial)
            one = mdl.predict(1, N, bw)
            ideal = pr["tf"] - pr["parts"]["step_cost"]
            out(f"  {kind} P = {p} forward {pr['tf'] * 1e3:.1f} ms = " + " + ".join(
                f"{k.replace('_', ' ')} {v * 1e3:.1f}" for k, v in pr["parts"].items()) + " ms; without the assumed "
                f"per-step cost: efficiency {one['tf'] / p / ideal:.2f} instead of {one['tf'] / p / pr['tf']:.2f}")


def calibrated(a):
    recs = parse_log(a.calibrate)
    if not recs:
        sys.exit(f"ring_model.py: no kfa_bench_ring records in {a.calibrate}")
    r0 = next(r for r in recs if r["p"] > 1)
    mdl = Model(a.heads or r0["heads"], a.kv_heads or (a.heads or r0["kv"]), a.head_dim or r0["d"],
                a.dtype_bytes or DTYPE_BYTES.get(r0.get("dtype", "bfloat16"), 2), r0["causal"] or a.causal,
                (5.0 if a.latency is None else a.latency) * 1e-6, a.step_overhead_us * 1e-6)
    rel = lambda p: os.path.relpath(p, os.path.dirname(HERE))
    out = print
    out("# ring_model.py, calibrated: measured rates and bandwidths from kfa_bench_ring logs; assumptions marked")
    out(f"# command: python3 perf/ring_model.py {' '.join(sys.argv[1:])}".rstrip())
    out(f"\n## Calibration (MEASURED): {rel(a.calibrate)} ({r0.get('dtype', '?')}, transport {r0.get('transport', '?')})")
    mdl.dq_frac = a.dq_fraction
    bw = calibrate(mdl, recs, out)
    for name, val in (("r1f", a.single_fwd_rate), ("r1b", a.single_bwd_rate), ("rf", a.fwd_rate), ("rb", a.bwd_rate)):
        if val is not None:
            setattr(mdl, name, val * 1e12)
            out(f"  OVERRIDE {name} = {val} TFLOP/s (command line)")
    if a.fwd_overhead is not None:
        mdl.of = a.fwd_overhead
        out(f"  OVERRIDE Of = {a.fwd_overhead} s")
    if a.bwd_overhead is not None:
        mdl.ob = a.bwd_overhead
        out(f"  OVERRIDE Ob = {a.bwd_overhead} s")
    if a.nvlink_gbs is not None:
        bw = a.nvlink_gbs * 1e9
        out(f"  OVERRIDE bw = {a.nvlink_gbs} GB/s")
    # host staging bandwidth
    staging_bw = None
    if a.staging_gbs is not None:
        staging_bw = a.staging_gbs * 1e9
    elif a.staging_log:
        srec = [r for r in parse_log(a.staging_log) if r["p"] > 1]
        if srec:
            ex = statistics.mean(r["exch"] for r in srec)
            staging_bw = mdl.kv_bytes(srec[0]["n"]) / ex
            out(f"  host-staging bandwidth = {staging_bw / 1e9:.2f} GB/s per direction ({rel(a.staging_log)}: exchange "
                f"alone {', '.join('%.4f' % r['exch'] for r in srec)} s, mean {ex:.4f} s; transport "
                f"{srec[0].get('transport', '?')}, includes the device<->host copies)")
    out(f"\n## ASSUMED: latency {mdl.lat * 1e6:g} us per message; per-step cost {mdl.step_s * 1e6:g} us + end-of-step "
        f"MPI_Allreduce 2*ceil(log2 P)*latency ({mdl.fixed(8) * 1e6:g} us at P = 8, {mdl.fixed(1024) * 1e6:g} us at "
        f"P = 1024); rates, overheads, imbalance independent of P and n")
    calib_name = os.path.basename(a.calibrate)
    if a.validate:
        validate(mdl, a.validate, bw, staging_bw or bw, out, calib_name,
                 a.staging_log if (staging_bw and a.staging_gbs is None) else None)
    links = []
    if a.bandwidth:
        links = [(f"{b:g} GB/s (command line)", b * 1e9, False) for b in a.bandwidth]
    else:
        links.append((f"NVLink, MEASURED exchange bandwidth, every hop ({calib_name})", bw, False))
        links.append((f"ASSUMPTION: inter-node link, InfiniBand-class {a.ib_gbs:g} GB/s per direction, every hop",
                      a.ib_gbs * 1e9, False))
        if staging_bw:
            links.append(("host staging, MEASURED bandwidth (pinned buffers, Open MPI 4.1 shared memory)"
                          + ("" if a.staging_overlap else ", serialized as measured"), staging_bw,
                          not a.staging_overlap))
    per_rank = a.tokens_per_rank or [mdl.n0]
    seqs = a.seq or [1 << 20]
    out(f"\n## Predictions: weak scaling {', '.join(f'{n:,}' for n in per_rank)} tokens per GPU; strong scaling "
        f"{', '.join(f'{N:,}' for N in seqs)} tokens; P = {', '.join(map(str, a.ranks))} (EXTRAPOLATED: measured "
        f"P = 1, 2 only)")
    rows = []
    scaling_tables(mdl, links, a.ranks, per_rank, seqs, out, rows)
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows({k: float(f"{v:.6g}") if isinstance(v, float) else v for k, v in r.items()} for r in rows)
    return 0


# ---------------------------------------------------------------- strategies mode
def kv_local_heads(heads, kv_heads, u):
    ql, g = heads // u, heads // kv_heads
    if kv_heads % u == 0:
        return kv_heads // u
    if g % ql == 0:
        return 1
    return ql


def predict_strategy(m, u):
    """kfa-longseq's SpPrediction for Ulysses degree u: dict of compute, a2a, ring, overhead, total seconds."""
    p = m["ranks"]
    r = p // u
    n, b, e, a, d = m["seq"] / p, m["batch"], m["elem_bytes"], m["acc_bytes"], m["d"]
    hl, kvl = m["heads"] / u, kv_local_heads(m["heads"], m["kv_heads"], u)
    flops = 4.0 * b * m["seq"] * m["seq"] * m["heads"] * d * (0.5 if m["causal"] else 1.0)
    cf = flops / p / m["rate"]
    cb = 2.5 * cf
    out = {"u": u, "compute": cf + (cb if m["backward"] else 0.0), "a2a": 0.0, "ring": 0.0, "overhead": 0.0}
    multi_node = m["node_ranks"] < p
    groups_in_node = u <= m["node_ranks"] and m["node_ranks"] % u == 0
    lat_agree = 2.0 * math.ceil(math.log2(max(2, p))) * m["latency_s"]
    if u > 1:
        bw, peers = (m["bw_intra"] if groups_in_node else m["bw_inter"]), u - 1
        nbytes = peers * b * n * ((hl + 2 * kvl) * d * e + hl * (d * e + a))
        messages = 5
        if m["backward"]:
            nbytes += peers * b * n * ((2 * hl + 2 * kvl) * d * e + 2 * hl * a + (hl + 2 * kvl) * d * e)
            messages += 9
        out["a2a"] = nbytes / bw + messages * peers * m["latency_s"]
        out["overhead"] += (10 if m["backward"] else 5) * lat_agree
    if r > 1:
        bw = m["bw_inter"] if multi_node else m["bw_intra"]
        shard = b * (m["seq"] / r) * kvl * d
        kv = 2 * shard * e / bw + m["latency_s"]
        acc = 2 * shard * a / bw + m["latency_s"]
        out["ring"] = (r - 1) * max(0.0, kv - cf / r)
        if m["backward"]:
            out["ring"] += (r - 1) * max(0.0, kv + acc - cb / r) + max(0.0, acc - cb / r * 3.0 / 7.0)
        out["overhead"] += (2 if m["backward"] else 1) * r * lat_agree
    out["total"] = out["compute"] + out["a2a"] + out["ring"] + out["overhead"]
    return out


def strategy_name(u, p):
    return "ring" if u == 1 else "ulysses" if u == p else f"hybrid U={u}"


def strategies(a):
    """--strategies: every Ulysses degree's prediction per (P, N), the smallest marked; --csv writes the rows."""
    m0 = {"batch": 1, "heads": a.heads or 32, "kv_heads": a.kv_heads or a.heads or 32, "d": a.head_dim or 128,
          "elem_bytes": a.dtype_bytes or 2, "acc_bytes": 8 if a.dtype_bytes == 8 else 4, "causal": a.causal,
          "backward": a.backward, "rate": (a.kernel_tflops or 500.0) * 1e12, "bw_intra": (a.intra_gbs or 150.0) * 1e9,
          "bw_inter": (a.inter_gbs or 25.0) * 1e9, "latency_s": (a.latency or 5.0) * 1e-6,
          "node_ranks": a.node_ranks or 8}
    ranks, seqs = a.ranks, a.seq or [2 ** 20]
    if a.from_json:
        with open(a.from_json) as f:
            j = json.load(f)
        if not j.get("sp_model"):
            sys.exit(f"ring_model.py: {a.from_json} has no sp_model (kfa-longseq --sp auto on two ranks or more)")
        cal = j["sp_model"]
        m0.update({"batch": j["batch"], "heads": j["heads"], "kv_heads": j["kv_heads"], "d": j["head_dim"],
                   "elem_bytes": DTYPE_BYTES[j["dtype"]], "acc_bytes": 8 if j["dtype"] == "float64" else 4,
                   "causal": j["causal"], "backward": j["backward"], "rate": cal["rate_flops"],
                   "bw_intra": cal["bw_intra_bytes_per_s"], "bw_inter": cal["bw_inter_bytes_per_s"],
                   "latency_s": cal["latency_s"], "node_ranks": cal["node_ranks"]})
        if a.ranks == DEFAULT_RANKS:
            ranks = [j["ranks"]]
        if not a.seq:
            seqs = [j["seq"]]
    print(f"strategies model: batch {m0['batch']}, heads {m0['heads']}/{m0['kv_heads']}, d {m0['d']}, "
          f"{m0['elem_bytes']}-byte elements, {'causal' if m0['causal'] else 'non-causal'}, "
          f"{'forward+backward' if m0['backward'] else 'forward'}; kernel {m0['rate'] * 1e-12:.4g} TFLOP/s per rank, "
          f"intra-node {m0['bw_intra'] * 1e-9:.4g} GB/s, inter-node {m0['bw_inter'] * 1e-9:.4g} GB/s, "
          f"latency {m0['latency_s'] * 1e6:.3g} us, {m0['node_ranks']} ranks per node")
    rows = []
    for p in ranks:
        for n in seqs:
            m = dict(m0, ranks=p, seq=n)
            preds = [predict_strategy(m, u) for u in range(1, p + 1) if p % u == 0 and m["heads"] % u == 0]
            best = min(preds, key=lambda x: x["total"])
            for x in preds:
                rows.append({"ranks": p, "seq": n, "strategy": strategy_name(x["u"], p), "u": x["u"],
                             "ring_degree": p // x["u"], "compute_s": x["compute"], "a2a_s": x["a2a"],
                             "ring_exposed_s": x["ring"], "overhead_s": x["overhead"], "total_s": x["total"],
                             "chosen": x is best})
                print(f"P {p:5d} N {n:9d} {strategy_name(x['u'], p):>14s} (R {p // x['u']:4d}): total "
                      f"{x['total']:.6g} s = compute {x['compute']:.4g} + all-to-all {x['a2a']:.4g} + ring exposed "
                      f"{x['ring']:.4g} + overhead {x['overhead']:.4g}{'   <- chosen' if x is best else ''}")
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
            w.writeheader()
            w.writerows(rows)
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, help="LEGACY mode: per-rank block compute rate, GFLOP/s")
    ap.add_argument("--bandwidth", type=float, nargs="+",
                    help="link bandwidths, GB/s (legacy default: 450 50; calibrated mode: replaces the link list)")
    ap.add_argument("--latency", type=float, help="per-message latency, microseconds (assumed; default 5)")
    ap.add_argument("--heads", type=int, help="query heads (legacy default 16; calibrated: from the log)")
    ap.add_argument("--kv-heads", type=int, default=0, help="default: --heads (calibrated: from the log)")
    ap.add_argument("--head-dim", type=int, help="legacy default 128; calibrated: from the log")
    ap.add_argument("--dtype-bytes", type=int, help="legacy default 2; calibrated: from the log's dtype")
    ap.add_argument("--causal", action="store_true", help="zigzag-balanced causal: half the compute per step "
                    "(calibrated: from the log)")
    ap.add_argument("--ranks", type=int, nargs="+", default=DEFAULT_RANKS)
    ap.add_argument("--seq", type=int, nargs="+",
                    help="sequence lengths (legacy default 2^20 2^22 2^24; calibrated: strong scaling, default 2^20)")
    ap.add_argument("--csv", help="also write every row to this CSV file")
    g = ap.add_argument_group("calibrated mode (defaults: the 2026-11-30 H200 measurements)")
    g.add_argument("--calibrate", default=DEFAULT_CALIBRATE, help="bench_ring log with P = 1 and P = 2 records "
                   "(--steps), fwd and fwd+bwd (default: %(default)s)")
    g.add_argument("--validate", nargs="*", default=DEFAULT_VALIDATE,
                   help="logs to predict with the calibrated parameters (default: run5's NCCL logs)")
    g.add_argument("--staging-log", default=DEFAULT_STAGING, help="bench_ring log of the host-staging transport, "
                   "for its bandwidth (default: %(default)s)")
    g.add_argument("--staging-gbs", type=float, help="host-staging bandwidth, GB/s (default: from --staging-log)")
    g.add_argument("--staging-overlap", action="store_true", help="model the staging transfer overlapping compute "
                   "(default: serialized, as measured)")
    g.add_argument("--nvlink-gbs", type=float, help="override the measured link bandwidth, GB/s")
    g.add_argument("--ib-gbs", type=float, default=50.0, help="ASSUMED inter-node link, GB/s (default 50)")
    g.add_argument("--tokens-per-rank", type=int, nargs="+", help="weak scaling (default: the log's, 131072)")
    g.add_argument("--dq-fraction", type=float, default=3.0 / 7.0,
                   help="ASSUMED share of a backward step's compute in its dQ kernels (default 3/7)")
    g.add_argument("--step-overhead-us", type=float, default=10.0,
                   help="ASSUMED per-step cost not hidden (launches, events), us; plus the allreduce (default 10)")
    g.add_argument("--single-fwd-rate", type=float, help="override r1f, TFLOP/s")
    g.add_argument("--single-bwd-rate", type=float, help="override r1b, TFLOP/s")
    g.add_argument("--fwd-rate", type=float, help="override rf (ring step forward rate), TFLOP/s")
    g.add_argument("--bwd-rate", type=float, help="override rb (ring step backward rate), TFLOP/s")
    g.add_argument("--fwd-overhead", type=float, help="override Of, seconds")
    g.add_argument("--bwd-overhead", type=float, help="override Ob, seconds")
    st = ap.add_argument_group("strategies mode (ring, Ulysses, hybrid; kfa-longseq --sp auto's model)")
    st.add_argument("--strategies", action="store_true", help="predict ring, Ulysses and hybrid side by side")
    st.add_argument("--from-json", help="a kfa-longseq --sp auto --json summary: its shape and calibration")
    st.add_argument("--node-ranks", type=int, help="ranks per node (default 8)")
    st.add_argument("--kernel-tflops", type=float, help="attention kernel rate per rank, TFLOP/s (default 500)")
    st.add_argument("--intra-gbs", type=float, help="pairwise exchange inside a node, GB/s per rank (default 150)")
    st.add_argument("--inter-gbs", type=float, help="pairwise exchange between nodes, GB/s per rank (default 25)")
    st.add_argument("--backward", action="store_true", help="forward+backward")
    a = ap.parse_args()
    if a.strategies:
        return strategies(a)
    if a.rate is not None:
        return legacy(a)
    return calibrated(a)


if __name__ == "__main__":
    sys.exit(main())
