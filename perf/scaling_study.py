#!/usr/bin/env python3
"""Scaling study of kfa-longseq: runs the app over a grid of rank counts and sequence lengths (each run
with --json), then writes CSV files and PNG plots:

  strong.csv/png   fixed N, P = 1, 2, 4, ...: time and speed-up
  weak.csv/png     fixed tokens per rank: per-rank TFLOP/s and efficiency
  causal.csv/png   causal attention, contiguous vs zigzag sharding
  memory.csv/png   memory per rank vs N: kfa (app high-water) vs the materialized reference (extra MiB of
                   kfa_bench_forward's reference_attention, which stores the N x N scores)
  speed.csv/png    TFLOP/s vs N

  /usr/bin/python3 perf/scaling_study.py --build build --out perf/study [--max-ranks 4] [--quick]

Needs numpy-free Python with matplotlib (Debian: python3-matplotlib). Ranks above the core count are
oversubscribed (Open MPI: --oversubscribe), which the plots label.
"""
import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def app_run(a, np_, *args):
    js = tempfile.mktemp(suffix=".json")
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", str(np_), os.path.join(a.build, "apps/kfa-longseq/kfa-longseq"),
           "--generate", "--heads", str(a.heads), "--head-dim", str(a.head_dim), "--json", js] + [str(x) for x in args]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(js) as f:
        r = json.load(f)
    os.remove(js)
    return r


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--out", default="perf/study")
    ap.add_argument("--max-ranks", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="smaller sizes (a CI-sized smoke run)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    cores = os.cpu_count() or 1
    ranks = [p for p in (1, 2, 4, 8, 16) if p <= a.max_ranks]
    n_strong = 8192 if a.quick else 32768
    per_rank = 4096 if a.quick else 16384

    strong = [dict(ranks=p, seq=n_strong, **{k: app_run(a, p, "--seqlen", n_strong)[k] for k in ("compute_s", "tflops")})
              for p in ranks]
    for r in strong:
        r["speedup"] = strong[0]["compute_s"] / r["compute_s"]
    weak = []
    for p in ranks:
        r = app_run(a, p, "--seqlen", per_rank * p)
        weak.append(dict(ranks=p, seq=per_rank * p, compute_s=r["compute_s"], tflops_per_rank=r["tflops"] / p))
    for r in weak:
        r["efficiency"] = r["tflops_per_rank"] / weak[0]["tflops_per_rank"]
    causal = []
    for p in [x for x in ranks if x > 1]:
        for layout in ("contiguous", "zigzag"):
            r = app_run(a, p, "--seqlen", n_strong, "--causal", "--layout", layout)
            causal.append(dict(ranks=p, layout=layout, seq=n_strong, compute_s=r["compute_s"], tflops=r["tflops"]))
    memory, speed = [], []
    lengths = [512, 2048, 4096, 16384] + ([] if a.quick else [65536])
    for n in lengths:
        r = app_run(a, 1, "--seqlen", n)
        speed.append(dict(seq=n, tflops=r["tflops"]))
        ref_mib = ""
        if n <= 16384:
            out = subprocess.run([os.path.join(a.build, "perf/kfa_bench_forward"), "--n", str(n), "--d", str(a.head_dim), "--heads",
                                  str(a.heads), "--reps", "1"], check=True, capture_output=True, text=True).stdout
            rows = [l.split() for l in out.splitlines() if l.strip() and not l.startswith("#") and l.split()[0] == str(n)]
            ref_mib = float(rows[0][-1])
        memory.append(dict(seq=n, kfa_rank_high_water_mib=r["memory_high_water_mib"], reference_extra_mib=ref_mib))

    for name, rows in (("strong", strong), ("weak", weak), ("causal", causal), ("memory", memory), ("speed", speed)):
        write_csv(os.path.join(a.out, name + ".csv"), rows)
    over = f" (ranks > {cores} cores are oversubscribed)"
    fig, ax = plt.subplots()
    ax.plot([r["ranks"] for r in strong], [r["speedup"] for r in strong], "o-", label="kfa")
    ax.plot(ranks, ranks, "k--", label="ideal")
    ax.set(xlabel="MPI ranks", ylabel="speed-up", title=f"strong scaling, N = {n_strong}" + over)
    ax.legend()
    fig.savefig(os.path.join(a.out, "strong.png"), dpi=100)
    fig, ax = plt.subplots()
    ax.plot([r["ranks"] for r in weak], [r["efficiency"] for r in weak], "o-")
    ax.set(xlabel="MPI ranks", ylabel="efficiency (per-rank TFLOP/s vs 1 rank)", ylim=(0, 1.1),
           title=f"weak scaling, {per_rank} tokens per rank" + over)
    fig.savefig(os.path.join(a.out, "weak.png"), dpi=100)
    if causal:
        fig, ax = plt.subplots()
        for layout in ("contiguous", "zigzag"):
            rs = [r for r in causal if r["layout"] == layout]
            ax.plot([r["ranks"] for r in rs], [r["compute_s"] for r in rs], "o-", label=layout)
        ax.set(xlabel="MPI ranks", ylabel="compute time [s]", title=f"causal, N = {n_strong}: sharding layouts")
        ax.legend()
        fig.savefig(os.path.join(a.out, "causal.png"), dpi=100)
    fig, ax = plt.subplots()
    ax.loglog([r["seq"] for r in memory], [r["kfa_rank_high_water_mib"] for r in memory], "o-", label="kfa-longseq, whole process high-water")
    rm = [r for r in memory if r["reference_extra_mib"] != ""]
    ax.loglog([r["seq"] for r in rm], [r["reference_extra_mib"] for r in rm], "s-", label="materialized reference, extra allocations")
    ax.set(xlabel="sequence length N", ylabel="MiB", title="memory vs sequence length (1 rank)")
    ax.legend()
    fig.savefig(os.path.join(a.out, "memory.png"), dpi=100)
    fig, ax = plt.subplots()
    ax.semilogx([r["seq"] for r in speed], [r["tflops"] for r in speed], "o-")
    ax.set(xlabel="sequence length N", ylabel="TFLOP/s", title="kfa-longseq forward, 1 rank")
    fig.savefig(os.path.join(a.out, "speed.png"), dpi=100)
    print("wrote", ", ".join(sorted(os.listdir(a.out))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
