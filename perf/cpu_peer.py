#!/usr/bin/env python3
"""kfa's CPU kernels against PyTorch's CPU scaled_dot_product_attention, in the same run, on the same shapes and
threads, forward and backward, each also as a fraction of the core's measured FP32 FMA peak.

    python3 perf/cpu_peer.py --build build [--n 2048,4096,8192] [--d 64,128] [--heads 2] [--threads 1]
                             [--rounds 2] [--reps 3] [--cpus 0] [--isa avx2] [--layout bnhd|bhnd] [--markdown]

Each round runs, for every head dim, kfa_bench_forward, then PyTorch (forward, forward+backward), then
kfa_bench_backward (the kfa programs of --build, whose header gives the Kokkos backend, the SIMD level and the
measured FMA peak), all pinned to the same CPUs (--cpus, a taskset list; default the first --threads CPUs).
The table gives per case the median over rounds of each side's median over --reps. FLOPs as kfa's benchmarks
count them: forward 4·H·N²·d (halved for causal), backward alone 2.5× that (PyTorch's backward alone is its
forward+backward time less its forward time). Shapes: float32, batch 1, H heads, seq_q = seq_k = N. Both sides
read tensors in the same memory order (--layout): bnhd (default) puts the heads of a position side by side, as a
model's projections give them (kfa: a LayoutRight [batch, N, heads, d] View; PyTorch: a transposed view of such a
tensor), bhnd makes each head's rows contiguous (PyTorch's own [batch, heads, N, d]; kfa: a LayoutStride View).
Until 2026-12-07 PyTorch always read bhnd and kfa bnhd; at d = 64, N = 8192 bnhd costs both sides 5-13% on a Zen 4.

--isa avx2 holds both sides to AVX2: kfa through KFA_HOST_ISA=avx2, PyTorch through ATEN_CPU_CAPABILITY=avx2 (its
own kernels) and MKL_ENABLE_INSTRUCTIONS=AVX2, ONEDNN_MAX_CPU_ISA=AVX2 (the GEMM libraries its CPU flash kernel
calls, which ignore ATen's setting: with ATen's alone PyTorch's SDPA still ran AVX-512 GEMMs, 189 GFLOP/s on a core
whose AVX2 peak is 122).

PyTorch is a yardstick here (pip install torch), never a dependency of kfa, its tests or CI. Threads: kfa's
Serial backend (Debian's Kokkos) runs one thread whatever --threads says; a threaded Kokkos (OpenMP) takes
OMP_NUM_THREADS, which this script sets to --threads, as it sets PyTorch's.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time


def run_kfa(prog, args, cpus, threads):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OMP_PROC_BIND="spread", OMP_PLACES="threads")
    out = subprocess.run(["taskset", "-c", cpus, prog] + args, env=env, check=True, capture_output=True,
                         text=True).stdout
    header = [ln for ln in out.splitlines() if ln.startswith("#")]
    rows = [ln.split() for ln in out.splitlines() if ln and ln[0] != "#" and ln.split()[0].isdigit()]
    return header, rows


def torch_case(torch, F, n, d, heads, causal, reps, layout):
    g = torch.Generator().manual_seed(n * 131 + d)
    if layout == "bhnd":
        q, k, v, do = (torch.rand(1, heads, n, d, generator=g) * 2 - 1 for _ in range(4))
    else:  # [batch, N, heads, d] memory seen as [batch, heads, N, d]
        q, k, v, do = ((torch.rand(1, n, heads, d, generator=g) * 2 - 1).transpose(1, 2) for _ in range(4))

    def median(fn):
        fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    with torch.no_grad():
        tf = median(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
    qg, kg, vg = (t.detach().clone(memory_format=torch.preserve_format).requires_grad_(True) for t in (q, k, v))

    def fwdbwd():
        o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
        o.backward(do)
        qg.grad = kg.grad = vg.grad = None

    tfb = median(fwdbwd)
    return tf, max(tfb - tf, 1e-12)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", required=True, help="kfa build directory (perf/kfa_bench_forward and _backward)")
    ap.add_argument("--n", default="2048,4096,8192")
    ap.add_argument("--d", default="64,128")
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cpus", default=None, help="taskset CPU list for both sides (default: 0..threads-1)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--isa", choices=["native", "avx2"], default="native",
                    help="avx2: hold kfa and PyTorch (ATen, MKL, oneDNN) to AVX2")
    ap.add_argument("--layout", choices=["bnhd", "bhnd"], default="bnhd",
                    help="memory order of both sides' tensors (see above)")
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args()
    if a.isa == "avx2":  # before PyTorch is imported, and inherited by the kfa programs
        os.environ.update(KFA_HOST_ISA="avx2", ATEN_CPU_CAPABILITY="avx2", MKL_ENABLE_INSTRUCTIONS="AVX2",
                          ONEDNN_MAX_CPU_ISA="AVX2")
    cpus = a.cpus or ",".join(str(i) for i in range(a.threads))
    fwd_prog = os.path.join(a.build, "perf", "kfa_bench_forward")
    bwd_prog = os.path.join(a.build, "perf", "kfa_bench_backward")
    for p in (fwd_prog, bwd_prog):
        if not os.access(p, os.X_OK):
            sys.exit(f"cpu_peer.py: --build {a.build}: {p} is not an executable (build the perf targets)")
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        sys.exit("cpu_peer.py: PyTorch is not installed (pip install torch): it is the peer this script measures")
    torch.set_num_threads(a.threads)
    os.sched_setaffinity(0, {int(c) for part in cpus.split(",") for c in (
        range(int(part.split("-")[0]), int(part.split("-")[1]) + 1) if "-" in part else [int(part)])})
    common = ["--n", a.n, "--heads", str(a.heads), "--reps", str(a.reps), "--reference-max-n", "0",
              "--gemm-n", "256", "--layout", a.layout]
    ns = [int(x) for x in a.n.split(",")]
    res = {}  # (d, n, causal) -> lists of kfa fwd s, kfa bwd s, torch fwd s, torch bwd s
    header = []
    peak = 0.0
    for r in range(a.rounds):
        for d in [int(x) for x in a.d.split(",")]:
            h, rows = run_kfa(fwd_prog, common + ["--d", str(d)], cpus, a.threads)
            header = h
            for ln in h:
                if ln.startswith("# FP32 FMA peak:"):
                    peak = float(ln.split()[4])
            for row in rows:
                res.setdefault((d, int(row[0]), row[2] == "yes"), [[], [], [], []])[0].append(float(row[4]))
            for n in ns:
                for causal in (False, True):
                    tf, tb = torch_case(torch, F, n, d, a.heads, causal, a.reps, a.layout)
                    res[(d, n, causal)][2].append(tf)
                    res[(d, n, causal)][3].append(tb)
            _, rows = run_kfa(bwd_prog, common + ["--d", str(d)], cpus, a.threads)
            for row in rows:
                res[(d, int(row[0]), row[2] == "yes")][1].append(float(row[5]))
    print("\n".join(header))
    print(f"# torch {torch.__version__}, threads {torch.get_num_threads()}, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}" + (", MKL and oneDNN held to AVX2" if a.isa == "avx2" else "") +
          f"; CPUs {cpus}; rounds {a.rounds}, reps {a.reps}; both sides' tensors in {a.layout} memory order")
    cols = ["d", "N", "causal", "kfa fwd", "torch fwd", "fwd ratio", "kfa fwd/peak", "kfa bwd", "torch bwd",
            "bwd ratio", "kfa bwd/peak", "kfa f+b", "torch f+b", "f+b ratio"]
    if a.markdown:
        print("| " + " | ".join(cols) + " |")
        print("|" + "---|" * len(cols))
    else:
        print(" ".join(c.replace(" ", "_") for c in cols))
    for (d, n, causal), (kf, kb, tf, tb) in sorted(res.items()):
        fl = 4.0 * a.heads * n * n * d * (0.5 if causal else 1.0)
        kf, kb, tf, tb = (statistics.median(x) for x in (kf, kb, tf, tb))
        g = [fl / kf * 1e-9, fl / tf * 1e-9, 2.5 * fl / kb * 1e-9, 2.5 * fl / tb * 1e-9,
             3.5 * fl / (kf + kb) * 1e-9, 3.5 * fl / (tf + tb) * 1e-9]
        vals = [str(d), str(n), "yes" if causal else "no", f"{g[0]:.1f}", f"{g[1]:.1f}", f"{g[0] / g[1]:.2f}",
                f"{g[0] / peak:.2f}" if peak else "-", f"{g[2]:.1f}", f"{g[3]:.1f}", f"{g[2] / g[3]:.2f}",
                f"{g[2] / peak:.2f}" if peak else "-", f"{g[4]:.1f}", f"{g[5]:.1f}", f"{g[4] / g[5]:.2f}"]
        print(("| " + " | ".join(vals) + " |") if a.markdown else " ".join(vals), flush=True)


if __name__ == "__main__":
    main()
