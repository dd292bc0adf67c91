#!/usr/bin/env python3
"""Summary of ab_threads.sh output: per case, each build's median GFLOP/s and the median of new/base per round.
Usage: absum.py LOG COL (COL: 0-based field of GFLOP/s, 5 for the forward, 6 for the backward)."""
import re, statistics as st, sys
col = int(sys.argv[2])
runs = {}
v = r = h = None
for line in open(sys.argv[1]):
    m = re.match(r"-- (\w+) round (\d+) heads (\d+)", line)
    if m:
        v, r, h = m.group(1), int(m.group(2)), int(m.group(3))
        continue
    f = line.split()
    if len(f) > col and f[0].isdigit():
        runs.setdefault((h, int(f[0]), int(f[1]), f[2]), {}).setdefault(v, {})[r] = float(f[col])
print("heads N d causal | base median | new median | new/base median (range)")
for k in sorted(runs):
    b, n = runs[k].get("base", {}), runs[k].get("new", {})
    rat = [n[i] / b[i] for i in n if i in b]
    if rat:
        print(f"{k[0]} {k[1]} {k[2]} {k[3]} | {st.median(b.values()):.1f} | {st.median(n.values()):.1f} | "
              f"{st.median(rat):.2f} ({min(rat):.2f}-{max(rat):.2f})")
