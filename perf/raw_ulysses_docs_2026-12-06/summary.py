#!/usr/bin/env python3
"""Medians over the rounds of run.sh's output: compute_s per configuration, and Ulysses (and auto) / ring."""
import collections
import statistics
import sys

for path in sys.argv[1:]:
    t = collections.defaultdict(list)
    ran = {}
    for line in open(path):
        f = line.split()
        if len(f) < 8:
            continue
        key = (f[1], f[2], f[3])
        t[key].append(float(f[7]))
        ran[key] = f"{f[4]} U={f[5]}"
    print(f"== {path}: median compute_s of {len(next(iter(t.values())))} rounds; ring / this = speed-up")
    for cfg in sorted({k[0] for k in t}):
        for lay in ("zigzag", "contiguous"):
            ring = statistics.median(t[(cfg, lay, "ring")])
            row = [f"{cfg} {lay:10s} ring {ring:.3f} s"]
            for sp in ("ulysses", "auto"):
                m = statistics.median(t[(cfg, lay, sp)])
                row.append(f"{sp} ({ran[(cfg, lay, sp)]}) {m:.3f} s = {ring / m:.2f}x")
            print("  " + ", ".join(row))
