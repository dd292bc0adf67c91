#!/usr/bin/env python3
"""Ring-attention performance model: from a measured per-block compute rate and a link bandwidth, predict
the step time, the fraction of communication hidden behind compute, and the parallel efficiency for
P ranks and sequence lengths N, and the tokens per rank above which communication hides completely.

Per ring step each rank computes one (N/P) x (N/P) block and passes one K/V shard to its neighbour:
  compute = 4 * H * n^2 * d / rate                      (n = N / P tokens per rank; halve for causal)
  comm    = latency + 2 * H_kv * n * d * bytes / bandwidth
  step    = max(compute, comm)   (double-buffered: the transfer overlaps the compute)
  hidden  = min(1, compute / comm);  efficiency = compute / step
Communication hides completely once n >= n* = rate * 2 * H_kv * bytes / (4 * H * bandwidth) (+ latency).

  python3 perf/ring_model.py --rate 94 --bandwidth 450 50 --heads 4 --head-dim 64 --dtype-bytes 4
"""
import argparse
import csv
import sys


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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, required=True, help="measured per-rank block compute rate, GFLOP/s")
    ap.add_argument("--bandwidth", type=float, nargs="+", default=[450.0, 50.0], help="link bandwidths, GB/s")
    ap.add_argument("--latency", type=float, default=5.0, help="per-message latency, microseconds")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=0, help="default: --heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype-bytes", type=int, default=2)
    ap.add_argument("--causal", action="store_true", help="zigzag-balanced causal: half the compute per step")
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256, 512, 1024])
    ap.add_argument("--seq", type=int, nargs="+", default=[1 << 20, 1 << 22, 1 << 24])
    ap.add_argument("--csv", help="also write every row to this CSV file")
    a = ap.parse_args()
    kv = a.kv_heads or a.heads
    rows = []
    print(f"# rate {a.rate} GFLOP/s per rank, heads {a.heads}/{kv}, d {a.head_dim}, {a.dtype_bytes}-byte K/V, "
          f"latency {a.latency} us, {'causal (zigzag)' if a.causal else 'non-causal'}")
    for bw in a.bandwidth:
        nstar = threshold(a.rate, bw, a.latency, a.heads, kv, a.head_dim, a.dtype_bytes, a.causal)
        print(f"\n## link {bw} GB/s: communication hides completely above {nstar:,.0f} tokens per rank")
        print(f"{'N':>10} {'P':>6} {'tokens/rank':>12} {'compute ms':>11} {'comm ms':>9} {'step ms':>9} "
              f"{'hidden':>7} {'efficiency':>10}")
        for n_total in a.seq:
            for p in a.ranks:
                n, c, m, s, h, e = model(a.rate, bw, a.latency, a.heads, kv, a.head_dim, a.dtype_bytes, p, n_total,
                                         a.causal)
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


if __name__ == "__main__":
    sys.exit(main())
