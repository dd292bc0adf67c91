#!/usr/bin/env python3
"""PyTorch CPU SDPA at the shapes of kfa_bench_forward / kfa_bench_backward (float32, batch 1, heads H,
seq_q = seq_k = N, head dim d, causal off/on), one thread unless --threads, median of --reps calls after a
warm-up. FLOPs as kfa's benchmarks count them: forward 4*H*N^2*d (halved for causal), backward 2.5x that.
Prints one line per case and backend: forward GFLOP/s, backward-alone GFLOP/s, forward+backward GFLOP/s.

  python3 torch_cpu_sdpa.py --n 1024,4096 --d 64,128 --heads 4 --reps 3 [--threads 1]
"""
import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def median(fn, reps):
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", default="1024,4096")
    ap.add_argument("--d", default="64,128")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--backends", default="flash,math")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"# torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}, float32, batch 1, heads {a.heads}")
    print("backend d N causal fwd_s fwd_GF/s bwd_s bwd_GF/s fwdbwd_GF/s")
    bk = {"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}
    for d in [int(x) for x in a.d.split(",")]:
        for n in [int(x) for x in a.n.split(",")]:
            for causal in (False, True):
                g = torch.Generator().manual_seed(n * 131 + d)
                q, k, v, do = (torch.rand(1, a.heads, n, d, generator=g) * 2 - 1 for _ in range(4))
                flops = 4.0 * a.heads * n * n * d * (0.5 if causal else 1.0)
                for name in a.backends.split(","):
                    with sdpa_kernel(bk[name]), torch.no_grad():
                        tf = median(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), a.reps)
                    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))

                    def fwdbwd():
                        with sdpa_kernel(bk[name]):
                            o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
                        o.backward(do)
                        qg.grad = kg.grad = vg.grad = None
                    tfb = median(fwdbwd, a.reps)
                    tb = max(tfb - tf, 1e-12)
                    print(f"{name} {d} {n} {'yes' if causal else 'no'} {tf:.4f} {flops / tf * 1e-9:.1f} "
                          f"{tb:.4f} {2.5 * flops / tb * 1e-9:.1f} {3.5 * flops / tfb * 1e-9:.1f}", flush=True)


if __name__ == "__main__":
    main()
