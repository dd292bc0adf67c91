"""Summary of an ab_bench.sh log: per case the rates of each round and the median new / base.
python3 absum.py LOG COLUMN (COLUMN 5: forward GFLOP/s of kfa_bench_forward, 6: backward GFLOP/s of kfa_bench_backward)
"""
import collections
import statistics
import sys

col = int(sys.argv[2])
rows = collections.defaultdict(lambda: collections.defaultdict(list))
v = None
for ln in open(sys.argv[1]):
    if ln.startswith("--"):
        v = ln.split()[1]
        continue
    f = ln.split()
    if len(f) > 5 and f[0].isdigit():
        rows[(f[0], f[1], f[2])][v].append(float(f[col]))
for k, d in rows.items():
    b, n = d["base"], d["new"]
    if b and n:
        ratio = statistics.median(n) / statistics.median(b)
        print(" ".join(k), "base", [round(x, 1) for x in b], "new", [round(x, 1) for x in n],
              "new/base median %.3f" % ratio)
